# UperNet with a trainable laplace ViT on ADE20K: mmseg's ViT / DeiT UperNet recipe
# (configs/vit/vit_deit-s16_upernet_8xb2-160k_ade20k-512x512.py): not the paper's protocol (that
# is ade20k_linear.py), for users who fine-tune the whole network.
#   python -m eval.mmseg.train configs/mmseg/ade20k_upernet.py \
#       --cfg-options model.backbone.checkpoint=runs/dino/.../ckpt/last.pt data_root=/data/ade
#   python -m eval.mmseg.train configs/mmseg/ade20k_upernet.py \
#       --cfg-options model.backbone.model.name=vits_5L data_root=/data/ade        # from scratch
# The heads' input widths follow the backbone (eval/mmseg/cli.py). mmseg's "mln" variants add
# neck=dict(type='MultiLevelNeck', in_channels=[384] * 4, out_channels=384, scales=[4, 2, 1, 0.5]).
_base_ = ['./ade20k_linear.py']

norm_cfg = dict(type='SyncBN', requires_grad=True)
model = dict(
    backbone=dict(
        _delete_=True,
        type='LaplaceViT',
        checkpoint=None,  # a laplace checkpoint to fine-tune, or None: `model` from scratch
        model=dict(name='vits_0L', drop_path_rate=0.1),  # with a checkpoint, its own model (+ drop path)
        img_size=512,
        out_indices=[2, 5, 8, 11],
        frozen=False,
        final_norm=False),
    decode_head=dict(
        _delete_=True,
        type='UPerHead',
        in_channels=[384, 384, 384, 384],
        in_index=[0, 1, 2, 3],
        pool_scales=(1, 2, 3, 6),
        channels=512,
        dropout_ratio=0.1,
        num_classes=150,
        norm_cfg=norm_cfg,
        align_corners=False,
        loss_decode=dict(type='CrossEntropyLoss', use_sigmoid=False, loss_weight=1.0)),
    auxiliary_head=dict(
        type='FCNHead',
        in_channels=384,
        in_index=3,
        channels=256,
        num_convs=1,
        concat_input=False,
        dropout_ratio=0.1,
        num_classes=150,
        norm_cfg=norm_cfg,
        align_corners=False,
        loss_decode=dict(type='CrossEntropyLoss', use_sigmoid=False, loss_weight=0.4)),
    test_cfg=dict(mode='whole'))

# AdamW 6e-5, wd 0.01; no weight decay on the position embedding, class token and norms.
max_iters = 160000
optim_wrapper = dict(
    _delete_=True,
    type='OptimWrapper',
    optimizer=dict(type='AdamW', lr=6e-5, betas=(0.9, 0.999), weight_decay=0.01),
    paramwise_cfg=dict(custom_keys={
        'pos_embed': dict(decay_mult=0.0),
        'cls_token': dict(decay_mult=0.0),
        'norm': dict(decay_mult=0.0)}))
param_scheduler = [
    dict(type='LinearLR', start_factor=1e-6, by_epoch=False, begin=0, end=1500),
    dict(type='PolyLR', eta_min=0.0, power=1.0, by_epoch=False, begin=1500, end=max_iters),
]
train_cfg = dict(max_iters=max_iters, val_interval=16000)
default_hooks = dict(checkpoint=dict(interval=16000))

# The paper's ADE20K evaluation in mmsegmentation: DINOv2's linear protocol on a frozen laplace
# ViT (the same protocol as `python -m eval.segmentation`, eval/segmentation.py).
#   python -m eval.mmseg.train configs/mmseg/ade20k_linear.py \
#       --cfg-options model.backbone.checkpoint=runs/dino/.../ckpt/last.pt data_root=/data/ade
#   (+ms head: model.backbone.out_indices="[-4,-3,-2,-1]" model.decode_head.in_index="[0,1,2,3]")
# Batch 16 = 2 per GPU x 8 GPUs (`torchrun --nproc-per-node 8 -m eval.mmseg.train ... --launcher
# pytorch`); on fewer GPUs raise train_dataloader.batch_size to keep 16.
# The heads' input widths follow the backbone (eval/mmseg/cli.py): no need to set them.
default_scope = 'mmseg'

data_root = 'data/ade/ADEChallengeData2016'  # --cfg-options data_root=... (or its parent folder)
crop_size = (512, 512)
num_classes = 150

# ---- model: frozen LaplaceViT (last block, final norm) -> BN + 1x1 conv ----
data_preprocessor = dict(
    type='SegDataPreProcessor',
    mean=[123.675, 116.28, 103.53],  # ImageNet's, on 0-255 RGB (our DINO / DeiT-III runs')
    std=[58.395, 57.12, 57.375],
    bgr_to_rgb=True,
    pad_val=0,
    seg_pad_val=255,
    size=crop_size)
model = dict(
    type='EncoderDecoder',
    data_preprocessor=data_preprocessor,
    backbone=dict(
        type='LaplaceViT',
        checkpoint=None,  # required: a laplace checkpoint of a ViT (DINO's teacher, DeiT-III, ...)
        img_size=crop_size[0],
        out_indices=[-1],
        frozen=True,
        final_norm=True),
    decode_head=dict(
        type='BNHead',
        in_channels=[384],  # ViT-S; set from the backbone by eval.mmseg
        in_index=[0],
        input_transform='resize_concat',
        dropout_ratio=0.0,
        num_classes=num_classes,
        norm_cfg=dict(type='SyncBN', requires_grad=True),
        align_corners=False,
        loss_decode=dict(type='CrossEntropyLoss', use_sigmoid=False, loss_weight=1.0)),
    train_cfg=dict(),
    test_cfg=dict(mode='slide', crop_size=crop_size, stride=(341, 341)))

# ---- data: mmseg's ADE20K config (configs/_base_/datasets/ade20k.py) ----
dataset_type = 'ADE20KDataset'
train_pipeline = [
    dict(type='LoadImageFromFile'),
    dict(type='LoadAnnotations', reduce_zero_label=True),
    dict(type='RandomResize', scale=(2048, 512), ratio_range=(0.5, 2.0), keep_ratio=True),
    dict(type='RandomCrop', crop_size=crop_size, cat_max_ratio=0.75),
    dict(type='RandomFlip', prob=0.5),
    dict(type='PhotoMetricDistortion'),
    dict(type='PackSegInputs'),
]
test_pipeline = [
    dict(type='LoadImageFromFile'),
    dict(type='Resize', scale=(2048, 512), keep_ratio=True),
    dict(type='LoadAnnotations', reduce_zero_label=True),  # after Resize: mIoU on full-size labels
    dict(type='PackSegInputs'),
]
train_dataloader = dict(
    batch_size=2,
    num_workers=4,
    persistent_workers=True,
    sampler=dict(type='InfiniteSampler', shuffle=True),
    dataset=dict(
        type=dataset_type,
        data_root=data_root,
        data_prefix=dict(img_path='images/training', seg_map_path='annotations/training'),
        pipeline=train_pipeline))
val_dataloader = dict(
    batch_size=1,
    num_workers=4,
    persistent_workers=True,
    sampler=dict(type='DefaultSampler', shuffle=False),
    dataset=dict(
        type=dataset_type,
        data_root=data_root,
        data_prefix=dict(img_path='images/validation', seg_map_path='annotations/validation'),
        pipeline=test_pipeline))
test_dataloader = val_dataloader
val_evaluator = dict(type='IoUMetric', iou_metrics=['mIoU'])  # mIoU, aAcc, mAcc
test_evaluator = val_evaluator

# ---- schedule: AdamW 1e-3, wd 1e-4; linear warm-up 1,500 iters, then poly (power 1) to 0 ----
max_iters = 40000
optim_wrapper = dict(
    type='OptimWrapper',
    optimizer=dict(type='AdamW', lr=1e-3, betas=(0.9, 0.999), weight_decay=1e-4))
param_scheduler = [
    dict(type='LinearLR', start_factor=1e-6, by_epoch=False, begin=0, end=1500),
    dict(type='PolyLR', eta_min=0.0, power=1.0, by_epoch=False, begin=1500, end=max_iters),
]
train_cfg = dict(type='IterBasedTrainLoop', max_iters=max_iters, val_interval=4000)
val_cfg = dict(type='ValLoop')
test_cfg = dict(type='TestLoop')

# ---- runtime: mmseg's default_runtime.py ----
default_hooks = dict(
    timer=dict(type='IterTimerHook'),
    logger=dict(type='LoggerHook', interval=50, log_metric_by_epoch=False),
    param_scheduler=dict(type='ParamSchedulerHook'),
    checkpoint=dict(type='CheckpointHook', by_epoch=False, interval=4000),
    sampler_seed=dict(type='DistSamplerSeedHook'),
    visualization=dict(type='SegVisualizationHook'))
# Checkpoints as plain data: torch.load's weights_only default then reads them (resume too).
custom_hooks = [dict(type='PlainCheckpointHook')]
env_cfg = dict(
    cudnn_benchmark=True,
    mp_cfg=dict(mp_start_method='fork', opencv_num_threads=0),
    dist_cfg=dict(backend='nccl'))
vis_backends = [dict(type='LocalVisBackend')]
visualizer = dict(type='SegLocalVisualizer', vis_backends=vis_backends, name='visualizer')
log_processor = dict(by_epoch=False)
log_level = 'INFO'
randomness = dict(seed=0)
load_from = None
resume = False

# UperNet fine-tuning of a laplace ViT on ADE20K with mmsegmentation (the [seg] extra). Not the
# paper's protocol (that is `python -m eval.segmentation`: a linear head on the frozen ViT) but
# the recipe of labs that fine-tune the whole network: mmseg's own ViT UperNet config (its ADE20K
# pipeline, AdamW 6e-5, 160k iterations at batch 16 = 2 per GPU x 8, IoUMetric) with DeiT-S's
# settings (no neck, drop path 0.1) and our ViT as the backbone.
#   python -m eval.mmseg.train configs/mmseg/ade20k_upernet.py \
#       --cfg-options model.backbone.checkpoint=runs/dino/.../ckpt/last.pt data_root=/data/ade
#   torchrun --nproc-per-node 8 -m eval.mmseg.train configs/mmseg/ade20k_upernet.py --launcher pytorch ...
#   python -m eval.mmseg.train configs/mmseg/ade20k_upernet.py \
#       --cfg-options model.backbone.model.name=vits_5L data_root=/data/ade      # from scratch
# The heads' input widths follow the backbone's (eval/mmseg/cli.py): a ViT-B checkpoint needs no
# edit. mmseg's "mln" variant keeps its neck: model.neck=None is what turns it off here.
_base_ = 'mmseg::vit/vit_vit-b16_mln_upernet_8xb2-160k_ade20k-512x512.py'

model = dict(
    pretrained=None,  # mmseg's ViT weights file: ours come from the checkpoint below
    backbone=dict(
        _delete_=True,  # mmseg's VisionTransformer -> ours (eval/mmseg/backbone.py)
        type='LaplaceViT',
        checkpoint=None,  # a laplace checkpoint of a ViT to fine-tune, or None: `model` from scratch
        model=dict(name='vits_0L', drop_path_rate=0.1),  # with a checkpoint: its own model, this drop path
        img_size=512,
        out_indices=[2, 5, 8, 11]),
    neck=None,
    decode_head=dict(in_channels=[384, 384, 384, 384]),  # ViT-S; eval.mmseg sets the backbone's
    auxiliary_head=dict(in_channels=384))
randomness = dict(seed=0)

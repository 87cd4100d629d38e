# The linear protocol of ade20k_linear.py on the tiny built-in digits set (CPU-sized, for tests):
# 64 px canvases of 2 x 2 digits, 10 classes (0 = background, ignored), written to data_root on
# first use by eval.mmseg (laplace.data.ade20k.write_digits_ade20k).
#   python -m eval.mmseg.train configs/mmseg/digits_linear.py \
#       --cfg-options model.backbone.checkpoint=runs/deit3/digits/vitt_3L_s0/ckpt/last.pt
# Same settings as configs/eval/seg_digits_linear.yaml (eval/segmentation.py's digits run).
_base_ = ['./ade20k_linear.py']

data_root = 'data/digits_ade20k/ADEChallengeData2016'
builtin_digits = True  # eval.mmseg writes the set to data_root if it is missing
crop_size = (64, 64)
num_classes = 10

data_preprocessor = dict(
    mean=[127.5, 127.5, 127.5],  # the digits ViTs' normalisation (configs/data/digits.yaml)
    std=[127.5, 127.5, 127.5],
    size=crop_size)
model = dict(
    data_preprocessor=data_preprocessor,
    backbone=dict(img_size=crop_size[0]),
    decode_head=dict(num_classes=num_classes, in_channels=[192]),
    test_cfg=dict(mode='slide', crop_size=crop_size, stride=(43, 43)))  # 2/3 of the window

# The canvases are written as images/ + annotations/ in ADE20K's layout; the classes are digits.
digits_dataset = dict(
    type='BaseSegDataset',
    data_root=data_root,
    img_suffix='.jpg',
    seg_map_suffix='.png',
    reduce_zero_label=True,
    metainfo=dict(classes=tuple(str(d) for d in range(10))))
train_pipeline = [
    dict(type='LoadImageFromFile'),
    dict(type='LoadAnnotations', reduce_zero_label=True),
    dict(type='RandomResize', scale=(256, 64), ratio_range=(0.5, 2.0), keep_ratio=True),
    dict(type='RandomCrop', crop_size=crop_size, cat_max_ratio=0.75),
    dict(type='RandomFlip', prob=0.5),
    dict(type='PhotoMetricDistortion'),
    dict(type='PackSegInputs'),
]
test_pipeline = [
    dict(type='LoadImageFromFile'),
    dict(type='Resize', scale=(256, 64), keep_ratio=True),
    dict(type='LoadAnnotations', reduce_zero_label=True),
    dict(type='PackSegInputs'),
]
train_dataloader = dict(
    batch_size=16,  # one process: the protocol's global batch
    num_workers=0,
    persistent_workers=False,
    dataset=dict(digits_dataset, data_prefix=dict(img_path='images/training', seg_map_path='annotations/training'),
                 pipeline=train_pipeline, _delete_=True))
val_dataloader = dict(
    num_workers=0,
    persistent_workers=False,
    dataset=dict(digits_dataset, data_prefix=dict(img_path='images/validation', seg_map_path='annotations/validation'),
                 pipeline=test_pipeline, _delete_=True))
test_dataloader = val_dataloader

max_iters = 300
param_scheduler = [
    dict(type='LinearLR', start_factor=1e-6, by_epoch=False, begin=0, end=20),
    dict(type='PolyLR', eta_min=0.0, power=1.0, by_epoch=False, begin=20, end=max_iters),
]
train_cfg = dict(max_iters=max_iters, val_interval=100)
default_hooks = dict(
    logger=dict(interval=25),
    checkpoint=dict(interval=100))
env_cfg = dict(cudnn_benchmark=False)

"""Facts about the backbones the config needs (names, the MiT's smallest input, each one's ImageNet
normalisation); pure Python, read before TensorFlow starts."""

# The Mix Transformer sizes (models/mit.py), SegFormer's encoders.
MIT_BACKBONES = tuple(f"mit_b{i}" for i in range(6))
# The smallest training or slide crop side a MiT takes: its first stage's 8x8 spatial-reduction conv
# needs an 8x8 map at stride 4 (models/mit.py).
MIT_MIN_SIZE = 29
# The DINO ViTs (models/vit.py's VARIANTS): name -> (patch size, number of blocks). *_reg: DINOv2 with register
# tokens. tests/test_vit_wiring.py holds this table to models/vit.py's.
DINO_BACKBONES = {
    "dinov3_vits16": (16, 12), "dinov3_vits16plus": (16, 12), "dinov3_vitb16": (16, 12),
    "dinov3_vitl16": (16, 24), "dinov3_vith16plus": (16, 32),
    **{f"dinov2_vit{size}14{reg}": (14, depth) for size, depth in (("s", 12), ("b", 12), ("l", 24), ("g", 40))
       for reg in ("", "_reg")},
    # EoMT's DINOv2 ViTs: the register models at patch 16, as its published checkpoints hold them.
    **{f"dinov2_vit{size}16_reg": (16, depth) for size, depth in (("s", 12), ("b", 12), ("l", 24), ("g", 40))},
}
# model.backbone's values (models/backbones.py).
BACKBONES = ("tiny", "mobilenetv2", "mobilenetv3_large", "mobilenetv3_small", "resnet50", "resnet101") + MIT_BACKBONES \
    + tuple(DINO_BACKBONES)

# Input normalisation each backbone's ImageNet weights expect, as (mean, std) on RGB 0..255.
BACKBONE_NORMALIZATION = {
    "tiny": ((123.675, 116.28, 103.53), (58.395, 57.12, 57.375)),
    "mobilenetv2": ((127.5, 127.5, 127.5), (127.5, 127.5, 127.5)),
    # Keras' MobileNetV3 rescales x / 127.5 - 1 inside the model; built here without that layer.
    "mobilenetv3_large": ((127.5, 127.5, 127.5), (127.5, 127.5, 127.5)),
    "mobilenetv3_small": ((127.5, 127.5, 127.5), (127.5, 127.5, 127.5)),
    "resnet50": ((123.68, 116.779, 103.939), (1.0, 1.0, 1.0)),
    "resnet101": ((123.68, 116.779, 103.939), (1.0, 1.0, 1.0)),
    # keras-hub's SegFormer and MiT presets: ImageNet's mean and std (its image converter's 0.485.../0.229...).
    **{name: ((123.675, 116.28, 103.53), (58.395, 57.12, 57.375)) for name in MIT_BACKBONES},
    # DINOv2 and DINOv3 (web images, LVD): ImageNet's too (keras-hub's DINO image converters).
    **{name: ((123.675, 116.28, 103.53), (58.395, 57.12, 57.375)) for name in DINO_BACKBONES},
}

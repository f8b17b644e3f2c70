"""Every backbone's facts, each written once: the names `model.backbone` takes, the MiT and DINO ViT size tables
(models/ builds from them), the model family each backbone belongs to, the MiT's smallest input and each backbone's
input normalisation. Pure Python: the config reads it before TensorFlow starts, and models/ imports it too."""

from __future__ import annotations

from dataclasses import dataclass, replace

# ---- the conv backbones (models/cnn/) ------------------------------------------------------------------------
CNN_BACKBONES = ("tiny", "mobilenetv2", "mobilenetv3_large", "mobilenetv3_small", "resnet50", "resnet101")


# ---- the Mix Transformers, SegFormer's encoders (models/mit/) -------------------------------------------------
@dataclass(frozen=True)
class MiTVariant:
    """One MiT size: per-stage widths and block counts (heads, reduction ratios and patches are shared)."""

    widths: tuple[int, int, int, int]
    depths: tuple[int, int, int, int]
    heads: tuple[int, int, int, int] = (1, 2, 5, 8)
    sr_ratios: tuple[int, int, int, int] = (8, 4, 2, 1)
    patch_sizes: tuple[int, int, int, int] = (7, 3, 3, 3)
    patch_strides: tuple[int, int, int, int] = (4, 2, 2, 2)


# The SegFormer paper's Table 6 (and keras-hub's MiT presets).
MIT_VARIANTS = {
    "mit_b0": MiTVariant((32, 64, 160, 256), (2, 2, 2, 2)),
    "mit_b1": MiTVariant((64, 128, 320, 512), (2, 2, 2, 2)),
    "mit_b2": MiTVariant((64, 128, 320, 512), (3, 4, 6, 3)),
    "mit_b3": MiTVariant((64, 128, 320, 512), (3, 4, 18, 3)),
    "mit_b4": MiTVariant((64, 128, 320, 512), (3, 8, 27, 3)),
    "mit_b5": MiTVariant((64, 128, 320, 512), (3, 6, 40, 3)),
}
MIT_BACKBONES = tuple(MIT_VARIANTS)
# The smallest training or slide crop side a MiT takes: its first stage's 8x8 spatial-reduction conv
# needs an 8x8 map at stride 4 (models/mit/encoder.py).
MIT_MIN_SIZE = 29


# ---- the DINOv3 / DINOv2 ViTs (models/dino/) -------------------------------------------------------------------
@dataclass(frozen=True)
class ViTVariant:
    """One DINO size, in keras-hub's config terms (the field names of its config.json, models/dino/presets.py)."""

    family: str          # "dinov3" or "dinov2"
    patch: int
    width: int           # hidden_dim
    depth: int           # num_layers
    heads: int
    mlp: int             # intermediate_dim (DINOv2's SwiGLU uses 2/3 of it, rounded up to 8)
    registers: int = 0
    gated: bool = False  # DINOv3: gated MLP (use_gated_mlp); DINOv2: SwiGLU (use_swiglu_ffn)
    activation: str = "gelu"  # DINOv3's MLP activation (hidden_activation); DINOv2's is GELU
    key_bias: bool = True     # DINOv3's key projection bias (use_key_bias)
    layer_scale: float = 1.0  # layer_scale_init_value
    rope_theta: float = 100.0  # DINOv3
    pos_grid: int = 37        # DINOv2: the position embedding's grid (position_embedding_shape / patch)
    antialias: bool = False   # DINOv2: antialias_in_interpolation (True in the register presets)
    cls_position: bool = True  # DINOv2: the position embedding has a CLS entry (keras-hub's); False: the
    #                            patches' grid only, CLS without one (transformers' EoMT, models/eomt/eomt.py)
    torch_bicubic: bool = False  # DINOv2: the grid resized as torch's bicubic (transformers' Dinov2Model):
    #                              models/dino/vit.py torch_bicubic_matrix; TensorFlow's otherwise (keras-hub's)

    @property
    def epsilon(self) -> float:
        return 1e-5 if self.family == "dinov3" else 1e-6


def _v3(width, depth, heads, mlp, gated=False):
    return ViTVariant("dinov3", 16, width, depth, heads, mlp, registers=4, gated=gated,
                      activation="silu" if gated else "gelu", key_bias=False)


def _v2(width, depth, heads, mlp, gated=False, registers=0):
    return ViTVariant("dinov2", 14, width, depth, heads, mlp, registers=registers, gated=gated,
                      antialias=registers > 0)


# The released sizes (keras-hub's presets; *_reg: dinov2_with_registers_*, DINOv2 with register tokens).
VIT_VARIANTS = {
    "dinov3_vits16": _v3(384, 12, 6, 1536),
    "dinov3_vits16plus": _v3(384, 12, 6, 1536, gated=True),
    "dinov3_vitb16": _v3(768, 12, 12, 3072),
    "dinov3_vitl16": _v3(1024, 24, 16, 4096),
    "dinov3_vith16plus": _v3(1280, 32, 20, 5120, gated=True),
    "dinov2_vits14": _v2(384, 12, 6, 1536),
    "dinov2_vitb14": _v2(768, 12, 12, 3072),
    "dinov2_vitl14": _v2(1024, 24, 16, 4096),
    "dinov2_vitg14": _v2(1536, 40, 24, 6144, gated=True),
}
VIT_VARIANTS.update({f"{n}_reg": replace(v, registers=4, antialias=True)
                     for n, v in list(VIT_VARIANTS.items()) if v.family == "dinov2"})
# EoMT's DINOv2 ViTs (its published checkpoints, transformers' EomtForUniversalSegmentation): the register
# models at patch 16, positions for the patches only on a 40 x 40 grid (640 / 16; model.position_grid).
VIT_VARIANTS.update({f"dinov2_vit{size}16_reg": replace(VIT_VARIANTS[f"dinov2_vit{size}14_reg"], patch=16,
                                                        pos_grid=40, antialias=False, cls_position=False,
                                                        torch_bicubic=True)
                     for size in "sblg"})
DINO_BACKBONES = tuple(VIT_VARIANTS)


def swiglu_width(mlp: int) -> int:
    """DINOv2's SwiGLU hidden width: 2/3 of intermediate_dim rounded up to a multiple of 8 (keras-hub's)."""
    return (int(mlp * 2 / 3) + 7) // 8 * 8


def four_blocks(depth: int) -> tuple[int, ...]:
    """Four blocks evenly spaced, the last one included (1-based: 3, 6, 9, 12 of 12; DINOv2's "+ms" linear
    protocol, ViTDet's); fewer when depth < 4."""
    return tuple(sorted({max(1, depth * k // 4) for k in range(1, 5)}))


# ---- every backbone ---------------------------------------------------------------------------------------------
# model.backbone's values.
BACKBONES = CNN_BACKBONES + MIT_BACKBONES + DINO_BACKBONES
# The model family (models/<family>/) of each backbone under a per-pixel head; model.head: eomt is a family of its
# own on the DINO ViTs.
BACKBONE_FAMILY = {**{n: "cnn" for n in CNN_BACKBONES}, **{n: "mit" for n in MIT_BACKBONES},
                   **{n: "dino" for n in DINO_BACKBONES}}
HEAD_FAMILY = {"eomt": "eomt"}


def family_of(backbone: str, head: str) -> str:
    """The model family (models/<family>/) that builds `head` on `backbone`."""
    return HEAD_FAMILY.get(head) or BACKBONE_FAMILY[backbone]


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

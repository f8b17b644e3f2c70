#!/usr/bin/env python
"""A keras-hub DINOv3 or DINOv2 backbone with RANDOM weights (a fixed seed), saved as a preset directory, so
several runs start from the same backbone weights through `--set model.backbone_weights=DIR`.

    python benchmarks/random_dino_preset.py OUTPUT_DIR [--backbone dinov3_vits16] [--seed 0] [--size 224]

keras-hub's own initializers, nothing pretrained: a stand-in for the released weights where those cannot be
downloaded (docs/ACCURACY.md compares EoMT with the per-pixel heads from such a preset). The architecture
comes from seg-train's table of DINO sizes, so seg-train's preset check accepts the directory for that
backbone (it is checked here before the script exits).
"""

from __future__ import annotations

import argparse
import sys

import keras
import keras_hub

from seg_train.config.variants import VIT_VARIANTS
from seg_train.models.dino.presets import check_dino_preset


def build(name: str, size: int):
    """keras-hub's backbone for the DINO size `name`, in keras-hub's config terms."""
    spec = VIT_VARIANTS[name]
    common = dict(patch_size=spec.patch, num_layers=spec.depth, hidden_dim=spec.width, num_heads=spec.heads,
                  intermediate_dim=spec.mlp, num_register_tokens=spec.registers,
                  layer_scale_init_value=spec.layer_scale, image_shape=(size, size, 3))
    if spec.family == "dinov3":
        return keras_hub.models.DINOV3Backbone(
            **common, use_gated_mlp=spec.gated, hidden_activation=spec.activation, use_key_bias=spec.key_bias,
            rope_theta=spec.rope_theta, layer_norm_eps=spec.epsilon)
    edge = spec.pos_grid * spec.patch
    return keras_hub.models.DINOV2Backbone(**common, use_swiglu_ffn=spec.gated,
                                           position_embedding_shape=(edge, edge, 3),
                                           antialias_in_interpolation=spec.antialias)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("output")
    p.add_argument("--backbone", default="dinov3_vits16", choices=sorted(VIT_VARIANTS))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--size", type=int, default=224, help="the image size keras-hub builds for (any; not saved "
                                                         "in the weights seg-train reads)")
    a = p.parse_args(argv)
    keras.utils.set_random_seed(a.seed)
    build(a.backbone, a.size).save_to_preset(a.output)
    check_dino_preset(a.output, a.backbone)
    print(f"{a.output}: random {a.backbone}, seed {a.seed}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

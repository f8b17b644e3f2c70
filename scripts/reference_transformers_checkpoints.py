"""Writes tests/fixtures/transformers/: small random-weight models of each transformers class seg-train loads
(models/dino/transformers.py), saved with save_pretrained, and transformers' own outputs on them, for
tests/test_transformers_weights.py.

Not part of seg-train and never imported by it: it needs torch and transformers, which seg-train does not.
Run it from the repository root with a separate environment:

    python3 -m venv /tmp/hf-ref && /tmp/hf-ref/bin/pip install torch transformers safetensors
    /tmp/hf-ref/bin/python scripts/reference_transformers_checkpoints.py     # or give another output folder

What it writes (float32 unless said), for each CASE below:
  CASE/            the folder save_pretrained wrote (config.json, model.safetensors; dinov2_registers: sharded,
                   model.safetensors.index.json and its shards; dinov2: saved in bfloat16, its weights rounded
                   to bfloat16 before the outputs were computed)
  CASE.npz         images_<k> [b, H, W, 3] (NHWC; the models take NCHW) and, per input k:
                     encoders: last_<k> [b, N, C] the patch tokens after the final LayerNorm, middle_<k> the
                               patch tokens after block MIDDLE, through the same LayerNorm
                     EoMT: class_<k> [b, Q, K + 1], mask_<k> [b, Q, 4 H / p, 4 W / p] in eval mode with
                           attn_mask_probs 0 (no masking, as a trained model ends)
  positions.npz    grid [1, C, G, G] and torch's F.interpolate(mode="bicubic", align_corners=False) of it to
                   several sizes, with and without antialias ("<h>x<w>_<antialias>", NCHW)
  layouts.json     for the seg-train runs the tests start: config.json and every tensor's (dtype, shape) of a
                   DINOv3ViTModel and an EomtDinov3ForUniversalSegmentation at the size of the tests'
                   TINY_VITS16 (tests/helpers.py: dinov3_vits16's structure, put in its place for those runs), as
                   save_pretrained writes them (the weights themselves are not kept)

Input k = 0 is the model's own square size; k = 1 a non-square one, where transformers runs it: DINOv3 (RoPE
from the actual grid) and DINOv2 (positions resized: bicubic, align_corners=False, to the patch grid's size
(no +0.1 offset, no scale factor); Dinov2WithRegistersModel with antialias). EomtForUniversalSegmentation has
positions for its config's grid only (an nn.Embedding added as it is), so it runs at image_size alone;
EomtDinov3ForUniversalSegmentation's encoder takes any size, and its one size-bound attribute, grid_size (the
patch grid `predict` reshapes to), is set to the input's grid for k = 1.

Weights: every matrix N(0, 1 / fan_in) and every vector and token away from its initial value (norm weights
and layer scales near 1, biases and register tokens near 0), so that a weight dropped, misplaced, transposed
or swapped with another changes the outputs well beyond the tests' tolerance.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
import transformers
from safetensors import safe_open
from transformers import (
    Dinov2Config,
    Dinov2Model,
    Dinov2WithRegistersConfig,
    Dinov2WithRegistersModel,
    DINOv3ViTConfig,
    DINOv3ViTModel,
    EomtConfig,
    EomtDinov3Config,
    EomtDinov3ForUniversalSegmentation,
    EomtForUniversalSegmentation,
)

SEED = 7
MIDDLE = 2  # the encoders' middle block compared besides the last (1-based)
SMALL = dict(hidden_size=16, num_hidden_layers=3, num_attention_heads=2, patch_size=4)
CASES = {
    # DINOv3 ViT with the gated SiLU MLP of vits16plus / vith16plus, registers, no key bias.
    "dinov3_vit": (DINOv3ViTModel, DINOv3ViTConfig(**SMALL, intermediate_size=32, num_register_tokens=2,
                                                   use_gated_mlp=True, hidden_act="silu", image_size=16)),
    "dinov2": (Dinov2Model, Dinov2Config(**SMALL, mlp_ratio=4, image_size=16)),
    "dinov2_registers": (Dinov2WithRegistersModel, Dinov2WithRegistersConfig(
        **SMALL, mlp_ratio=4, image_size=16, num_register_tokens=2, use_swiglu_ffn=True)),
    "eomt": (EomtForUniversalSegmentation, EomtConfig(
        **SMALL, mlp_ratio=4, image_size=16, num_register_tokens=2, use_swiglu_ffn=True, num_queries=5,
        num_blocks=2, num_labels=3)),
    "eomt_dinov3": (EomtDinov3ForUniversalSegmentation, EomtDinov3Config(
        **SMALL, intermediate_size=32, image_size=16, num_register_tokens=2, num_queries=5, num_blocks=2,
        num_labels=3, layer_norm_eps=1e-5)),
}
SIZES = {0: (16, 16), 1: (12, 28)}  # input k: (H, W); k = 1 only where transformers runs it (module doc)
NON_SQUARE = ("dinov3_vit", "dinov2", "dinov2_registers", "eomt_dinov3")
# The tests' TINY_VITS16 (tests/helpers.py: dinov3_vits16 of config/variants.py VIT_VARIANTS at 4 blocks of width
# 32) in transformers' terms, for layouts.json.
TINY_VITS16 = dict(hidden_size=32, num_hidden_layers=4, num_attention_heads=2, intermediate_size=64, patch_size=16,
                   num_register_tokens=4)
LAYOUTS = {"DINOv3ViTModel": (DINOv3ViTModel, DINOv3ViTConfig(**TINY_VITS16)),
           "EomtDinov3ForUniversalSegmentation": (EomtDinov3ForUniversalSegmentation, EomtDinov3Config(
               **TINY_VITS16, num_queries=6, num_blocks=2, num_labels=3, image_size=64, layer_norm_eps=1e-5))}


def _randomize(model: torch.nn.Module, rng: np.random.Generator) -> None:
    with torch.no_grad():
        for name, p in model.named_parameters():
            shape = tuple(p.shape)
            if p.ndim == 1 or "token" in name:
                a = rng.normal(0.0, 0.1, shape)
                if p.ndim == 1 and (name.endswith("lambda1") or ("norm" in name and name.endswith("weight"))):
                    a += 1.0
            elif "position_embeddings" in name or name == "query.weight":
                a = rng.normal(0.0, 1.0, shape)
            else:  # Linear [out, in], Conv2d [out, in, kh, kw], ConvTranspose2d [in, out, kh, kw]
                fan_in = int(np.prod(shape[1:])) if "conv1" not in name else shape[0] * int(np.prod(shape[2:]))
                a = rng.normal(0.0, fan_in ** -0.5, shape)
            p.copy_(torch.from_numpy(a.astype(np.float32)))


def _encoder_outputs(model, config, pixels) -> dict:
    out = model(pixel_values=pixels, output_hidden_states=True)
    prefix = 1 + getattr(config, "num_register_tokens", 0)
    norm = model.norm if isinstance(model, DINOv3ViTModel) else model.layernorm
    # hidden_states[0] is the embeddings, [i] block i's output (before the final LayerNorm)
    middle = norm(out.hidden_states[MIDDLE])
    return {"last": out.last_hidden_state[:, prefix:], "middle": middle[:, prefix:]}


def _eomt_outputs(model, pixels) -> dict:
    out = model(pixel_values=pixels)
    return {"class": out.class_queries_logits, "mask": out.masks_queries_logits}


def _case(name: str, out: Path, rng: np.random.Generator) -> None:
    cls, config = CASES[name]
    torch.manual_seed(SEED)
    model = cls(config)
    _randomize(model, rng)
    if name == "dinov2":  # saved in bfloat16: the float32 run uses the same, rounded, weights
        model = model.to(torch.bfloat16).to(torch.float32)
    model.eval()
    eomt = name.startswith("eomt")
    if eomt:
        model.attn_mask_probs.fill_(0.0)
    arrays = {}
    for k, (h, w) in SIZES.items():
        if k and name not in NON_SQUARE:
            continue
        images = rng.normal(0.0, 1.0, (2, h, w, 3)).astype(np.float32)
        pixels = torch.from_numpy(images).permute(0, 3, 1, 2).contiguous()
        if eomt:
            model.grid_size = (h // config.patch_size, w // config.patch_size)
        with torch.no_grad():
            got = _eomt_outputs(model, pixels) if eomt else _encoder_outputs(model, config, pixels)
        arrays[f"images_{k}"] = images
        arrays.update({f"{key}_{k}": v.numpy() for key, v in got.items()})
    if eomt:
        model.grid_size = (config.image_size // config.patch_size,) * 2
    folder = out / name
    if name == "dinov2":
        model = model.to(torch.bfloat16)
    model.save_pretrained(folder, **({"max_shard_size": "12KB"} if name == "dinov2_registers" else {}))
    np.savez_compressed(out / f"{name}.npz", **arrays)
    size = sum(f.stat().st_size for f in folder.iterdir())
    print(f"wrote {folder} ({len(list(folder.iterdir()))} files, {size} bytes) and {name}.npz")


def _positions(out: Path, rng: np.random.Generator) -> None:
    grid = rng.normal(0.0, 1.0, (1, 3, 5, 5)).astype(np.float32)
    arrays = {"grid": grid}
    for h, w in ((3, 8), (7, 4), (9, 11), (5, 5), (2, 12)):
        for antialias in (False, True):
            arrays[f"{h}x{w}_{antialias}"] = F.interpolate(torch.from_numpy(grid), size=(h, w), mode="bicubic",
                                                           align_corners=False, antialias=antialias).numpy()
    np.savez_compressed(out / "positions.npz", **arrays)


def _layouts(out: Path) -> None:
    layouts = {}
    for arch, (cls, config) in LAYOUTS.items():
        with tempfile.TemporaryDirectory() as tmp:
            cls(config).save_pretrained(tmp)
            raw = json.loads((Path(tmp) / "config.json").read_text())
            with safe_open(Path(tmp) / "model.safetensors", "pt") as f:
                tensors = {k: [f.get_slice(k).get_dtype(), list(f.get_slice(k).get_shape())] for k in f.keys()}
        assert raw["architectures"] == [arch], raw["architectures"]
        layouts[arch] = {"config": raw, "tensors": tensors}
    (out / "layouts.json").write_text(json.dumps(layouts, indent=1, sort_keys=True) + "\n")


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(SEED)
    for name in CASES:
        _case(name, out, rng)
    _positions(out, rng)
    _layouts(out)
    print(f"transformers {transformers.__version__}, torch {torch.__version__}: wrote {out}")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path("tests/fixtures/transformers"))

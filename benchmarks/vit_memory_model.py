#!/usr/bin/env python3
"""Training memory model of the DINO ViTs: activation memory per image, and the images per 40 / 80 GiB GPU of every
ViT recipe in configs/.

By arithmetic, not measured on a GPU. For each block it lists the tensors TensorFlow's autodiff keeps between the
forward and the backward pass (`block_tensors`: which inputs and outputs each op's gradient reads, for the ops
models/dino/vit.py and models/attention.py run), with EoMT's extra (`eomt_tensors`) and the ViTDet pyramid +
SegFormer head's (`pyramid_tensors`), in three forms of the encoder:

  plain      softmax attention with whole [heads, T, T] maps (model.attention: plain)
  blockwise  the memory-efficient form of models/attention.py (model.attention: blockwise, the default): the output
             and each row's max and 1 / sum kept, no T x T map
  recompute  each block's forward run again in the backward pass: its input kept, and one block's tensors (blockwise
             attention inside) alive at a time while its gradient is taken

The list is checked against CPU measurements (TensorFlow's allocator peak: docs/PERFORMANCE.md's ViT-S/16 encoder,
and `--probe`: encoders of 1, 2 and 4 blocks, whose differences are one block's memory); where the two differ, the
"fitted" figures scale the list to the measurement (FIT_* below) and the recipes' batches use them.

The ViTs' sizes are the published ones, written here (PUBLISHED), not read from seg-train's tables; the script says
if seg_train/config/variants.py disagrees. The recipes are read with seg-train's config loader (no TensorFlow).

Usage:
    python benchmarks/vit_memory_model.py              # the tables of docs/SCALING.md section 9
    python benchmarks/vit_memory_model.py --probe      # the CPU measurement behind FIT_* (about a minute per run)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

GIB = 2 ** 30
MIB = 2 ** 20


@dataclass(frozen=True)
class ViT:
    width: int      # D
    heads: int
    depth: int
    mlp: int        # the MLP's hidden width M (GELU MLP, not gated)
    registers: int
    rope: bool      # DINOv3: rotary q, k; DINOv2: learned positions added once
    pos_grid: int = 0  # DINOv2 at patch 16 (EoMT's): the learned positions' grid (the checkpoint's crop / 16)


# DINOv3 (Simeoni et al. 2025, its ViT-S / B / L distilled models: patch 16, 4 registers, RoPE, an MLP of 4 D with
# GELU; its S+ and H+ use SwiGLU, the recipes do not) and EoMT's DINOv2 ViT-L with 4 registers at patch 16 (Kerssies
# et al. 2025; Darcet et al. 2024: D 1024, 24 blocks, 16 heads, MLP 4096).
PUBLISHED = {
    "ViT-S/16": ViT(384, 6, 12, 1536, 4, True),
    "ViT-B/16": ViT(768, 12, 12, 3072, 4, True),
    "ViT-L/16": ViT(1024, 16, 24, 4096, 4, True),
}
BACKBONES = {  # seg-train's model.backbone -> (the published size, RoPE)
    "dinov3_vits16": "ViT-S/16", "dinov3_vitb16": "ViT-B/16", "dinov3_vitl16": "ViT-L/16",
    "dinov2_vitl16_reg": "ViT-L/16 (DINOv2)",
}
PATCH = 16
CROPS = (512, 640, 1024)
VARIANTS = ("plain", "blockwise", "recompute")

# Measured on the CPU (2-core Xeon, TensorFlow 2.21, `--probe`: DINOv3 ViT-S/16 encoders of 1, 2 and 4 blocks at
# 512 x 512, batch 1, forward + gradient, no optimizer; the allocator's peak). One block adds PROBE_BLOCK_MIB
# (float32, blockwise; of which the block's float32 weights, 1,774,848 parameters), and the plain form
# PROBE_MAPS_PER_BLOCK float32 [heads, T, T] maps more: the mean of three runs of the probe (the 4-block encoder's
# peak less the 2-block one's, halved), whose peaks move by a few MiB per block from run to run. The whole 12-block
# encoder at 1024 (docs/PERFORMANCE.md, "Attention: plain against blockwise") kept 1.96 maps per block more
# in the plain form: the model uses 2.
PROBE_T = 1 + 4 + (512 // 16) ** 2
PROBE_BLOCK_MIB = 46.65
PROBE_BLOCK_PARAMS = 1_774_848
PROBE_MAPS_PER_BLOCK = 2.03
FIT_MAPS = 2.0
# docs/PERFORMANCE.md's allocator peaks of the whole ViT-S/16 encoder (12 blocks, batch 1, float32, no optimizer;
# "Attention: plain against blockwise", the runs with models/layers.py's gelu): crop -> (plain, blockwise:256) MiB.
MEASURED_ENCODER = {224: (180, 174), 512: (1059, 592), 1024: (11295, 2218)}
# The same under mixed_bfloat16 at 512. Its blockwise figure is the CPU's floor under that policy, not activations:
# the probe's encoders of 1, 2, 6 and 12 blocks peaked at 795, 803, 846 and 909 MiB, 10.3 MiB per block (its float32
# weights and their bfloat16 copy), plain or blockwise alike (with Keras' GELU under autodiff then); only the plain
# form's 12 blocks rise above it.
MEASURED_ENCODER_MIXED = {512: (1076, 906)}
# The peer run (ViT-S/16 EoMT, 200 queries in the last 4 blocks, 150 classes, AdamW, float32, plain
# attention and Keras' GELU under autodiff then): seg-train's process peak RSS, MiB, at 2 x 224 and 1 x 512, and
# transformers' (PyTorch SDPA).
PEER = {"seg-train": (2705, 4233), "transformers": (1996, 2944)}

# Per GPU: weights, gradients and AdamW's two slots, float32 (16 bytes per trained parameter; the mixed policies keep
# float32 variables and add a half-precision copy of each weight for its matmuls, 2 bytes); HEADROOM of the card
# left for what the model does not count: the CUDA context and cuDNN / cuBLAS workspaces, allocator fragmentation,
# the gradients of one block's activations while its backward runs, the optimizer update's temporaries.
HEADROOM = 0.15
GPUS = (40, 80)
TOWERS = 4  # the recipes' comment: global batch over 4 GPUs


def tokens(crop: int, vit: ViT) -> int:
    return (crop // PATCH) ** 2 + 1 + vit.registers


def block_tensors(t: int, vit: ViT, attention: str, mixed: bool, prefix: int | None = None, rows: int = 0):
    """[(what, elements, bytes each)] one block keeps for its backward pass, per image: T tokens (EoMT's blocks:
    T + Q), `prefix` tokens without RoPE, `rows` float32 mask entries (EoMT's masked attention, blockwise form)."""
    d, m, h = vit.width, vit.mlp, vit.heads
    a, f = (2 if mixed else 4), 4   # the compute dtype's bytes; float32's
    prefix = 1 + vit.registers if prefix is None else prefix
    out = [
        ("norm1's input (float32: the block's input; under mixed precision the LayerNorm's float32 copy)", t * d, f),
        ("norm1's output (the q, k, v matmuls' input)", t * d, a),
    ]
    if vit.rope:
        out.append(("RoPE: q's and k's patch part and its half-swapped copy (the products with cos, sin), float32",
                    4 * (t - prefix) * d, f))
    out += [("q and k as the logits take them (rotated), float32", 2 * t * d, f),
            ("v split into heads", t * d, a)]
    if attention == "plain":
        out.append(("the softmax [heads, T, T], float32", h * t * t, f))
        if mixed:
            out.append(("the softmax cast to the compute dtype (its matmul with v)", h * t * t, a))
    else:
        out.append(("the float32 output, each row's max and 1 / sum (the custom gradient's)", t * d + 2 * h * t, f))
        if rows:
            out.append(("EoMT's mask in compact form [Q, N], float32", rows, f))
    out += [("the heads merged (the output projection's input)", t * d, a),
            ("the output projection (LayerScale's input)", t * d, a),
            ("norm2's input (float32: the first residual sum, or its float32 copy)", t * d, f),
            ("norm2's output (the MLP's input)", t * d, a),
            ("the exact GELU's input h (the first matmul's output; models/layers.py gelu runs 0.5 h, erfc(...) "
             "and its argument again from it in the backward pass)", t * m, a),
            ("the GELU's output (the second matmul's input)", t * m, a),
            ("the MLP's output (LayerScale's input)", t * d, a)]
    # Not kept: the projections' outputs before the head split (reshape / transpose need only shapes), the
    # residual sums (Add), the scaled logits (the scale is a constant), drop path's input (its mask is [b, 1, 1]).
    return out


def block_bytes(t, vit, attention, mixed, prefix=None, rows=0, fitted=False) -> float:
    """One block's kept bytes per image; `fitted`: scaled to the CPU measurement (FIT_*)."""
    total = 0.0
    for what, n, size in block_tensors(t, vit, attention, mixed, prefix, rows):
        if "[heads, T, T]" in what or "softmax cast" in what:
            total += n * size * (FIT_MAPS if fitted else 1.0)
        else:
            total += n * size * (fit_linear(mixed) if fitted else 1.0)
    return total


def fit_linear(mixed: bool) -> float:
    """Measured / listed bytes of a blockwise block's tensors (the probe at 512, ViT-S/16, float32)."""
    vit = PUBLISHED["ViT-S/16"]
    measured = PROBE_BLOCK_MIB * MIB - 4 * PROBE_BLOCK_PARAMS
    return measured / block_bytes(PROBE_T, vit, "blockwise", False)


def embed_tensors(crop: int, vit: ViT, mixed: bool, outputs: int = 1):
    """The patch embedding's input image, the tokens' assembly and the final LayerNorm on `outputs` maps."""
    a = 2 if mixed else 4
    t = tokens(crop, vit)
    return [("the image (the patch embedding's input)", 3 * crop * crop, a),
            ("the final LayerNorm's input and output per map read", outputs * 2 * t * vit.width, 4)]


def eomt_tensors(crop: int, vit: ViT, queries: int, blocks: int, mixed: bool, points: int = 12544):
    """EoMT's extra per image: per prediction (before each of the `blocks` EoMT blocks and the final one) the
    tokens through the final LayerNorm, the queries' class head and mask MLP, two upscale blocks (2x2 stride-2
    transposed conv, GELU, 3x3 depthwise conv, LayerNorm) to 4 x the patch grid, the mask logits [Q, 4 g, 4 g]
    float32; the loss's points. The EoMT blocks themselves: `block_tensors` at T + Q."""
    a, d = (2 if mixed else 4), vit.width
    g2 = (crop // PATCH) ** 2
    k = blocks + 1
    t = tokens(crop, vit) + queries
    out = [
        ("final LayerNorm's output sliced: the queries and the patch map (float32 copy of its input, mixed)",
         k * (queries + g2) * d + (k * t * d if mixed else 0), a),
        ("mask MLP (3 layers of D; two exact GELUs, each keeping its input) and class head inputs",
         k * queries * d * 5, a),
        ("upscale block 1 at 2 g x 2 g, D channels: the transposed conv's output (the exact GELU's input, all it "
         "keeps), the GELU's output (the depthwise conv's input), the depthwise conv's output (the LayerNorm's "
         "input), the LayerNorm's output (the next conv's input)", k * 4 * 4 * g2 * d, a),
        ("upscale block 2 at 4 g x 4 g: the same four", k * 4 * 16 * g2 * d, a),
        ("the mask logits [Q, 4 g, 4 g], float32 (alive until the loss samples them)", k * queries * 16 * g2, 4),
        ("the loss: each query's logits at the matching's and the loss's points, float32 (an upper bound: every "
         "query matched)", k * queries * points * 3, 4),
    ]
    if mixed:
        out.append(("the patch map cast to float32 for the mask logits' einsum", k * 16 * g2 * d, 4))
    return out


def pyramid_tensors(crop: int, vit: ViT, channels: int, classes: int, mixed: bool):
    """ViTDet's simple pyramid (models/dino/neck.py) under the SegFormer head (models/heads/segformer.py), per
    image: levels at strides 4, 8, 16, 32 from the last block's map, C channels each; the head's per-level
    projections upsampled to stride 4, concatenated, fused, BN, ReLU, the logits resized to the crop."""
    a, d, c = (2 if mixed else 4), vit.width, channels
    p4 = (crop // 4) ** 2
    p8, p16, p32 = p4 // 4, p4 // 16, p4 // 64
    return [
        ("stride 4: two transposed convs, LayerNorm and exact GELU between (at stride 8, D / 2: the first conv's "
         "output, the LayerNorm's output, the GELU's input and all it keeps, the GELU's output), the second's output",
         3 * p8 * d // 2 + p4 * d // 4, a),
        ("stride 8: one transposed conv output (D / 2)", p8 * d // 2, a),
        ("stride 32: max pool's input and output", p16 * d + p32 * d, a),
        ("each level: 1x1 conv output, its LayerNorm output, 3x3 conv output, its LayerNorm output (C)",
         4 * c * (p4 + p8 + p16 + p32), a),
        ("head: each level projected to C, the three deeper ones resized to stride 4 (the resize's input kept)",
         c * (p8 + p16 + p32) + c * p4, a),
        ("head: the 4 C concatenation (the fuse conv's input), BN's input, ReLU's output", p4 * 6 * c, a),
        ("logits at stride 4 (the resize's input) and at the crop, float32, with the loss's softmax",
         p4 * classes + 2 * crop * crop * classes, 4),
    ]


def total(items) -> float:
    return sum(n * size for _, n, size in items)


@dataclass(frozen=True)
class Model:
    """One training set-up, per image."""
    vit: ViT
    crop: int
    head: str = "none"          # none | eomt | linear | pyramid
    queries: int = 0
    eomt_blocks: int = 0
    classes: int = 0
    frozen: bool = False
    channels: int = 256


def activation_bytes(mdl: Model, variant: str, mixed: bool, fitted: bool) -> float:
    """Bytes kept for the backward pass per image (the frozen backbone: the largest block's forward, not kept)."""
    vit, t = mdl.vit, tokens(mdl.crop, mdl.vit)
    fit = fit_linear(mixed) if fitted else 1.0
    eomt = mdl.eomt_blocks if mdl.head == "eomt" else 0
    g2 = (mdl.crop // PATCH) ** 2
    inner = "plain" if variant == "plain" else "blockwise"

    def block(i):  # block i (0-based): an EoMT block takes the queries in front, masked (rows) while training
        if i >= vit.depth - eomt:
            return block_bytes(t + mdl.queries, vit, inner, mixed, prefix=mdl.queries + 1 + vit.registers,
                               rows=mdl.queries * g2 if inner == "blockwise" else 0, fitted=fitted)
        return block_bytes(t, vit, inner, mixed, fitted=fitted)

    if mdl.frozen:  # no backward through the encoder: one block's tensors at a time in the forward pass
        body = max(block(i) for i in range(vit.depth))
    elif variant == "recompute":
        a = 2 if mixed else 4
        inputs = sum((t + (mdl.queries if i >= vit.depth - eomt else 0)) * vit.width * a for i in range(vit.depth))
        body = inputs + max(block(i) for i in range(vit.depth))
    else:
        body = sum(block(i) for i in range(vit.depth))
    rest = total(embed_tensors(mdl.crop, vit, mixed))
    if mdl.head == "eomt":
        rest += total(eomt_tensors(mdl.crop, vit, mdl.queries, mdl.eomt_blocks, mixed))
    elif mdl.head == "pyramid":
        rest += total(pyramid_tensors(mdl.crop, vit, mdl.channels, mdl.classes, mixed))
    return body + rest * fit


def params(mdl: Model) -> tuple[int, int]:
    """(backbone, head) parameter counts from the published sizes."""
    vit, d = mdl.vit, mdl.vit.width
    per_block = 4 * d * d + 4 * d + 2 * d * vit.mlp + vit.mlp + d + 4 * d + 2 * d  # attention, MLP, norms, scales
    if vit.rope:
        per_block -= d  # DINOv3: no key bias
    embed = 3 * PATCH * PATCH * d + d + (1 + vit.registers) * d + vit.pos_grid ** 2 * d + 2 * d
    backbone = vit.depth * per_block + embed
    if mdl.head == "eomt":
        head = (mdl.queries * d + (d + 1) * (mdl.classes + 1) + 3 * (d * d + d)
                + 2 * (4 * d * d + d + 9 * d + 2 * d))
    elif mdl.head == "linear":
        head = 4 * d + d * mdl.classes + mdl.classes
    elif mdl.head == "pyramid":
        c = mdl.channels
        neck = (4 * d * d // 2 + d // 2 + 2 * d // 2 + 4 * d // 2 * d // 4 + d // 4) + (4 * d * d // 2 + d // 2)
        neck += sum(w * c + 2 * c + 9 * c * c + 2 * c for w in (d // 4, d // 2, d, d))
        head = 4 * (c * c + c) + 4 * c * c + 4 * c + c * mdl.classes + mdl.classes
        head += neck
    else:
        head = 0
    return backbone, head


def fixed_bytes(mdl: Model, mixed: bool) -> float:
    backbone, head = params(mdl)
    trained = head + (0 if mdl.frozen else backbone)
    return 4 * (backbone + head) + 12 * trained + (2 * trained if mixed else 0)


def per_gpu(mdl: Model, variant: str, mixed: bool, gib: int) -> int:
    usable = gib * GIB * (1 - HEADROOM) - fixed_bytes(mdl, mixed)
    return max(0, math.floor(usable / activation_bytes(mdl, variant, mixed, fitted=True)))


def gib(x: float) -> str:
    return f"{x / GIB:.2f}"


def check_variants() -> list[str]:
    """Where seg-train's size table disagrees with PUBLISHED (a note, not the reference)."""
    try:
        from seg_train.config.variants import VIT_VARIANTS
    except ImportError:
        return []
    notes = []
    for name, label in BACKBONES.items():
        v, p = VIT_VARIANTS[name], PUBLISHED[label.split(" ")[0]]
        if (v.width, v.heads, v.depth, v.mlp, v.registers, v.gated) != (p.width, p.heads, p.depth, p.mlp,
                                                                         p.registers, False):
            notes.append(f"{name}: seg_train/config/variants.py says {v}, the published size is {p}")
    return notes


def vit_of(backbone: str, grid: int | None = None) -> ViT:
    label = BACKBONES[backbone]
    vit = PUBLISHED[label.split(" ")[0]]
    if "DINOv2" in label:
        vit = ViT(vit.width, vit.heads, vit.depth, vit.mlp, vit.registers, rope=False, pos_grid=grid or 0)
    return vit


def recipes():
    """(name, Model, per-tower batch, accumulate_steps, precision, attention, trains) of every ViT recipe."""
    from seg_train.config import load
    out = []
    for path in sorted((ROOT / "configs").glob("*.yaml")):
        cfg = load(path)
        m = cfg.model
        if not m.backbone.startswith("dino") or path.stem.startswith("demo"):
            continue
        crop = cfg.data.crop_size[0]
        head = {"eomt": "eomt", "linear": "linear"}.get(m.head, "pyramid" if m.neck else m.head)
        mdl = Model(vit_of(m.backbone, m.position_grid), crop, head, m.num_queries if head == "eomt" else 0,
                    m.eomt_blocks if head == "eomt" else 0, cfg.data.num_classes, m.freeze_backbone,
                    m.segformer_channels or 256)
        # Evaluation-only recipes: their comment says seg-train refuses to train them (100 queries, 150 classes).
        trains = not (head == "eomt" and m.num_queries < cfg.data.num_classes and cfg.data.task == "semantic")
        out.append((path.name, mdl, cfg.data.batch_size // TOWERS, cfg.train.accumulate_steps, cfg.train.precision,
                    m.attention, trains))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--probe", action="store_true", help="measure one block's memory on this CPU (FIT_*)")
    args = p.parse_args(argv)
    if args.probe:
        return probe()
    for note in check_variants():
        print(f"note: {note}")

    print(f"### What one block keeps for the backward pass (per image; ViT-L/16 at 1024: T = "
          f"{tokens(1024, PUBLISHED['ViT-L/16'])}, D = 1024, 16 heads, M = 4096)\n")
    vit = PUBLISHED["ViT-L/16"]
    t = tokens(1024, vit)
    print("| tensor | elements | float32 MiB | mixed MiB |")
    print("| --- | ---: | ---: | ---: |")
    f32 = {w: (n, s) for w, n, s in block_tensors(t, vit, "plain", False) + block_tensors(t, vit, "blockwise", False)}
    mix = {w: (n, s) for w, n, s in block_tensors(t, vit, "plain", True) + block_tensors(t, vit, "blockwise", True)}
    for what in mix:
        n32, s32 = f32.get(what, (0, 0))
        n16, s16 = mix[what]
        print(f"| {what} | {n16:,} | {n32 * s32 / MIB:,.1f} | {n16 * s16 / MIB:,.1f} |")
    for form in ("plain", "blockwise"):
        cells = [f"{block_bytes(t, vit, form, mixed) / MIB:,.0f}; "
                 f"{block_bytes(t, vit, form, mixed, fitted=True) / MIB:,.0f}" for mixed in (False, True)]
        print(f"| **one block, {form} (list; fitted)** | | {cells[0]} | {cells[1]} |")

    print("\n### Check against the CPU (DINOv3 ViT-S/16 encoder, batch 1, float32, no optimizer; allocator peak MiB)\n")
    vs = PUBLISHED["ViT-S/16"]
    unit = PROBE_T * vs.width * 4
    listed = block_bytes(PROBE_T, vs, "blockwise", False) / unit
    print(f"One block at 512 (T = {PROBE_T}), `--probe`: measured {PROBE_BLOCK_MIB:.1f} MiB per block "
          f"(blockwise), {4 * PROBE_BLOCK_PARAMS / MIB:.1f} of them its weights: "
          f"{(PROBE_BLOCK_MIB * MIB - 4 * PROBE_BLOCK_PARAMS) / unit:.1f} float32 T x D per block against the "
          f"list's {listed:.1f} (fit x{fit_linear(False):.2f}); "
          f"the plain form {PROBE_MAPS_PER_BLOCK:.2f} [heads, T, T] float32 maps per block more, the list 1.\n")
    print("| crop (tokens) | attention | measured | list: weights + activations | fitted | fitted / measured |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    w = 4 * sum(params(Model(vs, 224)))
    for crop, (plain, blockwise) in MEASURED_ENCODER.items():
        for form, measured in (("plain", plain), ("blockwise", blockwise)):
            mdl = Model(vs, crop)
            lst = w + activation_bytes(mdl, form, False, False)
            fit = w + activation_bytes(mdl, form, False, True)
            print(f"| {crop} ({tokens(crop, vs)}) | {form} | {measured:,} | {lst / MIB:,.0f} | {fit / MIB:,.0f} | "
                  f"{fit / MIB / measured:.2f} |")

    for crop, (plain, blockwise) in MEASURED_ENCODER_MIXED.items():
        for form, measured in (("plain", plain), ("blockwise", blockwise)):
            mdl = Model(vs, crop)
            w16 = w + 2 * sum(params(mdl))
            lst, fit = (w16 + activation_bytes(mdl, form, True, fitted) for fitted in (False, True))
            print(f"| {crop} ({tokens(crop, vs)}), mixed_bfloat16 | {form} | {measured:,}"
                  f"{' (the floor)' if form == 'blockwise' else ''} | {lst / MIB:,.0f} | {fit / MIB:,.0f} | "
                  f"{fit / MIB / measured:.2f} |")

    eomt = Model(vs, 512, "eomt", 200, 4, 150)
    small = Model(vs, 224, "eomt", 200, 4, 150)
    print("\nThe issue's EoMT runs (ViT-S/16, 200 queries in the last 4 blocks, 150 classes, float32): growth of the "
          "process's peak from 2 x 224 to 1 x 512, MiB\n")
    print("| | measured (peak RSS) | model, plain (fitted) | model, blockwise (fitted) | model, recompute |")
    print("| --- | ---: | ---: | ---: | ---: |")
    grow = {v: (activation_bytes(eomt, v, False, True) - 2 * activation_bytes(small, v, False, True)) / MIB
            for v in VARIANTS}
    a, b = PEER["seg-train"]
    c, d = PEER["transformers"]
    print(f"| seg-train (plain attention, Keras' GELU under autodiff then) | {b - a:,} | {grow['plain']:,.0f} | "
          f"{grow['blockwise']:,.0f} | {grow['recompute']:,.0f} |")
    print(f"| transformers (PyTorch SDPA: no T x T map kept) | {d - c:,} | | | |")

    for mixed in (False, True):
        kind = "mixed precision (bfloat16 / float16 activations, float32 softmax and LayerNorm)" if mixed else \
            "float32"
        print(f"\n### Activation memory per image, encoder alone, {kind}: GiB, fitted (list)\n")
        print("| ViT | crop | tokens | " + " | ".join(VARIANTS) + " | plain's maps alone (list) |")
        print("| --- | ---: | ---: | " + " | ".join("---:" for _ in VARIANTS) + " | ---: |")
        for label, vit in PUBLISHED.items():
            for crop in CROPS:
                mdl = Model(vit, crop)
                cells = " | ".join(f"{gib(activation_bytes(mdl, v, mixed, True))} "
                                   f"({gib(activation_bytes(mdl, v, mixed, False))})" for v in VARIANTS)
                t = tokens(crop, vit)
                maps = vit.depth * vit.heads * t * t * (6 if mixed else 4)
                print(f"| {label} | {crop} | {t:,} | {cells} | {gib(maps)} |")

    print(f"\n### The recipes: images per GPU (fitted, {int(HEADROOM * 100)}% of the card kept free; weights, "
          f"gradients and AdamW's slots in float32)\n")
    print("| recipe | model | crop | precision | per-tower micro-batch (global / 4) x accumulate_steps | weights + "
          "gradients + AdamW GiB | activations per image GiB: plain / blockwise / recompute | images per 40 GiB: plain "
          "/ blockwise / recompute | per 80 GiB | the recipe's micro-batch fits 80 GiB (its attention)? | per 80 GiB, "
          "blockwise, mixed_bfloat16 |")
    print("| --- | --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | --- | ---: |")
    for name, mdl, tower, accum, precision, attention, trains in recipes():
        mixed = precision != "float32"
        label = {"eomt": f"EoMT, {mdl.queries} queries", "linear": "linear head, frozen ViT",
                 "pyramid": "simple pyramid + SegFormer"}[mdl.head]
        vit_label = next(k for k, v in PUBLISHED.items() if (v.width, v.depth) == (mdl.vit.width, mdl.vit.depth))
        acts = " / ".join(gib(activation_bytes(mdl, v, mixed, True)) for v in VARIANTS)
        fits = {g: [per_gpu(mdl, v, mixed, g) for v in VARIANTS] for g in GPUS}
        mine = fits[80][VARIANTS.index(attention)]
        verdict = f"yes ({attention})" if mine >= tower else \
            f"no ({attention}): {mine} of {tower}, accumulate_steps {math.ceil(tower / max(mine, 1))}"
        if not trains:
            verdict = f"{verdict}; evaluation only"
        print(f"| {name} | {vit_label}{'' if mdl.vit.rope else ' DINOv2'}, {label} | {mdl.crop} | {precision} | "
              f"{tower} x {accum} | {gib(fixed_bytes(mdl, mixed))} | {acts} | "
              f"{' / '.join(map(str, fits[40]))} | {' / '.join(map(str, fits[80]))} | {verdict} | "
              f"{per_gpu(mdl, 'blockwise', True, 80)} |")
    return 0


def probe(runs=((m, d) for m in ("blockwise", "plain") for d in (1, 2, 4))) -> int:
    """Allocator peaks of DINOv3 ViT-S/16 encoders of 1, 2 and 4 blocks at 512 in float32, each in a fresh
    process."""
    code = ("import json, sys\n"
            "from seg_train.cli import set_tf_env_defaults\n"
            "set_tf_env_defaults()\n"
            "import keras, numpy as np, tensorflow as tf\n"
            "from seg_train.models.dino.vit import dino_encoder\n"
            "method, depth, precision = sys.argv[1], int(sys.argv[2]), sys.argv[3]\n"
            "keras.mixed_precision.set_global_policy(precision)\n"
            "keras.utils.set_random_seed(0)\n"
            "model = dino_encoder('dinov3_vits16', layers=(depth,), attention=method)\n"
            "x = tf.constant(np.random.default_rng(0).normal(0, 1, (1, 512, 512, 3)).astype('float32'))\n"
            "@tf.function\n"
            "def step(x):\n"
            "    with tf.GradientTape() as tape:\n"
            "        outs = tf.nest.flatten(model(x, training=True))\n"
            "        loss = tf.add_n([tf.reduce_mean(tf.square(tf.cast(o, tf.float32))) for o in outs])\n"
            "    grads = tape.gradient(loss, model.trainable_variables)\n"
            "    return loss + tf.add_n([tf.reduce_sum(tf.square(tf.cast(g, tf.float32))) for g in grads]) * 0.0\n"
            "step(x).numpy(); step(x).numpy()\n"
            "print(json.dumps(tf.config.experimental.get_memory_info('CPU:0')['peak'] / 2 ** 20))\n")
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONPATH": str(ROOT)}
    print("| attention | precision | blocks | allocator peak MiB |")
    print("| --- | --- | ---: | ---: |")
    for method, depth in runs:
        out = subprocess.run([sys.executable, "-c", code, method, str(depth), "float32"], env=env,
                             capture_output=True, text=True, check=True)
        print(f"| {method} | float32 | {depth} | {json.loads(out.stdout.splitlines()[-1]):.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

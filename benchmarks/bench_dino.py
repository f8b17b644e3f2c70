#!/usr/bin/env python
"""seg-train's DINOv3 encoder (models/dino/vit.py) against keras-hub's own DINOV3Backbone: forward, and forward +
backward, at one fixed square size, in one process, with the same random weights.

    python benchmarks/bench_dino.py [--backbone dinov3_vits16] [--size 224] [--batch 2] [--steps 3]
                                    [--windows 5] [--warmup 2] [--output FILE.json]

keras-hub builds its backbone for the size (it takes one fixed size), its vectors (norms, layer scales,
tokens, biases) are set away from their initial values, it is saved with `save_to_preset` into a temporary
folder and loaded into seg-train's encoder (`model.backbone_weights` does the same), so both compute the same
function: the last block's patch tokens after the final LayerNorm (seg-train: `model.vit_layers: [last]`; keras-hub:
its output with the CLS and register tokens dropped). The script checks that the two outputs and the two
gradients agree before timing.

Each side runs as a tf.function (no XLA) on one CPU device: "forward" returns the output's mean square,
"forward + backward" also its gradient with respect to every variable (the part of a fine-tuning step
that depends on the backbone; no optimizer). After the warm-up calls (tracing included), the sides
alternate in windows (A B, B A, ...) of --steps calls; the MEDIAN window of each is reported, as ms per
call and as the CPU time (all threads) per call, with the ratio keras-hub / seg-train (above 1: seg-train
is faster) and the range of the ratios of neighbouring windows. Prints a markdown table; --output also
writes every number as JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backbone", default="dinov3_vits16", help="a DINOv3 model.backbone name (default dinov3_vits16)")
    p.add_argument("--size", type=int, default=224, help="square input side, a multiple of 16 (default 224)")
    p.add_argument("--batch", type=int, default=2, help="images per call (default 2)")
    p.add_argument("--steps", type=int, default=3, help="timed calls per window (default 3)")
    p.add_argument("--windows", type=int, default=5, help="timed windows per side and mode (default 5)")
    p.add_argument("--warmup", type=int, default=2, help="untimed calls per side and mode first (default 2)")
    p.add_argument("--output", type=Path, help="also write the results as JSON here")
    args = p.parse_args(argv)
    if args.size % 16:
        p.error(f"--size {args.size}: expected a multiple of 16 (whole patches)")
    if min(args.batch, args.steps, args.windows) < 1 or args.warmup < 0:
        p.error("--batch, --steps, --windows: expected >= 1; --warmup: >= 0")
    return args


def _build(name: str, size: int, folder: Path):
    """keras-hub's backbone with random weights and seg-train's encoder loaded from its preset."""
    import numpy as np

    from benchmarks.random_dino_preset import build
    from seg_train.config.variants import VIT_VARIANTS
    from seg_train.models.dino.presets import load_dino_preset
    from seg_train.models.dino.vit import dino_encoder

    spec = VIT_VARIANTS[name]
    if spec.family != "dinov3":
        raise SystemExit(f"error: --backbone {name}: expected a DINOv3 backbone (keras-hub's DINOV3Backbone)")
    hub = build(name, size)
    rng = np.random.default_rng(0)
    for v in hub.weights:  # the kernels are random already; move the vectors and tokens off their init
        if len(v.shape) > 1 and "token" not in v.path:
            continue
        a = rng.normal(0, 0.02, v.shape)
        if len(v.shape) == 1 and ("gamma" in v.path or "lambda" in v.path or "layer_scale" in v.path):
            a += 1.0
        v.assign(a.astype("float32"))
    hub.save_to_preset(str(folder))
    ours = dino_encoder(name, layers=(spec.depth,), norm=True)
    load_dino_preset(ours, folder, spec)
    return spec, hub, ours


def _functions(spec, hub, ours, batch: int, size: int):
    """{side: {mode: tf.function}} on one fixed image batch."""
    import tensorflow as tf

    skip = 1 + spec.registers
    grid = size // spec.patch

    def hub_out(x):
        return tf.reshape(hub({"pixel_values": x})[:, skip:], [batch, grid, grid, spec.width])

    def ours_out(x):
        return ours(x)

    def forward(out):
        return tf.function(lambda x: tf.reduce_mean(tf.square(out(x))))

    def backward(out, variables):
        def f(x):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(out(x)))
            return loss, tape.gradient(loss, variables)
        return tf.function(f)

    return {
        "seg-train": {"forward": forward(ours_out), "forward + backward": backward(ours_out, ours.trainable_variables)},
        "keras-hub": {"forward": forward(hub_out), "forward + backward": backward(hub_out, hub.trainable_variables)},
    }, hub_out, ours_out


def _check(hub, ours, hub_out, ours_out, image) -> dict:
    """How far apart the outputs and the gradients (matched by shape, in order) are, relative to the largest."""
    import numpy as np
    import tensorflow as tf

    def rel(a, b):
        a, b = np.asarray(a), np.asarray(b)
        return float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(b))), 1e-30))

    out_err = rel(ours_out(image), hub_out(image))
    grads = {}
    for side, out, model in (("seg-train", ours_out, ours), ("keras-hub", hub_out, hub)):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(out(image)))
        g = tape.gradient(loss, model.trainable_variables)
        grads[side] = sorted((float(np.sum(np.abs(np.asarray(t)))) for t in g if t is not None))
    # Variable names differ between the two; the sorted per-variable L1 norms of the gradients must agree.
    a, b = np.array(grads["seg-train"]), np.array(grads["keras-hub"])
    grad_err = float(np.max(np.abs(a - b) / np.maximum(np.abs(b), 1e-30))) if a.shape == b.shape else float("inf")
    return {"output_rel_err": out_err, "gradient_norm_rel_err": grad_err,
            "variables": {"seg-train": len(ours.trainable_variables), "keras-hub": len(hub.trainable_variables)}}


def _window(fn, image, steps: int) -> tuple[float, float]:
    """(wall ms, CPU ms) per call over `steps` calls."""
    import numpy as np

    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(steps):
        out = fn(image)
        np.asarray(out[0] if isinstance(out, tuple) else out)  # wait for the call
    return (time.perf_counter() - t0) * 1e3 / steps, (time.process_time() - c0) * 1e3 / steps


def main(argv=None) -> int:
    args = _parse(argv)
    from seg_train.cli import set_tf_env_defaults

    set_tf_env_defaults()  # the allocator the commands run on (the environment's choice wins)
    import numpy as np

    from seg_train.bench.machine import machine_info
    from seg_train.parallel import replicas

    replicas.setup_devices(1)
    with tempfile.TemporaryDirectory() as tmp:
        spec, hub, ours = _build(args.backbone, args.size, Path(tmp) / "preset")
    image = np.random.default_rng(1).normal(0, 1, (args.batch, args.size, args.size, 3)).astype("float32")
    fns, hub_out, ours_out = _functions(spec, hub, ours, args.batch, args.size)
    check = _check(hub, ours, hub_out, ours_out, image)
    print(f"same function: output rel. error {check['output_rel_err']:.2e}, gradient norms rel. error "
          f"{check['gradient_norm_rel_err']:.2e}", file=sys.stderr)

    results = {}
    for mode in ("forward", "forward + backward"):
        for side in fns:
            for _ in range(args.warmup):
                _window(fns[side][mode], image, 1)
        wins = {side: [] for side in fns}
        order = list(fns)
        for w in range(args.windows):
            for side in (order if w % 2 == 0 else order[::-1]):
                wins[side].append(_window(fns[side][mode], image, args.steps))
            print(f"{mode}: window {w + 1}/{args.windows} done", file=sys.stderr)
        ratios = [h[0] / s[0] for s, h in zip(wins["seg-train"], wins["keras-hub"])]
        results[mode] = {
            side: {"ms": statistics.median(x[0] for x in wins[side]),
                   "cpu_ms": statistics.median(x[1] for x in wins[side]),
                   "windows_ms": [round(x[0], 2) for x in wins[side]]}
            for side in fns}
        results[mode]["ratio"] = results[mode]["keras-hub"]["ms"] / results[mode]["seg-train"]["ms"]
        results[mode]["ratio_cpu"] = results[mode]["keras-hub"]["cpu_ms"] / results[mode]["seg-train"]["cpu_ms"]
        results[mode]["window_ratios"] = [min(ratios), max(ratios)]

    record = {"backbone": args.backbone, "size": args.size, "batch": args.batch, "steps": args.steps,
              "windows": args.windows, "warmup": args.warmup, "check": check, "results": results,
              "machine": machine_info()}
    if args.output:
        args.output.write_text(json.dumps(record, indent=1) + "\n")
    print(f"{args.backbone}, {args.batch} x {args.size}x{args.size}, float32, 1 CPU device; median of "
          f"{args.windows} windows of {args.steps} calls per side, interleaved\n")
    print("| pass | seg-train ms | keras-hub ms | keras-hub / seg-train (wall) | per-window | by CPU |")
    print("| --- | ---: | ---: | ---: | --- | ---: |")
    for mode, r in results.items():
        lo, hi = r["window_ratios"]
        print(f"| {mode} | {r['seg-train']['ms']:.1f} | {r['keras-hub']['ms']:.1f} | {r['ratio']:.2f}x | "
              f"{lo:.2f}-{hi:.2f}x | {r['ratio_cpu']:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

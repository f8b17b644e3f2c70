#!/usr/bin/env python
"""Plain against blockwise attention (seg_train/models/attention.py) in a whole encoder's forward + backward pass:
seconds per step and the peak resident memory of a fresh process per variant.

    python benchmarks/bench_attention.py [--model dinov3_vits16] [--sizes 512 1024] [--batch 1]
                                         [--variants plain blockwise:128 blockwise:256 blockwise:512]
                                         [--rounds 2] [--steps 3] [--warmup 1] [--precision float32]
                                         [--output FILE.json]

--model: a DINO encoder (models/dino/vit.py's dino_encoder, every block, the final LayerNorm) or a MiT
(models/mit/encoder.py's mix_transformer, its four stages), random weights. A variant is `plain` or
`blockwise:BLOCK` (keys per block). For each size, every variant runs in a process of its own (a fresh process: its
peak memory is its own), the variants in the given order, and the whole sequence --rounds times (A B C A B C: a
change of machine load hits every variant alike). Each process builds the model, traces one tf.function (the mean
square of the outputs, its gradient with respect to every trainable variable; no optimizer), runs --warmup untimed
steps (the first one traces) and --steps timed steps, and reports the median seconds per step, the CPU seconds per
step (all its threads), its resident memory before the first step (VmRSS), its peak (VmHWM) and, where TensorFlow's
CPU allocator keeps statistics, the allocator's peak.

The table also gives, by arithmetic, what the attention keeps per block for the backward pass: plain, the float32
softmax [b, heads, Tq, Tk] (under mixed precision also its half-precision copy); blockwise, the float32 output and
each row's maximum and 1 / sum, [b, heads, Tq, head_dim + 2] (q, k and v are kept by both).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="dinov3_vits16", help="a dinov*_ or mit_* name (default dinov3_vits16)")
    p.add_argument("--sizes", type=int, nargs="+", default=[512], help="square input sides (default 512)")
    p.add_argument("--batch", type=int, default=1, help="images per step (default 1)")
    p.add_argument("--variants", nargs="+", default=["plain", "blockwise:128", "blockwise:256", "blockwise:512"],
                   help="plain and blockwise:BLOCK (default plain blockwise:128 blockwise:256 blockwise:512)")
    p.add_argument("--rounds", type=int, default=2, help="times the sequence of variants is run (default 2)")
    p.add_argument("--steps", type=int, default=3, help="timed steps per process (default 3)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps first, tracing included (default 1)")
    p.add_argument("--precision", default="float32", choices=("float32", "mixed_float16", "mixed_bfloat16"),
                   help="the Keras dtype policy (default float32)")
    p.add_argument("--output", type=Path, help="also write every number as JSON here")
    p.add_argument("--child", help=argparse.SUPPRESS)  # one variant at --sizes[0], in this process
    args = p.parse_args(argv)
    for v in args.variants:
        _variant(p, v)
    if min(args.batch, args.rounds, args.steps, args.warmup) < 1:
        p.error("--batch, --rounds, --steps, --warmup: expected >= 1 (tracing is never timed)")
    return args, p


def _variant(parser, text: str) -> tuple[str, int]:
    """'plain' -> ('plain', 0); 'blockwise:256' -> ('blockwise', 256)."""
    method, _, block = text.partition(":")
    if method == "plain" and not block:
        return method, 0
    if method == "blockwise" and block.isdigit() and int(block) > 0:
        return method, int(block)
    parser.error(f"variant {text!r}: expected plain or blockwise:BLOCK (a positive number of keys)")


def _shapes(model: str, size: int, batch: int) -> list[tuple[int, int, int, int]]:
    """(b, heads, Tq, Tk) of each attention block of `model` at size x size."""
    if model.startswith("mit_"):
        from seg_train.config.variants import MIT_VARIANTS as VARIANTS
        spec, side, out = VARIANTS[model], size, []
        for i in range(4):
            side = (side + 2 * (spec.patch_sizes[i] // 2) - spec.patch_sizes[i]) // spec.patch_strides[i] + 1
            keys = (side // spec.sr_ratios[i]) ** 2
            out += [(batch, spec.heads[i], side * side, keys)] * spec.depths[i]
        return out
    from seg_train.config.variants import VIT_VARIANTS as VARIANTS
    spec = VARIANTS[model]
    t = 1 + spec.registers + (size // spec.patch) ** 2
    return [(batch, spec.heads, t, t)] * spec.depth


def _head_dim(model: str) -> list[int]:
    if model.startswith("mit_"):
        from seg_train.config.variants import MIT_VARIANTS as VARIANTS
        spec = VARIANTS[model]
        return [w // h for w, h, n in zip(spec.widths, spec.heads, spec.depths) for _ in range(n)]
    from seg_train.config.variants import VIT_VARIANTS as VARIANTS
    spec = VARIANTS[model]
    return [spec.width // spec.heads] * spec.depth


def stored_mib(model: str, size: int, batch: int, method: str, precision: str) -> tuple[float, float]:
    """(largest block's, all blocks') MiB the attention keeps for the backward pass (module doc), by arithmetic."""
    per = []
    for (b, h, tq, tk), d in zip(_shapes(model, size, batch), _head_dim(model)):
        if method == "plain":
            per.append(b * h * tq * tk * (4 + (2 if precision != "float32" else 0)))
        else:
            per.append(b * h * tq * (d + 2) * 4)
    return max(per) / 2 ** 20, sum(per) / 2 ** 20


def _rss_mib(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024.0
    return float("nan")


def child(args) -> dict:
    """One variant at one size in this process: the record the parent reads (the last line of stdout)."""
    from seg_train.cli import set_tf_env_defaults

    set_tf_env_defaults()  # the allocator the commands run on (the environment's choice wins)
    import keras
    import numpy as np
    import tensorflow as tf

    method, block = _variant(argparse.ArgumentParser(), args.child)
    size = args.sizes[0]
    keras.mixed_precision.set_global_policy(args.precision)
    keras.utils.set_random_seed(0)
    kwargs = {"attention": method}
    if args.model.startswith("mit_"):
        from seg_train.models.mit.encoder import mix_transformer
        model = mix_transformer(args.model, **kwargs)
    else:
        from seg_train.config.variants import VIT_VARIANTS as VARIANTS
        from seg_train.models.dino.vit import dino_encoder
        model = dino_encoder(args.model, layers=(VARIANTS[args.model].depth,), **kwargs)
    if block:
        from seg_train.models.dino.vit import Attention
        from seg_train.models.mit.encoder import EfficientAttention
        for layer in model.layers:
            if isinstance(layer, (Attention, EfficientAttention)):
                layer.block = block  # read when the step is traced, below
    x = tf.constant(np.random.default_rng(0).normal(0, 1, (args.batch, size, size, 3)).astype("float32"))

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            outs = tf.nest.flatten(model(x, training=True))
            loss = tf.add_n([tf.reduce_mean(tf.square(tf.cast(o, tf.float32))) for o in outs])
        grads = tape.gradient(loss, model.trainable_variables)
        return loss + tf.add_n([tf.reduce_sum(tf.square(tf.cast(g, tf.float32))) for g in grads]) * 0.0

    def allocator_peak():
        try:
            return tf.config.experimental.get_memory_info("CPU:0")["peak"] / 2 ** 20
        except (ValueError, RuntimeError):
            return None

    rss_before = _rss_mib("VmRSS")
    first = time.perf_counter()
    for _ in range(args.warmup):
        step(x).numpy()
    first = time.perf_counter() - first
    times, cpu = [], time.process_time()
    for _ in range(args.steps):
        t0 = time.perf_counter()
        step(x).numpy()
        times.append(time.perf_counter() - t0)
    cpu = (time.process_time() - cpu) / args.steps
    return {"variant": args.child, "size": size, "tokens": _shapes(args.model, size, args.batch)[0][2],
            "s_per_step": statistics.median(times), "steps_s": [round(t, 3) for t in times], "cpu_s_per_step": cpu,
            "warmup_s": round(first, 2), "rss_before_mib": rss_before, "peak_rss_mib": _rss_mib("VmHWM"),
            "allocator_peak_mib": allocator_peak()}


def _run_child(args, variant: str, size: int) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", variant, "--model", args.model,
           "--sizes", str(size), "--batch", str(args.batch), "--steps", str(args.steps),
           "--warmup", str(args.warmup), "--precision", args.precision]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        tail = out.stderr.strip().splitlines()[-3:]
        print(f"{variant} at {size}: exit {out.returncode}: {' | '.join(tail)}", file=sys.stderr)
        return {"variant": variant, "size": size, "failed": out.returncode}
    return json.loads(out.stdout.strip().splitlines()[-1])


def _load() -> str:
    try:
        with open("/proc/loadavg") as f:
            return f.read().split()[0]
    except OSError:
        return "?"


def main(argv=None) -> int:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    args, parser = _parse(argv)
    if args.child:
        print(json.dumps(child(args)))
        return 0
    runs = []
    for size in args.sizes:
        for r in range(args.rounds):
            for variant in args.variants:
                rec = _run_child(args, variant, size)
                rec.update(round=r + 1, load=_load())
                runs.append(rec)
                print(f"size {size} round {r + 1} {variant}: "
                      + (f"{rec['s_per_step']:.2f} s/step, peak {rec['peak_rss_mib']:.0f} MiB" if "failed" not in rec
                         else "failed") + f" (load {rec['load']})", file=sys.stderr)
    if args.output:
        given = {k: v for k, v in vars(args).items() if k not in ("output", "child")}
        args.output.write_text(json.dumps({"args": given, "runs": runs}, indent=1, default=str) + "\n")
    print(f"{args.model}, batch {args.batch}, {args.precision}, forward + backward (no optimizer); a fresh process "
          f"per variant, {args.rounds} rounds of the variants in order; per process {args.warmup} warm-up and "
          f"{args.steps} timed steps (median)\n")
    print("| input (tokens) | attention | s / step (median of rounds) | per round | CPU s / step | peak RSS MiB "
          "| RSS before step 1 MiB | allocator peak MiB | stored per block / all blocks MiB (arithmetic) |")
    print("| --- | --- | ---: | --- | ---: | ---: | ---: | ---: | ---: |")
    for size in args.sizes:
        for variant in args.variants:
            recs = [r for r in runs if r["size"] == size and r["variant"] == variant and "failed" not in r]
            method, _ = _variant(parser, variant)
            block, total = stored_mib(args.model, size, args.batch, method, args.precision)
            tokens = _shapes(args.model, size, args.batch)[0][2]
            if not recs:
                print(f"| {size} ({tokens}) | {variant} | failed | | | | | | {block:.1f} / {total:.1f} |")
                continue
            alloc = [r["allocator_peak_mib"] for r in recs if r["allocator_peak_mib"] is not None]
            print(f"| {size} ({tokens}) | {variant} | {statistics.median(r['s_per_step'] for r in recs):.2f} | "
                  + ", ".join(f"{r['s_per_step']:.2f}" for r in recs)
                  + f" | {statistics.median(r['cpu_s_per_step'] for r in recs):.2f}"
                  + f" | {max(r['peak_rss_mib'] for r in recs):,.0f} | "
                  + f"{statistics.median(r['rss_before_mib'] for r in recs):,.0f} | "
                  + (f"{max(alloc):,.0f}" if alloc else "n/a") + f" | {block:.1f} / {total:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

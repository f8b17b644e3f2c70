#!/usr/bin/env python
"""EoMT's loss alone (seg_train/objectives/mask_loss.py) at a train step's shapes, with and without its Hungarian
matcher, and the matcher alone: how much of an EoMT step the matching takes.

    python benchmarks/bench_eomt_loss.py [--batch 8] [--size 512] [--classes 5] [--present N] [--queries 100]
                                         [--blocks 4] [--steps 3] [--windows 5] [--warmup 2] [--step-ms MS]
                                         [--segments N] [--output FILE.json]

Random predictions of the step's shapes: --blocks + 1 prediction layers (one before each EoMT block and the
final one, as the train step's deep supervision), each class logits [b, Q, K+1] and mask logits
[b, Q, size/4, size/4]; label maps [b, size, size] of random 64x64 tiles with an ignored border, each image's
tiles drawn from --present of the K classes (its own random choice; default all K, so most images hold every
class: the matcher's largest problem, K masks per image). ADE20K's images hold about ten of its 150 classes:
--classes 150 --present 10. --segments N: panoptic targets instead (data.task panoptic: segment labels, one mask
per segment) of N + 1 segments per image: N tiles of the 64x64 grid are thing instances 1..N of classes drawn from
the image's --present, the other tiles one stuff region of the image's first class; COCO's images hold up to about
a hundred (--classes 133 --queries 200 --segments 100).

Three tf.functions (no XLA) on one CPU device, on the same tensors:
  loss               eomt_loss_terms and the weighted total, and its gradient with respect to the predictions
                     (the loss's part of a train step: matching, point sampling, class and mask terms)
  loss, no matcher   the same with the matcher replaced by a fixed assignment (mask slot g to query g), the
                     cost matrices still built; the difference from "loss" is the assignment's time
  matcher alone      batched_linear_sum_assignment on one random cost [b, Q, K] per layer, with the labels'
                     mask counts (the same calls the loss makes)
  points' pick       the loss points' selection alone (mask_loss._top_k_indices: the importance ratio's most
                     uncertain of the oversampled points of each matched mask, a bracket of the k-th value), per
                     layer on random -|logit| rows of the loss's shape [b x G, oversampled points], G the most
                     classes (or segments) an image holds
  points' pick, top_k  the same rows through tf.math.top_k, the form it replaced
After the warm-up calls (tracing included), the three alternate in windows of --steps calls, the order
rotating; the MEDIAN window of each is reported, as wall ms and CPU ms (this process's threads, all cores)
per call. --step-ms (a train step's wall ms, e.g. from seg-bench) adds each part's share of that step.
Prints a markdown table and the process's peak resident memory; --output also writes every number as JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PARTS = ("loss", "loss, no matcher", "matcher alone", "points' pick", "points' pick, top_k")


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=8, help="images per call (default 8)")
    p.add_argument("--size", type=int, default=512, help="square label side, a multiple of 4 (default 512)")
    p.add_argument("--classes", type=int, default=5, help="K, data.num_classes (default 5, the demo's)")
    p.add_argument("--present", type=int, help="classes each image's tiles are drawn from (default: --classes)")
    p.add_argument("--queries", type=int, default=100, help="Q, model.num_queries (default 100)")
    p.add_argument("--blocks", type=int, default=4, help="model.eomt_blocks: blocks + 1 layers (default 4)")
    p.add_argument("--points", type=int, default=12544, help="loss.mask_points (default 12544)")
    p.add_argument("--steps", type=int, default=3, help="timed calls per window (default 3)")
    p.add_argument("--windows", type=int, default=5, help="timed windows per part (default 5)")
    p.add_argument("--warmup", type=int, default=2, help="untimed calls per part first (default 2)")
    p.add_argument("--step-ms", type=float, help="a train step's wall ms, for each part's share of it")
    p.add_argument("--segments", type=int, help="panoptic targets: thing segments per image (default: semantic)")
    p.add_argument("--output", type=Path, help="also write the results as JSON here")
    args = p.parse_args(argv)
    if args.size % 4:
        p.error(f"--size {args.size}: expected a multiple of 4 (masks at a quarter of it)")
    if min(args.batch, args.classes, args.queries, args.blocks, args.points, args.steps, args.windows) < 1:
        p.error("--batch, --classes, --queries, --blocks, --points, --steps, --windows: expected >= 1")
    args.present = args.classes if args.present is None else args.present
    if not 1 <= args.present <= args.classes:
        p.error(f"--present {args.present}: expected 1 .. --classes ({args.classes})")
    if args.segments is None and args.queries < args.classes:
        p.error(f"--queries {args.queries}: expected at least --classes ({args.classes})")
    if args.segments is not None and not 1 <= args.segments < min(args.queries, (-(-args.size // 64)) ** 2):
        p.error(f"--segments {args.segments}: expected 1 .. min(--queries, 64x64 tiles) - 1")
    if args.warmup < 1:
        p.error("--warmup: expected >= 1 (tracing is never timed)")
    return args


def _inputs(args):
    """(predictions, labels, seeds, costs) as numpy arrays, from a fixed seed."""
    import numpy as np

    rng = np.random.default_rng(0)
    b, q, k, h = args.batch, args.queries, args.classes, args.size // 4
    layers = args.blocks + 1
    predictions = [(rng.normal(0, 1, (b, q, k + 1)).astype("float32"),
                    rng.normal(0, 3, (b, q, h, h)).astype("float32")) for _ in range(layers)]
    tiles = -(-args.size // 64)
    chosen = np.stack([rng.choice(k, args.present, replace=False) for _ in range(b)])  # [b, present]
    tile_classes = np.take_along_axis(chosen, rng.integers(0, args.present, (b, tiles * tiles)), 1)
    labels = np.kron(tile_classes.reshape(b, tiles, tiles), np.ones((64, 64), np.int64))
    labels = labels[:, :args.size, :args.size].astype("int32")
    if args.segments is not None:
        # Segment labels: N tiles numbered instances 1..N, the other tiles the image's first class as stuff.
        number = np.zeros((b, tiles * tiles), np.int64)
        for i in range(b):
            number[i, rng.choice(tiles * tiles, args.segments, replace=False)] = np.arange(1, args.segments + 1)
        tile_values = np.where(number > 0, tile_classes * 1000 + number, chosen[:, :1] * 1000)
        labels = np.kron(tile_values.reshape(b, tiles, tiles), np.ones((64, 64), np.int64))
        labels = labels[:, :args.size, :args.size].astype("int32")
        labels[:, :4], labels[:, :, :4] = 255000, 255000
    else:
        labels[:, :4], labels[:, :, :4] = 255, 255
    seeds = np.stack([np.arange(b), np.full(b, 12345)], axis=1).astype("int32")
    slots = k if args.segments is None else args.segments + 1
    costs = [rng.normal(0, 1, (b, q, slots)).astype("float32") for _ in range(layers)]
    return predictions, labels, seeds, costs


@contextlib.contextmanager
def _fixed_assignment(eomt_loss):
    """eomt_loss's matcher replaced, while tracing, by slot g -> query g (the outputs' shapes and dtypes)."""
    import tensorflow as tf

    def fixed(cost, num_valid):
        q, g = tf.shape(cost)[1], tf.shape(cost)[2]
        valid = tf.range(g)[tf.newaxis, :] < tf.cast(num_valid, tf.int32)[:, tf.newaxis]
        # Read the cost (always true for finite costs) so that building it is not pruned as unused.
        valid &= tf.reduce_max(cost, axis=1) > float("-inf")
        row_of_col = tf.where(valid, tf.range(g)[tf.newaxis, :], -1)
        rows = tf.range(q)[tf.newaxis, :]
        col_of_row = tf.where(rows < tf.cast(num_valid, tf.int32)[:, tf.newaxis], rows, -1)
        return row_of_col, col_of_row

    original = eomt_loss.batched_linear_sum_assignment
    eomt_loss.batched_linear_sum_assignment = fixed
    try:
        yield
    finally:
        eomt_loss.batched_linear_sum_assignment = original


def _functions(args, predictions, labels, seeds, costs):
    """{part: a no-argument callable running one traced call and waiting for it}."""
    import numpy as np
    import tensorflow as tf

    from seg_train.objectives import mask_loss as eomt_loss
    from seg_train.objectives.matching import batched_linear_sum_assignment

    task = "semantic" if args.segments is None else "panoptic"
    opts = eomt_loss.EomtLossOptions(num_classes=args.classes, num_points=args.points, task=task)
    preds = [(tf.constant(c), tf.constant(m)) for c, m in predictions]
    labels_t, seeds_t = tf.constant(labels), tf.constant(seeds)
    costs_t = [tf.constant(c) for c in costs]

    def loss_and_grad(preds, labels, seeds):
        with tf.GradientTape() as tape:
            tape.watch(preds)
            terms = eomt_loss.eomt_loss_terms(preds, labels, seeds, opts)
            loss = eomt_loss.losses_from_terms(terms, opts)["loss"]
        return loss, tape.gradient(loss, preds)

    def matcher(costs, labels):
        _, _, num_valid = eomt_loss.targets_of(labels, opts, max_segments=args.queries)
        return [batched_linear_sum_assignment(c, num_valid)[0] for c in costs]

    with_matcher = tf.function(loss_and_grad).get_concrete_function(preds, labels_t, seeds_t)
    with _fixed_assignment(eomt_loss):
        without = tf.function(loss_and_grad).get_concrete_function(preds, labels_t, seeds_t)
    alone = tf.function(matcher).get_concrete_function(costs_t, labels_t)

    # The points' pick: as many rows per layer as the loss's matched masks, [b x G, oversampled].
    _, _, num_valid = eomt_loss.targets_of(labels_t, opts, max_segments=args.queries)
    rows = args.batch * max(int(tf.reduce_max(num_valid)), 1)
    sampled = int(opts.num_points * opts.oversample_ratio)
    k = int(opts.importance_sample_ratio * opts.num_points)
    rng = np.random.default_rng(1)
    uncertainty = tf.constant(-np.abs(rng.normal(0.0, 3.0, (len(preds), rows, sampled))).astype(np.float32))

    def pick(select):
        return tf.function(lambda u: [select(u[i]) for i in range(len(preds))]).get_concrete_function(uncertainty)

    picked = pick(lambda u: eomt_loss._top_k_indices(u, k))
    heap = pick(lambda u: tf.math.top_k(u, k, sorted=False).indices)

    def run(fn, *a):
        return lambda: np.asarray(tf.nest.flatten(fn(*a))[0])  # wait for the call

    return {"loss": run(with_matcher, preds, labels_t, seeds_t),
            "loss, no matcher": run(without, preds, labels_t, seeds_t),
            "matcher alone": run(alone, costs_t, labels_t),
            "points' pick": run(picked, uncertainty), "points' pick, top_k": run(heap, uncertainty)}


def _window(fn, steps: int) -> tuple[float, float]:
    """(wall ms, CPU ms) per call over `steps` calls."""
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(steps):
        fn()
    return (time.perf_counter() - t0) * 1e3 / steps, (time.process_time() - c0) * 1e3 / steps


def main(argv=None) -> int:
    args = _parse(argv)
    from seg_train.cli import set_tf_env_defaults

    set_tf_env_defaults()  # the allocator the commands run on (the environment's choice wins)
    from seg_train.bench.machine import machine_info
    from seg_train.parallel import replicas

    replicas.setup_devices(1)
    fns = _functions(args, *_inputs(args))
    for part in PARTS:
        for _ in range(args.warmup):
            fns[part]()
    wins = {part: [] for part in PARTS}
    for w in range(args.windows):
        for i in range(len(PARTS)):
            part = PARTS[(w + i) % len(PARTS)]
            wins[part].append(_window(fns[part], args.steps))
        print(f"window {w + 1}/{args.windows} done", file=sys.stderr)
    results = {part: {"ms": statistics.median(x[0] for x in wins[part]),
                      "cpu_ms": statistics.median(x[1] for x in wins[part]),
                      "windows_ms": [round(x[0], 2) for x in wins[part]]} for part in PARTS}
    results["assignment_ms"] = results["loss"]["ms"] - results["loss, no matcher"]["ms"]
    results["assignment_cpu_ms"] = results["loss"]["cpu_ms"] - results["loss, no matcher"]["cpu_ms"]

    from seg_train.util.sysinfo import peak_rss_mb

    record = {k: getattr(args, k) for k in ("batch", "size", "classes", "present", "queries", "blocks", "points",
                                            "steps", "windows", "warmup", "step_ms", "segments")}
    record.update(results=results, peak_rss_mib=peak_rss_mb(), machine=machine_info())
    if args.output:
        args.output.write_text(json.dumps(record, indent=1) + "\n")
    layers = args.blocks + 1
    targets = "semantic targets" if args.segments is None else f"panoptic targets, {args.segments + 1} per image"
    print(f"{args.batch} x {args.size}x{args.size} labels ({targets}), K={args.classes} ({args.present} per image), "
          f"Q={args.queries}, {layers} layers of "
          f"masks at {args.size // 4}x{args.size // 4}, {args.points} points, float32, 1 CPU device; median of "
          f"{args.windows} windows of {args.steps} calls per part, interleaved\n")
    share = args.step_ms is not None
    print("| part | ms (wall) | CPU ms | of the loss (wall) |" + (" of the step (wall) |" if share else ""))
    print("| --- | ---: | ---: | ---: |" + (" ---: |" if share else ""))
    rows = [(part, results[part]["ms"], results[part]["cpu_ms"]) for part in PARTS]
    rows.append(("assignment (loss - loss, no matcher)", results["assignment_ms"], results["assignment_cpu_ms"]))
    for name, ms, cpu in rows:
        line = f"| {name} | {ms:.1f} | {cpu:.1f} | {100 * ms / results['loss']['ms']:.1f}% |"
        print(line + (f" {100 * ms / args.step_ms:.2f}% |" if share else ""))
    print(f"\npeak resident memory of the process: {record['peak_rss_mib']:.0f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())

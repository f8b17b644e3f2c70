#!/usr/bin/env python3
"""TF Model Garden's own segmentation input pipeline, timed the way `seg-bench --input-only` times seg-train's.

A peer to compare seg-train's reader with: tf-models-official's `official.vision` semantic segmentation
task, experiment `seg_deeplabv3plus_cityscapes` (Cityscapes DeepLabV3+), its training input built by its
own `task.build_inputs(params.task.train_data)` (TFRecord reader, `segmentation_input.Decoder` and
`Parser`: decode, resize to output_size, random crop, random flip, random scale with crop or pad, batch)
with the augmentation set to seg-train's Cityscapes recipe: 769x769 crops, scale 0.5-2.0, flip, batch 8.

tf-models-official pins its own TensorFlow (2.20 for tf-models-official 2.20.0), so this runs ONLY in a
separate virtual environment, never imported by seg-train and never one of its dependencies:

    python3.11 -m venv /path/to/tfm
    /path/to/tfm/bin/pip install tf-models-official==2.20.0 tensorflow==2.20.0
    /path/to/tfm/bin/python scripts/bench_model_garden_input.py --records 'DATA/tfrecords/train-*.tfrecord'
        [--steps 3] [--windows 4] [--warmup 2] [--json]

The records are those seg-prepare tfrecords writes (image/encoded, image/height, image/width and
image/segmentation/class/encoded, a single-channel PNG of class indices: the features Model Garden's
segmentation Decoder reads); scripts/make_cityscapes_like.py OUT --tfrecords writes a Cityscapes-scale
set with them. Timing: `--warmup` batches untimed, then `--windows` windows of `--steps` batches;
images/s, cores busy (this process's CPU time, all threads, over the window's wall time) and CPU
milliseconds per sample (that CPU time / the window's samples), the median window of each, as
seg_train/bench/runner.py does for seg-train's reader. Prints one line, or one JSON object with --json.

Model Garden's parser resizes the decoded image to output_size (a no-op for 2048x1024 frames), cuts a
random crop_size window at scale 1, mirrors it, then scales the crop by U(0.5, 2.0) and crops or pads
that to crop_size; seg-train scales the frame first and crops after. Both draw scale, flip and
position per sample and deliver 769x769 float32 crops; the work differs in where the crop is cut.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--records", required=True, help="TFRecord file pattern, e.g. 'DATA/tfrecords/train-*.tfrecord'")
    p.add_argument("--experiment", default="seg_deeplabv3plus_cityscapes")
    p.add_argument("--crop", type=int, nargs=2, default=(769, 769), metavar=("HEIGHT", "WIDTH"))
    p.add_argument("--output-size", type=int, nargs=2, default=(1024, 2048), metavar=("HEIGHT", "WIDTH"))
    p.add_argument("--scale", type=float, nargs=2, default=(0.5, 2.0), metavar=("MIN", "MAX"))
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=3, help="batches per timed window (default 3)")
    p.add_argument("--windows", type=int, default=4, help="timed windows, the median is reported (default 4)")
    p.add_argument("--warmup", type=int, default=2, help="untimed batches first (default 2)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    try:
        import tensorflow as tf
        from official.core import exp_factory, task_factory
        import official.vision  # noqa: F401  (registers the vision experiments and tasks)
    except ImportError as e:
        print(f"error: Model Garden not importable ({e}): expected tf-models-official in this Python's "
              "environment (see the docstring: a separate venv)", file=sys.stderr)
        return 2
    from importlib import metadata

    params = exp_factory.get_exp_config(args.experiment)
    data = params.task.train_data
    data.input_path = args.records
    data.global_batch_size = args.batch
    data.crop_size = list(args.crop)
    data.output_size = list(args.output_size)
    data.aug_scale_min, data.aug_scale_max = args.scale
    data.aug_rand_hflip = True
    data.is_training = True
    data.dtype = "float32"
    task = task_factory.get_task(params.task)
    it = iter(task.build_inputs(data))
    for _ in range(args.warmup):
        next(it)
    rates, busy, cpu = [], [], []
    for _ in range(args.windows):
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(args.steps):
            images, _ = next(it)
        wall, used = time.perf_counter() - t0, time.process_time() - c0
        samples = args.steps * args.batch
        rates.append(samples / wall)
        busy.append(used / wall)
        cpu.append(1000.0 * used / samples)
    shape = list(images.shape)
    del it
    out = {"pipeline": f"Model Garden {args.experiment} task.build_inputs", "records": args.records,
           "images_per_sec": statistics.median(rates), "cores_busy": statistics.median(busy),
           "cpu_ms_per_sample": statistics.median(cpu), "window_images_per_sec": rates,
           "window_cores_busy": busy, "window_cpu_ms_per_sample": cpu, "batch_shape": shape,
           "crop_size": list(args.crop), "output_size": list(args.output_size), "scale": list(args.scale),
           "steps_per_window": args.steps, "windows": args.windows, "warmup_steps": args.warmup,
           "tensorflow": tf.__version__, "tf_models_official": metadata.version("tf-models-official")}
    if args.json:
        print(json.dumps(out))
    else:
        print(f"Model Garden ({args.experiment}) input pipeline: {out['images_per_sec']:.1f} images/s, "
              f"{out['cores_busy']:.2f} cores busy, {out['cpu_ms_per_sample']:.1f} ms CPU per sample "
              f"(batches {shape}, TF {tf.__version__})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

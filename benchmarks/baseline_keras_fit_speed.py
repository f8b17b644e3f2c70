#!/usr/bin/env python
"""seg-train's train step vs a plain Keras `model.fit` on the same model, data, batch and device.

    python benchmarks/baseline_keras_fit_speed.py --config FILE [--set KEY=VALUE ...] [--steps K]
        [--windows W] [--warmup N] [--json]

The baseline is what a Keras user would write: the same DeepLabV3+ (`seg_train.models.build`, the
config's precision policy) built from plain Keras layers (`model.fast_atrous: false` and
`model.fused_batchnorm: false`: keras.layers.Conv2D for the dilated convs and
keras.layers.BatchNormalization, not seg-train's fast equivalents in models/atrous.py and
models/fused_bn.py; make bench's variants table times each of those on its own, so the trainer's
share of the ratio can be read off), the same batches (`ImageReader.train_dataset(global_batch,
num_replicas=1)`: (image, label) pairs), `model.compile(Adam(learning_rate), SparseCategorical
Crossentropy(from_logits=True, ignore_class=ignore_label))` with Keras' defaults otherwise
(jit_compile="auto", which Keras resolves to False on a CPU-only machine; it is reported), and
`model.fit(ds, steps_per_epoch=K + 1, epochs=W + 1)` on one device (no strategy).

seg-train's side is `seg_train.bench.train_runner.TrainRunner` on one tower (the real `Trainer.train_step` fed by
the real reader through MirroredStrategy, as `seg-train --gpus 1` runs it).

The two are timed interleaved in one process, so a change in machine load hits both: Keras' epoch 0
is its warm-up (tracing included); at the end of every Keras epoch a callback runs one seg-train
window; in each window (Keras epoch or seg-train window) the first step is untimed (picking up after
the other) and the next K are timed. Reported: the median window's images/s of each and the ratio
seg-train / Keras (> 1: seg-train is faster). seg-train does more per step than this baseline (weight
decay, non-finite checks, returning predictions for summaries); the ratio includes that.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True)
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--steps", type=int, default=6, help="timed steps per window (default 6)")
    p.add_argument("--windows", type=int, default=3, help="timed windows per side; medians reported (default 3)")
    p.add_argument("--warmup", type=int, default=3, help="seg-train warm-up steps (Keras warms up for one epoch)")
    p.add_argument("--json", action="store_true", help="print exactly one JSON object on stdout")
    p.add_argument("--debug", action="store_true")
    return p.parse_args(argv)


def main(args) -> int:
    from seg_train import cli
    from seg_train import config as config_lib
    cli.setup_logging(args.debug)
    log = cli.log
    cfg = config_lib.load(args.config, args.overrides)
    cli.import_tensorflow(args.debug)
    from seg_train.parallel import replicas
    with cli.quiet_stderr(args.debug):
        devices = replicas.setup_devices(1)
    import keras

    from seg_train import models
    from seg_train.bench.machine import machine_info
    from seg_train.bench.train_runner import TrainRunner
    from seg_train.data.split import open_split
    from seg_train.util import sysinfo

    reader = open_split(cfg, cfg.data.train_split).reader
    batch, k, windows = cfg.data.batch_size, args.steps, args.windows

    # ---- seg-train: the real step on one tower --------------------------------------------------
    seg = TrainRunner("seg-train", cfg, devices, reader, "reader")
    log.info("seg-train: warming up (%d steps, the first one traces)", args.warmup)
    seg.warmup(args.warmup)
    log.info("seg-train: first step %.1fs", seg.first_step_s)

    # ---- plain Keras ----------------------------------------------------------------------------
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy("float32" if cfg.train.precision == "float32" else cfg.train.precision)
    try:
        # What a Keras user has: Keras' Conv2D for the dilated convs and Keras' BN (module doc).
        model = models.build(dataclasses.replace(cfg.model, fast_atrous=False, fused_batchnorm=False),
                             cfg.data.num_classes, cfg.seed)
    finally:
        keras.config.set_dtype_policy(previous)
    model.compile(optimizer=keras.optimizers.Adam(learning_rate=cfg.train.learning_rate),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True,
                                                                  ignore_class=cfg.data.ignore_label),
                  jit_compile=True if cfg.train.jit_compile else "auto")
    ds = reader.train_dataset(batch, 0, 1)

    keras_rates, keras_ms, keras_cpu_ms, keras_losses = [], [], [], []
    first_epoch_s = []

    class Interleave(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.t_begin, self.ends, self.cpu = time.perf_counter(), [], []

        def on_train_batch_end(self, batch_index, logs=None):
            if logs and "loss" in logs:
                keras_losses.append(float(logs["loss"]))  # a host read per step, like seg-train's
            self.ends.append(time.perf_counter())
            self.cpu.append(time.process_time())

        def on_epoch_end(self, epoch, logs=None):
            if epoch == 0:
                first_epoch_s.append(self.ends[-1] - self.t_begin)
                log.info("keras: warm-up epoch (%d steps, tracing included) %.1fs", len(self.ends), first_epoch_s[0])
            else:
                dt = self.ends[-1] - self.ends[0]  # the first step of the epoch is the untimed pick-up step
                keras_rates.append(k * batch / dt)
                keras_ms.append(1000.0 * dt / k)
                keras_cpu_ms.append(1000.0 * (self.cpu[-1] - self.cpu[0]) / k)
                log.info("keras window %d: %.2f images/s", epoch, keras_rates[-1])
            if epoch < windows:
                seg.window(k, reentry=1)
                log.info("seg-train window %d: %.2f images/s", epoch + 1, seg.rates[-1])

    log.info("timing: %d windows of %d steps each side, interleaved", windows, k)
    model.fit(ds, steps_per_epoch=k + 1, epochs=windows + 1, verbose=0, callbacks=[Interleave()])

    s = seg.summary()
    keras_rate = statistics.median(keras_rates)
    result = {
        "config": os.path.abspath(args.config), "overrides": list(args.overrides),
        "backbone": cfg.model.backbone, "crop_size": list(cfg.data.crop_size), "global_batch": batch,
        "precision": cfg.train.precision, "device": devices.names[0],
        "steps_per_window": k, "windows": windows,
        "seg_train_images_per_sec": s["images_per_sec"], "seg_train_step_time_ms": s["step_time_ms"],
        "seg_train_input_wait_fraction": s["input_wait_fraction"],
        "seg_train_window_images_per_sec": s["window_images_per_sec"],
        "seg_train_jit_compile": cfg.train.jit_compile,
        "keras_fit_images_per_sec": keras_rate, "keras_fit_step_time_ms": statistics.median(keras_ms),
        "keras_fit_window_images_per_sec": keras_rates,
        "seg_train_cpu_ms_per_step": s["cpu_ms_per_step"],
        "keras_fit_cpu_ms_per_step": statistics.median(keras_cpu_ms),
        "cpu_speedup_seg_train_vs_keras_fit": statistics.median(keras_cpu_ms) / s["cpu_ms_per_step"],
        "keras_fit_jit_compile": bool(model.jit_compile),
        "keras_first_epoch_s": first_epoch_s[0] if first_epoch_s else None,
        "seg_train_first_step_s": s["first_step_s"],
        "speedup_seg_train_vs_keras_fit": s["images_per_sec"] / keras_rate,
        "speedup_window_range": [min(a / b for a, b in zip(s["window_images_per_sec"], keras_rates)),
                                 max(a / b for a, b in zip(s["window_images_per_sec"], keras_rates))],
        "speedup_definition": "seg-train images/s / keras model.fit images/s (median windows, interleaved)",
        "keras_model": ("seg_train.models.build with model.fast_atrous=false, model.fused_batchnorm=false "
                        "(plain keras.layers.Conv2D and BatchNormalization)"),
        "seg_train_fast_atrous": cfg.model.fast_atrous, "seg_train_fused_batchnorm": cfg.model.fused_batchnorm,
        "keras_last_loss": keras_losses[-1] if keras_losses else None, "seg_train_last_loss": s["last_loss"],
        "machine": machine_info(),
        "peak_rss_mb": sysinfo.peak_rss_mb(),
    }
    if args.json:
        print(json.dumps(result))
    else:
        print(f"seg-train step: {result['seg_train_images_per_sec']:.2f} images/s "
              f"({result['seg_train_step_time_ms']:.0f} ms)")
        print(f"keras model.fit: {keras_rate:.2f} images/s ({result['keras_fit_step_time_ms']:.0f} ms, "
              f"jit_compile {result['keras_fit_jit_compile']})")
        print(f"seg-train / keras: {result['speedup_seg_train_vs_keras_fit']:.3f}x")
    return 0


if __name__ == "__main__":
    args = parse_args()
    from seg_train import cli
    sys.exit(cli.run_guarded(main, args))

#!/usr/bin/env python
"""seg-train's SegFormer step vs keras-hub's own SegFormerImageSegmenter trained with `fit()`: images/s.

    python scripts/bench_keras_hub_fit.py --config configs/camvid_segformer.yaml [--size 224] [--set KEY=VALUE ...]
        [--steps K] [--windows W] [--warmup N] [--recipe-vs configs/camvid.yaml] [--json]

The peer is what a keras-hub user trains: `keras_hub.models.SegFormerImageSegmenter` on keras-hub's
`SegFormerBackbone(MiTBackbone)` of the config's size (mit_b0: depths 2,2,2,2, widths 32,64,160,256;
`model.segformer_channels` as its projection_filters; drop path `model.drop_path_rate`), `data.num_classes`
outputs, compiled with `keras.optimizers.AdamW(train.learning_rate, weight_decay=train.weight_decay)`
(plus Keras' own EMA of the weights, `use_ema=True`, when `train.ema_decay` is set, as seg-train keeps one)
and `SparseCategoricalCrossentropy(from_logits=True, ignore_class=data.ignore_label)` (keras-hub's "auto"
loss has no ignore label), and `model.fit(ds, steps_per_epoch=K + 1, epochs=W + 1)` on one device. Its MiT
computes H = W = sqrt(N), so it takes only a square input of the size it was built for: both sides train
on square crops, `data.crop_size` [S, S] (--size S), from the same reader (the split opened by
`data.split.open_split`, its `train_dataset`: the same random scale, mirror and crop, normalised as the
config says). Differences left: keras-hub's
loss has no class weights (Keras' `class_weight` takes no per-pixel targets), and seg-train's step also
checks for non-finite values and returns what its summaries need; the ratio includes that.

seg-train's side is `seg_train.bench.runner.TrainRunner` on one tower (the real train step, seg-train's
step loop and host work, as `seg-train --gpus 1` runs it) on the config with `data.crop_size` [S, S].
With `--recipe-vs OTHER.yaml` two more seg-train runners join the same session, each config at its own
`data.crop_size`: the config's recipe and OTHER's (e.g. SegFormer-B0 against DeepLabV3+ MobileNetV2 at
CamVid's 176x240).

Everything runs in one process (the same threads, the same allocator: seg-train's TF_ENV_DEFAULTS), timed
interleaved so that a change in machine load hits every side: Keras' epoch 0 is its warm-up (tracing
included); at the end of every Keras epoch a callback runs one window of each seg-train runner (in
alternating order); in each window the first step is untimed (picking up after the others) and the next
K are timed. Reported: each side's median window images/s and the ratios (seg-train / keras-hub > 1:
seg-train is faster).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True, help="a SegFormer config (model.backbone mit_b*, model.head segformer)")
    p.add_argument("--size", type=int, default=224, help="the square crop S of both sides (default 224)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--steps", type=int, default=5, help="timed steps per window (default 5)")
    p.add_argument("--windows", type=int, default=3, help="timed windows per side; medians reported (default 3)")
    p.add_argument("--warmup", type=int, default=3, help="seg-train warm-up steps (Keras warms up for one epoch)")
    p.add_argument("--recipe-vs", metavar="CONFIG",
                   help="also time the config and CONFIG at their own data.crop_size, seg-train both")
    p.add_argument("--json", action="store_true", help="print exactly one JSON object on stdout")
    p.add_argument("--debug", action="store_true")
    return p.parse_args(argv)


def keras_hub_segformer(cfg, size: int):
    """keras-hub's SegFormerImageSegmenter of the config's MiT size, built for [size, size] inputs."""
    import keras_hub

    from seg_train.models.mit import VARIANTS

    spec = VARIANTS[cfg.model.backbone]
    encoder = keras_hub.models.MiTBackbone(
        image_shape=(size, size, 3), num_layers=len(spec.depths), hidden_dims=list(spec.widths),
        layerwise_depths=list(spec.depths), layerwise_num_heads=list(spec.heads),
        layerwise_sr_ratios=list(spec.sr_ratios), layerwise_patch_sizes=list(spec.patch_sizes),
        layerwise_strides=list(spec.patch_strides), max_drop_path_rate=cfg.model.drop_path_rate)
    backbone = keras_hub.models.SegFormerBackbone(image_encoder=encoder,
                                                  projection_filters=cfg.model.segformer_channels)
    return keras_hub.models.SegFormerImageSegmenter(backbone=backbone, num_classes=cfg.data.num_classes)


def main(args) -> int:
    from seg_train import cli
    from seg_train import config as config_lib
    cli.setup_logging(args.debug)
    log = cli.log
    square = [f"data.crop_size=[{args.size},{args.size}]"]
    cfg = config_lib.load(args.config, args.overrides + square)
    if not cfg.model.backbone.startswith("mit_") or cfg.model.head != "segformer":
        raise config_lib.ConfigError("not a SegFormer config", args.config,
                                     "model.backbone mit_b0..mit_b5 and model.head segformer (keras-hub's model)")
    recipes = []
    if args.recipe_vs:
        recipes = [("recipe", config_lib.load(args.config, args.overrides)),
                   ("recipe-vs", config_lib.load(args.recipe_vs, args.overrides))]
    cli.import_tensorflow(args.debug)
    from seg_train.dist import replicas
    with cli.quiet_stderr(args.debug):
        devices = replicas.setup_devices(1)
    import keras

    from seg_train.util import sysinfo
    from seg_train.bench import runner as bench
    from seg_train.data.scan import class_weights_for_split
    from seg_train.data.split import open_split

    batch, k, windows = cfg.data.batch_size, args.steps, args.windows
    runners, readers = [], []  # (name, config, TrainRunner); each runner's reader
    for name, c in [("seg-train", cfg)] + recipes:
        reader = open_split(c, c.data.train_split).reader
        readers.append(reader)
        log.info("%s: building %s + %s at %s", name, c.model.backbone, c.model.head, list(c.data.crop_size))
        runners.append((name, c, bench.TrainRunner(name, c, devices, reader, "reader",
                                                   class_weights=class_weights_for_split(c, reader))))
    for name, _, r in runners:
        log.info("%s: warming up (%d steps, the first one traces)", name, args.warmup)
        r.warmup(args.warmup)
        log.info("%s: first step %.1fs", name, r.first_step_s)

    # ---- keras-hub ------------------------------------------------------------------------------
    if cfg.train.precision != "float32":
        keras.config.set_dtype_policy(cfg.train.precision)
    model = keras_hub_segformer(cfg, args.size)
    ema = {"use_ema": True, "ema_momentum": cfg.train.ema_decay} if cfg.train.ema_decay else {}
    model.compile(optimizer=keras.optimizers.AdamW(learning_rate=cfg.train.learning_rate,
                                                   weight_decay=cfg.train.weight_decay or 0.0, **ema),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True, ignore_class=cfg.data.ignore_label),
                  metrics=[])  # keras-hub's "auto" adds CategoricalAccuracy, which takes one-hot labels
    ds = readers[0].train_dataset(batch, 0, 1)  # the seg-train side's reader: the same samples and crops
    rates, step_ms, cpu_ms, losses, first_epoch_s = [], [], [], [], []

    class Interleave(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.t_begin, self.ends, self.cpu = time.perf_counter(), [], []

        def on_train_batch_end(self, batch_index, logs=None):
            if logs and "loss" in logs:
                losses.append(float(logs["loss"]))  # a host read per step, as seg-train's loop makes
            self.ends.append(time.perf_counter())
            self.cpu.append(time.process_time())

        def on_epoch_end(self, epoch, logs=None):
            if epoch == 0:
                first_epoch_s.append(self.ends[-1] - self.t_begin)
                log.info("keras-hub: warm-up epoch (%d steps, tracing included) %.1fs", len(self.ends),
                         first_epoch_s[0])
            else:
                dt = self.ends[-1] - self.ends[0]  # the epoch's first step is the untimed pick-up step
                rates.append(k * batch / dt)
                step_ms.append(1000.0 * dt / k)
                cpu_ms.append(1000.0 * (self.cpu[-1] - self.cpu[0]) / k)
                log.info("keras-hub window %d: %.2f images/s", epoch, rates[-1])
            if epoch < windows:
                for name, _, r in (runners if epoch % 2 == 0 else runners[::-1]):
                    r.window(k, reentry=1)
                    log.info("%s window %d: %.2f images/s", name, epoch + 1, r.rates[-1])

    log.info("timing: %d windows of %d steps per side, interleaved", windows, k)
    model.fit(ds, steps_per_epoch=k + 1, epochs=windows + 1, verbose=0, callbacks=[Interleave()])

    hub = {"images_per_sec": statistics.median(rates), "step_time_ms": statistics.median(step_ms),
           "cpu_ms_per_step": statistics.median(cpu_ms), "window_images_per_sec": rates,
           "first_epoch_s": first_epoch_s[0] if first_epoch_s else None, "last_loss": losses[-1] if losses else None,
           "parameters": int(model.count_params()), "jit_compile": bool(model.jit_compile)}
    sides = {}
    for name, c, r in runners:
        s = r.summary()
        sides[name] = {"config": c.model.backbone + " + " + c.model.head, "crop_size": list(c.data.crop_size),
                       "images_per_sec": s["images_per_sec"], "step_time_ms": s["step_time_ms"],
                       "cpu_ms_per_step": s["cpu_ms_per_step"], "window_images_per_sec": s["window_images_per_sec"],
                       "first_step_s": s["first_step_s"], "last_loss": s["last_loss"],
                       "parameters": int(r.state.model.count_params())}
    seg = sides["seg-train"]
    result = {
        "config": os.path.abspath(args.config), "overrides": list(args.overrides), "size": args.size,
        "global_batch": batch, "precision": cfg.train.precision, "device": devices.names[0],
        "steps_per_window": k, "windows": windows, "keras_hub": hub, "seg_train": sides,
        "speedup_seg_train_vs_keras_hub": seg["images_per_sec"] / hub["images_per_sec"],
        "speedup_window_range": [min(a / b for a, b in zip(seg["window_images_per_sec"], rates)),
                                 max(a / b for a, b in zip(seg["window_images_per_sec"], rates))],
        "cpu_speedup_seg_train_vs_keras_hub": hub["cpu_ms_per_step"] / seg["cpu_ms_per_step"],
        "speedup_definition": "images/s ratios of median windows, interleaved in one process",
        "machine": bench.machine_info(), "peak_rss_mb": sysinfo.peak_rss_mb(),
    }
    if recipes:
        a, b = sides["recipe"], sides["recipe-vs"]
        result["recipe_vs"] = os.path.abspath(args.recipe_vs)
        result["speedup_recipe_vs_other"] = a["images_per_sec"] / b["images_per_sec"]
    for _, _, r in runners:
        r.close()
    if args.json:
        print(json.dumps(result))
    else:
        for name, s in sides.items():
            print(f"{name:10s} {s['config']} {s['crop_size']}: {s['images_per_sec']:.2f} images/s "
                  f"({s['step_time_ms']:.0f} ms/step)")
        print(f"keras-hub  fit() {[args.size, args.size]}: {hub['images_per_sec']:.2f} images/s "
              f"({hub['step_time_ms']:.0f} ms/step)")
        print(f"seg-train / keras-hub: {result['speedup_seg_train_vs_keras_hub']:.3f}x")
        if recipes:
            print(f"recipe / {os.path.basename(args.recipe_vs)}: {result['speedup_recipe_vs_other']:.3f}x")
    return 0


if __name__ == "__main__":
    args = parse_args()
    from seg_train import cli
    sys.exit(cli.run_guarded(main, args))

"""Which ops of seg-train's traced train step have no deterministic GPU kernel (seg_train/train/determinism.py).

Traces the real step (TrainStep on logical CPU towers, one train_step on a small synthetic batch, then
the concrete function of the step with its whole function library) and prints the ops of
seg_train.train.determinism.TABLE found in it. No GPU is needed: the graph is the same, only kernels differ.

  python scripts/determinism_audit.py --config configs/voc.yaml [--set model.freeze_batchnorm=true]
  python scripts/determinism_audit.py --matrix      # tiny, mobilenetv2, resnet50 x fast_atrous x sync BN

Op determinism is enabled before the trace, as train.py does for train.deterministic: true (the loss
then traces without SparseSoftmaxCrossEntropyWithLogits); --no-determinism traces as a normal run.
"""

from __future__ import annotations

import argparse
import collections
import itertools
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from seg_train import config as config_lib  # noqa: E402

# Small enough to trace each backbone in seconds to a minute on a 2-core CPU; the op types do not
# depend on sizes (output_stride 16 keeps dilated convs in the backbone and the ASPP).
SMALL = {"data": {"root": "data/unused", "num_classes": 3, "batch_size": 2, "crop_size": [64, 64]},
         "model": {"aspp_channels": 16, "decoder_channels": 16, "low_level_channels": 8},
         "train": {"num_steps": 1}}


def matrix_configs(extra: list[str], backbones: list[str]) -> list[tuple[str, config_lib.Config]]:
    out = []
    for backbone, fast, sync in itertools.product(backbones, (True, False), (False, True)):
        raw = {k: dict(v) for k, v in SMALL.items()}
        raw["model"].update(backbone=backbone, fast_atrous=fast, sync_batchnorm=sync)
        for item in extra:
            config_lib._set_dotted(raw, *config_lib.parse_override(item))
        cfg = config_lib.from_dict(raw)
        out.append((f"{backbone} fast_atrous={fast} sync_batchnorm={sync}" + "".join(f" {e}" for e in extra), cfg))
    return out


def audit(cfg, towers: int, devices, show_all: bool) -> dict:
    import numpy as np
    import tensorflow as tf

    from seg_train.train import determinism
    from seg_train.dist import replicas
    from seg_train.train.state import TrainState
    from seg_train.train.step import TrainStep

    strategy = replicas.strategy_for(cfg.train, devices, towers)
    train_step = TrainStep(TrainState(cfg, strategy))
    h, w = cfg.data.crop_size
    k = cfg.train.accumulate_steps
    b = cfg.data.batch_size * k
    rng = np.random.default_rng(0)
    images = rng.normal(size=(b, h, w, 3)).astype(np.float32)
    labels = rng.integers(0, cfg.data.num_classes, size=(b, h, w)).astype(np.uint8)
    per = b // towers
    # Rows in the order reader.train_dataset gives each tower (its K micro-batches contiguous).
    dist = strategy.experimental_distribute_values_from_function(
        lambda ctx: (tf.constant(images[ctx.replica_id_in_sync_group * per:(ctx.replica_id_in_sync_group + 1) * per]),
                     tf.constant(labels[ctx.replica_id_in_sync_group * per:(ctx.replica_id_in_sync_group + 1) * per])))
    # The trace train_step would make (same signature), then one real step on these CPU towers.
    step = train_step.concrete_function(dist)
    t0 = time.perf_counter()
    error = None
    try:
        train_step(dist)
    except tf.errors.UnimplementedError as e:  # e.g. XLA's refusals under op determinism, on any device
        lines = [line.strip() for line in e.message.splitlines() if line.strip()]
        error = next((line for line in lines if "determinis" in line), lines[0] if lines else "")
    seconds = time.perf_counter() - t0
    findings = determinism.find_nondeterministic(step)
    by_op = collections.defaultdict(list)
    for f in findings:
        by_op[f.op].append(f.node)
    result = {"first_step_s": seconds, "step_error": error,
              "flagged": {op: (len(nodes), nodes[0]) for op, nodes in by_op.items()}}
    if show_all:
        result["op_types"] = sorted(determinism.op_types(step))
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", help="YAML config (data need not exist: the batch is synthetic)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--matrix", action="store_true",
                        help="every backbone x model.fast_atrous x model.sync_batchnorm, small crops "
                             "(--set applies to each)")
    parser.add_argument("--backbones", default="tiny,mobilenetv2,resnet50", help="with --matrix (comma-separated)")
    parser.add_argument("--towers", type=int, default=2, help="logical CPU towers (default 2)")
    parser.add_argument("--no-determinism", action="store_true", help="trace without op determinism")
    parser.add_argument("--all-ops", action="store_true", help="also print every op type of the step")
    args = parser.parse_args(argv)
    if bool(args.config) == args.matrix:
        parser.error("give exactly one of --config or --matrix")
    if args.matrix:
        configs = matrix_configs(args.overrides, [b.strip() for b in args.backbones.split(",") if b.strip()])
    else:
        cfg = config_lib.load(args.config, args.overrides)
        cfg = config_lib.replace(cfg, "data.batch_size", args.towers * max(1, cfg.data.batch_size // args.towers))
        configs = [(args.config + "".join(f" {o}" for o in args.overrides), cfg)]

    from seg_train.dist import replicas
    devices = replicas.setup_devices(args.towers)
    import tensorflow as tf
    if not args.no_determinism:
        tf.config.experimental.enable_op_determinism()
    print(f"TensorFlow {tf.__version__}, {args.towers} logical CPU tower(s), op determinism "
          f"{'off' if args.no_determinism else 'on'} at trace time")
    from seg_train.config import ConfigError
    for name, cfg in configs:
        try:
            r = audit(cfg, args.towers, devices, args.all_ops)
        except ConfigError as e:  # e.g. train.jit_compile with synchronized BN
            print(f"{name}: not a valid set-up: {e}", flush=True)
            continue
        flagged = "; ".join(f"{op} x{n} (e.g. {node})" for op, (n, node) in sorted(r["flagged"].items())) or "none"
        ran = (f"the step raised on CPU: {r['step_error']}" if r["step_error"] else
               f"first step {r['first_step_s']:.1f} s")
        print(f"{name}: {ran}; without a deterministic GPU kernel: {flagged}", flush=True)
        if args.all_ops:
            print("  op types: " + ", ".join(r["op_types"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())

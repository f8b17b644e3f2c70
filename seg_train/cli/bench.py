"""seg-bench's arguments, and seg-bench --verify-towers (N towers against 1)."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

from seg_train.cli import preflight, process
from seg_train.config import ConfigError
from seg_train.config.resolve import check_trainable
from seg_train.util import exit_codes


def bench_main(argv=None) -> int:
    """seg-bench: training images/s per tower count, input speed and wait, FLOP utilisation, peak memory."""
    parser = argparse.ArgumentParser(
        prog="seg-bench", description=f"Benchmark the train step ({process.MODEL_FAMILIES}): images/s (global "
        "and per tower) and scaling efficiency for each tower count, the input pipeline alone and the time spent "
        "waiting for it, achieved FLOP/s against a peak measured in the same run, peak resident memory. See "
        "docs/PERFORMANCE.md.")
    process.add_version(parser)
    parser.add_argument("--config", required=True, help="YAML config file")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config key (dotted, YAML-typed; repeatable), "
                        "e.g. --set train.precision=mixed_bfloat16")
    parser.add_argument("--gpus", default="1", metavar="N[,N...]",
                        help="tower counts to measure, e.g. 1,2,4 (logical CPU devices if no GPU); default 1")
    parser.add_argument("--steps", type=int, default=10, metavar="K", help="timed steps per window (default 10)")
    parser.add_argument("--windows", type=int, default=3, help="timed windows; the median is reported (default 3)")
    parser.add_argument("--warmup", type=int, default=3,
                        help="untimed steps first, tracing included (default 3)")
    parser.add_argument("--pickup", type=int, default=1,
                        help="untimed steps at the start of each window when several set-ups alternate (default 1)")
    parser.add_argument("--input", choices=("reader", "cached"), default="reader",
                        help="train from the real ImageReader (default) or from the same batches cached in memory")
    parser.add_argument("--compare", action="append", default=[], metavar="KEY=VALUE[,VALUE...]",
                        help="also time the config with KEY=VALUE (a config key, e.g. train.precision=mixed_bfloat16; "
                        "input=cached; loop=blocking: the host waits for every step), "
                        "interleaved with the base config; "
                        "repeatable; reports speedups vs the base. train.accumulate_steps=K divides data.batch_size "
                        "by K (the same images per update) and also reports each variant's peak memory")
    parser.add_argument("--bn-images", type=int, default=200, metavar="N",
                        help="time precise-BN re-estimation on N training images per tower count "
                        "(0: skip; default 200)")
    parser.add_argument("--eval-images", type=int, default=64, metavar="N",
                        help="time evaluation on the first N val images per tower count (0: skip; default 64)")
    parser.add_argument("--no-probes", action="store_true",
                        help="skip the fresh seg-train processes that time the first step from launch (with and "
                        "without synchronized BN) and the accumulation variants' peak memory")
    parser.add_argument("--no-input-alone", action="store_true", help="skip timing the input pipeline alone")
    parser.add_argument("--input-only", action="store_true",
                        help="time the input pipeline alone and nothing else (e.g. with --set data.cache=true)")
    parser.add_argument("--no-peak", action="store_true", help="skip measuring the device peak FLOP/s")
    parser.add_argument("--profile", action="store_true",
                        help="after timing, profile 2 steps of each runner: op time per op type (where the time goes)")
    parser.add_argument("--json", action="store_true", help="print exactly one JSON object on stdout")
    parser.add_argument("--debug", action="store_true", help="show tracebacks and TensorFlow's own logs")
    parser.add_argument("--verify-towers", action="store_true",
                        help="self-test instead of timing: one step on 1 tower and on --gpus N towers (synchronized "
                        "BN, same weights and batch); prints how far apart the gradients and BN statistics are; "
                        "exit 0 if within tolerance, 1 if not")
    args = parser.parse_args(argv)

    def main(args):
        if args.verify_towers:
            return verify_towers_main(args)
        import json

        from seg_train import config as config_lib
        from seg_train.bench.report import format_input_only, format_report
        from seg_train.bench.runner import parse_towers
        process.setup_logging(args.debug)
        towers = parse_towers(args.gpus)
        for name in ("steps", "windows"):
            if getattr(args, name) < 1:
                raise ConfigError(f"invalid --{name}", f"--{name}",
                                  f"expected a positive integer, got {getattr(args, name)}")
        if args.pickup < 0:
            raise ConfigError("invalid --pickup", "--pickup", f"expected an integer >= 0, got {args.pickup}")
        if args.warmup < 1:
            raise ConfigError("invalid --warmup", "--warmup",
                              f"expected at least 1 (tracing is never timed), got {args.warmup}")
        cfg = config_lib.load(args.config, args.overrides)
        variants = None
        if args.compare:
            from seg_train.bench.runner import BenchVariant
            variants = [BenchVariant("base", cfg, args.input)]
            for spec in args.compare:
                key, sep, values = spec.partition("=")
                key, values = key.strip(), [v.strip() for v in values.split(",") if v.strip()]
                if not sep or not key or not values:
                    raise ConfigError("invalid --compare", "--compare",
                                      "expected KEY=VALUE[,VALUE...] (e.g. train.precision=mixed_bfloat16), "
                                      f"got {spec!r}")
                for v in values:
                    if key == "input":
                        if v not in ("reader", "cached"):
                            raise ConfigError("invalid --compare", "--compare",
                                              f"expected input=reader or cached, got {v!r}")
                        variants.append(BenchVariant(f"input={v}", cfg, v))
                    elif key == "loop":
                        if v not in ("overlapped", "blocking"):
                            raise ConfigError("invalid --compare", "--compare",
                                              f"expected loop=overlapped or blocking, got {v!r}")
                        variants.append(BenchVariant(f"loop={v}", cfg, args.input, v))
                    else:
                        extra = [f"{key}={v}"]
                        if key == "train.accumulate_steps":
                            # The same images per update: K micro-batches of batch / K.
                            k = config_lib.parse_override(f"{key}={v}")[1]
                            if not isinstance(k, int) or k < 1 or cfg.data.batch_size % k:
                                raise ConfigError("invalid --compare", "--compare",
                                                  f"train.accumulate_steps=K with K dividing data.batch_size "
                                                  f"({cfg.data.batch_size}), got {v!r}")
                            extra.append(f"data.batch_size={cfg.data.batch_size // k}")
                        variants.append(BenchVariant(f"{key}={v}", config_lib.load(args.config, args.overrides + extra),
                                                args.input, overrides=tuple(extra)))
        for name in ("bn_images", "eval_images"):
            if getattr(args, name) < 0:
                raise ConfigError(f"invalid --{name.replace('_', '-')}", f"--{name.replace('_', '-')}",
                                  f"expected an integer >= 0, got {getattr(args, name)}")
        preflight.for_evaluation(cfg)
        check_trainable(cfg)
        process.import_tensorflow(args.debug)
        from seg_train.bench import runner as bench
        from seg_train.parallel import replicas
        with process.quiet_stderr(args.debug):
            # The logical devices are configured once, for the largest tower count, before TF starts.
            devices = replicas.setup_devices(max(towers))
        process.log.info("%s", devices.message)
        # With --json, stdout carries exactly one JSON object: anything else printed goes to stderr.
        if args.input_only:
            with contextlib.redirect_stdout(sys.stderr) if args.json else contextlib.nullcontext():
                result = bench.run_input_only(cfg, steps=args.steps, windows=args.windows, warmup=args.warmup)
            result["config"], result["overrides"] = os.path.abspath(args.config), list(args.overrides)
            print(json.dumps(result) if args.json else format_input_only(result))
            return 0
        with contextlib.redirect_stdout(sys.stderr) if args.json else contextlib.nullcontext():
            result = bench.run(cfg, towers, devices, steps=args.steps, windows=args.windows, warmup=args.warmup,
                               input_mode=args.input, measure_input=not args.no_input_alone,
                               measure_peak_flops=not args.no_peak, variants=variants,
                               profile=args.profile, pickup=args.pickup, config_path=os.path.abspath(args.config),
                               overrides=tuple(args.overrides), bn_images=args.bn_images,
                               eval_images=args.eval_images, probes=not args.no_probes)
        result["config"] = os.path.abspath(args.config)
        result["overrides"] = list(args.overrides)
        if args.json:
            print(json.dumps(result))
        else:
            print(format_report(result))
        return 0

    return process.run_guarded(main, args, end_process=argv is None)


def verify_towers_main(args) -> int:
    """seg-bench --verify-towers (seg_train/bench/verify.py): exit 0 if N towers agree with 1, else 1."""
    import json

    from seg_train import config as config_lib
    from seg_train.bench.runner import parse_towers
    process.setup_logging(args.debug)
    towers = parse_towers(args.gpus)
    if len(towers) != 1:
        raise ConfigError("invalid --gpus", "--gpus", f"one tower count N with --verify-towers, got {args.gpus!r}")
    cfg = config_lib.load(args.config, args.overrides)
    from seg_train.bench.verify import check_towers
    check_towers(cfg, towers[0])
    preflight.for_evaluation(cfg)
    check_trainable(cfg)
    process.import_tensorflow(args.debug)
    from seg_train.bench import verify
    from seg_train.parallel import replicas
    with process.quiet_stderr(args.debug):
        devices = replicas.setup_devices(towers[0])
    process.log.info("%s", devices.message)
    with contextlib.redirect_stdout(sys.stderr) if args.json else contextlib.nullcontext():
        result = verify.run(cfg, devices, towers[0])
    result["config"], result["overrides"] = os.path.abspath(args.config), list(args.overrides)
    print(json.dumps(result) if args.json else verify.format_report(result))
    return exit_codes.OK if result["ok"] else exit_codes.VERIFY_FAILED  # a verdict, not a user error

"""seg-bench: training throughput, input-pipeline speed, tower scaling, FLOP utilisation and memory.

What is measured (docs/PERFORMANCE.md quotes these definitions):

- **Training images/s** (per tower count N): the real `TrainStep` on the real `ImageReader.train_dataset`,
  distributed and run as `seg-train` runs it (loss read back every step). After untimed warm-up,
  `windows` windows of `steps` steps are timed and the MEDIAN window reported: images/s = global
  batch * steps / window time; per tower = that / N; step time = window time / steps.
- **Scaling efficiency** at N = images/s at N / images/s at 1 tower, SAME global batch (batch / N
  per tower). 1.0 = no loss from splitting; on logical CPU devices (shared cores) the ideal is 1.0, not N.
- **Input wait fraction**: time blocked in `next(iterator)` / time of the timed steps (median window).
- **CPU time per step**: process CPU time (all threads) over a window / its steps; `cores_busy` = CPU
  time / wall time. Other processes inflate wall time more than CPU time, so CPU ratios cross-check.
- **Input images/s**: the same pipeline iterated alone after warm-up (median window); **CPU ms per
  sample** = CPU time / samples. `--input-only` also times the **decode-only floor**
  (DECODE_FLOOR_DEFINITION) and reports `cpu_per_sample_vs_floor`.
- **FLOPs, achieved FLOP/s, peak and `flops_utilization`**: flops.py. **Op time** (`--profile`): op_profile.py.
- **Peak resident memory**: VmHWM (ru_maxrss as fallback) at the end, every runner alive at once.

All runners (per tower count, and per variant with `--compare`) are built and warmed up first, then
timed in interleaved windows (A B C, C B A, ...), so their ratios hold under uneven machine load.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from seg_train.bench.flops import compute_dtype, count_train_flops, measure_peak, utilisation
from seg_train.bench.input import DECODE_FLOOR_DEFINITION, decode_floor, input_throughput
from seg_train.bench.machine import machine_info
from seg_train.bench.op_profile import profile_ops
from seg_train.bench.probes import cli_probe
from seg_train.bench.train_runner import TrainRunner, interleave, measure_bn_reestimate, measure_eval
from seg_train.config import Config, ConfigError
from seg_train.util.sysinfo import peak_rss_mb

log = logging.getLogger("seg_train")

EFFICIENCY_DEFINITION = ("images/s at N towers / images/s at 1 tower, same global batch "
                         "(each tower gets global_batch / N images); 1.0 = no loss from splitting")
WAIT_DEFINITION = "time blocked in next(iterator) / total time of the timed steps (median window)"


@dataclass(frozen=True)
class BenchVariant:
    """One set-up to time: a config, where its batches come from, and how the host runs its loop.

    overrides: the --set strings that make this config (for the fresh-process probes)."""
    name: str
    cfg: Config
    input: str = "reader"        # "reader" (the real pipeline) or "cached" (the same batches from memory)
    loop: str = "overlapped"     # train.py's loop, or "blocking" (the host waits for every step)
    overrides: tuple = ()


# ---- small helpers ------------------------------------------------------------------------------
def parse_towers(text: str) -> list[int]:
    """'1,2,4' -> [1, 2, 4] (sorted, unique); a user error for anything else."""
    try:
        towers = sorted({int(x) for x in str(text).split(",") if x.strip()})
    except ValueError:
        towers = []
    if not towers or towers[0] < 1:
        raise ConfigError("invalid --gpus", "--gpus", f"expected tower counts like 1,2,4, got {text!r}")
    return towers


# ---- seg-bench --input-only ----------------------------------------------------------------------------
def run_input_only(cfg: Config, steps: int = 10, windows: int = 3, warmup: int = 3) -> dict:
    """`seg-bench --input-only`: the reader's training stream alone (no model, no training)."""
    from seg_train.data.split import open_split

    reader = open_split(cfg, cfg.data.train_split).reader
    batch = cfg.data.batch_size
    log.info("timing the input pipeline alone (data.cache %s)", cfg.data.cache)
    inp = input_throughput(reader, batch, steps, windows, warmup)
    log.info("input pipeline alone: %.1f images/s, %.2f cores busy, %.1f ms CPU per sample", inp["images_per_sec"],
             inp["cores_busy"], inp["cpu_ms_per_sample"])
    log.info("timing the decode-only floor on the same samples")
    floor = decode_floor(reader, batch, steps, windows, warmup)
    log.info("decode only: %.1f images/s, %.2f cores busy, %.1f ms CPU per sample", floor["images_per_sec"],
             floor["cores_busy"], floor["cpu_ms_per_sample"])
    return {"input_images_per_sec": inp["images_per_sec"], "input": inp, "global_batch": batch,
            "input_cpu_ms_per_sample": inp["cpu_ms_per_sample"], "decode_floor": floor,
            "cpu_per_sample_vs_floor": inp["cpu_ms_per_sample"] / floor["cpu_ms_per_sample"],
            "decode_floor_definition": DECODE_FLOOR_DEFINITION,
            "crop_size": list(cfg.data.crop_size), "data_root": str(cfg.data.root), "num_train_images": len(reader),
            "num_parallel_calls": cfg.data.num_parallel_calls, "cache": cfg.data.cache,
            "steps_per_window": steps, "windows": windows, "warmup_steps": warmup,
            "machine": machine_info(), "peak_rss_mb": peak_rss_mb()}


# ---- the benchmark's phases, in the order run() calls them -----------------------------------------
def _setup_figures(cfg: Config, reader, input_mode: str, all_devices, steps: int, windows: int, warmup: int,
                   pickup: int) -> dict:
    """What is measured and how (config, data, timing plan, machine): the report's first keys."""
    return {
        "config": None, "precision": cfg.train.precision, "jit_compile": cfg.train.jit_compile,
        "backbone": cfg.model.backbone, "output_stride": cfg.model.output_stride,
        "crop_size": list(cfg.data.crop_size), "global_batch": cfg.data.batch_size,
        "num_classes": cfg.data.num_classes, "data_root": str(cfg.data.root), "num_train_images": len(reader),
        "input": input_mode, "device_kind": all_devices.kind, "steps_per_window": steps, "windows": windows,
        "warmup_steps": warmup, "pickup_steps": pickup, "accumulate_steps": cfg.train.accumulate_steps,
        "allreduce_pack_mb": cfg.train.allreduce_pack_mb,
        "efficiency_definition": EFFICIENCY_DEFINITION, "input_wait_definition": WAIT_DEFINITION,
        "machine": machine_info(),
    }


def _measure_peaks(variants: list[BenchVariant], device: str) -> dict[str, dict]:
    """The device's peak FLOP/s (matmul and 3x3 conv), once per compute dtype of the variants."""
    peaks: dict[str, dict] = {}
    for v in variants:
        dtype = compute_dtype(v.cfg.train.precision)
        if dtype not in peaks:
            log.info("measuring the device peak (%s matmul and 3x3 conv)", dtype)
            peaks[dtype] = measure_peak(dtype, device)
            log.info("peak %s: matmul %.0f GFLOP/s, 3x3 conv %.0f GFLOP/s", dtype, peaks[dtype]["matmul_gflops"],
                     peaks[dtype]["conv3x3_gflops"])
    return peaks


def flops_key(vcfg: Config) -> tuple:
    """What a train step's FLOP count depends on, hashable: the model section by its repr, since some of its
    keys are lists (model.vit_layers)."""
    return (repr(vcfg.model), vcfg.data.crop_size, vcfg.data.batch_size, vcfg.data.num_classes,
            vcfg.train.accumulate_steps)


def _count_flops(vcfg: Config, counts: dict[tuple, dict]) -> dict:
    """The FLOPs of vcfg's train step, counted the first time its shapes are met (`counts` keeps them)."""
    k = vcfg.train.accumulate_steps
    key = flops_key(vcfg)
    if key not in counts:
        log.info("counting the FLOPs of the train step")
        one = count_train_flops(vcfg, vcfg.data.batch_size)
        # A step of K micro-batches does K times one micro-batch's work (per-image figures unchanged).
        counts[key] = dict(one, train_flops_per_step=one["train_flops_per_step"] * k,
                           forward_flops_per_step=one["forward_flops_per_step"] * k)
        log.info("train step: %.2f GFLOP per image (forward %.2f)", counts[key]["train_gflop_per_image"],
                 counts[key]["forward_gflop_per_image"])
    return counts[key]


def _time_input_alone(reader, batch: int, steps: int, windows: int, warmup: int) -> dict:
    log.info("timing the input pipeline alone")
    inp = input_throughput(reader, batch, steps, windows, warmup)
    log.info("input pipeline alone: %.1f images/s, %.2f cores busy", inp["images_per_sec"], inp["cores_busy"])
    return inp


def _build_runners(variants: list[BenchVariant], towers: list[int], all_devices, reader, class_weights) -> list[tuple]:
    """One TrainRunner per variant and tower count (each times its own build): (variant name, config, runner)."""
    from seg_train.data.split import open_split
    from seg_train.parallel import replicas

    cfg = variants[0].cfg
    runners = []
    try:
        for v in variants:
            vreader = reader if v.cfg.data == cfg.data else open_split(v.cfg, v.cfg.data.train_split).reader
            for n in towers:
                name = f"gpus={n}" if len(variants) == 1 else f"{v.name} gpus={n}"
                devices = replicas.Devices(all_devices.names[:n], all_devices.kind, "")
                log.info("%s: building (%s input, %s loop, %s, jit_compile %s)", name, v.input, v.loop,
                         v.cfg.train.precision, v.cfg.train.jit_compile)
                runners.append((v.name, v.cfg, TrainRunner(name, v.cfg, devices, vreader, v.input, v.loop,
                                                           class_weights)))
    except BaseException:
        for _, _, r in runners:
            r.close()
        raise
    return runners


def _time_interleaved(runners: list[tuple], steps: int, windows: int, warmup: int, pickup: int) -> None:
    log.info("timing: %d warm-up steps each, then %d windows of %d steps per runner, interleaved", warmup, windows,
             steps)
    interleave([r for _, _, r in runners], steps, windows, warmup, pickup)


def _profile_runners(runners: list[tuple]) -> dict:
    """Op time per op type of every runner (2 profiled steps each), by runner name."""
    profiles = {}
    for _, vcfg, r in runners:
        if vcfg.train.jit_compile:
            continue  # XLA runs the step as one fused cluster: no per-op times to show
        log.info("%s: profiling 2 steps", r.name)
        profiles[r.name] = profile_ops(r)
    return profiles


def _cross_tower_profile(top_runner: TrainRunner, cfg: Config, profiles: dict | None) -> dict | None:
    """Where the time of the largest tower count goes: the share of op time that is cross-tower work."""
    if top_runner.num_towers > 1 and not cfg.train.jit_compile:
        log.info("%s: profiling 2 steps for the cross-tower share", top_runner.name)
        return (profiles or {}).get(top_runner.name) or profile_ops(top_runner)
    return None


def _time_bn_and_eval(cfg: Config, reader, base_runners: list[TrainRunner], bn_images: int,
                      eval_images: int) -> dict[int, dict]:
    """Precise BN re-estimation and evaluation timed on each tower count (base variant), by tower count."""
    from seg_train.data.split import open_split

    extra: dict[int, dict] = {}
    val = open_split(cfg, cfg.data.val_split, optional=True) if eval_images else None
    if val is not None:
        val.reader.samples = val.samples[:eval_images]
    for r in base_runners:
        row = {}
        if bn_images:
            log.info("%s: precise BN on %d images", r.name, bn_images)
            row.update(measure_bn_reestimate(r, reader, bn_images))
        if val is not None:
            log.info("%s: evaluating %d val images", r.name, len(val))
            row.update(measure_eval(r, val.reader, val.class_names))
        extra[r.num_towers] = row
    return extra


def _add_efficiency(rows: list[dict]) -> dict:
    """Scaling efficiency of each row (median and window range) against the 1-tower row; returns that row."""
    ref = next((x for x in rows if x["gpus"] == 1), rows[0])
    for x in rows:
        x["efficiency"] = x["images_per_sec"] / ref["images_per_sec"]
        ratios = [a / b for a, b in zip(x["window_images_per_sec"], ref["window_images_per_sec"])]
        x["efficiency_window_range"] = [min(ratios), max(ratios)]
    return ref


def _variant_figures(v: BenchVariant, is_base: bool, runners: list[tuple], extra: dict[int, dict],
                     profiles: dict | None,
                     flops: dict, peak: dict | None) -> dict:
    """One variant's row per tower count and its top figures; extra: the base variant's BN/eval figures."""
    rows = []
    for name, _, r in runners:
        if name == v.name:
            row = dict(r.summary(), **r.warmup_figures())
            if is_base:
                row.update(extra.get(r.num_towers, {}))
            if profiles is not None:
                row["op_profile"] = profiles.get(r.name)
            utilisation(row, flops, peak)
            rows.append(row)
            log.info("%s: %.2f images/s (%.2f per tower), step %.0f ms, input wait %.1f%%, %.1f GFLOP/s", r.name,
                     row["images_per_sec"], row["images_per_sec_per_tower"], row["step_time_ms"],
                     100 * row["input_wait_fraction"], row["achieved_gflops"])
    ref = _add_efficiency(rows)
    top, vcfg = rows[-1], v.cfg
    return {
        "name": v.name, "precision": vcfg.train.precision, "jit_compile": vcfg.train.jit_compile, "input": v.input,
        "loop": v.loop, "accumulate_steps": vcfg.train.accumulate_steps, "global_batch": vcfg.data.batch_size,
        "allreduce_pack_mb": vcfg.train.allreduce_pack_mb,
        "top_level_figures_for_gpus": top["gpus"], "efficiency_reference_gpus": ref["gpus"],
        "train_images_per_sec": top["images_per_sec"],
        "train_images_per_sec_per_tower": top["images_per_sec_per_tower"],
        "step_time_ms": top["step_time_ms"], "input_wait_fraction": top["input_wait_fraction"],
        "efficiency": top["efficiency"], "achieved_gflops": top["achieved_gflops"],
        "peak_gflops": peak["peak_gflops"] if peak else None, "flops_utilization": top["flops_utilization"],
        "towers": rows}


def _fresh_process_probes(variants: list[BenchVariant], per_variant: list[dict], cfg: Config, config_path: str,
                          overrides: tuple) -> None:
    """The first step from launch (with and without synchronized BN) and the peak memory of accumulation
    variants, each in a fresh seg-train process; added to the variants' rows."""
    # One process per accumulation variant: a shared process's peak memory would mix them.
    for v, pv in zip(variants, per_variant):
        is_base, is_accum = v is variants[0], "train.accumulate_steps" in v.name
        if not (is_base or is_accum):
            continue
        for row in pv["towers"]:
            n = row["gpus"]
            log.info("%s gpus=%d: seg-train in a fresh process (first step from launch%s)", v.name, n,
                     ", peak memory" if is_accum else "")
            probe = cli_probe(config_path, list(overrides) + list(v.overrides), n, steps=3)
            row.update({"first_step_s": probe["first_step_s"], "first_step_tracing_s": probe["tracing_s"],
                        "first_step_first_call_s": probe["first_call_s"],
                        # TensorFlow reports graph optimisation only with the first execution: steady step stands in.
                        "first_step_graph_optimization_s": max(probe["first_call_s"] - row["step_time_ms"] / 1e3,
                                                               0.0),
                        "first_step_first_execution_s": row["step_time_ms"] / 1e3,
                        "peak_rss_mb_process": probe["peak_rss_mb"]})
            if is_base and not cfg.model.sync_batchnorm:
                sync = cli_probe(config_path, list(overrides) + ["model.sync_batchnorm=true"], n, steps=1)
                row.update({"first_step_sync_bn_s": sync["first_step_s"],
                            "first_step_sync_bn_tracing_s": sync["tracing_s"],
                            "first_step_sync_bn_first_call_s": sync["first_call_s"]})


def _top_level_figures(first: dict, inp: dict | None, peaks: dict[str, dict], cfg: Config, flops: dict) -> dict:
    """The report's headline: the first variant's figures at the largest tower count, input alone, peak, FLOPs."""
    out = {k: first[k] for k in (
        "top_level_figures_for_gpus", "efficiency_reference_gpus", "train_images_per_sec",
        "train_images_per_sec_per_tower", "step_time_ms", "input_wait_fraction", "efficiency")}
    out.update({
        "input_images_per_sec": inp["images_per_sec"] if inp else None,
        "input_window_images_per_sec": inp["window_images_per_sec"] if inp else None,
        "achieved_gflops": first["achieved_gflops"],
        "peak_gflops": first["peak_gflops"],
        "flops_utilization": first["flops_utilization"],
        "peak": peaks.get(compute_dtype(cfg.train.precision)),
        "peaks": peaks,
        "flops": flops,
        "towers": first["towers"],
    })
    return out


def _variant_speedups(per_variant: list[dict]) -> dict:
    """Each variant's speedup over the first at the largest tower count: wall time (median, window range), CPU time."""
    first = per_variant[0]
    return {
        "variants": per_variant,
        "speedup_vs_first_variant": {
            v["name"]: v["train_images_per_sec"] / first["train_images_per_sec"] for v in per_variant},
        "speedup_definition": ("train images/s of the variant / train images/s of the first variant, at "
                               f"{first['top_level_figures_for_gpus']} tower(s), interleaved windows"),
        "speedup_window_range": {
            v["name"]: [min(a / b for a, b in zip(v["towers"][-1]["window_images_per_sec"],
                                                  first["towers"][-1]["window_images_per_sec"])),
                        max(a / b for a, b in zip(v["towers"][-1]["window_images_per_sec"],
                                                  first["towers"][-1]["window_images_per_sec"]))]
            for v in per_variant},
        "cpu_speedup_vs_first_variant": {
            v["name"]: first["towers"][-1]["cpu_ms_per_step"] / v["towers"][-1]["cpu_ms_per_step"]
            for v in per_variant},
        "cpu_speedup_definition": ("process CPU time per step of the first variant / that of the variant "
                                   "(less sensitive to other processes' load than wall time)"),
    }


def _add_tower_ratios(rows: list[dict]) -> None:
    """Adds N-towers-vs-1 ratios (same global batch) of first step, precise BN and evaluation to the rows."""
    by_gpus = {r["gpus"]: r for r in rows}
    if 1 in by_gpus:
        one = by_gpus[1]
        for r in by_gpus.values():
            for key, ratio in (("first_step_s", "first_step_ratio"),
                               ("first_step_sync_bn_s", "first_step_sync_bn_ratio"),
                               ("bn_reestimate_s", "bn_reestimate_ratio"),
                               ("bn_reestimate_repeat_s", "bn_reestimate_repeat_ratio"),
                               ("eval_images_per_sec", "eval_ratio")):
                if r.get(key) is not None and one.get(key):
                    r[ratio] = r[key] / one[key]


def _closing_figures(top: dict, warmup_runner: str, first_warmup: dict, cross: dict | None) -> dict:
    """The largest tower count's first step, BN and eval figures, the first runner's warm-up, the cross-tower share."""
    out = {k: top.get(k) for k in (
        "first_step_s", "first_step_sync_bn_s", "bn_reestimate_s", "eval_images_per_sec", "first_step_ratio",
        "first_step_sync_bn_ratio", "bn_reestimate_ratio", "eval_ratio")}
    # The first runner's warm-up: the only one not delayed by other runners' building and warming up.
    out.update({"warmup_runner": warmup_runner, **{k: first_warmup[k] for k in (
        "warmup_steps_to_steady", "warmup_reached_steady", "launch_to_steady_s", "build_to_steady_s")}})
    out["cross_tower_share"] = cross["cross_tower_share"] if cross else None
    out["cross_tower_profile"] = cross
    return out


def run(cfg: Config, towers: list[int], all_devices, steps: int = 10, windows: int = 3, warmup: int = 3,
        input_mode: str = "reader", measure_input: bool = True, measure_peak_flops: bool = True,
        variants: list[BenchVariant] | None = None, profile: bool = False, pickup: int = 1,
        config_path: str | None = None, overrides: tuple = (), bn_images: int = 200, eval_images: int = 64,
        probes: bool = True) -> dict:
    """The whole benchmark: peak, FLOP count, input alone, then training at each tower count.

    Args:
      cfg: the resolved config (its data.batch_size is the GLOBAL batch for every tower count).
      all_devices: replicas.Devices for max(towers) towers (set up once, before TensorFlow starts).
      variants: set-ups to compare, each at every tower count, interleaved; the first is the reference.
      pickup: untimed steps at the start of each window when several runners alternate.
      config_path, overrides: the config file and --set strings, for the fresh-process probes.
      bn_images, eval_images: images on which precise BN / evaluation are timed per tower count (0: skip).
      probes: time the first step from launch in fresh seg-train processes (with and without sync BN),
        and the accumulation variants' peak memory.
    Returns:
      The JSON-able result; top-level figures are the first variant's at the largest tower count.
    """
    from seg_train.config import check_batch
    from seg_train.data.scan import class_weights_for_split
    from seg_train.data.split import open_split

    variants = variants or [BenchVariant("default", cfg, input_mode)]
    cfg, input_mode = variants[0].cfg, variants[0].input
    for v in variants:
        for n in towers:
            check_batch(v.cfg, n)
    reader = open_split(cfg, cfg.data.train_split).reader
    class_weights = class_weights_for_split(cfg, reader)
    t0 = time.perf_counter()
    result = _setup_figures(cfg, reader, input_mode, all_devices, steps, windows, warmup, pickup)
    # ---- before any runner exists: the device peak, the FLOP count, the input pipeline alone ---------
    peaks = _measure_peaks(variants, all_devices.names[0]) if measure_peak_flops else {}
    flop_counts: dict[tuple, dict] = {}
    for v in variants:
        _count_flops(v.cfg, flop_counts)
    inp = _time_input_alone(reader, cfg.data.batch_size, steps, windows, warmup) if measure_input else None
    # ---- every runner alive at once --------------------------------------------------------------------
    runners = _build_runners(variants, towers, all_devices, reader, class_weights)
    try:
        _time_interleaved(runners, steps, windows, warmup, pickup)
        profiles = _profile_runners(runners) if profile else None
        base_runners = [r for name, _, r in runners if name == variants[0].name]
        cross = _cross_tower_profile(base_runners[-1], cfg, profiles)
        extra = _time_bn_and_eval(cfg, reader, base_runners, bn_images, eval_images)
        per_variant = [_variant_figures(v, v is variants[0], runners, extra, profiles, _count_flops(v.cfg, flop_counts),
                                        peaks.get(compute_dtype(v.cfg.train.precision))) for v in variants]
        first_warmup = runners[0][2].warmup_figures()
    finally:  # every way out (a runner sits in a reference cycle: it would live until a garbage collection)
        for _, _, r in runners:
            r.close()
    # ---- fresh seg-train processes, after every in-process runner is gone -----------------------------
    if probes and config_path:
        _fresh_process_probes(variants, per_variant, cfg, config_path, overrides)
    first = per_variant[0]
    result.update(_top_level_figures(first, inp, peaks, cfg, _count_flops(cfg, flop_counts)))
    if len(variants) > 1:
        result.update(_variant_speedups(per_variant))
    _add_tower_ratios(first["towers"])
    result.update(_closing_figures(first["towers"][-1], runners[0][2].name, first_warmup, cross))
    result.update({
        "peak_rss_mb": peak_rss_mb(),
        "peak_rss_scope": "whole process: every runner above was alive at once (interleaved timing)",
        "wall_time_s": time.perf_counter() - t0,
    })
    return result

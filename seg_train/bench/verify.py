"""`seg-bench --verify-towers`: does this box's N-tower step compute the 1-tower update?

Builds the real train step on 1 tower and on N of the user's devices (with train.allreduce's
reduction), from the same weights (checked, not assumed), and runs TrainStep.probe on the same first
training batch, distributed as training does. Synchronized BN is forced on, so that N towers compute
the same function as 1 and every cross-tower path (packed gradient all-reduce, BN's all-reduces) runs.

Compared per variable: the gradients, and the batch statistics each BN update carried, recovered as
(new - m * old) / (1 - m). Not the new moving statistics, which momentum dominates (an error shrinks
by 1 - m), and not one L2 over everything, under which an error in one small layer disappears.

Tolerance 0.1 relative, not equality: summation order and ReLU kinks make a correct build differ by a
few percent per variable, while a wrong reduction is 50% off or more (measurements: docs/SCALING.md).
Each difference is over max(the variable's norm, FLOOR of the whole norm), so variables whose exact
gradient is 0 (pure rounding noise) do not fail. float32 whatever train.precision (bfloat16's rounding
alone nears the tolerance); no XLA (a per-tower XLA cluster cannot hold sync BN's forward all-reduces).
"""

from __future__ import annotations

import logging

import numpy as np

from seg_train import config as config_lib
from seg_train.config import Config, ConfigError
from seg_train.data.feed import Feed

log = logging.getLogger("seg_train")

TOLERANCE = 0.1
FLOOR = 1e-3
NAMED = 5  # variables over tolerance named in the report
TOLERANCE_REASON = ("relative L2 per variable, over max(its norm, 1e-3 of the whole norm); float32 summation "
                    "order and ReLU6 kinks give up to 2.8% for MobileNetV2 DeepLabV3+ at 4 towers, a wrong "
                    "reduction 50% or more")


def rel_l2(reference: list, other: list) -> float:
    """||other - reference|| / ||reference|| over all arrays concatenated (0 when both are all zero)."""
    if not reference:
        return 0.0
    a = np.concatenate([np.ravel(np.asarray(x, np.float64)) for x in reference])
    b = np.concatenate([np.ravel(np.asarray(x, np.float64)) for x in other])
    diff = float(np.linalg.norm(b - a))
    norm = float(np.linalg.norm(a))
    if norm == 0.0:
        return 0.0 if diff == 0.0 else float("inf")
    return diff / norm


def batch_statistics(new: list, old: list, momentum: list) -> list:
    """The batch statistics a BN update carried: (new - m * old) / (1 - m) per moving variable, in float64."""
    return [(np.asarray(n, np.float64) - m * np.asarray(o, np.float64)) / (1.0 - m)
            for n, o, m in zip(new, old, momentum)]


def compare(names: list, reference: list, other: list, tolerance: float = TOLERANCE, floor: float = FLOOR) -> dict:
    """Per-variable relative L2 differences, each over max(||reference_i||, floor * ||reference||).

    Returns rel_l2 (over everything concatenated), worst ({variable, rel_l2} or None) and over
    (the variables whose difference exceeds `tolerance`, worst first, as {variable, rel_l2}).
    """
    ref = [np.asarray(x, np.float64) for x in reference]
    total = float(np.sqrt(sum(float(np.sum(np.square(x))) for x in ref)))
    values = []
    for a, b in zip(ref, other):
        diff = float(np.linalg.norm(np.asarray(b, np.float64) - a))
        denom = max(float(np.linalg.norm(a)), floor * total)
        values.append(0.0 if diff == 0.0 else (diff / denom if denom > 0.0 else float("inf")))
    order = sorted(range(len(values)), key=lambda i: -values[i])
    row = lambda i: {"variable": names[i], "rel_l2": values[i]}  # noqa: E731
    return {"rel_l2": rel_l2(reference, other), "per_variable": values,
            "worst": row(order[0]) if order else None,
            "over": [row(i) for i in order if values[i] > tolerance]}


def check_towers(cfg: Config, towers: int) -> None:
    """The user errors of --verify-towers, before any device is touched."""
    if towers < 2:
        raise ConfigError("invalid --gpus", "--gpus",
                          f"at least 2 towers for --verify-towers (it compares N towers with 1), got {towers}")
    config_lib.check_batch(cfg, towers)


def verify_config(cfg: Config) -> Config:
    """The config the check runs: synchronized BN on, float32, no XLA (module doc)."""
    for key, value in (("model.sync_batchnorm", True), ("train.precision", "float32"), ("train.jit_compile", False)):
        cfg = config_lib.replace(cfg, key, value)
    return cfg


def _probe(cfg: Config, devices, n: int, reader) -> dict:
    """One probe step of the real TrainStep on the first n devices; numpy results."""
    from seg_train.data.split import train_dataset_fn
    from seg_train.parallel import replicas
    from seg_train.run.state import TrainState
    from seg_train.train.step import TrainStep

    t = cfg.train
    strategy = replicas.strategy_for(t, devices, n)
    weights = cfg.loss.class_weights
    if isinstance(weights, str):
        # Unit weights exercise the same weighted-loss path without median_frequency's full scan.
        weights = np.ones(cfg.data.num_classes, np.float32)
    state = TrainState(cfg, strategy)
    train_step = TrainStep(state, class_weights=weights)
    dataset_fn = train_dataset_fn(reader, cfg.data.batch_size, start_step=0, end_step=1,
                                  micro_batches=t.accumulate_steps)
    with Feed(state.distribute(dataset_fn)) as batches:
        first = next(batches)
    # The moving statistics before the probe, to recover the batch statistics it used (module doc).
    bn_old = [np.asarray(v) for v in state.bn_variables]
    out = train_step.probe(first)
    return {
        "weights": [np.asarray(v) for v in state.model.weights],
        "names": [v.path for v in state.model.trainable_variables],
        "gradients": [np.asarray(g) for g in out.gradients],
        "bn_names": [v.path for v in state.bn_variables],
        "bn_old": bn_old,
        "bn_momentum": state.bn_momenta,
        "bn_stats": [np.asarray(b) for b in out.bn_stats],
        "loss": float(out.loss),
        "global_norm": float(out.global_norm),
    }


def run(cfg: Config, devices, towers: int) -> dict:
    """Runs the check on devices.names[:towers] (and the first of them alone); the JSON-able report.

    Args:
      cfg: the user's resolved config (synchronized BN, float32 and no XLA are forced here).
      devices: replicas.Devices with at least `towers` devices (the user's GPUs, or logical CPUs).
      towers: N, at least 2.
    """
    from seg_train.data.split import open_split

    check_towers(cfg, towers)
    cfg = verify_config(cfg)
    reader = open_split(cfg, cfg.data.train_split).reader
    one = _probe(cfg, devices, 1, reader)
    many = _probe(cfg, devices, towers, reader)
    return judge(cfg, devices.kind, towers, one, many)


def judge(cfg: Config, device_kind: str, towers: int, one: dict, many: dict) -> dict:
    """The report and verdict from the 1-tower and the N-tower probe results (see _probe)."""
    start_diff = max((float(np.max(np.abs(a - b))) if a.size else 0.0
                      for a, b in zip(one["weights"], many["weights"])), default=0.0)
    same_start = len(one["weights"]) == len(many["weights"]) and start_diff == 0.0
    grad = compare(one["names"], one["gradients"], many["gradients"])
    bn = compare(one["bn_names"], batch_statistics(one["bn_stats"], one["bn_old"], one["bn_momentum"]),
                 batch_statistics(many["bn_stats"], many["bn_old"], many["bn_momentum"]))
    ok = bool(same_start and not grad["over"] and not bn["over"]
              and grad["rel_l2"] <= TOLERANCE and bn["rel_l2"] <= TOLERANCE)
    return {
        "gpus": towers, "device_kind": device_kind, "allreduce": cfg.train.allreduce,
        "backbone": cfg.model.backbone, "global_batch": cfg.data.batch_size, "crop_size": list(cfg.data.crop_size),
        "accumulate_steps": cfg.train.accumulate_steps, "sync_batchnorm": True, "precision": "float32",
        "bn_momentum": cfg.model.bn_momentum,
        "same_start": same_start, "start_max_abs_diff": start_diff,
        "gradient_rel_l2": grad["rel_l2"], "bn_stats_rel_l2": bn["rel_l2"],
        "num_gradient_values": int(sum(g.size for g in one["gradients"])),
        "num_bn_stat_values": int(sum(b.size for b in one["bn_stats"])),
        "num_gradient_variables": len(one["gradients"]), "num_bn_stat_variables": len(one["bn_stats"]),
        "worst_gradient": grad["worst"], "worst_bn_stat": bn["worst"],
        "num_gradients_over_tolerance": len(grad["over"]), "num_bn_stats_over_tolerance": len(bn["over"]),
        # The worst few, worst first: enough to tell one broken layer from a broken reduction.
        "gradients_over_tolerance": grad["over"][:NAMED], "bn_stats_over_tolerance": bn["over"][:NAMED],
        "loss_1_tower": one["loss"], "loss_n_towers": many["loss"],
        "global_norm_1_tower": one["global_norm"], "global_norm_n_towers": many["global_norm"],
        "tolerance": TOLERANCE, "floor": FLOOR, "tolerance_reason": TOLERANCE_REASON, "ok": ok,
    }


def format_report(r: dict) -> str:
    """The human-readable report (a few lines, the verdict last)."""
    n = r["gpus"]

    def per_variable(kind, worst, over, count):
        if worst is None:
            return ""
        return (f"; per variable: worst {worst['rel_l2']:.2e} in {worst['variable']}, "
                f"{r[over]} of {r[count]} {kind} over tolerance")

    lines = [
        f"tower self-test: 1 vs {n} {r['device_kind']} towers (train.allreduce {r['allreduce']}), {r['backbone']}, "
        f"global batch {r['global_batch']}, crop {r['crop_size'][0]}x{r['crop_size'][1]}, synchronized BN, float32",
        f"  loss            1 tower {r['loss_1_tower']:.6f}   {n} towers {r['loss_n_towers']:.6f}",
        f"  gradients       relative L2 difference {r['gradient_rel_l2']:.2e} over {r['num_gradient_values']} values"
        + per_variable("variables", r["worst_gradient"], "num_gradients_over_tolerance", "num_gradient_variables"),
        f"  BN statistics   relative L2 difference {r['bn_stats_rel_l2']:.2e} over {r['num_bn_stat_values']} batch "
        f"statistics (recovered from the moving ones, bn_momentum {r['bn_momentum']:g})"
        + per_variable("statistics", r["worst_bn_stat"], "num_bn_stats_over_tolerance", "num_bn_stat_variables"),
    ]
    for label, key, total in (("gradient of", "gradients_over_tolerance", "num_gradients_over_tolerance"),
                              ("batch statistics of", "bn_stats_over_tolerance", "num_bn_stats_over_tolerance")):
        if r[key]:
            more = r[total] - len(r[key])
            names = ", ".join(f"{v['variable']} ({v['rel_l2']:.2e})" for v in r[key])
            lines.append(f"  over tolerance  {label} {names}" + (f" and {more} more" if more else ""))
    lines.append(f"  tolerance       {r['tolerance']:g} ({r['tolerance_reason']})")
    if not r["same_start"]:
        lines.append(f"  the two builds did not start from the same weights (max difference "
                     f"{r['start_max_abs_diff']:.3g}): the comparison means nothing")
    if r["ok"]:
        lines.append(f"verdict: OK - {n} towers compute the same update as 1 tower")
    else:
        hint = (" (to tell the all-reduce from the rest, run again with --set train.allreduce=hierarchical_copy "
                "or reduction_to_one_device)" if r["device_kind"] == "GPU" else "")
        lines.append(f"verdict: FAIL - {n} towers do not compute the 1-tower update on these devices: do not trust "
                     f"multi-tower training here{hint}")
    return "\n".join(lines)

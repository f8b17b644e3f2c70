"""`seg-bench --verify-towers`: does this box's N-tower step compute the 1-tower update?

The self-test a user runs on a new GPU box, before trusting it with a long run. It builds the real
train step twice from the same config, on 1 tower and on N towers of the user's own devices and
all-reduce (train.allreduce through replicas.strategy_for; on logical CPU towers that is
ReductionToOneDevice), and feeds both the same global batch: the first training batch of the
config's data through the real ImageReader, distributed the way training distributes it. Each
step runs as TrainStep.probe (the update's gradient and the BN moving statistics it would set,
nothing applied). Synchronized BN is forced on, because then N towers compute the same function as
1 tower, and every cross-tower path is exercised: the packed gradient all-reduce, the BN statistics
riding in it, and the per-layer forward and backward all-reduces of synchronized BN. Both builds
start from the same weights (models.build is seeded by cfg.seed); that is checked, not assumed.

What is compared, variable by variable: the gradient of every trainable variable, and for every
BN moving statistic the batch statistics the update carried, batch = (new - m * old) / (1 - m)
(old: the model's moving statistic, which the probe leaves alone; m: that layer's momentum). Not
the new moving statistics themselves: momentum dominates them, so at m = 0.99 a batch mean 100%
wrong moves them by about 1% (less where the moving statistic is far from the batch's). And not
one relative L2 over everything concatenated, under which an error confined to one small layer
disappears (a variable with 1% of the model's gradient norm scaled by 1.5 moves it by 0.5%).

Why a relative tolerance of 0.1, not bitwise equality: a deep net is not bitwise equal across
tower counts. The towers sum in a different order than one device does, so the results differ by a
few float32 roundings; and a ReLU6 / ReLU kink turns a tiny difference in its input into a gradient
element that is either 0 or not, which the backward pass carries into every earlier layer. So a
correct MobileNetV2 build is a few percent apart per variable, concentrated in a few elements (kinks,
not a drift), and variables whose exact gradient is 0 (the beta of a BN feeding a 1x1 convolution and
another BN, which cancels any shift) are pure rounding noise of their own size. Hence each
variable's difference is taken relative to max(its own norm, FLOOR = 1e-3 of the whole norm): no
variable carrying a thousandth of the update is excused, and noise variables are not failed. A
wrong reduction is nowhere near: a double reduction is off by a factor N, per-tower BN statistics
by 50% or more, one variable counted twice by 100%. 0.1 sits about 4x above the measured rounding
and 4x below the smallest of those errors; the measurements (per backbone, batch size and BN
momentum, and with synchronized BN's all-reduces switched off through the test hook in
models/sync_bn.py) are in docs/SCALING.md, section 8.

The check runs in float32 whatever train.precision says (the tolerance is float32's; bfloat16
keeps 8 significant bits, so its rounding alone would be of the order of the tolerance) and without
XLA (synchronized BN all-reduces inside the forward pass, which a per-tower XLA cluster cannot hold).
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
    """The batch statistics a BN update carried: (new - m * old) / (1 - m) per moving variable, in float64.

    new = m * old + (1 - m) * batch, so the moving statistics alone change by only (1 - m) of an
    error in the batch statistics (module doc).
    """
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
    from seg_train.dist import replicas
    from seg_train.data.split import train_dataset_fn
    from seg_train.train.state import TrainState
    from seg_train.train.step import TrainStep

    t = cfg.train
    strategy = replicas.strategy_for(t, devices, n)
    weights = cfg.loss.class_weights
    if isinstance(weights, str):
        # 'median_frequency' needs a scan of the whole train split; any weights exercise the same
        # weighted-loss path across towers, so unit weights stand in for them here.
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

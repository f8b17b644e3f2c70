"""`seg-bench --verify-towers`: does this box's N-tower step compute the 1-tower update?

The self-test a user runs on a new GPU box, before trusting it with a long run. It builds the real
train step twice from the same config, on 1 tower and on N towers of the user's own devices and
all-reduce (train.allreduce through replicas.make_strategy; on logical CPU towers that is
ReductionToOneDevice), and feeds both the same global batch: the first training batch of the
config's data through the real ImageReader, distributed the way training distributes it. Each
step runs as Trainer.probe (the update's gradient and the BN moving statistics it would set,
nothing applied). Synchronized BN is forced on, because then N towers compute the same function as
1 tower, and every cross-tower path is exercised: the packed gradient all-reduce, the BN statistics
riding in it, and the per-layer forward and backward all-reduces of synchronized BN. Both builds
start from the same weights (models.build is seeded by cfg.seed); that is checked, not assumed.

Why a relative L2 tolerance of 1e-2, not bitwise equality: a deep net is not bitwise equal across
tower counts. The towers sum in a different order than one device does, so the results differ by a
few float32 roundings; and a ReLU6 / ReLU kink turns a 1e-7 difference in its input into a gradient
that is either 0 or not, so a handful of gradient elements differ by O(1) of their own size, and
the backward pass carries that into every earlier layer. A MobileNetV2 DeepLabV3+ with every BN
synchronised gave gradients 0.4% apart (relative L2 over all gradients concatenated) between 1 and
4 towers; on the demo data at 64x64 crops, global batch 8, 4 logical CPU towers, 0.65%, of which
the largest 1000 of 5.8 million elements carried 73% of the squared difference (kinks, not a
drift). A wrong reduction is nowhere near that: a double reduction is off by a factor N (100%+),
per-tower BN statistics or a per-tower loss normaliser by 50% or more (synchronized BN with its
all-reduces switched off, the test hook in models/sync_bn.py, puts the tiny test model's gradients
280% apart). The tiny model itself agrees to ~3e-6. So 1e-2 separates rounding from a bug; the
margin over rounding is about 1.5x for MobileNetV2, so a marginal FAIL (gradients 1-3% apart, BN
statistics close) on a real backbone deserves a second look before it is called a bug.

The check runs in float32 whatever train.precision says (the figures above are float32; bfloat16
keeps 8 significant bits, so its rounding alone would be of the order of the tolerance) and without
XLA (synchronized BN all-reduces inside the forward pass, which a per-tower XLA cluster cannot hold).
"""

from __future__ import annotations

import logging

import numpy as np

from seg_train import config as config_lib
from seg_train.config import Config, ConfigError

log = logging.getLogger("seg_train")

TOLERANCE = 1e-2
TOLERANCE_REASON = ("relative L2 over all values; float32 summation order and ReLU kinks give 0.4-0.65% for "
                    "MobileNetV2 DeepLabV3+ at 4 towers, a wrong reduction 50% or more")


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
    """One probe step of the real Trainer on the first n devices; numpy results."""
    from seg_train import replicas
    from seg_train.trainer import Trainer

    t = cfg.train
    sub = replicas.Devices(devices.names[:n], devices.kind, "")
    strategy = replicas.make_strategy(sub, t.allreduce, t.allreduce_num_packs, t.allreduce_pack_mb)
    weights = cfg.loss.class_weights
    if isinstance(weights, str):
        # 'median_frequency' needs a scan of the whole train split; any weights exercise the same
        # weighted-loss path across towers, so unit weights stand in for them here.
        weights = np.ones(cfg.data.num_classes, np.float32)
    trainer = Trainer(cfg, strategy, class_weights=weights)
    batch, k = cfg.data.batch_size, t.accumulate_steps

    def dataset_fn(ctx):
        return reader.train_dataset(batch, 0, ctx.num_replicas_in_sync, ctx.input_pipeline_id,
                                    ctx.num_input_pipelines, end_step=1, micro_batches=k)

    first = next(iter(trainer.distribute(dataset_fn)))
    out = trainer.probe(first)
    return {
        "weights": [np.asarray(v) for v in trainer.model.weights],
        "names": [v.path for v in trainer.model.trainable_variables],
        "gradients": [np.asarray(g) for g in out["gradients"]],
        "bn_stats": [np.asarray(b) for b in out["bn_stats"]],
        "loss": float(out["loss"]),
        "global_norm": float(out["global_norm"]),
    }


def run(cfg: Config, devices, towers: int) -> dict:
    """Runs the check on devices.names[:towers] (and the first of them alone); the JSON-able report.

    Args:
      cfg: the user's resolved config (synchronized BN, float32 and no XLA are forced here).
      devices: replicas.Devices with at least `towers` devices (the user's GPUs, or logical CPUs).
      towers: N, at least 2.
    """
    from seg_train.train import prepare_data

    check_towers(cfg, towers)
    cfg = verify_config(cfg)
    reader = prepare_data(cfg)
    one = _probe(cfg, devices, 1, reader)
    many = _probe(cfg, devices, towers, reader)
    start_diff = max((float(np.max(np.abs(a - b))) if a.size else 0.0
                      for a, b in zip(one["weights"], many["weights"])), default=0.0)
    same_start = len(one["weights"]) == len(many["weights"]) and start_diff == 0.0
    grad = rel_l2(one["gradients"], many["gradients"])
    bn = rel_l2(one["bn_stats"], many["bn_stats"])
    per_var = [rel_l2([a], [b]) for a, b in zip(one["gradients"], many["gradients"])]
    worst = int(np.argmax(per_var)) if per_var else None
    ok = bool(same_start and grad <= TOLERANCE and bn <= TOLERANCE)
    return {
        "gpus": towers, "device_kind": devices.kind, "allreduce": cfg.train.allreduce,
        "backbone": cfg.model.backbone, "global_batch": cfg.data.batch_size, "crop_size": list(cfg.data.crop_size),
        "accumulate_steps": cfg.train.accumulate_steps, "sync_batchnorm": True, "precision": "float32",
        "same_start": same_start, "start_max_abs_diff": start_diff,
        "gradient_rel_l2": grad, "bn_stats_rel_l2": bn,
        "num_gradient_values": int(sum(g.size for g in one["gradients"])),
        "num_bn_stat_values": int(sum(b.size for b in one["bn_stats"])),
        "worst_gradient": None if worst is None else {"variable": one["names"][worst], "rel_l2": per_var[worst]},
        "loss_1_tower": one["loss"], "loss_n_towers": many["loss"],
        "global_norm_1_tower": one["global_norm"], "global_norm_n_towers": many["global_norm"],
        "tolerance": TOLERANCE, "tolerance_reason": TOLERANCE_REASON, "ok": ok,
    }


def format_report(r: dict) -> str:
    """The human-readable report (a few lines, the verdict last)."""
    n = r["gpus"]
    lines = [
        f"tower self-test: 1 vs {n} {r['device_kind']} towers (train.allreduce {r['allreduce']}), {r['backbone']}, "
        f"global batch {r['global_batch']}, crop {r['crop_size'][0]}x{r['crop_size'][1]}, synchronized BN, float32",
        f"  loss            1 tower {r['loss_1_tower']:.6f}   {n} towers {r['loss_n_towers']:.6f}",
        f"  gradients       relative L2 difference {r['gradient_rel_l2']:.2e}  ({r['num_gradient_values']} values"
        + (f"; largest in {r['worst_gradient']['variable']}: {r['worst_gradient']['rel_l2']:.2e}"
           if r["worst_gradient"] else "") + ")",
        f"  BN statistics   relative L2 difference {r['bn_stats_rel_l2']:.2e}  ({r['num_bn_stat_values']} values)",
        f"  tolerance       {r['tolerance']:.0e} ({r['tolerance_reason']})",
    ]
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

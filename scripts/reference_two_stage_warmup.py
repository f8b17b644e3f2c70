"""Prints the learning rates of the EoMT reference's two-stage warmup, the numbers written into
tests/test_two_stage_warmup.py (SMALL and CITYSCAPES) for seg-train's train.backbone_warmup_steps.

Not part of seg-train and never imported by it. The schedule lives in the EoMT authors' repository
(training/two_stage_warmup_poly_schedule.py, a PyTorch LRScheduler), which is not a package: give its checkout.

    python3 -m venv /tmp/eomt-ref && /tmp/eomt-ref/bin/pip install torch
    git clone https://github.com/tue-mps/eomt /tmp/eomt
    /tmp/eomt-ref/bin/python scripts/reference_two_stage_warmup.py /tmp/eomt

One backbone and one head parameter group, ordered as the reference's configure_optimizers orders them (backbone
groups first); each row is the update index and the (head, backbone) rates the optimizer step of that index used
(the scheduler steps after every optimizer step, as Lightning's "step" interval does).
"""

from __future__ import annotations

import sys

import torch


def rates(schedule_cls, base: float, total: int, power: float, warmup: tuple[int, int], steps) -> list[tuple]:
    backbone, head = torch.nn.Parameter(torch.zeros(1)), torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.AdamW([{"params": [backbone], "lr": base}, {"params": [head], "lr": base}])
    sched = schedule_cls(opt, num_backbone_params=1, warmup_steps=warmup, total_steps=total, poly_power=power)
    wanted, rows = set(steps), []
    for k in range(max(wanted) + 1):
        if k in wanted:
            rows.append((k, float(opt.param_groups[1]["lr"]), float(opt.param_groups[0]["lr"])))
        opt.step()
        sched.step()
    return rows


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    sys.path.insert(0, argv[0])
    from training.two_stage_warmup_poly_schedule import TwoStageWarmupPolySchedule

    print("SMALL =", rates(TwoStageWarmupPolySchedule, 0.02, 7, 2.0, (2, 2), range(7)))
    print("CITYSCAPES =", rates(TwoStageWarmupPolySchedule, 1e-4, 19902, 0.9, (500, 1000),
                                [0, 1, 250, 499, 500, 501, 1000, 1499, 1500, 1501, 10000, 19901]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

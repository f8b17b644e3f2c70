#!/usr/bin/env python3
"""Scaling cost model for seg-train: gradient bytes per step and all-reduce time at 8, 64, 512 GPUs.

For each shipped backbone it builds the DeepLabV3+ model exactly as training does
(`seg_train.models.build(ModelConfig(backbone=...), num_classes=21)`, every other key at its
default), counts the trainable parameters (= gradient elements all-reduced every step) and the BN
moving statistics (averaged across towers every step unless `model.sync_batchnorm: true`), and
models the communication time per step:

  ring all-reduce of S bytes over N ranks:  2 (N-1)/N * S / B  +  2 (N-1) * latency
  N <= GPUs per node: one ring over NVLink.
  N >  GPUs per node: hierarchical: reduce-scatter inside the node (NVLink), ring all-reduce of the
                      node's data across the M = N / gpus_per_node nodes over the node's NIC(s),
                      all-gather inside the node.

Gradients are float32 under every `train.precision`: the mixed policies keep float32 variables, and
the gradient of a float32 variable is float32. Mixed precision shortens compute, not communication,
so it raises communication's share.

The compute step times are ASSUMPTIONS (V100-class GPU, 513x513 crops, batch 4 per GPU, float32),
not measured here; pass --step-time BACKBONE=SECONDS to use your own. With --published it also runs
the same model on the published configurations it is checked against (tf_cnn_benchmarks on a
DGX-1, Horovod's 512-GPU benchmark) and prints the efficiency they imply. See docs/SCALING.md.

Usage:
    TF_CPP_MIN_LOG_LEVEL=2 .venv/bin/python benchmarks/scaling_model.py [--published]
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

BACKBONES = ("tiny", "mobilenetv2", "resnet50", "resnet101")

# Assumed compute time of one step per GPU (forward + backward + update), V100, 513x513, batch 4/GPU,
# float32. mobilenetv2 and resnet50 are the round figures of DeepLabV3+ runs reported elsewhere;
# resnet101 is scaled from resnet50 (its 17 extra conv4 blocks run at stride 16); tiny is a guess
# (the 256-channel decoder at stride 4 dominates it). None of them was measured on this machine.
STEP_TIME = {"tiny": 0.05, "mobilenetv2": 0.15, "resnet50": 0.35, "resnet101": 0.50}


@dataclass(frozen=True)
class Link:
    name: str
    bytes_per_s: float
    latency_s: float


def gbit(gbits: float, efficiency: float) -> float:
    return gbits * 1e9 / 8 * efficiency


def ring(num: int, size: float, link: Link) -> float:
    """Seconds for a ring all-reduce of `size` bytes over `num` ranks on `link`."""
    if num <= 1:
        return 0.0
    return 2 * (num - 1) / num * size / link.bytes_per_s + 2 * (num - 1) * link.latency_s


def allreduce(num_gpus: int, size: float, per_node: int, nvlink: Link, net: Link, nics: int = 1) -> float:
    """Hierarchical all-reduce time: NVLink inside a node, the network across nodes."""
    if num_gpus <= per_node:
        return ring(num_gpus, size, nvlink)
    nodes = math.ceil(num_gpus / per_node)
    intra = ring(per_node, size, nvlink)  # = reduce-scatter + all-gather inside the node
    # Across nodes each GPU all-reduces its 1/per_node shard; the node's shards share its NICs, so the
    # node moves 2 (M-1)/M * size over `nics` links.
    inter = 2 * (nodes - 1) / nodes * size / (net.bytes_per_s * nics) + 2 * (nodes - 1) * net.latency_s
    return intra + inter


def flat_ring(num_gpus: int, size: float, net: Link) -> float:
    """A single ring over every GPU, bottlenecked by the NIC each node's segment of the ring crosses."""
    return ring(num_gpus, size, net)


def latency_only(num_gpus: int, per_node: int, nvlink: Link, net: Link) -> float:
    """Seconds of one small (latency-bound) hierarchical all-reduce."""
    return allreduce(num_gpus, 0.0, per_node, nvlink, net)


def exposed(comm: float, compute: float, backward_fraction: float, overlap: bool, tail: float = 0.0) -> float:
    """Communication time the step waits for: all of it, or what the backward pass cannot hide.

    Overlapped (gradients all-reduced in packs as the backward pass produces them, Horovod / DDP
    style): the backward pass hides up to `backward_fraction * compute`, but the last pack (`tail`)
    can only start once the backward pass has ended, so it is always exposed.
    """
    return max(tail, comm - backward_fraction * compute) if overlap else comm


@dataclass(frozen=True)
class Counts:
    name: str
    params: int
    tensors: int
    bn_layers: int
    bn_stat_values: int


def count_seg_model(backbone: str) -> Counts:
    import keras

    from seg_train.config import ModelConfig
    from seg_train.models import batchnorm_layers, build
    model = build(ModelConfig(backbone=backbone), num_classes=21)
    params = sum(int(math.prod(v.shape)) for v in model.trainable_variables)
    bns = batchnorm_layers(model)
    stats = sum(int(math.prod(b.moving_mean.shape)) * 2 for b in bns)
    counts = Counts(backbone, params, len(model.trainable_variables), len(bns), stats)
    del model
    keras.backend.clear_session()
    return counts


def count_app(name: str) -> int:
    import keras
    ctor = {"ResNet-50": keras.applications.ResNet50, "ResNet-101": keras.applications.ResNet101,
            "Inception V3": keras.applications.InceptionV3, "VGG-16": keras.applications.VGG16}[name]
    model = ctor(weights=None, include_top=True)
    n = sum(int(math.prod(v.shape)) for v in model.trainable_variables)
    del model
    keras.backend.clear_session()
    return n


def pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backbones", default=",".join(BACKBONES))
    p.add_argument("--gpus", default="8,64,512", help="GPU counts to model")
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--nvlink-gbytes", type=float, default=150.0, help="effective NVLink GB/s per GPU in a ring")
    p.add_argument("--networks", default="100,25", help="inter-node link speeds, Gb/s")
    p.add_argument("--net-efficiency", type=float, default=0.85)
    p.add_argument("--nics-per-node", type=int, default=1)
    p.add_argument("--latency-us", type=float, default=15.0, help="per-hop latency across nodes")
    p.add_argument("--nvlink-latency-us", type=float, default=5.0, help="per-hop latency inside a node")
    p.add_argument("--backward-fraction", type=float, default=2 / 3,
                   help="share of the compute step that is the backward pass (what overlap can hide)")
    p.add_argument("--pack-mb", type=float, default=25.0,
                   help="overlapped case: size of the last gradient pack, whose all-reduce cannot be hidden")
    p.add_argument("--step-time", action="append", default=[], metavar="BACKBONE=SECONDS",
                   help="compute step time per GPU (overrides the assumption)")
    p.add_argument("--published", action="store_true", help="also model the published benchmarks")
    args = p.parse_args(argv)

    step_time = dict(STEP_TIME)
    for item in args.step_time:
        k, v = item.split("=")
        step_time[k] = float(v)
    gpus = [int(x) for x in args.gpus.split(",")]
    nvlink = Link("NVLink", args.nvlink_gbytes * 1e9, args.nvlink_latency_us * 1e-6)
    nets = [Link(f"{float(g):g} Gb/s", gbit(float(g), args.net_efficiency), args.latency_us * 1e-6)
            for g in args.networks.split(",")]
    per_node = args.gpus_per_node

    counts = [count_seg_model(b) for b in args.backbones.split(",")]

    print("### What one step all-reduces (DeepLabV3+, 21 classes, default model keys)\n")
    print("| backbone | trainable params | gradient MB / step (float32) | gradient tensors | BN layers | "
          "BN moving stats MB / step |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for c in counts:
        print(f"| {c.name} | {c.params:,} | {4 * c.params / 1e6:.1f} | {c.tensors} | {c.bn_layers} | "
              f"{4 * c.bn_stat_values / 1e6:.2f} |")

    print(f"\n### Communication per step and its share of the step (hierarchical ring; {per_node} GPUs/node, "
          f"NVLink {args.nvlink_gbytes:g} GB/s, {args.nics_per_node} NIC/node at {pct(args.net_efficiency)} of line "
          f"rate, latency {args.nvlink_latency_us:g} us/{args.latency_us:g} us per hop inside/across nodes)\n")
    print("| backbone | compute s/step (assumed) | GPUs | inter-node link | all-reduce ms | flat ring ms | "
          "comm share, no overlap | comm share, overlapped | scaling efficiency, no overlap / overlapped |")
    print("| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: |")
    for c in counts:
        t = step_time[c.name]
        # Gradients in one pack, BN moving statistics in one more, plus two scalar all-reduces (the
        # global valid-pixel count and the stop flag): what TrainStep._train_step issues per step.
        size = 4 * c.params
        for n in gpus:
            for net in (nets if n > per_node else nets[:1]):
                comm = (allreduce(n, size, per_node, nvlink, net, args.nics_per_node)
                        + allreduce(n, 4 * c.bn_stat_values, per_node, nvlink, net, args.nics_per_node)
                        + 2 * latency_only(n, per_node, nvlink, net))
                flat = flat_ring(n, size, net) if n > per_node else float("nan")
                e0 = exposed(comm, t, args.backward_fraction, False)
                tail = allreduce(n, min(size, args.pack_mb * 1e6), per_node, nvlink, net, args.nics_per_node)
                e1 = exposed(comm, t, args.backward_fraction, True, tail)
                link = net.name if n > per_node else "(NVLink only)"
                flat_s = f"{1e3 * flat:.1f}" if n > per_node else "-"
                print(f"| {c.name} | {t:.2f} | {n} | {link} | {1e3 * comm:.1f} | {flat_s} | "
                      f"{pct(e0 / (t + e0))} | {pct(e1 / (t + e1))} | {pct(t / (t + e0))} / {pct(t / (t + e1))} |")

    print("\n### model.sync_batchnorm: true adds latency-bound all-reduces inside the forward/backward pass\n")
    print("Keras' synchronized BN issues 3 all-reduces per BN layer forward (sum, sum of squares, count) and 2 "
          "backward; each is tiny, so each costs about the latency term, on the critical path.\n")
    print("| backbone | BN layers | collectives / step | " +
          " | ".join(f"{n} GPUs, ring (ms)" for n in gpus) + f" | {gpus[-1]} GPUs, tree (ms) |")
    print("| --- | ---: | ---: | " + " | ".join("---:" for _ in gpus) + " | ---: |")
    for c in counts:
        k = 5 * c.bn_layers
        cells = " | ".join(f"{1e3 * k * latency_only(n, per_node, nvlink, nets[0]):.1f}" for n in gpus)
        # NCCL's tree algorithm (its choice for small messages at scale): ~2 log2(N) hops.
        tree = k * 2 * math.ceil(math.log2(gpus[-1])) * nets[0].latency_s
        print(f"| {c.name} | {c.bn_layers} | {k} | {cells} | {1e3 * tree:.1f} |")

    if args.published:
        published(args, nvlink)
    return 0


def published(args, nvlink: Link) -> None:
    """The same model on published configurations, with the efficiency they reported."""
    # (label, model, GPUs, GPUs/node, intra-node link, inter-node Gb/s, per-GPU images/s at batch 64,
    #  how that figure was obtained, published scaling efficiency)
    p100_nvlink = Link("P100 NVLink", 40e9, args.nvlink_latency_us * 1e-6)  # DGX-1 hybrid cube mesh, assumed
    pcie = Link("PCIe 3", 10e9, args.nvlink_latency_us * 1e-6)
    cases = [
        ("tf_cnn_benchmarks, DGX-1 8x P100, synthetic", "ResNet-50", 8, 8, p100_nvlink, None, 219,
         "measured (TF benchmarks page)", 0.98),
        ("Horovod, 128 servers x 4 Pascal, 25 Gb/s RoCE", "Inception V3", 512, 4, pcie, 25, 142,
         "P100, TF benchmarks page", 0.90),
        ("Horovod, 128 servers x 4 Pascal, 25 Gb/s RoCE", "ResNet-101", 512, 4, pcie, 25, 115,
         "ResNet-50's 219 x 4.1/7.8 GFLOPs", 0.90),
        ("Horovod, 128 servers x 4 Pascal, 25 Gb/s RoCE", "VGG-16", 512, 4, pcie, 25, 58,
         "ResNet-50's 219 x 4.1/15.5 GFLOPs", 0.68),
    ]
    print("\n### Check against published scaling (batch 64 per GPU; same formulas)\n")
    print("| benchmark | model | params | GPUs | compute s/step | comm ms (model) | efficiency, no overlap | "
          "efficiency, overlapped | published | exposed comm the published figure implies (ms) |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for label, name, n, per_node, intra, gbits, ips, how, eff in cases:
        params = count_app(name)
        t = 64 / ips
        net = Link(f"{gbits} Gb/s", gbit(gbits, args.net_efficiency), args.latency_us * 1e-6) if gbits else intra
        # Horovod (2018) ran one flat NCCL ring over all GPUs; a node's part of the ring crosses its NIC.
        comm = ring(n, 4 * params, intra) if n <= per_node else flat_ring(n, 4 * params, net)
        e0 = t / (t + comm)
        last = min(4 * params, args.pack_mb * 1e6)
        tail = ring(n, last, intra) if n <= per_node else flat_ring(n, last, net)
        e1 = t / (t + exposed(comm, t, args.backward_fraction, True, tail))
        implied = t * (1 / eff - 1)
        print(f"| {label} | {name} | {params / 1e6:.1f}M | {n} | {t:.3f} ({ips} img/s: {how}) | {1e3 * comm:.0f} | "
              f"{pct(e0)} | {pct(e1)} | {pct(eff)} | {1e3 * implied:.0f} |")


if __name__ == "__main__":
    sys.exit(main())

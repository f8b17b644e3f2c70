#!/usr/bin/env python3
"""The training streams of two seg-train source trees, sample by sample: are they the same batches?

    python scripts/compare_streams.py --config CFG --trees OLD_TREE NEW_TREE [--samples 64] [--set KEY=VALUE ...]

Each tree runs in a fresh process (PYTHONPATH set to it) and writes the first --samples samples of its
training stream (ImageReader.train_dataset on 1 tower, from step 0: normalised float32 images, uint8
labels) to a temporary .npy file; then they are compared value by value. Prints one line: the largest
image difference (in normalised units and in levels of 0..255, through data.std), how many image values
and label pixels differ, and whether the two streams are equal bit for bit. Exit 0 if bitwise equal, 1
if not, 2 on a user error. Use it when a change touches the reader: a stream that changes must be said
in README (old runs then resume on other batches).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np


def child(args) -> None:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    from seg_train import config as config_lib
    from seg_train.data.split import open_split

    cfg = config_lib.load(args.config, args.set)
    reader = open_split(cfg, cfg.data.train_split).reader
    batch = cfg.data.batch_size
    images, labels = [], []
    for image, label in reader.train_dataset(batch, 0, 1).take(-(-args.samples // batch)):
        images.append(image.numpy())
        labels.append(label.numpy())
    np.save(args.out + ".image.npy", np.concatenate(images)[:args.samples])
    np.save(args.out + ".label.npy", np.concatenate(labels)[:args.samples])
    print(json.dumps({"std": list(cfg.data.std)}))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True)
    p.add_argument("--trees", nargs=2, metavar=("A", "B"), help="two seg-train source trees (repo roots)")
    p.add_argument("--samples", type=int, default=64)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args)
        return 0
    if not args.trees:
        p.error("--trees A B is required")
    with tempfile.TemporaryDirectory(prefix="compare-streams-") as tmp:
        arrays, std = [], None
        for i, tree in enumerate(args.trees):
            out = os.path.join(tmp, str(i))
            argv = [sys.executable, os.path.abspath(__file__), "--child", "--config", os.path.abspath(args.config),
                    "--samples", str(args.samples), "--out", out] + [f"--set={s}" for s in args.set]
            proc = subprocess.run(argv, env={**os.environ, "PYTHONPATH": os.path.abspath(tree)},
                                  stdout=subprocess.PIPE, text=True, check=False)
            if proc.returncode != 0:
                print(f"error: the stream of {tree} failed (exit code {proc.returncode})", file=sys.stderr)
                return 2
            std = json.loads(proc.stdout.strip().splitlines()[-1])["std"]
            arrays.append((np.load(out + ".image.npy"), np.load(out + ".label.npy")))
    (ia, la), (ib, lb) = arrays
    diff = np.abs(ia - ib)
    levels = (diff * np.asarray(std, np.float32)).max()
    bitwise = np.array_equal(ia.view(np.uint32), ib.view(np.uint32)) and np.array_equal(la, lb)
    print(f"{len(ia)} samples: image max |diff| {diff.max():.3g} (normalised; {levels:.3g} levels of 0..255), "
          f"{int((diff > 0).sum())} of {diff.size} image values differ, {int((la != lb).sum())} of {la.size} "
          f"label pixels; bitwise equal: {bitwise}")
    return 0 if bitwise else 1


if __name__ == "__main__":
    raise SystemExit(main())

#!/usr/bin/env python
"""Peak memory of whole-image vs sliding-window evaluation (eval.mode) on one large synthetic image.

    python benchmarks/bench_slide_memory.py [--backbone mobilenetv2] [--size 2048x1024] [--crop 512x1024]
                                         [--stride 341x683] [--large 4096x2048] [--output FILE.json]

Each case runs in its own process (so each peak is its own), through the real evaluation
(seg_train.infer.evaluate on one tower: the data reader, the tower function, the inference modes, the
confusion matrix) on a one-image split written to a temporary folder. The model has random weights
(the memory does not depend on them). Cases:

  model  the TrainState built, nothing evaluated: the baseline of the process (TensorFlow, the model)
  whole  eval.mode: whole on the WxH image
  slide  eval.mode: slide with the given window and stride on the same image
  whole_large, slide_large  the same on the --large image (4x the pixels by default): whole
         image activations grow with the image; in slide mode the window's activations stay the
         same and only the image-sized tensors grow (image, label, the logits sum and the averaged
         logits, one-hot confusion rows)

Each case reports the peak resident set size (VmHWM of /proc/self/status) in MiB after evaluating
the image twice (the first call traces), and the seconds of the second evaluation. Prints one JSON
object (also written to --output): {"backbone", "num_classes", "crop", "stride", "cases": {case:
{"image": [h, w], "peak_rss_mb", "above_model_mb", "seconds", "windows"}}}.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NUM_CLASSES = 19  # Cityscapes' classes: the logits sum and one-hot rows scale with it


def _pair(text: str) -> tuple[int, int]:
    """'2048x1024' (width x height, as image sizes are usually written) -> (height, width)."""
    try:
        w, h = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected WIDTHxHEIGHT like 2048x1024, got {text!r}") from None
    if w <= 0 or h <= 0:
        raise argparse.ArgumentTypeError(f"expected positive sizes, got {text!r}")
    return h, w


def _write_split(root: Path, h: int, w: int) -> None:
    """A one-image VOC-layout split: smooth random colours, random labels."""
    import numpy as np
    from PIL import Image

    from seg_train.data.label_images import save_index_png, voc_colormap

    rng = np.random.default_rng(0)
    for d in ("JPEGImages", "SegmentationClass", "ImageSets/Segmentation"):
        (root / d).mkdir(parents=True, exist_ok=True)
    blocks = rng.integers(0, 256, (h // 16 + 1, w // 16 + 1, 3), dtype=np.uint8)
    Image.fromarray(np.repeat(np.repeat(blocks, 16, axis=0), 16, axis=1)[:h, :w]).save(root / "JPEGImages" / "big.jpg")
    save_index_png(root / "SegmentationClass" / "big.png",
                   rng.integers(0, NUM_CLASSES, (h, w)).astype(np.uint8), voc_colormap())
    (root / "ImageSets/Segmentation/val.txt").write_text("big\n")


def run_case(case: str, backbone: str, size, crop, stride) -> dict:
    """One case in this process: build, evaluate twice, report."""
    from seg_train.cli import set_tf_env_defaults

    set_tf_env_defaults()  # the CPU allocator seg-eval runs on (the environment's choice wins)
    from seg_train.parallel import replicas

    devices = replicas.setup_devices(1)
    from seg_train import config as config_lib
    from seg_train.data.split import open_split
    from seg_train.infer.evaluate import Evaluator
    from seg_train.run.state import TrainState
    from seg_train.util.sysinfo import peak_rss_mb

    h, w = size
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "data"
        _write_split(root, h, w)
        modes = {"mode": "slide", "crop_size": list(crop), "stride": list(stride)} if case.startswith("slide") else {}
        cfg = config_lib.from_dict({
            "data": {"root": str(root), "num_classes": NUM_CLASSES, "batch_size": 1},
            "model": {"backbone": backbone},
            "eval": {"bn_reestimate_batches": 0, **modes},
        })
        state = TrainState(cfg, replicas.make_strategy(devices), optimizer=False)
        result = {"image": [h, w]}
        if case != "model":
            reader = open_split(cfg, "val").reader
            names = [f"c{i}" for i in range(NUM_CLASSES)]
            evaluator = Evaluator(state)
            evaluator.evaluate(reader, names, progress=False)  # traces
            start = time.perf_counter()
            evaluator.evaluate(reader, names, progress=False)
            result["seconds"] = round(time.perf_counter() - start, 2)
            if modes:
                (ch, cw), (sh, sw) = crop, stride
                result["windows"] = ((max(h - ch + sh - 1, 0) // sh + 1) * (max(w - cw + sw - 1, 0) // sw + 1))
        result["peak_rss_mb"] = round(peak_rss_mb(), 1)
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backbone", default="mobilenetv2", choices=("tiny", "mobilenetv2", "resnet50", "resnet101"))
    p.add_argument("--size", type=_pair, default=(1024, 2048), metavar="WxH", help="the image (default 2048x1024)")
    p.add_argument("--crop", type=_pair, default=(512, 1024), metavar="WxH",
                   help="eval.crop_size of the slide cases, as WxH (default 1024x512: mmsegmentation's Cityscapes "
                        "window)")
    p.add_argument("--stride", type=_pair, default=(341, 683), metavar="WxH", help="eval.stride (default 683x341)")
    p.add_argument("--large", type=_pair, default=(2048, 4096), metavar="WxH",
                   help="the image of whole_large and slide_large (default 4096x2048)")
    p.add_argument("--cases", default="model,whole,slide,whole_large,slide_large")
    p.add_argument("--output", help="also write the JSON here")
    p.add_argument("--case", help=argparse.SUPPRESS)  # internal: run one case in this process
    args = p.parse_args(argv)

    if args.case:
        size = args.large if args.case.endswith("_large") else args.size
        print(json.dumps(run_case(args.case, args.backbone, size, args.crop, args.stride)))
        return 0

    report = {"backbone": args.backbone, "num_classes": NUM_CLASSES, "crop": list(args.crop),
              "stride": list(args.stride), "cases": {}}
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    for case in args.cases.split(","):
        cmd = [sys.executable, __file__, "--case", case, "--backbone", args.backbone,
               "--size", "x".join(map(str, args.size[::-1])), "--crop", "x".join(map(str, args.crop[::-1])),
               "--stride", "x".join(map(str, args.stride[::-1])), "--large", "x".join(map(str, args.large[::-1]))]
        proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True, check=False)
        if proc.returncode != 0:
            print(f"error: case {case} failed (exit {proc.returncode}): see its output above", file=sys.stderr)
            return 1
        report["cases"][case] = json.loads(proc.stdout.strip().splitlines()[-1])
        print(f"{case}: {report['cases'][case]}", file=sys.stderr)
    base = report["cases"].get("model", {}).get("peak_rss_mb")
    if base is not None:
        for result in report["cases"].values():
            result["above_model_mb"] = round(result["peak_rss_mb"] - base, 1)
    # One case per line.
    text = "{\n" + ",\n".join(f' "{k}": {json.dumps(v)}' for k, v in report.items() if k != "cases")
    text += ',\n "cases": {\n' + ",\n".join(f'  "{k}": {json.dumps(v)}' for k, v in report["cases"].items())
    text += "\n }\n}"
    print(text)
    if args.output:
        Path(args.output).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The synthetic panoptic demo data set, in COCO's panoptic layout (numpy/Pillow only): data.synthetic with data.task
panoptic or instance generates it, and it is read as any COCO-format data set is (data/panoptic.py).

Each image: stuff regions (two to three of the stuff classes, each with its own hue and texture, split by wavy
boundaries) under 1-6 things, separate blobs of the thing classes, several of a class in one image, the later
occluding the earlier; a one-pixel unlabelled band (id 0) along every thing's visible outline; sometimes a crowd
(a cluster of small blobs of one thing class listed as one segment with `iscrowd: 1`). Segment ids are drawn over
the whole 24-bit range, so all three channels of the PNG carry them; category ids are not contiguous (3 t + 2 for
train id t), so the mapping to train ids is exercised. Command line: `python -m seg_train.data.synthetic_panoptic`.
"""

from __future__ import annotations

import argparse
import colorsys
import json
from pathlib import Path

import numpy as np
from PIL import Image

from seg_train.data import synthetic

COMPLETE_MARKER = synthetic.COMPLETE_MARKER  # the semantic demo set's, so data/checks.py reads both alike
STUFF_NAMES = ("sky", "grass", "water", "wall", "road", "sand")
THING_SHAPES = ("disc", "box", "diamond", "bar")


def default_things(num_classes: int) -> list[int]:
    """The thing classes when the config names none: the last num_classes // 2 (at least one stuff and one thing)."""
    return list(range(num_classes - num_classes // 2, num_classes))


def category_id(train_id: int) -> int:
    return 3 * train_id + 2


def class_names(num_classes: int, things) -> list[str]:
    names, s, t = [], 0, 0
    for c in range(num_classes):
        if c in things:
            names.append(THING_SHAPES[t % len(THING_SHAPES)] + (f"_{t // len(THING_SHAPES) + 1}"
                                                                 if t >= len(THING_SHAPES) else ""))
            t += 1
        else:
            names.append(STUFF_NAMES[s % len(STUFF_NAMES)] + (f"_{s // len(STUFF_NAMES) + 1}"
                                                               if s >= len(STUFF_NAMES) else ""))
            s += 1
    return names


def _hue(c: int) -> float:
    return (0.07 + c * 0.618034) % 1.0


def _colour(rng, c: int) -> np.ndarray:
    return 255.0 * np.array(colorsys.hsv_to_rgb((_hue(c) + rng.uniform(-0.03, 0.03)) % 1.0, rng.uniform(0.5, 0.9),
                                                rng.uniform(0.5, 0.95)))


def _blob(shape: str, dx, dy, r: float, angle: float) -> np.ndarray:
    u = dx * np.cos(angle) + dy * np.sin(angle)
    v = -dx * np.sin(angle) + dy * np.cos(angle)
    if shape == "disc":
        return u * u + v * v <= r * r
    if shape == "box":
        return np.maximum(np.abs(u), np.abs(v)) <= 0.8 * r
    if shape == "diamond":
        return np.abs(u) / r + np.abs(v) / (0.6 * r) <= 1.0
    return (np.abs(u) <= 1.3 * r) & (np.abs(v) <= 0.35 * r)  # bar


def _outline(ids: np.ndarray) -> np.ndarray:
    """Pixels with a 4-neighbour of another id."""
    band = np.zeros(ids.shape, bool)
    band[1:] |= ids[1:] != ids[:-1]
    band[:-1] |= ids[:-1] != ids[1:]
    band[:, 1:] |= ids[:, 1:] != ids[:, :-1]
    band[:, :-1] |= ids[:, :-1] != ids[:, 1:]
    return band


def render_scene(rng: np.random.Generator, size: tuple[int, int], num_classes: int, things) -> tuple:
    """One scene: (image uint8 [H, W, 3], segment ids int64 [H, W] (0 unlabelled), segments [{id, category_id,
    iscrowd}] with train ids as category_id)."""
    h, w = size
    things = list(things)
    stuff = [c for c in range(num_classes) if c not in things]
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    # Stuff: 2-3 bands split by wavy lines; a class may come back (one segment for both bands).
    n = int(rng.integers(2, 4))
    cuts = np.sort(rng.uniform(0.2, 0.8, n - 1)) * h
    band = np.zeros((h, w), np.int64)
    for cut in cuts:
        wave = cut + rng.uniform(2, 0.08 * h) * np.sin(xx / w * rng.uniform(2, 7) + rng.uniform(0, 6.3))
        band += yy > wave
    region_class = rng.choice(stuff, n)
    classes = np.asarray(region_class)[band]
    image = np.zeros((h, w, 3), np.float32)
    for c in set(region_class.tolist()):
        m = classes == c
        texture = 18.0 * np.sin((xx * np.cos(c) + yy * np.sin(c)) / (2.0 + c % 4))
        image[m] = _colour(rng, c) + texture[m][:, None]
    instance = np.zeros((h, w), np.int64)  # 0: stuff, k: the k-th thing drawn
    drawn, crowd_of = [], {}
    for k in range(1, int(rng.integers(1, 7)) + 1):
        c = int(rng.choice(things))
        shape = THING_SHAPES[things.index(c) % len(THING_SHAPES)]
        colour = _colour(rng, c)
        if rng.uniform() < 0.12:  # a crowd: a cluster of small blobs, one segment
            cy, cx = rng.uniform(0.2, 0.8) * h, rng.uniform(0.2, 0.8) * w
            mask = np.zeros((h, w), bool)
            for _ in range(int(rng.integers(3, 6))):
                mask |= _blob(shape, xx - cx - rng.normal(0, 0.08 * w), yy - cy - rng.normal(0, 0.08 * h),
                              rng.uniform(0.04, 0.07) * min(h, w), rng.uniform(0, 6.3))
            crowd_of[k] = True
        else:
            r = rng.uniform(0.1, 0.2) * min(h, w)
            mask = _blob(shape, xx - rng.uniform(0.15, 0.85) * w, yy - rng.uniform(0.15, 0.85) * h, r,
                         rng.uniform(0, 6.3))
        if not mask.any():
            continue
        spots = 20.0 * np.sign(np.sin(xx / (3.0 + things.index(c))) * np.sin(yy / (3.0 + things.index(c))))
        image[mask] = colour + spots[mask][:, None]
        classes[mask] = c
        instance[mask] = k
        drawn.append((k, c))
    # Lighting and noise, as the semantic demo set's.
    theta = rng.uniform(0, 6.3)
    ramp = ((xx - w / 2) * np.cos(theta) + (yy - h / 2) * np.sin(theta)) / min(h, w)
    image *= (1.0 + rng.uniform(0.1, 0.4) * ramp)[..., None]
    image += rng.normal(0.0, rng.uniform(3.0, 8.0), image.shape)
    # One segment per stuff class present and per visible thing; ids over the 24-bit range.
    keys = classes * 1000 + instance
    values = np.unique(keys)
    seg_ids = rng.integers(1, 256 ** 3, len(values))
    while len(set(seg_ids.tolist())) < len(values):
        seg_ids = rng.integers(1, 256 ** 3, len(values))
    ids = seg_ids[np.searchsorted(values, keys)]
    ids[_outline(keys) & (instance > 0)] = 0
    segments = []
    for v, i in zip(values.tolist(), seg_ids.tolist()):
        if (ids == i).any():
            segments.append({"id": int(i), "category_id": int(v // 1000),
                             "iscrowd": int(crowd_of.get(v % 1000, False))})
    return np.clip(image, 0, 255).astype(np.uint8), ids, segments


def _bbox(mask: np.ndarray) -> list[int]:
    rows, cols = np.flatnonzero(mask.any(1)), np.flatnonzero(mask.any(0))
    return [int(cols[0]), int(rows[0]), int(cols[-1] - cols[0] + 1), int(rows[-1] - rows[0] + 1)]


def _write_split(out: Path, split: str, first_id: int, count: int, rng, size, num_classes: int, things) -> None:
    images_dir, pngs = out / split, out / "annotations" / f"panoptic_{split}"
    images_dir.mkdir(parents=True)
    pngs.mkdir(parents=True)
    images, annotations = [], []
    for image_id in range(first_id, first_id + count):
        image, ids, segs = render_scene(rng, size, num_classes, things)
        stem = f"{image_id:012d}"
        Image.fromarray(image).save(images_dir / f"{stem}.jpg", quality=95)
        Image.fromarray(np.stack([ids % 256, ids // 256 % 256, ids // 256 ** 2], -1).astype(np.uint8)).save(
            pngs / f"{stem}.png")
        info = [{"id": s["id"], "category_id": category_id(s["category_id"]), "iscrowd": s["iscrowd"],
                 "area": int((ids == s["id"]).sum()), "bbox": _bbox(ids == s["id"])} for s in segs]
        images.append({"id": image_id, "file_name": f"{stem}.jpg", "height": size[0], "width": size[1]})
        annotations.append({"image_id": image_id, "file_name": f"{stem}.png", "segments_info": info})
    names = class_names(num_classes, things)
    categories = [{"id": category_id(c), "name": names[c], "isthing": int(c in things),
                   "supercategory": "thing" if c in things else "stuff",
                   "color": [int(v) for v in _colour(np.random.default_rng(c), c)]} for c in range(num_classes)]
    (out / "annotations" / f"panoptic_{split}.json").write_text(
        json.dumps({"images": images, "annotations": annotations, "categories": categories}))


def generate(root: str | Path, num_train: int = 160, num_val: int = 40, size: tuple[int, int] = (96, 96),
             num_classes: int = 5, seed: int = 0, thing_classes=None) -> Path:
    """Creates the panoptic demo set at `root` unless it is complete there (built beside it and renamed into
    place, `.complete` last, as data/synthetic.py's). `thing_classes`: default_things' when None."""
    root = Path(root)
    if (root / COMPLETE_MARKER).is_file():
        return root
    if not 2 <= num_classes <= 255:
        raise ValueError(f"num_classes={num_classes}; expected 2..255")
    things = default_things(num_classes) if thing_classes is None else sorted(thing_classes)
    if not things or len(things) == num_classes or min(things) < 0 or max(things) >= num_classes:
        raise ValueError(f"thing_classes={things}; expected at least one thing and one stuff class of {num_classes}")
    if num_train < 1 or num_val < 0 or min(size) < 16:
        raise ValueError("expected num_train >= 1, num_val >= 0 and images of at least 16 x 16")
    params = dict(num_train=num_train, num_val=num_val, size=list(size), num_classes=num_classes, seed=seed,
                  thing_classes=things)

    def write(tmp: Path) -> None:
        rng = np.random.default_rng(seed)
        _write_split(tmp, "train", 1, num_train, rng, size, num_classes, things)
        _write_split(tmp, "val", 1 + num_train, num_val, rng, size, num_classes, things)

    return synthetic.publish(root, write, params)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m seg_train.data.synthetic_panoptic",
                                     description="Generate the synthetic panoptic demo set (COCO panoptic layout).")
    parser.add_argument("out_dir")
    parser.add_argument("--num-train", type=int, default=160)
    parser.add_argument("--num-val", type=int, default=40)
    parser.add_argument("--size", type=int, nargs=2, default=(96, 96), metavar=("HEIGHT", "WIDTH"))
    parser.add_argument("--num-classes", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        print(generate(args.out_dir, args.num_train, args.num_val, tuple(args.size), args.num_classes, args.seed))
    except (ValueError, FileExistsError) as exc:
        parser.exit(2, f"error: {exc}\n")
    except OSError as exc:
        parser.exit(2, f"error: cannot write the data set ({args.out_dir}): {exc.strerror or exc}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

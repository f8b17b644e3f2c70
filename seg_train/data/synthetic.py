"""Synthetic PASCAL-VOC-layout data set for smoke tests and demos (numpy/Pillow only).

Each image is a textured background (class 0) with 1-4 objects, each class with its own jittered shape,
hue and texture plus lighting and noise: learnable, but not by colour alone. As in VOC, ignore pixels
(255) outline the objects. Command line: `python -m seg_train.data.synthetic --help`.
"""

from __future__ import annotations

import argparse
import colorsys
import json
import os
import shutil
from pathlib import Path

import numpy as np
from PIL import Image

from seg_train.data.label_images import save_index_png, voc_colormap

IGNORE_LABEL = 255
COMPLETE_MARKER = ".complete"
SHAPES = ("disc", "square", "triangle", "stripe", "ring", "cross", "diamond", "crescent")
TEXTURES = ("plain", "stripes", "checker", "speckle")


def class_names(num_classes: int) -> list[str]:
    """Return ["background", "disc", "square", ...] for ``num_classes`` classes."""
    names = ["background"]
    for c in range(1, num_classes):
        shape = SHAPES[(c - 1) % len(SHAPES)]
        cycle = (c - 1) // len(SHAPES)
        names.append(shape if cycle == 0 else f"{shape}_{cycle + 1}")
    return names


def _class_style(c: int) -> tuple[str, float, str]:
    """Return (shape, base hue, texture) of object class ``c`` >= 1; fixed, independent of the seed."""
    shape = SHAPES[(c - 1) % len(SHAPES)]
    # Golden-ratio steps spread hues evenly however many classes there are.
    hue = (0.05 + (c - 1) * 0.618034) % 1.0
    # Offset by the shape cycle so classes sharing a shape also differ in texture.
    texture = TEXTURES[((c - 1) + (c - 1) // len(SHAPES)) % len(TEXTURES)]
    return shape, hue, texture


def _shape_mask(shape: str, dx: np.ndarray, dy: np.ndarray, r: float, angle: float) -> np.ndarray:
    """Boolean mask of ``shape`` with radius ``r`` rotated by ``angle``; dx, dy are offsets from its centre."""
    cos, sin = np.cos(angle), np.sin(angle)
    u = dx * cos + dy * sin
    v = -dx * sin + dy * cos
    dist2 = dx * dx + dy * dy
    if shape == "disc":
        return dist2 <= r * r
    if shape == "square":
        return np.maximum(np.abs(u), np.abs(v)) <= 0.8 * r
    if shape == "triangle":
        mask = np.ones(dx.shape, dtype=bool)
        for k in range(3):
            theta = angle + k * 2.0 * np.pi / 3.0
            mask &= dx * np.cos(theta) + dy * np.sin(theta) <= 0.55 * r
        return mask
    if shape == "stripe":
        return (np.abs(u) <= 1.6 * r) & (np.abs(v) <= 0.28 * r)
    if shape == "ring":
        return (dist2 <= r * r) & (dist2 >= (0.55 * r) ** 2)
    if shape == "cross":
        au, av = np.abs(u), np.abs(v)
        return ((au <= r) & (av <= 0.3 * r)) | ((av <= r) & (au <= 0.3 * r))
    if shape == "diamond":
        return np.abs(u) / r + np.abs(v) / (0.55 * r) <= 1.0
    if shape == "crescent":
        bite2 = (u - 0.5 * r) ** 2 + v**2
        return (dist2 <= r * r) & (bite2 > (0.8 * r) ** 2)
    raise ValueError(f"unknown shape {shape!r}")


def _smooth_field(rng: np.random.Generator, grid: int, size: tuple[int, int], scale: float) -> np.ndarray:
    """Random [H, W, 3] float field: a ``grid`` x ``grid`` lattice of N(0, scale) values, bilinearly upsampled."""
    height, width = size
    coarse = rng.normal(0.0, scale, (grid, grid, 3)).astype(np.float32)
    channels = [
        np.asarray(Image.fromarray(np.ascontiguousarray(coarse[..., k])).resize((width, height), Image.BILINEAR))
        for k in range(3)
    ]
    return np.stack(channels, axis=-1)


def _texture(kind: str, rng: np.random.Generator, xx: np.ndarray, yy: np.ndarray) -> np.ndarray:
    """Texture pattern of the given kind in roughly [-1, 1], shape [H, W]."""
    if kind == "plain":
        return np.zeros(xx.shape, dtype=np.float32)
    if kind == "stripes":
        theta = rng.uniform(0.0, np.pi)
        period = rng.uniform(5.0, 9.0)
        return np.sin(2.0 * np.pi * (xx * np.cos(theta) + yy * np.sin(theta)) / period)
    if kind == "checker":
        period = rng.uniform(6.0, 10.0)
        phase = rng.uniform(0.0, period, 2)
        return np.sign(np.sin(np.pi * (xx + phase[0]) / period) * np.sin(np.pi * (yy + phase[1]) / period))
    if kind == "speckle":
        return np.clip(rng.normal(0.0, 0.8, xx.shape), -2.0, 2.0)
    raise ValueError(f"unknown texture {kind!r}")


def _outline(instances: np.ndarray, radius: int) -> np.ndarray:
    """Pixels within ``radius`` (Chebyshev) of a pixel of another instance: a band ~2*radius wide."""
    height, width = instances.shape
    padded = np.pad(instances, radius, mode="edge")
    band = np.zeros(instances.shape, dtype=bool)
    for dy in range(-radius, radius + 1):
        for dx in range(-radius, radius + 1):
            shifted = padded[radius + dy : radius + dy + height, radius + dx : radius + dx + width]
            band |= shifted != instances
    return band


def render_scene(
    rng: np.random.Generator, size: tuple[int, int], num_classes: int
) -> tuple[np.ndarray, np.ndarray]:
    """One random scene of `size` (h, w) from `rng` alone: (image uint8 [H, W, 3], label uint8 [H, W]
    in 0..num_classes-1 and 255); background is class 0."""
    height, width = size
    short = min(height, width)
    yy, xx = np.mgrid[0:height, 0:width].astype(np.float32)

    # Background: a muted base colour with large-scale blotches and finer mottling.
    base = rng.uniform(70.0, 180.0) + rng.normal(0.0, 20.0, 3)
    image = base + _smooth_field(rng, 3, size, 35.0) + _smooth_field(rng, 8, size, 10.0)
    label = np.zeros(size, dtype=np.uint8)
    instances = np.zeros(size, dtype=np.int32)

    for k in range(1, int(rng.integers(1, 5)) + 1):
        c = int(rng.integers(1, num_classes))
        shape, hue, texture = _class_style(c)
        r = rng.uniform(0.12, 0.24) * short
        cy, cx = rng.uniform(0.15, 0.85) * height, rng.uniform(0.15, 0.85) * width
        mask = _shape_mask(shape, xx - cx, yy - cy, r, rng.uniform(0.0, 2.0 * np.pi))
        colour = 255.0 * np.array(
            colorsys.hsv_to_rgb(
                (hue + rng.uniform(-0.05, 0.05)) % 1.0, rng.uniform(0.45, 0.9), rng.uniform(0.55, 0.95)
            )
        )
        pattern = rng.uniform(15.0, 35.0) * _texture(texture, rng, xx, yy)
        image[mask] = colour + pattern[mask][:, None]
        label[mask] = c
        instances[mask] = k  # later objects occlude earlier ones

    # Lighting gradient over the whole scene, then sensor noise.
    theta = rng.uniform(0.0, 2.0 * np.pi)
    ramp = ((xx - width / 2) * np.cos(theta) + (yy - height / 2) * np.sin(theta)) / short
    image *= (1.0 + rng.uniform(0.2, 0.6) * ramp)[..., None]
    image += rng.normal(0.0, rng.uniform(4.0, 12.0), image.shape)

    # VOC-style ignore band along visible outlines, its width scaling with the image size.
    border_width = max(1, round(2 * short / 96))
    label[_outline(instances, max(1, round(border_width / 2)))] = IGNORE_LABEL
    return np.clip(image, 0, 255).astype(np.uint8), label


_README = """\
# Synthetic segmentation demo data

This data set is synthetic: it was generated procedurally by seg-train
(`python -m seg_train.data.synthetic`) and contains no real photographs.

- {num_train} training and {num_val} validation images of {height}x{width} pixels, seed {seed}.
- Layout follows PASCAL VOC: `JPEGImages/<id>.jpg`, `SegmentationClass/<id>.png`
  (palette PNGs whose pixel values are class indices), `ImageSets/Segmentation/{{train,val}}.txt`.
- {num_classes} classes, listed in `classes.txt`; label value 255 marks the ignored
  band along object outlines.
"""


def _write_dataset(
    out: Path, num_train: int, num_val: int, size: tuple[int, int], num_classes: int, seed: int
) -> None:
    """Write the whole data set into the (fresh) directory ``out``."""
    image_dir = out / "JPEGImages"
    label_dir = out / "SegmentationClass"
    split_dir = out / "ImageSets" / "Segmentation"
    for d in (image_dir, label_dir, split_dir):
        d.mkdir(parents=True, exist_ok=True)
    palette = voc_colormap(256)
    rng = np.random.default_rng(seed)
    ids = [f"demo_{i:05d}" for i in range(num_train + num_val)]
    for image_id in ids:
        image, label = render_scene(rng, size, num_classes)
        Image.fromarray(image).save(image_dir / f"{image_id}.jpg", quality=95)
        save_index_png(label_dir / f"{image_id}.png", label, palette)
    (split_dir / "train.txt").write_text("".join(f"{i}\n" for i in ids[:num_train]))
    (split_dir / "val.txt").write_text("".join(f"{i}\n" for i in ids[num_train:]))
    (out / "classes.txt").write_text("".join(f"{n}\n" for n in class_names(num_classes)))
    (out / "README.md").write_text(
        _README.format(
            num_train=num_train,
            num_val=num_val,
            height=size[0],
            width=size[1],
            seed=seed,
            num_classes=num_classes,
        )
    )


def generate(
    root: str | Path,
    num_train: int = 160,
    num_val: int = 40,
    size: tuple[int, int] = (96, 96),
    num_classes: int = 5,
    seed: int = 0,
) -> Path:
    """Create the synthetic data set at ``root`` unless it is already complete there.

    Built in a sibling temporary directory and renamed into place (``.complete`` written last), so
    ``root`` is absent or complete; a complete ``root`` is returned untouched, whatever its parameters.
    `size`: (height, width); `num_classes`: 2..255, background included. Returns ``root`` as a Path.
    """
    root = Path(root)
    if (root / COMPLETE_MARKER).is_file():
        return root
    if not 2 <= num_classes <= 255:
        raise ValueError(f"num_classes={num_classes}; expected 2..255 (255 is the ignore label)")
    if num_train < 1 or num_val < 0:
        raise ValueError(f"num_train={num_train}, num_val={num_val}; expected num_train >= 1, num_val >= 0")
    height, width = (int(s) for s in size)
    if height < 8 or width < 8:
        raise ValueError(f"size={tuple(size)}; expected (height, width) of at least 8 pixels each")
    params = dict(num_train=num_train, num_val=num_val, size=[height, width], num_classes=num_classes, seed=seed)
    return publish(root, lambda tmp: _write_dataset(tmp, num_train, num_val, (height, width), num_classes, seed),
                   params)


def publish(root: Path, write, params: dict) -> Path:
    """Runs `write(tmp)` into a sibling temporary directory, writes ``.complete`` (the `params`) last and renames
    it into place, so ``root`` is absent or complete; another process that got there first wins. Refuses a
    ``root`` that holds anything else (it may be a user's directory: never delete what we did not create)."""
    if root.exists() and (not root.is_dir() or any(root.iterdir())):
        raise FileExistsError(
            f"{root} exists but is not a complete demo data set (no {COMPLETE_MARKER}); "
            "remove it or choose another directory"
        )

    root.parent.mkdir(parents=True, exist_ok=True)
    tmp = root.with_name(f"{root.name}.tmp-{os.getpid()}")
    if tmp.exists():  # left over by a crashed earlier process that had our pid
        shutil.rmtree(tmp)
    try:
        write(tmp)
        (tmp / COMPLETE_MARKER).write_text(json.dumps(params) + "\n")
        try:
            os.replace(tmp, root)  # atomic; also succeeds over an empty directory
        except OSError:
            # Another process (e.g. another training worker) got there first.
            if (root / COMPLETE_MARKER).is_file():
                shutil.rmtree(tmp, ignore_errors=True)
                return root
            raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return root


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(
        prog="python -m seg_train.data.synthetic",
        description="Generate a synthetic PASCAL-VOC-layout segmentation data set.",
    )
    parser.add_argument("out_dir", help="output directory (left as is if already complete)")
    parser.add_argument("--num-train", type=int, default=160, help="training images (default 160)")
    parser.add_argument("--num-val", type=int, default=40, help="validation images (default 40)")
    parser.add_argument(
        "--size", type=int, nargs=2, default=(96, 96), metavar=("HEIGHT", "WIDTH"), help="image size (default 96 96)"
    )
    parser.add_argument("--num-classes", type=int, default=5, help="classes including background (default 5)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    args = parser.parse_args(argv)
    try:
        root = generate(args.out_dir, args.num_train, args.num_val, tuple(args.size), args.num_classes, args.seed)
    except (ValueError, FileExistsError) as exc:
        parser.exit(2, f"error: {exc}\n")
    except OSError as exc:  # a read-only or full disk
        parser.exit(2, f"error: cannot write the data set ({args.out_dir}): {exc.strerror or exc}\n")
    print(root)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Label-image I/O and colour palettes (numpy/Pillow only, no TensorFlow).

Labels are PNGs whose pixel values are class indices: palette ('P') images (the value is the palette
index; the palette is only for display) or single-channel ('L'). RGB labels are rejected (colours, not
classes), and so are JPEGs whatever their name: compression damages values at every edge, and a greyscale
JPEG would otherwise pass as 'L'.
"""

from __future__ import annotations

import posixpath
from pathlib import Path

import numpy as np
from PIL import Image

# Colour VOC uses for its "ignore" (void/boundary) value 255.
VOID_COLOUR = (224, 224, 192)

# A JPEG's first bytes: start-of-image (FF D8), then the next marker's FF.
JPEG_START = b"\xff\xd8\xff"
# How a lossy label is named in messages (the pre-training scan counts its samples by this prefix).
LOSSY_WHAT = "lossy JPEG label"
LOSSY_EXPECTED = ("expected a PNG of class indices (JPEG compression damages the class values); convert the "
                  "label to PNG, from its source annotation if you have it")


class LossyLabel(ValueError):
    """A label image stored as a JPEG (found by its bytes, whatever its name): a bad sample."""

    def __init__(self, name):
        super().__init__(f"{LOSSY_WHAT} ({name}): {LOSSY_EXPECTED}")


def is_lossy_message(message: str) -> bool:
    """Whether a bad sample's message is that of a JPEG label."""
    return message.startswith(f"{LOSSY_WHAT} (")


def _head(source, n: int) -> bytes:
    """The first n bytes of a path or a binary file object (whose position is left where it was)."""
    if hasattr(source, "read"):
        pos = source.tell()
        head = source.read(n)
        source.seek(pos)
        return head
    with open(source, "rb") as f:
        return f.read(n)


def voc_colormap(n: int = 256) -> np.ndarray:
    """The standard PASCAL VOC colour map: uint8 [n, 3]; e.g. 1 -> (128, 0, 0), 255 -> (224, 224, 192)."""
    cmap = np.zeros((n, 3), dtype=np.uint8)
    for i in range(n):
        c, r, g, b = i, 0, 0, 0
        for shift in range(7, -1, -1):
            r |= (c & 1) << shift
            g |= ((c >> 1) & 1) << shift
            b |= ((c >> 2) & 1) << shift
            c >>= 3
        cmap[i] = (r, g, b)
    return cmap


def colorize(label: np.ndarray, palette: np.ndarray, ignore_label: int = 255) -> np.ndarray:
    """Class indices [H, W] -> uint8 RGB [H, W, 3] for viewing: ``ignore_label`` white, indices outside
    the palette black."""
    label = np.asarray(label)
    if not np.issubdtype(label.dtype, np.integer):
        raise ValueError(f"label must hold integer class indices, got dtype {label.dtype}")
    palette = np.asarray(palette, dtype=np.uint8).reshape(-1, 3)
    out = np.zeros(label.shape + (3,), dtype=np.uint8)
    valid = (label >= 0) & (label < len(palette))
    out[valid] = palette[label[valid]]
    out[label == ignore_label] = 255
    return out


def _full_palette(palette: np.ndarray) -> np.ndarray:
    """Pad/truncate ``palette`` to the 256 entries a 'P' PNG holds; unset entry 255 is VOID_COLOUR."""
    palette = np.asarray(palette, dtype=np.uint8).reshape(-1, 3)[:256]
    full = np.zeros((256, 3), dtype=np.uint8)
    full[255] = VOID_COLOUR
    full[: len(palette)] = palette
    return full


def save_index_png(path: str | Path, label: np.ndarray, palette: np.ndarray) -> None:
    """Write class indices [H, W] in 0..255 as a palette ('P') PNG; `palette` [n, 3] is padded to 256."""
    label = np.asarray(label)
    if label.ndim != 2:
        raise ValueError(f"label must be 2-D [H, W], got shape {label.shape}")
    if label.dtype != np.uint8:
        if not np.issubdtype(label.dtype, np.integer) or (
            label.size and (label.min() < 0 or label.max() > 255)
        ):
            raise ValueError("label must hold integer class indices in 0..255")
        label = label.astype(np.uint8)
    img = Image.fromarray(np.ascontiguousarray(label))  # mode 'L'
    img.putpalette(_full_palette(palette).tobytes())  # turns it into mode 'P', same values
    img.save(path, format="PNG")


def read_label(path, name: str | None = None) -> np.ndarray:
    """Read a label PNG ('P', 'L', 'I;16' or 'I'; a path or binary file object) as uint8 class indices
    [H, W]; for 'P' images the palette indices, never the colours.

    `name`: how messages name the file (default: the path, or a file object's name, never its repr).
    Raises LossyLabel for a JPEG (by its first bytes), ValueError for colour images or values outside 0..255.
    """
    if name is None:
        name = getattr(path, "name", "label image") if hasattr(path, "read") else path
    if _head(path, len(JPEG_START)) == JPEG_START:
        raise LossyLabel(name)
    with Image.open(path) as img:
        mode = img.mode
        if mode in ("P", "L"):
            return np.array(img, dtype=np.uint8)
        if mode in ("RGB", "RGBA"):
            raise ValueError(
                f"{name}: colour (RGB) label image; expected a palette ('P') or "
                "single-channel ('L') PNG of class indices"
            )
        if mode == "I" or mode.startswith("I;16"):
            values = np.array(img)
            if values.size and (values.min() < 0 or values.max() > 255):
                raise ValueError(
                    f"{name}: {mode} label image holds values outside 0..255 "
                    f"(min {values.min()}, max {values.max()}); expected class indices 0..255"
                )
            return values.astype(np.uint8)
        raise ValueError(
            f"{name}: unsupported label image mode {mode!r}; expected a palette ('P') "
            "or single-channel ('L') PNG of class indices"
        )


def load_class_names(
    root: str | Path | None, num_classes: int, names: list[str] | None = None,
    classes_txt: str | None = None,
) -> list[str]:
    """The ``num_classes`` class names: ``names``, else ``root/classes.txt`` (one per non-empty line),
    else ``class_0 .. class_{n-1}``; ValueError if the count differs.

    `classes_txt`: that file's text when the caller read it (through tf.io.gfile, which this module must
    not import); None: read it here from a local ``root``.
    """
    if names is not None:
        names = [str(n) for n in names]
        if len(names) != num_classes:
            raise ValueError(f"got {len(names)} class names; expected num_classes={num_classes}")
        return names
    if root is not None:
        path = posixpath.join(str(root), "classes.txt")  # a string: pathlib would mangle a URL root
        if classes_txt is None and Path(path).is_file():
            classes_txt = Path(path).read_text(encoding="utf-8")
        if classes_txt is not None:
            found = [line.strip() for line in classes_txt.splitlines() if line.strip()]
            if len(found) != num_classes:
                raise ValueError(
                    f"{path}: has {len(found)} non-empty lines; expected one class name "
                    f"per line for num_classes={num_classes}"
                )
            return found
    return [f"class_{i}" for i in range(num_classes)]

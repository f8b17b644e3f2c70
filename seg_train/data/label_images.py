"""Label-image I/O and colour palettes (numpy/Pillow only, no TensorFlow).

Segmentation labels are stored as PNGs whose pixel values are class indices:
either palette ('P') images, where the stored value is the palette index and
the palette only controls how viewers display it (the PASCAL VOC convention),
or plain single-channel ('L') images.  Colour (RGB) label images are rejected
because their pixel values are colours, not classes, and so are JPEGs, whatever
their file name says: JPEG compression changes the values around every edge (a
greyscale JPEG decodes as 'L', so without the check it would pass as class
indices, most of its damaged values still in the class range).
"""

from __future__ import annotations

import posixpath
from pathlib import Path

import numpy as np
from PIL import Image

# Colour VOC uses for its "ignore" (void/boundary) value 255.
VOID_COLOUR = (224, 224, 192)

# A JPEG file starts with its start-of-image marker (FF D8), then the next marker's FF; Pillow and libjpeg
# recognise a JPEG by the same bytes.
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
    """Return the standard PASCAL VOC colour map.

    The colour of class ``i`` spreads the bits of ``i`` over the high bits of
    R, G and B (bit 0 -> R, bit 1 -> G, bit 2 -> B, repeated for higher bits),
    so that neighbouring class indices get very different colours.

    Args:
        n: number of entries.

    Returns:
        uint8 array of shape [n, 3]; e.g. 1 -> (128, 0, 0), 255 -> (224, 224, 192).
    """
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
    """Turn a map of class indices into an RGB image for viewing.

    Args:
        label: integer array [H, W] of class indices.
        palette: array [n, 3] of colours, one per class index.
        ignore_label: value drawn white, whatever the palette says.

    Returns:
        uint8 array [H, W, 3]; indices outside [0, n) other than ``ignore_label`` are black.
    """
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
    """Write class indices as a palette ('P') PNG.

    Args:
        path: output file.
        label: array [H, W] of class indices in 0..255 (uint8, or any integer dtype in range).
        palette: array [n, 3] of display colours; padded to 256 entries.
    """
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
    """Read a label PNG as class indices.

    For palette ('P') images the stored palette indices are returned, never
    the colours they are displayed with.

    Args:
        path: a 'P', 'L' or 16/32-bit integer ('I;16', 'I') image: a file path
            or a binary file object (e.g. the bytes of a file read elsewhere).
        name: how messages name the file (default: ``path``; for a file object, its name if it has
            one: never its repr).

    Returns:
        uint8 array [H, W].

    Raises:
        LossyLabel: for a JPEG (by its first bytes, whatever the name), before Pillow decodes anything.
        ValueError: for colour images, or integer images with values outside 0..255.
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
    """Return the names of the ``num_classes`` classes.

    Taken from ``names`` if given, else from ``root/classes.txt`` (one name per
    non-empty line) if that exists, else ``class_0 .. class_{n-1}``.

    Args:
        classes_txt: the text of ``root/classes.txt`` when the caller has read it
            (the reader reads it through tf.io.gfile: this module stays free of
            TensorFlow); None: read it here from a local ``root``, if it exists.

    Raises:
        ValueError: if ``names`` or classes.txt does not have exactly ``num_classes`` names.
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

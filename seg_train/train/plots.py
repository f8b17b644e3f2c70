"""Pictures for TensorBoard, drawn with numpy and Pillow: side-by-side panels and the confusion matrix.

No plotting library: a few rectangles and labels, text in Pillow's built-in font (scalable or bitmap:
text is measured before anything is placed, so the layout holds either way).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from seg_train.data.label_images import colorize

GAP = 4  # pixels between panels
GAP_COLOUR = (48, 48, 48)  # dark: white already means "ignored" in label panels
BLEND_ALPHA = 0.5  # weight of the prediction's colours over the image


def _font(size: int):
    try:
        return ImageFont.load_default(size=size)
    except TypeError:  # Pillow < 10.1: only the fixed bitmap font
        return ImageFont.load_default()


# ---- panels ---------------------------------------------------------------------------------------
def side_by_side(panels: Sequence[np.ndarray], gap: int = GAP) -> np.ndarray:
    """Panels uint8 [h, w, 3] of one height -> one uint8 image, `gap` dark pixels between neighbours."""
    h = panels[0].shape[0]
    if any(p.shape[0] != h or p.ndim != 3 for p in panels):
        raise ValueError(f"panels must be [h, w, 3] of one height, got {[p.shape for p in panels]}")
    sep = np.empty((h, gap, 3), np.uint8)
    sep[:] = GAP_COLOUR
    parts = []
    for i, p in enumerate(panels):
        if i:
            parts.append(sep)
        parts.append(p.astype(np.uint8, copy=False))
    return np.concatenate(parts, axis=1)


def blend(image: np.ndarray, colours: np.ndarray, alpha: float = BLEND_ALPHA) -> np.ndarray:
    """The colours [h, w, 3] laid over the image [h, w, 3] with weight `alpha` (both uint8)."""
    mixed = (1 - alpha) * image.astype(np.float32) + alpha * colours.astype(np.float32)
    return np.clip(np.round(mixed), 0, 255).astype(np.uint8)


def sample_panels(image: np.ndarray, label: np.ndarray, pred: np.ndarray, palette: np.ndarray,
                  ignore_label: int, overlay: bool) -> np.ndarray:
    """image | label | prediction (| prediction over the image) for one sample.

    `image` uint8 RGB [h, w, 3], `label` and `pred` class indices [h, w], `palette` colours [n, 3];
    ignored pixels are white in the label and prediction panels (the overlay shows every pixel).
    """
    label = np.asarray(label)
    pred = np.asarray(pred)
    marked = np.where(label == ignore_label, ignore_label, pred)
    panels = [image, colorize(label, palette, ignore_label), colorize(marked, palette, ignore_label)]
    if overlay:
        panels.append(blend(image, colorize(pred, palette, ignore_label)))
    return side_by_side(panels)


def fit(panel: np.ndarray, max_side: int, nearest: bool) -> np.ndarray:
    """Shrinks a uint8 [h, w(, 3)] picture so its longer side is at most `max_side` (never enlarges)."""
    h, w = panel.shape[:2]
    scale = max_side / max(h, w)
    if scale >= 1:
        return panel
    size = (max(1, round(w * scale)), max(1, round(h * scale)))
    # Nearest for class maps: averaging neighbouring classes' colours would invent colours.
    resample = Image.NEAREST if nearest else Image.BILINEAR
    return np.asarray(Image.fromarray(np.ascontiguousarray(panel)).resize(size, resample))


def pad_to_common(pictures: Sequence[np.ndarray]) -> np.ndarray:
    """uint8 [h_k, w_k, 3] pictures -> [K, max h, max w, 3], each padded right and below with GAP_COLOUR."""
    h = max(p.shape[0] for p in pictures)
    w = max(p.shape[1] for p in pictures)
    out = np.empty((len(pictures), h, w, 3), np.uint8)
    out[:] = GAP_COLOUR
    for k, p in enumerate(pictures):
        out[k, :p.shape[0], :p.shape[1]] = p
    return out


# ---- confusion matrix -------------------------------------------------------------------------------
CELL = 34  # cell side in pixels: fits "100" at the cell font and stays square up to 21+ classes
LOW, HIGH = np.array([255, 255, 255], np.float32), np.array([8, 48, 107], np.float32)  # white -> dark blue
EMPTY_ROW = (200, 200, 200)  # a class without ground-truth pixels: its row has no fractions
INK, PAPER = (20, 20, 20), (255, 255, 255)
MIN_TITLE_WIDTH = 360  # pixels the title may use however few the classes
MAX_NAME = 20  # characters of a class name before it is shortened with an ellipsis


def shade(fraction: float) -> float:
    """0..1 darkness of a cell holding `fraction` of its row (square root: small confusions stay visible)."""
    return float(np.sqrt(np.clip(fraction, 0.0, 1.0)))


def cell_colour(fraction: float) -> tuple[int, int, int]:
    """The colour of a cell holding `fraction` (0..1) of its row: white at 0, dark blue at 1."""
    rgb = LOW + (HIGH - LOW) * shade(fraction)
    return tuple(int(round(c)) for c in rgb)


def row_fractions(cm: np.ndarray) -> np.ndarray:
    """Each row divided by its sum (rows: ground truth); rows without pixels are NaN."""
    cm = np.asarray(cm, np.float64)
    sums = cm.sum(axis=1, keepdims=True)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(sums > 0, cm / np.where(sums > 0, sums, 1), np.nan)


def _short(name: str) -> str:
    name = str(name)
    return name if len(name) <= MAX_NAME else name[:MAX_NAME - 2] + ".."


def _count(n: int) -> str:
    for unit, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return str(int(n))


def _text_size(draw, text, font) -> tuple[int, int]:
    left, top, right, bottom = draw.textbbox((0, 0), text, font=font)
    return right, bottom


def _wrap(draw, text: str, font, width: int) -> list[str]:
    """`text` broken at spaces into lines at most `width` pixels wide (a longer word keeps its own line)."""
    lines: list[str] = []
    for word in text.split():
        if lines and _text_size(draw, lines[-1] + " " + word, font)[0] <= width:
            lines[-1] += " " + word
        else:
            lines.append(word)
    return lines


def _vertical_text(text: str, font, fill, background) -> Image.Image:
    """`text` drawn on its own strip and turned to read bottom-up (Pillow draws horizontally only)."""
    probe = ImageDraw.Draw(Image.new("RGB", (1, 1)))
    w, h = _text_size(probe, text, font)
    strip = Image.new("RGB", (w + 2, h + 2), background)
    ImageDraw.Draw(strip).text((1, 0), text, font=font, fill=fill)
    return strip.rotate(90, expand=True)


class MatrixLayout:
    """Where the cells of a confusion-matrix picture are: cell (r, c) spans
    x in [x0 + c * cell, x0 + (c + 1) * cell), y in [y0 + r * cell, ...)."""

    def __init__(self, x0: int, y0: int, cell: int):
        self.x0, self.y0, self.cell = x0, y0, cell

    def centre(self, row: int, col: int) -> tuple[int, int]:
        """(x, y) of the cell's centre pixel."""
        return self.x0 + col * self.cell + self.cell // 2, self.y0 + row * self.cell + self.cell // 2

    def swatch(self, row: int, col: int) -> tuple[int, int]:
        """(x, y) of a pixel of the cell's plain colour: off its grid line and clear of its text."""
        return self.x0 + col * self.cell + 3, self.y0 + row * self.cell + 3


def confusion_matrix_image(cm: np.ndarray, class_names: Sequence[str], title: str = "",
                           cell: int = CELL) -> tuple[np.ndarray, MatrixLayout]:
    """The confusion matrix as a picture: rows normalised, class names on both axes.

    Each cell shows, and is shaded by, the percentage of the row's ground-truth pixels predicted as
    the column's class. Rows without pixels are grey; each row ends with its pixel count, so a 100%
    from a handful of pixels is not mistaken for a reliable one.

    `cm`: int [C, C], rows ground truth; `title` is wrapped to the grid's width. Returns (uint8 RGB
    image, MatrixLayout of its cells).
    """
    cm = np.asarray(cm)
    c = cm.shape[0]
    if cm.shape != (c, c) or len(class_names) != c:
        raise ValueError(f"need a square matrix and one name per class, got {cm.shape} and {len(class_names)} names")
    frac = row_fractions(cm)
    names = [f"{i} {_short(n)}" for i, n in enumerate(class_names)]
    label_font, cell_font, title_font = _font(14), _font(12), _font(15)
    probe = ImageDraw.Draw(Image.new("RGB", (1, 1)))
    pad = 8
    name_w = max(_text_size(probe, n, label_font)[0] for n in names)
    line_h = _text_size(probe, "Ag", label_font)[1]
    counts = [_count(int(s)) for s in cm.sum(axis=1)]
    count_w = max(_text_size(probe, t, cell_font)[0] for t in counts + ["pixels"])
    axis_w = line_h + pad  # the rotated "ground truth" caption left of the row names

    x0 = pad + axis_w + name_w + pad
    width = x0 + c * cell + pad + count_w + pad
    # Wrapped by the grid's width (not the counts'), so the layout depends on the names and title only.
    title_lines = _wrap(probe, title, title_font, max(x0 + c * cell, MIN_TITLE_WIDTH) - pad) if title else []
    title_line_h = _text_size(probe, "Ag", title_font)[1] + 2
    title_h = len(title_lines) * title_line_h + pad if title else 0
    top_caption_h = line_h + pad  # "prediction" above the column names
    y0 = pad + title_h + top_caption_h + name_w + pad
    height = y0 + c * cell + pad
    width = max(width, pad + max((_text_size(probe, t, title_font)[0] for t in title_lines), default=0) + pad)
    img = Image.new("RGB", (width, height), PAPER)
    draw = ImageDraw.Draw(img)

    for i, line in enumerate(title_lines):
        draw.text((pad, pad + i * title_line_h), line, font=title_font, fill=INK)
    caption = "prediction"
    draw.text((x0, pad + title_h), caption, font=label_font, fill=INK)
    gt = _vertical_text("ground truth", label_font, INK, PAPER)
    img.paste(gt, (pad, y0 + max(0, (c * cell - gt.height) // 2)))

    for i, name in enumerate(names):
        w, h = _text_size(probe, name, label_font)
        draw.text((x0 - pad - w, y0 + i * cell + (cell - h) // 2), name, font=label_font, fill=INK)
        col = _vertical_text(name, label_font, INK, PAPER)
        img.paste(col, (x0 + i * cell + (cell - col.width) // 2, y0 - pad - col.height))

    for r in range(c):
        for k in range(c):
            x, y = x0 + k * cell, y0 + r * cell
            f = frac[r, k]
            fill = EMPTY_ROW if np.isnan(f) else cell_colour(f)
            draw.rectangle([x, y, x + cell - 1, y + cell - 1], fill=fill)
            if np.isnan(f) or cm[r, k] == 0:
                continue
            pct = 100 * f
            text = "<1" if pct < 0.5 else f"{pct:.0f}"
            tw, th = _text_size(probe, text, cell_font)
            ink = PAPER if shade(f) > 0.55 else INK
            draw.text((x + (cell - tw) // 2, y + (cell - th) // 2), text, font=cell_font, fill=ink)
        draw.text((x0 + c * cell + pad, y0 + r * cell + (cell - line_h) // 2), counts[r], font=cell_font, fill=INK)
    draw.text((x0 + c * cell + pad, y0 - pad - line_h), "pixels", font=cell_font, fill=INK)
    # Grid lines between cells keep neighbouring near-white cells apart.
    for i in range(c + 1):
        draw.line([x0 + i * cell - (i == c), y0, x0 + i * cell - (i == c), y0 + c * cell - 1], fill=(180, 180, 180))
        draw.line([x0, y0 + i * cell - (i == c), x0 + c * cell - 1, y0 + i * cell - (i == c)], fill=(180, 180, 180))
    return np.asarray(img), MatrixLayout(x0, y0, cell)

"""Predictions in the COCO formats other tools read: panoptic PNG + its JSON `annotations` entry (panopticapi,
cityscapesscripts' panoptic evaluator) and results JSON entries with RLE masks (pycocotools' COCOeval); numpy and
Pillow only.

COCO's RLE, written here because pycocotools is not a dependency: the mask flattened in column-major order (down
the first column, then the next), the lengths of alternating runs of 0s and 1s starting with 0s (a mask whose
first pixel is 1 starts with a run of length 0). The "counts" string is pycocotools' compressed form: each count
(from the fourth on, minus the count two before it) as a little-endian series of 5-bit groups with a continuation
bit, 6 bits per character, offset by 48 ('0').
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def rle_counts(mask) -> np.ndarray:
    """Run lengths [n] int64 of a 2-D mask in column-major order, starting with a (possibly empty) run of 0s."""
    flat = np.asarray(mask, bool).ravel(order="F")
    edges = np.flatnonzero(flat[1:] != flat[:-1]) + 1
    bounds = np.concatenate([[0], edges, [flat.size]])
    counts = np.diff(bounds)
    if flat.size and flat[0]:
        counts = np.concatenate([[0], counts])
    return counts.astype(np.int64)


def counts_to_string(counts: Sequence[int]) -> str:
    """pycocotools' compressed "counts" string of run lengths."""
    out = []
    for i, c in enumerate(counts):
        x = int(c) - (int(counts[i - 2]) if i > 2 else 0)
        more = True
        while more:
            group = x & 0x1F
            x >>= 5  # Python's >> floors, as the C code's arithmetic shift on a negative long
            more = x != -1 if group & 0x10 else x != 0
            out.append(chr(48 + (group | 0x20 if more else group)))
    return "".join(out)


def string_to_counts(s: str) -> np.ndarray:
    """The run lengths of a compressed "counts" string (counts_to_string's inverse)."""
    counts: list[int] = []
    p = 0
    while p < len(s):
        x, k, more = 0, 0, True
        while more:
            c = ord(s[p]) - 48
            x |= (c & 0x1F) << (5 * k)
            more = bool(c & 0x20)
            p += 1
            k += 1
            if not more and c & 0x10:
                x |= -1 << (5 * k)
        if len(counts) > 2:
            x += counts[-2]
        counts.append(x)
    return np.asarray(counts, np.int64)


def rle_encode(mask) -> dict:
    """A 2-D mask -> {"size": [H, W], "counts": str}, as pycocotools.mask.encode (its counts decoded to str)."""
    mask = np.asarray(mask)
    if mask.ndim != 2:
        raise ValueError(f"rle_encode takes one [H, W] mask, got shape {mask.shape}")
    return {"size": [int(mask.shape[0]), int(mask.shape[1])], "counts": counts_to_string(rle_counts(mask))}


def rle_decode(rle: dict) -> np.ndarray:
    """{"size": [H, W], "counts": str or bytes, or a list of run lengths} -> [H, W] bool."""
    h, w = (int(v) for v in rle["size"])
    counts = rle["counts"]
    if isinstance(counts, bytes):
        counts = counts.decode("ascii")
    counts = string_to_counts(counts) if isinstance(counts, str) else np.asarray(counts, np.int64)
    if counts.sum() != h * w:
        raise ValueError(f"RLE counts cover {counts.sum()} pixels, size {h} x {w} has {h * w}")
    values = np.arange(len(counts)) % 2 == 1
    return np.repeat(values, counts).reshape((w, h)).T


def instance_results(image_id: int, masks, scores, labels, category_ids: Sequence[int]) -> list[dict]:
    """COCO results entries for one image's instance predictions (mask_postprocess.InstancePrediction's masks,
    scores, labels): {image_id, category_id, segmentation (RLE), score}, in the given order. No "bbox": COCO's
    loadRes would take the area from it instead of the mask for segm evaluation.

    Args:
        category_ids: the data set's category id per train id.
    """
    return [{"image_id": int(image_id), "category_id": int(category_ids[int(label)]),
             "segmentation": rle_encode(mask), "score": float(score)}
            for mask, score, label in zip(masks, scores, labels)]


def id_to_rgb(segment_ids) -> np.ndarray:
    """[H, W] segment ids -> [H, W, 3] uint8: id = R + 256 G + 256^2 B (COCO panoptic's PNG encoding)."""
    ids = np.asarray(segment_ids, np.int64)
    if ids.min(initial=0) < 0 or ids.max(initial=0) >= 256 ** 3:
        raise ValueError("segment ids must lie in [0, 256^3)")
    return np.stack([ids % 256, ids // 256 % 256, ids // 256 ** 2], -1).astype(np.uint8)


def rgb_to_id(rgb) -> np.ndarray:
    """[H, W, 3] uint8 -> [H, W] int64 segment ids (id_to_rgb's inverse)."""
    rgb = np.asarray(rgb, np.int64)
    return rgb[..., 0] + 256 * rgb[..., 1] + 256 ** 2 * rgb[..., 2]


def write_panoptic_png(path, segment_ids) -> None:
    """The COCO panoptic PNG of a segment-id map (0 = no segment, VOID to the evaluators)."""
    from PIL import Image

    Image.fromarray(id_to_rgb(segment_ids)).save(path, format="PNG")


def _bbox(mask: np.ndarray) -> list[int]:
    rows, cols = np.flatnonzero(mask.any(1)), np.flatnonzero(mask.any(0))
    if rows.size == 0:
        return [0, 0, 0, 0]
    return [int(cols[0]), int(rows[0]), int(cols[-1] - cols[0] + 1), int(rows[-1] - rows[0] + 1)]


def panoptic_annotation(image_id, file_name: str, segment_ids, segments: Sequence[dict],
                        category_ids: Sequence[int]) -> dict:
    """The COCO panoptic JSON `annotations` entry of one image's prediction (mask_postprocess.PanopticPrediction's
    segment_ids and segments): {image_id, file_name, segments_info: [{id, category_id, iscrowd 0, area, bbox
    [x, y, w, h]}]}, category ids mapped from train ids. Segments without a pixel are left out (the evaluators
    refuse a segment missing from the PNG).

    Args:
        category_ids: the data set's category id per train id.
    """
    segment_ids = np.asarray(segment_ids)
    areas = np.bincount(segment_ids.ravel(), minlength=max([s["id"] for s in segments], default=0) + 1)
    info = []
    for s in segments:
        if areas[s["id"]] == 0:
            continue
        info.append({"id": int(s["id"]), "category_id": int(category_ids[int(s["category_id"])]), "iscrowd": 0,
                     "area": int(areas[s["id"]]), "bbox": _bbox(segment_ids == s["id"])})
    return {"image_id": image_id, "file_name": file_name, "segments_info": info}

"""The COCO writers (seg_train/infer/coco_format.py) held to pycocotools.mask's encode / decode / area and read
back as the evaluators read them (the evaluators' own round trips are in tests/test_panoptic_metrics.py and
tests/test_instance_metrics.py)."""

import json

import numpy as np
import pytest
from PIL import Image

from seg_train.infer import coco_format as F

pytest.importorskip("pycocotools")
from pycocotools import mask as mask_util  # noqa: E402


def masks(rng):
    """Empty, full, first pixel set, a single pixel, long runs (counts past 2^10 and 2^15, deltas negative and
    positive), random noise, thin stripes, on square, tall and wide shapes."""
    out = []
    for h, w in ((1, 1), (7, 5), (5, 7), (64, 64), (300, 220)):
        out += [np.zeros((h, w), bool), np.ones((h, w), bool), rng.random((h, w)) < 0.5, rng.random((h, w)) < 0.02]
        first = np.zeros((h, w), bool)
        first[0, 0] = True
        out.append(first)
        block = np.zeros((h, w), bool)
        block[h // 3:, : w // 2] = True
        out.append(block)
        stripes = np.zeros((h, w), bool)
        stripes[:, ::3] = True
        out.append(stripes)
    return out


def test_rle_encode_is_pycocotools():
    """counts string and size equal pycocotools.mask.encode's for every mask. Fails for: row-major order, the
    leading 0-run left out when the first pixel is set, the delta taken from i >= 2 instead of i > 2, the sign
    bit not carried, 32 characters instead of 64 per group."""
    for m in masks(np.random.default_rng(0)):
        ref = mask_util.encode(np.asfortranarray(m.astype(np.uint8)))
        got = F.rle_encode(m)
        assert got == {"size": list(ref["size"]), "counts": ref["counts"].decode("ascii")}, m.shape


def test_rle_decode_inverts_both_encoders():
    """rle_decode of our strings and of pycocotools' bytes gives the mask back, equal to pycocotools.mask.decode
    of ours; area is pycocotools' too. Fails for: the decode's column order or sign extension wrong."""
    for m in masks(np.random.default_rng(1)):
        ours = F.rle_encode(m)
        ref = mask_util.encode(np.asfortranarray(m.astype(np.uint8)))
        np.testing.assert_array_equal(F.rle_decode(ours), m)
        np.testing.assert_array_equal(F.rle_decode(ref), m)
        theirs = {"size": ours["size"], "counts": ours["counts"].encode("ascii")}
        np.testing.assert_array_equal(mask_util.decode(theirs).astype(bool), m)
        assert mask_util.area(theirs) == m.sum()
        np.testing.assert_array_equal(F.rle_decode({"size": ours["size"], "counts": F.rle_counts(m).tolist()}), m)


def test_instance_results_are_coco_results():
    """instance_results: one entry per mask, category ids mapped from train ids, JSON-ready, scores exact after a
    JSON round trip, no bbox. Fails for: train ids written as category ids, float32 scores rounded in JSON."""
    rng = np.random.default_rng(2)
    m = rng.random((3, 6, 9)) < 0.4
    scores = np.float32([0.1, 0.7000001, 0.3])
    out = json.loads(json.dumps(F.instance_results(12, m, scores, np.int32([2, 0, 1]), [5, 8, 13])))
    assert [r["category_id"] for r in out] == [13, 5, 8] and all(r["image_id"] == 12 for r in out)
    assert [np.float32(r["score"]) for r in out] == list(scores) and all("bbox" not in r for r in out)
    for r, mask in zip(out, m):
        np.testing.assert_array_equal(mask_util.decode({**r["segmentation"],
                                                        "counts": r["segmentation"]["counts"].encode()}), mask)


def test_panoptic_png_and_annotation(tmp_path):
    """The PNG decodes (R + 256 G + 256^2 B) to the ids, the annotation lists each segment with pixels, its
    category id mapped, area and bbox; segments without a pixel are left out. Fails for: channels in BGR order,
    a palette PNG, train ids written, an empty segment listed (the evaluators refuse it)."""
    ids = np.zeros((5, 6), np.int64)
    ids[1:3, 2:5] = 70000  # all three channels non-zero
    ids[4, 0] = 3
    F.write_panoptic_png(tmp_path / "p.png", ids)
    img = Image.open(tmp_path / "p.png")
    assert img.mode == "RGB"
    rgb = np.asarray(img).astype(np.int64)
    np.testing.assert_array_equal(rgb[..., 0] + 256 * rgb[..., 1] + 256 ** 2 * rgb[..., 2], ids)
    np.testing.assert_array_equal(F.rgb_to_id(rgb), ids)
    segments = [{"id": 3, "category_id": 0}, {"id": 70000, "category_id": 1}, {"id": 9, "category_id": 1}]
    ann = F.panoptic_annotation(4, "p.png", ids, segments, [17, 23])
    assert ann == {"image_id": 4, "file_name": "p.png", "segments_info": [
        {"id": 3, "category_id": 17, "iscrowd": 0, "area": 1, "bbox": [0, 4, 1, 1]},
        {"id": 70000, "category_id": 23, "iscrowd": 0, "area": 6, "bbox": [2, 1, 3, 2]}]}

"""EoMT's panoptic and instance post-processing (seg_train/infer/mask_postprocess.py) held to Hugging Face
transformers' EomtImageProcessor post_process_panoptic_segmentation / post_process_instance_segmentation and to
Mask2FormerImageProcessor's top-k over (query, class) pairs, through tests/fixtures/eomt_postprocess.npz (written
by scripts/reference_eomt_postprocess.py): crafted cases (nothing kept, ties, stuff merged, the area ratio at
exactly 0.8 and below) and random ones.

Exactness: segments exactly, scores to the 6 decimals transformers rounds them to, pixels exactly but where float32
cannot decide (check_panoptic says which)."""

import numpy as np
import pytest

from seg_train.infer import mask_postprocess as P

FIXTURE = "tests/fixtures/eomt_postprocess.npz"


@pytest.fixture(scope="module")
def ref():
    return dict(np.load(FIXTURE))


def case(ref, c):
    return {k[len(f"c{c}_"):]: v for k, v in ref.items() if k.startswith(f"c{c}_")}


def is_thing(ref):
    return [c not in set(ref["stuff_classes"].tolist()) for c in range(int(ref["num_classes"]))]


def cases(ref):
    return [case(ref, c) for c in range(int(ref["num_cases"]))]


def check_panoptic(got, r, logits):
    """Segments exactly; pixels exactly except where float32 cannot tell: the two largest probability x mask
    values of the kept queries within 1e-6 of each other (torch's sigmoid and softmax differ from numpy's by an
    ulp), or the owner's logit within 1e-4 of 0 (the resize's float32 sums)."""
    want = [(int(i) + 1, int(label), float(score)) for i, label, score in r["pan_segments"]]
    assert [(s["id"], s["category_id"], round(s["score"], 6)) for s in got.segments] == want
    differ = np.argwhere(got.segment_ids != r["pan_segmentation"] + 1)
    if differ.size:
        probs = np.exp(r["class_logits"] - r["class_logits"].max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        kept = np.flatnonzero((probs.argmax(-1) < probs.shape[1] - 1) & (probs.max(-1) > 0.8))
        for y, x in differ:
            value = probs[kept].max(-1) / (1 + np.exp(-logits[kept, y, x].astype(np.float64)))
            top = np.sort(value)[-2:]
            near_tie = top.size == 2 and top[1] - top[0] < 1e-6
            assert near_tie or np.abs(logits[kept, y, x]).min() < 1e-4, (y, x, value, logits[kept, y, x])
        assert len(differ) <= 3, differ


def test_panoptic_matches_transformers_from_logits_at_the_image(ref):
    """Every case from the mask logits as transformers resized them: the same segment map (ids + 1) and the same
    segments (id, class, score). Fails for: queries kept at probability >= 0.5 instead of > 0.8, the no-object
    class allowed, pixels to the largest mask alone (not probability x mask), the area ratio against the pixels
    won (not those at sigmoid >= 0.5), a ratio of exactly 0.8 dropped, stuff of one class not merged, things
    merged, a tie given to the later query, a dropped segment's pixels given to another."""
    for c, r in enumerate(cases(ref)):
        got = P.panoptic_prediction(r["class_logits"], r["resized"], is_thing(ref))
        check_panoptic(got, r, r["resized"])
        if c == 0:
            assert got.segments == [] and not got.segment_ids.any()


def test_panoptic_from_the_models_logits_resizes_as_the_reference(ref):
    """The same from the model's low-resolution mask logits with image_size and crop_size (resize to the crop,
    cut the padding, resize to the image). Fails for: the padding cut from the other side, the crop cut at the
    crop size instead of the scaled size, align_corners=True, a nearest resize."""
    for r in cases(ref):
        got = P.panoptic_prediction(r["class_logits"], r["mask_logits"], is_thing(ref),
                                    image_size=tuple(r["image"]), crop_size=tuple(r["crop"]))
        check_panoptic(got, r, r["resized"])


def test_resized_logits_are_torchs(ref):
    """resize_mask_logits against torch's interpolate + unpad_image, within 2e-5 (float32 sums). Fails for: the
    scaled size truncated instead of rounded (40 x 56 in a 32 crop), half-pixel centres off, no clamp at 0."""
    for r in cases(ref):
        got = P.resize_mask_logits(r["mask_logits"], tuple(r["image"]), tuple(r["crop"]))
        np.testing.assert_allclose(got, r["resized"], atol=2e-5)


def test_scaled_size_is_the_authors_rounding():
    """The authors' round(side * min(crop / H, crop / W)) on sizes worked out from their formula by hand.
    Fails for: the short side scaled to the crop (semantic's max), truncation (transformers': 621 x 639)."""
    assert P.scaled_size((480, 640), (640, 640)) == (480, 640)
    assert P.scaled_size((100, 103), (640, 640)) == (621, 640)
    assert P.scaled_size((500, 375), (640, 640)) == (640, 480)
    assert P.scaled_size((32, 48), (64, 64)) == (43, 64)
    assert P.scaled_size((1000, 1000), (640, 640)) == (640, 640)


def test_instance_scores_and_masks_match_eomts_transformers(ref):
    """With every pair kept (top_k = Q K), each query's pair with its best real class has transformers' EoMT
    label and score (class probability x mean mask probability inside mask logits > 0), and painting the
    non-empty masks in query order gives its segmentation. Fails for: the mask at sigmoid >= 0.5 taken as
    logits >= 0 in the mean, the mean over all pixels, the no-object probability not left out, masks at logits
    >= -1."""
    for r in cases(ref):
        q, k = r["class_logits"].shape[0], r["class_logits"].shape[1] - 1
        got = P.instance_prediction(r["class_logits"], r["resized"], top_k=q * k)
        best = np.argmax(r["class_logits"][:, :k], -1)
        painted = np.full(tuple(r["image"]), -1)
        rows = []
        for query in range(q):
            i = np.flatnonzero((got.queries == query) & (got.labels == best[query]))
            assert i.size == 1
            mask = got.masks[i[0]]
            if mask.any():
                painted[mask] = len(rows)
                rows.append((len(rows), int(best[query]), round(float(got.scores[i[0]]), 6)))
        assert rows == [(int(a), int(b), float(c)) for a, b, c in r["ins_segments"]]
        np.testing.assert_array_equal(painted, r["ins_segmentation"])


def test_instance_top_k_pairs_match_mask2formers(ref):
    """top_k = Q over Q x K pairs: the same (label, score, mask) set as transformers' Mask2Former processor (its
    384 x 384 masks, blocky from 16 x 16). Fails for: the top pairs by class probability x mask score instead
    of class probability alone, one class per query, the no-object column among the pairs."""
    block = 24
    for i in range(int(ref["num_m2f"])):
        cl, small = ref[f"m2f{i}_class_logits"], ref[f"m2f{i}_mask_logits"]
        big = np.repeat(np.repeat(small, block, 1), block, 2)
        got = P.instance_prediction(cl, big, top_k=cl.shape[0])
        assert len(got.scores) == cl.shape[0]
        ours = sorted((int(lab), round(float(s), 6), m[::block, ::block].tobytes())
                      for lab, s, m in zip(got.labels, got.scores, got.masks) if m.any())
        theirs = sorted((int(lab), float(s), m.tobytes()) for lab, s, m in
                        zip(ref[f"m2f{i}_labels"], ref[f"m2f{i}_scores"], ref[f"m2f{i}_masks"]))
        assert ours == theirs


def test_instance_ties_and_order_by_hand():
    """Ties written out: pairs tied at the top-k boundary go to the lower pair index; equal final scores keep
    pair order; output sorted by score; an empty mask stays with score 0. Fails for: ties to the higher index,
    output in pair order, empty masks dropped."""
    cl = np.log(np.array([[1, 1, 1e-9], [1, 1, 1e-9], [3, 1, 1e-9]], np.float32))  # pairs (0,0) = (0,1) = ... < (2,0)
    ml = np.full((3, 4, 4), -5.0, np.float32)
    ml[0, :2] = ml[1, :2] = 3.0  # queries 0 and 1: same mask; query 2: empty
    got = P.instance_prediction(cl, ml, top_k=3)
    # top 3 by class probability: (2, 0) at 0.75, then the tie at 0.5 between (0, 0), (0, 1), (1, 0), (1, 1)
    # goes to the lowest indices, (0, 0) and (0, 1); (2, 0) has an empty mask, so the lowest score.
    assert got.queries.tolist() == [0, 0, 2] and got.labels.tolist() == [0, 1, 0]
    assert got.scores[0] == got.scores[1] > 0 and got.scores[2] == 0 and not got.masks[2].any()


def test_panoptic_tie_goes_to_the_first_query_by_hand():
    """Two kept queries with the same class probability and mask: every pixel to the first (lowest index), the
    second is dropped (it wins nothing). Fails for: the tie to the later query."""
    cl = np.array([[9, 0, 0], [9, 0, 0]], np.float32)
    ml = np.full((2, 3, 3), 4.0, np.float32)
    got = P.panoptic_prediction(cl, ml, [True, True])
    assert [s["query"] for s in got.segments] == [0] and (got.segment_ids == 1).all()

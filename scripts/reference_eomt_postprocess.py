"""Writes tests/fixtures/eomt_postprocess.npz: Hugging Face transformers' EoMT post-processing (PyTorch) on small
crafted and random logits, the reference tests/test_mask_postprocess.py holds seg_train/infer/mask_postprocess.py to.

Runs ONLY in a separate venv, never a dependency of seg-train:
    python3 -m venv REFVENV && REFVENV/bin/pip install torch transformers pillow numpy
    REFVENV/bin/python scripts/reference_eomt_postprocess.py [--out tests/fixtures/eomt_postprocess.npz]

K = 5 classes (0, 1, 2 things; 3, 4 stuff), each case one image. Per case c the fixture holds, under the prefix
"c{c}_":
  class_logits [Q, K + 1], mask_logits [Q, h, w] (the model's outputs), image [2] (H, W), crop [2];
  resized [Q, H, W]: the mask logits as EomtImageProcessorPil brings them to the image (bilinear to the crop,
      the padding cut off, bilinear to the image; its unpad_image);
  panoptic: post_process_panoptic_segmentation(stuff_classes=[3, 4]) as pan_segmentation [H, W] (-1 = none)
      and pan_segments [S, 3] (id, label_id, score);
  instance: EoMT's post_process_instance_segmentation(threshold=0): every query with a non-empty mask, its
      best real class and class probability x mean mask probability, as ins_segmentation [H, W] (each pixel the
      last such query covering it, -1 = none) and ins_segments [S, 3] (id, label_id, score).
Crafted cases (crop 48, mask logits already 48 x 48, so the resizes are exact copies): 0 no query kept; 1 ties
(two queries with equal probability x mask on a region, two identical queries); 2 stuff of one class in two
queries merged, two things of one class kept apart; 3 a segment at final / original area exactly 0.8 (kept) and
one at 0.7 (dropped, its pixels left unassigned). Random cases: smooth blobs at 16 x 16, several crops and
orientations.

Top-k over (query, class) pairs: EoMT's transformers post-processing keeps one class per query; the EoMT authors'
evaluation takes the top 100 (query, class) pairs by class probability, the same selection as transformers'
Mask2FormerImageProcessorPil.post_process_instance_segmentation with k = Q. It is run on 384 x 384 mask logits
(its fixed working size, so its own resize is an exact copy), blocky from 16 x 16 (np.repeat by 24, exactly
reproduced by the test), threshold 0, return_binary_maps: m2f{i}_class_logits [Q, K + 1], m2f{i}_mask_logits
[Q, 16, 16], m2f{i}_labels [S], m2f{i}_scores [S] and m2f{i}_masks [S, 16, 16] (the 384 x 384 masks, checked
blocky, at one pixel per block).
"""

import argparse
import types

import numpy as np
import torch
from transformers.image_transforms import get_size_with_aspect_ratio
from transformers.models.eomt.image_processing_pil_eomt import EomtImageProcessorPil
from transformers.models.mask2former.image_processing_pil_mask2former import Mask2FormerImageProcessorPil

K = 5
STUFF = [3, 4]
H, W = 32, 48
M2F_SIZE, M2F_BLOCK = 384, 24


def authors_scaled_size(image, crop):
    """The EoMT repository's scale_img_size_instance_panoptic: round(side * min(crop / H, crop / W))."""
    factor = min(crop[0] / image[0], crop[1] / image[1])
    return round(image[0] * factor), round(image[1] * factor)


def logits_with(rows):
    """[Q, K + 1] class logits: row q strongly (logit 8) for its class, or near-uniform (None)."""
    out = np.zeros((len(rows), K + 1), np.float32)
    for q, c in enumerate(rows):
        if c is not None:
            out[q, c] = 8.0
    return out


def crafted():
    cases = []
    # 0: no query kept: no-object wins, or the best real class below 0.8.
    cl = logits_with([K, K, None, 1])
    cl[3, 1], cl[3, 2] = 3.0, 2.5  # class 1 at about 0.5
    cases.append((cl, np.full((4, 48, 48), 2.0, np.float32)))

    # 1: ties. q0 and q1 identical in class and in mask on columns 0..5 (q0 wins them); q1 alone on 6..39, kept
    # (1088 / 1280). q2 and q3 identical everywhere (q3 never wins a pixel). q4 stuff on columns 40..47.
    cl = logits_with([0, 0, 1, 1, 3])
    ml = np.full((5, 48, 48), -20.0, np.float32)
    ml[0, :32, :6] = 3.0
    ml[1, :32, :40] = 3.0
    ml[2, 2:8, 41:47] = 6.0
    ml[3, 2:8, 41:47] = 6.0
    ml[4, :, 40:] = 1.0
    cases.append((cl, ml))

    # 2: stuff class 3 in two queries (disjoint), stuff class 4 in one, thing class 1 in two queries (disjoint).
    cl = logits_with([3, 1, 3, 4, 1])
    ml = np.full((5, 48, 48), -20.0, np.float32)
    ml[0, :16, :] = 4.0
    ml[2, 16:24, :] = 4.0
    ml[3, 24:32, :] = 4.0
    ml[1, 2:8, 2:10] = 9.0
    ml[4, 26:30, 30:40] = 9.0
    cases.append((cl, ml))

    # 3: final / original area. q1 (thing 1) owns 10 pixels of which q0 (stronger) takes 2: 8 / 10 = 0.8, kept.
    # q2 (thing 2) owns 10 of which q0 takes 3: 0.7, dropped. q3 stuff everywhere else.
    cl = logits_with([0, 1, 2, 3])
    cl[0, 0] = 12.0
    ml = np.full((4, 48, 48), -20.0, np.float32)
    ml[1, 4, 10:20] = 5.0
    ml[0, 4, 18:20] = 9.0
    ml[2, 12, 10:20] = 5.0
    ml[0, 12, 17:20] = 9.0
    ml[3] = 0.5
    cases.append((cl, ml))
    return [(cl, ml, (H, W), (48, 48)) for cl, ml in cases]


def blobs(rng, q, size):
    """[q, size, size] mask logits: 1-3 Gaussian bumps per query minus an offset, plus a little noise."""
    yy, xx = np.mgrid[0:size, 0:size] + 0.5
    out = np.zeros((q, size, size))
    for i in range(q):
        for _ in range(rng.integers(1, 4)):
            cy, cx = rng.uniform(0, size, 2)
            s = rng.uniform(1.0, size / 5)
            out[i] += rng.uniform(4, 10) * np.exp(-((yy - cy) ** 2 + (xx - cx) ** 2) / (2 * s * s))
        out[i] -= rng.uniform(2, 4)
    return (out + rng.normal(0, 0.3, out.shape)).astype(np.float32)


def random_class_logits(rng, q):
    cl = rng.normal(0, 1, (q, K + 1))
    for i in range(q):
        cl[i, rng.integers(0, K + 1)] += rng.uniform(2, 9)
    return cl.astype(np.float32)


def random_cases(rng):
    shapes = [((32, 48), (64, 64), 8), ((32, 48), (64, 64), 10), ((48, 32), (64, 64), 8), ((40, 56), (32, 32), 10),
              ((30, 50), (64, 64), 8)]
    return [(random_class_logits(rng, q), blobs(rng, q, 16), image, crop) for image, crop, q in shapes]


def eomt_run(cl, ml, image, crop):
    size = {"shortest_edge": crop[0], "longest_edge": crop[1]}
    assert crop[0] == crop[1], "the EoMT processor's square crop"
    # Where the two resize rules agree (the authors round, transformers truncates some sizes).
    assert get_size_with_aspect_ratio(image, crop[0], crop[1]) == authors_scaled_size(image, crop), image
    proc = EomtImageProcessorPil(size=size)
    outputs = types.SimpleNamespace(class_queries_logits=torch.from_numpy(cl)[None],
                                    masks_queries_logits=torch.from_numpy(ml)[None])
    with torch.no_grad():
        up = torch.nn.functional.interpolate(outputs.masks_queries_logits, size=tuple(crop), mode="bilinear")
        resized = proc.unpad_image(up, [image], size)[0].numpy()
        pan = proc.post_process_panoptic_segmentation(outputs, target_sizes=[image], stuff_classes=STUFF, size=size)[0]
        ins = proc.post_process_instance_segmentation(outputs, target_sizes=[image], threshold=0.0, size=size)[0]

    def segs(r):
        return np.asarray([[s["id"], s["label_id"], s["score"]] for s in r["segments_info"]], np.float64).reshape(-1, 3)

    return dict(class_logits=cl, mask_logits=ml, image=np.int32(image), crop=np.int32(crop), resized=resized,
                pan_segmentation=r_int(pan["segmentation"]), pan_segments=segs(pan),
                ins_segmentation=r_int(ins["segmentation"]), ins_segments=segs(ins))


def r_int(t):
    return t.numpy().astype(np.int32)


def m2f_run(rng):
    q = 8
    cl = random_class_logits(rng, q)
    small = blobs(rng, q, M2F_SIZE // M2F_BLOCK)
    big = np.repeat(np.repeat(small, M2F_BLOCK, 1), M2F_BLOCK, 2)
    probs = torch.from_numpy(cl).softmax(-1)[:, :-1].flatten()
    kth = probs.sort(descending=True).values
    assert kth[q - 1] > kth[q], "a tie at the k-th pair: torch.topk's pick would be arbitrary"
    outputs = types.SimpleNamespace(class_queries_logits=torch.from_numpy(cl)[None],
                                    masks_queries_logits=torch.from_numpy(big)[None])
    with torch.no_grad():
        r = Mask2FormerImageProcessorPil().post_process_instance_segmentation(
            outputs, threshold=0.0, return_binary_maps=True)[0]
    masks = r["segmentation"].numpy().astype(bool)
    if not r["segments_info"]:
        masks = np.zeros((0, M2F_SIZE, M2F_SIZE), bool)
    small_masks = masks[:, ::M2F_BLOCK, ::M2F_BLOCK]
    assert np.array_equal(np.repeat(np.repeat(small_masks, M2F_BLOCK, 1), M2F_BLOCK, 2), masks)
    return dict(class_logits=cl, mask_logits=small,
                labels=np.int32([s["label_id"] for s in r["segments_info"]]),
                scores=np.float64([s["score"] for s in r["segments_info"]]), masks=small_masks)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="tests/fixtures/eomt_postprocess.npz")
    args = parser.parse_args()
    rng = np.random.default_rng(20250712)
    out = {"num_classes": np.int32(K), "stuff_classes": np.int32(STUFF)}
    cases = crafted() + random_cases(rng)
    for c, case in enumerate(cases):
        run = eomt_run(*case)
        if c < 4:  # crafted at crop = mask size: every resize an exact copy
            assert np.array_equal(run["resized"], case[1][:, :H, :W])
        for key, value in run.items():
            out[f"c{c}_{key}"] = value
        print(f"case {c}: panoptic segments (id, label, score)\n{run['pan_segments']}\n"
              f"instance segments\n{run['ins_segments']}")
    out["num_cases"] = np.int32(len(cases))
    m2f = [m2f_run(rng) for _ in range(3)]
    for i, run in enumerate(m2f):
        for key, value in run.items():
            out[f"m2f{i}_{key}"] = value
        print(f"mask2former {i}: labels {run['labels']} scores {run['scores']}")
    out["num_m2f"] = np.int32(len(m2f))
    np.savez_compressed(args.out, **out)


if __name__ == "__main__":
    main()

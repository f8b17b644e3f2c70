"""Writes tests/fixtures/eomt_loss.npz and tests/fixtures/eomt_loss_segments.npz: Hugging Face transformers'
EomtLoss / EomtHungarianMatcher (PyTorch) on small random inputs, the reference tests/test_eomt_loss.py holds
seg_train/objectives/mask_loss.py to.

Runs ONLY in a separate venv, never a dependency of seg-train:
    python3 -m venv REFVENV && REFVENV/bin/pip install torch transformers scipy numpy
    REFVENV/bin/python scripts/reference_eomt_loss.py [--out tests/fixtures/eomt_loss.npz]
        [--segments-out tests/fixtures/eomt_loss_segments.npz] [--only semantic|segments]

Inputs (fixed numpy seed): 2 images, 8 queries, 5 classes, 2 prediction layers of 16 x 16 mask logits,
64 x 64 label maps of Voronoi cells (boundaries off the pixel grid, so sampled targets are fractional),
image 0 with 3 classes, image 1 with all 5; no ignored pixel (the reference has no notion of one).
Targets as the EoMT image processor's convert_segmentation_map_to_binary_masks_fast builds them without an
ignore index (one mask per torch.unique label, ascending; written out here, that module needs torchvision). Two modes:
  grid    the reference's point sampling replaced by every pixel centre of the 16 x 16 prediction grid:
          torch.rand patched while its matcher runs, sample_points_using_uncertainty patched in its loss
          (importance sampling off). Deterministic: matched pairs and each term per layer.
  random  the reference's own sampling (train_num_points=RANDOM_POINTS), REPS runs with torch seeds 0..REPS-1:
          each term's mean and standard deviation per layer.

Segment targets (eomt_loss_segments.npz; the panoptic and instance tasks): the same shapes with 10 queries, 64 x 64
segment labels (value = class * 1000 + instance) of Voronoi cells: stuff classes 0, 2, 4 (instance 0), thing classes
1 and 3 with several instances each (one instance over two cells; the same instance number in both thing classes,
so only the pair tells segments apart). Targets as the EoMT authors' COCO panoptic parser builds them, one mask per
segment value present (`target == id`, class = value // 1000), in ascending value order; the instance task keeps
the thing instances only (COCO instance annotations have no stuff: its pixels are background in every mask). Both
modes for each task, arrays prefixed panoptic_ and instance_.
"""

import argparse
from unittest import mock

import numpy as np
import torch
from transformers import EomtConfig
from transformers.models.eomt.modeling_eomt import EomtLoss

B, Q, K, LAYERS, MASK, LABEL = 2, 8, 5, 2, 16, 64
RANDOM_POINTS, REPS = 1000, 1000
TERMS = ("loss_cross_entropy", "loss_mask", "loss_dice")
SEGMENT_QUERIES, INSTANCE_BASE = 10, 1000
# Per image, per Voronoi cell: (class, instance); classes 1 and 3 are things.
SEGMENT_CELLS = (
    [(0, 0), (0, 0), (0, 0), (2, 0), (2, 0), (1, 1), (1, 2), (1, 2), (1, 3), (3, 4), (3, 7), (0, 0)],
    [(0, 0), (4, 0), (4, 0), (1, 5), (1, 9), (3, 1), (3, 2), (3, 3), (1, 1), (0, 0), (4, 0), (3, 1)],
)


def inputs():
    rng = np.random.default_rng(20250611)
    labels = np.zeros((B, LABEL, LABEL), np.int64)
    yy, xx = np.mgrid[0:LABEL, 0:LABEL] + 0.5
    for i, present in enumerate(([0, 2, 3], [0, 1, 2, 3, 4])):
        cells = rng.uniform(0, LABEL, (12, 2))
        cell_class = np.concatenate([present, rng.choice(present, 12 - len(present))])
        nearest = np.argmin((yy[..., None] - cells[:, 0]) ** 2 + (xx[..., None] - cells[:, 1]) ** 2, axis=-1)
        labels[i] = cell_class[nearest]
    class_logits = rng.normal(0, 1.5, (LAYERS, B, Q, K + 1)).astype(np.float32)
    mask_logits = rng.normal(0, 2.0, (LAYERS, B, Q, MASK, MASK)).astype(np.float32)
    return labels, class_logits, mask_logits


def segment_inputs():
    rng = np.random.default_rng(20250712)
    labels = np.zeros((B, LABEL, LABEL), np.int64)
    yy, xx = np.mgrid[0:LABEL, 0:LABEL] + 0.5
    for i, cells_of in enumerate(SEGMENT_CELLS):
        cells = rng.uniform(0, LABEL, (len(cells_of), 2))
        value = np.asarray([c * INSTANCE_BASE + k for c, k in cells_of])
        nearest = np.argmin((yy[..., None] - cells[:, 0]) ** 2 + (xx[..., None] - cells[:, 1]) ** 2, axis=-1)
        labels[i] = value[nearest]
    class_logits = rng.normal(0, 1.5, (LAYERS, B, SEGMENT_QUERIES, K + 1)).astype(np.float32)
    mask_logits = rng.normal(0, 2.0, (LAYERS, B, SEGMENT_QUERIES, MASK, MASK)).astype(np.float32)
    return labels, class_logits, mask_logits


def targets(labels):
    masks, classes = [], []
    for lab in torch.from_numpy(labels):
        present = torch.unique(lab)
        masks.append(torch.stack([lab == c for c in present]).float())
        classes.append(present.long())
    return masks, classes


def segment_targets(labels, things_only):
    """The authors' COCO panoptic target_parser: one mask per segment id, its category; instance: things only."""
    masks, classes = [], []
    for lab in torch.from_numpy(labels):
        present = [v for v in torch.unique(lab).tolist() if not things_only or v % INSTANCE_BASE]
        masks.append(torch.stack([lab == v for v in present]).float())
        classes.append(torch.tensor([v // INSTANCE_BASE for v in present], dtype=torch.long))
    return masks, classes


def grid_centres():
    c = (torch.arange(MASK, dtype=torch.float32) + 0.5) / MASK
    y, x = torch.meshgrid(c, c, indexing="ij")
    return torch.stack([x, y], -1).reshape(1, -1, 2)


def make_loss(num_points):
    config = EomtConfig(num_labels=K, train_num_points=num_points)
    return EomtLoss(config, weight_dict={"loss_cross_entropy": config.class_weight,
                                         "loss_mask": config.mask_weight, "loss_dice": config.dice_weight})


def row_of_col(indices, num_valid, slots=K):
    out = np.full((B, slots), -1, np.int32)
    for i, (rows, cols) in enumerate(indices):
        assert len(rows) == num_valid[i]
        out[i, cols.numpy()] = rows.numpy()
    return out


def run(class_logits, mask_logits, masks, classes, slots):
    """(grid matches [LAYERS, B, slots], grid terms [term, layer], random mean and std [term, layer])."""
    num_valid = [len(c) for c in classes]
    grid = grid_centres()
    loss = make_loss(MASK * MASK)
    loss.sample_points_using_uncertainty = lambda logits, *a, **k: grid.repeat(logits.shape[0], 1, 1)

    def fake_rand(*shape, **kwargs):
        assert tuple(shape) == (1, MASK * MASK, 2), shape
        return grid.clone()

    matches, grid_terms = [], []
    with torch.no_grad(), mock.patch("torch.rand", fake_rand):
        for layer in range(LAYERS):
            m, c = torch.from_numpy(mask_logits[layer]), torch.from_numpy(class_logits[layer])
            matches.append(row_of_col(loss.matcher(m, c, masks, classes), num_valid, slots))
            out = loss(masks_queries_logits=m, class_queries_logits=c, mask_labels=masks, class_labels=classes)
            grid_terms.append([out[t].item() for t in TERMS])

    loss = make_loss(RANDOM_POINTS)
    draws = np.zeros((REPS, LAYERS, len(TERMS)))
    with torch.no_grad():
        for rep in range(REPS):
            torch.manual_seed(rep)
            for layer in range(LAYERS):
                out = loss(masks_queries_logits=torch.from_numpy(mask_logits[layer]),
                           class_queries_logits=torch.from_numpy(class_logits[layer]),
                           mask_labels=masks, class_labels=classes)
                draws[rep, layer] = [out[t].item() for t in TERMS]
    return np.stack(matches), np.asarray(grid_terms, np.float64).T, draws.mean(0).T, draws.std(0, ddof=1).T


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="tests/fixtures/eomt_loss.npz")
    parser.add_argument("--segments-out", default="tests/fixtures/eomt_loss_segments.npz")
    parser.add_argument("--only", choices=("semantic", "segments"))
    args = parser.parse_args()
    if args.only != "segments":
        labels, class_logits, mask_logits = inputs()
        masks, classes = targets(labels)
        matches, grid_terms, mean, std = run(class_logits, mask_logits, masks, classes, K)
        np.savez_compressed(
            args.out, labels=labels.astype(np.uint8), class_logits=class_logits, mask_logits=mask_logits,
            num_valid=np.asarray([len(c) for c in classes], np.int32), grid_matches=matches,
            grid_terms=grid_terms,  # [term, layer] in TERMS order
            random_points=np.int32(RANDOM_POINTS), random_reps=np.int32(REPS), random_mean=mean, random_std=std)
        print("grid terms [term, layer]:\n", grid_terms)
        print("random mean [term, layer]:\n", mean, "\nstd:\n", std)
        print("matches:\n", matches)
    if args.only != "semantic":
        labels, class_logits, mask_logits = segment_inputs()
        out = dict(labels=labels.astype(np.int32), class_logits=class_logits, mask_logits=mask_logits,
                   random_points=np.int32(RANDOM_POINTS), random_reps=np.int32(REPS))
        for task in ("panoptic", "instance"):
            masks, classes = segment_targets(labels, things_only=task == "instance")
            matches, grid_terms, mean, std = run(class_logits, mask_logits, masks, classes, SEGMENT_QUERIES)
            out.update({f"{task}_num_valid": np.asarray([len(c) for c in classes], np.int32),
                        f"{task}_grid_matches": matches, f"{task}_grid_terms": grid_terms,
                        f"{task}_random_mean": mean, f"{task}_random_std": std})
            print(task, "grid terms [term, layer]:\n", grid_terms, "\nmatches:\n", matches)
        np.savez_compressed(args.segments_out, **out)


if __name__ == "__main__":
    main()

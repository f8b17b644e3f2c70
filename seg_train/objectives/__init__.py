"""What the train step minimises, one objective per kind of head, chosen once when the step is built.

  per_pixel.py            PerPixel: the per-pixel heads' loss (cross-entropy, top-k / OHEM mining, Lovasz, Dice,
                          class weights), from pixel_losses.py
  mask_classification.py  MaskClassification: EoMT's matching of queries to target masks and its class / mask /
                          dice terms (mask_loss.py, matching.py), with the annealed masked attention

The interface the step calls (train/step.py), the same for every head, so the step has no head branch:

  objective.prepare(labels)   in a tower's replica context, before its pass: what the objective needs from the
                              WHOLE global batch (it may all-reduce), as a nest of tensors (`()` when nothing)
  objective.context_spec()    that nest's tf.TensorSpecs (the tower pass is traced once for every tower)
  objective.micro(tv, st, images, labels, sample_ids, step, context)
      -> micro.Micro(loss_sum, normalizer, new_state, predict): one micro-batch's loss SUM and NORMALIZER (the step
         divides the sum over towers and micro-batches of the sums by the sum of the normalizers), the model's new
         non-trainable values (its BN statistics), and a function giving its per-pixel class scores [b, h, w, K]
         (the image summaries' predictions, computed only when asked)
  objective.compile_tower     whether train.jit_compile XLA-compiles the whole tower pass (True), or the objective
                              compiles only what XLA can take itself (False: the model's forward)

Which objective a model takes is its family's (models.objective_of); `objective_for` maps that name to the class.
"""

from __future__ import annotations

from seg_train import models
from seg_train.objectives.mask_classification import MaskClassification
from seg_train.objectives.per_pixel import PerPixel

OBJECTIVES = {"per_pixel": PerPixel, "mask_classification": MaskClassification}


def objective_for(model, cfg, class_weights=None):
    """The objective of `model` built from `cfg` (its family's kind). `class_weights`: the per-class loss weights
    data/class_weights.py computed for loss.class_weights (per-pixel objectives only)."""
    return OBJECTIVES[models.objective_of(cfg.model)](model, cfg, class_weights)

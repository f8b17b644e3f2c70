"""The per-pixel heads' objective: the model's logits [b, h, w, K] against the labels by pixel_losses.py's
objective_sum (loss.type / loss.terms, class weights, top-k or OHEM mining), as a sum and its normaliser."""

from __future__ import annotations

import numpy as np

from seg_train.config import ConfigError
from seg_train.objectives.micro import Micro
from seg_train.objectives.pixel_losses import objective_sum


class PerPixel:
    """The per-pixel objective of one model and config (objectives/__init__.py's interface).

    `class_weights`: data/class_weights.py's weights, needed when loss.class_weights names a scheme; a list in the
    config is used as it is.
    """

    compile_tower = True  # train.jit_compile: the whole tower pass in one XLA cluster

    def __init__(self, model, cfg, class_weights=None):
        if class_weights is None and cfg.loss.class_weights is not None:
            if isinstance(cfg.loss.class_weights, str):
                raise ConfigError("class weights not computed", "loss.class_weights",
                                  "the weights from the train split's histogram (data/class_weights.py)")
            class_weights = cfg.loss.class_weights
        self.model, self.loss = model, cfg.loss
        self.ignore_label = cfg.data.ignore_label
        self.class_weights = None if class_weights is None else np.asarray(class_weights, np.float32)

    def prepare(self, labels):
        return ()

    def context_spec(self):
        return ()

    def micro(self, tv, st, images, labels, sample_ids, step, context) -> Micro:
        logits, new_state = self.model.stateless_call(tv, st, images, training=True)
        loss = self.loss
        loss_sum, normalizer = objective_sum(logits, labels, self.ignore_label, self.class_weights,
                                             loss.top_k_percent_pixels, loss.term_weights(), loss.ohem_threshold,
                                             loss.ohem_min_kept)
        return Micro(loss_sum, normalizer, new_state, lambda: logits)

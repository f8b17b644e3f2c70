"""The mask-classification objective (EoMT's; objectives/__init__.py's interface): the masked-attention
probabilities of the step, each sample's seeds, the forward pass with every intermediate prediction, and the
mask-classification loss (mask_loss.py) as the tower's share of the global loss.

Exact over towers and micro-batches: the loss is sum over layers of 2 * class_sum / class_weight + 5 * (mask_sum +
dice_sum) / mask_count, each a sum over the WHOLE global batch divided by a whole-batch total. Both totals
depend on the labels only (mask_count: the classes present per image; class_weight: 1 per matched query, which
is every target, and the no-object weight for the other queries), so the step all-reduces them from the labels
BEFORE any forward pass (`prepare`, one tiny collective), and each tower differentiates its own numerators
over the global totals: the sum of the towers' gradients is the gradient of the global loss, whatever the split.
(transformers' EomtLoss all-reduces the mask count the same way; its class term is a per-process mean, which
is not split-invariant; on one process both agree.)

Randomness: the masked attention's keep draws and the loss's point draws come from each sample's global counter
(stochastic.sample_ids) and the run seed, salted apart; the annealed probability is a pure function of the
step. So 1 tower = N towers and a resumed run draws what the uninterrupted one drew.
"""

from __future__ import annotations

import keras
import tensorflow as tf

from seg_train.config.resolve import annealing_windows
from seg_train.models.eomt.eomt import semantic_logits
from seg_train.models.stochastic import salt as salt_of
from seg_train.objectives.mask_loss import EomtLossOptions, eomt_loss_terms, targets_of
from seg_train.objectives.micro import Micro
from seg_train.parallel import collectives

# The EoMT reference's annealing curve: p = (1 - progress) ** POWER over a block's window.
POWER = 0.9


def mask_probabilities(step, windows) -> tf.Tensor:
    """float32 [n]: block k's masked-attention probability at `step`: 1 before its window [start, end), 0 from its
    end, (1 - (step - start) / (end - start)) ** 0.9 inside. An empty window (start = end, as a short run derives
    some) holds no step, so those two rules are all of it: 1 before `start`, 0 from it (not 0/0)."""
    step = tf.cast(step, tf.float32)
    out = []
    for start, end in windows:
        if end == start:
            out.append(tf.where(step < float(start), 1.0, 0.0))
            continue
        progress = tf.clip_by_value((step - float(start)) / float(end - start), 0.0, 1.0)
        out.append(tf.pow(1.0 - progress, POWER))
    return tf.stack(out)


def sample_seeds(sample_ids, seed: int, purpose: str) -> tf.Tensor:
    """int32 [b, 2]: (the sample's global counter mod 2^31, a 31-bit salt of the run seed and `purpose`)."""
    ids = tf.cast(tf.math.floormod(tf.cast(sample_ids, tf.int64), 2 ** 31), tf.int32)
    salt = tf.fill(tf.shape(ids), tf.constant(salt_of(seed, f"eomt/{purpose}") % 2 ** 31, tf.int32))
    return tf.stack([ids, salt], axis=1)


class MaskClassification:
    """The EoMT loss of one model and config, for the train step (`class_weights`: not used; per-pixel only)."""

    compile_tower = False  # train.jit_compile: the model's forward alone (__init__)

    def __init__(self, model, cfg, class_weights=None):
        self.model, self.seed = model, cfg.seed
        self.windows = annealing_windows(cfg)
        self.queries = cfg.model.num_queries
        self.opts = EomtLossOptions(num_classes=cfg.data.num_classes, ignore_label=cfg.data.ignore_label,
                                    num_points=cfg.loss.mask_points, task=cfg.data.task)
        # train.jit_compile compiles the model's forward here (and so its gradient), not the whole tower pass:
        # the targets' slot count (the classes or segments a batch holds, mask_loss.py's compaction) and the
        # matcher's sizes inside its loops are data-dependent shapes, which XLA refuses ("Input 1 to node PadV2
        # must be a compile-time constant"; the matcher's Fill likewise); padding them to the worst case (every
        # class, every query) would multiply the loss's point sampling by K / G' for nothing. The attention, what
        # XLA fuses, is all in the forward. The forward's random draws are TensorFlow's under XLA too
        # (models/stochastic.py uniform), so the compiled step is the plain one to round-off.
        self.jit_compile = cfg.train.jit_compile

    def _forward(self, tv, st, images, probs, seeds):
        """(every layer's predictions, the model's new non-trainable values): the stateless training forward."""
        model = self.model
        mapping = list(zip(model.trainable_variables, tv)) + list(zip(model.non_trainable_variables, st))
        with keras.StatelessScope(state_mapping=mapping) as scope:
            predictions = model.predictions(images, probs, seeds, training=True)
        current = [scope.get_current_value(v) for v in model.non_trainable_variables]
        return predictions, [value if now is None else now for now, value in zip(current, st)]

    def local_totals(self, labels) -> tf.Tensor:
        """float32 [2]: (target masks, images) in this tower's labels [rows, H, W] (all its micro-batches): one
        mask per class present (semantic) or per segment, at most the queries' count (panoptic, instance)."""
        _, _, num_valid = targets_of(labels, self.opts, max_segments=self.queries)
        return tf.stack([tf.cast(tf.reduce_sum(num_valid), tf.float32), tf.cast(tf.shape(labels)[0], tf.float32)])

    def prepare(self, labels) -> tf.Tensor:
        """`local_totals` summed over every tower (replica context): the loss divides by whole-batch totals."""
        return collectives.all_reduce_sum([self.local_totals(labels)])[0]

    def context_spec(self):
        return tf.TensorSpec([2], tf.float32)

    def micro(self, tv, st, images, labels, sample_ids, step, totals) -> Micro:
        """One micro-batch (objectives/__init__.py's Micro); its `predict` gives the semantic logits.

        `totals`: `prepare`'s. loss_sum / normalizer summed over the towers and micro-batches is the global loss:
        loss_sum = (this micro-batch's share) x (global images), normalizer = its rows (module doc)."""
        probs = mask_probabilities(step, self.windows)
        forward = tf.function(self._forward, jit_compile=True, autograph=False) if self.jit_compile else self._forward
        predictions, new_state = forward(tv, st, images, probs, sample_seeds(sample_ids, self.seed, "mask"))
        terms = eomt_loss_terms(predictions, labels, sample_seeds(sample_ids, self.seed, "points"), self.opts)
        masks, images_total = totals[0], totals[1]
        o = self.opts
        class_total = o.no_object_weight * (images_total * self.queries - masks) + masks
        count = tf.maximum(masks, 1.0)
        share = tf.reduce_sum(o.class_weight * terms["class_sum"] / class_total
                              + (o.mask_weight * terms["mask_sum"] + o.dice_weight * terms["dice_sum"]) / count)
        rows = tf.cast(tf.shape(labels)[0], tf.float32)
        class_logits, mask_logits = predictions[-1]
        scores = semantic_logits if self.opts.task == "semantic" else query_scores
        return Micro(share * images_total, rows, new_state,
                     lambda: scores(class_logits, mask_logits, tf.shape(images)[1:3]))


def query_scores(class_logits, mask_logits, size):
    """[b, H, W, Q] float32: each query's best real-class probability x sigmoid(its mask logits resized bilinearly to
    `size`), whose argmax is the query that owns a pixel in the panoptic post-processing before its thresholds (the
    training pictures of the panoptic and instance tasks)."""
    masks = tf.image.resize(tf.transpose(tf.cast(mask_logits, tf.float32), [0, 2, 3, 1]), size, method="bilinear")
    probs = tf.reduce_max(tf.nn.softmax(tf.cast(class_logits, tf.float32), axis=-1)[..., :-1], axis=-1)
    return tf.sigmoid(masks) * probs[:, tf.newaxis, tf.newaxis, :]

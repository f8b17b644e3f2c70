"""Full-resolution evaluation: one confusion matrix over every labelled pixel of a split -> mIoU.

- Each tower predicts one whole, unpadded image per step with the inference modes (modes.py), so
  padding is never counted; towers without an image in the last step get an all-ignore dummy.
- Counts are a per-row product of one-hot matrices in float32 (exact: a row has far fewer than 2**24
  pixels), summed in int64, so any number of towers gives the identical matrix. Not tf.math.bincount:
  it has no deterministic GPU kernel, which train.deterministic refuses.
- The step is traced once for unknown image sizes.

An `Evaluator`, built once per TrainState and inference setup, owns the eval step, precise BN's
probe and the eval examples' serving module, so evaluations during a run trace each once.
"""

from __future__ import annotations

import itertools

import tensorflow as tf

from seg_train import models
from seg_train.config import Config, ConfigError
from seg_train.data.feed import Feed
from seg_train.data.reader import ImageReader
from seg_train.infer import modes
from seg_train.infer.examples import NUM_EXAMPLES, predict_examples
from seg_train.infer.metrics import SegMetrics, compute_metrics
from seg_train.infer.precise_bn import PreciseBN
from seg_train.infer.serving import mask_serving_module, serving_module
from seg_train.parallel.towers import TowerPass
from seg_train.util.progress import progress_bar


# ---- the evaluation itself ----------------------------------------------------------------------
def confusion_counts(labels, preds, num_classes: int, ignore_label: int):
    """int64 [C * C] counts of (label, prediction) pairs (row-major: label * C + prediction).

    labels, preds: integer [1, H, W] (or [H, W]); `ignore_label` pixels (and any label outside
    [0, C)) count nothing. Deterministic on GPUs too (module doc).
    """
    c = num_classes
    labels = tf.cast(tf.reshape(labels, tf.shape(labels)[-2:]), tf.int32)
    preds = tf.cast(tf.reshape(preds, tf.shape(preds)[-2:]), tf.int32)
    labels = tf.where(tf.equal(labels, ignore_label), -1, labels)  # one_hot(-1) is all zeros
    onehot_l = tf.one_hot(labels, c, dtype=tf.float32)  # [H, W, C]
    onehot_p = tf.one_hot(preds, c, dtype=tf.float32)
    rows = tf.matmul(onehot_l, onehot_p, transpose_a=True)  # [H, C, C], exact per row
    return tf.reshape(tf.reduce_sum(tf.cast(rows, tf.int64), axis=0), [c * c])


def _make_eval_step(state, eval_cfg, offsets):
    """A tf.function (N images, N labels; one per tower) -> int64 counts [C * C] summed over the towers."""
    model, strategy = state.model, state.strategy
    c, ignore = state.cfg.data.num_classes, state.cfg.data.ignore_label
    pad_to = models.input_multiple(model)

    def body(tv, st, image, label):
        def model_fn(x):
            return model.stateless_call(tv, st, x, training=False)[0]

        scores = modes.class_scores(model_fn, image, eval_cfg, c, pad_to=pad_to, offsets=offsets)
        pred = tf.argmax(scores, axis=-1, output_type=tf.int32)
        return confusion_counts(label, pred, c, ignore)

    n = strategy.num_replicas_in_sync
    multiworker = isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy)
    # One trace for all image sizes: n images and n labels of unknown height and width.
    image_spec, label_spec = tf.TensorSpec([1, None, None, 3], tf.float32), tf.TensorSpec([1, None, None], tf.uint8)

    @tf.function(input_signature=[[image_spec] * n, [label_spec] * n], autograph=False)
    def step(images, labels):
        def tower_input(ctx):
            i = ctx.replica_id_in_sync_group
            # tf.identity under the replica's device scope places the sample on that tower.
            return tf.identity(images[i]), tf.identity(labels[i])

        # The variable lists as they are now: freezing a layer moves its weights between them.
        tower = TowerPass(body, model.trainable_variables, model.non_trainable_variables).trace(image_spec, label_spec)
        counts = strategy.run(tower, strategy.experimental_distribute_values_from_function(tower_input))
        if multiworker:
            # Each worker holds only its own towers' counts: sum them over the workers too.
            return strategy.reduce(tf.distribute.ReduceOp.SUM, counts, axis=None)
        return tf.add_n(strategy.experimental_local_results(counts))

    return step


class Evaluator:
    """Evaluation of a TrainState with fixed inference modes; owns its compiled functions (module doc).

    Args:
      eval_cfg: the inference modes (an EvalConfig; default: the state's config's `eval`).
      score_offsets: modes.score_offsets' result; required exactly when eval_cfg.logit_adjustment is set.
    """

    def __init__(self, state, eval_cfg=None, score_offsets=None):
        self.state = state
        self.eval_cfg = state.cfg.eval if eval_cfg is None else eval_cfg
        if bool(self.eval_cfg.logit_adjustment) != (score_offsets is not None):
            raise ValueError("eval.logit_adjustment and the offsets passed disagree (modes.score_offsets)")
        self.score_offsets = score_offsets
        self.precise_bn = PreciseBN(state)
        self._step = None  # the eval step, traced at the first evaluation
        self._examples = None  # the eval examples' serving module, traced at their first prediction
        self._mask_step = None  # data.task panoptic / instance: their eval step (mask_evaluate.make_step)
        self._mask_examples = []  # ... and the pictures of their last evaluation

    def evaluate(self, reader: ImageReader, class_names, progress: bool = True) -> tuple[SegMetrics, int]:
        """Evaluates the state's model on every image of `reader`'s split at full resolution.

        Returns:
          (metrics from the summed confusion matrix, number of images evaluated); for data.task panoptic and
          instance (metrics: mask_evaluate.MaskScores, PQ or mask AP, number of images evaluated).
        """
        state = self.state
        c = state.cfg.data.num_classes
        if len(class_names) != c:
            raise ConfigError("wrong number of class names", "data.class_names",
                              f"expected {c} names (data.num_classes), got {len(class_names)}")
        if state.cfg.data.task != "semantic":
            return self._evaluate_masks(reader, class_names, progress)
        if reader.cfg.ignore_label != state.cfg.data.ignore_label:
            raise ValueError("the reader and the state disagree on data.ignore_label")
        if self._step is None:
            self._step = _make_eval_step(state, self.eval_cfg, self.score_offsets)
        n = state.strategy.num_replicas_in_sync
        dummy = (tf.zeros([1, 32, 32, 3], tf.float32),
                 tf.fill([1, 32, 32], tf.constant(reader.cfg.ignore_label, tf.uint8)))  # all ignored
        total = tf.zeros([c * c], tf.int64)
        num_images = 0
        samples = Feed(reader.eval_dataset(pad_to=1))  # unpadded: the inference modes pad each forward pass
        with progress_bar(len(reader), f"eval {reader.split}", enabled=progress) as bar:
            while True:
                group = [(image, label) for image, label, _ in itertools.islice(samples, n)]
                if not group:
                    break
                real = len(group)
                group += [dummy] * (n - real)  # towers without an image count nothing
                images, labels = zip(*group)
                total += self._step(list(images), list(labels))
                num_images += real
                bar.update(real)
        cm = total.numpy().reshape(c, c)
        if not cm.any():
            raise ConfigError("no labelled pixels", f"split {reader.split}",
                              f"expected pixels whose label is not data.ignore_label ({reader.cfg.ignore_label})")
        return compute_metrics(cm), num_images

    def _evaluate_masks(self, reader: ImageReader, class_names, progress: bool):
        from seg_train.infer import mask_evaluate

        setup = mask_evaluate.MaskSetup.of(self.state.cfg, self.eval_cfg)
        if self._mask_step is None:
            self._mask_step = mask_evaluate.make_step(self.state, setup.crop)
        scores, count = mask_evaluate.evaluate(self.state, self._mask_step, reader, setup, class_names, progress)
        if scores.value is None:
            raise ConfigError("nothing to score", f"split {reader.split}",
                              f"ground-truth segments (data.task {setup.task}): no class has any")
        self._mask_examples = scores.examples
        return scores, count

    def reestimate_bn(self, reader: ImageReader, num_batches: int, progress: bool = True) -> bool:
        """Precise BN on the training split's `reader` (precise_bn.PreciseBN.reestimate)."""
        return self.precise_bn.reestimate(reader, num_batches, progress)

    def maybe_reestimate_bn(self, cfg: Config, progress: bool = True) -> bool:
        """Re-estimates BN if eval.bn_reestimate_batches > 0; whether the statistics match the weights."""
        return self.precise_bn.maybe_reestimate(cfg, progress)

    def serving_module(self, mean, std):
        """The serving module of the state's model with these modes and offsets; a new one per call."""
        return serving_module(self.state.model, mean, std, self.eval_cfg, self.score_offsets)

    def mask_serving_module(self, mean, std):
        """data.task panoptic / instance: the raw-output serving module of the state's model
        (serving.mask_serving_module); a new one per call."""
        return mask_serving_module(self.state.model, mean, std)

    def predict_examples(self, reader: ImageReader, k: int = NUM_EXAMPLES):
        """eval/examples: the first k images of the val split `reader` with their predictions.

        The serving module is built at the first call, with `reader`'s normalisation, and kept.
        """
        if self.state.cfg.data.task != "semantic":
            return self._mask_examples[:k]  # drawn by the evaluation itself: (image, ground truth, prediction) RGB
        if self._examples is None:
            self._examples = self.serving_module(reader.cfg.mean, reader.cfg.std)
        return predict_examples(self._examples, reader, k)


# ---- evaluation during training -------------------------------------------------------------------
def write_eval_summaries(writer, step: int, metrics: SegMetrics, class_names) -> None:
    """TensorBoard scalars eval/miou, eval/pixel_accuracy, eval/mean_class_accuracy, eval/iou/<class>.

    Classes with an undefined IoU are left out. Panoptic and instance evaluations (mask_evaluate.MaskScores): their
    scalars (eval/pq, eval/pq_things, eval/pq_stuff, eval/sq .., eval/pq/<class>; eval/ap, eval/ap50, ..).
    """
    if hasattr(metrics, "scalars"):
        with writer.as_default(step=step):
            for tag, value in metrics.scalars().items():
                tf.summary.scalar(tag, value)
        writer.flush()
        return
    with writer.as_default(step=step):
        tf.summary.scalar("eval/miou", metrics.miou)
        tf.summary.scalar("eval/pixel_accuracy", metrics.pixel_accuracy)
        tf.summary.scalar("eval/mean_class_accuracy", metrics.mean_class_accuracy)
        for name, iou in zip(class_names, metrics.per_class_iou):
            if iou is not None:
                tf.summary.scalar(f"eval/iou/{name}", iou)
    writer.flush()

"""The model, optimizer and the one-graph multi-tower train step (reused by train, bench and tests)."""

from __future__ import annotations

import keras
import tensorflow as tf

from seg_train import losses, models, replicas
from seg_train.config import Config, ConfigError
from seg_train.schedule import poly_lr


class Trainer:
    """Builds the model and a built optimizer inside `strategy.scope()`, and the compiled train step.

    Args:
      cfg: the resolved config.
      strategy: a tf.distribute strategy (one replica per tower).
    """

    def __init__(self, cfg: Config, strategy: tf.distribute.Strategy):
        self.cfg, self.strategy = cfg, strategy
        self.num_replicas = strategy.num_replicas_in_sync
        t = cfg.train
        if t.jit_compile and cfg.model.sync_batchnorm:
            raise ConfigError("invalid combination", "train.jit_compile",
                              "false with model.sync_batchnorm: true (synchronized BN all-reduces inside the "
                              "forward pass, which cannot be XLA-compiled per tower)")
        with strategy.scope():
            # The dtype policy is global in Keras; set it only while this model's layers are built.
            previous = keras.config.dtype_policy()
            keras.config.set_dtype_policy("float32" if t.precision == "float32" else t.precision)
            try:
                self.model = models.build(cfg.model, cfg.data.num_classes, cfg.seed)
            finally:
                keras.config.set_dtype_policy(previous)
            # Dynamic loss scaling for float16 (bfloat16 has float32's range and needs none).
            self.loss_scale = tf.Variable(2.0 ** 15 if t.precision == "mixed_float16" else 1.0, trainable=False,
                                          name="loss_scale", aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)
            self.good_steps = tf.Variable(0, dtype=tf.int64, trainable=False, name="good_steps",
                                          aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)
            self.step = tf.Variable(0, dtype=tf.int64, trainable=False, name="step",
                                    aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)
            # The step at which the BN moving statistics were last re-estimated (-1: never); they
            # match the weights only while this equals `step` (see bn_stats.py).
            self.bn_stats_step = tf.Variable(-1, dtype=tf.int64, trainable=False, name="bn_stats_step",
                                             aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)

            def lr():
                return poly_lr(self.step, t.learning_rate, t.num_steps, t.lr_power, t.warmup_steps)

            if t.optimizer == "adam":
                self.optimizer = keras.optimizers.Adam(learning_rate=lr)
            else:
                self.optimizer = keras.optimizers.SGD(learning_rate=lr, momentum=t.momentum)
            # Build the slots now: an unbuilt optimizer fails on the first distributed step and a
            # checkpoint restored into it silently skips its slots.
            self.optimizer.build(self.model.trainable_variables)
        self.kernels = losses.decay_variables(self.model)
        self.bn_layers = replicas.batchnorm_layers(self.model)
        self._bn_stats = [v for b in self.bn_layers for v in (b.moving_mean, b.moving_variance)]
        self._per_tower = tf.function(self._loss_and_grads, jit_compile=True) if t.jit_compile else self._loss_and_grads
        self.train_step = tf.function(self._train_step)

    def checkpoint_objects(self) -> dict:
        """What a checkpoint holds (the data position is a pure function of `step`, see reader.py)."""
        objects = {"model": self.model, "optimizer": self.optimizer, "step": self.step,
                   "bn_stats_step": self.bn_stats_step}
        if self.cfg.train.precision == "mixed_float16":
            objects.update(loss_scale=self.loss_scale, good_steps=self.good_steps)
        return objects

    def restore_weights(self, prefix: str) -> int:
        """Loads model weights, step and bn_stats_step from a checkpoint (for eval/predict/export).

        Returns the checkpoint's step. The optimizer state is not needed and not read.
        """
        ckpt = tf.train.Checkpoint(model=self.model, step=self.step, bn_stats_step=self.bn_stats_step)
        ckpt.read(prefix).expect_partial().assert_existing_objects_matched()
        return int(self.step.numpy())

    def learning_rate(self) -> float:
        t = self.cfg.train
        return float(poly_lr(self.step, t.learning_rate, t.num_steps, t.lr_power, t.warmup_steps))

    def _loss_and_grads(self, images, labels, global_count):
        """One tower's forward and backward pass; no cross-tower sync inside, so it can be XLA-compiled."""
        cfg = self.cfg
        with tf.GradientTape() as tape:
            logits = self.model(images, training=True)
            ce_sum, count = losses.pixel_cross_entropy_sum(logits, labels, cfg.data.ignore_label)
            wd = losses.weight_decay(self.kernels, cfg.model.weight_decay)
            # THE cross-tower scaling. apply_gradients (in _apply) SUMs the towers' gradients (Keras
            # 3 inside strategy.run), so each tower's loss is its share of the global objective:
            # its cross-entropy sum over the GLOBAL valid-pixel count (all towers' pixels weigh the
            # same), plus 1/N of the weight decay (the N shares add up to the decay counted once).
            loss = ce_sum / tf.maximum(global_count, 1.0) + wd / self.num_replicas
            scaled = loss * self.loss_scale
        grads = tape.gradient(scaled, self.model.trainable_variables)
        grads = [g / self.loss_scale for g in grads]
        # One reduce_sum per gradient instead of is_finite + reduce_all over every element: a sum is
        # inf/nan iff an element is (or the sum itself overflows float32, i.e. gradients past ~1e38,
        # where skipping the step is right anyway). It cost 4% of the step's op time the other way.
        finite = tf.reduce_all(tf.math.is_finite(tf.stack([tf.reduce_sum(tf.cast(g, tf.float32)) for g in grads])))
        preds = tf.cast(tf.argmax(logits, axis=-1), tf.uint8)
        return grads, ce_sum, count, wd, finite, tf.math.is_finite(loss), preds

    def _forward_backward(self, images, labels, stop):
        """One tower: loss and gradients on its slice of the global batch (nothing applied yet)."""
        # BN moving statistics are updated by the forward pass itself; keep the old values so a
        # skipped (non-finite) step can put them back.
        bn_before = [tf.identity(v.value) for v in self._bn_stats]
        # The valid-pixel count depends on the labels only, so it is all-reduced before the forward
        # pass, outside the (optionally XLA-compiled) per-tower computation.
        count = tf.reduce_sum(tf.cast(tf.not_equal(tf.cast(labels, tf.int32), self.cfg.data.ignore_label),
                                      tf.float32))
        global_count = replicas.all_reduce_sum(count)
        grads, ce_sum, count, wd, finite, loss_finite, preds = self._per_tower(images, labels, global_count)
        if not self.cfg.model.sync_batchnorm:
            # Here rather than in _apply: a collective of plain tensors inside the cond's branch has no
            # device under MultiWorkerMirroredStrategy ("destinations can not be empty"). A skipped
            # step puts the statistics back from bn_before anyway.
            replicas.average_bn_moving_stats(self.bn_layers)
        # Any process asked to stop (a signal) -> all stop after this same step: a worker that went
        # on alone would wait forever for its peers' collectives.
        stop_any = replicas.all_reduce_sum(tf.cast(stop, tf.float32))
        # Every process must take the same branch (apply or skip) below, so the finiteness verdict is
        # all-reduced too: with several workers, one worker's towers alone would not do.
        bad_towers = replicas.all_reduce_sum(1.0 - tf.cast(finite & loss_finite, tf.float32))
        return grads, bn_before, {"stop": stop_any, "bad_towers": bad_towers, "ce_sum": ce_sum, "count": count, "wd": wd,
                                  "finite": tf.cast(finite & loss_finite, tf.int32),
                                  "loss_finite": tf.cast(loss_finite, tf.int32),
                                  "images": images, "labels": labels, "preds": preds}

    def _apply(self, grads):
        """One tower: apply the gradients (Keras sums them over the towers inside apply_gradients)."""
        self.optimizer.apply_gradients(zip(grads, self.model.trainable_variables))

    def _undo_bn(self, bn_before):
        for v, old in zip(self._bn_stats, bn_before):
            v.assign(old)

    def _train_step(self, batch, stop=False):
        """One step on a distributed global batch; `stop` is this process's wish to stop after it."""
        images, labels = batch
        s = self.strategy
        grads, bn_before, out = s.run(self._forward_backward, (images, labels, tf.convert_to_tensor(stop)))
        local = lambda v: s.experimental_local_results(v)  # noqa: E731  (tower order = replica order)
        finite = tf.stack(local(out["finite"]))
        # Apply only if every tower is finite: a non-finite step changes no weight, no optimizer
        # slot and no BN statistic (train.on_nan decides on the host whether to stop or go on).
        # The cond is in cross-replica context: Keras' apply_gradients synchronises the towers,
        # which is not allowed inside control flow within a replica function.
        ok = local(out["bad_towers"])[0] < 0.5

        def apply():
            s.run(self._apply, (grads,))
            return tf.constant(True)

        def skip():
            s.run(self._undo_bn, (bn_before,))
            return tf.constant(False)

        applied = tf.cond(ok, apply, skip)
        if self.cfg.train.precision == "mixed_float16":
            self._update_loss_scale(applied)
        self.step.assign_add(1)
        ce_sums, counts = local(out["ce_sum"]), local(out["count"])
        # Over all towers of all workers (local results would be this worker's share only).
        total_ce = (s.reduce(tf.distribute.ReduceOp.SUM, out["ce_sum"], axis=None)
                    / tf.maximum(s.reduce(tf.distribute.ReduceOp.SUM, out["count"], axis=None), 1.0))
        wd = local(out["wd"])[0]
        return {
            "loss": total_ce + wd,
            "weight_decay": wd,
            "tower_ce": tf.stack([c / tf.maximum(n, 1.0) for c, n in zip(ce_sums, counts)]),
            "finite": finite,
            "stop": local(out["stop"])[0] > 0,
            "loss_finite": tf.stack(local(out["loss_finite"])),
            "loss_scale": tf.identity(self.loss_scale),
            "images": local(out["images"]),
            "labels": local(out["labels"]),
            "preds": local(out["preds"]),
        }

    def _update_loss_scale(self, applied):
        """Dynamic loss scaling: halve on overflow, double after 2000 finite steps (Keras' defaults)."""
        def grow():
            self.good_steps.assign_add(1)
            done = self.good_steps >= 2000
            self.loss_scale.assign(tf.where(done, self.loss_scale * 2.0, self.loss_scale))
            self.good_steps.assign(tf.where(done, tf.constant(0, tf.int64), self.good_steps))
            return tf.constant(0)

        def shrink():
            self.loss_scale.assign(tf.maximum(self.loss_scale / 2.0, 1.0))
            self.good_steps.assign(0)
            return tf.constant(0)

        tf.cond(applied, grow, shrink)

    def distribute(self, dataset_fn):
        """Distributes a per-replica-batched dataset function (see ImageReader.train_dataset)."""
        return self.strategy.distribute_datasets_from_function(dataset_fn)

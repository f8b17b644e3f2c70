"""The model, the optimizer and the one-graph multi-tower train step (used by train, bench and tests).

One step is one optimizer update, in ONE tf.function over the strategy:

  each tower (replica function):
    tower function: for each of the K micro-batches (train.accumulate_steps) of its slice:
        forward pass (Keras' stateless_call: BN moving statistics come back as values, so nothing
        is assigned before the update is known to be finite), loss sum and normaliser (losses.py),
        backward pass; gradients and new BN statistics summed over the micro-batches
    ONE all-reduce (SUM) of flat packs (train.allreduce_pack_mb) holding: the gradients, the BN
        statistics / (K * towers), and a few scalars per tower in one-hot slots (loss sum,
        normaliser, squared gradient norm, finiteness, the stop request)
    apply function: gradient = reduced sum / global normaliser + weight decay (once), global norm,
        clipping (train.clip_global_norm); if finite (a verdict computed from reduced values, so
        identical on every tower), TensorFlow's fused update ops on Keras' slot variables and the
        averaged BN statistics assigned
  then: step += 1, optimizer iterations += 1 if applied, dynamic loss scale (float16)

The maths is that of "K x N towers" (K micro-batches on N towers): every micro-batch's loss sum is
divided by the normaliser of ALL micro-batches on all towers (the valid pixels, or the weights of
the kept pixels with loss options), weight decay is counted once per update, each micro-batch's
BN update starts from the same statistics and the K x N results are averaged. So K micro-batches
on N towers equal one step on K x N towers (tests/test_gradients.py, test_accumulation_equals_towers).

Why it is built this way (each point measured on MobileNetV2 DeepLabV3+, 64x64 crops, global
batch 8, 2-core CPU, 4 logical towers; docs/PERFORMANCE.md):
- Keras' optimizer.apply_gradients inside strategy.run SUMs the towers' gradients itself, clips
  each tower's partial gradient (clipnorm / global_clipnorm), and builds ~25 graph ops per variable
  per tower: the apply branch alone had more graph nodes than the 4 towers' forward and backward
  passes. So the reduction is ours (one packed all-reduce, never a second one) and the update is
  TensorFlow's fused ResourceApplyAdam / ResourceApplyKerasMomentum / ResourceApplyGradientDescent
  on Keras' own slot variables, which compute exactly Keras' Adam / SGD (with or without momentum)
  formulas, one op per variable.
- Under MirroredStrategy a replica function is traced once per tower. The tower's forward and
  backward pass is therefore a tf.function traced ONCE and called by every tower with its own
  variable handles, and marked not to be inlined, so TensorFlow also optimises its graph once per
  device instead of one whole graph N times the size (docs/SCALING.md, "One trace for every
  tower": the first step at 4 towers in about a third of the time).
- With synchronized BN on several towers the BN layers all-reduce inside the forward and backward
  passes, which needs each tower's own replica context: the tower function is then traced per
  tower (models/sync_bn.py keeps that trace cheap), and micro-batches are unrolled in Python,
  because a cross-tower reduction inside a tf.while_loop is refused by MirroredStrategy.
- The apply decision is a tf.cond in replica context with no collective inside (all-reduces
  inside control flow of a replica function are not allowed); the verdict is identical on every
  tower because it is computed from reduced values.
"""

from __future__ import annotations

import contextlib
import math

import keras
import numpy as np
import tensorflow as tf

from seg_train import collectives, losses, models
from seg_train.config import Config, ConfigError
from seg_train.schedule import lr_at

# Per-tower scalars carried in one-hot slots of the all-reduce (see _tower): "finite" is the loss
# and gradient's, "bn_finite" the new BN statistics'.
TOWER_FIELDS = ("loss_sum", "normalizer", "grad_sq", "finite", "bn_finite")
_NF = len(TOWER_FIELDS)

# train.precision mixed_float16: the dynamic loss scale starts at LOSS_SCALE_INITIAL and is never
# halved below LOSS_SCALE_FLOOR (TensorFlow's LossScaleOptimizer's floor): a gradient that is still
# non-finite with the loss unscaled is a non-finite step, not a float16 overflow.
LOSS_SCALE_INITIAL, LOSS_SCALE_FLOOR = 2.0 ** 15, 1.0


def _read(handle, like):
    """A variable's value from its resource handle (inside a function traced once for every tower)."""
    value = tf.raw_ops.ReadVariableOp(resource=handle, dtype=like.dtype)
    value.set_shape(like.shape)
    return value


def _handles(variables) -> list:
    """The resource handles of (Keras) variables on the calling tower (replica context)."""
    return [(v.value if isinstance(v, keras.Variable) else v).handle for v in variables]


def slot_variables(optimizer, variables) -> list:
    """Keras' own slot variables of each variable, in the order TensorFlow's fused update ops take them.

    Adam: [m, v]; SGD with momentum: [momentum]; plain SGD (momentum 0): [] (Keras keeps none).
    The one place that reads Keras' private slot lists (Keras 3 has no public per-variable lookup);
    tests/test_trainer_slots.py holds the mapping to what Keras' own update writes.
    """
    index = optimizer._get_variable_index
    if isinstance(optimizer, keras.optimizers.Adam):
        return [[optimizer._momentums[index(v)], optimizer._velocities[index(v)]] for v in variables]
    if isinstance(optimizer, keras.optimizers.SGD) and optimizer.momentum:
        return [[optimizer.momentums[index(v)]] for v in variables]
    if isinstance(optimizer, keras.optimizers.SGD):
        return [[] for _ in variables]
    raise ValueError(f"no fused update for {type(optimizer).__name__}: Adam or SGD")


class Trainer:
    """Builds the model and a built optimizer inside `strategy.scope()`, and the compiled train step.

    Args:
      cfg: the resolved config.
      strategy: a tf.distribute strategy (one replica per tower).
      class_weights: the per-class loss weights (losses.class_weights_for), needed when
        loss.class_weights is 'median_frequency' (computed from the train split's histogram).
    """

    def __init__(self, cfg: Config, strategy: tf.distribute.Strategy, class_weights=None):
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
            self.loss_scale = tf.Variable(LOSS_SCALE_INITIAL if t.precision == "mixed_float16" else 1.0,
                                          trainable=False, name="loss_scale",
                                          aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)
            self.good_steps = tf.Variable(0, dtype=tf.int64, trainable=False, name="good_steps",
                                          aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)
            self.step = tf.Variable(0, dtype=tf.int64, trainable=False, name="step",
                                    aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)
            # The step at which the BN moving statistics were last re-estimated (-1: never); they
            # match the weights only while this equals `step` (see bn_stats.py).
            self.bn_stats_step = tf.Variable(-1, dtype=tf.int64, trainable=False, name="bn_stats_step",
                                             aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)
            # Keras' optimizer holds the slots and the iteration count (checkpoint layout unchanged);
            # the update itself is ours (module doc). The learning rate is fed per step.
            if t.optimizer == "adam":
                self.optimizer = keras.optimizers.Adam(learning_rate=t.learning_rate)
            else:
                self.optimizer = keras.optimizers.SGD(learning_rate=t.learning_rate, momentum=t.momentum)
            # Build the slots now: a checkpoint restored into an unbuilt optimizer silently skips
            # its slots.
            self.optimizer.build(self.model.trainable_variables)
            # train.ema_decay: the moving average of every trainable weight, starting at the weights.
            self.ema, self.ema_restored = None, False
            if t.ema_decay:
                self.ema = [tf.Variable(v.value, trainable=False, name=f"ema/{v.path}") for v in
                            self.model.trainable_variables]
        self.variables = list(self.model.trainable_variables)
        self.state = list(self.model.non_trainable_variables)
        self.bn_layers = models.batchnorm_layers(self.model)
        self.kernels = losses.decay_variables(self.model)
        decay_ids = {id(v) for v in self.kernels}
        self._decay = [id(v) in decay_ids for v in self.variables]
        # The BN moving statistics the forward pass updates (frozen layers update nothing), as
        # positions in model.non_trainable_variables (the order stateless_call returns them in).
        state_pos = {id(v): i for i, v in enumerate(self.state)}
        self._bn_pos = [state_pos[id(v)] for b in self.bn_layers if b.trainable
                        for v in (b.moving_mean, b.moving_variance)]
        self._slots = slot_variables(self.optimizer, self.variables)
        # train.backbone_lr_multiplier scales the learning rate (not the gradient: Adam would undo that).
        self._lr_mult = [t.backbone_lr_multiplier if in_backbone else 1.0
                         for in_backbone in models.backbone_variable_mask(self.model)]
        if class_weights is None and cfg.loss.class_weights is not None:
            if isinstance(cfg.loss.class_weights, str):
                raise ConfigError("class weights not computed", "loss.class_weights",
                                  "the weights from the train split's histogram (losses.class_weights_for)")
            class_weights = cfg.loss.class_weights
        self.class_weights = None if class_weights is None else np.asarray(class_weights, np.float32)
        self.accumulate = t.accumulate_steps
        self.pack_bytes = int(t.allreduce_pack_mb * 2 ** 20)
        # Synchronized BN across towers needs each tower's replica context while tracing (module doc).
        self.per_tower_trace = cfg.model.sync_batchnorm and self.num_replicas > 1
        attrs = {"_noinline": True}
        self._tower_fn = tf.function(self._tower_from_handles, jit_compile=t.jit_compile or None,
                                     experimental_attributes=attrs)
        self._apply_fn = tf.function(self._apply_from_handles, experimental_attributes=attrs)
        self._concrete: dict = {}
        self._grad_layout = self._state_layout = None
        self._step_fn = tf.function(self._train_step)

    # ---- checkpoints -------------------------------------------------------------------------------
    def checkpoint_objects(self) -> dict:
        """What a checkpoint holds (the data position is a pure function of `step`, see reader.py)."""
        objects = {"model": self.model, "optimizer": self.optimizer, "step": self.step,
                   "bn_stats_step": self.bn_stats_step}
        if self.ema is not None:
            objects["ema"] = self.ema
        if self.cfg.train.precision == "mixed_float16":
            objects.update(loss_scale=self.loss_scale, good_steps=self.good_steps)
        return objects

    def restore_weights(self, prefix: str) -> int:
        """Loads model weights, step and bn_stats_step from a checkpoint (for eval/predict/export).

        Returns the checkpoint's step. The optimizer state is not needed and not read.
        """
        objects = {"model": self.model, "step": self.step, "bn_stats_step": self.bn_stats_step}
        reader = tf.train.load_checkpoint(prefix)
        if self.ema is not None and any(k.startswith("ema/") for k in reader.get_variable_to_shape_map()):
            objects["ema"] = self.ema  # a checkpoint of training (best/ holds the averaged weights as the model)
        ckpt = tf.train.Checkpoint(**objects)
        ckpt.read(prefix).expect_partial().assert_existing_objects_matched()
        self.ema_restored = "ema" in objects
        return int(self.step.numpy())

    def use_averaged_weights(self) -> None:
        """For evaluation, prediction and export: the model keeps the EMA weights from now on.

        The BN statistics in a training checkpoint belong to the training weights, so they are
        marked as not matching (bn_stats_step = -1) for eval.bn_reestimate_batches to redo.
        """
        for v, e in zip(self.variables, self.ema):
            v.assign(e)
        self.bn_stats_step.assign(-1)

    @contextlib.contextmanager
    def averaged_weights(self):
        """Within the block the model holds the EMA weights (train.ema_decay; a no-op without it).

        The training weights, the BN moving statistics and bn_stats_step are put back exactly on
        exit, so evaluating in the middle of a run leaves the run's state (and its next checkpoint)
        as it was. The BN statistics inside the block are the training run's until re-estimated for
        the averaged weights (bn_stats_step is set to -1 so bn_stats.reestimate does it).
        """
        if self.ema is None:
            yield
            return
        saved = [tf.identity(v.value) for v in self.variables + self.state]
        saved_marker = int(self.bn_stats_step.numpy())
        for v, e in zip(self.variables, self.ema):
            v.assign(e)
        self.bn_stats_step.assign(-1)
        try:
            yield
        finally:
            for v, x in zip(self.variables + self.state, saved):
                v.assign(x)
            self.bn_stats_step.assign(saved_marker)

    def learning_rate(self, step: int | None = None) -> float:
        """The learning rate of the update made at `step` (default: the next one), computed on the host."""
        t = self.cfg.train
        step = int(self.step.numpy()) if step is None else step
        return lr_at(step, t.learning_rate, t.num_steps, t.lr_power, t.warmup_steps)

    # ---- functions traced once for every tower -------------------------------------------------------
    def tower_function(self, body, input_specs, training: bool):
        """`body(trainable_values, state_values, *inputs)` as a function every tower calls from ONE trace.

        Returns f(*inputs) for use inside `strategy.run`, which passes the calling tower's own
        variable handles (see the module doc for why: a replica function is traced once per tower).
        Call this in cross-replica context (inside the outer tf.function, before strategy.run), so
        the trace is not made inside a tower's thread. In training mode with synchronized BN on
        several towers the BN layers all-reduce, which needs each tower's replica context: then
        `body` is traced per tower instead (called with the tower's variable values).
        """
        # The model's variable lists as they are now (a layer frozen after the Trainer was built
        # moves its weights from one list to the other).
        variables, state = list(self.model.trainable_variables), list(self.model.non_trainable_variables)
        if training and self.per_tower_trace:
            return lambda *inputs: body([tf.convert_to_tensor(v.value) for v in variables],
                                        [tf.convert_to_tensor(v.value) for v in state], *inputs)

        def from_handles(var_handles, state_handles, *inputs):
            tv = [_read(h, v) for h, v in zip(var_handles, variables)]
            st = [_read(h, v) for h, v in zip(state_handles, state)]
            return body(tv, st, *inputs)

        res = tf.TensorSpec([], tf.resource)
        fn = tf.function(from_handles, experimental_attributes={"_noinline": True})
        concrete = fn.get_concrete_function([res] * len(variables), [res] * len(state), *input_specs)
        return lambda *inputs: concrete(_handles(variables), _handles(state), *inputs)

    # ---- the tower: forward and backward over the micro-batches --------------------------------------
    @staticmethod
    def _pixel_scale(b: int, h: int, w: int) -> float:
        """P: a power of two near one micro-batch's pixel count on one tower.

        Each tower differentiates loss_sum * loss_scale / P; the reduced sum is multiplied back by
        P / loss_scale / (global normaliser). Any P common to all towers gives the same maths; a
        power of two makes the two scalings exact in floating point, and a P near the pixel count
        keeps the backward pass's magnitudes those of a mean (float16 needs that).
        """
        return float(2.0 ** round(math.log2(max(b * h * w, 1))))

    def _micro(self, tv, st, images, labels, scale, want_preds):
        """One micro-batch on this tower: (gradients of loss_sum * scale, new BN statistics, loss_sum,
        normalizer, preds)."""
        cfg = self.cfg
        with tf.GradientTape() as tape:
            tape.watch(tv)
            logits, new_state = self.model.stateless_call(tv, st, images, training=True)
            loss_sum, normalizer = losses.pixel_loss_sum(logits, labels, cfg.data.ignore_label, self.class_weights,
                                                         cfg.loss.top_k_percent_pixels)
            scaled = loss_sum * scale
        grads = tape.gradient(scaled, tv, unconnected_gradients=tf.UnconnectedGradients.ZERO)
        grads = [tf.cast(g, tf.float32) for g in grads]
        bn = [new_state[i] for i in self._bn_pos]
        if want_preds is None:
            preds = None
        else:
            preds = tf.cond(want_preds, lambda: tf.cast(tf.argmax(logits, axis=-1), tf.uint8),
                            lambda: tf.zeros(tf.shape(labels), tf.uint8))
        return grads, bn, loss_sum, normalizer, preds

    def _tower(self, tv, st, images, labels, loss_scale, tower_index, stop, want_preds, unrolled: bool):
        """One tower's share of the update: the flat packs to all-reduce, and its predictions.

        images [K * b, h, w, 3], labels [K * b, h, w]: micro-batch m is rows m*b .. m*b+b-1.
        """
        k, n = self.accumulate, self.num_replicas
        b = images.shape[0] // k
        shape_i, shape_l = [k, b] + images.shape[1:].as_list(), [k, b] + labels.shape[1:].as_list()
        images, labels = tf.reshape(images, shape_i), tf.reshape(labels, shape_l)
        scale = loss_scale / self._pixel_scale(b, shape_i[2], shape_i[3])
        grads, bn, loss_sum, norm, preds = self._micro(tv, st, images[0], labels[0], scale, want_preds)
        if k > 1:
            def body(m, grads, bn, loss_sum, norm):
                g, s, micro_loss, z, _ = self._micro(tv, st, images[m], labels[m], scale, None)
                return (m + 1, [a + x for a, x in zip(grads, g)], [a + x for a, x in zip(bn, s)],
                        loss_sum + micro_loss,
                        norm + z)

            if unrolled:  # synchronized BN: all-reduces cannot sit inside a while loop (module doc)
                m = tf.constant(1)
                for _ in range(1, k):
                    m, grads, bn, loss_sum, norm = body(m, grads, bn, loss_sum, norm)
            else:
                _, grads, bn, loss_sum, norm = tf.while_loop(
                    lambda m, *_: m < k, body, (tf.constant(1), grads, bn, loss_sum, norm),
                    parallel_iterations=1)
        grad_packs = collectives.pack(grads, self._grad_layout)
        grad_sq = tf.add_n([tf.reduce_sum(tf.square(p)) for p in grad_packs])
        finite = tf.cast(tf.math.is_finite(grad_sq) & tf.math.is_finite(loss_sum), tf.float32)
        # BN statistics: the mean over micro-batches and towers of each one's updated statistics
        # (with synchronized BN the towers' values are already equal, and their mean is that value),
        # scaled pack by pack.
        bn_packs = [p * (1.0 / (k * n)) for p in collectives.pack(bn, self._state_layout)]
        # A moving statistic can turn non-finite while the loss and gradient stay finite (the
        # batch statistics are finite, the moving update is not): assigning it would poison every
        # later evaluation, so it vetoes the update like a non-finite gradient does.
        bn_finite = tf.cast(tf.reduce_all([tf.reduce_all(tf.math.is_finite(p)) for p in bn_packs]), tf.float32) \
            if bn_packs else tf.constant(1.0)
        row = collectives.one_hot_row(tf.stack([loss_sum, norm, grad_sq, finite, bn_finite]), tower_index, n)
        scalars = tf.concat([row, tf.reshape(tf.cast(stop, tf.float32), [1])], axis=0)
        return grad_packs + bn_packs + [scalars], preds

    def _tower_from_handles(self, var_handles, state_handles, images, labels, loss_scale, tower_index, stop,
                            want_preds):
        """_tower on variables read from this tower's handles (traced once, called by every tower)."""
        tv = [_read(h, v) for h, v in zip(var_handles, self.variables)]
        st = [_read(h, v) for h, v in zip(state_handles, self.state)]
        return self._tower(tv, st, images, labels, loss_scale, tower_index, stop, want_preds, unrolled=False)

    # ---- after the all-reduce: normalise, decay, clip, apply ------------------------------------------
    def _apply_from_handles(self, packs, var_handles, slot_handles, state_handles, ema_handles, lr, t, loss_scale,
                            want_details, apply_update):
        """Turns the reduced packs into the update and applies it on this tower's variables (traced once).

        The arithmetic runs on the flat packs (a handful of ops per pack, not per variable): graph
        size is what tracing and TensorFlow's graph optimisation pay for.
        """
        cfg, n = self.cfg, self.num_replicas
        n_grad_packs = len(self._grad_layout) if self._grad_layout is not None else len(self.variables)
        grad_packs, scalars = packs[:n_grad_packs], packs[-1]
        bn = collectives.unpack(packs[n_grad_packs:-1], self._state_layout)
        towers = tf.reshape(scalars[:-1], [n, _NF])
        loss_total, norm_total = tf.reduce_sum(towers[:, 0]), tf.reduce_sum(towers[:, 1])
        # The normaliser is a pixel count, or a sum of class weights (which may be below 1): 0 only
        # when nothing counts, and then the loss gradient is 0, not a division by zero.
        to_mean = tf.math.divide_no_nan(self._scale_back / loss_scale, norm_total)
        coeff = cfg.model.weight_decay
        # The decayed weights in the packs' layout (zeros for biases, BN scales and offsets).
        decayed = [_read(h, v) if d else tf.zeros(v.shape) for h, v, d in zip(var_handles, self.variables, self._decay)]
        w_packs = collectives.pack(decayed, self._grad_layout)
        update = [g * to_mean + coeff * w for g, w in zip(grad_packs, w_packs)] if coeff else \
            [g * to_mean for g in grad_packs]
        weight_decay = 0.5 * coeff * tf.add_n([tf.reduce_sum(tf.square(w)) for w in w_packs])
        global_norm = tf.sqrt(tf.add_n([tf.reduce_sum(tf.square(u)) for u in update]))
        finite = tf.math.is_finite(global_norm) & tf.math.is_finite(loss_total) & \
            (tf.reduce_min(towers[:, 4]) > 0.5)
        clip = cfg.train.clip_global_norm
        clipped = global_norm > clip if clip else tf.constant(False)
        factor = tf.where(clipped, clip / tf.maximum(global_norm, 1e-30), 1.0) if clip else tf.constant(1.0)
        if clip:
            update = [u * factor for u in update]
        grads = collectives.unpack(update, self._grad_layout)
        opt = self.optimizer
        if cfg.train.optimizer == "adam":
            b1p, b2p = tf.pow(opt.beta_1, t), tf.pow(opt.beta_2, t)
        rates = {m: (lr * m if m != 1.0 else lr) for m in set(self._lr_mult)}

        def apply():
            ops = []
            for g, h, slots, mult in zip(grads, var_handles, slot_handles, self._lr_mult):
                if cfg.train.optimizer == "adam":
                    ops.append(tf.raw_ops.ResourceApplyAdam(
                        var=h, m=slots[0], v=slots[1], beta1_power=b1p, beta2_power=b2p, lr=rates[mult],
                        beta1=opt.beta_1, beta2=opt.beta_2, epsilon=opt.epsilon, grad=g))
                elif slots:
                    ops.append(tf.raw_ops.ResourceApplyKerasMomentum(
                        var=h, accum=slots[0], lr=rates[mult], grad=g, momentum=cfg.train.momentum))
                else:
                    ops.append(tf.raw_ops.ResourceApplyGradientDescent(var=h, alpha=rates[mult], delta=g))
            for pos, value in zip(self._bn_pos, bn):
                ops.append(tf.raw_ops.AssignVariableOp(resource=state_handles[pos], value=value))
            if ema_handles:
                # ema -= (1 - d) * (ema - w), with TF's ExponentialMovingAverage decay schedule.
                d = cfg.train.ema_decay
                rate = 1.0 - tf.minimum(d, (1.0 + t) / (10.0 + t))
                with tf.control_dependencies(ops):
                    for h, e, v in zip(var_handles, ema_handles, self.variables):
                        ops.append(tf.raw_ops.ResourceApplyGradientDescent(
                            var=e, alpha=rate, delta=_read(e, v) - _read(h, v)))
            with tf.control_dependencies(ops):
                return tf.constant(True)

        applied = tf.cond(finite & apply_update, apply, lambda: tf.constant(False))
        # Per-variable norms of the update's gradient (before clipping), for the histogram.
        var_norms = tf.cond(want_details,
                            lambda: tf.sqrt(tf.stack([tf.reduce_sum(tf.square(g)) for g in grads])) / factor,
                            lambda: tf.zeros([len(grads)]))
        return {"applied": applied, "global_norm": global_norm, "clipped": clipped & applied,
                "loss_total": loss_total, "norm_total": norm_total, "weight_decay": weight_decay,
                "towers": towers, "stop": scalars[-1], "tower_grad_norm": tf.sqrt(towers[:, 2]) * to_mean,
                "var_grad_norms": var_norms, "finite_update": finite,
                # For probe(): the update's gradient (after clipping) and the BN statistics it would set.
                "gradients": grads, "bn_stats": bn}

    # ---- the step ------------------------------------------------------------------------------------
    def _tower_shape(self, images) -> tf.TensorShape:
        """One tower's image shape with its batch dimension known.

        Under MultiWorkerMirroredStrategy (TF 2.21) the distributed dataset's per-tower tensors come
        without a static batch size, although the reader batches with drop_remainder; the tower
        graph needs it (the pixel scale and the micro-batch reshape are static), and it
        is the reader's per-tower batch: K micro-batches of data.batch_size / towers images.
        """
        shape = images.shape
        if shape[0] is None:
            shape = tf.TensorShape([self.accumulate * (self.cfg.data.batch_size // self.num_replicas)]).concatenate(
                shape[1:])
        return shape

    def _signatures(self, images):
        """Traces the tower and apply functions once for this per-tower input shape (module doc)."""
        images = tf.TensorSpec(self._tower_shape(images), images.dtype)
        key = tuple(images.shape.as_list())
        if key in self._concrete:
            return self._concrete[key]
        res = tf.TensorSpec([], tf.resource)
        spec_i = tf.TensorSpec(images.shape, images.dtype)
        spec_l = tf.TensorSpec(images.shape[:3], tf.uint8)
        scalar = lambda dtype: tf.TensorSpec([], dtype)  # noqa: E731
        k = self.accumulate
        self._scale_back = self._pixel_scale(images.shape[0] // k, images.shape[1], images.shape[2])
        grad_shapes = [v.shape for v in self.variables]
        state_shapes = [self.state[i].shape for i in self._bn_pos]
        self._grad_layout = collectives.pack_layout(grad_shapes, self.pack_bytes)
        self._state_layout = collectives.pack_layout(state_shapes, self.pack_bytes)
        tower = None
        if not self.per_tower_trace:
            tower = self._tower_fn.get_concrete_function(
                [res] * len(self.variables), [res] * len(self.state), spec_i, spec_l, scalar(tf.float32),
                scalar(tf.int32), scalar(tf.bool), scalar(tf.bool))

        pack_specs = [tf.TensorSpec(x, tf.float32) for x in
                      collectives.pack_sizes(grad_shapes, self._grad_layout) +
                      collectives.pack_sizes(state_shapes, self._state_layout) + [[self.num_replicas * _NF + 1]]]
        apply = self._apply_fn.get_concrete_function(
            pack_specs, [res] * len(self.variables), [[res] * len(s) for s in self._slots], [res] * len(self.state),
            [res] * len(self.ema or []), scalar(tf.float32), scalar(tf.float32), scalar(tf.float32), scalar(tf.bool),
            scalar(tf.bool))
        self._concrete[key] = (tower, apply)
        return tower, apply

    def _replica(self, images, labels, lr, t, loss_scale, stop, want_images, apply_update=True):
        """One tower's part of the step (replica context)."""
        shape = self._tower_shape(images)
        images, labels = tf.ensure_shape(images, shape), tf.ensure_shape(labels, shape[:3])
        tower, apply = self._signatures(images)  # traced in _train_step already; a lookup here
        index = collectives.replica_id()
        if tower is not None:
            packs, preds = tower(_handles(self.variables), _handles(self.state), images, labels, loss_scale, index,
                                 stop, want_images)
        else:
            tv = [tf.convert_to_tensor(v.value) for v in self.variables]
            st = [tf.convert_to_tensor(v.value) for v in self.state]
            packs, preds = self._tower(tv, st, images, labels, loss_scale, index, stop, want_images, unrolled=True)
        packs = collectives.all_reduce_sum(packs)
        out = apply(packs, _handles(self.variables), [_handles(s) for s in self._slots], _handles(self.state),
                    _handles(self.ema or []), lr, t, loss_scale, want_images, tf.constant(apply_update))
        out["preds"] = preds
        return out

    def _train_step(self, batch, lr, stop=False, want_images=False):
        """One update on a distributed global batch.

        Args:
          batch: (images, labels) per tower, [K * b, h, w, 3] and [K * b, h, w] (reader.train_dataset).
          lr: this update's learning rate (computed on the host, see schedule.py).
          stop: this process's wish to stop after this step (signals); all-reduced.
          want_images: also return the towers' predictions of their first micro-batch, and
            per-variable gradient norms (image-summary steps only).
        """
        images, labels = batch
        s = self.strategy
        # Trace the shared functions here, in cross-replica context, not inside a tower's thread.
        self._signatures(s.experimental_local_results(images)[0])
        t = tf.cast(self.optimizer.iterations + 1, tf.float32)
        loss_scale = tf.identity(self.loss_scale)
        out = s.run(self._replica, (images, labels, tf.cast(lr, tf.float32), t, loss_scale,
                                    tf.convert_to_tensor(stop), tf.convert_to_tensor(want_images)))
        return self._finish_step(out, loss_scale)

    def _finish_step(self, out, loss_scale_used) -> dict:
        """Cross-replica end of a step: counters, loss scale, and the outputs the host reads.

        `loss_scale_used` is the scale this step's gradients were computed with: the host needs it
        (not only the scale after the update) to tell a float16 overflow, which a smaller scale
        cures, from a non-finite gradient at the scale's floor, which no scale cures.
        """
        s = self.strategy
        first = lambda v: s.experimental_local_results(v)[0]  # noqa: E731  (identical on every tower)
        applied = first(out["applied"])
        self.optimizer.iterations.assign_add(tf.cast(applied, tf.int64))
        towers = first(out["towers"])
        loss_finite = tf.math.is_finite(first(out["loss_total"]))
        if self.cfg.train.precision == "mixed_float16":
            self._update_loss_scale(applied)
        self.step.assign_add(1)
        return {
            "loss": tf.math.divide_no_nan(first(out["loss_total"]), first(out["norm_total"])) +
            first(out["weight_decay"]),
            "weight_decay": first(out["weight_decay"]),
            # Each tower's own loss: its sum over its own normaliser.
            "tower_ce": tf.math.divide_no_nan(towers[:, 0], towers[:, 1]),
            "tower_grad_norm": first(out["tower_grad_norm"]),
            # Per tower: everything it contributed was finite; then the two parts, for the log.
            "finite": (towers[:, 3] > 0.5) & (towers[:, 4] > 0.5),
            "loss_grad_finite": towers[:, 3] > 0.5,
            "bn_finite": towers[:, 4] > 0.5,
            "loss_finite": loss_finite,
            "applied": applied,
            "global_norm": first(out["global_norm"]),
            "clipped": first(out["clipped"]),
            "stop": first(out["stop"]) > 0.5,
            "loss_scale": tf.identity(self.loss_scale),  # after this step's update (the next step's)
            "loss_scale_used": loss_scale_used,
            "preds": s.experimental_local_results(out["preds"]),
            "var_grad_norms": first(out["var_grad_norms"]),
        }

    def _probe(self, batch):
        """The update's gradient and new BN statistics for a batch, computed as train_step does, nothing applied."""
        images, labels = batch
        s = self.strategy
        self._signatures(s.experimental_local_results(images)[0])
        t = tf.cast(self.optimizer.iterations + 1, tf.float32)
        out = s.run(self._replica, (images, labels, tf.constant(0.0), t, tf.identity(self.loss_scale),
                                    tf.constant(False), tf.constant(False), False))
        first = lambda v: s.experimental_local_results(v)[0]  # noqa: E731
        return {"loss": tf.math.divide_no_nan(first(out["loss_total"]), first(out["norm_total"])),
                "gradients": [first(g) for g in out["gradients"]], "bn_stats": [first(b) for b in out["bn_stats"]],
                "global_norm": first(out["global_norm"])}

    def probe(self, batch) -> dict:
        """The update's gradient (list, aligned with model.trainable_variables, after clipping), the BN
        moving statistics it would set (aligned with `bn_variables`), the loss and the global norm, for
        one distributed batch; nothing is applied and no counter moves (seg-bench --verify-towers)."""
        if not hasattr(self, "_probe_fn"):
            self._probe_fn = tf.function(self._probe)
        return self._probe_fn(batch)

    @property
    def bn_variables(self) -> list:
        """The BN moving statistics the step updates, in the order probe() returns them."""
        return [self.state[i] for i in self._bn_pos]

    def _update_loss_scale(self, applied):
        """Dynamic loss scaling: halve on a skipped step, double after 2000 applied steps (Keras' defaults).

        The scale never goes below LOSS_SCALE_FLOOR; a step skipped at the floor is not an overflow
        but a non-finite step (train.py's _Loop decides that from the step's `loss_scale_used`).
        """
        def grow():
            self.good_steps.assign_add(1)
            done = self.good_steps >= 2000
            self.loss_scale.assign(tf.where(done, self.loss_scale * 2.0, self.loss_scale))
            self.good_steps.assign(tf.where(done, tf.constant(0, tf.int64), self.good_steps))
            return tf.constant(0)

        def shrink():
            self.loss_scale.assign(tf.maximum(self.loss_scale / 2.0, LOSS_SCALE_FLOOR))
            self.good_steps.assign(0)
            return tf.constant(0)

        tf.cond(applied, grow, shrink)

    def distribute(self, dataset_fn):
        """Distributes a per-replica-batched dataset function (see ImageReader.train_dataset)."""
        return self.strategy.distribute_datasets_from_function(dataset_fn)

    def step_function(self, element_spec):
        """The traced train step (a ConcreteFunction) for a distributed dataset's element_spec; train_step
        reuses this trace. For inspecting the graph (determinism.check_graph)."""
        scalar = lambda dtype: tf.TensorSpec([], dtype)  # noqa: E731
        return self._step_fn.get_concrete_function(element_spec, scalar(tf.float32), scalar(tf.bool), scalar(tf.bool))

    def train_step(self, batch, lr: float | None = None, stop=False, want_images=False) -> dict:
        """One update on a distributed global batch (see _train_step for the outputs).

        Args:
          batch: an element of a distributed dataset (`distribute`).
          lr: the learning rate; default: the schedule's value at the current step, computed on
            the host (so the host never waits for the device to read it).
          stop, want_images: bools or bool tensors (see _train_step).
        """
        if lr is None:
            lr = self.learning_rate()
        return self._step_fn(batch, tf.constant(lr, tf.float32), tf.constant(stop), tf.constant(want_images))

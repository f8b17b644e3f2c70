"""The one-graph multi-tower train step on a TrainState (state.py): used by seg-train, seg-bench and tests.

One step is one optimizer update in ONE tf.function over the strategy. Each tower runs the tower
pass (parallel/towers.py): for each of its K micro-batches (train.accumulate_steps), the objective's stateless
forward (BN statistics come back as values, assigned only if the update is finite), its loss sum and normaliser
(objectives/) and the backward pass. Then ONE all-reduce (SUM) of flat packs: gradients, BN statistics /
(K * towers) and per-tower scalars (scalars.py); then the update (update.py), the same on every tower.

Every loss sum is divided by the normaliser of ALL micro-batches on all towers, so K micro-batches on
N towers equal one step on K x N towers (tests/test_gradients.py). What an objective needs from the whole
global batch (the mask-classification loss's label totals) it gathers before the tower pass (`prepare`).
With synchronized BN the tower pass is traced per tower and micro-batches are unrolled in Python:
MirroredStrategy refuses a cross-tower reduction inside a tf.while_loop.
"""
from __future__ import annotations

import functools
import math
from typing import NamedTuple

import tensorflow as tf

from seg_train.config import ConfigError
from seg_train.models import stochastic
from seg_train.objectives import objective_for
from seg_train.parallel import collectives
from seg_train.parallel.towers import TowerPass
from seg_train.run.state import TrainState
from seg_train.train.scalars import TowerScalars
from seg_train.train.update import Reduced, Update


class StepResult(NamedTuple):
    """What one train step returns (tensors; the host reads them one step late, loop.py)."""
    loss: tf.Tensor  # the global loss (sum / global normaliser) + weight decay
    weight_decay: tf.Tensor
    tower_ce: tf.Tensor  # [towers] each tower's own loss: its sum over its own normaliser
    tower_grad_norm: tf.Tensor  # [towers] the norm of each tower's share of the mean gradient
    finite: tf.Tensor  # [towers] everything the tower contributed was finite (the next two)
    loss_grad_finite: tf.Tensor  # [towers]
    bn_finite: tf.Tensor  # [towers] its new BN statistics
    loss_finite: tf.Tensor  # the global loss
    applied: tf.Tensor  # the update was applied (finite, and a train step)
    global_norm: tf.Tensor  # of the update's gradient, before clipping
    clipped: tf.Tensor
    stop: tf.Tensor  # some process asked the group to stop after this step
    loss_scale: tf.Tensor  # after this step's update (the next step's)
    loss_scale_used: tf.Tensor  # the scale this step's gradients were computed with
    preds: tuple  # per tower: argmax of its first micro-batch (image-summary steps), else zeros
    var_grad_norms: tf.Tensor  # per trainable variable (image-summary steps), else zeros


class ProbeResult(NamedTuple):
    """The update a step would make, nothing applied (TrainStep.probe; seg-bench --verify-towers)."""
    loss: tf.Tensor  # without weight decay
    gradients: list  # aligned with model.trainable_variables, after clipping
    bn_stats: list  # aligned with TrainState.bn_variables
    global_norm: tf.Tensor


class _Traced(NamedTuple):
    """The tower pass and the update traced for one per-tower input shape, and that shape's pixel scale."""
    tower: object  # f(images, labels, loss_scale, tower_index, stop, want_preds, step, context) (TowerPass.trace)
    update: object  # f(packs, lr, t, loss_scale, scale_back, want_details, apply_update) (update.Update.trace)
    pixel_scale: float


def pixel_scale(b: int, h: int, w: int) -> float:
    """P: a power of two near one micro-batch's pixel count on one tower.

    Each tower differentiates loss_sum * loss_scale / P; the reduced sum is scaled back by
    P / loss_scale / (global normaliser). A power of two keeps both scalings exact; near the pixel
    count, the backward pass's magnitudes stay those of a mean (float16 needs that).
    """
    return float(2.0 ** round(math.log2(max(b * h * w, 1))))


class TrainStep:
    """The compiled train step for a TrainState built with its optimizer.

    Calling it makes one update: `TrainStep(state)(batch, lr)`. Everything it holds is fixed when it
    is built; nothing is set on it while tracing. `class_weights`: data.class_weights.class_weights_for's, needed
    when loss.class_weights names a scheme (objectives.PerPixel).
    """

    def __init__(self, state: TrainState, class_weights=None):
        cfg = state.cfg
        if state.optimizer is None:
            raise ValueError("TrainStep needs a TrainState built with its optimizer")
        if cfg.train.jit_compile and cfg.model.sync_batchnorm:
            raise ConfigError("invalid combination", "train.jit_compile",
                              "false with model.sync_batchnorm: true (synchronized BN all-reduces inside the "
                              "forward pass, which cannot be XLA-compiled per tower)")
        self.state, self.cfg, self.strategy = state, cfg, state.strategy
        self.num_replicas = state.num_replicas
        self.objective = objective_for(state.model, cfg, class_weights)
        self.accumulate = cfg.train.accumulate_steps
        # One tower: nothing is all-reduced, and packing would copy every gradient twice (concat, split).
        pack_bytes = int(cfg.train.allreduce_pack_mb * 2 ** 20) if self.num_replicas > 1 else 0
        self._grad_layout = collectives.pack_layout([v.shape for v in state.variables], pack_bytes)
        self._state_layout = collectives.pack_layout([v.shape for v in state.bn_variables], pack_bytes)
        # One tower without an L2 term: its gradient's norm is the update's global norm (the same gradient,
        # normalised), and a non-finite gradient makes that norm non-finite, so the tower spends no pass of its
        # own over the gradients on a sum of squares (update.py reads the global norm instead).
        self._own_norm = self.num_replicas > 1 or bool(cfg.model.weight_decay)
        self._tower_pass = TowerPass(functools.partial(self._tower, unrolled=state.per_tower_trace), state.variables,
                                     state.non_trainable, per_tower=state.per_tower_trace,
                                     jit_compile=(cfg.train.jit_compile and self.objective.compile_tower) or None)
        self._update = Update(state, self._grad_layout, self._state_layout, self._own_norm)
        # autograph=False (here and in every function the step traces: parallel/towers.py, the matcher): the step
        # is written with tf.cond / tf.while_loop, and AutoGraph's rewriting of every Python function it calls
        # cost about a third of the trace (docs/PERFORMANCE.md, "EoMT's start-up").
        self._step_fn = tf.function(self._train_step, autograph=False)
        self._probe_fn = tf.function(self._probe, autograph=False)

    # ---- the tower: forward and backward over the micro-batches --------------------------------------
    def _micro(self, tv, st, images, labels, scale, want_preds, sample_ids, step, context):
        """One micro-batch: (gradients of loss_sum * scale, new BN statistics, loss_sum, normalizer, preds).
        `sample_ids` seed each row's random draws (models/stochastic.py); `step` (the data position) and
        `context` (the objective's `prepare`) go to the objective."""
        with tf.GradientTape() as tape, stochastic.per_sample(sample_ids, self.cfg.seed):
            tape.watch(tv)
            micro = self.objective.micro(tv, st, images, labels, sample_ids, step, context)
            scaled = micro.loss_sum * scale
        grads = tape.gradient(scaled, tv, unconnected_gradients=tf.UnconnectedGradients.ZERO)
        grads = [tf.cast(g, tf.float32) for g in grads]
        bn = [micro.new_state[i] for i in self.state.bn_positions]
        if want_preds is None:
            preds = None
        else:
            preds = tf.cond(want_preds, lambda: tf.cast(tf.argmax(micro.predict(), axis=-1), tf.uint8),
                            lambda: tf.zeros(tf.shape(images)[:3], tf.uint8))
        return grads, bn, micro.loss_sum, micro.normalizer, preds

    def _tower(self, tv, st, images, labels, loss_scale, tower_index, stop, want_preds, step, context,
               unrolled: bool):
        """One tower's share of the update: the flat packs to all-reduce, and its predictions.

        images [K * b, h, w, 3], labels [K * b, h, w]: micro-batch m is rows m*b .. m*b+b-1. `step`: the
        state's step counter (the data position), `tower_index` the tower's index in the whole group: row
        i of micro-batch m is global sample (step*K + m)*N*b + tower_index*b + i, as the reader numbers it.
        """
        k, n = self.accumulate, self.num_replicas
        b = images.shape[0] // k
        shape_i, shape_l = [k, b] + images.shape[1:].as_list(), [k, b] + labels.shape[1:].as_list()
        images, labels = tf.reshape(images, shape_i), tf.reshape(labels, shape_l)
        scale = loss_scale / pixel_scale(b, shape_i[2], shape_i[3])

        def ids(m):
            return stochastic.sample_ids(step, m, tower_index, b, n, k)

        grads, bn, loss_sum, norm, preds = self._micro(tv, st, images[0], labels[0], scale, want_preds, ids(0),
                                                       step, context)
        if k > 1:
            def body(m, grads, bn, loss_sum, norm):
                g, s, micro_loss, z, _ = self._micro(tv, st, images[m], labels[m], scale, None, ids(m), step,
                                                     context)
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
        grad_sq = 2.0 * tf.add_n([tf.nn.l2_loss(p) for p in grad_packs]) if self._own_norm \
            else tf.constant(0.0)  # l2_loss: one op, no squared copy
        finite = tf.cast(tf.math.is_finite(grad_sq) & tf.math.is_finite(loss_sum), tf.float32)
        # BN statistics: the mean over micro-batches and towers of each one's updated statistics.
        bn_packs = [p * (1.0 / (k * n)) for p in collectives.pack(bn, self._state_layout)]
        # A moving statistic can turn non-finite while loss and gradient stay finite; assigning it
        # would poison every later evaluation, so it vetoes the update too.
        bn_finite = tf.cast(tf.reduce_all([tf.reduce_all(tf.math.is_finite(p)) for p in bn_packs]), tf.float32) \
            if bn_packs else tf.constant(1.0)
        scalars = TowerScalars(loss_sum, norm, grad_sq, finite, bn_finite, tf.cast(stop, tf.float32))
        return grad_packs + bn_packs + [scalars.pack(tower_index, n)], preds

    # ---- the step ------------------------------------------------------------------------------------
    def _tower_shape(self, images) -> tf.TensorShape:
        """One tower's image shape with its batch dimension known.

        MultiWorkerMirroredStrategy's per-tower tensors lack a static batch size, which the pixel
        scale and the micro-batch reshape need: K micro-batches of data.batch_size / towers images.
        """
        shape = images.shape
        if shape[0] is None:
            shape = tf.TensorShape([self.accumulate * (self.cfg.data.batch_size // self.num_replicas)]).concatenate(
                shape[1:])
        return shape

    def _trace(self, images, labels) -> _Traced:
        """The tower pass and the update for this per-tower input shape, traced in cross-replica context."""
        shape = self._tower_shape(images)
        label_shape = shape[:1].concatenate(labels.shape[1:])
        scalar = lambda dtype: tf.TensorSpec([], dtype)  # noqa: E731
        tower = self._tower_pass.trace(tf.TensorSpec(shape, images.dtype), tf.TensorSpec(label_shape, labels.dtype),
                                       scalar(tf.float32), scalar(tf.int32), scalar(tf.bool), scalar(tf.bool),
                                       scalar(tf.int64), self.objective.context_spec())
        k = self.accumulate
        return _Traced(tower, self._update.trace(), pixel_scale(shape[0] // k, shape[1], shape[2]))

    def _replica(self, traced: _Traced, images, labels, lr, t, loss_scale, stop, want_images, step,
                 apply_update=True):
        """One tower's part of the step (replica context): (its update.Reduced, its predictions)."""
        shape = self._tower_shape(images)
        images = tf.ensure_shape(images, shape)
        labels = tf.ensure_shape(labels, shape[:1].concatenate(labels.shape[1:]))
        context = self.objective.prepare(labels)  # what the objective needs from the whole global batch
        packs, preds = traced.tower(images, labels, loss_scale, collectives.replica_id(), stop, want_images, step,
                                    context)
        packs = collectives.all_reduce_sum(packs)
        out = traced.update(packs, lr, t, loss_scale, tf.constant(traced.pixel_scale, tf.float32), want_images,
                            tf.constant(apply_update))
        return out, preds

    def _train_step(self, batch, lr, stop=False, want_images=False) -> StepResult:
        """One update on a distributed global batch.

        Args:
          batch: (images, labels) per tower, [K * b, h, w, 3] and [K * b, h, w].
          stop: this process's wish to stop after this step (signals); all-reduced.
          want_images: also return the first micro-batch's predictions and per-variable gradient norms.
        """
        images, labels = batch
        s, st = self.strategy, self.state
        traced = self._trace(s.experimental_local_results(images)[0], s.experimental_local_results(labels)[0])
        t = tf.cast(st.optimizer.iterations + 1, tf.float32)
        loss_scale = tf.identity(st.loss_scale)
        out, preds = s.run(functools.partial(self._replica, traced),
                           (images, labels, tf.cast(lr, tf.float32), t, loss_scale,
                            tf.convert_to_tensor(stop), tf.convert_to_tensor(want_images), tf.identity(st.step)))
        return self._finish_step(out, preds, loss_scale)

    def _finish_step(self, out: Reduced, preds, loss_scale_used) -> StepResult:
        """Cross-replica end of a step: counters, loss scale, and the outputs the host reads.

        The host needs `loss_scale_used` (the step's own scale) to tell a float16 overflow from a
        non-finite gradient at the scale's floor (loss_scale.is_overflow).
        """
        s, st = self.strategy, self.state
        first = lambda v: s.experimental_local_results(v)[0]  # noqa: E731  (identical on every tower)
        applied = first(out.applied)
        st.optimizer.iterations.assign_add(tf.cast(applied, tf.int64))
        towers = TowerScalars.unpack(first(out.towers))
        st.loss_scaling.update(applied)
        st.step.assign_add(1)
        return StepResult(
            loss=tf.math.divide_no_nan(first(out.loss_total), first(out.norm_total)) + first(out.weight_decay),
            weight_decay=first(out.weight_decay),
            tower_ce=tf.math.divide_no_nan(towers.loss_sum, towers.normalizer),
            tower_grad_norm=first(out.tower_grad_norm),
            finite=(towers.finite > 0.5) & (towers.bn_finite > 0.5),
            loss_grad_finite=towers.finite > 0.5,
            bn_finite=towers.bn_finite > 0.5,
            loss_finite=tf.math.is_finite(first(out.loss_total)),
            applied=applied,
            global_norm=first(out.global_norm),
            clipped=first(out.clipped),
            stop=tf.reduce_sum(towers.stop) > 0.5,
            loss_scale=tf.identity(st.loss_scale),
            loss_scale_used=loss_scale_used,
            preds=tuple(s.experimental_local_results(preds)),
            var_grad_norms=first(out.var_grad_norms),
        )

    def _probe(self, batch) -> ProbeResult:
        images, labels = batch
        s, st = self.strategy, self.state
        traced = self._trace(s.experimental_local_results(images)[0], s.experimental_local_results(labels)[0])
        t = tf.cast(st.optimizer.iterations + 1, tf.float32)
        out, _ = s.run(functools.partial(self._replica, traced, apply_update=False),
                       (images, labels, tf.zeros([2]), t, tf.identity(st.loss_scale), tf.constant(False),
                        tf.constant(False), tf.identity(st.step)))
        first = lambda v: s.experimental_local_results(v)[0]  # noqa: E731
        return ProbeResult(loss=tf.math.divide_no_nan(first(out.loss_total), first(out.norm_total)),
                           gradients=[first(g) for g in out.gradients], bn_stats=[first(b) for b in out.bn_stats],
                           global_norm=first(out.global_norm))

    # ---- public ----------------------------------------------------------------------------------------
    def probe(self, batch) -> ProbeResult:
        """What a step on this batch would compute (gradient, BN statistics, loss, norm); nothing applied."""
        return self._probe_fn(batch)

    def concrete_function(self, element_spec):
        """The traced train step for a distributed dataset's element_spec (calls reuse it)."""
        scalar = lambda dtype: tf.TensorSpec([], dtype)  # noqa: E731
        return self._step_fn.get_concrete_function(element_spec, tf.TensorSpec([2], tf.float32), scalar(tf.bool),
                                                   scalar(tf.bool))

    def __call__(self, batch, lr: float | tuple[float, float] | None = None, stop=False,
                 want_images=False) -> StepResult:
        """One update on a distributed global batch (see _train_step).

        `lr`: TrainState.learning_rates(step), (head, backbone), computed on the host so it never waits for the
        device (default: read the counter and compute it); one number is both.
        """
        if lr is None:
            lr = self.state.learning_rates()
        pair = tuple(lr) if isinstance(lr, (tuple, list)) else (lr, lr)
        return self._step_fn(batch, tf.constant(pair, tf.float32), tf.constant(stop), tf.constant(want_images))

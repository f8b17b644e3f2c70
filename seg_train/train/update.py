"""The train step's update after the all-reduce (step.py): normalise, decay, clip, then the fused optimizer
ops, the BN statistics and the EMA (the dynamic loss scale of mixed_float16 is loss_scale.py's).

Traced once for every tower (towers.shared). Every tower computes it from the same reduced packs, so
all reach the same verdict: no second all-reduce, and the apply decision is a collective-free tf.cond.

Why fused ops (ResourceApplyAdam, ...) on Keras' own slots, not optimizer.apply_gradients: inside
strategy.run Keras reduces the gradients again, clips each tower's partial gradient, and builds
several ops per variable; the fused ops compute Keras' formulas in one op and keep its checkpoint layout.
"""

from __future__ import annotations

from typing import NamedTuple

import keras
import tensorflow as tf

from seg_train import models
from seg_train.models import param_groups
from seg_train.parallel import collectives
from seg_train.parallel.towers import handles, read_handle, shared
from seg_train.train.scalars import TowerScalars


class Reduced(NamedTuple):
    """The update's outputs on one tower (identical on every tower: computed from reduced values)."""
    applied: tf.Tensor
    global_norm: tf.Tensor
    clipped: tf.Tensor
    loss_total: tf.Tensor
    norm_total: tf.Tensor
    weight_decay: tf.Tensor
    towers: tf.Tensor  # [towers, fields]: every tower's TowerScalars (TowerScalars.table)
    tower_grad_norm: tf.Tensor
    var_grad_norms: tf.Tensor
    finite_update: tf.Tensor
    gradients: list  # the update's gradient (after clipping), for TrainStep.probe
    bn_stats: list  # the BN statistics it would set, for TrainStep.probe


def _fused_kind(optimizer) -> str:
    """Which fused op makes `optimizer`'s update: "adam", "adamw", "momentum" (SGD with momentum) or "sgd".

    Exact classes, not isinstance: AdamW subclasses Adam but adds decoupled decay. A new optimizer gets
    its kind here, its slots in `slot_variables` and its op in `fused_update`.
    """
    if type(optimizer) is keras.optimizers.Adam:
        return "adam"
    if type(optimizer) is keras.optimizers.AdamW:
        return "adamw"
    if type(optimizer) is keras.optimizers.SGD:
        return "momentum" if optimizer.momentum else "sgd"
    raise ValueError(f"no fused update for {type(optimizer).__name__}: Adam, AdamW or SGD")


def slot_variables(optimizer, variables) -> list:
    """Keras' own slot variables of each variable, in the order the fused op (`fused_update`) takes them.

    Adam and AdamW: [m, v]; SGD with momentum: [momentum]; plain SGD: []. The one place that reads
    Keras' private slot lists (no public per-variable lookup; tests/test_trainer_slots.py holds it).
    """
    index, kind = optimizer._get_variable_index, _fused_kind(optimizer)
    if kind in ("adam", "adamw"):
        return [[optimizer._momentums[index(v)], optimizer._velocities[index(v)]] for v in variables]
    if kind == "momentum":
        return [[optimizer.momentums[index(v)]] for v in variables]
    return [[] for _ in variables]


def decoupled_decay(optimizer, variables) -> list[bool]:
    """For each variable: whether `optimizer` decays it itself (AdamW's decoupled weight decay).

    Read from Keras' AdamW object (`exclude_from_weight_decay`, set in state.py), so Keras' own update
    would decay the same variables; all False for the other optimizers.
    """
    if _fused_kind(optimizer) != "adamw":
        return [False] * len(variables)
    return [bool(optimizer._use_weight_decay(v)) for v in variables]


def fused_update(optimizer, t):
    """`apply(var, slots, grad, lr, decay_lr)`: the fused TensorFlow ops making `optimizer`'s update of one variable.

    `var` and `slots` are resource handles (slots as `slot_variables` orders them), `lr` the variable's
    learning rate (multiplier applied), `t` the 1-based update count (Adam's bias correction);
    `decay_lr` (AdamW only): its decoupled decay rate (its learning rate, as in Keras and PyTorch), or
    None if not decayed. Held to Keras' update by tests/test_optimizer_reference.py.
    """
    kind = _fused_kind(optimizer)
    if kind in ("adam", "adamw"):
        b1, b2 = optimizer.beta_1, optimizer.beta_2
        b1p, b2p = tf.pow(b1, t), tf.pow(b2, t)

        def adam(var, slots, grad, lr, decay_lr=None):
            return tf.raw_ops.ResourceApplyAdam(
                var=var, m=slots[0], v=slots[1], beta1_power=b1p, beta2_power=b2p, lr=lr, beta1=b1, beta2=b2,
                epsilon=optimizer.epsilon, grad=grad)

        if kind == "adam":
            return adam
        wd = optimizer.weight_decay

        def adamw(var, slots, grad, lr, decay_lr=None):
            if decay_lr is None:
                return adam(var, slots, grad, lr)
            # Keras' AdamW: w -= w * wd * lr BEFORE the Adam step, with the variable's own learning rate. As one
            # product written back, w * (1 - lr * wd) (the assignment takes the product's buffer): Keras' form as
            # a ResourceApplyGradientDescent of w * wd read and wrote every weight once more. The two round
            # apart by a float32 ulp of w (tests/test_optimizer_reference.py holds the weights to Keras').
            w = tf.raw_ops.ReadVariableOp(resource=var, dtype=tf.float32)
            decay = tf.raw_ops.AssignVariableOp(resource=var, value=w * (1.0 - decay_lr * wd))
            with tf.control_dependencies([decay]):
                return adam(var, slots, grad, lr)

        return adamw
    if kind == "momentum":
        return lambda var, slots, grad, lr, decay_lr=None: tf.raw_ops.ResourceApplyKerasMomentum(
            var=var, accum=slots[0], lr=lr, grad=grad, momentum=optimizer.momentum)
    return lambda var, slots, grad, lr, decay_lr=None: tf.raw_ops.ResourceApplyGradientDescent(
        var=var, alpha=lr, delta=grad)


class Update:
    """The update from the reduced packs, traced once for every tower: `trace()` in cross-replica context.

    `grad_layout`, `state_layout`: how the tower pass packed gradients and BN statistics. `own_norm`: whether
    the towers sent their gradient's squared norm; if not (one tower, no L2 term), the tower's norm is the
    global norm.
    """

    def __init__(self, state, grad_layout, state_layout, own_norm: bool = True):
        cfg = state.cfg
        self.state, self.cfg = state, cfg
        self._grad_layout, self._state_layout = grad_layout, state_layout
        self._own_norm = own_norm
        decay_ids = {id(v) for v in param_groups.decay_variables(state.model)}
        self._decay = [id(v) in decay_ids for v in state.variables]
        self.slots = slot_variables(state.optimizer, state.variables)
        self._decoupled = decoupled_decay(state.optimizer, state.variables)
        # The lr multipliers scale the learning rate, not the gradient (Adam would undo that).
        t = cfg.train
        self._lr_mult = param_groups.lr_multipliers(state.model, cfg.model, t.backbone_lr_multiplier,
                                                    t.head_lr_multiplier, t.layer_decay)
        # Which of the step's two learning rates (head, backbone) each variable takes: they differ only in
        # train.backbone_warmup_steps' two-stage warmup.
        self._lr_index = [int(b) for b in models.backbone_variable_mask(state.model)]
        self._function = shared(self._apply)

    def trace(self):
        """f(packs, lr, t, loss_scale, scale_back, want_details, apply_update) -> Reduced, for strategy.run."""
        st, n = self.state, self.state.num_replicas
        res = tf.TensorSpec([], tf.resource)
        scalar = lambda dtype: tf.TensorSpec([], dtype)  # noqa: E731
        sizes = (collectives.pack_sizes([v.shape for v in st.variables], self._grad_layout)
                 + collectives.pack_sizes([v.shape for v in st.bn_variables], self._state_layout)
                 + [[TowerScalars.size(n)]])
        concrete = self._function.get_concrete_function(
            [tf.TensorSpec(x, tf.float32) for x in sizes], [res] * len(st.variables),
            [[res] * len(s) for s in self.slots], [res] * len(st.non_trainable), [res] * len(st.ema or []),
            tf.TensorSpec([2], tf.float32), scalar(tf.float32), scalar(tf.float32), scalar(tf.float32),
            scalar(tf.bool), scalar(tf.bool))
        return lambda packs, *args: concrete(packs, handles(st.variables), [handles(s) for s in self.slots],
                                             handles(st.non_trainable), handles(st.ema or []), *args)

    def _apply(self, packs, var_handles, slot_handles, state_handles, ema_handles, lr, t, loss_scale, scale_back,
               want_details, apply_update) -> Reduced:
        """Turns the reduced packs into the update and applies it on this tower's variables (traced once).

        Arithmetic on the flat packs, not per variable, to keep the graph small. `scale_back` is the
        towers' pixel scale P (step.pixel_scale).
        """
        cfg, n, variables = self.cfg, self.state.num_replicas, self.state.variables
        n_grad_packs = len(self._grad_layout) if self._grad_layout is not None else len(variables)
        grad_packs, scalars = packs[:n_grad_packs], packs[-1]
        bn = collectives.unpack(packs[n_grad_packs:-1], self._state_layout)
        table = TowerScalars.table(scalars, n)
        towers = TowerScalars.unpack(table)
        loss_total, norm_total = tf.reduce_sum(towers.loss_sum), tf.reduce_sum(towers.normalizer)
        # The normaliser is 0 only when nothing counts; the gradient is then 0.
        to_mean = tf.math.divide_no_nan(scale_back / loss_scale, norm_total)
        coeff = cfg.model.weight_decay or 0.0  # the L2 term (0 with AdamW: config/resolve.py)
        if coeff:
            # The decayed weights in the packs' layout (zeros for biases, BN scales and offsets).
            decayed = [read_handle(h, v) if d else tf.zeros(v.shape) for h, v, d in
                       zip(var_handles, variables, self._decay)]
            w_packs = collectives.pack(decayed, self._grad_layout)
            update = [g * to_mean + coeff * w for g, w in zip(grad_packs, w_packs)]
            weight_decay = coeff * tf.add_n([tf.nn.l2_loss(w) for w in w_packs])
        else:  # no L2 term: the weights are neither packed nor squared (a pass over every weight saved)
            update = [g * to_mean for g in grad_packs]
            weight_decay = tf.constant(0.0)
        global_norm = tf.sqrt(2.0 * tf.add_n([tf.nn.l2_loss(u) for u in update]))
        finite = tf.math.is_finite(global_norm) & tf.math.is_finite(loss_total) & \
            (tf.reduce_min(towers.bn_finite) > 0.5)
        clip = cfg.train.clip_global_norm
        clipped = global_norm > clip if clip else tf.constant(False)
        factor = tf.where(clipped, clip / tf.maximum(global_norm, 1e-30), 1.0) if clip else tf.constant(1.0)
        if clip:
            update = [u * factor for u in update]
        grads = collectives.unpack(update, self._grad_layout)
        apply_one = fused_update(self.state.optimizer, t)
        rates = {(m, i): (lr[i] * m if m != 1.0 else lr[i]) for m, i in set(zip(self._lr_mult, self._lr_index))}

        def apply():
            ops = [apply_one(h, slots, g, rates[mult, i], rates[mult, i] if decayed else None)
                   for g, h, slots, mult, i, decayed in zip(grads, var_handles, slot_handles, self._lr_mult,
                                                            self._lr_index, self._decoupled)]
            for pos, value in zip(self.state.bn_positions, bn):
                ops.append(tf.raw_ops.AssignVariableOp(resource=state_handles[pos], value=value))
            if ema_handles:
                # ema -= (1 - d) * (ema - w), with TF's ExponentialMovingAverage decay schedule.
                d = cfg.train.ema_decay
                rate = 1.0 - tf.minimum(d, (1.0 + t) / (10.0 + t))
                with tf.control_dependencies(ops):
                    for h, e, v in zip(var_handles, ema_handles, variables):
                        ops.append(tf.raw_ops.ResourceApplyGradientDescent(
                            var=e, alpha=rate, delta=read_handle(e, v) - read_handle(h, v)))
            with tf.control_dependencies(ops):
                return tf.constant(True)

        applied = tf.cond(finite & apply_update, apply, lambda: tf.constant(False))
        # Per-variable norms of the update's gradient (before clipping), for the histogram.
        var_norms = tf.cond(want_details,
                            lambda: tf.sqrt(tf.stack([tf.reduce_sum(tf.square(g)) for g in grads])) / factor,
                            lambda: tf.zeros([len(grads)]))
        return Reduced(applied=applied, global_norm=global_norm, clipped=clipped & applied, loss_total=loss_total,
                       norm_total=norm_total, weight_decay=weight_decay, towers=table,
                       tower_grad_norm=tf.sqrt(towers.grad_sq) * to_mean if self._own_norm else global_norm[None],
                       var_grad_norms=var_norms,
                       finite_update=finite, gradients=grads, bn_stats=bn)


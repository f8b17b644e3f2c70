"""The train step's update held to Keras' own optimizers and TensorFlow's ExponentialMovingAverage.

seg-train applies its update with TensorFlow's fused kernels on Keras' slot variables, with a
learning-rate multiplier for the backbone (and one for the head), weight decay folded into the
gradient (Adam, SGD) or decoupled (AdamW) and an EMA of the weights. Here three steps of Adam, of SGD
with momentum and of AdamW are replayed on an independent copy of the weights: the update's gradient
comes from trainer.probe (nothing applied), and is applied by keras.optimizers.Adam /
keras.optimizers.SGD(momentum=0.8) / keras.optimizers.AdamW (one Keras optimizer per learning-rate
group: the backbone at lr * 0.1, the head at lr, or lr * 10 for AdamW, SegFormer's head multiplier;
AdamW's exclusions given to Keras by name, `exclude_from_weight_decay(var_names=[bias, gamma, beta])`);
the copy's weights and Keras' slots must equal the trainer's after every step, on every tower. The EMA
is replayed with tf.train.ExponentialMovingAverage.

Tolerances, per element: weights 2e-6 absolute (float32 rounding of weights of order 1); slots
2e-4 relative plus 1e-6 of the slot's largest magnitude; the EMA 1e-7 absolute; probe's gradient
against the plain tape's 1e-4 relative plus 1e-5 absolute. The wrong answers they rule out move
elements by over 20 times more (lr = 0.01, backbone lr = 0.001):
- Adam's bias correction one step late (beta powers at t + 1): step 1's move lr * sqrt(1 - b2^t) /
  (1 - b1^t) * m / sqrt(v) shrinks from lr to 0.74 lr, 2.6e-4 on the backbone; one step early
  (t - 1) divides by 1 - b1^0 = 0 (the weights turn non-finite, step 2 is not applied).
- the backbone multiplier ignored: backbone weights move lr instead of 0.1 lr (9e-3 under Adam).
- momentum unused (plain SGD): the momentum slot stays 0 while Keras' holds -lr * g after step 1; or
  train.momentum replaced by its default 0.9 (hence 0.8 here): step 2's slot is off by 0.1 lr * g.
- weight decay left out of the update's gradient (it would be left out of probe's too, so the
  replay cannot see it): probe's gradient is held to the plain tape's gradient of the mean
  cross-entropy plus 0.5 * coefficient * |kernel|^2; every kernel has elements whose decay term
  coefficient * w is over 20 times the tolerance.
- AdamW (decay 0.5, lr 0.01, head lr 0.1): the decay applied after the Adam step instead of before
  (Keras' order) moves each head weight by lr * wd * (its Adam step) more, ~5e-3; the decay at the base
  rate instead of the variable's multiplied one, 0.09 * 0.5 * |w|; the decay on a norm or a bias (BN
  gamma is 1: 0.05 per step at the head's rate); the head multiplier given to the backbone: backbone
  steps 100x too large.
- the EMA without its cap, or its t off by one: with ema_decay 0.3, TF's decay min(0.3, (1 + n) /
  (10 + n)) is 2/11 and 3/12 at steps 1 and 2 (capped) and 0.3 at step 3; step 1's average then
  differs by 0.07 to 0.12 of the step's move.

Why the slots' tolerance is relative: the fused Adam kernel computes 1 - beta_2 in float32 from
float32(0.999), which is 1.3e-5 (relative) below Keras' 1 - 0.999, so the second moment v is that
much smaller in every element (the weights move by the square root of that, far below their
tolerance); m is rounded likewise, and where m's step-2 terms cancel its relative error grows.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from seg_train import models
from seg_train.data import synthetic
from seg_train.models import param_groups
from seg_train.objectives import pixel_losses as losses
from seg_train.parallel import replicas
from seg_train.run.state import TrainState
from seg_train.train.step import TrainStep
from tests.helpers import open_reader, tiny_config, train_batches

pytestmark = pytest.mark.slow  # DEVELOPING.md: starts processes or takes seconds per test

DEVICES = [f"/device:CPU:{i}" for i in range(4)]
STEPS = 3
EMA_DECAY = 0.3
MULT = 0.1
MOMENTUM = 0.8  # not train.momentum's default 0.9
WEIGHT_DECAY = 0.01
ADAMW_DECAY = 0.5  # large, so that where and at which rate the decay is applied shows far above the tolerance
HEAD_MULT = 10.0  # SegFormer's
WEIGHT_ATOL = 2e-6
SLOT_RTOL = 2e-4
EMA_ATOL = 1e-7
GRAD_ATOL = 1e-5


@pytest.fixture(scope="module")
def data_root(tmp_path_factory):
    return synthetic.generate(tmp_path_factory.mktemp("data") / "demo", num_train=20, num_val=2, size=(40, 48),
                              num_classes=3)


def keras_slots(opt, var, adam: bool) -> list:
    """Keras' own slot variables of `var` in optimizer `opt` (Adam, AdamW: m and v; SGD: the momentum)."""
    i = opt._get_variable_index(var)
    return [opt._momentums[i], opt._velocities[i]] if adam else [opt.momentums[i]]


def per_tower(trainer, var) -> list:
    """Every tower's copy of a (Keras or tf) variable, as numpy arrays."""
    value = var.value if isinstance(var, keras.Variable) else var
    return [np.asarray(x) for x in trainer.state.strategy.experimental_local_results(value)]


def tape_gradient(trainer, images, labels):
    """The update's gradient by the book on one tower: TensorFlow's autodiff of the mean cross-entropy
    plus 0.5 * coefficient * |kernel|^2 (BN statistics of the batch, none assigned)."""
    model = trainer.state.model
    decayed = {id(v) for v in param_groups.decay_variables(model)}
    tv = [tf.convert_to_tensor(v.value) for v in model.trainable_variables]
    st = [tf.convert_to_tensor(v.value) for v in model.non_trainable_variables]
    with tf.GradientTape() as tape:
        tape.watch(tv)
        logits, _ = model.stateless_call(tv, st, images, training=True)
        ce, count = losses.pixel_cross_entropy_sum(logits, labels, 255)
        decay = tf.add_n([tf.reduce_sum(tf.square(x)) for x, v in zip(tv, model.trainable_variables)
                          if id(v) in decayed])
        loss = ce / count + 0.5 * WEIGHT_DECAY * decay
    return [g.numpy() for g in tape.gradient(loss, tv)]


def replay(tmp_path, data_root, optimizer, towers):
    """STEPS train steps, each replayed with Keras' optimizer and TF's EMA; what both hold after each step."""
    adamw = optimizer == "adamw"
    head_mult = HEAD_MULT if adamw else 1.0
    train = {"optimizer": optimizer, "momentum": MOMENTUM, "learning_rate": 0.01, "backbone_lr_multiplier": MULT,
             "head_lr_multiplier": head_mult, "ema_decay": EMA_DECAY}
    if adamw:
        train["weight_decay"] = ADAMW_DECAY
    # AdamW: model.weight_decay left out (it resolves to 0: no L2 term beside the decoupled decay).
    cfg = tiny_config(tmp_path, data_root=data_root, model={"weight_decay": None if adamw else WEIGHT_DECAY},
                      train=train)
    assert cfg.model.weight_decay == (0.0 if adamw else WEIGHT_DECAY)
    adam = optimizer in ("adam", "adamw")
    trainer = TrainStep(TrainState(cfg, replicas.make_strategy(replicas.Devices(DEVICES[:towers], "CPU", ""))))
    it = train_batches(trainer.state, open_reader(cfg, cfg.data.train_split))

    variables = trainer.state.model.trainable_variables
    mask = models.backbone_variable_mask(trainer.state.model)
    assert 0 < sum(mask) < len(mask)  # both optimizers below have variables
    # The copies carry the variables' names (kernel, bias, gamma, beta): Keras' AdamW excludes by name.
    copy = [keras.Variable(np.asarray(v), name=v.name) for v in variables]

    def make(lr):
        if adamw:
            opt = keras.optimizers.AdamW(lr, weight_decay=ADAMW_DECAY)
            opt.exclude_from_weight_decay(var_names=["bias", "gamma", "beta"])
            return opt
        return keras.optimizers.Adam(lr) if adam else keras.optimizers.SGD(lr, momentum=MOMENTUM)

    groups = {}
    for backbone in (False, True):
        opt = make(0.0)
        members = [i for i, m in enumerate(mask) if m == backbone]
        opt.build([copy[i] for i in members])
        groups[backbone] = (opt, members)
    if adamw:  # the rule Keras was given by name excludes some of each group, and decays the others
        for opt, members in groups.values():
            used = [opt._use_weight_decay(copy[i]) for i in members]
            assert any(used) and not all(used)

    # TF's EMA: shadows are made from the copies' current values (the initial weights), then updated
    # after each step with num_updates = the number of updates applied so far, this one included.
    ema_copy = [tf.Variable(np.asarray(v)) for v in variables]
    num_updates = tf.Variable(0.0)
    tf_ema = tf.train.ExponentialMovingAverage(EMA_DECAY, num_updates=num_updates)
    tf_ema.apply(ema_copy)  # shadows = initial weights, update (w - w) * (1 - d) = 0

    initial = [np.asarray(v) for v in variables]
    records = []
    for step in range(STEPS):
        batch = next(it)
        lr = trainer.state.learning_rate()
        grads = [g.numpy() for g in trainer.probe(batch).gradients]
        tape = None
        if towers == 1:
            images, labels = (trainer.state.strategy.experimental_local_results(x)[0] for x in batch)
            tape = tape_gradient(trainer, images, labels)
        kernels = [np.asarray(v) for v in param_groups.decay_variables(trainer.state.model)]
        out = trainer(batch)
        assert bool(out.applied), f"step {step + 1} not applied (a non-finite gradient after step {step})"
        for backbone, (opt, members) in groups.items():
            opt.learning_rate = lr * MULT if backbone else lr * head_mult
            opt.apply_gradients([(grads[i], copy[i]) for i in members])
        for e, v in zip(ema_copy, variables):
            e.assign(np.asarray(v))
        num_updates.assign(step + 1)
        tf_ema.apply(ema_copy)

        slot_of = {}
        for backbone, (opt, members) in groups.items():
            for i in members:
                slot_of[i] = [np.asarray(s) for s in keras_slots(opt, copy[i], adam)]
        records.append({
            "lr": lr, "grads": grads, "tape": tape, "kernels": kernels,
            "weights": [per_tower(trainer, v) for v in variables],
            "slots": [[per_tower(trainer, s) for s in keras_slots(trainer.state.optimizer, v, adam)]
                      for v in variables],
            "ema": [per_tower(trainer, e) for e in trainer.state.ema],
            "ref_weights": [np.asarray(c) for c in copy],
            "ref_slots": [slot_of[i] for i in range(len(copy))],
            "ref_ema": [tf_ema.average(e).numpy() for e in ema_copy],
            "paths": [v.path for v in variables], "mask": mask, "initial": initial,
        })
    records[-1]["trainer"] = trainer
    return records


@pytest.fixture(scope="module")
def adam_1(tmp_path_factory, data_root):
    return replay(tmp_path_factory.mktemp("adam1"), data_root, "adam", 1)


@pytest.fixture(scope="module")
def sgd_1(tmp_path_factory, data_root):
    return replay(tmp_path_factory.mktemp("sgd1"), data_root, "sgd", 1)


@pytest.fixture(scope="module")
def adamw_2(tmp_path_factory, data_root):
    return replay(tmp_path_factory.mktemp("adamw2"), data_root, "adamw", 2)


# AdamW on two towers only: its update is Adam's fused op after the decay (plain Adam's op for the excluded
# variables), so it holds Adam's path on several towers too, for one trace fewer; the update's code does not
# depend on the tower count, so no 1-tower AdamW run. Two towers: every tower's copy is compared, and a second
# tower is what an update applied on the first tower only, or computed from its own gradient, gets wrong; two
# more add trace time and no other wrong answer.
CASES = ["adam_1", "sgd_1", "adamw_2"]


@pytest.mark.parametrize("case", CASES)
def test_weights_and_slots_match_keras(case, request):
    records = request.getfixturevalue(case)
    for step, r in enumerate(records, 1):
        for path, towers, ref in zip(r["paths"], r["weights"], r["ref_weights"]):
            for got in towers:
                np.testing.assert_allclose(got, ref, rtol=0, atol=WEIGHT_ATOL, err_msg=f"{path} step {step}")
        for path, towers, refs in zip(r["paths"], r["slots"], r["ref_slots"]):
            for kind, (slot, ref) in enumerate(zip(towers, refs)):
                scale = float(np.abs(ref).max())
                for got in slot:
                    np.testing.assert_allclose(got, ref, rtol=SLOT_RTOL, atol=1e-6 * scale,
                                               err_msg=f"{path} slot {kind} step {step}")
    # It trained, the backbone too (an equality of no-ops proves nothing).
    last = records[-1]
    for backbone in (False, True):
        moved = max(float(np.abs(w - w0).max()) for w, w0, m in zip(last["ref_weights"], records[0]["initial"],
                                                                    last["mask"]) if m == backbone)
        assert moved > 1e-4, f"backbone={backbone}"


@pytest.mark.parametrize("case", CASES)
def test_ema_matches_tf_exponential_moving_average(case, request):
    """trainer.state.ema == tf.train.ExponentialMovingAverage(decay, num_updates=n) applied after the n-th
    update (n = 1 at the first step: the trainer's t is the optimizer's iteration count after this
    update), from shadows that start at the initial weights."""
    records = request.getfixturevalue(case)
    for step, r in enumerate(records, 1):
        for path, towers, ref in zip(r["paths"], r["ema"], r["ref_ema"]):
            for got in towers:
                np.testing.assert_allclose(got, ref, rtol=0, atol=EMA_ATOL, err_msg=f"{path} ema step {step}")
    # The average lags the weights (it is not the weights, nor the initial weights).
    last = records[-1]
    assert max(float(np.abs(e[0] - w).max()) for e, w in zip(last["ema"], last["ref_weights"])) > 1e-4
    assert max(float(np.abs(e[0] - w).max()) for e, w in zip(last["ema"], records[0]["initial"])) > 1e-4


@pytest.mark.parametrize("case", ["adam_1", "sgd_1"])
def test_update_gradient_is_tape_gradient_plus_weight_decay(case, request):
    """The gradient replayed above is the update's: the plain tape's, weight decay included."""
    records = request.getfixturevalue(case)
    for step, r in enumerate(records, 1):
        for path, got, ref in zip(r["paths"], r["grads"], r["tape"]):
            np.testing.assert_allclose(got, ref, rtol=1e-4, atol=GRAD_ATOL, err_msg=f"{path} step {step}")
    # Every kernel's decay term is far above the tolerance, so leaving it out fails.
    assert min(WEIGHT_DECAY * float(np.abs(k).max()) for k in records[0]["kernels"]) > 20 * GRAD_ATOL


def _slots_by_variable(opt, variables) -> list:
    return [[np.asarray(s) for s in keras_slots(opt, v, True)] for v in variables]


def test_adamw_checkpoint_is_keras_adamws_and_restores_both_ways(adamw_2, tmp_path):
    """Checkpoint layout: a Keras AdamW object. seg-train's checkpoint after three AdamW steps on 2 towers restores
    into a keras.optimizers.AdamW built by hand on a fresh model (m and v of every variable equal seg-train's, the
    update count 3); Keras' own AdamW then makes a step (apply_gradients) and its checkpoint restores into a
    seg-train TrainState (its slots equal Keras'). Fails for slots kept anywhere else than Keras' object
    (another object name or variable order would not restore, or restore into the wrong variables)."""
    trainer = adamw_2[-1]["trainer"]
    state = trainer.state
    prefix = tf.train.Checkpoint(**state.checkpoint_objects()).write(str(tmp_path / "seg" / "ckpt"))
    cfg = state.cfg
    model = models.build(cfg.model, cfg.data.num_classes, seed=1)  # other initial weights
    opt = keras.optimizers.AdamW(0.01, weight_decay=ADAMW_DECAY)
    opt.build(model.trainable_variables)
    tf.train.Checkpoint(model=model, optimizer=opt).read(prefix).expect_partial().assert_existing_objects_matched()
    assert int(opt.iterations.numpy()) == STEPS
    ours = _slots_by_variable(state.optimizer, state.model.trainable_variables)
    for path, got, want in zip([v.path for v in model.trainable_variables],
                               _slots_by_variable(opt, model.trainable_variables), ours):
        for g, w in zip(got, want):
            np.testing.assert_array_equal(g, w, err_msg=path)
    assert max(float(np.abs(m).max()) for m, _ in ours) > 1e-3  # slots that moved

    # Keras' AdamW steps on, and seg-train restores its slots.
    rng = np.random.default_rng(0)
    opt.apply_gradients([(rng.normal(size=v.shape).astype(np.float32), v) for v in model.trainable_variables])
    keras_prefix = tf.train.Checkpoint(model=model, optimizer=opt).write(str(tmp_path / "keras" / "ckpt"))
    fresh = TrainState(cfg, replicas.make_strategy(replicas.Devices(DEVICES[:1], "CPU", "")))
    tf.train.Checkpoint(model=fresh.model, optimizer=fresh.optimizer).read(keras_prefix).expect_partial() \
        .assert_existing_objects_matched()
    assert int(fresh.optimizer.iterations.numpy()) == STEPS + 1
    for got, want in zip(_slots_by_variable(fresh.optimizer, fresh.model.trainable_variables),
                         _slots_by_variable(opt, model.trainable_variables)):
        for g, w in zip(got, want):
            np.testing.assert_array_equal(g, w)
    for a, b in zip(fresh.model.weights, model.weights):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_adamw_exclusions_are_in_keras_object(adamw_2):
    """seg-train's AdamW decays what Keras' AdamW object says it decays (update.decoupled_decay reads it),
    which is the conv/dense kernels: every kernel decayed, every bias, BN gamma and beta not."""
    from seg_train.train import update

    state = adamw_2[-1]["trainer"].state
    flags = update.decoupled_decay(state.optimizer, state.variables)
    names = [v.name for v in state.variables]
    assert {n for n, f in zip(names, flags) if f} == {"kernel", "depthwise_kernel", "pointwise_kernel"} & set(names)
    assert {n for n, f in zip(names, flags) if not f} == set(names) - {"kernel", "depthwise_kernel",
                                                                      "pointwise_kernel"}
    assert {"bias", "gamma", "beta"} <= {n for n, f in zip(names, flags) if not f}

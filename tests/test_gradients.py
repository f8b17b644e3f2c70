"""The gradient path: accumulation equals towers, clipping and gradient norms independent of the tower
count, packed all-reduce exact, loss options tower-invariant.

Each test would fail for a known wrong answer: micro-batches normalised by their own pixels or
averaged (Keras' gradient_accumulation_steps), BN statistics carried from one micro-batch to the
next, weight decay counted per micro-batch, per-tower clipping (Keras' clipnorm / global_clipnorm
under a strategy), a norm taken before the all-reduce, a second reduction after packing.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from seg_train.data import synthetic
from seg_train.models import param_groups
from seg_train.objectives import pixel_losses as losses
from seg_train.parallel import replicas
from seg_train.run.state import TrainState
from seg_train.train.step import TrainStep
from tests.helpers import open_reader, random_batch, tiny_config, train_batches

pytestmark = pytest.mark.slow  # DEVELOPING.md: starts processes or takes seconds per test

DEVICES = [f"/device:CPU:{i}" for i in range(4)]


def strategy(n):
    return replicas.make_strategy(replicas.Devices(DEVICES[:n], "CPU", ""))


@pytest.fixture(scope="module")
def data_root(tmp_path_factory):
    return synthetic.generate(tmp_path_factory.mktemp("data") / "demo", num_train=20, num_val=2, size=(40, 48),
                              num_classes=3)


def run(cfg, towers, steps):
    """`steps` updates through the real reader stream, as train.py feeds them; also the state before the first
    (the same seed builds the same weights, so it stands for a fresh model of this config)."""
    trainer = TrainStep(TrainState(cfg, strategy(towers)))
    start = state(trainer)
    it = train_batches(trainer.state, open_reader(cfg, cfg.data.train_split))
    outs = [trainer(next(it)) for _ in range(steps)]
    return trainer, outs, start


def state(trainer):
    """Weights (BN moving statistics included) and optimizer slots, by path."""
    out = {v.path: np.asarray(v) for v in trainer.state.model.weights}
    # Keras names each optimizer instance apart (adam, adam_1, ...): key slots by position.
    out.update({f"optimizer/{i}": np.asarray(v) for i, v in enumerate(trainer.state.optimizer.variables)})
    return out


def assert_states_close(a, b, atol=None, rtol=None):
    assert a.keys() == b.keys() and len(a) > 50
    for key in a:
        if rtol is not None:
            scale = max(float(np.abs(a[key]).max()), 1e-6)
            assert float(np.abs(a[key] - b[key]).max()) <= rtol * scale, key
        else:
            np.testing.assert_allclose(a[key], b[key], atol=atol, err_msg=key)


ACC_COMMON = {"model": {"sync_batchnorm": False, "bn_momentum": 0.5, "weight_decay": 0.05}}
ACC_SGD = {"optimizer": "sgd", "learning_rate": 0.1}


@pytest.fixture(scope="module")
def accumulation_reference(tmp_path_factory, data_root):
    """The reference of both accumulation cases: 2 steps of batch 8 on 4 towers, and the state it started from
    (read only by the tests)."""
    cfg = tiny_config(tmp_path_factory.mktemp("ref"), data_root=data_root, data={"batch_size": 8}, train=ACC_SGD,
                      **ACC_COMMON)
    ref, ref_out, start = run(cfg, 4, 2)
    return state(ref), ref_out, start


@pytest.mark.parametrize("towers, k, batch", [(1, 4, 2), (2, 2, 4)])
def test_accumulation_equals_towers(tmp_path, data_root, accumulation_reference, towers, k, batch):
    """K micro-batches of batch B on T towers == one step of batch K*B on K*T towers (no sync BN).

    SGD with momentum: Adam's first steps are lr * g / |g| elementwise, which turns float rounding
    in near-zero gradient elements into O(lr) differences and would hide the comparison.
    """
    ref_state, ref_out, start = accumulation_reference
    acc_cfg = tiny_config(tmp_path / "acc", data_root=data_root, data={"batch_size": batch},
                          train={**ACC_SGD, "accumulate_steps": k}, **ACC_COMMON)
    acc, acc_out, acc_start = run(acc_cfg, towers, 2)
    acc_state = state(acc)
    assert_states_close(ref_state, acc_state, atol=1e-5)
    for a, b in zip(ref_out, acc_out):
        np.testing.assert_allclose(float(a.loss), float(b.loss), rtol=1e-5)
        np.testing.assert_allclose(float(a.global_norm), float(b.global_norm), rtol=1e-4)
    # It trained (an equality of two no-ops proves nothing), and the BN statistics moved (from the same start).
    assert_states_close(start, acc_start, atol=0)
    moved = max(float(np.abs(acc_state[v.path] - start[v.path]).max()) for v in acc.state.model.weights)
    assert moved > 1e-3


def probe(cfg, towers, images, labels, class_weights=None):
    trainer = TrainStep(TrainState(cfg, strategy(towers)), class_weights=class_weights)
    dist = trainer.state.strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensors((images, labels)))
    return trainer, dist, trainer.probe(next(iter(dist)))


def plain_gradient(cfg, images, labels):
    """The update's gradient by the book: one model, one GradientTape, the global mean + decay."""
    trainer = TrainStep(TrainState(cfg, strategy(1)))
    model = trainer.state.model
    with tf.GradientTape() as tape:
        logits = model(images, training=True)
        ce, count = losses.pixel_cross_entropy_sum(logits, labels, 255)
        loss = ce / count + param_groups.weight_decay(param_groups.decay_variables(model), cfg.model.weight_decay)
    grads = tape.gradient(loss, model.trainable_variables)
    return grads, float(tf.linalg.global_norm(grads))


CLIP = 0.5


@pytest.fixture(scope="module")
def clipped_steps(tmp_path_factory):
    """One step with clipping (train.clip_global_norm 0.5, plain SGD, synchronized BN, weight decay) on 1 and on
    4 towers from the same seeded weights and batch, and the plain tape's gradient and norm on that batch;
    read only by the global-norm and the clipping tests (the norm is taken before clipping either way)."""
    cfg = tiny_config(tmp_path_factory.mktemp("clip"), model={"sync_batchnorm": True, "weight_decay": 0.05},
                      train={"optimizer": "sgd", "learning_rate": 0.5, "clip_global_norm": CLIP})
    images, labels = random_batch(ignore_rows=[20, 0, 5, 0])
    grads, norm = plain_gradient(cfg, images, labels)
    trainers, starts, outs = [], [], []
    for n in (1, 4):
        trainer = TrainStep(TrainState(cfg, strategy(n)))
        starts.append([v.numpy() for v in trainer.state.model.trainable_variables])
        dist = trainer.state.strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensors((images, labels)))
        outs.append(trainer(next(iter(dist))))
        trainers.append(trainer)
    return {"cfg": cfg, "images": images, "labels": labels, "grads": grads, "norm": norm, "trainers": trainers,
            "starts": starts, "outs": outs}


def test_global_norm_is_the_plain_tape_norm_on_any_tower_count(clipped_steps):
    expected = clipped_steps["norm"]
    for n, out in zip((1, 4), clipped_steps["outs"]):
        np.testing.assert_allclose(float(out.global_norm), expected, rtol=1e-5)
        # Each tower's share before the all-reduce: shares add up to the cross-entropy gradient.
        assert out.tower_grad_norm.shape == (n,) and np.all(out.tower_grad_norm.numpy() > 0)


def test_clipping_is_tower_invariant_and_per_tower_clipping_is_not(clipped_steps):
    clip = CLIP
    cfg, images, labels = clipped_steps["cfg"], clipped_steps["images"], clipped_steps["labels"]
    grads, norm = clipped_steps["grads"], clipped_steps["norm"]
    results, starts = clipped_steps["trainers"], clipped_steps["starts"]
    assert norm > 4 * clip  # clipping really happens
    assert all(bool(out.clipped) for out in clipped_steps["outs"])
    for a, b in zip(results[0].state.model.weights, results[1].state.model.weights):
        np.testing.assert_allclose(a.numpy(), b.numpy(), atol=1e-5, err_msg=a.path)
    # SGD's first step is -lr * clipped gradient: check the clipped update against the plain tape's (both
    # tower counts started from the same weights, the plain tape's too: the same seed).
    for v0, v4 in zip(*starts):
        np.testing.assert_array_equal(v0, v4)
    for g, v0, v1 in zip(grads, starts[0], results[0].state.model.trainable_variables):
        np.testing.assert_allclose(v1.numpy() - v0, -0.5 * g.numpy() * clip / norm, atol=1e-6)

    # Keras' global_clipnorm under a strategy clips each tower's partial gradient before its own
    # all-reduce: the same step on 4 towers then moves the weights differently.
    st = strategy(4)
    keras_trainer = TrainStep(TrainState(cfg, st))
    with st.scope():
        opt = keras.optimizers.SGD(learning_rate=0.5, momentum=0.9, global_clipnorm=clip)
        opt.build(keras_trainer.state.model.trainable_variables)
    model = keras_trainer.state.model

    @tf.function
    def keras_step(x, y):
        def replica(x, y):
            with tf.GradientTape() as tape:
                logits = model(x, training=True)
                ce, _ = losses.pixel_cross_entropy_sum(logits, y, 255)
                count = float(np.sum(labels != 255))
                wd = param_groups.weight_decay(param_groups.decay_variables(model), cfg.model.weight_decay)
                loss = ce / count + wd / 4.0  # each tower's share of the global objective
            g = tape.gradient(loss, model.trainable_variables)
            opt.apply_gradients(zip(g, model.trainable_variables))
        st.run(replica, (x, y))

    dist = st.experimental_distribute_dataset(tf.data.Dataset.from_tensors((images, labels)))
    keras_step(*next(iter(dist)))
    diff = max(float(np.abs(a.numpy() - b.numpy()).max())
               for a, b in zip(results[1].state.model.trainable_variables, model.trainable_variables))
    assert diff > 1e-3


def test_packing_is_exact(tmp_path):
    """Packed (many small packs, some of one tensor, some of several) vs unpacked (one all-reduce per tensor):
    the same update, and not reduced twice (the plain tape's gradient on one tower). The default packs this model
    into one pack of several tensors: the layout is checked, not stepped (the same pack and unpack code as the
    small packs' groups of several)."""
    images, labels = random_batch(ignore_rows=[20, 0, 5, 0])
    default = TrainStep(TrainState(tiny_config(tmp_path / "default", model={"sync_batchnorm": False}), strategy(4)))
    assert len(default._grad_layout) == 1 and len(default._grad_layout[0]) > 1
    results = {}
    for name, pack_mb in (("unpacked", 0.0), ("small", 0.002)):
        cfg = tiny_config(tmp_path / name, model={"sync_batchnorm": False}, train={"allreduce_pack_mb": pack_mb})
        results[name] = probe(cfg, 4, images, labels)
    assert results["unpacked"][0]._grad_layout is None
    layout = results["small"][0]._grad_layout
    assert len(layout) > 3 and {len(group) > 1 for group in layout} == {True, False}  # both kinds of pack
    ref, got = results["unpacked"][2], results["small"][2]
    for a, b in zip(ref.gradients + ref.bn_stats, got.gradients + got.bn_stats):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-6, atol=1e-7)
    # Not reduced twice: on one tower the reduced gradient is the plain tape's (on 4 towers without
    # sync BN each tower's BN normalises its own quarter, which a single tape cannot reproduce).
    cfg = tiny_config(tmp_path / "one", model={"sync_batchnorm": False})
    _, _, one = probe(cfg, 1, images, labels)
    grads, _ = plain_gradient(cfg, images, labels)
    for a, b in zip(grads, one.gradients):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-4, atol=1e-6)



def test_backbone_lr_multiplier_scales_only_the_backbone_step(tmp_path):
    """One plain SGD step with train.backbone_lr_multiplier 0.1: every backbone weight moves by
    -0.1 * lr * (the plain tape's gradient), every head weight by -lr * gradient. Wrong answers: the
    multiplier ignored (backbone steps 10x too large), or applied to the head instead."""
    lr, mult = 0.5, 0.1
    cfg = tiny_config(tmp_path, model={"sync_batchnorm": False, "weight_decay": 0.05},
                      train={"optimizer": "sgd", "momentum": 0.0, "learning_rate": lr, "backbone_lr_multiplier": mult})
    images, labels = random_batch(ignore_rows=[20, 0, 5, 0])
    grads, _ = plain_gradient(cfg, images, labels)
    trainer = TrainStep(TrainState(cfg, strategy(1)))
    start = [v.numpy() for v in trainer.state.model.trainable_variables]
    dist = trainer.state.strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensors((images, labels)))
    trainer(next(iter(dist)), lr=lr)
    paths = [v.path for v in trainer.state.model.trainable_variables]
    in_backbone = [p.startswith(("stem_", "stage")) for p in paths]  # the tiny backbone's layer names
    assert 0 < sum(in_backbone) < len(paths)
    for g, w0, v, backbone in zip(grads, start, trainer.state.model.trainable_variables, in_backbone):
        want = -lr * (mult if backbone else 1.0) * g.numpy()
        np.testing.assert_allclose(v.numpy() - w0, want, rtol=1e-3, atol=1e-6, err_msg=v.path)
    assert max(float(np.abs(g.numpy()).max()) for g, b in zip(grads, in_backbone) if b) * lr > 1e-3

# Top-k alone is the combined case with unit weights; the combined case also checks the weighted
# normaliser of the kept pixels (it depends on the logits).
@pytest.fixture(scope="module")
def plain_loss(tmp_path_factory):
    """The loss without loss options on the batch of test_loss_options_tower_invariant (1 tower)."""
    images, labels = random_batch(ignore_rows=[20, 0, 5, 0])
    _, _, base = probe(tiny_config(tmp_path_factory.mktemp("plain"), model={"sync_batchnorm": True}), 1, images,
                       labels)
    return float(base.loss)


def test_loss_options_tower_invariant(tmp_path, plain_loss):
    # Class weights with top-k: the weighted normaliser of the kept pixels and the ranking at once (class weights
    # alone on 1 and 4 towers: tests/test_loss_terms.py).
    cfg = tiny_config(tmp_path, model={"sync_batchnorm": True},
                      loss={"class_weights": [0.2, 1.0, 3.0], "top_k_percent_pixels": 0.3})
    images, labels = random_batch(ignore_rows=[20, 0, 5, 0])
    # 2 towers of 2 images (synchronized BN traces the pass once per tower): the towers' valid-pixel counts
    # differ (20 and 5 ignored rows), and a tower ranks 2 images together, so a normaliser or a top-k
    # ranking per tower batch instead of per image shows (with 1 image per tower the ranking could not).
    _, _, one = probe(cfg, 1, images, labels)
    _, _, two = probe(cfg, 2, images, labels)
    np.testing.assert_allclose(float(one.loss), float(two.loss), rtol=1e-5)
    g1 = np.concatenate([g.numpy().ravel() for g in one.gradients])
    g2 = np.concatenate([g.numpy().ravel() for g in two.gradients])
    # Relative L2: with top-k, pixels whose losses tie at the cut-off to float precision may be
    # kept on one tower count and not the other (a few gradient elements); ranking per tower batch
    # instead of per image would change the kept set wholesale (tens of %).
    assert np.linalg.norm(g1 - g2) / np.linalg.norm(g1) < 1e-3
    # And the option changes the loss (it is really on).
    assert abs(plain_loss - float(one.loss)) > 1e-3


def test_keras_gradient_accumulation_is_not_usable_with_towers():
    """Why train.accumulate_steps is the train step's own: Keras 3.15's optimizer option fails under
    a strategy (its update and all-reduce sit in a replica-context cond), and on one device it
    averages the micro-batch gradients, so micro-batch losses normalised to the whole update (the
    global valid-pixel count) get half the step with 2 micro-batches."""
    st = strategy(4)
    with st.scope():
        w = tf.Variable(np.ones((3, 1), np.float32))
        opt = keras.optimizers.SGD(learning_rate=0.1, gradient_accumulation_steps=2)
        opt.build([w])

    @tf.function
    def step(x):
        def replica(x):
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(tf.matmul(x, w))
            opt.apply_gradients(zip(tape.gradient(loss, [w]), [w]))
        st.run(replica, (x,))

    x = st.experimental_distribute_dataset(tf.data.Dataset.from_tensors(np.ones((4, 3), np.float32)))
    with pytest.raises(RuntimeError, match="merge_call"):
        step(next(iter(x)))

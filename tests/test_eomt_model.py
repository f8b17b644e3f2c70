"""EoMT (models/eomt/eomt.py) held to transformers' EomtForUniversalSegmentation: the fixture
tests/fixtures/eomt_model.npz (scripts/reference_eomt_model.py: a 5-block ViT of width 32, 8 queries, the last
3 blocks EoMT blocks, 5 classes, 2 registers, random weights, two 64x64 images) is loaded into seg-train's
model by its transformers names (tests/helpers.py: eomt_from_reference) and every output compared in float32
at 1e-4 of the largest reference value: the eval-mode prediction, all four predictions of the training-mode
pass with every attention mask kept, and the semantic scores of the reference's post-processing. Then what
the reference cannot show: one trace for any size, probability 0 = no masking, and the mask draw a pure
function of (sample seed, block).
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from seg_train.models import backbone_of, backbone_variable_mask
from seg_train.models.eomt.eomt import eomt, mask_keeps
from seg_train.models.stochastic import per_sample
from tests.helpers import eomt_from_reference

TOLERANCE = 1e-4  # of the largest reference value; float32 against torch's float32 (seen: ~5e-7)
BLOCKS = 3  # the fixture's num_blocks
ALL = [1.0] * BLOCKS


@pytest.fixture(scope="module")
def ref():
    return eomt_from_reference()


def _close(ours, theirs, tol=TOLERANCE):
    ours, theirs = np.asarray(ours), np.asarray(theirs)
    assert ours.shape == theirs.shape, (ours.shape, theirs.shape)
    err = np.max(np.abs(ours - theirs)) / np.max(np.abs(theirs))
    assert err < tol, err


def _seeds(*rows):
    return tf.constant(rows, tf.int32)


def _semantic_reference(z):
    return np.transpose(z["eval_semantic"], (0, 2, 3, 1))  # [b, K, H, W] -> ours [b, H, W, K]


def test_eval_prediction_is_the_references(ref):
    """training=False: one prediction, the reference's eval output. Fails for: the queries joined before the
    wrong block, the final LayerNorm skipped before the heads, the position embeddings given to CLS or
    dropped, registers out of place, the upscale's transposed-conv kernel misread or a step of it dropped, the
    mask MLP's activations, the class head on unnormed queries."""
    model, z = ref
    got = model.predictions(z["images"])
    assert len(got) == 1
    class_logits, mask_logits = got[0]
    assert class_logits.dtype == mask_logits.dtype == tf.float32
    _close(class_logits, z["eval_class"][0])
    _close(mask_logits, z["eval_mask"][0])


def test_masked_training_forward_is_the_references(ref):
    """training=True, every mask kept (p = 1 in each block): the four predictions (one before each EoMT block,
    then the final one) are the reference's, in its order; masking changes the final one (so this sees it).
    Fails for: the threshold's sign or level, masks resized another way to the patch grid, the mask from a
    prediction after its block instead of before, patches masked for CLS or the patches instead of for the
    queries, predictions missing or out of order."""
    model, z = ref
    got = model.predictions(z["images"], ALL, _seeds([1, 2], [3, 4]), training=True)
    assert len(got) == BLOCKS + 1
    for i, (class_logits, mask_logits) in enumerate(got):
        _close(class_logits, z["masked_class"][i])
        _close(mask_logits, z["masked_mask"][i])
    assert np.max(np.abs(z["masked_mask"][-1] - z["eval_mask"][0])) > 100 * TOLERANCE * np.max(np.abs(z["eval_mask"]))


def test_semantic_output_is_the_references_post_processing(ref):
    """model(images, training=False) = log of the scores post_process_semantic_segmentation gives ([b, H, W, K]
    float32). Fails for: the no-object class kept or another one dropped, the scores summed before the masks
    are resized (not the reference's order), softmax over the queries, a missing sigmoid, the log left out."""
    model, z = ref
    got = model(z["images"], training=False)
    assert got.dtype == tf.float32 and tuple(got.shape) == (2, 64, 64, 5)
    _close(np.exp(got), _semantic_reference(z))
    _close(got, np.log(_semantic_reference(z)))


@pytest.mark.slow
def test_one_trace_serves_two_sizes(ref):
    """Traced once with unknown H and W (inference and the masked training pass): the fixture's size gives the
    reference, a non-square size its shapes. Fails for: a grid, an upscale size or a resize taken from the
    traced shape (None) or fixed at build time."""
    model, z = ref
    spec = tf.TensorSpec([None, None, None, 3], tf.float32)
    infer = tf.function(lambda x: model(x, training=False), input_signature=[spec])
    train = tf.function(lambda x, s: model.predictions(x, ALL, s, training=True),
                        input_signature=[spec, tf.TensorSpec([None, 2], tf.int32)])
    other = np.random.default_rng(3).normal(0, 1, (2, 48, 80, 3)).astype("float32")
    assert tuple(infer(other).shape) == (2, 48, 80, 5)
    _close(infer(z["images"]), np.log(_semantic_reference(z)))
    assert [tuple(m.shape) for _, m in train(other, _seeds([1, 2], [3, 4]))] == [(2, 8, 12, 20)] * (BLOCKS + 1)
    got = train(z["images"], _seeds([1, 2], [3, 4]))
    _close(got[-1][1], z["masked_mask"][-1])
    assert infer.experimental_get_tracing_count() == train.experimental_get_tracing_count() == 1
    class_logits, mask_logits = train.get_concrete_function().structured_outputs[-1]
    assert class_logits.shape.as_list() == [None, 8, 6] and mask_logits.shape.as_list() == [None, 8, None, None]


def test_mask_probability_zero_is_no_masking(ref):
    """p = 0 in every block: the training pass's predictions are those without mask_probs, and its final one
    the reference's unmasked prediction. Fails for: the keep test inverted (u >= p: every mask kept at p = 0),
    the bias added whatever the draw."""
    model, z = ref
    seeds = _seeds([5, 6], [7, 8])
    zero = model.predictions(z["images"], [0.0] * BLOCKS, seeds, training=True)
    plain = model.predictions(z["images"], None, None, training=True)
    for (c0, m0), (c1, m1) in zip(zero, plain):
        np.testing.assert_array_equal(c0, c1)
        np.testing.assert_array_equal(m0, m1)
    _close(zero[-1][1], z["eval_mask"][0])
    _close(zero[-1][0], z["eval_class"][0])


@pytest.mark.slow  # seven training passes: ~2-4 s
def test_mask_draw_is_a_function_of_seed_and_block(ref):
    """At p = 0.5: the same seeds give the same output; a batch gives what its samples give alone (1 tower =
    N towers); a sample's result does not depend on the other sample; another seed changes it. mask_keeps
    differs between blocks. Fails for: a global or per-call RNG, one seed for the whole batch (seeds[0]
    drawing [b, Q]), the block index not folded in."""
    model, z = ref
    x = z["images"]
    half = [0.5] * BLOCKS
    other = np.random.default_rng(9).normal(0, 1, x.shape[1:]).astype("float32")

    def final(images, seeds):
        return np.asarray(model.predictions(images, half, _seeds(*seeds), training=True)[-1][1])

    both = final(x, ([11, 12], [13, 14]))
    np.testing.assert_array_equal(final(x, ([11, 12], [13, 14])), both)
    _close(final(x[1:], ([13, 14],))[0], both[1], 1e-6)
    _close(final(x[:1], ([11, 12],))[0], both[0], 1e-6)
    _close(final(np.stack([other, x[1]]), ([21, 22], [13, 14]))[1], both[1], 1e-6)
    assert np.max(np.abs(final(x, ([11, 12], [15, 16]))[1] - both[1])) > 1e-3
    keeps = [np.asarray(mask_keeps(_seeds([11, 12], [13, 14]), j, 0.5, 64)) for j in range(BLOCKS)]
    assert not np.array_equal(keeps[0], keeps[1]) and not np.array_equal(keeps[1], keeps[2])
    assert 0.3 < np.mean(keeps) < 0.7
    np.testing.assert_array_equal(np.asarray(mask_keeps(_seeds([13, 14]), 1, 0.5, 64))[0], keeps[1][1])


def test_one_backbone_and_every_variable_made_at_construction(ref):
    """backbone_of finds the ViT (its variables: those of patch_embed, tokens, blocks and norm), and a forward
    creates no variable. Fails for: the mask module or the queries inside the backbone (the backbone learning
    rate would scale them), a second nested model, variables built lazily in a trace (under tf.distribute)."""
    model, z = ref
    assert backbone_of(model) is model.backbone
    mask = backbone_variable_mask(model)
    names = [v.path for v, inside in zip(model.trainable_variables, mask) if not inside]
    assert sorted(n.split("/")[0] for n in names) == sorted(
        ["eomt", "class_head", "class_head"] + [f"mask_mlp{i}" for i in (1, 2, 3) for _ in (0, 1)]
        + [f"upscale{i}_{p}" for i in (1, 2) for p in ("deconv", "deconv", "dwconv", "norm", "norm")])
    before = len(model.weights)
    model.predictions(z["images"][:1], ALL, _seeds([1, 2]), training=True)
    assert len(model.weights) == before
    with pytest.raises(ValueError, match="eomt_blocks 6"):
        eomt(model.spec, 5, queries=8, eomt_blocks=6)
    with pytest.raises(ValueError, match=r"one probability per EoMT block, \[3\]"):
        model.predictions(z["images"][:1], [1.0, 1.0], _seeds([1, 2]), training=True)


def test_training_pass_reaches_every_variable(ref):
    """A loss on every prediction of a masked training pass has a gradient for each trainable variable. Fails
    for: a variable outside the training graph (a head used only at inference, queries not joined)."""
    model, z = ref
    with tf.GradientTape() as tape:
        got = model.predictions(z["images"], [0.5] * BLOCKS, _seeds([1, 2], [3, 4]), training=True)
        loss = tf.add_n([tf.reduce_sum(c ** 2) + tf.reduce_sum(tf.sigmoid(m)) for c, m in got])
    grads = tape.gradient(loss, model.trainable_variables)
    assert [v.path for v, g in zip(model.trainable_variables, grads) if g is None] == []


@pytest.mark.slow
def test_mirrored_variables_and_towers_agree(ref):
    """Built in a 2-tower MirroredStrategy scope: every variable mirrored, and the masked training pass run on
    both towers (one sample each) gives the 1-tower batch's predictions. Fails for: variables created per
    tower or in the first call, a draw that depends on the tower."""
    model, z = ref
    strategy = tf.distribute.MirroredStrategy(["/device:CPU:0", "/device:CPU:1"])
    with strategy.scope():
        mirrored = eomt(model.spec, 5, queries=8, eomt_blocks=BLOCKS)
    mirrored.set_weights(model.get_weights())
    assert all(isinstance(v.value, tf.distribute.DistributedValues) or "Mirrored" in type(v.value).__name__
               for v in mirrored.weights)
    seeds = np.array([[1, 2], [3, 4]], np.int32)
    half = [0.5] * BLOCKS

    @tf.function
    def tower(images, s):
        return mirrored.predictions(images, half, s, training=True)[-1][1]

    def inputs(ctx):
        i = ctx.replica_id_in_sync_group
        return z["images"][i:i + 1], seeds[i:i + 1]

    images = strategy.experimental_distribute_values_from_function(lambda ctx: inputs(ctx)[0])
    ss = strategy.experimental_distribute_values_from_function(lambda ctx: inputs(ctx)[1])
    per_tower = strategy.experimental_local_results(strategy.run(tower, (images, ss)))
    whole = model.predictions(z["images"], half, tf.constant(seeds), training=True)[-1][1]
    _close(np.concatenate([np.asarray(t) for t in per_tower]), whole, 1e-6)


@pytest.mark.slow
def test_mixed_precision_and_drop_path(ref):
    """Under mixed_float16 the outputs stay float32 with float32 softmax and LayerNorm moments, within 2e-2 of
    float32; with drop path, inference is the plain model and a training pass draws per sample (vit.py's
    mechanism). Fails for: the predictions or semantic logits left in float16, drop path at inference."""
    model, z = ref
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        half = eomt(model.spec, 5, queries=8, eomt_blocks=BLOCKS)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    half.set_weights(model.get_weights())
    f = tf.function(lambda x: half(x, training=False)).get_concrete_function(tf.TensorSpec([None, None, None, 3]))
    ops = f.graph.get_operations()
    assert all(o.outputs[0].dtype == tf.float32 for o in ops if o.type in ("Softmax", "SquaredDifference"))
    got = half(z["images"], training=False)
    assert got.dtype == tf.float32
    _close(np.exp(got), _semantic_reference(z), 2e-2)
    (class_logits, mask_logits), = half.predictions(z["images"])
    assert class_logits.dtype == mask_logits.dtype == tf.float32

    dropped = eomt(model.spec, 5, queries=8, eomt_blocks=BLOCKS, drop_path_rate=0.5)
    dropped.set_weights(model.get_weights())
    np.testing.assert_array_equal(dropped(z["images"], training=False), model(z["images"], training=False))
    with per_sample(tf.range(2, dtype=tf.int64), seed=3):
        plain = model.predictions(z["images"], None, None, training=True)[-1][1]
        drawn = dropped.predictions(z["images"], None, None, training=True)[-1][1]
    assert np.max(np.abs(np.asarray(drawn) - np.asarray(plain))) > 1e-3


@pytest.mark.slow  # a model built and run in both modes: ~3 s alone
def test_dinov3_encoder_rotates_the_patches_behind_the_queries():
    """On a DINOv3 encoder (rotary positions, no position embedding) the rotary table covers the patches after
    the queries, CLS and registers: both passes run and give their shapes. Fails for: the rotation's prefix
    left at CLS + registers once the queries are in (the table no longer lines up with the patches)."""
    from seg_train.config.variants import ViTVariant

    spec = ViTVariant("dinov3", 16, 32, 3, 2, 64, registers=2, key_bias=False)
    model = eomt(spec, 4, queries=5, eomt_blocks=2)
    x = np.random.default_rng(0).normal(0, 1, (1, 32, 48, 3)).astype("float32")
    assert tuple(model(x).shape) == (1, 32, 48, 4)
    got = model.predictions(x, [1.0, 0.5], _seeds([1, 2]), training=True)
    assert [(tuple(c.shape), tuple(m.shape)) for c, m in got] == [((1, 5, 5), (1, 5, 8, 12))] * 3


def test_a_checkpoint_of_the_model_holds_every_variable(ref, tmp_path):
    """tf.train.Checkpoint(model=...) written from the loaded model and read into a fresh one (what seg-eval,
    seg-predict and seg-export do) gives back every weight. Fails for: layers kept in a Python list on the model
    (Keras 3's TrackedList is outside TensorFlow's checkpoint graph: the mask MLP and upscale blocks were left
    at their initial values)."""
    model, z = ref
    path = tf.train.Checkpoint(model=model).write(str(tmp_path / "ckpt"))
    fresh = eomt(model.spec, 5, queries=8, eomt_blocks=BLOCKS)
    tf.train.Checkpoint(model=fresh).read(path).assert_consumed()
    assert len(fresh.weights) == len(model.weights)
    for a, b in zip(fresh.weights, model.weights):
        np.testing.assert_array_equal(a, b, err_msg=a.path)

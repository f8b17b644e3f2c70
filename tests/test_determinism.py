"""determinism.check_graph: ops without a deterministic GPU kernel refuse train.deterministic on GPUs."""

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.framework import config as tf_config

from seg_train.config import ConfigError
from seg_train.parallel import replicas
from seg_train.run.state import TrainState
from seg_train.train import determinism
from seg_train.train.step import TrainStep
from tests.helpers import random_batch, tiny_config

pytestmark = pytest.mark.slow  # DEVELOPING.md: starts processes or takes seconds per test

def _trace_step(cfg, deterministic: bool):
    """The concrete train step of a 2-tower Trainer, traced as train.py traces it (op determinism on
    first when train.deterministic is set)."""
    # TensorFlow exports no way to switch op determinism off again, and the test process is shared.
    was = tf_config.is_op_determinism_enabled()
    if deterministic:
        tf.config.experimental.enable_op_determinism()
    try:
        strategy = replicas.make_strategy(replicas.Devices(["/device:CPU:0", "/device:CPU:1"], "CPU", ""))
        trainer = TrainStep(TrainState(cfg, strategy))
        images, labels = random_batch(batch=2)
        dist = strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensors((images, labels)))
        batch = next(iter(dist))
        trainer(batch)
        return trainer._step_fn.get_concrete_function(batch, tf.zeros([2]), tf.constant(False), tf.constant(False))
    finally:
        if not was:
            tf_config.disable_op_determinism()


@pytest.fixture(scope="module")
def steps(tmp_path_factory):
    """Two traced tiny steps: as a deterministic run traces it, and with frozen backbone BN traced
    without op determinism."""
    plain = tiny_config(tmp_path_factory.mktemp("plain"), data={"batch_size": 2})
    frozen = tiny_config(tmp_path_factory.mktemp("frozen"), data={"batch_size": 2}, model={"freeze_batchnorm": True})
    return {"deterministic": _trace_step(plain, True), "frozen_bn_not_deterministic": _trace_step(frozen, False)}


def _expected(concrete) -> set:
    """The table's ops present in the graph, read independently: the outer graph and every library
    function (the library of a GraphDef is flat: nested functions are listed in it too)."""
    gd = concrete.graph.as_graph_def()
    nodes = list(gd.node) + [n for f in gd.library.function for n in f.node_def]
    out = set()
    for n in nodes:
        e = determinism.TABLE.get(n.op)
        if e is not None and not e.xla_only and (e.applies is None or e.applies(n)):
            out.add(n.op)
    return out


def _refusal(graphs, device="GPU") -> str:
    with pytest.raises(ConfigError) as info:
        determinism.check_graph(graphs, device)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_step_traced_deterministically_has_no_such_op(steps):
    step = steps["deterministic"]
    ops = determinism.op_types(step)
    # The ops the table treats conditionally or leaves out are really in this step: a table that
    # flagged every FusedBatchNormGradV3, or the gather gradient's UnsortedSegmentSum, would refuse it.
    assert {"FusedBatchNormGradV3", "ResizeBilinearGrad"} <= ops
    # The loss's cross-entropy is written out (pixel_losses.softmax_cross_entropy): deterministic ops
    # whether or not op determinism was on at trace time.
    assert not {"SparseSoftmaxCrossEntropyWithLogits", "LogSoftmax"} & ops and "OneHot" in ops
    assert _expected(step) == set()
    assert determinism.find_nondeterministic(step) == []
    determinism.check_graph(step, "GPU")  # nothing to refuse
    determinism.check_graph([step], "CPU")


def test_frozen_bn_has_deterministic_gradients_and_fused_loss_is_refused_on_gpu(steps):
    step = steps["frozen_bn_not_deterministic"]
    # The backbone's frozen BN layers run as element-wise ops in a training pass (models/fused_bn.py):
    # no inference-mode fused BN gradient, which has no deterministic GPU kernel.
    frozen_grads = [n for n in (list(step.graph.as_graph_def().node) +
                                [n for f in step.graph.as_graph_def().library.function for n in f.node_def])
                    if n.op.startswith("FusedBatchNormGrad") and not n.attr["is_training"].b]
    assert frozen_grads == []
    # Traced without op determinism, the step still has none of the table's ops: the loss's cross-entropy
    # does not use TensorFlow's fused op.
    assert _expected(step) == set() and determinism.find_nondeterministic(step) == []
    determinism.check_graph(step, "GPU")
    # TensorFlow's fused op, traced without op determinism (as another loss could use it), is refused on GPUs.
    def xent(logits, labels):
        with tf.GradientTape() as tape:
            tape.watch(logits)
            loss = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits)
        return tape.gradient(loss, logits)

    fused = tf.function(xent).get_concrete_function(tf.TensorSpec([4, 3], tf.float32), tf.TensorSpec([4], tf.int32))
    assert {f.op for f in determinism.find_nondeterministic(fused)} == _expected(fused) == {
        "SparseSoftmaxCrossEntropyWithLogits"}
    message = _refusal(fused)
    assert message.startswith("no deterministic GPU kernel (train.deterministic): op "
                              "SparseSoftmaxCrossEntropyWithLogits (used by ")
    determinism.check_graph(fused, "CPU")  # CPU kernels are deterministic: never refused


def test_bincount_in_nested_function_is_refused():
    @tf.function
    def hist(x):
        return tf.raw_ops.Bincount(arr=x, size=5, weights=tf.zeros([0], tf.float32))

    message = _refusal(hist.get_concrete_function(tf.TensorSpec([None], tf.int32)))
    assert message.startswith("no deterministic GPU kernel (train.deterministic): op Bincount (used by "
                              "tf.math.bincount on a 1-D input")
    assert message.endswith("; set train.deterministic: false, or count with a one-hot matmul "
                            "(tf.one_hot(pairs) summed, or one_hot(labels)^T @ one_hot(preds))")

    # tf.math.bincount (DenseBincount in TF 2.21) inside a not-inlined function inside a cond branch.
    inner = tf.function(lambda x: tf.math.bincount(x, minlength=4, maxlength=4),
                        experimental_attributes={"_noinline": True})
    outer = tf.function(lambda x: tf.cond(tf.size(x) > 0, lambda: inner(x), lambda: tf.zeros([4], tf.int32)))
    concrete = outer.get_concrete_function(tf.TensorSpec([None], tf.int32))
    assert "DenseBincount" not in {n.op for n in concrete.graph.as_graph_def().node}  # only in the library
    assert "op DenseBincount (used by tf.math.bincount" in _refusal(concrete)
    assert [f.op for f in determinism.find_nondeterministic(concrete)] == ["DenseBincount"]
    determinism.check_graph(concrete, "CPU")
    np.testing.assert_array_equal(outer(tf.constant([0, 1, 1, 3])).numpy(), [1, 2, 0, 1])


def test_max_pool_gradient_refused_only_under_xla():
    def grad_of_pool(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = tf.nn.max_pool2d(x, 2, 2, "VALID")
        return tape.gradient(y, x)

    spec = tf.TensorSpec([1, 4, 4, 1], tf.float32)
    compiled = tf.function(grad_of_pool, jit_compile=True)
    in_xla = tf.function(lambda x: compiled(x) * 2.0).get_concrete_function(spec)
    plain = tf.function(grad_of_pool).get_concrete_function(spec)
    assert "MaxPoolGrad" in determinism.op_types(plain) and "MaxPoolGrad" in determinism.op_types(in_xla)
    determinism.check_graph(plain, "GPU")  # cuDNN's deterministic max pooling
    determinism.check_graph(plain, "CPU")
    for device in ("GPU", "CPU"):  # XLA's refusal does not look at the device
        message = _refusal(in_xla, device)
        assert message.startswith("no deterministic XLA kernel (train.deterministic): op MaxPoolGrad (used by the "
                                  "gradient of max pooling")
        assert message.endswith("; set train.deterministic: false, or train.jit_compile: false")
    # What the table says of XLA on a CPU is what TensorFlow does.
    was = tf_config.is_op_determinism_enabled()
    tf.config.experimental.enable_op_determinism()
    try:
        x = tf.reshape(tf.range(16, dtype=tf.float32), [1, 4, 4, 1])
        with pytest.raises(tf.errors.UnimplementedError, match="MaxPool gradient ops do not yet have a deterministic"):
            tf.function(lambda x: compiled(x) * 2.0)(x)
    finally:
        if not was:
            tf_config.disable_op_determinism()

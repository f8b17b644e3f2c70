"""Which ops of a traced step have no deterministic GPU kernel in TensorFlow 2.21, and the refusal.

`train.deterministic: true` calls `tf.config.experimental.enable_op_determinism()`. From then on a
GPU kernel that can only sum in a nondeterministic order (atomic adds) raises `UnimplementedError`
when it RUNS, which a CPU never shows. `check_graph` walks the traced step (its graph and every
library function: tower, apply, cond and while bodies) and refuses the run up front, naming the op.

TABLE was read from TensorFlow's sources and binary (docs/DETERMINISM.md). Not in it, because op
determinism gives them a deterministic path: DepthwiseConv2dNativeBackpropFilter (cuDNN), the segment
sums (sort-then-reduce), the resource-variable scatters (host), ResizeBilinearGrad, the Conv2D and
non-XLA MaxPool gradients, BiasAddGrad and training-mode FusedBatchNormGradV3. The softmax
cross-entropies are in it only for graphs traced before op determinism was enabled (train.py enables
it first). Unseeded random ops raise on every device (seg-train seeds its own). XLA
(train.jit_compile) has refusals of its own on every device: the xla_only entries.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

from seg_train.config import ConfigError

TF_VERSION = "2.21"


@dataclass(frozen=True)
class Entry:
    """One op type without a deterministic GPU kernel.

    alternative: what to do instead of `train.deterministic: false`.
    applies: a test on the node for ops that refuse only in some configurations (None: always).
    xla_only: refuses only inside an XLA-compiled function; any_device: on CPUs too (XLA's check).
    """

    used_by: str
    reason: str
    alternative: str
    applies: Callable | None = None
    xla_only: bool = False
    any_device: bool = False


def _attr_false(name: str) -> Callable:
    def test(node) -> bool:
        return name in node.attr and not node.attr[name].b
    return test


def _attr_int_in(name: str, values: set) -> Callable:
    def test(node) -> bool:
        return name in node.attr and node.attr[name].i in values
    return test


_FROZEN_BN = Entry(
    used_by="the gradient through a BatchNormalization layer in inference mode, i.e. the backbone's BN with "
            "model.freeze_batchnorm: true",
    reason="its offset gradient sums over all pixels with atomic adds; TensorFlow raises for it when "
           "is_training is false (its training-mode kernel is deterministic)",
    alternative="model.freeze_batchnorm: false (or model.fused_batchnorm: false with model.sync_batchnorm: "
                "false: Keras' unfused BN has only deterministic gradient ops)",
    applies=_attr_false("is_training"))

_XENT_NOTE = ("TensorFlow's Python API uses a deterministic log-softmax path instead when op determinism is "
              "enabled before the graph is traced")

TABLE: dict[str, Entry] = {
    "Bincount": Entry(
        used_by="tf.math.bincount on a 1-D input (e.g. a confusion matrix)",
        reason="a CUB histogram whose order of atomic increments TensorFlow does not guarantee",
        alternative="count with a one-hot matmul (tf.one_hot(pairs) summed, or one_hot(labels)^T @ one_hot(preds))"),
    "DenseBincount": Entry(
        used_by="tf.math.bincount (TensorFlow 2.21 builds DenseBincount for it), e.g. a confusion matrix",
        reason="atomic adds into shared bins",
        alternative="count with a one-hot matmul (one_hot(labels)^T @ one_hot(preds))"),
    "FusedBatchNormGrad": _FROZEN_BN,
    "FusedBatchNormGradV2": _FROZEN_BN,
    "FusedBatchNormGradV3": _FROZEN_BN,
    "SparseSoftmaxCrossEntropyWithLogits": Entry(
        used_by="tf.nn.sparse_softmax_cross_entropy_with_logits traced before op determinism was enabled",
        reason="the fused GPU kernel reduces in a nondeterministic order; " + _XENT_NOTE,
        alternative="enable op determinism before tracing (train.py does)"),
    "SoftmaxCrossEntropyWithLogits": Entry(
        used_by="tf.nn.softmax_cross_entropy_with_logits traced before op determinism was enabled",
        reason="the fused GPU kernel reduces in a nondeterministic order; " + _XENT_NOTE,
        alternative="enable op determinism before tracing (train.py does)"),
    "ResizeNearestNeighborGrad": Entry(
        used_by="the gradient of nearest-neighbour resizing (tf.image.resize(method='nearest'))",
        reason="scatters into the input with atomic adds",
        alternative="bilinear resizing (its gradient has a deterministic GPU kernel)"),
    "MaxPoolGradWithArgmax": Entry(
        used_by="the gradient of tf.nn.max_pool_with_argmax",
        reason="scatters into the input through the argmax indices with atomic adds",
        alternative="tf.nn.max_pool (its gradient runs on cuDNN's deterministic max pooling)"),
    # TensorFlow's XLA lowering of these refuses under op determinism whatever the device.
    "MaxPoolGrad": Entry(
        used_by="the gradient of max pooling (ResNet's stem) in an XLA-compiled tower",
        reason="TensorFlow's XLA lowering has no deterministic select-and-scatter for it",
        alternative="train.jit_compile: false", xla_only=True, any_device=True),
    "MaxPoolGradV2": Entry(
        used_by="the gradient of max pooling in an XLA-compiled tower",
        reason="TensorFlow's XLA lowering has no deterministic select-and-scatter for it",
        alternative="train.jit_compile: false", xla_only=True, any_device=True),
    "CropAndResizeGradImage": Entry(
        used_by="the image gradient of tf.image.crop_and_resize",
        reason="scatters with atomic adds", alternative="tf.image.resize of static crops"),
    "CropAndResizeGradBoxes": Entry(
        used_by="the box gradient of tf.image.crop_and_resize",
        reason="reduces with atomic adds", alternative="stop the gradient into the boxes"),
    "SparseTensorDenseMatMul": Entry(
        used_by="tf.sparse.sparse_dense_matmul",
        reason="accumulates with atomic adds", alternative="a dense matmul"),
    "AdjustContrast": Entry(
        used_by="tf.image.adjust_contrast (v1 op)", reason="a nondeterministic mean reduction",
        alternative="contrast adjustment on the host (tf.data)"),
    "AdjustContrastv2": Entry(
        used_by="tf.image.adjust_contrast", reason="a nondeterministic mean reduction",
        alternative="contrast adjustment on the host (tf.data)"),
    "FakeQuantWithMinMaxVarsGradient": Entry(
        used_by="quantization-aware training", reason="reduces the min/max gradients with atomic adds",
        alternative="no quantization-aware training"),
    "FakeQuantWithMinMaxVarsPerChannelGradient": Entry(
        used_by="per-channel quantization-aware training", reason="reduces the min/max gradients with atomic adds",
        alternative="no quantization-aware training"),
    "Dilation2DBackpropFilter": Entry(
        used_by="the filter gradient of tf.nn.dilation2d (morphology)", reason="atomic adds",
        alternative="no morphological layers"),
    "Dilation2DBackpropInput": Entry(
        used_by="the input gradient of tf.nn.dilation2d (morphology)", reason="atomic adds",
        alternative="no morphological layers"),
    "DebugNumericSummaryV2": Entry(
        used_by="tf.debugging.experimental.enable_dump_debug_info with CONCISE_HEALTH or FULL_HEALTH",
        reason="health counts accumulated with atomic adds", alternative="another tensor_debug_mode",
        applies=_attr_int_in("tensor_debug_mode", {3, 4})),
}


@dataclass(frozen=True)
class Finding:
    """One node of a traced graph whose op has no deterministic GPU kernel."""

    op: str
    node: str  # the node's name (its name scope says which layer made it)
    function: str  # the library function holding it ("" for the outer graph)
    entry: Entry


def _graph_defs(items) -> list:
    """GraphDefs of ConcreteFunctions, tf.Graphs, GraphDefs or tf.functions (any mix, or one of them)."""
    if not isinstance(items, (list, tuple)):
        items = [items]
    out = []
    for item in items:
        if hasattr(item, "library") and hasattr(item, "node"):  # a GraphDef already
            out.append(item)
        elif hasattr(item, "graph") and hasattr(item.graph, "as_graph_def"):  # ConcreteFunction
            out.append(item.graph.as_graph_def())
        elif hasattr(item, "as_graph_def"):  # tf.Graph / FuncGraph
            out.append(item.as_graph_def())
        elif hasattr(item, "get_concrete_function"):  # a traced tf.function: every concrete trace
            out.extend(f.graph.as_graph_def() for f in item._list_all_concrete_functions())
        else:
            raise TypeError(f"expected a ConcreteFunction, tf.Graph or GraphDef, got {type(item).__name__}")
    return out


def _xla_attr(attrs) -> bool:
    return "_XlaMustCompile" in attrs and attrs["_XlaMustCompile"].b


def _callees(node, library: dict) -> list[str]:
    """Names of the library functions a node calls: call ops, If/While/Case branches and bodies, and
    functions called directly by name."""
    names = [node.op] if node.op in library else []
    for value in node.attr.values():
        if value.HasField("func") and value.func.name:
            names.append(value.func.name)
        elif value.HasField("list"):
            names.extend(f.name for f in value.list.func if f.name)
    return [n for n in names if n in library]


def _walk(graph_def) -> Iterable[tuple[object, str, bool]]:
    """(node, function name, inside XLA) for every node of the graph and of every library function.

    Inside XLA: it, or a call on the way to it, carries `_XlaMustCompile`. Uncalled library functions
    are walked too, as not XLA-compiled.
    """
    library = {f.signature.name: f for f in graph_def.library.function}
    seen: set[tuple[str, bool]] = set()
    stack: list[tuple[str, bool]] = []

    def visit(nodes, fname: str, xla: bool):
        for node in nodes:
            yield node, fname, xla
            for callee in _callees(node, library):
                inner = xla or _xla_attr(node.attr) or _xla_attr(library[callee].attr)
                if (callee, inner) not in seen:
                    seen.add((callee, inner))
                    stack.append((callee, inner))

    yield from visit(graph_def.node, "", False)
    while stack:
        name, xla = stack.pop()
        yield from visit(library[name].node_def, name, xla)
    for name, fdef in library.items():
        if not any((name, x) in seen for x in (False, True)):
            seen.add((name, _xla_attr(fdef.attr)))
            stack.append((name, _xla_attr(fdef.attr)))
            while stack:
                n, xla = stack.pop()
                yield from visit(library[n].node_def, n, xla)


def op_types(graphs) -> set[str]:
    """Every op type in the graphs and their function libraries (for audits and tests)."""
    return {node.op for gd in _graph_defs(graphs) for node, _, _ in _walk(gd)}


def find_nondeterministic(graphs) -> list[Finding]:
    """The nodes of the graphs (and their libraries) whose op has no deterministic GPU kernel under
    the node's attributes, whatever the device; sorted by (op, function, node)."""
    found = {}
    for gd in _graph_defs(graphs):
        for node, fname, xla in _walk(gd):
            entry = TABLE.get(node.op)
            if entry is None or (entry.xla_only and not xla) or (entry.applies and not entry.applies(node)):
                continue
            found[(node.op, fname, node.name)] = Finding(node.op, node.name, fname, entry)
    return [found[k] for k in sorted(found)]


def enabled() -> bool:
    """Whether TensorFlow's op determinism is on now (TensorFlow has no public getter; its own tests read this)."""
    from tensorflow.python.framework import config as tf_config

    return tf_config.is_op_determinism_enabled()


def check_graph(graphs, device_kind: str) -> None:
    """Refuses op determinism for a traced step holding an op without a deterministic kernel on these devices.

    `graphs`: the traced step(s); `device_kind`: "GPU" or "CPU" (on CPUs only XLA's own refusals,
    any_device, apply). Raises a ConfigError naming the first such op and what to do instead.
    """
    findings = [f for f in find_nondeterministic(graphs) if device_kind == "GPU" or f.entry.any_device]
    if not findings:
        return
    first = findings[0]
    others = sorted({f.op for f in findings} - {first.op})
    more = f" (also: {', '.join(others)})" if others else ""
    kind = "XLA kernel" if first.entry.xla_only else "GPU kernel"
    raise ConfigError(
        f"no deterministic {kind}", "train.deterministic",
        f"op {first.op} (used by {first.entry.used_by}; node {first.node}) has no deterministic {kind} in "
        f"TensorFlow {TF_VERSION}{more}; set train.deterministic: false, or {first.entry.alternative}")

"""seg-export --format onnx: one .onnx file for ONNX Runtime (or another ONNX runtime), without TensorFlow.

- The model as seg-export --format tflite exports it, from the same frozen concrete function
  (tflite_export.frozen_app): one fixed input, uint8 RGB [1, H, W, 3] (NHWC, as the .tflite file's);
  normalisation, eval.logit_adjustment's offsets and the argmax inside; the class map uint8 [1, H, W] out
  (optionally the softmax too). float32 only.
- Converted by tf2onnx from the frozen GraphDef. Its other front ends fail here: `from_function` on the
  unfrozen function turns the captured mean and std into extra graph inputs, and its .tflite front end has
  no handler for TFLite's GELU (every ViT).
- TensorFlow writes an exact GELU (keras.activations.gelu) as 0.5 x erfc(-x / sqrt 2). tf2onnx 1.17 has no
  handler for Erfc and leaves it in the graph as an op ONNX does not define; ONNX has Erf, so Erfc(x) is
  converted as 1 - Erf(x) here. Any other op tf2onnx cannot map refuses the export in one line.
- Sigmoid is written as 1 / (1 + exp(-x)), not as ONNX's Sigmoid op: ONNX Runtime's CPU kernel is accurate
  to about 6e-8 in absolute terms only, and returns 0 below x = -18 (TensorFlow: 1.5e-8 there). EoMT's
  semantic scores sum the queries' sigmoids and take their log, so a pixel that every query's mask leaves
  far outside was given another class than TensorFlow's; Exp is accurate in relative terms.
- FILE.json beside FILE.onnx describes it as it does the .tflite file; both are written atomically.
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from pathlib import Path

import numpy as np

from seg_train.config import Config, ConfigError, without_reprs
from seg_train.infer.onnx_runtime import INSTALL_HINT

log = logging.getLogger("seg_train")

# The ONNX opset of the file: tf2onnx 1.17's default, which has every op the models need.
OPSET = 15


def check_converter(where: str) -> None:
    """tf2onnx and onnx are installed (else a one-line ConfigError naming `where`), found without importing
    them: importing tf2onnx starts TensorFlow, which the command line checks its flags before."""
    import importlib.util

    if any(importlib.util.find_spec(name) is None for name in ("tf2onnx", "onnx")):
        raise ConfigError("tf2onnx is not installed", where, INSTALL_HINT)


def converter(where: str):
    """The tf2onnx module; a one-line ConfigError naming `where` when the [onnx] extra is missing."""
    check_converter(where)
    try:
        import onnx  # noqa: F401 - tf2onnx imports it too; checked here to name the extra, not a traceback
        import tf2onnx
    except ImportError:
        raise ConfigError("tf2onnx is not installed", where, INSTALL_HINT) from None
    return tf2onnx


def _erfc_as_one_minus_erf(ctx, node, name, args):
    """tf2onnx's custom handler for Erfc: the node becomes ONNX's Erf (tf2onnx renames it, `args`), and
    1 - Erf(x) takes its place for every consumer."""
    from tf2onnx import utils

    dtype = utils.map_onnx_to_numpy_type(ctx.get_dtype(node.input[0]))
    one = ctx.make_const(utils.make_name(f"{name}_one"), np.array(1, dtype))
    ctx.insert_new_node_on_output("Sub", node.output[0], inputs=[one.output[0], node.output[0]],
                                  name=utils.make_name(f"{name}_one_minus"))


def _sigmoid_as_reciprocal(ctx, node, name, args):
    """tf2onnx's custom handler for Sigmoid: the node becomes Reciprocal (tf2onnx renames it, `args`) of
    1 + Exp(-x), which keeps the tails' relative precision (module doc)."""
    from tf2onnx import utils

    x = node.input[0]
    shape, dtype = ctx.get_shape(x), ctx.get_dtype(x)
    one = ctx.make_const(utils.make_name(f"{name}_one"), np.array(1, utils.map_onnx_to_numpy_type(dtype)))
    neg = ctx.make_node("Neg", [x], op_name_scope=name, shapes=[shape], dtypes=[dtype])
    exp = ctx.make_node("Exp", neg.output, op_name_scope=name, shapes=[shape], dtypes=[dtype])
    add = ctx.make_node("Add", [exp.output[0], one.output[0]], op_name_scope=name, shapes=[shape], dtypes=[dtype])
    ctx.replace_inputs(node, [add.output[0]])


# TensorFlow op -> (tf2onnx custom handler, [the ONNX op the node becomes]) (module doc).
HANDLERS = {"Erfc": (_erfc_as_one_minus_erf, ["Erf"]), "Sigmoid": (_sigmoid_as_reciprocal, ["Reciprocal"])}


class _Records(logging.Handler):
    """tf2onnx's error log lines, kept to name what it could not convert."""

    def __init__(self):
        super().__init__(logging.ERROR)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def convert(frozen) -> bytes:
    """The .onnx bytes of a frozen app function (tflite_export.frozen_function): input `image`, outputs
    `classes` (and `probabilities`), every op one ONNX defines at OPSET."""
    tf2onnx = converter("seg-export --format onnx")
    import onnx

    outputs = {t.name: "classes" if t.dtype.name == "uint8" else "probabilities" for t in frozen.outputs}
    image = frozen.inputs[0].name
    logger = logging.getLogger("tf2onnx")
    records, level, propagate = _Records(), logger.level, logger.propagate
    # Its INFO lines and its ERROR lines (kept, to name the ops) stay off the command's output.
    logger.addHandler(records)
    logger.setLevel(logging.ERROR)
    logger.propagate = False
    try:
        proto, _ = tf2onnx.convert.from_graph_def(
            frozen.graph.as_graph_def(), input_names=[image], output_names=list(outputs), opset=OPSET,
            custom_op_handlers=HANDLERS,
            tensors_to_rename={image: "image", **outputs})
    except Exception as e:  # noqa: BLE001 - tf2onnx raises plain Exceptions of many kinds
        raise ConfigError("cannot convert the model to ONNX", "seg-export --format onnx",
                          f"a model tf2onnx {tf2onnx.__version__} converts ({without_reprs(str(e))[:300]})") from None
    finally:
        logger.removeHandler(records)
        logger.setLevel(level)
        logger.propagate = propagate
    unknown = sorted({n.op_type for n in proto.graph.node
                      if n.domain in ("", "ai.onnx") and not onnx.defs.has(n.op_type, OPSET, "")})
    if unknown:
        raise ConfigError("cannot convert the model to ONNX", "seg-export --format onnx",
                          f"TensorFlow ops tf2onnx {tf2onnx.__version__} converts, got {', '.join(unknown)} "
                          f"(no ONNX op at opset {OPSET})")
    try:
        onnx.checker.check_model(proto)
    except onnx.checker.ValidationError as e:
        lines = [line for line in map(without_reprs, str(e).splitlines()) if line]
        raise ConfigError("cannot convert the model to ONNX", "seg-export --format onnx",
                          f"a valid ONNX model ({(lines or [type(e).__name__])[0][:300]})") from None
    if records.lines:  # mapped, yet tf2onnx reported a failure on the way: not a file to trust
        raise ConfigError("cannot convert the model to ONNX", "seg-export --format onnx",
                          f"a model tf2onnx {tf2onnx.__version__} converts ({without_reprs(records.lines[0])[:300]})")
    return proto.SerializeToString()


def describe(content: bytes) -> tuple[dict, list, list]:
    """Of a .onnx model: ({op: count}, inputs, outputs), the tensors as FILE.json lists them."""
    import onnx
    from onnx import helper

    model = onnx.load_from_string(content)
    ops = Counter(n.op_type for n in model.graph.node)

    def tensor(v):
        t = v.type.tensor_type
        return {"name": v.name, "dtype": np.dtype(helper.tensor_dtype_to_np_dtype(t.elem_type)).name,
                "shape": [d.dim_value if d.HasField("dim_value") else None for d in t.shape.dim]}

    return dict(sorted(ops.items())), [tensor(v) for v in model.graph.input], [tensor(v) for v in model.graph.output]


def run_export_onnx(cfg: Config, strategy, checkpoint: str, output: str | os.PathLike, *, force: bool = False,
                    size=None, probabilities: bool = False, check: bool = False, threads: int = 1,
                    progress: bool = True) -> Path:
    """seg-export --format onnx: writes FILE.onnx and FILE.json; with `check`, measures it (run_check)."""
    from seg_train.infer.litert import check_threads, sidecar_path
    from seg_train.infer.onnx_runtime import session_class
    from seg_train.infer.tflite_export import INPUT_DESCRIPTION, check_output_file, frozen_app, run_check, sidecar
    from seg_train.run.rundir import write_atomic, write_json

    if cfg.data.task != "semantic":
        raise ConfigError("not available for this task", "--format onnx",
                          f"--format tflite or a SavedModel with data.task {cfg.data.task} (their raw class and mask "
                          "logits are read by seg-eval / seg-predict --model; the ONNX file is not)")
    out = check_output_file(output, force, ".onnx")
    tf2onnx = converter("seg-export --format onnx")  # fail before the work, not after it
    if check:
        check_threads(threads)
        session_class("seg-export --check")
    app = frozen_app(cfg, strategy, checkpoint, size, probabilities, progress)
    log.info("converting step %d to ONNX (tf2onnx %s, opset %d, input %dx%d)", app.step, tf2onnx.__version__,
             OPSET, app.height, app.width)
    content = convert(app.frozen)
    ops, inputs, outputs = describe(content)
    meta = {
        **sidecar(cfg, app, "onnx"), "quantization": "none",
        "input": {**inputs[0], **INPUT_DESCRIPTION, "layout": "NHWC"}, "outputs": outputs, "calibration": None,
        "size_bytes": len(content), "opset": OPSET, "converter": f"tf2onnx {tf2onnx.__version__}", "ops": ops,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(out, lambda tmp: tmp.write_bytes(content))
    write_json(sidecar_path(out), meta)
    print(f"exported step {app.step} ({app.prefix}) to {out}: float32, {len(content) / 1e6:.2f} MB, ONNX opset "
          f"{OPSET}, image uint8 [1, {app.height}, {app.width}, 3] -> classes uint8 [1, {app.height}, {app.width}]; "
          f"wrote {sidecar_path(out)}")
    if check:
        run_check(cfg, out, None, threads, progress)
    return out

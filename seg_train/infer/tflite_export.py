"""seg-export --format tflite: one .tflite file for LiteRT (a phone, or a server without TensorFlow).

- One fixed input, uint8 RGB [1, H, W, 3]: TFLite's builtin kernels need static shapes.
- Normalisation, eval.logit_adjustment's offsets and the argmax are inside the model: the output is
  the class map uint8 [1, H, W] (optionally the softmax too). One forward pass, no flips or scales.
- Builtin ops only, so the file runs in the stock LiteRT interpreter (a ViT's attention in its plain form).
- The variables are frozen into constants here: given the Keras 3 model, the converter keeps them as
  resource variables (a file without its weights) and int8 calibration fails.
- --quantize int8 is full-integer post-training quantization calibrated on seeded training images
  resized as an app resizes. --float-ops keeps named op kinds in float32 for ops XNNPACK declines in
  int8 (docs/DEPLOY.md); the converter offers this only through its quantization debugger's denylist.
- FILE.json beside FILE.tflite describes it; both are written atomically.
"""

from __future__ import annotations

import logging
import os
import re
import tempfile
import warnings
from collections import Counter
from pathlib import Path
from typing import NamedTuple

import numpy as np

from seg_train.config import Config, ConfigError, without_reprs
from seg_train.config.variants import VIT_VARIANTS

log = logging.getLogger("seg_train")

QUANTIZATIONS = ("none", "float16", "int8")
# FILE.json's words for the input every exported file takes.
INPUT_DESCRIPTION = {"color": "RGB", "range": "0..255", "normalization": "(x - mean) / std, inside the model"}


def check_output_file(path: str | os.PathLike, force: bool, suffix: str = ".tflite") -> Path:
    """The output file's path (.tflite, or `suffix`): new, or an existing file with `force`; never a folder."""
    from seg_train.util.paths import check_creatable_dir

    out = Path(path)
    if out.suffix != suffix:
        raise ConfigError(f"output is not a {suffix} file", str(out), f"a file name ending in {suffix}")
    if out.is_dir():
        raise ConfigError("output is a folder", str(out), f"a {suffix} file name")
    if out.exists() and not force:
        raise ConfigError("output file exists", str(out), "a new file name (pass --force to replace it)")
    # m.tflite and m.onnx would share m.json, the description of each: the other file would lose its own.
    for other in (out.with_suffix(s) for s in (".tflite", ".onnx") if s != suffix):
        if other.exists():
            raise ConfigError("output name taken by another export", str(out),
                              f"a name of its own ({other.name} is described by {out.with_suffix('.json').name})")
    check_creatable_dir(out.parent, "output folder", "choose another --output")
    return out


def input_size(cfg: Config, flag) -> tuple[int, int]:
    """(H, W): --input-size, else eval.crop_size, else data.crop_size."""
    if flag is not None:
        h, w = flag
        if h < 8 or w < 8:
            raise ConfigError("invalid --input-size", "--input-size", f"height and width of at least 8, got {h} {w}")
    elif cfg.data.task != "semantic":
        h, w = cfg.data.crop_size  # the letterbox of the panoptic / instance evaluation
    else:
        h, w = cfg.eval.crop_size or cfg.data.crop_size
    patch = VIT_VARIANTS[cfg.model.backbone].patch if cfg.model.backbone in VIT_VARIANTS else 1
    if h % patch or w % patch:
        # The file has one fixed input, and a ViT takes whole patches only (the one padding inside is the
        # pyramid's one patch, tflite_pad_to).
        raise ConfigError("not whole patches", "--input-size",
                          f"height and width multiples of {patch} for model.backbone {cfg.model.backbone!r}, "
                          f"got {h} {w}")
    return int(h), int(w)


def app_function(model, mean, std, height: int, width: int, probabilities: bool = False, offsets=None,
                 pad_to: int = 1):
    """The tf.function an app runs: uint8 [1, H, W, 3] -> {"classes": uint8 [1, H, W] (, "probabilities")}.

    `offsets` (eval.logit_adjustment; modes.score_offsets) are subtracted from the logits before the
    argmax and the softmax, as in seg-eval's single view. `pad_to`: the normalised image padded inside at the
    bottom / right with zeros (the mean colour) to a multiple of it and the logits cropped back, as seg-eval's
    passes are (`tflite_pad_to`).
    """
    import tensorflow as tf

    num_classes = model.output_shape[-1]
    if num_classes > 256:
        raise ConfigError("too many classes for a uint8 class map", "data.num_classes",
                          f"at most 256, got {num_classes}")
    mean = tf.constant(mean, tf.float32)
    std = tf.constant(std, tf.float32)

    from seg_train.models.attention import plain_only

    @tf.function(input_signature=[tf.TensorSpec([1, height, width, 3], tf.uint8, name="image")])
    def run(image):
        x = (tf.cast(image, tf.float32) - mean) / std  # the same ops as ImageReader.normalize
        pad_h, pad_w = -height % pad_to, -width % pad_to
        if pad_h or pad_w:
            x = tf.pad(x, [[0, 0], [0, pad_h], [0, pad_w], [0, 0]])
        # The plain attention, the same function: the blockwise form's loop becomes WHILE ops, on which the
        # converter's int8 calibration crashed (models/attention.py).
        with plain_only():
            logits = model(x, training=False)[:, :height, :width]
        if offsets is not None:
            logits = logits - tf.constant(offsets, tf.float32)
        out = {"classes": tf.cast(tf.argmax(logits, axis=-1, output_type=tf.int32), tf.uint8)}
        if probabilities:
            out["probabilities"] = tf.nn.softmax(logits, axis=-1)
        return out

    return run


def mask_app_function(model, mean, std, height: int, width: int):
    """data.task panoptic / instance: uint8 [1, H, W, 3] (the letterboxed image) -> {"class_logits": float32
    [1, Q, K + 1], "mask_logits": float32 [1, Q, h, w]}, the raw outputs; the letterbox and the post-processing
    run outside the file (infer/mask_evaluate.py, infer/mask_postprocess.py)."""
    import tensorflow as tf

    mean = tf.constant(mean, tf.float32)
    std = tf.constant(std, tf.float32)

    @tf.function(input_signature=[tf.TensorSpec([1, height, width, 3], tf.uint8, name="image")])
    def run(image):
        x = (tf.cast(image, tf.float32) - mean) / std  # ImageReader.normalize's ops, as in app_function
        class_logits, mask_logits = model.predictions(x, training=False)[-1]
        return {"class_logits": class_logits, "mask_logits": mask_logits}

    return run


def tflite_pad_to(cfg: Config, model) -> int:
    """What a .tflite file pads its fixed input to inside: a ViT's models.input_multiple (2p under the simple
    pyramid's pooled level, so a file at an odd patch grid predicts as seg-eval does at that size); 1 for the
    other backbones, whose files run at their input size (their convs keep every pixel; no padding to 32)."""
    from seg_train import models

    return models.input_multiple(model) if cfg.model.backbone in VIT_VARIANTS else 1


def frozen_function(fn):
    """The concrete function of `fn` with its variables turned into constants (module doc)."""
    from tensorflow.python.framework.convert_to_constants import convert_variables_to_constants_v2

    return convert_variables_to_constants_v2(fn.get_concrete_function())


class AppExport(NamedTuple):
    """A checkpoint's app function, frozen at the file's input size: what the .tflite and .onnx files are
    converted from (`frozen_app`)."""

    frozen: object        # the frozen concrete function (frozen_function)
    prefix: str           # the checkpoint
    step: int
    class_names: list
    bn_reestimated: bool
    height: int
    width: int
    score_offsets: object  # eval.logit_adjustment's, inside the function (modes.score_offsets)


def frozen_app(cfg: Config, strategy, checkpoint: str, size=None, probabilities: bool = False,
               progress: bool = True) -> AppExport:
    """The checkpoint loaded (BN statistics re-estimated as seg-eval does) and its app function frozen."""
    from seg_train.data.split import class_names_of
    from seg_train.infer.load import load_evaluator

    height, width = input_size(cfg, size)
    names = class_names_of(cfg)
    masks = cfg.data.task != "semantic"
    if masks and probabilities:
        raise ConfigError("not available for this task", "--probabilities",
                          f"no --probabilities with data.task {cfg.data.task}: the file's outputs are the class and "
                          "mask logits")
    evaluator, prefix, step = load_evaluator(cfg, strategy, checkpoint, names)
    reestimated = evaluator.maybe_reestimate_bn(cfg, progress)
    if masks:
        frozen = frozen_function(mask_app_function(evaluator.state.model, cfg.data.mean, cfg.data.std, height, width))
    else:
        frozen = frozen_function(app_function(evaluator.state.model, cfg.data.mean, cfg.data.std, height, width,
                                              probabilities, evaluator.score_offsets,
                                              tflite_pad_to(cfg, evaluator.state.model)))
    return AppExport(frozen, prefix, step, names, reestimated, height, width, evaluator.score_offsets)


def sidecar(cfg: Config, app: AppExport, fmt: str) -> dict:
    """What FILE.json says of every exported file, whatever its format: where it comes from, its input size,
    the normalisation and the classes inside it, and how an app resizes for it."""
    from seg_train.infer import modes
    from seg_train.infer.export import mask_metadata
    from seg_train.infer.litert import RESIZE
    from seg_train.infer.mask_evaluate import LETTERBOX

    masks = cfg.data.task != "semantic"
    return {"format": fmt, "checkpoint": app.prefix, "step": app.step, "input_size": [app.height, app.width],
            "mean": list(cfg.data.mean), "std": list(cfg.data.std), "num_classes": cfg.data.num_classes,
            "class_names": app.class_names, "bn_stats_reestimated": app.bn_reestimated,
            "app_resize": LETTERBOX if masks else RESIZE, "logit_adjustment": cfg.eval.logit_adjustment,
            "score_offsets": modes.offsets_by_class(app.score_offsets, app.class_names),
            **(mask_metadata(cfg) if masks else {})}



def calibration_samples(cfg: Config, count: int):
    """(the opened train split, its first `count` samples of a permutation seeded by the run's seed)."""
    from seg_train.data.split import open_split

    train = open_split(cfg, cfg.data.train_split)
    order = np.random.default_rng(cfg.seed).permutation(len(train.samples))[:count]
    return train, [train.samples[i] for i in order]


FLOAT_OPS_PATTERN = re.compile(r"[A-Z][A-Z0-9_]*")


def parse_float_ops(text: str | None, quantize: str) -> tuple[str, ...]:
    """--float-ops: comma-separated TFLite builtin op names (BATCH_MATMUL,SOFTMAX,...), only with int8."""
    if not text:
        return ()
    names = tuple(dict.fromkeys(t.strip() for t in text.split(",") if t.strip()))
    check_float_ops(names or ("",), quantize, text)
    return names


def check_float_ops(names: tuple[str, ...], quantize: str, given: str | None = None) -> None:
    """The op names of --float-ops (`given`: as typed): only with int8, each a name in capitals."""
    if names and quantize != "int8":
        raise ConfigError("--float-ops needs --quantize int8", "--float-ops",
                          "--quantize int8 (only an int8 file has ops to keep in float32)")
    if any(not FLOAT_OPS_PATTERN.fullmatch(n) for n in names):
        raise ConfigError("invalid --float-ops", "--float-ops", "TFLite builtin op names in capitals, "
                          f"comma-separated (e.g. SOFTMAX,GELU), got {given or ','.join(names)!r}")


def convert(frozen, quantize: str, representative=None, float_ops: tuple[str, ...] = ()) -> bytes:
    """The .tflite bytes of a frozen concrete function; `float_ops`: op kinds kept in float32 (int8)."""
    import tensorflow as tf

    converter = tf.lite.TFLiteConverter.from_concrete_functions([frozen])
    converter.target_spec.supported_ops = [tf.lite.OpsSet.TFLITE_BUILTINS]
    if quantize == "float16":
        converter.optimizations = [tf.lite.Optimize.DEFAULT]
        converter.target_spec.supported_types = [tf.float16]
    elif quantize == "int8":
        converter.optimizations = [tf.lite.Optimize.DEFAULT]
        converter.representative_dataset = representative
        # int8 kernels first; an op without one keeps its float builtin (reported in the JSON).
        converter.target_spec.supported_ops = [tf.lite.OpsSet.TFLITE_BUILTINS_INT8, tf.lite.OpsSet.TFLITE_BUILTINS]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if float_ops:
                # The denylist is honoured only by the debugger's own conversion (the debugger is not run).
                debugger = tf.lite.experimental.QuantizationDebugger(
                    converter=converter, debug_dataset=representative,
                    debug_options=tf.lite.experimental.QuantizationDebugOptions(denylisted_ops=list(float_ops)))
                return debugger.get_nondebug_quantized_model()
            return converter.convert()
    except Exception as e:  # noqa: BLE001 - the converter raises ConverterError and plain Exceptions alike
        lines = [line for line in map(without_reprs, str(e).splitlines()) if line]
        detail = next((line for line in lines if "ops" in line.lower() or "error" in line.lower()),
                      lines[0] if lines else type(e).__name__)
        raise ConfigError("cannot convert the model to TFLite builtin ops", f"--quantize {quantize}",
                          f"a model of TFLite builtin ops ({detail[:300]})") from None


def describe(content: bytes) -> tuple[dict, dict, list, list]:
    """Of a .tflite model: ({op: count}, {op: count computing in float32}, inputs, outputs).

    An op computes in float32 when one of its tensors is float32. Read without the XNNPACK delegate,
    which would fold the ops into DELEGATE nodes.
    """
    try:
        from ai_edge_litert.interpreter import Interpreter, OpResolverType
    except ImportError:
        import tensorflow as tf
        Interpreter, OpResolverType = tf.lite.Interpreter, tf.lite.experimental.OpResolverType
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        interpreter = Interpreter(model_content=content,
                                  experimental_op_resolver_type=OpResolverType.BUILTIN_WITHOUT_DEFAULT_DELEGATES)
    interpreter.allocate_tensors()
    tensors = {t["index"]: t for t in interpreter.get_tensor_details()}
    ops, floating = Counter(), Counter()
    for op in interpreter._get_ops_details():  # noqa: SLF001 - the only API that lists a model's ops
        ops[op["op_name"]] += 1
        used = [i for i in list(op["inputs"]) + list(op["outputs"]) if i >= 0 and i in tensors]
        if any(tensors[i]["dtype"] == np.float32 for i in used):
            floating[op["op_name"]] += 1

    def tensor(d, name):
        return {"name": name, "index": int(d["index"]), "dtype": np.dtype(d["dtype"]).name,
                "shape": [int(v) for v in d["shape"]]}

    inputs = [tensor(d, "image") for d in interpreter.get_input_details()]
    details = interpreter.get_output_details()
    if any(np.dtype(d["dtype"]) == np.float32 and len(d["shape"]) == 3 for d in details):  # panoptic / instance
        outputs = [tensor(d, "class_logits" if len(d["shape"]) == 3 else "mask_logits") for d in details]
    else:
        outputs = [tensor(d, "classes" if len(d["shape"]) == 3 else "probabilities") for d in details]
    return dict(sorted(ops.items())), dict(sorted(floating.items())), inputs, outputs


def check_calibration_images(count: int) -> None:
    """--calibration-images: a positive number (checked by the CLI before TensorFlow starts, and here)."""
    if count < 1:
        raise ConfigError("invalid --calibration-images", "--calibration-images",
                          f"a positive number of images, got {count}")


def run_export_tflite(cfg: Config, strategy, checkpoint: str, output: str | os.PathLike, *, force: bool = False,
                      size=None, quantize: str = "none", calibration_images: int = 200, probabilities: bool = False,
                      check: bool = False, threads: int = 1, progress: bool = True,
                      float_ops: tuple[str, ...] = ()) -> Path:
    """seg-export --format tflite: writes FILE.tflite and FILE.json; with `check`, measures it (run_check)."""
    from seg_train.infer.litert import RESIZE, interpreter_class, sidecar_path, to_input_size
    from seg_train.infer.mask_evaluate import LETTERBOX, letterbox
    from seg_train.run.rundir import write_atomic, write_json
    from seg_train.util.progress import progress_bar

    if quantize not in QUANTIZATIONS:
        raise ConfigError("invalid --quantize", "--quantize", f"one of {', '.join(QUANTIZATIONS)}, got {quantize!r}")
    check_calibration_images(calibration_images)
    check_float_ops(float_ops, quantize)
    out = check_output_file(output, force)
    if check:
        interpreter_class("seg-export --check")  # fail before the work, not after it
    app = frozen_app(cfg, strategy, checkpoint, size, probabilities, progress)
    frozen, prefix, step, height, width = app.frozen, app.prefix, app.step, app.height, app.width
    masks = cfg.data.task != "semantic"

    calibration, representative = None, None
    if quantize == "int8":
        from seg_train.data import reader as reader_lib
        train, samples = calibration_samples(cfg, calibration_images)
        if len(samples) < calibration_images:
            log.warning("the train split has %d images: calibrating on all of them, not %d", len(samples),
                        calibration_images)

        def representative():
            with progress_bar(len(samples), "int8 calibration", enabled=progress) as bar:
                for sample in samples:
                    image, _ = reader_lib.load(sample, cfg.data.num_classes, cfg.data.ignore_label, train.label_table)
                    yield [(letterbox(image, (height, width)) if masks else to_input_size(image, height, width))[None]]
                    bar.update(1)

        calibration = {"split": cfg.data.train_split, "images": len(samples), "seed": cfg.seed,
                       "selection": "the first images of a permutation of the split seeded by the run's seed",
                       "resize": LETTERBOX if masks else RESIZE, "ids": [s.id for s in samples]}
    log.info("converting step %d to TFLite (%s, input %dx%d)", step, quantize, height, width)
    content = convert(frozen, quantize, representative, tuple(float_ops))
    ops, floating, inputs, outputs = describe(content)
    absent = [op for op in float_ops if op not in ops]
    if absent:
        raise ConfigError("not an op of this model", "--float-ops",
                          f"op names of the converted file ({', '.join(ops)}), got {', '.join(absent)}")
    meta = {
        **sidecar(cfg, app, "tflite"), "quantization": quantize,
        "input": {**inputs[0], **INPUT_DESCRIPTION}, "outputs": outputs, "calibration": calibration,
        "size_bytes": len(content), "builtin_ops_only": True, "ops": ops, "float32_ops": floating,
        "float_ops_requested": list(float_ops),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(out, lambda tmp: tmp.write_bytes(content))
    write_json(sidecar_path(out), meta)
    where = "" if quantize != "int8" else \
        f"; float32 ops: {', '.join(f'{k} x{v}' for k, v in floating.items()) or 'none'}"
    result = "class_logits, mask_logits (letterboxed input)" if masks else f"classes uint8 [1, {height}, {width}]"
    print(f"exported step {step} ({prefix}) to {out}: {quantize}, {len(content) / 1e6:.2f} MB, "
          f"image uint8 [1, {height}, {width}, 3] -> {result}{where}; wrote {sidecar_path(out)}")
    if check:
        run_check(cfg, out, frozen if quantize != "none" else None, threads, progress)
    return out


def run_check(cfg: Config, path: Path, frozen=None, threads: int = 1, progress: bool = True) -> list[dict]:
    """seg-export --check: the exported file and (if quantized) the float32 conversion of the same model,
    both evaluated in their runtime (LiteRT, ONNX Runtime for a .onnx file) on data.val_split; prints them
    side by side. Returns the records."""
    from seg_train.infer.litert import evaluate_file, evaluate_masks_file, open_model, read_sidecar, sidecar_path
    from seg_train.run.rundir import write_json

    split = cfg.data.val_split
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        files = []
        if frozen is not None:
            float_path = Path(tmp) / "float32.tflite"
            float_path.write_bytes(convert(frozen, "none"))
            # The same function as the exported file's (its logit adjustment included): the same description.
            write_json(sidecar_path(float_path), {**(read_sidecar(path) or {}), "quantization": "none",
                                                  "calibration": None})
            files.append(("float32 (not written)", float_path))
        files.append((f"{path.name}", path))
        for label, file in files:
            model = open_model(file, threads, "seg-export --check")
            if cfg.data.task != "semantic":
                record, _ = evaluate_masks_file(cfg, model, split, progress)
            else:
                record, _, _ = evaluate_file(cfg, model, split, progress)
            record["label"] = label
            rows.append(record)
    key = {"semantic": "miou", "panoptic": "pq", "instance": "ap"}[cfg.data.task]
    title = {"miou": "mIoU", "pq": "PQ", "ap": "mask AP"}[key]
    name_w = max(len(r["label"]) for r in rows)
    print(f"check on {split} ({rows[0]['num_images']} images), {rows[-1]['runtime']}, {threads} thread(s):")
    print(f"  {'model':<{name_w}}  {title + ' %':>7}  {'size MB':>8}  {'ms/image':>9}")
    for r in rows:
        print(f"  {r['label']:<{name_w}}  {100 * r[key]:7.2f}  {r['size_bytes'] / 1e6:8.2f}  "
              f"{r['latency_ms']['median']:9.1f}")
    if len(rows) == 2:
        f, q = rows
        print(f"  exported - float32: {100 * (q[key] - f[key]):+.2f} {title}, "
              f"{f['latency_ms']['median'] / q['latency_ms']['median']:.2f}x the speed, "
              f"{f['size_bytes'] / q['size_bytes']:.2f}x smaller")
    return rows

"""Exported files run the way an app runs them: .tflite files in LiteRT's Python interpreter (the
`ai-edge-litert` package), .onnx files in ONNX Runtime (infer/onnx_runtime.py).

Used by seg-eval --model, seg-predict --model and seg-export --check. LiteRT's own interpreter (with
its default XNNPACK delegate), not TensorFlow's: the runtime an app has; an optional extra, as ONNX
Runtime is. Both kinds of file go through the same code here (FileModel): images of another size than
the model's input are resized with Pillow (`RESIZE`), what a Python app has at hand; latency is the wall
time of the runtime's call alone, after one warm-up call. Evaluation decodes with reader.load and reports
metrics.compute_metrics', as a checkpoint's evaluation does.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import numpy as np
from PIL import Image

from seg_train.config import Config, ConfigError, exception_text

log = logging.getLogger("seg_train")

RESIZE = ("Pillow: the image BILINEAR to the model's input size, the class map NEAREST back to the image's "
          "size; neither where the image already has the input size")
INSTALL_HINT = "pip install 'seg-train[tflite]' (LiteRT's interpreter, the ai-edge-litert package)"


def interpreter_class(where: str):
    """LiteRT's Interpreter class; a one-line ConfigError naming `where` when ai-edge-litert is missing."""
    try:
        from ai_edge_litert.interpreter import Interpreter
    except ImportError:
        raise ConfigError("ai-edge-litert is not installed", where, INSTALL_HINT) from None
    return Interpreter


def sidecar_path(model_path: str | os.PathLike) -> Path:
    """model.tflite (or model.onnx) -> model.json: what seg-export writes beside the file."""
    return Path(model_path).with_suffix(".json")


def read_sidecar(model_path: str | os.PathLike) -> dict | None:
    """The export's JSON beside the file, or None (a file from another tool has none, or a JSON that
    describes a file of the other format)."""
    import json

    path = sidecar_path(model_path)
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        log.warning("ignoring %s: not a JSON file", path)
        return None
    fmt = "onnx" if Path(model_path).suffix == ".onnx" else "tflite"
    return data if isinstance(data, dict) and data.get("format") == fmt else None


def to_input_size(image: np.ndarray, height: int, width: int) -> np.ndarray:
    """uint8 [h, w, 3] -> [height, width, 3]: Pillow BILINEAR, or the image itself if already that size."""
    if image.shape[:2] == (height, width):
        return image
    return np.asarray(Image.fromarray(image).resize((width, height), Image.BILINEAR))


def to_image_size(classes: np.ndarray, height: int, width: int) -> np.ndarray:
    """uint8 class map -> [height, width]: Pillow NEAREST, or the map itself if already that size."""
    if classes.shape == (height, width):
        return classes
    return np.asarray(Image.fromarray(classes).resize((width, height), Image.NEAREST))


def check_threads(threads: int) -> None:
    """--threads: a positive number (checked by the CLI before TensorFlow starts, and by TFLiteModel)."""
    if threads < 1:
        raise ConfigError("invalid --threads", "--threads", f"a positive number of threads, got {threads}")


class FileModel:
    """An exported segmentation model as an app runs it: `classes(image)` for a uint8 image of any size.

    What seg-eval / seg-predict --model and seg-export --check need of a file, whatever runs it: the checks
    of its one input and its class-map (or score) output, the resizes, the latency. `runner` opens the file
    and calls its runtime (LiteRTFile here, onnx_runtime.ONNXFile): `path`, `size_bytes`, `runtime` (who runs
    it, as messages and records name it), `format` ("tflite" or "onnx", as FILE.json says), `inputs` and
    `outputs` ((handle, shape, numpy dtype) per tensor) and `run(input, output, x) -> (output array, seconds
    of the runtime's call alone)`.
    """

    def __init__(self, runner, threads: int):
        self.runner, self.threads = runner, threads
        self.path, self.size_bytes = runner.path, runner.size_bytes
        self.runtime, self.format = runner.runtime, runner.format
        inputs = runner.inputs
        if len(inputs) != 1 or len(inputs[0][1]) != 4 or [inputs[0][1][0], inputs[0][1][3]] != [1, 3] \
                or inputs[0][2] != np.uint8:
            got = ", ".join(f"{np.dtype(d).name} {list(s)}" for _, s, d in inputs)
            raise ConfigError("unsupported model input", str(self.path),
                              f"one uint8 RGB image [1, H, W, 3] (seg-export --format {self.format} writes one), "
                              f"got {got}")
        self._input = inputs[0][0]
        self.height, self.width = (int(v) for v in inputs[0][1][1:3])
        # data.task panoptic / instance: the raw class and mask logits (seg-export writes them), else a class map.
        self.mask_outputs = self._mask_outputs(runner.outputs)
        if self.mask_outputs is None:
            self._output, self.num_classes = self._class_output(runner.outputs)
        else:
            self._output = self.mask_outputs[0]
            self.num_classes = int(next(s for h, s, _ in runner.outputs if h == self._output)[-1]) - 1
        # Warm-up: the first call prepares the runtime's kernels; it is not counted in the latency.
        runner.run(self._input, self._output, np.zeros((1, self.height, self.width, 3), np.uint8))
        self.invoke_seconds: list[float] = []

    @staticmethod
    def _mask_outputs(outputs):
        """(class logits handle, mask logits handle) of float outputs [1, Q, K + 1] and [1, Q, h, w], or None."""
        by_rank = {len(s): (h, s) for h, s, d in outputs if np.dtype(d) == np.float32}
        if len(outputs) != 2 or set(by_rank) != {3, 4} or by_rank[3][1][1] != by_rank[4][1][1]:
            return None
        return by_rank[3][0], by_rank[4][0]

    def logits(self, image: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """A panoptic / instance file: uint8 [H, W, 3] at the input's size (letterboxed: mask_evaluate.letterbox)
        -> (class logits [Q, K + 1], mask logits [Q, h, w]), from one call of the runtime."""
        if self.mask_outputs is None:
            raise ConfigError("not a panoptic / instance model", str(self.path),
                              "a file with class and mask logits outputs (seg-export of a data.task panoptic or "
                              "instance checkpoint)")
        if image.shape[:2] != (self.height, self.width):
            raise ValueError(f"image of size {image.shape[:2]}, the file takes {(self.height, self.width)}")
        outs, seconds = self.runner.run_all(self._input, self.mask_outputs,
                                            np.ascontiguousarray(image, np.uint8)[None])
        self.invoke_seconds.append(seconds)
        return outs[0][0], outs[1][0]

    def _class_output(self, outputs):
        """(handle of the class-map or score output, number of classes if the scores say it)."""
        size = [1, self.height, self.width]
        for handle, shape, dtype in outputs:  # the class map: integer [1, H, W]
            if list(shape) == size and np.issubdtype(dtype, np.integer):
                return handle, None
        for handle, shape, dtype in outputs:  # else scores [1, H, W, C]
            if len(shape) == 4 and list(shape[:3]) == size:
                return handle, int(shape[3])
        got = ", ".join(f"{np.dtype(d).name} {list(s)}" for _, s, d in outputs)
        raise ConfigError("unsupported model output", str(self.path),
                          f"a class map [1, {self.height}, {self.width}] or scores [1, {self.height}, {self.width}, C] "
                          f"at the input's size, got {got}")

    def classes(self, image: np.ndarray) -> np.ndarray:
        """uint8 [h, w, 3] RGB -> int64 class map [h, w] (resized in and out as the module doc says)."""
        h, w = image.shape[:2]
        x = to_input_size(np.ascontiguousarray(image, np.uint8), self.height, self.width)
        out, seconds = self.runner.run(self._input, self._output, x[None])
        self.invoke_seconds.append(seconds)
        out = out[0]
        if out.ndim == 3:
            out = out.argmax(-1)
        if out.max(initial=0) > 255 or out.min(initial=0) < 0:
            raise ConfigError("class out of range", str(self.path),
                              f"class indices in 0..255, got {int(out.min())}..{int(out.max())}")
        return to_image_size(out.astype(np.uint8), h, w).astype(np.int64)

    def latency_ms(self) -> dict:
        """Median, mean and 90th percentile of the runtime's call in ms over the calls so far (warm-up
        excluded)."""
        t = np.asarray(self.invoke_seconds) * 1000.0
        if t.size == 0:
            return {"median": None, "mean": None, "p90": None, "invokes": 0, "threads": self.threads}
        return {"median": round(float(np.median(t)), 3), "mean": round(float(t.mean()), 3),
                "p90": round(float(np.percentile(t, 90)), 3), "invokes": int(t.size), "threads": self.threads}


class LiteRTFile:
    """A .tflite file in LiteRT's interpreter (FileModel's runner); `where`: what to name in error messages
    (the flag that gave the path)."""

    runtime = "LiteRT"
    format = "tflite"

    def __init__(self, path: str | os.PathLike, threads: int, where: str):
        self.path = Path(path)
        if not self.path.is_file():
            raise ConfigError("model file not found", str(path), "a .tflite file (seg-export --format tflite)")
        interpreter = interpreter_class(where)
        try:
            self.interpreter = interpreter(model_path=str(self.path), num_threads=threads)
            self.interpreter.allocate_tensors()
        except (ValueError, RuntimeError) as e:
            raise ConfigError("not a TFLite model LiteRT can run", str(path),
                              f"a .tflite file ({exception_text(e)})") from None
        self.size_bytes = self.path.stat().st_size
        self.inputs = [(d["index"], d["shape"], d["dtype"]) for d in self.interpreter.get_input_details()]
        self.outputs = [(d["index"], d["shape"], d["dtype"]) for d in self.interpreter.get_output_details()]

    def run(self, input_index, output_index, x: np.ndarray) -> tuple[np.ndarray, float]:
        self.interpreter.set_tensor(input_index, x)
        start = time.perf_counter()
        self.interpreter.invoke()
        seconds = time.perf_counter() - start
        return self.interpreter.get_tensor(output_index), seconds

    def run_all(self, input_index, output_indices, x: np.ndarray) -> tuple[list, float]:
        """`run` reading several outputs of the one call."""
        out, seconds = self.run(input_index, output_indices[0], x)
        return [out] + [self.interpreter.get_tensor(i) for i in output_indices[1:]], seconds


class TFLiteModel(FileModel):
    """A .tflite segmentation model in LiteRT (FileModel)."""

    def __init__(self, path: str | os.PathLike, threads: int = 1, where: str = "--model"):
        check_threads(threads)
        super().__init__(LiteRTFile(path, threads, where), threads)


def open_model(path: str | os.PathLike, threads: int = 1, where: str = "--model") -> FileModel:
    """The exported file at `path` in its runtime: ONNX Runtime for a .onnx file, else LiteRT."""
    if Path(path).suffix != ".onnx":
        return TFLiteModel(path, threads, where)
    from seg_train.infer.onnx_runtime import ONNXFile

    check_threads(threads)
    return FileModel(ONNXFile(path, threads, where), threads)


def check_runtime(path: str | os.PathLike, where: str = "--model") -> None:
    """The runtime of the file at `path` is installed (else a one-line ConfigError naming `where`)."""
    if Path(path).suffix != ".onnx":
        interpreter_class(where)
        return
    from seg_train.infer.onnx_runtime import session_class

    session_class(where)


def eval_record_path(model_path: str | os.PathLike, split_tag: str) -> Path:
    """model.tflite (or model.onnx) -> model.eval-<split>.json, beside the file."""
    p = Path(model_path)
    return p.with_name(f"{p.stem}.eval-{split_tag}.json")


def confusion(cfg: Config, model: FileModel, split, progress: bool = True) -> tuple[np.ndarray, int]:
    """int64 [C, C] (label, prediction) counts of `model` over the opened `split`, and the image count."""
    from seg_train.data import reader as reader_lib
    from seg_train.util.progress import progress_bar

    c, ignore = cfg.data.num_classes, cfg.data.ignore_label
    if model.num_classes is not None and model.num_classes != c:
        raise ConfigError("model and config disagree on the number of classes", str(model.path),
                          f"{c} classes (data.num_classes), the model gives {model.num_classes}")
    cm = np.zeros(c * c, np.int64)
    n = 0
    with progress_bar(len(split), f"eval {split.name} ({model.runtime})", enabled=progress) as bar:
        for sample in split.samples:
            try:
                image, label = reader_lib.load(sample, c, ignore, split.label_table)
            except reader_lib.BadSample as e:
                if cfg.data.on_bad_sample == "skip":
                    log.warning("skipping %s", e)
                    bar.update(1)
                    continue
                raise ConfigError("bad sample", sample.image, str(e)) from None
            pred = model.classes(image)
            if pred.max(initial=0) >= c:
                raise ConfigError("model predicts a class the config does not have", str(model.path),
                                  f"classes 0..{c - 1} (data.num_classes: {c}), got {int(pred.max())}")
            keep = (label != ignore) & (label < c)
            cm += np.bincount(label[keep].astype(np.int64) * c + pred[keep], minlength=c * c)
            n += 1
            bar.update(1)
    return cm.reshape(c, c), n


def evaluate_file(cfg: Config, model: FileModel, split: str, progress: bool = True):
    """(evaluation record of an exported file on `split`, SegMetrics, class names). Writes nothing."""
    from seg_train.data.split import open_split
    from seg_train.infer.metrics import compute_metrics, metrics_to_json

    opened = open_split(cfg, split)
    names = opened.class_names
    cm, n = confusion(cfg, model, opened, progress)
    if not cm.any():
        raise ConfigError("no labelled pixels", f"split {split}",
                          f"expected pixels whose label is not data.ignore_label ({cfg.data.ignore_label})")
    metrics = compute_metrics(cm)
    sidecar = read_sidecar(model.path) or {}
    baked = sidecar.get("logit_adjustment") or 0.0
    if cfg.eval.logit_adjustment != baked:
        log.warning("eval.logit_adjustment is %g but %s was exported with %g: the file's own is what runs",
                    cfg.eval.logit_adjustment, model.path, baked)
    return {"split": split, "model": str(model.path.resolve()), "format": model.format, "runtime": model.runtime,
            "quantization": sidecar.get("quantization"), "checkpoint": sidecar.get("checkpoint"),
            "step": sidecar.get("step"), "input_size": [model.height, model.width], "num_images": n,
            "size_bytes": model.size_bytes, "latency_ms": model.latency_ms(), "resize": RESIZE,
            "logit_adjustment": baked, "score_offsets": sidecar.get("score_offsets"),
            **metrics_to_json(metrics, names)}, metrics, names


def evaluate_masks_file(cfg: Config, model: FileModel, split: str, progress: bool = True):
    """(evaluation record, mask_evaluate.MaskScores) of a panoptic / instance file on `split`: each image letterboxed
    to the file's input size, its logits post-processed on the host as seg-eval does. Writes nothing."""
    import dataclasses

    from seg_train.data.split import open_split
    from seg_train.infer.mask_evaluate import LETTERBOX, MaskSetup, evaluate_host

    if model.mask_outputs is None:
        model.logits(np.zeros((model.height, model.width, 3), np.uint8))  # the one-line error
    setup = dataclasses.replace(MaskSetup.of(cfg), crop=(model.height, model.width))
    if model.num_classes != setup.num_classes:
        raise ConfigError("model and config disagree on the number of classes", str(model.path),
                          f"{setup.num_classes} classes (data.num_classes), the model gives {model.num_classes}")
    opened = open_split(cfg, split)
    scores, n = evaluate_host(opened.reader, setup, model.logits, opened.class_names, progress)
    sidecar = read_sidecar(model.path) or {}
    return {"split": split, "model": str(model.path.resolve()), "format": model.format, "runtime": model.runtime,
            "quantization": sidecar.get("quantization"), "checkpoint": sidecar.get("checkpoint"),
            "step": sidecar.get("step"), "input_size": [model.height, model.width], "num_images": n,
            "size_bytes": model.size_bytes, "latency_ms": model.latency_ms(), "resize": LETTERBOX,
            **scores.to_json()}, scores


def run_eval_model(cfg: Config, model_path: str, split: str | None = None, threads: int = 1,
                    progress: bool = True) -> dict:
    """seg-eval --model FILE.tflite|FILE.onnx: evaluates the file in LiteRT or ONNX Runtime, prints the table,
    writes FILE.eval-<split>.json."""
    from seg_train.infer.eval_checkpoint import split_tag
    from seg_train.infer.metrics import format_table
    from seg_train.run.rundir import write_json
    from seg_train.util.paths import check_creatable_dir

    split = split or cfg.data.val_split
    model = open_model(model_path, threads)
    out = eval_record_path(model_path, split_tag(split))
    check_creatable_dir(out.parent, "eval output folder", "write access to the model file's folder")
    log.info("evaluating %s (%s, %d thread(s), input %dx%d) on %s", model_path, model.runtime, threads,
             model.height, model.width, split)
    if cfg.data.task != "semantic":
        record, scores = evaluate_masks_file(cfg, model, split, progress)
        write_json(out, record)
        print(scores.table())
        print(f"{record['num_images']} images, {model.path.name} ({record['quantization'] or model.format}, "
              f"{model.size_bytes / 1e6:.2f} MB): {scores.headline_text()}; {model.runtime} run "
              f"{record['latency_ms']['median']:.1f} ms per image (median, {threads} thread(s)); wrote {out}")
        return record
    record, metrics, names = evaluate_file(cfg, model, split, progress)
    write_json(out, record)
    lat = record["latency_ms"]
    print(format_table(metrics, names))
    print(f"{record['num_images']} images, {model.path.name} ({record['quantization'] or model.format}, "
          f"{model.size_bytes / 1e6:.2f} MB): mIoU {100 * metrics.miou:.2f}%; {model.runtime} run "
          f"{lat['median']:.1f} ms per image (median, {threads} thread(s)); wrote {out}")
    return record


def run_predict_model(cfg: Config, model_path: str, inputs, output, threads: int = 1,
                       progress: bool = True, label_ids: bool = False) -> list[Path]:
    """seg-predict --model FILE.tflite|FILE.onnx: the same PNGs seg-predict writes for a checkpoint."""
    from seg_train.infer.predict import check_output_dir, collect_inputs, raw_ids_of, write_predictions, written_summary

    files = collect_inputs(inputs, label_ids)
    out = check_output_dir(output)
    if cfg.data.task != "semantic":
        import dataclasses

        from seg_train.infer.predict import check_mask_flags, predict_masks

        check_mask_flags(cfg, label_ids)
        model = open_model(model_path, threads)
        at_input = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, crop_size=(model.height, model.width)))
        return predict_masks(at_input, files, out, model.logits, progress, f"{model_path}, {model.runtime}")
    raw = raw_ids_of(cfg, label_ids)
    model = open_model(model_path, threads)
    written = write_predictions(files, out, model.classes, progress, raw)
    print(f"wrote {written_summary(cfg, len(written), raw)} to {out} ({model_path}, {model.runtime})")
    return written

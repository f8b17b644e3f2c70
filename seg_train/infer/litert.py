""".tflite files run the way an app runs them: LiteRT's Python interpreter (the `ai-edge-litert` package).

Used by seg-eval --model, seg-predict --model and seg-export --check. LiteRT's own interpreter (with
its default XNNPACK delegate), not TensorFlow's: the runtime an app has; an optional extra.
Images of another size than the model's input are resized with Pillow (`RESIZE`), what a Python app
has at hand. Latency is the wall time of `invoke()` alone, after one warm-up call. Evaluation decodes
with reader.load and reports metrics.compute_metrics', as a checkpoint's evaluation does.
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
    """model.tflite -> model.json: what seg-export writes beside the file."""
    return Path(model_path).with_suffix(".json")


def read_sidecar(model_path: str | os.PathLike) -> dict | None:
    """The export's JSON beside the file, or None (a file from another tool has none)."""
    import json

    path = sidecar_path(model_path)
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        log.warning("ignoring %s: not a JSON file", path)
        return None
    return data if isinstance(data, dict) and data.get("format") == "tflite" else None


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


class TFLiteModel:
    """A .tflite segmentation model in LiteRT: `classes(image)` for a uint8 image of any size.

    `where`: what to name in error messages (the flag that gave the path).
    """

    def __init__(self, path: str | os.PathLike, threads: int = 1, where: str = "--model"):
        self.path = Path(path)
        if not self.path.is_file():
            raise ConfigError("model file not found", str(path), "a .tflite file (seg-export --format tflite)")
        check_threads(threads)
        interpreter = interpreter_class(where)
        try:
            self.interpreter = interpreter(model_path=str(self.path), num_threads=threads)
            self.interpreter.allocate_tensors()
        except (ValueError, RuntimeError) as e:
            raise ConfigError("not a TFLite model LiteRT can run", str(path),
                              f"a .tflite file ({exception_text(e)})") from None
        self.threads = threads
        self.size_bytes = self.path.stat().st_size
        inputs = self.interpreter.get_input_details()
        if len(inputs) != 1 or list(inputs[0]["shape"][[0, 3]]) != [1, 3] or len(inputs[0]["shape"]) != 4 \
                or inputs[0]["dtype"] != np.uint8:
            got = ", ".join(f"{d['dtype'].__name__} {list(d['shape'])}" for d in inputs)
            raise ConfigError("unsupported model input", str(path),
                              f"one uint8 RGB image [1, H, W, 3] (seg-export --format tflite writes one), got {got}")
        self._input = inputs[0]["index"]
        self.height, self.width = (int(v) for v in inputs[0]["shape"][1:3])
        outputs = self.interpreter.get_output_details()
        # data.task panoptic / instance: the raw class and mask logits (seg-export writes them), else a class map.
        self.mask_outputs = self._mask_outputs(outputs)
        if self.mask_outputs is None:
            self._output, self.num_classes = self._class_output(outputs)
        else:
            self.num_classes = int(outputs[0]["shape"][-1] if self.mask_outputs[0] == outputs[0]["index"]
                                   else outputs[1]["shape"][-1]) - 1
        self.invoke_seconds: list[float] = []
        # Warm-up: the first invoke prepares the delegate's kernels; it is not counted in the latency.
        self.interpreter.set_tensor(self._input, np.zeros((1, self.height, self.width, 3), np.uint8))
        self.interpreter.invoke()

    @staticmethod
    def _mask_outputs(outputs):
        """(class logits index, mask logits index) of float outputs [1, Q, K + 1] and [1, Q, h, w], or None."""
        by_rank = {len(d["shape"]): d for d in outputs if d["dtype"] == np.float32}
        if len(outputs) != 2 or set(by_rank) != {3, 4} or by_rank[3]["shape"][1] != by_rank[4]["shape"][1]:
            return None
        return by_rank[3]["index"], by_rank[4]["index"]

    def logits(self, image: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """A panoptic / instance file: uint8 [H, W, 3] at the input's size (letterboxed: mask_evaluate.letterbox)
        -> (class logits [Q, K + 1], mask logits [Q, h, w])."""
        if self.mask_outputs is None:
            raise ConfigError("not a panoptic / instance model", str(self.path),
                              "a file with class and mask logits outputs (seg-export of a data.task panoptic or "
                              "instance checkpoint)")
        if image.shape[:2] != (self.height, self.width):
            raise ValueError(f"image of size {image.shape[:2]}, the file takes {(self.height, self.width)}")
        self.interpreter.set_tensor(self._input, np.ascontiguousarray(image, np.uint8)[None])
        start = time.perf_counter()
        self.interpreter.invoke()
        self.invoke_seconds.append(time.perf_counter() - start)
        return tuple(self.interpreter.get_tensor(i)[0] for i in self.mask_outputs)

    def _class_output(self, outputs):
        """(index of the class-map or score output, number of classes if the scores say it)."""
        size = [1, self.height, self.width]
        for d in outputs:  # the class map: integer [1, H, W]
            if list(d["shape"]) == size and np.issubdtype(d["dtype"], np.integer):
                return d["index"], None
        for d in outputs:  # else scores [1, H, W, C]
            if len(d["shape"]) == 4 and list(d["shape"][:3]) == size:
                return d["index"], int(d["shape"][3])
        got = ", ".join(f"{d['dtype'].__name__} {list(d['shape'])}" for d in outputs)
        raise ConfigError("unsupported model output", str(self.path),
                          f"a class map [1, {self.height}, {self.width}] or scores [1, {self.height}, {self.width}, C] "
                          f"at the input's size, got {got}")

    def classes(self, image: np.ndarray) -> np.ndarray:
        """uint8 [h, w, 3] RGB -> int64 class map [h, w] (resized in and out as the module doc says)."""
        h, w = image.shape[:2]
        x = to_input_size(np.ascontiguousarray(image, np.uint8), self.height, self.width)
        self.interpreter.set_tensor(self._input, x[None])
        start = time.perf_counter()
        self.interpreter.invoke()
        self.invoke_seconds.append(time.perf_counter() - start)
        out = self.interpreter.get_tensor(self._output)[0]
        if out.ndim == 3:
            out = out.argmax(-1)
        if out.max(initial=0) > 255 or out.min(initial=0) < 0:
            raise ConfigError("class out of range", str(self.path),
                              f"class indices in 0..255, got {int(out.min())}..{int(out.max())}")
        return to_image_size(out.astype(np.uint8), h, w).astype(np.int64)

    def latency_ms(self) -> dict:
        """Median, mean and 90th percentile of invoke() in ms over the calls so far (warm-up excluded)."""
        t = np.asarray(self.invoke_seconds) * 1000.0
        if t.size == 0:
            return {"median": None, "mean": None, "p90": None, "invokes": 0, "threads": self.threads}
        return {"median": round(float(np.median(t)), 3), "mean": round(float(t.mean()), 3),
                "p90": round(float(np.percentile(t, 90)), 3), "invokes": int(t.size), "threads": self.threads}


def eval_record_path(model_path: str | os.PathLike, split_tag: str) -> Path:
    """model.tflite -> model.eval-<split>.json, beside the file."""
    p = Path(model_path)
    return p.with_name(f"{p.stem}.eval-{split_tag}.json")


def confusion(cfg: Config, model: TFLiteModel, split, progress: bool = True) -> tuple[np.ndarray, int]:
    """int64 [C, C] (label, prediction) counts of `model` over the opened `split`, and the image count."""
    from seg_train.data import reader as reader_lib
    from seg_train.util.progress import progress_bar

    c, ignore = cfg.data.num_classes, cfg.data.ignore_label
    if model.num_classes is not None and model.num_classes != c:
        raise ConfigError("model and config disagree on the number of classes", str(model.path),
                          f"{c} classes (data.num_classes), the model gives {model.num_classes}")
    cm = np.zeros(c * c, np.int64)
    n = 0
    with progress_bar(len(split), f"eval {split.name} (LiteRT)", enabled=progress) as bar:
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


def evaluate_file(cfg: Config, model: TFLiteModel, split: str, progress: bool = True):
    """(evaluation record of a .tflite file on `split`, SegMetrics, class names). Writes nothing."""
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
    return {"split": split, "model": str(model.path.resolve()), "format": "tflite",
            "quantization": sidecar.get("quantization"), "checkpoint": sidecar.get("checkpoint"),
            "step": sidecar.get("step"), "input_size": [model.height, model.width], "num_images": n,
            "size_bytes": model.size_bytes, "latency_ms": model.latency_ms(), "resize": RESIZE,
            "logit_adjustment": baked, "score_offsets": sidecar.get("score_offsets"),
            **metrics_to_json(metrics, names)}, metrics, names


def evaluate_masks_file(cfg: Config, model: TFLiteModel, split: str, progress: bool = True):
    """(evaluation record, mask_evaluate.MaskScores) of a panoptic / instance .tflite file on `split`: each image
    letterboxed to the file's input size, its logits post-processed on the host as seg-eval does. Writes nothing."""
    import dataclasses

    from seg_train.data.split import open_split
    from seg_train.infer.mask_evaluate import MaskSetup, evaluate_host

    if model.mask_outputs is None:
        model.logits(np.zeros((model.height, model.width, 3), np.uint8))  # the one-line error
    setup = dataclasses.replace(MaskSetup.of(cfg), crop=(model.height, model.width))
    if model.num_classes != setup.num_classes:
        raise ConfigError("model and config disagree on the number of classes", str(model.path),
                          f"{setup.num_classes} classes (data.num_classes), the model gives {model.num_classes}")
    opened = open_split(cfg, split)
    scores, n = evaluate_host(opened.reader, setup, model.logits, opened.class_names, progress)
    sidecar = read_sidecar(model.path) or {}
    return {"split": split, "model": str(model.path.resolve()), "format": "tflite",
            "quantization": sidecar.get("quantization"), "checkpoint": sidecar.get("checkpoint"),
            "step": sidecar.get("step"), "input_size": [model.height, model.width], "num_images": n,
            "size_bytes": model.size_bytes, "latency_ms": model.latency_ms(),
            "resize": "the image letterboxed to the input size (Pillow BILINEAR, padded with 0), the mask logits "
                      "resized back bilinearly (infer/mask_evaluate.py)", **scores.to_json()}, scores


def run_eval_tflite(cfg: Config, model_path: str, split: str | None = None, threads: int = 1,
                    progress: bool = True) -> dict:
    """seg-eval --model FILE.tflite: evaluates the file in LiteRT, prints the table, writes FILE.eval-<split>.json."""
    from seg_train.infer.eval_checkpoint import split_tag
    from seg_train.infer.metrics import format_table
    from seg_train.run.rundir import write_json
    from seg_train.util.paths import check_creatable_dir

    split = split or cfg.data.val_split
    model = TFLiteModel(model_path, threads)
    out = eval_record_path(model_path, split_tag(split))
    check_creatable_dir(out.parent, "eval output folder", "write access to the model file's folder")
    log.info("evaluating %s (LiteRT, %d thread(s), input %dx%d) on %s", model_path, threads, model.height,
             model.width, split)
    if cfg.data.task != "semantic":
        record, scores = evaluate_masks_file(cfg, model, split, progress)
        write_json(out, record)
        print(scores.table())
        print(f"{record['num_images']} images, {model.path.name} ({record['quantization'] or 'tflite'}, "
              f"{model.size_bytes / 1e6:.2f} MB): {scores.headline_text()}; LiteRT invoke "
              f"{record['latency_ms']['median']:.1f} ms per image (median, {threads} thread(s)); wrote {out}")
        return record
    record, metrics, names = evaluate_file(cfg, model, split, progress)
    write_json(out, record)
    lat = record["latency_ms"]
    print(format_table(metrics, names))
    print(f"{record['num_images']} images, {model.path.name} ({record['quantization'] or 'tflite'}, "
          f"{model.size_bytes / 1e6:.2f} MB): mIoU {100 * metrics.miou:.2f}%; LiteRT invoke {lat['median']:.1f} ms "
          f"per image (median, {threads} thread(s)); wrote {out}")
    return record


def run_predict_tflite(cfg: Config, model_path: str, inputs, output, threads: int = 1,
                       progress: bool = True, label_ids: bool = False) -> list[Path]:
    """seg-predict --model FILE.tflite: the same PNGs seg-predict writes for a checkpoint."""
    from seg_train.infer.predict import check_output_dir, collect_inputs, raw_ids_of, write_predictions, written_summary

    files = collect_inputs(inputs, label_ids)
    out = check_output_dir(output)
    if cfg.data.task != "semantic":
        import dataclasses

        from seg_train.infer.mask_evaluate import MaskSetup
        from seg_train.infer.predict import check_mask_flags, predict_masks

        check_mask_flags(cfg, label_ids)
        model = TFLiteModel(model_path, threads)
        setup = dataclasses.replace(MaskSetup.of(cfg), crop=(model.height, model.width))
        cfg_crop = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, crop_size=setup.crop))
        return predict_masks(cfg_crop, files, out, model.logits, progress, f"{model_path}, LiteRT")
    raw = raw_ids_of(cfg, label_ids)
    model = TFLiteModel(model_path, threads)
    written = write_predictions(files, out, model.classes, progress, raw)
    print(f"wrote {written_summary(cfg, len(written), raw)} to {out} ({model_path}, LiteRT)")
    return written

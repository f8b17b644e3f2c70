"""seg-predict: class-index PNGs and colour overlays for whole images.

Each image is predicted at its own size with the inference modes of eval.* (modes.py). Per input
`<name>.<ext>`: `<name>.png`, a palette PNG of class indices (VOC colours), and `<name>_overlay.jpg`.
With --label-ids instead one 8-bit PNG of the data set's raw label values (labels.raw_ids), named as
the official evaluators look for them. The model runs through serving.serving_module, so predictions
agree with the exported SavedModel and with evaluation.

Inputs whose output names would collide are refused before anything runs. TensorFlow is imported
only inside `run_predict`, so the inputs are checked before its slow start.
"""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path

import numpy as np
from PIL import Image, UnidentifiedImageError

from seg_train.config import Config, ConfigError
from seg_train.data.label_images import save_index_png, voc_colormap
from seg_train.run.rundir import write_atomic
from seg_train.util.progress import progress_bar

log = logging.getLogger("seg_train")

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".tif", ".tiff", ".webp")
OVERLAY_ALPHA = 0.5


def _check_image(path: Path) -> None:
    """Raises ConfigError unless Pillow can identify `path` as an image (reads the header only)."""
    try:
        with Image.open(path):
            pass
    except (UnidentifiedImageError, OSError, SyntaxError) as e:
        raise ConfigError("unreadable image", str(path), f"expected a JPEG/PNG image ({e})") from None


# Cityscapes' evaluator matches predictions by `<city>_<seq>_<frame>*.png` and stops at a second match.
CITYSCAPES_IMAGE_SUFFIX = "_leftImg8bit"


def label_ids_name(image: Path) -> str:
    """The --label-ids PNG's name: `<city>_<seq>_<frame>_labelIds.png` for Cityscapes, else `<name>.png`."""
    stem = image.stem
    if stem.endswith(CITYSCAPES_IMAGE_SUFFIX):
        return stem[:-len(CITYSCAPES_IMAGE_SUFFIX)] + "_labelIds.png"
    return f"{stem}.png"


def _palette_name(image: Path) -> str:
    return f"{image.stem}.png"


def collect_inputs(paths, label_ids: bool = False) -> list[Path]:
    """Image files from files and folders (folders: images one level deep, sorted), checked.

    `label_ids`: the names checked for collisions are --label-ids' (label_ids_name).

    Raises:
      ConfigError: a path that does not exist, a folder without images, an unreadable image, or
        two inputs that would write the same output names.
    """
    files: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            found = sorted(f for f in p.iterdir() if f.is_file() and f.suffix.lower() in IMAGE_SUFFIXES)
            if not found:
                raise ConfigError("no images in folder", str(p),
                                  f"expected image files ({', '.join(IMAGE_SUFFIXES)}); folders are not searched "
                                  "recursively")
            files += found
        elif p.is_file():
            files.append(p)
        else:
            raise ConfigError("input not found", str(p), "expected an image file or a folder of images")
    name_of = label_ids_name if label_ids else _palette_name
    unique, seen, by_name = [], set(), {}
    for f in files:
        key = f.resolve()
        if key in seen:  # the same file given twice (e.g. a file and its folder): predict it once
            continue
        seen.add(key)
        _check_image(f)
        other = by_name.setdefault(name_of(f), f)
        if other is not f:
            raise ConfigError("output name collision", f"{other} and {f}",
                              f"expected inputs with distinct names: both would write {name_of(f)}; "
                              "rename one or predict them into separate --output folders")
        unique.append(f)
    return unique


def check_output_dir(path: str | os.PathLike) -> Path:
    """The predictions folder: anything but an existing file (created if missing)."""
    out = Path(path)
    if out.exists() and not out.is_dir():
        raise ConfigError("output is a file", str(out), "expected a folder for the predictions (created if missing)")
    from seg_train.util.paths import check_creatable_dir
    check_creatable_dir(out, "output folder", "choose another --output")
    return out


def overlay(image: np.ndarray, classes: np.ndarray, palette: np.ndarray, alpha: float = OVERLAY_ALPHA) -> np.ndarray:
    """uint8 [H, W, 3]: the class colours blended over `image` with weight `alpha`."""
    colours = np.asarray(palette, np.float32)[classes]
    return np.round((1 - alpha) * image.astype(np.float32) + alpha * colours).astype(np.uint8)


def run_predict(cfg: Config, strategy, checkpoint: str, inputs, output: str | os.PathLike,
                progress: bool = True, label_ids: bool = False) -> list[Path]:
    """seg-predict: segments every input image with CKPT_OR_RUN_DIR and writes the PNGs (module doc).

    Returns:
      The class-index (or raw-label-value) PNGs written (one per input image, in input order).
    """
    import tensorflow as tf

    from seg_train.infer.load import load_evaluator

    files = collect_inputs(inputs, label_ids)
    out = check_output_dir(output)
    if cfg.data.task != "semantic":
        check_mask_flags(cfg, label_ids)
    raw = raw_ids_of(cfg, label_ids)
    evaluator, prefix, step = load_evaluator(cfg, strategy, checkpoint)
    # As in seg-eval and seg-export, so predictions match the exported model and the eval numbers.
    evaluator.maybe_reestimate_bn(cfg, progress)
    if cfg.data.task != "semantic":
        return predict_masks(cfg, files, out, evaluator.mask_serving_module(cfg.data.mean, cfg.data.std),
                             progress, f"step {step}, {prefix}")
    module = evaluator.serving_module(cfg.data.mean, cfg.data.std)
    written = write_predictions(files, out, lambda image: module.serve(tf.constant(image))["classes"].numpy(),
                                progress, raw)
    print(f"wrote {written_summary(cfg, len(written), raw)} to {out} (step {step}, {prefix})")
    return written


def check_mask_flags(cfg: Config, label_ids: bool) -> None:
    """--label-ids is semantic segmentation's: refused for data.task panoptic / instance."""
    if label_ids:
        raise ConfigError("not available for this task", "--label-ids",
                          f"no --label-ids with data.task {cfg.data.task}: seg-predict writes COCO's "
                          f"{'panoptic PNG + JSON' if cfg.data.task == 'panoptic' else 'results JSON'} instead")


def predict_masks(cfg: Config, files, out: Path, module, progress: bool, source: str) -> list[Path]:
    """seg-predict for data.task panoptic / instance (infer/mask_predict.py): `module` gives the raw logits of a
    letterboxed image (serving.mask_serving_module, or a .tflite file's `logits`)."""
    from seg_train.data.split import categories_of, class_names_of
    from seg_train.infer.mask_evaluate import MaskSetup
    from seg_train.infer.mask_predict import summary_line, write_mask_predictions

    setup = MaskSetup.of(cfg)
    if hasattr(module, "serve"):
        def logits_of(image):
            result = module.serve(image)
            return result["class_logits"].numpy(), result["mask_logits"].numpy()
    else:
        logits_of = module
    written = write_mask_predictions(files, out, logits_of, setup, categories_of(cfg).ids, class_names_of(cfg),
                                     progress)
    print(f"wrote {summary_line(cfg.data.task, len(files))} to {out} ({source})")
    return written


def raw_ids_of(cfg: Config, label_ids: bool) -> np.ndarray | None:
    """--label-ids: train id -> raw label value (labels.raw_ids); None without it."""
    if not label_ids:
        return None
    from seg_train.data.labels import raw_ids
    return raw_ids(cfg.data)


def written_summary(cfg: Config, n: int, raw: np.ndarray | None) -> str:
    """What the run wrote, for its last line."""
    if raw is None:
        return f"{n} class-index PNG(s) and {n} overlay(s)"
    return f"{n} PNG(s) of the {cfg.data.layout} layout's raw label values (--label-ids)"


def _save_gray_png(path: Path, values: np.ndarray) -> None:
    Image.fromarray(np.ascontiguousarray(values, np.uint8)).save(path, format="PNG")  # 2-D uint8: mode L


def write_predictions(files, out: Path, classes_of, progress: bool = True,
                      raw_ids: np.ndarray | None = None) -> list[Path]:
    """Writes each file's `classes_of(uint8 [h, w, 3])` into `out` as seg-predict does (module doc);
    with `raw_ids` (train id -> raw label value) as raw label values. Returns the PNGs in input order.

    Raises:
      ConfigError: with `raw_ids`, a predicted class that has no raw value.
    """
    palette = voc_colormap()
    out.mkdir(parents=True, exist_ok=True)
    written = []
    with progress_bar(len(files), "predict", enabled=progress) as bar:
        for f in files:
            with Image.open(f) as im:
                image = np.asarray(im.convert("RGB"))
            classes = classes_of(image)
            if raw_ids is not None:
                if classes.size and int(classes.max()) >= len(raw_ids):
                    raise ConfigError("model predicts a class the config does not have", str(f),
                                      f"classes 0..{len(raw_ids) - 1} (data.num_classes: {len(raw_ids)}) to write "
                                      f"as raw label values, got {int(classes.max())}")
                mask_path = out / label_ids_name(f)
                write_atomic(mask_path, functools.partial(_save_gray_png, values=raw_ids[classes]))
            else:
                mask_path = out / _palette_name(f)
                write_atomic(mask_path, functools.partial(save_index_png, label=classes, palette=palette))
                blended = Image.fromarray(overlay(image, classes, palette))
                write_atomic(out / f"{f.stem}_overlay.jpg",
                             functools.partial(blended.save, format="JPEG", quality=90))
            written.append(mask_path)
            bar.update(1)
    return written

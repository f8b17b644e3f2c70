"""Full-resolution evaluation: one confusion matrix over every labelled pixel of a split -> mIoU.

How the pixels are counted (why it looks like this):
- Each tower takes one whole image per step (batch 1): no crop, no resize. ImageReader.eval_dataset
  pads it to a multiple of 32 and pads the label with ignore_label, so the padding is never counted;
  ignore-label pixels are excluded like the padding.
- A step on N towers takes N consecutive images of the split. Towers left without an image in the
  last step get an all-ignore dummy, which counts nothing, so every image is counted exactly once.
- Each tower counts its (label, prediction) pairs with a bincount in int32 (an image has far fewer
  than 2**31 pixels); the counts are summed across towers and steps in int64. Integer sums are
  exact in any order, so any number of towers gives the identical matrix.
- Images differ in size, so the step is traced once for unknown heights and widths (an input
  signature of N plain tensors, dealt to the towers inside the graph); the model resizes with
  tf.image.resize, which takes dynamic sizes (project notes item 14).

Also here: the seg-eval command body (`run_eval`), and the helpers train.py uses for evaluation
during training (`write_eval_summaries`, `keep_best`).
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import re
import sys
import weakref
from pathlib import Path

import tensorflow as tf

from seg_train import checkpoint as ckpt_lib
from seg_train import preflight
from seg_train.config import Config, ConfigError
from seg_train.metrics import SegMetrics, compute_metrics, format_table, metrics_to_json
from seg_train.palette import load_class_names
from seg_train.reader import ImageReader

log = logging.getLogger("seg_train")

# One compiled eval step per Trainer: evaluation during training calls evaluate() many times and
# must not retrace each time. Weak keys, so a dropped Trainer frees its graph.
_EVAL_STEPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


# ---- the evaluation itself ----------------------------------------------------------------------
def _make_eval_step(trainer):
    """A tf.function (N images, N labels; one per tower) -> int64 counts [C * C] summed over the towers."""
    model, strategy = trainer.model, trainer.strategy
    c, ignore = trainer.cfg.data.num_classes, trainer.cfg.data.ignore_label

    def tower(image, label):
        logits = model(image, training=False)
        pred = tf.argmax(logits, axis=-1, output_type=tf.int32)
        label = tf.cast(label, tf.int32)
        # Flat index gt * C + pred, so one bincount counts every (gt, pred) pair; the reader has
        # already refused label values outside [0, C) other than ignore_label.
        pairs = tf.boolean_mask(label * c + pred, tf.not_equal(label, ignore))
        return tf.math.bincount(pairs, minlength=c * c, maxlength=c * c, dtype=tf.int32)

    n = strategy.num_replicas_in_sync
    multiworker = isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy)
    # One trace for all image sizes: n images and n labels of unknown height and width.
    signature = [[tf.TensorSpec([1, None, None, 3], tf.float32)] * n, [tf.TensorSpec([1, None, None], tf.uint8)] * n]

    @tf.function(input_signature=signature)
    def step(images, labels):
        def tower_input(ctx):
            i = ctx.replica_id_in_sync_group
            # tf.identity under the replica's device scope places the sample on that tower.
            return tf.identity(images[i]), tf.identity(labels[i])

        counts = strategy.run(tower, strategy.experimental_distribute_values_from_function(tower_input))
        if multiworker:
            # Each worker holds only its own towers' counts: sum them over the workers too.
            return tf.cast(strategy.reduce(tf.distribute.ReduceOp.SUM, counts, axis=None), tf.int64)
        return tf.add_n([tf.cast(x, tf.int64) for x in strategy.experimental_local_results(counts)])

    return step


def _progress_bar(total: int, desc: str, progress: bool):
    """A tqdm bar on stderr, disabled unless `progress` and stderr is a terminal."""
    from tqdm import tqdm
    return tqdm(total=total, desc=desc, unit="img", dynamic_ncols=True, file=sys.stderr, leave=False,
                disable=not (progress and sys.stderr.isatty()))


def evaluate(trainer, reader: ImageReader, class_names, progress: bool = True) -> tuple[SegMetrics, int]:
    """Evaluates the trainer's model on every image of `reader`'s split at full resolution.

    Args:
      trainer: a `Trainer` (its model in inference mode, its strategy's towers share the images).
      reader: the split to evaluate (`ImageReader`); its data config gives ignore_label.
      class_names: one name per class (checked against the model's number of classes).
      progress: show a tqdm bar on stderr (only when stderr is a terminal).
    Returns:
      (metrics from the summed confusion matrix, number of images evaluated).
    """
    c = trainer.cfg.data.num_classes
    if len(class_names) != c:
        raise ConfigError("wrong number of class names", "data.class_names",
                          f"expected {c} names (data.num_classes), got {len(class_names)}")
    if reader.cfg.ignore_label != trainer.cfg.data.ignore_label:
        raise ValueError("the reader and the trainer disagree on data.ignore_label")
    step = _EVAL_STEPS.get(trainer)
    if step is None:
        step = _EVAL_STEPS[trainer] = _make_eval_step(trainer)
    strategy = trainer.strategy
    n = strategy.num_replicas_in_sync
    dummy = (tf.zeros([1, 32, 32, 3], tf.float32),
             tf.fill([1, 32, 32], tf.constant(reader.cfg.ignore_label, tf.uint8)))  # all ignored
    total = tf.zeros([c * c], tf.int64)
    num_images = 0
    samples = iter(reader.eval_dataset())
    with _progress_bar(len(reader), f"eval {reader.split}", progress) as bar:
        while True:
            group = [(image, label) for image, label, _ in itertools.islice(samples, n)]
            if not group:
                break
            real = len(group)
            group += [dummy] * (n - real)  # towers without an image count nothing
            images, labels = zip(*group)
            total += step(list(images), list(labels))
            num_images += real
            bar.update(real)
    cm = total.numpy().reshape(c, c)
    if not cm.any():
        raise ConfigError("no labelled pixels", f"split {reader.split}",
                          f"expected pixels whose label is not data.ignore_label ({reader.cfg.ignore_label})")
    return compute_metrics(cm), num_images


# ---- loading a checkpoint for eval / predict / export ---------------------------------------------
def class_names_of(cfg: Config) -> list[str]:
    """data.class_names, else classes.txt in the data root, else class_0..class_{C-1}."""
    try:
        return load_class_names(cfg.data.root, cfg.data.num_classes, cfg.data.class_names)
    except ValueError as e:
        where = "data.class_names" if cfg.data.class_names is not None else str(Path(cfg.data.root) / "classes.txt")
        raise ConfigError("wrong class names", where, str(e)) from None


def ensure_data(cfg: Config) -> None:
    """Generates the synthetic demo data set at data.root if the config asks for it."""
    if cfg.data.synthetic:
        from seg_train import demo_data
        preflight.check_synthetic_data(cfg)  # a clear error for a folder that is in the way or read-only
        try:
            demo_data.generate(cfg.data.root, num_classes=cfg.data.num_classes, seed=0)
        except OSError as e:  # e.g. the disk filled up while writing
            raise ConfigError("cannot generate the synthetic data set", str(cfg.data.root),
                              f"a folder with room to write it ({e.strerror or e})") from None


def run_dir_of(prefix: str) -> Path:
    """RUN_DIR of a checkpoint prefix RUN_DIR/checkpoints/ckpt-K (or RUN_DIR/best/ckpt-K)."""
    folder = Path(prefix).parent
    return folder.parent if folder.name in ("checkpoints", "best") else folder


def _mismatch(e: Exception) -> str:
    """A short description of a failed restore: the variable and both shapes if Keras names them."""
    text = str(e).strip()
    m = re.search(r"variable\.shape=(\([^)]*\)), Received: value\.shape=(\([^)]*\)).*?path=([^,]+)", text, re.DOTALL)
    if m:
        return f"{m.group(3)} has shape {m.group(1)} in this model, {m.group(2)} in the checkpoint"
    return text.splitlines()[0][:300] if text else type(e).__name__


def load_trainer(cfg: Config, strategy: tf.distribute.Strategy, checkpoint: str):
    """Builds a Trainer for `cfg` and loads the weights of CKPT_OR_RUN_DIR into it.

    Returns:
      (trainer, checkpoint prefix, the checkpoint's step).
    """
    from seg_train.trainer import Trainer  # here, not at the top: train.py imports this module

    prefix = os.path.abspath(ckpt_lib.resolve(checkpoint))
    trainer = Trainer(cfg, strategy)
    try:
        step = trainer.restore_weights(prefix)
    except (AssertionError, ValueError, tf.errors.OpError) as e:
        # A checkpoint of another model (backbone, channels, num_classes) fails here.
        raise ConfigError("checkpoint does not fit the model", prefix,
                          f"expected a checkpoint of the model this config builds (model.*, data.num_classes): "
                          f"{_mismatch(e)}") from None
    return trainer, prefix, step


def maybe_reestimate_bn(trainer, cfg: Config, progress: bool = True) -> bool:
    """Re-estimates the BN statistics if eval.bn_reestimate_batches > 0.

    Returns:
      Whether the BN statistics match the weights (re-estimated now or before the checkpoint).
    """
    if cfg.eval.bn_reestimate_batches > 0 and int(trainer.bn_stats_step.numpy()) != int(trainer.step.numpy()):
        from seg_train import bn_stats
        from seg_train.reader import split_file
        ensure_data(cfg)  # the re-estimation reads the training split
        if not split_file(cfg.data.root, cfg.data.train_split).is_file():
            # Predicting or exporting where the training data is not at hand: go on with the
            # statistics as trained, and say so.
            log.warning("BN statistics not re-estimated: training split %r not found under %s "
                        "(eval.bn_reestimate_batches needs it)", cfg.data.train_split, cfg.data.root)
            return False
        train_reader = ImageReader(cfg.data, cfg.data.train_split, cfg.seed)
        bn_stats.reestimate(trainer, train_reader, cfg.eval.bn_reestimate_batches, progress=progress)
    return int(trainer.bn_stats_step.numpy()) == int(trainer.step.numpy())


def write_json(path: Path, obj) -> None:
    """Writes the dict `obj` as JSON atomically (temp file + os.replace): readers never see half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    # One top-level key per line, each value compact: a confusion matrix stays a few lines long.
    body = ",\n".join(f" {json.dumps(str(k))}: {json.dumps(v)}" for k, v in obj.items())
    tmp.write_text("{\n" + body + "\n}\n")
    os.replace(tmp, path)


def _split_tag(split: str) -> str:
    """File-name tag of a split: the name itself, or a list file's stem."""
    return Path(split).stem if ("/" in split or os.sep in split or split.endswith(".txt")) else split


def run_eval(cfg: Config, strategy: tf.distribute.Strategy, checkpoint: str, split: str | None = None,
             progress: bool = True) -> dict:
    """seg-eval: evaluates a checkpoint on a split, prints the table, writes RUN_DIR/eval/<split>-step<k>.json.

    Returns:
      The JSON record that was written.
    """
    split = split or cfg.data.val_split
    # The JSON goes next to the checkpoint's run dir: check it can be written before the work.
    out_dir = run_dir_of(os.path.abspath(ckpt_lib.resolve(checkpoint))) / "eval"
    preflight.check_creatable_dir(out_dir, "eval output folder", "write access to the checkpoint's run dir")
    ensure_data(cfg)
    reader = ImageReader(cfg.data, split, cfg.seed)
    names = class_names_of(cfg)
    trainer, prefix, step = load_trainer(cfg, strategy, checkpoint)
    reestimated = maybe_reestimate_bn(trainer, cfg, progress)
    if not reestimated:
        log.info("BN moving statistics as saved (not re-estimated for step %d; see eval.bn_reestimate_batches)",
                 step)
    log.info("evaluating %s (step %d) on %d %s images, %d tower(s)", prefix, step, len(reader), split,
             strategy.num_replicas_in_sync)
    metrics, num_images = evaluate(trainer, reader, names, progress)
    record = {"split": split, "checkpoint": prefix, "step": step, "num_images": num_images,
              "bn_stats_reestimated": reestimated, **metrics_to_json(metrics, names)}
    path = out_dir / f"{_split_tag(split)}-step{step}.json"
    write_json(path, record)
    print(format_table(metrics, names))
    print(f"{num_images} images, step {step}: mIoU {100 * metrics.miou:.2f}%; wrote {path}")
    return record


# ---- evaluation during training -------------------------------------------------------------------
def write_eval_summaries(writer, step: int, metrics: SegMetrics, class_names) -> None:
    """TensorBoard scalars eval/miou, eval/pixel_accuracy, eval/mean_class_accuracy, eval/iou/<class>.

    Args:
      writer: a tf.summary writer (e.g. `Summaries.writer`).
      step: the training step.
      metrics: from `evaluate`.
      class_names: one name per class; classes with an undefined IoU (empty union) are left out.
    """
    with writer.as_default(step=step):
        tf.summary.scalar("eval/miou", metrics.miou)
        tf.summary.scalar("eval/pixel_accuracy", metrics.pixel_accuracy)
        tf.summary.scalar("eval/mean_class_accuracy", metrics.mean_class_accuracy)
        for name, iou in zip(class_names, metrics.per_class_iou):
            if iou is not None:
                tf.summary.scalar(f"eval/iou/{name}", iou)
    writer.flush()


BEST_DIR, BEST_JSON = "best", "best.json"


def read_best(run_dir: Path) -> dict | None:
    """RUN_DIR/best/best.json ({'step', 'miou', 'checkpoint'}), or None if there is no best yet."""
    path = Path(run_dir) / BEST_DIR / BEST_JSON
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None


def keep_best(run_dir: Path, trainer, step: int, metrics: SegMetrics) -> bool:
    """Saves the weights under RUN_DIR/best/ if mIoU beats the best so far.

    The checkpoint (model, step, bn_stats_step; no optimizer) is written first (CheckpointManager:
    data files, then its state file, then the previous best is deleted), then best.json through
    best.tmp + os.replace. A crash in between leaves the better checkpoint with the older best.json,
    never a half-written file. `checkpoint.resolve(RUN_DIR/best)` and `Trainer.restore_weights` read
    it back. `step` names the checkpoint; the step saved inside it is trainer.step (the same value
    during training).

    Returns:
      True if mIoU improved and the checkpoint was written.
    """
    best_dir = Path(run_dir) / BEST_DIR
    best = read_best(run_dir)
    if best is not None and not metrics.miou > best["miou"]:
        return False
    ckpt = tf.train.Checkpoint(model=trainer.model, step=trainer.step, bn_stats_step=trainer.bn_stats_step)
    manager = tf.train.CheckpointManager(ckpt, str(best_dir), max_to_keep=1)
    prefix = manager.save(checkpoint_number=step)
    tmp = best_dir / "best.tmp"
    tmp.write_text(json.dumps({"step": int(step), "miou": metrics.miou,
                               "pixel_accuracy": metrics.pixel_accuracy,
                               "checkpoint": Path(prefix).name}, indent=1) + "\n")
    os.replace(tmp, best_dir / BEST_JSON)
    return True

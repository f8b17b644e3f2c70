"""Panoptic and instance evaluation (data.task panoptic / instance): EoMT's final class and mask logits through
mask_postprocess.py, scored per image into panoptic_metrics.PanopticState or instance_metrics.InstanceState.

As the EoMT authors evaluate these tasks: each image resized with Pillow's BILINEAR so that its long side fits
the crop (data.crop_size, the training crop; mask_postprocess.scaled_size), padded at the bottom and right with
black to the crop (`letterbox`), one forward pass, the mask logits of the padded crop resized back to the image
(mask_postprocess.resize_mask_logits) for the kept queries only. The same letterbox runs in front of seg-predict,
the exported SavedModel's and TFLite file's callers and seg-eval --model, so all of them score what seg-eval scores.

Ground truth from the segment labels (data/segments.py's to_panoptic, to_instances): a segment per value (crowd
regions, instance 999, are crowd segments of their class: one per class, as COCO's panoptic files hold them);
unlabelled pixels (class data.ignore_label) are VOID. Panoptic: every segment (thing instances, stuff regions,
crowds), things and stuff per the data's categories (data/split.py categories_of). Instance: the thing classes'
instances and crowd regions (iscrowd); stuff pixels are no ground truth.

Over the towers: each tower predicts one image per step (all of one shape, the crop); the host post-processes the
images of its own towers and adds their states. Over the workers of a multi-worker run: the PQ states summed, the
AP states (a list of detections per image, of any length) concatenated, both through SUM all-reduces of the
strategy (`combine_over_workers`). States only add, so any number of towers and workers gives the same numbers
(the AP state sorts its detections by image id, the sample's index in the split).
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field

import numpy as np
from PIL import Image

from seg_train.data import segments
from seg_train.infer import mask_postprocess as post
from seg_train.infer.instance_metrics import InstanceState, instance_image_state, instance_summary
from seg_train.infer.panoptic_metrics import PanopticState, panoptic_image_state, panoptic_summary

log = logging.getLogger("seg_train")

TASKS = ("panoptic", "instance")
HEADLINE = {"semantic": "miou", "panoptic": "pq", "instance": "ap"}  # what best/ follows, per task
NUM_EXAMPLES = 4  # val images shown in eval/examples
LETTERBOX = ("the image letterboxed to the input size (Pillow BILINEAR so that its long side fits, padded with 0 "
             "below and right; infer/mask_evaluate.py), the mask logits of the kept queries resized back "
             "(infer/mask_postprocess.py)")  # what exported files' callers do, as FILE.json and records say


@dataclass(frozen=True)
class MaskSetup:
    """What the panoptic and instance inference takes from a config (`of`)."""

    task: str
    num_classes: int
    ignore_label: int
    is_thing: np.ndarray  # bool [K]; all True for the instance task
    crop: tuple[int, int]  # the letterbox: data.crop_size
    mean: np.ndarray
    std: np.ndarray
    mask_thresh: float
    overlap_thresh: float

    @classmethod
    def of(cls, cfg, eval_cfg=None) -> MaskSetup:
        """From `cfg` (its data keys; the things from data/split.py's categories_of) and `eval_cfg` (default
        cfg.eval: the post-processing thresholds)."""
        from seg_train.data.split import categories_of

        d, e = cfg.data, eval_cfg or cfg.eval
        if d.task not in TASKS:
            raise ValueError(f"MaskSetup: data.task {d.task!r} is not one of {TASKS}")
        is_thing = np.asarray(categories_of(cfg).is_thing, bool)
        return cls(d.task, d.num_classes, d.ignore_label, is_thing, tuple(int(v) for v in d.crop_size),
                   np.asarray(d.mean, np.float32), np.asarray(d.std, np.float32), e.mask_thresh, e.overlap_thresh)

    def normalize(self, image: np.ndarray) -> np.ndarray:
        """uint8 [..., 3] -> float32 (x - mean) / std (ImageReader.normalize's arithmetic)."""
        return (image.astype(np.float32) - self.mean) / self.std


def letterbox(image: np.ndarray, crop) -> np.ndarray:
    """uint8 [H, W, 3] -> uint8 [crop_h, crop_w, 3]: resized with Pillow's BILINEAR to
    mask_postprocess.scaled_size (the long side fills the crop), padded with 0 at the bottom and right."""
    h, w = image.shape[:2]
    sh, sw = post.scaled_size((h, w), crop)
    if (sh, sw) != (h, w):
        image = np.asarray(Image.fromarray(np.ascontiguousarray(image, np.uint8)).resize((sw, sh), Image.BILINEAR))
    out = np.zeros((int(crop[0]), int(crop[1]), 3), np.uint8)
    out[:sh, :sw] = image
    return out


def image_state(setup: MaskSetup, image_id: int, class_logits, mask_logits, label):
    """(state, prediction) of one image: its class logits [Q, K + 1] and the padded crop's mask logits [Q, h, w]
    post-processed at the label's size and scored against the segment labels' ground truth (data/segments.py's
    to_panoptic, to_instances: the things per is_thing)."""
    size = np.shape(label)
    if setup.task == "panoptic":
        pred = post.panoptic_prediction(class_logits, mask_logits, setup.is_thing, mask_thresh=setup.mask_thresh,
                                        overlap_thresh=setup.overlap_thresh, image_size=size, crop_size=setup.crop)
        gt_ids, gt_segments = segments.to_panoptic(label, setup.ignore_label)
        state = panoptic_image_state(gt_ids, gt_segments, pred.segment_ids, pred.segments, setup.num_classes)
        return state, pred
    pred = post.instance_prediction(class_logits, mask_logits, image_size=size, crop_size=setup.crop)
    masks, labels, crowd = segments.to_instances(label, setup.ignore_label, np.flatnonzero(setup.is_thing))
    state = instance_image_state(image_id, pred.masks, pred.scores, pred.labels, masks, labels, setup.num_classes,
                                 gt_crowd=crowd)
    return state, pred


def empty_state(setup: MaskSetup):
    return (PanopticState if setup.task == "panoptic" else InstanceState).zeros(setup.num_classes)


# ---- the report ---------------------------------------------------------------------------------------------------
@dataclass
class MaskScores:
    """An evaluation's result for data.task panoptic or instance. `summary`: panoptic_metrics.panoptic_summary's or
    instance_metrics.instance_summary's dict (fractions, None where undefined); `headline`: the key best/ follows
    (pq, ap) and `value` its value; `examples`: (image, ground truth, prediction) pictures of the first images."""

    task: str
    state: object
    summary: dict
    examples: list = field(default_factory=list, repr=False)

    @property
    def headline(self) -> str:
        return HEADLINE[self.task]

    @property
    def value(self) -> float | None:
        return self.summary[self.headline]

    def to_json(self) -> dict:
        """The JSON record's metrics: the summary's keys (README names them)."""
        return {"task": self.task, **self.summary}

    def scalars(self) -> dict:
        """TensorBoard's eval/* scalars (None values left out): eval/pq, eval/sq, eval/rq (and _things, _stuff),
        eval/pq/<class>; or eval/ap, eval/ap50, eval/ap75, eval/ap_small .. eval/ar_large, eval/ap/<class>."""
        out = {f"eval/{k}": v for k, v in self.summary.items() if not k.startswith("per_class") and k[0] != "n"
               and v is not None}
        if self.task == "panoptic":
            out.update({f"eval/pq/{name}": r["pq"] for name, r in self.summary["per_class"].items()
                        if r["tp"] + r["fp"] + r["fn"]})
        else:
            out.update({f"eval/ap/{name}": v for name, v in self.summary["per_class_ap"].items() if v is not None})
        return out

    def headline_text(self) -> str:
        """'PQ 51.60 (things 55.00, stuff 46.50)' or 'mask AP 45.20 (AP50 .., AP75 ..)'."""
        s = self.summary

        def pct(v):
            return "-" if v is None else f"{100 * v:.2f}"

        if self.task == "panoptic":
            return f"PQ {pct(s['pq'])} (things {pct(s['pq_things'])}, stuff {pct(s['pq_stuff'])})"
        return f"mask AP {pct(s['ap'])} (AP50 {pct(s['ap50'])}, AP75 {pct(s['ap75'])})"

    def table(self) -> str:
        """Per-class rows and the summary lines, percentages ('-' undefined)."""
        s = self.summary

        def pct(v):
            return "-" if v is None else f"{100 * v:.2f}"

        if self.task == "panoptic":
            names = list(s["per_class"])
            w = max(len("Class"), *(len(n) for n in names))
            lines = [f"{'Class':<{w}}  {'PQ':>6}  {'SQ':>6}  {'RQ':>6}  {'TP':>5}  {'FP':>5}  {'FN':>5}"]
            for name, r in s["per_class"].items():
                lines.append(f"{name:<{w}}  {pct(r['pq']):>6}  {pct(r['sq']):>6}  {pct(r['rq']):>6}  {r['tp']:>5}  "
                             f"{r['fp']:>5}  {r['fn']:>5}")
            for group in ("", "_things", "_stuff"):
                lines.append(f"{('all' if not group else group[1:]) + ':':<8} PQ {pct(s['pq' + group]):>6}  "
                             f"SQ {pct(s['sq' + group]):>6}  RQ {pct(s['rq' + group]):>6}  ({s['n' + group]} classes)")
            return "\n".join(lines)
        names = list(s["per_class_ap"])
        w = max(len("Class"), *(len(n) for n in names))
        lines = [f"{'Class':<{w}}  {'AP':>6}"] + [f"{n:<{w}}  {pct(v):>6}" for n, v in s["per_class_ap"].items()]
        lines.append("  ".join(f"{k.upper() if k != 'ap' else 'AP'} {pct(s[k])}" for k in
                               ("ap", "ap50", "ap75", "ap_small", "ap_medium", "ap_large")))
        return "\n".join(lines)


def summarize(setup: MaskSetup, state, class_names) -> MaskScores:
    """The report of a (combined) state."""
    names = [str(n) for n in class_names]
    if setup.task == "panoptic":
        return MaskScores("panoptic", state, panoptic_summary(state, setup.is_thing, names))
    return MaskScores("instance", state, instance_summary(state, names))


# ---- over workers ---------------------------------------------------------------------------------------------
def _worker(strategy) -> tuple[int, int]:
    """(this worker's index, number of workers) of `strategy`."""
    import tensorflow as tf

    if isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
        resolver = strategy.cluster_resolver
        return int(resolver.task_id or 0), strategy.num_replicas_in_sync // len(strategy.extended.worker_devices)
    return 0, 1


def _sum_over_workers(strategy, arrays: list[np.ndarray]) -> list[np.ndarray]:
    """float64 arrays summed over the workers: each worker's on its first tower, zeros on the others, one
    SUM all-reduce."""
    import tensorflow as tf

    local = len(strategy.extended.worker_devices)
    worker, _ = _worker(strategy)
    first = worker * local

    def value(ctx):
        mine = ctx.replica_id_in_sync_group == first
        return [tf.constant(a if mine else np.zeros_like(a), tf.float64) for a in arrays]

    per_replica = strategy.experimental_distribute_values_from_function(value)
    return [t.numpy() for t in strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica, axis=None)]


def combine_over_workers(strategy, state):
    """The state of every worker's images (module doc); `state` itself with one worker."""
    worker, workers = _worker(strategy)
    if workers == 1:
        return state
    arrays = state.as_arrays()
    if isinstance(state, PanopticState):
        summed = _sum_over_workers(strategy, [arrays[k] for k in ("iou", "tp", "fp", "fn")])
        return PanopticState.from_arrays(dict(zip(("iou", "tp", "fp", "fn"), summed)))
    # Detections: worker w's rows at its offset of one buffer per field, zeros elsewhere; summed = concatenated.
    n = len(arrays["score"])
    lengths = _sum_over_workers(strategy, [np.eye(workers)[worker] * n])[0].astype(np.int64)
    offset, total = int(lengths[:worker].sum()), int(lengths.sum())
    out = {"npig": _sum_over_workers(strategy, [arrays["npig"].astype(np.float64)])[0]}
    for key in ("image", "category", "rank", "score", "matched", "ignored"):
        buffer = np.zeros((total,) + arrays[key].shape[1:], np.float64)
        buffer[offset:offset + n] = arrays[key]
        out[key] = _sum_over_workers(strategy, [buffer])[0]
    return InstanceState.from_arrays(out)


# ---- the evaluation over the towers ---------------------------------------------------------------------------
def make_step(state, crop):
    """A tf.function (N images float32 [1, crop_h, crop_w, 3], one per tower) -> per tower (class logits [Q, K + 1],
    mask logits [Q, h, w]) of the model's final prediction, unmasked."""
    import keras
    import tensorflow as tf

    from seg_train.parallel.towers import TowerPass

    model, strategy = state.model, state.strategy
    n = strategy.num_replicas_in_sync
    spec = tf.TensorSpec([1, int(crop[0]), int(crop[1]), 3], tf.float32)

    def body(tv, st, image):
        mapping = list(zip(model.trainable_variables, tv)) + list(zip(model.non_trainable_variables, st))
        with keras.StatelessScope(state_mapping=mapping):
            class_logits, mask_logits = model.predictions(image, training=False)[-1]
        return class_logits[0], mask_logits[0]

    @tf.function(input_signature=[[spec] * n], autograph=False)
    def step(images):
        def tower_input(ctx):
            return tf.identity(images[ctx.replica_id_in_sync_group])

        tower = TowerPass(body, model.trainable_variables, model.non_trainable_variables).trace(spec)
        return strategy.run(tower, (strategy.experimental_distribute_values_from_function(tower_input),))

    return step


def samples(reader):
    """(uint8 image [H, W, 3], label [H, W], index) of every image of `reader`'s split, in order, at full size."""
    import tensorflow as tf

    from seg_train.data.feed import Feed

    ds = tf.data.Dataset.range(len(reader)).map(lambda i: (*reader.decode(i), i), num_parallel_calls=2,
                                                deterministic=True).prefetch(2)
    return Feed(ds)


def evaluate(state, step, reader, setup: MaskSetup, class_names, progress: bool = True,
             num_examples: int = NUM_EXAMPLES) -> tuple[MaskScores, int]:
    """Every image of `reader`'s split through `step` (make_step's), scored (module doc): (scores, images)."""
    from seg_train.infer.mask_pictures import example_panels
    from seg_train.util.progress import progress_bar

    strategy = state.strategy
    n = strategy.num_replicas_in_sync
    local = len(strategy.extended.worker_devices)
    worker, _ = _worker(strategy)
    mine = range(worker * local, worker * local + local)  # the towers this worker's host reads
    total = empty_state(setup)
    dummy = np.zeros((1, *setup.crop, 3), np.float32)
    examples, num_images = [], 0
    feed = samples(reader)
    try:
        with progress_bar(len(reader), f"eval {reader.split}", enabled=progress) as bar:
            while True:
                group = [(im.numpy(), lb.numpy(), int(i)) for im, lb, i in itertools.islice(feed, n)]
                if not group:
                    break
                inputs = [setup.normalize(letterbox(image, setup.crop))[None] for image, _, _ in group]
                inputs += [dummy] * (n - len(group))
                out = strategy.experimental_local_results(step(inputs))
                for j, tower in enumerate(mine):
                    if tower >= len(group):
                        continue
                    image, label, index = group[tower]
                    class_logits, mask_logits = (t.numpy() for t in out[j])
                    one, pred = image_state(setup, index, class_logits, mask_logits, label)
                    total = total + one
                    if index < num_examples:
                        examples.append((index, example_panels(image, label, pred, setup)))
                num_images += len(group)
                bar.update(len(group))
    finally:
        feed.close()
    scores = summarize(setup, combine_over_workers(strategy, total), class_names)
    scores.examples = [p for _, p in sorted(examples, key=lambda e: e[0])]
    return scores, num_images


def evaluate_host(reader, setup: MaskSetup, logits_of, class_names, progress: bool = True) -> tuple[MaskScores, int]:
    """Every image of `reader`'s split scored with `logits_of(uint8 letterboxed image)` -> (class logits, mask
    logits) run on the host, one image at a time (a .tflite file in LiteRT): (scores, images)."""
    from seg_train.util.progress import progress_bar

    total, num_images = empty_state(setup), 0
    feed = samples(reader)
    try:
        with progress_bar(len(reader), f"eval {reader.split}", enabled=progress) as bar:
            for image, label, index in feed:
                class_logits, mask_logits = logits_of(letterbox(image.numpy(), setup.crop))
                total = total + image_state(setup, int(index), class_logits, mask_logits, label.numpy())[0]
                num_images += 1
                bar.update(1)
    finally:
        feed.close()
    return summarize(setup, total, class_names), num_images

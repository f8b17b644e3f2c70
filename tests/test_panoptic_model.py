"""The panoptic and instance tasks on the model side (data.task panoptic / instance): the train step on segment
labels over towers, resume, evaluation, prediction and export, as a user runs them.

Outside references: cityscapesscripts' panoptic evaluator (panopticapi's pq_compute) on the synthetic set's own COCO
panoptic files and seg-predict's PNG + JSON; pycocotools' COCOeval(iouType="segm") on seg-predict's results JSON
against COCO instance annotations written here from the same files; Pillow for the letterbox; the exported files
loaded without seg_train (tf.saved_model.load, LiteRT). Where no outside reference exists (towers, resume), the
same numbers from 1 and 4 towers, and from a run killed and resumed.

The runs: EoMT (2 EoMT blocks, 8 queries) on dinov3_vits16, tests/helpers.py's TINY_VITS16 in its place (the
`tiny_vits16` fixture: its structure at 4 blocks of width 32), on the synthetic panoptic demo set (data/
synthetic_panoptic.py: 4 classes, things and stuff, crowds, unlabelled bands) at 40 x 56, 48 x 48 crops.
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import numpy as np
import pytest
import yaml
from PIL import Image

from seg_train import cli
from seg_train.config import ConfigError, from_dict, load
from seg_train.config.resolve import annealing_windows, check_trainable
from seg_train.data import synthetic_panoptic
from seg_train.infer import mask_evaluate
from seg_train.infer.mask_postprocess import scaled_size
from seg_train.run import checkpoint as ckpt_lib

official = pytest.importorskip("cityscapesscripts.evaluation.evalPanopticSemanticLabeling")
pytest.importorskip("pycocotools")
from pycocotools import mask as mask_util  # noqa: E402
from pycocotools.coco import COCO  # noqa: E402
from pycocotools.cocoeval import COCOeval  # noqa: E402

# dinov3_vits16 is tests/helpers.py's TINY_VITS16 throughout the module (conftest.py's `tiny_vits16`).
pytestmark = pytest.mark.usefixtures("tiny_vits16")

K = 4
QUIET = ["--set", "eval.bn_reestimate_batches=0"]
# Post-processing that keeps an untrained model's queries, so the files hold segments to score.
LOOSE = ["--set", "eval.mask_thresh=0.0", "--set", "eval.overlap_thresh=0.3"]


def _raw(root, **train):
    return {"seed": 0, "run_dir": "run",
            "data": {"root": str(root), "task": "panoptic", "layout": "coco_panoptic", "num_classes": K,
                     "batch_size": 4, "crop_size": [48, 48], "num_parallel_calls": 2},
            "model": {"backbone": "dinov3_vits16", "head": "eomt", "eomt_blocks": 2, "num_queries": 8,
                      "drop_path_rate": 0.2},
            "train": {"num_steps": 2, "optimizer": "adamw", "learning_rate": 1e-4, "checkpoint_every": 2,
                      "summary_every": 1, "image_summary_every": 1, **train},
            "loss": {"mask_points": 64}, "eval": {"bn_reestimate_batches": 0}}


def _run(main, argv):
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        rc = main(argv)
    assert rc == 0, out.getvalue()[-3000:]
    return out.getvalue()


@pytest.fixture(scope="module")
def panoptic_run(tmp_path_factory, tiny_vits16):
    """seg-train on 2 towers, 2 steps, evaluated at the end; (folder, config path)."""
    base = tmp_path_factory.mktemp("panoptic")
    root = synthetic_panoptic.generate(base / "data", num_train=8, num_val=3, size=(40, 56), num_classes=K)
    path = base / "cfg.yaml"
    path.write_text(yaml.safe_dump(_raw(root)))
    _run(cli.train_main, ["--config", str(path), "--gpus", "2"])
    return base, path


# ---- fast -----------------------------------------------------------------------------------------------------
def test_letterbox_is_pillows_resize_and_a_black_pad():
    """The image resized with Pillow's BILINEAR to round(side x min(crop / size)) and padded with 0 below and to
    the right (the EoMT authors' resize_and_pad_imgs_instance_panoptic). Fails for TensorFlow's resize (no
    antialiasing), the pad on the top or left, the mean colour as padding, the long side not filling the crop."""
    rng = np.random.default_rng(0)
    image = rng.integers(0, 256, (100, 103, 3), np.uint8)
    out = mask_evaluate.letterbox(image, (64, 80))
    h, w = round(100 * min(64 / 100, 80 / 103)), round(103 * min(64 / 100, 80 / 103))
    assert (h, w) == scaled_size((100, 103), (64, 80)) == (64, 66)
    want = np.zeros((64, 80, 3), np.uint8)
    want[:h, :w] = np.asarray(Image.fromarray(image).resize((w, h), Image.BILINEAR))
    np.testing.assert_array_equal(out, want)


class _Scores:
    def __init__(self, headline, value):
        self.headline, self.value = headline, value


def test_best_follows_the_tasks_headline(tmp_path):
    """keep_best with panoptic / instance scores keeps the checkpoint of the highest PQ (AP), best.json naming
    it. Fails for best/ still following mIoU (an attribute a MaskScores has not), a lower value replacing a
    higher one."""
    from seg_train.run.state import TrainState
    from tests.helpers import strategy, tiny_config

    state = TrainState(tiny_config(tmp_path), strategy(1), optimizer=False)
    for step, pq, improved in ((1, 0.2, True), (2, 0.1, False), (3, 0.3, True)):
        assert ckpt_lib.keep_best(tmp_path, state, step, _Scores("pq", pq)) is improved
    best = ckpt_lib.read_best(tmp_path)
    assert best["step"] == 3 and best["pq"] == 0.3 and "miou" not in best


@pytest.mark.parametrize("key, value", [("eval.flip", True), ("eval.scales", [1.0, 1.5]), ("eval.mode", "slide"),
                                        ("eval.logit_adjustment", 1.0)])
def test_inference_modes_refused_for_mask_tasks(tmp_path, key, value):
    """The panoptic evaluation is the reference's one letterboxed pass: flips, scales, windows and the logit
    adjustment are refused in one line naming the key."""
    raw = _raw(tmp_path / "data")
    section, name = key.split(".")
    raw[section][name] = value
    if key == "eval.mode":
        raw["eval"]["crop_size"] = [48, 48]
    with pytest.raises(ConfigError) as err:
        from_dict(raw)
    assert key in str(err.value) and "\n" not in str(err.value)


def test_fewer_queries_than_classes_allowed_for_segments(tmp_path):
    """Training semantic EoMT needs a query per class; the segment tasks need a query per segment of an image,
    whatever K. Fails for the semantic check applied to panoptic configs."""
    raw = _raw(tmp_path / "data")
    raw["model"]["num_queries"] = 3
    check_trainable(from_dict(raw))
    raw["data"] = {"root": "x", "num_classes": 4, "crop_size": [48, 48]}
    with pytest.raises(ConfigError, match="model.num_queries"):
        check_trainable(from_dict(raw))


# ---- a run ------------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_training_logs_pq_and_best_follows_it(panoptic_run):
    """The run's evaluation writes eval/pq, eval/pq_things, eval/pq_stuff, eval/sq, eval/rq (TensorBoard), best/
    holds the PQ it logged, and the triplets and eval/examples are pictures of segments. Fails for the semantic
    evaluation run on segment labels, best/ following mIoU, the summaries dropped."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    base, _ = panoptic_run
    acc = EventAccumulator(str(base / "run"), size_guidance={"tensors": 0, "images": 0})
    acc.Reload()
    tags = set(acc.Tags()["tensors"])
    for tag in ("eval/pq", "eval/pq_things", "eval/pq_stuff", "eval/sq", "eval/rq", "eval/rq_stuff"):
        assert tag in tags, sorted(tags)
    assert not any(t.startswith("eval/miou") for t in tags)
    logged = float(np.asarray(tf_value(acc.Tensors("eval/pq")[-1])))
    assert ckpt_lib.read_best(base / "run")["pq"] == pytest.approx(logged, abs=1e-7)
    assert {"tower_0/triplet", "tower_1/triplet", "eval/examples"} <= tags


def tf_value(event):
    import tensorflow as tf

    return tf.make_ndarray(event.tensor_proto)


def _coco_gt(root: Path, split="val"):
    return json.loads((root / "annotations" / f"panoptic_{split}.json").read_text()), \
        root / "annotations" / f"panoptic_{split}"


@pytest.mark.slow
def test_seg_eval_pq_is_the_official_evaluators_on_seg_predicts_files(panoptic_run):
    """seg-predict's COCO panoptic PNGs + JSON scored by cityscapesscripts' evaluator (panopticapi's pq_compute)
    against the data set's own COCO panoptic files give seg-eval's per-class TP / FP / FN and PQ / SQ / RQ (all,
    things, stuff), with eval.mask_thresh and eval.overlap_thresh set. Fails for evaluation and prediction
    letterboxing differently, category ids not mapped back, crowd or unlabelled ground truth read otherwise than
    the evaluator reads it, the thresholds dropped on one of the two paths."""
    base, path = panoptic_run
    root = base / "data"
    _run(cli.predict_main, ["--config", str(path), "--checkpoint", str(base / "run"), "--output",
                            str(base / "pred"), str(root / "val")] + LOOSE)
    _run(cli.eval_main, ["--config", str(path), "--checkpoint", str(base / "run"), "--gpus", "2"] + LOOSE)
    record = json.loads((base / "run" / "eval" / "val-step2.json").read_text())
    assert record["postprocess"] == {"letterbox": [48, 48], "mask_thresh": 0.0, "overlap_thresh": 0.3}
    gt, gt_folder = _coco_gt(root)
    pred = json.loads((base / "pred" / "panoptic.json").read_text())
    categories = {c["id"]: c for c in gt["categories"]}
    by_image = {a["image_id"]: a for a in pred["annotations"]}
    assert len(by_image) == len(gt["annotations"]) == record["num_images"] == 3
    with contextlib.redirect_stdout(io.StringIO()):
        stat = official.pq_compute_single_core(0, [(g, by_image[g["image_id"]]) for g in gt["annotations"]],
                                               str(gt_folder), str(base / "pred"), categories)
        results = official.average_pq(stat, categories)
    names = [c["name"] for c in sorted(gt["categories"], key=lambda c: c["id"])]
    ids = sorted(categories)
    assert sum(stat.pq_per_cat[i].fp for i in ids) > 0  # segments were predicted (mask_thresh 0 was used)
    for name, cat in zip(names, ids):
        ours, ref = record["per_class"][name], stat.pq_per_cat[cat]
        assert (ours["tp"], ours["fp"], ours["fn"]) == (ref.tp, ref.fp, ref.fn), name
    for group, suffix in (("All", ""), ("Things", "_things"), ("Stuff", "_stuff")):
        for key in ("pq", "sq", "rq"):
            assert record[key + suffix] == pytest.approx(results[group][key], rel=1e-9, abs=1e-12), (group, key)


def _coco_instances(root: Path, split="val"):
    """COCO instance annotations (RLE from pycocotools) of the panoptic files' thing segments."""
    gt, folder = _coco_gt(root, split)
    things = {c["id"] for c in gt["categories"] if c["isthing"]}
    images, annotations = [], []
    for ann in gt["annotations"]:
        rgb = np.asarray(Image.open(folder / ann["file_name"]), np.int64)
        ids = rgb[..., 0] + 256 * rgb[..., 1] + 65536 * rgb[..., 2]
        images.append({"id": ann["image_id"], "height": ids.shape[0], "width": ids.shape[1]})
        for s in ann["segments_info"]:
            if s["category_id"] not in things:
                continue
            rle = mask_util.encode(np.asfortranarray(ids == s["id"], np.uint8))
            rle["counts"] = rle["counts"].decode()
            annotations.append({"id": len(annotations) + 1, "image_id": ann["image_id"], "segmentation": rle,
                                "category_id": s["category_id"], "iscrowd": s["iscrowd"],
                                "area": float(mask_util.area(rle)), "bbox": list(mask_util.toBbox(rle))})
    return {"images": images, "annotations": annotations, "categories": gt["categories"]}


@pytest.mark.slow
def test_instance_seg_eval_ap_is_cocoevals_on_seg_predicts_results(panoptic_run):
    """data.task instance on the same checkpoint: seg-predict's results JSON (RLE masks) scored by pycocotools'
    COCOeval(iouType="segm") against the thing segments of the data set's files gives seg-eval's AP, AP50, AP75,
    AP small / medium / large. Fails for stuff made instances, crowd regions matched as objects, the top-100
    pairs or their scores computed otherwise in evaluation and prediction, RLE in row-major order."""
    base, path = panoptic_run
    root = base / "data"
    task = ["--set", "data.task=instance"]
    _run(cli.predict_main, ["--config", str(path), "--checkpoint", str(base / "run"), "--output",
                            str(base / "inst"), str(root / "val")] + task)
    _run(cli.eval_main, ["--config", str(path), "--checkpoint", str(base / "run"), "--gpus", "2"] + task)
    record = json.loads((base / "run" / "eval" / "val-step2.json").read_text())
    assert record["task"] == "instance"
    gt_path = base / "instances_gt.json"
    gt_path.write_text(json.dumps(_coco_instances(root)))
    results = json.loads((base / "inst" / "instances.json").read_text())
    assert results and all("counts" in r["segmentation"] for r in results)
    with contextlib.redirect_stdout(io.StringIO()):
        coco = COCO(str(gt_path))
        ev = COCOeval(coco, coco.loadRes(results), iouType="segm")
        ev.evaluate()
        ev.accumulate()
        ev.summarize()
    for i, key in enumerate(("ap", "ap50", "ap75", "ap_small", "ap_medium", "ap_large")):
        want = None if ev.stats[i] == -1 else ev.stats[i]
        assert record[key] == pytest.approx(want, abs=1e-12), key


@pytest.mark.slow
def test_evaluation_on_four_towers_equals_one(panoptic_run):
    """The PQ state and the AP state of the val images from 4 towers (the last step with one image and three idle
    towers) equal 1 tower's exactly; eval.overlap_thresh from the config reaches the post-processing. Fails
    for only the first tower's images scored, a dummy image scored, the states of the towers combined out of image
    order, eval.overlap_thresh dropped for its default."""
    from seg_train.data.split import open_split
    from seg_train.infer.load import load_state
    from tests.helpers import strategy

    base, path = panoptic_run
    loose = ["eval.mask_thresh=0.0", "eval.overlap_thresh=0.3"]
    cfg = load(path, loose)
    reader = open_split(cfg, "val").reader
    setups = {task: mask_evaluate.MaskSetup.of(load(path, loose + [f"data.task={task}"]))
              for task in ("panoptic", "instance")}
    states = {}
    for towers in (1, 4):
        state, _, _ = load_state(cfg, strategy(towers), str(base / "run"))
        step = mask_evaluate.make_step(state, setups["panoptic"].crop)
        for task, setup in setups.items():
            scores, n = mask_evaluate.evaluate(state, step, reader, setup, [str(c) for c in range(K)], False)
            assert n == 3
            states[task, towers] = scores.state.as_arrays()
    assert states["panoptic", 1]["fp"].sum() > 0 and states["instance", 1]["score"].size > 0
    # eval.overlap_thresh reaches the evaluation: the post-processing the evaluation calls receives the config's
    # thresholds (the 2-step model predicts whole-image stuff segments, which no threshold drops, so the effect
    # on the scores cannot show it; tests/test_mask_postprocess.py holds what the thresholds do).
    seen = []
    original = mask_evaluate.post.panoptic_prediction

    def spy(*args, **kwargs):
        seen.append((kwargs["mask_thresh"], kwargs["overlap_thresh"]))
        return original(*args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(mask_evaluate.post, "panoptic_prediction", spy)
        mask_evaluate.evaluate(state, step, reader, setups["panoptic"], [str(c) for c in range(K)], False)
    assert seen and set(seen) == {(0.0, 0.3)}, seen
    for task in setups:
        for key, value in states[task, 1].items():
            np.testing.assert_array_equal(states[task, 4][key], value, err_msg=f"{task} {key}")


# ---- the train step on segment labels ---------------------------------------------------------------------------
def _segment_batch(b=4, seed=0):
    """Images and segment labels [b, 32, 48]: stuff classes 0, 1 as bands, things 2, 3 as numbered boxes (two of a
    class touching), a crowd box, unlabelled pixels on one image only."""
    rng = np.random.default_rng(seed)
    images = rng.normal(size=(b, 32, 48, 3)).astype(np.float32)
    labels = np.zeros((b, 32, 48), np.int32)
    labels[:, 16:] = 1000
    for i in range(b):
        for k in range(1 + i):
            y, x = rng.integers(0, 24), rng.integers(0, 40)
            labels[i, y:y + 8, x:x + 8] = (2 + k % 2) * 1000 + k + 1
    labels[1, :6, :6] = 2999                 # a crowd of class 2
    labels[0, :, :10] = 255000               # unlabelled, on one tower only
    return images, labels


@pytest.fixture(scope="module")
def segment_steps(tmp_path_factory, tiny_vits16):
    """Two SGD steps on 1 and 4 towers from the same seed and panoptic batch (drop path, annealing in progress)."""
    import keras
    import tensorflow as tf

    from seg_train.run.state import TrainState
    from seg_train.train.step import TrainStep
    from tests.helpers import strategy, tiny_config

    tmp = tmp_path_factory.mktemp("steps")
    images, labels = _segment_batch()
    out = {}
    for name, towers in (("one", 1), ("four", 4)):
        cfg = tiny_config(tmp / name, data={"crop_size": [32, 48], "task": "panoptic", "layout": "coco_panoptic",
                                            "num_classes": K},
                          model={"backbone": "dinov3_vits16", "head": "eomt", "eomt_blocks": 2, "num_queries": 6,
                                 "weight_decay": 0.0, "drop_path_rate": 0.3},
                          train={"optimizer": "sgd", "learning_rate": 0.05, "num_steps": 8,
                                 "mask_annealing": [[0, 2], [1, 3]]}, loss={"mask_points": 64})
        step = TrainStep(TrainState(cfg, strategy(towers)))
        batch = next(iter(step.state.strategy.experimental_distribute_dataset(
            tf.data.Dataset.from_tensors((images, labels)))))
        first = float(step(batch).loss)
        after_first = [v.numpy() for v in step.state.model.weights]
        out[name] = (step, [first, float(step(batch).loss)], after_first)
    yield images, labels, out
    keras.backend.clear_session()


@pytest.mark.slow
def test_segment_step_on_four_towers_equals_one(segment_steps):
    """Fails for the segment totals (masks, images) taken per tower instead of gathered in `prepare`, for the
    segments cut to the queries in the loss but not in the totals."""
    _, _, out = segment_steps
    (one, l1, _), (four, l4, _) = out["one"], out["four"]
    assert np.isfinite(l1).all() and l1[0] != l1[1]
    np.testing.assert_allclose(l1, l4, rtol=2e-5)
    for a, b in zip(one.state.model.weights, four.state.model.weights):
        np.testing.assert_allclose(a.numpy(), b.numpy(), atol=2e-5, err_msg=a.path)


@pytest.mark.slow
def test_segment_step_loss_is_the_panoptic_loss_of_the_predictions(segment_steps):
    """Step 2's loss is mask_loss.py's panoptic total (held to transformers' EomtLoss on segment targets) of the
    model's own predictions with the step's seeds. Fails for data.task not reaching the objective (the step
    training semantic targets of the segment values' classes)."""
    import tensorflow as tf

    from seg_train.models import stochastic
    from seg_train.objectives.mask_classification import mask_probabilities, sample_seeds
    from seg_train.objectives.mask_loss import EomtLossOptions, eomt_loss_terms, losses_from_terms
    from seg_train.run.state import TrainState
    from tests.helpers import strategy

    images, labels, out = segment_steps
    step, losses, after_first = out["one"]
    cfg = step.state.cfg
    fresh = TrainState(cfg, strategy(1), optimizer=False)
    fresh.model.set_weights(after_first)
    ids = stochastic.sample_ids(1, 0, 0, 4, 1, 1)
    probs = mask_probabilities(1, [(0, 2), (1, 3)])
    with stochastic.per_sample(ids, cfg.seed):
        preds = fresh.model.predictions(tf.constant(images), probs, sample_seeds(ids, cfg.seed, "mask"),
                                        training=True)

    def total(task):
        opts = EomtLossOptions(num_classes=K, num_points=64, task=task)
        terms = eomt_loss_terms(preds, tf.constant(labels), sample_seeds(ids, cfg.seed, "points"), opts)
        return float(losses_from_terms(terms, opts)["loss"])

    np.testing.assert_allclose(losses[1], total("panoptic"), rtol=1e-5)
    assert abs(total("panoptic") - total("instance")) > 1e-3  # the tasks' targets differ on this batch


@pytest.mark.slow
def test_resumed_panoptic_run_is_bitwise_the_uninterrupted_one(tmp_path):
    """seg-train on 2 towers on the synthetic panoptic set (AdamW, layer decay, drop path, annealing in progress,
    mixed_float16 with its loss scale, train.recompute: blocks), rewound to step 2 and resumed: ckpt-4 bitwise the
    uninterrupted run's. Fails for segment draws (crops, points, masks) keyed by anything but the seed and the
    sample, the recomputation's included (drop path or masks drawn from the process's history rather than the step's
    sample counters). The one EoMT resume test: the semantic task's draws are these same functions of the seed and
    the sample, on class labels instead of segment labels."""
    from tests.helpers import resume_bitwise

    root = synthetic_panoptic.generate(tmp_path / "data", num_train=8, num_val=0, size=(40, 56), num_classes=K)
    raw = _raw(root, num_steps=4, checkpoint_every=2, layer_decay=0.8, mask_annealing=[[1, 3], [2, 4]],
               precision="mixed_float16", recompute="blocks")
    raw["data"]["val_split"] = "none"
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(raw))
    keys = resume_bitwise(tmp_path / "cfg.yaml", tmp_path)
    assert any("queries" in k for k in keys)


# ---- export ---------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_exports_give_the_raw_logits_and_the_tflite_file_is_scored(panoptic_run):
    """The SavedModel (loaded without seg_train) and the TFLite file (LiteRT) give the class and mask logits of the
    checkpoint's model on a letterboxed val image; seg-eval --model FILE.tflite reports the PQ seg-eval reports for
    the checkpoint. Fails for a normalisation other than the reader's, the semantic output exported, the file's
    logits post-processed at another letterbox."""
    import tensorflow as tf

    from seg_train.infer.litert import TFLiteModel
    from seg_train.infer.load import load_state
    from tests.helpers import strategy

    base, path = panoptic_run
    _run(cli.export_main, ["--config", str(path), "--checkpoint", str(base / "run"), "--output", str(base / "sm")])
    _run(cli.export_main, ["--config", str(path), "--checkpoint", str(base / "run"), "--output",
                           str(base / "m.tflite"), "--format", "tflite"])
    image = np.asarray(Image.open(sorted((base / "data" / "val").iterdir())[0]).convert("RGB"))
    boxed = mask_evaluate.letterbox(image, (48, 48))
    cfg = load(path)
    state, _, _ = load_state(cfg, strategy(1), str(base / "run"))
    x = (boxed.astype(np.float32) - np.asarray(cfg.data.mean, np.float32)) / np.asarray(cfg.data.std, np.float32)
    want = [t.numpy()[0] for t in state.model.predictions(tf.constant(x[None]), training=False)[-1]]
    served = tf.saved_model.load(str(base / "sm")).signatures["serving_default"](image=tf.constant(boxed))
    tflite = TFLiteModel(base / "m.tflite").logits(boxed)
    for got in ((served["class_logits"].numpy(), served["mask_logits"].numpy()), tflite):
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4)
    _run(cli.eval_main, ["--config", str(path), "--model", str(base / "m.tflite")] + LOOSE)
    _run(cli.eval_main, ["--config", str(path), "--checkpoint", str(base / "run")] + LOOSE)
    file_record = json.loads((base / "m.eval-val.json").read_text())
    ckpt_record = json.loads((base / "run" / "eval" / "val-step2.json").read_text())
    assert file_record["num_images"] == 3 and file_record["task"] == "panoptic"
    for name, counts in ckpt_record["per_class"].items():
        assert [file_record["per_class"][name][k] for k in ("tp", "fp", "fn")] == \
            [counts[k] for k in ("tp", "fp", "fn")], name
    assert file_record["pq"] == pytest.approx(ckpt_record["pq"], abs=1e-3)


# ---- the recipes ------------------------------------------------------------------------------------------------
def test_recipes_are_the_authors_configs():
    """configs/coco_panoptic_eomt.yaml, coco_instance_eomt.yaml, cityscapes_panoptic_eomt.yaml load with the EoMT
    authors' numbers written here: COCO (their DINOv3 ViT-L configs) 200 queries in 4 blocks, AdamW 2e-4, layer
    decay 0.8, decay 0.05, warmup (2000, 3000), batch 16 of 640 crops, 12 epochs (7391 steps each for panoptic,
    7329 for the 117266 train images with objects), windows starting [0, 29564, 44346, 59128] and ending [3000,
    44346, 59128, 73910]; Cityscapes their semantic recipe (107 epochs of 186 steps, windows 3317 k)."""
    folder = Path(__file__).resolve().parents[1] / "configs"
    windows = [(0, 3000), (29564, 44346), (44346, 59128), (59128, 73910)]
    for name, task, steps in (("coco_panoptic_eomt", "panoptic", 12 * 7391), ("coco_instance_eomt", "instance",
                                                                            12 * 7329)):
        c = load(folder / f"{name}.yaml")
        t = c.train
        assert (c.data.layout, c.data.task, c.data.num_classes, c.data.crop_size, c.data.batch_size) == \
            ("coco_panoptic", task, 133, (640, 640), 16)
        assert (c.model.backbone, c.model.head, c.model.num_queries, c.model.eomt_blocks) == \
            ("dinov3_vitl16", "eomt", 200, 4)
        assert (t.optimizer, t.learning_rate, t.layer_decay, t.weight_decay, t.lr_power, t.warmup_steps,
                t.backbone_warmup_steps, t.num_steps, t.mask_annealing) == \
            ("adamw", 2e-4, 0.8, 0.05, 0.9, 2000, 3000, steps, windows)
        assert (c.eval.mask_thresh, c.eval.overlap_thresh, c.loss.mask_points) == (0.8, 0.8, 12544)
    c = load(folder / "cityscapes_panoptic_eomt.yaml")
    t = c.train
    assert (c.data.layout, c.data.task, c.data.num_classes, c.data.crop_size, c.data.thing_classes) == \
        ("cityscapes", "panoptic", 19, (1024, 1024), list(range(11, 19)))
    assert (c.model.num_queries, t.learning_rate, t.warmup_steps, t.backbone_warmup_steps, t.num_steps) == \
        (200, 1e-4, 500, 1000, 107 * 186)
    assert annealing_windows(c) == [(3317 * k, 3317 * (k + 1)) for k in range(1, 5)]

"""The panoptic and instance tasks on the model side (data.task panoptic / instance): the train step on segment
labels over towers, resume, evaluation, prediction and export, as a user runs them.

Outside references: cityscapesscripts' panoptic evaluator (panopticapi's pq_compute) on the synthetic set's own COCO
panoptic files and seg-predict's PNG + JSON; pycocotools' COCOeval(iouType="segm") on seg-predict's results JSON
against COCO instance annotations written here from the same files; Pillow for the letterbox; the exported files
loaded without seg_train (tf.saved_model.load, LiteRT). Where no outside reference exists (towers, resume), the
same numbers from 1 and 4 towers, and from a run killed and resumed.

The runs: DINOv3 ViT-S/16 EoMT (2 EoMT blocks, 8 queries) on the synthetic panoptic demo set (data/
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
from seg_train.data import synthetic_panoptic
from seg_train.infer import mask_evaluate
from seg_train.infer.mask_postprocess import scaled_size
from seg_train.run import checkpoint as ckpt_lib

official = pytest.importorskip("cityscapesscripts.evaluation.evalPanopticSemanticLabeling")
pytest.importorskip("pycocotools")
from pycocotools import mask as mask_util  # noqa: E402
from pycocotools.coco import COCO  # noqa: E402
from pycocotools.cocoeval import COCOeval  # noqa: E402

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
def panoptic_run(tmp_path_factory):
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
    """Semantic EoMT needs a query per class; the segment tasks need a query per segment of an image, whatever K.
    Fails for the semantic check applied to panoptic configs."""
    raw = _raw(tmp_path / "data")
    raw["model"]["num_queries"] = 3
    assert from_dict(raw).model.num_queries == 3
    raw["data"] = {"root": "x", "num_classes": 4, "crop_size": [48, 48]}
    with pytest.raises(ConfigError, match="model.num_queries"):
        from_dict(raw)


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
    towers) equal 1 tower's exactly. Fails for only the first tower's images scored, a dummy image scored, the
    states of the towers combined out of image order."""
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
    for task in setups:
        for key, value in states[task, 1].items():
            np.testing.assert_array_equal(states[task, 4][key], value, err_msg=f"{task} {key}")

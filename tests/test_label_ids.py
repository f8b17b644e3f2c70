"""seg-predict --label-ids: the benchmarks' own raw label values, held to the references their users trust.

The Cityscapes check runs cityscapesscripts' official evaluator (evalPixelLevelSemanticLabeling: its own
file matching, getPrediction, and its own IoU) on what `seg-predict --label-ids` wrote for a model
trained here through seg-train on a tiny Cityscapes tree, and requires seg-eval --json's per-class IoU and
mIoU on the same checkpoint, class by class, for the checkpoint and for its .tflite export.

Fails for: train ids written instead of labelIds (the evaluator then scores today's palette PNGs, shown
below to be far off), an inverse table off by one or built from the wrong side, file names the
evaluator does not match or matches twice, ADE20K's +1 dropped, VOC indices moved, a user label map or
binary mask not inverted by the stated rule (lowest raw value; 0 / 255), and a .tflite class with no raw
value written instead of refused.
"""

import contextlib
import copy
import io
import json
from pathlib import Path

import numpy as np
import pytest
import yaml
from PIL import Image

from seg_train import cli
from seg_train import config as config_lib
from seg_train.data import labels, layouts

pytestmark = pytest.mark.slow  # DEVELOPING.md: starts processes or takes seconds per test

official = pytest.importorskip("cityscapesscripts.evaluation.evalPixelLevelSemanticLabeling")
from cityscapesscripts.helpers.labels import trainId2label  # noqa: E402

H, W = 48, 64
CITIES = {"train": {"aachen": 3, "bochum": 1}, "val": {"frankfurt": 2, "lindau": 1}}
# road, sidewalk, building, vegetation, sky, person, car, bicycle and the ignored unlabeled, static, parking,
# guard rail: few classes, so that a few steps learn them; the other classes have no ground truth (the
# official IoU: nan unless predicted).
LABEL_IDS = (7, 8, 11, 21, 23, 24, 26, 33, 0, 4, 9, 14)


def blocks(rng, values):
    b = rng.choice(np.asarray(values), (H // 8 + 1, W // 8 + 1))
    return np.repeat(np.repeat(b, 8, 0), 8, 1)[:H, :W].astype(np.uint8)


def make_cityscapes(root: Path) -> None:
    """leftImg8bit/ and gtFine/ as they ship; each labelId has its own colour (plus noise), so a few steps
    learn several classes."""
    rng = np.random.default_rng(0)
    colours = rng.integers(0, 256, (34, 3))
    for split, cities in CITIES.items():
        for city, count in cities.items():
            (root / "leftImg8bit" / split / city).mkdir(parents=True)
            (root / "gtFine" / split / city).mkdir(parents=True)
            for n in range(count):
                stem = f"{city}_{n:06d}_000019"
                raw = blocks(rng, LABEL_IDS)
                photo = np.clip(colours[raw] + rng.normal(0, 8, (H, W, 3)), 0, 255).astype(np.uint8)
                Image.fromarray(photo).save(root / "leftImg8bit" / split / city / f"{stem}_leftImg8bit.png")
                Image.fromarray(raw).save(root / "gtFine" / split / city / f"{stem}_gtFine_labelIds.png")


def write_config(folder: Path, name: str, data: dict) -> str:
    raw = {"seed": 0, "run_dir": "run",
           "data": {"batch_size": 2, "crop_size": [32, 32], "random_scale": [1.0, 1.0], "num_parallel_calls": 2,
                    **data},
           "model": {"backbone": "tiny", "aspp_channels": 8, "decoder_channels": 8, "low_level_channels": 4},
           "train": {"num_steps": 30, "checkpoint_every": 30, "summary_every": 10, "image_summary_every": 0,
                     "learning_rate": 0.05},
           "eval": {"bn_reestimate_batches": 1}}
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return str(path)


def command(main, *argv) -> str:
    """Runs a seg-* entry point in-process; its stdout (exit code 0 required)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(list(argv)) == 0
    return out.getvalue()


def official_eval(predictions: Path, gt_root: Path) -> dict:
    """cityscapesscripts' evaluator as its main() runs it (ground truth gtFine/val/*/*_gtFine_labelIds.png,
    each matched to a prediction by getPrediction), quiet, writing no file, on its own copy of the args."""
    args = copy.copy(official.args)
    args.predictionPath, args.predictionWalk = str(predictions), None
    args.quiet, args.JSONOutput, args.colorized = True, False, False
    args.evalInstLevelScore = False  # nIoU needs instanceIds PNGs; the IoU does not
    gts = sorted(str(p) for p in gt_root.glob("gtFine/val/*/*_gtFine_labelIds.png"))
    return official.evaluateImgLists([official.getPrediction(args, gt) for gt in gts], gts, args)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("label_ids")
    root = tmp / "cityscapes"
    make_cityscapes(root)
    config = write_config(tmp, "cityscapes", {"layout": "cityscapes", "root": str(root)})
    command(cli.train_main, "--config", config, "--gpus", "1")
    record = json.loads(command(cli.eval_main, "--config", config, "--gpus", "1", "--checkpoint",
                                str(tmp / "run"), "--json").strip().splitlines()[-1])
    cities = [str(p) for p in sorted((root / "leftImg8bit" / "val").iterdir())]
    for flag, out in (("--label-ids", "ids"), (None, "train_ids")):
        command(cli.predict_main, "--config", config, "--gpus", "1", "--checkpoint", str(tmp / "run"),
                "--output", str(tmp / out), *([flag] if flag else []), *cities)
    return {"tmp": tmp, "root": root, "config": config, "record": record, "cities": cities}


def assert_same_scores(official_result: dict, record: dict) -> None:
    """The official per-class IoU (nan: no ground truth and no prediction) and mIoU equal seg-eval's (None)."""
    ours = record["per_class_iou"]
    assert list(ours) == list(layouts.CITYSCAPES_CLASSES)
    for name, iou in ours.items():
        theirs = official_result["classScores"][name]
        if iou is None:
            assert np.isnan(theirs), name
        else:
            assert theirs == pytest.approx(iou, abs=1e-12), name
    assert official_result["averageScoreClasses"] == pytest.approx(record["miou"], abs=1e-12)


def test_official_evaluator_on_label_ids_equals_seg_eval(run):
    out = run["tmp"] / "ids"
    names = sorted(p.name for p in out.iterdir())
    assert names == ["frankfurt_000000_000019_labelIds.png", "frankfurt_000001_000019_labelIds.png",
                     "lindau_000000_000019_labelIds.png"]  # nothing else: the folder is the submission
    result = official_eval(out, run["root"])
    assert_same_scores(result, run["record"])
    iou = run["record"]["per_class_iou"]
    # The comparison is not vacuous: several classes predicted right, and classes without ground truth.
    assert sum(v is not None and v > 0 for v in iou.values()) >= 3, iou
    assert any(v is None for v in iou.values()), iou
    for p in out.iterdir():
        assert Image.open(p).mode == "L"


def test_official_evaluator_fails_on_train_ids(run):
    """Today's output (palette PNGs of train ids) is matched by the evaluator and scored far off: the
    comparison above can fail."""
    theirs, ours = official_eval(run["tmp"] / "train_ids", run["root"])["averageScoreClasses"], run["record"]["miou"]
    assert theirs < ours / 2 and ours - theirs > 0.05, (theirs, ours)


@pytest.fixture(scope="module")
def lite(run):
    """The checkpoint exported to .tflite at the images' size, and the train ids it predicts (today's output)."""
    pytest.importorskip("ai_edge_litert")
    model = run["tmp"] / "m.tflite"
    command(cli.export_main, "--config", run["config"], "--checkpoint", str(run["tmp"] / "run"), "--format", "tflite",
            "--input-size", str(H), str(W), "--output", str(model))
    # The val photos under ADE20K-style names (ADE's devkit looks for <image name>.png).
    ade = run["tmp"] / "ade_images"
    ade.mkdir()
    photos = sorted(Path(run["root"], "leftImg8bit", "val").glob("*/*.png"))
    for n, p in enumerate(photos):
        Image.open(p).save(ade / f"ADE_val_{n + 1:08d}.jpg", quality=95)
    command(cli.predict_main, "--config", run["config"], "--model", str(model), "--output",
            str(run["tmp"] / "lite_train_ids"), str(ade))
    train_ids = {p.stem: np.array(Image.open(p)) for p in sorted((run["tmp"] / "lite_train_ids").glob("*.png"))}
    return {"model": model, "ade": ade, "train_ids": train_ids}


def test_official_evaluator_on_tflite_label_ids_equals_seg_eval_model(run, lite):
    out = run["tmp"] / "lite_ids"
    command(cli.predict_main, "--config", run["config"], "--model", str(lite["model"]), "--label-ids", "--output",
            str(out), *run["cities"])
    record = json.loads(command(cli.eval_main, "--config", run["config"], "--model", str(lite["model"]),
                                "--json").strip().splitlines()[-1])
    assert len(list(out.iterdir())) == 3
    assert_same_scores(official_eval(out, run["root"]), record)


@pytest.mark.parametrize("layout, data, raw_of", [
    ("ade20k", {}, lambda t: t + 1),                     # the SceneParsing devkit's 1..150
    ("voc", {"num_classes": 21}, lambda t: t),           # VOC's indices, unchanged
    ("pairs", {"num_classes": 30, "label_map": {**{t: t for t in range(30)}, **{t + 100: t for t in range(30)}}},
     lambda t: t),                                       # two raw values per class: the lowest
])
def test_other_layouts_write_their_raw_values(run, lite, layout, data, raw_of):
    """The same .tflite file's train ids (today's output) are the reference, each pixel mapped by hand."""
    config = write_config(run["tmp"], layout, {"layout": layout, "root": str(run["tmp"] / "nowhere"), **data})
    out = run["tmp"] / f"lite_{layout}"
    command(cli.predict_main, "--config", config, "--model", str(lite["model"]), "--label-ids", "--output", str(out),
            str(lite["ade"]))
    assert sorted(p.name for p in out.iterdir()) == [f"{stem}.png" for stem in lite["train_ids"]]
    for stem, train_ids in lite["train_ids"].items():
        written = Image.open(out / f"{stem}.png")
        assert written.mode == "L"
        np.testing.assert_array_equal(np.array(written), raw_of(train_ids.astype(np.int64)), err_msg=stem)
    assert len(np.unique(np.concatenate([t.ravel() for t in lite["train_ids"].values()]))) >= 3


def test_a_class_with_no_raw_value_is_one_line(run, lite, capsys):
    """A config with fewer classes than the .tflite file predicts (its highest predicted class is one past
    the config's) has no raw value to write for it: one line, exit 2, no traceback."""
    top = max(int(t.max()) for t in lite["train_ids"].values())
    assert top >= 2
    config = write_config(run["tmp"], "fewer", {"root": str(run["tmp"] / "nowhere"), "num_classes": top})
    capsys.readouterr()
    assert cli.predict_main(["--config", config, "--model", str(lite["model"]), "--label-ids", "--output",
                             str(run["tmp"] / "lite_fewer"), str(lite["ade"])]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: model predicts a class the config does not have (") and "Traceback" not in \
        "".join(err), err
    assert f"data.num_classes: {top}" in err[-1] and err[-1].endswith(f"got {top}")


def load_data(tmp_path, **data):
    return config_lib.load(write_config(tmp_path, "c", {"root": str(tmp_path), **data})).data


def test_raw_ids_invert_the_reader_table(tmp_path):
    """labels.raw_ids against cityscapesscripts' own table and rules written here by hand; reading a raw
    value back through the reader's table gives its class (the round trip) in every case."""
    cases = {
        "cityscapes": (load_data(tmp_path, layout="cityscapes"), [trainId2label[t].id for t in range(19)]),
        "ade20k": (load_data(tmp_path, layout="ade20k"), list(range(1, 151))),
        "voc": (load_data(tmp_path, num_classes=21), list(range(21))),
        "reduce_zero_label": (load_data(tmp_path, num_classes=5, reduce_zero_label=True), [1, 2, 3, 4, 5]),
        "label_map": (load_data(tmp_path, num_classes=3, label_map={9: 0, 2: 0, 7: 1, 5: 2, 4: 2, 0: 255}),
                      [2, 7, 4]),  # the lowest raw value of each class
        "binary": (load_data(tmp_path, layout="pairs", num_classes=2, binary_threshold=100), [0, 255]),
    }
    for name, (data, want) in cases.items():
        raw = labels.raw_ids(data)
        assert raw.dtype == np.uint8 and raw.tolist() == want, name
        back = labels.apply(labels.label_table(data), raw)
        np.testing.assert_array_equal(back, np.arange(data.num_classes), err_msg=name)


def test_label_ids_names_and_their_collisions(tmp_path, capsys):
    from seg_train.config import ConfigError
    from seg_train.infer.predict import collect_inputs, label_ids_name

    assert label_ids_name(Path("a/berlin_000123_000019_leftImg8bit.png")) == "berlin_000123_000019_labelIds.png"
    assert label_ids_name(Path("ADE_val_00000001.jpg")) == "ADE_val_00000001.png"
    for sub, name in (("a", "x_leftImg8bit.png"), ("b", "x_labelIds.jpg")):
        (tmp_path / sub).mkdir()
        Image.fromarray(np.zeros((4, 4, 3), np.uint8)).save(tmp_path / sub / name)
    inputs = [str(tmp_path / "a"), str(tmp_path / "b")]
    assert len(collect_inputs(inputs)) == 2  # x_leftImg8bit.png and x_labelIds.png: distinct
    with pytest.raises(ConfigError, match=r"output name collision .*both would write x_labelIds\.png"):
        collect_inputs(inputs, label_ids=True)
    # Through the command, before TensorFlow or the config is needed.
    capsys.readouterr()
    assert cli.predict_main(["--config", str(tmp_path / "none.yaml"), "--checkpoint", str(tmp_path), "--label-ids",
                             "--output", str(tmp_path / "out"), *inputs]) == 2
    assert capsys.readouterr().err.startswith("error: output name collision (")

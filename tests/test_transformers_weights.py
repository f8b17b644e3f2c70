"""transformers checkpoints (models/dino/transformers.py) held to transformers itself: the folders
scripts/reference_transformers_checkpoints.py saved with save_pretrained (tests/fixtures/transformers: a
DINOv3ViTModel with the gated SiLU MLP, a Dinov2Model saved in bfloat16, a Dinov2WithRegistersModel with SwiGLU
sharded into 5 files, an EomtForUniversalSegmentation with SwiGLU, an EomtDinov3ForUniversalSegmentation; random
weights, 3 blocks of width 16, patch 4) loaded into seg-train's encoder / EoMT and compared with transformers'
outputs on the same images in float32, at TOLERANCE of the largest reference value: the encoders' patch tokens
after the final LayerNorm of the last and the middle block, EoMT's class and mask logits; at the model's own
16 x 16 and at 12 x 28 wherever transformers runs it (not EomtForUniversalSegmentation: its positions fit one
grid). Then the position resize alone against torch's, every refusal in one line, and through the config and the
seg-train command: runs start from a folder of dinov3_vits16's layout as transformers saves it (at the size of
tests/helpers.py's TINY_VITS16, in dinov3_vits16's place for the whole module: the `tiny_vits16` fixture), a
mismatched folder is refused with exit code 2 and no run dir written.
"""

import io
import json
import shutil
from contextlib import redirect_stderr
from dataclasses import replace

import numpy as np
import pytest
import tensorflow as tf
import yaml

from seg_train import cli
from seg_train import config as config_lib
from seg_train.config import ConfigError
from seg_train.data import synthetic
from seg_train.models.dino.transformers import (
    check_backbone_folder,
    check_eomt_folder,
    is_transformers_folder,
    load_backbone_folder,
    load_eomt_folder,
)
from seg_train.models.dino.vit import dino_encoder, resize_positions
from seg_train.models.eomt.eomt import eomt
from tests.helpers import (
    ENCODER_CASES,
    EOMT_CASES,
    TRANSFORMERS_FIXTURES,
    strategy,
    transformers_case,
    transformers_layout,
    write_transformers_folder,
)

# dinov3_vits16 is tests/helpers.py's TINY_VITS16 throughout the module (conftest.py's `tiny_vits16`).
pytestmark = pytest.mark.usefixtures("tiny_vits16")

TOLERANCE = 1e-4  # of the largest reference value; float32 against torch's float32 (seen: below 1e-6)
MIDDLE = 2  # the script's middle block


def _rel(ours, theirs):
    ours, theirs = np.asarray(ours, np.float64), np.asarray(theirs, np.float64)
    assert ours.shape == theirs.shape, (ours.shape, theirs.shape)
    return np.max(np.abs(ours - theirs)) / np.max(np.abs(theirs))


def _encoder(case):
    folder, z, spec, _ = transformers_case(case)
    model = dino_encoder(spec, layers=(MIDDLE, spec.depth))
    load_backbone_folder(model, check_backbone_folder(folder, spec, case))
    return model, z, spec


def _eomt(case, classes=None):
    folder, z, spec, keys = transformers_case(case)
    classes = keys["classes"] if classes is None else classes
    model = eomt(spec, classes, queries=keys["queries"], eomt_blocks=keys["eomt_blocks"])
    loaded = check_eomt_folder(folder, spec, case, keys["queries"], keys["eomt_blocks"], classes)
    load_eomt_folder(model, loaded)
    return model, z, loaded


@pytest.mark.parametrize("case", ENCODER_CASES)
def test_encoder_features_are_transformers(case):
    """The patch tokens of the middle and last block after the final LayerNorm, at 16 x 16 and 12 x 28. Fails for:
    a Linear not transposed, q and k (or v) swapped, the patch kernel's axes misordered, a layer scale or norm
    of another block, the gate and up halves of a gated / SwiGLU MLP swapped, registers or CLS out of place, BF16
    widened wrongly (dinov2 is saved in it), a shard not read (dinov2_registers), the positions resized with
    TensorFlow's bicubic instead of torch's (dinov2 at 12 x 28) or without antialias (dinov2_registers)."""
    model, z, spec = _encoder(case)
    for k in (0, 1):
        x = z[f"images_{k}"]
        middle, last = model(x)
        assert tuple(last.shape) == (2, x.shape[1] // spec.patch, x.shape[2] // spec.patch, spec.width)
        assert _rel(np.reshape(last, (2, -1, spec.width)), z[f"last_{k}"]) < TOLERANCE, (case, k)
        assert _rel(np.reshape(middle, (2, -1, spec.width)), z[f"middle_{k}"]) < TOLERANCE, (case, k)


@pytest.mark.parametrize("case", EOMT_CASES)
def test_eomt_logits_are_transformers(case):
    """Eval-mode class and mask logits (no masking), at 16 x 16 and, for EoMT-DINOv3, 12 x 28. Fails for: the
    queries or class head transposed, the mask MLP's layers out of order, the upscale's transposed-conv kernel as
    a conv's (in and out swapped) or the depthwise kernel misread, EoMT's position table given a CLS entry,
    SwiGLU's gate and up split the wrong way round, the key bias of DINOv3's attention expected."""
    model, z, _ = _eomt(case)
    for k in (0, 1):
        if f"images_{k}" not in z:
            continue
        (class_logits, mask_logits), = model.predictions(z[f"images_{k}"])
        assert _rel(class_logits, z[f"class_{k}"]) < TOLERANCE, (case, k)
        assert _rel(mask_logits, z[f"mask_{k}"]) < TOLERANCE, (case, k)


def test_every_tensor_used_and_the_skipped_ones_named():
    """Each folder's tensors are all loaded but for the ones skipped on purpose. Fails for: a tensor silently
    left out of the table (a bias, a register), something else than the mask token and EoMT's annealing state
    and loss weight skipped."""
    for case in ENCODER_CASES + EOMT_CASES:
        folder, _, spec, keys = transformers_case(case)
        checked = check_eomt_folder(folder, spec, case, keys["queries"], keys["eomt_blocks"], keys["classes"]) \
            if keys else check_backbone_folder(folder, spec, case)
        used = {n for e in checked.entries for n in e.names}
        present = set(checked.checkpoint.tensors)
        assert used | (present & set(checked.skipped)) == present and not used & set(checked.skipped), case
        assert sorted(present - used) == {
            "dinov3_vit": ["embeddings.mask_token"], "dinov2": ["embeddings.mask_token"],
            "dinov2_registers": ["embeddings.mask_token"], "eomt": ["attn_mask_probs", "criterion.empty_weight"],
            "eomt_dinov3": ["attn_mask_probs", "criterion.empty_weight"]}[case], case


def test_class_head_loaded_only_for_the_runs_classes(caplog):
    """data.num_classes 3 (the folder's): the class head is loaded (the logits above). 4: it keeps its seeded
    initialisation, with a one-line notice, while everything else is loaded. Fails for: a class head of other
    classes half-loaded or refused (COCO -> ADE20K fine-tuning), the notice missing."""
    tf.keras.utils.set_random_seed(3)
    fresh = eomt(transformers_case("eomt")[2], 4, queries=5, eomt_blocks=2)
    with caplog.at_level("INFO", logger="seg_train"):
        tf.keras.utils.set_random_seed(3)
        model, z, loaded = _eomt("eomt", classes=4)
    assert not loaded.class_head
    notice = [r.getMessage() for r in caplog.records if "class head" in r.getMessage()]
    assert len(notice) == 1 and "its 3 classes are not data.num_classes (4)" in notice[0]
    np.testing.assert_array_equal(model.class_head.kernel, fresh.class_head.kernel)
    assert not np.array_equal(model.queries, fresh.queries)
    _, mask_logits = model.predictions(z["images_0"])[0]
    assert _rel(mask_logits, z["mask_0"]) < TOLERANCE


def test_torch_bicubic_is_torchs_interpolate():
    """resize_positions against torch's F.interpolate(bicubic, align_corners=False) given a size, up and down, per
    axis: torch_bicubic without antialias; with antialias TensorFlow's own resize. And TensorFlow's plain bicubic is
    not torch's (why the flag exists). Fails for: a = -0.5, edge taps dropped instead of clamped, align-corners
    coordinates, a scale factor with DINOv2's +0.1 offset, antialias ignored."""
    z = np.load(TRANSFORMERS_FIXTURES / "positions.npz")
    grid = z["grid"]  # [1, C, G, G]
    c, g = grid.shape[1], grid.shape[2]
    table = np.concatenate([np.zeros((1, 1, c), np.float32), grid.transpose(0, 2, 3, 1).reshape(1, g * g, c)], 1)
    plain_differs = []
    for key in z.files:
        if key == "grid":
            continue
        size, antialias = key.split("_")
        h, w = map(int, size.split("x"))
        antialias = antialias == "True"
        want = z[key].transpose(0, 2, 3, 1).reshape(1, h * w, c)
        got = resize_positions(tf.constant(table), h, w, antialias, torch_bicubic=True)
        assert _rel(got[:, 1:], want) < 1e-5, key
        np.testing.assert_array_equal(got[:, :1], table[:, :1])
        if not antialias and (h, w) != (g, g):
            plain = resize_positions(tf.constant(table), h, w, False)
            plain_differs.append(_rel(plain[:, 1:], want))
    assert min(plain_differs) > 1e-2, plain_differs


def _error(fn, *args):
    with pytest.raises(ConfigError) as e:
        fn(*args)
    assert "\n" not in str(e.value)
    return f"error: {e.value}"


def _copy(case, tmp_path):
    dst = tmp_path / case
    shutil.copytree(TRANSFORMERS_FIXTURES / case, dst)
    return dst


def _rewrite(folder, change):
    """The folder's single model.safetensors rewritten through `change` {name: array} -> {name: array}."""
    from safetensors.numpy import load_file, save_file
    arrays = load_file(folder / "model.safetensors")
    save_file(change(arrays), folder / "model.safetensors")


def test_refusals_are_one_line_naming_the_key_and_both_values(tmp_path):
    """Before anything is built: a folder of another architecture, a config of another size (each key named with
    both values), a tensor missing, of another shape or dtype, or left over, the position resize keras-hub's for a
    transformers DINOv2. Fails for: any of them accepted (a model half-loaded or silently off), or reported in
    a traceback."""
    folder, _, v3, _ = transformers_case("dinov3_vit")
    v2_folder, _, v2, _ = transformers_case("dinov2")
    eomt_folder, _, e2, keys = transformers_case("eomt")
    assert is_transformers_folder(folder) and not is_transformers_folder(tmp_path)
    assert _error(check_backbone_folder, v2_folder, v3, "dinov3_x") == (
        f"error: transformers folder of another architecture ({v2_folder}/config.json): DINOv3ViTModel for "
        f"model.backbone_weights with model.backbone 'dinov3_x', got Dinov2Model")
    assert _error(check_backbone_folder, eomt_folder, e2, "dinov2_x") == (
        f"error: transformers folder of another architecture ({eomt_folder}/config.json): Dinov2Model or "
        f"Dinov2WithRegistersModel for model.backbone_weights with model.backbone 'dinov2_x', got "
        f"EomtForUniversalSegmentation (an EoMT folder goes in model.init_weights with model.head eomt)")
    assert _error(check_backbone_folder, folder, replace(v3, width=32), "dinov3_x") == (
        f"error: transformers folder does not fit the model (model.backbone): hidden_size 32 (dinov3_x's), got 16 "
        f"in {folder}/config.json")
    assert "(model.backbone): num_register_tokens 4 (dinov3_x's), got 2" in _error(
        check_backbone_folder, folder, replace(v3, registers=4), "dinov3_x")
    assert "(model.backbone): use_gated_mlp False (dinov3_x's), got True" in _error(
        check_backbone_folder, folder, replace(v3, gated=False), "dinov3_x")
    assert _error(check_backbone_folder, v2_folder, replace(v2, torch_bicubic=False), "dinov2_x") == (
        "error: transformers folder does not fit the model (model.position_resize): torch for a transformers "
        "Dinov2Model (its positions are resized by torch's bicubic), got tensorflow")
    assert _error(check_backbone_folder, v2_folder, replace(v2, pos_grid=37), "dinov2_x") == (
        f"error: transformers folder does not fit the model (model.position_grid): image_size / patch_size 37 "
        f"(this config's position grid), got image_size 16 with patch_size 4 in {v2_folder}/config.json")
    q, b, k = keys["queries"], keys["eomt_blocks"], keys["classes"]
    assert _error(check_eomt_folder, eomt_folder, e2, "dinov2_x", 7, b, k) == (
        f"error: transformers folder does not fit the model (model.num_queries): num_queries 7 (this config's), "
        f"got 5 in {eomt_folder}/config.json")
    assert "(model.eomt_blocks): num_blocks 3 (this config's), got 2" in _error(
        check_eomt_folder, eomt_folder, e2, "dinov2_x", q, 3, k)
    assert "EoMT backbone with positions for the patches only" in _error(
        check_eomt_folder, eomt_folder, replace(e2, cls_position=True), "dinov2_x", q, b, k)

    missing = _copy("dinov3_vit", tmp_path)
    _rewrite(missing, lambda a: {n: v for n, v in a.items() if n != "layer.2.attention.v_proj.bias"})
    assert _error(check_backbone_folder, missing, v3, "dinov3_x") == (
        f"error: tensor missing from the transformers folder ({missing}/model.safetensors): "
        f"'layer.2.attention.v_proj.bias' of shape [16] for block3_attn_v/bias (DINOv3ViTModel)")
    shape = _copy("dinov3_vit", tmp_path / "s")
    _rewrite(shape, lambda a: {**a, "layer.0.mlp.up_proj.weight": a["layer.0.mlp.up_proj.weight"].T.copy()})
    assert _error(check_backbone_folder, shape, v3, "dinov3_x") == (
        f"error: tensor of another shape in the transformers folder ({shape}/model.safetensors): "
        f"'layer.0.mlp.up_proj.weight' of shape [32, 16] for block1_mlp_up/kernel, got [16, 32]")
    extra = _copy("dinov3_vit", tmp_path / "e")
    _rewrite(extra, lambda a: {**a, "layer.0.attention.k_proj.bias": np.zeros(16, np.float32)})
    assert _error(check_backbone_folder, extra, v3, "dinov3_x") == (
        f"error: tensor the model has no place for ({extra}/model.safetensors): only DINOv3ViTModel's tensors "
        f"for this model, got 'layer.0.attention.k_proj.bias'")
    ints = _copy("dinov3_vit", tmp_path / "i")
    _rewrite(ints, lambda a: {**a, "norm.bias": a["norm.bias"].astype(np.int32)})
    assert "'norm.bias' as one of F64, F32, F16, BF16, got I32" in _error(check_backbone_folder, ints, v3, "x")


# ---- through the config and the command: folders of dinov3_vits16's layout at TINY_VITS16's size ------------------
CLASSES = 3


def _config(tmp_path, root, model, **train):
    raw = {"seed": 0, "run_dir": "run",
           "data": {"root": str(root), "num_classes": CLASSES, "batch_size": 2, "crop_size": [32, 32],
                    "num_parallel_calls": 2},
           "model": {"backbone": "dinov3_vits16", **model},
           "train": {"num_steps": 1, "learning_rate": 1e-12, "checkpoint_every": 1, "summary_every": 1,
                     "image_summary_every": 100, "eval_every": 100, **train},
           "eval": {"bn_reestimate_batches": 0}}
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(raw))
    return tmp_path / "config.yaml"


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    return synthetic.generate(tmp_path_factory.mktemp("data") / "demo", num_train=4, num_val=2, size=(40, 48),
                              num_classes=CLASSES)


def _train(config):
    err = io.StringIO()
    with redirect_stderr(err):
        rc = cli.train_main(["--config", str(config), "--gpus", "1"])
    return rc, err.getvalue()


def _variable(model, name):
    return np.asarray(next(v for v in model.weights if v.path == name))


@pytest.mark.slow
def test_run_starts_from_an_eomt_folder(tmp_path, demo, tiny_vits16):
    """seg-train --config with model.init_weights: an EomtDinov3ForUniversalSegmentation folder (dinov3_vits16 at
    TINY_VITS16's size, its tensors in BF16) trains one step at a negligible rate; the checkpoint holds the
    folder's weights in the encoder, the queries, the class head, the mask MLP and the upscale blocks. seg-eval
    without --checkpoint (the model as the folder starts it) counts what seg-eval of that checkpoint counts. Fails for:
    model.init_weights dropped between the config and the model (random weights), the folder read into the
    encoder only, seg-eval evaluating a model other than the folder's."""
    from seg_train.infer.load import load_state

    written = write_transformers_folder(tmp_path / "eomt", transformers_layout("EomtDinov3ForUniversalSegmentation"))
    config = _config(tmp_path, demo, {"head": "eomt", "num_queries": 6, "eomt_blocks": 2, "init_weights": "eomt"},
                     optimizer="adamw", weight_decay=0.0)
    rc, err = _train(config)
    assert rc == 0, err
    cfg = config_lib.load(config)
    state, _, step = load_state(cfg, strategy(1), str(tmp_path / "run"))
    assert step == 1
    model = state.model
    last = tiny_vits16.depth
    theirs = {"patch_embed/kernel": written["embeddings.patch_embeddings.weight"].transpose(2, 3, 1, 0),
              f"block{last}_attn_q/kernel": written[f"layers.{last - 1}.attention.q_proj.weight"].T,
              f"block{last}_mlp_down/bias": written[f"layers.{last - 1}.mlp.down_proj.bias"],
              "eomt/queries": written["query.weight"],
              "class_head/kernel": written["class_predictor.weight"].T,
              "mask_mlp3/bias": written["mask_head.fc3.bias"],
              "upscale2_deconv/kernel": written["upscale_block.block.1.conv1.weight"].transpose(2, 3, 1, 0)}
    paths = {v.path for v in model.weights}
    for name, value in theirs.items():
        assert name in paths, (name, sorted(paths)[:5])
        np.testing.assert_allclose(_variable(model, name), value, atol=1e-6, err_msg=name)

    records = []
    for extra in (["--checkpoint", str(tmp_path / "run")], []):
        err = io.StringIO()
        with redirect_stderr(err):
            rc = cli.eval_main(["--config", str(config), "--gpus", "1"] + extra)
        assert rc == 0, err.getvalue()
        records.append(json.loads((tmp_path / "run" / "eval" / f"val-{'step1' if extra else 'init'}.json")
                                  .read_text()))
    assert records[1]["step"] == 0 and records[1]["checkpoint"] == str(tmp_path / "eomt")
    matrix = np.asarray(records[1]["confusion_matrix"])
    assert np.count_nonzero(matrix.sum(0)) > 1  # not one class everywhere: the counts tell models apart
    np.testing.assert_array_equal(matrix, records[0]["confusion_matrix"])


@pytest.mark.slow
def test_backbone_folder_reaches_the_runs_model(tmp_path):
    """A config file with model.backbone_weights: a DINOv3ViTModel folder (dinov3_vits16 at TINY_VITS16's size)
    and the linear head, built as a run builds it (TrainState): the encoder holds the folder's tensors. Fails for:
    the key dropped (random weights) or the folder taken for a keras-hub preset."""
    from seg_train.run.state import TrainState

    written = write_transformers_folder(tmp_path / "vit", transformers_layout("DINOv3ViTModel"))
    config = _config(tmp_path, "data", {"head": "linear", "backbone_weights": "vit"})
    state = TrainState(config_lib.load(config), strategy(1), optimizer=False)
    encoder = state.model.get_layer("dinov3_vits16")
    np.testing.assert_allclose(encoder.get_layer("tokens").register_tokens, written["embeddings.register_tokens"])
    np.testing.assert_allclose(encoder.get_layer("block2_mlp_up").kernel, written["layer.1.mlp.up_proj.weight"].T)
    np.testing.assert_allclose(encoder.get_layer("norm").gamma, written["norm.weight"])


@pytest.mark.slow
def test_position_keys_reach_the_runs_model(tmp_path):
    """model.position_grid and model.position_resize through a config file (TrainState): EoMT's DINOv2 ViT-S
    with a 3 x 3 position table, and a DINOv2 ViT-S resizing as torch does. Fails for: either key dropped (40 x 40
    positions; TensorFlow's resize, the default of dinov2_vits14)."""
    from seg_train.run.state import TrainState

    config = _config(tmp_path, "data", {"backbone": "dinov2_vits16_reg", "head": "eomt", "num_queries": 4,
                                        "position_grid": 3})
    tokens = TrainState(config_lib.load(config), strategy(1), optimizer=False).model.backbone.get_layer("tokens")
    assert tuple(tokens.position_embeddings.shape) == (1, 9, 384) and tokens.torch_bicubic
    raw = yaml.safe_load(config.read_text())
    raw["model"] = {"backbone": "dinov2_vits14", "head": "linear", "position_resize": "torch"}
    raw["data"]["crop_size"] = [28, 28]
    config.write_text(yaml.safe_dump(raw))
    state = TrainState(config_lib.load(config), strategy(1), optimizer=False)
    tokens = state.model.get_layer("dinov2_vits14").get_layer("tokens")
    assert tokens.torch_bicubic and tuple(tokens.position_embeddings.shape) == (1, 1 + 37 * 37, 384)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["architecture", "missing", "shape", "config"])
def test_command_refuses_a_mismatched_folder(tmp_path, demo, kind):
    """seg-train --config with a folder that does not fit: exit code 2, one error line naming it, no run dir.
    Fails for: the refusal after the run dir was written, a traceback, a half-loaded model trained on."""
    layout = transformers_layout("DINOv3ViTModel")
    model = {"head": "linear", "backbone_weights": "vit"}
    if kind == "architecture":  # an EoMT folder given as the backbone's
        layout = transformers_layout("EomtDinov3ForUniversalSegmentation")
    write_transformers_folder(tmp_path / "vit", layout, drop={"missing": ["layer.1.norm2.bias"]}.get(kind, ()),
                              config={"hidden_size": 768} if kind == "config" else None,
                              shapes={"layer.0.attention.k_proj.weight": [32, 31]} if kind == "shape" else None)
    rc, err = _train(_config(tmp_path, demo, model))
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert rc == 2 and len(lines) == 1, err
    assert {"architecture": "transformers folder of another architecture",
            "missing": "'layer.1.norm2.bias' of shape [32] for block2_norm2/beta",
            "shape": "'layer.0.attention.k_proj.weight' of shape [32, 32] for block1_attn_k/kernel, got [32, 31]",
            "config": "(model.backbone): hidden_size 32 (dinov3_vits16's), got 768"}[kind] in lines[0], lines[0]
    assert "Traceback" not in err and not (tmp_path / "run").exists()

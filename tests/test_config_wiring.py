"""Every config key reaches the code that uses it.

A key can be read, validated and documented, then dropped between the config and the code: the schedule's
own tests call lr_at(step, base, total, power, warmup) with their own numbers, so a run that never passed
train.lr_power on would still pass them. Each key here is held THROUGH what a user runs (the seg-train
command, TrainState/TrainStep built from a config file, the strategy the commands build) to an outside
reference, and each test fails when its key is replaced by its default. WIRED below maps every key of
the config to the test that does that, or to the reason it cannot be observed on this machine;
test_every_documented_key_is_wired keeps the map complete as keys are added.

The tests of this file:
- one real run of the seg-train command (`run`, 2 towers, 6 steps, a dozen non-default keys), read back
  from disk: TensorBoard's EventAccumulator for the learning rate of every step (against the poly +
  warmup formula worked out by hand from the config's numbers), the steps that carry scalars, pictures
  and evaluations, the step-1 tower losses (against numpy's weighted, top-k cross-entropy of the model
  built from the config's seed, on the reader's first batch, with sqrt median-frequency weights counted
  by numpy from the label files), the step-1 weight decay, the clipped flags, the checkpoint files and
  their shapes, best/ holding the moving average, the profile (and in it the op determinism);
- TrainStep built from a config file: the clipping of a plain SGD step against TF autodiff (a norm below
  the bound passes unchanged, one above is scaled to exactly the bound), the configured losses against
  numpy (Dice; a cross-entropy + Lovász sum with OHEM), the traced step's XLA attribute and all-reduce
  count;
- TrainState built from a config file: the model's layers (widths, strides, BN momentum and classes,
  frozen BN, dilated-conv classes, the head, the backbone);
- the strategy the commands build from train.allreduce / train.allreduce_num_packs, and the command
  refusing what CPU towers cannot do.
"""

import io
import os
import re
import subprocess
import sys
from contextlib import redirect_stderr
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf
import yaml
from PIL import Image

from seg_train import cli, models
from seg_train import config as config_lib
from seg_train.config.schema import leaf_fields
from seg_train.data import synthetic
from seg_train.models.sync_bn import SyncBatchNormalization
from seg_train.parallel import replicas
from seg_train.run.state import TrainState
from seg_train.train.step import TrainStep
from tests.helpers import WIRED_DATA, dice_numpy, lovasz_numpy, random_batch, softmax64, tiny_config

ROOT = Path(__file__).resolve().parents[1]

# ---- WIRED: every config key (the dataclasses' leaf keys) -> its wiring test, or why it cannot be observed --------
# "key": "test_name" (a test of this file), "tests/<file>.py::<test_name>" (a test of another file; it builds its
# config through the config file or the command too), or "unobservable: <reason>". Each named test fails when
# the key is replaced by its default (scripts/mutants.yaml holds the mutants that show it).
WIRED = {
    # -- top level, model.*, train.*, loss.* -----------------------------------------------------------------
    "seed": "test_run_step1_tower_losses_are_numpys_on_the_first_batch",
    "run_dir": "test_run_checkpoints_kept_and_their_steps",
    "model.backbone": "test_model_keys_shape_the_deeplab_model",
    "model.head": "test_model_keys_shape_the_lraspp_model",
    "model.output_stride": "test_model_keys_shape_the_deeplab_model",
    "model.sync_batchnorm": "test_model_keys_shape_the_lraspp_model",
    "model.bn_momentum": "test_model_keys_shape_the_deeplab_model",
    "model.weight_decay": "test_run_step1_weight_decay_is_numpys_of_the_seeded_model",
    # (a transformers DINOv3 folder through a config file: tests/test_transformers_weights.py::
    # test_backbone_folder_reaches_the_runs_model)
    "model.backbone_weights": "test_backbone_weights_reach_the_runs_model",
    "model.aspp_channels": "test_run_model_has_the_configured_widths",
    "model.decoder_channels": "test_run_model_has_the_configured_widths",
    "model.low_level_channels": "test_run_model_has_the_configured_widths",
    "model.lraspp_channels": "test_model_keys_shape_the_lraspp_model",
    "model.decoder_stride": "test_run_model_has_the_configured_widths",
    "model.fine_low_level_channels": "test_run_model_has_the_configured_widths",
    "model.fine_channels": "test_run_model_has_the_configured_widths",
    "model.fused_batchnorm": "test_model_keys_shape_the_deeplab_model",
    "model.freeze_batchnorm": "test_model_keys_shape_the_deeplab_model",
    "model.fast_atrous": "test_model_keys_shape_the_deeplab_model",
    "train.num_steps": "test_run_learning_rate_of_every_step_is_the_formulas",
    "train.learning_rate": "test_run_learning_rate_of_every_step_is_the_formulas",
    "train.lr_power": "test_run_learning_rate_of_every_step_is_the_formulas",
    "train.warmup_steps": "test_run_learning_rate_of_every_step_is_the_formulas",
    "train.optimizer": "tests/test_optimizer_reference.py::test_weights_and_slots_match_keras",
    "train.momentum": "tests/test_optimizer_reference.py::test_weights_and_slots_match_keras",
    "train.checkpoint_every": "test_run_checkpoints_kept_and_their_steps",
    "train.keep_checkpoints": "test_run_checkpoints_kept_and_their_steps",
    "train.summary_every": "test_run_summary_image_and_eval_steps",
    "train.image_summary_every": "test_run_summary_image_and_eval_steps",
    "train.deterministic": "test_run_profile_of_the_asked_step_traced_with_op_determinism",
    "train.on_nan": "tests/test_robustness.py::test_nonfinite_loss_skip_step_continues",
    "train.eval_every": "test_run_summary_image_and_eval_steps",
    "train.precision": "tests/test_robustness.py::test_mixed_float16_step_applied_and_loss_scale_shown",
    # (with EoMT, its forward compiled: tests/test_eomt_train.py::
    # test_eomt_jit_compile_compiles_the_forward_and_its_gradient)
    "train.jit_compile": "test_traced_step_xla_and_all_reduce_packs",
    "train.allreduce": "test_allreduce_keys_reach_the_strategy",
    "train.allreduce_pack_mb": "test_traced_step_xla_and_all_reduce_packs",
    "train.allreduce_num_packs": "test_allreduce_keys_reach_the_strategy",
    "train.accumulate_steps": "test_run_step1_tower_losses_are_numpys_on_the_first_batch",
    "train.recompute": "tests/test_recompute.py::test_recompute_key_reaches_the_model",
    "train.clip_global_norm": "test_clip_passes_a_norm_below_the_bound_and_scales_one_above_to_it",
    "train.ema_decay": "test_run_evaluates_and_keeps_the_ema_weights",
    "train.collective_timeout": "unobservable: it only bounds a collective whose peer is alive but silent; a peer "
                                "that dies is caught by TensorFlow's health checks within seconds "
                                "(tests/test_multiworker.py::test_dead_worker_stops_the_other), and a hung peer "
                                "would cost the suite the timeout itself",
    "train.backbone_lr_multiplier":
        "tests/test_gradients.py::test_backbone_lr_multiplier_scales_only_the_backbone_step",
    "train.profile_steps": "test_run_profile_of_the_asked_step_traced_with_op_determinism",
    "loss.class_weights": "test_run_step1_tower_losses_are_numpys_on_the_first_batch",
    "loss.top_k_percent_pixels": "test_run_step1_tower_losses_are_numpys_on_the_first_batch",
    "loss.type": "test_loss_keys_reach_the_step",
    "loss.terms": "test_loss_keys_reach_the_step",
    "loss.ohem_threshold": "test_loss_keys_reach_the_step",
    "loss.ohem_min_kept": "test_loss_keys_reach_the_step",
    "model.segformer_channels": "test_segformer_channels_shape_the_segformer_head",
    # A keras-hub SegFormer preset loaded through the config (TrainState): keras-hub's own logits, which a
    # model built without the preset (random weights) cannot give.
    # (a transformers EoMT folder through the seg-train command: tests/test_transformers_weights.py::
    # test_run_starts_from_an_eomt_folder)
    "model.init_weights":
        "tests/test_presets.py::test_segformer_preset_gives_keras_hubs_levels_and_logits_classifier_kept",
    # TrainState from a config file: EoMT's DINOv2 position table at the configured grid, the torch resize flag.
    "model.position_grid": "tests/test_transformers_weights.py::test_position_keys_reach_the_runs_model",
    "model.position_resize": "tests/test_transformers_weights.py::test_position_keys_reach_the_runs_model",
    # TrainState from a config file: the MiT's DropPath layers at keras-hub's rate for each block, and the head's
    # dropout; the masks they draw in the step are tests/test_segformer.py's 4-towers test (with vs without).
    "model.vit_layers": "tests/test_vit_wiring.py::test_vit_layers_and_neck_channels_reach_the_model",
    "model.neck": "unobservable: its one value, simple_pyramid, is also what a per-pixel head on a ViT gets without "
                  "it; the pyramid's layers in the run's model are "
                  "tests/test_vit_wiring.py::test_vit_layers_and_neck_channels_reach_the_model's",
    "model.neck_channels": "tests/test_vit_wiring.py::test_vit_layers_and_neck_channels_reach_the_model",
    "model.freeze_backbone": "tests/test_vit_wiring.py::test_frozen_backbone_has_no_gradient_no_slots_and_stays_put",
    # A config file through TrainState, seg-export's SavedModel and its TFLite file, with each form.
    "model.attention": "tests/test_attention.py::test_attention_key_reaches_the_run_and_its_exports",
    "train.layer_decay": "tests/test_vit_wiring.py::test_layer_decay_rates_are_the_hand_table",
    "model.num_queries": "tests/test_eomt_train.py::test_step_loss_is_eomt_loss_of_the_predictions",
    "model.eomt_blocks": "tests/test_eomt_train.py::test_step_loss_is_eomt_loss_of_the_predictions",
    "loss.mask_points": "tests/test_eomt_train.py::test_step_loss_is_eomt_loss_of_the_predictions",
    "train.mask_annealing": "tests/test_eomt_train.py::test_step_loss_is_eomt_loss_of_the_predictions",
    "train.backbone_warmup_steps":
        "tests/test_two_stage_warmup.py::test_run_moves_each_part_only_from_its_first_nonzero_rate",
    "model.drop_path_rate": "tests/test_stochastic.py::test_drop_path_rate_and_head_dropout_reach_the_model",
    "model.head_dropout": "tests/test_stochastic.py::test_drop_path_rate_and_head_dropout_reach_the_model",
    # Three TrainStep updates built from a config file (AdamW at decay 0.5, the head at 10x) held to Keras' AdamW:
    # the default decay (0.01) or head multiplier (1) would move the weights elsewhere.
    "train.weight_decay": "tests/test_optimizer_reference.py::test_weights_and_slots_match_keras",
    "train.head_lr_multiplier": "tests/test_optimizer_reference.py::test_weights_and_slots_match_keras",
}
# data.* and eval.*: their tests and entries are in tests/test_config_wiring_data.py.
WIRED.update(WIRED_DATA)


def documented_keys() -> list[str]:
    """Every key a user can write, read from the config's dataclasses (docs/CONFIG.md is rendered from them)."""
    return list(leaf_fields())


def test_every_documented_key_is_wired():
    keys = documented_keys()
    assert {"seed", "train.lr_power", "loss.ohem_min_kept", "model.fast_atrous", "data.root"} <= set(keys)
    missing = [k for k in keys if k not in WIRED]
    assert not missing, f"config keys with neither a wiring test nor a reason in WIRED: {missing}"
    assert not set(WIRED) - set(keys), f"WIRED names keys the config does not have: {set(WIRED) - set(keys)}"
    here = Path(__file__).read_text()
    for key, entry in WIRED.items():
        if entry.startswith("unobservable: "):
            assert len(entry) > 40, (key, "say why")
            continue
        path, _, name = entry.rpartition("::")
        name = re.sub(r"\[.*\]$", "", name)  # a parametrised test's id
        source = (ROOT / path).read_text() if path else here
        assert re.search(rf"^def {re.escape(name)}\(", source, re.M), f"{key}: no test {entry}"


# ---- one real run of the command ---------------------------------------------------------------------------
SEED, TOWERS, BATCH, K_MICRO, CROP, CLASSES = 3, 2, 4, 2, 32, 3
BASE_LR, POWER, WARMUP, STEPS = 0.02, 2.0, 3, 6
CLIP, WEIGHT_DECAY, TOP_K = 0.5, 0.003, 0.6
WIDTHS = {"aspp_channels": 6, "decoder_channels": 5, "low_level_channels": 3, "fine_low_level_channels": 2,
          "fine_channels": 7}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """seg-train on 2 towers with a non-default value for every key it can show in 6 steps."""
    tmp = tmp_path_factory.mktemp("wired")
    root = synthetic.generate(tmp / "demo", num_train=12, num_val=4, size=(40, 48), num_classes=CLASSES)
    raw = {"seed": SEED, "run_dir": "out/wired",
           "data": {"root": str(root), "num_classes": CLASSES, "batch_size": BATCH, "crop_size": [CROP, CROP],
                    "num_parallel_calls": 2},
           "model": {"backbone": "tiny", "weight_decay": WEIGHT_DECAY, "decoder_stride": 2, **WIDTHS},
           "train": {"num_steps": STEPS, "learning_rate": BASE_LR, "lr_power": POWER, "warmup_steps": WARMUP,
                     "checkpoint_every": 2, "keep_checkpoints": 2, "summary_every": 1, "image_summary_every": 4,
                     "eval_every": 4, "accumulate_steps": K_MICRO, "clip_global_norm": CLIP, "deterministic": True,
                     "profile_steps": [2, 2], "ema_decay": 0.6},
           "loss": {"class_weights": "sqrt_median_frequency", "top_k_percent_pixels": TOP_K},
           "eval": {"bn_reestimate_batches": 1}}
    (tmp / "cfg.yaml").write_text(yaml.safe_dump(raw))
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    r = subprocess.run([sys.executable, "-m", "seg_train.cli", "--config", "cfg.yaml", "--gpus", str(TOWERS)],
                       cwd=tmp, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(tmp / "out" / "wired"), size_guidance={"tensors": 0})
    acc.Reload()
    return {"tmp": tmp, "dir": tmp / "out" / "wired", "root": root, "log": r.stderr, "acc": acc,
            "cfg": config_lib.load(tmp / "cfg.yaml")}


def _events(run, tag) -> dict[int, float]:
    return {e.step: float(tf.make_ndarray(e.tensor_proto)) for e in run["acc"].Tensors(tag)}


@pytest.mark.slow
def test_run_learning_rate_of_every_step_is_the_formulas(run):
    """Update k (0-based, logged at step k + 1): base * (k + 1) / warmup during the warmup, then
    base * (1 - k / num_steps) ** power, from the config's numbers. Dropped on the way to the step:
    the power (0.9: step 4 logs 0.0107, not 0.005), the warmup (step 1 logs 0.02), the base rate
    (1e-3), num_steps (30000: hardly any decay)."""
    want = [BASE_LR * (k + 1) / WARMUP if k < WARMUP else BASE_LR * (1 - k / STEPS) ** POWER for k in range(STEPS)]
    assert want[:4] == pytest.approx([0.02 / 3, 0.04 / 3, 0.02, 0.005])
    got = _events(run, "learning_rate")
    assert sorted(got) == list(range(1, STEPS + 1))
    np.testing.assert_allclose([got[s] for s in range(1, STEPS + 1)], want, rtol=1e-6)


@pytest.mark.slow
def test_run_summary_image_and_eval_steps(run):
    """summary_every 1: scalars at every step (20: only at the last); image_summary_every 4: pictures at
    the first step and step 4 (500: the first only); eval_every 4: evaluations at 4 and 6 (0: the end only)."""
    assert sorted(_events(run, "loss/total")) == list(range(1, STEPS + 1))
    assert sorted(e.step for e in run["acc"].Tensors("tower_0/triplet")) == [1, 4]
    assert sorted(_events(run, "eval/miou")) == [4, 6]


@pytest.mark.slow
def test_run_evaluates_and_keeps_the_ema_weights(run):
    """train.ema_decay: evaluation during training uses the moving average, so best/ (the best evaluation,
    at step 4 or 6) holds, variable for variable, the average that the same step's training checkpoint
    holds (written after the evaluation), not the training weights. Evaluating the training weights (the
    average kept but not swapped in), or no average at all, fails."""
    step = yaml.safe_load((run["dir"] / "best" / "best.json").read_text())["step"]
    assert step in (4, 6)
    best = tf.train.load_checkpoint(str(run["dir"] / "best" / f"ckpt-{step}"))
    kept = [best.get_tensor(k) for k in best.get_variable_to_shape_map() if k.endswith("VARIABLE_VALUE")]
    ckpt = tf.train.load_checkpoint(str(run["dir"] / "checkpoints" / f"ckpt-{step}"))
    names = ckpt.get_variable_to_shape_map()
    ema = [ckpt.get_tensor(k) for k in names if k.startswith("ema/") and k.endswith("VARIABLE_VALUE")]
    weights = [ckpt.get_tensor(k) for k in names if k.startswith("optimizer/_trainable_variables/")]
    assert len(ema) == len(weights) > 20

    def held(x, arrays):
        return any(a.shape == x.shape and np.array_equal(a, x) for a in arrays)

    assert all(held(e, kept) for e in ema)
    assert sum(held(w, kept) for w in weights) < len(weights) // 2  # the average is not the weights


@pytest.mark.slow
def test_run_checkpoints_kept_and_their_steps(run):
    """In the configured run_dir (relative to the config file), checkpoints every 2 steps (2, 4, 6), the
    newest 2 kept: 4 and 6 on disk (keep 3: 2 too; every 1000: only 6)."""
    ckpts = run["dir"] / "checkpoints"
    assert sorted(int(p.name[5:-6]) for p in ckpts.glob("ckpt-*.index")) == [4, 6]
    state = tf.train.get_checkpoint_state(str(ckpts))
    assert [Path(p).name for p in state.all_model_checkpoint_paths] == ["ckpt-4", "ckpt-6"]
    assert (run["dir"] / "config.yaml").is_file() and not (run["tmp"] / "runs").exists()


@pytest.mark.slow
def test_run_model_has_the_configured_widths(run):
    """The run's checkpoint holds the head the config asks for: ASPP 6 wide, decoder 5, low-level
    projection 3, the stride-2 stage (model.decoder_stride: 2) with its projection 2 and convs 7 wide
    (defaults 256, 256, 48; no stage; 24, 32). Read from the checkpoint file, not from a rebuilt model."""
    shapes = [tuple(s) for _, s in tf.train.list_variables(str(run["dir"] / "checkpoints" / "ckpt-6"))]
    kernels = {(s[0], s[1], s[3]) for s in shapes if len(s) == 4}
    for k, width in [(1, 6), (3, 6), (3, 5), (1, 3), (1, 2), (3, 7)]:
        assert (k, k, width) in kernels, (k, width, sorted(kernels))
    # the logits read the fine stage's 7 channels: [1, 1, 7, classes]
    assert (1, 1, 7, CLASSES) in shapes


def _first_batch(cfg):
    """The reader's first training batch of the run, per tower, as train.py distributes it. The reader is
    made from its parts with the config's seed, not through the front door (split.open_split): a front
    door that dropped the seed would give this reference the same wrong stream as the run."""
    from seg_train.data import labels as labels_lib
    from seg_train.data import layouts
    from seg_train.data.reader import ImageReader

    strategy = replicas.make_strategy(replicas.Devices([f"/device:CPU:{i}" for i in range(TOWERS)], "CPU", ""))
    split = cfg.data.train_split
    reader = ImageReader(cfg.data, split, cfg.seed, layouts.list_samples(cfg.data, split),
                         labels_lib.label_table(cfg.data))
    dist = strategy.distribute_datasets_from_function(lambda ctx: reader.train_dataset(
        cfg.data.batch_size, 0, ctx.num_replicas_in_sync, ctx.input_pipeline_id, ctx.num_input_pipelines,
        micro_batches=cfg.train.accumulate_steps))
    images, labels = next(iter(dist))
    local = strategy.experimental_local_results
    return [(x.numpy(), y.numpy()) for x, y in zip(local(images), local(labels))]


def _sqrt_median_frequency(root: Path) -> np.ndarray:
    """SegNet's weights, square-rooted, from the train split's label PNGs counted with numpy (docs/GUIDE.md,
    "Loss options")."""
    ids = (root / "ImageSets" / "Segmentation" / "train.txt").read_text().split()
    class_px, image_px = np.zeros(CLASSES), np.zeros(CLASSES)
    for i in ids:
        label = np.array(Image.open(root / "SegmentationClass" / f"{i}.png"))
        labelled = label[label != 255]
        for c in range(CLASSES):
            n = np.sum(labelled == c)
            class_px[c] += n
            image_px[c] += labelled.size if n else 0
    freq = class_px / image_px
    return np.sqrt(np.median(freq) / freq)


def _weighted_top_k(logits, labels, weights, top_k):
    """Per image: the round(top_k * valid) pixels of largest weighted cross-entropy (halves up, at least one);
    returns (their weighted loss sum, their weight sum), summed over the images."""
    total = norm = 0.0
    for z, y in zip(np.asarray(logits, np.float64), labels):
        valid = y.reshape(-1) != 255
        yv = y.reshape(-1)[valid].astype(int)
        p = softmax64(z.reshape(-1, z.shape[-1]))[valid]
        w = weights[yv]
        loss = -np.log(p[np.arange(yv.size), yv]) * w
        keep = max(int(np.floor(yv.size * top_k + 0.5)), 1)
        order = np.argsort(-loss, kind="stable")[:keep]
        total += loss[order].sum()
        norm += w[order].sum()
    return total, norm


@pytest.mark.slow
def test_run_step1_tower_losses_are_numpys_on_the_first_batch(run):
    """loss/tower_i at step 1 is tower i's cross-entropy before any update: the model built from the
    config's seed (Keras' forward pass in training mode, each micro-batch with its own BN batch
    statistics), on tower i's share of the reader's first batch (train.accumulate_steps: 2 micro-batches
    of 2 images), weighted by the square-rooted median-frequency weights numpy counts from the label
    files, top 60% of each image's pixels, divided by the kept pixels' weight sum; all in numpy.
    Dropped on the way: the seed (other weights and other images), the class weights, top-k, the
    micro-batches (one batch of 4, or micro-batches of 1 image)."""
    cfg = run["cfg"]
    weights = _sqrt_median_frequency(run["root"])
    model = models.build(cfg.model, CLASSES, cfg.seed)
    got = _events(run, "loss/tower_0")[1], _events(run, "loss/tower_1")[1]
    per_tower = BATCH // TOWERS
    for tower, (images, labels) in enumerate(_first_batch(cfg)):
        assert images.shape[0] == K_MICRO * per_tower
        total = norm = 0.0
        for m in range(K_MICRO):
            rows = slice(m * per_tower, (m + 1) * per_tower)
            logits = model(images[rows], training=True).numpy()
            s, n = _weighted_top_k(logits, labels[rows], weights, TOP_K)
            total, norm = total + s, norm + n
        np.testing.assert_allclose(got[tower], total / norm, rtol=1e-4, err_msg=f"tower {tower}")
    # the weights were the square-rooted ones (1 for the median class), not the full ones
    assert np.sort(weights)[1] == pytest.approx(1.0) and weights.max() / weights.min() > 1.5


@pytest.mark.slow
def test_run_step1_weight_decay_is_numpys_of_the_seeded_model(run):
    """loss/weight_decay at step 1: 0.5 * model.weight_decay * the squared kernels (conv and dense) of the
    model the seed builds, before the first update (4e-5, the default, gives 75 times less)."""
    model = models.build(run["cfg"].model, CLASSES, SEED)
    squares = sum(float(np.sum(np.square(np.asarray(v, np.float64)))) for v in model.trainable_variables
                  if v.path.split("/")[-1] in ("kernel", "depthwise_kernel", "pointwise_kernel"))
    np.testing.assert_allclose(_events(run, "loss/weight_decay")[1], 0.5 * WEIGHT_DECAY * squares, rtol=1e-5)


@pytest.mark.slow
def test_run_clipped_flag_is_the_norm_above_the_bound(run):
    """gradients/clipped is 1 exactly at the steps whose (pre-clipping) global norm exceeds 0.5."""
    norms, clipped = _events(run, "gradients/global_norm"), _events(run, "gradients/clipped")
    assert sorted(clipped) == list(range(1, STEPS + 1))
    assert {s: float(norms[s] > CLIP) for s in norms} == clipped
    assert any(clipped.values())


@pytest.mark.slow
def test_run_profile_of_the_asked_step_traced_with_op_determinism(run):
    """train.profile_steps [2, 2]: one trace, of step 2. train.deterministic: TensorFlow's op determinism was on
    when the step was traced (the run reads it back from TensorFlow and logs it; the per-pixel loss's ops are
    the same either way, pixel_losses.softmax_cross_entropy)."""
    profiles = list((run["dir"] / "plugins" / "profile").glob("*/*.xplane.pb"))
    assert len(profiles) == 1, profiles
    data = profiles[0].read_bytes()
    assert b"step_num" in data  # the step marker of seg_train/train/profiling.py
    assert "profiling steps 2..2 (train.profile_steps)" in run["log"]
    assert "op determinism on when the step was traced (train.deterministic)" in run["log"]


# ---- TrainStep and TrainState built from a config file ----------------------------------------------------
def _strategy(n):
    return replicas.make_strategy(replicas.Devices([f"/device:CPU:{i}" for i in range(n)], "CPU", ""))


def _one_tower_batch(strategy, images, labels):
    return next(iter(strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensors((images, labels)))))


def _tape_gradient(model, images, labels, weight_decay):
    """TF autodiff of the mean cross-entropy over the valid pixels (written out: log-softmax at the label)
    plus 0.5 * weight_decay * |kernels|^2, at the model's current weights."""
    variables = model.trainable_variables
    valid = labels != 255
    onehot = tf.one_hot(np.where(valid, labels, 0), model.output_shape[-1]) * valid[..., None]
    with tf.GradientTape() as tape:
        logits = model(images, training=True)
        ce = -tf.reduce_sum(onehot * tf.nn.log_softmax(logits)) / float(valid.sum())
        decay = tf.add_n([tf.reduce_sum(tf.square(v)) for v in variables if v.path.endswith("kernel")])
        loss = ce + 0.5 * weight_decay * decay
    return [g.numpy().astype(np.float64) for g in tape.gradient(loss, variables)]


def test_clip_passes_a_norm_below_the_bound_and_scales_one_above_to_it(tmp_path):
    """One plain SGD step (momentum 0: w -= lr * gradient) through TrainStep, with train.clip_global_norm
    1.25 and 0.8 times the update's gradient norm (TF autodiff on the same weights and batch). Below the
    bound the step is -lr * the tape's gradient, unscaled (the wrong answer: scaled up to the bound, 1.25
    times too far); above it, -lr * gradient * bound / norm, a move of exactly lr * bound. Without the key
    (null) the second step would be 1.25 times too long."""
    lr, wd = 0.5, 0.01
    images, labels = random_batch(ignore_rows=[20, 0, 5, 0])
    first = tiny_config(tmp_path / "ref", model={"weight_decay": wd})
    grads = _tape_gradient(models.build(first.model, CLASSES, first.seed), images, labels, wd)
    norm = float(np.sqrt(sum(np.sum(g * g) for g in grads)))
    for factor in (1.25, 0.8):
        bound = factor * norm
        cfg = tiny_config(tmp_path / str(factor), model={"weight_decay": wd},
                          train={"optimizer": "sgd", "momentum": 0.0, "clip_global_norm": bound})
        step = TrainStep(TrainState(cfg, _strategy(1)))
        before = [v.numpy().astype(np.float64) for v in step.state.model.trainable_variables]
        out = step(_one_tower_batch(step.state.strategy, images, labels), lr=lr)
        moved = [(v.numpy() - w) / -lr for v, w in zip(step.state.model.trainable_variables, before)]
        scale = 1.0 if factor > 1 else bound / norm
        assert bool(out.clipped) == (factor < 1)
        np.testing.assert_allclose(float(out.global_norm), norm, rtol=1e-4)
        for v, got, g in zip(step.state.model.trainable_variables, moved, grads):
            np.testing.assert_allclose(got, scale * g, rtol=2e-3, atol=2e-6, err_msg=f"{v.path} ({factor} x norm)")
        if factor < 1:
            np.testing.assert_allclose(np.sqrt(sum(np.sum(m * m) for m in moved)), bound, rtol=1e-3)


def test_loss_keys_reach_the_step(tmp_path):
    """The loss of a step (TrainStep.probe, 1 tower) against numpy on the logits of the same model:
    loss.type: dice alone is the valid-pixel-weighted mean over images of each image's soft Dice loss;
    loss.terms [cross_entropy 0.5, lovasz 2.0] with loss.ohem_threshold t and loss.ohem_min_kept m is
    (0.5 * the kept pixels' cross-entropy + 2.0 * sum_i n_i Lovasz_i) / sum_i n_i, n_i image i's kept
    pixels: those with true-class probability below t, at least the m of lowest probability. t and m
    are chosen from the logits so that each matters (t keeps about a third, m about half of each image)."""
    classes = 4
    images, labels = random_batch(num_classes=classes, ignore_rows=[20, 0, 5, 0])
    dice_cfg = tiny_config(tmp_path / "dice", data={"num_classes": classes}, loss={"type": "dice"})
    dice = TrainStep(TrainState(dice_cfg, _strategy(1)))
    batch = _one_tower_batch(dice.state.strategy, images, labels)
    logits = dice.state.model(images, training=True).numpy().astype(np.float64)
    valid = (labels != 255).reshape(len(labels), -1).sum(axis=1).astype(np.float64)
    per_image, _ = dice_numpy(logits, labels)
    np.testing.assert_allclose(float(dice.probe(batch).loss), (valid * per_image).sum() / valid.sum(), rtol=1e-5)

    probs = [softmax64(z.reshape(-1, classes))[y.reshape(-1) != 255] for z, y in zip(logits, labels)]
    truth = [p[np.arange(len(p)), y.reshape(-1)[y.reshape(-1) != 255].astype(int)] for p, y in zip(probs, labels)]
    threshold = float(np.quantile(np.concatenate(truth), 0.33))
    min_kept = int(valid.min() // 2)
    kept_ce, kept, below = [], [], []
    for p in truth:
        order = np.argsort(p, kind="stable")
        keep = np.zeros(p.size, bool)
        keep[order[:min(min_kept, p.size)]] = True
        keep |= p < threshold
        kept_ce.append(-np.log(p[keep]).sum())
        kept.append(keep.sum())
        below.append(np.sum(p < threshold))
    kept, below = np.array(kept, np.float64), np.array(below)
    # Both keys change what is kept: the threshold drops pixels, min_kept brings some back.
    assert kept.sum() < 0.7 * valid.sum() and np.any(below < min_kept) and np.all(below > 0)
    lovasz, _ = lovasz_numpy(logits, labels)
    want = (0.5 * sum(kept_ce) + 2.0 * (kept * lovasz).sum()) / kept.sum()
    terms = [{"type": "cross_entropy", "weight": 0.5}, {"type": "lovasz", "weight": 2.0}]
    terms_cfg = tiny_config(tmp_path / "terms", data={"num_classes": classes},
                            loss={"terms": terms, "ohem_threshold": threshold, "ohem_min_kept": min_kept})
    terms = TrainStep(TrainState(terms_cfg, _strategy(1)))
    np.testing.assert_allclose(float(terms.probe(batch).loss), want, rtol=1e-5)


def test_traced_step_xla_and_all_reduce_packs(tmp_path):
    """The step traced from a config with train.jit_compile and train.allreduce_pack_mb 0.002 (packs of 2 KiB),
    on 2 towers: the tower function carries XLA's must-compile attribute, and the towers' gradients, BN
    statistics and scalars cross in more than 3 all-reduces (the default 32 MB: one pack of each), none
    of them over 0.002 MB (2097 bytes) unless it holds a single larger tensor."""
    cfg = tiny_config(tmp_path, train={"jit_compile": True, "allreduce_pack_mb": 0.002})
    step = TrainStep(TrainState(cfg, _strategy(2)))
    images, labels = random_batch()
    spec = step.state.strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensors((images, labels))).element_spec
    graph = step.concrete_function(spec).graph
    assert any(f.attr["_XlaMustCompile"].b for f in graph.as_graph_def().library.function
               if "_XlaMustCompile" in f.attr)
    # ReductionToOneDevice (CPU towers) sums each all-reduced tensor with one AddN on the first tower.
    sums = [int(np.prod(op.outputs[0].shape)) for op in graph.get_operations()
            if op.type == "AddN" and "cross_tower" in op.name]
    assert len(sums) > 3, sums
    single = {int(np.prod(v.shape)) for v in step.state.variables + step.state.bn_variables}
    assert all(n * 4 <= 0.002 * 2 ** 20 or n in single for n in sums), sums  # or one larger tensor alone
    assert sum(sums) > sum(int(np.prod(v.shape)) for v in step.state.variables)  # all of the gradient crossed


def test_model_keys_shape_the_deeplab_model(tmp_path):
    """TrainState from a config with non-default model keys: the tiny backbone (not MobileNetV2) at output
    stride 8 (its last features at 1/8 of the input, ASPP rates 12/24/36), every BN layer at momentum 0.7
    and of Keras' own class (model.fused_batchnorm: false), every dilated conv Keras' own Conv2D
    (model.fast_atrous: false), the backbone's BN layers frozen (not trainable, not updated by the step)
    and the head's training."""
    cfg = tiny_config(tmp_path, model={"output_stride": 8, "bn_momentum": 0.7, "fused_batchnorm": False,
                                       "fast_atrous": False, "freeze_batchnorm": True})
    state = TrainState(cfg, _strategy(1))
    backbone = models.backbone_of(state.model)
    assert {layer.name for layer in backbone.layers if layer.weights} >= {"stem_conv", "stage3b_conv"}
    low, high = backbone(np.zeros((1, 64, 64, 3), np.float32))
    assert tuple(high.shape[1:3]) == (8, 8) and tuple(low.shape[1:3]) == (16, 16)
    assert [tuple(state.model.get_layer(f"aspp{i}_conv").dilation_rate) for i in (1, 2, 3)] == \
        [(12, 12), (24, 24), (36, 36)]
    bn = models.batchnorm_layers(state.model)
    assert bn and {type(layer) for layer in bn} == {keras.layers.BatchNormalization}
    assert {layer.momentum for layer in bn} == {0.7}
    convs = [layer for layer in state.model._flatten_layers() if isinstance(layer, keras.layers.Conv2D)]
    dilated = [c for c in convs if tuple(c.dilation_rate) != (1, 1)]
    assert len(dilated) >= 4 and {type(c) for c in dilated} == {keras.layers.Conv2D}
    frozen = models.batchnorm_layers(backbone)
    assert frozen and not any(layer.trainable for layer in frozen)
    head = [layer for layer in bn if layer not in frozen]
    assert head and all(layer.trainable for layer in head)
    assert len(state.bn_variables) == 2 * len(head)


def test_model_keys_shape_the_lraspp_model(tmp_path):
    """TrainState from a config with model.head: lraspp (5 wide, model.lraspp_channels) and
    model.sync_batchnorm: every BN layer, the backbone's too, is the synchronized one."""
    cfg = tiny_config(tmp_path, model={"head": "lraspp", "lraspp_channels": 5, "sync_batchnorm": True})
    state = TrainState(cfg, _strategy(1))
    names = {layer.name for layer in state.model.layers}
    assert "aspp0_conv" not in names and state.model.get_layer("lraspp_cbr_conv").filters == 5
    assert state.model.get_layer("lraspp_scale_conv").filters == 5
    bn = models.batchnorm_layers(state.model)
    assert len(bn) > 3 and all(isinstance(layer, SyncBatchNormalization) for layer in bn)


def test_segformer_channels_shape_the_segformer_head(tmp_path):
    """TrainState from a config with model.head: segformer and model.segformer_channels: 6: every level's
    projection, the fuse conv and the classifier's input are 6 wide (the default would be 256)."""
    cfg = tiny_config(tmp_path, model={"head": "segformer", "segformer_channels": 6})
    model = TrainState(cfg, _strategy(1), optimizer=False).model
    linear = [layer for layer in model.layers if layer.name.startswith("segformer_linear")]
    assert len(linear) >= 2 and all(layer.units == 6 for layer in linear)
    assert model.get_layer("segformer_fuse_conv").filters == 6
    assert model.get_layer("logits").kernel.shape == (1, 1, 6, CLASSES)


@pytest.mark.slow
def test_backbone_weights_reach_the_runs_model(tmp_path):
    """seg-train with model.backbone_weights on the tiny backbone (which has no ImageNet file) stops with
    the builder's one-line error: the path reached the model the run builds. Dropped on the way (the run
    building its model without the file), the run would train from random weights instead. That the
    file's values land in each layer is tests/test_backbone_weights.py's (models.build from the config)."""
    root = synthetic.generate(tmp_path / "demo", num_train=4, num_val=1, size=(40, 48), num_classes=CLASSES)
    (tmp_path / "w.h5").write_bytes(b"")
    cfg = tiny_config(tmp_path, root, model={"backbone_weights": "w.h5"}, train={"num_steps": 1})
    err = io.StringIO()
    with redirect_stderr(err):
        rc = cli.train_main(["--config", str(tmp_path / "config.yaml"), "--gpus", "1"])
    assert rc == 2, err.getvalue()
    assert "error: no pretrained weights for this backbone (model.backbone_weights)" in err.getvalue()
    assert cfg.model.backbone_weights == tmp_path / "w.h5"
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.slow
def test_allreduce_keys_reach_the_strategy(tmp_path):
    """The strategy every command builds (replicas.strategy_for) from a config's train.allreduce and
    train.allreduce_num_packs, on GPU towers: TensorFlow's HierarchicalCopyAllReduce / NcclAllReduce with
    that many packs (constructed, not run: there is no GPU here). On this machine's CPU towers the
    command refuses nccl and num_packs 2 naming the key (auto and reduction_to_one_device are the same
    ReductionToOneDevice there, and ring needs several workers)."""
    gpus = replicas.Devices(["/device:GPU:0", "/device:GPU:1"], "GPU", "")
    for allreduce, kind in (("hierarchical_copy", tf.distribute.HierarchicalCopyAllReduce),
                            ("nccl", tf.distribute.NcclAllReduce)):
        cfg = tiny_config(tmp_path / allreduce, train={"allreduce": allreduce, "allreduce_num_packs": 3})
        ops = replicas.strategy_for(cfg.train, gpus).extended._cross_device_ops
        assert type(ops) is kind and ops._num_packs == 3
    root = synthetic.generate(tmp_path / "demo", num_train=4, num_val=1, size=(40, 48), num_classes=CLASSES)
    tiny_config(tmp_path / "cmd", root)
    for override, line in [("train.allreduce=nccl", "error: invalid combination (train.allreduce): nccl needs GPUs"),
                           ("train.allreduce_num_packs=2", "error: invalid combination (train.allreduce_num_packs)")]:
        err = io.StringIO()
        with redirect_stderr(err):
            rc = cli.train_main(["--config", str(tmp_path / "cmd" / "config.yaml"), "--gpus", "2", "--set", override])
        assert rc == 2 and line in err.getvalue(), err.getvalue()

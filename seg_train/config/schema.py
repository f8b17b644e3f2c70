"""The config's keys: one frozen dataclass per section, each field with its default, its constraint and a
one-line doc (docs/CONFIG.md is rendered from these: seg_train/config/docs.py). No TensorFlow here."""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from seg_train.config.variants import BACKBONES


def _c(default=dataclasses.MISSING, *, doc, default_doc=None, check=None, path=False, url=False, choices=None,
       factory=None):
    """A config field: default, its one-line `doc` (what it is, its unit or allowed values), an optional
    check(value) -> error string or None, path, choices.

    `default_doc`: what a derived default derives from (shown in docs/CONFIG.md). A `path` is resolved
    against the config file's folder; with `url` it may be a URL, kept as a string (pathlib would mangle it).
    """
    meta = {"check": check, "path": path, "url": url, "choices": choices, "doc": doc, "default_doc": default_doc}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


def _positive(v):
    return None if v > 0 else "a positive number"


def _non_negative(v):
    return None if v >= 0 else "a number >= 0"


def _pair_positive(v):
    return None if all(x > 0 for x in v) else "two positive numbers"


def _scale_range(v):
    lo, hi = v
    return None if 0 < lo <= hi else "[lo, hi] with 0 < lo <= hi"


def _fraction(v):
    return None if 0 <= v < 1 else "a number in [0, 1)"


def _step_range(v):
    a, b = v
    return None if 1 <= a <= b else "[a, b] with 1 <= a <= b"


# data.photometric's keys and the largest value each may take (the field's doc gives the meaning).
PHOTOMETRIC_KEYS = {"brightness": 255.0, "contrast": 1.0, "saturation": 1.0, "hue": 90.0}


def _photometric(v):
    for key, value in v.items():
        if key not in PHOTOMETRIC_KEYS:
            return f"keys among {', '.join(PHOTOMETRIC_KEYS)} (got {key!r})"
        if not 0 < value <= PHOTOMETRIC_KEYS[key]:
            return f"{key} in (0, {PHOTOMETRIC_KEYS[key]:g}]"
    return None


def _label_value(v):
    return None if 0 <= v <= 255 else "an integer in [0, 255]"


@dataclass(frozen=True)
class DataConfig:
    root: Path = _c(check=None, path=True, url=True,
                    doc="the data set's folder in the layout data.layout names: a local path or a URL "
                        "(gs://, s3://, hdfs://) read through tf.io.gfile",
                    default_doc="required; with data.synthetic: data/<config name> in the current folder")
    layout: str = _c("voc", choices=("voc", "cityscapes", "ade20k", "pairs", "coco_panoptic"),
                     doc="how the files are laid out (docs/DATA.md, 'Layouts'); pairs: list files of `image label` "
                         "paths; coco_panoptic: COCO's panoptic JSON and PNGs")
    # Required unless the layout knows its classes (LAYOUT_LABELS); resolve_defaults fills it.
    num_classes: Optional[int] = _c(None, check=lambda v: None if 2 <= v <= 255 else "an integer in [2, 255]",
                                    doc="number of classes, 2..255 (cityscapes and ade20k: another value needs "
                                        "a data.label_map)",
                                    default_doc="required; cityscapes 19, ade20k 150")
    train_split: str = _c("train", doc="the training split's name, list file, or with data.format tfrecord "
                                       "shard prefix or glob")
    val_split: str = _c("val", doc="the validation split's name, list file, or shard prefix or glob")
    ignore_label: int = _c(255, check=_label_value, doc="label value left out of the loss and the metrics, 0..255")
    batch_size: int = _c(8, check=_positive, doc="the GLOBAL batch, split evenly across the towers")
    crop_size: tuple[int, int] = _c((321, 321), check=_pair_positive,
                                    doc="training crop [h, w] in pixels; smaller images are padded")
    random_scale: tuple[float, float] = _c((0.5, 2.0), check=_scale_range,
                                           doc="random rescale range [lo, hi] of each training image, "
                                               "0 < lo <= hi")
    random_mirror: bool = _c(True, doc="random left-right flip of the training crops")
    mean: Optional[tuple[float, float, float]] = _c(None, doc="RGB mean of the normalisation (x - mean) / std, "
                                                              "on 0..255",
                                                    default_doc="the backbone's")
    std: Optional[tuple[float, float, float]] = _c(None, check=_pair_positive,
                                                   doc="RGB std of the normalisation (x - mean) / std, positive",
                                                   default_doc="the backbone's")
    class_names: Optional[list[str]] = _c(None, doc="class names for tables and TensorBoard",
                                          default_doc="the layout's (cityscapes, ade20k), else classes.txt "
                                                      "in the root")
    synthetic: bool = _c(False, doc="generate the synthetic demo data set at data.root if it is not there")
    num_parallel_calls: int = _c(-1, check=lambda v: None if v == -1 or v > 0
                                 else "-1 (autotune) or a positive integer",
                                 doc="parallel decode/augment workers; -1: autotune")
    on_bad_sample: str = _c("error", choices=("error", "skip"),
                            doc="a bad sample (missing, unreadable, wrong size or values): error stops naming it, "
                                "skip drops it")
    cache: bool = _c(False, doc="keep each decoded image and label in memory after its first read "
                                "(about 4 bytes per pixel)")
    label_map: Optional[typing.Union[dict[int, int], list[int]]] = _c(
        None, doc="raw label value (0..255) -> train id or data.ignore_label, as a mapping or a list",
        default_doc="null (the layout's: cityscapes' labelIds -> train ids, ade20k's 0 ignored)")
    reduce_zero_label: bool = _c(False, doc="raw 0 -> data.ignore_label, k -> k - 1 (mmsegmentation's)")
    binary_threshold: Optional[int] = _c(None, check=lambda v: None if 1 <= v <= 255 else "an integer in [1, 255]",
                                         doc="T in 1..255: raw < T -> 0, raw >= T -> 1; needs "
                                             "data.num_classes 2")
    scan_cache: bool = _c(True, doc="keep the pre-training scan's result between runs while the files and "
                                    "settings are unchanged")
    scan_cache_dir: Optional[Path] = _c(None, path=True, doc="where the scan cache's entries go",
                                        default_doc="null: $XDG_CACHE_HOME/seg-train/scans, else "
                                                    "~/.cache/seg-train/scans")
    format: str = _c("files", choices=("files", "tfrecord"),
                     doc="image and label files, or TFRecord shards written by seg-prepare tfrecords")
    photometric: Optional[dict[str, float]] = _c(None, check=_photometric,
                                                 doc="colour jitter of the training crops, keys brightness "
                                                     "(0, 255], contrast, saturation (0, 1], hue (0, 90]; null: off")
    task: str = _c("semantic", choices=("semantic", "panoptic", "instance"),
                   doc="what a label holds: semantic (a class per pixel), panoptic or instance (a segment per "
                       "pixel: class and instance; docs/DATA.md, 'Panoptic and instance labels')")
    thing_classes: Optional[list[int]] = _c(None, check=lambda v: None if list(v) == sorted(set(v)) and all(
                                                i >= 0 for i in v) else "increasing train ids >= 0",
                                            doc="the train ids that are things (have instances), the others stuff; "
                                                "panoptic and instance tasks only",
                                            default_doc="the layout's: coco_panoptic's JSON (`isthing`), "
                                                        "cityscapes' 8 classes with instances")


@dataclass(frozen=True)
class ModelConfig:
    backbone: str = _c("mobilenetv2", choices=BACKBONES,
                       doc="the backbone; mit_b0..mit_b5: the Mix Transformer, SegFormer's encoder; dinov3_*, "
                           "dinov2_*: the DINO ViTs (patch 16 / 14; dinov2_vit*16_reg: EoMT's DINOv2 at patch 16)")
    head: str = _c("deeplabv3plus", choices=("deeplabv3plus", "lraspp", "segformer", "linear", "eomt"),
                   doc="the head: DeepLabV3+, Lite R-ASPP, SegFormer's all-MLP decoder, linear (BN + 1x1 conv "
                       "on a ViT's patch features, the DINO papers' protocol) or eomt (mask classification "
                       "inside a ViT's last blocks)")
    # None: the backbone's (default_output_stride); resolve_defaults fills it and checks it against the backbone.
    output_stride: Optional[int] = _c(None, choices=(8, 16, 32),
                                      doc="the backbone's output stride: 8 or 16 (dilated last stages); "
                                          "32 for mit_* (fixed); dinov*_: the neck's level the head reads "
                                          "last (8, 16, 32 = patch / 2, patch, 2 x patch)",
                                      default_doc="16; 32 for mit_* and for dinov*_ with head segformer")
    sync_batchnorm: bool = _c(False, doc="synchronized BN across the towers (else per-tower statistics, "
                                         "moving statistics averaged)")
    bn_momentum: float = _c(0.9, check=lambda v: None if 0 <= v < 1 else "a number in [0, 1)",
                            doc="momentum of every BN layer, in [0, 1)")
    # 0 with adamw: AdamW decays the weights itself (train.weight_decay), and the two must not stack unasked.
    weight_decay: Optional[float] = _c(None, check=_non_negative,
                                       doc="L2 coefficient on conv/dense kernels, added to the loss (adam, sgd); "
                                           "0 with adamw",
                                       default_doc="4e-5; 0 with train.optimizer adamw")
    backbone_weights: Optional[Path] = _c(None, path=True,
                                          doc="the backbone's Keras ImageNet .h5 file (mit_*: a keras-hub MiT "
                                              "preset directory; dinov*_: a keras-hub DINOv3 / DINOv2 preset "
                                              "directory, or a transformers DINOv3ViTModel / Dinov2Model / "
                                              "Dinov2WithRegistersModel folder)")
    aspp_channels: int = _c(256, check=_positive, doc="DeepLabV3+'s ASPP width")
    decoder_channels: int = _c(256, check=_positive, doc="DeepLabV3+'s decoder width")
    low_level_channels: int = _c(48, check=_positive, doc="DeepLabV3+'s projection width of the stride-4 features")
    # Why a stride-2 refinement stage: models/heads/deeplabv3plus.py.
    decoder_stride: int = _c(4, choices=(4, 2),
                             doc="DeepLabV3+'s last decoder stride: 4, or 2 with a refinement stage on "
                                 "stride-2 features")
    fine_low_level_channels: int = _c(24, check=_positive,
                                      doc="with decoder_stride 2: the stride-2 features' projection width")
    fine_channels: int = _c(32, check=_positive, doc="with decoder_stride 2: the width of the two 3x3 convs")
    lraspp_channels: int = _c(128, check=_positive, doc="LR-ASPP's width (its 1x1 conv and gate)")
    fused_batchnorm: bool = _c(True, doc="BN as TensorFlow's fused kernel with Keras' semantics (false: Keras' own)")
    fast_atrous: bool = _c(True, doc="dilated convs as one native dilated conv, padding-only taps dropped "
                                     "(exact; false: Keras' Conv2D)")
    freeze_batchnorm: bool = _c(False, doc="the backbone's BN layers in inference mode with their loaded "
                                           "statistics, gamma/beta frozen")
    # The SegFormer head's width C; None: the paper's for the backbone (default_segformer_channels).
    segformer_channels: Optional[int] = _c(None, check=_positive, doc="the SegFormer head's width C",
                                           default_doc="with head segformer: 256 (mit_b0, mit_b1, others), "
                                                       "768 (mit_b2..mit_b5)")
    init_weights: Optional[Path] = _c(None, path=True,
                                      doc="the whole model's start: a keras-hub SegFormer preset directory "
                                          "(head segformer), or a transformers EomtForUniversalSegmentation / "
                                          "EomtDinov3ForUniversalSegmentation folder (head eomt; its class head "
                                          "only when it has data.num_classes classes)")
    # Both drawn per sample (models/stochastic.py); None: filled by default_drop_path_rate, ...
    drop_path_rate: Optional[float] = _c(None, check=_fraction,
                                         doc="stochastic depth of the transformer blocks, in [0, 1): mit_* and "
                                             "dinov3_* rising to this at the last block, dinov2_* this in every "
                                             "block; not with model.freeze_backbone",
                                         default_doc="with mit_*: 0.1 (else null: none)")
    head_dropout: Optional[float] = _c(None, check=_fraction,
                                       doc="channel dropout before the SegFormer head's classifier, in [0, 1); "
                                           "segformer only",
                                       default_doc="with head segformer: 0.1 (else null: none)")
    # The ViT keys (models/dino/vit.py, models/dino/neck.py).
    vit_layers: Optional[list[int]] = _c(None, check=lambda v: None if v and all(i >= 1 for i in v) and
                                         list(v) == sorted(set(v)) else "increasing block numbers >= 1",
                                         doc="dinov*_: the blocks (1-based, increasing) whose patch tokens the "
                                             "head reads; the neck reads the last",
                                         default_doc="head linear: the last 4 evenly spaced (e.g. 3, 6, 9, 12); "
                                                     "with a neck: the last block")
    neck: Optional[str] = _c(None, choices=("simple_pyramid",),
                             doc="dinov*_: simple_pyramid (ViTDet's: 4 levels from the last block) under the "
                                 "deeplabv3plus, lraspp or segformer head",
                             default_doc="with dinov*_ and a head other than linear: simple_pyramid")
    neck_channels: int = _c(256, check=_positive, doc="the simple pyramid's width per level")
    num_queries: int = _c(100, check=_positive, doc="eomt: learned queries (masks predicted per image), at least "
                                                   "data.num_classes; the reference's 200 for ADE20K")
    eomt_blocks: int = _c(4, check=_positive, doc="eomt: the ViT's last blocks the queries go through")
    # DINOv2's learned positions (config/variants.py's ViTVariant.pos_grid, torch_bicubic); None: the backbone's own.
    position_grid: Optional[int] = _c(None, check=_positive,
                                      doc="dinov2_*: the side G of the learned G x G position table (resized to "
                                          "each input's patch grid); a transformers folder's image_size / "
                                          "patch_size",
                                      default_doc="37 (518 / 14) for dinov2_vit*14*, 40 (640 / 16) for EoMT's "
                                                  "dinov2_vit*16_reg")
    position_resize: Optional[str] = _c(None, choices=("tensorflow", "torch"),
                                        doc="dinov2_*: the bicubic resize of the position table to another grid: "
                                            "tensorflow (keras-hub's) or torch (transformers'; a transformers "
                                            "DINOv2 folder needs it)",
                                        default_doc="tensorflow for dinov2_vit*14*, torch for dinov2_vit*16_reg")
    freeze_backbone: bool = _c(False, doc="no gradient through the backbone: no backward pass, no optimizer "
                                          "slots, its BN in inference mode; its weights stay as loaded")
    # The same function either way; the default is models/attention.py's DEFAULT (docs/PERFORMANCE.md measured it).
    attention: str = _c("blockwise", choices=("plain", "blockwise"),
                        doc="dinov*_ (and eomt): softmax attention over blocks of keys, each block's maps recomputed "
                            "in the backward pass and none kept (blockwise), or as whole T x T maps kept for it "
                            "(plain: several times the memory at large inputs, less compute there)")


# train.allreduce_pack_mb's default (docs/PERFORMANCE.md, "packing", says why).
PACK_MB_DEFAULT = 32.0


@dataclass(frozen=True)
class TrainConfig:
    num_steps: int = _c(30000, check=_positive, doc="total steps (updates)")
    learning_rate: float = _c(1e-3, check=_positive, doc="base learning rate of the poly schedule")
    lr_power: float = _c(0.9, check=_non_negative, doc="poly power: lr = base * (1 - step / num_steps) ** power")
    warmup_steps: int = _c(0, check=_non_negative, doc="steps of linear warmup before the poly schedule")
    backbone_warmup_steps: int = _c(
        0, check=_non_negative,
        doc="EoMT's two-stage warmup: the backbone keeps learning rate 0 through train.warmup_steps (the head "
            "warms up alone), then warms up linearly over these steps; each part's poly then runs over the "
            "steps left after its own warmup (0: one warmup for all)")
    optimizer: str = _c("adam", choices=("adam", "sgd", "adamw"),
                        doc="adam, sgd with momentum, or adamw (decoupled decay, train.weight_decay)")
    momentum: float = _c(0.9, check=_fraction, doc="sgd's momentum, in [0, 1)")
    checkpoint_every: int = _c(1000, check=_positive, doc="steps between checkpoints")
    keep_checkpoints: int = _c(3, check=_positive, doc="how many checkpoints are kept")
    summary_every: int = _c(20, check=_positive, doc="steps between TensorBoard scalar summaries")
    image_summary_every: int = _c(500, check=_non_negative, doc="steps between TensorBoard image summaries")
    deterministic: bool = _c(False, doc="TensorFlow op determinism: bitwise reproducible runs and resumes")
    eval_every: int = _c(0, check=_non_negative, doc="steps between evaluations on the val split (0: only at "
                                                     "the end)")
    on_nan: str = _c("stop", choices=("stop", "skip_step"),
                     doc="on a non-finite loss, gradient or BN update: stop (exit 3) or skip the step")
    precision: str = _c("float32", choices=("float32", "mixed_bfloat16", "mixed_float16"),
                        doc="float32 or a mixed precision (float16: dynamic loss scaling)")
    jit_compile: bool = _c(False, doc="XLA-compile each tower's pass (not with sync_batchnorm); with EoMT the "
                                      "model's forward and backward only, not the matcher and loss")
    allreduce: str = _c("auto", choices=("auto", "nccl", "hierarchical_copy", "reduction_to_one_device", "ring"),
                        doc="the cross-tower all-reduce; several machines: ring or nccl")
    allreduce_pack_mb: float = _c(PACK_MB_DEFAULT, check=_non_negative,
                                  doc="gradients cross the towers in packs of at most this many MB (0: one per "
                                      "tensor)")
    accumulate_steps: int = _c(1, check=_positive, doc="micro-batches per update (each of data.batch_size images)")
    recompute: str = _c("none", choices=("none", "blocks"),
                        doc="dinov*_ and eomt: keep every activation for the backward pass (none), or only each "
                            "transformer block's input, its forward run again in the backward pass (blocks: less "
                            "memory, about one more forward pass of compute; the same gradients)")
    clip_global_norm: Optional[float] = _c(None, check=_positive,
                                           doc="clip the all-reduced gradient to this global L2 norm (null: off)")
    allreduce_num_packs: int = _c(1, check=_positive,
                                  doc="one machine, nccl/hierarchical_copy: TensorFlow's own packs on top")
    collective_timeout: float = _c(600.0, check=_positive,
                                   doc="several machines: seconds a collective may wait for a peer")
    ema_decay: Optional[float] = _c(None, check=lambda v: None if 0 < v < 1 else "a number in (0, 1)",
                                    doc="keep an exponential moving average of the weights, in (0, 1); inference "
                                        "uses it (null: off)")
    backbone_lr_multiplier: float = _c(1.0, check=_positive,
                                       doc="the backbone's variables learn at this multiple of the learning rate")
    # The head: everything outside the backbone.
    head_lr_multiplier: float = _c(1.0, check=_positive,
                                   doc="the head's variables learn at this multiple of the learning rate")
    mask_annealing: Optional[list[tuple[int, int]]] = _c(
        None, check=lambda v: None if all(0 <= a <= b for a, b in v) else "[start, end] steps with 0 <= start <= end",
        doc="eomt: per EoMT block (first first) the [start, end] steps over which its masked attention's "
            "probability falls from 1 to 0 as (1 - progress)^0.9 (start = end: 1 before that step, 0 from it)",
        default_doc="with head eomt: the reference's stagger, block k of n over steps [k, k + 1] x "
                    "num_steps / (n + 2), derived from num_steps at each start (not saved: an extended run's "
                    "windows stretch with it)")
    layer_decay: Optional[float] = _c(None, check=lambda v: None if 0 < v <= 1 else "a number in (0, 1]",
                                      doc="dinov*_: layer-wise learning-rate decay; block i of L learns at "
                                          "decay^(L - i), the embeddings at decay^L, the head at 1 (null: off)")
    weight_decay: Optional[float] = _c(None, check=_non_negative,
                                       doc="AdamW's decoupled weight decay (kernels only); adamw only",
                                       default_doc="with adamw 0.01 (else null)")
    profile_steps: Optional[tuple[int, int]] = _c(None, check=_step_range,
                                                  doc="[a, b], 1 <= a <= b: a TensorFlow profiler trace of steps "
                                                      "a..b")


CLASS_WEIGHT_SCHEMES = ("median_frequency", "sqrt_median_frequency")


def _class_weights(v):
    if isinstance(v, str):
        return None if v in CLASS_WEIGHT_SCHEMES else \
            "null, a list of per-class weights, 'median_frequency' or 'sqrt_median_frequency'"
    if any(w < 0 for w in v):
        return "weights >= 0"
    if not any(w > 0 for w in v):
        return "at least one weight above 0"
    return None


LOSS_TYPES = ("cross_entropy", "lovasz", "dice")


def _loss_terms(v):
    if not v:
        return "a non-empty list of {type, weight} mappings"
    seen = set()
    for term in v:
        if set(term) != {"type", "weight"}:
            return f"mappings with the keys type and weight (got {sorted(term)})"
        if term["type"] not in LOSS_TYPES:
            return f"type one of {', '.join(LOSS_TYPES)} (got {term['type']!r})"
        if term["type"] in seen:
            return f"each type at most once ({term['type']!r} twice)"
        seen.add(term["type"])
        if isinstance(term["weight"], str) or not term["weight"] > 0:
            return f"a weight > 0 for {term['type']} (got {term['weight']!r})"
    return None


@dataclass(frozen=True)
class LossConfig:
    class_weights: Optional[typing.Union[list[float], str]] = _c(
        None, check=_class_weights,
        doc="per-class loss weights: null (all 1), one weight >= 0 per class, median_frequency or "
            "sqrt_median_frequency")
    top_k_percent_pixels: float = _c(1.0, check=lambda v: None if 0 < v <= 1 else "a number in (0, 1]",
                                     doc="hard-pixel mining, in (0, 1]: the fraction of each image's valid pixels "
                                         "with the largest loss that counts")
    type: str = _c("cross_entropy", choices=LOSS_TYPES, doc="the loss: cross_entropy, lovasz (Lovasz-softmax) or "
                                                            "dice (soft Dice)")
    terms: Optional[list[dict[str, typing.Union[float, str]]]] = _c(
        None, check=_loss_terms, doc="a weighted sum of losses instead of loss.type: a list of {type, weight}")
    ohem_threshold: Optional[float] = _c(None, check=lambda v: None if 0 < v < 1 else "a number in (0, 1)",
                                         doc="OHEM: only pixels whose true-class probability is below this, in "
                                             "(0, 1), count")
    ohem_min_kept: int = _c(0, check=_non_negative, doc="with ohem_threshold: pixels each image keeps at least")
    mask_points: int = _c(12544, check=_positive,
                          doc="model.head eomt: points per image sampled for the matching and per mask for its "
                              "BCE and dice (the reference's 12544 = 112 x 112)")

    def term_weights(self) -> dict[str, float]:
        """The loss as {type: weight}: loss.terms, or loss.type with weight 1."""
        if self.terms is None:
            return {self.type: 1.0}
        return {t["type"]: float(t["weight"]) for t in self.terms}


def _scales(v):
    if not v:
        return "a non-empty list of positive numbers"
    return None if all(s > 0 for s in v) else "positive numbers"


@dataclass(frozen=True)
class EvalConfig:
    bn_reestimate_batches: int = _c(50, check=_non_negative,
                                    doc="training batches to re-estimate BN statistics before evaluation and "
                                        "export (0: off)")
    # The inference modes (seg_train/infer/modes.py): evaluation, seg-predict and the exported model.
    mode: str = _c("whole", choices=("whole", "slide"),
                   doc="whole: one pass per image; slide: overlapping windows of eval.crop_size")
    flip: bool = _c(False, doc="also predict the left-right flipped image; probabilities averaged")
    scales: list[float] = _c(check=_scales, factory=lambda: [1.0],
                             doc="image scales predicted (positive numbers); probabilities averaged")
    crop_size: Optional[tuple[int, int]] = _c(None, check=_pair_positive,
                                              doc="[h, w] of the sliding window; required with eval.mode slide")
    stride: Optional[tuple[int, int]] = _c(None, check=_pair_positive,
                                           doc="[h, w] step between windows, at most eval.crop_size",
                                           default_doc="null; with eval.crop_size: two thirds of it, rounded up")
    # data.task panoptic: EoMT's post-processing (seg_train/infer/mask_postprocess.py), the reference's values.
    mask_thresh: float = _c(0.8, check=lambda v: None if 0 <= v < 1 else "a number in [0, 1)",
                            doc="data.task panoptic: a query makes a segment when its class probability is above "
                                "this, in [0, 1)")
    overlap_thresh: float = _c(0.8, check=lambda v: None if 0 <= v <= 1 else "a number in [0, 1]",
                               doc="data.task panoptic: a segment is kept when the pixels it wins / its pixels at "
                                   "mask probability >= 0.5 is at least this, in [0, 1]")
    # Post-hoc logit adjustment (modes.score_offsets): tau * log(loss.class_weights) off the scores.
    logit_adjustment: float = _c(0.0, check=_non_negative,
                                 doc="tau >= 0: probabilities divided by loss.class_weights ** tau before the "
                                     "argmax")


@dataclass(frozen=True)
class Config:
    data: DataConfig
    model: ModelConfig = _c(factory=ModelConfig, doc="the model")
    train: TrainConfig = _c(factory=TrainConfig, doc="training")
    loss: LossConfig = _c(factory=LossConfig, doc="the loss")
    eval: EvalConfig = _c(factory=EvalConfig, doc="evaluation and inference")
    seed: int = _c(0, check=_non_negative, doc="one seed for weights, data order and augmentation")
    run_dir: Optional[Path] = _c(None, path=True,
                                 doc="checkpoints, TensorBoard events and the resolved config (--run-dir "
                                     "overrides)",
                                 default_doc="runs/<config name> in the current folder")

    def to_dict(self) -> dict:
        """Plain YAML-able dict (paths as strings, tuples as lists)."""
        return to_plain(self)


SECTIONS = {"data": DataConfig, "model": ModelConfig, "train": TrainConfig, "loss": LossConfig, "eval": EvalConfig}


def to_plain(obj):
    if dataclasses.is_dataclass(obj):
        return {f.name: to_plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, Path):
        return str(obj)
    if isinstance(obj, (tuple, list)):
        return [to_plain(x) for x in obj]
    return obj


def leaf_fields(cls=None, prefix: str = "") -> dict[str, dataclasses.Field]:
    """Every key a user can write, dotted ('data.crop_size'), -> its field, in the dataclasses' order."""
    out = {}
    for f in dataclasses.fields(cls or Config):
        if f.name in SECTIONS and not prefix:
            out.update(leaf_fields(SECTIONS[f.name], f"{f.name}."))
        else:
            out[prefix + f.name] = f
    return out


def replace(cfg: Config, dotted: str, value) -> Config:
    """Returns a copy of `cfg` with the dotted key set to `value` (no validation; for code, not users)."""
    parts = dotted.split(".")
    if len(parts) == 1:
        return dataclasses.replace(cfg, **{parts[0]: value})
    section = getattr(cfg, parts[0])
    return dataclasses.replace(cfg, **{parts[0]: dataclasses.replace(section, **{parts[1]: value})})

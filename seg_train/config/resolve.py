"""The keys that depend on other keys: derived defaults filled in, combinations that cannot work refused.
Every loaded config goes through resolve_defaults, a run dir's copy too. No TensorFlow here."""

from __future__ import annotations

import dataclasses

from seg_train.config.label_tables import LAYOUT_LABELS, label_ids, label_map_keys
from seg_train.config.schema import Config, ModelConfig, replace
from seg_train.config.variants import (
    BACKBONE_NORMALIZATION,
    DINO_BACKBONES,
    MIT_BACKBONES,
    MIT_MIN_SIZE,
    VIT_VARIANTS,
    four_blocks,
)
from seg_train.util.errors import ConfigError


def default_output_stride(backbone: str, head: str = "deeplabv3plus") -> int:
    """model.output_stride when not given: 32 for the MiT backbones (fixed) and for the SegFormer head on a ViT's
    pyramid (its four levels, as on a MiT), else 16."""
    return 32 if backbone in MIT_BACKBONES or (backbone in DINO_BACKBONES and head == "segformer") else 16


def default_vit_layers(depth: int, head: str) -> list[int]:
    """model.vit_layers when not given: for the linear head four blocks evenly spaced, the last included
    (3, 6, 9, 12 of 12: DINOv2's "+ms", ViTDet's), fewer when depth < 4; under a neck, the last block."""
    return list(four_blocks(depth)) if head == "linear" else [depth]


# SegFormer's published regularisation and decays (drop path over the MiT's blocks, dropout before the
# classifier, AdamW's decoupled weight decay).
SEGFORMER_DROP_PATH, SEGFORMER_DROPOUT = 0.1, 0.1
L2_DEFAULT, ADAMW_DECAY_DEFAULT = 4e-5, 0.01


def default_drop_path_rate(backbone: str, frozen: bool = False) -> float:
    """model.drop_path_rate when not given: SegFormer's 0.1 for the MiT backbones, else 0 (no blocks to drop,
    or a frozen backbone, which runs as in inference)."""
    return SEGFORMER_DROP_PATH if backbone in MIT_BACKBONES and not frozen else 0.0


def default_head_dropout(head: str) -> float:
    """model.head_dropout when not given: SegFormer's 0.1 for its head, else 0."""
    return SEGFORMER_DROPOUT if head == "segformer" else 0.0


def default_segformer_channels(backbone: str) -> int:
    """model.segformer_channels when not given: the paper's C (256 for B0/B1, 768 for B2-B5), else 256."""
    return 768 if backbone in MIT_BACKBONES[2:] else 256


def resolve_defaults(cfg: Config) -> Config:
    """Fills defaults that depend on other keys (normalisation from the backbone); checks keys that depend on others."""
    cfg = _resolve_data(cfg)
    weights = cfg.loss.class_weights
    if isinstance(weights, list) and len(weights) != cfg.data.num_classes:
        raise ConfigError("wrong number of class weights", "loss.class_weights",
                          f"expected one weight per class ({cfg.data.num_classes}, data.num_classes), "
                          f"got {len(weights)}")
    _check_loss(cfg)
    if cfg.model.head != "deeplabv3plus" and cfg.model.decoder_stride != 4:
        raise ConfigError("not available for this head", "model.decoder_stride",
                          f"expected 4 (or no value) with model.head {cfg.model.head!r}: the stride-2 stage is "
                          f"DeepLabV3+'s, got {cfg.model.decoder_stride}")
    cfg = _resolve_eval(cfg)
    cfg = _resolve_model(cfg)
    cfg = _resolve_optimizer(cfg)
    _check_two_stage_warmup(cfg)
    mean, std = BACKBONE_NORMALIZATION[cfg.model.backbone]
    if cfg.data.mean is None:
        cfg = replace(cfg, "data.mean", mean)
    if cfg.data.std is None:
        cfg = replace(cfg, "data.std", std)
    return cfg


def _resolve_data(cfg: Config) -> Config:
    """data.num_classes from the layout when it knows its classes; the label map checked before any work."""
    d = cfg.data
    if d.synthetic and d.task == "semantic" and d.layout != "voc":
        raise ConfigError("synthetic data is VOC-layout", "data.layout",
                          f"expected voc (or no value) with data.synthetic: true, got {d.layout!r}")
    _check_task(cfg)
    own = LAYOUT_LABELS.get(d.layout)
    if d.num_classes is None:
        if own is None:
            raise ConfigError("missing required value", "data.num_classes", "expected an integer")
        cfg = replace(cfg, "data.num_classes", own.num_classes)
    elif own is not None and d.num_classes != own.num_classes and not label_map_keys(d):
        raise ConfigError("wrong number of classes", "data.num_classes",
                          f"expected {own.num_classes} (the {d.layout} layout's classes; or leave it out), got "
                          f"{d.num_classes}; another class set needs a data.label_map of your own")
    label_ids(cfg.data)
    return _resolve_thing_classes(cfg)


# The layouts whose labels hold segments (class and instance), for data.task panoptic and instance.
SEGMENT_LAYOUTS = ("coco_panoptic", "cityscapes")


def _check_task(cfg: Config) -> None:
    """data.task against the head, the layout and the keys that only one kind of label has."""
    d = cfg.data
    if d.task == "semantic":
        if d.layout == "coco_panoptic":
            raise ConfigError("not available for this task", "data.layout",
                              "a layout of class labels with data.task semantic (coco_panoptic's labels are "
                              "segments: data.task panoptic or instance)")
        if d.thing_classes is not None:
            raise ConfigError("not available for this task", "data.thing_classes",
                              "no value with data.task semantic (things and stuff are the panoptic and instance "
                              "tasks')")
        return
    if cfg.model.head != "eomt":
        raise ConfigError("not available for this head", "data.task",
                          f"semantic with model.head {cfg.model.head!r} (a per-pixel head predicts a class per "
                          f"pixel, not segments; {d.task} needs model.head eomt)")
    if d.synthetic and d.layout != "coco_panoptic":
        raise ConfigError("synthetic panoptic data is COCO-panoptic-layout", "data.layout",
                          f"expected coco_panoptic with data.synthetic: true and data.task {d.task}, got "
                          f"{d.layout!r}")
    if d.layout not in SEGMENT_LAYOUTS:
        raise ConfigError("no segment labels in this layout", "data.layout",
                          f"one of {', '.join(SEGMENT_LAYOUTS)} with data.task {d.task} (their labels hold each "
                          f"pixel's instance), got {d.layout!r}")
    keys = label_map_keys(d)
    if d.layout == "coco_panoptic" and keys:
        raise ConfigError("not available for this layout", keys[0],
                          "no value with data.layout coco_panoptic (its JSON's categories map to train ids)")


def _resolve_thing_classes(cfg: Config) -> Config:
    """data.thing_classes: within the classes; a layout that knows its things fills it (coco_panoptic's come
    from its JSON when the split is opened, data/panoptic.py)."""
    d = cfg.data
    if d.task == "semantic":
        return cfg
    if d.thing_classes is not None and d.thing_classes and max(d.thing_classes) >= d.num_classes:
        raise ConfigError("no such class", "data.thing_classes",
                          f"train ids in [0, {d.num_classes}) (data.num_classes), got {list(d.thing_classes)}")
    own = LAYOUT_LABELS.get(d.layout)
    if own is None or own.thing_classes is None:
        return cfg
    if label_map_keys(d):
        if d.thing_classes is None:
            raise ConfigError("thing classes unknown", "data.thing_classes",
                              f"the train ids with instances under your {label_map_keys(d)[0]} (the layout's own "
                              f"apply to its own train ids only)")
        return cfg
    if d.thing_classes is None:
        return replace(cfg, "data.thing_classes", list(own.thing_classes))
    if list(d.thing_classes) != list(own.thing_classes):
        raise ConfigError("not the layout's things", "data.thing_classes",
                          f"{list(own.thing_classes)} (or no value): the {d.layout} layout's classes with instances, "
                          f"got {list(d.thing_classes)}")
    return cfg


def _check_loss(cfg: Config) -> None:
    """The loss keys that depend on each other: mining and class weights act on the cross-entropy term."""
    loss = cfg.loss
    if loss.terms is not None and loss.type != "cross_entropy":
        raise ConfigError("two loss definitions", "loss.type",
                          f"loss.type or loss.terms, not both (got type {loss.type!r} and terms)")
    has_ce = "cross_entropy" in loss.term_weights()
    mining = {"loss.top_k_percent_pixels": loss.top_k_percent_pixels < 1.0,
              "loss.ohem_threshold": loss.ohem_threshold is not None,
              "loss.class_weights": loss.class_weights is not None}
    for key, on in mining.items():
        if on and not has_ce:
            raise ConfigError("needs a cross_entropy term", key,
                              "a loss with a cross_entropy term (loss.type or loss.terms): it acts on that term")
    if mining["loss.top_k_percent_pixels"] and mining["loss.ohem_threshold"]:
        raise ConfigError("two pixel minings", "loss.ohem_threshold",
                          "null with loss.top_k_percent_pixels below 1 (one mining at a time)")
    if cfg.eval.logit_adjustment and loss.class_weights is None:
        raise ConfigError("nothing to adjust", "eval.logit_adjustment",
                          "0 (or no value) without loss.class_weights: it divides the scores by those weights")


def model_defaults(m: ModelConfig) -> ModelConfig:
    """The model's null derived keys filled from the backbone and head; also for a ModelConfig made in code
    (a no-op on a loaded config)."""
    mit = m.backbone in MIT_BACKBONES
    filled = {}
    if m.output_stride is None:
        filled["output_stride"] = default_output_stride(m.backbone, m.head)
    if m.backbone in DINO_BACKBONES and m.head != "eomt":
        if m.vit_layers is None:
            filled["vit_layers"] = default_vit_layers(VIT_VARIANTS[m.backbone].depth, m.head)
        if m.neck is None and m.head != "linear":
            filled["neck"] = "simple_pyramid"
    # Filled only for the head that uses it, so a run dir's config resolves unchanged
    # (rundir.check_resume_config).
    if m.segformer_channels is None and m.head == "segformer":
        filled["segformer_channels"] = default_segformer_channels(m.backbone)
    # Likewise the regularisation of SegFormer's recipe: filled for the MiT / the SegFormer head only.
    if m.drop_path_rate is None and mit:
        filled["drop_path_rate"] = default_drop_path_rate(m.backbone, m.freeze_backbone)
    if m.head_dropout is None and m.head == "segformer":
        filled["head_dropout"] = default_head_dropout(m.head)
    return dataclasses.replace(m, **filled) if filled else m


def _resolve_model(cfg: Config) -> Config:
    """model.output_stride, model.segformer_channels, model.drop_path_rate and model.head_dropout from the
    backbone and head (model_defaults); the MiT and preset keys checked."""
    m = cfg.model
    mit = m.backbone in MIT_BACKBONES
    if mit and m.output_stride not in (None, 32):
        raise ConfigError("not available for this backbone", "model.output_stride",
                          f"expected 32 (or no value) with model.backbone {m.backbone!r}: the Mix Transformer's "
                          f"stages have no dilated form, got {m.output_stride}")
    elif not mit and m.backbone not in DINO_BACKBONES and m.output_stride == 32:
        raise ConfigError("not available for this backbone", "model.output_stride",
                          f"expected one of 8, 16 (or no value) with model.backbone {m.backbone!r} (32 is the "
                          f"MiT backbones' fixed stride), got 32")
    if m.drop_path_rate and not mit and m.backbone not in DINO_BACKBONES:
        raise ConfigError("not available for this backbone", "model.drop_path_rate",
                          f"0 (or no value) with model.backbone {m.backbone!r}: drop path skips a transformer's "
                          f"residual blocks (mit_*, dinov3_*, dinov2_*), got {m.drop_path_rate}")
    if m.drop_path_rate and m.freeze_backbone:
        raise ConfigError("not available with a frozen backbone", "model.drop_path_rate",
                          f"0 (or no value) with model.freeze_backbone: true (a frozen backbone runs as in "
                          f"inference), got {m.drop_path_rate}")
    cfg = _check_vit(cfg)
    if m.head != "eomt":
        cfg = _check_eomt(cfg)
    if m.head_dropout and m.head != "segformer":
        raise ConfigError("not available for this head", "model.head_dropout",
                          f"0 (or no value) with model.head {m.head!r}: it is the SegFormer head's dropout before "
                          f"its classifier, got {m.head_dropout}")
    cfg = dataclasses.replace(cfg, model=model_defaults(m))
    if mit and m.decoder_stride != 4:
        raise ConfigError("not available for this backbone", "model.decoder_stride",
                          f"expected 4 (or no value) with model.backbone {m.backbone!r}: the Mix Transformer has "
                          f"no stride-2 features, got {m.decoder_stride}")
    if m.init_weights is not None:
        eomt = m.backbone in DINO_BACKBONES and m.head == "eomt"
        if not eomt and (not mit or m.head != "segformer"):
            raise ConfigError("not available for this model", "model.init_weights",
                              f"a keras-hub SegFormer preset needs model.backbone mit_b0..mit_b5 and model.head "
                              f"segformer, a transformers EoMT folder a dinov*_ backbone and model.head eomt, got "
                              f"{m.backbone!r} and {m.head!r}")
        if m.backbone_weights is not None:
            raise ConfigError("two initialisations", "model.backbone_weights",
                              f"null with model.init_weights (the {'EoMT folder' if eomt else 'SegFormer preset'} "
                              f"holds the encoder too)")
    for key, value in (("model.position_grid", m.position_grid), ("model.position_resize", m.position_resize)):
        if value is not None and not m.backbone.startswith("dinov2_"):
            raise ConfigError("not available for this backbone", key,
                              f"no value with model.backbone {m.backbone!r}: it sets DINOv2's learned positions "
                              f"(dinov2_*), got {value!r}")
    if mit:
        for key, size in (("data.crop_size", cfg.data.crop_size), ("eval.crop_size", cfg.eval.crop_size)):
            if size is not None and min(size) < MIT_MIN_SIZE:
                raise ConfigError("too small for this backbone", key,
                                  f"expected at least {MIT_MIN_SIZE} pixels per side with model.backbone "
                                  f"{m.backbone!r} (its first stage's 8x8 spatial reduction at stride 4), "
                                  f"got {list(size)}")
    return cfg


def _check_vit(cfg: Config) -> Config:
    """The ViT keys (model.vit_layers, model.neck, model.head linear, train.layer_decay) need a dinov*_ backbone;
    with one, the blocks must exist, the neck suit the head and the training crop be whole patches."""
    m = cfg.model
    if m.backbone not in DINO_BACKBONES:
        given = {"model.vit_layers": m.vit_layers is not None, "model.neck": m.neck is not None,
                 "model.head": m.head in ("linear", "eomt"), "train.layer_decay": cfg.train.layer_decay is not None,
                 "train.recompute": cfg.train.recompute != "none"}
        for key, on in given.items():
            if on:
                raise ConfigError("not available for this backbone", key,
                                  f"a ViT backbone (dinov3_*, dinov2_*) for this key, got model.backbone "
                                  f"{m.backbone!r}")
        return cfg
    patch, depth = VIT_VARIANTS[m.backbone].patch, VIT_VARIANTS[m.backbone].depth
    if m.vit_layers is not None and max(m.vit_layers) > depth:
        raise ConfigError("no such block", "model.vit_layers",
                          f"block numbers 1..{depth} (model.backbone {m.backbone!r}), got {list(m.vit_layers)}")
    if m.head == "linear" and m.neck is not None:
        raise ConfigError("not available for this head", "model.neck",
                          f"no value with model.head linear (it reads the patch maps themselves), got {m.neck!r}")
    if m.decoder_stride != 4:
        raise ConfigError("not available for this backbone", "model.decoder_stride",
                          f"expected 4 (or no value) with model.backbone {m.backbone!r}: the pyramid's finest "
                          f"level is stride 4, got {m.decoder_stride}")
    if m.head == "lraspp" and m.output_stride == 8:
        raise ConfigError("not available for this head", "model.output_stride",
                          "16 or 32 with model.head lraspp on a ViT (its low-level features are the stride-8 "
                          "level), got 8")
    crop = cfg.data.crop_size
    if any(c % patch for c in crop):
        raise ConfigError("not whole patches", "data.crop_size",
                          f"multiples of {patch} with model.backbone {m.backbone!r} (its patch size), got "
                          f"{list(crop)}")
    return _check_eomt(cfg) if m.head == "eomt" else cfg


def default_mask_annealing(num_steps: int, blocks: int) -> list[tuple[int, int]]:
    """train.mask_annealing when not given: the EoMT reference's stagger. Training is cut in n + 2 equal parts;
    block k (1-based) of n is annealed over part k + 1, steps k T / (n + 2) .. (k + 1) T / (n + 2): masking is
    on for every block through the first part and off for all of them through the last one (its Cityscapes
    config: 19902 steps, 4 blocks -> windows of 3317 steps, the last ending at 16585). With fewer than n + 2
    steps some windows are empty (start = end): a step from 1 to 0 at `start` (eomt_step.mask_probabilities)."""
    return [(k * num_steps // (blocks + 2), (k + 1) * num_steps // (blocks + 2)) for k in range(1, blocks + 1)]


def annealing_windows(cfg: Config) -> list[tuple[int, int]]:
    """The EoMT blocks' annealing windows a run uses: train.mask_annealing as given, else derived from the
    current train.num_steps (default_mask_annealing).

    Derived here, where the run uses them, and never stored in the config: a config that leaves the key unset
    keeps it unset in RUN_DIR/config.yaml, so raising train.num_steps to extend a run stretches the windows
    as it stretches the poly schedule (both are fractions of the run's length), and the run dir's config
    still resolves unchanged (rundir.check_resume_config). Stored, they would stay where the shorter run put
    them while the learning rate stretched, and the extension would read as a change of the windows."""
    t = cfg.train
    if t.mask_annealing is not None:
        return [tuple(w) for w in t.mask_annealing]
    return default_mask_annealing(t.num_steps, cfg.model.eomt_blocks)


def _check_eomt(cfg: Config) -> Config:
    """The EoMT head: a ViT under it, enough queries, the loss it trains with (its own), the annealing windows."""
    m, t, loss = cfg.model, cfg.train, cfg.loss
    if m.head != "eomt":
        if t.mask_annealing is not None:
            raise ConfigError("not available for this head", "train.mask_annealing",
                              f"no value with model.head {m.head!r}: it anneals EoMT's masked attention")
        if loss.mask_points != 12544:
            raise ConfigError("not available for this head", "loss.mask_points",
                              f"no value with model.head {m.head!r}: it is EoMT's point count")
        return cfg
    depth = VIT_VARIANTS[m.backbone].depth
    if m.eomt_blocks > depth:
        raise ConfigError("no such block", "model.eomt_blocks",
                          f"at most {depth} (the blocks of model.backbone {m.backbone!r}), got {m.eomt_blocks}")
    if m.vit_layers is not None or m.neck is not None:
        key = "model.vit_layers" if m.vit_layers is not None else "model.neck"
        raise ConfigError("not available for this head", key,
                          "no value with model.head eomt (its queries read the last block's tokens)")
    refused = {"loss.type": loss.type != "cross_entropy", "loss.terms": loss.terms is not None,
               "loss.class_weights": loss.class_weights is not None,
               "loss.top_k_percent_pixels": loss.top_k_percent_pixels < 1.0,
               "loss.ohem_threshold": loss.ohem_threshold is not None}
    for key, on in refused.items():
        if on:
            raise ConfigError("not available for this head", key,
                              "its default with model.head eomt: EoMT trains with its own mask-classification loss "
                              "(matched class cross-entropy, mask BCE and dice), not a per-pixel one")
    if t.mask_annealing is None:
        return cfg  # derived from num_steps where it is used (annealing_windows)
    if len(t.mask_annealing) != m.eomt_blocks:
        raise ConfigError("one window per EoMT block", "train.mask_annealing",
                          f"{m.eomt_blocks} [start, end] pairs (model.eomt_blocks), got {len(t.mask_annealing)}")
    return cfg


def check_trainable(cfg: Config) -> None:
    """What only training needs (seg-train, seg-bench): EoMT's matcher gives each class present in an image its
    own query, so at least data.num_classes of them. Evaluation takes fewer (the published ADE20K EoMTs have 100
    queries for 150 classes). The panoptic and instance tasks match a query per segment, whatever the classes (an
    image's segments beyond the queries are left out: objectives/mask_loss.py)."""
    m = cfg.model
    if m.head == "eomt" and cfg.data.task == "semantic" and m.num_queries < cfg.data.num_classes:
        raise ConfigError("fewer queries than classes", "model.num_queries",
                          f"at least data.num_classes ({cfg.data.num_classes}) to train: each class present in an "
                          f"image is matched to its own query, got {m.num_queries}")


def _check_two_stage_warmup(cfg: Config) -> None:
    """train.backbone_warmup_steps: a backbone that trains, and both warmups over before the last step."""
    t = cfg.train
    if not t.backbone_warmup_steps:
        return
    if cfg.model.freeze_backbone:
        raise ConfigError("not available with a frozen backbone", "train.backbone_warmup_steps",
                          f"0 (or no value) with model.freeze_backbone: true (the backbone never learns), "
                          f"got {t.backbone_warmup_steps}")
    if t.warmup_steps + t.backbone_warmup_steps >= t.num_steps:
        raise ConfigError("warmup longer than the run", "train.backbone_warmup_steps",
                          f"train.warmup_steps + train.backbone_warmup_steps below train.num_steps "
                          f"({t.num_steps}), got {t.warmup_steps} + {t.backbone_warmup_steps}")


def _resolve_optimizer(cfg: Config) -> Config:
    """The two weight decays: model.weight_decay (an L2 term in the loss, Adam and SGD) and train.weight_decay
    (AdamW's decoupled decay). Each defaults for its optimizer and the other is refused, so they never stack
    unasked; a run dir's resolved config keeps its values."""
    t, m = cfg.train, cfg.model
    if t.optimizer == "adamw":
        if m.weight_decay:
            raise ConfigError("two weight decays", "model.weight_decay",
                              f"0 (or no value) with train.optimizer adamw, which decays the weights itself "
                              f"(train.weight_decay), got {m.weight_decay}")
        if m.weight_decay is None:
            cfg = replace(cfg, "model.weight_decay", 0.0)
        if t.weight_decay is None:
            cfg = replace(cfg, "train.weight_decay", ADAMW_DECAY_DEFAULT)
        return cfg
    if t.weight_decay is not None:
        raise ConfigError("not available for this optimizer", "train.weight_decay",
                          f"no value with train.optimizer {t.optimizer!r}: it is AdamW's decoupled decay (adamw); "
                          f"the L2 term of adam and sgd is model.weight_decay, got {t.weight_decay}")
    if m.weight_decay is None:
        cfg = replace(cfg, "model.weight_decay", L2_DEFAULT)
    return cfg


def _resolve_eval(cfg: Config) -> Config:
    """Checks the slide window against its stride; fills eval.stride's default."""
    e = cfg.eval
    if e.mode == "slide" and e.crop_size is None:
        raise ConfigError("missing value", "eval.crop_size",
                          "expected [height, width] of the sliding window when eval.mode is slide")
    if cfg.data.task != "semantic":
        # The panoptic and instance evaluation is the reference's one letterboxed pass (infer/mask_evaluate.py).
        refused = {"eval.mode": e.mode != "whole", "eval.flip": e.flip, "eval.scales": list(e.scales) != [1.0],
                   "eval.logit_adjustment": bool(e.logit_adjustment)}
        for key, on in refused.items():
            if on:
                raise ConfigError("not available for this task", key,
                                  f"its default with data.task {cfg.data.task} (one pass on the image resized to "
                                  "fit data.crop_size, as EoMT evaluates it)")
    if e.crop_size is not None and e.stride is None:
        cfg = replace(cfg, "eval.stride", tuple(-(-2 * c // 3) for c in e.crop_size))
    elif e.crop_size is not None and any(s > c for s, c in zip(e.stride, e.crop_size)):
        raise ConfigError("out of range", "eval.stride",
                          f"expected a stride at most eval.crop_size {list(e.crop_size)} in each dimension "
                          f"(windows must overlap or touch), got {list(e.stride)}")
    return cfg


def check_batch(cfg: Config, num_towers: int) -> None:
    """Raises ConfigError unless data.batch_size (the GLOBAL batch) splits evenly over `num_towers`:
    the one check against the tower count, known only once the devices are chosen."""
    if cfg.data.batch_size % num_towers:
        raise ConfigError("batch does not divide across towers", "data.batch_size",
                          f"expected a multiple of the {num_towers} towers, got {cfg.data.batch_size}")

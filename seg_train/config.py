"""Typed, frozen configuration: YAML -> validated dataclasses. No TensorFlow import here.

Every key a user can write is a field below, with its default and its constraint. Loading is strict:
an unknown key names the nearest valid one, a wrong type or an out-of-range value names the key, the
value received and what was expected. Relative paths are resolved against the config file's folder.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import yaml


class ConfigError(ValueError):
    """A user mistake in the config; `where` names the key or file, the message says what was expected."""

    def __init__(self, what: str, where: str, expected: str):
        self.what, self.where, self.expected = what, where, expected
        super().__init__(f"{what} ({where}): {expected}")


# A Python object's default repr, which some libraries paste into their messages (Pillow: "cannot identify
# image file <_io.BytesIO object at 0x7f...>" for bytes it was handed in memory): noise in a user's line.
_OBJECT_REPR = re.compile(r"\s*<[^<>\n]*\bat 0x[0-9a-fA-F]+>")


def without_reprs(text: str) -> str:
    """`text` without the Python object reprs in it."""
    return _OBJECT_REPR.sub("", text).strip()


def exception_text(e: BaseException) -> str:
    """What an exception says, for a user's one-line message: the first non-empty line of its message
    without Python object reprs, or its type's name when that leaves nothing."""
    for line in str(e).splitlines():
        line = without_reprs(line)
        if line:
            return line
    return type(e).__name__


def _c(default=dataclasses.MISSING, *, check=None, path=False, url=False, choices=None, factory=None):
    """A config field: default, an optional check(value) -> error string or None, path, choices.

    A `path` is resolved against the config file's folder; with `url` it may also be a URL such as
    gs://bucket/data (kept as the string it is: pathlib would make it gs:/bucket/data).

    What each key means is written once, in README.md's config table (tests/test_config_docs.py
    checks that every key has a row there and that every row names a key).
    """
    meta = {"check": check, "path": path, "url": url, "choices": choices}
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


# data.photometric's keys and the largest value each may take (README's config table gives the meaning).
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


_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")


def is_url(path) -> bool:
    """Whether a configured path is a URL (`scheme://...`, a file system of a TensorFlow plugin)."""
    return isinstance(path, str) and _URL.match(path) is not None


def _local_path(value, key: str, base_dir: Path, url_ok: bool):
    """A configured path made absolute against `base_dir`; a URL as it is, where the key allows one."""
    if is_url(value):
        if not url_ok:
            raise ConfigError("not a local path", key, f"expected a path on this machine (of the paths only "
                              f"data.root may be a URL such as gs://bucket/data), got {value!r}")
        return value
    return Path(os.path.normpath(base_dir / Path(value).expanduser()))


@dataclass(frozen=True)
class DataConfig:
    # A Path, or the str of a URL (gs://, s3://, ...): the reader reads it through tf.io.gfile.
    root: Path = _c(check=None, path=True, url=True)
    layout: str = _c("voc", choices=("voc", "cityscapes", "ade20k", "pairs"))
    # Required unless the layout knows its classes (LAYOUT_LABELS); resolve_defaults fills it.
    num_classes: Optional[int] = _c(None, check=lambda v: None if 2 <= v <= 255 else "an integer in [2, 255]")
    train_split: str = _c("train")
    val_split: str = _c("val")
    ignore_label: int = _c(255, check=_label_value)
    batch_size: int = _c(8, check=_positive)
    crop_size: tuple[int, int] = _c((321, 321), check=_pair_positive)
    random_scale: tuple[float, float] = _c((0.5, 2.0), check=_scale_range)
    random_mirror: bool = _c(True)
    mean: Optional[tuple[float, float, float]] = _c(None)
    std: Optional[tuple[float, float, float]] = _c(None, check=_pair_positive)
    class_names: Optional[list[str]] = _c(None)
    synthetic: bool = _c(False)
    num_parallel_calls: int = _c(-1, check=lambda v: None if v == -1 or v > 0
                                 else "-1 (autotune) or a positive integer")
    on_bad_sample: str = _c("error", choices=("error", "skip"))
    cache: bool = _c(False)
    # Raw label values -> train ids (label_ids checks them against num_classes).
    label_map: Optional[typing.Union[dict[int, int], list[int]]] = _c(None)
    reduce_zero_label: bool = _c(False)
    binary_threshold: Optional[int] = _c(None, check=lambda v: None if 1 <= v <= 255 else "an integer in [1, 255]")
    scan_cache: bool = _c(True)
    scan_cache_dir: Optional[Path] = _c(None, path=True)
    format: str = _c("files", choices=("files", "tfrecord"))
    # Colour jitter of the training crops (reader.apply_photometric); null: off.
    photometric: Optional[dict[str, float]] = _c(None, check=_photometric)


# The Mix Transformer sizes (models/mit.py), SegFormer's encoders.
MIT_BACKBONES = tuple(f"mit_b{i}" for i in range(6))
# The smallest training or slide crop side a MiT takes: its first stage's 8x8 spatial-reduction conv
# needs an 8x8 map at stride 4 (models/mit.py).
MIT_MIN_SIZE = 29


def default_output_stride(backbone: str) -> int:
    """model.output_stride when not given: 32 for the MiT backbones (fixed), else 16."""
    return 32 if backbone in MIT_BACKBONES else 16


# SegFormer's regularisation (the paper's, mmsegmentation's segformer_mit-b0 config and keras-hub's): drop path
# 0.1 over the MiT's blocks and dropout 0.1 before the classifier. model.weight_decay's L2 default, and the
# AdamW decay train.weight_decay defaults to (SegFormer's 0.01).
SEGFORMER_DROP_PATH, SEGFORMER_DROPOUT = 0.1, 0.1
L2_DEFAULT, ADAMW_DECAY_DEFAULT = 4e-5, 0.01


def default_drop_path_rate(backbone: str) -> float:
    """model.drop_path_rate when not given: SegFormer's 0.1 for the MiT backbones, else 0 (no blocks to drop)."""
    return SEGFORMER_DROP_PATH if backbone in MIT_BACKBONES else 0.0


def default_head_dropout(head: str) -> float:
    """model.head_dropout when not given: SegFormer's 0.1 for its head, else 0."""
    return SEGFORMER_DROPOUT if head == "segformer" else 0.0


def default_segformer_channels(backbone: str) -> int:
    """model.segformer_channels when not given: the paper's C, 256 for B0/B1 and 768 for B2-B5 (also
    the width of keras-hub's SegFormer presets), 256 on other backbones."""
    return 768 if backbone in MIT_BACKBONES[2:] else 256


@dataclass(frozen=True)
class ModelConfig:
    backbone: str = _c("mobilenetv2", choices=("tiny", "mobilenetv2", "mobilenetv3_large", "mobilenetv3_small",
                                               "resnet50", "resnet101") + MIT_BACKBONES)
    head: str = _c("deeplabv3plus", choices=("deeplabv3plus", "lraspp", "segformer"))
    # None: the backbone's (default_output_stride); resolve_defaults fills it and checks it against the backbone.
    output_stride: Optional[int] = _c(None, choices=(8, 16, 32))
    sync_batchnorm: bool = _c(False)
    bn_momentum: float = _c(0.9, check=lambda v: None if 0 <= v < 1 else "a number in [0, 1)")
    # The L2 term; None: 4e-5 with train.optimizer adam or sgd, 0 with adamw (resolve_defaults: AdamW decays
    # the weights itself, train.weight_decay, and the two must not stack unasked).
    weight_decay: Optional[float] = _c(None, check=_non_negative)
    backbone_weights: Optional[Path] = _c(None, path=True)
    aspp_channels: int = _c(256, check=_positive)
    decoder_channels: int = _c(256, check=_positive)
    low_level_channels: int = _c(48, check=_positive)
    # DeepLabV3+'s last decoder stride: 4 (DeepLab's), or 2 (a refinement stage on the backbone's
    # stride-2 features: models/deeplabv3plus.py says why).
    decoder_stride: int = _c(4, choices=(4, 2))
    fine_low_level_channels: int = _c(24, check=_positive)
    fine_channels: int = _c(32, check=_positive)
    lraspp_channels: int = _c(128, check=_positive)
    fused_batchnorm: bool = _c(True)
    fast_atrous: bool = _c(True)
    freeze_batchnorm: bool = _c(False)
    # The SegFormer head's width C; None: the paper's for the backbone (default_segformer_channels).
    segformer_channels: Optional[int] = _c(None, check=_positive)
    # A keras-hub SegFormer preset directory: encoder and head (models/presets.py).
    init_weights: Optional[Path] = _c(None, path=True)
    # Stochastic depth of the MiT blocks and the SegFormer head's dropout, drawn per sample (models/stochastic.py);
    # None: SegFormer's 0.1 for the MiT backbones / the SegFormer head, else 0 (default_drop_path_rate, ...).
    drop_path_rate: Optional[float] = _c(None, check=_fraction)
    head_dropout: Optional[float] = _c(None, check=_fraction)


# train.allreduce_pack_mb's default, chosen by measurement (docs/PERFORMANCE.md, "packing").
PACK_MB_DEFAULT = 32.0


@dataclass(frozen=True)
class TrainConfig:
    num_steps: int = _c(30000, check=_positive)
    learning_rate: float = _c(1e-3, check=_positive)
    lr_power: float = _c(0.9, check=_non_negative)
    warmup_steps: int = _c(0, check=_non_negative)
    optimizer: str = _c("adam", choices=("adam", "sgd", "adamw"))
    momentum: float = _c(0.9, check=_fraction)
    checkpoint_every: int = _c(1000, check=_positive)
    keep_checkpoints: int = _c(3, check=_positive)
    summary_every: int = _c(20, check=_positive)
    image_summary_every: int = _c(500, check=_non_negative)
    deterministic: bool = _c(False)
    eval_every: int = _c(0, check=_non_negative)
    on_nan: str = _c("stop", choices=("stop", "skip_step"))
    precision: str = _c("float32", choices=("float32", "mixed_bfloat16", "mixed_float16"))
    jit_compile: bool = _c(False)
    allreduce: str = _c("auto", choices=("auto", "nccl", "hierarchical_copy", "reduction_to_one_device", "ring"))
    allreduce_pack_mb: float = _c(PACK_MB_DEFAULT, check=_non_negative)
    accumulate_steps: int = _c(1, check=_positive)
    clip_global_norm: Optional[float] = _c(None, check=_positive)
    allreduce_num_packs: int = _c(1, check=_positive)
    collective_timeout: float = _c(600.0, check=_positive)
    ema_decay: Optional[float] = _c(None, check=lambda v: None if 0 < v < 1 else "a number in (0, 1)")
    backbone_lr_multiplier: float = _c(1.0, check=_positive)
    # The head's variables (everything outside the backbone) learn at this multiple of the learning rate.
    head_lr_multiplier: float = _c(1.0, check=_positive)
    # AdamW's decoupled weight decay; None: 0.01 with train.optimizer adamw (SegFormer's), refused with the others.
    weight_decay: Optional[float] = _c(None, check=_non_negative)
    profile_steps: Optional[tuple[int, int]] = _c(None, check=_step_range)


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
        None, check=_class_weights)
    top_k_percent_pixels: float = _c(1.0, check=lambda v: None if 0 < v <= 1 else "a number in (0, 1]")
    type: str = _c("cross_entropy", choices=LOSS_TYPES)
    terms: Optional[list[dict[str, typing.Union[float, str]]]] = _c(None, check=_loss_terms)
    ohem_threshold: Optional[float] = _c(None, check=lambda v: None if 0 < v < 1 else "a number in (0, 1)")
    ohem_min_kept: int = _c(0, check=_non_negative)

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
    bn_reestimate_batches: int = _c(50, check=_non_negative)
    # The inference modes (seg_train/infer/modes.py): evaluation, seg-predict and the exported model.
    mode: str = _c("whole", choices=("whole", "slide"))
    flip: bool = _c(False)
    scales: list[float] = _c(check=_scales, factory=lambda: [1.0])
    crop_size: Optional[tuple[int, int]] = _c(None, check=_pair_positive)
    stride: Optional[tuple[int, int]] = _c(None, check=_pair_positive)
    # Post-hoc logit adjustment (modes.score_offsets): tau * log(loss.class_weights) off the scores.
    logit_adjustment: float = _c(0.0, check=_non_negative)


@dataclass(frozen=True)
class Config:
    data: DataConfig
    model: ModelConfig = _c(factory=ModelConfig)
    train: TrainConfig = _c(factory=TrainConfig)
    loss: LossConfig = _c(factory=LossConfig)
    eval: EvalConfig = _c(factory=EvalConfig)
    seed: int = _c(0, check=_non_negative)
    run_dir: Optional[Path] = _c(None, path=True)

    def to_dict(self) -> dict:
        """Plain YAML-able dict (paths as strings, tuples as lists)."""
        return _to_plain(self)


_SECTIONS = {"data": DataConfig, "model": ModelConfig, "train": TrainConfig, "loss": LossConfig, "eval": EvalConfig}


def _to_plain(obj):
    if dataclasses.is_dataclass(obj):
        return {f.name: _to_plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, Path):
        return str(obj)
    if isinstance(obj, (tuple, list)):
        return [_to_plain(x) for x in obj]
    return obj


def _plural(tp) -> str:
    """float -> 'numbers' (for 'a list of numbers')."""
    return re.sub(r"^an? ", "", _type_name(tp)) + "s"


def _type_name(tp) -> str:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return " or ".join(_type_name(a) for a in args) + " (or null)"
    if origin is tuple:
        args = typing.get_args(tp)
        return f"a list of {len(args)} {_plural(args[0])}"
    if origin is list:
        return f"a list of {_plural(typing.get_args(tp)[0])}"
    if origin is dict:
        key, value = typing.get_args(tp)
        return f"a mapping of {_plural(key)} to {_plural(value)}"
    names = {int: "an integer", float: "a number", bool: "true or false", str: "a string", Path: "a path"}
    return names.get(tp, str(tp))


def _coerce(value, tp, key: str):
    """Checks `value` against the annotation `tp` and converts it (lists -> tuples, ints -> floats)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None:
            return None
        inner = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(inner) == 1:  # Optional[X]: X's own message (it names the element that is wrong)
            return _coerce(value, inner[0], key)
        for option in inner[:-1]:  # several types (e.g. a list of weights or a name): the first that fits
            try:
                return _coerce(value, option, key)
            except ConfigError as e:
                if e.what != "wrong type":
                    raise
        try:
            return _coerce(value, inner[-1], key)
        except ConfigError as e:
            if e.what != "wrong type":
                raise
            raise ConfigError("wrong type", key, f"expected {_type_name(tp)}, got {value!r}") from None
    bad = ConfigError("wrong type", key, f"expected {_type_name(tp)}, got {value!r}")
    if origin is tuple:
        args = typing.get_args(tp)
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            raise bad
        return tuple(_coerce(v, a, key) for v, a in zip(value, args))
    if origin is list:
        if not isinstance(value, (list, tuple)):
            raise bad
        return [_coerce(v, typing.get_args(tp)[0], key) for v in value]
    if origin is dict:
        if not isinstance(value, dict):
            raise bad
        key_tp, value_tp = typing.get_args(tp)
        return {_coerce(k, key_tp, key): _coerce(v, value_tp, key) for k, v in value.items()}
    if tp is bool:
        if not isinstance(value, bool):
            raise bad
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad
        if abs(value) >= 2**53:
            raise ConfigError("out of range", key, f"expected an integer below 2**53, got {value!r}")
        return value
    if tp is float:
        # PyYAML (YAML 1.1) reads 1e-3 as a string; users mean a number.
        if isinstance(value, str) and re.fullmatch(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+", value.strip()):
            value = float(value)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad
        if not math.isfinite(value) or abs(value) > 3.4e38:  # float32's range: TF computes in it
            raise ConfigError("out of range", key, f"expected a finite number within float32 range, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise bad
        return value
    if tp is Path:
        if not isinstance(value, str) or not value:
            raise bad
        return value if is_url(value) else Path(value)
    raise TypeError(f"unsupported config type {tp}")


def _suggest(key: str, valid) -> str:
    close = difflib.get_close_matches(key, list(valid), n=1, cutoff=0.5)
    return f"did you mean '{close[0]}'?" if close else f"valid keys: {', '.join(sorted(valid))}"


def _build(cls, raw: Any, prefix: str, base_dir: Path):
    """Builds dataclass `cls` from the mapping `raw`, validating every key."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError("wrong type", prefix.rstrip(".") or "config", f"expected a mapping of keys, got {raw!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key in raw:
        if key not in fields:
            raise ConfigError("unknown key", f"{prefix}{key}", _suggest(str(key), fields))
    kwargs = {}
    for name, f in fields.items():
        key = f"{prefix}{name}"
        if name in _SECTIONS and prefix == "":
            kwargs[name] = _build(_SECTIONS[name], raw.get(name), f"{name}.", base_dir)
            continue
        if name not in raw:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ConfigError("missing required value", key, f"expected {_type_name(hints[name])}")
            continue
        value = _coerce(raw[name], hints[name], key)
        meta = f.metadata
        if value is not None:
            if meta.get("choices") and value not in meta["choices"]:
                raise ConfigError("invalid value", key,
                                  f"expected one of {', '.join(map(str, meta['choices']))}, got {value!r}")
            problem = meta["check"](value) if meta.get("check") else None
            if problem:
                raise ConfigError("invalid value" if isinstance(value, str) else "out of range", key,
                                  f"expected {problem}, got {_to_plain(value)!r}")
            if meta.get("path"):
                value = _local_path(value, key, base_dir, meta.get("url"))
        kwargs[name] = value
    return cls(**kwargs)


def _set_dotted(tree: dict, dotted: str, value) -> None:
    parts = dotted.split(".")
    node = tree
    for i, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise ConfigError("invalid override", f"--set {dotted}", f"'{'.'.join(parts[:i + 1])}' is not a section")
        node = child
    node[parts[-1]] = value


def parse_override(text: str) -> tuple[str, Any]:
    """Parses one `--set KEY=VALUE`; VALUE is read as YAML (so 4, 1e-3, true, [321, 321] are typed)."""
    if "=" not in text:
        raise ConfigError("invalid override", f"--set {text}", "expected KEY=VALUE, e.g. train.num_steps=100")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key:
        raise ConfigError("invalid override", f"--set {text}", "expected KEY=VALUE with a non-empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as e:
        raise ConfigError("invalid override value", f"--set {key}",
                          f"expected a YAML value ({str(e).splitlines()[0]})") from None
    return key, value


def read_yaml(path: Path) -> dict:
    """Reads a YAML mapping with safe_load: tags that would construct Python objects are refused."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        raise ConfigError("config file not found", str(path), "expected an existing YAML file") from None
    except OSError as e:
        raise ConfigError("cannot read config", str(path), str(e.strerror or e)) from None
    except UnicodeDecodeError as e:
        raise ConfigError("cannot read config", str(path),
                          f"a UTF-8 text YAML file (byte {e.start} is not UTF-8)") from None
    try:
        raw = yaml.safe_load(text)
    except yaml.constructor.ConstructorError as e:
        line = f":{e.problem_mark.line + 1}" if e.problem_mark else ""
        raise ConfigError("refused YAML tag", f"{path}{line}", f"plain YAML values only ({e.problem})") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else str(path)
        raise ConfigError("YAML syntax error", where, f"valid YAML ({getattr(e, 'problem', None) or e})") from None
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError("wrong type", str(path),
                          f"expected a YAML mapping at the top level, got {type(raw).__name__}")
    return raw


def load(path: str | os.PathLike, overrides: list[str] = (), run_dir: str | None = None) -> Config:
    """Loads, overrides and validates a config.

    Args:
      path: the YAML file; relative paths inside it are relative to its folder.
      overrides: `KEY=VALUE` strings (dotted keys, YAML values); paths in them are relative to the cwd.
      run_dir: the `--run-dir` flag, relative to the cwd; wins over the file and the overrides.
    Returns:
      The frozen Config, with absolute paths.
    """
    path = Path(path)
    raw = read_yaml(path)
    base_dir = path.resolve().parent
    cwd = Path.cwd()
    # Overrides are typed on the command line, so their paths are relative to where the user is.
    cli_paths = {}
    for text in overrides:
        key, value = parse_override(text)
        _set_dotted(raw, key, value)
        cli_paths[key] = value
    data = raw.get("data")
    if isinstance(data, dict) and data.get("synthetic") is True and data.get("root") is None:
        # Generated data needs no place of its own: like the default run dir, it goes under the
        # current folder, so a copied demo config works wherever it is run.
        data["root"] = str(cwd / "data" / path.stem)
    cfg = _build(Config, raw, "", base_dir)
    for key, value in cli_paths.items():
        if key in ("run_dir", "data.root", "model.backbone_weights", "model.init_weights") and \
                isinstance(value, str) and value:
            cfg = replace(cfg, key, _local_path(value, key, cwd, key == "data.root"))
    if run_dir is not None:
        cfg = replace(cfg, "run_dir", _local_path(run_dir, "--run-dir", cwd, False))
    if cfg.run_dir is None:
        cfg = replace(cfg, "run_dir", Path(os.path.normpath(cwd / "runs" / path.stem)))
    return resolve_defaults(cfg)


# Input normalisation each backbone's ImageNet weights expect, as (mean, std) on RGB 0..255.
BACKBONE_NORMALIZATION = {
    "tiny": ((123.675, 116.28, 103.53), (58.395, 57.12, 57.375)),
    "mobilenetv2": ((127.5, 127.5, 127.5), (127.5, 127.5, 127.5)),
    # Keras' MobileNetV3 rescales x / 127.5 - 1 inside the model; built here without that layer.
    "mobilenetv3_large": ((127.5, 127.5, 127.5), (127.5, 127.5, 127.5)),
    "mobilenetv3_small": ((127.5, 127.5, 127.5), (127.5, 127.5, 127.5)),
    "resnet50": ((123.68, 116.779, 103.939), (1.0, 1.0, 1.0)),
    "resnet101": ((123.68, 116.779, 103.939), (1.0, 1.0, 1.0)),
    # keras-hub's SegFormer and MiT presets: ImageNet's mean and std (its image converter's 0.485.../0.229...).
    **{name: ((123.675, 116.28, 103.53), (58.395, 57.12, 57.375)) for name in MIT_BACKBONES},
}


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
    mean, std = BACKBONE_NORMALIZATION[cfg.model.backbone]
    if cfg.data.mean is None:
        cfg = replace(cfg, "data.mean", mean)
    if cfg.data.std is None:
        cfg = replace(cfg, "data.std", std)
    return cfg


def _resolve_data(cfg: Config) -> Config:
    """data.num_classes from the layout when it knows its classes; the label map checked before any work."""
    d = cfg.data
    if d.synthetic and d.layout != "voc":
        raise ConfigError("synthetic data is VOC-layout", "data.layout",
                          f"expected voc (or no value) with data.synthetic: true, got {d.layout!r}")
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
    return cfg


# ---- what a raw label value means ----------------------------------------------------------------------
# Raw label values (0..255, as stored in the label PNGs) -> training class ids, from data.label_map,
# data.reduce_zero_label, data.binary_threshold or the layout's own map: defined and checked here, with the
# keys, so that a config is refused before TensorFlow starts; seg_train/data/labels.py applies the table.

# cityscapesScripts' helpers/labels.py, the official table: trainId of each labelId 0..33, None where
# the table says 255 (not trained, not evaluated). A labelIds PNG holds nothing else (license plates,
# id -1, are not drawn into it).
CITYSCAPES_TRAIN_IDS = (
    None, None, None, None, None, None, None,  # 0-6: unlabeled, ego vehicle, rectification border, out of roi,
                                               # static, dynamic, ground
    0, 1,                                      # 7 road, 8 sidewalk
    None, None,                                # 9 parking, 10 rail track
    2, 3, 4,                                   # 11 building, 12 wall, 13 fence
    None, None, None,                          # 14 guard rail, 15 bridge, 16 tunnel
    5,                                         # 17 pole
    None,                                      # 18 polegroup
    6, 7, 8, 9, 10, 11, 12, 13, 14, 15,        # 19 traffic light .. 28 bus
    None, None,                                # 29 caravan, 30 trailer
    16, 17, 18,                                # 31 train, 32 motorcycle, 33 bicycle
)


@dataclass(frozen=True)
class LayoutLabels:
    """What a shipped data set's label values mean: its class count and how raw values become classes
    (its class names are in seg_train/data/layouts.py)."""
    num_classes: int
    # raw value -> train id, None: ignore_label; raw values not listed have no mapping.
    label_map: Optional[dict[int, Optional[int]]] = None
    reduce_zero_label: bool = False


# The layouts that know their classes: Cityscapes' labelIds -> the 19 train ids, ADE20K's 0 = "other" and
# classes 1..150. voc and pairs labels hold class indices.
LAYOUT_LABELS = {
    "cityscapes": LayoutLabels(19, dict(enumerate(CITYSCAPES_TRAIN_IDS))),
    "ade20k": LayoutLabels(150, reduce_zero_label=True),
}

NO_ID = -1  # a raw value with no mapping: a sample holding one is bad, and its message names the value
RAW_VALUES = 256  # 8-bit labels
LABEL_MAP_KEYS = ("label_map", "reduce_zero_label", "binary_threshold")


def label_map_keys(data: DataConfig) -> list[str]:
    """The label-map keys the config sets (data.label_map, reduce_zero_label, binary_threshold)."""
    return [f"data.{k}" for k in LABEL_MAP_KEYS if getattr(data, k) not in (None, False)]


def _ids_from_dict(mapping: dict, ignore_label: int) -> list[int]:
    ids = [NO_ID] * RAW_VALUES
    for raw, train_id in mapping.items():
        ids[raw] = ignore_label if train_id is None else train_id
    return ids


def _reduce_zero(ignore_label: int) -> list[int]:
    """mmsegmentation's reduce_zero_label: 0 -> ignore, k -> k - 1, and ignore stays ignore."""
    ids = [raw - 1 for raw in range(RAW_VALUES)]
    ids[0] = ignore_label
    ids[ignore_label] = ignore_label
    return ids


def _check_user_map(mapping, data: DataConfig) -> dict[int, int]:
    """data.label_map as {raw: train id}, each key and value checked (one line naming the key)."""
    if isinstance(mapping, list):
        if len(mapping) > RAW_VALUES:
            raise ConfigError("label map too long", "data.label_map",
                              f"expected at most {RAW_VALUES} entries (raw values 0..255), got {len(mapping)}")
        mapping = dict(enumerate(mapping))
    for raw, train_id in mapping.items():
        if not 0 <= raw < RAW_VALUES:
            raise ConfigError("label map key out of range", "data.label_map",
                              f"expected raw label values in 0..255 (8-bit labels), got key {raw}")
        if not (0 <= train_id < data.num_classes or train_id == data.ignore_label):
            raise ConfigError("label map value out of range", "data.label_map",
                              f"expected train ids in [0, {data.num_classes}) (data.num_classes) or "
                              f"{data.ignore_label} (data.ignore_label), got {raw}: {train_id}")
    return mapping


def label_ids(data: DataConfig) -> Optional[list[int]]:
    """The train id of each raw label value 0..255 (NO_ID: no mapping), or None for the identity (labels
    already hold class indices, VOC's convention).

    Raises:
      ConfigError: more than one of data.label_map / reduce_zero_label / binary_threshold, binary_threshold
        without num_classes 2, a key outside 0..255 or a value out of range in data.label_map, or a class
        that no raw value maps to.
    """
    given = label_map_keys(data)
    if len(given) > 1:
        raise ConfigError("more than one label map", ", ".join(given), "expected at most one of them")
    if data.binary_threshold is not None:
        if data.num_classes != 2:
            raise ConfigError("binary_threshold needs 2 classes", "data.num_classes",
                              f"expected 2 with data.binary_threshold (raw < {data.binary_threshold} -> 0, "
                              f"raw >= {data.binary_threshold} -> 1), got {data.num_classes}")
        ids = [int(raw >= data.binary_threshold) for raw in range(RAW_VALUES)]
    elif data.label_map is not None:
        ids = _ids_from_dict(_check_user_map(data.label_map, data), data.ignore_label)
    elif data.reduce_zero_label:
        ids = _reduce_zero(data.ignore_label)
    else:
        own = LAYOUT_LABELS.get(data.layout)
        if own is None:
            return None
        ids = _reduce_zero(data.ignore_label) if own.reduce_zero_label else _ids_from_dict(own.label_map,
                                                                                             data.ignore_label)
    missing = sorted(set(range(data.num_classes)) - set(ids))
    if missing:
        raise ConfigError("a class with no id", given[0] if given else "data.num_classes",
                          f"expected every class 0..{data.num_classes - 1} to have a raw value mapped to it, "
                          f"none maps to {missing[:8]}{' ...' if len(missing) > 8 else ''}")
    return ids


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


def _resolve_model(cfg: Config) -> Config:
    """model.output_stride, model.segformer_channels, model.drop_path_rate and model.head_dropout from the
    backbone and head; the MiT and preset keys checked."""
    m = cfg.model
    mit = m.backbone in MIT_BACKBONES
    if m.output_stride is None:
        cfg = replace(cfg, "model.output_stride", default_output_stride(m.backbone))
    elif mit and m.output_stride != 32:
        raise ConfigError("not available for this backbone", "model.output_stride",
                          f"expected 32 (or no value) with model.backbone {m.backbone!r}: the Mix Transformer's "
                          f"stages have no dilated form, got {m.output_stride}")
    elif not mit and m.output_stride == 32:
        raise ConfigError("not available for this backbone", "model.output_stride",
                          f"expected one of 8, 16 (or no value) with model.backbone {m.backbone!r} (32 is the "
                          f"MiT backbones' fixed stride), got 32")
    # Filled for the head that uses it only: an older run's config.yaml has no such key, and its resolved
    # config must stay what it was (rundir.check_resume_config).
    if m.segformer_channels is None and m.head == "segformer":
        cfg = replace(cfg, "model.segformer_channels", default_segformer_channels(m.backbone))
    # Likewise the regularisation of SegFormer's recipe: filled for the MiT / the SegFormer head only.
    if m.drop_path_rate is None and mit:
        cfg = replace(cfg, "model.drop_path_rate", default_drop_path_rate(m.backbone))
    elif m.drop_path_rate and not mit:
        raise ConfigError("not available for this backbone", "model.drop_path_rate",
                          f"0 (or no value) with model.backbone {m.backbone!r}: drop path skips the Mix Transformer's "
                          f"residual blocks (mit_b0..mit_b5), got {m.drop_path_rate}")
    if m.head_dropout is None and m.head == "segformer":
        cfg = replace(cfg, "model.head_dropout", default_head_dropout(m.head))
    elif m.head_dropout and m.head != "segformer":
        raise ConfigError("not available for this head", "model.head_dropout",
                          f"0 (or no value) with model.head {m.head!r}: it is the SegFormer head's dropout before "
                          f"its classifier, got {m.head_dropout}")
    if mit and m.decoder_stride != 4:
        raise ConfigError("not available for this backbone", "model.decoder_stride",
                          f"expected 4 (or no value) with model.backbone {m.backbone!r}: the Mix Transformer has "
                          f"no stride-2 features, got {m.decoder_stride}")
    if m.init_weights is not None:
        if not mit or m.head != "segformer":
            raise ConfigError("not available for this model", "model.init_weights",
                              f"a keras-hub SegFormer preset needs model.backbone mit_b0..mit_b5 and model.head "
                              f"segformer, got {m.backbone!r} and {m.head!r}")
        if m.backbone_weights is not None:
            raise ConfigError("two initialisations", "model.backbone_weights",
                              "null with model.init_weights (the SegFormer preset holds the encoder too)")
    if mit:
        for key, size in (("data.crop_size", cfg.data.crop_size), ("eval.crop_size", cfg.eval.crop_size)):
            if size is not None and min(size) < MIT_MIN_SIZE:
                raise ConfigError("too small for this backbone", key,
                                  f"expected at least {MIT_MIN_SIZE} pixels per side with model.backbone "
                                  f"{m.backbone!r} (its first stage's 8x8 spatial reduction at stride 4), "
                                  f"got {list(size)}")
    return cfg


def _resolve_optimizer(cfg: Config) -> Config:
    """The two weight decays: model.weight_decay (an L2 term in the loss, Adam and SGD) and train.weight_decay
    (AdamW's decoupled decay). Each defaults for its optimizer and the other is refused, so they never stack
    unasked; an older run's resolved config (model.weight_decay 4e-5 or its own value) stays what it was."""
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
    if e.crop_size is not None and e.stride is None:
        cfg = replace(cfg, "eval.stride", tuple(-(-2 * c // 3) for c in e.crop_size))
    elif e.crop_size is not None and any(s > c for s, c in zip(e.stride, e.crop_size)):
        raise ConfigError("out of range", "eval.stride",
                          f"expected a stride at most eval.crop_size {list(e.crop_size)} in each dimension "
                          f"(windows must overlap or touch), got {list(e.stride)}")
    return cfg


def replace(cfg: Config, dotted: str, value) -> Config:
    """Returns a copy of `cfg` with the dotted key set to `value` (no validation; for code, not users)."""
    parts = dotted.split(".")
    if len(parts) == 1:
        return dataclasses.replace(cfg, **{parts[0]: value})
    section = getattr(cfg, parts[0])
    return dataclasses.replace(cfg, **{parts[0]: dataclasses.replace(section, **{parts[1]: value})})


def without_weight_files(cfg: Config) -> Config:
    """`cfg` with model.backbone_weights and model.init_weights null: for building a model whose every
    weight a checkpoint is about to restore (resume, inference, --init-from's source), so the files a run
    started from are not read again (they may have moved since)."""
    return replace(replace(cfg, "model.backbone_weights", None), "model.init_weights", None)


def from_dict(raw: dict, base_dir: str | os.PathLike = ".") -> Config:
    """Builds a Config from a plain dict (as written to RUN_DIR/config.yaml)."""
    return resolve_defaults(_build(Config, raw, "", Path(base_dir)))


def dump(cfg: Config, path: Path) -> None:
    """Writes the resolved config as YAML, atomically (temp file + rename)."""
    path = Path(path)
    tmp = path.with_name(path.name + f".tmp-{os.getpid()}")
    tmp.write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    os.replace(tmp, path)


def check_batch(cfg: Config, num_towers: int) -> None:
    """Raises ConfigError unless data.batch_size (the GLOBAL batch) splits evenly over `num_towers`.

    The one check of the config against the tower count, which is known only once the devices are
    chosen: train, seg-bench and the BN re-estimation all call it.
    """
    if cfg.data.batch_size % num_towers:
        raise ConfigError("batch does not divide across towers", "data.batch_size",
                          f"expected a multiple of the {num_towers} towers, got {cfg.data.batch_size}")


def flatten(d: dict, prefix: str = "") -> dict:
    """{'a': {'b': 1}} -> {'a.b': 1}: the sections' keys, dotted; a key's own mapping (data.label_map) stays whole."""
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and not prefix:
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out

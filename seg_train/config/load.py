"""YAML -> the config's dataclasses, strictly (an unknown key names the nearest valid one; a bad value
names the key, the value and what was expected), with --set overrides; dump and from_dict write and
rebuild it. No TensorFlow here."""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from seg_train.config.resolve import resolve_defaults
from seg_train.config.schema import SECTIONS, Config, replace, to_plain
from seg_train.util.errors import ConfigError

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
        if name in SECTIONS and prefix == "":
            kwargs[name] = _build(SECTIONS[name], raw.get(name), f"{name}.", base_dir)
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
                                  f"expected {problem}, got {to_plain(value)!r}")
            if meta.get("path"):
                value = _local_path(value, key, base_dir, meta.get("url"))
        kwargs[name] = value
    return cls(**kwargs)


def set_dotted(tree: dict, dotted: str, value) -> None:
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
      run_dir: the `--run-dir` flag; wins over the file and the overrides.
    """
    path = Path(path)
    raw = read_yaml(path)
    base_dir = path.resolve().parent
    cwd = Path.cwd()
    # Overrides are typed on the command line, so their paths are relative to where the user is.
    cli_paths = {}
    for text in overrides:
        key, value = parse_override(text)
        set_dotted(raw, key, value)
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


def without_weight_files(cfg: Config) -> Config:
    """`cfg` with model.backbone_weights and model.init_weights null, for a model a checkpoint is about to
    restore: the run's starting weights need not be read (they may have moved)."""
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


def flatten(d: dict, prefix: str = "") -> dict:
    """{'a': {'b': 1}} -> {'a.b': 1}: the sections' keys, dotted; a key's own mapping (data.label_map) stays whole."""
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and not prefix:
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out

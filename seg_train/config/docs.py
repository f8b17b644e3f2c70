"""docs/CONFIG.md, rendered from schema.py: one row per key (type, default, doc).

Write it with `python -m seg_train.config.docs > docs/CONFIG.md` (`make docs`); tests/test_config_docs.py
fails while the file differs from render().
"""

from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path

import yaml

from seg_train.config.schema import SECTIONS, Config, leaf_fields, to_plain

INTRO = """# Config keys

Generated from the config's dataclasses (seg_train/config/schema.py) by seg_train/config/docs.py: do not
edit by hand. After changing a key, its default or its doc, regenerate it with `make docs` (or
`python -m seg_train.config.docs > docs/CONFIG.md`); tests/test_config_docs.py fails until then.

A config is YAML, read strictly: an unknown key names the nearest valid one, a wrong type or an
out-of-range value names the key, the value and what was expected. Relative paths are relative to the
config file's folder; `--set KEY=VALUE` overrides a key (its paths relative to the current folder). The
resolved config, every default filled in, is written to `RUN_DIR/config.yaml`.
"""

SECTION_TITLES = {"": "Top level", "data": "data", "model": "model", "train": "train", "loss": "loss",
                  "eval": "eval"}


def type_text(tp, f: dataclasses.Field) -> str:
    """A key's type as a user writes it: int, [int, int], list of float, str one of ..., ... or null."""
    choices = f.metadata.get("choices")
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        text = " or ".join(type_text(a, f) for a in args)
        return f"{text} or null" if type(None) in typing.get_args(tp) else text
    if choices:
        return "one of " + ", ".join(map(str, choices))
    if origin is tuple:
        return "[" + ", ".join(type_text(a, f) for a in typing.get_args(tp)) + "]"
    if origin is list:
        return f"list of {type_text(typing.get_args(tp)[0], f)}"
    if origin is dict:
        key, value = typing.get_args(tp)
        return f"mapping {type_text(key, f)}: {type_text(value, f)}"
    if tp is Path:
        return "path or URL" if f.metadata.get("url") else "path"
    return {int: "int", float: "float", bool: "bool", str: "str"}.get(tp, str(tp))


def default_text(f: dataclasses.Field) -> str:
    """The default as YAML writes it, or what a derived (or required) default is."""
    if f.metadata.get("default_doc"):
        return f.metadata["default_doc"]
    value = f.default_factory() if f.default is dataclasses.MISSING else f.default
    text = yaml.safe_dump(to_plain(value), default_flow_style=True).strip()
    return "`" + text.removesuffix("...").strip() + "`"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def render() -> str:
    """docs/CONFIG.md's text."""
    hints = {"": typing.get_type_hints(Config), **{s: typing.get_type_hints(c) for s, c in SECTIONS.items()}}
    rows: dict[str, list[str]] = {s: [] for s in SECTION_TITLES}
    for key, f in leaf_fields().items():
        section = key.split(".")[0] if "." in key else ""
        rows[section].append(f"| `{key}` | {_cell(type_text(hints[section][f.name], f))} | "
                             f"{_cell(default_text(f))} | {_cell(f.metadata['doc'])} |")
    out = [INTRO]
    for section, title in SECTION_TITLES.items():
        out += [f"## {title}", "", "| key | type | default | what |", "| --- | --- | --- | --- |", *rows[section], ""]
    return "\n".join(out)


if __name__ == "__main__":
    print(render(), end="")

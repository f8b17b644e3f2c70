"""docs/CONFIG.md is the description of every config key, rendered from the dataclasses (seg_train/config/docs.py).

Fails for a key without a one-line doc in its field (the reference would have an empty cell), and for a
docs/CONFIG.md that differs from what render() gives (a key, default or doc changed without `make docs`).
"""

from pathlib import Path

from seg_train.config import docs
from seg_train.config.schema import leaf_fields

CONFIG_MD = Path(__file__).resolve().parent.parent / "docs" / "CONFIG.md"


def test_every_key_has_a_one_line_doc():
    fields = leaf_fields()
    assert len(fields) > 60 and {"seed", "data.root", "eval.logit_adjustment"} <= set(fields)  # every section
    undocumented = sorted(k for k, f in fields.items() if not f.metadata.get("doc", "").strip())
    assert not undocumented, f"config keys without a doc: {undocumented}"
    multi_line = sorted(k for k, f in fields.items() if "\n" in f.metadata["doc"])
    assert not multi_line, f"docs of more than one line: {multi_line}"


def test_config_md_is_rendered_from_the_dataclasses():
    text = docs.render()
    for key in leaf_fields():
        assert f"| `{key}` |" in text, key  # one row per key
    assert CONFIG_MD.read_text() == text, "docs/CONFIG.md is stale: run `make docs`"

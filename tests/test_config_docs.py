"""README.md's config table is the one description of every config key.

Fails for a key added to config.py without a row in the table (a user cannot find it), and for a
row that names a key config.py no longer has (the README promises what the code does not do).
"""

import dataclasses
import re
from pathlib import Path

from seg_train import config as config_lib

README = Path(__file__).resolve().parent.parent / "README.md"


def config_keys(cls=config_lib.Config, prefix="") -> set:
    keys = set()
    for f in dataclasses.fields(cls):
        tp = f.type if isinstance(f.type, type) else getattr(config_lib, str(f.type), None)
        if dataclasses.is_dataclass(tp):
            keys |= config_keys(tp, f"{prefix}{f.name}.")
        else:
            keys.add(prefix + f.name)
    return keys


def documented_keys() -> set:
    """The keys in the first column of the table under '| key | default | meaning |'."""
    lines = README.read_text().splitlines()
    start = lines.index("| key | default | meaning |")
    keys = set()
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        keys |= set(re.findall(r"`([a-z_]+(?:\.[a-z_0-9]+)?)`", line.split("|")[1]))
    return keys


def test_every_config_key_has_a_readme_row_and_every_row_a_key():
    code, docs = config_keys(), documented_keys()
    assert len(code) > 60  # the walk reached every section
    assert not code - docs, f"config keys without a README row: {sorted(code - docs)}"
    assert not docs - code, f"README rows naming no config key: {sorted(docs - code)}"

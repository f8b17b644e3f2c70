"""scripts/mutants.yaml stays applicable to the code (`make mutants` is not part of `make test`, so a
refactoring that breaks a mutant's find text would otherwise go unnoticed until the next check).

Wrong answers this catches: a find text that no longer occurs in its file, or occurs twice (the
mutant would be an ERROR, or mutate the wrong place); a test it names that was renamed or removed."""

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import mutants  # noqa: E402


def test_every_mutant_applies_once_and_names_existing_tests():
    entries = mutants.load_mutants()
    assert len(entries) >= 15
    for m in entries:
        assert mutants.applicability(m) is None, m["name"]
        for node in m["tests"]:
            path, _, name = node.partition("::")
            function = re.sub(r"\[.*\]$", "", name)
            assert function and re.search(rf"^def {re.escape(function)}\(", (ROOT / path).read_text(), re.M), node

"""scripts/mutants.py --check, the list check `make mutants` runs first, on a tiny made-up repository.

Wrong answers this catches: a find text that no longer occurs in its file, or occurs twice, or a test
it names that was renamed, passing the check (the mutant would be an ERROR or mutate the wrong place);
a list that applies failing it."""

import sys
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

import mutants  # noqa: E402


def entry(name, find, test="checks/test_m.py::test_half[1]"):
    return {"name": name, "file": "pkg/m.py", "find": find, "replace": "    return x", "why": "made up",
            "tests": [test]}


def check(tmp_path, entries):
    (tmp_path / "pkg").mkdir(exist_ok=True)
    (tmp_path / "pkg" / "m.py").write_text("def half(x):\n    return x / 2\n\n\ndef twice(x):\n    return x * 2\n"
                                           "\n\ndef same(x):\n    return x * 1\n\n\ndef also(x):\n"
                                           "    return x * 1\n")
    (tmp_path / "checks").mkdir(exist_ok=True)
    (tmp_path / "checks" / "test_m.py").write_text("def test_half(v):\n    pass\n")
    (tmp_path / "list.yaml").write_text(yaml.safe_dump(entries))
    return mutants.main(["--check", "--file", str(tmp_path / "list.yaml"), "--root", str(tmp_path)])


def test_check_passes_a_list_that_applies(tmp_path, capsys):
    assert check(tmp_path, [entry("half", "    return x / 2"), entry("twice", "x * 2")]) == 0
    assert capsys.readouterr().out.strip() == "2 mutant(s) apply"


def test_check_names_every_stale_entry(tmp_path, capsys):
    rc = check(tmp_path, [entry("ok", "    return x / 2"), entry("gone", "    return x / 3"),
                          entry("twice-found", "    return x * 1"),
                          entry("renamed-test", "x * 2", "checks/test_m.py::test_twice"),
                          entry("no-test-file", "x * 2", "checks/test_gone.py::test_half")])
    assert rc == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert [line.split(" ")[3] for line in err] == ["(gone):", "(twice-found):", "(renamed-test):", "(no-test-file):"]
    assert all(line.startswith("error: stale mutant (") for line in err)
    assert "occurs 0 times" in err[0] and "occurs 2 times" in err[1]
    assert "no test function checks/test_m.py::test_twice" in err[2] and "no test file" in err[3]

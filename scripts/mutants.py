#!/usr/bin/env python3
"""The mutation check: each plausible bug of scripts/mutants.yaml must make its targeted tests fail.

For each mutation: a fresh temporary copy of the repository (the checkout itself is never touched, so
an interrupted run leaves nothing behind), the one text replaced there, and `python -m pytest -x -q
<its tests>` run in the copy with PYTHONPATH pointing at it. Verdicts:
  KILLED    a listed test failed: the tests catch this bug;
  SURVIVED  every listed test passed: a hole in the tests (exit 1);
  ERROR     the find text is missing or not unique, pytest could not collect the tests on the mutant
            (e.g. it does not import), or the per-mutant timeout (exit 1: nothing proved for it).
Every selected entry is first checked to apply (its find text once in its file, its test functions
present): a stale entry stops the check before anything runs (exit 1). The listed tests are then run
once on an unmutated copy: a mutant "killed" by a test that fails anyway (or by a test id that does
not exist) proves nothing, so the check aborts (exit 2) unless they all pass.

  python scripts/mutants.py                 # all mutants (make mutants)
  python scripts/mutants.py --list          # the list, checked, nothing run
  python scripts/mutants.py --check         # only: does every entry still apply (exit 1 if not)
  python scripts/mutants.py --only NAME ... --json results.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
LIST = ROOT / "scripts" / "mutants.yaml"
# What the tests need of the repository (docs and README: tests read configs and docs' templates; benchmarks: the
# tests of the benchmark scripts load them).
COPY = ["seg_train", "tests", "scripts", "benchmarks", "configs", "docs", "setup.cfg", "pyproject.toml", "README.md",
        "Makefile"]
KEYS = ("name", "file", "find", "replace", "why", "tests")


class ListError(Exception):
    """A malformed list file (a user error: exit 2)."""


def load_mutants(path: Path = LIST) -> list[dict]:
    """The entries of the list file, checked for their keys and unique names."""
    entries = yaml.safe_load(path.read_text())
    if not isinstance(entries, list) or not entries:
        raise ListError(f"error: no mutants ({path}): expected a YAML list of entries")
    names = set()
    for i, m in enumerate(entries):
        where = f"{path.name} entry {i + 1}"
        if not isinstance(m, dict) or set(m) != set(KEYS):
            got = sorted(m) if isinstance(m, dict) else type(m).__name__
            raise ListError(f"error: bad mutant ({where}): expected exactly the keys {', '.join(KEYS)}, got {got}")
        if m["name"] in names:
            raise ListError(f"error: duplicate mutant name ({where}): expected unique names, got {m['name']!r}")
        names.add(m["name"])
        if not isinstance(m["tests"], list) or not m["tests"] or not all(isinstance(t, str) for t in m["tests"]):
            raise ListError(f"error: bad tests ({where}): expected a non-empty list of pytest node ids")
        for key in ("find", "replace"):
            if not isinstance(m[key], str):
                raise ListError(f"error: bad {key} ({where}): expected a string")
        if m["find"] == m["replace"]:
            raise ListError(f"error: no-op mutant ({where}): expected replace to differ from find")
    return entries


def applicability(m: dict, root: Path = ROOT) -> str | None:
    """Why the mutant cannot be applied to `root` (None: it can: its find text occurs exactly once)."""
    path = root / m["file"]
    if not path.is_file():
        return f"no file {m['file']}"
    count = path.read_text().count(m["find"])
    if count != 1:
        return f"find text occurs {count} times in {m['file']} (expected exactly once)"
    for test in m["tests"]:
        path, _, name = test.partition("::")
        if not (root / path).is_file():
            return f"no test file {path}"
        function = re.sub(r"\[.*\]$", "", name)
        if not function or not re.search(rf"^def {re.escape(function)}\(", (root / path).read_text(), re.M):
            return f"no test function {test}"
    return None


def stale(mutants: list[dict], root: Path = ROOT) -> list[str]:
    """One error line per entry that cannot be applied to `root` (empty: every entry applies)."""
    return [f"error: stale mutant ({m['name']}): {reason}; expected its find text once and its tests to exist"
            for m in mutants if (reason := applicability(m, root))]


def copy_repo(dest: Path) -> None:
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".pytest_cache")
    for name in COPY:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, dest / name, ignore=ignore)
        elif src.is_file():
            shutil.copy2(src, dest / name)


def env_for(copy: Path) -> dict:
    env = dict(os.environ)
    # The copy first: the venv's editable install of the checkout appends its finder after sys.path.
    env["PYTHONPATH"] = str(copy)
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    return env


def run_pytest(copy: Path, tests: list[str], timeout: float) -> tuple[int | None, str, float]:
    """(pytest's exit code or None on timeout, its output, seconds), run in `copy` on the copy's code."""
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider",
           f"--basetemp={copy / '.pytest-tmp'}", *tests]
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=copy, env=env_for(copy), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
        return proc.returncode, out, time.monotonic() - start
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the pytest we started and its children (subprocess tests)
        out, _ = proc.communicate()
        return None, out, time.monotonic() - start
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise


def imports_the_copy(copy: Path) -> bool:
    code = "import seg_train, tests.helpers; print(seg_train.__file__); print(tests.helpers.__file__)"
    r = subprocess.run([sys.executable, "-c", code], cwd=copy, env=env_for(copy), capture_output=True, text=True)
    return r.returncode == 0 and all(Path(line).resolve().is_relative_to(copy.resolve())
                                     for line in r.stdout.split())


def first_failure(output: str) -> str:
    """pytest's first failing node id and the first 'E ' lines of its report (the assertion), shortened."""
    lines = output.splitlines()
    node = next((line.split(" - ")[0] for line in lines if line.startswith(("FAILED ", "ERROR "))), "")
    message = " | ".join([line[1:].strip() for line in lines if line.startswith("E ") and line[1:].strip()][:3])
    if not node and not message:
        tail = [line for line in lines if line.strip()]
        return tail[-1][:200] if tail else ""
    return f"{node}: {message[:200]}" if message else node


def check_mutant(m: dict, timeout: float) -> dict:
    result = {"name": m["name"], "file": m["file"], "tests": m["tests"], "why": m["why"]}
    reason = applicability(m)
    if reason:
        return {**result, "verdict": "ERROR", "seconds": 0.0, "detail": reason}
    with tempfile.TemporaryDirectory(prefix=f"mutant-{m['name']}-") as tmp:
        copy = Path(tmp)
        copy_repo(copy)
        target = copy / m["file"]
        target.write_text(target.read_text().replace(m["find"], m["replace"], 1))
        code, out, seconds = run_pytest(copy, m["tests"], timeout)
    if code is None:
        verdict, detail = "ERROR", f"timeout after {timeout:.0f} s"
    elif code == 1:
        verdict, detail = "KILLED", first_failure(out)
    elif code == 0:
        verdict, detail = "SURVIVED", "all listed tests passed"
    else:  # 2: interrupted or collection error (e.g. the mutant does not import); 4: bad node id; 5: none run
        verdict, detail = "ERROR", f"pytest exit code {code}: {first_failure(out)}"
    return {**result, "verdict": verdict, "seconds": round(seconds, 1), "detail": detail}


def baseline(mutants: list[dict], timeout: float) -> tuple[bool, str, float]:
    """The union of the listed tests on an unmutated copy: (all passed, output, seconds)."""
    tests = list(dict.fromkeys(t for m in mutants for t in m["tests"]))
    with tempfile.TemporaryDirectory(prefix="mutant-baseline-") as tmp:
        copy = Path(tmp)
        copy_repo(copy)
        if not imports_the_copy(copy):
            return False, "the copy's seg_train / tests are not what Python imports from PYTHONPATH", 0.0
        code, out, seconds = run_pytest(copy, tests, timeout * max(1, len(tests)))
    return code == 0, out, seconds


def table(results: list[dict]) -> str:
    rows = [("mutant", "file", "tests", "verdict", "seconds")]
    for r in results:
        tests = r["tests"][0].replace("tests/", "") + (f" (+{len(r['tests']) - 1})" if len(r["tests"]) > 1 else "")
        rows.append((r["name"], r["file"].replace("seg_train/", ""), tests, r["verdict"], f"{r['seconds']:.1f}"))
    widths = [max(len(row[i]) for row in rows) for i in range(5)]
    lines = ["  ".join(c.ljust(w) if i < 4 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
             for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", action="append", metavar="NAME", help="run only this mutant (repeatable)")
    ap.add_argument("--list", action="store_true", help="print the mutants (checked against the code) and exit")
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per mutant (default 900)")
    ap.add_argument("--check", action="store_true",
                    help="only check that every entry applies (find text once, tests exist); run nothing")
    ap.add_argument("--file", type=Path, default=LIST, help=argparse.SUPPRESS)
    ap.add_argument("--root", type=Path, default=ROOT, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    try:
        mutants = load_mutants(args.file)
    except (ListError, yaml.YAMLError, OSError) as e:
        print(e if isinstance(e, ListError) else f"error: unreadable list ({args.file}): {e}", file=sys.stderr)
        return 2
    if args.only:
        unknown = [n for n in args.only if n not in {m["name"] for m in mutants}]
        if unknown:
            print(f"error: unknown mutant (--only {unknown[0]}): expected one of the names --list prints",
                  file=sys.stderr)
            return 2
        mutants = [m for m in mutants if m["name"] in args.only]

    if args.list:
        for m in mutants:
            reason = applicability(m, args.root)
            print(f"{m['name']}  [{m['file']}]{'  ERROR: ' + reason if reason else ''}\n    {m['why']}")
            for t in m["tests"]:
                print(f"    - {t}")
        return 1 if any(applicability(m, args.root) for m in mutants) else 0

    # Every entry checked before anything runs: a stale entry fails the check at once (exit 1).
    errors = stale(mutants, args.root)
    for line in errors:
        print(line, file=sys.stderr)
    if errors or args.check:
        if not errors:
            print(f"{len(mutants)} mutant(s) apply")
        return 1 if errors else 0

    start = time.monotonic()
    runnable = mutants
    print(f"baseline: the listed tests of {len(runnable)} mutant(s) on the unmutated code ...", flush=True)
    ok, out, seconds = baseline(runnable, args.timeout) if runnable else (True, "", 0.0)
    if not ok:
        print(out[-4000:], file=sys.stderr)
        print(f"error: the listed tests fail without any mutation ({args.file}): expected them to pass first "
              "(a mutant killed by a failing test proves nothing)", file=sys.stderr)
        return 2
    print(f"baseline: passed ({seconds:.1f} s)", flush=True)

    results = []
    for i, m in enumerate(mutants, 1):
        r = check_mutant(m, args.timeout)
        results.append(r)
        print(f"[{i}/{len(mutants)}] {r['name']}: {r['verdict']} ({r['seconds']:.1f} s) {r['detail']}", flush=True)
    total = time.monotonic() - start
    print()
    print(table(results))
    counts = {v: sum(r["verdict"] == v for r in results) for v in ("KILLED", "SURVIVED", "ERROR")}
    print(f"\n{counts['KILLED']} killed, {counts['SURVIVED']} survived, {counts['ERROR']} error; "
          f"{total:.0f} s in all (baseline {seconds:.0f} s)")
    if args.json:
        Path(args.json).write_text(json.dumps({"results": results, "baseline_seconds": round(seconds, 1),
                                               "total_seconds": round(total, 1), **counts}, indent=2) + "\n")
    return 1 if counts["SURVIVED"] or counts["ERROR"] else 0


if __name__ == "__main__":
    sys.exit(main())

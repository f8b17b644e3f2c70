"""Every repository path that the docs, docstrings and comments cite exists.

Fails for a comment or doc that still names a file after it was renamed or removed (it happened:
comments cited an accumulation test file and a schedule test file that did not exist).
A citation is a path under one of the repository's own folders (seg_train/, tests/, scripts/,
docs/, configs/), or a module path relative to seg_train/ (models/sync_bn.py), ending in a file
suffix the repository has; and, in the Markdown docs and in comments, a bare module name
(collectives.py), which must be a module of seg_train/, scripts/ or tests/.
"""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CITED = re.compile(r"(?<![\w/.-])((?:seg_train|tests|scripts|docs|configs|models|\.ci)/"
                   r"[\w./-]*\.(?:py|md|yaml|sh|json|png))")
BARE = re.compile(r"(?<![\w/.-])([a-z_]\w*\.py)\b")
# Paths that name what a run or a command WRITES, not repository files.
NOT_REPO = ("docs/PERFORMANCE.md.new",)


def sources():
    yield ROOT / "README.md"
    for folder, pattern in (("docs", "*.md"), ("seg_train", "*.py"), ("scripts", "*"), ("tests", "*.py"),
                            ("configs", "*.yaml"), (".ci", "*")):
        yield from (p for p in (ROOT / folder).rglob(pattern) if p.is_file() and p.suffix in (".py", ".md", ".yaml",
                                                                                           ".sh", ""))
    yield ROOT / "Makefile"
    yield ROOT / "setup.cfg"


def exists(cited: str) -> bool:
    return (ROOT / cited).exists() or (ROOT / "seg_train" / cited).exists()


def test_every_cited_repository_path_exists():
    modules = {p.name for folder in ("seg_train", "scripts", "tests") for p in (ROOT / folder).rglob("*.py")}
    missing = []
    checked = 0
    for path in sources():
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            prose = line if path.suffix == ".md" else line.partition("#")[2]
            for name in BARE.findall(prose):
                checked += 1
                if name not in modules:
                    missing.append(f"{path.relative_to(ROOT)}:{number}: {name}")
            for cited in CITED.findall(line):
                cited = cited.rstrip(".")
                if cited in NOT_REPO:
                    continue
                checked += 1
                if not exists(cited):
                    missing.append(f"{path.relative_to(ROOT)}:{number}: {cited}")
    assert checked > 100  # the scan reads what it should
    assert not missing, "cited paths that do not exist:\n" + "\n".join(missing)


def test_every_module_is_in_the_readme_layout():
    """README's Layout section names every module of the package (a newcomer's map of the code).

    Fails for a module added without a line there (six were missing once)."""
    text = (ROOT / "README.md").read_text()
    layout = text[text.index("## Layout"):]
    layout = layout[:layout.index("```", layout.index("```") + 3)]
    missing = [str(p.relative_to(ROOT)) for p in sorted((ROOT / "seg_train").rglob("*.py"))
               if p.name != "__init__.py" and str(p.relative_to(ROOT)) not in layout and p.name not in layout]
    assert not missing, f"modules missing from README's Layout section: {missing}"

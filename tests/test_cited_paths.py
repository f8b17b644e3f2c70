"""Every repository path that the docs, docstrings and comments cite exists.

Fails for a comment or doc that still names a file after it was renamed or removed (it happened:
comments cited an accumulation test file and a schedule test file that did not exist).
A citation is a path under one of the repository's own folders (seg_train/, tests/, scripts/,
benchmarks/, docs/, configs/), or a module path relative to seg_train/ (models/sync_bn.py), ending in
a file suffix the repository has; and, in the Markdown docs and in comments, a bare module name
(collectives.py), which must be a module of seg_train/, scripts/, benchmarks/ or tests/. A path given at
a commit (abc1234:scripts/x.py, what `git show` takes) names a file of the history, not of the tree.
"""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CITED = re.compile(r"(?<![\w/.-])((?:seg_train|tests|scripts|benchmarks|docs|configs|models|\.ci)/"
                   r"[\w./-]*\.(?:py|md|yaml|sh|json|png))")
BARE = re.compile(r"(?<![\w/.-])([a-z_]\w*\.py)\b")
# Paths that name what a run or a command WRITES, not repository files.
NOT_REPO = ("docs/PERFORMANCE.md.new",)
AT_COMMIT = re.compile(r"(?<![\w])[0-9a-f]{7,40}:$")


def sources():
    yield ROOT / "README.md"
    yield ROOT / "DEVELOPING.md"
    for folder, pattern in (("docs", "*.md"), ("seg_train", "*.py"), ("scripts", "*"), ("benchmarks", "*"),
                            ("tests", "*.py"), ("configs", "*.yaml"), (".ci", "*")):
        yield from (p for p in (ROOT / folder).rglob(pattern) if p.is_file() and p.suffix in (".py", ".md", ".yaml",
                                                                                           ".sh", ""))
    yield ROOT / "Makefile"
    yield ROOT / "setup.cfg"


def exists(cited: str) -> bool:
    return (ROOT / cited).exists() or (ROOT / "seg_train" / cited).exists()


def test_every_cited_repository_path_exists():
    modules = {p.name for folder in ("seg_train", "scripts", "benchmarks", "tests")
               for p in (ROOT / folder).rglob("*.py")}
    missing = []
    checked = 0
    for path in sources():
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            prose = line if path.suffix == ".md" else line.partition("#")[2]
            for name in BARE.findall(prose):
                checked += 1
                if name not in modules:
                    missing.append(f"{path.relative_to(ROOT)}:{number}: {name}")
            for match in CITED.finditer(line):
                cited = match.group(1).rstrip(".")
                if cited in NOT_REPO or AT_COMMIT.search(line[:match.start()]):
                    continue
                checked += 1
                if not exists(cited):
                    missing.append(f"{path.relative_to(ROOT)}:{number}: {cited}")
    assert checked > 100  # the scan reads what it should
    assert not missing, "cited paths that do not exist:\n" + "\n".join(missing)


def test_every_module_is_in_the_layout():
    """DEVELOPING.md's Layout section names every module of the package (a newcomer's map of the code).

    Fails for a module added without a line there (six were missing once)."""
    text = (ROOT / "DEVELOPING.md").read_text()
    layout = text[text.index("## Layout"):]
    layout = layout[:layout.index("```", layout.index("```") + 3)]
    missing = [str(p.relative_to(ROOT)) for p in sorted((ROOT / "seg_train").rglob("*.py"))
               if p.name != "__init__.py" and str(p.relative_to(ROOT)) not in layout and p.name not in layout]
    assert not missing, f"modules missing from DEVELOPING.md's Layout section: {missing}"


# ---- dotted names: `module.function`, `Class.method`, `section.key` ------------------------------------
# A doc or comment that names a function, class, method or config key by a dotted name must name one that
# exists (docs/BATCHNORM.md once described a `reestimate` function of a bn_stats module, a `load_trainer` of a
# restore module and an `average_bn_moving_stats` of replicas.py, none of which existed any more).
#
# What is checked:
# - in the Markdown docs, every dotted name inside backticks or a fenced code block: its first part must be a
#   module, package or class of seg_train (then the rest must be defined there), a config section (then the
#   key must be one of its fields), `seg_train` (the import path must resolve), or one of the outside roots
#   below (TensorFlow, Keras, numpy, file names...); anything else is reported as unknown;
# - in comments and docstrings of the code, every dotted name whose first part is a module or class of
#   seg_train (a local variable of the same name, e.g. `state.step`, resolves through the module's instance
#   attributes).
OUTSIDE_ROOTS = {
    "tf", "keras", "np", "numpy", "yaml", "PIL", "Image", "os", "sys", "json", "tqdm", "h5py", "pytest",
    "tensorboard", "keras_hub", "kagglehub", "cityscapesscripts", "ai_edge_litert", "tflite", "absl", "scipy",
    "onnx", "onnxruntime", "tf2onnx",
    "CommunicationOptions", "CommunicationImplementation", "libtensorflow_cc",  # TF's C++/collective API names
    "FILE", "RUN_DIR", "classes", "best", "leftImg8bit_trainvaltest", "gtFine_trainvaltest",  # file names
    "summary", "optimizer", "state", "cfg", "args", "self",  # objects of a code sample or a docstring
}
CONFIG_SECTIONS = ("data", "model", "train", "loss", "eval")
# Names that are both a module of seg_train and a config section: in prose they mean the config key.
AMBIGUOUS_MODULES = {"train", "data", "eval"}
FILE_SUFFIXES = {"py", "md", "yaml", "yml", "json", "txt", "png", "jpg", "h5", "sh", "lock", "index", "tflite",
                 "onnx", "pb", "cfg", "toml", "tfrecord", "csv", "html", "gz", "zip", "whl", "so", "log", "out", "com",
                 "bin", "safetensors"}
# Dotted names of the outside world that start like one of ours: Keras' Model.fit, Latin.
OUTSIDE_NAMES = {"model.fit", "e.g", "i.e"}
DOTTED = re.compile(r"(?<![\w./-])([A-Za-z_]\w*)((?:\.[A-Za-z_]\w*)+)")


def _defined_names() -> tuple[dict, dict]:
    """(module or package name -> names it defines, class name -> its attributes), read from the source.

    A module's names: its top-level functions, classes, assignments and imports, `Class.attr` for each
    class's methods and class attributes, and the attributes its code assigns on `self` (so a dotted name
    of an instance, `reader.cfg`, resolves). A package adds its submodules.
    """
    import ast
    modules, classes = {}, {}
    for path in (ROOT / "seg_train").rglob("*.py"):
        name = path.parent.name if path.name == "__init__.py" else path.stem
        names = modules.setdefault(name, set())
        tree = ast.parse(path.read_text())
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                for target in (node.targets if isinstance(node, ast.Assign) else [node.target]):
                    names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                names.update((a.asname or a.name).split(".")[0] for a in node.names)
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                attrs = classes.setdefault(node.name, set())
                for sub in ast.walk(node):
                    if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        attrs.add(sub.name)
                    elif isinstance(sub, (ast.Assign, ast.AnnAssign)):
                        for target in (sub.targets if isinstance(sub, ast.Assign) else [sub.target]):
                            attrs.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
                    if isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name) and sub.value.id == "self":
                        attrs.add(sub.attr)
                names.update(attrs)
                names.update(f"{node.name}.{a}" for a in attrs)
        if path.name == "__init__.py":
            names.update(p.stem for p in path.parent.glob("*.py"))
            names.update(p.name for p in path.parent.iterdir() if p.is_dir())
    return modules, classes


def _config_keys() -> dict:
    import dataclasses

    from seg_train import config
    sections = {"data": config.DataConfig, "model": config.ModelConfig, "train": config.TrainConfig,
                "loss": config.LossConfig, "eval": config.EvalConfig}
    return {s: {f.name for f in dataclasses.fields(cls)} for s, cls in sections.items()}


def _code_spans(text: str):
    """(line number, text) of each backticked span and each line of a fenced code block of a Markdown file."""
    fenced = False
    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if fenced:
            yield number, line
        else:
            for span in re.findall(r"`([^`]+)`", line):
                yield number, span


def _comments_and_docstrings(path: Path):
    import ast
    source = path.read_text()
    for number, line in enumerate(source.splitlines(), 1):
        if "#" in line:
            yield number, line.partition("#")[2]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                for offset, line in enumerate(doc.splitlines()):
                    yield node.body[0].lineno + offset, line


def _resolve(first: str, rest: list[str], modules: dict, classes: dict, keys: dict, in_docs: bool) -> str | None:
    """None if the dotted name first.rest resolves (or is not ours to check), else why not."""
    if rest[-1] in FILE_SUFFIXES or f"{first}.{rest[0]}" in OUTSIDE_NAMES:
        return None  # a file name (config.yaml, train.py)
    if first == "seg_train":  # a package path: each part must be defined in the one before it
        names = modules["seg_train"]
        for i, part in enumerate(rest):
            if part not in names:
                return f"seg_train.{'.'.join(rest[:i])} has no {part}" if i else f"no module {part} in seg_train"
            if part not in modules:
                return None
            names = modules[part]
        return None
    if first in CONFIG_SECTIONS and (in_docs or first in AMBIGUOUS_MODULES):
        if rest[0] in keys[first] or (first in modules and rest[0] in modules[first]):
            return None
        return f"no config key {first}.{rest[0]}"
    if first in modules and first not in AMBIGUOUS_MODULES:
        if rest[0] in modules[first] or (len(rest) > 1 and f"{rest[0]}.{rest[1]}" in modules[first]):
            return None
        return f"{first} has no {rest[0]}"
    if first in classes:
        return None if rest[0] in classes[first] else f"{first} has no {rest[0]}"
    if not in_docs or first in OUTSIDE_ROOTS or first in modules:
        return None
    return f"unknown name {first}"


def test_every_cited_dotted_name_exists():
    modules, classes = _defined_names()
    keys = _config_keys()
    missing, checked = [], 0
    docs = [ROOT / "README.md", ROOT / "DEVELOPING.md", *sorted((ROOT / "docs").glob("*.md"))]
    code = [*sorted((ROOT / "seg_train").rglob("*.py")), *sorted((ROOT / "scripts").glob("*.py")),
            *sorted((ROOT / "tests").glob("*.py"))]
    for path, in_docs in [(p, True) for p in docs] + [(p, False) for p in code]:
        lines = _code_spans(path.read_text()) if in_docs else _comments_and_docstrings(path)
        for number, text in lines:
            for m in DOTTED.finditer(text):
                first, rest = m.group(1), m.group(2).split(".")[1:]
                if not in_docs and not (first in modules or first in classes or first == "seg_train"):
                    continue
                checked += 1
                why = _resolve(first, rest, modules, classes, keys, in_docs)
                if why:
                    missing.append(f"{path.relative_to(ROOT)}:{number}: {m.group(0)} ({why})")
    assert checked > 300  # the scan reads what it should
    assert not missing, "dotted names that do not exist:\n" + "\n".join(missing)


# A section cited by its title: `docs/GUIDE.md, "TensorBoard in detail"`, `README: "Resume, interruption, exit
# codes"`, `(docs/GUIDE.md, Loss options)`; or by its number: `docs/SCALING.md, section 8`.
QUOTED_SECTION = re.compile(r"(?<![\w/.-])(README|DEVELOPING|docs/[A-Z]+)(?:\.md)?(?:'s)?[,:]?\s+(?:section\s+)?"
                            r"[\"'“]([^\"'”]{2,80})[\"'”]")
BARE_SECTION = re.compile(r"\((?:see )?(README|DEVELOPING|docs/[A-Z]+)(?:\.md)?,\s+([A-Z][^)\"'“”;]{2,60})[);]")
NUMBERED_SECTION = re.compile(r"(?<![\w/.-])(README|DEVELOPING|docs/[A-Z]+)(?:\.md)?,?\s+sections?\s+(\d+)")


def _headings(doc: str) -> list[str]:
    text = (ROOT / f"{doc}.md").read_text()
    return [re.sub(r"^#+\s*", "", line).strip().lower() for line in text.splitlines() if line.startswith("#")]


def test_every_cited_section_exists():
    """A title (or number) cited for a section of README, DEVELOPING or docs/ is a heading of that file.

    Fails for a citation left behind when a section moved or was renamed: configs and the schema cited README
    sections ("Fine-tuning from ImageNet", "SegFormer and keras-hub presets", "Your data", "Loss options") after
    README became a user's page and those sections went to docs/; the generated docs/CONFIG.md carried one.
    A title may be cut where a line wraps: it must begin a heading, or appear in one.
    """
    missing, checked = [], 0
    for path in sources():
        if path.suffix not in (".py", ".md", ".yaml", ".sh", "") or not path.is_file():
            continue
        flat = re.sub(r"\n\s*#?\s*", " ", path.read_text(errors="replace"))  # a citation wraps over comment lines
        for m in list(QUOTED_SECTION.finditer(flat)) + list(BARE_SECTION.finditer(flat)):
            doc, title = m.group(1), m.group(2).strip().rstrip(".").lower()
            checked += 1
            if not any(h.startswith(title) or title in h for h in _headings(doc)):
                missing.append(f"{path.relative_to(ROOT)}: {doc}, {m.group(2)!r}")
        for m in NUMBERED_SECTION.finditer(flat):
            checked += 1
            if not any(re.match(rf"{m.group(2)}[.)\s]", h) for h in _headings(m.group(1))):
                missing.append(f"{path.relative_to(ROOT)}: {m.group(1)}, section {m.group(2)}")
    assert checked > 15  # the scan reads what it should
    assert not missing, "cited sections that do not exist:\n" + "\n".join(missing)

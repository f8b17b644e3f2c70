"""The package's import graph: no circle anywhere in seg_train/, and config/ on the ground floor.

The graph is read from the source (ast), every import counted wherever it stands: at module level, inside
a function (a function-local import that closes a circle is the circle itself, put off until the call),
under `if TYPE_CHECKING:`. `from seg_train.data import files` is an arrow to seg_train/data/files.py;
`from seg_train.data import open_split` (a name, not a module) would be an arrow to seg_train/data/__init__.py,
so a circle through a package's __init__.py is a circle here too. Python also runs a package's __init__.py
before any of its modules; that alone is no arrow: a module that imports its siblings never reads the
half-run __init__.py (the models package's __init__.py imports its modules, which import one another),
while a module that takes a name from it does, and that is an arrow.

Fails for: a circle such as the one config.py, data/labels.py, data/layouts.py, data/reader.py,
data/files.py and preflight.py made (config.py checking label maps through data/, whose modules import
config.py), two modules importing each other inside functions (data/scan.py and data/scan_cache.py did),
and config/ importing anything of seg_train other than seg_train/util/errors.py (which imports no TensorFlow and
nothing of config/); its tables (label_tables.py, variants.py) are its own.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "seg_train"


def modules(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every .py under the package folder `root`."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def imports(name: str, path: Path, known: dict[str, Path]) -> list[tuple[str, int, bool]]:
    """(imported module of the package, line, inside a function) for every import in one module."""
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []

    def visit(node, in_function: bool):
        for child in ast.iter_child_nodes(node):
            inside = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            targets = []
            if isinstance(child, ast.Import):
                targets = [alias.name for alias in child.names]
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:  # relative: from the package, one level up per extra dot
                    up = package.split(".")[:len(package.split(".")) - child.level + 1]
                    base = ".".join(up + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in child.names]
            found.extend((t, child.lineno, in_function) for t in dict.fromkeys(targets) if t in known and t != name)
            visit(child, inside)

    visit(tree, False)
    return found


def graph(root: Path) -> dict[str, list[tuple[str, int, bool]]]:
    known = modules(root)
    return {name: imports(name, path, known) for name, path in known.items()}


def cycles(edges: dict[str, list[tuple[str, int, bool]]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm), each sorted."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def connect(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w, _, _ in edges[v]:
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            connect(v)
    return out


def describe(edges, component: list[str]) -> str:
    """The arrows inside a circle, with the line of each import and where it stands."""
    inside = set(component)
    return "; ".join(f"{a} -> {b} (line {line}{', in a function' if local else ''})"
                     for a in component for b, line, local in edges[a] if b in inside)


def test_no_circle_in_the_package_imports():
    edges = graph(PACKAGE)
    assert len(edges) > 60 and sum(map(len, edges.values())) > 200  # the whole package was read
    found = cycles(edges)
    assert not found, "import circles: " + " | ".join(describe(edges, c) for c in found)


# What config/ may import outside itself: the error type, no TensorFlow (its tables, label_tables.py and
# variants.py, are its own).
CONFIG_MAY_IMPORT = {"seg_train.util.errors"}


def test_config_is_the_ground_floor():
    """config/ imports of seg_train only the pure table modules, and they import nothing else of seg_train
    (so no data module, no config/ in a circle): every other module may import the config."""
    edges = graph(PACKAGE)
    inside = {name for name in edges if name == "seg_train.config" or name.startswith("seg_train.config.")}
    outside = {b for name in inside for b, _, _ in edges[name]} - inside
    assert outside == CONFIG_MAY_IMPORT, f"config/ imports {sorted(outside - CONFIG_MAY_IMPORT)}"
    for table in sorted(CONFIG_MAY_IMPORT):
        assert {b for b, _, _ in edges[table]} <= CONFIG_MAY_IMPORT, f"{table} imports {edges[table]}"
    assert any(b == "seg_train.config" for b, _, _ in edges["seg_train.data.labels"])  # the walk sees imports


def test_config_imports_no_tensorflow():
    """Importing the config (and with it the tables) starts no TensorFlow: a command refuses a config before
    TensorFlow's slow start."""
    code = ("import sys, seg_train.config, seg_train.config.docs\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('tensorflow', 'keras', 'numpy')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=PACKAGE.parent).stdout
    assert out.strip() == "[]", out


# Each case: the files of a small package pkg/ with one circle, and the modules on it.
CIRCLES = {
    "module level": ({"a.py": "import os\nfrom pkg.sub import b\n", "sub/b.py": "from pkg import a\n"},
                     ["pkg.a", "pkg.sub.b"]),
    "in a function": ({"a.py": "from pkg.sub import b\n", "sub/b.py": "def f():\n    from pkg import a\n"},
                      ["pkg.a", "pkg.sub.b"]),
    # module a takes a name from the package pkg.sub (its __init__), which imports module b, which imports a
    "through __init__": ({"a.py": "from pkg.sub import thing\n", "sub/__init__.py": "from pkg.sub.b import thing\n",
                          "sub/b.py": "from pkg import a\nthing = 1\n"}, ["pkg.a", "pkg.sub", "pkg.sub.b"]),
}


@pytest.mark.parametrize("case", list(CIRCLES))
def test_the_walk_finds_a_circle(tmp_path, case):
    """The check itself fails on a circle of each kind (a check that cannot fail would pass anything), and
    passes once the arrow back is gone."""
    files, expected = CIRCLES[case]
    pkg = tmp_path / "pkg"
    for name, text in {"__init__.py": "", "sub/__init__.py": "", **files}.items():
        (pkg / name).parent.mkdir(parents=True, exist_ok=True)
        (pkg / name).write_text(text)
    assert cycles(graph(pkg)) == [expected]
    (pkg / "sub" / "b.py").write_text("thing = 1\n")
    assert cycles(graph(pkg)) == []

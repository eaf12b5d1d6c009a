"""decode/ is layered (``decode.LAYERS``, bottom first): every import — module level, inside functions, under
TYPE_CHECKING — goes to the importer's own layer or one below; decode never imports toolkit; modules do not
import each other in a cycle; every module sits in a layer package whose docstring says what it holds."""
from __future__ import annotations

import ast
import textwrap
from pathlib import Path

import pytest

import decode

ROOT = Path(decode.__file__).resolve().parent


def module_files(root: Path) -> dict[str, Path]:
    """Dotted module name (``decode.core.target``; a package by its own name) → file."""
    out = {}
    for p in sorted(root.rglob("*.py")):
        parts = [root.name, *p.relative_to(root).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


def imports_of(name: str, path: Path, known: set[str]) -> list[tuple[str, int]]:
    """(imported module, line) for every import statement in ``path`` naming a module of ``known``'s packages
    (``from pkg import sub`` counts as importing ``pkg.sub`` when that is a module)."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    top = {k.split(".")[0] for k in known} | {"toolkit"}
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names if a.name.split(".")[0] in top]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if mod.split(".")[0] not in top:
                continue
            subs = [f"{mod}.{a.name}" for a in node.names if f"{mod}.{a.name}" in known]
            out += [(s, node.lineno) for s in subs] or [(mod, node.lineno)]
    return out


def layer_of(module: str, layers: tuple[str, ...]) -> int | None:
    """Index of the module's layer; the root package and its ``__main__`` sit above every layer."""
    parts = module.split(".")
    if len(parts) == 1 or parts[1] == "__main__":
        return len(layers)
    return layers.index(parts[1]) if parts[1] in layers else None


def check_layers(root: Path, layers: tuple[str, ...]) -> list[str]:
    """Every breach of the layer rules under ``root``, as readable lines (empty: none)."""
    files = module_files(root)
    known = set(files)
    problems = []
    for name, path in files.items():
        mine = layer_of(name, layers)
        if mine is None:
            problems.append(f"{path.relative_to(root.parent)}: not in a layer package (decode.LAYERS: {layers})")
            continue
        for dep, line in imports_of(name, path, known):
            where = f"{path.relative_to(root.parent)}:{line}"
            if dep.split(".")[0] == "toolkit":
                problems.append(f"{where}: {name} imports {dep} (decode never imports toolkit)")
                continue
            theirs = layer_of(dep, layers)
            if theirs is not None and theirs > mine:
                problems.append(f"{where}: {name} (layer {layers[mine]}) imports {dep} "
                                f"(higher layer {layers[theirs]})")
    return problems


def import_cycles(root: Path) -> list[list[str]]:
    """Cycles among modules (a package's ``__init__`` importing its own submodules excepted: Python
    runs a package's ``__init__`` first, so a submodule importing a sibling through it is no cycle)."""
    files = module_files(root)
    known = set(files)
    graph = {n: {d for d, _ in imports_of(n, p, known) if d in known and not n.startswith(d + ".")
                 and not d.startswith(n + ".")} for n, p in files.items()}
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):  # Tarjan's strongly connected components
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_import_reaches_a_higher_layer():
    problems = check_layers(ROOT, decode.LAYERS)
    assert not problems, "imports against the layer order:\n" + "\n".join(problems)


def test_no_import_cycle():
    assert import_cycles(ROOT) == []


def test_every_layer_is_a_documented_package():
    for layer in decode.LAYERS:
        init = ROOT / layer / "__init__.py"
        assert init.is_file(), f"decode.LAYERS names {layer}, but decode/{layer}/__init__.py is missing"
        doc = ast.get_docstring(ast.parse(init.read_text()))
        assert doc and f"``{layer}``" in doc, f"decode/{layer}/__init__.py's docstring must say what the layer holds"
    stray = sorted(p.name for p in ROOT.iterdir() if p.suffix == ".py" and p.name not in ("__init__.py", "__main__.py"))
    assert not stray, f"modules outside every layer: {stray}"


@pytest.fixture
def fake_tree(tmp_path):
    """A two-layer package with one legal and one illegal import, a toolkit import and a cycle."""
    files = {
        "pkg/__init__.py": "",
        "pkg/low/__init__.py": '"""``low``."""',
        "pkg/low/a.py": "from . import b\n",
        "pkg/low/b.py": "def f():\n    from ..high import e\n",      # lazy import of a higher layer
        "pkg/high/__init__.py": '"""``high``."""',
        "pkg/high/c.py": "from ..low.a import x\nfrom .d import y\n",  # legal; c ↔ d is a cycle
        "pkg/high/d.py": "from pkg.high import c\nimport toolkit.thing\n",
        "pkg/high/e.py": "",
        "pkg/stray.py": "",
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(textwrap.dedent(text))
    return tmp_path / "pkg"


def test_the_checks_catch_what_they_are_for(fake_tree):
    problems = check_layers(fake_tree, ("low", "high"))
    assert any("pkg.low.b (layer low) imports pkg.high.e" in p for p in problems)
    assert any("imports toolkit.thing" in p for p in problems)
    assert any("pkg/stray.py: not in a layer package" in p for p in problems)
    assert not any("pkg.high.c (layer high)" in p for p in problems)  # importing a lower layer is fine
    assert len(problems) == 3
    assert import_cycles(fake_tree) == [["pkg.high.c", "pkg.high.d"]]

"""Layers point down only: every import of the package (imports inside functions too) against the declared order.

The order is declared once, in docs/architecture.md (the fenced block under "## Layers"): one layer per
line, lowest first; a line lists module names relative to ``thunder_train`` and a name covers its
submodules (the longest matching name decides).  A module may import modules of its own layer or of
lower ones; no import may close a cycle.  A lower layer that needs a higher one gets a hook the
higher layer installs at import time (see the docs).
"""
from __future__ import annotations

import ast
import pathlib
import re
import textwrap

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PKG = ROOT / "thunder_train"
DOC = ROOT / "docs" / "architecture.md"


def declared_layers() -> list[list[str]]:
    text = DOC.read_text()
    m = re.search(r"^## Layers\n(.*?)^```\n(.*?)^```", text, re.S | re.M)
    assert m, "docs/architecture.md needs a '## Layers' section with a fenced block of layers"
    layers = []
    for line in m.group(2).splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            layers.append(line.split())
    return layers


def modules() -> dict[str, pathlib.Path]:
    out = {}
    for p in sorted(PKG.rglob("*.py")):
        parts = p.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


EMPTY_PACKAGES = {m for m, p in modules().items() if p.name == "__init__.py" and not p.read_text().strip()}


def imports_of(name: str, path: pathlib.Path, mods) -> list[tuple[str, int]]:
    """(imported package module, line) for every import statement in the file, nested ones included.

    ``from pkg import mod`` counts as importing ``pkg.mod``; ``from pkg import obj`` as importing ``pkg``.
    """
    is_pkg = path.name == "__init__.py"
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names if a.name in mods]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_pkg else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            subs = [f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in mods]
            out += [(s, node.lineno) for s in subs]
            if len(subs) < len(node.names) and target in mods:
                out.append((target, node.lineno))
    return [(t, line) for t, line in out if t != name]


def layer_of(name: str, layers) -> int | None:
    if name in EMPTY_PACKAGES:
        return 0  # an empty __init__.py imports nothing
    rel = name.removeprefix("thunder_train").lstrip(".") or "thunder_train"
    best = None
    for i, layer in enumerate(layers):
        for entry in layer:
            if rel == entry or rel.startswith(entry + "."):
                if best is None or len(entry) > best[1]:
                    best = (i, len(entry))
    return None if best is None else best[0]


def graph():
    mods = modules()
    return mods, {m: imports_of(m, p, mods) for m, p in mods.items()}


def test_every_module_has_a_layer():
    layers = declared_layers()
    missing = [m for m in modules() if layer_of(m, layers) is None]
    assert not missing, f"modules without a layer in docs/architecture.md (add them to the '## Layers' block): {missing}"


def test_imports_point_down():
    layers = declared_layers()
    mods, edges = graph()
    bad = []
    for m, targets in edges.items():
        lm = layer_of(m, layers)
        for t, line in targets:
            lt = layer_of(t, layers)
            if lm is not None and lt is not None and lt > lm:
                bad.append(f"{mods[m].relative_to(ROOT)}:{line} imports {t} (layer {lt} {layers[lt]}) from layer {lm} {layers[lm]}")
    assert not bad, "imports against the declared layer order:\n" + "\n".join(bad)


def _cycles(edges) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w, _ in edges.get(v, ()):
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

    for v in edges:
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles():
    _, edges = graph()
    cycles = _cycles(edges)
    assert not cycles, "import cycles (a lower module must get a hook from the higher one instead):\n" + "\n".join(map(str, cycles))


def test_the_checker_sees_nested_and_relative_imports(tmp_path):
    # The walker must find imports inside functions and resolve relative ones, or the tests above prove nothing.
    src = "from . import b\n\ndef f():\n    from .sub import c\n    import pkg.d\n"
    p = tmp_path / "a.py"
    p.write_text(src)
    mods = {"pkg.a": p, "pkg.b": p, "pkg.sub": p, "pkg.sub.c": p, "pkg.d": p}
    found = {t for t, _ in imports_of("pkg.a", p, mods)}
    assert found == {"pkg.b", "pkg.sub.c", "pkg.d"}
    assert _cycles({"x": [("y", 1)], "y": [("x", 2)], "z": [("x", 3)]}) == [["x", "y"]]


@pytest.mark.parametrize("name,expected", [("thunder_train.compiler.torchlang.nn", "compiler.torchlang"),
                                           ("thunder_train", "thunder_train")])
def test_layer_lookup_uses_the_longest_name(name, expected):
    layers = declared_layers()
    assert expected in layers[layer_of(name, layers)]


def _package_of(name: str) -> str:
    """``compiler``, ``runtime``, ... : the first folder (or module) under thunder_train."""
    rel = name.removeprefix("thunder_train").lstrip(".")
    return rel.split(".")[0] if rel else "thunder_train"


@pytest.mark.parametrize("package,allowed", [
    ("compiler", {"compiler"}),  # compile time ends in a frozen product and knows nothing of what calls it
    ("runtime", {"compiler", "runtime"}),  # call time runs what compile time produced
])
def test_compile_time_and_call_time_are_separate_packages(package, allowed):
    mods, edges = graph()
    bad = [f"{mods[m].relative_to(ROOT)}:{line} imports {t}"
           for m, targets in edges.items() if _package_of(m) == package
           for t, line in targets if _package_of(t) not in allowed]
    assert not bad, f"thunder_train/{package}/ may import only {sorted(allowed)}:\n" + "\n".join(bad)


def test_callbacks_and_compiled_sit_above_runtime():
    layers = declared_layers()
    runtime = layer_of("thunder_train.runtime", layers)
    assert runtime > max(layer_of(m, layers) for m in modules() if _package_of(m) == "compiler")
    assert layer_of("thunder_train.compiled", layers) > runtime
    assert layer_of("thunder_train.callbacks", layers) > layer_of("thunder_train.compiled", layers)


MAX_FUNCTION_LINES = 150


def test_no_function_is_longer_than_150_lines():
    long = []
    for name, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({n} lines)")
    assert not long, f"functions longer than {MAX_FUNCTION_LINES} lines (split them):\n" + "\n".join(long)


def test_the_length_check_counts_nested_functions(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    tree = ast.parse(f"def outer():\n    def inner():\n{textwrap.indent(body, '    ')}\n    return inner\n")
    lengths = {n.name: n.end_lineno - n.lineno + 1 for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
    assert lengths["inner"] == MAX_FUNCTION_LINES + 1 and lengths["outer"] > lengths["inner"]
def _imported(edges, module: str) -> set:
    return {t for t, _ in edges[f"thunder_train.compiler.{module}"]}


def test_fusing_executors_share_regions_not_each_other():
    # What Inductor and nvFuser fusion both need (fusible lines, a region's values and key) is executors/regions.py.
    _, edges = graph()
    assert "thunder_train.compiler.executors.inductor_fusion" not in _imported(edges, "executors.nvfuser_fusion")
    assert "thunder_train.compiler.executors.nvfuser_fusion" not in _imported(edges, "executors.inductor_fusion")
    for m in ("executors.inductor_fusion", "executors.nvfuser_fusion"):
        assert "thunder_train.compiler.executors.regions" in _imported(edges, m)


def test_transforms_import_no_executor():
    # Passes that serve one executor (saved statistics, re-inplacing, kept buffers) live with it in executors/.
    mods, edges = graph()
    bad = [f"{m} imports {t}" for m in mods if m.startswith("thunder_train.compiler.transforms")
           for t, _ in edges[m] if t.startswith("thunder_train.compiler.executors")]
    assert not bad, bad

"""The house, checked against the real tree: the layers ``docs/development.md`` draws, its
layout of ``compjax/``, the moved module paths, and the size and documentation rules.

Nothing here runs JAX: the imports are read from the source (``ast``), so a rule broken by an
import inside a function counts as much as one at the top of a module.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import pathlib
import re
import warnings

import pytest

import compjax
from compjax import _moved

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "compjax"
DEVELOPMENT = ROOT / "docs" / "development.md"
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 120


def module_files() -> dict[str, pathlib.Path]:
    """Every module of ``compjax``: dotted name -> file (a package by its ``__init__.py``)."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = module_files()


def imports(name: str, path: pathlib.Path) -> set[str]:
    """The ``compjax`` modules that module ``name`` imports (anywhere in its source).

    ``from compjax.pkg import sub`` imports the submodule ``sub``, not the package's
    ``__init__``; ``from compjax.pkg import function`` imports the package.
    """
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name in MODULES)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            subs = [f"{source}.{a.name}" for a in node.names if f"{source}.{a.name}" in MODULES]
            found.update(subs)
            if len(subs) < len(node.names) and source in MODULES:
                found.add(source)
    return found - {name}


GRAPH = {name: imports(name, path) for name, path in MODULES.items()}


def unit(name: str) -> str:
    """The layer unit a module belongs to: a top-level module or package of ``compjax``."""
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else "compjax"


def layers_from_docs() -> list[tuple[str, list[str]]]:
    """The layer picture in ``docs/development.md`` (top to bottom): ``(label, units)``."""
    text = DEVELOPMENT.read_text()
    block = re.search(r"## Layers\n.*?```text\n(.*?)```", text, re.S)
    assert block, "docs/development.md has no ## Layers section with a text block"
    rows = []
    for line in block.group(1).splitlines():
        if not line.strip():
            continue
        label, _, rest = line.partition(":")
        units = [u.strip().removesuffix("/").removesuffix(".py") for u in rest.split()]
        rows.append((label.strip(), [u for u in units if u]))
    return rows


def layer_of() -> dict[str, int]:
    return {u: i for i, (_, units) in enumerate(layers_from_docs()) for u in units}


def test_the_layer_picture_names_every_unit_once():
    named = [u for _, units in layers_from_docs() for u in units]
    twice = sorted({u for u in named if named.count(u) > 1})
    assert not twice, f"named twice: {twice}"
    real = {unit(m) for m in MODULES}
    assert set(named) == real, (
        f"docs/development.md's layers lack {sorted(real - set(named))} "
        f"and name {sorted(set(named) - real)}, which are not in compjax/"
    )


def test_imports_go_down_the_layers_only():
    level = layer_of()
    back = sorted(
        f"{a} -> {b}"
        for a, targets in GRAPH.items()
        for b in targets
        if unit(a) != unit(b) and level[unit(b)] <= level[unit(a)]
    )
    assert not back, f"imports that do not go down a layer: {back}"


def test_no_module_imports_its_own_package_or_the_root():
    up = sorted(
        f"{a} -> {b}"
        for a, targets in GRAPH.items()
        for b in targets
        if a.startswith(b + ".") and MODULES[a].name != "__main__.py"
    )
    assert not up, f"modules importing a package above them: {up}"


def test_no_import_circles():
    index, low, stack, on, circles, counter = {}, {}, [], set(), [], [0]

    def visit(v):  # Tarjan's strongly connected components
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in GRAPH[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in GRAPH:
        if v not in index:
            visit(v)
    assert not circles, f"import circles: {circles}"


def test_modules_are_short():
    long = {n: len(p.read_text().splitlines()) for n, p in MODULES.items()}
    over = {n: k for n, k in long.items() if k > MAX_MODULE_LINES}
    assert not over, f"modules over {MAX_MODULE_LINES} lines (split by concept): {over}"


def test_functions_are_short():
    """A function's length counts the closures inside it."""
    over = []
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    over.append(f"{name}.{node.name}: {length}")
    assert not over, f"functions over {MAX_FUNCTION_LINES} lines: {over}"


def public_functions():
    """The functions a user calls: ``compjax.__all__``'s, and the advisor's and NNX's."""
    found = {f"compjax.{n}": getattr(compjax, n) for n in compjax.__all__}
    for name in ("compjax.advise", "compjax.nnx"):
        module = importlib.import_module(name)
        for n in getattr(module, "__all__", dir(module)):
            obj = getattr(module, n)
            if inspect.isfunction(obj) and obj.__module__.startswith(module.__name__):
                found[f"{name}.{n}"] = obj
    return {n: f for n, f in found.items() if inspect.isfunction(f)}


def test_every_public_function_documents_args_and_returns():
    functions = public_functions()
    sample = {"compjax.qsgd", "compjax.fsdp", "compjax.advise.advise", "compjax.nnx.optimizer"}
    assert sample <= set(functions)
    lacking = sorted(
        f"{name} ({', '.join(s for s in ('Args:', 'Returns:') if s not in (f.__doc__ or ''))})"
        for name, f in functions.items()
        if not all(s in (f.__doc__ or "") for s in ("Args:", "Returns:"))
    )
    assert not lacking, f"public functions whose docstring lacks a section: {lacking}"


def layout_paths() -> set[str]:
    """The paths the layout block of ``docs/development.md`` names under ``compjax/``."""
    text = DEVELOPMENT.read_text()
    block = re.search(r"## Layout\n.*?```text\n(.*?)```", text, re.S)
    assert block, "docs/development.md has no ## Layout section with a text block"
    paths, stack = set(), []
    for line in block.group(1).splitlines():
        match = re.match(r"^( *)(\S+?(?:/|\.py))(?:\s|$)", line)
        if not match:
            continue
        depth = len(match.group(1)) // 2
        stack = [*stack[:depth], match.group(2).removesuffix("/")]
        if stack[0] == "compjax" and not stack[-1].endswith(("__init__.py", "__main__.py")):
            paths.add("/".join(stack))
    return paths


def test_the_layout_names_every_module_and_only_real_ones():
    real = {"compjax"}
    for path in PACKAGE.rglob("*"):
        if "__pycache__" in path.parts or path.name in ("__init__.py", "__main__.py"):
            continue
        if path.suffix == ".py" or (path.is_dir() and (path / "__init__.py").exists()):
            real.add(str(path.relative_to(ROOT).with_suffix("")))
    named = {p.removesuffix(".py") for p in layout_paths()}
    assert named == real, (
        f"docs/development.md's layout lacks {sorted(real - named)} "
        f"and names {sorted(named - real)}, which are not in compjax/"
    )


@pytest.mark.parametrize("old", sorted(_moved.MOVED))
def test_a_moved_path_imports_the_module_now_there(old):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        module = importlib.import_module(old)
    assert module is importlib.import_module(_moved.MOVED[old])
    assert old in DEVELOPMENT.read_text(), f"docs/development.md's moved paths lack {old}"


def test_old_paths_keep_the_public_functions():
    """``import compjax.auto`` (a moved module's old path) leaves ``compjax.auto`` the function."""
    import compjax.auto
    import compjax.local_steps

    assert inspect.isfunction(compjax.auto) and inspect.isfunction(compjax.local_steps)
    from compjax.sharded import fsdp

    assert fsdp is compjax.fsdp

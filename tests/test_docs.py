"""The documentation builds without a warning, and its API reference lists every public name.

The public names are those of ``compjax.__all__`` and ``compjax.advise.__all__`` and, for
``compjax.nnx``, ``compjax.advise.report``, ``compjax.advise.fsdp``, ``compjax.advise.cli``
and ``compjax.advise.codec_timing`` (which have no ``__all__``), every top-level
function, class and constant their source defines without a leading underscore.  The
reference lists a name with an ``autosummary`` entry (which generates its page from the
docstring) or, for a submodule, an ``automodule`` directive.
"""

import ast
import importlib
import importlib.util
import os
import pathlib
import re
import subprocess
import sys

import pytest

import compjax
import compjax.advise

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
API = DOCS / "api"
BUILD_TIMEOUT_S = 300
ADVISE_MODULES = (
    "compjax.advise.report",
    "compjax.advise.fsdp",
    "compjax.advise.cli",
)


def defined_names(module_name: str) -> set[str]:
    """The public names a module's own source defines at top level."""
    module = importlib.import_module(module_name)
    tree = ast.parse(pathlib.Path(module.__file__).read_text())
    names = set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                elts = target.elts if isinstance(target, ast.Tuple) else [target]
                names.update(t.id for t in elts if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return {f"{module_name}.{name}" for name in names if not name.startswith("_")}


def public_names() -> set[str]:
    names = {f"compjax.{name}" for name in compjax.__all__}
    advise = set().union(
        *map(defined_names, ADVISE_MODULES),
        defined_names("compjax.advise.codec_timing"),
    )
    advise |= {f"compjax.advise.{name}" for name in compjax.advise.__all__}
    return names | defined_names("compjax.nnx") | advise


def listed_names() -> set[str]:
    """Every name the reference's ``.rst`` files list, fully qualified."""
    names = set()
    for path in sorted(API.glob("*.rst")):
        current, in_summary = None, False
        for line in path.read_text().splitlines():
            directive = re.match(r"^\.\. (\w+)::\s*(\S*)", line)
            if directive:
                kind, argument = directive.groups()
                in_summary = kind == "autosummary"
                if kind in ("automodule", "currentmodule"):
                    current = argument
                if kind == "automodule":
                    names.add(argument)
            elif in_summary and re.match(r"^\s+[\w.]+\s*$", line):
                entry = line.strip()
                names.add(entry if current is None else f"{current}.{entry}")
            elif in_summary and line and not line.startswith(" "):
                in_summary = False
    return names


def test_public_names_are_found():
    names = public_names()
    # a sample of each module, so that an empty or wrong collection fails here
    assert {"compjax.qsgd", "compjax.nnx.optimizer", "compjax.advise.advise"} <= names
    assert "compjax.advise.codec_timing.SAMPLE_ENTRIES" in names
    assert not any(name.rsplit(".", 1)[1].startswith("_") for name in names)


def test_api_reference_lists_every_public_name():
    missing = public_names() - listed_names()
    assert not missing, f"not in docs/api/*.rst: {sorted(missing)}"


def test_api_reference_lists_only_real_names():
    for name in listed_names() - public_names():
        module_name, _, attribute = name.rpartition(".")
        if not module_name:  # a top-level module: compjax itself
            importlib.import_module(name)
            continue
        module = importlib.import_module(module_name)
        if not hasattr(module, attribute) and importlib.util.find_spec(name) is not None:
            continue  # a submodule its package does not import (compjax.steps.elastic_sync)
        assert hasattr(module, attribute), f"docs/api lists {name}, which does not exist"


@pytest.mark.slow  # 16 s: make test-slow (and make docs) build it; the name checks run fast
def test_docs_build_without_warnings(tmp_path):
    """``make docs``'s build in a fresh output folder, every warning an error.  The ``dummy``
    builder reads every page, generates and renders the API reference from the docstrings and
    resolves every reference, as ``make docs`` does, but writes no HTML (the theme's
    navigation on every page is most of ``make docs``'s time)."""
    cmd = [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-j", "1", "-q", "-b", "dummy"]
    cmd += ["-d", str(tmp_path / "doctrees"), str(DOCS), str(tmp_path / "out")]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert (tmp_path / "doctrees" / "api" / "generated" / "compjax.qsgd.doctree").is_file()

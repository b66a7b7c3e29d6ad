"""Module paths that moved, kept importable: ``import compjax.sharded`` gives
:mod:`compjax.steps.fsdp` (the same module object, so ``isinstance`` checks agree).

The table is the one list of old paths; ``docs/development.md`` prints it and
``tests/test_layout.py`` holds every entry to an existing module.  A path that
names a public function too (``compjax.auto``, ``compjax.local_steps``) is bound
in ``sys.modules`` up front, so importing it never replaces the function.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys

#: Old module path -> the module it names now.
MOVED = {
    "compjax.step": "compjax.steps.data_parallel",
    "compjax.sharded": "compjax.steps.fsdp",
    "compjax.fsdp_layout": "compjax.steps.fsdp_layout",
    "compjax.fsdp_state": "compjax.steps.fsdp_state",
    "compjax.param_gather": "compjax.steps.param_gather",
    "compjax.hpz": "compjax.steps.hpz",
    "compjax.local_steps": "compjax.steps.local_steps",
    "compjax.auto": "compjax.steps.auto",
    "compjax.nnx": "compjax.steps.nnx",
    "compjax.advise_cli": "compjax.advise.cli",
    "compjax.advise_fsdp": "compjax.advise.fsdp",
    "compjax.advise_report": "compjax.advise.report",
    "compjax.codec_timing": "compjax.advise.codec_timing",
    "compjax.flat_exchange": "compjax.exchange.flat",
    "compjax.scatter": "compjax.exchange.scatter",
    "compjax.overflow": "compjax.exchange.overflow",
    "compjax.transforms.guards": "compjax.guards",
    "compjax.transforms.dgc_select": "compjax.compressors.selection",
}


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Resolves an old path to the module now at its new one."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        return importlib.import_module(MOVED[spec.name])

    def exec_module(self, module):
        """Nothing to run: the module was imported at its new path."""


def install(shadowed: tuple[str, ...]) -> None:
    """Put the finder on ``sys.meta_path`` once, and bind the ``shadowed`` old paths (those
    whose last name is a public function of their package) in ``sys.modules`` now.

    Args:
      shadowed: old paths, keys of :data:`MOVED`, already imported at their new path.

    Returns:
      None.
    """
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.append(_Finder())
    for old in shadowed:
        sys.modules.setdefault(old, importlib.import_module(MOVED[old]))

"""Numerical checks of the theorems and lemmas compjax relies on.

Each module checks one paper's results against the library's own
compressors and transformations (never a re-implementation), so a wrong
constant, a biased sampler or a broken transformation in compjax makes a
check fail.  ``python -m proofs_checks`` runs them all and prints a table;
see ``proofs_checks/README.md`` for what each check proves and what it
cannot.

A check is a function ``fn(fast: bool) -> list[Result]`` registered with
:func:`check`; :func:`run_all` runs them in module order.
"""

from __future__ import annotations

import dataclasses
import importlib
import time
import traceback
from collections.abc import Callable

PASS, FAIL, SKIPPED = "PASS", "FAIL", "SKIPPED"

# One module per paper result, in the order of the report.
MODULES = (
    "qsgd",
    "terngrad",
    "random_k",
    "natural",
    "natural_dithering",
    "eden",
    "int_quant",
    "atomo",
    "contraction",
    "two_stage",
    "error_feedback",
    "onebit_adam",
    "diana",
    "dad",
    "local_sgd",
)


@dataclasses.dataclass(frozen=True)
class Result:
    """One claim and its verdict.

    Attributes:
      claim: what is asserted, in words.
      source: the paper and result number (or section) it comes from.
      measured: the measured value, formatted.
      bound: the bound (or the exact value) it is compared with, formatted.
      verdict: ``"PASS"``, ``"FAIL"`` or ``"SKIPPED"``.
      detail: how it was measured (cases, sample sizes, confidence).
    """

    claim: str
    source: str
    measured: str
    bound: str
    verdict: str
    detail: str = ""


@dataclasses.dataclass(frozen=True)
class Check:
    name: str
    module: str
    fn: Callable[[bool], list[Result]]


REGISTRY: list[Check] = []


def check(fn: Callable[[bool], list[Result]]) -> Callable[[bool], list[Result]]:
    """Register ``fn(fast) -> list[Result]`` as a check (in definition order)."""
    module = fn.__module__.rsplit(".", 1)[-1]
    REGISTRY[:] = [c for c in REGISTRY if (c.module, c.name) != (module, fn.__name__)]
    REGISTRY.append(Check(name=fn.__name__, module=module, fn=fn))
    return fn


def result(claim, source, measured, bound, ok, detail="") -> Result:
    """A :class:`Result` with verdict PASS if ``ok`` else FAIL."""
    return Result(claim, source, measured, bound, PASS if ok else FAIL, detail)


def load(modules=MODULES) -> list[Check]:
    """Import the check modules (registering their checks); the checks, in order."""
    for name in modules:
        importlib.import_module(f"proofs_checks.{name}")
    order = {name: i for i, name in enumerate(MODULES)}
    return sorted(
        (c for c in REGISTRY if c.module in modules),
        key=lambda c: order.get(c.module, len(order)),
    )


def run_all(fast: bool = False, modules=MODULES, log: Callable[[str], None] | None = None):
    """Run the checks of ``modules``; returns ``(results, seconds per check)``.

    A check that raises gives one FAIL row naming the exception.
    """
    results: list[Result] = []
    timings: dict[str, float] = {}
    for c in load(modules):
        start = time.perf_counter()
        try:
            rows = list(c.fn(fast))
        except Exception as err:  # a crash is a failed claim, shown in the table
            rows = [
                Result(
                    claim=f"{c.module}.{c.name} runs",
                    source="-",
                    measured=f"{type(err).__name__}: {err}",
                    bound="no exception",
                    verdict=FAIL,
                    detail=traceback.format_exc(limit=3),
                )
            ]
        name = f"{c.module}.{c.name}"
        timings[name] = time.perf_counter() - start
        if log is not None:
            log(f"  {name}: {len(rows)} claims, {timings[name]:.1f} s")
        results.extend(rows)
    return results, timings


__all__ = ["FAIL", "MODULES", "PASS", "SKIPPED", "Result", "check", "load", "result", "run_all"]

"""What the figure scripts share: where outputs go, quick or full runs, the SUMMARY sections."""

from __future__ import annotations

import math
import os
import pathlib
from collections.abc import Sequence

import numpy as np
from scipy import stats
from tqdm.auto import tqdm

from experiments.harness import train

OUT_DIR = pathlib.Path(__file__).parent / "out"
# Where runs are cached; COMPJAX_RESULTS points elsewhere (e.g. an empty folder for timing).
RESULTS = pathlib.Path(
    os.environ.get("COMPJAX_RESULTS", pathlib.Path(__file__).parents[1] / "results")
)


def full() -> bool:
    """Whether the longer runs were asked for (``make figures FULL=1``, i.e. ``FULL=1``)."""
    return os.environ.get("FULL", "").strip().lower() in ("1", "true", "yes")


def mean_ci95(values: Sequence[float]) -> tuple[float, float]:
    """``(mean, half-width)`` of the two-sided 95% Student-t interval of the mean.

    One value has no interval: the half-width is ``inf``.
    """
    x = np.asarray(values, np.float64)
    if x.size < 2:
        return float(x.mean()), math.inf
    half = stats.t.ppf(0.975, x.size - 1) * x.std(ddof=1) / math.sqrt(x.size)
    return float(x.mean()), float(half)


def ci_verdict(mean: float, half: float) -> str:
    """``"higher"`` when the interval lies above 0, ``"lower"`` below, else ``"no difference"``."""
    if mean - half > 0:
        return "higher"
    if mean + half < 0:
        return "lower"
    return "no difference"


def runs(configs: Sequence[train.Config], desc: str) -> list[train.Run]:
    """Train (or read the finished results of) every config, with one progress bar."""
    return [
        train.run(cfg, RESULTS, progress=False)
        for cfg in tqdm(configs, desc=desc, unit="run", leave=False)
    ]


def section(
    name: str,
    title: str,
    *,
    claim: str,
    setting: str,
    measured: str,
    verdict: str,
    out_dir: pathlib.Path = OUT_DIR,
) -> pathlib.Path:
    """Write ``out/<name>.md``, this figure's section of ``SUMMARY.md``.

    Args:
      name: the figure's module name (its PNG is ``<name>.png``).
      title: the section title.
      claim: the paper's claim, in a sentence or two.
      setting: what was run (task, workers, steps, seeds, hyperparameters).
      measured: the measured numbers (markdown; a table is welcome).
      verdict: starts with "Reproduced", "Partly reproduced" or "Did not
        reproduce" (at this scale), then why.
    """
    if not verdict.startswith(("Reproduced", "Partly reproduced", "Did not reproduce")):
        raise ValueError(f"verdict must start with a verdict word, got {verdict[:40]!r}")
    scale = "full" if full() else "quick"
    text = (
        f"## {title}\n\n![{title}]({name}.png)\n\n"
        f"**The paper's claim.** {claim}\n\n"
        f"**What ran** ({scale} mode). {setting}\n\n"
        f"**Measured.** {measured}\n\n"
        f"**Verdict.** {verdict}\n"
    )
    path = out_dir / f"{name}.md"
    out_dir.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path

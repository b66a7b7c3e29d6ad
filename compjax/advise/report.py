"""The advice of :mod:`compjax.advise`: one method's predicted step, and how it is told.

:class:`Advice` holds what :func:`compjax.advise.advise` predicts for one
method; :func:`table` lays a list of them out as aligned text,
:func:`crossover_text` says where a method pays, and :func:`recommendation`
names the method with the shortest step (or time to quality) and the codecs
timed within their noise.  Nothing here times or costs anything.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

DENSE, BF16 = "dense fp32", "bf16 cast"


@dataclasses.dataclass(frozen=True)
class Advice:
    """One method's predicted step.

    Attributes:
      method: its name.
      bits_per_worker: bits that leave one worker per step (``communication()``'s
        ring traffic).
      routes: ``{(collective, axes): payload bits}`` (``payload_bits_by_route()``:
        the message sizes the cost model turns into time, not the traffic).
      codec_s: the codec time per worker and step: the median over timing
        rounds of this method's update less dense float32's (negative when
        it timed faster; never clipped).
      codec_range_s: ``(least, most)`` of those per-round differences.
      comm_s: the messages' time on the network.
      step_s: ``compute + dense's update + codec + comm``.
      speedup_fp32, speedup_bf16: dense float32's and the bf16 cast's step
        over this one.
      crossover_gbps: the bandwidth where this step equals dense float32's
        (``inf``: it pays at every bandwidth; ``0``: at none; ``nan`` for dense).
      pays_below: whether it pays below ``crossover_gbps`` (else above it: a
        method that sends more than dense but whose update is cheaper).
      crossover_range_gbps: ``crossover_gbps`` at the codec's most and least
        per-round times.
      steps_factor: steps to a quality target over dense float32's (1 unless given).
      quality_fp32, quality_bf16: dense float32's and the bf16 cast's time to the target
        (``steps_factor * step_s``) over this one's.

    With a ``steps_factor``, ``crossover_gbps`` and ``pays_below`` are about the
    time to the target.
    """

    method: str
    bits_per_worker: int
    routes: dict
    codec_s: float
    comm_s: float
    step_s: float
    codec_range_s: tuple[float, float] = (math.nan, math.nan)
    speedup_fp32: float = math.nan
    speedup_bf16: float = math.nan
    crossover_gbps: float = math.nan
    pays_below: bool = True
    crossover_range_gbps: tuple[float, float] = (math.nan, math.nan)
    steps_factor: float = 1.0
    quality_fp32: float = math.nan
    quality_bf16: float = math.nan

    @property
    def quality_s(self) -> float:
        """The time to the quality target, in dense float32's steps' units: ``steps_factor *
        step_s``."""
        return self.steps_factor * self.step_s

    @property
    def noisy(self) -> bool:
        """Whether the per-round differences of the codec span zero (or their median is < 0)."""
        low, high = self.codec_range_s
        return self.method != DENSE and (self.codec_s < 0 or low < 0 < high)


def _gbps(value: float) -> str:
    return "any" if value == math.inf else "none" if value == 0 else f"{value:.3g}"


def crossover_text(a: Advice, *, spread: bool = False) -> str:
    """Where a method pays, as text.

    Args:
      a: one method's advice.
      spread: also give the crossovers at the codec's least and most measured time.

    Returns:
      ``"below 85.3"``, ``"above 2"``, ``"any"`` or ``"none"`` (Gbit/s where it pays), ``"-"``
      for dense float32; with ``spread``, ``" (low to high)"`` after it where they differ.
    """
    if a.method == DENSE:
        return "-"
    text = _gbps(a.crossover_gbps)
    if a.crossover_gbps not in (0.0, math.inf):
        text = f"{'below' if a.pays_below else 'above'} {text}"
    low, high = (_gbps(g) for g in a.crossover_range_gbps)
    return f"{text} ({low} to {high})" if spread and low != high else text


def _by_quality(advice: Sequence[Advice]) -> bool:
    """Whether a steps factor was given: then the answers are about time to quality."""
    return any(a.steps_factor != 1.0 for a in advice)


def table(advice: Sequence[Advice]) -> str:
    """The advice as an aligned text table.

    Args:
      advice: every method's :class:`Advice`, dense float32 first.

    Returns:
      The table: one row per method (bits, collectives, codec, communication and step times,
      speedups over fp32 and bf16, where it pays); with steps factors, the times to quality too.
    """
    quality = _by_quality(advice)
    rows = [("method", "Mbit/worker", "travels by", "codec ms (range)", "comm ms", "step ms",
             "x fp32", "x bf16")]  # fmt: skip
    rows[0] += ("steps x", "to target x fp32", "x bf16") if quality else ()
    rows[0] += ("pays at Gbit/s",)
    for a in advice:
        routes = ", ".join(sorted({via for via, _ in a.routes}))
        low, high = (1e3 * v for v in a.codec_range_s)
        codec = "-" if a.method == DENSE else f"{1e3 * a.codec_s:.1f} ({low:.1f} to {high:.1f})"
        row = (a.method, f"{a.bits_per_worker / 1e6:.2f}", routes, codec,
               f"{1e3 * a.comm_s:.1f}", f"{1e3 * a.step_s:.1f}", f"{a.speedup_fp32:.2f}",
               f"{a.speedup_bf16:.2f}")  # fmt: skip
        if quality:
            row += (f"{a.steps_factor:g}", f"{a.quality_fp32:.2f}", f"{a.quality_bf16:.2f}")
        rows.append((*row, crossover_text(a, spread=True)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows
    )


def recommendation(advice: Sequence[Advice], bandwidth_gbps: float) -> str:
    """The answer, in words.

    Args:
      advice: every method's :class:`Advice`, dense float32 first.
      bandwidth_gbps: the bandwidth the advice is for.

    Returns:
      The method with the shortest step (with steps factors: the shortest time to quality),
      how much it gains over fp32 and bf16, where it stops paying, and which codec times were
      within their timing noise.
    """
    quality = _by_quality(advice)
    best = min(advice, key=lambda a: a.quality_s)
    dense = advice[0]
    at = f"at {bandwidth_gbps:g} Gbit/s"
    what = "time to quality" if quality else "step"
    if best.method == DENSE:
        payers = [a for a in advice[1:] if a.pays_below and a.crossover_gbps > 0]
        first = max(payers, key=lambda a: a.crossover_gbps, default=None)
        text = f"Recommendation: dense fp32; no method's {what} is shorter {at}"
        if first is not None:
            text += (f" (as the bandwidth falls, the first to pay is {first.method}, below "
                     f"{_gbps(first.crossover_gbps)} Gbit/s)")  # fmt: skip
        text += "."
    else:
        where = {
            math.inf: "at every bandwidth",
            0.0: "at no bandwidth",
        }.get(best.crossover_gbps, f"{crossover_text(best)} Gbit/s")
        if quality:
            text = (f"Recommendation: {best.method}, {best.quality_fp32:.2f}x dense fp32's time "
                    f"to quality and {best.quality_bf16:.2f}x the bf16 cast's {at} "
                    f"({best.steps_factor:g}x the steps of "
                    f"{1e3 * best.step_s:.1f} ms against {1e3 * dense.step_s:.1f} ms); "
                    f"it pays {where}.")  # fmt: skip
        else:
            text = (f"Recommendation: {best.method}, {best.speedup_fp32:.2f}x dense fp32's step "
                    f"and {best.speedup_bf16:.2f}x the bf16 cast's {at} ({1e3 * best.step_s:.1f} "
                    f"ms against {1e3 * dense.step_s:.1f} ms); it pays {where}.")  # fmt: skip
    lines = [text]
    noisy = [a.method for a in advice if a.noisy]
    if noisy:
        lines.append(f"Within timing noise (their codec range spans 0 or is negative, kept as "
                     f"measured): {', '.join(noisy)}.")  # fmt: skip
    return "\n".join(lines)

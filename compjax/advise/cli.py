"""The command line of :mod:`compjax.advise` (``python -m compjax.advise``), replicated data
parallelism and, with ``--fsdp``, sharded training (:mod:`compjax.advise.fsdp`)."""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Sequence

import jax

from compjax.advise import advisor as advise
from compjax.advise.codec_timing import CLOCK_CHOICES, SAMPLE_ENTRIES, resolve_clock
from compjax.advise.fsdp import advise_fsdp, fsdp_recommendation, fsdp_table
from compjax.advise.report import recommendation, table


def _flag(kind: type, least: float, *, above: bool = False):
    """An argparse type: a finite ``kind`` >= ``least`` (> with ``above``; an ``int`` any whole
    number, ``25.6e6`` included); argparse's error names the flag."""

    def parse(text: str):
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        ok = math.isfinite(value) and (value > least if above else value >= least)
        if not ok or (kind is int and not value.is_integer()):
            what = "a whole number" if kind is int else "a finite number"
            bound = f"> {least:g}" if above else f">= {least:g}"
            raise argparse.ArgumentTypeError(f"must be {what} {bound}, got {text!r}")
        return kind(value)

    parse.__name__ = kind.__name__
    return parse


def _parse_steps_factors(pairs: Sequence[str]) -> dict[str, float]:
    """``["QSGD 4-bit=1.2", ...]`` as ``{"QSGD 4-bit": 1.2}``; a ``ValueError`` names the flag."""
    factors = {}
    for pair in pairs:
        name, sep, value = pair.rpartition("=")
        try:
            factors[name.strip()] = float(value)
        except ValueError:
            sep = ""
        if not sep or not name.strip():
            raise ValueError(f"--steps-factor: expected METHOD=X, got {pair!r}")
    return factors


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m compjax.advise``: print the table and the recommendation.

    Args:
      argv: the command line's arguments (``sys.argv[1:]`` when ``None``); ``--help`` lists
        them.

    Returns:
      The exit status, 0 (argparse exits with 2 on a bad argument).
    """
    parser = argparse.ArgumentParser(
        prog="python -m compjax.advise",
        description=advise.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--params", type=_flag(int, 1), required=True,
                        help="parameter count (25.6e6)")  # fmt: skip
    parser.add_argument("--workers", type=_flag(int, 2), required=True)
    parser.add_argument("--bandwidth-gbps", type=_flag(float, 0, above=True), required=True)
    parser.add_argument("--latency-us", type=_flag(float, 0), default=5.0)
    parser.add_argument("--compute-ms", type=_flag(float, 0, above=True), required=True,
                        help="per step, per worker")  # fmt: skip
    parser.add_argument("--exchange", default="scatter_gather",
                        choices=("scatter_gather", "all_gather"))  # fmt: skip
    parser.add_argument("--shared", action="store_true", help="one medium shared by all workers")
    parser.add_argument("--repeats", type=_flag(int, 1), default=5, help="timing rounds (5)")
    parser.add_argument("--clock", default="auto", choices=CLOCK_CHOICES,
                        help="time by the wall clock, or the process's CPU time (steadier on "
                        "a shared machine, CPU backends only); auto (the default): the process "
                        "clock on a CPU, the wall clock on an accelerator")  # fmt: skip
    parser.add_argument("--sample-entries", type=_flag(int, 1), default=SAMPLE_ENTRIES,
                        help="most entries of a timed sample leaf (4194304)")  # fmt: skip
    parser.add_argument("--steps-factor", action="append", default=[], metavar="METHOD=X",
                        help="a method's steps to a quality target over dense fp32's (repeat the "
                        "flag per method): the answer is then about time to quality")  # fmt: skip
    parser.add_argument("--fsdp", action="store_true",
                        help="cost sharded-training (compjax.fsdp) steps instead: the parameter "
                        "gather and the gradient reduce-scatter, codecs not timed")  # fmt: skip
    args = parser.parse_args(argv)
    if args.fsdp:
        try:
            rows = advise_fsdp(args.params, args.workers, args.bandwidth_gbps, args.latency_us,
                               args.compute_ms / 1e3, shared=args.shared)  # fmt: skip
        except ValueError as err:
            parser.error(str(err))
        print(
            f"{args.params:,} parameters, {args.workers} workers, {args.bandwidth_gbps:g} Gbit/s "
            f"({'one shared medium' if args.shared else 'each worker on its own link'}), "
            f"{args.latency_us:g} us latency, {args.compute_ms:g} ms compute; FSDP steps "
            "(leaves of 4,096 entries or more sharded), messages only"
        )
        print(fsdp_table(rows))
        print(fsdp_recommendation(rows, args.bandwidth_gbps))
        return 0
    began, cpu = time.perf_counter(), time.process_time()
    try:
        factors = _parse_steps_factors(args.steps_factor)
        advice = advise.advise(args.params, args.workers, args.bandwidth_gbps, args.latency_us,
                        args.compute_ms / 1e3, exchange=args.exchange, shared=args.shared,
                        repeats=args.repeats, sample_entries=args.sample_entries,
                        clock=args.clock, steps_factor=factors)  # fmt: skip
    except ValueError as err:
        parser.error(str(err))
    link = "one shared medium" if args.shared else "each worker on its own link"
    wall, cpu = time.perf_counter() - began, time.process_time() - cpu
    print(
        f"{args.params:,} parameters, {args.workers} workers, {args.bandwidth_gbps:g} Gbit/s "
        f"({link}), {args.latency_us:g} us latency, {args.compute_ms:g} ms compute; codecs "
        f"timed on {jax.devices()[0].platform} ({resolve_clock(args.clock)} clock) in "
        f"{args.repeats} interleaved rounds, at most "
        f"{args.sample_entries:,} entries per sample leaf, scaled by size ({wall:.1f} s, "
        f"{cpu:.1f} s CPU)"
    )
    print(table(advice))
    print(recommendation(advice, args.bandwidth_gbps))
    return 0

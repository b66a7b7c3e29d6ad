"""``make bench``'s verdicts and tables: pure functions of the results dictionary.

:func:`goal_rows` judges every goal (a row each, MET or MISSED with its ratio),
:func:`reported_rows` lists the ratios measured without a goal, :func:`markdown`
writes ``results/bench.md``, and :func:`summary` puts every goal of a run in
one table, a line per goal (the docs' table).  ``python -m
experiments.bench.report FILE.json`` prints both for a saved run.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
from pathlib import Path

from experiments.common.codecs import (
    BUCKET_LOG2,
    CODEC,
    HWIO_PART,
    POWERSGD_RANK,
    STEP_GOAL,
    TOPK_CODEC_GOAL,
    TOPK_SPEEDUP_GOAL,
    TORCH_GOAL,
    Codec,
)


def verdict(ok: bool) -> str:
    return "MET" if ok else "MISSED"


def roofline_rows(res: dict) -> list[dict]:
    """A row per compressor and roofline section; ``goal`` None where it has none there."""
    rows = []
    for label, key in (
        ("2^24 fp32", "roofline"),
        ("ResNet-50 tree", "roofline_tree"),
        (f"ResNet-50 tree in buckets of 2^{BUCKET_LOG2}", "roofline_buckets"),
        (f"ResNet-50 tree, Flax's HWIO layout, in buckets of 2^{BUCKET_LOG2}", HWIO_PART),
    ):
        sec = res.get(key, {})
        for spec, r in sec.get("compressors", {}).items():
            codec = CODEC.get(spec, Codec(spec))
            goal = codec.goal if key in codec.goal_on else None
            med = r["median_s"]
            per_entry = 1e9 * med["copy"] / sec["entries"]
            note = (
                f"compress {r['compress_ratio']:.2f}x + decompress {r['decompress_ratio']:.2f}x; "
                f"copy {per_entry:.2f} ns/entry, "
                f"{r['page_faults_per_call']['copy']:.0f} page faults per copy"
            )
            rows.append(
                {
                    "group": "roofline",
                    "what": f"`{spec}` compress+decompress, {label}",
                    "time": f"{1e3 * (med['compress'] + med['decompress']):.1f} ms",
                    "baseline": f"copy {1e3 * r['median_s']['copy']:.1f} ms",
                    "ratio": r["ratio"],
                    "goal": None if goal is None else f"<= {goal:g}x",
                    "met": None if goal is None else r["ratio"] <= goal,
                    "note": note,
                }
            )
    return rows


def topk_codec_rows(res: dict) -> list[dict]:
    """The top-k codecs against the copy: EF top-k 1% with a goal, SparseLoCo's without."""
    rows = []
    tc = res.get("topk_codec")
    if not tc:
        return rows
    for name in tc["ratio"]:
        ratio = tc["ratio"][name]
        chunked = name.startswith("chunked")
        kept = tc["kept"][name]
        rows.append(
            {
                "group": "top-k",
                "what": f"{'SparseLoCo' if chunked else 'EF top-k 1%'} codec, {name}, "
                f"{tc['d']:,} entries",
                "family": f"{'SparseLoCo' if chunked else 'EF top-k 1%'} codec, "
                f"{tc['d']:,} entries",
                "name": name,
                "time": f"{1e3 * tc['median_s'][name]:.1f} ms",
                "baseline": f"copy {1e3 * tc['median_s']['copy']:.1f} ms",
                "ratio": ratio,
                "goal": None if chunked else f"<= {TOPK_CODEC_GOAL:g}x",
                "met": None if chunked else ratio <= TOPK_CODEC_GOAL,
                "note": "compress + decompress"
                + (
                    f"; kept {kept:,} in [{tc['band'][0]:,}, {tc['band'][1]:,}]"
                    if name.startswith("threshold")
                    else ""
                ),
            }
        )
    return rows


def reported_rows(res: dict) -> list[dict]:
    """Ratios against the copy with no goal: the Hadamard transform, codecs without one."""
    rows = [r for r in roofline_rows(res) if r["goal"] is None]
    rows += [r for r in topk_codec_rows(res) if r["goal"] is None]
    had = res.get("hadamard")
    if had:
        med = had["median_s"]
        for name, what in (
            ("fwht", "`hadamard.fwht` (forward transform)"),
            ("rotate", f"EDEN's rotation, {had['rounds']} rounds with signs from the key"),
        ):
            rows.append(
                {
                    "group": "hadamard",
                    "what": f"{what}, 2^24 fp32",
                    "time": f"{1e3 * med[name]:.1f} ms",
                    "baseline": f"copy {1e3 * med['copy']:.1f} ms",
                    "ratio": had[f"{name}_ratio"],
                    "note": f"{had['page_faults_per_call'][name]:.0f} page faults per call, "
                    f"{had['page_faults_per_call']['copy']:.0f} per copy",
                }
            )
    return rows


def goal_rows(res: dict) -> list[dict]:
    rows = [r for r in roofline_rows(res) if r["goal"] is not None]
    for label, key, jkey in (
        ("2^24 fp32", "torch", "roofline"),
        ("ResNet-50 tree", "torch_tree", "roofline_tree"),
    ):
        sec, jsec = res.get(key) or {}, res.get(jkey, {})
        if "error" in sec:
            rows.append(
                {
                    "group": "pytorch",
                    "what": f"compressors vs PyTorch, {label}",
                    "time": "-",
                    "baseline": "-",
                    "ratio": float("nan"),
                    "goal": f"< {TORCH_GOAL:g}x",
                    "met": False,
                    "note": sec["error"],
                }
            )
            continue
        for spec, t in sec.get("compressors", {}).items():
            j = jsec["compressors"][spec]["median_s"]
            jf = jsec["compressors"][spec]["page_faults_per_call"]
            ours = j["compress"] + j["decompress"]
            ratio = ours / t["median_s"]
            tc = t["times"]
            rows.append(
                {
                    "group": "pytorch",
                    "what": f"`{spec}` vs PyTorch, {label}",
                    "time": f"{1e3 * ours:.1f} ms",
                    "baseline": f"PyTorch {1e3 * t['median_s']:.1f} ms",
                    "ratio": ratio,
                    "goal": f"< {TORCH_GOAL:g}x",
                    "met": ratio < TORCH_GOAL,
                    "note": (
                        f"PyTorch compress {1e3 * statistics.median(tc['compress']):.1f} ms + "
                        f"decompress {1e3 * statistics.median(tc['decompress']):.1f} ms, its copy "
                        f"{1e3 * statistics.median(sec['copy']):.1f} ms; page faults per compress+"
                        f"decompress: PyTorch {t['page_faults_per_call']:.0f}, compjax "
                        f"{jf['compress'] + jf['decompress']:.0f}"
                    ),
                }
            )
    ps = res.get("powersgd", {})
    if "jax" in ps and "torch" in ps and "error" not in ps["jax"] and "error" not in ps["torch"]:
        ratio = ps["jax"]["median_s"] / ps["torch"]["median_s"]
        rows.append(
            {
                "group": "pytorch",
                "what": f"`powersgd(rank={POWERSGD_RANK})` step vs DDP `powerSGD_hook`, "
                "ResNet-50 tree, 2 workers",
                "time": f"{1e3 * ps['jax']['median_s']:.1f} ms",
                "baseline": f"hook {1e3 * ps['torch']['median_s']:.1f} ms",
                "ratio": ratio,
                "goal": f"<= {TORCH_GOAL:g}x",
                "met": ratio <= TORCH_GOAL,
                "note": (
                    f"PyTorch: 2 gloo processes x {ps['torch']['threads_per_process']} thread, "
                    f"{ps['torch']['buckets']} DDP buckets, whole backward "
                    f"{1e3 * statistics.median(ps['torch']['backward']):.1f} ms; "
                    "compjax: 2 CPU devices"
                ),
            }
        )
    else:
        rows.append(
            {
                "group": "pytorch",
                "what": "`powersgd` vs DDP `powerSGD_hook`",
                "time": "-",
                "baseline": "-",
                "ratio": float("nan"),
                "goal": f"<= {TORCH_GOAL:g}x",
                "met": False,
                "note": "did not run: "
                + str(ps.get("jax", {}).get("error") or ps.get("torch", {}).get("error"))[-300:],
            }
        )
    tk = res.get("topk")
    if tk:
        k = tk["k"]
        low, high = tk["band"]
        rows.append(
            {
                "group": "top-k",
                "what": f"DGC sampled threshold vs exact `lax.top_k`, k = {k} of 2^24",
                "time": f"{1e3 * tk['median_s']['sampled']:.1f} ms",
                "baseline": f"top_k {1e3 * tk['median_s']['exact']:.1f} ms",
                "ratio": tk["speedup"],
                "goal": f">= {TOPK_SPEEDUP_GOAL:g}x faster",
                "met": tk["speedup"] >= TOPK_SPEEDUP_GOAL,
                "note": "ratio is top_k time / sampled time",
            }
        )
        in_band = [
            low <= c <= high and not f for c, f in zip(tk["counts"], tk["fallbacks"], strict=True)
        ]
        rows.append(
            {
                "group": "top-k",
                "what": f"DGC selected count in [0.8k, 1.3k] = [{low}, {high}]",
                "time": f"{min(tk['counts'])}..{max(tk['counts'])}",
                "baseline": f"k = {k}",
                "ratio": max(tk["counts"]) / k,
                "goal": "every offset in band",
                "met": all(in_band),
                "note": f"{len(tk['counts'])} sample offsets, "
                f"{sum(tk['fallbacks'])} fell back to top-k",
            }
        )
    rows += [r for r in topk_codec_rows(res) if r["goal"] is not None]
    st = res.get("step", {})
    if "error" in st:
        rows.append(
            {
                "group": "step",
                "what": "training-step overhead",
                "time": "-",
                "baseline": "-",
                "ratio": float("nan"),
                "goal": f"<= {STEP_GOAL:g}x",
                "met": False,
                "note": "did not run: " + st["error"][-300:],
            }
        )
    no_ynn = res.get("step_no_ynn", {}).get("ratio", {})
    for spec, ratio in st.get("ratio", {}).items():
        diag = f"; {no_ynn[spec]:.2f}x with XLA's YNNPACK fusions off" if spec in no_ynn else ""
        rows.append(
            {
                "group": "step",
                "what": f"`compress({spec})` MLP step, {st['workers']} workers",
                "time": f"{1e3 * st['median_s'][spec]:.1f} ms",
                "baseline": f"pmean step {1e3 * st['median_s']['plain pmean']:.1f} ms",
                "ratio": ratio,
                "goal": f"<= {STEP_GOAL:g}x",
                "met": ratio <= STEP_GOAL,
                "note": f"MLP {'-'.join(map(str, st['widths']))}, "
                f"{st['batch_per_worker']} examples/worker{diag}",
            }
        )
    return rows


def _cell(text) -> str:
    """``text`` as one Markdown table cell: on one line, its pipes escaped (an error message
    in a note would otherwise end the table)."""
    return " ".join(str(text).split()).replace("|", "\\|")


def markdown(res: dict, rows: list[dict]) -> str:
    m = res["machine"]
    lines = [
        "# compjax benchmark",
        "",
        f"{m['cpu']}, {m['cpu_count']} cores; jax {m['jax']}, torch "
        f"{(res.get('torch') or {}).get('machine', {}).get('torch', 'absent')}; "
        f"medians of {res['config']['repeats']} interleaved rounds after 2 warm-up calls; "
        f"load average {res.get('load_before')} before, {res.get('load_after')} after.",
        "",
        "| measurement | median time | baseline (same run) | ratio | goal | verdict | note |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ratio = "n/a" if math.isnan(r["ratio"]) else f"{r['ratio']:.2f}x"
        mark = "MET" if r["met"] else f"MISSED ({ratio})"
        lines.append(
            f"| {_cell(r['what'])} | {r['time']} | {_cell(r['baseline'])} | {ratio} | {r['goal']} "
            f"| {mark} | {_cell(r['note'])} |"
        )
    reported = reported_rows(res)
    if reported:
        lines += [
            "",
            "Measured against the copy in the same run, no goal:",
            "",
            "| measurement | median time | baseline (same run) | ratio | note |",
            "|---|---|---|---|---|",
        ]
        for r in reported:
            lines.append(
                f"| {_cell(r['what'])} | {r['time']} | {_cell(r['baseline'])} | {r['ratio']:.2f}x "
                f"| {_cell(r['note'])} |"
            )
    mem = res.get("memory")
    if mem:
        lines += [
            "",
            "Memory (XLA compiled memory analysis on 2^24 float32 entries: temporaries plus "
            "outputs of the jitted call, over the input's bytes; the copy `x * 2` is 1.00):",
            "",
            "| compressor | compress | decompress |",
            "|---|---|---|",
        ]
        for spec, r in mem["compressors"].items():
            lines.append(f"| `{spec}` | {r['compress_ratio']:.3f} | {r['decompress_ratio']:.3f} |")
    met = sum(r["met"] for r in rows)
    lines += ["", f"{met} of {len(rows)} goals met."]
    return "\n".join(lines) + "\n"


def family(row: dict) -> tuple[str, str]:
    """``(family, name)`` of a row: the goal it shares with others, and what tells it apart.

    A row about one codec (``what`` starting with its spec in backquotes) is
    named by its spec; the top-k codec rows carry theirs; any other row is a
    family of its own.
    """
    if "family" in row:
        return row["family"], row["name"]
    match = re.fullmatch(r"`([^`]+)` (.+)", row["what"])
    return (match.group(2), match.group(1)) if match else (row["what"], "")


def summary(rows: list[dict]) -> str:
    """The goals in one table, a line per family of rows (the docs' table): what met its
    goal and what missed it, each with its ratio, in the order of ``rows``."""
    families: dict[str, dict[bool, list[str]]] = {}
    for r in rows:
        fam, name = family(r)
        ratio = "n/a" if math.isnan(r["ratio"]) else f"{r['ratio']:.2f}"
        cell = families.setdefault(f"{fam}: {r['goal']}", {True: [], False: []})
        cell[bool(r["met"])].append(f"{name} {ratio}".strip())
    lines = ["| goal | met (ratio) | missed (ratio) |", "|---|---|---|"]
    for fam, cells in families.items():
        lines.append(
            f"| {_cell(fam)} | {_cell(', '.join(cells[True]))} | {_cell(', '.join(cells[False]))} |"
        )
    met = sum(bool(r["met"]) for r in rows)
    return "\n".join([*lines, "", f"{met} of {len(rows)} goals met."]) + "\n"


def main(argv=None) -> int:
    """Print the table of a saved ``bench.json`` (its goals judged again)."""
    parser = argparse.ArgumentParser(
        prog="python -m experiments.bench.report", description=main.__doc__
    )
    parser.add_argument("file", type=Path, help="a saved run, such as results/bench.json")
    res = json.loads(parser.parse_args(argv).file.read_text())
    rows = goal_rows(res)
    print(markdown(res, rows))
    print(summary(rows), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""``make bench-net``'s analysis: predictions, traffic against theory, the goals, table, figure.

Everything here is a pure function of the results dictionary that
:mod:`experiments.net.run` assembles (tested without processes):

* the **prediction** of a step at rate ``R`` with ``n`` processes is
  ``costmodel.predicted_step(base, messages, n, SharedMedium(min(R, R_0)))``:
  ``messages`` are the ``(collective, bits per worker)`` of every collective
  in the compiled step (XLA's HLO, so whatever XLA does to the library's
  messages is in it); ``base`` is the same method's step measured in the
  same run without a rate limit, less the time its messages took on that
  unlimited loopback.  The unlimited loopback is not free: gloo's TCP
  transfers are CPU-bound, at an aggregate rate ``R_0`` measured in the same
  run from dense float32 (its bits over its unlimited step less the compute
  alone: about 1.8 Gbit/s for 2 processes and 4.4 for 4 on the 2-core
  machine).  The first version of the model took ``base`` as the whole
  unlimited step and charged the bits at ``R`` on top, counting the
  transfers twice; it is kept as ``predicted_naive_s`` (``R_0 = inf``) for
  comparison;
* the **theory** of the traffic is the library's count
  (``compjax.communication``): ``2 (n - 1) / n M_c`` per worker for a
  scatter-gather or an all-reduce, ``(n - 1) M_c`` for an all-gather, with
  ``M_c`` the compressed message of one worker (the compressor's bits on
  every leaf);
* the **goals** (:mod:`experiments.net.goals`): some method 2x faster
  than dense float32 at 1 Gbit/s with 4 processes; the measured speedups
  within 25% of the predicted ones; the measured traffic within 10% of
  ``2 (n - 1) / n M_c`` (scatter-gather) and ``(n - 1) M_c`` (all-gather);
  the FSDP goals; and on the fast link (10 Gbit/s) no compressed method
  slower than 0.95x dense float32.

The sharded-training (FSDP) methods (``collective == "fsdp"``) gather the
parameters and reduce-scatter the gradient: their theory is
``(n - 1) / n (M_grad,c + M_param,c)`` per worker (the library's
``bits_per_worker`` is listed beside it).

The local-steps methods (``collective == "local_steps"``: DiLoCo, SparseLoCo)
exchange once a round of ``H`` steps, and are accounted per round: their
step time is the mean over whole timed rounds (each synchronisation counted
once in ``H`` steps), their compiled collectives in the synchronisation's
branch count ``1 / H`` of their bits per step (:func:`experiments.common.hlo.per_step`; the
prediction is linear in the bits, so it predicts that mean), and their
traffic theory is a synchronisation's messages (the library's, ``M_c`` their
sum) over ``H``: ``(n - 1) M_c / H`` all-gathered, ``2 (n - 1) / n M_c / H``
all-reduced.  The traffic table and :func:`local_table` give their
measured traffic against that theory.
"""

from __future__ import annotations

import math
import statistics

import numpy as np

from compjax import costmodel
from experiments.common import netns
from experiments.common.hlo import per_step
from experiments.net.goals import (
    SPEEDUP_GOAL,
    fast_link_goal,
    fsdp_goals,
    goals,
    verdict,
)

MIB = 8 * 2**20  # bits


def library_collective(kind: str, gathered: bool) -> str:
    """The collective a message of the library's ``kind`` travels by."""
    return {"scatter": "alltoall", "gather": "allgather"}.get(
        kind, "allgather" if gathered else "allreduce"
    )


def library_wire_bits(messages, n: int) -> float:
    """Per-worker wire bits of the library's ``[kind, bits, gathered]`` messages."""
    return sum(
        costmodel.wire_bits(library_collective(kind, gathered), bits, n)
        for kind, bits, gathered in messages
    )


def message_bits(info: dict) -> float:
    """``M_c``: a worker's compressed message (the compressor's bits, else the gathered ones)."""
    if info.get("payload_bits") is not None:
        return float(info["payload_bits"])
    messages = info["library_messages"]
    if any(kind == "scatter" for kind, _, _ in messages):  # every shard of the whole array
        return float(sum(bits for kind, bits, _ in messages if kind == "scatter"))
    gathered = [bits for _, bits, g in messages if g]
    return float(sum(gathered) or info["library_bits"])


def theory_bits(collective: str, payload: float, n: int) -> float:
    """The per-worker traffic the goal states: ``2 (n-1)/n M_c`` or ``(n-1) M_c``; for
    FSDP (``payload = M_grad,c + M_param,c``) a reduce-scatter's and a gather's
    ``(n-1)/n`` of each."""
    if collective == "fsdp":
        return costmodel.wire_bits("reduce_scatter", payload, n)
    return costmodel.wire_bits(collective, payload, n)


def measured_bits(setting: dict, n: int) -> float:
    """Bits one worker sent per step: loopback bytes over the timed steps and the workers."""
    return 8 * setting["tx_bytes"] / setting["steps"] / n


def shared_bits(collectives: list[dict], n: int) -> float:
    """Bits all ``n`` workers put on the shared medium per step for these collectives."""
    return n * sum(costmodel.wire_bits(c["collective"], c["bits"], n) for c in collectives)


def loopback_bps(run: dict, n: int) -> float:
    """``R_0``: the unlimited loopback's aggregate rate, from dense float32 in the same run.

    Dense float32's step without a limit less the compute alone (no exchange)
    is the time its collectives took; ``R_0`` is all workers' bits over it
    (infinite when that time is not positive or either measurement is missing).
    """
    fp32 = run.get("methods", {}).get("fp32", {})
    if "compute" not in run or "unlimited" not in fp32.get("rates", {}):
        return math.inf
    busy = fp32["rates"]["unlimited"]["step_s"] - run["compute"]["step_s"]
    bits = shared_bits(per_step(fp32["hlo_collectives"], None), n)
    return bits / busy if busy > 0 and bits > 0 else math.inf


def predict(
    unlimited_s: float,
    collectives: list[dict],
    n: int,
    rate_bps: float,
    loopback: float = math.inf,
) -> float:
    """Predicted step seconds at ``rate_bps`` on the shared loopback (see the module docstring).

    ``unlimited_s`` is the step measured without a limit, ``loopback`` the
    unlimited loopback's own rate ``R_0`` (``inf``: the naive model).
    """
    messages = [(c["collective"], c["bits"]) for c in collectives]
    own = costmodel.SharedMedium(bandwidth_gbps=loopback / 1e9)
    base = unlimited_s - own.exchange(messages, n)
    link = costmodel.SharedMedium(bandwidth_gbps=min(rate_bps, loopback) / 1e9)
    return costmodel.predicted_step(base, messages, n, link)


def _ran(run: dict) -> dict:
    return {k: m for k, m in run.get("methods", {}).items() if m.get("rates")}


def settings(res: dict) -> list[dict]:
    """One row per (processes, rate, method): measured and predicted steps and speedups."""
    rows = []
    for n_text, run in res["runs"].items():
        n, methods = int(n_text), _ran(run)
        if "fp32" not in methods:
            continue
        rates = list(methods["fp32"]["rates"])
        r0 = loopback_bps(run, n)
        for rate in rates:
            bps = math.inf if rate == "unlimited" else netns.rate_bits_per_s(rate)
            measured, predicted, naive = {}, {}, {}
            for key, m in methods.items():
                if rate not in m["rates"] or "unlimited" not in m["rates"]:
                    continue
                measured[key] = m["rates"][rate]["step_s"]
                base = m["rates"]["unlimited"]["step_s"]
                hlo = per_step(m["hlo_collectives"], m.get("sync_every"))
                predicted[key] = base if bps == math.inf else predict(base, hlo, n, bps, r0)
                naive[key] = base if bps == math.inf else predict(base, hlo, n, bps)
            for key in measured:
                row = {"workers": n, "rate": rate, "method": key, "loopback_bps": r0}
                row["sync_every"] = methods[key].get("sync_every")
                row |= {"measured_s": measured[key], "predicted_s": predicted[key]}
                row["predicted_naive_s"] = naive[key]
                for b in ("fp32", "bf16"):
                    if b in measured:
                        row[f"speedup_{b}"] = measured[b] / measured[key]
                        row[f"predicted_speedup_{b}"] = predicted[b] / predicted[key]
                row["ratio"] = row["speedup_fp32"] / row["predicted_speedup_fp32"]
                row["ratio_naive"] = row["speedup_fp32"] / (naive["fp32"] / naive[key])
                rows.append(row)
    return rows


def traffic(res: dict) -> list[dict]:
    """One row per (processes, method): measured, compiled and theoretical bits per worker."""
    rows = []
    for n_text, run in res["runs"].items():
        n = int(n_text)
        for key, m in _ran(run).items():
            collective = res["methods"][key]["collective"]
            payload = message_bits(m)
            per_setting = [measured_bits(s, n) for s in m["rates"].values()]
            measured = statistics.median(per_setting)
            library = m.get("library_wire_bits") or library_wire_bits(m["library_messages"], n)
            if collective == "local_steps":
                # A synchronisation's messages, by the collectives that carry them, over H.
                theory = library_wire_bits(m["library_messages"], n) / m["sync_every"]
            elif collective == "scatter_gather" and m.get("payload_bits") is None:
                # The sign vote's outcome is not a compressed message of M_c / n (2 bits
                # per entry for even n): its theory is the library's count of both phases.
                theory = library
            else:
                theory = theory_bits(collective, payload, n)
            rows.append(
                {
                    "workers": n,
                    "method": key,
                    "collective": collective,
                    "sync_every": m.get("sync_every"),
                    "payload_bits": payload,
                    "theory_bits": theory,
                    "library_bits": library,
                    "compiled_bits": m["hlo_wire_bits"],
                    "measured_bits": measured,
                    "measured_spread": [min(per_setting), max(per_setting)],
                    "ratio": measured / theory if theory else math.nan,
                }
            )
    return rows


def analyse(res: dict) -> dict:
    """Settings, traffic and goals of a run."""
    labels = {k: m["label"] for k, m in res["methods"].items()}
    kinds = {k: m["collective"] for k, m in res["methods"].items()}
    rows, flows = settings(res), traffic(res)
    return {
        "settings": rows,
        "traffic": flows,
        "goals": goals(rows, flows, labels)
        + fsdp_goals(rows, labels)
        + [fast_link_goal(rows, labels, kinds)],
    }


# -- the table ----------------------------------------------------------------------------------
def _ms(seconds: float) -> str:
    return f"{1e3 * seconds:,.0f}"


def markdown(res: dict, report: dict) -> str:
    """``results/bench_net.md``: setting, step table, traffic table, goals, what skipped."""
    m, cfg = res["machine"], res["config"]
    labels = {k: v["label"] for k, v in res["methods"].items()}
    first = next((r for r in res["runs"].values() if "parameters" in r), {})
    model = first.get("model", {})
    local = [k for k, v in res["methods"].items() if v["collective"] == "local_steps"]
    lines = [
        "# compjax on a rate-limited network (make bench-net)",
        "",
        f"{m['cpu']}, {m['cpu_count']} cores; jax {m['jax']}. A {first.get('parameters', 0):,}"
        f"-parameter transformer LM ({model.get('layers')} layers, width {model.get('width')}, "
        f"vocab {model.get('vocab')}; {first.get('leaves')} leaves), "
        f"{model.get('batch_per_worker')} x {model.get('length')} tokens per process, "
        "SGD; one `jax.distributed` process per worker (1 CPU device, 1 thread, gloo), "
        f"inside a network namespace whose loopback is limited by `tc tbf` (burst "
        f"{res['network']['burst']}, latency {res['network']['latency']}). Step time: median "
        f"over {cfg['steps']} timed steps of the slowest process, after {cfg['warmup']} "
        f"warm-up steps (plus 1 at each rate)"
        + (
            f"; for the local-steps methods, the mean over {cfg['rounds']} whole round(s) "
            "of H steps, each ending with its synchronisation (after one round of warm-up)"
            if local
            else ""
        )
        + f". Load average {res.get('load_before')} before, "
        f"{res.get('load_after')} after; {res.get('seconds', 0) / 60:.0f} min.",
        "",
        "Predicted = this method's step without a limit, less its compiled collectives' bits "
        "at the unlimited loopback's own rate R_0, plus the same bits at min(R, R_0) on one "
        "shared link (`costmodel.SharedMedium`: all workers' bits / rate). R_0 (from dense "
        "fp32: its bits over its unlimited step less the compute alone): "
        + ", ".join(
            f"n={n}: {loopback_bps(run, int(n)) / 1e9:.2f} Gbit/s"
            for n, run in res["runs"].items()
            if "methods" in run
        )
        + ".",
        "",
        "| n | rate | method | step ms | × fp32 | × bf16 | predicted ms | predicted × fp32 "
        "| measured / predicted |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["settings"]:
        lines.append(
            f"| {r['workers']} | {r['rate']} | {labels[r['method']]} | {_ms(r['measured_s'])} "
            f"| {r['speedup_fp32']:.2f} | {r.get('speedup_bf16', math.nan):.2f} "
            f"| {_ms(r['predicted_s'])} | {r['predicted_speedup_fp32']:.2f} | {r['ratio']:.2f} |"
        )
    lines += [
        "",
        "Traffic per worker per step (MiB): theory from `compjax.communication` "
        "(M_c = one worker's compressed message; 2(n-1)/n·M_c for all-reduce and "
        "scatter-gather, (n-1)·M_c for all-gather; (n-1)/n·(M_grad,c + M_param,c) for FSDP, "
        "M_c = M_grad,c + M_param,c), the same from the collectives XLA compiled, "
        "and measured (loopback tx_bytes / steps / n, median over the rates).",
        "",
        "| n | method | exchange | M_c | theory | library's messages | compiled | measured "
        "| measured / theory |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for f in report["traffic"]:
        lines.append(
            f"| {f['workers']} | {labels[f['method']]} | {f['collective']} "
            f"| {f['payload_bits'] / MIB:.2f} | {f['theory_bits'] / MIB:.2f} "
            f"| {f['library_bits'] / MIB:.2f} | {f['compiled_bits'] / MIB:.2f} "
            f"| {f['measured_bits'] / MIB:.2f} | {f['ratio']:.3f} |"
        )
    if local:
        lines += local_table(res, labels)
    lines += ["", "Compute alone (forward, backward, SGD; no exchange), per process count: "]
    lines[-1] += ", ".join(
        f"n={n}: {_ms(run['compute']['step_s'])} ms"
        for n, run in res["runs"].items()
        if "compute" in run
    )
    lines.append("")
    for g in report["goals"]:
        lines.append(f"GOAL {g['goal']}: **{verdict(g['met'])}** ({g['detail']})")
        lines.append("")
    for n, run in res["runs"].items():
        for key, info in run.get("methods", {}).items():
            if "skipped" in info:
                lines.append(f"- n={n}: {labels[key]} skipped: {info['skipped']}")
        if "error" in run:
            lines.append(f"- n={n} FAILED: {run['error'].splitlines()[0]}")
    return "\n".join(lines).rstrip() + "\n"


def local_table(res: dict, labels: dict[str, str]) -> list[str]:
    """The local-steps methods' rounds: the mean step, its inner and synchronising steps, and
    the bits per step (a synchronisation's over ``H``, plus every step's flag)."""
    lines = [
        "",
        "Local steps (inner AdamW on each worker's own copy, one synchronisation every H "
        "steps): the step time is the mean over whole rounds of the slowest process's step; "
        "bits per step per worker = (a synchronisation's + H flags) / H, the library's "
        "count, and measured. The goals below leave these rows out.",
        "",
        "| n | rate | method | H | rounds | mean step ms | inner step ms | sync step ms "
        "| bits/step, library | bits/step, measured |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for n_text, run in res["runs"].items():
        n = int(n_text)
        for key, m in _ran(run).items():
            if m.get("sync_every") is None:
                continue
            for rate, r in m["rates"].items():
                lines.append(
                    f"| {n} | {rate} | {labels[key]} | {m['sync_every']} | {r.get('rounds')} "
                    f"| {_ms(r['step_s'])} | {_ms(r.get('inner_s', math.nan))} "
                    f"| {_ms(r.get('sync_s', math.nan))} | {m['library_wire_bits']:,.0f} "
                    f"| {measured_bits(r, n):,.0f} |"
                )
    return lines


# -- the figure ---------------------------------------------------------------------------------
def figure(res: dict, report: dict, path) -> None:
    """Measured speedups over dense fp32 (markers) on the predicted curves, one panel per n."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    labels = {k: v["label"] for k, v in res["methods"].items()}
    runs = {int(n): _ran(r) for n, r in res["runs"].items() if _ran(r).get("fp32")}
    fig = Figure(figsize=(6.5 * max(len(runs), 1), 5.2), layout="constrained")
    axes = np.atleast_1d(fig.subplots(1, max(len(runs), 1), sharey=True))
    grid = np.logspace(np.log10(0.05), np.log10(20), 60)
    colors = matplotlib.colormaps["tab10"]
    for ax, (n, methods) in zip(axes, sorted(runs.items()), strict=False):
        fp32, r0 = methods["fp32"], loopback_bps(res["runs"][str(n)], n)
        dense_hlo = per_step(fp32["hlo_collectives"], None)
        dense = [
            predict(fp32["rates"]["unlimited"]["step_s"], dense_hlo, n, g * 1e9, r0) for g in grid
        ]
        for i, key in enumerate(k for k in res["methods"] if k in methods and k != "fp32"):
            m, color = methods[key], colors(i % 10)
            base = m["rates"]["unlimited"]["step_s"]
            hlo = per_step(m["hlo_collectives"], m.get("sync_every"))
            curve = [
                d / predict(base, hlo, n, g * 1e9, r0) for d, g in zip(dense, grid, strict=True)
            ]
            ax.plot(grid, curve, "-", color=color, lw=1.4, label=labels[key])
            points = [r for r in report["settings"] if r["workers"] == n and r["method"] == key]
            points = [r for r in points if r["rate"] != "unlimited"]
            xs = [netns.rate_bits_per_s(r["rate"]) / 1e9 for r in points]
            ax.plot(xs, [r["speedup_fp32"] for r in points], "o", color=color, mec="black")
        ax.axhline(1.0, color="black", lw=1)
        ax.axhline(SPEEDUP_GOAL, color="0.5", lw=1, ls=":")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.grid(True, which="major", alpha=0.3)
        ax.set_xlabel("loopback rate shared by all processes (Gbit/s)")
        ax.set_title(f"{n} processes")
    axes[0].set_ylabel("speedup over dense fp32 (step time ratio)")
    handles, names = axes[0].get_legend_handles_labels()
    fig.legend(handles, names, loc="outside lower center", ncol=5, fontsize=8, frameon=False)
    fig.suptitle(
        "Measured (dots) vs predicted (lines) step speedup, transformer LM, rate-limited loopback",
        fontsize=11,
    )
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    """``python -m experiments.net.report [results/bench_net.json]``: analyse a run again
    (after a change to the model) and rewrite its ``.md`` and ``.png`` next to it."""
    import argparse
    import json
    from pathlib import Path

    parser = argparse.ArgumentParser(
        prog="python -m experiments.net.report", description=main.__doc__.split(":", 1)[1]
    )
    parser.add_argument("file", nargs="?", default="results/bench_net.json", help="a saved run")
    path = Path(parser.parse_args(argv).file)
    res = json.loads(path.read_text())
    res["analysis"] = analyse(res)
    path.write_text(json.dumps(res, indent=1, default=float))
    table = markdown(res, res["analysis"])
    path.with_suffix(".md").write_text(table)
    figure(res, res["analysis"], path.with_suffix(".png"))
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

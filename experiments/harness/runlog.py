"""A run directory's files, written so that a crash at any instant leaves a resumable run.

Every file is written whole to ``<name>.tmp`` and renamed over ``<name>``
(:func:`write_atomic`): a reader sees the old file or the new one, never a
torn one.  At each checkpoint the metrics are written *before* the
checkpoint, so the logs on disk always reach at least the checkpoint's step;
:func:`restore` cuts them back to that step, on disk too, and the resumed run
appends from there.  A kill between the two writes therefore costs the
steps since the previous checkpoint, never a row of the logs.

:func:`crash_point` is the test seam that proves it: with
``$EXPERIMENTS_CRASH_AT=<point>@<step>`` the process SIGKILLs itself at that
point (``tests/test_experiments_crash.py``).
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
from flax import serialization

CRASH_AT = "EXPERIMENTS_CRASH_AT"
CHECKPOINT = "checkpoint.msgpack"
METRICS = "metrics.jsonl"
CSV = "metrics.csv"


def crash_point(point: str) -> None:
    """Test seam: SIGKILL this process here if ``$EXPERIMENTS_CRASH_AT`` equals ``point``.

    The points, each ``<where>@<step>`` of the checkpoint being saved:
    ``metrics-mid-write`` (half of ``metrics.jsonl``'s text written),
    ``metrics-saved`` (both metrics files in place, the checkpoint not yet),
    ``checkpoint-saved`` (the checkpoint renamed into place).
    """
    if os.environ.get(CRASH_AT) == point:
        os.kill(os.getpid(), signal.SIGKILL)


def write_atomic(file: Path, text: str, seam: str | None = None) -> None:
    """Write ``text`` to ``file`` by way of ``file.tmp`` and a rename.

    ``seam`` names a :func:`crash_point` between the two halves of the text.
    """
    tmp = file.with_name(file.name + ".tmp")
    with tmp.open("w") as out:
        middle = len(text) // 2
        out.write(text[:middle])
        if seam is not None:
            out.flush()
            crash_point(seam)
        out.write(text[middle:])
        out.flush()
        os.fsync(out.fileno())
    tmp.replace(file)


def write_json(file: Path, value: Any) -> None:
    """``value`` as indented JSON, atomically."""
    write_atomic(file, json.dumps(value, indent=1, default=str) + "\n")


def write_metrics(path: Path, records: Sequence[dict]) -> None:
    """``metrics.jsonl`` (one JSON object per row) and ``metrics.csv`` (blank where absent)."""
    step = records[-1]["step"]
    lines = "".join(json.dumps(r) + "\n" for r in records)
    write_atomic(path / METRICS, lines, seam=f"metrics-mid-write@{step}")
    keys = list(dict.fromkeys(k for r in records for k in r))
    rows = [",".join(keys)]
    rows += [",".join("" if k not in r else repr(r[k]) for k in keys) for r in records]
    write_atomic(path / CSV, "\n".join(rows) + "\n")


def read_records(path: Path) -> list[dict]:
    """The rows of ``path/metrics.jsonl``."""
    text = (path / METRICS).read_text()
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def save(path: Path, step: int, params, opt_state, records: Sequence[dict]) -> None:
    """The logs up to ``step``, then the checkpoint (params, optimizer state, step)."""
    write_metrics(path, records)
    crash_point(f"metrics-saved@{step}")
    state = serialization.to_state_dict(
        {"step": step, "params": jax.device_get(params), "opt_state": jax.device_get(opt_state)}
    )
    tmp = path / (CHECKPOINT + ".tmp")
    tmp.write_bytes(serialization.msgpack_serialize(state))
    tmp.replace(path / CHECKPOINT)
    crash_point(f"checkpoint-saved@{step}")


def restore(path: Path, params, opt_state):
    """``(step, params, opt_state, records)`` of the checkpoint, arrays placed like the arguments.

    The logs are cut back to the checkpoint's step (and rewritten so); logs
    that stop short of it cannot come from :func:`save` and raise.
    """
    raw = serialization.msgpack_restore((path / CHECKPOINT).read_bytes())
    template = {"step": 0, "params": jax.device_get(params), "opt_state": jax.device_get(opt_state)}
    state = serialization.from_state_dict(template, raw)
    step = int(state["step"])
    shardings = jax.tree.map(lambda a: a.sharding, (params, opt_state))
    params, opt_state = jax.device_put((state["params"], state["opt_state"]), shardings)
    logged = read_records(path) if (path / METRICS).exists() else []
    records = [r for r in logged if r["step"] <= step]
    if not records or records[-1]["step"] != step:
        last = records[-1]["step"] if records else None
        raise RuntimeError(
            f"{path / METRICS} ends at step {last} but {path / CHECKPOINT} is at step {step}; "
            "the logs were not written by this harness: start over with fresh=True (--fresh)"
        )
    write_metrics(path, records)
    return step, params, opt_state, records

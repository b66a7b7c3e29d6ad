"""Data-parallel training over (simulated) workers with any compjax method.

::

    python -m experiments.harness.train --task digits_mlp --method "diana(qsgd(levels=4))" \\
        --workers 8 --steps 400 --seed 0
    python -m experiments.harness.train --config run.json        # the same fields in a file

Each worker holds its own shard of the training set (dealt at random, or by
worker for the heterogeneous task) and runs inside ``jax.shard_map`` over a
``("data",)`` mesh of ``workers`` devices: on a CPU the 8 devices XLA is asked
for on import of :mod:`experiments`, on a GPU/TPU host the accelerators.
Every step a worker draws its minibatch (without replacement, seeded by the
step and its index), takes its local gradient, and the method's compjax
transformation exchanges it; the optimizer that follows is
``add_decayed_weights(l2)`` (the task's regulariser) and ``sgd(lr, momentum)``.

A run writes ``results/<task>/<method>-w<workers>-s<seed>-<hash>/``:

* ``config.json``: the resolved config, the parameter count, the bits per
  step and how they travel, the machine, and ``dropped_examples``: the
  training examples left out so that every worker's shard has the same size
  (``len(train) % workers`` of them; a warning names them too);
* ``metrics.jsonl`` and ``metrics.csv``: one row per step with the workers'
  mean minibatch ``loss`` and ``accuracy``, ``bits``: the size of the
  messages a worker hands its collectives (the payloads, as
  ``compjax.communication()``'s ``payload_bits``, not its ring traffic
  ``bits_per_worker``; real bits for variance-based and Strom's methods),
  ``cum_bits``, the alpha-beta model's ``comm_s`` and ``cum_comm_s`` (which
  applies each collective's ring factor to those sizes); every
  ``eval_every`` steps (and at step 0) also the full training ``objective``
  (loss plus the L2 term), ``train_accuracy``, ``test_loss``,
  ``test_accuracy`` and, on the convex tasks, ``dist_to_opt`` =
  ``||params - params*||^2``;
* ``checkpoint.msgpack`` every ``checkpoint_every`` steps: a run started
  again with the same config resumes from it and gives the same numbers as
  an uninterrupted one (batches and compressor keys depend only on the seed
  and the step).  Every file is written atomically and the logs before the
  checkpoint, which a resume cuts them back to (:mod:`experiments.harness.runlog`),
  so a run killed at any instant resumes to the records of an unkilled one;
* ``summary.json`` when finished; running a finished config again only reads it.

This module is the run loop and the command line; :mod:`experiments.harness.config`
holds :class:`Config` and its checks, :mod:`experiments.harness.problem` what a config
builds (shards, model, jitted steps, bits), :mod:`experiments.harness.runlog` the
run directory's files.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import platform
import sys
import time
import tomllib
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from tqdm.auto import tqdm

import compjax
from experiments.common import methods
from experiments.harness import runlog, tasks
from experiments.harness.config import RESULTS, Config, code_version, field_types
from experiments.harness.problem import AXIS, P, Problem, real_totals

log = logging.getLogger(__name__)


class ConfigError(ValueError):
    """A config that passed :meth:`Config.resolved` but that building its run rejects (a
    batch larger than a worker's shard, a method its task cannot take); nothing is written."""


@dataclasses.dataclass
class Run:
    """A finished run: its directory, resolved config, metadata and per-step records."""

    path: Path
    config: Config
    info: dict[str, Any]
    records: list[dict[str, Any]]

    def column(self, key: str) -> tuple[np.ndarray, np.ndarray]:
        """``(steps, values)`` of the records that have ``key``."""
        rows = [r for r in self.records if key in r]
        return np.array([r["step"] for r in rows]), np.array([r[key] for r in rows], float)

    @property
    def final(self) -> dict[str, Any]:
        """The last evaluated record."""
        return [r for r in self.records if "test_accuracy" in r][-1]


# --- the run -------------------------------------------------------------------


def run(
    cfg: Config,
    root: Path | str = RESULTS,
    *,
    fresh: bool = False,
    progress: bool = True,
    until: int | None = None,
) -> Run:
    """Train ``cfg`` (or read its finished results); returns the :class:`Run`.

    Args:
      cfg: the configuration.
      root: results directory.
      fresh: ignore any existing results and checkpoint of this config.
      progress: show a tqdm progress bar.
      until: stop after this many steps with a checkpoint (an interrupted
        run, resumed by the next call); ``None`` trains all ``cfg.steps``.
    """
    cfg = cfg.resolved()
    path = cfg.run_dir(Path(root))
    if not fresh and (path / "summary.json").exists():
        return load(path)
    try:  # built before anything is written: a config it rejects leaves no directory
        problem = Problem(cfg)
    except (TypeError, ValueError) as err:
        raise ConfigError(str(err)) from err
    path.mkdir(parents=True, exist_ok=True)
    if fresh:  # an old checkpoint or summary must not outlive the logs this run rewrites
        for name in (runlog.CHECKPOINT, "summary.json"):
            (path / name).unlink(missing_ok=True)
    plan = problem.bits_plan()
    steady_reduced, steady_gathered = problem.split(plan["steady"])
    info = {
        "config": dataclasses.asdict(cfg),
        "task": problem.task.description,
        "params": int(sum(a.size for a in jax.tree.leaves(problem.params))),
        "dense_bits": int(sum(32 * a.size for a in jax.tree.leaves(problem.params))),
        "steady_bits": {"allreduce": steady_reduced, "allgather": steady_gathered},
        "messages": plan["steady"],
        "shard_size": problem.shard_size,
        "dropped_examples": problem.dropped.tolist(),
        "batch_size": problem.batch,
        "devices": [str(d) for d in problem.mesh.devices.flat],
        "code_version": code_version(),
        "jax": jax.__version__,
        "machine": platform.machine(),
    }
    runlog.write_json(path / "config.json", info)
    if len(problem.dropped):
        log.warning(
            "%s: %d training examples over %d workers: %d each, the %d left over are dropped "
            "(train-split indices %s; config.json's dropped_examples)",
            cfg.task,
            len(problem.dataset.train),
            cfg.workers,
            problem.shard_size,
            len(problem.dropped),
            problem.dropped.tolist(),
        )

    param_sharding = NamedSharding(problem.mesh, P())
    data_sharding = NamedSharding(problem.mesh, P(AXIS))
    x = jax.device_put(problem.x, data_sharding)
    y = jax.device_put(problem.y, data_sharding)
    params = jax.device_put(problem.params, param_sharding)
    opt_state = problem.init_state(params)
    start, records = 0, []
    if (path / runlog.CHECKPOINT).exists():
        start, params, opt_state, records = runlog.restore(path, params, opt_state)
    chunk = problem.chunk_fn()
    evaluate = problem.eval_fn()
    if start == 0:
        records = [{"step": 0, **_floats(evaluate(params))}]
    cum_bits = records[-1].get("cum_bits", 0)
    cum_comm = records[-1].get("cum_comm_s", 0.0)
    previous_real = compjax.real_bits_sent(opt_state)
    n = cfg.workers
    began = time.perf_counter()
    stop = cfg.steps if until is None else min(until, cfg.steps)
    with tqdm(total=cfg.steps, initial=start, disable=not progress, desc=path.name) as bar:
        while start < stop:
            length = min(cfg.eval_every, stop - start)
            steps = jnp.arange(start, start + length, dtype=jnp.int32)
            params, opt_state, (loss, acc, counters) = chunk(params, opt_state, x, y, steps)
            loss, acc, counters = np.asarray(loss), np.asarray(acc), np.asarray(counters)
            real = real_totals(counters) if counters.shape[1] else None
            for j in range(length):
                step = start + j
                reduced, gathered = problem.split(problem.step_messages(plan, step))
                if real is not None:
                    sent = int(real[j] - (previous_real if j == 0 else real[j - 1]))
                    padded = sum(b for k, b in problem.step_messages(plan, step) if k == "payload")
                    gathered += sent / n - padded  # real payload bits, mean over workers
                bits = reduced + gathered
                comm = problem.network.step(reduced, gathered, n)
                cum_bits += bits
                cum_comm += comm
                records.append(
                    {
                        "step": step + 1,
                        "loss": float(loss[j]),
                        "accuracy": float(acc[j]),
                        "bits": bits,
                        "cum_bits": cum_bits,
                        "comm_s": comm,
                        "cum_comm_s": cum_comm,
                    }
                )
            if real is not None:
                previous_real = real[-1]
            start += length
            records[-1].update(_floats(evaluate(params)))
            bar.update(length)
            bar.set_postfix(loss=f"{records[-1]['objective']:.4g}")
            every = max(cfg.checkpoint_every, cfg.eval_every)
            if start % every < length or start == stop:
                runlog.save(path, start, params, opt_state, records)
    info["wall_s"] = time.perf_counter() - began
    if start < cfg.steps:
        return Run(path, cfg, info, records)
    runlog.write_metrics(path, records)
    runlog.write_json(path / "config.json", info)
    runlog.write_json(path / "summary.json", {"final": records[-1], "wall_s": info["wall_s"]})
    return Run(path, cfg, info, records)


def _floats(tree: dict) -> dict[str, float]:
    return {k: float(v) for k, v in tree.items()}


def load(path: Path | str) -> Run:
    """Read a finished run from its directory."""
    path = Path(path)
    info = json.loads((path / "config.json").read_text())
    cfg = Config(**info["config"])
    return Run(path, cfg, info, runlog.read_records(path))


PROG = "python -m experiments.harness.train"


def _fail(message: str) -> NoReturn:
    """A command-line error: one line on stderr, exit code 2, no traceback."""
    print(f"{PROG}: error: {message}", file=sys.stderr)
    raise SystemExit(2)


class _Parser(argparse.ArgumentParser):
    """argparse with its errors (a bad flag or value) as one line, like the harness's own."""

    def error(self, message: str) -> NoReturn:
        _fail(message)


def _os_error(err: OSError, out: Path) -> str:
    """An ``OSError`` of the run's files as one line, naming ``--out`` when it is under it."""
    name = str(err.filename) if err.filename is not None else ""
    what = f"{err.strerror or err}" + (f": {_short(name)}" if name else "")
    if name.startswith(str(out)):
        return f"--out {_short(str(out))}: cannot write the results there: {what}"
    return what


def _short(text: str) -> str:
    return text if len(text) <= 120 else f"{text[:60]}...{text[-40:]} ({len(text)} characters)"


def _read_config(file: Path) -> dict[str, Any]:
    """The Config fields in a JSON or TOML file; an unreadable or malformed file is one line."""
    try:
        text = file.read_text()
        values = tomllib.loads(text) if file.suffix == ".toml" else json.loads(text)
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError, json.JSONDecodeError) as err:
        _fail(f"--config {file}: {err}")
    except RecursionError:  # a document nested deeper than the parser's recursion
        _fail(f"--config {file}: nested too deeply to be a config (an object of Config fields)")
    if not isinstance(values, dict):
        _fail(f"--config {file}: expected an object of Config fields, got {type(values).__name__}")
    unknown = set(values) - set(field_types())
    if unknown:
        _fail(f"--config {file}: unknown config fields {sorted(unknown)}")
    return values


def _parse_args(argv: Sequence[str] | None) -> tuple[Config, argparse.Namespace]:
    names = sorted(
        {*methods.COMPRESSORS, *methods.WITH_COMPRESSOR, *methods.WITH_AXIS, methods.ADAM}
    )
    epilog = (
        f"tasks: {', '.join(sorted(tasks.TASKS))}.  methods (--method, an expression such as "
        f'"ef(top_k(ratio=0.01))"): dense(), {", ".join(names)}, '
        f"{', '.join(g for g in methods.GRADIENTS if g != 'dense')}."
    )
    parser = _Parser(prog=PROG, description=__doc__.split("\n\n")[0], epilog=epilog)
    parser.add_argument("--config", type=Path, help="a JSON or TOML file of Config fields")
    for field in dataclasses.fields(Config):
        kind = next(k for k in field_types()[field.name] if k is not type(None))
        default = "the task's" if field.default is None else repr(field.default)
        parser.add_argument(
            "--" + field.name.replace("_", "-"),
            dest=field.name,
            type=kind,
            default=None,
            help=f"Config.{field.name} (default: {default})",
        )
    parser.add_argument("--out", type=Path, default=RESULTS, help="results directory")
    parser.add_argument("--fresh", action="store_true", help="ignore existing results")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    values = {} if args.config is None else _read_config(args.config)
    for field in dataclasses.fields(Config):
        if getattr(args, field.name) is not None:
            values[field.name] = getattr(args, field.name)
    return Config(**values), args


def main(argv: Sequence[str] | None = None) -> Run:
    """The command line: a bad task, method, field or config file is one line on stderr
    (exit 2) and writes nothing; Ctrl-C says how to resume (exit 130); a finished run read
    back says so."""
    cfg, args = _parse_args(argv)
    try:
        resolved = cfg.resolved()
    except (TypeError, ValueError) as err:  # Config.resolved's checks, each naming the field
        _fail(str(err))
    try:
        path = resolved.run_dir(Path(args.out))
        finished = not args.fresh and (path / "summary.json").exists()
        result = run(cfg, args.out, fresh=args.fresh, progress=not args.no_progress)
    except ConfigError as err:
        _fail(str(err))
    except OSError as err:  # --out too long, under a file, read-only, full
        _fail(_os_error(err, Path(args.out)))
    except KeyboardInterrupt:
        every = max(resolved.checkpoint_every, resolved.eval_every)
        print(
            f"\ninterrupted: {path} keeps a checkpoint every {every} steps; run the same "
            "command again to resume from the last one (add --fresh to start over)",
            file=sys.stderr,
        )
        raise SystemExit(130) from None
    final = result.final
    if finished:
        print("read back the finished run (nothing trained; --fresh trains it again):")
    print(f"{result.path}")
    print(
        "  "
        + "  ".join(f"{k}={final[k]:.4g}" for k in ("objective", "train_accuracy", "test_accuracy"))
        + f"  bits/worker={final['cum_bits']:.4g}  comm_s={final['cum_comm_s']:.4g}"
    )
    return result


if __name__ == "__main__":
    main()

"""Elastic local steps on Ray: islands that may die, rejoin, straggle or lie.

:func:`train` runs DiLoCo (Douillard et al.) with independent programs
instead of lock-step SPMD workers.  Each **island** is a Ray actor
(:mod:`compjax.steps.elastic_island`) taking inner steps on its own copy of
the parameters; one **synchronizer** actor (:mod:`compjax.steps.elastic_sync`)
holds the global parameters, the outer optimizer's state and the round,
merges a quorum of the islands' compressed pseudo-gradients by the rules of
:mod:`compjax.steps.elastic_rounds`, and saves every merge with orbax.  The
driver (this function) starts them, watches them, restarts killed islands as
the faults say (:mod:`compjax.steps.elastic_faults`), shows the rounds with
tqdm, and gives up with a clear error when no round merges for ``timeout_s``.

Ray is an optional dependency (``pip install 'compjax[elastic]'``), imported
when :func:`train` runs.
"""

from __future__ import annotations

import math
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from compjax.merges import MERGES
from compjax.steps import elastic_faults as faults_
from compjax.steps.elastic_island import Island, IslandConfig
from compjax.steps.elastic_rounds import STARTUP_S, Round, as_float32
from compjax.steps.elastic_sync import SyncConfig, Synchronizer
from compjax.transforms.outer import check_positive, error_memory


class ElasticResult(NamedTuple):
    """What :func:`train` returns.

    Attributes:
      params: the final global parameters, in the dtypes of the params given.
      theta: the same in float32, as the synchronizer holds them.
      history: one :class:`~compjax.steps.elastic_rounds.Round` per merged round.
      wall_s: seconds from the start to the last merge.
      islands: what each island process that finished reported: its
        ``island``, ``incarnation`` (0, or 1 after a restart), ``tokens`` (inner
        steps), ``pushes`` and ``devices``.
    """

    params: Any
    theta: Any
    history: list[Round]
    wall_s: float
    islands: list[dict]


def _check_arguments(
    params, islands, min_quorum, grace_s, merge, island_devices, island_step, timeout_s
):
    check_positive("islands", islands)
    check_positive("island_devices", island_devices)
    quorum = islands if min_quorum is None else min_quorum
    if isinstance(quorum, bool) or not isinstance(quorum, int) or not 1 <= quorum <= islands:
        raise ValueError(f"min_quorum must be an integer in [1, islands={islands}], got {quorum!r}")
    if grace_s is not None and not (math.isfinite(grace_s) and grace_s >= 0):
        raise ValueError(f"grace_s must be None or a finite number >= 0, got {grace_s!r}")
    if island_step not in ("data_parallel", "fsdp"):
        raise ValueError(f"island_step must be 'data_parallel' or 'fsdp', got {island_step!r}")
    if merge not in MERGES:
        raise ValueError(f"merge must be one of {MERGES}, got {merge!r}")
    if not (math.isfinite(timeout_s) and timeout_s > 0):
        raise ValueError(f"timeout_s must be a positive number, got {timeout_s!r}")
    for leaf in jax.tree.leaves(params):
        dtype = np.asarray(leaf).dtype  # (jnp.asarray would make float64 float32)
        if not jnp.issubdtype(dtype, jnp.floating) or dtype == jnp.float64:
            raise ValueError(f"params must be float32, bfloat16 or float16 arrays, got {dtype}")
    return quorum


def _ray():
    try:
        import ray
    except ImportError as err:  # pragma: no cover - the extra is installed by every make target
        raise ImportError("compjax.elastic needs Ray: pip install 'compjax[elastic]'") from err
    return ray


def _start_ray(ray, address: str | None, islands: int) -> bool:
    """Join ``address``'s cluster, or start a local instance on 127.0.0.1, unless Ray is
    running already; whether this call started it (and so shuts it down)."""
    if ray.is_initialized():
        return False
    if address is None:
        ray.init(_node_ip_address="127.0.0.1", include_dashboard=False, num_cpus=islands + 1,
                 log_to_driver=False)  # fmt: skip
    else:
        ray.init(address=address, log_to_driver=False)
    return True


def train(
    loss_fn: Callable[..., jax.Array],
    params: Any,
    batches: Callable[[int, int], tuple],
    *,
    inner: optax.GradientTransformation,
    outer: optax.GradientTransformation,
    sync_every: int,
    rounds: int,
    islands: int,
    compressor: Any = None,
    min_quorum: int | None = None,
    grace_s: float | None = None,
    merge: str = "mean",
    faults: Any = (),
    checkpoint_dir: str | None = None,
    address: str | None = None,
    trim: float = 0.1,
    error_feedback: bool | None = None,
    evaluate: Callable[[Any], float] | None = None,
    island_devices: int = 1,
    island_step: str = "data_parallel",
    island_options: dict | None = None,
    seed: int = 0,
    timeout_s: float = 300.0,
    progress: bool = True,
) -> ElasticResult:
    """DiLoCo over independent islands on Ray, with quorum, healing and robust merges.

    Args:
      loss_fn: ``loss_fn(params, *batch) -> scalar``.
      params: the initial parameters (float32, bfloat16 or float16 leaves).
      batches: ``batches(island, step) -> batch`` (a tuple), deterministic.
      inner: the islands' optimizer (e.g. ``optax.adamw(1e-3)``).
      outer: the synchronizer's optimizer, stepped from the merged
        pseudo-gradient as from a gradient (DiLoCo's:
        ``optax.sgd(0.7, momentum=0.9, nesterov=True)``).
      sync_every: inner steps per round (``H``).
      rounds: outer rounds.
      islands: the number of islands.
      compressor: a compjax compressor of each leaf's pseudo-gradient; ``None``:
        float32 pseudo-gradients.
      min_quorum: the least number of contributions a round merges; ``None``: ``islands``.
      grace_s: seconds to wait after the quorum for the other live islands;
        ``None``: adaptive (:func:`~compjax.steps.elastic_rounds.grace_over`).
      merge: ``"mean"``, ``"median_norm_clip"`` or ``"trimmed_mean"``
        (:mod:`compjax.merges`), each weighted by tokens.
      faults: :class:`~compjax.steps.elastic_faults.Kill`, ``Slow``, ``Poison``
        and ``KillSynchronizer`` faults to inject.
      checkpoint_dir: where the synchronizer saves every round (orbax); one
        holding a previous run's checkpoint resumes it; ``None``: a temporary
        directory, removed at the end.  On a cluster, storage every node sees.
      address: a Ray cluster's address; ``None``: the running Ray instance,
        or a local one started (on 127.0.0.1) and shut down at the end.
      trim: the fraction of weight ``"trimmed_mean"`` cuts from each end.
      error_feedback: keep an error memory on each island; ``None``: exactly
        for a biased compressor (as :func:`compjax.diloco`).
      evaluate: ``evaluate(params) -> float`` run by the synchronizer after
        every merge (recorded as ``Round.evaluation``); ``None``: none.
      island_devices: devices per island; above 1, each island's inner step
        is a :func:`compjax.data_parallel` step over its own mesh (on CPU the
        island's process is given that many host devices).
      island_step: the step over an island's devices: ``"data_parallel"`` (the
        gradients averaged exactly) or ``"fsdp"`` (:func:`compjax.fsdp`: the
        params and the inner state split over them).
      island_options: Ray actor options of each island (default ``{"num_cpus": 1}``).
      seed: the compressors' random draws.
      timeout_s: the longest any wait may last (no merge for this long:
        ``TimeoutError``); an actor's first answer is allowed
        :data:`~compjax.steps.elastic_rounds.STARTUP_S` more.
      progress: show the rounds, participants and bits with tqdm.

    Returns:
      :class:`ElasticResult`.

    Raises:
      ValueError: a bad argument (named), e.g. ``min_quorum > islands``.
      RuntimeError: an island failed (its ``batches`` raised); the message names it.
      TimeoutError: no round merged for ``timeout_s`` (too few live islands).
    """
    check_positive("sync_every", sync_every)
    check_positive("rounds", rounds)
    quorum = _check_arguments(
        params, islands, min_quorum, grace_s, merge, island_devices, island_step, timeout_s
    )
    faults = faults_.check_faults(faults, islands, rounds)
    _, keep_error = error_memory(compressor, error_feedback)
    ray = _ray()
    started = time.time()
    own_dir = checkpoint_dir is None
    if own_dir:
        checkpoint_dir = os.path.join(tempfile.gettempdir(), f"compjax-elastic-{uuid.uuid4().hex}")
    host = jax.tree.map(np.asarray, params)
    sync_config = SyncConfig(
        params=as_float32(host), outer=outer, rounds=rounds, islands=islands,
        min_quorum=quorum, grace_s=grace_s, merge=merge, trim=trim,
        compressor=compressor, checkpoint_dir=str(checkpoint_dir), started_at=started,
        kill_at_round=faults_.synchronizer_kill_round(faults), evaluate=evaluate,
    )  # fmt: skip
    island_config = IslandConfig(
        loss_fn=loss_fn, batches=batches, inner=inner, params=host, sync_every=sync_every,
        rounds=rounds, compressor=compressor, error_feedback=keep_error, faults=faults,
        devices=island_devices, step=island_step, seed=seed, timeout_s=timeout_s,
    )  # fmt: skip
    own_ray = _start_ray(ray, address, islands)
    try:
        run = _Run(ray, sync_config, island_config, island_options, timeout_s, progress)
        theta, history = run.until_done()
        reports = run.reports
    finally:
        if own_ray:
            ray.shutdown()
        if own_dir:
            shutil.rmtree(checkpoint_dir, ignore_errors=True)
    final = jax.tree.map(lambda t, p: jnp.asarray(t).astype(jnp.asarray(p).dtype), theta, host)
    wall = history[-1].wall_s if history else 0.0
    return ElasticResult(params=final, theta=theta, history=history, wall_s=wall, islands=reports)


class _Run:
    """The driver's side of one run: the actors, the watch loop, the restarts."""

    def __init__(self, ray, sync_config, island_config, island_options, timeout_s, progress):
        self.ray, self.config, self.timeout_s = ray, island_config, timeout_s
        options = {"num_cpus": 1, **(island_options or {})}
        if island_config.devices > 1:
            flags = os.environ.get("XLA_FLAGS", "")
            flag = f"--xla_force_host_platform_device_count={island_config.devices}"
            options.setdefault("runtime_env", {"env_vars": {"XLA_FLAGS": f"{flags} {flag}"}})
        self.island_actor = ray.remote(Island).options(max_task_retries=0, **options)
        self.sync = (
            ray.remote(Synchronizer)
            .options(num_cpus=0, max_restarts=-1, max_task_retries=-1)
            .remote(sync_config)
        )
        self.rounds, self.islands = sync_config.rounds, sync_config.islands
        self.min_quorum = sync_config.min_quorum
        self.handles, self.runs, self.reports = {}, {}, []
        for i in range(self.islands):
            self._start(i, incarnation=0)
        self.dead: set[int] = set()
        self.progress = progress

    def _start(self, island: int, incarnation: int) -> None:
        handle = self.island_actor.remote(self.config, island, incarnation)
        self.handles[island] = handle
        self.runs[handle.run.remote(self.sync)] = island

    def _get(self, ref, what: str, timeout_s: float | None = None):
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        try:
            return self.ray.get(ref, timeout=timeout_s)
        except self.ray.exceptions.GetTimeoutError as err:
            raise TimeoutError(f"the synchronizer did not answer {what} in {timeout_s} s") from err

    def _reap(self, status: dict) -> None:
        done, _ = self.ray.wait(list(self.runs), num_returns=len(self.runs), timeout=0.2)
        for ref in done:
            island = self.runs.pop(ref)
            try:
                self.reports.append(self.ray.get(ref))
            except self.ray.exceptions.RayActorError:
                self.dead.add(island)
                self._get(self.sync.leave.remote(island), "leave")
            except self.ray.exceptions.RayTaskError as err:
                cause = err.cause if getattr(err, "cause", None) is not None else err
                raise RuntimeError(f"island {island} failed: {cause}") from err
        for island in sorted(self.dead):
            at = faults_.restart_round(self.config.faults, island)
            if at is not None and at <= status["round"] < self.rounds:
                self.dead.discard(island)
                self._start(island, incarnation=1)

    def until_done(self) -> tuple[Any, list[Round]]:
        """Watch until every round merged; the final params and history."""
        from tqdm.auto import tqdm

        bar = tqdm(total=self.rounds, desc="elastic", unit="round", disable=not self.progress)
        try:
            first = self._get(self.sync.status.remote(), "status", self.timeout_s + STARTUP_S)
            seen, changed = first["round"], time.monotonic()
            bar.update(seen)
            while True:
                status = self._get(self.sync.status.remote(), "status")
                if status["round"] != seen:
                    bar.update(status["round"] - seen)
                    seen, changed = status["round"], time.monotonic()
                    last = status["history"][-1]
                    bar.set_postfix(merged=f"{len(last.merged)}/{self.islands}",
                                    late=len(last.late), Mbit=f"{last.bits / 1e6:.2f}")  # fmt: skip
                if seen >= self.rounds:
                    break
                if time.monotonic() - changed > self.timeout_s:
                    raise TimeoutError(
                        f"round {seen} did not merge in {self.timeout_s} s: pushed "
                        f"{status['pending']}, live {status['live']}, dead {sorted(self.dead)}, "
                        f"min_quorum {self.min_quorum}"
                    )
                self._reap(status)
            result = self._get(self.sync.result.remote(), "result")
            deadline = time.monotonic() + min(self.timeout_s, 10.0)
            while self.runs and time.monotonic() < deadline:  # the islands' own reports
                self._reap(status)
            return result
        finally:
            bar.close()
            for handle in [*self.handles.values(), self.sync]:
                self.ray.kill(handle)

"""One process of ``make bench-net``: real data-parallel training steps, timed.

:mod:`experiments.bench_net` starts ``n`` of these inside its network
namespace (``ip netns exec``); they join a ``jax.distributed`` job on
127.0.0.1 (gloo CPU collectives, one CPU device per process, XLA and BLAS on
one thread each) and train the language model of
:mod:`experiments.bench_net_model` over the global 1-D mesh axis ``"data"``,
with the step of docs/distributed.md ("A complete shard_map training step"):
``jax.jit(jax.shard_map(...))`` differentiating
``compjax.worker_params(params, "data")``, the method's optimizer state
sharded by ``compjax.state_specs`` and ``optax.chain(method, optax.sgd(lr))``.

For every method the step is compiled once (the compiled HLO's collectives
are recorded, :func:`hlo_collectives`) and run twice to warm up.  Then, for
each rate (the first without a limit), process 0 sets the loopback's token
bucket with ``tc`` and every method in turn runs one more warm-up step, a
barrier, the namespace's loopback ``tx_bytes``, the timed steps (each
process blocks on each step's outputs and keeps its own times), a barrier
and ``tx_bytes`` again.  The local-steps methods (DiLoCo, SparseLoCo: the
step of :func:`compjax.local_steps` over per-worker copies) are timed over
whole rounds instead (:func:`measure`): their first warm-up is a whole
round, so that its synchronisation has run once.  A forward-backward-SGD step on each process's own
device with no exchange at all is timed first (the compute alone).

Process 0 writes the results as JSON after every rate, so a run cut short
keeps what it measured::

    ip netns exec NS python -m experiments.bench_net_worker --process-id 0 \\
        --num-processes 2 --port 29500 --config config.json --out result.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import statistics
import sys
import time
import traceback
from functools import partial
from pathlib import Path

import jax
import numpy as np

import compjax
from compjax import costmodel
from experiments import methods, netns
from experiments.bench_net_model import (
    FSDP_MIN_SIZE,
    METHODS,
    BenchMethod,
    LMConfig,
    init_params,
    loss_fn,
)
from experiments.bench_net_model import tokens as make_tokens
from experiments.bench_net_report import per_step

AXIS = "data"
P = jax.P
BATCHES = 4  # distinct batches per worker, cycled
INIT_TIMEOUT_S = 120
#: A process silent this long is declared dead and the others fail, rather than block
#: for JAX's default of 100 s on a peer that died.  Heartbeats are tiny: a throttled link
#: or a loaded CPU delays them by well under a second.
HEARTBEAT_TIMEOUT_S = 20

# -- the compiled exchange ------------------------------------------------------------------
_OPS = {
    "all-reduce": "allreduce",
    "all-gather": "allgather",
    "all-to-all": "alltoall",
    "reduce-scatter": "reduce_scatter",
    "collective-permute": "permute",
}
_DTYPE_BITS = {"pred": 8, "s4": 4, "u4": 4, "s8": 8, "u8": 8, "s16": 16, "u16": 16}
_DTYPE_BITS |= {"f16": 16, "bf16": 16, "s32": 32, "u32": 32, "f32": 32, "s64": 64, "u64": 64}
_DTYPE_BITS |= {"f64": 64}
_LINE = re.compile(
    r"=\s*(?P<shape>.*?)\s+(?P<op>" + "|".join(_OPS) + r")(?P<start>-start)?\((?P<args>.*)$"
)
_ARRAY = re.compile(r"\b([a-z]+[0-9]+|pred)\[([0-9,]*)\]")
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%(?P<name>[\w.\-]+)\s.*\{\s*$")
_CALLED = re.compile(
    r"\b(?:calls|to_apply|body|condition|true_computation|false_computation)=%([\w.\-]+)"
)
_BRANCHES = re.compile(
    r"\b(?:branch_computations=\{([^}]*)\}|(?:true|false)_computation=%([\w.\-]+))"
)
_WHILE = re.compile(r"\swhile\(")
_LOOP_PARTS = re.compile(r"\b(?:condition|body)=%([\w.\-]+)")


def shape_bits(shape: str) -> int:
    """Bits of every array in an HLO shape string such as ``(f32[2,3]{1,0}, s8[4]{0})``."""
    total = 0
    for dtype, dims in _ARRAY.findall(shape):
        if dtype not in _DTYPE_BITS:
            raise ValueError(f"unknown HLO element type {dtype!r} in {shape!r}")
        count = int(np.prod([int(d) for d in dims.split(",") if d], dtype=np.int64))
        total += count * _DTYPE_BITS[dtype]
    return int(total)


def nested_computations(text: str) -> dict[str, set[str]]:
    """The computations of a compiled HLO module that do not run once per execution:
    ``"conditional"``, those that run only when a ``conditional`` takes their branch (the
    branches and every computation they call), and ``"loop"``, those a ``while`` loop runs
    (its condition and body, and every computation they call)."""
    calls: dict[str, set[str]] = {}
    roots: dict[str, set[str]] = {"conditional": set(), "loop": set()}
    current = None
    for line in text.splitlines():
        header = _COMPUTATION.match(line)
        if header is not None:
            current = header["name"]
            calls[current] = set()
            continue
        if current is None:
            continue
        calls[current].update(_CALLED.findall(line))
        for group, single in _BRANCHES.findall(line):
            names = (group or single).split(",")
            roots["conditional"].update(n.strip().lstrip("%") for n in names if n)
        if _WHILE.search(line):
            roots["loop"].update(_LOOP_PARTS.findall(line))
    out = {}
    for kind, names in roots.items():
        seen, todo = set(), list(names)
        while todo:
            name = todo.pop()
            if name not in seen:
                seen.add(name)
                todo.extend(calls.get(name, ()))
        out[kind] = seen
    return out


def hlo_collectives(text: str, workers: int) -> list[dict]:
    """The collectives of a compiled HLO module, with the message one worker contributes.

    Returns ``{"op", "collective", "dtypes", "bits", "conditional", "loop"}``
    per collective op, in program order (:func:`nested_computations`):
    ``conditional`` says whether it lies in a branch of a ``conditional`` (a
    local-steps method's synchronisation, which runs once a round), ``loop``
    whether in a ``while`` loop (compjax's overflow guard resends a mean in
    a loop that runs only when a float32 sum overflows, so a step sends none
    of these); ``bits`` is the per-worker message in
    :func:`compjax.costmodel.wire_bits`'s convention: the output of an
    all-reduce, an all-to-all or a permute, the output over ``workers`` for an
    all-gather, the output times ``workers`` for a reduce-scatter (every
    collective here spans the whole 1-D mesh).  ``*-done`` halves of async
    pairs are skipped; a ``*-start``'s shape holds its operands and results,
    and only the results (the last element) are counted.
    """
    found = []
    nested, current = nested_computations(text), None
    for line in text.splitlines():
        header = _COMPUTATION.match(line)
        if header is not None:
            current = header["name"]
            continue
        m = _LINE.search(line)
        if m is None or not line.lstrip().startswith(("%", "ROOT")):
            continue
        shape = m["shape"]
        if m["start"]:
            shape = shape.rsplit("}, ", 1)[-1] if "}, " in shape else shape
        out = shape_bits(shape)
        op = m["op"]
        bits = {"all-gather": out / workers, "reduce-scatter": out * workers}.get(op, out)
        dtypes = sorted({dtype for dtype, _ in _ARRAY.findall(shape)})
        found.append(
            {
                "op": op,
                "collective": _OPS[op],
                "dtypes": dtypes,
                "bits": int(bits),
                "conditional": current in nested["conditional"],
                "loop": current in nested["loop"],
            }
        )
    return found


def hlo_wire_bits(collectives: list[dict], workers: int) -> float:
    """Bits one worker sends per step for these collectives (ring algorithms)."""
    return sum(costmodel.wire_bits(c["collective"], c["bits"], workers) for c in collectives)


# -- arrays across processes ------------------------------------------------------------------
def replicated(tree, mesh):
    """Host arrays (equal in every process) as global arrays replicated over ``mesh``."""
    sharding = jax.NamedSharding(mesh, P())
    return jax.tree.map(
        lambda x: jax.make_array_from_callback(x.shape, sharding, lambda i, x=x: x[i]), tree
    )


def barrier(name: str) -> None:
    from jax.experimental import multihost_utils

    multihost_utils.sync_global_devices(name)


def gather_times(times: list[float]) -> list[list[float]]:
    """Every process's list of step times, by process index."""
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(np.asarray(times))).tolist()


def step_seconds(times: list[list[float]]) -> float:
    """The step time of a setting: the median over steps of the slowest process's time."""
    return float(statistics.median(np.max(np.asarray(times), axis=0)))


# -- one method ---------------------------------------------------------------------------------
@dataclasses.dataclass
class Trainer:
    """A compiled step with its parameters, optimizer state and batches."""

    method: BenchMethod
    compiled: object
    params: object
    state: object
    batches: list
    count: int = 0

    def step(self) -> tuple[float, float]:
        """Run one step; ``(seconds until its outputs are ready, loss)``."""
        batch = self.batches[self.count % len(self.batches)]
        self.count += 1
        start = time.perf_counter()
        self.params, self.state, loss = self.compiled(self.params, self.state, batch)
        jax.block_until_ready((self.params, self.state, loss))
        seconds = time.perf_counter() - start
        return seconds, float(np.asarray(loss.addressable_data(0)))


def build(
    method: BenchMethod, cfg: LMConfig, host_params, mesh, batches, optimizer=None
) -> tuple[Trainer, dict]:
    """Compile ``method``'s training step; the trainer and what is known before running it.

    ``optimizer`` follows the exchange (``optax.sgd(method.lr)`` when ``None``).

    Raises:
      TypeError: the library does not take one of the method's arguments yet.
    """
    import optax

    if method.fsdp is not None:
        return build_fsdp(method, cfg, host_params, mesh, batches, optimizer)
    if method.local is not None:
        return build_local(method, cfg, host_params, mesh, batches)
    parsed = None if method.factory else methods.parse(method.spec)
    tx = method.factory(AXIS) if method.factory else parsed.build(AXIS)
    opt = optax.chain(tx, optax.sgd(method.lr) if optimizer is None else optimizer)
    params = replicated(host_params, mesh)
    specs = compjax.state_specs(jax.eval_shape(opt.init, params), AXIS)
    init = jax.jit(jax.shard_map(opt.init, mesh=mesh, in_specs=P(), out_specs=specs))

    @partial(jax.jit, donate_argnums=(0, 1))
    @partial(jax.shard_map, mesh=mesh, in_specs=(P(), specs, P(AXIS)), out_specs=(P(), specs, P()))
    def step(params, state, batch):
        local = compjax.worker_params(params, AXIS)
        loss, grads = jax.value_and_grad(loss_fn)(local, batch, cfg.heads)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state, jax.lax.pmean(loss, AXIS)

    state = init(params)
    start = time.perf_counter()
    compiled = step.lower(params, state, batches[0]).compile()
    n = mesh.size
    report = compjax.communication(opt, host_params, AXIS, num_workers=n)
    comp = parsed.compressor if parsed else None
    entries = sum(np.size(x) for x in jax.tree.leaves(host_params))
    gathered = parsed.gathered if parsed else lambda kind: kind in ("scatter", "gather")
    if comp is not None and getattr(comp, "summable", False):
        # Its integer fields widen with n: M_c is the library's count of this run's messages.
        payload_bits = None
    elif comp is not None:
        payload_bits = sum(comp.bits(np.shape(x)) for x in jax.tree.leaves(host_params))
    else:
        payload_bits = method.bits_per_entry * entries if method.bits_per_entry else None
    info = {
        "compile_s": time.perf_counter() - start,
        # Payload sizes: bench_net_report applies the ring factors (costmodel.wire_bits).
        "library_messages": [[kind, bits, gathered(kind)] for kind, bits in report.payloads],
        "library_bits": report.payload_bits,
        "payload_bits": payload_bits,
        "hlo_collectives": hlo_collectives(compiled.as_text(), n),
    }
    info["hlo_wire_bits"] = hlo_wire_bits(per_step(info["hlo_collectives"], None), n)
    return Trainer(method, compiled, params, state, batches), info


def fsdp_message_bits(payloads, n: int) -> float:
    """``M_grad,c + M_param,c`` of an FSDP step from the library's ``(kind, bits)`` payloads:
    the whole compressed parameters (``n`` times a worker's gathered shard) and the whole
    compressed gradient (the reduce-scatter's input); the replicated leaves' exact mean and
    the non-finite flag are left out (all-reduces of a few kilobytes)."""
    params = n * sum(bits for kind, bits in payloads if kind == "param_gather")
    grads = sum(bits for kind, bits in payloads if kind in ("payload", "scale", "scatter"))
    return float(params + grads)


def build_fsdp(
    method: BenchMethod, cfg: LMConfig, host_params, mesh, batches, optimizer=None
) -> tuple[Trainer, dict]:
    """:func:`build` for a sharded-training method: the step of :func:`compjax.fsdp`."""
    import optax

    opt = optax.sgd(method.lr) if optimizer is None else optimizer
    fs = compjax.fsdp(
        lambda p, batch: loss_fn(p, batch, cfg.heads),
        opt,
        host_params,
        mesh,
        AXIS,
        min_size=FSDP_MIN_SIZE,
        **method.fsdp(),
    )
    params = fs.shard(replicated(host_params, mesh))  # a padded leaf in its padded shape
    state = fs.init(params)
    start = time.perf_counter()
    compiled = fs.step.lower(params, state, batches[0]).compile()
    n = mesh.size
    report = compjax.communication(fs, host_params, mesh=mesh)
    info = {
        "compile_s": time.perf_counter() - start,
        # The parameter gather travels by all-gather, the gradient by a reduce-scatter: the
        # library's per-worker count of both is library_wire_bits.
        "library_messages": [[k, b, k == "param_gather"] for k, b in report.payloads],
        "library_bits": report.payload_bits,
        "payload_bits": fsdp_message_bits(report.payloads, n),
        "library_wire_bits": report.bits_per_worker,
        "hlo_collectives": hlo_collectives(compiled.as_text(), n),
    }
    info["hlo_wire_bits"] = hlo_wire_bits(per_step(info["hlo_collectives"], None), n)
    return Trainer(method, fs.step, params, state, batches), info


#: Messages every step of a local-steps method sends (the non-finite flag); the others are
#: the synchronisation's, sent once a round.
EVERY_STEP_KINDS = ("flag",)


def local_stepper(opt, cfg: LMConfig, host_params, mesh, batch) -> tuple:
    """The compiled :func:`compjax.local_steps` step of ``opt`` (an optimizer of per-worker
    params) on the language model: ``(step, copies, state, compile seconds)``; ``batch`` is
    the global batch it is compiled for."""
    loss = lambda p, rows: loss_fn(p, rows, cfg.heads)  # noqa: E731
    built = compjax.local_steps(loss, opt, replicated(host_params, mesh), mesh, AXIS)
    copies, state = built.init(replicated(host_params, mesh))
    start = time.perf_counter()
    compiled = built.step.lower(copies, state, batch).compile()
    return compiled, copies, state, time.perf_counter() - start


def build_local(
    method: BenchMethod, cfg: LMConfig, host_params, mesh, batches
) -> tuple[Trainer, dict]:
    """:func:`build` for a local-steps method (:func:`local_stepper`), counted per round.

    ``compjax.communication`` traces one synchronising step: its messages are
    the round's (``library_messages``, ``payload_bits`` = ``M_c``), except the
    flag every step sends (``step_messages``); ``library_wire_bits`` and
    ``hlo_wire_bits`` are per step, averaged over a round of ``H =
    sync_every`` steps (the synchronisation's bits over ``H`` plus each
    step's own).
    """
    h, n = method.sync_every, mesh.size
    opt = method.local(AXIS, h)
    compiled, copies, state, compile_s = local_stepper(opt, cfg, host_params, mesh, batches[0])
    report = compjax.communication(opt, host_params, AXIS, num_workers=n)
    rows = list(zip(report.payloads, report.routes, report.messages, strict=True))
    each = [r for r in rows if r[0][0] in EVERY_STEP_KINDS]
    sync = [r for r in rows if r[0][0] not in EVERY_STEP_KINDS]

    def listed(part):
        return [[kind, bits, via == "all_gather"] for (kind, bits), (_, via, _), _ in part]

    def ring(part):
        return sum(wire for _, _, (_, wire) in part)

    info = {
        "compile_s": compile_s,
        "sync_every": h,
        "library_messages": listed(sync),
        "step_messages": listed(each),
        "library_bits": report.payload_bits,
        "payload_bits": float(sum(bits for (_, bits), _, _ in sync)),
        "library_wire_bits": ring(sync) / h + ring(each),
        "hlo_collectives": hlo_collectives(compiled.as_text(), n),
    }
    info["hlo_wire_bits"] = hlo_wire_bits(per_step(info["hlo_collectives"], h), n)
    return Trainer(method, compiled, copies, state, batches), info


def time_compute(cfg: LMConfig, host_params, rank: int, steps: int) -> list[list[float]]:
    """Each process's forward-backward-SGD step on its own device, no exchange (all at once)."""
    import optax

    device = jax.local_devices()[0]
    params = jax.device_put(host_params, device)
    batch = jax.device_put(make_tokens(cfg, rank, 0), device)

    @partial(jax.jit, donate_argnums=0)
    def step(params, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch, cfg.heads)
        return optax.apply_updates(params, jax.tree.map(lambda g: -0.1 * g, grads)), loss

    for _ in range(2):
        params, _ = jax.block_until_ready(step(params, batch))
    barrier("compute")
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        params, _ = jax.block_until_ready(step(params, batch))
        times.append(time.perf_counter() - start)
    return gather_times(times)


# -- the run ------------------------------------------------------------------------------------
def round_warmup(trainer: Trainer) -> int:
    """Warm-up steps before a local-steps method's timed window: enough to end the current
    round (at least one whole round on a fresh trainer, so its synchronisation has run)."""
    h = trainer.method.sync_every
    return h if trainer.count == 0 else -trainer.count % h


def measure(
    trainer: Trainer, steps: int, rank: int, idle_bytes: int, rounds: int | None = None
) -> dict:
    """Time ``steps`` steps of a warmed-up trainer; loopback bytes from process 0's counter.

    A local-steps method (``trainer.method.sync_every = H``) is timed over
    ``rounds`` whole rounds instead: it first ends the round under way, then
    the ``rounds * H`` timed steps each end with a synchronisation, so the
    step time (``step_s``) is the **mean** over them of the slowest process's
    step, each synchronisation counted once in ``H`` steps (``sync_s`` and
    ``inner_s`` split it), and the traffic is whole rounds'.
    """
    h = trainer.method.sync_every
    if h is None:
        trainer.step()  # warm-up at this rate
    else:
        steps = rounds * h
        for _ in range(round_warmup(trainer)):
            trainer.step()
    barrier("before")
    before = netns.read_tx_bytes() if rank == 0 else 0
    times, losses = [], []
    for _ in range(steps):
        seconds, loss = trainer.step()
        times.append(seconds)
        losses.append(loss)
    barrier("after")
    sent = netns.read_tx_bytes() - before - idle_bytes if rank == 0 else 0
    all_times = gather_times(times)
    out = {
        "steps": steps,
        "times": all_times,
        "step_s": step_seconds(all_times),
        "tx_bytes": int(sent),
        "losses": losses,
    }
    if h is not None:
        out |= round_seconds(all_times, h)
    return out


def round_seconds(times: list[list[float]], sync_every: int) -> dict:
    """A local-steps method's step times over whole rounds (each process's list starting at
    a round's first step): the mean of the slowest process's step (``step_s``), and of its
    synchronising steps (every ``sync_every``-th, ``sync_s``) and the others (``inner_s``)."""
    slowest = np.max(np.asarray(times), axis=0)
    if slowest.size == 0 or slowest.size % sync_every:
        raise ValueError(f"{slowest.size} steps are not whole rounds of {sync_every}")
    rounds = slowest.reshape(-1, sync_every)
    return {
        "rounds": int(rounds.shape[0]),
        "step_s": float(slowest.mean()),
        "sync_s": float(rounds[:, -1].mean()),
        "inner_s": float(rounds[:, :-1].mean()) if sync_every > 1 else math.nan,
    }


def run(config: dict, rank: int, n: int, out: Path | None) -> dict:
    """Every measurement of this job (process 0 writes them to ``out`` after each rate)."""
    cfg = LMConfig(**config["model"])
    mesh = jax.make_mesh((n,), (AXIS,))
    say = print if rank == 0 else (lambda *a, **k: None)
    host_params = init_params(cfg)
    result: dict = {"workers": n, "model": dataclasses.asdict(cfg), "methods": {}}
    result["parameters"] = int(sum(x.size for x in jax.tree.leaves(host_params)))
    result["leaves"] = len(jax.tree.leaves(host_params))
    sharding = jax.NamedSharding(mesh, P(AXIS))
    batches = [
        jax.make_array_from_process_local_data(sharding, make_tokens(cfg, rank, i))
        for i in range(BATCHES)
    ]
    result["compute"] = {"times": time_compute(cfg, host_params, rank, config["compute_steps"])}
    result["compute"]["step_s"] = step_seconds(result["compute"]["times"])
    say(f"[n={n}] compute alone: {1e3 * result['compute']['step_s']:.0f} ms/step", flush=True)

    trainers = {}
    by_key = {m.key: m for m in METHODS}
    for key in config["methods"]:
        method = by_key[key]
        try:
            trainer, info = build(method, cfg, host_params, mesh, batches)
        except TypeError as err:  # a keyword the library does not take yet
            result["methods"][key] = {"skipped": f"TypeError: {err}"}
            say(f"[n={n}] {method.label}: SKIPPED (TypeError: {err})", flush=True)
            continue
        for _ in range(config["warmup"] if method.sync_every is None else 0):
            trainer.step()
        trainers[key] = trainer
        result["methods"][key] = {**info, "rates": {}}
        say(f"[n={n}] compiled {method.label} in {info['compile_s']:.1f} s", flush=True)

    barrier("idle0")
    before = netns.read_tx_bytes() if rank == 0 else 0
    barrier("idle1")
    idle = netns.read_tx_bytes() - before if rank == 0 else 0
    result["idle_bytes"] = int(idle)
    installed = False
    for rate in config["rates"]:
        name = rate or "unlimited"
        if rank == 0:
            netns.run(netns.rate_command(rate, installed=installed))
            installed = rate is not None
        barrier(f"rate {name}")
        for key, trainer in trainers.items():
            r = measure(trainer, config["steps"][name], rank, idle, config["rounds"])
            result["methods"][key]["rates"][name] = r
            mb = r["tx_bytes"] / n / r["steps"] / 2**20
            say(
                f"[n={n}] {name:>9s}  {trainer.method.label:30s} {1e3 * r['step_s']:8.0f} ms/step"
                f"  {mb:8.2f} MiB/worker/step  loss {r['losses'][-1]:.3f}",
                flush=True,
            )
        if rank == 0 and out is not None:
            out.write_text(json.dumps(result))
    return result


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--process-id", type=int, required=True)
    parser.add_argument("--num-processes", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--config", required=True, help="JSON: model, methods, rates, steps")
    parser.add_argument("--out", required=True, help="JSON result (written by process 0)")
    return parser.parse_args(argv)


def join(address: str, num_processes: int, process_id: int) -> None:
    """``jax.distributed.initialize`` on the loopback job, with a short heartbeat timeout."""
    jax.distributed.initialize(
        address,
        num_processes=num_processes,
        process_id=process_id,
        coordinator_bind_address=address,
        initialization_timeout=INIT_TIMEOUT_S,
        heartbeat_timeout_seconds=HEARTBEAT_TIMEOUT_S,
    )


def run_joined(port: int, num_processes: int, process_id: int, body) -> None:
    """Join the loopback job (gloo, one CPU device) and call ``body()``; on an error print
    it and exit at once, so that the other processes fail too rather than hang."""
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.config.update("jax_num_cpu_devices", 1)
    join(f"127.0.0.1:{port}", num_processes, process_id)
    try:
        body()
    except BaseException:
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    jax.distributed.shutdown()


def main(argv=None) -> None:
    """Join the loopback job and run every measurement."""
    args = parse_args(argv)
    config = json.loads(Path(args.config).read_text())
    run_joined(
        args.port,
        args.num_processes,
        args.process_id,
        lambda: run(config, args.process_id, args.num_processes, Path(args.out)),
    )


if __name__ == "__main__":
    main()

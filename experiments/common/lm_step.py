"""The compiled training step of a benchmark method (:mod:`experiments.common.lm`) over the
global 1-D mesh axis ``"data"`` of a job of processes, and what is known of its traffic
before it runs: the library's count (``compjax.communication``) and the collectives of the
compiled HLO (:mod:`experiments.common.hlo`).

Three kinds of step: the data-parallel step of docs/distributed.md ("A complete shard_map
training step": ``jax.jit(jax.shard_map(...))`` differentiating
``compjax.worker_params(params, "data")``, the method's optimizer state sharded by
``compjax.state_specs`` and ``optax.chain(method, optimizer)``), the sharded step of
:func:`compjax.fsdp`, and the local-steps step of :func:`compjax.local_steps`.
"""

from __future__ import annotations

import dataclasses
import time
from functools import partial

import jax
import numpy as np

import compjax
from experiments.common import methods
from experiments.common.hlo import hlo_collectives, hlo_wire_bits, per_step
from experiments.common.lm import FSDP_MIN_SIZE, BenchMethod, LMConfig, loss_fn

AXIS = "data"
P = jax.P


# -- arrays across processes ------------------------------------------------------------------
def replicated(tree, mesh):
    """Host arrays (equal in every process) as global arrays replicated over ``mesh``."""
    sharding = jax.NamedSharding(mesh, P())
    return jax.tree.map(
        lambda x: jax.make_array_from_callback(x.shape, sharding, lambda i, x=x: x[i]), tree
    )


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
        # Payload sizes: experiments.net.report applies the ring factors (costmodel.wire_bits).
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

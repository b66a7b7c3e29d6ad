"""Bits each worker sends per step, counted from the payloads a transformation builds.

The transformation's update is traced abstractly (``jax.eval_shape``, nothing
runs) under ``jax.vmap`` with the axis names bound, while
:func:`compjax.recording.recording` logs every message each worker puts
into a collective: payloads with their scales and indices, integer votes,
shared scalers, flags, each with its wire bits (from the arrays themselves),
the collective that carries it and the axes it crosses.

**The convention.**  The reported bits are the bits that *leave each worker*
per step, per collective, under ring algorithms, with ``n`` the number of
workers along the axes the message crosses and ``M`` its payload:

* all-reduce of ``M`` bits (``psum``, ``pmax``): ``2 (n - 1) / n * M``;
* all-gather of an ``M``-bit contribution: ``(n - 1) * M``;
* reduce-scatter of an ``M``-bit input: ``(n - 1) / n * M``;
* all-to-all of an ``M``-bit message (all its ``n`` blocks): ``(n - 1) / n * M``.

One worker (``n = 1``, or ``axis_name=None``) sends nothing.  The dense
baseline is the ring all-reduce of the gradient, in its own dtype, over the
same axes, so :attr:`CommunicationReport.compression_ratio` compares like
with like.  The payload sizes themselves (what
:mod:`compjax.costmodel` turns into time per collective) stay available as
:attr:`CommunicationReport.payloads`.

Each compjax transformation counts one round per step even where a wrapper
traces it twice; under ``optax.MultiSteps(k)`` a round happens every ``k``
steps, so divide by ``k`` for the per-step mean.
"""

from __future__ import annotations

import concurrent.futures
import math
from typing import Any, NamedTuple

import jax
import numpy as np

from compjax.axes import AxisName, UnboundAxisError
from compjax.collectives import _names
from compjax.recording import recording

#: Kinds of the messages a hierarchical exchange sends over its fast axis.
FAST_PREFIX = "fast_"

#: Kind of the parameter all-gather of sharded training (:func:`compjax.fsdp`); on a
#: ``(slow, fast)`` pair of axes, of its slow stage (the fast one is ``FAST_PREFIX + GATHER_KIND``).
GATHER_KIND = "param_gather"

#: Bits leaving each of ``n`` workers per payload bit, per collective (ring algorithms).
RING_FACTORS = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: n - 1,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
}


def ring_bits(via: str, payload_bits: float, n: int) -> float:
    """Bits one of ``n`` workers sends for an ``payload_bits``-bit message carried by ``via``."""
    return float(RING_FACTORS[via](n) * payload_bits) if n > 1 else 0.0


class CommunicationReport(NamedTuple):
    """Per-step communication of one worker (see the module docstring for the convention).

    Attributes:
      bits_per_worker: bits leaving one worker per step (ring traffic).
      dense_bits: the same for a ring all-reduce of the gradient in each
        leaf's own dtype over the same axes (16 bits per entry for a bf16
        model, 32 for float32).
      messages: ``(kind, bits)`` of every message, in order: the bits it
        puts on the wire (ring traffic).
      routes: ``(kind, via, axes)`` of every message, in the same order:
        ``via`` the collective that carries it (``"all_reduce"``,
        ``"all_gather"``, ``"all_to_all"`` or ``"reduce_scatter"``; a
        ``pmax`` is an all-reduce), ``axes`` the mesh axes it crosses.
      payloads: ``(kind, bits)`` of every message's payload, what the
        worker hands the collective (the input of :mod:`compjax.costmodel`).
      axis_sizes: ``(name, workers)`` of every axis.
    """

    bits_per_worker: float
    dense_bits: float
    messages: tuple[tuple[str, float], ...]
    routes: tuple[tuple[str, str, tuple[str, ...]], ...] = ()
    payloads: tuple[tuple[str, int], ...] = ()
    axis_sizes: tuple[tuple[str, int], ...] = ()

    @property
    def payload_bits(self) -> int:
        """Sum of the payloads (each message counted once, whatever it costs on a ring)."""
        return sum(b for _, b in self.payloads)

    def bits_by_route(self) -> dict[tuple[str, tuple[str, ...]], float]:
        """Bits leaving a worker per ``(via, axes)``: what each collective costs, per axis."""
        return _by_route(self.messages, self.routes)

    def payload_bits_by_route(self) -> dict[tuple[str, tuple[str, ...]], int]:
        """Payload bits per ``(via, axes)`` (the cost model's per-collective input)."""
        return _by_route(self.payloads, self.routes)

    @property
    def compression_ratio(self) -> float:
        """``dense_bits / bits_per_worker`` (``inf`` if nothing is sent, ``nan`` for one worker)."""
        if self.bits_per_worker:
            return self.dense_bits / self.bits_per_worker
        return float("inf") if self.dense_bits else float("nan")

    @property
    def fast_bits(self) -> float:
        """Bits sent over the fast axis of a hierarchical exchange or of :func:`compjax.fsdp`
        on a ``(slow, fast)`` pair of axes (uncompressed)."""
        return sum(b for kind, b in self.messages if kind.startswith(FAST_PREFIX))

    @property
    def slow_bits(self) -> float:
        """Bits sent over the other axes (everything but :attr:`fast_bits`)."""
        return self.bits_per_worker - self.fast_bits

    @property
    def gather_bits(self) -> float:
        """Bits of the parameter all-gather of sharded training (:func:`compjax.fsdp`), both
        stages on a ``(slow, fast)`` pair of axes; 0 else."""
        return self.fast_gather_bits + self.slow_gather_bits

    @property
    def fast_gather_bits(self) -> float:
        """Bits of :attr:`gather_bits` over the fast axis (:mod:`compjax.steps.hpz`; 0 on one
        axis)."""
        return sum(b for kind, b in self.messages if kind == FAST_PREFIX + GATHER_KIND)

    @property
    def slow_gather_bits(self) -> float:
        """Bits of :attr:`gather_bits` over the other axes (all of them on one axis)."""
        return sum(b for kind, b in self.messages if kind == GATHER_KIND)

    @property
    def gradient_bits(self) -> float:
        """Bits of the gradient exchange: everything but :attr:`gather_bits` (under
        :func:`compjax.fsdp`, the reduce-scatter, the replicated leaves' mean and the flag)."""
        return self.bits_per_worker - self.gather_bits

    @property
    def fast_gradient_bits(self) -> float:
        """Bits of :attr:`gradient_bits` over the fast axis (exact, uncompressed)."""
        return self.fast_bits - self.fast_gather_bits

    @property
    def slow_gradient_bits(self) -> float:
        """Bits of :attr:`gradient_bits` over the other axes (a message that crosses both
        axes, the 8-bit non-finite flag, counts here)."""
        return self.slow_bits - self.slow_gather_bits


def _by_route(messages, routes) -> dict:
    out: dict = {}
    for (_, bits), (_, via, axes) in zip(messages, routes, strict=True):
        out[via, axes] = out.get((via, axes), 0) + bits
    return out


def _axis_sizes(names: tuple[str, ...], num_workers, mesh) -> tuple[int, ...]:
    """Workers along each of ``names``: given, from ``mesh``, or from the bound axes."""
    if mesh is not None:
        shape = dict(mesh.shape)
        for name in names:
            if name not in shape:
                raise ValueError(
                    f"axis_name {name!r} is not an axis of mesh (its axes: {tuple(shape)})"
                )
        from_mesh = tuple(shape[a] for a in names)
    if num_workers is None:
        if mesh is not None:
            return from_mesh
        try:
            return tuple(int(jax.lax.axis_size(a)) for a in names)
        except NameError:
            raise ValueError(
                f"communication() needs the number of workers along axis_name {names}: pass "
                f"num_workers= (an int, or one per axis) or mesh=, or call it inside the "
                f"mapped step where the axes are bound"
            ) from None
    sizes = (
        tuple(num_workers) if isinstance(num_workers, tuple | list) else (num_workers,) * len(names)
    )
    if len(sizes) != len(names):
        raise ValueError(f"num_workers {num_workers!r} must give one size per axis of {names}")
    if not all(isinstance(s, int | np.integer) and s >= 1 for s in sizes):
        raise ValueError(f"num_workers must be positive integers, got {num_workers!r}")
    if mesh is not None and sizes != from_mesh:
        raise ValueError(f"num_workers {num_workers!r} disagrees with mesh sizes {from_mesh}")
    return tuple(int(s) for s in sizes)


def _bound(name: str) -> bool:
    try:
        jax.lax.axis_size(name)
    except NameError:
        return False
    return True


def _local_shape(shape: tuple[int, ...], spec, mesh, names: tuple[str, ...]) -> tuple[int, ...]:
    """The block of a ``shape`` leaf one device holds under ``spec`` (a ``PartitionSpec``)."""
    out = list(shape)
    for dim, entry in enumerate(tuple(spec or ())):
        axes = _names(entry)
        if set(axes) & set(names):
            raise ValueError(
                f"specs: {spec} shards a leaf over the data-parallel axis {axes}; "
                f"communication() counts leaves sharded over other axes (a model axis) only"
            )
        unknown = [a for a in axes if a not in mesh.shape]
        if unknown:
            raise ValueError(f"specs: {spec} names {unknown[0]!r}, not an axis of mesh")
        blocks = math.prod(mesh.shape[a] for a in axes)
        if out[dim] % blocks:
            raise ValueError(f"specs: {spec} does not split a leaf of shape {shape} evenly")
        out[dim] //= blocks
    return tuple(out)


def _shard_shape(shape, spec, names: tuple[str, ...], sizes: tuple[int, ...]) -> tuple[int, ...]:
    """One worker's shard of a ``shape`` leaf split over the data axes as ``spec`` says."""
    size_of = dict(zip(names, sizes, strict=True))
    out = list(shape)
    for dim, entry in enumerate(tuple(spec)):
        for axis in _names(entry):
            if axis not in size_of:
                raise ValueError(
                    f"the fsdp step splits its params over {axis!r}: pass axis_name={axis!r}"
                )
            out[dim] = -(-out[dim] // size_of[axis])  # a padded leaf: its padded shard
    return tuple(out)


def _traced(step, batched, isolate: bool) -> list:
    """The rounds ``step`` records while traced; with ``isolate`` in a thread of its own, so
    that inside a mapped step the simulated axes do not meet the enclosing trace's (JAX's
    trace state is per thread)."""

    def trace():
        with recording() as log:
            jax.eval_shape(step, batched)
        return log

    if not isolate:
        return trace()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(trace).result()


def _exposes_exchange(tx: Any) -> bool:
    """Whether ``tx`` is a step that exposes its exchange and parameter specs (not a
    transformation, which :func:`communication` runs through ``init`` and ``update``)."""
    return callable(getattr(tx, "exchange", None)) and hasattr(tx, "param_specs")


def communication(
    tx: Any,
    params: Any,
    axis_name: AxisName = "data",
    num_workers: int | tuple[int, ...] | None = None,
    *,
    mesh: jax.sharding.Mesh | None = None,
    specs: Any = None,
) -> CommunicationReport:
    """The bits one worker sends per step when ``tx`` updates ``params``-shaped gradients.

    Args:
      tx: any optax transformation containing compjax transformations
        (chains, wrappers); transformations that send nothing count zero.
        Or a step that exposes its messages: any object with an
        ``exchange(shards) -> grad_shards`` (one step's messages in a worker's
        view) and the ``param_specs`` its params are split by, as a
        :func:`compjax.fsdp` step (its :class:`compjax.FSDP`) does: the
        parameter gather (:attr:`CommunicationReport.gather_bits`) and the
        gradient exchange (:attr:`CommunicationReport.gradient_bits`) of one
        step, against the dense baseline of a ring all-reduce of the
        gradient (which is also what an uncompressed FSDP step sends: a
        gather and a reduce-scatter of ``(n - 1) / n`` each).  For a step
        on a ``(slow, fast)`` pair of axes pass that pair as ``axis_name``;
        each part is then also split by link (:attr:`CommunicationReport.fast_gather_bits`,
        ``slow_gather_bits``, ``fast_gradient_bits``, ``slow_gradient_bits``).
      params: the parameters (arrays or ``jax.ShapeDtypeStruct``), whole
        (the local blocks inside ``shard_map``).
      axis_name: the axis name (or tuple of names) ``tx``'s compjax parts
        reduce over; ``None`` for transformations built with ``axis_name=None``.
      num_workers: workers along each axis (an int for all of them, or one
        per name).  Without it the sizes come from ``mesh``, or, called
        inside the mapped step, from the bound axes; otherwise a
        ``ValueError``.
      mesh: the device mesh (its sizes for the named axes).
      specs: the params' ``PartitionSpec`` pytree on a model-sharded
        ``mesh``: each worker (device) compresses its own block of every
        leaf, so the messages and the dense baseline are counted per block.

    Returns:
      A :class:`CommunicationReport`.

    Raises:
      ValueError: the number of workers cannot be known, ``axis_name`` is
        not among ``mesh``'s axes or not the axis ``tx`` reduces over
        (the message names both), or ``specs`` without ``mesh``.
    """
    if specs is not None and mesh is None:
        raise ValueError("specs= needs the mesh= they refer to")
    names = _names(axis_name)
    sizes = _axis_sizes(names, num_workers, mesh)
    shapes = jax.tree.map(lambda p: jax.ShapeDtypeStruct(np.shape(p), p.dtype), params)
    if specs is not None:
        shapes = jax.tree.map(
            lambda s, spec: jax.ShapeDtypeStruct(_local_shape(s.shape, spec, mesh, names), s.dtype),
            shapes,
            specs,
        )
    dense_shapes = shapes
    if _exposes_exchange(tx):
        if specs is not None:
            raise ValueError("specs=: a step with an exchange carries its own param_specs")
        step = tx.exchange
        shapes = jax.tree.map(
            lambda s, spec: jax.ShapeDtypeStruct(
                _shard_shape(s.shape, spec, names, sizes), s.dtype
            ),
            shapes,
            tx.param_specs,
        )
    else:

        def step(p):
            return tx.update(p, tx.init(p), p)

    batched = jax.tree.map(lambda s: jax.ShapeDtypeStruct((*sizes, *s.shape), s.dtype), shapes)
    for name in reversed(names):
        step = jax.vmap(step, axis_name=name)
    try:
        log = _traced(step, batched, isolate=any(map(_bound, names)))
    except UnboundAxisError as err:
        if err.axis in names:
            raise
        raise ValueError(
            f"communication(axis_name={axis_name!r}): the transformation reduces over axis "
            f"{err.axis!r}, which is not among {names}; pass the axis the transformation was "
            f"built with"
        ) from err
    payloads, routes, seen = [], [], set()
    for owner, sent in log:
        if owner is not None and owner in seen:
            continue  # the same transformation traced again (e.g. by MultiSteps)
        seen.add(owner)
        payloads.extend(sent)
        routes.extend(sent.routes)
    size_of = dict(zip(names, sizes, strict=True))
    messages = tuple(
        (kind, ring_bits(via, bits, math.prod(size_of[a] for a in axes)))
        for (kind, bits), (_, via, axes) in zip(payloads, routes, strict=True)
    )
    gradient = sum(
        8 * np.dtype(s.dtype).itemsize * math.prod(s.shape) for s in jax.tree.leaves(dense_shapes)
    )
    return CommunicationReport(
        bits_per_worker=sum(b for _, b in messages),
        dense_bits=ring_bits("all_reduce", gradient, math.prod(sizes)),
        messages=messages,
        routes=tuple(routes),
        payloads=tuple(payloads),
        axis_sizes=tuple(size_of.items()),
    )

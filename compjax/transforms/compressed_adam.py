"""The building blocks that 1-bit Adam and 0/1 Adam share.

Their moments ``mu``, ``nu`` (shared) and error buffers (per worker: the
workers' ``error`` and the shard owners' ``server_error``), all float32; Adam's
moments of the uncompressed mean gradient; and the error-compensated 1-bit
all-reduce of a per-worker vector (worker and server error feedback).

An update of either is :func:`begin` (leaves, non-finite flag, keys, buffers),
one of the branches (:func:`dense_branch`, :func:`gradient_branch`,
:func:`momentum_branch`) chosen by ``lax.cond``/``lax.switch`` on the step
count, and :func:`finish` (the direction, the new state, the guard).

References:
  Tang, Gan, Awan, Rajbhandari, Li, Lian, Liu, Zhang, He, "1-bit Adam:
  Communication Efficient Large-Scale Training with Adam's Convergence
  Speed", ICML 2021.
  Lu, Li, Zhang, Tang, Awan, He, "Maximizing Communication Efficiency for
  Large-scale Training via 0/1 Adam", ICLR 2023.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from compjax.axes import AxisName
from compjax.compressor import Compressor
from compjax.compressors.dense import identity
from compjax.compressors.l2_sign import l2_scaled_sign
from compjax.draws import init_key, step_keys
from compjax.exchange import Exchange, as_exchange, compressed_mean
from compjax.guards import any_non_finite, guarded, saturated
from compjax.recording import unrecorded
from compjax.transforms.base import Leaves, ServerMemory


def _is_number(x) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)


def check_hyperparams(b1, b2, eps, **steps) -> None:
    """Construction-time checks of the Python numbers (arrays, e.g. from
    ``optax.inject_hyperparams``, pass through): each of ``steps`` an integer >= 1."""
    for name, value in steps.items():
        if isinstance(value, bool | float) or (_is_number(value) and value < 1):
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    for name, beta in (("b1", b1), ("b2", b2)):
        if _is_number(beta) and not 0.0 <= beta < 1.0:
            raise ValueError(f"{name} must be in [0, 1), got {beta!r}")
    if _is_number(eps) and not eps > 0.0:
        raise ValueError(f"eps must be > 0, got {eps!r}")


class Adam(NamedTuple):
    """What a compressed Adam's construction fixes: the exchange and Adam's constants."""

    axis_name: AxisName
    comp: Compressor
    exchange: str | Exchange
    server: ServerMemory
    flatten: bool
    bucket_size: int | None
    b1: float
    b2: float
    eps: float


def configure(axis_name, b1, b2, eps, comp, exchange, flatten, bucket_size) -> Adam:
    """The :class:`Adam` of checked arguments; ``comp=None`` is the paper's l2-scaled sign.

    Raises:
      ValueError: a bad ``exchange``.
    """
    comp = l2_scaled_sign() if comp is None else comp
    as_exchange(exchange)
    server = ServerMemory(comp, exchange)
    return Adam(axis_name, comp, exchange, server, flatten, bucket_size, b1, b2, eps)


def float32_zeros(a):
    """Zeros of ``a``'s shape in float32 (the moments' and buffers' dtype)."""
    return jnp.zeros(a.shape, jnp.float32)


def init_buffers(adam: Adam, seed: int, params) -> dict:
    """The shared ``key`` of ``seed``; zero ``mu``, ``nu`` (shared), ``error`` and
    ``server_error`` (per worker) for ``params``."""
    leaves = Leaves(params, adam.flatten, adam.bucket_size)
    return {
        "key": init_key(seed),
        "mu": leaves.shared_state(float32_zeros),
        "nu": leaves.shared_state(float32_zeros),
        "error": leaves.worker_state(float32_zeros),
        "server_error": adam.server.init(leaves),
    }


def read_buffers(leaves: Leaves, server: ServerMemory, state) -> tuple[list, list, list, list]:
    """``(mus, nus, errors, server memories)`` of ``state``, leaf by leaf."""
    return (
        leaves.read(state.mu, "mu", per_worker=False),
        leaves.read(state.nu, "nu", per_worker=False),
        leaves.read(state.error, "error", per_worker=True),
        server.read(leaves, state.server_error),
    )


def write_buffers(leaves: Leaves, server: ServerMemory, mus, nus, errors, memories, old) -> dict:
    """The state fields of :func:`init_buffers` from new values (``old``: the old memories)."""
    return {
        "mu": leaves.write(mus, per_worker=False),
        "nu": leaves.write(nus, per_worker=False),
        "error": leaves.write(errors, per_worker=True),
        "server_error": server.write(leaves, memories, old),
    }


def dense_moments(keys, grads, mus, nus, axis_name: AxisName, b1, b2):
    """Adam's ``m``, ``v`` of the mean gradient, all-reduced uncompressed (not logged:
    ``communication()`` reports the compressed rounds)."""
    new_mus, new_nus = [], []
    with unrecorded():
        for k, g, m, v in zip(keys, grads, mus, nus, strict=True):
            mean = compressed_mean(identity(), k, g, axis_name).mean.astype(jnp.float32)
            new_mus.append(b1 * m + (1.0 - b1) * mean)
            new_nus.append(saturated(b2 * v + (1.0 - b2) * jnp.square(mean)))
    return new_mus, new_nus


def error_compensated_mean(comp, key, x, error, memory, axis_name, exchange):
    """The compressed all-reduce with worker and server error feedback, in float32.

    Worker ``i`` sends ``C(x_i + e_i)`` and keeps ``e_i <- x_i + e_i - C(x_i +
    e_i)``; the shard owners' ``memory`` is the server error.

    Returns:
      ``(mean, new error, new memory)``.
    """
    compensated = x + error
    sent = compressed_mean(comp, key, compensated, axis_name, exchange, memory)
    new_error = sent.residual(compensated).astype(jnp.float32)
    return sent.mean.astype(jnp.float32), new_error, sent.memory


def compensated_means(comp, keys, xs, errors, memories, axis_name, exchange):
    """:func:`error_compensated_mean` leaf by leaf: ``(means, errors, memories)``."""
    out = ([], [], [])
    for k, x, e, s in zip(keys, xs, errors, memories, strict=True):
        for column, value in zip(
            out, error_compensated_mean(comp, k, x, e, s, axis_name, exchange), strict=True
        ):
            column.append(value)
    return out


def momenta(mus, grads, b1):
    """``b1 m + (1 - b1) g`` leaf by leaf, in float32 (each worker's own, for a local ``g``)."""
    return [b1 * m + (1.0 - b1) * g.astype(jnp.float32) for m, g in zip(mus, grads, strict=True)]


def directions(mus, nus, grads, eps):
    """``m / (sqrt(v) + eps)`` in each gradient's dtype."""
    return [
        (m / (jnp.sqrt(v) + eps)).astype(g.dtype) for m, v, g in zip(mus, nus, grads, strict=True)
    ]


class Step(NamedTuple):
    """One update's leaves, its non-finite flag, its keys and the buffers read from the state."""

    leaves: Leaves
    bad: jax.Array
    key: jax.Array
    keys: list
    mus: list
    nus: list
    errors: list
    memories: list


def begin(adam: Adam, updates, state) -> Step:
    """The updates split into leaves, flagged, and the state's buffers and keys."""
    leaves = Leaves(updates, adam.flatten, adam.bucket_size)
    bad = any_non_finite(leaves.arrays, adam.axis_name)
    mus, nus, errors, memories = read_buffers(leaves, adam.server, state)
    key, keys = step_keys(state.key, len(leaves.arrays))
    return Step(leaves, bad, key, keys, mus, nus, errors, memories)


def finish(adam: Adam, step: Step, state, make: Callable, buffers, counters: dict) -> tuple:
    """The direction ``m / (sqrt(v) + eps)`` and the new state (``make(**fields)``), guarded.

    ``buffers`` are the new ``(mus, nus, errors, memories)``; ``counters`` the
    other fields but the key.
    """
    mus, nus, errors, memories = buffers
    new_state = make(
        **counters,
        key=step.key,
        **write_buffers(step.leaves, adam.server, mus, nus, errors, memories, step.memories),
    )
    out = directions(mus, nus, step.leaves.arrays, adam.eps)
    out, new_state = guarded(step.bad, out, new_state, state)
    return step.leaves.rebuild(out), new_state


def dense_branch(adam: Adam, grads, keys, mus, nus, errors, memories):
    """Adam's moments of the mean gradient, all-reduced uncompressed; the buffers kept."""
    mus, nus = dense_moments(keys, grads, mus, nus, adam.axis_name, adam.b1, adam.b2)
    return mus, nus, errors, memories


def momentum_branch(adam: Adam, grads, keys, mus, nus, errors, memories):
    """Each worker's momentum ``b1 m + (1 - b1) g_i`` averaged by the compensated all-reduce."""
    local = momenta(mus, grads, adam.b1)
    mus, errors, memories = compensated_means(
        adam.comp, keys, local, errors, memories, adam.axis_name, adam.exchange
    )
    return mus, nus, errors, memories


def gradient_branch(adam: Adam, grads, keys, mus, nus, errors, memories):
    """The gradients averaged by the compensated all-reduce, ``g_hat``, and ``m <- b1 m + (1 -
    b1) g_hat`` (its messages are a momentum round's, reported once)."""
    with unrecorded():
        g_hats, errors, memories = compensated_means(
            adam.comp, keys, grads, errors, memories, adam.axis_name, adam.exchange
        )
    return momenta(mus, g_hats, adam.b1), nus, errors, memories


def branches(bound: Any, *functions: Callable) -> list[Callable]:
    """``functions`` with ``bound`` as their first argument, as new objects at every call.

    ``lax.cond`` and ``lax.switch`` cache a traced branch by the function
    object: a cached branch would not log its messages again at the next
    trace, so every trace builds its own.
    """
    return [functools.partial(f, bound) for f in functions]

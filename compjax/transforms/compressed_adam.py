"""The building blocks that 1-bit Adam and 0/1 Adam share.

Their moments ``mu``, ``nu`` (shared) and error buffers (per worker: the
workers' ``error`` and the shard owners' ``server_error``), all float32; Adam's
moments of the uncompressed mean gradient; and the error-compensated 1-bit
all-reduce of a per-worker vector (worker and server error feedback).

References:
  Tang, Gan, Awan, Rajbhandari, Li, Lian, Liu, Zhang, He, "1-bit Adam:
  Communication Efficient Large-Scale Training with Adam's Convergence
  Speed", ICML 2021.
  Lu, Li, Zhang, Tang, Awan, He, "Maximizing Communication Efficiency for
  Large-scale Training via 0/1 Adam", ICLR 2023.
"""

from __future__ import annotations

import jax.numpy as jnp

from compjax.collectives import AxisName, unrecorded
from compjax.compressors.dense import identity
from compjax.exchange import compressed_mean
from compjax.transforms.base import Leaves, ServerMemory, saturated


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


def _zeros(a):
    return jnp.zeros(a.shape, jnp.float32)


def init_buffers(leaves: Leaves, server: ServerMemory) -> dict:
    """Zero ``mu``, ``nu`` (shared), ``error`` and ``server_error`` (per worker)."""
    return {
        "mu": leaves.shared_state(_zeros),
        "nu": leaves.shared_state(_zeros),
        "error": leaves.worker_state(_zeros),
        "server_error": server.init(leaves),
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

"""The wire message of a compressor: a pytree whose arrays are exactly what is sent.

A :class:`Payload` holds

* ``wire``: the arrays that travel (bit-packed signs, packed integer codes,
  int32 indices, float scales...).  :func:`wire_bits` counts these and nothing
  else.
* ``side``: arrays every worker already holds without communication, such as
  the shared PRNG key of ``rand_k(shared_seed=True)``.  They are pytree leaves
  (so ``jax.vmap`` and ``jax.lax.all_gather`` carry them along) but are never
  counted as sent.
* ``meta``: static, hashable metadata (input shape and dtype, and whatever a
  compressor needs to decode), stored in the pytree's aux data so that
  ``jax.lax.all_gather(payload, axis)`` followed by
  ``jax.vmap(compressor.decompress)`` just works.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Hashable, Mapping
from typing import Any

import jax
import numpy as np


@dataclasses.dataclass(frozen=True)
class Payload:
    """A compressed message.

    Attributes:
      wire: mapping from field name to array (or nested :class:`Payload`) sent
        on the wire.
      side: mapping from field name to array known to all workers in advance
        (never counted as sent).
      meta: static metadata; ``meta[0]`` is the input shape and ``meta[1]`` its
        dtype for every compressor in compjax.
    """

    wire: Mapping[str, Any]
    side: Mapping[str, Any]
    meta: Hashable

    @property
    def shape(self) -> tuple[int, ...]:
        return self.meta[0]

    @property
    def dtype(self) -> np.dtype:
        return self.meta[1]


jax.tree_util.register_dataclass(Payload, data_fields=["wire", "side"], meta_fields=["meta"])


def _array_bits(leaf: Any) -> int:
    dtype = np.dtype(leaf.dtype)
    return math.prod(leaf.shape) * dtype.itemsize * 8


def wire_bits(payload: Any) -> int:
    """Bits on the wire of ``payload``, counted from its arrays.

    Works on concrete arrays, tracers and ``jax.ShapeDtypeStruct`` alike (only
    shapes and dtypes are read).  Side information (``Payload.side``) is not
    counted; nested payloads are counted recursively.  A payload gathered over
    workers (a leading worker axis) counts the bits of all workers together.

    Args:
      payload: a :class:`Payload`, or any pytree of arrays.

    Returns:
      The number of bits, a Python ``int``.
    """
    if isinstance(payload, Payload):
        return sum(wire_bits(v) for v in payload.wire.values())
    leaves = jax.tree_util.tree_leaves(payload, is_leaf=lambda x: isinstance(x, Payload))
    total = 0
    for leaf in leaves:
        total += wire_bits(leaf) if isinstance(leaf, Payload) else _array_bits(leaf)
    return total

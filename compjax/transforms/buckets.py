"""Gradient buckets: a pytree laid end to end and cut into fixed-size flat arrays.

A transformation given ``bucket_size`` compresses and exchanges one bucket
at a time instead of one leaf at a time, so a step issues a few large
messages whatever the number of leaves (a ResNet-50 has 161), each with its
own scale where the compressor has one.

References:
  Li et al., "PyTorch Distributed: Experiences on Accelerating Data Parallel
  Training", VLDB 2020 (gradient bucketing in DDP).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from compjax.compressor import unflatten
from compjax.numerics import flatten
from compjax.pieces import Pieces


class Buckets:
    """The layout of a pytree cut into consecutive flat buckets of ``size`` entries.

    Bucket ``b`` holds entries ``[b size, (b + 1) size)`` of the leaves laid
    end to end (the last bucket is shorter), in the leaves' common dtype.
    The layout depends only on the leaves' shapes and dtypes, so it can be
    built from ``jax.ShapeDtypeStruct`` leaves and used outside a trace.

    Args:
      tree: a pytree of arrays (or of anything with ``shape`` and ``dtype``).
      size: entries per bucket, at least 1.
    """

    def __init__(self, tree: Any, size: int):
        leaves, self._treedef = jax.tree.flatten(tree)
        self._shapes = [(tuple(leaf.shape), leaf.dtype) for leaf in leaves]
        self.dtype = jnp.result_type(*(d for _, d in self._shapes)) if leaves else jnp.float32
        starts = np.cumsum([0] + [math.prod(s) for s, _ in self._shapes])
        self._starts, total = starts, int(starts[-1])
        self.bounds = [(a, min(a + size, total)) for a in range(0, total, size)] or [(0, 0)]

    def _pieces(self, a: int, b: int) -> list[tuple[int, int, int]]:
        """``(leaf, start, stop)`` of the leaf slices that make up entries ``[a, b)``."""
        out = []
        for i, (s0, s1) in enumerate(zip(self._starts[:-1], self._starts[1:], strict=True)):
            lo, hi = max(a, int(s0)), min(b, int(s1))
            if lo < hi:
                out.append((i, lo - int(s0), hi - int(s0)))
        return out

    def pieces(self, tree: Any) -> list[Pieces]:
        """Each bucket as the pieces of leaves it covers, nothing copied.

        An elementwise compressor encodes a bucket from its pieces
        (:meth:`compjax.Compressor.compress_pieces`); :meth:`Pieces.join
        <compjax.pieces.Pieces.join>` is the bucket as one array.
        """
        flat = [flatten(leaf).astype(self.dtype) for leaf in jax.tree.leaves(tree)]
        return [
            Pieces(
                tuple(flat[i] for i, _, _ in self._pieces(a, b)),
                tuple((lo, hi) for _, lo, hi in self._pieces(a, b)),
                np.dtype(self.dtype),
            )
            for a, b in self.bounds
        ]

    def sizes(self, bucket: int) -> tuple[int, ...]:
        """The entries of each piece of bucket ``bucket`` (:meth:`pieces`)."""
        return tuple(hi - lo for _, lo, hi in self._pieces(*self.bounds[bucket]))

    def cut(self, tree: Any) -> list[jax.Array]:
        """One flat array per bucket: the concatenation of its pieces, a fresh buffer.

        Each bucket is built from only the leaves it overlaps (never one
        concatenation of the whole tree, whose fresh buffer costs about three
        copies of the tree on a CPU) and is materialised once behind an
        optimisation barrier (fused into a compressor, XLA's CPU backend
        would evaluate the concatenation per entry).  Where a compressor
        encodes pieces, :meth:`pieces` avoids the copy.
        """
        return [p.join() for p in self.pieces(tree)]

    def rebuild(self, arrays: Sequence[jax.Array | Sequence[jax.Array]]) -> Any:
        """The tree from one array per bucket (each leaf back in its own dtype).

        A bucket may also be given as its pieces (a sequence of 1-D arrays of
        :meth:`sizes`, as :meth:`compjax.Compressor.decompress_pieces`
        returns): each piece then goes to its leaf as it is.
        """
        parts: list[list[jax.Array]] = [[] for _ in self._shapes]
        for (a, b), bucket in zip(self.bounds, arrays, strict=True):
            for j, (i, lo, hi) in enumerate(self._pieces(a, b)):
                if not hasattr(bucket, "shape"):  # in pieces
                    parts[i].append(bucket[j])
                    continue
                start = int(self._starts[i]) + lo - a
                parts[i].append(bucket[start : start + hi - lo])
        leaves = [
            unflatten((jnp.concatenate(p) if len(p) > 1 else p[0]).astype(dtype), shape)
            if p
            else jnp.zeros(shape, dtype)
            for p, (shape, dtype) in zip(parts, self._shapes, strict=True)
        ]
        return jax.tree.unflatten(self._treedef, leaves)

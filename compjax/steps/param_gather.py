"""The parameter all-gather of :func:`compjax.fsdp`, exact or compressed (ZeRO++'s qwZ).

Each worker holds a shard of a parameter; the forward pass needs the whole
of it.  :func:`gathered` all-gathers the shards in float32, as blockwise int8
with one float32 step per block (:func:`quantize_blocks`), or cast to a
16- or 8-bit float.  A compressed gather shows the forward pass decoded
weights: a bias, bounded per entry by half a block's step for int8.

References:
  Wang et al., "ZeRO++: Extremely Efficient Collective Communication for
  Giant Model Training", ICLR 2024 (quantized weight gather, qwZ).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from compjax import collectives
from compjax.numerics import to_dtype
from compjax.recording import record

#: Parameter gathers other than the exact float32 one (see :func:`fsdp`'s ``gather``).
GATHERS = ("int8", "bfloat16", "float16", "float8_e4m3fn")

#: Largest int8 code of the blockwise quantizer (symmetric grid ``{-127, ..., 127}``).
INT8_LEVELS = 127


def quantize_blocks(x: jax.Array, block: int) -> tuple[jax.Array, jax.Array]:
    """Blockwise symmetric int8 with nearest rounding: ``(codes, steps)``.

    ``x`` is flattened and zero-padded to whole blocks of ``block`` entries;
    each block gets the step ``D = max|block| / 127`` and the codes
    ``round(x / D)`` in ``[-127, 127]`` (int8), so that the decode
    ``codes * D`` is within ``D / 2`` of every entry of its block (up to
    float32 rounding of the step).  A zero block has step 0 and codes 0; an
    Inf or NaN entry makes its block's decode NaN.

    Returns:
      ``codes`` (int8, ``(blocks, block)``) and ``steps`` (float32, ``(blocks,)``).

    References:
      Wang et al., "ZeRO++", ICLR 2024 (blockwise int8 weights, qwZ).
    """
    flat = x.reshape(-1).astype(jnp.float32)
    blocks = jnp.pad(flat, (0, -flat.shape[0] % block)).reshape(-1, block)
    top = jnp.max(jnp.abs(blocks), axis=1)
    steps = top / INT8_LEVELS
    safe = jnp.where(steps > 0, steps, 1.0)[:, None]
    codes = jnp.clip(jnp.round(blocks / safe), -INT8_LEVELS, INT8_LEVELS)
    codes = jnp.where(jnp.isfinite(codes), codes, 0).astype(jnp.int8)
    steps = jnp.where(jnp.isfinite(top), steps, jnp.nan)
    return codes, steps


def dequantize_blocks(codes: jax.Array, steps: jax.Array, shape, dtype) -> jax.Array:
    """The inverse of :func:`quantize_blocks`: ``codes * step``, cut to ``shape``, in ``dtype``."""
    flat = (codes.astype(jnp.float32) * steps[:, None]).reshape(-1)
    return to_dtype(flat[: int(np.prod(shape, dtype=np.int64))].reshape(shape), dtype)


def joined_bytes(codes: jax.Array, steps: jax.Array) -> jax.Array:
    """int8 ``codes`` and float32 ``steps`` as one int8 vector: the codes, then the steps'
    bytes (the same bits on the wire as the two arrays)."""
    raw = jax.lax.bitcast_convert_type(steps, jnp.int8).reshape(-1)
    return jnp.concatenate([codes.reshape(-1), raw])


def split_bytes(message: jax.Array, codes_shape) -> tuple[jax.Array, jax.Array]:
    """The inverse of :func:`joined_bytes`: ``(codes, steps)``."""
    size = int(np.prod(codes_shape))
    steps = jax.lax.bitcast_convert_type(message[size:].reshape(-1, 4), jnp.float32)
    return message[:size].reshape(codes_shape), steps


def gathered(shard: jax.Array, dim: int | None, axis_name: str, gather, block: int):
    """The whole parameter from every worker's ``shard`` (split along ``dim``), as gathered."""
    if dim is None:
        return shard
    moved = jnp.moveaxis(shard, dim, 0)
    if gather is None:
        record("param_gather", moved, "all_gather", axis_name)
        whole = collectives.all_gather_tiled(moved, axis_name)
    elif gather == "int8":
        # A shard smaller than a block is one block of its own size (no padding on the wire).
        codes, steps = quantize_blocks(moved, max(1, min(block, moved.size)))
        record("param_gather", (codes, steps), "all_gather", axis_name)
        # One message: the codes, then the steps' float32 bytes (a collective each would
        # double the gathers, and between processes each costs its own round trip).
        every = collectives.all_gather(joined_bytes(codes, steps), axis_name)
        decode = lambda m: dequantize_blocks(  # noqa: E731
            *split_bytes(m, codes.shape), moved.shape, shard.dtype
        )
        parts = jax.vmap(decode)(every)
        whole = parts.reshape((-1, *moved.shape[1:]))
    else:
        low = to_dtype(moved, jnp.dtype(gather))  # saturating: float8 has no Inf
        # Gathered as unsigned integers of the same width: a backend that computes in wider
        # floats (XLA's CPU widens bfloat16 collectives to float32) must not widen the wire.
        wire = jax.lax.bitcast_convert_type(low, jnp.dtype(f"uint{8 * low.dtype.itemsize}"))
        record("param_gather", wire, "all_gather", axis_name)
        whole = collectives.all_gather_tiled(wire, axis_name)
        whole = jax.lax.bitcast_convert_type(whole, low.dtype).astype(shard.dtype)
    return jnp.moveaxis(whole, 0, dim)

"""Checks on the params of the local-step transformations (per-worker params).

:func:`compjax.diloco`, :func:`compjax.streaming_diloco` and 0/1 Adam's local
rounds keep the global params ``theta`` in the state and send the
pseudo-gradients ``theta - theta_i`` through a compressor, in float32.  Their
params are therefore float32, bfloat16 or float16: float64 params (under
``jax_enable_x64``) are refused when the state is built, with advice that
fits the API (the params, not the gradients, are what the user casts).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp


def check_params_dtype(params: Any, where: str, before: str = "init") -> None:
    """Refuse floating-point params wider than float32.

    Args:
      params: the params pytree (arrays or ``jax.ShapeDtypeStruct``).
      where: the function the params were given to, for the message.
      before: what the advice says to cast the params before.

    Raises:
      ValueError: a floating leaf of ``params`` is wider than float32 (the
        message names the leaf, its dtype and how to cast the params).
    """
    for path, _, dtype in wide_float_leaves(params):
        raise ValueError(
            f"{where}: params must be float32, bfloat16 or float16, got {dtype} at "
            f"params{jax.tree_util.keystr(path)} (jax_enable_x64): the global params, "
            f"the memories and the pseudo-gradients are float32; cast the params to "
            f"float32 (jax.tree.map(lambda p: p.astype(jnp.float32), params)) before "
            f"{before}, or disable jax_enable_x64"
        )


def wide_float_leaves(params: Any):
    """``(path, leaf, dtype)`` of each floating leaf of ``params`` wider than float32."""
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        dtype = jnp.dtype(leaf.dtype) if hasattr(leaf, "dtype") else jnp.result_type(leaf)
        if jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize > 4:
            yield path, leaf, dtype

"""Two-level sharded training on a ``(slow, fast)`` mesh: ZeRO++'s hpZ for :func:`compjax.fsdp`.

With ``axis_name=("hosts", "local")`` (the slow axis first: hosts over a
network; the fast one second: chips in a host), :func:`compjax.fsdp` splits
every sharded leaf into ``n = H L`` blocks along its split dimension, laid
out *local-major*: worker ``(hosts=h, local=l)`` owns block ``l H + h`` (the
``PartitionSpec`` entry is ``("local", "hosts")``), so the ``H`` workers
with the same local index own the contiguous ``l``-th ``1/L`` of the leaf.
The arrays stay ordinary global arrays (orbax saves and restores them onto
any mesh).  Each step, every worker

* **gathers the parameters in two stages**: its block over the slow axis,
  compressed as ``gather=`` says (:func:`compjax.steps.param_gather.gathered`;
  ZeRO++'s qwZ), which gives the ``l``-th ``1/L`` of the leaf, decoded: the
  node-level *secondary shard* of hpZ; then that secondary shard over the
  fast axis, exact, in the parameter's dtype (:func:`fast_gathered`);
* **reduce-scatters the gradient in two stages**: exactly over the fast
  axis, which leaves each worker the mean over its host of the ``l``-th
  ``1/L`` of the gradient (:func:`locally_reduced`), then compressed over
  the slow axis alone (:func:`compjax.exchange.compressed_reduce_scatter`
  of that ``1/L``), which leaves it the mean over all ``n`` workers of the
  block it owns.

Per worker and step, for a model of ``M`` bits (``M_c`` compressed by the
gradient compressor, ``M_w`` by the parameter gather), the slow link
carries ``(H - 1) M_w / n`` (the gather) and ``(H - 1) / H · M_c / L`` (the
reduce-scatter); the fast link ``(L - 1) M / L`` twice, uncompressed.  A
flat :func:`compjax.fsdp` over the same ``n`` workers sends ``(n - 1) / n``
of each message, most of it over the slow link.

What hpZ saves in ZeRO++ is the *backward* pass's re-gather over the slow
link: DeepSpeed frees each layer's gathered weights after the forward pass
and gathers them again for the backward pass, from the secondary shard.
:func:`compjax.fsdp` never re-gathers: it gathers the whole model once per
step and differentiates the loss as a function of the gathered weights, so
the backward pass reuses them.  What the two levels add here is that the
slow link carries the compressed gather (and the compressed gradient) once,
of ``1/L`` of the model, and the fast link does the rest.  The secondary
shard costs ``M / L`` of memory per device within the step (decoded, in
the parameters' dtype); it is not kept between steps.

References:
  Wang et al., "ZeRO++: Extremely Efficient Collective Communication for
  Giant Model Training", ICLR 2024 (hpZ, the secondary shard; qwZ, the
  quantized weight gather).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from compjax import collectives
from compjax.axes import num_workers
from compjax.recording import record

#: Kind of the fast axis's parameter all-gather (its slow stage is ``"param_gather"``).
FAST_GATHER_KIND = "fast_param_gather"

#: Kind of the fast axis's exact gradient reduce-scatter.
FAST_REDUCE_KIND = "fast_reduce_scatter"

#: Kind of the fast axis's sum of the replicated (small) leaves' gradients.
FAST_MEAN_KIND = "fast_replicated_mean"


def check_axis_name(axis_name, mesh: jax.sharding.Mesh) -> tuple[str, ...]:
    """``axis_name``'s mesh axes: ``(name,)`` for one axis, ``(slow, fast)`` for a pair.

    Raises:
      ValueError: not a name or a pair of distinct names, or a name that is
        not an axis of ``mesh`` (the message names ``axis_name``).
    """
    if isinstance(axis_name, str):
        names = (axis_name,)
    elif (
        isinstance(axis_name, tuple)
        and len(axis_name) == 2
        and all(isinstance(a, str) for a in axis_name)
    ):
        names = axis_name
    else:
        raise ValueError(
            f"fsdp shards over one mesh axis or a (slow, fast) pair of them: axis_name must be "
            f"a name or a pair of names such as ('hosts', 'local'), got {axis_name!r}"
        )
    if len(set(names)) != len(names):
        raise ValueError(f"axis_name {axis_name!r} names the same axis twice")
    for name in names:
        if name not in mesh.axis_names:
            which = "" if name == axis_name else f": {name!r}"
            raise ValueError(
                f"axis_name {axis_name!r}{which} is not an axis of the mesh {mesh.axis_names}"
            )
    return names


def fast_gathered(secondary: jax.Array, dim: int | None, fast: str) -> jax.Array:
    """The whole parameter from every fast worker's ``secondary`` shard (split along ``dim``).

    An exact tiled all-gather over ``fast``, in the secondary shard's dtype
    (the decoded weights of the slow gather).
    """
    if dim is None:
        return secondary
    moved = jnp.moveaxis(secondary, dim, 0)
    record(FAST_GATHER_KIND, moved, "all_gather", fast)
    return jnp.moveaxis(collectives.all_gather_tiled(moved, fast), 0, dim)


def locally_reduced(moved: jax.Array, fast: str) -> jax.Array:
    """This worker's ``1/L`` of ``moved`` (rows split), averaged exactly over ``fast``.

    ``moved`` is a gradient whose split dimension is first (its length a
    multiple of ``L`` workers along ``fast``); worker ``l`` receives the mean
    over ``fast`` of its ``l``-th block of rows: a reduce-scatter in
    ``moved``'s dtype.
    """
    size = num_workers(fast)
    record(FAST_REDUCE_KIND, moved, "reduce_scatter", fast)
    return collectives.psum_scatter(moved, fast) / jnp.asarray(size, moved.dtype)


def fast_summed(g: jax.Array, fast: str) -> jax.Array:
    """The sum over ``fast`` of a replicated leaf's gradient ``g`` (an exact all-reduce)."""
    record(FAST_MEAN_KIND, g, "all_reduce", fast)
    return collectives.psum(g, fast)

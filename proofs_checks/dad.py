"""dAD and rank-dAD (Baker et al. 2021): the outer-product identity.

For a linear layer with inputs ``A`` (``rows x in``) and backpropagated output
cotangents ``Delta`` (``rows x out``) the kernel gradient over a batch is
``A^T Delta = sum_s A_s^T Delta_s``, a sum over sites ``s``.  dAD all-gathers
``(A_s, Delta_s)`` and every site forms the sum: exactly the pooled gradient.
rank-dAD sends rank-``r`` factors of each ``Delta_s^T [A_s, 1]``; with ``r`` at
least their rank it is exact too.

The checks use ``compjax.dad.dad_grads`` and ``compjax.dad.rank_dad_grads`` on a
flax linen MLP with sites simulated by ``jax.vmap(axis_name="data")``, against
``jax.grad`` of the same mean loss on all sites' data in one batch.  Where
``compjax.dad`` is not importable they report SKIPPED.
"""

from __future__ import annotations

import importlib

import jax
import jax.numpy as jnp
import numpy as np

from proofs_checks import SKIPPED, Result, check, result
from proofs_checks._common import fmt

SOURCE = "Baker et al. 2021"
SITES, LOCAL, D_IN, HIDDEN, CLASSES = 4, 6, 9, 7, 5


def _module():
    """``compjax.dad`` and ``None``, or ``None`` and why it is unavailable."""
    try:
        module = importlib.import_module("compjax.dad")
    except ImportError as err:
        return None, f"compjax.dad is not importable ({err})"
    missing = [n for n in ("dad_grads", "rank_dad_grads") if not hasattr(module, n)]
    if missing:
        return None, f"compjax.dad has no {', '.join(missing)}"
    return module, None


def _problem():
    import flax.linen as nn

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(CLASSES)(jnp.tanh(nn.Dense(HIDDEN)(x)))

    model = MLP()
    rng = np.random.default_rng(1100)
    x = jnp.asarray(rng.standard_normal((SITES * LOCAL, D_IN)), jnp.float32)
    y = jnp.asarray(rng.standard_normal((SITES * LOCAL, CLASSES)), jnp.float32)
    params = jax.jit(model.init)(jax.random.key(1100), x[:1])

    def loss_fn(params, batch):
        x, y = batch
        return 0.5 * jnp.mean(jnp.sum((model.apply(params, x) - y) ** 2, axis=-1))

    return loss_fn, params, (x, y)


def _deviation(grads_per_site, reference):
    """Largest relative deviation of any site's gradient from the reference, leaf by leaf,
    and whether every site holds the same gradient."""
    worst, same = 0.0, True
    for got, ref in zip(jax.tree.leaves(grads_per_site), jax.tree.leaves(reference), strict=True):
        got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
        worst = max(worst, float(np.max(np.abs(got - ref[None]))) / float(np.max(np.abs(ref))))
        same &= bool(np.all(got == got[:1]))
    return worst, same


@check
def outer_product_identity(fast: bool):
    claims = (
        "dAD: all-gathered activations and deltas give exactly the pooled gradient "
        "(Σ_s A_sᵀΔ_s for every Dense layer)",
        "rank-dAD with rank ≥ the rank of every Δ_sᵀ[A_s, 1] is exact",
    )
    dad, why = _module()
    if dad is None:
        return [
            Result(c, SOURCE, "—", "—", SKIPPED, f"SKIPPED (not available): {why}") for c in claims
        ]
    loss_fn, params, batch = _problem()
    reference = jax.jit(jax.grad(loss_fn))(params, batch)
    sites = jax.tree.map(lambda v: v.reshape(SITES, LOCAL, *v.shape[1:]), batch)

    def exact(b):
        return dad.dad_grads(loss_fn, params, b, "data")[1]

    def low_rank(b):
        return dad.rank_dad_grads(loss_fn, params, b, "data", rank=max(D_IN, HIDDEN) + 1)[1]

    dev, same = _deviation(jax.jit(jax.vmap(exact, axis_name="data"))(sites), reference)
    rdev, rsame = _deviation(jax.jit(jax.vmap(low_rank, axis_name="data"))(sites), reference)
    layers = f"{D_IN} → {HIDDEN} (tanh) → {CLASSES}"
    return [
        result(
            claims[0],
            SOURCE + " (dAD)",
            f"max |dAD − ∇L|/max|∇L| over leaves and sites = {fmt(dev, 2)}; sites agree: {same}",
            "≤ 1e-5 (float32); identical on every site",
            dev <= 1e-5 and same,
            f"compjax.dad.dad_grads on a flax MLP {layers} (kernels and biases), "
            f"{SITES} sites × {LOCAL} rows under jax.vmap(axis_name='data'), squared loss "
            f"(mean over the batch); reference: jax.grad of the same loss on the pooled batch.",
        ),
        result(
            claims[1],
            SOURCE + " (rank-dAD)",
            f"max |rank-dAD − ∇L|/max|∇L| = {fmt(rdev, 2)}; sites agree: {rsame}",
            "≤ 1e-4 (float32 power iteration); identical on every site",
            rdev <= 1e-4 and rsame,
            f"compjax.dad.rank_dad_grads(rank={max(D_IN, HIDDEN) + 1}) (capped per layer at "
            f"min(out, in + 1, rows), the rank of Δ_sᵀ[A_s, 1]), default 2 power iterations; "
            f"same model and sites.",
        ),
    ]

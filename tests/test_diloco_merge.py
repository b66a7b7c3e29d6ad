"""compjax.diloco's robust merges (merge="median_norm_clip" | "trimmed_mean"): the round's
pseudo-gradients are gathered, decoded and merged by compjax.merges, one leaf at a time.

Checked under jax.vmap over 4 workers against the merge computed directly on the workers'
pseudo-gradients (outer SGD(1): theta_new = theta - merged), with one worker lying."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import compjax
from compjax import merges

N = 4
P0 = {"w": jnp.linspace(-1.0, 1.0, 12).reshape(3, 4), "b": jnp.zeros((4,))}
# The workers' gradients: worker 3's is 1e6 times larger (a lying worker).
SCALES = jnp.array([1.0, 2.0, 3.0, 1e6])


def grads_of(scale):
    return jax.tree.map(lambda a: scale * (jnp.cos(a) + 0.5), P0)


@functools.cache
def stepper(merge, compressor=None, dtype=jnp.float32):
    tx = compjax.diloco(optax.sgd(0.1), optax.sgd(1.0), 1, "i", compressor=compressor,
                        merge=merge, trim=0.25)  # fmt: skip
    params = jax.tree.map(lambda a: a.astype(dtype), P0)

    def step(p, s, scale):
        u, s = tx.update(jax.tree.map(lambda g: g.astype(dtype), grads_of(scale)), s, p)
        return optax.apply_updates(p, u), s

    init = jax.jit(jax.vmap(lambda _: tx.init(params)))
    return params, init, jax.jit(jax.vmap(step, axis_name="i"))


def one_round(merge, compressor=None, dtype=jnp.float32):
    params, init, step = stepper(merge, compressor, dtype)
    local, state = step(compjax.worker_copies(params, N), init(jnp.arange(N)), SCALES)
    return local, compjax.global_params(state, stacked=True)


def pseudo_gradients():
    """Each worker's theta - theta_i after one inner SGD(0.1) step: 0.1 * its gradient."""
    return jax.vmap(lambda s: jax.tree.map(lambda g: 0.1 * g, grads_of(s)))(SCALES)


@pytest.mark.parametrize("merge", ["median_norm_clip", "trimmed_mean"])
def test_a_round_steps_theta_by_the_merge_of_the_workers_pseudo_gradients(merge):
    local, theta = one_round(merge)
    merged = {
        k: merges.merger(merge, 0.25)(v.reshape(N, -1)).reshape(v.shape[1:])
        for k, v in pseudo_gradients().items()
    }
    for k in P0:
        np.testing.assert_allclose(theta[k], P0[k] - merged[k], rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(local[k][0], theta[k], rtol=1e-6, atol=1e-6)  # moved there


def test_a_lying_worker_drags_the_mean_but_not_the_robust_merges():
    honest = max(float(jnp.linalg.norm(0.1 * s * (jnp.cos(P0["w"]) + 0.5))) for s in SCALES[:3])
    moves = {}
    for merge in ("mean", "median_norm_clip", "trimmed_mean"):
        _, theta = one_round(merge)
        moves[merge] = float(jnp.linalg.norm(theta["w"] - P0["w"]))
    assert moves["mean"] > 1e4 * honest
    assert moves["median_norm_clip"] <= honest * (1 + 1e-6)
    assert moves["trimmed_mean"] <= honest * (1 + 1e-6)


def test_merge_mean_is_the_default_path_bit_for_bit():
    tx, default = (compjax.diloco(optax.adam(1e-2), optax.sgd(0.7), 2, "i", **kw)
                   for kw in ({"merge": "mean"}, {}))  # fmt: skip
    args = (
        jax.tree.map(lambda a: a[None], P0),
        jax.vmap(lambda _: default.init(P0))(jnp.arange(1)),
    )

    def run(t):
        def step(p, s):
            u, s = t.update(grads_of(1.0), s, p)
            return optax.apply_updates(p, u), s

        return jax.make_jaxpr(jax.vmap(step, axis_name="i"))(*args)

    assert str(run(tx)) == str(run(default))


def test_compressed_messages_are_decoded_before_the_merge_in_bf16_too():
    comp = compjax.int_quant(8)
    for dtype in (jnp.float32, jnp.bfloat16):
        local, theta = one_round("median_norm_clip", comp, dtype)
        assert all(bool(jnp.isfinite(x).all()) for x in jax.tree.leaves(theta))
        honest = float(jnp.linalg.norm(0.3 * (jnp.cos(P0["w"]) + 0.5)))
        assert float(jnp.linalg.norm(theta["w"] - P0["w"])) <= 1.05 * honest
        assert local["w"].dtype == dtype


def test_the_merged_round_is_counted_as_an_all_gather():
    tx = compjax.diloco(optax.sgd(0.1), optax.sgd(1.0), 1, "i", compressor=compjax.int_quant(8),
                        merge="trimmed_mean")  # fmt: skip
    report = compjax.communication(tx, P0, "i", num_workers=N)
    payloads = [(via, bits) for (kind, via, _), (_, bits) in
                zip(report.routes, report.payloads, strict=True) if kind == "payload"]  # fmt: skip
    # one int8 payload per leaf (4 and 12 entries, plus its float32 scale), all-gathered
    assert payloads == [("all_gather", 8 * 4 + 32), ("all_gather", 8 * 12 + 32)]


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"merge": "median"}, "merge must be one of"),
        ({"merge": "trimmed_mean", "trim": 0.5}, "trim must be a fraction"),
        (
            {"merge": "median_norm_clip", "exchange": "scatter_gather"},
            "exchange must be 'all_gather'",
        ),
    ],
)
def test_bad_merges_are_refused_naming_the_parameter(kw, match):
    with pytest.raises(ValueError, match=match):
        compjax.diloco(optax.sgd(0.1), optax.sgd(1.0), 1, "i", **kw)


def test_merger_names_each_merge_with_weights():
    rng = np.random.default_rng(0)
    stacked = {"a": rng.normal(size=(5, 3)), "b": rng.normal(size=(5, 2, 2))}
    stacked["b"][1] *= 9.0  # worker 1's second leaf far larger: per-leaf clipping differs
    w = jnp.array([1.0, 2.0, 0.0, 1.0, 3.0])

    def same(x, y):
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), x, y)

    same(merges.merger("mean")(stacked, w), merges.mean(stacked, w))
    same(merges.merger("median_norm_clip")(stacked, w),
         merges.median_norm_clip(stacked, w, per_leaf=True))  # fmt: skip
    same(merges.merger("trimmed_mean", 0.2)(stacked, w), merges.trimmed_mean(stacked, 0.2, w))

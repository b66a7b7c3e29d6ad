"""Variance-based compression and Strom's threshold method against step-by-step references.

The references below are written independently in numpy, one worker at a
time, straight from the rules in the docstrings.  Gradients are multiples of
1/4 (with a power-of-two batch and worker count), so every sum is exact in
float32 and the transformation must reproduce the reference to the last bit
(a tolerance is kept only for robustness).  Shapes and transformations are
module constants so that each program compiles once.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from test_transforms import PARAMS, assert_trees_close, run_shard_map

import compjax
from compjax.transforms import variance_based as vbm
from compjax.transforms.padded_sparse import real_bits_sent
from compjax.transforms.strom import strom_threshold
from compjax.transforms.variance_based import per_example_grads, variance_based

N = 8  # workers (8 forced CPU devices under shard_map)
B = 4  # examples per worker
STEPS = 4
ALPHA, ZETA, TAU = 2.0, 0.999, 0.5
F32 = np.float32

VB = variance_based("data", ALPHA, ZETA, budget=0.5)
STROM = strom_threshold("data", TAU, budget=0.5)


def slots(budget, d):
    """Independent restatement of the budget rule."""
    if isinstance(budget, int):
        return min(budget, d)
    return min(d, max(1, round(budget * d)))


def dyadic(rng, shape, drift):
    """Multiples of 1/4: a per-coordinate drift plus unit noise."""
    return (drift + np.round(rng.normal(size=shape) * 4) / 4).astype(F32)


def example_grads(step, n=N, batch=B, scale=1.0):
    """Per-example gradients ``{"b": (n, batch, 3), "w": (n, batch, 5, 3)}``, multiples of 1/4."""
    rng = np.random.default_rng(step)
    out = {}
    for name in sorted(PARAMS):
        shape = PARAMS[name].shape
        d = math.prod(shape)
        drift = (np.round(np.linspace(-1.5, 1.5, d) * 4) / 4).reshape(shape)
        out[name] = F32(scale) * dyadic(rng, (n, batch, *shape), drift)
    return out


def worker_grads(step, n=N):
    """Ordinary gradients ``(n, *shape)`` (the first example of :func:`example_grads`)."""
    return {k: v[:, 0] for k, v in example_grads(step, n).items()}


@functools.cache
def vmapped(tx):
    return jax.jit(jax.vmap(tx.update, axis_name="data"))


def run_steps(tx, grads_steps, n=N):
    """Workers simulated by vmap: worker 0's updates and the stacked state after each step."""
    state = jax.vmap(lambda _: tx.init(PARAMS))(jnp.arange(n))
    outs, states = [], [state]
    for grads in grads_steps:
        upd, state = vmapped(tx)(grads, state)
        outs.append(jax.tree.map(lambda u: np.asarray(u[0]), upd))
        states.append(state)
    return outs, states


def squeeze(tree):
    """A stacked per-worker field ``(n, 1, *shape)`` as numpy ``(n, *shape)``."""
    return jax.tree.map(lambda a: np.asarray(a)[:, 0], tree)


# --- numpy references ---------------------------------------------------------


def vb_message(r, v, alpha, k):
    """One worker's sent values (dense) for accumulated ``r``, ``v`` (1-D float32)."""
    r2 = r * r
    qualify = r2 > F32(alpha) * v
    with np.errstate(divide="ignore", invalid="ignore"):
        score = np.where(v > 0, r2 / v, np.inf)
    chosen = [i for i in np.argsort(-score, kind="stable") if qualify[i]][:k]
    sent = np.zeros_like(r)
    if not chosen:
        return sent
    top = max(abs(float(r[i])) for i in chosen)
    levels = [top * 2.0**-e for e in range(8)]
    for i in chosen:
        a = abs(float(r[i]))
        if a < top * 2.0**-8:
            continue  # nearer to 0 than to the smallest level: kept
        e = min(range(8), key=lambda e, a=a: (abs(a - levels[e]), e))  # ties upwards
        sent[i] = math.copysign(levels[e], float(r[i]))
    return sent


def vb_reference(grads_steps, alpha, zeta, budget, sheet=False):
    """Updates per step, final ``r``, ``v`` (per worker) and real bits, worker by worker.

    ``sheet``: REFERENCES.md's rule instead, as the public PyTorch
    implementation writes it: ``v += mean_b g_b^2`` (no ``1/B``) and
    ``r <- 0`` where sent (the quantisation error dropped).
    """
    n = next(iter(grads_steps[0].values())).shape[0]
    r = {k: np.zeros((n, math.prod(PARAMS[k].shape)), F32) for k in PARAMS}
    v = {k: np.zeros_like(a) for k, a in r.items()}
    bits = 0
    updates = []
    for grads in grads_steps:
        update = {}
        for name, g in grads.items():
            g = np.asarray(g, F32).reshape(n, g.shape[1], -1)
            total = np.zeros(g.shape[2], F32)
            for i in range(n):
                r_acc = r[name][i] + g[i].mean(0)
                v_acc = v[name][i] + (g[i] * g[i]).mean(0) / F32(1 if sheet else g.shape[1])
                sent = vb_message(r_acc, v_acc, alpha, slots(budget, g.shape[2]))
                r[name][i] = np.where(sent != 0, F32(0), r_acc) if sheet else r_acc - sent
                v[name][i] = np.where(sent != 0, F32(0), F32(zeta) * v_acc)
                m = int(np.count_nonzero(sent))
                bits += 36 * m + 32 * (m > 0)
                total += sent
            update[name] = (total / F32(n)).reshape(PARAMS[name].shape)
        updates.append(update)
    shaped = {
        k: {n_: a.reshape(-1, *PARAMS[n_].shape) for n_, a in t.items()}
        for k, t in (("r", r), ("v", v))
    }
    return updates, shaped["r"], shaped["v"], bits


def strom_reference(grads_steps, tau, budget):
    n = next(iter(grads_steps[0].values())).shape[0]
    res = {k: np.zeros((n, math.prod(PARAMS[k].shape)), F32) for k in PARAMS}
    bits = 0
    updates = []
    for grads in grads_steps:
        update = {}
        for name, g in grads.items():
            g = np.asarray(g, F32).reshape(n, -1)
            total = np.zeros(g.shape[1], F32)
            for i in range(n):
                acc = res[name][i] + g[i]
                mag = np.abs(acc)
                order = np.argsort(-mag, kind="stable")
                chosen = [j for j in order if mag[j] > tau][: slots(budget, g.shape[1])]
                sent = np.zeros_like(acc)
                sent[chosen] = np.copysign(F32(tau), acc[chosen])
                res[name][i] = acc - sent
                bits += 33 * len(chosen)
                total += sent
            update[name] = (total / F32(n)).reshape(PARAMS[name].shape)
        updates.append(update)
    return updates, {k: a.reshape(-1, *PARAMS[k].shape) for k, a in res.items()}, bits


# --- variance-based -----------------------------------------------------------


def test_variance_based_matches_reference_under_vmap_and_shard_map():
    grads = [example_grads(t) for t in range(STEPS)]
    ref_updates, ref_r, ref_v, ref_bits = vb_reference(grads, ALPHA, ZETA, 0.5)
    outs, states = run_steps(VB, grads)
    for got, want in zip(outs, ref_updates, strict=True):
        assert_trees_close(got, want, rtol=0, atol=1e-7)
    final = states[-1]
    assert_trees_close(squeeze(final.r), ref_r, rtol=0, atol=1e-7)
    assert_trees_close(squeeze(final.v), ref_v, rtol=1e-7, atol=0)
    assert real_bits_sent(final) == ref_bits
    # Something was sent and something withheld: the test is not vacuous.
    sent = sum(np.count_nonzero(u[k]) for u in ref_updates for k in u)
    assert 0 < sent < STEPS * 18
    mesh = jax.make_mesh((N,), ("data",))
    assert_trees_close(run_shard_map(VB, grads, mesh), ref_updates, rtol=0, atol=1e-7)


def test_variance_based_single_worker_axis_none_matches_reference():
    tx = variance_based(None, ALPHA, ZETA, budget=3)
    grads = [example_grads(t, n=1) for t in range(STEPS)]
    ref_updates, ref_r, _, ref_bits = vb_reference(grads, ALPHA, ZETA, 3)
    step = jax.jit(tx.update)
    state = tx.init(PARAMS)
    for g, want in zip(grads, ref_updates, strict=True):
        upd, state = step(jax.tree.map(lambda a: a[0], g), state)
        assert_trees_close(upd, want, rtol=0, atol=1e-7)
    assert_trees_close(jax.tree.map(np.asarray, state.r), ref_r, rtol=0, atol=1e-7)
    assert real_bits_sent(state) == ref_bits


@pytest.mark.parametrize("scale", [1.0, 3.0])
def test_never_sends_an_ambiguous_coordinate_and_loses_nothing(scale):
    """Sent only where r^2 > alpha v; v reset there, decayed elsewhere; sent + r = accumulated."""
    grads = [example_grads(t, scale=scale) for t in range(6)]
    outs, states = run_steps(VB, grads)
    for t, g in enumerate(grads):
        before, after = states[t], states[t + 1]
        r_prev, v_prev = squeeze(before.r), squeeze(before.v)
        r_new, v_new = squeeze(after.r), squeeze(after.v)
        for name in PARAMS:
            x = np.asarray(g[name])
            r_acc = r_prev[name] + x.mean(1)
            v_acc = v_prev[name] + (x * x).mean(1) / F32(B)
            sent = r_acc - r_new[name]  # exact: multiples of 2^-k of dyadic values
            mask = sent != 0
            assert np.all(r_acc[mask] ** 2 > F32(ALPHA) * v_acc[mask])
            assert np.all(v_new[name][mask] == 0)
            np.testing.assert_array_equal(v_new[name][~mask], F32(ZETA) * v_acc[~mask])
            np.testing.assert_array_equal(r_new[name][~mask], r_acc[~mask])
            np.testing.assert_allclose(sent.mean(0), outs[t][name], rtol=0, atol=1e-6)
    # Nothing lost: sum of updates + mean residual = sum of mean gradients.
    total_sent = {k: sum(o[k] for o in outs) for k in PARAMS}
    residual = {k: a.mean(0) for k, a in squeeze(states[-1].r).items()}
    total = {k: sum(np.asarray(g[k]).mean((0, 1)) for g in grads) for k in PARAMS}
    assert_trees_close(jax.tree.map(np.add, total_sent, residual), total, rtol=1e-6, atol=1e-5)


def test_alpha_is_the_reference_sheet_alpha_times_the_batch_size():
    """``keep_error=False, alpha=a B`` makes the reference sheet's decisions with ``alpha=a``.

    The reference sheet (and the public implementation) accumulate
    ``mean_b g_b^2``; this library ``mean_b g_b^2 / B``.  With ``B`` and
    ``a`` powers of two the scaling is exact, so every update, ``r`` and
    ``B v`` must agree to the last bit.  Fails if ``v`` drops its ``1/B``
    (then ``a B`` is ``B`` times too strict) or if ``keep_error=False``
    keeps the quantisation error.
    """
    grads = [example_grads(t) for t in range(STEPS)]
    want_updates, want_r, want_v, _ = vb_reference(grads, ALPHA, ZETA, 1.0, sheet=True)
    tx = variance_based("data", ALPHA * B, ZETA, budget=1.0, keep_error=False)
    outs, states = run_steps(tx, grads)
    for got, want in zip(outs, want_updates, strict=True):
        assert_trees_close(got, want, rtol=0, atol=0)
    final = states[-1]
    assert_trees_close(squeeze(final.r), want_r, rtol=0, atol=0)
    assert_trees_close(jax.tree.map(lambda v: v * F32(B), squeeze(final.v)), want_v, rtol=0, atol=0)
    # Both outcomes occur: some coordinates were reset, some kept accumulating.
    flat_r = np.concatenate([want_r[k].ravel() for k in PARAMS])
    assert 0 < np.count_nonzero(flat_r == 0) < flat_r.size


@pytest.mark.parametrize("batch", [16, 64])
def test_pure_noise_is_sent_at_the_chi2_rate_whatever_the_batch_size(batch):
    """``v`` estimates the variance of ``r``: noise passes ``r^2 > alpha v`` at a B-free rate.

    One step of i.i.d. N(0, 1) per-example gradients: ``r^2 / v =
    B Z^2 / (Z^2 + chi^2_{B-1})``, i.e. ``B Beta(1/2, (B-1)/2)``, about
    ``chi^2_1`` (0.164 and 0.159 of the coordinates pass at ``alpha = 2``,
    ``B = 16, 64``).  A ``v`` without the ``1/B`` would pass none
    (``r^2 <= B v`` by Cauchy-Schwarz).
    """
    from scipy import stats

    d, alpha = 4096, 2.0
    tx = variance_based(None, alpha, ZETA, budget=1.0)
    g = np.random.default_rng(batch).normal(size=(batch, d)).astype(F32)
    _, state = jax.jit(tx.update)({"w": g}, tx.init({"w": np.zeros(d, F32)}))
    rate = np.mean(np.asarray(state.v["w"]) == 0)  # v is reset exactly where sent
    want = stats.beta.sf(alpha / batch, 0.5, (batch - 1) / 2)
    assert abs(rate - want) < 4 * math.sqrt(want * (1 - want) / d)


def test_criterion_is_invariant_to_rescaling_the_gradients():
    grads = [example_grads(t) for t in range(3)]
    doubled = [jax.tree.map(lambda a: 2 * a, g) for g in grads]
    outs, _ = run_steps(VB, grads)
    outs2, _ = run_steps(VB, doubled)
    for a, b in zip(outs, outs2, strict=True):
        assert_trees_close(jax.tree.map(lambda x: 2 * x, a), b, rtol=0, atol=0)


def test_non_finite_input_gives_nan_and_keeps_the_accumulators():
    grads = [example_grads(t) for t in range(2)]
    grads[1]["w"][3, 1, 2, 0] = np.nan  # one example of one worker
    outs, states = run_steps(VB, grads)
    assert all(np.isnan(u).all() for u in jax.tree.leaves(outs[1]))
    assert_trees_close(squeeze(states[2].r), squeeze(states[1].r), rtol=0, atol=0)
    assert_trees_close(squeeze(states[2].v), squeeze(states[1].v), rtol=0, atol=0)


@pytest.mark.parametrize("tx", [VB, STROM], ids=["variance_based", "strom"])
def test_non_finite_step_keeps_the_bit_counter(tx):
    grads = [example_grads(t) for t in range(2)]
    grads[1]["w"][3, 0, 2, 0] = np.nan  # the first example: also Strom's gradient
    if tx is STROM:
        grads = [{k: v[:, 0] for k, v in g.items()} for g in grads]
    _, states = run_steps(tx, grads)
    assert real_bits_sent(states[1]) > 0
    assert real_bits_sent(states[2]) == real_bits_sent(states[1])
    np.testing.assert_array_equal(states[2].bits_sent, states[1].bits_sent)


def test_gradients_near_the_float32_limit_keep_the_accumulators_finite():
    """Squares above 3.4e38 saturate v; the batch mean of 3e38 and 2e38 does not overflow."""
    tx = variance_based(None, ALPHA, ZETA, budget=1.0)
    g = {"x": jnp.array([[3e38, 1e20, -2.0], [2e38, 1e20, 2.0]], jnp.float32)}
    upd, state = single(tx)(g, tx.init({"x": jnp.zeros(3)}))
    assert np.all(np.isfinite(state.v["x"])) and np.all(np.isfinite(state.r["x"]))
    # Saturated at the float32 maximum (not Inf), then decayed: nothing was sent.
    assert state.v["x"][0, 0] == np.float32(ZETA) * np.finfo(np.float32).max
    # Exactly, r^2 / v is 1.92 and 2 for coordinates 0 and 1: not above alpha = 2, so they
    # wait; coordinate 2 has mean 0.  Nothing is sent and nothing is lost.
    np.testing.assert_array_equal(upd["x"], [0, 0, 0])
    np.testing.assert_array_equal(state.r["x"][0], np.array([2.5e38, 1e20, 0], np.float32))


@functools.cache
def single(tx):
    return jax.jit(tx.update)


def test_budget_overflow_sends_the_largest_ratio_and_keeps_the_rest():
    # Per coordinate: r = mean, v = mean(g^2)/4; r^2/v = 3.77, 3.2, 2 (= alpha: not
    # sent), 4, and 0/0 (not sent).
    x = np.array([[1, 3, 1, -2, 0], [1, 1, 0, -2, 0], [1, 3, 1, -2, 0], [0.5, 1, 0, -2, 0]], F32)
    tx = variance_based(None, ALPHA, ZETA, budget=1)
    state = tx.init({"x": jnp.zeros(5)})
    upd, state = single(tx)({"x": x}, state)
    np.testing.assert_array_equal(upd["x"], [0, 0, 0, -2, 0])
    v_acc = (x * x).mean(0) / F32(4)
    np.testing.assert_array_equal(state.r["x"][0], [0.875, 2, 0.5, 0, 0])
    np.testing.assert_array_equal(state.v["x"][0], np.where([0, 0, 0, 1, 0], 0, F32(ZETA) * v_acc))
    # No new gradient: the decayed variance now lets coordinate 2 qualify too,
    # and the largest ratio (coordinate 0) goes first.
    upd, state = single(tx)({"x": np.zeros_like(x)}, state)
    np.testing.assert_array_equal(upd["x"], [0.875, 0, 0, 0, 0])
    assert real_bits_sent(state) == 2 * (36 + 32)
    # A budget of every entry: all three qualifying coordinates, scale 2.
    tx = variance_based(None, ALPHA, ZETA, budget=1.0)
    upd, state = single(tx)({"x": x}, tx.init({"x": jnp.zeros(5)}))
    np.testing.assert_array_equal(upd["x"], [1, 2, 0, -2, 0])  # 0.875 -> 1
    np.testing.assert_array_equal(state.r["x"][0], [-0.125, 0, 0.5, 0, 0])
    assert real_bits_sent(state) == 3 * 36 + 32


def test_wire_format_of_the_quantised_values():
    r = np.array([1.0, -0.5, 0.74, 0.76, -(2.0**-7), 0.003, 2.0**-8, 0.375, 0.3749], F32)
    # alpha = 0.5 with one example: every nonzero entry qualifies (r^2 > r^2/2).
    payload, _, q, _ = jax.jit(vbm._vb_encode, static_argnums=(2, 3))(
        jnp.asarray(r), jnp.asarray(r * r), 0.5, 9
    )
    expected = [1.0, -0.5, 0.5, 1.0, -(2.0**-7), 0.0, 2.0**-7, 0.5, 0.25]
    np.testing.assert_array_equal(q, expected)
    np.testing.assert_array_equal(payload.wire["indices"], [0, 1, 2, 3, 4, 9, 6, 7, 8])
    # codes 8*sign + k: 0, 9, 1, 0, 15, (unused) 0, 7, 1, 2; eight to a uint32 word, the first
    # in the lowest nibble
    np.testing.assert_array_equal(payload.wire["codes"], [0x170F0190, 0x2])
    assert payload.wire["scale"] == 1.0
    assert compjax.wire_bits(payload) == 32 * 9 + 32 * 2 + 32
    # Through the transformation: decoded values, kept residuals.
    tx = variance_based(None, 0.5, ZETA, budget=1.0)
    upd, state = jax.jit(tx.update)({"x": r[None]}, tx.init({"x": jnp.zeros(9)}))
    np.testing.assert_array_equal(upd["x"], expected)
    np.testing.assert_array_equal(state.r["x"][0], r - np.asarray(expected, F32))
    assert state.v["x"][0][5] == F32(ZETA) * (r[5] * r[5])


def test_flatten_sends_one_message_and_loses_nothing():
    tx = variance_based("data", ALPHA, ZETA, budget=0.5, flatten=True)
    grads = [example_grads(t) for t in range(3)]
    outs, states = run_steps(tx, grads)
    report = compjax.communication(with_batch_axis(tx), PARAMS, "data", 2)
    k = slots(0.5, 18)
    assert report.messages == (("flag", 8), ("payload", 32 * k + 32 * math.ceil(k / 8) + 32))
    flat = states[-1].r[:, 0].mean(0)  # the flattened residual: b then w
    residual = {"b": flat[:3], "w": flat[3:].reshape(5, 3)}
    total = {k: sum(np.asarray(g[k]).mean((0, 1)) for g in grads) for k in PARAMS}
    sent = {k: sum(o[k] for o in outs) for k in PARAMS}
    assert_trees_close(jax.tree.map(np.add, sent, residual), total, rtol=1e-6, atol=1e-5)


def with_batch_axis(tx):
    """``tx`` fed param-shaped gradients as a batch of one (for compjax.communication)."""

    def update(updates, state, params=None):
        return tx.update(jax.tree.map(lambda g: g[None], updates), state, params)

    return optax.GradientTransformation(tx.init, update)


def test_padded_bits_are_counted_from_the_payloads():
    report = compjax.communication(with_batch_axis(VB), PARAMS, "data", 2)
    expected = [
        ("payload", 32 * k + 32 * math.ceil(k / 8) + 32) for k in (slots(0.5, 3), slots(0.5, 15))
    ]
    assert report.messages == (("flag", 8), *expected)  # leaves in order b, w
    report = compjax.communication(STROM, PARAMS, "data", 2)
    expected = [("payload", 32 * k + 32 * math.ceil(k / 32)) for k in (2, 8)]
    assert report.messages == (("flag", 8), *expected)


def test_per_example_grads():
    def loss(p, x, y):
        return jnp.mean((x @ p["w"] + p["b"] - y) ** 2)

    kx, ky = jax.random.split(jax.random.key(0))
    x, y = jax.random.normal(kx, (B, 5)), jax.random.normal(ky, (B, 3))
    grads = jax.jit(per_example_grads, static_argnums=0)(loss, PARAMS, x, y)
    assert jax.tree.map(jnp.shape, grads) == {"w": (B, 5, 3), "b": (B, 3)}
    for b in range(B):
        one = jax.grad(loss)(PARAMS, x[b : b + 1], y[b : b + 1])
        assert_trees_close(jax.tree.map(lambda g, b=b: g[b], grads), one)
    mean = jax.tree.map(lambda g: g.mean(0), grads)
    assert_trees_close(mean, jax.grad(loss)(PARAMS, x, y), rtol=1e-5, atol=1e-6)


def test_updates_without_a_batch_axis_are_rejected():
    tx = variance_based(None)
    with pytest.raises(ValueError, match="per-example"):
        tx.update(PARAMS, tx.init(PARAMS))  # leading sizes 3 and 5
    with pytest.raises(ValueError, match="state field 'r'"):
        tx.update({"w": jnp.ones((2, 5, 4)), "b": jnp.ones((2, 3))}, tx.init(PARAMS))


# --- Strom ---------------------------------------------------------------------


def test_strom_matches_reference_under_vmap_and_shard_map():
    grads = [worker_grads(t) for t in range(STEPS)]
    ref_updates, ref_res, ref_bits = strom_reference(grads, TAU, 0.5)
    outs, states = run_steps(STROM, grads)
    for got, want in zip(outs, ref_updates, strict=True):
        assert_trees_close(got, want, rtol=0, atol=1e-7)
    assert_trees_close(squeeze(states[-1].residual), ref_res, rtol=0, atol=1e-7)
    assert real_bits_sent(states[-1]) == ref_bits > 0
    mesh = jax.make_mesh((N,), ("data",))
    assert_trees_close(run_shard_map(STROM, grads, mesh), ref_updates, rtol=0, atol=1e-7)


def test_strom_sends_plus_minus_tau_and_keeps_the_residual():
    rng = np.random.default_rng(5)
    grads = [
        {k: rng.normal(size=(N, *PARAMS[k].shape)).astype(F32) for k in PARAMS} for _ in range(5)
    ]
    outs, states = run_steps(STROM, grads)
    for t, g in enumerate(grads):
        before, after = squeeze(states[t].residual), squeeze(states[t + 1].residual)
        bits = real_bits_sent(states[t + 1]) - real_bits_sent(states[t])
        count = 0
        for name in PARAMS:
            acc = before[name] + g[name]
            sent = acc - after[name]
            mask = ~np.isclose(sent, 0, atol=1e-6)
            np.testing.assert_allclose(np.abs(sent[mask]), TAU, rtol=1e-6)
            assert np.all(np.sign(sent[mask]) == np.sign(acc[mask]))
            assert np.all(np.abs(acc[mask]) > TAU)
            count += int(mask.sum())
            np.testing.assert_allclose(sent.mean(0), outs[t][name], atol=1e-6)
        assert bits == 33 * count
    total_sent = {k: sum(o[k] for o in outs) for k in PARAMS}
    residual = {k: a.mean(0) for k, a in squeeze(states[-1].residual).items()}
    total = {k: sum(g[k].mean(0) for g in grads) for k in PARAMS}
    assert_trees_close(jax.tree.map(np.add, total_sent, residual), total, rtol=1e-6, atol=1e-5)


def test_strom_budget_overflow_sends_the_largest():
    tx = strom_threshold(None, TAU, budget=2)
    g = {"x": np.array([0.6, -2.0, 1.5, 0.2], F32)}
    upd, state = single(tx)(g, tx.init({"x": jnp.zeros(4)}))
    np.testing.assert_array_equal(upd["x"], [0, -0.5, 0.5, 0])
    np.testing.assert_array_equal(state.residual["x"][0], np.array([0.6, -1.5, 1.0, 0.2], F32))
    assert real_bits_sent(state) == 2 * 33


def test_strom_flatten_agrees_with_per_leaf_when_the_budget_is_not_binding():
    grads = [worker_grads(t) for t in range(2)]
    per_leaf, _ = run_steps(strom_threshold("data", TAU, budget=1.0), grads)
    flat, _ = run_steps(strom_threshold("data", TAU, budget=1.0, flatten=True), grads)
    for a, b in zip(per_leaf, flat, strict=True):
        assert_trees_close(a, b, rtol=0, atol=0)


def test_scalar_and_empty_leaves():
    params = {"e": jnp.zeros((0,)), "s": jnp.zeros(()), "x": jnp.zeros(4)}
    g = {"e": jnp.zeros((0,)), "s": jnp.float32(1.0), "x": jnp.array([1.0, -1.0, 0.2, 0.0])}
    tx = strom_threshold(None, TAU, budget=1.0)
    upd, _ = jax.jit(tx.update)(g, tx.init(params))
    assert jax.tree.map(jnp.shape, upd) == jax.tree.map(jnp.shape, params)
    np.testing.assert_array_equal(upd["x"], [0.5, -0.5, 0, 0])
    tx = variance_based(None, 0.5, budget=1.0)
    upd, _ = jax.jit(tx.update)(jax.tree.map(lambda a: a[None], g), tx.init(params))
    assert jax.tree.map(jnp.shape, upd) == jax.tree.map(jnp.shape, params)
    np.testing.assert_array_equal(upd["x"], [1.0, -1.0, 0.25, 0])
    assert upd["s"] == 1.0


# --- parameters ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("make", "name"),
    [
        (lambda: variance_based("data", alpha=0.0), "alpha"),
        (lambda: variance_based("data", alpha=-1.0), "alpha"),
        (lambda: variance_based("data", alpha=float("nan")), "alpha"),
        (lambda: variance_based("data", alpha=float("inf")), "alpha"),
        (lambda: variance_based("data", alpha="2"), "alpha"),
        (lambda: variance_based("data", alpha=True), "alpha"),
        (lambda: variance_based("data", zeta=0.0), "zeta"),
        (lambda: variance_based("data", zeta=1.5), "zeta"),
        (lambda: variance_based("data", zeta=-0.1), "zeta"),
        (lambda: variance_based("data", zeta=float("nan")), "zeta"),
        (lambda: variance_based("data", budget=0), "budget"),
        (lambda: variance_based("data", budget=-3), "budget"),
        (lambda: variance_based("data", budget=0.0), "budget"),
        (lambda: variance_based("data", budget=1.5), "budget"),
        (lambda: variance_based("data", budget=True), "budget"),
        (lambda: variance_based("data", budget=None), "budget"),
        (lambda: strom_threshold("data", 0.0), "tau"),
        (lambda: strom_threshold("data", -0.5), "tau"),
        (lambda: strom_threshold("data", float("inf")), "tau"),
        (lambda: strom_threshold("data", None), "tau"),
        (lambda: strom_threshold("data", 1.0, budget=0), "budget"),
        (lambda: strom_threshold("data", 1.0, budget=2.0), "budget"),
    ],
)
def test_bad_parameters_raise_naming_the_parameter(make, name):
    with pytest.raises(ValueError, match=name):
        make()


def test_unbound_axis_name_is_named():
    for tx, g in ((VB, example_grads(0, n=2)), (STROM, worker_grads(0, n=2))):
        state = jax.vmap(lambda _, tx=tx: tx.init(PARAMS))(jnp.arange(2))
        with pytest.raises(ValueError, match="axis_name 'data' is not bound"):
            jax.vmap(tx.update, axis_name="batch")(g, state)

"""DeMo against a numpy transcription of the paper's algorithm (scipy's DCT, argpartition
top-k per chunk, every worker's message combined, sign); the chunked DCT against scipy; wire
bits, zeros, non-finite input, bf16 and the arguments."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import scipy.fft
from helpers import run_vmap
from jax.sharding import NamedSharding

import compjax
from compjax import dct

P = jax.P
CHUNK, TOPK, DECAY = 4, 2, 0.9
# A matrix (4 x 2 chunks), a vector (chunks of 3), a 3-D leaf (as a 6 x 8 matrix).
PARAMS = {"w": jnp.zeros((12, 10)), "b": jnp.zeros(30), "k": jnp.zeros((2, 3, 8))}
STEPS = 4
#: One leaf for the checks that are not about the layout (one compile each).
SMALL = {"w": jnp.zeros((12, 10))}


def worker_grads(step, n, params=PARAMS):
    """Gradients with a leading worker axis, different per worker and step."""
    key = jax.random.fold_in(jax.random.key(11), step)
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(key, len(leaves))
    out = [jax.random.normal(k, (n, *p.shape)) for k, p in zip(keys, leaves, strict=True)]
    return jax.tree.unflatten(treedef, out)


# -- the reference: numpy, float64, written from the paper --------------------------------------


def divisor(n, target):
    return max(d for d in range(1, min(n, target) + 1) if n % d == 0)


def reference(grads, chunk, topk, decay, sign):
    """DeMo on one leaf: ``grads[t]`` has shape ``(n, *shape)``.

    Returns:
      (updates per step, decoded (pre-sign) per step, final deltas ``(n, *shape)``).
    """
    n, *shape = grads[0].shape
    rows, cols = (
        (1, 1)
        if not shape
        else (1, shape[0])
        if len(shape) == 1
        else (
            int(np.prod(shape[:-1])),
            shape[-1],
        )
    )
    h, w = divisor(rows, chunk), divisor(cols, chunk)
    k = min(topk, h * w)

    def to_coeffs(x):  # (R, C) -> (chunks, h w)
        c = scipy.fft.dctn(x.reshape(rows // h, h, cols // w, w), axes=(1, 3), norm="ortho")
        return c.transpose(0, 2, 1, 3).reshape(-1, h * w)

    def from_coeffs(c):
        c = c.reshape(rows // h, cols // w, h, w).transpose(0, 2, 1, 3)
        return scipy.fft.idctn(c, axes=(1, 3), norm="ortho").reshape(rows, cols)

    delta = np.zeros((n, rows, cols))
    updates, decoded = [], []
    for g in grads:
        g = np.asarray(g, np.float64).reshape(n, rows, cols)
        sums = np.zeros(((rows // h) * (cols // w), h * w))
        counts = np.zeros_like(sums)
        for i in range(n):
            delta[i] = decay * delta[i] + g[i]
            c = to_coeffs(delta[i])
            idx = np.argpartition(-np.abs(c), k - 1, axis=1)[:, :k]
            vals = np.take_along_axis(c, idx, axis=1)
            sent = np.zeros_like(c)
            np.put_along_axis(sent, idx, vals, axis=1)
            delta[i] -= from_coeffs(sent)
            sums += sent
            np.put_along_axis(counts, idx, np.take_along_axis(counts, idx, 1) + 1, axis=1)
        if sign:  # the reference's scatter "mean" over the contributors
            q = from_coeffs(np.where(counts > 0, sums / np.maximum(counts, 1), 0.0))
            updates.append(np.sign(q).reshape(shape))
        else:
            q = from_coeffs(sums / n)
            updates.append(q.reshape(shape))
        decoded.append(q.reshape(shape))
    return updates, decoded, delta.reshape(n, *shape)


def assert_signs_match(got, want_sign, decoded):
    """Signs equal wherever the decoded value is not within rounding of zero."""
    clear = np.abs(decoded) > 1e-5 * max(np.abs(decoded).max(), 1e-30)
    np.testing.assert_array_equal(np.asarray(got, np.float64)[clear], want_sign[clear])
    assert clear.mean() > 0.99


# -- the chunked DCT ------------------------------------------------------------------------


@pytest.mark.parametrize("c", [1, 2, 5, 8, 64])
def test_dct_matrix_is_scipys_orthonormal_dct(c):
    basis = dct.dct_matrix(c)
    np.testing.assert_allclose(basis, scipy.fft.dct(np.eye(c), norm="ortho", axis=0), atol=1e-12)
    np.testing.assert_allclose(basis @ basis.T, np.eye(c), atol=1e-12)


def test_chunk_size_is_the_largest_divisor_at_most_the_target():
    cases = {(64, 64): 64, (128, 64): 64, (100, 64): 50, (97, 64): 1, (30, 4): 3, (1, 64): 1}
    for (n, target), want in cases.items():
        assert dct.chunk_size(n, target) == want == divisor(n, target)
    with pytest.raises(ValueError, match="chunk_size"):
        dct.chunk_size(0, 4)


@pytest.mark.parametrize("shape", [(12, 10), (8, 64), (7, 9), (30,), (97,), (1,)])
def test_chunked_dct_is_scipys_per_chunk_and_inverts(shape):
    x = np.random.default_rng(0).normal(size=shape)
    got = np.asarray(dct.chunked_dct(jnp.asarray(x, jnp.float32), 4))
    if len(shape) == 1:
        h = divisor(shape[0], 4)
        want = scipy.fft.dct(x.reshape(-1, h), norm="ortho", axis=1)
    else:
        h, w = divisor(shape[0], 4), divisor(shape[1], 4)
        blocks = x.reshape(shape[0] // h, h, shape[1] // w, w).transpose(0, 2, 1, 3)
        want = scipy.fft.dctn(blocks, axes=(2, 3), norm="ortho")
    np.testing.assert_allclose(got, want, atol=1e-5)
    back = dct.chunked_idct(jnp.asarray(got))
    np.testing.assert_allclose(np.asarray(back), x, atol=1e-5)


# -- DeMo against the reference -------------------------------------------------------------


def test_shard_map_on_4_workers_is_the_reference():
    n = 4
    params = {"w": PARAMS["w"], "k": PARAMS["k"]}
    tx = compjax.scale_by_demo("data", chunk=CHUNK, topk=TOPK, decay=DECAY)
    specs = compjax.state_specs(jax.eval_shape(tx.init, params), "data")
    assert specs.delta == {"w": P("data"), "k": P("data")}
    mesh = jax.make_mesh((n,), ("data",), devices=jax.devices()[:n])
    state = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs))(params)
    step = jax.jit(
        jax.shard_map(tx.update, mesh=mesh, in_specs=(P("data"), specs), out_specs=(P(), specs))
    )
    grads = [worker_grads(t, n, params) for t in range(STEPS)]
    ref = {
        name: reference([g[name] for g in grads], CHUNK, TOPK, DECAY, sign=True) for name in params
    }
    for t, g in enumerate(grads):
        flat = jax.tree.map(
            lambda a: jax.device_put(a.reshape(-1, *a.shape[2:]), NamedSharding(mesh, P("data"))),
            g,
        )
        upd, state = step(flat, state)
        for name, (updates, decoded, _) in ref.items():
            assert_signs_match(upd[name], updates[t], decoded[t])
    assert state.delta["w"].sharding.spec[0] == "data"
    for name, (_, _, delta) in ref.items():
        got = np.asarray(state.delta[name]).reshape(delta.shape)
        np.testing.assert_allclose(got, delta, rtol=1e-4, atol=1e-5)
        assert np.abs(delta).max() > 0.1  # the unsent components stay


def test_plain_mean_and_a_scalar_on_3_vmapped_workers_is_the_reference():
    n = 3
    params = {"b": PARAMS["b"], "s": jnp.zeros(())}
    tx = compjax.scale_by_demo("data", chunk=CHUNK, topk=TOPK, decay=DECAY, sign=False)
    grads = [worker_grads(t, n, params) for t in range(STEPS)]
    outs, states, _ = run_vmap(tx, grads, n, params)
    for name in params:
        updates, _, delta = reference([g[name] for g in grads], CHUNK, TOPK, DECAY, sign=False)
        for t in range(STEPS):
            for i in range(n):  # every worker applies the same update
                np.testing.assert_allclose(outs[t][name][i], updates[t], rtol=1e-4, atol=1e-5)
        got = np.asarray(states[-1].delta[name]).reshape(delta.shape)
        np.testing.assert_allclose(got, delta, rtol=1e-4, atol=1e-5)
    # A scalar is one chunk of one entry, always sent: its momentum is empty.
    np.testing.assert_allclose(np.asarray(states[-1].delta["s"]), 0.0, atol=1e-6)


# -- bits, zeros, non-finite input, bf16, arguments -----------------------------------------


def test_bits_recorded_are_the_payload():
    params = {
        "big": jnp.zeros((128, 192)),  # 64 x 64 chunks: uint16 indices, 6 chunks
        "small": jnp.zeros((3, 5)),  # one 3 x 5 chunk, all 15 sent: uint8
        "half": jnp.zeros(100, jnp.bfloat16),  # chunks of 50, bf16 values
    }
    report = compjax.communication(compjax.scale_by_demo("data"), params, "data", 4)
    want = 8 + 6 * 32 * (16 + 32) + 15 * (8 + 32) + 2 * 32 * (8 + 16)  # the flag, then payloads
    assert report.payload_bits == want
    assert report.bits_per_worker == 8 * 2 * 3 / 4 + 3 * (want - 8)  # ring all-reduce, all-gather
    assert [kind for kind, _ in report.messages] == ["flag", "payload", "payload", "payload"]
    assert {via for _, via, _ in report.routes[1:]} == {"all_gather"}
    tx = compjax.scale_by_demo(None)
    payload_bits = report.payload_bits - 8
    assert compjax.communication(tx, params, None).payload_bits == payload_bits + 8


def test_zero_gradients_give_zero_updates_and_keep_delta_zero():
    n = 2
    opt = compjax.demo(0.1, "data", weight_decay=0.1, chunk=CHUNK, topk=TOPK)
    zeros = jax.tree.map(lambda p: jnp.zeros((n, *p.shape)), SMALL)
    state = jax.vmap(lambda _: opt.init(SMALL))(jnp.arange(n))
    run = jax.jit(jax.vmap(opt.update, axis_name="data"))
    for _ in range(2):
        upd, state = run(zeros, state, zeros)
    for a in jax.tree.leaves((upd, state)):
        if jnp.issubdtype(a.dtype, jnp.floating):
            np.testing.assert_array_equal(np.asarray(a), 0.0)


def test_an_empty_leaf_sends_nothing_and_leaves_the_others_alone():
    """A zero-size leaf passes through (its update and momentum empty, in their dtypes), and
    the other leaf's updates and momentum are those of a run without it."""
    n = 2
    tx = compjax.scale_by_demo("data", chunk=CHUNK, topk=TOPK, decay=DECAY)
    grads = [worker_grads(t, n, SMALL) for t in range(2)]
    empty = jnp.zeros((n, 0, 3))
    outs, states, _ = run_vmap(tx, [{**g, "z": empty} for g in grads], n, {**SMALL, "z": empty[0]})
    alone, alone_states, _ = run_vmap(tx, grads, n, SMALL)
    assert (outs[-1]["z"].shape, outs[-1]["z"].dtype) == ((n, 0, 3), jnp.float32)
    delta = states[-1].delta["z"]  # per-worker: a leading axis of 1 in each worker's state
    assert (delta.shape, delta.dtype) == ((n, 1, 0, 3), jnp.float32)
    for got, want in zip(outs, alone, strict=True):
        np.testing.assert_array_equal(np.asarray(got["w"]), np.asarray(want["w"]))
    np.testing.assert_allclose(
        np.asarray(states[-1].delta["w"]), np.asarray(alone_states[-1].delta["w"]), rtol=1e-6
    )
    assert np.abs(np.asarray(states[-1].delta["w"])).max() > 0.1  # something stayed unsent


def test_non_finite_gradient_keeps_the_state():
    n = 2
    tx = compjax.scale_by_demo("data", chunk=CHUNK, topk=TOPK, decay=DECAY)
    _, states, run = run_vmap(tx, [worker_grads(0, n, SMALL)], n, SMALL)
    for bad_value in (jnp.nan, jnp.inf):
        bad = {"w": worker_grads(1, n, SMALL)["w"].at[1, 0].set(bad_value)}
        upd, state = run(bad, states[-1])
        assert all(bool(jnp.all(jnp.isnan(u))) for u in jax.tree.leaves(upd))
        for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(states[-1]), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.slow  # test_hostile (make test-slow) also sends 3e38 through both factories
def test_huge_finite_gradients_saturate_instead_of_overflowing():
    n = 2
    top = float(np.finfo(np.float32).max)
    grads = {"w": jnp.full((n, 12, 10), top).at[1].set(-top)}
    for sign in (True, False):
        tx = compjax.scale_by_demo("data", chunk=CHUNK, topk=TOPK, sign=sign)
        outs, states, _ = run_vmap(tx, [grads, grads], n, SMALL)
        for a in jax.tree.leaves((outs, states[-1])):
            assert np.all(np.isfinite(np.asarray(a)))


def test_bfloat16_gradients_keep_a_float32_delta():
    n = 2
    params = {"w": jnp.zeros((12, 10), jnp.bfloat16)}
    grads = [
        jax.tree.map(lambda g: g.astype(jnp.bfloat16), worker_grads(t, n, params))
        for t in range(STEPS)
    ]
    tx = compjax.scale_by_demo("data", chunk=CHUNK, topk=TOPK, decay=DECAY)
    outs, states, _ = run_vmap(tx, grads, n, params)
    assert {a.dtype for a in jax.tree.leaves(states[-1])} == {jnp.dtype(jnp.float32)}
    assert {a.dtype for a in jax.tree.leaves(outs[-1])} == {jnp.dtype(jnp.bfloat16)}
    for name in params:  # the values travel in bf16: close to the float64 reference, not equal
        updates, _, delta = reference([g[name] for g in grads], CHUNK, TOPK, DECAY, sign=True)
        agree = np.mean(np.asarray(outs[-1][name][0], np.float64) == updates[-1])
        assert agree > 0.85, (name, agree)
        got = np.asarray(states[-1].delta[name]).reshape(delta.shape)
        np.testing.assert_allclose(got, delta, atol=0.1)


def test_bad_arguments_are_refused():
    for kwargs in (
        {"chunk": 0},
        {"chunk": 2.5},
        {"topk": 0},
        {"topk": True},
        {"decay": 1.0},
        {"decay": -0.1},
        {"state_dtype": jnp.int32},
    ):
        with pytest.raises(ValueError, match=next(iter(kwargs))):
            compjax.scale_by_demo("data", **kwargs)
    with pytest.raises(ValueError, match="weight_decay"):
        compjax.demo(0.1, "data", weight_decay=-1.0)


def test_demo_is_sign_sgd_with_decoupled_weight_decay_and_a_schedule():
    """``p <- p (1 - lr_t wd) - lr_t sign(decoded)``, the learning rate and decay injected."""
    n, wd = 2, 0.5
    opt = optax.inject_hyperparams(compjax.demo, static_args=("axis_name", "chunk", "topk"))(
        learning_rate=optax.linear_schedule(0.1, 0.0, 4),
        axis_name="data",
        weight_decay=wd,
        chunk=CHUNK,
        topk=TOPK,
        decay=DECAY,
    )
    params = {"w": jnp.linspace(-1.0, 1.0, 120).reshape(12, 10)}
    stacked = jax.tree.map(lambda p: jnp.stack([p] * n), params)
    state = jax.vmap(lambda _: opt.init(params))(jnp.arange(n))
    run = jax.jit(jax.vmap(opt.update, axis_name="data"))
    grads = [worker_grads(t, n, params) for t in range(2)]
    signs, decoded, _ = reference([g["w"] for g in grads], CHUNK, TOPK, DECAY, sign=True)
    for t, g in enumerate(grads):
        upd, state = run(g, state, stacked)
        lr = 0.1 * (1 - t / 4)
        direction = -np.asarray(upd["w"][0], np.float64) / lr - wd * np.asarray(params["w"])
        assert_signs_match(np.round(direction, 4), signs[t], decoded[t])

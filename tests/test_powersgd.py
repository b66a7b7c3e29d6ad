"""PowerSGD: a step-by-step numpy reference, error feedback, warm start, start_iter, bits."""

import warnings

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from test_transforms import assert_trees_close

import compjax
from compjax.transforms.powersgd import LayoutWarning, orthogonalize

P = jax.P
PARAMS = {"w": jnp.zeros((16, 12)), "b": jnp.zeros(12), "k": jnp.zeros((3, 3, 2, 8))}
N = 4


def grads_at(step, n=N):
    rng = np.random.default_rng([7, step])
    return {k: rng.standard_normal((n, *v.shape)).astype(np.float32) for k, v in PARAMS.items()}


def run(tx, steps, n=N):
    state = jax.vmap(lambda _: tx.init(PARAMS))(jnp.arange(n))
    step = jax.jit(jax.vmap(tx.update, axis_name="data"))
    outs = []
    for t in range(steps):
        upd, state = step(grads_at(t, n), state)
        outs.append(jax.tree.map(lambda u: np.asarray(u[0]), upd))
    return outs, state


def gram_schmidt(m):
    m = m.copy()
    for i in range(m.shape[1]):
        for j in range(i):
            m[:, i] -= (m[:, j] @ m[:, i]) * m[:, j]
        m[:, i] /= np.linalg.norm(m[:, i])
    return m


def reference(q0, steps, rank, start_iter=0, n=N, error_feedback=True):
    """PowerSGD written plainly (numpy, float64) for the compressible leaves."""
    shapes = {"w": (16, 12), "k": (18, 8)}  # a flax conv kernel: (kh kw cin) x cout
    q = {k: np.asarray(q0[k], np.float64) for k in shapes}
    err = {k: np.zeros((n, *s)) for k, s in shapes.items()}
    outs = []
    for t in range(steps):
        g = grads_at(t, n)
        out = {"b": g["b"].mean(0)}
        for k, (rows, cols) in shapes.items():
            gi = g[k].reshape(n, rows, cols).astype(np.float64)
            if t < start_iter:
                out[k] = gi.mean(0).reshape(PARAMS[k].shape)
                continue
            m = gi + err[k]
            p = gram_schmidt(sum(m[i] @ q[k] for i in range(n)))
            q[k] = sum(m[i].T @ p for i in range(n)) / n
            approx = p @ q[k].T
            err[k] = m - approx if error_feedback else 0.0 * m
            out[k] = approx.reshape(PARAMS[k].shape)
        outs.append(out)
    return outs, err


@pytest.mark.parametrize(
    "start_iter,error_feedback",
    [(0, True), pytest.param(2, True, marks=pytest.mark.slow), (0, False)],
    ids=["ef", "start2", "no_ef"],
)
def test_matches_reference(start_iter, error_feedback):
    tx = compjax.powersgd(2, "data", start_iter=start_iter, error_feedback=error_feedback)
    outs, state = run(tx, 4)
    q0 = dict(zip(sorted(PARAMS), tx.init(PARAMS).q, strict=True))
    expect, err = reference(q0, 4, 2, start_iter, error_feedback=error_feedback)
    for got, want in zip(outs, expect, strict=True):
        assert_trees_close(got, want, rtol=1e-4, atol=1e-5)
    errors = state.error
    np.testing.assert_allclose(errors["w"][:, 0], err["w"], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(errors["k"][:, 0].reshape(N, 18, 8), err["k"], rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(errors["b"], 0.0)  # sent uncompressed, no memory


def test_shard_map_agrees_with_vmap():
    tx = compjax.powersgd(2, "data")
    simulated, _ = run(tx, 3, n=8)
    mesh = jax.make_mesh((8,), ("data",))
    specs = compjax.state_specs(jax.eval_shape(tx.init, PARAMS), "data")
    state = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs))(PARAMS)
    step = jax.jit(
        jax.shard_map(tx.update, mesh=mesh, in_specs=(P("data"), specs), out_specs=(P(), specs))
    )
    for t in range(3):
        g = {
            k: jax.device_put(v.reshape(-1, *v.shape[2:]), NamedSharding(mesh, P("data")))
            for k, v in grads_at(t, 8).items()
        }
        upd, state = step(g, state)
        assert_trees_close(upd, simulated[t], rtol=1e-4, atol=1e-5)


def test_error_feedback_identity_and_warm_start():
    tx = compjax.powersgd(1, None)
    state = tx.init(PARAMS)
    g = jax.tree.map(lambda v: jnp.asarray(v[0]), grads_at(0, 1))
    upd, new = jax.jit(tx.update)(g, state)
    # M = g + e_old = update + e_new exactly (up to rounding), for compressed leaves.
    np.testing.assert_allclose(upd["w"] + new.error["w"][0], g["w"], rtol=1e-5, atol=1e-6)
    # Warm start: the next P is computed from this step's Q.
    q = new.q[sorted(PARAMS).index("w")]
    m = g["w"] + new.error["w"][0]
    p = orthogonalize(m @ q)
    _, newer = jax.jit(tx.update)(g, new)
    np.testing.assert_allclose(newer.q[sorted(PARAMS).index("w")], m.T @ p, rtol=1e-4, atol=1e-5)


def test_exact_when_rank_covers_the_gradient():
    rng = np.random.default_rng(0)
    low = (rng.standard_normal((16, 2)) @ rng.standard_normal((2, 12))).astype(np.float32)
    tx = compjax.powersgd(2, None)
    g = {"w": jnp.asarray(low), "b": jnp.ones(12), "k": jnp.zeros((3, 3, 2, 8))}
    upd, state = tx.update(g, tx.init(PARAMS))
    np.testing.assert_allclose(upd["w"], low, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(state.error["w"], 0.0, atol=1e-4)


def test_shared_initial_q_is_orthonormal():
    q = compjax.powersgd(3, "data", seed=5).init(PARAMS).q
    assert q[sorted(PARAMS).index("b")] is None  # 1-D: sent uncompressed, no Q
    for m in q:
        if m is not None:
            np.testing.assert_allclose(m.T @ m, np.eye(m.shape[1]), atol=1e-5)


def test_every_matrixs_factors_travel_together():
    """The compiled step's all-reduces, outside the branches taken only on overflow: the
    uncompressed leaves, every ``P`` and every ``Q`` (each in one message) and the
    finiteness flag, whatever the number of matrices.  Sent matrix by matrix, each ``Q``
    waited for its ``P`` and the next ``P`` for it: 2 round trips per matrix."""
    params = {**PARAMS, "v": jnp.zeros((10, 6)), "u": jnp.zeros((6, 14))}  # 4 matrices
    tx = compjax.powersgd(2, "data")
    mesh = jax.make_mesh((8,), ("data",))
    specs = compjax.state_specs(jax.eval_shape(tx.init, params), "data")
    init = jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs)
    state = jax.eval_shape(init, params)
    step = jax.shard_map(tx.update, mesh=mesh, in_specs=(P("data"), specs), out_specs=(P(), specs))
    grads = {
        k: jax.ShapeDtypeStruct(
            (8 * v.shape[0], *v.shape[1:]), v.dtype, sharding=NamedSharding(mesh, P("data"))
        )
        for k, v in params.items()
    }
    hlo = jax.jit(step).lower(grads, state).compile().as_text()
    entry = hlo[hlo.index("\nENTRY") :]
    entry = entry[: entry.index("\n}")]
    assert 2 <= entry.count(" all-reduce(") <= 4  # dense and P (XLA may join them), Q, flag


def test_bits_per_worker():
    report = compjax.communication(compjax.powersgd(2, "data"), PARAMS, num_workers=2)
    expect = 32 * 2 * (16 + 12) + 32 * 2 * (18 + 8) + 32 * 12 + 8  # P and Q, dense b, flag
    assert report.bits_per_worker == expect
    # The warm-up all-reduce is not the steady state and is not counted.
    delayed = compjax.communication(
        compjax.powersgd(2, "data", start_iter=3), PARAMS, num_workers=2
    )
    assert delayed.bits_per_worker == expect


def test_no_matrix_sends_no_factor_messages():
    """Leaves all sent dense: one message of their means and the flag, no empty P or Q."""
    report = compjax.communication(compjax.powersgd(2, "data"), {"b": PARAMS["b"]}, num_workers=2)
    assert [kind for kind, _ in report.messages] == ["flag", "dense"]


def test_kernel_layouts_put_output_channels_on_one_side():
    flax_kernel = {"k": jnp.zeros((3, 3, 16, 32))}  # (kh, kw, cin, cout): (144) x 32
    torch_kernel = {"k": jnp.zeros((32, 16, 3, 3))}  # (cout, cin, kh, kw): 32 x (144)
    flax_bits = compjax.communication(compjax.powersgd(4, "data"), flax_kernel, num_workers=2)
    flax_bits = flax_bits.payload_bits
    torch_tx = compjax.powersgd(4, "data", channels_last=False)
    torch_bits = compjax.communication(torch_tx, torch_kernel, num_workers=2).payload_bits
    assert flax_bits == torch_bits == 32 * 4 * (144 + 32) + 8
    # read in the wrong layout the kernel is a 3 x 1536 matrix, not worth compressing at rank 4
    with pytest.warns(LayoutWarning, match=r"\(3, 3, 16, 32\).* 3 x 1536 .*compressible 144 x 32"):
        wrong = compjax.communication(
            compjax.powersgd(4, "data", channels_last=False), flax_kernel, num_workers=2
        )
    assert wrong.bits_per_worker == 32 * flax_kernel["k"].size + 8


def test_kernels_in_the_other_layout_warn_at_init():
    """PyTorch's (cout, cin, kh, kw) read channels-last is a thin (cout cin kh) x kw matrix,
    sent dense: init warns, naming the kernel; kernels in their own layout, thin kernels that
    no layout compresses and matrices do not warn."""
    torch_conv = jnp.zeros((64, 64, 1, 1))  # channels last: 4096 x 1, dense; else 64 x 64
    with pytest.warns(LayoutWarning, match=r"\(64, 64, 1, 1\).*4096 x 1.*channels_last=False"):
        compjax.powersgd(4, "data").init({"k": torch_conv})
    fine = {
        "flax": jnp.zeros((1, 1, 64, 64)),
        "torch": torch_conv,
        "thin": jnp.zeros((3, 3, 64, 3)),  # 576 x 3 or 3 x 576: dense either way
        "matrix": jnp.zeros((3, 4096)),
    }
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        compjax.powersgd(4, "data").init({k: v for k, v in fine.items() if k != "torch"})
        compjax.powersgd(4, "data", channels_last=False).init({"k": torch_conv})


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"rank": 0}, "rank"),
        ({"rank": 1, "start_iter": -1}, "start_iter"),
        ({"rank": 1, "min_compression_rate": 0.5}, "min_compression_rate"),
        ({"rank": 1, "orthogonalization_epsilon": -1.0}, "orthogonalization_epsilon"),
    ],
)
def test_bad_parameters(kwargs, name):
    with pytest.raises(ValueError, match=name):
        compjax.powersgd(axis_name="data", **kwargs)


def _eqns(jaxpr, skip=("cond",)):
    """Every equation of ``jaxpr`` and of the jitted calls in it, not inside a ``cond``."""
    for eqn in jaxpr.eqns:
        yield eqn
        if eqn.primitive.name in skip:
            continue
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            yield from _eqns(sub, skip)


def test_update_never_materialises_the_product_or_rereads_the_state():
    """``P Q^T`` is an elementwise expression fused into the update and the new memory, not
    a matrix product, and the guard reads each matrix once (the input's check): the memory
    saturates, so its finiteness is known without a pass over it."""
    tx = compjax.powersgd(2, "data")
    g = jax.tree.map(lambda v: jnp.asarray(v[0]), grads_at(0, 1))
    jaxpr = jax.make_jaxpr(tx.update, axis_env=[("data", 2)])(g, tx.init(PARAMS)).jaxpr
    sizes = {PARAMS["w"].size, PARAMS["k"].size}  # the compressed leaves

    def out_size(eqn):
        return max(int(np.prod(v.aval.shape)) for v in eqn.outvars)

    eqns = list(_eqns(jaxpr))
    assert not [e for e in eqns if e.primitive.name == "dot_general" and out_size(e) in sizes]
    full_reductions = [
        e
        for e in eqns
        if e.primitive.name.startswith("reduce_") and int(np.prod(e.invars[0].aval.shape)) in sizes
    ]
    assert len(full_reductions) == len(sizes)  # one finiteness sum per matrix: its input's


def test_memory_saturates_where_it_would_overflow():
    """A float16 memory whose residual passes 65504 saturates there: the step is taken
    (finite updates) and the memory stays finite.  Before, the overflow refused the step,
    and every step after it."""
    tx = compjax.powersgd(1, None, min_compression_rate=1.0, state_dtype="float16")
    rng = np.random.default_rng(3)
    g = {"w": jnp.asarray(rng.standard_normal((16, 12)) * 1e5, jnp.float32)}
    state = tx.init(g)
    for _ in range(2):
        upd, state = jax.jit(tx.update)(g, state)
        assert np.all(np.isfinite(upd["w"]))
        err = np.asarray(state.error["w"], np.float32)
        assert np.all(np.isfinite(err)) and np.max(np.abs(err)) == 65504.0

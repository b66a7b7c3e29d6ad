"""compjax.fsdp on leaves with no dimension divisible by the workers: padded shards.

A (13, 7) kernel has no dimension divisible by 4 or 8; it is split along its 13 rows,
padded with zero rows to 16 (PyTorch FSDP2's uneven shards), and the padding never reaches
the loss, the returned params' own shapes (``unpad``), the optimizer state or a restore.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

import compjax

P = jax.P
#: A kernel of 91 entries (split, padded) and a bias of 7 (under MIN_SIZE: replicated).
W0 = {"w": jnp.linspace(-0.3, 0.3, 91).reshape(13, 7), "b": jnp.linspace(0.0, 0.1, 7)}
MIN_SIZE = 64
LR = 0.05
SGD_LR = 0.5


def loss(p, x, y):
    return jnp.mean((jnp.tanh(x @ p["w"]) + p["b"] - y) ** 2)


def batch(t):
    """24 rows: whole parts for 3, 4 and 8 workers."""
    x = jax.random.normal(jax.random.key(2 * t), (24, 13))
    y = jax.random.normal(jax.random.key(2 * t + 1), (24, 7))
    return x, y


def pooled_adam(steps, params=W0):
    """Replicated data-parallel Adam on the pooled batch (one device, no compjax)."""
    opt = optax.adam(LR)
    state = opt.init(params)
    for t in range(steps):
        updates, state = opt.update(jax.grad(loss)(params, *batch(t)), state, params)
        params = optax.apply_updates(params, updates)
    return params


def mesh_of(n):
    return jax.make_mesh((n,), ("data",), devices=jax.devices()[:n])


@pytest.mark.parametrize("n", [4, 8])
def test_a_padded_leaf_trains_as_pooled_adam_and_its_padding_stays_zero(n):
    mesh = mesh_of(n)
    fs = compjax.fsdp(loss, optax.adam(LR), W0, mesh, min_size=MIN_SIZE)
    assert fs.param_specs == {"w": P("data", None), "b": P()}
    params, state = W0, fs.init(W0)
    for t in range(3):
        params, state, value = fs.step(params, state, *batch(t))
        assert np.isfinite(float(value))
    rows = -(-13 // n)  # each worker owns ceil(13 / n) rows
    assert params["w"].shape == (16, 7) and params["w"].sharding.spec == P("data", None)
    assert params["w"].addressable_shards[0].data.shape == (rows, 7)
    mu, nu = state.opt_state[0].mu["w"], state.opt_state[0].nu["w"]
    for stored in (params["w"], mu, nu):  # the padding rows: zero params, zero moments
        assert np.all(np.asarray(stored)[13:] == 0)
    assert np.abs(np.asarray(mu)[:13]).min() > 0
    own = fs.unpad(params)
    assert own["w"].shape == (13, 7) and own["b"].shape == (7,)
    want = pooled_adam(3)
    for k in W0:
        np.testing.assert_allclose(own[k], want[k], atol=2e-6)
    # memory per device: 1/n of the padded kernel (the padding included) and of its moments
    leaves = jax.tree.leaves((params, state.opt_state))
    per_device = sum(leaf.addressable_shards[0].data.nbytes for leaf in leaves)
    assert per_device == 3 * rows * 7 * 4 + 3 * 7 * 4 + 4
    # traffic: the padded shards gathered, the padded kernel reduce-scattered
    report = compjax.communication(fs, W0, mesh=mesh)
    assert report.gather_bits == (n - 1) * rows * 7 * 32
    flag = 2 * (n - 1) / n * 8
    assert report.gradient_bits == (n - 1) / n * 16 * 7 * 32 + 2 * (n - 1) / n * 7 * 32 + flag
    assert report.dense_bits == 2 * (n - 1) / n * 98 * 32  # the unpadded gradient


def test_the_step_takes_own_or_stored_shapes_and_refuses_others():
    mesh = mesh_of(8)
    fs = compjax.fsdp(loss, optax.adam(LR), W0, mesh, min_size=MIN_SIZE)
    stored = fs.shard(W0)
    assert stored["w"].shape == (16, 7) and np.all(np.asarray(stored["w"])[13:] == 0)
    np.testing.assert_array_equal(fs.unpad(stored)["w"], W0["w"])
    state = fs.init(W0)
    a = fs.step(W0, state, *batch(0))
    b = fs.step(stored, state, *batch(0))
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    with pytest.raises(ValueError, match=r"params: a leaf of shape \(14, 7\)"):
        fs.step({"w": jnp.zeros((14, 7)), "b": W0["b"]}, state, *batch(0))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_a_padded_half_precision_leaf_follows_float32_pooled_sgd(dtype):
    """bfloat16 and float16 params (gradients summed in their dtype): SGD with steps of ~0.05
    per entry lands within a few of the dtype's ulps of float32 SGD on the pooled batch."""
    mesh = mesh_of(8)
    w0 = jax.tree.map(lambda a: a.astype(dtype), W0)
    fs = compjax.fsdp(loss, optax.sgd(SGD_LR), w0, mesh, min_size=MIN_SIZE)
    params, state = w0, fs.init(w0)
    for t in range(2):
        params, state, _ = fs.step(params, state, *batch(t))
    assert params["w"].dtype == dtype and np.all(np.asarray(params["w"])[13:] == 0)
    want = jax.tree.map(lambda a: a.astype(jnp.float32), w0)
    for t in range(2):
        want = jax.tree.map(lambda p, g: p - SGD_LR * g, want, jax.grad(loss)(want, *batch(t)))
    got = np.asarray(fs.unpad(params)["w"].astype(jnp.float32))
    moved = np.abs(np.asarray(want["w"]) - np.asarray(w0["w"], np.float32)).max()
    error = np.abs(got - np.asarray(want["w"])).max()
    assert moved > 0.05
    assert error < 4 * float(jnp.finfo(dtype).eps), (error, moved)


def test_sign_decodes_on_the_padding_never_reach_params_state_or_memories():
    """A scaled sign decodes a zero as +-scale: the padding's decodes are set to zero, so
    the padding rows of the params, Adam's moments and the error memories stay zero."""
    mesh = mesh_of(8)
    fs = compjax.fsdp(
        loss,
        optax.adam(LR),
        W0,
        mesh,
        min_size=MIN_SIZE,
        compressor=compjax.scaled_sign(),
        feedback="ef",
    )
    params, state = W0, fs.init(W0)
    for t in range(2):
        params, state, _ = fs.step(params, state, *batch(t))
    memory = np.asarray(state.memory[0])
    assert memory.shape == (8, 16, 7)
    assert np.abs(memory[:, :13]).max() > 0 and np.all(memory[:, 13:] == 0)
    for stored in (params["w"], state.opt_state[0].mu["w"], state.opt_state[0].nu["w"]):
        assert np.all(np.asarray(stored)[13:] == 0)


def test_a_padded_leaf_on_a_hosts_local_mesh_is_pooled_adam():
    mesh = jax.make_mesh((2, 4), ("hosts", "local"))
    fs = compjax.fsdp(
        loss, optax.adam(LR), W0, mesh, axis_name=("hosts", "local"), min_size=MIN_SIZE
    )
    assert fs.param_specs["w"] == P(("local", "hosts"), None)
    params, state = W0, fs.init(W0)
    for t in range(2):
        params, state, _ = fs.step(params, state, *batch(t))
    want = pooled_adam(2)
    np.testing.assert_allclose(fs.unpad(params)["w"], want["w"], atol=2e-6)
    report = compjax.communication(fs, W0, ("hosts", "local"), mesh=mesh)
    assert report.slow_gather_bits == 1 * 2 * 7 * 32  # one 2-row shard over hosts
    assert report.fast_gather_bits == 3 * 4 * 7 * 32  # three 4-row secondary shards


def test_sign_decodes_on_a_hosts_local_mesh_keep_the_padding_zero():
    """On (2, 4) each worker's memory holds its host's 1/4 of the padded kernel (4 of 16 rows):
    the padding (rows 13-15) is rows 1-3 of local index 3's memories (workers 6 and 7 in the
    local-major order)."""
    mesh = jax.make_mesh((2, 4), ("hosts", "local"))
    fs = compjax.fsdp(
        loss,
        optax.adam(LR),
        W0,
        mesh,
        axis_name=("hosts", "local"),
        min_size=MIN_SIZE,
        compressor=compjax.scaled_sign(),
        feedback="ef",
    )
    params, state = W0, fs.init(W0)
    for t in range(2):
        params, state, _ = fs.step(params, state, *batch(t))
    memory = np.asarray(state.memory[0])
    assert memory.shape == (8, 4, 7)
    assert np.all(memory[6:, 1:] == 0) and np.abs(memory[6:, 0]).min() > 0
    assert np.abs(memory[:6]).min() > 0
    for stored in (params["w"], state.opt_state[0].mu["w"], state.opt_state[0].nu["w"]):
        assert np.all(np.asarray(stored)[13:] == 0) and np.abs(np.asarray(stored)[:13]).min() > 0


def test_restore_onto_another_worker_count_pads_or_truncates_the_zero_rows(tmp_path):
    """Saved from 8 workers (16 stored rows), restored onto 3 (15 rows: orbax's
    ``strict=False`` drops a padding row): the 3-worker step continues the 8-worker one up to
    float32 summation order."""
    fs8 = compjax.fsdp(loss, optax.adam(LR), W0, mesh_of(8), min_size=MIN_SIZE)
    params, state = W0, fs8.init(W0)
    for t in range(2):
        params, state, _ = fs8.step(params, state, *batch(t))
    ckptr = ocp.StandardCheckpointer()
    ckptr.save(tmp_path / "ckpt", {"params": params, "state": state})
    ckptr.wait_until_finished()
    fs3 = compjax.fsdp(loss, optax.adam(LR), W0, mesh_of(3), min_size=MIN_SIZE)
    target = {"params": fs3.shard(W0), "state": fs3.init(W0)}
    target = jax.tree.map(ocp.utils.to_shape_dtype_struct, target)
    with pytest.raises(ValueError, match="shape"):  # the stored shapes differ: 16 and 15 rows
        ckptr.restore(tmp_path / "ckpt", target)
    restored = ckptr.restore(tmp_path / "ckpt", target, strict=False)
    assert restored["params"]["w"].shape == (15, 7)
    assert restored["params"]["w"].addressable_shards[0].data.shape == (5, 7)
    a = fs8.step(params, state, *batch(2))
    b = fs3.step(restored["params"], restored["state"], *batch(2))
    np.testing.assert_allclose(fs8.unpad(a[0])["w"], fs3.unpad(b[0])["w"], atol=1e-6)
    np.testing.assert_allclose(a[2], b[2], rtol=1e-5)


def test_restore_with_error_feedback_onto_another_worker_count(tmp_path):
    """docs/fsdp.md's recipe: the params and Adam's moments carry over from 8 workers to 4;
    the error memories (one per worker) restart from a fresh ``init``'s zeros."""
    ef = dict(compressor=compjax.top_k(ratio=0.25), feedback="ef", min_size=MIN_SIZE)
    fs8 = compjax.fsdp(loss, optax.adam(LR), W0, mesh_of(8), **ef)
    params, state = W0, fs8.init(W0)
    for t in range(2):
        params, state, _ = fs8.step(params, state, *batch(t))
    ckptr = ocp.StandardCheckpointer()
    ckptr.save(tmp_path / "ckpt", {"params": params, "state": state})
    ckptr.wait_until_finished()

    fs4 = compjax.fsdp(loss, optax.adam(LR), W0, mesh_of(4), **ef)
    fresh = fs4.init(W0)
    target = {"params": fs4.shard(W0), "state": fresh}
    target = jax.tree.map(ocp.utils.to_shape_dtype_struct, target)
    restored = ckptr.restore(tmp_path / "ckpt", target, strict=False)
    params4 = restored["params"]
    state4 = restored["state"]._replace(memory=fresh.memory)  # one memory per worker: zeros

    assert np.abs(np.asarray(state.memory[0])).max() > 0
    assert state4.memory[0].shape == (4, 16, 7) and not np.asarray(state4.memory[0]).any()
    np.testing.assert_array_equal(fs4.unpad(params4)["w"], fs8.unpad(params)["w"])
    for old, new in zip(
        jax.tree.leaves(state.opt_state), jax.tree.leaves(state4.opt_state), strict=True
    ):
        np.testing.assert_array_equal(np.asarray(old), np.asarray(new))
    # the next step is the 8-worker recipe on 4 workers from zero memories
    ref = fs8.step(params, state._replace(memory=fs8.init(W0).memory), *batch(2))[2]
    _, after, value = fs4.step(params4, state4, *batch(2))
    np.testing.assert_allclose(value, ref, rtol=1e-5)
    assert np.abs(np.asarray(after.memory[0])).max() > 0

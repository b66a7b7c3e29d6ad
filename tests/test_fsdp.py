"""compjax.fsdp: sharded parameters and optimizer state, a compressed gradient reduce-scatter."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from jax.sharding import AxisType, NamedSharding

import compjax
from compjax.steps.fsdp_layout import padded_shape, shard_dim
from compjax.steps.param_gather import dequantize_blocks, quantize_blocks

P = jax.P
N = 8
#: A kernel split over the workers (96 entries, rows divisible by 8) and a bias left replicated.
W0 = {"w": jnp.linspace(-0.3, 0.3, 96).reshape(16, 6), "b": jnp.linspace(0.0, 0.1, 6)}
MIN_SIZE = 64
LR = 0.05


def loss(p, x, y):
    return jnp.mean((jnp.tanh(x @ p["w"]) + p["b"] - y) ** 2)


def batch(t):
    x = jax.random.normal(jax.random.key(2 * t), (32, 16))
    y = jax.random.normal(jax.random.key(2 * t + 1), (32, 6))
    return x, y


def pooled_adam(steps):
    """Replicated data-parallel Adam on the pooled batch (one device, no compjax)."""
    opt = optax.adam(LR)
    params, state = W0, opt.init(W0)
    for t in range(steps):
        updates, state = opt.update(jax.grad(loss)(params, *batch(t)), state, params)
        params = optax.apply_updates(params, updates)
    return params


@pytest.fixture(scope="module")
def lossless():
    mesh = jax.make_mesh((N,), ("data",))
    return mesh, compjax.fsdp(loss, optax.adam(LR), W0, mesh, min_size=MIN_SIZE)


@pytest.fixture(scope="module")
def trained(lossless):
    _, fs = lossless
    params, state = W0, fs.init(W0)
    for t in range(3):
        params, state, value = fs.step(params, state, *batch(t))
    return params, state, value


def test_layout_splits_the_largest_divisible_dimension_pads_others_replicates_small_leaves():
    assert shard_dim((16, 6), 8, 64) == 0
    assert shard_dim((6, 16), 8, 64) == 1
    assert shard_dim((24, 16), 8, 64) == 0  # both divisible: the largest
    assert shard_dim((16, 16), 8, 64) == 0  # a tie: the first
    assert shard_dim((9, 10), 8, 64) == 1  # none divisible: the largest, padded
    assert padded_shape((9, 10), 1, 8) == (9, 16)
    assert shard_dim((13, 7), 8, 64) == 0 and padded_shape((13, 7), 0, 4) == (16, 7)
    assert shard_dim((8, 7), 8, 64) is None  # too small
    assert shard_dim((), 8, 1) is None
    assert shard_dim((16, 6), 1, 1) is None  # one worker splits nothing
    specs = compjax.fsdp_specs({"w": W0["w"], "b": W0["b"]}, N, "data", MIN_SIZE)
    assert specs == {"w": P("data", None), "b": P()}


def test_lossless_adam_is_data_parallel_adam_on_the_pooled_batch(lossless, trained):
    _, fs = lossless
    params, state, value = trained
    assert fs.param_specs == {"w": P("data", None), "b": P()}
    assert params["w"].sharding.spec == P("data", None)
    assert state.opt_state[0].mu["w"].sharding.spec == P("data", None)
    assert state.opt_state[0].count.sharding.spec == P()
    assert np.isfinite(float(value))
    want = pooled_adam(3)
    for k in W0:
        np.testing.assert_allclose(params[k], want[k], atol=2e-6)


def test_each_device_holds_one_nth_of_params_and_optimizer_state(trained):
    params, state, _ = trained
    leaves = jax.tree.leaves((params, state.opt_state))
    per_device = sum(leaf.addressable_shards[0].data.nbytes for leaf in leaves)
    replicated = sum(leaf.nbytes for leaf in leaves)
    # w, mu_w, nu_w split 8 ways; b, mu_b, nu_b and the step count replicated.
    assert per_device == 3 * 96 * 4 // N + 3 * 6 * 4 + 4
    assert replicated == 3 * 96 * 4 + 3 * 6 * 4 + 4
    assert per_device < 0.2 * replicated


def test_orbax_round_trip_of_the_sharded_state_continues_bit_identically(lossless, tmp_path):
    _, fs = lossless
    params, state = W0, fs.init(W0)
    params, state, _ = fs.step(params, state, *batch(0))
    ckptr = ocp.StandardCheckpointer()
    ckptr.save(tmp_path / "ckpt", {"params": params, "state": state})
    ckptr.wait_until_finished()
    target = jax.tree.map(ocp.utils.to_shape_dtype_struct, {"params": params, "state": state})
    restored = ckptr.restore(tmp_path / "ckpt", target)
    assert restored["params"]["w"].sharding.spec == P("data", None)
    assert restored["state"].opt_state[0].nu["w"].sharding.spec == P("data", None)
    a = fs.step(params, state, *batch(1))
    b = fs.step(restored["params"], restored["state"], *batch(1))
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_orbax_restores_the_sharded_state_onto_a_smaller_mesh(lossless, trained, tmp_path):
    """Saved from 8 workers, restored onto 4 (each leaf resharded by orbax to the 4-worker
    layout): the next lossless step is the 8-worker one up to float32 summation order.
    (A ``feedback`` memory has one row per worker and does not carry over.)"""
    _, fs8 = lossless
    params, state, _ = trained
    ckptr = ocp.StandardCheckpointer()
    ckptr.save(tmp_path / "ckpt", {"params": params, "state": state})
    ckptr.wait_until_finished()
    mesh4 = jax.make_mesh((4,), ("data",), devices=jax.devices()[:4])
    fs4 = compjax.fsdp(loss, optax.adam(LR), W0, mesh4, min_size=MIN_SIZE)
    target = jax.tree.map(
        lambda x, spec: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh4, spec)),
        {"params": params, "state": state},
        {"params": fs4.param_specs, "state": fs4.specs},
    )
    restored = ckptr.restore(tmp_path / "ckpt", target)
    assert restored["params"]["w"].addressable_shards[0].data.shape == (4, 6)
    assert restored["state"].opt_state[0].mu["w"].sharding.mesh.size == 4
    a = fs8.step(params, state, *batch(3))
    b = fs4.step(restored["params"], restored["state"], *batch(3))
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-6)


def test_lossless_on_a_data_model_mesh_is_pooled_adam():
    """On a (data, model) mesh the shards are split over "data" and replicated over "model";
    the kernel is stored transposed, so its second dimension is the one split.  The mesh's
    axes are automatic (the 8-worker tests use the default, explicit sharding)."""
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    transposed = lambda p, x, y: loss({"w": p["w"].T, "b": p["b"]}, x, y)  # noqa: E731
    w0 = {"w": W0["w"].T, "b": W0["b"]}
    fs = compjax.fsdp(transposed, optax.adam(LR), w0, mesh, min_size=MIN_SIZE)
    params, state = w0, fs.init(w0)
    for t in range(2):
        params, state, _ = fs.step(params, state, *batch(t))
    assert params["w"].sharding.spec == P(None, "data")
    assert params["w"].addressable_shards[0].data.shape == (6, 4)
    assert state.opt_state[0].mu["w"].sharding.spec == P(None, "data")
    want = pooled_adam(2)
    np.testing.assert_allclose(params["w"].T, want["w"], atol=2e-6)
    np.testing.assert_allclose(params["b"], want["b"], atol=2e-6)


# -- a lossy step: top-k with error feedback on the reduce-scatter, int8 weights gathered --
TOPK = compjax.top_k(ratio=0.25)
BLOCK = 8


@pytest.fixture(scope="module")
def lossy():
    mesh = jax.make_mesh((N,), ("data",))
    opt = optax.adam(LR)
    fs = compjax.fsdp(
        loss,
        opt,
        W0,
        mesh,
        compressor=TOPK,
        feedback="ef",
        gather="int8",
        gather_block=BLOCK,
        min_size=MIN_SIZE,
    )
    return fs, opt


def worker_grads(params, x, y):
    """Each worker's kernel gradient on its 4 rows of the batch, stacked (one device)."""
    rows = lambda a: a.reshape(N, 4, *a.shape[1:])  # noqa: E731
    return jax.vmap(lambda a, b: jax.grad(loss)(params, a, b)["w"])(rows(x), rows(y))


def blockwise_top_k(g):
    """``TOPK`` applied to each owner's block (2 rows of the kernel) of each worker's ``g``."""
    blocks = g.reshape(-1, 12)
    sent = jax.vmap(lambda b: TOPK.decompress(TOPK.compress(None, b)))(blocks)
    return sent.reshape(g.shape)


@functools.partial(jax.jit, static_argnums=2)
def reference_lossy_step(params, memories, opt, opt_state, x, y):
    """The same step written out on one device: int8 shards decoded, each worker's gradient
    plus its memory cut into 8 blocks (block j: rows 2j, 2j + 1 of the kernel) and top-k
    compressed block by block, block j averaged over workers for its owner, the bias averaged
    exactly, Adam applied to the exact params."""
    decode = lambda s: dequantize_blocks(*quantize_blocks(s, BLOCK), s.shape, s.dtype)  # noqa: E731
    seen = {"w": jax.vmap(decode)(params["w"].reshape(N, 2, 6)).reshape(16, 6), "b": params["b"]}
    rows = lambda a: a.reshape(N, 4, *a.shape[1:])  # noqa: E731
    grads = jax.vmap(lambda a, b: jax.grad(loss)(seen, a, b))(rows(x), rows(y))
    target = grads["w"] + memories
    sent = blockwise_top_k(target)
    mean = {"w": jnp.mean(sent, 0), "b": jnp.mean(grads["b"], 0)}
    updates, opt_state = opt.update(mean, opt_state, params)
    return optax.apply_updates(params, updates), target - sent, opt_state, sent, grads["w"]


def test_lossy_step_is_the_explicit_reference_and_keeps_sent_plus_memory(lossy):
    fs, opt = lossy
    assert fs.specs.memory == (P("data"),)  # one memory, for the split kernel
    params, state = W0, fs.init(W0)
    ref_params, ref_memories, ref_state = W0, np.zeros((N, 16, 6), np.float32), opt.init(W0)
    for t in range(2):
        x, y = batch(t)
        old = np.asarray(state.memory[0])
        params, state, _ = fs.step(params, state, x, y)
        ref_params, ref_memories, ref_state, sent, grads = reference_lossy_step(
            ref_params, ref_memories, opt, ref_state, x, y
        )
        new = np.asarray(state.memory[0])
        assert np.abs(new).max() > 0  # top-k left a residual
        for i in range(N):  # error feedback: sent + new memory = gradient + old memory
            np.testing.assert_allclose(sent[i] + new[i], grads[i] + old[i], atol=1e-6)
        np.testing.assert_allclose(new, ref_memories, atol=1e-6)
        for k in W0:
            np.testing.assert_allclose(params[k], ref_params[k], atol=1e-6)


def test_a_non_finite_gradient_is_skipped_poisoning_neither_memory_nor_params(lossy):
    fs, _ = lossy
    params, state = W0, fs.init(W0)
    params, state, _ = fs.step(params, state, *batch(0))
    x, y = batch(1)
    x = x.at[13, 2].set(jnp.nan)  # worker 3's part of the batch
    new_params, new_state, value = fs.step(params, state, x, y)
    assert not np.isfinite(float(value))
    assert np.abs(np.asarray(state.memory[0])).max() > 0
    # every worker skipped the step: params, Adam's moments and the memories unchanged
    old, new = jax.tree.leaves((params, state)), jax.tree.leaves((new_params, new_state))
    for a, b in zip(old, new, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    after, _, _ = fs.step(new_params, new_state, *batch(2))
    assert all(np.isfinite(np.asarray(a)).all() for a in jax.tree.leaves(after))


def test_ef21_owners_hold_the_mean_estimate_moved_by_compressed_differences():
    mesh = jax.make_mesh((N,), ("data",))
    fs = compjax.fsdp(
        loss, optax.sgd(LR), W0, mesh, compressor=TOPK, feedback="ef21", min_size=MIN_SIZE
    )
    assert fs.specs.memory == (P("data"),) and fs.specs.shift == (P("data", None),)
    reference = jax.jit(lambda p, x, y, old: old + blockwise_top_k(worker_grads(p, x, y) - old))
    params, state = W0, fs.init(W0)
    for t in range(2):
        old = np.asarray(state.memory[0])
        expected = reference(jax.tree.map(np.asarray, params), *batch(t), old)
        new_params, state, _ = fs.step(params, state, *batch(t))
        new, shift = np.asarray(state.memory[0]), np.asarray(state.shift[0])
        assert np.abs(new - old).max() > 0
        # g_i <- g_i + C(grad_i - g_i), on each owner's block
        np.testing.assert_allclose(new, expected, atol=1e-6)
        # the owners' shift is the mean of the workers' estimates, and SGD steps along it
        np.testing.assert_allclose(shift, new.mean(0), atol=1e-6)
        np.testing.assert_allclose(new_params["w"], params["w"] - LR * shift, atol=1e-6)
        params = new_params


def test_int8_weight_gather_is_within_half_a_step_of_each_block():
    x = (
        jax.random.normal(jax.random.key(3), (5, 13))
        * jnp.array([1e-3, 1.0, 30.0, 0.0, 1e4])[:, None]
    )
    codes, steps = quantize_blocks(x, 16)
    assert codes.dtype == jnp.int8 and codes.shape == (5, 16) and steps.shape == (5,)
    back = dequantize_blocks(codes, steps, x.shape, x.dtype)
    err = np.pad(np.abs(np.asarray(back - x)).reshape(-1), (0, 80 - 65)).reshape(5, 16)
    bound = np.asarray(steps)[:, None] / 2
    assert np.all(err <= bound * (1 + 1e-5))
    assert np.all(err[np.asarray(steps) == 0] == 0)  # a zero block decodes exactly
    top = np.abs(np.pad(np.asarray(x).reshape(-1), (0, 15)).reshape(5, 16)).max(1)
    np.testing.assert_allclose(steps, top / 127, rtol=1e-6)


def reduce_scattered(comp, x):
    """Every worker's block of ``compressed_reduce_scatter`` over 8 workers, and their own decodes
    (``x`` holds one row per worker)."""
    mesh = jax.make_mesh((N,), ("data",))

    def local(rows):
        out = compjax.compressed_reduce_scatter(comp, jax.random.key(7), rows[0], "data")
        return out.mean[None], out.local[None]

    f = jax.shard_map(local, mesh=mesh, in_specs=P("data"), out_specs=(P("data"), P("data")))
    return jax.jit(f)(jax.device_put(x, NamedSharding(mesh, P("data"))))


def test_summable_reduce_scatter_is_the_mean_within_one_step_of_the_shared_grid():
    """int_quant: integer codes on one grid (step max|x| / 7 over all workers) summed by a
    reduce-scatter; each worker gets the mean of its block within one step."""
    x = jax.random.normal(jax.random.key(5), (N, 40))
    blocks, own = reduce_scattered(compjax.int_quant(4), x)
    assert blocks.shape == (N, 5)
    step = float(jnp.abs(x).max()) / 7
    assert np.abs(np.asarray(blocks).reshape(-1) - np.asarray(x.mean(0))).max() <= step
    assert np.abs(np.asarray(own - x)).max() <= step
    # the owner's block is the mean of the workers' own decodes
    np.testing.assert_allclose(blocks.reshape(-1), own.mean(0), atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize(
    "comp",
    [
        compjax.int_quant(4, rotate=True),
        compjax.rand_k(ratio=0.5, shared_seed=True),
        compjax.cast("bfloat16"),
        compjax.qsgd(levels=4),
        compjax.top_k(ratio=0.3),
    ],
    ids=str,
)
def test_every_route_gives_the_owner_the_mean_of_the_workers_decodes(comp):
    x = jax.random.normal(jax.random.key(5), (N, 37))  # padded to 8 blocks of 5
    blocks, own = map(np.asarray, reduce_scattered(comp, x))
    # a cast's payloads are summed in bfloat16
    tol = 1e-2 if isinstance(comp, type(compjax.cast("bfloat16"))) else 1e-5
    np.testing.assert_allclose(blocks.reshape(-1)[:37], own.mean(0), atol=tol)
    assert np.all(blocks.reshape(-1)[37:] == 0)
    assert np.abs(blocks.reshape(-1)[:37] - np.asarray(x.mean(0))).max() < 2  # decodes near x


@pytest.mark.slow
@pytest.mark.parametrize("gather", ["bfloat16", "float16", "float8_e4m3fn"])
def test_a_cast_gather_shows_the_forward_pass_the_cast_weights(gather):
    mesh = jax.make_mesh((N,), ("data",))
    fs = compjax.fsdp(loss, optax.adam(LR), W0, mesh, gather=gather, min_size=MIN_SIZE)
    _, _, value = fs.step(W0, fs.init(W0), *batch(0))
    seen = {"w": W0["w"].astype(gather).astype(jnp.float32), "b": W0["b"]}  # b is replicated
    assert not np.array_equal(seen["w"], W0["w"])
    np.testing.assert_allclose(value, loss(seen, *batch(0)), rtol=1e-6)
    bits = jnp.dtype(gather).itemsize * 8
    assert compjax.communication(fs, W0, mesh=mesh).gather_bits == 7 * 12 * bits


def test_bad_arguments_are_refused():
    mesh = jax.make_mesh((N,), ("data",))
    opt = optax.sgd(0.1)
    with pytest.raises(ValueError, match="axis_name 'batch' is not an axis"):
        compjax.fsdp(loss, opt, W0, mesh, "batch")
    with pytest.raises(ValueError, match="one mesh axis"):
        compjax.fsdp(loss, opt, W0, mesh, ("data",))
    with pytest.raises(ValueError, match="gather must be None or one of"):
        compjax.fsdp(loss, opt, W0, mesh, gather="int4")
    with pytest.raises(ValueError, match="gather_block"):
        compjax.fsdp(loss, opt, W0, mesh, gather="int8", gather_block=0)
    with pytest.raises(ValueError, match="feedback='ef' needs a compressor"):
        compjax.fsdp(loss, opt, W0, mesh, feedback="ef")
    with pytest.raises(ValueError, match="feedback must be one of"):
        compjax.fsdp(loss, opt, W0, mesh, compressor=TOPK, feedback="ef22")
    with pytest.raises(ValueError, match="min_size"):
        compjax.fsdp(loss, opt, W0, mesh, min_size=-1)
    # a per-tensor statistic cannot be computed on a shard
    factored = optax.adafactor(0.1, min_dim_size_to_factor=4)
    with pytest.raises(ValueError, match="not laid out like a parameter"):
        compjax.fsdp(loss, factored, {"w": jnp.zeros((16, 8))}, mesh, min_size=MIN_SIZE)


def test_communication_counts_the_gather_and_the_gradient_exchange_apart(lossless, lossy):
    mesh, fs = lossless
    report = compjax.communication(fs, W0, mesh=mesh)
    # ring traffic per worker: 7 shards of 12 float32 weights gathered; 7/8 of the 96-entry
    # kernel gradient reduce-scattered, the 6-entry bias all-reduced, the 8-bit flag
    assert report.gather_bits == 7 * 12 * 32
    assert report.gradient_bits == 7 / 8 * 96 * 32 + 2 * 7 / 8 * 6 * 32 + 2 * 7 / 8 * 8
    assert report.dense_bits == 2 * 7 / 8 * 102 * 32  # a ring all-reduce of the gradient
    lossy_fs, _ = lossy
    report = compjax.communication(lossy_fs, W0, mesh=mesh)
    # two int8 blocks of 8 codes and their float32 steps per shard
    assert report.gather_bits == 7 * (2 * 8 * 8 + 2 * 32)
    block = compjax.wire_bits(TOPK.compress(None, jnp.ones(12)))
    assert block == 3 * 64  # 3 of 12 entries: int32 index and float32 value
    assert report.gradient_bits == 7 / 8 * N * block + 2 * 7 / 8 * 6 * 32 + 2 * 7 / 8 * 8


def test_zero_plus_plus_sends_one_gather_per_leaf_and_one_scale_pmax_per_step():
    """ZeRO++'s recipe on three sharded leaves: each leaf's int8 codes and steps travel in one
    all-gather, and the three summable scales are agreed in one pmax (each collective between
    processes costs a round trip, however small); the words are reduce-scattered per leaf."""
    params = {k: jnp.ones((16, 6)) for k in ("u", "v", "w")}
    mesh = jax.make_mesh((N,), ("data",))
    fs = compjax.fsdp(
        lambda p, x, y: loss({"w": p["u"] + p["v"] * p["w"], "b": 0.0}, x, y),
        optax.sgd(LR),
        params,
        mesh,
        min_size=MIN_SIZE,
        compressor=compjax.int_quant(4),
        gather="int8",
    )
    jaxpr = str(jax.make_jaxpr(fs.step)(params, fs.init(params), *batch(0)))
    collectives = re.findall(r"(all_gather\w*|reduce_scatter|pmax|psum\w*|all_to_all)\[", jaxpr)
    # Per leaf a gather and a reduce-scatter; one pmax of the three scales, one of the
    # non-finite flag; the loss's mean.
    assert sorted(collectives) == sorted(
        ["all_gather_invariant"] * 3 + ["reduce_scatter"] * 3 + ["pmax"] * 2 + ["psum_invariant"]
    )
    report = compjax.communication(fs, params, mesh=mesh)
    assert sum(1 for kind, _ in report.payloads if kind == "scale") == 1
    assert dict(report.payloads)["scale"] == 3 * 32

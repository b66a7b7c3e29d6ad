"""compjax.fsdp on a (hosts, local) mesh: two-level gathers and reduce-scatters (ZeRO++'s hpZ)."""

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
from compjax.draws import step_keys
from compjax.steps.param_gather import dequantize_blocks, quantize_blocks

P = jax.P
H, L = 2, 4
N = H * L
AXES = ("hosts", "local")
#: A kernel split over the 8 workers (rows 16: 2 per worker, 4 per secondary shard) and a
#: bias left replicated.
W0 = {"w": jnp.linspace(-0.3, 0.3, 96).reshape(16, 6), "b": jnp.linspace(0.0, 0.1, 6)}
MIN_SIZE = 64
LR = 0.05
BLOCK = 8


def loss(p, x, y):
    return jnp.mean((jnp.tanh(x @ p["w"]) + p["b"] - y) ** 2)


def batch(t):
    x = jax.random.normal(jax.random.key(2 * t), (32, 16))
    y = jax.random.normal(jax.random.key(2 * t + 1), (32, 6))
    return x, y


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((H, L), AXES)


@pytest.fixture(scope="module")
def lossless(mesh):
    return compjax.fsdp(loss, optax.adam(LR), W0, mesh, AXES, min_size=MIN_SIZE)


def pooled_adam(steps):
    """Replicated data-parallel Adam on the pooled batch (one device, no compjax)."""
    opt = optax.adam(LR)
    params, state = W0, opt.init(W0)
    for t in range(steps):
        updates, state = opt.update(jax.grad(loss)(params, *batch(t)), state, params)
        params = optax.apply_updates(params, updates)
    return params


def test_lossless_adam_is_data_parallel_adam_on_the_pooled_batch(mesh, lossless):
    fs = lossless
    # split over both axes, local-major: worker (h, l) owns rows block l H + h
    assert fs.param_specs == {"w": P(("local", "hosts"), None), "b": P()}
    params, state = W0, fs.init(W0)
    for t in range(3):
        params, state, value = fs.step(params, state, *batch(t))
    assert np.isfinite(float(value))
    want = pooled_adam(3)
    for k in W0:
        np.testing.assert_allclose(params[k], want[k], atol=2e-6)
    coords = {device: at for at, device in np.ndenumerate(mesh.devices)}
    for shard in params["w"].addressable_shards:
        host, local = coords[shard.device]
        block = local * H + host
        assert shard.index[0] == slice(2 * block, 2 * block + 2)
    assert state.opt_state[0].mu["w"].sharding.spec == P(("local", "hosts"), None)
    leaves = jax.tree.leaves((params, state.opt_state))
    per_device = sum(leaf.addressable_shards[0].data.nbytes for leaf in leaves)
    assert per_device == 3 * 96 * 4 // N + 3 * 6 * 4 + 4  # w, mu_w, nu_w split 8 ways


def test_each_leaf_is_gathered_once_per_stage_and_the_backward_pass_reuses_it(lossless):
    """The traced step gathers the kernel twice (over hosts, then over local) and never again:
    the gradient is taken at the gathered weights, so the backward pass re-gathers nothing."""
    jaxpr = str(jax.make_jaxpr(lossless.step)(W0, lossless.init(W0), *batch(0)))
    gathers = re.findall(r"all_gather\w*\[([^\]]*)\]", jaxpr)
    assert len(gathers) == 2
    assert "axis_name=('hosts',)" in gathers[0] and "axis_name=('local',)" in gathers[1]


def test_the_checkpoint_is_ordinary_global_arrays_that_a_flat_step_continues(
    mesh, lossless, tmp_path
):
    """Saved from the (hosts, local) step, restored by orbax onto the flat 8-worker layout:
    the next lossless step agrees with the two-level one up to float32 summation order."""
    params, state = W0, lossless.init(W0)
    params, state, _ = lossless.step(params, state, *batch(0))
    ckptr = ocp.StandardCheckpointer()
    ckptr.save(tmp_path / "ckpt", {"params": params, "state": state})
    ckptr.wait_until_finished()
    flat_mesh = jax.make_mesh((N,), ("data",))
    flat = compjax.fsdp(loss, optax.adam(LR), W0, flat_mesh, min_size=MIN_SIZE)
    target = jax.tree.map(
        lambda x, spec: jax.ShapeDtypeStruct(
            x.shape, x.dtype, sharding=NamedSharding(flat_mesh, spec)
        ),
        {"params": params, "state": state},
        {"params": flat.param_specs, "state": flat.specs},
    )
    restored = ckptr.restore(tmp_path / "ckpt", target)
    np.testing.assert_array_equal(restored["params"]["w"], params["w"])
    a = lossless.step(params, state, *batch(1))
    b = flat.step(restored["params"], restored["state"], *batch(1))
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-6)


# -- lossy steps against the same math written with the existing pieces --------------------


def decoded(w, gather):
    """The kernel as the forward pass sees it: each worker's 2-row shard sent as ``gather``."""
    if gather is None:
        return w
    if gather == "int8":
        one = lambda s: dequantize_blocks(*quantize_blocks(s, BLOCK), s.shape, s.dtype)  # noqa: E731
        return jax.vmap(one)(w.reshape(N, 2, 6)).reshape(w.shape)
    return w.astype(gather).astype(w.dtype)


def host_means(params, gather, x, y):
    """Each worker's kernel gradient (batch rows split host-major: worker h L + l has rows
    4 (h L + l) ...), then the exact mean over each host of each local worker's 4-row block:
    ``(H, L, 4, 6)``, entry ``[h, l]`` what worker (h, l) sends over the hosts; and the bias
    gradients' mean over all workers."""
    seen = {"w": decoded(params["w"], gather), "b": params["b"]}
    rows = lambda a: a.reshape(N, 4, *a.shape[1:])  # noqa: E731
    grads = jax.vmap(lambda a, b: jax.grad(loss)(seen, a, b))(rows(x), rows(y))
    per_host = grads["w"].reshape(H, L, 16, 6).mean(1)  # (H, 16, 6)
    chunks = per_host.reshape(H, L, 4, 6)  # local worker l sends rows 4 l .. 4 l + 3
    return chunks, grads["b"].mean(0)


def over_hosts(comp, mesh, chunks, key):
    """The existing compressed reduce-scatter over "hosts" of every worker's chunk, each local
    worker with ``fold_in(key, l)``: its mean block ``(H, L, 2, 6)`` and own decode."""

    def local(c, shared):
        k = jax.random.fold_in(shared, jax.lax.axis_index("local"))
        out = compjax.compressed_reduce_scatter(comp, k, c[0, 0], "hosts")
        return out.mean.reshape(1, 1, 2, 6), out.local[None, None]

    spec = P("hosts", "local")
    f = jax.shard_map(local, mesh=mesh, in_specs=(spec, P()), out_specs=(spec, spec))
    return f(jax.device_put(chunks, NamedSharding(mesh, spec)), key)


def owned(blocks):
    """The kernel from every worker's owned 2-row block (worker (h, l): rows 2 (l H + h) ...)."""
    return jnp.swapaxes(blocks, 0, 1).reshape(16, 6)


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3, 4))
def reference_step(comp, feedback, gather, opt, mesh, params, opt_state, memory, shift, key, x, y):
    chunks, mean_b = host_means(params, gather, x, y)
    sent = {"ef": chunks + memory, "ef21": chunks - memory}.get(feedback, chunks)
    mean_w, local = over_hosts(comp, mesh, sent, key)
    if feedback == "ef":
        memory = sent - local
    elif feedback == "ef21":
        memory, shift = memory + local, shift + owned(mean_w)
    grad_w = shift if feedback == "ef21" else owned(mean_w)
    updates, opt_state = opt.update({"w": grad_w, "b": mean_b}, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, memory, shift


LOSSY = {
    "top_k+ef+int8": (compjax.top_k(ratio=0.25), "ef", "int8"),
    "int_quant+ef21+bf16": (compjax.int_quant(4), "ef21", "bfloat16"),
}


@pytest.mark.parametrize("name", list(LOSSY))
def test_lossy_step_is_exact_local_mean_then_compressed_reduce_scatter_over_hosts(mesh, name):
    comp, feedback, gather = LOSSY[name]
    opt = optax.adam(LR)
    fs = compjax.fsdp(
        loss,
        opt,
        W0,
        mesh,
        AXES,
        compressor=comp,
        feedback=feedback,
        gather=gather,
        gather_block=BLOCK,
        min_size=MIN_SIZE,
    )
    # one memory per worker, of the 4-row block it sends over the hosts (1/L of the kernel)
    assert fs.specs.memory == (P(("local", "hosts")),)
    params, state = W0, fs.init(W0)
    assert state.memory[0].shape == (N, 4, 6)
    ref = (W0, opt.init(W0), jnp.zeros((H, L, 4, 6)), jnp.zeros((16, 6)))
    auto = jax.make_mesh((H, L), AXES, axis_types=(AxisType.Auto,) * 2)  # for the reference
    for t in range(2):
        key = np.asarray(step_keys(state.key, 2)[1][1])  # the kernel's key (leaves: b, w)
        params, state, _ = fs.step(params, state, *batch(t))
        ref = reference_step(comp, feedback, gather, opt, auto, *ref, key, *batch(t))
        # the state's memory rows are the workers in the params' order, (local, hosts)
        memory = np.asarray(state.memory[0]).reshape(L, H, 4, 6).swapaxes(0, 1)
        assert np.abs(memory).max() > 0
        np.testing.assert_allclose(memory, ref[2], atol=1e-6)
        if feedback == "ef21":
            np.testing.assert_allclose(state.shift[0], ref[3], atol=1e-6)
        for k in W0:
            np.testing.assert_allclose(params[k], ref[0][k], atol=1e-6)


def test_communication_reports_each_link_of_the_gather_and_the_reduce_scatter(mesh, lossless):
    report = compjax.communication(lossless, W0, AXES, mesh=mesh)
    # ring traffic per worker, float32: the 12-entry shard to the other host, the 24-entry
    # secondary shard to the 3 other local workers
    assert report.slow_gather_bits == (H - 1) * 12 * 32
    assert report.fast_gather_bits == (L - 1) * 24 * 32
    assert report.gather_bits == report.slow_gather_bits + report.fast_gather_bits
    # fast: 3/4 of the 96-entry kernel gradient reduce-scattered, the bias all-reduced
    assert report.fast_gradient_bits == (L - 1) / L * 96 * 32 + 2 * (L - 1) / L * 6 * 32
    # slow: 1/2 of the 24-entry host mean, the bias all-reduced, the 8-bit flag over all 8
    slow_flag = 2 * (N - 1) / N * 8
    assert report.slow_gradient_bits == (H - 1) / H * 24 * 32 + 2 * (H - 1) / H * 6 * 32 + slow_flag
    assert report.fast_bits + report.slow_bits == report.bits_per_worker

    zero_pp = compjax.fsdp(
        loss,
        optax.adam(LR),
        W0,
        mesh,
        AXES,
        compressor=compjax.top_k(ratio=0.25),
        gather="int8",
        gather_block=BLOCK,
        min_size=MIN_SIZE,
    )
    report = compjax.communication(zero_pp, W0, AXES, mesh=mesh)
    # the slow gather: two int8 blocks (8 and 4 codes, padded to 8) and their float32 steps
    assert report.slow_gather_bits == (H - 1) * (2 * 8 * 8 + 2 * 32)
    assert report.fast_gather_bits == (L - 1) * 24 * 32  # decoded weights, exact
    # the slow reduce-scatter: the 24-entry host mean cut into 2 blocks of 12, top-3 of each
    # (int32 index and float32 value) all-to-all-ed: (H - 1) / H of a 1/L-sized message
    block = compjax.wire_bits(compjax.top_k(ratio=0.25).compress(None, jnp.ones(12)))
    assert block == 3 * 64
    assert report.slow_gradient_bits == (H - 1) / H * H * block + 2 * (H - 1) / H * 6 * 32 + (
        slow_flag
    )
    assert report.fast_gradient_bits == (L - 1) / L * 96 * 32 + 2 * (L - 1) / L * 6 * 32


@pytest.mark.parametrize(
    ("axis_name", "match"),
    [
        (("hosts", "nodes"), r"axis_name \('hosts', 'nodes'\): 'nodes' is not an axis"),
        ("data", "axis_name 'data' is not an axis"),
        (("local", "local"), r"axis_name \('local', 'local'\) names the same axis twice"),
        (("hosts", "local", "chips"), "axis_name must be a name or a pair of names"),
        (["hosts", "local"], "axis_name must be a name or a pair of names"),
    ],
)
def test_a_bad_axis_name_is_refused_by_name(mesh, axis_name, match):
    with pytest.raises(ValueError, match=match):
        compjax.fsdp(loss, optax.sgd(LR), W0, mesh, axis_name)

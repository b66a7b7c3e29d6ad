"""SparseLoCo (compjax.sparseloco, compjax.chunked_top_k): the chunked top-k selection and the
2-bit lookup codes against numpy, wire bits from the payload, and error feedback with a
decaying memory over DiLoCo rounds."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import roundtrip

import compjax

KEY = jax.random.key(0)


def np_chunked_top_k(x, k, chunk, bits, sigmas=6.0):
    """Numpy transcription: per chunk the k largest magnitudes (first on ties), then the kept
    values binned around their mean and replaced by their bin's mean."""
    x = np.asarray(x, np.float64).reshape(-1)
    d = x.size
    size = min(chunk, d)
    count = -(-d // size)
    rows = np.zeros(count * size)
    rows[:d] = x
    rows = rows.reshape(count, size)
    kept = min(k, size)
    idx = np.argsort(-np.abs(rows), axis=1, kind="stable")[:, :kept]
    vals = np.take_along_axis(rows, idx, axis=1).reshape(-1)
    if bits is not None:
        n_bins = 2**bits
        centred = vals - vals.mean()
        width = sigmas * centred.std(ddof=1) / n_bins if vals.size > 1 else 0.0
        width = width if width > 0 else 1.0
        codes = np.clip(np.round(centred / width + n_bins // 2), 0, n_bins - 1).astype(int)
        vals = np.array([vals[codes == c].mean() for c in codes])
    out = np.zeros(count * size)
    out[(np.arange(count)[:, None] * size + idx).reshape(-1)] = vals
    return out[:d]


X = np.random.default_rng(0).normal(size=(5, 13)).astype(np.float32)  # 65 entries


@pytest.mark.parametrize("bits", [None, 2])
def test_selection_and_codes_match_numpy(bits):
    comp = compjax.chunked_top_k(k=3, chunk=8, bits=bits)
    payload, y = roundtrip(comp, KEY, jnp.asarray(X))
    ref = np_chunked_top_k(X, 3, 8, bits)
    np.testing.assert_allclose(np.asarray(y).reshape(-1), ref, rtol=1e-6, atol=1e-7)
    assert (np.asarray(y) != 0).sum() == 9 * 3 - 2  # the last chunk holds one entry and 7 pads
    if bits == 2:
        assert len(np.unique(np.asarray(y)[np.asarray(y) != 0])) <= 4
        assert payload.wire["codes"].dtype == payload.wire["indices"].dtype == jnp.uint32
    # bits: 27 positions below 8 as 4-bit codes in 4 words, then 27 float32 values, or
    # 27 2-bit codes in 2 words and the 4 bin means in float32.
    wire = 4 * 32 + (27 * 32 if bits is None else 2 * 32 + 4 * 32)
    assert compjax.wire_bits(payload) == comp.bits(X.shape) == wire


@pytest.mark.parametrize("kind", ["normal", "ties", "sparse", "nan"])
def test_blocked_selection_matches_numpy(kind):
    """Chunks of 256, 4 kept: the per-chunk top-k from the 4 blocks of 8 with the largest
    maxima (d = 2,056, a multiple of 8: the last chunk 8 entries and 248 pads).  Ties and
    mostly-zero chunks keep the first entries; a NaN takes the plain top-k."""
    rng = np.random.default_rng(1)
    d = 2056
    x = {
        "normal": rng.normal(size=d),
        "ties": rng.integers(-2, 3, d) * 0.5,
        "sparse": np.where(rng.random(d) < 0.005, rng.normal(size=d), 0.0),
        "nan": np.where(np.arange(d) == 700, np.nan, rng.normal(size=d)),
    }[kind].astype(np.float32)
    comp = compjax.chunked_top_k(k=4, chunk=256, bits=None)
    idx, vals = jax.jit(comp.select)(jnp.asarray(x))
    size, count = 256, 9
    rows = np.zeros(count * size, np.float32)
    rows[:d] = x
    ref_idx = np.argsort(-np.abs(rows.reshape(count, size)), axis=1, kind="stable")[:, :4]
    if kind == "nan":  # NaN ranks first in jax.lax.top_k: chunk 2 keeps it and its 3 largest
        assert int(idx[2, 0]) == 700 - 512 and np.isnan(vals[2, 0])
        ref = np.argsort(-np.abs(np.nan_to_num(rows.reshape(count, size)[2])), kind="stable")
        np.testing.assert_array_equal(idx[2, 1:], [i for i in ref if i != 188][:3])
        idx, ref_idx = np.delete(np.asarray(idx), 2, 0), np.delete(ref_idx, 2, 0)
    np.testing.assert_array_equal(idx, ref_idx)
    y = roundtrip(comp, KEY, jnp.asarray(x))[1]
    if kind != "nan":
        np.testing.assert_array_equal(np.asarray(y), np_chunked_top_k(x, 4, 256, None))


def test_wire_bits_from_the_payload_on_every_shape():
    for comp in (
        compjax.chunked_top_k(k=2, chunk=300, bits=4),
        compjax.chunked_top_k(k=32, chunk=4096),
    ):
        for shape in [(), (0,), (1,), (7,), (3, 5), (301,), (2, 4097)]:
            x = jax.ShapeDtypeStruct(shape, jnp.float32)
            payload = jax.eval_shape(comp.compress, KEY, x)
            assert compjax.wire_bits(payload) == comp.bits(shape), (comp, shape)
            assert jax.eval_shape(comp.decompress, payload).shape == shape
    # Positions below 300 and 4096 take 16 bits each.
    assert compjax.chunked_top_k(k=32, chunk=4096).bits((8192,)) == 64 * 16 + 64 * 2 + 4 * 32


def test_bad_arguments_are_refused():
    for kwargs in (
        {"k": 0},
        {"k": 5, "chunk": 4},
        {"k": 1, "bits": 3},
        {"k": 1, "sigmas": 0.0},
    ):
        with pytest.raises(ValueError):
            compjax.chunked_top_k(**kwargs)
    with pytest.raises(ValueError, match="error_decay"):
        compjax.sparseloco(optax.sgd(0.1), 2, "data", error_decay=1.5)
    with pytest.raises(ValueError, match="error_decay"):
        compjax.diloco(optax.sgd(0.1), optax.sgd(1.0), 2, "data", error_decay=0.5)


N, LR, H, BETA, OUTER_LR = 4, 0.1, 2, 0.5, 0.8
P0 = {"w": np.linspace(-0.5, 0.5, 24, dtype=np.float32).reshape(6, 4)}
_RNG = np.random.default_rng(1)
XS = _RNG.normal(size=(6, N, 4, 6)).astype(np.float32)
YS = _RNG.normal(size=(6, N, 4, 4)).astype(np.float32)
COMP = dict(k=2, chunk=8, bits=2)


def loss(p, x, y):
    return jnp.mean((x @ p["w"] - y) ** 2)


@functools.cache
def vmapped():
    tx = compjax.sparseloco(optax.sgd(LR), H, "data", outer_lr=OUTER_LR, error_decay=BETA, **COMP)

    def step(p, s, x, y):
        g = jax.grad(loss)(p, x, y)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s, g

    init = jax.jit(jax.vmap(lambda _: tx.init(P0)))
    return init, jax.jit(jax.vmap(step, axis_name="data"))


def test_rounds_send_chunked_top_k_of_the_decayed_memory():
    """At every sync: ``e <- beta e + Delta``, ``m = C(e)`` (numpy), ``e <- e - m``, and
    ``theta <- theta - outer_lr mean(m)``, over three rounds."""
    init, step = vmapped()
    params, state = compjax.worker_copies(P0, N), init(jnp.arange(N))
    theta, error = P0["w"].astype(np.float64), np.zeros((N, *P0["w"].shape))
    local = np.broadcast_to(P0["w"], (N, *P0["w"].shape)).astype(np.float64)
    for t in range(6):
        params, state, grads = step(params, state, XS[t], YS[t])
        local = local - LR * np.asarray(grads["w"], np.float64)
        if (t + 1) % H:
            continue
        acc = BETA * error + (theta - local)
        sent = np.stack([np_chunked_top_k(a, **COMP).reshape(a.shape) for a in acc])
        error = acc - sent
        theta = theta - OUTER_LR * sent.mean(0)
        np.testing.assert_allclose(np.asarray(state.error["w"][:, 0]), error, atol=2e-6)
        got = compjax.global_params(state, stacked=True)["w"]
        np.testing.assert_allclose(got, np.broadcast_to(theta, got.shape), atol=2e-6)
        local = np.broadcast_to(theta, local.shape).copy()
        assert (np.abs(error) > 1e-3).any() and (np.abs(sent) > 0).sum() <= N * 3 * 2


# The reference options: 1-D leaves in their own chunks, median-norm clipping, per-entry
# averaging over the workers that sent an entry (the authors' code, templar).
P1 = {"w": P0["w"], "b": np.linspace(-0.2, 0.3, 16, dtype=np.float32)}
ZS = _RNG.normal(size=(6, N, 16)).astype(np.float32)
REFERENCE_OPTIONS = [
    dict(chunk_1d=8),  # 1-D chunks of 8 entries with min(k, 8) = 2 kept
    dict(merge="median_norm_clip", average="senders"),
    dict(chunk_1d=4, merge="median_norm_clip", average="senders"),
    dict(chunk_1d=8, average="senders"),
]


def loss1(p, x, y, z):
    return jnp.mean((x @ p["w"] - y) ** 2) + jnp.mean((p["b"] - z) ** 2)


@functools.cache
def vmapped_reference(options: tuple):
    tx = compjax.sparseloco(
        optax.sgd(LR), H, "data", outer_lr=OUTER_LR, error_decay=BETA, **COMP, **dict(options)
    )

    def step(p, s, x, y, z):
        g = jax.grad(loss1)(p, x, y, z)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s, g

    init = jax.jit(jax.vmap(lambda _: tx.init(P1)))
    return init, jax.jit(jax.vmap(step, axis_name="data"))


def np_sent(x, k, chunk):
    """Where the chunked top-k of ``x`` sends (numpy, first on ties)."""
    x = np.asarray(x, np.float64).reshape(-1)
    size = min(chunk, x.size)
    count = -(-x.size // size)
    rows = np.zeros(count * size)
    rows[: x.size] = x
    idx = np.argsort(-np.abs(rows.reshape(count, size)), axis=1, kind="stable")[:, : min(k, size)]
    mask = np.zeros(count * size, bool)
    mask[(np.arange(count)[:, None] * size + idx).reshape(-1)] = True
    return mask[: x.size]


def np_templar_outer(messages, sent, clip, senders):
    """Transcription of the authors' outer step for one tensor: each peer's message scaled by
    ``min(1, median / (norm + 1e-8))`` (``torch.median``: the lower median), then
    ``scatter_reduce(mean, include_self=False)``: each entry averaged over its senders."""
    if clip:
        norms = np.linalg.norm(messages, axis=1)
        med = np.sort(norms)[(len(norms) - 1) // 2]
        messages = messages * np.minimum(med / (norms + 1e-8), 1.0)[:, None]
    if not senders:
        return messages.mean(0)
    count = sent.sum(0)
    return np.where(count > 0, (messages * sent).sum(0) / np.maximum(count, 1), 0.0)


@pytest.mark.parametrize("options", REFERENCE_OPTIONS, ids=str)
def test_reference_options_match_a_transcription(options):
    """Three rounds with the reference options against numpy: the 1-D leaf chunked by
    ``chunk_1d``, the messages clipped to the median norm per leaf and averaged per entry."""
    init, step = vmapped_reference(tuple(sorted(options.items())))
    params, state = compjax.worker_copies(P1, N), init(jnp.arange(N))
    theta = {k: v.astype(np.float64) for k, v in P1.items()}
    error = {k: np.zeros((N, *v.shape)) for k, v in P1.items()}
    local = {k: np.broadcast_to(v, (N, *v.shape)).astype(np.float64) for k, v in P1.items()}
    clip = options.get("merge") == "median_norm_clip"
    senders = options.get("average") == "senders"
    for t in range(6):
        params, state, grads = step(params, state, XS[t], YS[t], ZS[t])
        for k in P1:
            local[k] = local[k] - LR * np.asarray(grads[k], np.float64)
        if (t + 1) % H:
            continue
        for k in P1:
            comp = dict(COMP)
            if k == "b" and "chunk_1d" in options:
                comp.update(chunk=options["chunk_1d"], k=min(COMP["k"], options["chunk_1d"]))
            acc = BETA * error[k] + (theta[k] - local[k])
            flat = acc.reshape(N, -1)
            sent = np.stack([np_chunked_top_k(a, **comp) for a in flat])
            mask = np.stack([np_sent(a, comp["k"], comp["chunk"]) for a in flat])
            error[k] = acc - sent.reshape(acc.shape)
            merged = np_templar_outer(sent, mask, clip, senders)
            theta[k] = theta[k] - OUTER_LR * merged.reshape(theta[k].shape)
            np.testing.assert_allclose(np.asarray(state.error[k][:, 0]), error[k], atol=3e-6)
            got = compjax.global_params(state, stacked=True)[k]
            np.testing.assert_allclose(got, np.broadcast_to(theta[k], got.shape), atol=3e-6)
            local[k] = np.broadcast_to(theta[k], local[k].shape).copy()


def test_reference_path_with_default_choices_is_the_default():
    """chunk_1d = chunk takes the gathering path with the default merge: the same rounds."""
    a_init, a_step = vmapped_reference(())
    b_init, b_step = vmapped_reference((("chunk_1d", COMP["chunk"]),))
    pa = pb = compjax.worker_copies(P1, N)
    sa, sb = a_init(jnp.arange(N)), b_init(jnp.arange(N))
    for t in range(4):
        pa, sa, _ = a_step(pa, sa, XS[t], YS[t], ZS[t])
        pb, sb, _ = b_step(pb, sb, XS[t], YS[t], ZS[t])
    for a, b in zip(jax.tree.leaves((pa, sa)), jax.tree.leaves((pb, sb)), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)


def test_reference_options_bad_arguments():
    for kwargs, match in (
        (dict(chunk_1d=0), "chunk_1d"),
        (dict(chunk_1d=True), "chunk_1d"),
        (dict(merge="median"), "merge"),
        (dict(average="peers"), "average"),
        (dict(merge="median_norm_clip", exchange="scatter_gather"), "exchange"),
        (dict(average="senders", sync_every=0), "sync_every"),
    ):
        args = dict(sync_every=2) | kwargs
        with pytest.raises(ValueError, match=match):
            compjax.sparseloco(optax.sgd(0.1), args.pop("sync_every"), "data", **args)


TEMPLAR = (("average", "senders"), ("chunk_1d", 8), ("merge", "median_norm_clip"))


def test_reference_options_under_shard_map_agree_with_vmap():
    """The gathering path under shard_map (specs from compjax.state_specs) gives vmap's
    params and states, and compjax.communication counts one chunked payload per leaf."""
    tx = compjax.sparseloco(
        optax.sgd(LR), H, "data", outer_lr=OUTER_LR, error_decay=BETA, **COMP, **dict(TEMPLAR)
    )
    specs = compjax.state_specs(jax.eval_shape(tx.init, P1), "data")
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:N]), ("data",))
    P = jax.sharding.PartitionSpec

    def body(p, s, x, y, z):
        p = jax.tree.map(lambda a: a[0], p)
        u, s = tx.update(jax.grad(loss1)(p, x[0], y[0], z[0]), s, p)
        return jax.tree.map(lambda a: a[None], optax.apply_updates(p, u)), s

    init = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs))
    run = jax.jit(
        jax.shard_map(
            body, mesh=mesh, in_specs=(P("data"), specs) + (P("data"),) * 3,
            out_specs=(P("data"), specs),
        )
    )  # fmt: skip
    v_init, v_step = vmapped_reference(TEMPLAR)
    ps, ss = compjax.worker_copies(P1, N), init(P1)
    pv, sv = compjax.worker_copies(P1, N), v_init(jnp.arange(N))
    for t in range(4):
        ps, ss = run(ps, ss, XS[t], YS[t], ZS[t])
        pv, sv, _ = v_step(pv, sv, XS[t], YS[t], ZS[t])
    for k in P1:
        np.testing.assert_allclose(np.asarray(ps[k]), np.asarray(pv[k]), atol=1e-6)
        np.testing.assert_allclose(
            np.asarray(ss.error[k]).reshape(N, -1), np.asarray(sv.error[k]).reshape(N, -1),
            atol=1e-6,
        )  # fmt: skip
    report = compjax.communication(tx, P1, "data", num_workers=N)
    w = compjax.chunked_top_k(k=2, chunk=8, bits=2).bits((6, 4))
    b = compjax.chunked_top_k(k=2, chunk=8, bits=2).bits((16,))
    assert sum(bits for kind, bits in report.payloads if kind == "payload") == w + b


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_reference_options_with_low_precision_params(dtype):
    """bfloat16 and float16 params: the global params stay float32 and follow the float32
    run within the low dtype's rounding of the local steps."""
    init, step = vmapped_reference(TEMPLAR)
    low = jax.tree.map(lambda a: jnp.asarray(a, dtype), P1)
    p32, s32 = compjax.worker_copies(P1, N), init(jnp.arange(N))
    tx = compjax.sparseloco(
        optax.sgd(LR), H, "data", outer_lr=OUTER_LR, error_decay=BETA, **COMP, **dict(TEMPLAR)
    )

    def step_low(p, s, x, y, z):
        g = jax.grad(loss1)(p, x, y, z)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    run = jax.jit(jax.vmap(step_low, axis_name="data"))
    pl = compjax.worker_copies(low, N)
    sl = jax.jit(jax.vmap(lambda _: tx.init(low)))(jnp.arange(N))
    for t in range(4):
        p32, s32, _ = step(p32, s32, XS[t], YS[t], ZS[t])
        pl, sl = run(pl, sl, XS[t], YS[t], ZS[t])
    theta = compjax.global_params(sl, stacked=True)
    ref = compjax.global_params(s32, stacked=True)
    for k in P1:
        assert pl[k].dtype == dtype and theta[k].dtype == jnp.float32
        assert np.all(np.isfinite(np.asarray(theta[k])))
        np.testing.assert_allclose(np.asarray(theta[k]), np.asarray(ref[k]), atol=3e-2)


def test_reference_options_refuse_a_non_finite_step():
    """A NaN gradient on one worker at a round's end: NaN updates on every worker and the
    whole state kept (the gathering path's guard)."""
    init, step = vmapped_reference(TEMPLAR)
    params, state = compjax.worker_copies(P1, N), init(jnp.arange(N))
    params, state, _ = step(params, state, XS[0], YS[0], ZS[0])
    bad = XS[1].copy()
    bad[2, 0, 0] = np.nan
    new_params, new_state, _ = step(params, state, bad, YS[1], ZS[1])
    assert all(np.all(np.isnan(np.asarray(a))) for a in jax.tree.leaves(new_params))
    for a, b in zip(jax.tree.leaves(new_state), jax.tree.leaves(state), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("options", [{}, {"average": "senders"}], ids=["default", "reference"])
def test_float64_params_are_refused_at_init_on_either_path(options):
    """The reference options' state refuses float64 params as the default path (diloco) does."""
    tx = compjax.sparseloco(optax.sgd(0.1), 2, "data", **options)
    with jax.enable_x64(True):
        wide = {"w": jnp.zeros((6, 4), jnp.float64), "b": jnp.zeros(4, jnp.float32)}
        with pytest.raises(ValueError, match=re.escape("got float64 at params['w']")):
            jax.vmap(lambda _: tx.init(wide))(jnp.arange(N))

"""Every transformation's guarantees in the forms users run, in float32, bfloat16 and float16.

For each transformation of the hostile-input catalogue (``tests/test_hostile.py``,
plus a few exchanges it does not reach) on 4 workers, under
``jax.vmap(axis_name=...)``, ``jax.shard_map`` on a mesh of 4 of the 8
simulated CPU devices, and ``jax.pmap``:

* finite gradients give a finite update and state (moderate values), or at the
  dtype's top a finite update or the documented refusal (NaN update on every
  worker, the whole state kept);
* an Inf or NaN on one worker refuses the step: NaN updates on every worker and
  the whole state (error memories, DIANA shifts, server memories, counts, keys)
  kept bit for bit;
* replication: after every step the update (but for the local-step methods,
  whose updates move each worker's own params), and every state field that
  :func:`compjax.state_specs` says is replicated (``P()``), is the same bit for
  bit on every worker.

The state travels in one layout in every form (a leading worker axis on every
leaf, as ``vmap(init)`` gives it); ``shard_map`` splits every leaf over the
workers and each worker drops its axis of one.  chex's ``variants`` are not
used for the forms: its ``with_pmap`` broadcasts one input to every device
and keeps the first device's output, which would hide a worker that differs.
A few (transformation, form, dtype) cases run in the fast suite; the whole
cross-product with ``-m slow``.
"""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from test_hostile import TRANSFORMS as HOSTILE
from test_hostile import WITH_PARAMS

import compjax

P = jax.P
AXIS = "data"
W = 4
SHAPES = {"w": (3, 5), "b": (1,)}
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
FORMS = ("vmap", "shard_map", "pmap")

TRANSFORMS = {
    **HOSTILE,
    "compress(cast(bfloat16))": lambda: compjax.compress(compjax.cast("bfloat16"), AXIS),
    "compress(natural, scatter_gather)": lambda: compjax.compress(
        compjax.natural(), AXIS, exchange="scatter_gather"
    ),
    "compress(eden, scatter_gather)": lambda: compjax.compress(
        compjax.eden(), AXIS, exchange="scatter_gather"
    ),
    "diana(qsgd, scatter_gather)": lambda: compjax.diana(
        compjax.qsgd(2), AXIS, exchange="scatter_gather"
    ),
    "ef21(top_k, scatter_gather)": lambda: compjax.ef21(
        compjax.top_k(ratio=0.5), AXIS, exchange="scatter_gather"
    ),
}

#: The fast suite: one compile each, the exchanges' code paths (all-gather, scatter-gather
#: with a server memory, integer votes), every form and every dtype at least once.
FAST = {
    ("error_feedback(top_k, scatter_gather)", "vmap", "float16"),
    ("error_feedback(top_k, scatter_gather)", "shard_map", "bfloat16"),
    ("compress(qsgd)", "pmap", "float32"),
    ("compress(cast(bfloat16))", "vmap", "float16"),
    ("diana(terngrad)", "shard_map", "float16"),
    ("sign_majority_vote", "pmap", "bfloat16"),
}


def _devices():
    return np.array(jax.devices()[:W])


@functools.cache
def _init(name, dtype_name):
    tx = TRANSFORMS[name]()
    params = {k: jnp.zeros(s, dtype_name) for k, s in SHAPES.items()}
    return jax.jit(jax.vmap(lambda _: tx.init(params)))(jnp.arange(W))


@functools.cache
def _step(name, form):
    """``(grads, state, params) -> (updates, new state)``, every leaf with a worker axis."""
    tx = TRANSFORMS[name]()

    def one(grads, state, params):
        if name in WITH_PARAMS:
            return tx.update(grads, state, params)
        if name == "variance_based":  # per-example gradients: the gradient and its half
            grads = jax.tree.map(lambda g: jnp.stack([g, g / 2]), grads)
        return tx.update(grads, state)

    if form == "vmap":
        return jax.jit(jax.vmap(one, axis_name=AXIS))
    if form == "pmap":
        return jax.pmap(one, axis_name=AXIS, devices=list(_devices()))

    # Replicated state fields enter as one copy (P()), per-worker ones split (P(axis)).
    specs = compjax.state_specs(jax.eval_shape(tx.init, _params(jnp.float32)), AXIS)
    is_spec = lambda x: isinstance(x, P)  # noqa: E731
    first = lambda a: a[0]  # noqa: E731

    def local(grads, state, params):
        state = jax.tree.map(lambda sp, a: a if sp == P() else a[0], specs, state, is_leaf=is_spec)
        out = one(jax.tree.map(first, grads), state, jax.tree.map(first, params))
        return jax.tree.map(lambda a: a[None], out)

    mesh = Mesh(_devices(), (AXIS,))
    in_specs = (P(AXIS), specs, P(AXIS))
    mapped = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=P(AXIS)))

    def run(grads, state, params):
        one_copy = jax.tree.map(
            lambda sp, a: a[0] if sp == P() else a, specs, state, is_leaf=is_spec
        )
        return mapped(grads, one_copy, params)

    return run


def _params(dtype):
    return {k: jnp.zeros(s, dtype) for k, s in SHAPES.items()}


def _comparable(tree):
    """Key arrays as their raw bits, so that chex compares them."""
    return jax.tree.map(
        lambda a: jax.random.key_data(a) if jnp.issubdtype(a.dtype, jax.dtypes.prng_key) else a,
        tree,
    )


def _replicated_mask(name, dtype_name):
    """Per state leaf: whether :func:`compjax.state_specs` says it is replicated."""
    tx = TRANSFORMS[name]()
    params = {k: jnp.zeros(s, dtype_name) for k, s in SHAPES.items()}
    specs = compjax.state_specs(jax.eval_shape(tx.init, params), AXIS)
    return [s == P() for s in jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))]


def _assert_replicated(tree, mask=None, name=None):
    if name in WITH_PARAMS:  # local steps: each worker's update moves its own params
        return
    leaves = jax.tree.leaves(_comparable(tree))
    mask = [True] * len(leaves) if mask is None else mask
    assert len(mask) == len(leaves)
    for leaf, replicated in zip(leaves, mask, strict=True):
        if replicated:
            chex.assert_trees_all_equal(*[np.asarray(leaf[i]) for i in range(W)])


def _grads(kind, dtype):
    key = jax.random.key({"moderate": 0, "top": 1, "nan": 2}[kind])
    out = {}
    for i, (k, s) in enumerate(SHAPES.items()):
        g = jax.random.normal(jax.random.fold_in(key, i), (W, *s))
        if kind == "top":  # magnitudes in [0.5, 0.9] of the dtype's largest value
            u = jax.random.uniform(jax.random.fold_in(key, 10 + i), (W, *s), minval=0.5, maxval=0.9)
            g = jnp.sign(g) * u * float(jnp.finfo(dtype).max)
        out[k] = g.astype(dtype)
    if kind == "nan":
        out["w"] = out["w"].at[1, 0, 0].set(jnp.nan)
    return out


def _finite(tree) -> bool:
    return all(
        bool(np.all(np.isfinite(np.asarray(a, np.float32))))
        for a in jax.tree.leaves(tree)
        if jnp.issubdtype(a.dtype, jnp.floating)
    )


def _refused(updates, state, new_state) -> bool:
    """NaN updates everywhere and the whole state kept bit for bit."""
    if not all(bool(jnp.all(jnp.isnan(u))) for u in jax.tree.leaves(updates)):
        return False
    chex.assert_trees_all_equal(_comparable(state), _comparable(new_state))
    return True


def _cases():
    for name in sorted(TRANSFORMS):
        for form in FORMS:
            for dtype_name in DTYPES:
                marks = () if (name, form, dtype_name) in FAST else (pytest.mark.slow,)
                yield pytest.param(name, form, dtype_name, marks=marks)


@pytest.mark.parametrize(("name", "form", "dtype_name"), list(_cases()))
def test_finite_refused_and_replicated_in_every_form(name, form, dtype_name):
    dtype = DTYPES[dtype_name]
    step = _step(name, form)
    mask = _replicated_mask(name, dtype_name)
    params = {k: jnp.zeros((W, *s), dtype_name) for k, s in SHAPES.items()}
    state = _init(name, dtype_name)

    updates, state = step(_grads("moderate", dtype), state, params)
    assert _finite(updates) and _finite(state), (name, form, dtype_name)
    _assert_replicated(updates, name=name)
    _assert_replicated(state, mask)

    top_updates, top_state = step(_grads("top", dtype), state, params)
    assert _finite(top_state), (name, form, dtype_name)
    assert _finite(top_updates) or _refused(top_updates, state, top_state)
    _assert_replicated(top_updates, name=name)
    _assert_replicated(top_state, mask)

    nan_updates, nan_state = step(_grads("nan", dtype), state, params)
    assert _refused(nan_updates, state, nan_state), (name, form, dtype_name)
    _assert_replicated(nan_updates, name=name)

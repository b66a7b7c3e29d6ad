"""Every compressor's guarantees in the forms users run: eager, ``jax.jit``, ``jax.jit(jax.vmap)``.

For every compressor of ``helpers.all_compressors()`` (and :data:`EXTRA`), in
float32, bfloat16 and float16, on ``D`` entries, each form runs the round trip
on :func:`inputs`: zeros of both signs, a normal draw, entries at and near the
dtype's largest value, and tiny and subnormal ones.  A compiled form runs
every input twice in its one program: as an argument (traced) and closed over
(a compile-time constant, which XLA's simplifier and constant folder rewrite:
``compjax.numerics.opaque``).  The ``jit(vmap)`` form maps over keys, as
workers are simulated; a ``lax.cond`` on a batched value runs as a select of
both branches there.

The checks (:func:`check_form`), for each form and input:

* the decode is finite, of the input's shape and dtype (or, where a compressor documents
  a refusal, :data:`REFUSED`, every entry NaN); zeros decode to zeros
  (``sign()``: to ``+1``, documented);
* ``wire_bits(payload) == bits(shape, dtype)``;
* a deterministic compressor decodes as in the eager form, to an ulp;
* an unbiased one (on inputs inside its ``unbiased_range``): each entry's mean
  over the form's draws is within ``Z`` standard errors of the entry (from
  ``omega(d) ||x||^2``), and the mean squared error within ``Z`` standard
  errors of ``omega(d) ||x||^2``; a biased one with ``delta(d)``: of
  ``(1 - delta(d)) ||x||^2``.

A few draws per form: a cheap check of each form.  The full statistics
(chi-square of the mean against exact variances, omega attained) run in one
form in ``test_unbiased.py``, ``test_dithering.py``, ``test_eden.py``,
``test_int_quant.py`` and ``test_biased.py``.  Where a compressor documents a
guarantee as not holding (:data:`OUTSIDE`, :data:`NO_RANGE`) the check is left
out, with the reason, and ``test_what_is_left_out_is_what_the_metadata_says``
holds the list to the compressors' metadata.  The fast suite runs
:data:`FAST`; every other (compressor, dtype) runs with ``-m slow``.
"""

from __future__ import annotations

import math
import warnings

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import all_compressors

import compjax
from compjax.compressor import UnbiasedRangeWarning
from compjax.compressors import qsgd as qsgd_module

D = 16
FORMS = ("eager", "jit", "jit_vmap")
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
#: Draws per form: the eager form runs op by op, the vmapped one draws in one program.
DRAWS = {"eager": 2, "jit": 4, "jit_vmap": 64}
Z = 6.0  # a false alarm per check has probability < 2e-9 (normal tail)

#: Variants beyond helpers.all_compressors() that reach other code paths here.
EXTRA = {
    "qsgd(levels=4, bucket_size=8)": compjax.qsgd(levels=4, bucket_size=8),
    "int_quant(bits=8, rotate=True)": compjax.int_quant(bits=8, rotate=True),
}
COMPRESSORS = {**all_compressors(), **EXTRA}

#: (compressor, dtype) pairs of the fast suite: the one-norm and bucketed QSGD and natural
#: dithering (whose norms broke on constant inputs), and one compressor per family.
FAST = {
    ("qsgd(levels=4)", "float32"),
    ("qsgd(levels=4, bucket_size=8)", "float32"),
    ("natural_dithering(levels=7)", "bfloat16"),
    ("sign()", "float32"),
    ("terngrad()", "float16"),
    ("natural()", "float32"),
    ("int_quant(bits=8, rotate=True)", "bfloat16"),
    ("rand_k(ratio=0.01)", "float32"),
    ("top_k(ratio=0.01)", "float32"),
}

#: (compressor, input) -> (dtypes, reason): in the compiled forms XLA's CPU backend flushes
#: subnormal results to zero, and int_quant's decode ``q / s * scale`` (which XLA reassociates
#: to ``q * (scale / s)``) is subnormal for entries below about ``scale / s``: on the tiny input
#: (max|x| = 2**-125) they decode to 0 in every draw, a bias below ``s * 2**-126`` that eager
#: does not have (docs/compressors.md).  The unbiasedness check is left out there, in the
#: compiled forms only; every other check runs.
FLUSHED = {
    (spec, "tiny"): (("float32", "bfloat16"), "subnormal decodes flushed to 0 (compiled forms)")
    for spec in ("int_quant(bits=4)", "int_quant(bits=8, rotate=True)")
}


def inputs(dtype) -> dict[str, np.ndarray]:
    """Inputs of ``D`` entries, as float64 arrays whose values ``dtype`` holds exactly."""
    info = jnp.finfo(dtype)
    top, tiny, sub = float(info.max), float(info.tiny), float(info.smallest_subnormal)
    raw = {
        "zeros": [0.0, -0.0] * (D // 2),
        "normal": np.random.default_rng(0).standard_normal(D),  # inside every cast's range
        # A norm beyond the dtype, squares beyond float32, and the smallest entries beside.
        "huge": [top, -top / 2, top / 2, tiny, -sub, 0.0, 1.0, -top / 3.4] * (D // 8),
        "tiny": [tiny, -tiny, 2 * tiny, 0.0, sub, -sub, 4 * sub, tiny] * (D // 8),
    }
    return {k: np.asarray(jnp.asarray(np.asarray(v), dtype), np.float64) for k, v in raw.items()}


# -- what each compressor documents as outside a guarantee -----------------------------------

_RAND_K = "x_i d/k beyond the dtype saturates (unbiased_range: max * k/d)"
_ATOMO = "x_i / p_i beyond the dtype saturates (unbiased_range: max / 4)"
_NATURAL = "|x_i| above 2**127 rounds up to 2**128, saturated (unbiased_range: 2**127)"
_CAST = "the cast saturates at its target's largest value (docs: cast), beyond delta"
_UNDER = "below the wire type's smallest normal (docs: cast), beyond delta"
_WIDE = ("float32", "bfloat16")
_ALL = tuple(DTYPES)

#: (compressor, input) -> (dtypes, reason): the bound (omega or delta) is not claimed there.
OUTSIDE = {
    ("rand_k(ratio=0.01)", "huge"): (_ALL, _RAND_K),
    ("rand_k(ratio=0.01, shared_seed=True)", "huge"): (_ALL, _RAND_K),
    ("rand_k(k=1)", "huge"): (_ALL, _RAND_K),
    ("atomo_svd(budget=2)", "huge"): (_ALL, _ATOMO),
    ("atomo_svd(budget=2.0)", "huge"): (_ALL, _ATOMO),
    ("atomo(budget=4.0)", "huge"): (_ALL, _ATOMO),
    ("natural()", "huge"): (_WIDE, _NATURAL),
    ("chain(rand_k(ratio=0.5, shared_seed=True), natural())", "huge"): (
        _ALL,
        "natural's rounding up of x_i d/k saturates (unbiased_range: min(r_q, r_s / 2))",
    ),
    ("scaled(natural(), 8 / 9)", "huge"): (_WIDE, _NATURAL),
    ("cast('bfloat16')", "huge"): (("float32",), _CAST),
    ("cast('float16')", "huge"): (_WIDE, _CAST),
    ("cast('float8_e4m3fn')", "huge"): (_ALL, _CAST),
    ("cast('float4_e2m1fn')", "huge"): (_ALL, _CAST),
    ("int_quant(bits=8, rotate=True)", "huge"): (
        _ALL,
        "a rotated entry reaches sqrt(d') max|x| (unbiased_range: max / min(d', 1 + d'/s))",
    ),
    ("cast('float16')", "tiny"): (_WIDE, _UNDER),
    ("cast('float8_e4m3fn')", "tiny"): (_ALL, _UNDER),
    ("cast('float4_e2m1fn')", "tiny"): (_ALL, _UNDER),
}
#: (compressor, input) -> (dtypes, reason): the decode is documented as all NaN, a refusal that
#: the transformations' finite guards catch (docs/compressors.md), checked as such.
REFUSED = {
    ("int_quant(bits=8, rotate=True)", "huge"): (
        _WIDE,
        "the rotation's float32 sums overflow beyond float32's max / d': every entry decodes NaN",
    ),
}
#: Unbiased compressors that state no unbiased_range: the unbiasedness and omega checks run on
#: the normal input only.
NO_RANGE = {
    spec: "no unbiased_range stated"
    for spec in (
        "eden()",
        "eden(bits=2)",
        "eden(bits=4)",
        "eden(rounds=1)",
    )
}


def bound_claimed(spec: str, name: str, dtype_name: str) -> bool:
    """Whether ``spec`` claims its omega/delta bound (and, if unbiased, E C(x) = x) on the
    input ``name`` in ``dtype_name`` (:data:`OUTSIDE`, :data:`NO_RANGE`)."""
    dtypes, _ = OUTSIDE.get((spec, name), ((), ""))
    if dtype_name in dtypes:
        return False
    return name == "normal" or spec not in NO_RANGE


# -- the forms --------------------------------------------------------------------------------


def _round_trip(comp, key, x):
    payload = comp.compress(key, x)
    return payload, comp.decompress(payload)


def program(comp, dtype, names):
    """``f(key, xs)``: the round trips of the traced ``xs`` and of the same inputs closed over."""
    consts = tuple(jnp.asarray(inputs(dtype)[n], dtype) for n in names)

    def f(key, xs):
        traced = tuple(_round_trip(comp, key, x) for x in xs)
        return traced, tuple(_round_trip(comp, key, c) for c in consts)

    return f


def jit_vmap(f):
    """The ``jit(vmap)`` form: ``f(key, *args)`` mapped over a leading axis of keys."""
    return jax.jit(jax.vmap(f, in_axes=(0, None)))


def run_form(comp, dtype_name: str, form: str, names=None, seed: int = 0) -> dict:
    """``{(input, source): (payload of the first draw, draws (n, D) as float64, dtype)}``, the
    source ``eager`` or, in a compiled form, ``arg`` and ``const``; one program per call."""
    dtype = DTYPES[dtype_name]
    names = tuple(names or inputs(dtype))
    xs = tuple(jnp.asarray(inputs(dtype)[n], dtype) for n in names)
    n = DRAWS[form] if not comp.deterministic else 1
    keys = jax.random.split(jax.random.key(seed), n)
    out = {}
    with warnings.catch_warnings():  # concrete inputs beyond a range warn (claims: OUTSIDE)
        warnings.simplefilter("ignore", UnbiasedRangeWarning)
        _run(comp, dtype, form, names, xs, keys, out)
    return {
        k: (payload, np.stack([np.asarray(y, np.float64) for y in ys]), ys[0].dtype)
        for k, (payload, ys) in out.items()
    }


def _run(comp, dtype, form, names, xs, keys, out):
    if form == "eager":
        for name, x in zip(names, xs, strict=True):
            trips = [_round_trip(comp, k, x) for k in keys]
            out[name, "eager"] = (trips[0][0], [t[1] for t in trips])
    elif form == "jit":
        fn = jax.jit(program(comp, dtype, names))
        runs = [fn(k, xs) for k in keys]
        for s, source in enumerate(("arg", "const")):
            for i, name in enumerate(names):
                out[name, source] = (runs[0][s][i][0], [r[s][i][1] for r in runs])
    else:
        traced, consts = jit_vmap(program(comp, dtype, names))(keys, xs)
        for source, res in (("arg", traced), ("const", consts)):
            for i, name in enumerate(names):
                payload, ys = res[i]
                out[name, source] = (jax.tree.map(lambda a: a[0], payload), list(ys))


# -- the checks -------------------------------------------------------------------------------


def check_form(spec: str, dtype_name: str, form: str, results: dict, eager=None) -> list[str]:
    """The failed checks of ``results`` (:func:`run_form`), one message each, naming the
    compressor, dtype, form, source and input."""
    comp = COMPRESSORS.get(spec) or eval(spec, vars(compjax))
    dtype = DTYPES[dtype_name]
    xs = inputs(dtype)
    eps = float(jnp.finfo(dtype).eps)
    fails = []
    for (name, source), (payload, draws, out_dtype) in results.items():
        where = f"{spec} {dtype_name} {form}/{source} on {name}"
        x = xs[name]
        if out_dtype != dtype or draws.shape[1:] != x.shape:
            fails.append(f"{where}: decoded {out_dtype}{draws.shape[1:]}")
        bits = compjax.wire_bits(payload)
        if bits != comp.bits(x.shape, dtype):
            fails.append(f"{where}: {bits} bits on the wire, bits() = {comp.bits(x.shape, dtype)}")
        if dtype_name in REFUSED.get((spec, name), ((), ""))[0]:
            if not np.all(np.isnan(draws)):
                fails.append(f"{where}: a documented refusal decodes {draws[0]}, not all NaN")
            continue
        if not np.all(np.isfinite(draws)):
            fails.append(f"{where}: non-finite decode {draws[~np.isfinite(draws).all(1)][0]}")
            continue
        if name == "zeros":
            zero = 1.0 if isinstance(comp, compjax.compressors.sign.Sign) else 0.0
            if np.any(draws != zero):
                fails.append(f"{where}: zeros decode to {draws[draws != zero][:4]}")
            continue
        # Decoded values are in the dtype: an ulp of each, and float32's flushed subnormals.
        ulp = np.abs(x) * eps + float(jnp.finfo(jnp.float32).tiny)
        if comp.deterministic and eager is not None:
            first = eager[name, "eager"][1][0]
            if np.any(np.abs(draws - first) > ulp):
                fails.append(f"{where}: {draws[0]}, eager {first}")
        flushed = form != "eager" and dtype_name in FLUSHED.get((spec, name), ((), ""))[0]
        if flushed or not bound_claimed(spec, name, dtype_name):
            continue
        if comp.unbiased:
            bound = comp.omega(x.size)
            se = math.sqrt(bound * float(np.sum(x**2)) / len(draws))
            mean = draws.mean(0)
            off = np.abs(mean - x) > Z * se + ulp
            if off.any():
                fails.append(f"{where}: mean {mean[off]} of {x[off]} ({len(draws)} draws)")
        elif comp.delta(x.size) is not None:
            bound = 1.0 - comp.delta(x.size)
        else:
            continue
        err = np.sum((draws - x) ** 2, axis=1)
        sd = float(err.std(ddof=1)) / math.sqrt(len(err)) if len(err) > 1 else 0.0
        # The dtype's rounding of each decoded value adds at most ~eps sqrt(d) ||x||^2.
        allowed = (bound + 2 * eps * math.sqrt(x.size)) * float(np.sum(x**2)) + Z * sd
        allowed += float(np.sum(ulp**2))
        if err.mean() > allowed:
            fails.append(f"{where}: squared error {err.mean():.4g} > bound {allowed:.4g}")
    return fails


def check_all_forms(spec: str, dtype_name: str, names=None) -> list[str]:
    comp = COMPRESSORS[spec]
    eager = run_form(comp, dtype_name, "eager", names)
    fails = check_form(spec, dtype_name, "eager", eager, eager)
    for form in FORMS[1:]:
        fails += check_form(spec, dtype_name, form, run_form(comp, dtype_name, form, names), eager)
    return fails


def _case(spec: str, dtype_name: str):
    marks = [] if (spec, dtype_name) in FAST else [pytest.mark.slow]
    return pytest.param(spec, dtype_name, marks=marks, id=f"{spec}-{dtype_name}")


@pytest.mark.parametrize(("spec", "dtype_name"), [_case(s, d) for s in COMPRESSORS for d in DTYPES])
def test_guarantees_hold_in_every_form(spec, dtype_name):
    fails = check_all_forms(spec, dtype_name)
    assert not fails, "\n".join(fails)


def test_what_is_left_out_is_what_the_metadata_says():
    """OUTSIDE and NO_RANGE are the compressors' own metadata: an unbiased compressor's input
    is left out exactly where it exceeds ``unbiased_range``, a cast's where it exceeds the
    target's largest value or lies wholly below its smallest normal, and NO_RANGE lists the
    unbiased compressors without a range."""
    assert set(NO_RANGE) == {
        s for s, c in COMPRESSORS.items() if c.unbiased and c.unbiased_range(D) is None
    }
    assert FAST <= {(s, d) for s in COMPRESSORS for d in DTYPES}
    for dtype_name, dtype in DTYPES.items():
        for name, x in inputs(dtype).items():
            top = float(np.max(np.abs(x)))
            for spec, comp in COMPRESSORS.items():
                dtypes, _ = OUTSIDE.get((spec, name), ((), ""))
                listed = dtype_name in dtypes
                inner = getattr(comp, "inner", comp)
                if comp.unbiased or inner is not comp:
                    limit = inner.unbiased_range(D, dtype)
                    beyond = limit is not None and top > limit
                elif isinstance(comp, compjax.compressors.dense.Cast):
                    wire = jnp.finfo(comp.dtype)
                    nonzero = np.abs(x[x != 0])
                    below = nonzero.size > 0 and nonzero.max() < float(wire.tiny)
                    beyond = top > float(wire.max) or below
                else:
                    beyond = False
                assert listed == beyond, (spec, name, dtype_name, listed, beyond)


# -- the harness catches a guard that does not survive the forms ----------------------------------


def _mutated_cond(kind: str, calls: list):
    """A ``lax.cond`` that runs both branches, as ``vmap`` of a batched predicate does, and
    combines them: by select (what vmap does), by arithmetic masks (a guard written as
    ``p a + (1 - p) b``), or not at all (the true branch: no guard)."""

    def cond(pred, true_fn, false_fn, *operands):
        calls.append(kind)
        a, b = true_fn(*operands), false_fn(*operands)
        if kind == "select":
            return jax.tree.map(lambda u, v: jnp.where(pred, u, v), a, b)
        if kind == "blend":
            p = jnp.asarray(pred, jnp.float32)
            return jax.tree.map(lambda u, v: p * u + (1 - p) * v, a, b)
        return a

    return cond


@pytest.mark.parametrize(
    ("kind", "caught_in"),
    [("blend", {"eager"}), ("unguarded", {"eager", "jit_vmap"}), ("select", set())],
)
def test_the_harness_catches_a_guard_that_does_not_survive(monkeypatch, kind, caught_in):
    """QSGD's one norm is ``lax.cond(sum of squares safe, one pass, exactly scaled two passes)``
    (``qsgd.l2_norm``); its cond is made to run both branches.  Combined by arithmetic masks
    (``0 * Inf`` on the huge input), the harness fails it in the eager form, where the ops run
    one by one (compiled, XLA's simplifier turns ``convert(p) * a`` into a select); with the
    guard dropped (the one pass overflows), in both forms.  Selected, as ``vmap`` selects, the
    guard survives: the harness passes, and the decodes are the unmutated ones bit for bit."""
    calls = []
    comp = qsgd_module.qsgd(levels=4)
    names = ("huge", "normal")
    forms = ("eager", "jit_vmap")
    before = {form: run_form(comp, "float32", form, names) for form in forms}
    monkeypatch.setattr(qsgd_module.jax.lax, "cond", _mutated_cond(kind, calls))
    after = {form: run_form(comp, "float32", form, names) for form in forms}
    assert calls, "the mutated cond was not traced"
    fails = {form: check_form("qsgd(levels=4)", "float32", form, after[form]) for form in forms}
    assert {form for form in forms if fails[form]} == caught_in, fails
    for form in caught_in:
        assert any("on huge: non-finite decode" in f for f in fails[form]), fails[form]
    if not caught_in:
        for form in forms:
            chex.assert_trees_all_equal(
                {k: v[1] for k, v in after[form].items()},
                {k: v[1] for k, v in before[form].items()},
            )

"""compjax.mx (OCP microscaling): the block scale rule, the elements' rounding against
ml_dtypes, the contraction bound (holds, and is needed), wire bits, non-finite entries and
DiLoCo pseudo-gradients that a plain 4-bit cast would zero."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest

import compjax
from compjax.compressors.microscaling import mx_delta

ELEMENTS = {"float4_e2m1fn": ml_dtypes.float4_e2m1fn, "float8_e4m3fn": ml_dtypes.float8_e4m3fn}
EMAX = {"float4_e2m1fn": 2, "float8_e4m3fn": 8}
BLOCK = 32
roundtrip = jax.jit(lambda comp, x: comp(None, x), static_argnums=0)


def reference(x: np.ndarray, element: str, block: int) -> np.ndarray:
    """The MX rule in numpy: per block, scale 2**(floor(log2 amax) - emax), ml_dtypes rounding."""
    out = np.zeros_like(x, dtype=np.float32)
    limit = float(ml_dtypes.finfo(ELEMENTS[element]).max)
    for a in range(0, x.size, block):
        b = x[a : a + block].astype(np.float64)
        amax = np.max(np.abs(b))
        e = int(np.floor(np.log2(amax))) - EMAX[element] if amax > 0 else 0
        y = np.clip(b / 2.0**e, -limit, limit).astype(ELEMENTS[element]).astype(np.float64)
        out[a : a + block] = y * 2.0**e
    return out


@pytest.mark.parametrize("element", list(ELEMENTS))
def test_decode_is_the_mx_rule(element):
    """Blocks spanning eleven decades (1e-9 to 1e2) and a short last block."""
    rng = np.random.default_rng(0)
    n = 5 * BLOCK + 7
    x = rng.standard_normal(n) * 10.0 ** rng.integers(-9, 3, n // BLOCK + 1).repeat(BLOCK)[:n]
    x = x.astype(np.float32)
    got = np.asarray(roundtrip(compjax.mx(element), jnp.asarray(x)))
    np.testing.assert_array_equal(got, reference(x, element, BLOCK))
    # every block keeps its relative precision: a plain cast would zero the small blocks
    assert np.all(np.abs(got - x) <= (1 - mx_delta(element, BLOCK)) ** 0.5 * np.abs(x).max())


@pytest.mark.parametrize("element", list(ELEMENTS))
def test_contraction_holds_and_its_subnormal_term_is_needed(element):
    """||C(x) - x||^2 <= (1 - delta)||x||^2 on random and adversarial blocks; the adversarial
    block (one entry at 4 X, the rest at a quarter of the smallest subnormal step above the
    tie) reaches more than the relative-rounding term r**2 alone allows."""
    comp = compjax.mx(element)
    bound = 1.0 - comp.delta(BLOCK)
    rng = np.random.default_rng(1)
    rows = [rng.standard_normal(BLOCK) * s for s in (1e-6, 1.0, 3e4)]
    rows.append(np.full(BLOCK, 7.99) * 2.0 ** -EMAX[element])  # saturating entries
    m, emin = {"float4_e2m1fn": (1, 0), "float8_e4m3fn": (3, -6)}[element]
    tie = 2.0 ** (emin - m - 1)  # half the smallest subnormal step: rounds to 0 (even)
    adversarial = np.full(BLOCK, tie)
    adversarial[0] = 2.0 ** EMAX[element]
    rows.append(adversarial)
    ratios = []
    for row in rows:
        x = jnp.asarray(row, jnp.float32)
        err = np.sum((np.asarray(roundtrip(comp, x)) - row.astype(np.float32)) ** 2)
        ratios.append(err / np.sum(row.astype(np.float32) ** 2))
    assert max(ratios) <= bound
    r = max(
        2.0 ** -(m + 1),
        1.0 - float(ml_dtypes.finfo(ELEMENTS[element]).max) / 2 ** (EMAX[element] + 1),
    )
    if element == "float4_e2m1fn":  # the B s**2 term is needed (in float8 it is 2**-31)
        assert ratios[-1] > r**2 and ratios[-1] >= 0.55 * bound
    assert ratios[3] >= 0.9 * r**2  # the saturation term is reached


def test_delta_constants():
    assert mx_delta("float4_e2m1fn", 32) == 1 - 1 / 16 - 32 / 256
    assert mx_delta("float8_e4m3fn", 32) == pytest.approx(1 - 1 / 64 - 32 * 2.0**-36)
    assert compjax.mx(block=32).delta(7) == mx_delta("float4_e2m1fn", 7)


def test_wire_bits_come_from_the_payload():
    comp = compjax.mx("float4_e2m1fn")
    x = jnp.ones((100,), jnp.float32)
    payload = comp.compress(None, x)
    # 100 4-bit codes in 13 uint32 words, 4 scales of 8 bits
    assert compjax.wire_bits(payload) == comp.bits((100,)) == 32 * 13 + 8 * 4
    assert compjax.mx("float8_e4m3fn", block=16).bits((100,)) == 8 * 100 + 8 * 7


def test_zeros_and_non_finite_entries():
    comp = compjax.mx()
    assert np.all(np.asarray(roundtrip(comp, jnp.zeros((40,)))) == 0)
    x = jnp.asarray([1e-3, jnp.inf, -2e-3, jnp.nan] + [5e-4] * 36, jnp.float32)
    got = np.asarray(roundtrip(comp, x))
    assert np.isnan(got[1]) and np.isnan(got[3])
    # the scale is the finite entries': they decode as if the others were 0
    finite = np.isfinite(np.asarray(x))
    as_zero = np.where(finite, np.asarray(x), 0.0).astype(np.float32)
    np.testing.assert_array_equal(got[finite], reference(as_zero, "float4_e2m1fn", BLOCK)[finite])


def test_bfloat16_input_decodes_in_its_dtype():
    x = jnp.linspace(-1e-2, 1e-2, 64, dtype=jnp.bfloat16)
    got = roundtrip(compjax.mx(), x)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_array_equal(
        np.asarray(got, np.float32),
        reference(np.asarray(x, np.float32), "float4_e2m1fn", BLOCK)
        .astype(ml_dtypes.bfloat16)
        .astype(np.float32),
    )


@pytest.mark.parametrize(
    ("element", "block"), [("float5", 32), ("float4_e2m1fn", 0), ("float4_e2m1fn", True)]
)
def test_bad_arguments_are_named(element, block):
    with pytest.raises(ValueError, match="element" if element == "float5" else "block"):
        compjax.mx(element, block)


def test_diloco_pseudo_gradients_survive_where_a_plain_cast_zeroes_them():
    """One DiLoCo round (2 workers, inner SGD 1e-3): the pseudo-gradient is about 1e-3 per
    entry, below float4's smallest value 0.5.  cast('float4_e2m1fn') sends zeros (the global
    params do not move); mx sends it within the contraction bound."""
    n, h = 2, 2
    params = {"w": jnp.linspace(-1.0, 1.0, 64, dtype=jnp.float32)}
    grads = {"w": jnp.stack([jnp.linspace(0.1, 0.5, 64), jnp.linspace(-0.3, 0.7, 64)])}

    def run(comp):
        tx = compjax.diloco(optax.sgd(1e-3), optax.sgd(1.0), h, "data", compressor=comp)
        state = jax.vmap(tx.init, axis_name="data")(compjax.worker_copies(params, n))
        local = compjax.worker_copies(params, n)
        for _ in range(h):
            upd, state = jax.vmap(tx.update, axis_name="data")(grads, state, local)
            local = optax.apply_updates(local, upd)
        return compjax.global_params(state, stacked=True)["w"]

    exact = run(None)
    moved = np.asarray(exact - params["w"])
    assert np.abs(moved).max() > 1e-4
    np.testing.assert_array_equal(run(compjax.cast("float4_e2m1fn")), params["w"])
    err = np.asarray(run(compjax.mx()) - exact)
    assert np.sum(err**2) <= (1 - compjax.mx().delta(64)) * np.sum(moved**2)

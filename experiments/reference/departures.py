"""Where compjax departs from the reference code, measured on identical inputs.

``python -m experiments.reference.departures`` writes
``results/reference_departures.json`` and ``results/reference_departures.md``.

Each reference is transcribed here in numpy from its source, step for step:

* INTELLECT-1's int8 ring all-reduce (prime, ``zeroband/C``): the flat
  tensor cut in ``2 P`` chunks; every message is the chunk's codes
  ``round(x / s) + 128`` clipped to ``[0, 255]`` with ``s = 6 std / 256``
  (``std = ||x|| / sqrt(n - 1)``, not centred) and a table of the mean of the
  values in each bin; every hop re-quantises (reduce-scatter: the partial
  sum, all-gather: the decoded chunk), deterministically.
* DeepSpeed ZeRO++'s qwZ (``CUDAQuantizer``, ``quantization_utils.h``): the
  float16 shard in groups (``ceil(n / 8000)`` raised until ``8 groups``
  divides ``n``, doubled while the groups stay above 8000 entries: 4096
  entries for ``2^22``), symmetric int8 with scale ``256 / (2 max)``: codes
  ``rint(x * scale)`` clipped to ``[-128, 127]``, decoded as ``code * (1 /
  scale)`` (step ``max / 128`` in float32) into float16.
* ZeRO++'s qgZ (``all_to_all_quant_reduce``, ``quant_reduce.cu``), on one
  node of ``P`` GPUs: each worker's float16 gradient in ``max(rows, cols, P)``
  groups of symmetric int4 (step ``max / 8``), all-to-all, each owner
  dequantises the ``P`` pieces into float16, adds them in float16,
  re-quantises the sum in int4 with its own per-group scales, and decodes it.
* templar's SparseLoCo outer step: see :func:`compjax.sparseloco`'s
  ``chunk_1d``, ``merge`` and ``average``, tested against a transcription in
  ``tests/test_sparseloco.py``; here the options' effect on one problem.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.flatten_util import ravel_pytree

import compjax
from compjax.steps.param_gather import dequantize_blocks, quantize_blocks

N_BINS, RANGE_IN_SIGMAS, BUFFER_COUNT = 256, 6.0, 2  # INTELLECT-1's compression.cpp
QWZ_TARGET_GROUP = 8000  # DeepSpeed's CUDAQuantizer.target_group_size


def rel(a, ref) -> float:
    """``||a - ref|| / ||ref||`` in float64."""
    a, ref = np.asarray(a, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(a - ref) / np.linalg.norm(ref))


def samples(kind: str, shape, seed: int) -> np.ndarray:
    """float32 draws: ``"gaussian"`` (standard normal) or ``"student_t3"``."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape) if kind == "gaussian" else rng.standard_t(3, shape)
    return x.astype(np.float32)


# ---- INTELLECT-1 ---------------------------------------------------------------------------


def intellect_quantize(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(codes, lookup)``: uint8 codes of float32 ``x`` and the float32 mean of each bin."""
    x = np.asarray(x, np.float32).reshape(-1)
    std = float(np.linalg.norm(x.astype(np.float64))) / math.sqrt(x.size - 1)
    scale = np.float32(RANGE_IN_SIGMAS * std / N_BINS)
    v = (x * (np.float32(1.0) / scale)).astype(np.float64)
    rounded = np.sign(v) * np.floor(np.abs(v) + 0.5)  # std::round: half away from zero
    codes = np.clip(rounded + N_BINS // 2, 0, N_BINS - 1).astype(np.uint8)
    sums = np.bincount(codes, weights=x.astype(np.float64), minlength=N_BINS)
    counts = np.bincount(codes, minlength=N_BINS)
    lookup = np.where(counts > 0, sums / np.maximum(counts, 1), 0.0).astype(np.float32)
    return codes, lookup


def _decoded(message) -> np.ndarray:
    codes, lookup = message
    return lookup[codes.astype(np.int64)]


def intellect_ring_allreduce(xs: np.ndarray) -> np.ndarray:
    """Every rank's result of INTELLECT-1's int8 ring all-reduce (``AVG``) of ``xs[r]``:
    ``(P, d)``, ``d`` a multiple of ``2 P``."""
    p, d = xs.shape
    nb, b = BUFFER_COUNT * p, BUFFER_COUNT
    if d % nb:
        raise ValueError(f"d = {d} must be a multiple of {nb}")
    chunks = np.asarray(xs, np.float32).reshape(p, nb, -1).copy()
    sent: dict[int, dict[int, tuple]] = {}
    for step in range(1, nb + 1):  # reduce-scatter
        sent[step] = {}
        for r in range(p):
            c = (r * b - step + nb) % nb
            if step > b:
                chunks[r, c] += _decoded(sent[step - b][(r - 1) % p])
            if step <= (p - 1) * b:
                sent[step][r] = intellect_quantize(chunks[r, c])
    for r in range(p):
        for i in range(b):
            chunks[r, r * b + i] /= np.float32(p)
            chunks[r, r * b + i] = _decoded(intellect_quantize(chunks[r, r * b + i]))
    sent = {}
    for step in range(1, nb + 1):  # all-gather
        sent[step] = {}
        for r in range(p):
            c = (r * b + b - step + nb) % nb
            if step > b:
                chunks[r, c] = _decoded(sent[step - b][(r - 1) % p])
            if step <= (p - 1) * b:
                sent[step][r] = intellect_quantize(chunks[r, c])
    return chunks.reshape(p, d)


@functools.cache
def _mean_fn(comp):
    """``(xs (P, ...), key) -> (P, ...)``: compjax's compressed mean under ``vmap``."""

    def one(x, key):
        return compjax.compressed_mean(comp, key, x, "w").mean

    return jax.jit(jax.vmap(one, in_axes=(0, None), axis_name="w"))


def compjax_mean(comp, xs: np.ndarray, seed: int = 0) -> np.ndarray:
    """Worker 0's compressed mean of ``xs`` (every worker's is the same)."""
    return np.asarray(_mean_fn(comp)(jnp.asarray(xs), jax.random.key(seed))[0])


def intellect_table(workers=(4, 6, 8), chunk: int = 8192, seed: int = 0) -> list[dict]:
    """Relative error of the mean: INTELLECT-1's ring against ``compjax.int_quant(8)``."""
    rows = []
    for kind in ("gaussian", "student_t3"):
        for p in workers:
            xs = samples(kind, (p, 2 * p * chunk), seed + p)
            mean = xs.astype(np.float64).mean(0)
            ring = intellect_ring_allreduce(xs)
            rows.append(
                {
                    "data": kind,
                    "P": p,
                    "d": xs.shape[1],
                    "intellect_int8": float(np.mean([rel(o, mean) for o in ring])),
                    "intellect_ranks_differ": bool(np.any(ring[0] != ring[-1])),
                    "compjax_int_quant8": rel(compjax_mean(compjax.int_quant(8), xs, seed), mean),
                    "compjax_int_quant8_rotated": rel(
                        compjax_mean(compjax.int_quant(8, rotate=True), xs, seed), mean
                    ),
                }
            )
    return rows


# ---- float16 against bfloat16 --------------------------------------------------------------


def pseudo_gradients(workers: int = 4, steps: int = 30, seed: int = 0) -> np.ndarray:
    """``(workers, P)``: one DiLoCo round's pseudo-gradients ``theta - theta_i`` of a
    64-256-10 MLP after ``steps`` AdamW steps (lr 1e-3, weight decay 0.1) on each worker's
    own batches of a teacher's labels, flattened."""
    key = jax.random.key(seed)
    k1, k2, k3 = jax.random.split(key, 3)
    params = {
        "w1": jax.random.normal(k1, (64, 256)) / 8.0,
        "b1": jnp.zeros(256),
        "w2": jax.random.normal(k2, (256, 10)) / 16.0,
        "b2": jnp.zeros(10),
    }
    teacher = jax.random.normal(k3, (64, 10))

    def loss(p, x):
        logits = jax.nn.relu(x @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]
        labels = jnp.argmax(x @ teacher, axis=1)
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    opt = optax.adamw(1e-3, weight_decay=0.1)

    @jax.jit
    def train(key):
        def step(carry, k):
            p, s = carry
            g = jax.grad(loss)(p, jax.random.normal(k, (32, 64)))
            u, s = opt.update(g, s, p)
            return (optax.apply_updates(p, u), s), None

        (p, _), _ = jax.lax.scan(step, (params, opt.init(params)), jax.random.split(key, steps))
        return ravel_pytree(jax.tree.map(lambda a, b: a - b, params, p))[0]

    keys = jax.random.split(jax.random.key(seed + 1), workers)
    return np.stack([np.asarray(train(k)) for k in keys]).astype(np.float32)


def half_precision_table(seed: int = 0, steps: int = 30) -> dict:
    """The mean of one round's pseudo-gradients through ``compjax.cast`` in float16 and
    bfloat16 (the all-reduce sums in the wire dtype), against the float32 mean."""
    deltas = pseudo_gradients(steps=steps, seed=seed)
    mean = deltas.astype(np.float64).mean(0)
    out = {"P": deltas.shape[0], "d": deltas.shape[1]}
    out["max_abs_entry"] = float(np.abs(deltas).max())
    out["entries_below_float16_normal"] = float(np.mean(np.abs(deltas) < 2.0**-14))
    for name in ("float16", "bfloat16"):
        out[name] = rel(compjax_mean(compjax.cast(name), deltas, seed), mean)
    return out


# ---- SparseLoCo ----------------------------------------------------------------------------

SPARSELOCO_VARIANTS = {
    "compjax default": {},
    "chunk_1d=64": {"chunk_1d": 64},
    "median_norm_clip": {"merge": "median_norm_clip"},
    "average=senders": {"average": "senders"},
    "median_norm_clip + senders": {"merge": "median_norm_clip", "average": "senders"},
    "templar (all three)": {"chunk_1d": 64, "merge": "median_norm_clip", "average": "senders"},
}


def sparseloco_table(workers=4, sync_every=10, rounds=10, seed=0, variants=None) -> list[dict]:
    """One problem (a 64-256-10 MLP on a teacher's labels, inner AdamW 1e-3, each worker its
    own batches): validation loss after ``rounds`` rounds, and how far the first round's
    outer update is from the default's, for each set of the reference's options."""
    key = jax.random.key(seed)
    k1, k2, k3, kx, kv = jax.random.split(key, 5)
    params = {
        "w1": jax.random.normal(k1, (64, 256)) / 8.0,
        "b1": jnp.zeros(256),
        "w2": jax.random.normal(k2, (256, 10)) / 16.0,
        "b2": jnp.zeros(10),
    }
    teacher = jax.random.normal(k3, (64, 10))

    def loss(p, x):
        logits = jax.nn.relu(x @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]
        labels = jnp.argmax(x @ teacher, axis=1)
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    steps = sync_every * rounds
    xs = jax.random.normal(kx, (steps, workers, 32, 64))
    xv = jax.random.normal(kv, (2048, 64))
    rows, first = [], {}
    for name in variants or SPARSELOCO_VARIANTS:
        options = SPARSELOCO_VARIANTS[name]
        tx = compjax.sparseloco(optax.adamw(1e-3, weight_decay=0.1), sync_every, "w", **options)

        def step(p, s, x, tx=tx):
            u, s = tx.update(jax.grad(loss)(p, x), s, p)
            return optax.apply_updates(p, u), s

        vstep = jax.jit(jax.vmap(step, axis_name="w"))
        p = compjax.worker_copies(params, workers)
        s = jax.vmap(lambda _, tx=tx: tx.init(params))(jnp.arange(workers))
        for t in range(steps):
            p, s = vstep(p, s, xs[t])
            if t + 1 == sync_every:
                theta = compjax.global_params(s, stacked=True)
                first[name] = ravel_pytree(jax.tree.map(lambda a, b: a - b, theta, params))[0]
        theta = compjax.global_params(s, stacked=True)
        rows.append({"variant": name, "options": options, "val_loss": float(loss(theta, xv))})
    base = np.asarray(first["compjax default"])
    for row in rows:
        row["first_update_rel_diff"] = rel(np.asarray(first[row["variant"]]), base)
    return rows


# ---- ZeRO++ --------------------------------------------------------------------------------


def qwz_groups(numel: int) -> int:
    """DeepSpeed's ``CUDAQuantizer.quantize`` group count for a shard of ``numel`` entries."""
    groups = math.ceil(numel / QWZ_TARGET_GROUP)
    while groups < numel and numel % (8 * groups):
        groups += 1
    while numel % (8 * groups * 2) == 0 and numel / groups > QWZ_TARGET_GROUP:
        groups *= 2
    return groups


def ds_quantize(x: np.ndarray, groups: int, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """DeepSpeed's symmetric quantizer on float16 ``x`` in ``groups`` consecutive groups:
    ``(codes, steps)`` with ``steps = 1 / scale`` in float32, ``scale = 2^bits / (2 max)``."""
    g = np.asarray(x, np.float16).reshape(groups, -1).astype(np.float32)
    top = np.max(np.abs(g), axis=1)
    scale = np.where(top == 0, np.float32(1.0), np.float32(1 << bits) / (np.float32(2) * top))
    scale = scale.astype(np.float32)
    lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    codes = np.clip(np.rint(g * scale[:, None]), lo, hi).astype(np.int8)
    return codes, (np.float32(1.0) / scale).astype(np.float32)


def ds_dequantize(codes: np.ndarray, steps: np.ndarray) -> np.ndarray:
    """``code * step`` in float32, rounded to float16, flattened."""
    return (codes.astype(np.float32) * steps[:, None]).astype(np.float16).reshape(-1)


def qwz(w: np.ndarray) -> np.ndarray:
    """ZeRO++'s qwZ round trip of a float16 shard: the decoded float16 weights."""
    flat = np.asarray(w, np.float16).reshape(-1)
    return ds_dequantize(*ds_quantize(flat, qwz_groups(flat.size), 8)).reshape(np.shape(w))


def qgz_mean(grads: np.ndarray) -> np.ndarray:
    """ZeRO++'s qgZ on one node of ``P`` workers: the float32 mean (the decoded float16 sum
    divided by ``P``) of float16 gradients ``(P, rows, cols)``, flattened."""
    p, rows, cols = grads.shape
    groups = max(rows, cols, p)
    if groups % p:
        raise ValueError(f"{groups} groups do not split over {p} workers")
    flat = np.asarray(grads, np.float16).reshape(p, -1)
    decoded = np.stack([ds_dequantize(*ds_quantize(g, groups, 4)) for g in flat])
    total = np.zeros(flat.shape[1], np.float16)
    for piece in decoded:  # float16 additions, each correctly rounded
        total = (total.astype(np.float64) + piece.astype(np.float64)).astype(np.float16)
    resent = ds_dequantize(*ds_quantize(total, groups, 4))  # the owners' own groups, int4 again
    return resent.astype(np.float32) / np.float32(p)


def zero_pp_table(shape=(1024, 4096), workers: int = 8, seed: int = 0) -> dict:
    """qwZ against ``fsdp(gather="int8")``'s blocks on identical float16-representable
    weights, and qgZ against ``int_quant(4)``'s mean on identical gradients."""
    w = (0.02 * samples("gaussian", shape, seed)).astype(np.float16)
    w32 = w.astype(np.float32)
    weights = {"numel": int(w.size), "qwz_group": int(w.size // qwz_groups(w.size))}
    weights["qwz_int8"] = rel(qwz(w), w32)
    for block in (256, 4096):
        codes, steps = quantize_blocks(jnp.asarray(w32), block)
        weights[f"compjax_int8_block{block}"] = rel(
            dequantize_blocks(codes, steps, shape, jnp.float32), w32
        )
    grads = {"P": workers, "shape": list(shape), "qgz_group": shape[0] * shape[1] // max(shape)}
    for kind in ("gaussian", "student_t3"):
        g = samples(kind, (workers, *shape), seed + 1).astype(np.float16)
        mean = g.astype(np.float64).mean(0).reshape(-1)
        grads[f"{kind}_qgz_int4"] = rel(qgz_mean(g), mean)
        got = compjax_mean(compjax.int_quant(4), g.astype(np.float32).reshape(workers, -1), seed)
        grads[f"{kind}_compjax_int_quant4"] = rel(got, mean)
        flat = g.astype(np.float32).reshape(workers, -1)
        got = compjax_mean(compjax.int_quant(4, rotate=True), flat, seed)
        grads[f"{kind}_compjax_int_quant4_rotated"] = rel(got, mean)
    return {"weights": weights, "gradients": grads}


# ---- the report ----------------------------------------------------------------------------


def measure(small: bool = False, seed: int = 0) -> dict:
    """Every table; ``small``: sizes for a test (seconds)."""
    return {
        "intellect_int8": intellect_table(
            workers=(4,) if small else (4, 6, 8), chunk=1024 if small else 8192, seed=seed
        ),
        "half_precision": half_precision_table(seed=seed),
        "sparseloco": sparseloco_table(rounds=2 if small else 10, seed=seed),
        "zero_pp": zero_pp_table(shape=(256, 512) if small else (1024, 4096), seed=seed),
    }


def _table(rows: list[dict], cols: list[str]) -> list[str]:
    fmt = lambda v: f"{v:.3g}" if isinstance(v, float) else str(v)  # noqa: E731
    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    return out + ["| " + " | ".join(fmt(r[c]) for c in cols) + " |" for r in rows]


def markdown(res: dict) -> str:
    """The report's markdown."""
    lines = ["# Reference departures, measured", "", "## INTELLECT-1 int8 ring vs int_quant(8)", ""]
    cols = ["data", "P", "d", "intellect_int8", "compjax_int_quant8", "compjax_int_quant8_rotated"]
    lines += _table(res["intellect_int8"], cols)
    h = res["half_precision"]
    lines += ["", "## float16 vs bfloat16 pseudo-gradient exchange", ""]
    lines += _table([h], ["P", "d", "max_abs_entry", "float16", "bfloat16"])
    lines += ["", "## SparseLoCo: the reference's options", ""]
    lines += _table(res["sparseloco"], ["variant", "val_loss", "first_update_rel_diff"])
    z = res["zero_pp"]
    lines += ["", "## ZeRO++ qwZ vs fsdp(gather='int8')", ""]
    lines += _table([z["weights"]], list(z["weights"]))
    lines += ["", "## ZeRO++ qgZ vs int_quant(4)", ""]
    lines += _table([z["gradients"]], [k for k in z["gradients"] if k != "shape"])
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """``python -m experiments.reference.departures [--small]``: write the results."""
    parser = argparse.ArgumentParser(prog="python -m experiments.reference.departures")
    parser.add_argument("--small", action="store_true", help="sizes for a test (seconds)")
    res = measure(small=parser.parse_args(argv).small)
    out = Path("results")
    out.mkdir(exist_ok=True)
    (out / "reference_departures.json").write_text(json.dumps(res, indent=1))
    (out / "reference_departures.md").write_text(markdown(res))
    print(markdown(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Local SGD (DiLoCo's Algorithm 1 with the plain outer step): pooled SGD at ``H = 1``, the
workers' average at every synchronisation for ``H > 1``.

``compjax.diloco(optax.sgd(lr), optax.sgd(1.0), H, "data")`` with the exact mean
(``compressor=None``): every worker takes ``H`` SGD steps on its own params and its own
data, then the pseudo-gradients ``Delta_i = theta - theta_i`` are averaged and the outer
SGD step with learning rate 1 gives ``theta <- theta - mean_i Delta_i = mean_i theta_i``:

* ``H = 1``: ``theta_i = theta - lr g_i`` with ``g_i`` the worker's gradient at ``theta``,
  so ``theta <- theta - lr mean_i g_i``: data-parallel SGD on the mean gradient, which for
  equal batch sizes is SGD on the pooled batch;
* ``H > 1``: local SGD / FedAvg (Stich 2019; McMahan et al. 2017): ``theta`` becomes the
  average of the workers' params at the end of the round, and every worker restarts from
  it.  The update returned at a sync is ``theta - params``, so a worker's params after
  ``optax.apply_updates`` are ``theta`` up to the float32 rounding of that addition:
  at most half an ulp of the update plus half an ulp of the result.

The checks run the library's transformation on ``n = 4`` workers simulated by
``jax.vmap(axis_name="data")`` on a heterogeneous least-squares problem (each worker's
targets come from its own linear model), a new mini-batch per worker and step, and compare
with float64 numpy: SGD on the pooled batch, and local SGD with the workers' average.  The
learning rate is a power of two, so the inner step ``-lr g`` is exact in float32 and the
rounding of the average can be bounded operation by operation.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

import compjax
from proofs_checks import check, result
from proofs_checks._common import fmt

SOURCE = "Douillard et al. 2023 (DiLoCo), Alg. 1"
AXIS = "data"
N_WORKERS = 4
D_IN, D_OUT, ROWS = 5, 3, 8  # a linear model 5 -> 3, 8 rows per worker per step
LR = 0.125  # a power of two: -lr * g is exact in float32
P0 = {
    "w": np.linspace(-0.5, 0.5, D_IN * D_OUT, dtype=np.float32).reshape(D_IN, D_OUT),
    "b": np.zeros(D_OUT, np.float32),
}
TRAJECTORY_TOL = 1e-5  # relative to max |theta|: float32 rounding accumulated over the run
AVERAGE_ULPS = 6  # float32 roundings of one sync, in ulps of the magnitudes (see _average_ulps)
MIN_SPREAD = 1e-2  # the workers' round-end params differ by at least this (relative)


def loss(p, x, y):
    """Half the mean squared error of the linear model on a batch."""
    return 0.5 * jnp.mean(jnp.sum((x @ p["w"] + p["b"] - y) ** 2, axis=-1))


def np_grad(p, x, y):
    """The gradient of :func:`loss` in float64."""
    r = x @ p["w"] + p["b"] - y
    return {"w": x.T @ r / len(x), "b": r.sum(0) / len(x)}


def batches(steps: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``(x, y)`` of shapes ``(steps, n, ROWS, D_IN)`` and ``(steps, n, ROWS, D_OUT)``: worker
    ``i``'s targets come from its own model ``W + W_i`` with offset ``i - 1.5``."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((D_IN, D_OUT))
    w_i = 0.5 * rng.standard_normal((N_WORKERS, D_IN, D_OUT))
    x = rng.standard_normal((steps, N_WORKERS, ROWS, D_IN))
    offset = (np.arange(N_WORKERS) - 1.5)[:, None, None]
    y = np.einsum("tnrd,nde->tnre", x, w + w_i) + offset
    y = y + 0.1 * rng.standard_normal(y.shape)
    return x.astype(np.float32), y.astype(np.float32)


def simulate(h: int, x: np.ndarray, y: np.ndarray) -> dict[str, dict[str, np.ndarray]]:
    """``compjax.diloco`` local SGD with ``sync_every=h`` on ``n`` workers (vmap), one step
    per batch.

    Returns, per step ``t`` and worker ``i`` (leaves ``(steps, n, *shape)``): ``grads``, the
    worker's gradient at its params; ``updates``, what the transformation returned;
    ``params``, the worker's params after ``optax.apply_updates``; ``theta``, the global
    params of its state.
    """
    tx = compjax.diloco(optax.sgd(LR), optax.sgd(1.0), h, AXIS)

    def worker(xs, ys):
        p0 = jax.tree.map(jnp.asarray, P0)

        def body(carry, batch):
            p, s = carry
            g = jax.grad(loss)(p, *batch)
            u, s = tx.update(g, s, p)
            new = optax.apply_updates(p, u)
            return (new, s), (g, u, new, s.global_params)

        _, out = jax.lax.scan(body, (p0, tx.init(p0)), (xs, ys))
        return out

    run = jax.jit(jax.vmap(worker, in_axes=1, axis_name=AXIS))
    names = ("grads", "updates", "params", "theta")
    out = run(jnp.asarray(x), jnp.asarray(y))
    return {
        name: {k: np.moveaxis(np.asarray(v), 0, 1) for k, v in tree.items()}
        for name, tree in zip(names, out, strict=True)
    }


def pooled_sgd(x: np.ndarray, y: np.ndarray) -> list[dict[str, np.ndarray]]:
    """Float64 SGD on the pooled batch of all workers: the params after every step."""
    theta = {k: v.astype(np.float64) for k, v in P0.items()}
    x, y = x.astype(np.float64), y.astype(np.float64)
    out = []
    for t in range(len(x)):
        g = np_grad(theta, x[t].reshape(-1, D_IN), y[t].reshape(-1, D_OUT))
        theta = {k: theta[k] - LR * g[k] for k in theta}
        out.append(theta)
    return out


def local_sgd(x: np.ndarray, y: np.ndarray, h: int | None) -> list[list[dict[str, np.ndarray]]]:
    """Float64 local SGD: each worker's params after every step; every ``h``-th step the
    workers restart from their average (``None``: never)."""
    theta = {k: v.astype(np.float64) for k, v in P0.items()}
    workers = [theta] * N_WORKERS
    out = []
    x, y = x.astype(np.float64), y.astype(np.float64)
    for t in range(len(x)):
        steps = [(p, np_grad(p, x[t, i], y[t, i])) for i, p in enumerate(workers)]
        workers = [{k: p[k] - LR * g[k] for k in p} for p, g in steps]
        if h is not None and (t + 1) % h == 0:
            theta = {k: np.mean([p[k] for p in workers], axis=0) for k in theta}
            workers = [theta] * N_WORKERS
        out.append(workers)
    return out


def _max_abs(tree) -> float:
    return max(float(np.max(np.abs(v))) for v in tree.values())


def _at(tree, t: int) -> dict[str, np.ndarray]:
    """Step ``t`` of a run's leaves."""
    return {k: v[t] for k, v in tree.items()}


def _stack(workers) -> dict[str, np.ndarray]:
    """A list of workers' params, stacked on a leading worker axis."""
    return {k: np.stack([w[k] for w in workers]) for k in P0}


def _deviation(got, ref) -> float:
    """``max |got - ref|`` over leaves (``got`` may carry leading axes) over ``max |ref|``."""
    worst = max(float(np.max(np.abs(got[k] - ref[k]))) for k in ref)
    return worst / _max_abs(ref)


def _before(run) -> dict[str, np.ndarray]:
    """Each worker's params before every step: ``P0``, then the previous step's."""
    return {
        k: np.concatenate([np.broadcast_to(P0[k], (1, N_WORKERS, *P0[k].shape)), v[:-1]])
        for k, v in run["params"].items()
    }


def _average_ulps(run, t: int) -> float:
    """At sync step ``t``: ``max |theta_new - mean_i theta_i^end|`` in ulps of the magnitudes.

    ``theta_i^end = params_i - lr g_i`` (float64 from the library's float32 params and
    gradients; exact, as ``lr`` is a power of two) is worker ``i``'s params after the round's
    last inner step.  In float32 the library rounds the inner step (half an ulp of
    ``M = max(|theta|, |theta_i^end|)``), each pseudo-gradient ``theta - theta_i^end``
    (``|.| <= 2M``: one ulp of ``M``), three additions of the mean's sum (partial sums
    ``<= 8M``: four ulps each, ``/4``: three ulps) and the outer step (one ulp): at most
    ``AVERAGE_ULPS = 6`` ulps of ``M``, entry by entry.
    """
    before = _before(run)
    worst = 0.0
    for k in P0:
        theta_old = run["theta"][k][t - 1, 0] if t else P0[k]
        local = before[k][t].astype(np.float64) - LR * run["grads"][k][t].astype(np.float64)
        ref = local.mean(0)
        m = np.maximum(np.abs(theta_old), np.abs(local).max(0)).astype(np.float32)
        err = np.abs(run["theta"][k][t].astype(np.float64) - ref)  # every worker's theta
        worst = max(worst, float(np.max(err / np.spacing(m))))
    return worst


def _spread(run, t: int) -> float:
    """At sync step ``t``: ``max_{i,j} |theta_i^end - theta_j^end|`` over ``max |theta|``."""
    before = _before(run)
    worst = 0.0
    for k in P0:
        local = before[k][t].astype(np.float64) - LR * run["grads"][k][t].astype(np.float64)
        worst = max(worst, float(np.max(local.max(0) - local.min(0))))
    return worst / _max_abs({k: v[0] for k, v in _at(run["theta"], t).items()})


def _sync_rounding(run, syncs) -> tuple[float, float, float, float, bool]:
    """After every sync in ``syncs``: the worst ``|params_i - theta| / (ulp(u_i)/2 +
    ulp(params_i)/2)`` (``u_i`` the update returned), the largest ``|params_i - theta|`` and
    ``|params_i - params_j|`` in ulps of ``theta``, the fraction of entries exactly
    ``theta``, and whether ``theta`` is the same, bit for bit, on every worker."""
    ratio, ulps, pair, exact, total, same = 0.0, 0.0, 0.0, 0, 0, True
    for k in P0:
        for t in syncs:
            theta = run["theta"][k][t]
            same &= bool(np.all(theta == theta[:1]))
            p = run["params"][k][t]
            err = np.abs(p.astype(np.float64) - theta.astype(np.float64))
            bound = 0.5 * np.spacing(np.abs(run["updates"][k][t])) + 0.5 * np.spacing(np.abs(p))
            ratio = max(ratio, float(np.max(err / bound)))
            unit = np.spacing(np.abs(theta[0]))
            ulps = max(ulps, float(np.max(err / unit)))
            pair = max(pair, float(np.max((p.max(0) - p.min(0)) / unit)))
            exact += int(np.sum(err == 0))
            total += err.size
    return ratio, ulps, pair, exact / total, same


def _syncs(steps: int, h: int) -> list[int]:
    return [t for t in range(steps) if (t + 1) % h == 0]


@check
def local_sgd_identities(fast: bool):
    steps_1 = 8 if fast else 40
    rounds = {4: 3} if fast else {4: 10, 7: 4}  # H: full rounds, then one step into the next

    # (a) H = 1: pooled data-parallel SGD.
    x, y = batches(steps_1, seed=0)
    run_1 = simulate(1, x, y)
    pooled = pooled_sgd(x, y)
    dev_1 = max(
        _deviation(_at(run_1[name], t), pooled[t])
        for name in ("params", "theta")
        for t in range(steps_1)
    )
    step_ulps = max(_average_ulps(run_1, t) for t in range(steps_1))
    apart = local_sgd(x, y, None)  # the same workers, never averaged
    alt = max(_deviation(_stack(apart[t]), pooled[t]) for t in range(steps_1))
    rows = [
        result(
            "DiLoCo with H = 1, the exact mean, inner SGD(lr) and outer SGD(1) is data-parallel "
            "SGD on the mean gradient, at every step",
            SOURCE + "; H = 1",
            f"max |θ_t − θ_t^pooled|/max|θ^pooled| = {fmt(dev_1, 3)} (global params and every "
            f"worker's, {steps_1} steps); θ_t+1 vs mean_i (θ_i,t − lr g_i): ≤ {fmt(step_ulps, 3)} "
            f"ulps",
            f"≤ {fmt(TRAJECTORY_TOL)} (float32 over the run); ≤ {AVERAGE_ULPS} ulps per step",
            dev_1 <= TRAJECTORY_TOL and step_ulps <= AVERAGE_ULPS,
            f"compjax.diloco(optax.sgd({LR}), optax.sgd(1.0), sync_every=1, 'data') on "
            f"{N_WORKERS} workers under jax.vmap(axis_name='data'), least squares "
            f"{D_IN} → {D_OUT} (kernel and bias) with each worker's targets from its own model, "
            f"{ROWS} new rows per worker and step; reference: float64 SGD on the pooled "
            f"{N_WORKERS * ROWS} rows. Per step, θ_t+1 against the float64 mean of the workers' "
            f"own θ_i − lr g_i (their float32 params and gradients), in ulps of "
            f"max(|θ|, |θ_i − lr g_i|). The same workers never averaged (float64 local SGD) "
            f"deviate from pooled SGD by {fmt(alt, 3)}.",
        )
    ]

    # (b) H > 1: local SGD / FedAvg.
    traj, avg_ulps, spread, still, parts = 0.0, 0.0, np.inf, True, []
    sync_rows = [("H = 1", run_1, list(range(steps_1)))]
    for h, n_rounds in rounds.items():
        steps = h * n_rounds + 1
        x, y = batches(steps, seed=h)
        run = simulate(h, x, y)
        ref = local_sgd(x, y, h)
        dev = max(_deviation(_at(run["params"], t), _stack(ref[t])) for t in range(steps))
        syncs = _syncs(steps, h)
        ulps = max(_average_ulps(run, t) for t in syncs)
        spr = min(_spread(run, t) for t in syncs)
        # Between syncs the global params do not move, bit for bit.
        for t in set(range(1, steps)) - set(syncs):
            still &= all(np.array_equal(run["theta"][k][t], run["theta"][k][t - 1]) for k in P0)
        traj, avg_ulps, spread = max(traj, dev), max(avg_ulps, ulps), min(spread, spr)
        parts.append(
            f"H = {h} ({n_rounds} rounds and a step): θ vs mean_i θ_i^end ≤ {fmt(ulps, 3)} ulps, "
            f"workers vs float64 local SGD {fmt(dev, 3)}, round-end spread ≥ {fmt(spr, 3)}"
        )
        sync_rows.append((f"H = {h}", run, syncs))
    rows.append(
        result(
            "DiLoCo with H > 1 and outer SGD(1) is local SGD (FedAvg): after each sync the "
            "global params are the average of the workers' params at the end of the round",
            SOURCE + "; Stich 2019; McMahan et al. 2017",
            "; ".join(parts),
            f"≤ {AVERAGE_ULPS} ulps at every sync; ≤ {fmt(TRAJECTORY_TOL)} at every step; "
            f"spread ≥ {fmt(MIN_SPREAD)}; θ unchanged between syncs",
            avg_ulps <= AVERAGE_ULPS and traj <= TRAJECTORY_TOL and spread >= MIN_SPREAD and still,
            f"compjax.diloco(optax.sgd({LR}), optax.sgd(1.0), H, 'data'), same problem and "
            f"workers (new data per H). θ_i^end = θ_i − lr g_i from the library's float32 params "
            f"and gradients at the round's last step, averaged in float64; ulps of "
            f"M = max(|θ|, |θ_i^end|) per entry: the inner step (½), the pseudo-gradient (1), "
            f"the 4-term mean (3) and the outer step (1) bound the float32 rounding by "
            f"{AVERAGE_ULPS}. Every worker's params at every step against float64 local SGD "
            f"(relative to max|θ|). Spread: max_ij |θ_i^end − θ_j^end|/max|θ| at the round's "
            f"end, so the average is not any one worker's params. θ (the state's global "
            f"params) is bit-identical across the steps of a round.",
        )
    )

    # (c) After every sync each worker holds theta, to one rounding of the additive update.
    ratio, ulps, pair, exact, same, parts = 0.0, 0.0, 0.0, 1.0, True, []
    for label, run, syncs in sync_rows:
        r, u, p, e, s = _sync_rounding(run, syncs)
        ratio, ulps, pair = max(ratio, r), max(ulps, u), max(pair, p)
        exact, same = min(exact, e), same and s
        parts.append(f"{label}: {fmt(r, 3)} of the bound, {fmt(u, 3)} ulps, {fmt(e, 3)} exact")
    rows.append(
        result(
            "after a sync every worker holds the global params, to one float32 rounding of the "
            "additive update, and the global params are the same on every worker",
            SOURCE + " (every worker restarts from θ)",
            "max |θ_i − θ|/(½ulp(u_i) + ½ulp(θ_i)): "
            + "; ".join(parts)
            + f"; max |θ_i − θ_j| = {fmt(pair, 3)} ulps of θ; θ identical: {same}",
            "≤ 1 (the rounding of θ_i + (θ − θ_i)); θ bit-identical on every worker",
            ratio <= 1 and same,
            "θ_i = optax.apply_updates(params_i, u_i) with u_i the update the library returns "
            "at the sync (θ − params_i, rounded); its float32 rounding is at most half an ulp "
            "of u_i plus half an ulp of the sum. Exact: the fraction of entries equal to θ "
            "(where params_i is within a factor 2 of θ, Sterbenz). Over every step of the "
            "H = 1 run and every sync of the H > 1 runs.",
        )
    )
    return rows

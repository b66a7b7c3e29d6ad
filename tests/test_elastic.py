"""compjax.elastic: the rules and the synchronizer and island logic in this process (no Ray),
then real runs on Ray (``elastic_worker.py``, started inside a network namespace of our own
with only its loopback up, as root; skipped with the reason elsewhere).

The Ray runs share one Ray instance (one worker process runs every scenario, module fixture):
no faults equals ``compjax.diloco`` under ``jax.vmap`` over the same islands and batches; a
killed island is absent and, restarted, present again; a killed synchronizer loses no merged
round (the final parameters are bit-identical to the clean run's); a poisoned island makes the
mean diverge and not the median-norm clip; NaN pushes are refused; a raising ``batches`` and a
round that can never merge give clear errors.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import elastic_worker as ew
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import compjax
import compjax.elastic as ce
from compjax import merges
from compjax.steps import elastic_faults as ef
from compjax.steps import elastic_rounds as er
from compjax.steps.elastic_island import IslandConfig, IslandCore
from compjax.steps.elastic_sync import SyncConfig, SyncCore

HERE = Path(__file__).resolve().parent


# -- faults ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "make, field",
    [
        (lambda: ce.Kill(-1, 0), "Kill.island"),
        (lambda: ce.Kill(0, 2, restart_at_round=2), "Kill.restart_at_round"),
        (lambda: ce.Slow(0, 0.5), "Slow.factor"),
        (lambda: ce.Slow(0, float("inf")), "Slow.factor"),
        (lambda: ce.Poison(0, "x"), "Poison.scale"),
        (lambda: ce.Poison(0, 2.0, from_round=-1), "Poison.from_round"),
        (lambda: ce.KillSynchronizer(True), "KillSynchronizer.at_round"),
    ],
)
def test_a_fault_that_cannot_happen_is_refused_naming_its_field(make, field):
    with pytest.raises(ValueError, match=field):
        make()


@pytest.mark.parametrize(
    "faults, match",
    [
        ((ce.Kill(3, 0),), "island must be < islands"),
        ((ce.Kill(0, 5),), "at_round must be < rounds"),
        ((ce.Kill(0, 1, restart_at_round=5),), "restart_at_round must be < rounds"),
        ((ce.Slow(1, 2.0), ce.Slow(1, 3.0)), "two Slow faults for island 1"),
        ((ce.KillSynchronizer(1), ce.KillSynchronizer(2)), "two KillSynchronizer"),
        (("kill",), "faults must hold"),
    ],
)
def test_faults_are_checked_against_the_run(faults, match):
    with pytest.raises(ValueError, match=match):
        ef.check_faults(faults, islands=3, rounds=5)


def test_each_island_reads_only_its_own_faults():
    faults = ef.check_faults(
        (ce.Kill(1, 2, 4), ce.Slow(0, 3.0), ce.Poison(2, -1.0, 3), ce.KillSynchronizer(1)), 3, 5
    )
    assert (ef.kill_round(faults, 1), ef.restart_round(faults, 1)) == (2, 4)
    assert ef.kill_round(faults, 0) is None and ef.restart_round(faults, 0) is None
    assert (ef.slow_factor(faults, 0), ef.slow_factor(faults, 1)) == (3.0, 1.0)
    assert [ef.poison_scale(faults, 2, r) for r in (2, 3, 4)] == [None, -1.0, -1.0]
    assert ef.poison_scale(faults, 0, 4) is None
    assert ef.synchronizer_kill_round(faults) == 1 and ef.synchronizer_kill_round(()) is None


# -- round rules -----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "pushed, live, quorum, grace, waited, took, ready",
    [
        (1, 3, 2, 10.0, 99.0, 1.0, False),  # no quorum: never
        (2, 3, 2, 10.0, 9.9, 1.0, False),  # quorum, within the grace
        (2, 3, 2, 10.0, 10.0, 1.0, True),  # the grace is over
        (2, 2, 2, 10.0, 0.0, 1.0, True),  # every live island pushed
        (2, 3, 2, 0.0, 0.0, 1.0, True),  # no grace
        (2, 3, 2, None, 0.49, 1.0, False),  # adaptive: at least MIN_GRACE_S
        (2, 3, 2, None, 0.5, 1.0, True),
        (2, 3, 2, None, 2.4, 10.0, False),  # adaptive: a quarter of the quorum's time
        (2, 3, 2, None, 2.5, 10.0, True),
    ],
)
def test_quorum_and_grace(pushed, live, quorum, grace, waited, took, ready):
    assert er.grace_over(pushed, live, quorum, grace, waited, took) is ready


def test_late_contributions_are_weighted_by_staleness_then_dropped():
    assert er.MAX_STALENESS == 1
    assert er.weight(8, 0) == 8.0 and er.weight(8, 1) == 4.0 and er.weight(8, 2) is None


@pytest.mark.parametrize("merge", ["mean", "median_norm_clip", "trimmed_mean"])
def test_zero_weight_padding_leaves_every_merge_unchanged(merge):
    rng = np.random.default_rng(0)
    rows = [{"a": rng.normal(size=(3, 2)).astype(np.float32)} for _ in range(4)]
    weights = [1.0, 2.0, 1.0, 3.0]
    fn = merges.merger(merge, 0.2)
    tight, w = er.stacked(rows, weights, 4)
    padded, wp = er.stacked(rows, weights, 7)
    assert wp.tolist() == [*weights, 0, 0, 0] and padded["a"].shape == (7, 3, 2)
    np.testing.assert_allclose(fn(padded, wp)["a"], fn(tight, w)["a"], rtol=1e-6, atol=1e-7)


def test_merger_refuses_unknown_merges_and_trims():
    with pytest.raises(ValueError, match="merge must be one of"):
        merges.merger("median", 0.1)
    with pytest.raises(ValueError, match="trim must be a fraction in"):
        merges.merger("trimmed_mean", 0.5)


# -- the synchronizer, in this process -------------------------------------------------------
THETA = {"w": np.ones((4,), np.float32), "b": np.zeros((2,), np.float32)}


def sync_core(tmp_path, **kw) -> SyncCore:
    config = dict(
        params=THETA, outer=optax.sgd(1.0), rounds=4, islands=3, min_quorum=2, grace_s=0.0,
        merge="mean", trim=0.1, compressor=None, checkpoint_dir=str(tmp_path / "ck"),
        started_at=0.0,
    )  # fmt: skip
    return SyncCore(SyncConfig(**{**config, **kw}))


def delta(value: float):
    return jax.tree.map(lambda a: np.full_like(a, value), THETA)


def test_a_round_merges_its_quorum_weighted_by_tokens(tmp_path):
    core = sync_core(tmp_path)
    assert core.push(0, 0, delta(1.0), 2) == "pending" and not core.ready()
    assert core.push(2, 0, delta(4.0), 1) == "pending" and core.ready()
    record = core.merge()
    # outer SGD(1): theta - (2 * 1 + 1 * 4) / 3
    np.testing.assert_allclose(core.theta["w"], 1.0 - 2.0)
    assert (record.round, record.merged, record.tokens, record.bits) == (0, (0, 2), (2, 1), 384)
    assert core.round == 1


def test_a_late_contribution_is_merged_at_half_weight_and_a_staler_one_dropped(tmp_path):
    core = sync_core(tmp_path)
    core.push(0, 0, delta(1.0), 2), core.push(1, 0, delta(1.0), 2)
    core.merge()
    assert core.push(2, 0, delta(7.0), 2) == "late"  # from round 0's params, round 1 open
    core.push(0, 1, delta(1.0), 2), core.push(1, 1, delta(1.0), 2)
    record = core.merge()
    # weights 2, 2 and 2 / (1 + 1): (2 + 2 + 7) / 5
    np.testing.assert_allclose(core.theta["w"], 0.0 - 11.0 / 5.0, rtol=1e-6)
    assert (record.merged, record.late, record.tokens) == ((0, 1), (2,), (2, 2, 2))
    assert core.push(2, 0, delta(7.0), 2) == "dropped"  # staleness 2
    core.push(0, 2, delta(0.0), 2), core.push(1, 2, delta(0.0), 2)
    assert core.merge().dropped == (2,)


@pytest.mark.parametrize("merge", ["mean", "median_norm_clip"])
def test_a_non_finite_push_is_refused_and_never_reaches_the_params(tmp_path, merge):
    core = sync_core(tmp_path, merge=merge, min_quorum=3)
    core.push(0, 0, delta(1.0), 2), core.push(1, 0, delta(1.0), 2)
    bad = {"w": np.array([1.0, np.nan, 0.0, 0.0], np.float32), "b": np.zeros(2, np.float32)}
    assert core.push(2, 0, bad, 2) == "refused"
    assert core.ready()  # a refused push answers the round (counts toward the quorum)
    record = core.merge()
    assert record.refused == (2,) and record.merged == (0, 1)
    np.testing.assert_array_equal(core.theta["w"], 0.0)
    core.push(0, 1, jax.tree.map(lambda a: a * np.inf, delta(1.0)), 2)
    core.push(1, 1, bad, 2), core.push(2, 1, bad, 2)
    assert core.merge().merged == ()  # every push refused: the params stay
    np.testing.assert_array_equal(core.theta["w"], 0.0)


def test_a_restarted_synchronizer_resumes_every_merged_round(tmp_path):
    core = sync_core(tmp_path, outer=optax.sgd(0.5, momentum=0.9))
    for r in range(3):
        core.push(0, r, delta(r + 1.0), 1), core.push(1, r, delta(1.0), 3)
        core.merge()
    again = sync_core(tmp_path, outer=optax.sgd(0.5, momentum=0.9))
    assert again.restored and again.round == 3 and again.history == core.history
    for a, b in zip(
        jax.tree.leaves(again.outer_state), jax.tree.leaves(core.outer_state), strict=True
    ):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(again.theta["w"], core.theta["w"])
    assert len(list((tmp_path / "ck").glob("round_*"))) == 2  # the last two kept


def test_compressed_pushes_are_decoded_and_counted_from_the_payloads(tmp_path):
    comp = compjax.int_quant(8)
    core = sync_core(tmp_path, compressor=comp)
    message = jax.tree.map(lambda a: comp.compress(jax.random.key(0), jnp.asarray(a)), delta(0.5))
    core.push(0, 0, jax.device_get(message), 1), core.push(1, 0, jax.device_get(message), 1)
    record = core.merge()
    bits = sum(compjax.payload.wire_bits(p) for p in jax.tree.leaves(
        message, is_leaf=lambda x: hasattr(x, "wire")))  # fmt: skip
    assert record.bits == 2 * bits < 2 * 32 * 6
    np.testing.assert_allclose(core.theta["w"], 0.5, atol=0.01)


# -- an island, in this process --------------------------------------------------------------
def island(**kw) -> IslandCore:
    config = dict(loss_fn=ew.loss_fn, batches=ew.batches, inner=optax.adam(1e-2),
                  params=ew.PARAMS, sync_every=4, rounds=3)  # fmt: skip
    core = IslandCore(IslandConfig(**{**config, **kw}), island=1)
    core.heal(er.as_float32(ew.PARAMS))
    return core


def test_an_island_stops_a_round_early_when_told_and_counts_its_tokens():
    core = island()
    calls = []
    delta_, taken = core.train(
        er.as_float32(ew.PARAMS), 0, lambda: calls.append(1) or len(calls) == 2
    )
    assert taken == 2 and core.tokens == 2
    assert all(np.abs(d).max() > 0 for d in jax.tree.leaves(delta_))


def test_a_poisoned_island_scales_its_pseudo_gradient():
    theta = er.as_float32(ew.PARAMS)
    honest, _ = island().train(theta, 1, lambda: False)
    poisoned, _ = island(faults=(ce.Poison(1, -3.0, from_round=1),)).train(theta, 1, lambda: False)
    for h, p in zip(jax.tree.leaves(honest), jax.tree.leaves(poisoned), strict=True):
        np.testing.assert_allclose(p, -3.0 * h, rtol=1e-6)


def test_error_feedback_keeps_what_was_not_sent():
    comp = compjax.top_k(ratio=0.25)
    core = island(compressor=comp, error_feedback=True)
    theta = er.as_float32(ew.PARAMS)
    d, _ = core.train(theta, 0, lambda: False)
    old = core.error
    message = core.message(d, 0)
    payloads = jax.tree.leaves(message, is_leaf=lambda x: hasattr(x, "wire"))
    for sent, new, x, e in zip(payloads, jax.tree.leaves(core.error), jax.tree.leaves(d),
                               jax.tree.leaves(old), strict=True):  # fmt: skip
        np.testing.assert_allclose(np.asarray(comp.decompress(sent)) + new, x + e, atol=1e-7)


def test_a_raising_batch_function_is_named():
    def broken(i, t):
        raise OSError("disk gone")

    with pytest.raises(RuntimeError, match=r"island 1: batches\(1, 4\) raised OSError: disk gone"):
        island(batches=broken).train(er.as_float32(ew.PARAMS), 1, lambda: False)


# -- train's arguments, refused before Ray starts ----------------------------------------------
@pytest.fixture(autouse=True)
def no_ray_in_this_process(monkeypatch):
    """Ray must never start in this process (outside a namespace it binds the machine's
    addresses): reaching it fails the test at once."""
    from compjax.steps import elastic

    def refuse():
        raise AssertionError("train reached Ray: the arguments were not refused first")

    monkeypatch.setattr(elastic, "_ray", refuse)


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(min_quorum=4), "min_quorum must be an integer in"),
        (dict(min_quorum=0), "min_quorum must be an integer in"),
        (dict(grace_s=-1.0), "grace_s must be"),
        (dict(merge="median"), "merge must be one of"),
        (dict(islands=0), "islands must be a positive integer"),
        (dict(sync_every=0), "sync_every must be a positive integer"),
        (dict(timeout_s=0.0), "timeout_s must be"),
        (dict(island_devices=0), "island_devices must be"),
        (dict(island_step="pmap"), "island_step must be"),
        (dict(faults=(ce.Kill(5, 0),)), "island must be < islands"),
        (dict(error_feedback=True), "error_feedback=True needs a compressor"),
    ],
)
def test_bad_arguments_are_refused_naming_them(kw, match):
    with pytest.raises(ValueError, match=match):
        ce.train(ew.loss_fn, ew.PARAMS, ew.batches, **{**ew.KW, **kw})


def test_float64_params_are_refused():
    params = jax.tree.map(lambda a: a.astype(np.float64), ew.PARAMS)
    with pytest.raises(ValueError, match="params must be float32, bfloat16 or float16"):
        ce.train(ew.loss_fn, params, ew.batches, **ew.KW)


# -- real runs on Ray ----------------------------------------------------------------------------
FAST = ["clean", "kill_sync", "kill_restart", "poison_mean", "poison_clip", "nan_push", "raises",
        "stuck"]  # fmt: skip
SLOW = ["clean_2dev", "fsdp_2dev", "int8"]


def in_namespace(argv: list[str]) -> subprocess.CompletedProcess:
    """``argv`` run inside a network namespace of its own (only loopback up), then deleted."""
    from experiments.common import netns

    ns = "compjax-elastic-test"
    reason = netns.unavailable_reason(ns)
    if reason is not None:
        pytest.skip(f"Ray runs only inside a network namespace here: {reason}")
    with netns.namespace(ns):
        proc = subprocess.run(netns.in_namespace(ns, argv), capture_output=True, text=True,
                              timeout=900, cwd=HERE.parent)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc


def ray_runs(tmp_path_factory, names) -> dict:
    out = tmp_path_factory.mktemp("elastic")
    in_namespace([sys.executable, str(HERE / "elastic_worker.py"), str(out), *names])
    return {n: json.loads((out / f"{n}.json").read_text()) for n in names}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return ray_runs(tmp_path_factory, FAST)


def diloco_under_vmap(rounds=ew.ROUNDS):
    """compjax.diloco over ISLANDS workers simulated by vmap, on the islands' batches."""
    tx = compjax.diloco(ew.KW["inner"], ew.KW["outer"], ew.H, "i")

    def step(p, s, x, y):
        updates, s = tx.update(jax.grad(ew.loss_fn)(p, x, y), s, p)
        return optax.apply_updates(p, updates), s

    step = jax.jit(jax.vmap(step, axis_name="i"))
    params = compjax.worker_copies(ew.PARAMS, ew.ISLANDS)
    state = jax.vmap(lambda _: tx.init(ew.PARAMS))(jnp.arange(ew.ISLANDS))
    for t in range(rounds * ew.H):
        xs, ys = zip(*[ew.batches(i, t) for i in range(ew.ISLANDS)], strict=True)
        params, state = step(params, state, np.stack(xs), np.stack(ys))
    for stacked in jax.tree.leaves(state.global_params):  # one theta, held by every worker
        np.testing.assert_array_equal(stacked, np.broadcast_to(stacked[0], stacked.shape))
    return jax.tree.map(lambda a: np.asarray(a[0]), state.global_params)


def params_of(run):
    return {k: np.asarray(v, np.float32) for k, v in run["params"].items()}


def test_no_faults_equals_diloco_under_vmap(runs):
    run = runs["clean"]
    assert [r["merged"] for r in run["history"]] == [[0, 1, 2]] * ew.ROUNDS
    reference = diloco_under_vmap()
    for name, value in params_of(run).items():
        np.testing.assert_allclose(value, reference[name], rtol=1e-5, atol=1e-6)


def test_a_killed_island_is_absent_then_heals_and_returns(runs):
    run = runs["kill_restart"]
    history = run["history"]
    assert [r["round"] for r in history] == list(range(24))  # every round finished
    assert all(1 in r["merged"] for r in history[:2])
    assert all(1 not in r["merged"] for r in history[2:3])
    back = [r["round"] for r in history if 1 in r["merged"] and r["round"] >= 3]
    assert back and all(1 in r["merged"] for r in history if r["round"] > back[0])
    assert all(len(r["merged"]) >= ew.ISLANDS - 1 for r in history)


def test_a_killed_synchronizer_loses_no_merged_round(runs):
    killed, clean = runs["kill_sync"], runs["clean"]
    assert [r["round"] for r in killed["history"]] == list(range(ew.ROUNDS))
    for name, value in params_of(killed).items():
        np.testing.assert_array_equal(value, params_of(clean)[name])


def test_a_poisoned_island_drags_the_mean_but_not_the_median_norm_clip(runs):
    clean = runs["clean"]["validation"]
    assert not runs["poison_mean"]["validation"] < 100 * clean  # diverged
    assert runs["poison_clip"]["validation"] <= 1.02 * clean


def test_nan_pushes_are_refused_and_the_params_stay_finite(runs):
    history = runs["nan_push"]["history"]
    assert history[0]["refused"] == [] and all(r["refused"] == [2] for r in history[1:])
    assert all(r["merged"] == [0, 1] for r in history[1:])
    assert np.isfinite(runs["nan_push"]["validation"])
    assert runs["nan_push"]["validation"] < ew.validation_loss(ew.PARAMS) / 5


def test_a_raising_batch_function_stops_the_run_with_its_island_named(runs):
    run = runs["raises"]
    assert run["error"] == "RuntimeError"
    assert "island 1" in run["message"] and "batches(1, 5) raised KeyError" in run["message"]


def test_a_round_that_cannot_merge_times_out_with_a_clear_error(runs):
    run = runs["stuck"]
    assert run["error"] == "TimeoutError", run
    assert "round 1 did not merge" in run["message"] and "min_quorum 3" in run["message"]
    assert "dead [1]" in run["message"]


@pytest.mark.slow
def test_multi_device_islands_and_compressed_trimmed_merges(tmp_path_factory):
    slow = ray_runs(tmp_path_factory, SLOW)
    reference = diloco_under_vmap()
    for two in (slow["clean_2dev"], slow["fsdp_2dev"]):
        assert {r["devices"] for r in two["islands"]} == {2}
        for name, value in params_of(two).items():
            np.testing.assert_allclose(value, reference[name], rtol=1e-4, atol=1e-5)
    int8 = slow["int8"]
    assert all(r["bits"] < 32 * sum(a.size for a in jax.tree.leaves(ew.PARAMS)) * ew.ISLANDS / 3
               for r in int8["history"])  # fmt: skip
    assert int8["validation"] < ew.validation_loss(ew.PARAMS) / 5


def test_the_example_runs():
    script = HERE.parent / "examples" / "elastic" / "islands.py"
    out = in_namespace([sys.executable, str(script), "--rounds", "3", "--sync-every", "5"]).stdout
    assert [int(r) for r in re.findall(r"round (\d+): merged \[0, 1, 2, 3\]", out)] == [0, 1, 2]
    loss = float(re.search(r"final validation loss ([\d.]+)", out).group(1))
    assert loss < 2.2  # below log(10) = 2.30, the loss of uniform guesses
    assert re.search(r"[\d,]+ bits against [\d,]+ bits in float32", out)

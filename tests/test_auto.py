"""compjax.auto: candidates timed on the first steps (scripted clock), the fastest kept, the
decision agreed over the mesh, every trial step a real training step, and checkpointed."""

import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from jax.sharding import NamedSharding

import compjax

P = jax.P
N = 8
AUTO = sys.modules["compjax.steps.auto"]  # the module (compjax.auto is the function)
W0 = {"w": jnp.linspace(-0.3, 0.3, 18).reshape(6, 3), "b": jnp.zeros(3)}
CANDIDATES = {
    "dense": optax.chain(compjax.compress(compjax.identity(), "data"), optax.sgd(0.1)),
    "ef_top_k": optax.chain(
        compjax.error_feedback(compjax.top_k(ratio=0.3), "data"), optax.sgd(0.1)
    ),
    "qsgd": optax.chain(compjax.compress(compjax.qsgd(levels=4), "data"), optax.sgd(0.1)),
}
TRIAL, WARMUP = 3, 1
PER = TRIAL + WARMUP
LENGTH = len(CANDIDATES) * PER


def loss(p, x, y):
    return jnp.mean((x @ p["w"] + p["b"] - y) ** 2)


def batch(t):
    return (
        jax.random.normal(jax.random.key(2 * t), (32, 6)),
        jax.random.normal(jax.random.key(2 * t + 1), (32, 3)),
    )


class Script:
    """A clock whose timed steps last the scripted durations, in order: called twice per timed
    step, it advances by the next duration on the second call (none left: IndexError)."""

    def __init__(self):
        self.durations, self.now, self.calls = [], 0.0, 0

    def __call__(self):
        self.calls += 1
        if self.calls % 2 == 0:
            self.now += self.durations.pop(0)
        return self.now

    def play(self, per_candidate):
        self.durations = [d for name in CANDIDATES for d in per_candidate[name]]
        self.calls = 0


CLOCK = Script()


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((N,), ("data",))


@pytest.fixture(scope="module")
def chooser(mesh):
    return compjax.auto(
        loss, CANDIDATES, W0, mesh, trial_steps=TRIAL, warmup_steps=WARMUP, clock=CLOCK
    )


def trial(chooser, durations):
    """The whole trial under scripted durations: every (params, state, loss) after each step."""
    CLOCK.play(durations)
    params, state = W0, chooser.init(W0)
    seen = []
    for t in range(LENGTH):
        assert chooser.report(state).chosen is None
        params, state, value = chooser.step(params, state, *batch(t))
        seen.append((params, state, value))
    assert CLOCK.durations == [] and CLOCK.calls == 2 * TRIAL * len(CANDIDATES)
    return seen


#: ef_top_k's median (1) is the smallest despite its outlier (its mean, 17.3, is the largest).
OUTLIER = {"dense": [3.0, 3.0, 3.0], "ef_top_k": [1.0, 50.0, 1.0], "qsgd": [2.0, 2.0, 2.5]}


@pytest.fixture(scope="module")
def trained(chooser):
    return trial(chooser, OUTLIER)


@pytest.mark.parametrize(
    ("durations", "chosen", "timings"),
    [
        (OUTLIER, "ef_top_k", (3.0, 1.0, 2.0)),
        ({"dense": [3, 3, 3], "ef_top_k": [2, 2, 2], "qsgd": [1, 1, 1]}, "qsgd", (3, 2, 1)),
        # a tie goes to the earlier candidate
        ({"dense": [2, 3, 2], "ef_top_k": [2, 2, 2], "qsgd": [3, 3, 3]}, "dense", (2, 2, 3)),
    ],
    ids=["median-not-mean", "qsgd-fast", "tie-first"],
)
def test_the_candidate_with_the_smallest_median_time_is_chosen(chooser, durations, chosen, timings):
    state = trial(chooser, durations)[-1][1]
    report = chooser.report(state)
    assert report.names == tuple(CANDIDATES)
    assert report.chosen == chosen and report.trial_steps_left == 0
    assert report.timings == pytest.approx(timings, abs=1e-6)
    assert int(state.choice) == list(CANDIDATES).index(chosen)


def test_every_trial_step_is_each_candidates_own_data_parallel_step(mesh, trained):
    """Each candidate in turn takes its warm-up and timed steps from where the last one left
    the params, with its own state from init: the trial equals those data_parallel steps, bit
    for bit, and the params move at every step (nothing is thrown away)."""
    params = W0
    for i, name in enumerate(CANDIDATES):
        dp = compjax.data_parallel(loss, CANDIDATES[name], W0, mesh)
        state = dp.init(W0)
        for t in range(i * PER, (i + 1) * PER):
            before = params
            params, state, value = dp.step(params, state, *batch(t))
            got_params, got_state, got_value = trained[t]
            assert not np.allclose(got_params["w"], before["w"])  # a real step
            for a, b in zip(
                jax.tree.leaves((params, state, value)),
                jax.tree.leaves((got_params, got_state.states[i], got_value)),
                strict=True,
            ):
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # the error memory of ef_top_k holds a residual from its own steps only
    assert np.abs(np.asarray(trained[PER - 1][1].states[1][0].error["w"])).max() == 0
    assert np.abs(np.asarray(trained[2 * PER - 1][1].states[1][0].error["w"])).max() > 0


def test_after_the_trial_only_the_winner_steps_as_its_data_parallel_step(mesh, chooser, trained):
    params, state, _ = trained[-1]
    c = int(state.choice)
    dp = compjax.data_parallel(loss, CANDIDATES["ef_top_k"], W0, mesh)
    ref_params, ref_state = params, state.states[c]
    CLOCK.play({name: [] for name in CANDIDATES})  # no clock call after the choice
    for t in range(LENGTH, LENGTH + 2):
        params, new, value = chooser.step(params, state, *batch(t))
        ref_params, ref_state, ref_value = dp.step(ref_params, ref_state, *batch(t))
        for a, b in zip(
            jax.tree.leaves((params, new.states[c], value)),
            jax.tree.leaves((ref_params, ref_state, ref_value)),
            strict=True,
        ):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        for j in (0, 2):  # the losers' states are frozen
            assert new.states[j] is state.states[j]
        assert chooser.report(new) == chooser.report(state)
        state = new
    assert CLOCK.calls == 0


def abstract(tree):
    return jax.tree.map(ocp.utils.to_shape_dtype_struct, tree)


def test_a_restored_run_keeps_the_choice_and_does_not_time_again(chooser, trained, tmp_path):
    params, state, _ = trained[-1]
    ckptr = ocp.StandardCheckpointer()
    ckptr.save(tmp_path / "ckpt", {"params": params, "state": state})
    ckptr.wait_until_finished()
    target = abstract({"params": params, "state": chooser.init(W0)})  # a fresh state
    restored = ckptr.restore(tmp_path / "ckpt", target)
    p2, s2 = restored["params"], restored["state"]
    assert isinstance(s2, compjax.AutoState)
    assert chooser.report(s2) == chooser.report(state)
    assert chooser.report(s2).chosen == "ef_top_k"
    CLOCK.play({name: [] for name in CANDIDATES})
    p1, s1, _ = chooser.step(params, state, *batch(LENGTH))
    p2, s2, _ = chooser.step(p2, s2, *batch(LENGTH))
    assert CLOCK.calls == 0
    for a, b in zip(jax.tree.leaves((p1, s1)), jax.tree.leaves((p2, s2)), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_restored_trial_continues_where_it_stopped(chooser, trained, tmp_path):
    params, state, _ = trained[PER + 1]  # ef_top_k's first timed step done
    ckptr = ocp.StandardCheckpointer()
    ckptr.save(tmp_path / "ckpt", {"params": params, "state": state})
    ckptr.wait_until_finished()
    restored = ckptr.restore(
        tmp_path / "ckpt", abstract({"params": params, "state": chooser.init(W0)})
    )
    report = chooser.report(restored["state"])
    assert report.trial_steps_left == LENGTH - PER - 2
    assert report.timings[0] == 3.0 and np.isnan(report.timings[1:]).all()
    np.testing.assert_array_equal(restored["state"].times, state.times)


def test_the_agreed_time_is_the_maximum_over_every_device_of_the_mesh():
    """Per-device values differ (as separate processes' clocks would); every device gets
    their maximum, on every axis of a 2-D mesh."""
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    values = np.array([[0.5, 3.0], [2.0, 0.1], [1.0, 1.0], [0.2, 0.2]] * 2, np.float32)
    values[5] = [7.0, 0.3]  # the slowest worker of the first number sits on the model axis
    rows = jax.make_array_from_callback(
        values.shape, NamedSharding(mesh, P(("data", "model"))), lambda index: values[index]
    )
    agreed = AUTO.agreed_max(mesh)(rows)
    assert agreed.sharding.is_fully_replicated
    for shard in agreed.addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data), [7.0, 3.0])
    local = AUTO.local_values(np.float32(0.25), mesh)
    assert local.shape == (8,) and (np.asarray(local) == 0.25).all()


def test_the_choice_follows_the_slowest_worker_not_this_one(chooser, monkeypatch):
    """Workers disagree: here dense looks fastest (device 0 sees 1 s), but device 5 took 11 s
    for each of its steps; ef_top_k is never slower than 1.5 s anywhere.  The agreed times are
    the maxima and ef_top_k is chosen, by every worker alike."""
    skew = {0: {5: 10.0}, 1: {0: 0.5}, 2: {3: 1.0}}  # candidate -> device -> extra seconds
    calls = []

    def disagreeing(value, mesh):
        candidate = len(calls) // TRIAL
        calls.append(value)
        rows = np.full(mesh.size, value, np.float32)
        for device, extra in skew[candidate].items():
            rows[device] += extra
        return jax.make_array_from_callback(
            rows.shape, NamedSharding(mesh, P(mesh.axis_names)), lambda index: rows[index]
        )

    monkeypatch.setattr(AUTO, "local_values", disagreeing)
    state = trial(chooser, {name: [1.0] * TRIAL for name in CANDIDATES})[-1][1]
    report = chooser.report(state)
    assert report.timings == pytest.approx((11.0, 1.5, 2.0))
    assert report.chosen == "ef_top_k"


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"candidates": {}}, "candidates"),
        ({"candidates": [optax.sgd(0.1)]}, "candidates"),
        ({"candidates": {"sgd": optax.sgd}}, r"candidates\['sgd'\]"),
        ({"candidates": {1: optax.sgd(0.1)}}, "candidates"),
        ({"trial_steps": 0}, "trial_steps"),
        ({"trial_steps": 2.0}, "trial_steps"),
        ({"trial_steps": True}, "trial_steps"),
        ({"warmup_steps": -1}, "warmup_steps"),
        ({"clock": 3.0}, "clock"),
        ({"axis_name": "batch"}, "axis_name"),
    ],
)
def test_bad_input_names_the_parameter(mesh, kwargs, match):
    args = {"candidates": CANDIDATES, **kwargs}
    candidates = args.pop("candidates")
    with pytest.raises(ValueError, match=match):
        compjax.auto(loss, candidates, W0, mesh, **args)


def test_the_first_params_compile_nothing_a_timed_step_would_pay_for(mesh, monkeypatch):
    """Params as users often give them (weakly typed, uncommitted) are typed and placed as the
    steps return them, so each candidate's step compiles once, in its warm-up, never in a
    timed step (a 0.9 s compile was once timed as dense's first step)."""
    built = []

    def recorded(*args, **kwargs):
        built.append(compjax.data_parallel(*args, **kwargs))
        return built[-1]

    monkeypatch.setattr(AUTO, "data_parallel", recorded)
    weak = {"w": jnp.full((6, 3), 0.1), "b": jnp.zeros(3)}
    assert weak["w"].weak_type
    chooser = compjax.auto(loss, CANDIDATES, weak, mesh, trial_steps=1, clock=CLOCK)
    CLOCK.play({name: [1.0] for name in CANDIDATES})
    params, state = weak, chooser.init(weak)
    for t in range(len(CANDIDATES) * 2):
        params, state, _ = chooser.step(params, state, *batch(t))
    assert [dp.step._cache_size() for dp in built] == [1, 1, 1]

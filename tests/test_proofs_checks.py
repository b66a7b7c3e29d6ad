"""proofs_checks: the fast mode passes, and deliberately wrong theory makes it fail.

A check that cannot fail is worthless, so besides running every check in fast
mode, these tests break compjax on purpose (a wrong variance constant, a biased
sampler, workers sharing their randomness) and assert that the claims that
depend on it FAIL.
"""

import dataclasses
import math
import pathlib
import sys

import jax
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # the repository root

import compjax
import compjax.collectives
import compjax.compressors.dithering
import compjax.compressors.eden
import compjax.compressors.qsgd
import compjax.compressors.terngrad
import compjax.exchange
import compjax.transforms.diloco
from proofs_checks import FAIL, MODULES, PASS, SKIPPED, run_all
from proofs_checks.__main__ import main, report_markdown, table_text


def by_claim(results, prefix):
    rows = [r for r in results if r.claim.startswith(prefix)]
    assert rows, f"no claim starts with {prefix!r}"
    return rows


@pytest.fixture
def broken(monkeypatch):
    """Patch compjax inside a context whose compiled programs are discarded on both ends
    (jit caches are keyed by the compressor value, not by the code it runs)."""
    jax.clear_caches()
    yield monkeypatch
    monkeypatch.undo()
    jax.clear_caches()


@pytest.mark.slow  # every check in fast mode: 75 s alone, twice that beside another worker
def test_fast_mode_passes():
    results, timings = run_all(fast=True)
    failed = [r for r in results if r.verdict == FAIL]
    assert not failed, "\n".join(
        f"{r.claim}: {r.measured} vs {r.bound}\n{r.detail}" for r in failed
    )
    assert {r.verdict for r in results} <= {PASS, SKIPPED}
    assert sum(r.verdict == PASS for r in results) >= 30
    assert {name.split(".")[0] for name in timings} == set(MODULES)
    # The report and the table hold every row.
    text = table_text(results)
    markdown = report_markdown(results, fast=True)
    for r in results:
        assert r.verdict in text
        assert r.source.replace("|", "\\|") in markdown


@pytest.mark.slow  # 6 s
@pytest.mark.parametrize("factor", [0.5, 2.0])
def test_a_wrong_qsgd_omega_is_caught(broken, factor):
    original = compjax.compressors.qsgd.qsgd_omega

    def wrong(d, levels):
        return factor * original(d, levels)

    broken.setattr(compjax.compressors.qsgd, "qsgd_omega", wrong)
    broken.setattr(compjax, "qsgd_omega", wrong)
    results, _ = run_all(fast=True, modules=("qsgd",))
    for row in by_claim(results, "QSGD sup"):
        assert row.verdict == FAIL, row
    # Lemma 3.1 itself does not depend on omega(d) and still holds.
    assert by_claim(results, "QSGD variance")[0].verdict == PASS


@pytest.mark.parametrize(
    ("nat_factor", "eden_factor"),
    [pytest.param(f, 1 / f, marks=pytest.mark.slow) for f in (0.5, 2.0)],  # 30 s each
)
def test_a_wrong_natural_dithering_or_eden_omega_is_caught(broken, nat_factor, eden_factor):
    dithering = compjax.compressors.dithering
    original = dithering.natural_dithering_omega
    broken.setattr(dithering, "natural_dithering_omega", lambda d, s: nat_factor * original(d, s))
    broken.setattr(compjax.compressors.eden, "EDEN_VNMSE", eden_factor * (math.pi / 2 - 1))
    results, _ = run_all(fast=True, modules=("natural_dithering", "eden"))
    assert by_claim(results, "natural dithering omega(d)")[0].verdict == FAIL
    assert by_claim(results, "EDEN's vNMSE is at most omega")[0].verdict == FAIL
    # Claims that do not read omega still hold.
    assert by_claim(results, "natural dithering obeys the theorem")[0].verdict == PASS


@pytest.mark.slow  # 10 s: the whole int_quant module in fast mode
@pytest.mark.parametrize("factor", [0.9, 1.1])
def test_a_wrong_int_quant_omega_is_caught(broken, factor):
    module = compjax.compressors.int_quant
    original = module.int_quant_omega

    def wrong(d, bits):
        return factor * original(d, bits)

    broken.setattr(module, "int_quant_omega", wrong)
    broken.setattr(compjax, "int_quant_omega", wrong)
    results, _ = run_all(fast=True, modules=("int_quant",))
    assert by_claim(results, "integer quantization omega(d)")[0].verdict == FAIL
    assert by_claim(results, "shared-scale integer sum")[0].verdict == FAIL
    assert by_claim(results, "integer quantization is unbiased")[0].verdict == PASS


@pytest.mark.slow  # 8 s; test_workers_sharing_randomness_is_caught is the fast mutation test
def test_a_biased_sampler_is_caught(broken):
    original = compjax.compressors.terngrad.ternarize

    def biased(key, x, scale, offset=0):  # keeps entry k with probability 0.9 |x_k| / scale
        return original(key, x, scale / 0.9, offset)

    broken.setattr(compjax.compressors.terngrad, "ternarize", biased)
    results, _ = run_all(fast=True, modules=("terngrad",))
    assert by_claim(results, "TernGrad is unbiased")[0].verdict == FAIL
    assert by_claim(results, "TernGrad sampler")[0].verdict == FAIL


def test_workers_sharing_randomness_is_caught(broken):
    broken.setattr(compjax.collectives, "worker_key", lambda key, axis_name: key)
    results, _ = run_all(fast=True, modules=("contraction",))
    assert by_claim(results, "averaging n independent workers")[0].verdict == FAIL


@pytest.mark.slow  # 30 s: the whole two-stage module in fast mode
def test_a_reduce_phase_that_drops_a_worker_is_caught(broken):
    """The shard owner sums n - 1 of the n decoded first-stage messages."""
    original = compjax.exchange.scatter.decoded_sum
    broken.setattr(
        compjax.exchange.scatter,
        "decoded_sum",
        lambda comp, g, n, scale=1.0: original(comp, g, n - 1, scale),
    )
    results, _ = run_all(fast=True, modules=("two_stage",))
    assert by_claim(results, "scatter-gather mean of an unbiased")[0].verdict == FAIL
    assert by_claim(results, "scatter-gather variance is exactly")[0].verdict == FAIL


@pytest.mark.slow  # 10 s: the local-SGD module in fast mode
def test_a_diloco_mean_that_loses_a_worker_is_caught(broken):
    """DiLoCo's outer step gets 3/4 of the mean pseudo-gradient (one of the 4 workers lost)."""
    module = compjax.transforms.diloco
    original = module.compressed_mean

    def lossy(*args, **kwargs):
        out = original(*args, **kwargs)
        return dataclasses.replace(out, mean=0.75 * out.mean)

    broken.setattr(module, "compressed_mean", lossy)
    results, _ = run_all(fast=True, modules=("local_sgd",))
    assert by_claim(results, "DiLoCo with H = 1")[0].verdict == FAIL
    assert by_claim(results, "DiLoCo with H > 1")[0].verdict == FAIL
    # The workers still restart from the (wrong) global params.
    assert by_claim(results, "after a sync every worker")[0].verdict == PASS


def test_cli_exit_status(tmp_path, capsys):
    report = tmp_path / "REPORT.md"
    assert main(["--fast", "--only", "natural", "--report", str(report)]) == 0
    assert "| natural compression is unbiased" in report.read_text()
    assert "PASS" in capsys.readouterr().out

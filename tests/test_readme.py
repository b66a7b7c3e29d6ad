"""The README and the docs tell the truth: their compressor tables are the generated ones,
and every python block of every page runs.

The python blocks of one page run in order in one namespace (a later block may use what an
earlier one defined), one test per page; a block's results are checked right after it runs,
by the check named after the page and the heading the block sits under.
"""

import pathlib
import re

import jax
import pytest

from compjax import table

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
FENCE = re.compile(r"^(`{3,}|~{3,})(.*)$")
# Fence languages that run; every other fence must name what it is (bash, text, ...).
RUNS = "python"


def pages() -> list[pathlib.Path]:
    """The README and every Markdown page of the docs (not the build output)."""
    found = sorted(p for p in DOCS.rglob("*.md") if "_build" not in p.relative_to(DOCS).parts)
    return [README, *found]


def fences(path: pathlib.Path) -> list[tuple[str, str, int, str]]:
    """Every fenced block of ``path``: (its info string, the heading above it, its first line,
    its code)."""
    blocks, heading, open_fence = [], "", None
    for number, line in enumerate(path.read_text().splitlines(), 1):
        match = FENCE.match(line)
        if open_fence is None:
            if match:
                open_fence, info, start, code = match.group(1), match.group(2).strip(), number, []
            elif line.startswith("#"):
                heading = line.lstrip("#").strip()
        elif match and match.group(1) == open_fence and not match.group(2).strip():
            blocks.append((info, heading, start, "\n".join(code) + "\n"))
            open_fence = None
        else:
            code.append(line)
    assert open_fence is None, f"{path}: a fence opened on line {start} is never closed"
    return blocks


def python_blocks(path: pathlib.Path) -> list[tuple[str, int, str]]:
    """(heading, first line, code) of each python block of ``path``."""
    return [(heading, line, code) for info, heading, line, code in fences(path) if info == RUNS]


def name(path: pathlib.Path) -> str:
    return str(path.relative_to(ROOT))


# --- what the blocks computed ------------------------------------------------------------


def check_quickstart(ns: dict) -> None:
    assert float(ns["value"]) == 1.0  # the loss at zero params
    assert not bool(jax.numpy.allclose(ns["params"]["w"], 0.0))  # it stepped


def check_shard_map_step(ns: dict) -> None:
    assert float(ns["loss"]) < 2.0  # below log(10): it trained


def check_jit(ns: dict) -> None:
    assert float(ns["value"]) == 1.0  # the loss at zero params on ones
    assert not bool(jax.numpy.allclose(ns["params"]["b"], 0.0))  # it stepped


def check_model_sharded(ns: dict) -> None:
    assert ns["params"]["w"].sharding.spec == ns["P"](None, "model")
    assert not bool(jax.numpy.allclose(ns["params"]["w"], 0.1))  # it stepped


def check_nnx(ns: dict) -> None:
    assert float(ns["loss"]) < 0.3  # it trained (the loss starts near 0.5)
    error = ns["optimizer"].opt_state[0].error
    assert jax.tree.leaves(error)[0].shape[0] == 8  # one error memory per worker


def check_fsdp(ns: dict) -> None:
    P = ns["jax"].P
    w = ns["params"]["w"]
    assert w.sharding.spec == P("data", None)
    assert w.addressable_shards[0].data.shape == (8, 16)  # 1/8 of the kernel per device
    assert not bool(jax.numpy.allclose(w, 0.1))  # it stepped
    report = ns["report"]
    assert report.gather_bits == 7 * (128 * 8 + 32)  # 7 shards of 128 int8 codes and a step
    assert 0 < report.gradient_bits < report.dense_bits / 4  # 4-bit codes in 8-worker fields


def check_fsdp_hpz(ns: dict) -> None:
    P = ns["jax"].P
    w = ns["params"]["w"]
    assert w.sharding.spec == P(("local", "hosts"), None)
    assert w.addressable_shards[0].data.shape == (8, 16)  # 1/8 of the kernel per device
    assert not bool(jax.numpy.allclose(w, 0.1))  # it stepped
    report = ns["report"]
    assert report.slow_gather_bits == 128 * 8 + 32  # to the other host: 128 codes and a step
    assert report.fast_gather_bits == 3 * 256 * 32  # the decoded secondary shard, 3 times
    assert 0 < report.slow_gradient_bits < report.fast_gradient_bits / 10


def check_scaling(ns: dict) -> None:
    report, d = ns["report"], 512 * 256 + 256
    # ring traffic on the fast axis (4 chips): 3/4 of the reduce-scatter's float32 input,
    # then this chip's shard to the 3 others
    assert report.fast_bits == 3 / 4 * 32 * d + 3 * 32 * (d // 4) == 6_303_744
    assert 0 < report.slow_bits < report.fast_bits / 10
    assert report.compression_ratio > 1


def check_local_steps_vmap(ns: dict) -> None:
    assert float(ns["loss"].mean()) < 0.3  # it trained (the loss starts near 0.45)
    assert ns["theta"]["w"].shape == (3, 2)  # worker 0's copy of the shared global params


def check_local_steps_shard_map(ns: dict) -> None:
    assert float(ns["loss"]) < 0.1
    # two whole rounds: every worker restarted from the global params (to one rounding)
    local, theta = jax.device_get(ns["local"]["w"]), jax.device_get(ns["theta"]["w"])
    assert local.shape == (4, 3, 2) and theta.shape == (3, 2)
    assert bool(jax.numpy.allclose(local, theta[None], rtol=1e-6, atol=1e-7))


def check_zero_one_adam_local(ns: dict) -> None:
    assert ns["kinds"][-1] == "compressed" and ns["kinds"].count("local") == 10
    # the last step ended a round: every worker restarted from theta (to one rounding)
    local, theta = jax.device_get(ns["local"]["w"]), ns["theta"]["w"]
    assert bool(jax.numpy.allclose(local, theta[None], rtol=1e-6, atol=1e-7))
    assert float(ns["loss"].mean()) < 0.3  # it trained (the loss starts near 0.34)
    assert ns["mean_bits_per_step"](ns["report"], ns["kinds"]) < ns["report"].dense_bits


def check_auto(ns: dict) -> None:
    report = ns["report"]
    assert report.chosen in ("dense", "qsgd") and report.trial_steps_left == 0
    assert all(0 < t < 60 for t in report.timings)  # seconds per step, both measured
    assert int(ns["state"].choice) == report.names.index(report.chosen)
    assert not bool(jax.numpy.allclose(ns["params"]["b"], 0.0))  # it stepped


CHECKS = {
    ("README.md", "Quickstart"): check_quickstart,
    ("docs/distributed.md", "A complete shard_map training step"): check_shard_map_step,
    ("docs/distributed.md", "`jax.jit` with sharded arrays (no `shard_map` of your own)"): (
        check_jit
    ),
    ("docs/distributed.md", "Choosing by measurement (`compjax.auto`)"): check_auto,
    ("docs/distributed.md", "Model-sharded parameters (tensor parallel, FSDP-style layouts)"): (
        check_model_sharded
    ),
    ("docs/distributed.md", "Flax NNX (`compjax.nnx`)"): check_nnx,
    ("docs/scaling.md", "Scaling and exchanges"): check_scaling,
    ("docs/local_steps.md", "Example: four workers under `vmap`"): check_local_steps_vmap,
    ("docs/local_steps.md", "Under `shard_map`"): check_local_steps_shard_map,
    ("docs/local_steps.md", "0/1 Adam's local rounds"): check_zero_one_adam_local,
    ("docs/fsdp.md", "Usage"): check_fsdp,
    ("docs/fsdp.md", "Two-level sharding on a (hosts, local) mesh (hpZ)"): check_fsdp_hpz,
}

RUNNABLE = [p for p in pages() if python_blocks(p)]


@pytest.mark.parametrize("path", RUNNABLE, ids=name)
def test_page_code_runs(path):
    """Every python block of the page, in order, in one namespace; then its checks."""
    namespace: dict = {}
    checked = set()
    for heading, line, code in python_blocks(path):
        exec(compile(code, f"{name(path)}:{line}", "exec"), namespace)
        check = CHECKS.get((name(path), heading))
        if check is not None:
            check(namespace)
            checked.add(heading)
    expected = {heading for page, heading in CHECKS if page == name(path)}
    assert checked == expected, f"no python block under {expected - checked} any more"


def test_every_check_has_its_page():
    assert {page for page, _ in CHECKS} <= {name(p) for p in RUNNABLE}


@pytest.mark.parametrize("path", pages(), ids=name)
def test_every_fence_says_what_it_holds(path):
    """A block that is not python names its language (bash, text, ...), so that no code is
    left out of the run by a bare fence or a ``py`` spelling."""
    for info, _, line, _ in fences(path):
        assert info, f"{name(path)}:{line}: a bare fence (```python, ```bash or ```text)"
        language = info.split()[0].strip("{}").lower()
        assert language == RUNS or language not in {"py", "python3", "pycon", "ipython"}, (
            f"{name(path)}:{line}: write ```python so that the block runs"
        )


def test_readme_is_short():
    assert len(README.read_text().splitlines()) <= 250


def test_tables_are_generated_from_metadata():
    readme = table.marked_blocks(README.read_text())
    docs = table.marked_blocks((DOCS / "compressors.md").read_text())
    assert readme == {(table.README_START, table.README_END): table.readme_table()}, (
        "run `make readme-table`"
    )
    assert docs == {(table.START, table.END): table.markdown_table()}, "run `make readme-table`"


def slug(heading: str) -> str:
    """A heading's anchor as GitHub (and the docs, ``myst_heading_anchors``) make it."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


def anchors(path: pathlib.Path) -> set[str]:
    headings, in_fence = [], False
    for line in path.read_text().splitlines():
        if FENCE.match(line):
            in_fence = not in_fence
        elif not in_fence and line.startswith("#"):
            headings.append(line.lstrip("#"))
    return {slug(h) for h in headings}


def test_readme_links_reach_their_pages_and_headings():
    """The README's relative links name files that exist and, with ``#``, their headings."""
    links = re.findall(r"\]\(([^)\s]+)\)", README.read_text())
    local = [link for link in links if "://" not in link]
    assert any("#" in link for link in local)
    for link in local:
        target, _, anchor = link.partition("#")
        path = ROOT / target
        assert path.exists(), f"README links {link}: no {target}"
        if anchor:
            assert anchor in anchors(path), f"README links {link}: no such heading"

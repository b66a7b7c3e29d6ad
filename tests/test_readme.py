"""The README tells the truth: its compressor table is the generated one, its examples run."""

import pathlib

import jax

from compjax import table

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def run_example(heading: str) -> dict:
    """Execute the first python block after ``heading``; its namespace."""
    section = README.read_text().split(heading, 1)[1]
    code = section.split("```python", 1)[1].split("```", 1)[0]
    namespace: dict = {}
    exec(compile(code, "README.md", "exec"), namespace)
    return namespace


def test_readme_table_is_generated_from_metadata():
    text = README.read_text()
    block = text.split(table.START, 1)[1].split(table.END, 1)[0].strip()
    assert block == table.markdown_table(), "run `make readme-table`"


def test_readme_usage_example_runs():
    run_example("## Usage")


def test_readme_shard_map_training_step_runs():
    namespace = run_example("### A complete shard_map training step")
    assert float(namespace["loss"]) < 2.0  # below log(10): it trained


def test_readme_scaling_example_runs():
    report, d = run_example("## Scaling")["report"], 512 * 256 + 256
    # ring traffic on the fast axis (4 chips): 3/4 of the reduce-scatter's float32 input,
    # then this chip's shard to the 3 others
    assert report.fast_bits == 3 / 4 * 32 * d + 3 * 32 * (d // 4) == 6_303_744
    assert 0 < report.slow_bits < report.fast_bits / 10
    assert report.compression_ratio > 1


def test_readme_model_sharded_example_runs():
    namespace = run_example("### Model-sharded parameters")
    params = namespace["params"]
    assert params["w"].sharding.spec == namespace["P"](None, "model")
    assert not bool(jax.numpy.allclose(params["w"], 0.1))  # it stepped


def test_readme_jit_example_runs():
    namespace = run_example("### `jax.jit` with sharded arrays")
    assert float(namespace["value"]) == 1.0  # the loss at zero params on ones
    assert not bool(jax.numpy.allclose(namespace["params"]["b"], 0.0))  # it stepped


def test_readme_nnx_example_runs():
    namespace = run_example("### Flax NNX")
    assert float(namespace["loss"]) < 0.3  # it trained (the loss starts near 0.5)
    error = namespace["optimizer"].opt_state[0].error
    assert jax.tree.leaves(error)[0].shape[0] == 8  # one error memory per worker

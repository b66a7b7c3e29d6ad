"""The README tells the truth: its compressor table is the generated one."""

import pathlib

import jax

from compjax import table

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def test_readme_table_is_generated_from_metadata():
    text = README.read_text()
    block = text.split(table.START, 1)[1].split(table.END, 1)[0].strip()
    assert block == table.markdown_table(), "run `make readme-table`"


def test_readme_usage_example_runs():
    text = README.read_text()
    code = text.split("## Usage", 1)[1].split("```python", 1)[1].split("```", 1)[0]
    exec(compile(code, "README.md", "exec"), {})


def test_readme_shard_map_training_step_runs():
    text = README.read_text()
    section = text.split("### A complete shard_map training step", 1)[1]
    code = section.split("```python", 1)[1].split("```", 1)[0]
    namespace = {}
    exec(compile(code, "README.md", "exec"), namespace)
    assert float(namespace["loss"]) < 2.0  # below log(10): it trained


def test_readme_scaling_example_runs():
    text = README.read_text()
    section = text.split("## Scaling", 1)[1]
    code = section.split("```python", 1)[1].split("```", 1)[0]
    namespace = {}
    exec(compile(code, "README.md", "exec"), namespace)
    report, d = namespace["report"], 512 * 256 + 256
    assert report.fast_bits == 32 * 5 * (d // 4)  # reduce-scatter 4 shards, gather 1, float32
    assert 0 < report.slow_bits < report.fast_bits / 10


def test_readme_model_sharded_example_runs():
    text = README.read_text()
    section = text.split("### Model-sharded parameters", 1)[1]
    code = section.split("```python", 1)[1].split("```", 1)[0]
    namespace = {}
    exec(compile(code, "README.md", "exec"), namespace)
    params = namespace["params"]
    assert params["w"].sharding.spec == namespace["P"](None, "model")
    assert not bool(jax.numpy.allclose(params["w"], 0.1))  # it stepped

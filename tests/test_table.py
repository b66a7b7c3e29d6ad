"""The compressor tables' names: a spec may call every compressor factory of ``compjax.__all__``
(and those only), each the same function as ``compjax``'s."""

import inspect

import pytest

import compjax
from compjax import table
from compjax.compressor import Compressor


def compressor_factories() -> dict:
    """``compjax.__all__``'s functions that return a compressor (by their annotation)."""
    out = {}
    for name in compjax.__all__:
        f = getattr(compjax, name)
        if not inspect.isfunction(f):
            continue
        returns = inspect.signature(f, eval_str=True).return_annotation
        if inspect.isclass(returns) and issubclass(returns, Compressor):
            out[name] = f
    return out


def test_the_tables_call_every_compressor_factory_of_compjax():
    factories = compressor_factories()
    assert {"qsgd", "top_k", "rand_k", "int_quant", "chain", "mx"} <= set(factories)
    assert set(table.FACTORIES) == set(factories)
    assert all(table.FACTORIES[n] is f for n, f in factories.items())


def test_a_spec_builds_its_compressor_and_nothing_else():
    assert table.build("chain(top_k(ratio=0.01), qsgd(levels=16))") == compjax.chain(
        compjax.top_k(ratio=0.01), compjax.qsgd(levels=16)
    )
    with pytest.raises(NameError):
        table.build("compress(qsgd(4))")  # a transformation, not a compressor

"""orbax-checkpoint, the documented path: the whole training state under shard_map (per-worker
leaves sharded over the data axis) saved and restored onto the mesh, continuing bit for bit."""

import functools
import importlib
import pkgutil

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
W0 = {"w": jnp.linspace(-0.3, 0.3, 18).reshape(6, 3), "b": jnp.zeros(3)}
#: Every transformation compjax exports (test_every_transformation_is_checkpointed checks
#: that none is missing), on a 2-D kernel and a 1-D bias.
BUILDERS = {
    "compress(qsgd)": lambda: compjax.compress(compjax.qsgd(levels=4), "data"),
    "compress(top_k, scatter_gather)": lambda: compjax.compress(
        compjax.top_k(ratio=0.5), "data", exchange="scatter_gather"
    ),
    "error_feedback(top_k)": lambda: compjax.error_feedback(compjax.top_k(ratio=0.3), "data"),
    "ef21(top_k)": lambda: compjax.ef21(compjax.top_k(ratio=0.3), "data"),
    "diana(qsgd, scatter_gather)": lambda: compjax.diana(
        compjax.qsgd(levels=4), "data", exchange="scatter_gather"
    ),
    "dgc": lambda: compjax.dgc("data", 0.3, min_size=1),
    # min_compression_rate=1 compresses the 6 x 3 kernel; the bias is sent dense.
    "powersgd": lambda: compjax.powersgd(1, "data", min_compression_rate=1.0),
    "signum": lambda: compjax.sign_majority_vote("data", momentum=0.9),
    "terngrad_allreduce": lambda: compjax.terngrad_allreduce("data"),
    "variance_based": lambda: compjax.variance_based("data", budget=0.5),
    "strom_threshold": lambda: compjax.strom_threshold("data", 0.05, budget=0.5),
    # Compressed from the third step on: the checkpoint holds both error memories.
    "onebit_adam": lambda: compjax.scale_by_onebit_adam("data", freeze_step=2),
    # Variance steps 1, 2, 4; 1-bit gradients at 3 and 5; frozen momentum from step 6.
    "zero_one_adam": lambda: compjax.scale_by_zero_one_adam("data", 4, 2),
    # Two 3 x 3 chunks of the 6 x 3 kernel, 2 of their 9 coefficients sent: delta keeps the rest.
    "demo": lambda: compjax.scale_by_demo("data", chunk=3, topk=2),
}
#: Transformations whose input is per-example gradients.
PER_EXAMPLE = {"variance_based"}


def loss(p, x, y):
    return jnp.mean((x @ p["w"] + p["b"] - y) ** 2)


def setup(tx, per_example: bool = False):
    mesh = jax.make_mesh((N,), ("data",))
    opt = optax.chain(tx, optax.sgd(0.1))
    specs = compjax.state_specs(jax.eval_shape(opt.init, W0), "data")
    grad = functools.partial(compjax.per_example_grads, loss) if per_example else jax.grad(loss)

    def step(p, s, x, y):
        g = grad(compjax.worker_params(p, "data"), x, y)
        u, s = opt.update(g, s, p)
        return optax.apply_updates(p, u), s

    init = jax.jit(jax.shard_map(opt.init, mesh=mesh, in_specs=P(), out_specs=specs))
    run = jax.jit(
        jax.shard_map(
            step, mesh=mesh, in_specs=(P(), specs, P("data"), P("data")), out_specs=(P(), specs)
        )
    )
    shard = NamedSharding(mesh, P("data"))

    def batch(t):
        x = jax.random.normal(jax.random.key(2 * t), (32, 6))
        y = jax.random.normal(jax.random.key(2 * t + 1), (32, 3))
        return jax.device_put(x, shard), jax.device_put(y, shard)

    return mesh, specs, init, run, batch


def abstract(tree):
    """What to restore onto: shapes, dtypes and shardings of ``tree``."""
    return jax.tree.map(ocp.utils.to_shape_dtype_struct, tree)


#: State kinds the fast suite checkpoints (per-worker memories, server memories, PowerSGD's
#: None leaves, counters); the rest run with make test-slow (1-bit Adam's two memories also
#: in test_onebit_adam's orbax test).
FAST = {"error_feedback(top_k)", "powersgd", "strom_threshold"}


@pytest.mark.parametrize(
    "name", [n if n in FAST else pytest.param(n, marks=pytest.mark.slow) for n in BUILDERS]
)
def test_standard_checkpointer_continues_bit_identically(name, tmp_path):
    _, _, init, run, batch = setup(BUILDERS[name](), name in PER_EXAMPLE)
    params, state = W0, init(W0)
    for t in range(3):
        params, state = run(params, state, *batch(t))
    ckptr = ocp.StandardCheckpointer()
    ckptr.save(tmp_path / "ckpt", {"params": params, "state": state})
    ckptr.wait_until_finished()
    target = abstract({"params": params, "state": state})
    for t in range(3, 6):
        params, state = run(params, state, *batch(t))
    restored = ckptr.restore(tmp_path / "ckpt", target)
    p2, s2 = restored["params"], restored["state"]
    for a, b in zip(jax.tree.leaves(s2), jax.tree.leaves(target["state"]), strict=True):
        assert a.sharding == b.sharding  # per-worker leaves back on the data axis
    for t in range(3, 6):
        p2, s2 = run(p2, s2, *batch(t))
    for a, b in zip(jax.tree.leaves((params, state)), jax.tree.leaves((p2, s2)), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_every_transformation_is_checkpointed():
    # FSDPState is the state of compjax.fsdp's step, not of a transformation: test_fsdp
    # checkpoints it; AutoState is compjax.auto's, checkpointed (chosen and mid-trial) in
    # test_auto.
    # Every transformation's state class: the *State classes defined in compjax.transforms.
    exported = set()
    for info in pkgutil.iter_modules(compjax.transforms.__path__):
        module = importlib.import_module(f"compjax.transforms.{info.name}")
        exported |= {
            c
            for name, c in vars(module).items()
            if name.endswith("State") and isinstance(c, type) and c.__module__ == module.__name__
        }
    assert {compjax.DianaState, compjax.DGCState} <= exported
    covered = {type(jax.eval_shape(make().init, W0)) for make in BUILDERS.values()}
    # DiLoCo trains per-worker params, checkpointed mid-round in test_diloco (Streaming
    # DiLoCo's state is DiLoCo's with one outer state per fragment), and so do 0/1 Adam's
    # local rounds, checkpointed mid-round in test_zero_one_adam_local.
    local = {compjax.DiLoCoState, compjax.StreamingDiLoCoState, compjax.ZeroOneAdamLocalState}
    assert exported == covered | local


def test_checkpoint_manager_restores_the_latest_step(tmp_path):
    _, _, init, run, batch = setup(BUILDERS["error_feedback(top_k)"]())
    params, state = W0, init(W0)
    with ocp.CheckpointManager(tmp_path, options=ocp.CheckpointManagerOptions(max_to_keep=2)) as m:
        for t in range(4):
            params, state = run(params, state, *batch(t))
            m.save(t, args=ocp.args.StandardSave({"params": params, "state": state}))
        m.wait_until_finished()
        assert m.latest_step() == 3 and len(m.all_steps()) == 2
        target = abstract({"params": params, "state": state})
        restored = m.restore(3, args=ocp.args.StandardRestore(target))
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves((params, state)), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert restored["state"][0].error["w"].sharding.spec[0] == "data"


def test_flax_serialization_restores_onto_the_mesh_with_device_put(tmp_path):
    """flax.serialization gives host arrays; device_put them with the state's specs."""
    from flax import serialization

    mesh, specs, init, run, batch = setup(BUILDERS["error_feedback(top_k)"]())
    params, state = W0, init(W0)
    for t in range(2):
        params, state = run(params, state, *batch(t))
    blob = serialization.to_bytes({"params": params, "state": state})
    host = serialization.from_bytes({"params": params, "state": state}, blob)
    shardings = jax.tree.map(
        lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P)
    )
    p2 = jax.device_put(host["params"], NamedSharding(mesh, P()))
    s2 = jax.device_put(host["state"], shardings)
    assert s2[0].error["w"].sharding.spec == P("data")
    for t in range(2, 4):
        params, state = run(params, state, *batch(t))
        p2, s2 = run(p2, s2, *batch(t))
    for a, b in zip(jax.tree.leaves((params, state)), jax.tree.leaves((p2, s2)), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

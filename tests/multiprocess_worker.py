"""The computation shared by the multi-process test and its single-process reference.

Run as a script, this is one process of a ``jax.distributed`` job on
127.0.0.1 (gloo CPU collectives, 2 CPU devices per process)::

    python tests/multiprocess_worker.py --process-id 0 --num-processes 2 \\
        --port 12345 --out updates.npz

Imported (by ``tests/test_multiprocess.py``), :func:`run` computes the same
updates on any mesh of the current process, e.g. 4 of its simulated devices.
Every worker's gradient depends only on its index and the step, so the two
runs must agree.  The :func:`compjax.fsdp` cases train a small model on a
batch split over the workers, and compare the params after each step; the
:func:`compjax.diloco` cases train the same model on per-worker params
(:func:`compjax.local_steps`) and compare every worker's params and the global
params after each step.
"""

import os

if __name__ == "__main__":
    # As a worker: 2 CPU devices in this process, requested before jax is imported.
    # (Compiled cheaply, as in tests/conftest.py.)
    os.environ["XLA_FLAGS"] = (
        "--xla_force_host_platform_device_count=2 --xla_backend_optimization_level=0"
        " --xla_llvm_disable_expensive_passes=true --xla_cpu_use_fusion_emitters=false"
        " --xla_cpu_parallel_codegen_split_count=1"
    )

import argparse
import sys
import traceback
from collections.abc import Callable

import jax
import numpy as np
import optax
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding

import compjax

P = jax.P
AXIS = "data"
WORKERS = 4
STEPS = 3
SHAPES = {"w": (5, 3), "b": (3,)}
INIT_TIMEOUT_S = 60


def transforms() -> dict[str, optax.GradientTransformation]:
    """The transformations under test: all_gather, psum, integer-sum and scatter-gather paths."""
    return {
        "compress_qsgd": compjax.compress(compjax.qsgd(levels=4), AXIS),
        "compress_rand_k_shared": compjax.compress(
            compjax.rand_k(ratio=0.5, shared_seed=True), AXIS
        ),
        "error_feedback_top_k": compjax.error_feedback(compjax.top_k(ratio=0.3), AXIS),
        "diana_qsgd": compjax.diana(compjax.qsgd(levels=4), AXIS),
        "diana_int_quant": compjax.diana(compjax.int_quant(4), AXIS),
        "compress_qsgd_scatter_gather": compjax.compress(
            compjax.qsgd(levels=4), AXIS, exchange="scatter_gather"
        ),
        "error_feedback_top_k_scatter_gather": compjax.error_feedback(
            compjax.top_k(ratio=0.3), AXIS, exchange="scatter_gather"
        ),
        "ef21_top_k": compjax.ef21(compjax.top_k(ratio=0.3), AXIS),
        "sign_vote": compjax.sign_majority_vote(AXIS),
        "signum_psum": compjax.sign_majority_vote(AXIS, momentum=0.9, via="psum"),
        "terngrad_allreduce": compjax.terngrad_allreduce(AXIS),
    }


#: One transformation per way a message travels (all-gather, psum of linear payloads, integer
#: sums, scatter-gather's all-to-all with a server memory, TernGrad's int8 psum with a shared
#: scale, and compjax.fsdp's compressed parameter gather and gradient reduce-scatter with an
#: error memory split over the workers): the fast suite's run; the others, the packed and int8
#: votes among them, repeat those paths (make test-slow).
FAST_NAMES = (
    "compress_qsgd",
    "compress_rand_k_shared",
    "diana_int_quant",
    "error_feedback_top_k_scatter_gather",
    "terngrad_allreduce",
    "fsdp_int_quant_ef_int8_gather",
)

#: compjax.fsdp's cases: a kernel split over the workers (rows divisible by ``WORKERS``) and a
#: bias left replicated (``FSDP_MIN_SIZE``), trained on a batch each worker holds a part of.
FSDP_SHAPES = {"w": (8, 3), "b": (3,)}
FSDP_MIN_SIZE = 16
FSDP_BATCH = 2 * WORKERS


def fsdp_cases() -> dict[str, dict]:
    """:func:`compjax.fsdp`'s keyword arguments under test: lossless, and compressed both ways
    (int4 gradients with error feedback, int8 parameter gather)."""
    return {
        "fsdp_exact": {},
        "fsdp_int_quant_ef_int8_gather": {
            "compressor": compjax.int_quant(4),
            "feedback": "ef",
            "gather": "int8",
            "gather_block": 8,
        },
    }


#: compjax.diloco's cases (slow suite only): inner SGD on each worker's own params, the
#: paper's outer Nesterov step every ``DILOCO_H`` steps (``STEPS`` holds a sync), with the
#: exact mean, with unbiased integer codes summed as integers, and with top-k and an error
#: memory per worker; and 0/1 Adam's local rounds.  They train the fsdp cases' model on the
#: same batches.
DILOCO_H = 2


def diloco_cases() -> dict[str, optax.GradientTransformation]:
    """:func:`compjax.diloco` transformations under test."""

    def diloco(**kwargs):
        outer = optax.sgd(0.7, momentum=0.9, nesterov=True)
        return compjax.diloco(optax.sgd(0.1), outer, DILOCO_H, AXIS, **kwargs)

    return {
        "diloco_nesterov": diloco(),
        "diloco_int_quant": diloco(compressor=compjax.int_quant(8)),
        "diloco_top_k_ef": diloco(compressor=compjax.top_k(ratio=0.3)),
        # 0/1 Adam's local rounds: the variance frozen after step 0, then rounds of 2 steps.
        "zero_one_adam_local": compjax.zero_one_adam(
            0.05, AXIS, var_freeze_step=1, local_step_scaler=1, local_step_clipper=2
        ),
    }


def fsdp_loss(params, x, y):
    """A worker's mean squared error on its part of the batch."""
    return jax.numpy.mean((jax.numpy.tanh(x @ params["w"]) + params["b"] - y) ** 2)


def fsdp_batch(step: int) -> tuple[np.ndarray, np.ndarray]:
    """The global batch at ``step`` (each worker gets ``FSDP_BATCH // WORKERS`` rows)."""
    rng = np.random.default_rng([321, step])
    x = rng.standard_normal((FSDP_BATCH, FSDP_SHAPES["w"][0])).astype(np.float32)
    y = rng.standard_normal((FSDP_BATCH, FSDP_SHAPES["w"][1])).astype(np.float32)
    return x, y


def worker_grads(worker: int, step: int) -> dict[str, np.ndarray]:
    """Worker ``worker``'s gradient at ``step``: a fixed function of the two."""
    rng = np.random.default_rng([123, worker, step])
    return {name: rng.standard_normal(shape).astype(np.float32) for name, shape in SHAPES.items()}


def global_grads(step: int) -> dict[str, np.ndarray]:
    """All workers' gradients at ``step``, concatenated on the leading axis."""
    per_worker = [worker_grads(w, step) for w in range(WORKERS)]
    return {name: np.concatenate([g[name] for g in per_worker]) for name in SHAPES}


def to_global(tree, mesh: Mesh, spec) -> dict[str, jax.Array]:
    """Host arrays as global jax arrays with ``spec``: each process fills its own shards."""
    sharding = NamedSharding(mesh, spec)
    return {
        name: jax.make_array_from_callback(x.shape, sharding, lambda index, x=x: x[index])
        for name, x in tree.items()
    }


def to_host(tree) -> dict[str, np.ndarray]:
    """Global jax arrays, possibly spread over processes, as full numpy arrays."""
    return jax.tree.map(np.asarray, multihost_utils.process_allgather(tree, tiled=True))


def compiled(tx: optax.GradientTransformation, mesh: Mesh, params) -> tuple[Callable, Callable]:
    """``(init, update)`` of ``tx`` as jitted ``shard_map``s over ``mesh``."""
    specs = compjax.state_specs(jax.eval_shape(tx.init, params), AXIS)
    init = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs))
    update = jax.jit(
        jax.shard_map(
            lambda g, s: tx.update(g, s),
            mesh=mesh,
            in_specs=(P(AXIS), specs),
            out_specs=(P(), specs),
        )
    )
    return init, update


def run_one(tx: optax.GradientTransformation, mesh: Mesh, steps: int) -> dict[str, np.ndarray]:
    """Updates of ``steps`` steps and the final state's leaves, as ``{name: array}``."""
    params = to_global({k: np.zeros(s, np.float32) for k, s in SHAPES.items()}, mesh, P())
    init, update = compiled(tx, mesh, params)
    state = init(params)
    out = {}
    for step in range(steps):
        updates, state = update(to_global(global_grads(step), mesh, P(AXIS)), state)
        for name, x in to_host(updates).items():
            out[f"step{step}/{name}"] = x
    for i, leaf in enumerate(jax.tree.leaves(to_host(state))):
        out[f"state/{i}"] = leaf
    return out


def initial_params() -> dict[str, np.ndarray]:
    """The fsdp and DiLoCo cases' starting params (:data:`FSDP_SHAPES`), the same everywhere."""
    return {
        name: np.linspace(-0.5, 0.5, int(np.prod(shape)), dtype=np.float32).reshape(shape)
        for name, shape in FSDP_SHAPES.items()
    }


def run_fsdp(kwargs: dict, mesh: Mesh, steps: int) -> dict[str, np.ndarray]:
    """:func:`compjax.fsdp`'s params and loss after each of ``steps`` steps and its final
    state's leaves, as ``{name: array}``."""
    params = to_global(initial_params(), mesh, P())
    fs = compjax.fsdp(
        fsdp_loss, optax.adam(0.05), params, mesh, AXIS, min_size=FSDP_MIN_SIZE, **kwargs
    )
    state = fs.init(params)
    out = {}
    for step in range(steps):
        x, y = fsdp_batch(step)
        batch = to_global({"x": x, "y": y}, mesh, P(AXIS))
        params, state, loss = fs.step(params, state, batch["x"], batch["y"])
        for name, x in to_host(params).items():
            out[f"step{step}/{name}"] = x
        out[f"step{step}/loss"] = np.asarray(to_host({"loss": loss})["loss"])
    for i, leaf in enumerate(jax.tree.leaves(to_host(state))):
        out[f"state/{i}"] = leaf
    return out


def run_diloco(tx: optax.GradientTransformation, mesh: Mesh, steps: int) -> dict[str, np.ndarray]:
    """:func:`compjax.local_steps` with ``tx``: after each of ``steps`` steps every worker's
    params (stacked), the global params and the loss; then the final state's leaves."""
    params = to_global(initial_params(), mesh, P())
    ls = compjax.local_steps(fsdp_loss, tx, params, mesh, AXIS)
    local, state = ls.init(params)
    out = {}
    for step in range(steps):
        x, y = fsdp_batch(step)
        batch = to_global({"x": x, "y": y}, mesh, P(AXIS))
        local, state, loss = ls.step(local, state, batch["x"], batch["y"])
        for name, value in to_host(local).items():
            out[f"step{step}/local_{name}"] = value
        for name, value in to_host(compjax.global_params(state)).items():
            out[f"step{step}/global_{name}"] = value
        out[f"step{step}/loss"] = np.asarray(to_host({"loss": loss})["loss"])
    for i, leaf in enumerate(jax.tree.leaves(to_host(state))):
        out[f"state/{i}"] = leaf
    return out


def run(mesh: Mesh, steps: int = STEPS, names=None) -> dict[str, np.ndarray]:
    """The results of the transformations ``names`` (``None``: every one) on ``mesh``
    (``WORKERS`` devices on axis ``AXIS``)."""
    if mesh.shape != {AXIS: WORKERS}:
        raise ValueError(f"expected a mesh {{{AXIS!r}: {WORKERS}}}, got {dict(mesh.shape)}")
    out = {
        f"{label}/{key}": value
        for label, tx in transforms().items()
        if names is None or label in names
        for key, value in run_one(tx, mesh, steps).items()
    }
    for label, kwargs in fsdp_cases().items():
        if names is None or label in names:
            out.update({f"{label}/{k}": v for k, v in run_fsdp(kwargs, mesh, steps).items()})
    for label, tx in diloco_cases().items():
        if names is None or label in names:
            out.update({f"{label}/{k}": v for k, v in run_diloco(tx, mesh, steps).items()})
    return out


def parse_args(argv=None) -> argparse.Namespace:
    """The command line of one worker process."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--process-id", type=int, required=True)
    parser.add_argument("--num-processes", type=int, default=2)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--out", required=True, help="the .npz file to write (process 0)")
    parser.add_argument(
        "--names",
        default=None,
        help="comma-separated transformations, fsdp and diloco cases (all)",
    )
    return parser.parse_args(argv)


def main(argv=None) -> None:
    """Join the loopback job, run every transformation; process 0 writes the results.

    On an error the traceback is printed and the process exits at once, rather
    than waiting in ``jax.distributed.shutdown`` for a peer that may never come.
    """
    args = parse_args(argv)
    address = f"127.0.0.1:{args.port}"
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        address,
        num_processes=args.num_processes,
        process_id=args.process_id,
        coordinator_bind_address=address,
        initialization_timeout=INIT_TIMEOUT_S,
    )
    try:
        names = None if args.names is None else args.names.split(",")
        results = run(jax.make_mesh((WORKERS,), (AXIS,)), names=names)
        if args.process_id == 0:
            np.savez(args.out, **results)
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()

"""What a training config builds: the workers' shards, the model, the jitted steps, the bits.

:class:`Problem` holds everything about a :class:`~experiments.harness.config.Config`
that does not change during a run: the training set dealt into equal worker
shards, the flax model and its loss, the method's compjax transformation and
the optimizer around it, the ``("data",)`` mesh, the jitted ``lax.scan`` of
steps under ``jax.shard_map``, the evaluation, and the bits one worker sends
in each step (traced abstractly from the step function itself).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import compjax
from compjax import costmodel
from compjax.recording import recording
from experiments.common import data, methods, models
from experiments.harness import tasks
from experiments.harness.config import Config

P = jax.P
AXIS = "data"


class Problem:
    """Everything about a config that does not change during the run."""

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.task = tasks.get(cfg.task)
        self.method = methods.parse(cfg.method)
        n = cfg.workers
        self.dataset = self.task.dataset(n, cfg.seed)
        self.x, self.y = data.worker_shards(self.dataset.train, n, self.dataset.partition, cfg.seed)
        self.shard_size = self.x.shape[1]
        self.dropped = data.dropped_examples(
            self.dataset.train, n, self.dataset.partition, cfg.seed
        )
        self.batch = cfg.batch_size or self.shard_size
        if self.batch > self.shard_size:
            raise ValueError(
                f"batch_size={self.batch} exceeds a worker's {self.shard_size} examples"
            )
        self.module = self.task.model(self.dataset.num_classes)
        init_key, self.data_key = jax.random.split(jax.random.key(cfg.seed))
        self.params = self.module.init(init_key, jnp.asarray(self.x[0, :1]))["params"]
        self.loss = tasks.loss_fn(self.module)
        self.exchange = self.method.build(AXIS)
        self.opt = self.optimizer(self.exchange)
        self.mesh = jax.make_mesh((n,), (AXIS,), devices=jax.devices()[:n])
        self.specs = compjax.state_specs(jax.eval_shape(self.opt.init, self.params), AXIS)
        self.network = costmodel.Network(cfg.bandwidth_gbps, cfg.latency_us)
        self.optimum = None
        if self.task.convex:
            flat_x = self.x.reshape(-1, *self.x.shape[2:])
            self.optimum = tasks.optimum(
                flat_x, self.y.reshape(-1), self.dataset.num_classes, self.task.l2
            )

    def optimizer(self, exchange: optax.GradientTransformation) -> optax.GradientTransformation:
        parts = [exchange]
        if self.task.l2:
            parts.append(optax.add_decayed_weights(self.task.l2))
        parts.append(optax.sgd(self.cfg.lr, momentum=self.cfg.momentum or None))
        return optax.chain(*parts)

    # -- one worker's step (inside shard_map, or vmap for the accounting) --

    def loss_and_accuracy(self, params, batch):
        x, y = batch
        logits = self.module.apply({"params": params}, x)
        return models.cross_entropy(logits, y), models.accuracy(logits, y)

    def local_batch(self, x, y, step):
        if self.batch == self.shard_size:
            return x, y
        key = jax.random.fold_in(jax.random.fold_in(self.data_key, step), _worker(AXIS))
        idx = jax.random.permutation(key, self.shard_size)[: self.batch]
        return x[idx], y[idx]

    def gradients(self, params, batch, step):
        """``(loss, accuracy, grads)`` of this worker, as the method needs them."""
        kind, opts = self.method.gradients, self.method.options
        if kind in ("dad", "rank_dad"):
            key = jax.random.fold_in(jax.random.key(self.cfg.seed + 1), step)
            fn, extra = compjax.dad_grads, {}
            if kind == "rank_dad":
                fn = compjax.rank_dad_grads
                extra = {"rank": opts["rank"], "iterations": opts.get("iterations", 2)}
            (loss, acc), grads = fn(
                self.loss_and_accuracy,
                params,
                batch,
                AXIS,
                has_aux=True,
                compressor=opts.get("compressor"),
                key=key,
                **extra,
            )
            return loss, acc, grads
        local = compjax.worker_params(params, AXIS)
        if kind == "per_example":
            loss, acc = self.loss_and_accuracy(local, batch)
            grads = compjax.per_example_grads(lambda p, x, y: self.loss(p, (x, y)), local, *batch)
            return loss, acc, grads
        (loss, acc), grads = jax.value_and_grad(self.loss_and_accuracy, has_aux=True)(local, batch)
        return loss, acc, grads

    def local_step(self, params, opt_state, x, y, step, opt=None):
        opt = self.opt if opt is None else opt
        loss, acc, grads = self.gradients(params, self.local_batch(x, y, step), step)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, acc

    # -- the jitted pieces --

    def chunk_fn(self):
        """``(params, state, x, y, steps) -> (params, state, (loss, acc, counters))`` jitted."""

        def chunk(params, opt_state, x, y, steps):
            x, y = x[0], y[0]

            def body(carry, step):
                params, opt_state = carry
                params, opt_state, loss, acc = self.local_step(params, opt_state, x, y, step)
                out = (
                    jax.lax.pmean(loss, AXIS),
                    jax.lax.pmean(acc, AXIS),
                    _counters(opt_state),
                )
                return (params, opt_state), out

            (params, opt_state), out = jax.lax.scan(body, (params, opt_state), steps)
            return params, opt_state, out

        out_specs = (P(), self.specs, (P(), P(), P(None, None, AXIS)))
        in_specs = (P(), self.specs, P(AXIS), P(AXIS), P())
        return jax.jit(jax.shard_map(chunk, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs))

    def init_state(self, params):
        init = jax.shard_map(self.opt.init, mesh=self.mesh, in_specs=P(), out_specs=self.specs)
        return jax.jit(init)(params)

    def eval_sets(self) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """``{"train", "test"[, "validation"]: (x, y)}`` the evaluation uses.

        The train set is the workers' shards (the examples trained on); each
        set is cut to the task's ``eval_examples`` (evenly spaced) if it has one.
        """
        sets = {
            "train": (self.x.reshape(-1, *self.x.shape[2:]), self.y.reshape(-1, *self.y.shape[2:])),
            "test": (self.dataset.test.x, self.dataset.test.y),
        }
        if self.dataset.validation is not None:
            sets["validation"] = (self.dataset.validation.x, self.dataset.validation.y)
        cap = self.task.eval_examples
        for name, (x, y) in sets.items():
            if cap is not None and len(y) > cap:
                idx = np.linspace(0, len(y) - 1, cap).round().astype(int)
                sets[name] = (x[idx], y[idx])
        return sets

    def eval_fn(self):
        sets = {k: (jnp.asarray(x), jnp.asarray(y)) for k, (x, y) in self.eval_sets().items()}
        optimum = self.optimum
        l2 = self.task.l2

        @jax.jit
        def evaluate(params):
            train_loss, train_acc = self.loss_and_accuracy(params, sets["train"])
            test_loss, test_acc = self.loss_and_accuracy(params, sets["test"])
            out = {
                "objective": train_loss + tasks.l2_term(params, l2),
                "train_accuracy": train_acc,
                "test_loss": test_loss,
                "test_accuracy": test_acc,
            }
            if "validation" in sets:
                val_loss, val_acc = self.loss_and_accuracy(params, sets["validation"])
                out["validation_loss"], out["validation_accuracy"] = val_loss, val_acc
            if optimum is not None:
                diff = jax.tree.map(lambda p, q: p - q.astype(p.dtype), params, optimum)
                out["dist_to_opt"] = sum(jnp.sum(jnp.square(d)) for d in jax.tree.leaves(diff))
            return out

        return evaluate

    # -- bits per step --

    def messages(self, exchange: optax.GradientTransformation) -> list[tuple[str, int]]:
        """``(kind, bits)`` one worker sends in a step, traced abstractly (nothing runs)."""
        opt = self.optimizer(exchange)
        shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), self.params)
        n = self.cfg.workers
        xs = jax.ShapeDtypeStruct((n, *self.x.shape[1:]), self.x.dtype)
        ys = jax.ShapeDtypeStruct((n, *self.y.shape[1:]), self.y.dtype)

        def step(params, x, y):
            state = opt.init(params)
            return self.local_step(params, state, x, y, jnp.int32(0), opt=opt)[0]

        with recording() as log:
            jax.eval_shape(jax.vmap(step, in_axes=(None, 0, 0), axis_name=AXIS), shapes, xs, ys)
        return [message for _, sent in log for message in sent]

    def split(self, messages) -> tuple[int, int]:
        """``(all-reduced bits, all-gathered bits)`` of these messages."""
        gathered = sum(b for kind, b in messages if self.method.gathered(kind))
        return sum(b for _, b in messages) - gathered, gathered

    def bits_plan(self) -> dict[str, Any]:
        """The static bits per step: ``steady`` and, where they differ, per-phase schedules."""
        steady = self.messages(self.exchange)
        plan = {"steady": steady, "phases": [], "dense_until": 0}
        opts = self.method.options
        if self.method.name == "dgc" and opts.get("warmup_steps_per_phase", 0):
            per = int(opts["warmup_steps_per_phase"])
            step = 0
            while (build := self.method.dgc_phase(step)) is not None:
                plan["phases"].append((step, step + per, self.messages(build(AXIS))))
                step += per
        # Warm-ups that all-reduce the gradient uncompressed (and record nothing while traced).
        warmup = {"powersgd": opts.get("start_iter", 0), "onebit_adam": opts.get("freeze_step", 0)}
        if warmup.get(self.method.name):
            dense = [("dense", 32 * a.size) for a in jax.tree.leaves(self.params)]
            flags = [m for m in steady if m[0] == "flag"]
            plan["dense_until"] = int(warmup[self.method.name])
            plan["dense"] = flags + dense
        return plan

    def step_messages(self, plan, step: int):
        """Messages of the step that starts at ``step`` (0-based)."""
        if step < plan["dense_until"]:
            return plan["dense"]
        for start, stop, messages in plan["phases"]:
            if start <= step < stop:
                return messages
        return plan["steady"]


def _worker(axis):
    return compjax.axes.worker_index(axis)


def _counted(node) -> bool:
    return isinstance(node, compjax.VarianceBasedState | compjax.StromState)


def _counters(opt_state) -> jax.Array:
    """The real-bits counters of variance-based / Strom states: ``(nodes, 1, 2)`` uint32."""
    nodes = [n for n in jax.tree.leaves(opt_state, is_leaf=_counted) if _counted(n)]
    if not nodes:
        return jnp.zeros((0, 1, 2), jnp.uint32)
    return jnp.stack([n.bits_sent for n in nodes])


def real_totals(counters: np.ndarray) -> np.ndarray:
    """Total real bits over all nodes and workers from ``(steps, nodes, workers, 2)`` counters."""
    c = counters.astype(np.uint64)
    return (c[..., 0] + (c[..., 1] << np.uint64(32))).sum(axis=(1, 2)).astype(np.int64)

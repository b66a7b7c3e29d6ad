"""The workload of ``make bench-net`` (and the model of ``make bench-e2e``): a small GPT-style
language model, its data, the methods.

* :class:`LMConfig`, :func:`init_params`, :func:`loss_fn`: a decoder-only
  transformer language model in plain JAX (pre-norm blocks, causal
  multi-head attention, a 4x MLP, learned positions, an untied output head);
  10,506,496 parameters at the defaults, in 52 leaves;
* :func:`tokens`: synthetic token sequences generated locally, a learnable
  stream (``t' = (a t + b) mod V`` with 10% of the tokens replaced at random),
  so the loss of a real training run falls;
* :data:`METHODS`: the exchanges the benchmark times, as expressions of the
  training harness (:func:`experiments.common.methods.parse`), each with the
  collective its payload travels by; and two local-steps methods, DiLoCo
  with int8 pseudo-gradients every ``H = 50`` steps (:func:`diloco_optimizer`)
  and SparseLoCo at its paper's defaults, which synchronise once a round.

QSGD runs at ``levels=7``: one sign bit and ``bit_length(7) = 3`` magnitude
bits pack to 4 bits per entry (``levels`` 2 to 7 all pack to 4 bits, 8 needs
5 and packs to 8), so 7 is the finest QSGD at 4 bits on the wire.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.flatten_util import ravel_pytree

import compjax
from compjax import axes, collectives, recording
from compjax.compressor import Compressor, to_dtype


@dataclasses.dataclass(frozen=True)
class LMConfig:
    """Sizes of the language model and of each worker's batch."""

    vocab: int = 8192
    width: int = 256
    layers: int = 8
    heads: int = 4
    length: int = 64
    batch_per_worker: int = 2

    @property
    def parameters(self) -> int:
        """Parameter count: ``2 V d + T d + L (12 d^2 + 2 d) + d``."""
        d = self.width
        return 2 * self.vocab * d + self.length * d + self.layers * (12 * d * d + 2 * d) + d


def init_params(cfg: LMConfig, seed: int = 0) -> dict:
    """Float32 numpy parameters: normal(0, 0.02) matrices, unit norm scales.

    Each block has its own leaves (``6 L + 4`` in all), as a framework's
    per-layer parameters are; every compjax method handles them leaf by leaf.
    """
    rng = np.random.default_rng(seed)
    d = cfg.width

    def normal(*shape, scale=0.02):
        return (rng.standard_normal(shape, dtype=np.float32) * np.float32(scale)).astype(np.float32)

    out_scale = 0.02 / math.sqrt(2 * cfg.layers)  # GPT-2's residual scaling
    layers = [
        {
            "norm1": np.ones(d, np.float32),
            "qkv": normal(d, 3 * d),
            "proj": normal(d, d, scale=out_scale),
            "norm2": np.ones(d, np.float32),
            "up": normal(d, 4 * d),
            "down": normal(4 * d, d, scale=out_scale),
        }
        for _ in range(cfg.layers)
    ]
    return {
        "embed": normal(cfg.vocab, d),
        "position": normal(cfg.length, d),
        "layers": layers,
        "norm": np.ones(d, np.float32),
        "head": normal(d, cfg.vocab),
    }


def _norm(x: jax.Array, scale: jax.Array) -> jax.Array:
    """RMS normalisation with a learned scale."""
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * scale


def _block(x: jax.Array, p: dict, heads: int) -> jax.Array:
    batch, length, d = x.shape
    q, k, v = jnp.split(_norm(x, p["norm1"]) @ p["qkv"], 3, axis=-1)
    q, k, v = (t.reshape(batch, length, heads, d // heads) for t in (q, k, v))
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(d // heads)
    causal = jnp.tril(jnp.ones((length, length), bool))
    weights = jax.nn.softmax(jnp.where(causal, scores, -1e9), axis=-1)
    x = x + jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(batch, length, d) @ p["proj"]
    return x + jax.nn.gelu(_norm(x, p["norm2"]) @ p["up"]) @ p["down"]


def loss_fn(params: dict, batch: jax.Array, heads: int) -> jax.Array:
    """Mean next-token cross-entropy of ``batch`` (``(B, T + 1)`` int32 tokens)."""
    inputs, targets = batch[:, :-1], batch[:, 1:]
    x = params["embed"][inputs] + params["position"][: inputs.shape[1]]
    for layer in params["layers"]:
        x = _block(x, layer, heads)
    logits = _norm(x, params["norm"]) @ params["head"]
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))


def tokens(cfg: LMConfig, worker: int, index: int, noise: float = 0.1) -> np.ndarray:
    """Batch ``index`` of worker ``worker``: ``(batch_per_worker, length + 1)`` int32 tokens.

    Each row starts at a random token and follows ``t' = (5 t + 17) mod V``;
    a fraction ``noise`` of the tokens is then replaced by uniform ones.
    """
    rng = np.random.default_rng([7, worker, index])
    rows, cols = cfg.batch_per_worker, cfg.length + 1
    out = np.empty((rows, cols), np.int64)
    out[:, 0] = rng.integers(0, cfg.vocab, rows)
    for t in range(1, cols):
        out[:, t] = (5 * out[:, t - 1] + 17) % cfg.vocab
    replace = rng.random((rows, cols)) < noise
    out[replace] = rng.integers(0, cfg.vocab, int(replace.sum()))
    return out.astype(np.int32)


def bf16_allreduce(axis_name) -> optax.GradientTransformation:
    """The bfloat16 baseline: a mean over workers that moves bf16 on the wire, as NCCL's does.

    XLA's CPU backend runs every collective of bfloat16 arrays in float32
    (the compiled all-reduce of ``compress(cast('bfloat16'))``, and even an
    all-to-all or all-gather of bf16, is f32, and the loopback counts 32 bits
    per entry), which would make the bf16 baseline as slow as the f32 one.
    So the baseline here is the all-reduce written as its two ring phases,
    with the bf16 bits sent as uint16: the whole gradient, raveled, is cast
    to bf16 and split into ``n`` shards, an ``all_to_all`` hands shard ``j``
    to worker ``j`` (reduce-scatter), which sums it in float32, casts the sum
    to bf16 and all-gathers it: ``2 (n - 1) / n * 16 d`` bits per worker, the
    traffic of a bf16 ring all-reduce.
    """
    as_bits = lambda a: jax.lax.bitcast_convert_type(a, jnp.uint16)  # noqa: E731
    as_bf16 = lambda a: jax.lax.bitcast_convert_type(a, jnp.bfloat16)  # noqa: E731

    def update(updates, state, params=None):
        del params
        flat, unravel = ravel_pytree(updates)
        d, n = flat.size, axes.num_workers(axis_name)
        m = -(-d // n)
        shards = as_bits(jnp.pad(flat.astype(jnp.bfloat16), (0, n * m - d)).reshape(n, m))
        recording.record("scatter", shards, "all_to_all", axis_name)
        received = as_bf16(collectives.all_to_all(shards, axis_name))
        own = as_bits(jnp.sum(received.astype(jnp.float32), axis=0).astype(jnp.bfloat16))
        recording.record("gather", own, "all_gather", axis_name)
        total = as_bf16(collectives.all_gather_tiled(own, axis_name)[:d])
        return unravel(total.astype(flat.dtype) / n), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


@dataclasses.dataclass(frozen=True)
class BF16Bits(Compressor):
    """bfloat16 transport whose payload is the bfloat16 bits as ``uint16``: the bf16 FSDP
    baseline's gradient compressor.

    Not linear, so :func:`compjax.exchange.compressed_reduce_scatter` all-to-alls each
    worker's blocks and the owner sums the decodes in float32: a bf16 reduce-scatter on
    the wire.  (``compjax.cast("bfloat16")`` is linear and reduce-scattered with a
    ``psum_scatter`` of bfloat16, which XLA's CPU backend runs in float32.)  Rounding to
    nearest: relative error at most ``2**-9`` per entry in bfloat16's normal range.
    """

    unbiased: ClassVar[bool] = False
    linear: ClassVar[bool] = False
    deterministic: ClassVar[bool] = True
    keeps_dtype: ClassVar[bool] = True

    def encode(self, key, flat, dtype):
        low = to_dtype(flat, jnp.dtype(jnp.bfloat16))
        return {"bits": jax.lax.bitcast_convert_type(low, jnp.uint16)}, {}

    def decode(self, wire, side, n, dtype):
        return jax.lax.bitcast_convert_type(wire["bits"], jnp.bfloat16).astype(jnp.float32)

    def omega(self, d):
        return None

    def delta(self, d):
        return 1.0 - 2.0**-18

    def unbiased_range(self, d, dtype=jnp.float32):
        return None

    def bits(self, shape, dtype=jnp.float32):
        return math.prod(shape) * 16


@dataclasses.dataclass(frozen=True)
class BenchMethod:
    """One timed exchange.

    Attributes:
      key: short name for ``--methods``.
      label: the name in the table.
      spec: the harness expression (:func:`experiments.common.methods.parse`).
      collective: how its main payload travels: ``"allreduce"`` (a psum),
        ``"allgather"`` or ``"scatter_gather"`` (all-to-all of compressed
        shards, then an all-gather of the re-compressed sums); ``"fsdp"``
        (sharded training) or ``"local_steps"`` (per-worker params that
        synchronise once every ``sync_every`` steps).
      lr: SGD learning rate (the sign methods' updates are +-1 per entry).
      factory: builds the transformation from the axis name instead of
        ``spec`` (the bf16 baseline, which is not a library method).
      bits_per_entry: ``M_c / d`` for a ``factory`` method.
      fsdp: for a sharded-training method (``collective="fsdp"``), a function
        returning :func:`compjax.fsdp`'s keyword arguments (``compressor``,
        ``feedback``, ``gather``): the worker then builds the step with
        ``compjax.fsdp`` instead of the replicated step, and ``spec`` is
        only its description.
      local: for a local-steps method (``collective="local_steps"``),
        ``local(axis_name, sync_every)`` returns its optimizer of per-worker
        params (:func:`compjax.diloco` or one built on it): the worker then
        builds the step with :func:`compjax.local_steps`, and ``spec`` is
        only its description.
      sync_every: a local-steps method's ``H``, inner steps per round.
    """

    key: str
    label: str
    spec: str
    collective: str
    lr: float = 0.1
    factory: Callable | None = None
    bits_per_entry: int | None = None
    fsdp: Callable[[], dict] | None = None
    local: Callable[[str, int], optax.GradientTransformation] | None = None
    sync_every: int | None = None

    def __post_init__(self):
        if (self.collective == "local_steps") != (self.local is not None):
            raise ValueError(
                f"local: given exactly for collective='local_steps' (method {self.key!r})"
            )
        if self.local is not None and (not isinstance(self.sync_every, int) or self.sync_every < 1):
            raise ValueError(f"sync_every must be a positive integer, got {self.sync_every!r}")


#: DiLoCo's outer step (Nesterov, momentum 0.9) and learning rate, as in its paper.
DILOCO_OUTER_LR = 0.7
#: DiLoCo's inner AdamW learning rate in the timed rows (bench-e2e sweeps its own).
DILOCO_INNER_LR = 1e-3
DILOCO_H = 50
#: SparseLoCo's round in its paper's configuration (:func:`compjax.sparseloco`'s defaults).
SPARSELOCO_H = 15


def diloco_optimizer(
    lr: float, axis_name: str, sync_every: int, compressor: Compressor | None = None
) -> optax.GradientTransformation:
    """DiLoCo's Algorithm 1: inner AdamW at ``lr``, outer Nesterov (learning rate 0.7,
    momentum 0.9), a round of ``sync_every`` steps, pseudo-gradients sent by ``compressor``
    (``None``: exactly).

    References:
      Douillard et al., "DiLoCo: Distributed Low-Communication Training of Language
      Models", arXiv 2311.08105, 2023.
    """
    outer = optax.sgd(DILOCO_OUTER_LR, momentum=0.9, nesterov=True)
    return compjax.diloco(optax.adamw(lr), outer, sync_every, axis_name, compressor=compressor)


def sparseloco_optimizer(
    axis_name: str, sync_every: int, lr: float = 1e-3
) -> optax.GradientTransformation:
    """SparseLoCo as its paper configures it: inner AdamW (``lr``, weight decay 0.1) and
    :func:`compjax.sparseloco`'s defaults (top-32 of every 4096 entries in 2 bits, error
    decay 0.95, outer learning rate 1).

    References:
      Sarfi et al., "Communication Efficient LLM Pre-training with SparseLoCo",
      arXiv 2508.15706, 2025.
    """
    return compjax.sparseloco(optax.adamw(lr, weight_decay=0.1), sync_every, axis_name)


#: Every compressed method but PowerSGD (whose factors are per matrix) sends the raveled
#: gradient in buckets of 2**22 entries: a few large messages per step instead of one per leaf.
BUCKET = 2**22
B = f"bucket_size={BUCKET}"

METHODS: tuple[BenchMethod, ...] = (
    BenchMethod("fp32", "dense fp32 (psum)", "dense()", "allreduce"),
    BenchMethod(
        "bf16",
        "bf16 all-reduce",
        "bf16_allreduce()",
        "scatter_gather",
        factory=bf16_allreduce,
        bits_per_entry=16,
    ),
    BenchMethod("terngrad", "TernGrad, int8 psum", f"terngrad_allreduce({B})", "allreduce"),
    BenchMethod(
        "int4", "int_quant 4-bit, integer psum", f"compress(int_quant(4), {B})", "allreduce"
    ),
    BenchMethod("qsgd-ag", "QSGD 4-bit, all-gather", f"compress(qsgd(levels=7), {B})", "allgather"),
    BenchMethod(
        "qsgd-sg",
        "QSGD 4-bit, scatter-gather",
        f"compress(qsgd(levels=7), exchange='scatter_gather', {B})",
        "scatter_gather",
    ),
    BenchMethod("topk-ag", "EF top-k 1%, all-gather", f"ef(top_k(ratio=0.01), {B})", "allgather"),
    BenchMethod(
        "topk-sg",
        "EF top-k 1%, scatter-gather",
        f"ef(top_k(ratio=0.01), exchange='scatter_gather', {B})",
        "scatter_gather",
    ),
    BenchMethod(
        "topk-th-ag",
        "EF top-k 1% (threshold), all-gather",
        f"ef(top_k(ratio=0.01, select='threshold'), {B})",
        "allgather",
    ),
    BenchMethod(
        "topk-th-sg",
        "EF top-k 1% (threshold), scatter-gather",
        f"ef(top_k(ratio=0.01, select='threshold'), exchange='scatter_gather', {B})",
        "scatter_gather",
    ),
    BenchMethod("powersgd", "PowerSGD rank 4", "powersgd(rank=4)", "allreduce"),
    BenchMethod(
        "sign-ag", "sign vote, packed all-gather", f"sign_majority_vote({B})", "allgather", 1e-4
    ),
    BenchMethod(
        "sign-sg",
        "sign vote, scatter-gather",
        f"sign_majority_vote(via='scatter_gather', {B})",
        "scatter_gather",
        1e-4,
    ),
    BenchMethod(
        "sign-psum",
        "sign vote, int8 psum",
        f"sign_majority_vote(via='psum', {B})",
        "allreduce",
        1e-4,
    ),
    BenchMethod(
        "fsdp-fp32",
        "FSDP fp32 (gather + reduce-scatter)",
        "fsdp()",
        "fsdp",
        fsdp=lambda: {},
    ),
    BenchMethod(
        "fsdp-bf16",
        "FSDP bf16 (gather + reduce-scatter)",
        "fsdp(compressor=BF16Bits(), gather='bfloat16')",
        "fsdp",
        fsdp=lambda: {"compressor": BF16Bits(), "gather": "bfloat16"},
    ),
    BenchMethod(
        "fsdp-zpp",
        "FSDP int8 gather + int4 grads (ZeRO++)",
        "fsdp(compressor=int_quant(4), gather='int8')",
        "fsdp",
        fsdp=lambda: {"compressor": compjax.int_quant(4), "gather": "int8"},
    ),
    BenchMethod(
        "fsdp-sign",
        "FSDP scaled sign + EF, int8 gather",
        "fsdp(compressor=scaled_sign(), feedback='ef', gather='int8')",
        "fsdp",
        fsdp=lambda: {"compressor": compjax.scaled_sign(), "feedback": "ef", "gather": "int8"},
    ),
    BenchMethod(
        "diloco-int8",
        f"DiLoCo H={DILOCO_H}, int8 outer gradients",
        f"diloco(adamw({DILOCO_INNER_LR:g}), nesterov({DILOCO_OUTER_LR:g}, 0.9), "
        f"sync_every={DILOCO_H}, compressor=int_quant(8))",
        "local_steps",
        local=lambda axis, h: diloco_optimizer(DILOCO_INNER_LR, axis, h, compjax.int_quant(8)),
        sync_every=DILOCO_H,
    ),
    BenchMethod(
        "sparseloco",
        f"SparseLoCo H={SPARSELOCO_H}, top-32/4096 2-bit",
        f"sparseloco(adamw(1e-3, weight_decay=0.1), sync_every={SPARSELOCO_H})",
        "local_steps",
        local=sparseloco_optimizer,
        sync_every=SPARSELOCO_H,
    ),
)
#: The sharded-training methods (built with compjax.fsdp); parameters with fewer entries
#: than this stay replicated (the norm scales and biases of the model).
FSDP_MIN_SIZE = 4096
#: The two baselines every speedup is reported against.
BASELINES = ("fp32", "bf16")


def select(keys: list[str] | None) -> tuple[BenchMethod, ...]:
    """The methods named by ``keys`` (all when ``None``), always with the two baselines first.

    Raises:
      ValueError: an unknown key (the message lists the known ones).
    """
    by_key = {m.key: m for m in METHODS}
    unknown = [k for k in keys or () if k not in by_key]
    if unknown:
        raise ValueError(f"unknown methods {unknown}; choose from {list(by_key)}")
    wanted = set(keys or by_key) | set(BASELINES)
    return tuple(m for m in METHODS if m.key in wanted)

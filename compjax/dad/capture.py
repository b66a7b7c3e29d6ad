"""Capturing each Dense layer's inputs ``A`` and output cotangents ``Delta`` in one backward pass.

Mechanism: :func:`flax.linen.intercept_methods` wraps the ``__call__`` of
every :class:`flax.linen.Dense` and :class:`flax.linen.DenseGeneral` applied
inside the user's ``loss_fn``.  Flax NNX has no method interception, so for
the duration of each trace ``flax.nnx.Linear.__call__`` is replaced by one
that hands the call to the same interceptor (and put back on exit, errors
included); an NNX layer is located in ``params`` by its kernel, the very
array of ``params`` that ``nnx.merge`` placed in the layer.  The interceptor

1. records the layer's input, flattened to ``A`` of shape ``(rows, in)``
   (``rows`` = every non-contracted axis: batch, sequence, ...; ``in`` = the
   contracted axes), and
2. adds a zero "perturbation" ``E`` of shape ``(rows, out)`` to the output
   (reshaped to the output's shape).

``jax.value_and_grad`` of the loss with respect to ``(params, E)`` then gives
the ordinary gradient of every parameter and ``Delta = dL/dE``, the output
cotangent of each Dense call, in a single forward/backward pass.  The shapes of
the perturbations come from an abstract first trace (``jax.eval_shape``: no
FLOPs, trace time only).  A layer's kernel gradient is ``A^T Delta`` (summed
over every call of a layer used more than once) and its bias gradient the
column sums of ``Delta``.

Limits (documented in :mod:`compjax.dad`): only exactly ``nn.Dense``,
``nn.DenseGeneral`` without ``batch_dims`` and ``nnx.Linear``, each without
a custom ``dot_general`` (or, for NNX, ``promote_dtype``), are captured
(everything else, subclasses included, is a "non-Dense" parameter);
``loss_fn`` must apply the same layers in the same order on every trace;
layers inside flax lifted transforms (``nn.scan``, ``nn.remat``,
``nn.vmap``, ``nn.jit``) cannot be captured; and a Dense kernel must reach
the loss only through its layer (no L2 term on it inside ``loss_fn``: use
``optax.add_decayed_weights``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Iterable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx
from flax.core import tracers
from flax.nnx.nn import dtypes as nnx_dtypes

from compjax.axes import AxisName
from compjax.worker_local import worker_params

LossFn = Callable[[Any, Any], Any]


@dataclasses.dataclass(frozen=True)
class Call:
    """One application of a Dense layer (static, from the abstract trace).

    Attributes:
      path: the flax module path of the layer (linen), or the path of its
        kernel in ``params`` without the final ``"kernel"`` (NNX).
      kernel_shape: the shape of its kernel.
      num_contracted: how many leading kernel axes are contracted with the input.
      rows: rows of ``A`` and ``Delta`` (product of the non-contracted axes).
      use_bias: whether the layer has a bias.
      dtype: the dtype of the layer's output (and of ``Delta``).
    """

    path: tuple
    kernel_shape: tuple[int, ...]
    num_contracted: int
    rows: int
    use_bias: bool
    dtype: Any

    @property
    def in_features(self) -> int:
        return math.prod(self.kernel_shape[: self.num_contracted])

    @property
    def out_features(self) -> int:
        return math.prod(self.kernel_shape[self.num_contracted :])


@dataclasses.dataclass(frozen=True)
class Layer:
    """A Dense layer located in the parameters, with all its calls.

    Attributes:
      name: ``"/"``-joined module path (for messages and reports).
      kernel: index of the kernel among the flattened parameter leaves.
      bias: index of the bias leaf, or ``None``.
      calls: indices (in call order) of this layer's calls.
      in_features: contracted size ``in``.
      out_features: output size ``out``.
      rows: rows of ``A`` over all calls of this layer on one site.
    """

    name: str
    kernel: int
    bias: int | None
    calls: tuple[int, ...]
    in_features: int
    out_features: int
    rows: int


def _as_tuple(x) -> tuple[int, ...]:
    return tuple(x) if isinstance(x, Iterable) else (x,)


def _captured(module: nn.Module) -> bool:
    """Exactly Dense / DenseGeneral (no subclass), default dot_general, no batch_dims."""
    if type(module) not in (nn.Dense, nn.DenseGeneral):
        return False
    if module.dot_general is not None or module.dot_general_cls is not None:
        return False
    return not (type(module) is nn.DenseGeneral and _as_tuple(module.batch_dims))


def _contracted(module: nn.Module, ndim: int) -> tuple[int, ...]:
    if type(module) is nn.Dense:
        return (ndim - 1,)
    # DenseGeneral sorts its normalised axes; the kernel's leading dims follow that order.
    return tuple(sorted(ax % ndim for ax in _as_tuple(module.axis)))


def _captured_nnx(module: nnx.Module) -> bool:
    """Exactly ``nnx.Linear`` with the default ``dot_general`` and ``promote_dtype``."""
    return (
        type(module) is nnx.Linear
        and module.dot_general is jax.lax.dot_general
        and module.promote_dtype is nnx_dtypes.promote_dtype
    )


def _kernel_paths(params: Any) -> dict[int, tuple]:
    """``id`` of each ``"kernel"`` leaf of ``params`` -> its path without ``"kernel"``."""
    leaves = jax.tree.leaves(params)
    return {
        id(leaves[i]): path[:-1]
        for path, i in leaf_paths(params).items()
        if path[-1:] == ("kernel",)
    }


class _Interceptor:
    """Records ``A`` of each Dense call and adds the perturbations (if given) to its output.

    Args:
      params: the parameters ``loss_fn`` is traced with (NNX layers are
        found among them by their kernel).
      perturbations: one zero array per call to add to its output, or
        ``None`` (discovery).
    """

    def __init__(self, params: Any, perturbations: list | None = None):
        self.perturbations = perturbations
        self.kernels = _kernel_paths(params)
        self.calls: list[Call] = []
        self.inputs: list[jax.Array] = []
        self.trace = tracers.current_trace()  # create inside the traced function

    def __call__(self, next_fun, args, kwargs, context):
        """The linen interceptor (:func:`flax.linen.intercept_methods`)."""
        module = context.module
        if context.method_name != "__call__" or not _captured(module):
            return next_fun(*args, **kwargs)
        inputs = jnp.asarray(args[0] if args else kwargs["inputs"])
        self._check_trace("/".join(module.path))
        axes = _contracted(module, inputs.ndim)
        y = next_fun(*args, **kwargs)
        return self._record(tuple(module.path), inputs, y, axes, module.use_bias)

    def nnx_call(self, call: Callable, module: nnx.Module, args, kwargs):
        """``call(module, *args, **kwargs)`` of an ``nnx.Linear``, recorded if captured."""
        if not _captured_nnx(module):
            return call(module, *args, **kwargs)
        inputs = jnp.asarray(args[0] if args else kwargs["inputs"])
        path = self.kernels.get(id(module.kernel[...]))
        if path is None:
            raise ValueError(
                f"an nnx.Linear layer (kernel shape {module.kernel.shape}) is applied whose "
                f"kernel is not among the differentiated params: loss_fn must build the model "
                f"from params, e.g. nnx.merge(graphdef, params, rest), with every Linear "
                f"layer's kernel in params"
            )
        self._check_trace("/".join(map(str, path)))
        y = call(module, *args, **kwargs)
        return self._record(path, inputs, y, (inputs.ndim - 1,), module.use_bias)

    def _check_trace(self, name: str) -> None:
        if tracers.current_trace() != self.trace:
            raise ValueError(
                f"the Dense layer {name} is applied inside a transformation "
                f"within loss_fn (a flax lifted transform such as nn.remat, nn.scan, nn.vmap, "
                f"nn.jit, or jax.jit / jax.vmap / jax.checkpoint around model.apply): dAD cannot "
                f"capture its inputs and deltas there; apply the model directly in loss_fn and "
                f"jit the whole step"
            )

    def _record(self, path: tuple, inputs, y, axes: tuple[int, ...], use_bias: bool):
        kept = inputs.ndim - len(axes)
        a = jnp.moveaxis(inputs, axes, tuple(range(kept, inputs.ndim)))
        kernel_shape = tuple(inputs.shape[ax] for ax in axes) + tuple(y.shape[kept:])
        rows = math.prod(y.shape[:kept])
        call = Call(path, kernel_shape, len(axes), rows, use_bias, y.dtype)
        index = len(self.calls)
        self.calls.append(call)
        self.inputs.append(a.reshape(rows, call.in_features))
        if self.perturbations is None or index >= len(self.perturbations):
            return y  # discovery; or an extra call, reported by _check_same_calls
        return y + self.perturbations[index].reshape(y.shape)


@contextlib.contextmanager
def _intercepting(interceptor: _Interceptor):
    """Route linen Dense calls and ``nnx.Linear`` calls to ``interceptor`` for the block."""
    original = nnx.Linear.__call__

    def call(module, *args, **kwargs):
        return interceptor.nnx_call(original, module, args, kwargs)

    nnx.Linear.__call__ = call
    try:
        with nn.intercept_methods(interceptor):
            yield
    finally:
        nnx.Linear.__call__ = original


def discover(loss_fn: LossFn, params: Any, batch: Any) -> list[Call]:
    """The Dense calls ``loss_fn(params, batch)`` makes, in order (abstract trace, no FLOPs).

    A fresh closure is traced every time: ``jax.eval_shape`` caches traces by
    function, and a cached trace would run no interceptor.

    Raises:
      ValueError: a Dense layer is applied inside a transformation within
        ``loss_fn`` (its inputs could not leave that trace).
    """
    calls = []

    def traced(p, b):
        interceptor = _Interceptor(p)
        with _intercepting(interceptor):
            out = loss_fn(p, b)
        calls.extend(interceptor.calls)
        return out

    jax.eval_shape(traced, params, batch)
    return calls


def _key_name(entry) -> Any:
    for attr in ("key", "name", "idx"):
        if hasattr(entry, attr):
            return getattr(entry, attr)
    return entry


def leaf_paths(params: Any) -> dict[tuple, int]:
    """Each parameter leaf's key path (dict keys, attribute names, indices) -> its index."""
    flat, _ = jax.tree_util.tree_flatten_with_path(params)
    return {tuple(_key_name(e) for e in path): i for i, (path, _) in enumerate(flat)}


def _locate(call: Call, paths: dict[tuple, int], shapes: list) -> tuple[int, int | None]:
    """Indices of the kernel and bias leaves of ``call``'s layer in ``params``."""
    for prefix in (("params", *call.path), call.path):
        k = paths.get((*prefix, "kernel"))
        if k is not None and tuple(shapes[k]) == call.kernel_shape:
            return k, paths.get((*prefix, "bias")) if call.use_bias else None
    raise ValueError(
        f"the Dense layer at module path {'/'.join(map(str, call.path)) or '(root)'} (kernel shape "
        f"{call.kernel_shape}) is not among the differentiated params: pass params so that "
        f"loss_fn applies the model with them (either the variables {{'params': ...}} or the "
        f"'params' collection itself), including every Dense layer's kernel"
    )


def group_layers(calls: list[Call], params: Any) -> list[Layer]:
    """Group the calls by layer (a layer applied twice shares its kernel) and locate each.

    Raises:
      ValueError: no Dense layer was applied, or one is not in ``params``.
    """
    if not calls:
        raise ValueError(
            "loss_fn applied no Dense layer: dAD needs at least one flax.linen.Dense or "
            "DenseGeneral (without batch_dims or a custom dot_general) whose kernel is in "
            "params, applied directly in loss_fn (a jax.jit-compiled model.apply inside "
            "loss_fn hides its layers: jit the whole step instead); for a model without one "
            "use an ordinary all-reduce (or a compjax transformation)"
        )
    paths = leaf_paths(params)
    shapes = [jnp.shape(leaf) for leaf in jax.tree.leaves(params)]
    found: dict[int, list[int]] = {}
    bias: dict[int, int | None] = {}
    for i, call in enumerate(calls):
        k, b = _locate(call, paths, shapes)
        found.setdefault(k, []).append(i)
        bias[k] = b
    layers = []
    for k, idx in found.items():
        first = calls[idx[0]]
        layers.append(
            Layer(
                name="/".join(map(str, first.path)),
                kernel=k,
                bias=bias[k],
                calls=tuple(idx),
                in_features=first.in_features,
                out_features=first.out_features,
                rows=sum(calls[i].rows for i in idx),
            )
        )
    return layers


@dataclasses.dataclass(frozen=True)
class Captured:
    """What one site computes locally in its forward/backward pass.

    Attributes:
      loss: ``loss_fn``'s output (``(loss, aux)`` with ``has_aux``).
      grads: the ordinary local gradient, a list of the params' leaves.
      layers: the Dense layers.
      inputs: per layer, ``A`` of all its calls stacked, ``(rows, in)``.
      deltas: per layer, ``Delta`` of all its calls stacked, ``(rows, out)``.
    """

    loss: Any
    grads: list[jax.Array]
    layers: list[Layer]
    inputs: list[jax.Array]
    deltas: list[jax.Array]


def _check_same_calls(expected: list[Call], got: list[Call]) -> None:
    if expected != got:
        raise ValueError(
            "loss_fn applied different Dense layers on two traces of the same inputs; "
            "dAD needs loss_fn's Dense calls to be fixed by the shapes of params and batch, "
            "and the layers applied directly in loss_fn (a jax.jit-compiled model.apply "
            "inside loss_fn is traced once and then hides its layers: jit the whole step)"
        )


def capture(
    loss_fn: LossFn, params: Any, batch: Any, has_aux: bool, axis_name: AxisName
) -> Captured:
    """One forward/backward pass of ``loss_fn(params, batch)`` recording ``A`` and ``Delta``.

    Args:
      loss_fn: ``loss_fn(params, batch) -> loss`` (a scalar), or ``(loss, aux)``
        with ``has_aux``; it applies a flax linen model with ``params``.
      params: the parameters to differentiate.
      batch: this site's batch.
      has_aux: whether ``loss_fn`` returns ``(loss, aux)``.
      axis_name: the sites' axis (the gradients are this site's own, see
        :func:`compjax.worker_params`).

    Returns:
      A :class:`Captured`.
    """
    calls = discover(loss_fn, params, batch)
    layers = group_layers(calls, params)

    def perturbed(p, perturbations):
        interceptor = _Interceptor(p, perturbations)
        with _intercepting(interceptor):
            out = loss_fn(p, batch)
        _check_same_calls(calls, interceptor.calls)
        loss, aux = out if has_aux else (out, None)
        return loss, (aux, interceptor.inputs)

    zeros = [jnp.zeros((c.rows, c.out_features), c.dtype) for c in calls]
    grad_fn = jax.value_and_grad(perturbed, argnums=(0, 1), has_aux=True)
    (loss, (aux, inputs)), (grads, deltas) = grad_fn(*worker_params((params, zeros), axis_name))

    def stacked(arrays, layer):
        return jnp.concatenate([arrays[i] for i in layer.calls], axis=0)

    return Captured(
        loss=(loss, aux) if has_aux else loss,
        grads=jax.tree.leaves(grads),
        layers=layers,
        inputs=[stacked(inputs, layer) for layer in layers],
        deltas=[stacked(deltas, layer) for layer in layers],
    )

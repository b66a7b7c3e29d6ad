"""Every compjax method selectable by name: a small expression language for the harness.

A method is written as a call expression of registered names, keyword
hyperparameters and nested compressors::

    dense()                                # the plain float32 all-reduce (the baseline)
    qsgd(levels=4)                         # a bare compressor: compressed SGD (QSGD, DQGD)
    diana(qsgd(levels=2))                  # a transformation taking a compressor
    ef(scaled_sign())                      # error feedback (alias of error_feedback)
    dgc(ratio=0.001, clip_norm=1.0, warmup_steps_per_phase=20)
    adam(b1=0.9)                           # Adam on the dense all-reduced gradient
    onebit_adam(freeze_step=100)           # 1-bit Adam (the harness's lr is Adam's)
    powersgd(rank=2)                       # the axis name is supplied by the harness
    demo(topk=8)                           # DeMo's direction (the SGD step follows)
    rank_dad(rank=2)                       # gradients from gathered activations and deltas
    chain(top_k(ratio=0.01), qsgd(levels=16))

Only the registered names, numbers, strings, booleans, ``None``, tuples and
lists are accepted (the text is parsed with :mod:`ast`, never evaluated).
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import functools
import inspect
from collections.abc import Callable
from typing import Any

import optax

import compjax

# The compressors (``compjax`` factories of the same names).
COMPRESSORS: dict[str, Callable] = {
    name: getattr(compjax, name)
    for name in (
        "identity",
        "cast",
        "qsgd",
        "terngrad",
        "sign",
        "scaled_sign",
        "natural",
        "int_quant",
        "natural_dithering",
        "eden",
        "drive",
        "l2_scaled_sign",
        "rand_k",
        "top_k",
        "atomo",
        "atomo_svd",
        "blockwise",
        "chain",
        "scaled",
    )
}

# Transformations whose first argument is a compressor, and their aliases.
WITH_COMPRESSOR: dict[str, Callable] = {
    "compress": compjax.compress,
    "error_feedback": compjax.error_feedback,
    "ef": compjax.error_feedback,
    "ef21": compjax.ef21,
    "diana": compjax.diana,
}


def _powersgd(axis_name, rank=1, **kwargs):
    return compjax.powersgd(rank, axis_name, **kwargs)


def _axis_first(signature: inspect.Signature) -> inspect.Signature:
    """powersgd's signature as ``_powersgd`` takes it: the axis name first, rank 1 by default."""
    params = dict(signature.parameters)
    rank = params.pop("rank").replace(default=1)
    return signature.replace(parameters=[params.pop("axis_name"), rank, *params.values()])


# Its keywords, for the did-you-mean of a misspelled one.
_powersgd.__signature__ = _axis_first(inspect.signature(compjax.powersgd))

# Transformations taking only the axis name and hyperparameters.
WITH_AXIS: dict[str, Callable] = {
    "sign_majority_vote": compjax.sign_majority_vote,
    "signsgd": compjax.sign_majority_vote,
    "signum": functools.partial(compjax.sign_majority_vote, momentum=0.9),
    "terngrad_allreduce": compjax.terngrad_allreduce,
    "dgc": compjax.dgc,
    "powersgd": _powersgd,
    "variance_based": compjax.variance_based,
    "strom_threshold": compjax.strom_threshold,
    # DeMo's sign direction; the SGD that follows is its step (weight decay 0).
    "demo": compjax.scale_by_demo,
    # The direction m / (sqrt(v) + eps); the harness's sgd(lr) after it is the step size.
    "onebit_adam": compjax.scale_by_onebit_adam,
}

# Methods that replace the gradient computation itself.
GRADIENTS = ("dense", "dad", "rank_dad")

# Adam on the dense all-reduced gradient (optax.scale_by_adam after dense()); the
# harness's sgd(lr) after it makes it optax.adam(lr).
ADAM = "adam"

# Message kinds (see compjax.recording.record) that always travel by all-reduce.
_REDUCED = frozenset({"dense", "flag", "scale", "scaler", "votes", "ternaries", "ranks"})


@dataclasses.dataclass(frozen=True)
class Method:
    """A parsed method.

    Attributes:
      spec: the expression it was parsed from.
      name: the outer name (``diana``, ``dgc``, a compressor's name, ...).
      build: ``build(axis_name) -> optax.GradientTransformation``, the exchange.
      gradients: ``"local"`` (each worker's gradient), ``"per_example"``
        (variance-based compression), ``"dad"`` or ``"rank_dad"``.
      kwargs: the hyperparameters of the outer call.
      compressor: the compressor inside, if any.
    """

    spec: str
    name: str
    build: Callable[[Any], optax.GradientTransformation]
    gradients: str = "local"
    kwargs: tuple[tuple[str, Any], ...] = ()
    compressor: compjax.Compressor | None = None

    @property
    def options(self) -> dict[str, Any]:
        return dict(self.kwargs)

    def gathered(self, kind: str) -> bool:
        """Whether a message of ``kind`` travels by all-gather (else by all-reduce)."""
        if kind in _REDUCED:
            return False
        if kind in ("P", "Q"):
            return self.name == "rank_dad"  # PowerSGD all-reduces its factors
        if kind == "payload" and self.compressor is not None:
            # Linear payloads and int_quant's integer fields are summed by psum.
            return not (self.compressor.linear or getattr(self.compressor, "summable", False))
        return True  # signs, sparse payloads, dAD's activations and deltas

    def dgc_phase(self, step: int) -> optax.GradientTransformation | None:
        """For DGC with warm-up: a DGC without warm-up at the density of ``step``'s phase."""
        if self.name != "dgc":
            return None
        opts = self.options
        per_phase = int(opts.get("warmup_steps_per_phase", 0))
        if per_phase == 0:
            return None
        warm = tuple(opts.get("warmup_ratios", compjax.transforms.dgc.PAPER_WARMUP))
        phase = step // per_phase
        if phase >= len(warm):
            return None
        return lambda axis: compjax.dgc(
            axis, **{**opts, "ratio": warm[phase], "warmup_steps_per_phase": 0}
        )


class _Builder:
    """Turns the parsed syntax tree into compressors and methods."""

    def __init__(self, spec: str):
        self.spec = spec

    def error(self, node: ast.AST, what: str) -> ValueError:
        return ValueError(f"method {self.spec!r}: {what} (at column {node.col_offset})")

    def value(self, node: ast.AST) -> Any:
        if isinstance(node, ast.Constant):
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -self.value(node.operand)
        if isinstance(node, ast.Tuple | ast.List):
            return tuple(self.value(e) for e in node.elts)
        if isinstance(node, ast.Call):
            return self.compressor(node)
        raise self.error(node, f"unsupported expression {ast.dump(node)}")

    def name(self, node: ast.Call, known: Any, what: str) -> str:
        """The called name, or an error with a did-you-mean when it is not in ``known``."""
        if not isinstance(node.func, ast.Name):
            raise self.error(node, "a method is a call of a registered name")
        name = node.func.id
        if name not in known:
            close = difflib.get_close_matches(name, sorted(known), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise self.error(node, f"{what.format(name=repr(name))}{hint}; one of {sorted(known)}")
        return name

    def call_parts(self, node: ast.Call) -> tuple[list, dict]:
        args = [self.value(a) for a in node.args]
        kwargs = {k.arg: self.value(k.value) for k in node.keywords}
        return args, kwargs

    def call(self, node: ast.AST, name: str, factory: Callable, *args, **kwargs) -> Any:
        """``factory(*args, **kwargs)``; a keyword it does not take is named (did you mean)."""
        taken = _keywords(factory, len(args))
        for key in kwargs:
            if taken is not None and key not in taken:
                close = difflib.get_close_matches(key, sorted(taken), n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise self.error(
                    node,
                    f"{name} got an unexpected keyword argument {key!r}{hint}; "
                    f"it takes {sorted(taken)}",
                )
        return factory(*args, **kwargs)

    def compressor(self, node: ast.Call) -> compjax.Compressor:
        name = self.name(node, COMPRESSORS, "{name} is not a compressor")
        args, kwargs = self.call_parts(node)
        return self.call(node, name, COMPRESSORS[name], *args, **kwargs)

    def method(self, node: ast.AST) -> Method:
        if not isinstance(node, ast.Call):
            raise self.error(node, "a method is a call such as diana(qsgd(levels=4))")
        known = {*COMPRESSORS, *WITH_COMPRESSOR, *WITH_AXIS, *GRADIENTS, ADAM}
        name = self.name(node, known, "unknown method {name}")
        args, kwargs = self.call_parts(node)
        items = tuple(sorted(kwargs.items()))
        if name in COMPRESSORS:
            comp = self.compressor(node)
            return Method(
                self.spec, name, lambda axis: compjax.compress(comp, axis), compressor=comp
            )
        if name in WITH_COMPRESSOR:
            if len(args) != 1 or not isinstance(args[0], compjax.Compressor):
                raise self.error(node, f"{name} takes one compressor, e.g. {name}(qsgd(levels=4))")
            comp, factory = args[0], WITH_COMPRESSOR[name]
            self.call(node, name, factory, comp, None, **kwargs)  # its options checked now
            return Method(
                self.spec,
                name,
                lambda axis: factory(comp, axis, **kwargs),
                kwargs=items,
                compressor=comp,
            )
        if args:
            raise self.error(node, f"{name} takes keyword arguments only")
        if name in WITH_AXIS:
            factory = WITH_AXIS[name]
            build = functools.partial(_with_axis, factory, kwargs)
            self.call(node, name, factory, None, **kwargs)  # hyperparameters checked now
            gradients = "per_example" if name == "variance_based" else "local"
            return Method(self.spec, name, build, gradients=gradients, kwargs=items)
        if name == "dense":
            if kwargs:
                raise self.error(node, "dense() takes no arguments")
            comp = compjax.identity()
            return Method(
                self.spec, name, lambda axis: compjax.compress(comp, axis), compressor=comp
            )
        if name == ADAM:
            comp = compjax.identity()
            self.call(node, name, optax.scale_by_adam, **kwargs)  # a bad one fails here
            return Method(
                self.spec,
                name,
                lambda axis: optax.chain(
                    compjax.compress(comp, axis), optax.scale_by_adam(**kwargs)
                ),
                kwargs=items,
                compressor=comp,
            )
        if name in ("dad", "rank_dad"):
            allowed = {"compressor"} | ({"rank", "iterations"} if name == "rank_dad" else set())
            unknown = set(kwargs) - allowed
            if unknown:
                raise self.error(node, f"{name} got unexpected arguments {sorted(unknown)}")
            if name == "rank_dad" and int(kwargs.get("rank", 0)) < 1:
                raise self.error(node, "rank_dad needs rank >= 1")
            return Method(
                self.spec,
                name,
                lambda axis: optax.identity(),
                gradients=name,
                kwargs=items,
                compressor=kwargs.get("compressor"),
            )
        raise AssertionError(f"unhandled method {name!r}")  # every known name is handled above


def _keywords(factory: Callable, positional: int = 0) -> set[str] | None:
    """The keywords ``factory`` takes after ``positional`` positional arguments, or ``None``
    when it takes any (``**kwargs``)."""
    try:
        parameters = list(inspect.signature(factory).parameters.values())
    except (TypeError, ValueError):
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return None
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return {p.name for p in parameters[positional:] if p.kind in kinds}


def _with_axis(factory: Callable, kwargs: dict, axis_name):
    return factory(axis_name, **kwargs)


def parse(spec: str) -> Method:
    """Parse a method expression (see the module docstring).

    Raises:
      ValueError: a syntax error, an unknown name, or a hyperparameter the
        compressor or transformation rejects (its message names it).
    """
    try:
        tree = ast.parse(spec.strip(), mode="eval")
    except SyntaxError as err:
        raise ValueError(f"method {spec!r} is not an expression: {err.msg}") from err
    try:
        return _Builder(spec).method(tree.body)
    except TypeError as err:
        raise ValueError(f"method {spec!r}: {err}") from err
    except ValueError as err:  # a compjax factory's own check: say which method it was
        if str(err).startswith(f"method {spec!r}"):
            raise
        raise ValueError(f"method {spec!r}: {err}") from err


def slug(spec: str) -> str:
    """A file-name-safe form of a method expression."""
    keep = [c if c.isalnum() or c in "._-" else "_" for c in spec.replace(" ", "")]
    return "".join(keep).strip("_").replace("__", "_")

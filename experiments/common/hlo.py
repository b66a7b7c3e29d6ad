"""The collectives of a compiled step, read from its HLO text: each one's per-worker message
in bits, whether it runs once a step, once a round (a conditional branch) or only on overflow
(a ``while`` loop), and the bits one worker sends per step over a ring."""

from __future__ import annotations

import re

import numpy as np

from compjax import costmodel

_OPS = {
    "all-reduce": "allreduce",
    "all-gather": "allgather",
    "all-to-all": "alltoall",
    "reduce-scatter": "reduce_scatter",
    "collective-permute": "permute",
}
_DTYPE_BITS = {"pred": 8, "s4": 4, "u4": 4, "s8": 8, "u8": 8, "s16": 16, "u16": 16}
_DTYPE_BITS |= {"f16": 16, "bf16": 16, "s32": 32, "u32": 32, "f32": 32, "s64": 64, "u64": 64}
_DTYPE_BITS |= {"f64": 64}
_LINE = re.compile(
    r"=\s*(?P<shape>.*?)\s+(?P<op>" + "|".join(_OPS) + r")(?P<start>-start)?\((?P<args>.*)$"
)
_ARRAY = re.compile(r"\b([a-z]+[0-9]+|pred)\[([0-9,]*)\]")
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%(?P<name>[\w.\-]+)\s.*\{\s*$")
_CALLED = re.compile(
    r"\b(?:calls|to_apply|body|condition|true_computation|false_computation)=%([\w.\-]+)"
)
_BRANCHES = re.compile(
    r"\b(?:branch_computations=\{([^}]*)\}|(?:true|false)_computation=%([\w.\-]+))"
)
_WHILE = re.compile(r"\swhile\(")
_LOOP_PARTS = re.compile(r"\b(?:condition|body)=%([\w.\-]+)")


def shape_bits(shape: str) -> int:
    """Bits of every array in an HLO shape string such as ``(f32[2,3]{1,0}, s8[4]{0})``."""
    total = 0
    for dtype, dims in _ARRAY.findall(shape):
        if dtype not in _DTYPE_BITS:
            raise ValueError(f"unknown HLO element type {dtype!r} in {shape!r}")
        count = int(np.prod([int(d) for d in dims.split(",") if d], dtype=np.int64))
        total += count * _DTYPE_BITS[dtype]
    return int(total)


def nested_computations(text: str) -> dict[str, set[str]]:
    """The computations of a compiled HLO module that do not run once per execution:
    ``"conditional"``, those that run only when a ``conditional`` takes their branch (the
    branches and every computation they call), and ``"loop"``, those a ``while`` loop runs
    (its condition and body, and every computation they call)."""
    calls: dict[str, set[str]] = {}
    roots: dict[str, set[str]] = {"conditional": set(), "loop": set()}
    current = None
    for line in text.splitlines():
        header = _COMPUTATION.match(line)
        if header is not None:
            current = header["name"]
            calls[current] = set()
            continue
        if current is None:
            continue
        calls[current].update(_CALLED.findall(line))
        for group, single in _BRANCHES.findall(line):
            names = (group or single).split(",")
            roots["conditional"].update(n.strip().lstrip("%") for n in names if n)
        if _WHILE.search(line):
            roots["loop"].update(_LOOP_PARTS.findall(line))
    out = {}
    for kind, names in roots.items():
        seen, todo = set(), list(names)
        while todo:
            name = todo.pop()
            if name not in seen:
                seen.add(name)
                todo.extend(calls.get(name, ()))
        out[kind] = seen
    return out


def hlo_collectives(text: str, workers: int) -> list[dict]:
    """The collectives of a compiled HLO module, with the message one worker contributes.

    Returns ``{"op", "collective", "dtypes", "bits", "conditional", "loop"}``
    per collective op, in program order (:func:`nested_computations`):
    ``conditional`` says whether it lies in a branch of a ``conditional`` (a
    local-steps method's synchronisation, which runs once a round), ``loop``
    whether in a ``while`` loop (compjax's overflow guard resends a mean in
    a loop that runs only when a float32 sum overflows, so a step sends none
    of these); ``bits`` is the per-worker message in
    :func:`compjax.costmodel.wire_bits`'s convention: the output of an
    all-reduce, an all-to-all or a permute, the output over ``workers`` for an
    all-gather, the output times ``workers`` for a reduce-scatter (every
    collective here spans the whole 1-D mesh).  ``*-done`` halves of async
    pairs are skipped; a ``*-start``'s shape holds its operands and results,
    and only the results (the last element) are counted.
    """
    found = []
    nested, current = nested_computations(text), None
    for line in text.splitlines():
        header = _COMPUTATION.match(line)
        if header is not None:
            current = header["name"]
            continue
        m = _LINE.search(line)
        if m is None or not line.lstrip().startswith(("%", "ROOT")):
            continue
        shape = m["shape"]
        if m["start"]:
            shape = shape.rsplit("}, ", 1)[-1] if "}, " in shape else shape
        out = shape_bits(shape)
        op = m["op"]
        bits = {"all-gather": out / workers, "reduce-scatter": out * workers}.get(op, out)
        dtypes = sorted({dtype for dtype, _ in _ARRAY.findall(shape)})
        found.append(
            {
                "op": op,
                "collective": _OPS[op],
                "dtypes": dtypes,
                "bits": int(bits),
                "conditional": current in nested["conditional"],
                "loop": current in nested["loop"],
            }
        )
    return found


def hlo_wire_bits(collectives: list[dict], workers: int) -> float:
    """Bits one worker sends per step for these collectives (ring algorithms)."""
    return sum(costmodel.wire_bits(c["collective"], c["bits"], workers) for c in collectives)


def per_step(collectives: list[dict], sync_every: int | None) -> list[dict]:
    """The compiled collectives a step runs, averaged over a round of ``sync_every`` steps.

    Those in a ``while`` loop (``loop``: the overflow guard's resend, which runs
    only when a float32 sum overflows) are left out; with ``sync_every``, those
    in a conditional branch (the synchronisation, once a round) carry ``1 /
    sync_every`` of their bits (``None``: a method that exchanges every step).
    """
    every = [c for c in collectives if not c.get("loop")]
    if sync_every is None:
        return every
    h = sync_every
    return [{**c, "bits": c["bits"] / h} if c.get("conditional") else c for c in every]

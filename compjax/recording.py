"""The bits log: every message a worker sends, logged while a :func:`recording` is open.

Every function of :mod:`compjax.collectives` records what it sends with
:func:`record` (at trace time, the :func:`compjax.wire_bits` of the payload
arrays themselves, and the collective that carries it); so does a
transformation that builds a message of its own.  :func:`exchange_round`
groups one update's messages into a round, :func:`unrecorded` silences a
branch that is not the steady state.  :mod:`compjax.accounting` turns the
log into bits per worker and per step.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

from compjax.axes import AxisName, axis_names
from compjax.payload import wire_bits

_LOG: contextvars.ContextVar[list | None] = contextvars.ContextVar("compjax_bits", default=None)
_ROUND: contextvars.ContextVar[list | None] = contextvars.ContextVar("compjax_round", default=None)


@contextlib.contextmanager
def recording() -> Iterator[list[tuple[object, list[tuple[str, int]]]]]:
    """Log the messages sent while tracing inside the context.

    The log is a list of ``(owner, messages)`` rounds, ``messages`` being
    ``(kind, bits)`` pairs; a round is one call of an update marked with
    :func:`exchange_round` (``owner`` identifies the transformation), and a
    collective called outside any round forms a round of its own
    (``owner=None``).  Each round's list also has ``routes``: ``(kind, via,
    axes)`` of every message, ``via`` the collective that carries it
    (:data:`ROUTES`) and ``axes`` the mesh axes it crosses.
    """
    log: list = []
    token = _LOG.set(log)
    try:
        yield log
    finally:
        _LOG.reset(token)


@contextlib.contextmanager
def exchange_round(owner: object) -> Iterator[None]:
    """Group the messages sent inside into one round of ``owner``."""
    log = _LOG.get()
    if log is None:
        yield
        return
    messages = _Round()
    log.append((owner, messages))
    token = _ROUND.set(messages)
    try:
        yield
    finally:
        _ROUND.reset(token)


_QUIET: contextvars.ContextVar[bool] = contextvars.ContextVar("compjax_quiet", default=False)


@contextlib.contextmanager
def unrecorded() -> Iterator[None]:
    """Do not log messages sent inside (e.g. a warm-up branch that is not the steady state)."""
    token = _QUIET.set(True)
    try:
        yield
    finally:
        _QUIET.reset(token)


#: The collectives a message can travel by (``record``'s ``via``).
ROUTES = ("all_reduce", "all_gather", "all_to_all", "reduce_scatter")


class _Round(list):
    """One round's ``(kind, bits)`` messages, with their ``routes`` alongside."""

    def __init__(self):
        super().__init__()
        self.routes: list[tuple[str, str, tuple[str, ...]]] = []


def record(what: str, message, via: str, axis_name: AxisName) -> None:
    """Log that this worker sends ``message`` (an array or payload) in this round.

    Every function of :mod:`compjax.collectives` records what it sends; a
    transformation that builds a message of its own (and sends it with
    :func:`compjax.collectives.all_gather` or :func:`compjax.collectives.psum`)
    records it with this.

    Args:
      what: the message's kind (``"payload"``, ``"flag"``, ...).
      message: what this worker puts in the collective.
      via: the collective, one of :data:`ROUTES` (a ``pmax`` is an all-reduce).
      axis_name: the axes it crosses.
    """
    log = _LOG.get()
    if log is None or _QUIET.get():
        return
    if via not in ROUTES:
        raise ValueError(f"via must be one of {ROUTES}, got {via!r}")
    current = _ROUND.get()
    if current is None:
        current = _Round()
        log.append((None, current))
    current.append((what, wire_bits(message)))
    current.routes.append((what, via, axis_names(axis_name)))

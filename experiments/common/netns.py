"""A network namespace with a rate-limited loopback, for ``make bench-net``.

The benchmark's processes run inside a namespace of their own
(``ip netns add``) and talk over its loopback device only (127.0.0.1).  A
token bucket filter on that device (``tc qdisc ... tbf rate R burst 256kb
latency 400ms``) turns it into one link of ``R`` bit/s shared by every
process: all the bytes any process sends pass through the same queue.

Every command is built by a pure function (tested) and run by
:func:`run`; :func:`unavailable_reason` says why the machine cannot do
this (no ``ip``/``tc``, not root, no namespaces or no ``tbf``) so the
benchmark can exit cleanly instead.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator

#: The commands used (module attributes so that a test can point them at a missing name).
IP = "ip"
TC = "tc"
#: Token bucket parameters: the bucket (bytes sent at line rate) and the queue bound.
BURST = "256kb"
LATENCY = "400ms"
TX_BYTES = "/sys/class/net/lo/statistics/tx_bytes"


def in_namespace(ns: str | None, argv: list[str]) -> list[str]:
    """``argv`` run inside namespace ``ns`` (``ip netns exec``); unchanged for ``None``."""
    return argv if ns is None else [IP, "netns", "exec", ns, *argv]


def add_command(ns: str) -> list[str]:
    return [IP, "netns", "add", ns]


def delete_command(ns: str) -> list[str]:
    return [IP, "netns", "delete", ns]


def loopback_up_command(ns: str) -> list[str]:
    return in_namespace(ns, [IP, "link", "set", "lo", "up"])


def rate_command(rate: str | None, ns: str | None = None, installed: bool = True) -> list[str]:
    """The ``tc`` command that limits loopback to ``rate`` (``"1gbit"``; ``None``: no limit).

    ``installed`` says whether a root qdisc is in place already: ``replace``
    works either way; removing the limit deletes the filter if there is one
    (else there is nothing to do: an empty command).
    """
    if rate is None:
        return in_namespace(ns, [TC, "qdisc", "del", "dev", "lo", "root"]) if installed else []
    tbf = ["tbf", "rate", rate, "burst", BURST, "latency", LATENCY]
    return in_namespace(ns, [TC, "qdisc", "replace", "dev", "lo", "root", *tbf])


def clear_rate(ns: str | None = None) -> None:
    """Remove any rate limit from the loopback (nothing to do if none), and check it is gone.

    The namespace outlives each process count's workers, which install and
    replace limits as they go: what the last of them left would otherwise
    limit the next count's unlimited setting.

    Raises:
      RuntimeError: a token bucket is still installed afterwards.
    """
    subprocess.run(in_namespace(ns, [TC, "qdisc", "del", "dev", "lo", "root"]), capture_output=True)
    shown = subprocess.run(
        in_namespace(ns, [TC, "qdisc", "show", "dev", "lo"]), capture_output=True, text=True
    )
    if "tbf" in shown.stdout:
        raise RuntimeError(f"a rate limit is still installed on lo: {shown.stdout.strip()}")


def rate_bits_per_s(rate: str) -> float:
    """``tc``'s rate units as bits per second: ``"100mbit"`` -> 1e8, ``"10gbit"`` -> 1e10.

    Raises:
      ValueError: not a number followed by ``bit``, ``kbit``, ``mbit``, ``gbit`` or ``tbit``.
    """
    units = {"tbit": 1e12, "gbit": 1e9, "mbit": 1e6, "kbit": 1e3, "bit": 1.0}
    text = rate.strip().lower()
    for unit, scale in units.items():  # longest suffixes first
        if text.endswith(unit):
            try:
                return float(text[: -len(unit)]) * scale
            except ValueError:
                break
    raise ValueError(f"not a tc rate: {rate!r} (e.g. 100mbit, 1gbit, 10gbit)")


def run(argv: list[str]) -> None:
    """Run ``argv`` (nothing for an empty command).

    Raises:
      RuntimeError: it failed; the message has the command and its stderr.
    """
    if not argv:
        return
    proc = subprocess.run(argv, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({proc.returncode}): {proc.stderr.strip()}")


def read_tx_bytes(path: str = TX_BYTES) -> int:
    """Bytes sent on loopback so far, read from inside the namespace (``ip netns exec``
    mounts the namespace's own ``/sys``)."""
    with open(path) as f:
        return int(f.read())


def unavailable_reason(ns: str) -> str | None:
    """Why a rate-limited namespace cannot be made here, or ``None`` when it can.

    Checks that ``ip`` and ``tc`` exist, then really creates ``ns``, brings
    its loopback up and installs a ``tbf`` (deleting the namespace again).
    """
    for tool in (IP, TC):
        if shutil.which(tool) is None:
            return f"the {tool!r} command is not installed (iproute2)"
    if hasattr(os, "geteuid") and os.geteuid() != 0:
        return "network namespaces and tc need root (run as root, or in a privileged container)"
    try:
        with namespace(ns) as made:
            run(rate_command("1gbit", made))
    except (RuntimeError, OSError) as err:
        return f"cannot make a rate-limited network namespace: {err}"
    return None


@contextlib.contextmanager
def namespace(ns: str) -> Iterator[str]:
    """Create namespace ``ns`` with its loopback up; delete it on the way out (also on Ctrl-C)."""
    run(add_command(ns))
    try:
        run(loopback_up_command(ns))
        yield ns
    finally:
        with contextlib.suppress(RuntimeError, OSError):
            run(delete_command(ns))

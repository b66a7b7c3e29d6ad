"""The variance constants of :func:`compjax.int_quant`, exact and with the rotation.

The derivations are in :mod:`compjax.compressors.int_quant`'s docstring;
``proofs_checks/int_quant.py`` and ``tests/test_int_quant.py`` check them.
"""

from __future__ import annotations

import math

from compjax import hadamard


def int_quant_omega(d: int, bits: int) -> float:
    """``omega(d) = (sqrt(1 + (d - 1)/s**2) - 1)/2`` for ``s = 2**(bits-1) - 1`` (exact).

    Args:
      d: the number of entries of the input.
      bits: the bits per code of :func:`compjax.int_quant`.

    Returns:
      The supremum of ``E||C(x) - x||^2 / ||x||^2`` (a float; 0 for ``d <= 1``).
    """
    if d <= 1:
        return 0.0
    s = 2 ** (bits - 1) - 1
    return (math.sqrt(1.0 + (d - 1) / s**2) - 1.0) / 2.0


def int_quant_rotated_omega(d: int, bits: int, workers: int = 1) -> float:
    """``min(omega(n d'), n (ln(2 n d') + 1) / (2 s**2))`` with ``d'`` the padded size (a bound).

    For ``workers = 1`` the ``omega`` of ``int_quant(bits, rotate=True)``;
    divided by ``workers**2`` the mean's constant (see the module docstring).

    Args:
      d: the number of entries of each worker's input (before padding).
      bits: the bits per code of :func:`compjax.int_quant`.
      workers: ``n``, the workers sharing one scale and one rotation.

    Returns:
      The bound (a float; 0 for ``d <= 1``).
    """
    if d <= 1:
        return 0.0
    padded = hadamard.next_power_of_two(d)
    s = 2 ** (bits - 1) - 1
    tail = workers * (math.log(2 * workers * padded) + 1.0) / (2 * s**2)
    return min(int_quant_omega(workers * padded, bits), tail)


def int_quant_mean_omega(d: int, bits: int, workers: int, rotate: bool = False) -> float:
    """The constant ``c`` of ``E||mean - x_bar||^2 <= c sum_i ||x_i||^2`` over ``workers``.

    ``c = omega(workers * d) / workers**2``: one scale for all workers'
    entries (see the module docstring).  With ``rotate=True``
    ``min(omega(n d'), n (ln(2 n d') + 1) / (2 s**2)) / n**2`` (a bound).

    Args:
      d: the number of entries of each worker's input.
      bits: the bits per code of :func:`compjax.int_quant`.
      workers: ``n``, the workers whose codes are summed on one shared scale.
      rotate: the constant of ``int_quant(bits, rotate=True)``.

    Returns:
      The constant ``c`` (a float): exact without the rotation, a bound with it.
    """
    if rotate:
        return int_quant_rotated_omega(d, bits, workers) / workers**2
    return int_quant_omega(workers * d, bits) / workers**2

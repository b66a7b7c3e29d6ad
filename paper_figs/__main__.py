"""Run every figure script in order and print where its outputs are."""

from __future__ import annotations

import importlib
import time

# The figure modules of this package, in the order they run.
FIGURES = ("compressors",)


def main() -> None:
    for name in FIGURES:
        start = time.perf_counter()
        outputs = importlib.import_module(f"paper_figs.{name}").main()
        print(f"{name}: done in {time.perf_counter() - start:.0f} s")
        for path in outputs:
            print(f"  {path}")


if __name__ == "__main__":
    main()

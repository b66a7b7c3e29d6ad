"""The compressor table of the README, generated from the compressors' metadata.

``python -m compjax.table`` prints it; ``python -m compjax.table --update
README.md`` rewrites the block between the table markers in place.  A test
checks that the README holds exactly what this module generates.
"""

from __future__ import annotations

import argparse
import pathlib

import compjax

# The compressors the README and the figures show, as the calls that build them.
CATALOGUE_SPECS = (
    "identity()",
    "cast('bfloat16')",
    "cast('float16')",
    "qsgd(levels=1)",
    "qsgd(levels=4)",
    "qsgd(levels=16)",
    "qsgd(levels=4, bucket_size=512)",
    "terngrad()",
    "terngrad(clip=2.5)",
    "blockwise(terngrad(), 512)",
    "natural()",
    "natural_dithering(levels=3)",
    "natural_dithering(levels=7)",
    "natural_dithering(levels=8, p=float('inf'))",
    "sign()",
    "int_quant(bits=4)",
    "eden()",
    "eden(bits=2)",
    "eden(bits=4)",
    "drive()",
    "scaled_sign()",
    "rand_k(ratio=0.01)",
    "rand_k(ratio=0.01, shared_seed=True)",
    "rand_k(ratio=0.01, scaled=False)",
    "top_k(ratio=0.01)",
    "chain(top_k(ratio=0.01), qsgd(levels=16))",
    "scaled(natural(), 8 / 9)",
    "atomo(budget=16)",
    "atomo_svd(budget=2)",
)

DIMS = (1024, 2**20)
START = "<!-- compressor-table:start -->"
END = "<!-- compressor-table:end -->"


def catalogue() -> dict[str, compjax.Compressor]:
    """Spec string -> compressor, each built by evaluating its spec."""
    namespace = {name: getattr(compjax, name) for name in compjax.__all__}
    return {spec: eval(spec, namespace) for spec in CATALOGUE_SPECS}


def _fmt(value) -> str:
    if value is None:
        return "—"
    if 0 < 1 - value < 1e-3:
        return f"1 - {1 - value:.3g}"
    if value == 0 or 1e-3 <= abs(value) < 1e4:
        return f"{value:.4g}"
    return f"{value:.3e}"


def markdown_table() -> str:
    header = ["compressor", "unbiased", "linear"]
    for d in DIMS:
        header += [f"omega(d={d})", f"delta(d={d})", f"bits/coord (d={d})"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for spec, comp in catalogue().items():
        row = [f"`{spec}`", "yes" if comp.unbiased else "no", "yes" if comp.linear else "no"]
        for d in DIMS:
            row += [_fmt(comp.omega(d)), _fmt(comp.delta(d)), _fmt(comp.bits_per_coordinate(d))]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def update_readme(path: pathlib.Path) -> bool:
    """Replace the table between the markers; returns whether the file changed."""
    text = path.read_text()
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    new = f"{head}{START}\n{markdown_table()}\n{END}{tail}"
    path.write_text(new)
    return new != text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--update", type=pathlib.Path, help="README to rewrite in place")
    args = parser.parse_args()
    if args.update:
        changed = update_readme(args.update)
        print(f"{args.update}: {'updated' if changed else 'already up to date'}")
    else:
        print(markdown_table())


if __name__ == "__main__":
    main()

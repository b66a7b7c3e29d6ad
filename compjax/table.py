"""The compressor tables of the docs and the README, generated from the compressors' metadata.

Two tables: the full one (:func:`markdown_table`: every catalogue entry at two sizes), which
``docs/compressors.md`` holds between the markers ``START`` and ``END``, and the README's
short one (:func:`readme_table`: one line per compressor at ``2^20`` entries, each linked to
its theory in the docs), between ``README_START`` and ``README_END``.

``python -m compjax.table`` prints the full table; ``python -m compjax.table --update
README.md docs/compressors.md`` rewrites every marked block of those files in place.  A test
checks that both files hold exactly what this module generates.
"""

from __future__ import annotations

import argparse
import pathlib

from compjax.compressor import Compressor
from compjax.compressors.atomo import atomo, atomo_svd
from compjax.compressors.chunked import chunked_top_k
from compjax.compressors.combinators import blockwise, chain, scaled
from compjax.compressors.dense import cast, identity
from compjax.compressors.dithering import natural_dithering
from compjax.compressors.eden import drive, eden
from compjax.compressors.int_quant import int_quant
from compjax.compressors.l2_sign import l2_scaled_sign
from compjax.compressors.microscaling import mx
from compjax.compressors.natural import natural
from compjax.compressors.qsgd import qsgd
from compjax.compressors.rand_k import rand_k
from compjax.compressors.sign import scaled_sign, sign
from compjax.compressors.sparse import top_k
from compjax.compressors.terngrad import terngrad

#: The names a spec may call: every compressor factory of ``compjax.__all__``.
FACTORIES = {
    f.__name__: f
    for f in (
        atomo,
        atomo_svd,
        blockwise,
        cast,
        chain,
        chunked_top_k,
        drive,
        eden,
        identity,
        int_quant,
        l2_scaled_sign,
        mx,
        natural,
        natural_dithering,
        qsgd,
        rand_k,
        scaled,
        scaled_sign,
        sign,
        terngrad,
        top_k,
    )
}

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

# The README's short table: one compressor per line, and where the docs give its theory.
README_START = "<!-- readme-table:start -->"
README_END = "<!-- readme-table:end -->"
README_DIM = 2**20
THEORY = "docs/compressors.md"
README_SPECS = (
    ("identity()", f"{THEORY}#the-compressor-contract"),
    ("cast('bfloat16')", f"{THEORY}#cast"),
    ("qsgd(levels=4, bucket_size=512)", f"{THEORY}#qsgd"),
    ("terngrad()", f"{THEORY}#terngrad"),
    ("natural()", f"{THEORY}#natural-compression"),
    ("natural_dithering(levels=7)", f"{THEORY}#natural-dithering"),
    ("int_quant(bits=4)", f"{THEORY}#integer-quantization-with-a-shared-scale"),
    ("eden()", f"{THEORY}#eden--drive"),
    ("drive()", f"{THEORY}#eden--drive"),
    ("sign()", f"{THEORY}#wire-formats"),
    ("scaled_sign()", f"{THEORY}#top-k-and-scaled-sign"),
    ("rand_k(ratio=0.01)", f"{THEORY}#random-k"),
    ("top_k(ratio=0.01)", f"{THEORY}#top-k-and-scaled-sign"),
    ("chain(top_k(ratio=0.01), qsgd(levels=16))", f"{THEORY}#chain"),
    ("atomo(budget=16)", "docs/methods.md#stateful-sparsification-and-low-rank"),
    ("atomo_svd(budget=2)", "docs/methods.md#stateful-sparsification-and-low-rank"),
)


def build(spec: str) -> Compressor:
    """The compressor a spec string names, built by evaluating it over :data:`FACTORIES`."""
    return eval(spec, dict(FACTORIES))


def catalogue() -> dict[str, Compressor]:
    """Spec string -> compressor, each built by evaluating its spec."""
    return {spec: build(spec) for spec in CATALOGUE_SPECS}


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


def readme_table() -> str:
    """The README's table: each compressor's constants at ``README_DIM`` entries, linked."""
    d = README_DIM
    header = ["compressor", "unbiased", f"omega(d={d})", f"delta(d={d})", f"bits/coord (d={d})"]
    header.append("theory")
    lines = [
        f"| {' | '.join(header)} |",
        "|" + "---|" * len(header),
    ]
    for spec, link in README_SPECS:
        comp = build(spec)
        row = [f"`{spec}`", "yes" if comp.unbiased else "no"]
        row += [_fmt(comp.omega(d)), _fmt(comp.delta(d)), _fmt(comp.bits_per_coordinate(d))]
        row.append(f"[docs]({link})")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def tables() -> dict[tuple[str, str], str]:
    """Each table's markers and its generated text."""
    return {(START, END): markdown_table(), (README_START, README_END): readme_table()}


def marked_blocks(text: str) -> dict[tuple[str, str], str]:
    """The text between each pair of table markers that ``text`` holds, stripped."""
    return {
        (start, end): text.split(start, 1)[1].split(end, 1)[0].strip()
        for start, end in tables()
        if start in text
    }


def update_readme(path: pathlib.Path) -> bool:
    """Replace every marked table of ``path`` (none: a ``ValueError``); whether it changed."""
    text = new = path.read_text()
    found = False
    for (start, end), table in tables().items():
        if start in new:
            head, rest = new.split(start, 1)
            _, tail = rest.split(end, 1)
            new = f"{head}{start}\n{table}\n{end}{tail}"
            found = True
    if not found:
        raise ValueError(f"{path} holds no table markers")
    path.write_text(new)
    return new != text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--update", type=pathlib.Path, nargs="+", help="Markdown files to rewrite in place"
    )
    args = parser.parse_args()
    if args.update:
        for path in args.update:
            changed = update_readme(path)
            print(f"{path}: {'updated' if changed else 'already up to date'}")
    else:
        print(markdown_table())


if __name__ == "__main__":
    main()

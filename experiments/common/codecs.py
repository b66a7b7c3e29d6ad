"""What ``make bench`` measures: its goals, sizes and codecs (one line each), and the
ResNet-50 tree's shapes.  :mod:`experiments.bench.run` times them,
:mod:`experiments.bench.report` judges and tabulates the results; ``make bench-gpu``
(:mod:`experiments.gpu.run`) times the same codecs on an accelerator.
"""

from __future__ import annotations

import dataclasses

N = 2**24
#: Bucket size of the bucketed ResNet-50 roofline (25.6M entries: 7 buckets).
BUCKET_LOG2 = 22
#: Goals of the benchmark (never loosened here; a miss is reported with its ratio).
ROOFLINE_GOAL = 2.0
EDEN_GOAL = 3.0
TORCH_GOAL = 1.0
TOPK_SPEEDUP_GOAL = 5.0
TOPK_CODEC_GOAL = 3.0
#: Density of error feedback's top-k codec row (``compjax.top_k(ratio=0.01)``).
EF_TOPK_RATIO = 0.01
STEP_GOAL = 1.25
DGC_RATIO = 0.001
POWERSGD_RANK = 4
MLP_WIDTHS = (784, 1024, 1024, 10)
MLP_BATCH_PER_WORKER = 64
STEP_WORKERS = 8
#: XLA flag that turns off its YNNPACK fusions (a diagnostic run of the step only).
NO_YNN = "--xla_cpu_experimental_ynn_fusion_type="

#: The roofline sections (compress + decompress against the copy) that carry goals.
ROOFLINE_PARTS = ("roofline", "roofline_tree", "roofline_buckets")
#: The bucketed tree again, its kernels in Flax's HWIO layout (reported, no goal).
HWIO_PART = "roofline_buckets_hwio"
#: Where an elementwise compressor runs: every roofline, the memory analysis, the MLP step.
ELEMENTWISE_PARTS = (*ROOFLINE_PARTS, HWIO_PART, "memory", "step")
#: Where a rotation-based one runs (its time grows with log d: no buckets, no step).
ROTATION_PARTS = ("roofline", "roofline_tree", "memory")


@dataclasses.dataclass(frozen=True)
class Codec:
    """One benchmarked compressor: its spec (the harness's parser), where it runs, its goal.

    ``goal`` is the most compress + decompress may take, in copies, on the
    sections of ``goal_on``; elsewhere (or with ``goal=None``) its ratio is
    reported without a verdict.  ``torch``: :mod:`experiments.bench.torch_baselines`
    has a plain PyTorch version to compare with.
    """

    spec: str
    parts: tuple[str, ...] = ELEMENTWISE_PARTS
    goal: float | None = ROOFLINE_GOAL
    goal_on: tuple[str, ...] = ROOFLINE_PARTS
    torch: bool = False


#: Every benchmarked compressor, one line each (a new codec joins ``make bench`` here).
CODECS = (
    Codec("sign()", torch=True),
    Codec("scaled_sign()", torch=True),
    Codec("terngrad()", torch=True),
    Codec("qsgd(levels=4)", torch=True),
    Codec("qsgd(levels=4, bucket_size=512)", torch=True),
    Codec("natural()", torch=True),
    Codec("cast('float16')", torch=True),
    Codec("cast('bfloat16')", torch=True),
    Codec("natural_dithering()"),
    Codec("l2_scaled_sign()"),
    Codec("int_quant(bits=4)"),
    Codec("eden(bits=1)", ROTATION_PARTS, goal=EDEN_GOAL, goal_on=("roofline",)),
    Codec("eden(bits=2)", ROTATION_PARTS, goal=None),
    Codec("eden(bits=4)", ROTATION_PARTS, goal=None),
    Codec("drive()", ROTATION_PARTS, goal=None),
)
CODEC = {c.spec: c for c in CODECS}


def specs(part: str) -> tuple[str, ...]:
    """The specs of the codecs that run in ``part`` (``"torch"``: those with a PyTorch twin)."""
    return tuple(c.spec for c in CODECS if (c.torch if part == "torch" else part in c.parts))


#: Rounds of the randomized Hadamard rotation the Hadamard row times (EDEN's default).
HADAMARD_ROUNDS = 3


# -- shapes ---------------------------------------------------------------------------------
def resnet50_shapes() -> list[tuple[int, ...]]:
    """Parameter shapes of ResNet-50 (torchvision layout, OIHW kernels; 25,557,032 entries).

    The stem, 16 bottleneck blocks (``[3, 4, 6, 3]`` at widths 64..512,
    expansion 4, a projection on the first block of each stage), a batch-norm
    scale and shift after every convolution, and the 1000-way classifier.
    """
    shapes: list[tuple[int, ...]] = [(64, 3, 7, 7), (64,), (64,)]
    channels = 64
    for width, blocks in ((64, 3), (128, 4), (256, 6), (512, 3)):
        out = 4 * width
        for block in range(blocks):
            shapes += [(width, channels, 1, 1), (width,), (width,)]
            shapes += [(width, width, 3, 3), (width,), (width,)]
            shapes += [(out, width, 1, 1), (out,), (out,)]
            if block == 0:
                shapes += [(out, channels, 1, 1), (out,), (out,)]
            channels = out
    return [*shapes, (1000, 2048), (1000,)]


def hwio(shape: tuple[int, ...]) -> tuple[int, ...]:
    """A torchvision shape in Flax's layout: OIHW kernels as HWIO, the classifier as
    ``(in, out)``; vectors as they are."""
    if len(shape) == 4:
        o, i, h, w = shape
        return (h, w, i, o)
    return shape[::-1]

"""PyTorch baselines for ``make bench``: the compressors written plainly, and DDP PowerSGD.

Imported only by the benchmark (never by compjax or the tests); needs the CPU
build of torch (``make bench`` installs ``torch==2.13.0``).

The compressors follow how public PyTorch compression frameworks write them
(GRACE, Xu et al. 2021: ``qsgd.py``, ``terngrad.py``, ``natural.py``,
``signsgd.py``, ``efsignsgd.py``, ``fp16.py``): a few tensor operations, a
``torch.rand``-style draw per entry where the method is stochastic, and codes
in one byte per entry (``int8``/``uint8``/``bool``), without bit packing.  Each
computes the same compressor as its compjax counterpart (TernGrad without
clipping, natural compression's exponent with the sign in a separate byte).

Run as a script, this module is one rank of the DDP PowerSGD measurement::

    python -m experiments.bench.torch_baselines powersgd INPUT.json STORE RANK WORLD OUTPUT.json
"""

from __future__ import annotations

import json
import resource
import sys
import time

import torch

# -- compressors: compress(x) -> payload tuple, decompress(payload, shape) -> tensor


def sign_compress(x):
    return ((x.flatten() >= 0).to(torch.uint8),)


def sign_decompress(payload, shape):
    (signs,) = payload
    return (signs.to(torch.float32) * 2 - 1).view(shape)


def scaled_sign_compress(x):
    flat = x.flatten()
    return flat.abs().mean(), (flat >= 0).to(torch.uint8)


def scaled_sign_decompress(payload, shape):
    mean, signs = payload
    return (mean * (signs.to(torch.float32) * 2 - 1)).view(shape)


def terngrad_compress(x):
    flat = x.flatten()
    magnitude = flat.abs()
    scalar = magnitude.max()
    keep = torch.rand_like(flat) * scalar < magnitude
    return scalar, (flat.sign() * keep).to(torch.int8)


def terngrad_decompress(payload, shape):
    scalar, codes = payload
    return (codes.to(torch.float32) * scalar).view(shape)


def qsgd_compress(x, levels, bucket_size=None):
    flat = x.flatten()
    size = bucket_size or flat.numel()
    pad = -flat.numel() % size
    buckets = torch.nn.functional.pad(flat, (0, pad)).view(-1, size)
    norm = buckets.norm(dim=1, keepdim=True)
    level_float = levels / norm * buckets.abs()
    previous_level = level_float.floor()
    is_next_level = torch.rand_like(buckets) < (level_float - previous_level)
    new_level = previous_level + is_next_level
    codes = (new_level * buckets.sign()).to(torch.int8 if levels < 128 else torch.int16)
    return norm, codes


def qsgd_decompress(payload, shape, levels):
    norm, codes = payload
    numel = torch.Size(shape).numel()
    return (norm / levels * codes.to(torch.float32)).flatten()[:numel].view(shape)


def natural_compress(x):
    bits = x.flatten().view(torch.int32)
    exponent = (bits >> 23) & 0xFF
    mantissa = bits & 0x7FFFFF
    draw = torch.randint(0, 1 << 23, mantissa.shape, dtype=torch.int32)
    up = ((draw < mantissa) & (exponent < 255)).to(torch.int32)
    exponent = torch.clamp(exponent + up, max=254).to(torch.uint8)
    return exponent, bits < 0


def natural_decompress(payload, shape):
    exponent, negative = payload
    magnitude = (exponent.to(torch.int32) << 23).view(torch.float32)
    return torch.where(negative, -magnitude, magnitude).view(shape)


def cast_compress(x, dtype):
    return (x.to(dtype),)


def cast_decompress(payload, shape):
    return payload[0].to(torch.float32).view(shape)


def compressor(name: str):
    """``(compress(x), decompress(payload, shape))`` for a compjax spec name of the benchmark."""
    if name == "sign()":
        return sign_compress, sign_decompress
    if name == "scaled_sign()":
        return scaled_sign_compress, scaled_sign_decompress
    if name == "terngrad()":
        return terngrad_compress, terngrad_decompress
    if name.startswith("qsgd("):
        levels, bucket = 4, None
        if "levels=16" in name:
            levels = 16
        if "bucket_size=512" in name:
            bucket = 512
        return (
            lambda x: qsgd_compress(x, levels, bucket),
            lambda p, s: qsgd_decompress(p, s, levels),
        )
    if name == "natural()":
        return natural_compress, natural_decompress
    if name == "cast('float16')":
        return (lambda x: cast_compress(x, torch.float16)), cast_decompress
    if name == "cast('bfloat16')":
        return (lambda x: cast_compress(x, torch.bfloat16)), cast_decompress
    raise KeyError(name)


def machine() -> dict:
    return {
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "torch_interop_threads": torch.get_num_interop_threads(),
        "torch_config": torch.__config__.parallel_info().splitlines()[:6],
    }


def time_compressors(names, shapes, repeats: int, warmup: int = 2) -> dict:
    """Median-ready times of each compressor on tensors of ``shapes`` (all leaves per call).

    Returns ``{"copy": [...], name: {"compress": [...], "decompress": [...]}}``,
    interleaved round by round with the ``x * 2`` copy of the same tensors.
    """
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(s, generator=gen) for s in shapes]
    torch.manual_seed(0)

    def copy():
        return [x * 2 for x in xs]

    fns = {}
    for name in names:
        comp, decomp = compressor(name)
        payloads = [comp(x) for x in xs]
        fns[name] = (
            lambda comp=comp: [comp(x) for x in xs],
            lambda decomp=decomp, payloads=payloads: [
                decomp(p, x.shape) for p, x in zip(payloads, xs, strict=True)
            ],
        )
    for _ in range(warmup):
        copy()
        for c, d in fns.values():
            c()
            d()
    out = {"copy": [], "copy_faults": []}
    out.update({name: {"compress": [], "decompress": [], "faults": []} for name in names})
    for _ in range(repeats):
        f0 = minor_faults()
        t0 = time.perf_counter()
        copy()
        out["copy"].append(time.perf_counter() - t0)
        out["copy_faults"].append(minor_faults() - f0)
        for name, (c, d) in fns.items():
            f0 = minor_faults()
            t0 = time.perf_counter()
            c()
            t1 = time.perf_counter()
            d()
            t2 = time.perf_counter()
            out[name]["compress"].append(t1 - t0)
            out[name]["decompress"].append(t2 - t1)
            out[name]["faults"].append(minor_faults() - f0)
    return out


def minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


# -- DDP PowerSGD (one rank) ------------------------------------------------------------


class _Grads(torch.nn.Module):
    """Parameters of the given shapes; ``forward(gs)`` is a loss whose gradient is ``gs``."""

    def __init__(self, shapes):
        super().__init__()
        self.ws = torch.nn.ParameterList([torch.nn.Parameter(torch.zeros(s)) for s in shapes])

    def forward(self, gs):
        return sum((w * g).sum() for w, g in zip(self.ws, gs, strict=True))


def powersgd_rank(inputs: str, store: str, rank: int, world: int, output: str) -> None:
    """Time ``powerSGD_hook`` per step on one rank; rank 0 writes the times."""
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as hook

    spec = json.loads(open(inputs).read())
    torch.set_num_threads(spec["threads"])
    shapes = [tuple(s) for s in spec["shapes"]]
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    model = torch.nn.parallel.DistributedDataParallel(_Grads(shapes))
    state = hook.PowerSGDState(
        process_group=None,
        matrix_approximation_rank=spec["rank"],
        start_powerSGD_iter=2,  # the hook's minimum with error feedback and warm start
        min_compression_rate=2,
    )
    hook_seconds = [0.0]

    def timed_hook(state, bucket):
        """The hook, timed to the completion of its future (all its allreduces)."""
        t0 = time.perf_counter()
        fut = hook.powerSGD_hook(state, bucket)
        fut.wait()
        hook_seconds[0] += time.perf_counter() - t0
        return fut

    model.register_comm_hook(state, timed_hook)
    gen = torch.Generator().manual_seed(1 + rank)
    grads = [torch.randn(s, generator=gen) for s in shapes]
    hooks, steps = [], []
    for step in range(spec["warmup"] + spec["steps"]):
        hook_seconds[0] = 0.0
        dist.barrier()
        t0 = time.perf_counter()
        model.zero_grad()
        model(grads).backward()
        total = time.perf_counter() - t0
        if step >= spec["warmup"]:
            hooks.append(hook_seconds[0])
            steps.append(total)
    if rank == 0:
        result = {"hook": hooks, "backward": steps, "buckets": len(state.p_memory_dict)}
        result.update(machine())
        open(output, "w").write(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    if sys.argv[1] != "powersgd":
        raise SystemExit(f"unknown command {sys.argv[1]!r}")
    powersgd_rank(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), sys.argv[6])

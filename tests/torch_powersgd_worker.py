"""One rank of PyTorch DDP with ``powerSGD_hook``, for ``test_powersgd_torch.py``.

Usage: ``python torch_powersgd_worker.py INPUT.npz STORE RANK WORLD OUTPUT.npz``.
INPUT holds ``grads`` (steps, world, *shape), ``q0``, ``rank`` and
``start_iter``; rank 0 writes the gradients after the hook (the compressed
mean) of every step to OUTPUT.
"""

import sys

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as hook


class Single(torch.nn.Module):
    """One parameter, so the hook's bucket holds exactly that matrix."""

    def __init__(self, shape):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(shape))

    def forward(self, g):
        """A loss whose gradient is ``g`` (through DDP's forward, so its reducer runs)."""
        return (self.w * g).sum()


def main(inputs, store, rank, world, output):
    data = np.load(inputs)
    grads, q0 = data["grads"], data["q0"]
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    model = torch.nn.parallel.DistributedDataParallel(Single(grads.shape[2:]))
    state = hook.PowerSGDState(
        process_group=None,
        matrix_approximation_rank=int(data["rank"]),
        start_powerSGD_iter=int(data["start_iter"]),
        min_compression_rate=2,
    )
    # Seed the warm-start memory with compjax's initial Q (the hook randomises Q
    # only when its P memory is empty).
    state.p_memory_dict[0] = torch.zeros(grads.shape[2] * q0.shape[1])
    state.q_memory_dict[0] = torch.tensor(q0).reshape(-1).clone()
    model.register_comm_hook(state, hook.powerSGD_hook)
    out = []
    for step in range(grads.shape[0]):
        model.zero_grad()
        model(torch.tensor(grads[step, rank])).backward()
        out.append(model.module.w.grad.detach().numpy().copy())
    if rank == 0:
        np.savez(output, updates=np.stack(out))
    dist.barrier()  # both ranks done with gloo before either tears it down
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])

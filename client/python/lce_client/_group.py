"""A tensor-parallel group whose ranks hold the same rows (Megatron's output layer without sequence
parallelism): the group's first rank makes the group's one request and its answers reach the other
ranks through torch.distributed, so the server sees each hidden state once and adds dW once."""
from __future__ import annotations

from typing import Optional, Sequence

import torch


class RowGroup:
    def __init__(self, group):
        import torch.distributed as dist

        self._dist, self._group = dist, group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self._src = dist.get_global_rank(group, 0) if hasattr(dist, "get_global_rank") else \
            dist.distributed_c10d.get_global_rank(group, 0)

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def share(self, t: Optional[torch.Tensor], shape: Sequence[int], dtype: torch.dtype,
              device: torch.device) -> torch.Tensor:
        """The leader's tensor `t` on every rank (the others pass None), sent as fp32 (exact for the
        16-bit dtypes, which not every backend carries) and returned in `dtype`."""
        buf = t.detach().to(device=device, dtype=torch.float32).contiguous() if self.leader else \
            torch.empty(tuple(shape), dtype=torch.float32, device=device)
        self._dist.broadcast(buf, src=self._src, group=self._group)
        return buf.to(dtype)

    def share_ids(self, ids: Sequence[int], device: torch.device) -> tuple:
        """The leader's ids (pending weight-gradient contributions) on every rank."""
        n = self.share(torch.tensor([len(ids)], dtype=torch.float64) if self.leader else None, (1,),
                       torch.int64, device)
        signed = [i - (1 << 64) if i >= 1 << 63 else i for i in ids]  # uint64 ids in int64 bits
        buf = torch.tensor(signed, dtype=torch.int64, device=device) if self.leader else \
            torch.empty(int(n[0]), dtype=torch.int64, device=device)
        self._dist.broadcast(buf, src=self._src, group=self._group)
        return tuple(int(i) % (1 << 64) for i in buf.tolist())

    def barrier(self) -> None:
        self._dist.barrier(group=self._group)

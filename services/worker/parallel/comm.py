"""The collectives a worker's ranks run together, over torch.distributed (NCCL on GPUs, gloo on
the CPU), behind one small interface the model and the engine call unconditionally.

``LocalComm`` is the one-rank group: every collective is the identity and costs nothing, so a
single-GPU worker runs the same code as a rank of a group. ``TorchComm`` wraps a process group
and counts the collectives it runs (``dhisparse:worker_collectives_total``; the tests check that
a group step runs some)."""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
import torch.distributed as dist


class Comm:
    """A group of ``size`` ranks; this process is ``rank``. Tensor collectives take and return
    tensors on the group's device; object collectives move picklable Python values (the step
    inputs rank 0 broadcasts)."""

    rank: int = 0
    size: int = 1

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()  # collectives run, by name

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """The elementwise sum of every rank's ``t`` (same shape on every rank), on every rank."""
        return t

    def all_gather(self, t: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's ``t`` (same shape on every rank) concatenated along ``dim`` in rank
        order, on every rank."""
        return t

    def all_to_all(self, t: torch.Tensor, send: list[int], recv: list[int]) -> torch.Tensor:
        """Rows ``t[sum(send[:j]) : sum(send[:j+1])]`` go to rank j; returns the rows every rank
        sent here, in rank order (``recv[j]`` of them from rank j: the counts every rank knows
        from a header exchanged before)."""
        return t

    def broadcast_object(self, obj: Any = None) -> Any:
        """Rank 0's ``obj`` on every rank (the others pass anything)."""
        return obj

    def gather_objects(self, obj: Any) -> list[Any] | None:
        """Every rank's ``obj`` in rank order on rank 0; None on the others."""
        return [obj]

    def close(self) -> None:
        """Leaves the group (the one-rank group has nothing to leave)."""


class LocalComm(Comm):
    """The group of one rank."""


LOCAL = LocalComm()


class TorchComm(Comm):
    """A torch.distributed process group. Object collectives go through a gloo group (on a GPU
    the tensor collectives use NCCL and the step inputs stay on the host)."""

    def __init__(self, group: dist.ProcessGroup, objects: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        self.group = group
        self.objects = objects or group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        self.calls["all_reduce"] += 1
        t = t.contiguous()
        dist.all_reduce(t, group=self.group)
        return t

    def all_gather(self, t: torch.Tensor, dim: int = -1) -> torch.Tensor:
        self.calls["all_gather"] += 1
        t = t.contiguous()
        parts = [torch.empty_like(t) for _ in range(self.size)]
        dist.all_gather(parts, t, group=self.group)
        return torch.cat(parts, dim=dim)

    def all_to_all(self, t: torch.Tensor, send: list[int], recv: list[int]) -> torch.Tensor:
        self.calls["all_to_all"] += 1
        out = t.new_empty((sum(recv), *t.shape[1:]))
        dist.all_to_all_single(out, t.contiguous(), list(recv), list(send), group=self.group)
        return out

    def broadcast_object(self, obj: Any = None) -> Any:
        self.calls["broadcast"] += 1
        box = [obj if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=dist.get_global_rank(self.objects, 0),
                                   group=self.objects)  # fmt: skip
        return box[0]

    def gather_objects(self, obj: Any) -> list[Any] | None:
        self.calls["gather"] += 1
        out: list[Any] | None = [None] * self.size if self.rank == 0 else None
        dist.gather_object(obj, out, dst=dist.get_global_rank(self.objects, 0),
                           group=self.objects)  # fmt: skip
        return out

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()

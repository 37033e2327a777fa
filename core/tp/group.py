"""``TPGroup``: the ranks of one tensor-parallel engine and the three things they do together.

* **Commands.** Rank 0 (the leader) runs the engine: scheduler, drafter, sampling, server. The
  other ranks (followers) hold a shard of the target and its KV pool and do what the leader's
  target does, in the same order: ``running(op, *args)`` on the leader broadcasts the command
  (``forward`` of a ForwardBatch, ``move`` of KV slots, ``call`` of one sharded module, ``stop``)
  and every follower executes it (``follower.py``). Calls made while a command is running (the
  layers inside a forward) send nothing.
* **All-reduce** of row-parallel partial sums, as an all-gather followed by a sum in rank
  order: every element is added in one fixed order whatever the number of rows, so a row's
  bits never depend on the rest of the forward (greedy speculation stays exact under TP). A
  ring all-reduce would chunk the tensor by its size, and with it the order of the additions.
* **Gather** of vocabulary-parallel logits: each rank's columns, concatenated.

gloo on CPUs, nccl on CUDA (``model.tp_backend``); ranks spawned on one x86 machine gather through
shared memory instead (``shm.py``). The process group's timeout is long on purpose:
an idle server's followers wait for their next command; if the leader dies, its sockets close
and the followers' wait fails, which ends them.
"""

from __future__ import annotations

import subprocess
from contextlib import contextmanager
from datetime import timedelta

import torch
import torch.distributed as dist

IDLE_TIMEOUT = timedelta(days=365)


class TPGroup:
    def __init__(self, rank: int, world: int):
        self.rank, self.world = rank, world
        self.busy = False  # the leader is inside a command the followers run too
        self.shm = None  # shm.ShmCollectives: all-gathers through shared memory (ranks spawned on one machine)
        self.processes: list = []  # the leader's spawned ranks (``launch.py``), waited for by ``stop``
        self._stopped = False

    @classmethod
    def join(cls, rank: int, world: int, init_method: str, backend: str, store=None) -> "TPGroup":
        """Join (or form) the process group (through ``store`` when given); blocks until every rank has joined."""
        if not dist.is_initialized():
            where = {"store": store} if store is not None else {"init_method": init_method}
            dist.init_process_group(backend, rank=rank, world_size=world, timeout=IDLE_TIMEOUT, **where)
        return cls(dist.get_rank(), dist.get_world_size())

    @property
    def leader(self) -> bool:
        return self.rank == 0

    # ---- commands -----------------------------------------------------------------------
    @contextmanager
    def running(self, op: str, *args):
        """Leader: start ``op`` on every follower (unless one is already running) and run the
        leader's part inside the block."""
        if not self.leader or self.busy:
            yield
            return
        dist.broadcast_object_list([(op, args)], src=0)
        self.busy = True
        try:
            yield
        finally:
            self.busy = False

    def send(self, op: str, *args) -> None:
        """Leader: a command with no part of the leader's own inside it (``stop``)."""
        with self.running(op, *args):
            pass

    def next_command(self) -> tuple[str, tuple]:
        """Follower: wait for the leader's next command."""
        box = [None]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    # ---- collectives --------------------------------------------------------------------
    def _all_gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        x = x.contiguous()
        if self.shm is not None and self.shm.fits(x):
            return self.shm.all_gather(x)
        parts = [torch.empty_like(x) for _ in range(self.world)]
        dist.all_gather(parts, x)
        return parts

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over ranks, added in rank order (batch invariant; see the module docstring)."""
        parts = self._all_gather(x)
        out = parts[0] + parts[1] if self.world > 1 else parts[0].clone()
        for p in parts[2:]:
            out = out + p
        return out

    def gather_columns(self, x: torch.Tensor, width: int) -> torch.Tensor:
        """Every rank's ``x`` [T, w] (same w: shards padded to equal width) side by side, cut to
        ``width`` columns."""
        return torch.cat(self._all_gather(x), dim=-1)[..., :width]

    def stop(self) -> None:
        """Leader: end the followers (``stop`` command), wait for spawned ones, leave the group. Once."""
        if self._stopped:
            return
        self._stopped = True
        try:
            self.send("stop")
        except Exception:  # noqa: BLE001 - the followers may be gone already
            pass
        for p in self.processes:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
        self.close()

    def close(self) -> None:
        if self.shm is not None:
            self.shm.close()
            self.shm = None
        if dist.is_initialized():
            dist.destroy_process_group()

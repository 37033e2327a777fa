"""Collectives over shared memory, for ranks spawned on one x86 machine (``model.tp_backend=auto``).

gloo's all-gather over loopback TCP costs ~0.5 ms, and a token of the demo model needs ~62 of them
(two per block, the embedding, the logits). Here each rank writes its tensor into its own slot of
one shared file in ``/dev/shm``, publishes a sequence number, and waits (spinning, yielding the
core) until every rank has published the same number; then it reads the other slots. Two slot
sets alternate by sequence parity: a rank overwrites a set only after every rank has published the
next number, so every rank has finished reading it. x86 keeps stores in order (and loads in order),
which is all the protocol needs; other CPUs use gloo. Tensors larger than a slot (long prefills) go
through gloo, the same decision on every rank.
"""

from __future__ import annotations

import mmap
import os
import platform

import numpy as np
import torch

SLOT_BYTES = 8 << 20  # per rank and parity: 8 MiB (a 16-row verify's logits shard is ~1.6 MB)
HEADER = 4096


def supported() -> bool:
    return platform.machine() in ("x86_64", "AMD64") and os.path.isdir("/dev/shm")


def path_for(tag: str) -> str:
    return f"/dev/shm/specfw-tp-{os.getpid()}-{tag}"


def create(path: str, world: int) -> None:
    with open(path, "wb") as f:
        f.truncate(HEADER + 2 * world * SLOT_BYTES)


class ShmCollectives:
    def __init__(self, path: str, rank: int, world: int):
        self.rank, self.world = rank, world
        fd = os.open(path, os.O_RDWR)
        try:
            self.map = mmap.mmap(fd, HEADER + 2 * world * SLOT_BYTES)
        finally:
            os.close(fd)
        self.flags = np.ndarray((world,), dtype=np.int64, buffer=self.map, offset=0)
        self.bytes = torch.frombuffer(self.map, dtype=torch.uint8)
        self.seq = int(self.flags[rank])

    def fits(self, x: torch.Tensor) -> bool:
        return x.numel() * x.element_size() <= SLOT_BYTES

    def _slot(self, parity: int, rank: int, like: torch.Tensor) -> torch.Tensor:
        start = HEADER + (parity * self.world + rank) * SLOT_BYTES
        return self.bytes[start : start + like.numel() * like.element_size()].view(like.dtype).view(like.shape)

    def all_gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``x`` (same shape and dtype on every rank), as views into shared memory:
        valid until this rank's next-but-one collective."""
        self.seq += 1
        parity = self.seq & 1
        self._slot(parity, self.rank, x).copy_(x)
        self.flags[self.rank] = self.seq
        while int(self.flags.min()) < self.seq:
            os.sched_yield()
        return [self._slot(parity, r, x) for r in range(self.world)]

    def close(self) -> None:
        self.flags = self.bytes = None
        try:
            self.map.close()
        except BufferError:  # a view handed out is still alive: the mapping goes with the process
            pass

"""The leader's KV pool under TP: a move of KV entries (the scheduler compacting an accepted tree
path) happens on every rank's shard of the pool."""

from __future__ import annotations

import torch

from ..kv_cache import KVPool
from .group import TPGroup


class ShardedKVPool(KVPool):
    group: TPGroup | None = None

    def move(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        with self.group.running("move", src, dst):
            super().move(src, dst)

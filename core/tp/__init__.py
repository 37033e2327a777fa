"""Tensor parallelism inside one engine (``model.tp_size``): ``group.py`` (the ranks, commands,
batch-invariant collectives), ``shard.py`` (what each rank keeps of the target), ``kv.py`` (KV
moves on every rank), ``follower.py`` (a rank other than 0), ``launch.py`` (spawned or torchrun
ranks). See docs/scale-out.md."""

from .group import TPGroup
from .launch import serve_as_follower, start_leader, torchrun_follower, tp_size
from .shard import Partition, TPConfigError, partition, shard_model

__all__ = ["Partition", "TPConfigError", "TPGroup", "partition", "serve_as_follower", "shard_model", "start_leader", "torchrun_follower", "tp_size"]

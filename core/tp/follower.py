"""A follower rank: loads the target, keeps its shard, and runs the leader's commands on it
until ``stop`` (or until the leader's sockets close)."""

from __future__ import annotations

import logging

import torch

from .group import TPGroup

logger = logging.getLogger(__name__)


def run_follower(cfg, group: TPGroup) -> None:
    from ..backends import backend_from_config
    from ..engine import DTYPES, load_target
    from ..model_runner import ModelRunner
    from .shard import shard_model

    device = tp_device(cfg, group.rank)
    loaded = load_target(cfg, device)
    shard_model(loaded.model, loaded.hf_config, group)
    op, args = group.next_command()
    if op != "init":
        raise RuntimeError(f"tp rank {group.rank}: expected the leader's 'init', got {op!r}")
    num_slots, dtype, timed_rows = args
    runner = ModelRunner(loaded.model, loaded.hf_config, num_slots, DTYPES[dtype], backend=backend_from_config(cfg.engine, device, cfg), timed_rows=timed_rows)
    kv_heads = loaded.model.layers[0].n_kv
    logger.info("tp rank %d/%d ready: %d KV heads of %d, kv_slots=%d", group.rank, group.world, kv_heads, loaded.hf_config.num_key_value_heads, num_slots)
    model, kv = runner.model, runner.kv
    while True:
        op, args = group.next_command()
        if op == "stop":
            break
        if op == "forward":
            model(args[0].to(runner.device), kv)
        elif op == "move":
            kv.move(*args)
        elif op == "call":
            path, method, *rest = args
            getattr(model.get_submodule(path), method)(*rest)
        else:
            raise RuntimeError(f"tp rank {group.rank}: unknown command {op!r}")
    group.close()


def tp_device(cfg, rank: int) -> torch.device:
    """The model's device on ``rank``: CUDA device ``rank`` (``LOCAL_RANK`` under torchrun) when the
    model runs on CUDA, the CPU otherwise."""
    import os

    from ..device import resolve_device

    device = resolve_device(str(getattr(cfg.model, "device", "auto")))
    if device.type == "cuda":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
    return device

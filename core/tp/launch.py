"""Starting the ranks of a tensor-parallel engine (``model.tp_size`` > 1).

* **Spawned** (``specfw serve model.tp_size=N``): the engine's process is rank 0; it starts
  ranks 1..N-1 on this machine (``python -m specfw.tp``, the config on their stdin), splits ``engine.num_threads`` (else
  the machine's cores) evenly over the ranks, and forms the group over TCP on 127.0.0.1.
* **torchrun** (multi-node, or one node by hand): ``torchrun --nproc-per-node N [--nnodes ..]
  -m specfw serve model.tp_size=N``; ranks come from ``RANK`` / ``WORLD_SIZE`` (``env://``);
  rank 0 serves, every other rank runs ``follower.run_follower``.

``model.tp_backend``: ``auto`` = nccl on CUDA, gloo on CPUs (spawned ranks on one x86 machine
all-gather through shared memory, ``shm.py``); ``gloo`` / ``nccl`` force one for everything.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import socket
import subprocess
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from ..config import ConfigError
from . import shm
from .group import TPGroup

logger = logging.getLogger(__name__)
RENDEZVOUS_TIMEOUT = timedelta(minutes=10)  # spawned ranks announce themselves before loading the model


def tp_size(cfg) -> int:
    return int(getattr(cfg.model, "tp_size", 1) or 1)


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ


def torchrun_follower(cfg) -> bool:
    """True on a torchrun rank other than 0 of a TP engine: it runs ``serve_as_follower``, not an engine."""
    return tp_size(cfg) > 1 and under_torchrun() and int(os.environ["RANK"]) != 0


def dist_backend(cfg, device: torch.device) -> str:
    name = str(getattr(cfg.model, "tp_backend", "auto"))
    return ("nccl" if device.type == "cuda" else "gloo") if name == "auto" else name


def _check_world(cfg) -> int:
    world = tp_size(cfg)
    if under_torchrun() and int(os.environ["WORLD_SIZE"]) != world:
        raise ConfigError("model.tp_size", f"{world}, but torchrun started {os.environ['WORLD_SIZE']} ranks (WORLD_SIZE); give the same number")
    return world


def start_leader(cfg, device: torch.device) -> TPGroup:
    """Rank 0: join the torchrun group, or spawn the other ranks and form the group."""
    world = _check_world(cfg)
    backend = dist_backend(cfg, device)
    if dist.is_initialized():
        raise RuntimeError("model.tp_size: one tensor-parallel engine per process (close() the other Engine first)")
    if under_torchrun():
        group = TPGroup.join(0, world, "env://", backend)
    else:
        group = _spawn_ranks(cfg, device, world, backend)
    atexit.register(group.stop)  # a no-op once Engine.close() has stopped it
    return group


def _spawn_ranks(cfg, device: torch.device, world: int, backend: str) -> TPGroup:
    """Ranks 1..world-1 as ``python -m specfw.tp`` on this machine (``group.processes``); the group
    formed through a TCPStore on 127.0.0.1, with shared-memory all-gathers where ``shm.supported()``."""
    from omegaconf import OmegaConf

    threads = max(1, (cfg.engine.num_threads or os.cpu_count() or 1) // world)
    torch.set_num_threads(threads)
    port = _free_port()
    store = dist.TCPStore("127.0.0.1", port, world, is_master=True, timeout=RENDEZVOUS_TIMEOUT, wait_for_workers=False)
    plain = OmegaConf.to_container(cfg if OmegaConf.is_config(cfg) else OmegaConf.structured(cfg), resolve=True, enum_to_str=True)
    shm_path = "-"
    if str(getattr(cfg.model, "tp_backend", "auto")) == "auto" and device.type == "cpu" and shm.supported():
        shm_path = shm.path_for(str(port))
        shm.create(shm_path, world)
    procs = []
    for r in range(1, world):  # a fresh interpreter per rank, the config on its stdin
        argv = [sys.executable, "-m", "specfw.tp", str(r), str(world), str(port), backend, str(threads), shm_path]
        p = subprocess.Popen(argv, stdin=subprocess.PIPE, start_new_session=True)
        p.stdin.write(json.dumps(plain).encode())
        p.stdin.close()
        procs.append(p)
    try:
        _await_followers(store, procs)  # every rank has mapped the shared file by now
        group = TPGroup.join(0, world, "", backend, store=store)
        group.shm = shm.ShmCollectives(shm_path, 0, world) if shm_path != "-" else None
        group.processes = procs
    finally:
        if shm_path != "-":
            os.unlink(shm_path)  # the mappings stay; nothing is left in /dev/shm
    how = f"{backend}, all-gathers through shared memory" if group.shm else backend
    logger.info("tensor parallel: %d ranks (%s, %d threads each) on this machine", world, how, threads)
    return group


def serve_as_follower(cfg) -> None:
    """A torchrun rank other than 0."""
    from .follower import run_follower, tp_device

    world = _check_world(cfg)
    rank = int(os.environ["RANK"])
    group = TPGroup.join(rank, world, "env://", dist_backend(cfg, tp_device(cfg, rank)))
    if cfg.engine.num_threads:
        torch.set_num_threads(cfg.engine.num_threads)
    run_follower(cfg, group)


def _await_followers(store, procs: list[subprocess.Popen]) -> None:
    """Wait until every spawned rank has announced itself; a rank that exits first is an error
    now, not a hang at the rendezvous."""
    deadline = time.monotonic() + RENDEZVOUS_TIMEOUT.total_seconds()
    keys = [f"specfw-tp-up-{r}" for r in range(1, len(procs) + 1)]
    while not store.check(keys):
        for r, p in enumerate(procs, 1):
            if p.poll() is not None:
                for q in procs:
                    q.kill()
                raise RuntimeError(f"model.tp_size: tensor-parallel rank {r} exited with code {p.returncode} before joining (its log is above)")
        if time.monotonic() > deadline:
            raise RuntimeError(f"model.tp_size: the tensor-parallel ranks did not join within {RENDEZVOUS_TIMEOUT}")
        time.sleep(0.05)


def follower_main(argv: list[str]) -> None:
    """``python -m specfw.tp RANK WORLD PORT BACKEND THREADS SHM`` with the config as JSON on stdin
    (SHM: the shared file of ``shm.py``, or ``-``)."""
    from omegaconf import OmegaConf

    from .follower import run_follower

    rank, world, port, backend, threads, shm_path = int(argv[0]), int(argv[1]), int(argv[2]), argv[3], int(argv[4]), argv[5]
    cfg = OmegaConf.create(json.loads(sys.stdin.read()))
    logging.basicConfig(level=logging.INFO, format=f"[tp{rank}] %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(threads)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=RENDEZVOUS_TIMEOUT)
    mapped = shm.ShmCollectives(shm_path, rank, world) if shm_path != "-" else None
    store.set(f"specfw-tp-up-{rank}", "1")
    group = TPGroup.join(rank, world, "", backend, store=store)
    group.shm = mapped
    try:
        run_follower(cfg, group)
    except Exception as exc:  # noqa: BLE001 - a leader that went away ends the follower quietly
        logger.info("tp rank %d stops: %s: %s", rank, type(exc).__name__, exc)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

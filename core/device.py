"""Where an engine's tensors live.

The host (CPU) keeps every piece of scheduling metadata: token ids, positions, KV slot tables,
draft trees and their masks, as small CPU tensors and Python lists. The device holds the
weights, the KV pools, activations and logits. ``ForwardBatch.to(device)`` is the one crossing
per forward (ids, positions, output slots, logits rows); attention plans are made from the
host-side slot lists and carry device copies of the index tensors they gather with. Results come
back to the host as Python values (``argmax(...).tolist()``), which is where a step waits for
the device; sampling with a request's seeded ``torch.Generator`` runs on a host copy of the row.

``auto`` picks CUDA when torch sees a GPU, else the CPU.
"""

from __future__ import annotations

import torch

from .config import ConfigError

DEVICE_CHOICES = ("auto", "cpu", "cuda", "cuda:N")


def check_device_name(name: str, key: str = "model.device") -> None:
    """Raise ConfigError naming ``key`` unless ``name`` is one of ``DEVICE_CHOICES``."""
    name = str(name)
    if name in ("auto", "cpu", "cuda"):
        return
    if name.startswith("cuda:") and name[5:].isdigit():
        return
    raise ConfigError(key, f"'{name}' is not one of {list(DEVICE_CHOICES)}")


def resolve_device(name: str, key: str = "model.device") -> torch.device:
    """The torch device for a configured name; a clear error when CUDA is asked for and absent."""
    check_device_name(name, key)
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(key, f"'{name}' asked for, but torch {torch.__version__} sees no CUDA device (use {key}=cpu or auto)")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ConfigError(key, f"'{name}' asked for, but torch sees {torch.cuda.device_count()} CUDA device(s)")
    return dev


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (timing code only; a no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def memory_info(device: torch.device) -> tuple[int, int]:
    """(available, total) bytes of the device's memory: RAM on the CPU (/proc/meminfo's
    MemAvailable, MemTotal), the GPU's free and total memory on CUDA."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return int(free), int(total)
    info = {}
    with open("/proc/meminfo") as f:
        for line in f:
            k, _, v = line.partition(":")
            info[k] = int(v.split()[0]) * 1024
    return info["MemAvailable"], info["MemTotal"]


def kv_budget_from_fraction(device: torch.device, fraction: float) -> int:
    """SGLang's ``--mem-fraction-static`` rule, with the weights already loaded: the KV pool gets
    what is left of ``fraction`` of the device's memory, ``available - total * (1 - fraction)``."""
    from .config import ConfigError

    available, total = memory_info(device)
    budget = available - total * (1 - fraction)
    if budget <= 0:
        raise ConfigError(
            "engine.mem_fraction_static",
            f"{fraction} of {total / 2**30:.1f} GiB leaves no room for the KV pool with "
            f"{available / 2**30:.1f} GiB available after loading the weights; raise it",
        )
    return int(budget)

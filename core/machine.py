"""What machine a measurement ran on, for benchmark headers and logs: the CPU's model name,
family/model numbers, the ISA flags specfw's kernels care about, cores and threads."""

from __future__ import annotations

from pathlib import Path

import torch

_FLAGS_OF_INTEREST = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni", "amx_tile", "amx_bf16", "amx_int8")


def _cpuinfo() -> dict[str, str]:
    info: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if ":" in line:
                key, value = (p.strip() for p in line.split(":", 1))
                info.setdefault(key, value)
    except OSError:
        pass
    return info


def cpu_description() -> str:
    """E.g. ``AMD EPYC (family 25 model 1), avx2 fma, 2 cpus, torch threads 2``."""
    info = _cpuinfo()
    flags = set(info.get("flags", "").split())
    isa = " ".join(f for f in _FLAGS_OF_INTEREST if f in flags) or "no AVX2"
    import os

    name = info.get("model name", "unknown CPU")
    return (
        f"{name} (family {info.get('cpu family', '?')} model {info.get('model', '?')}), {isa}, {os.cpu_count()} cpus, torch threads {torch.get_num_threads()}"
    )

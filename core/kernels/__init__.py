"""specfw's own compiled CPU kernels, built on first use with torch's C++ extension loader.

``bf16_dot()`` returns the AVX512-BF16 linear kernel (``bf16_dot.cpp``) or None where it cannot
run: a CPU without the ``avx512_bf16`` flag, no compiler or ninja, a failed build, or
``SPECFW_NO_KERNELS=1``. The build (~30 s) lands in torch's extension cache
(``TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``) and is reused afterwards.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path

logger = logging.getLogger(__name__)
_SOURCE = Path(__file__).with_name("bf16_dot.cpp")
_cache: dict[str, object] = {}


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return set(line.split(":", 1)[-1].split())


def cpu_has_avx512_bf16() -> bool:
    return "avx512_bf16" in _cpu_flags()


def bf16_dot_preferred() -> bool:
    """Whether bf16 linears should use ``bf16_dot`` rather than oneDNN on this CPU: where it runs
    and the CPU has no AMX (measured faster on the AVX512-BF16 EPYCs; with AMX, oneDNN's tiles
    were already flat from 1 to 16 rows on the Xeons and the kernel is unmeasured there)."""
    return "amx_bf16" not in _cpu_flags() and bf16_dot() is not None


def bf16_dot():
    """The compiled kernel module (``pack``, ``linear``), or None."""
    if "bf16_dot" not in _cache:
        _cache["bf16_dot"] = _build()
    return _cache["bf16_dot"]


def _build():
    if os.environ.get("SPECFW_NO_KERNELS", "").lower() in ("1", "true", "yes", "on"):
        return None
    if not cpu_has_avx512_bf16():
        logger.info("bf16 dot kernel: this CPU has no avx512_bf16; using oneDNN")
        return None
    try:
        from torch.utils.cpp_extension import load
        # the source's hash is in the name: an edited kernel never loads a stale build
        import hashlib
        tag = hashlib.sha1(_SOURCE.read_bytes()).hexdigest()[:10]
        logger.info("bf16 dot kernel: building or loading (first use compiles for ~30 s)")
        return load(name=f"specfw_bf16_dot_{tag}", sources=[str(_SOURCE)],
                    extra_cflags=["-O3", "-fopenmp", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16"],
                    extra_ldflags=["-fopenmp"], verbose=False)   # OpenMP: at::parallel_for's threads
    except Exception as e:   # no compiler, no ninja, a failed build: the oneDNN path still works
        logger.warning("bf16 dot kernel unavailable (%s: %s); using oneDNN", type(e).__name__, str(e).splitlines()[0][:200])
        return None

"""specfw's Triton kernels (the GPU serving path): attention over the slot-based KV pool
(``attention.py``) and the speculative bookkeeping of a step (``tree_ops.py``).

Triton is optional (``pip install specfw[gpu]``): ``available()`` says whether it imports and can
launch here -- on a CUDA device, or anywhere under ``TRITON_INTERPRET=1`` (Triton's interpreter
runs the kernels on CPU tensors: how the tests check them on machines without a GPU). Each kernel
module has the torch reference it replaces beside it."""

from __future__ import annotations

import os


def interpreted() -> bool:
    """Whether Triton runs in its interpreter (``TRITON_INTERPRET=1``, read when a kernel module is imported)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def importable() -> bool:
    try:
        import triton  # noqa: F401
    except Exception:
        return False
    return True


def available(device_type: str) -> bool:
    """Whether specfw's Triton kernels can run for tensors on ``device_type`` ("cuda" / "cpu")."""
    if not importable():
        return False
    return device_type == "cuda" or (device_type == "cpu" and interpreted())


def unavailable_reason(device_type: str) -> str:
    if not importable():
        return "triton is not installed (pip install 'specfw[gpu]')"
    return f"Triton kernels need a CUDA device (this one is {device_type}); on a CPU only under TRITON_INTERPRET=1 (Triton's interpreter: tests)"

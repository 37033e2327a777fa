"""specfw's own compiled CPU kernels, built on first use with torch's C++ extension loader.

``cpu_ops(isa)`` returns ``cpu_ops.cpp`` (batch-invariant linears over fp32/bf16 weights and
one-row-query attention over the KV pool) compiled for one instruction set: ``avx512``
(AVX-512F/BW/VL + FMA), ``avx2`` (AVX2 + FMA) or ``portable`` (no ISA flags). ``cpu_isa()``
picks the best the CPU's flags allow, or the one ``SPECFW_CPU_ISA`` / ``engine.cpu_isa`` forces
(an AVX-512 CPU runs the AVX2 build too, so that path is tested and timed everywhere). None
where it cannot be built (no compiler, ``SPECFW_NO_KERNELS=1``): callers keep torch's ops.

``bf16_dot()`` returns the AVX512-BF16 linear kernel (``bf16_dot.cpp``), ``bf16_amx()`` the AMX
tile one (``bf16_amx.cpp``), each or None where it cannot run: a CPU without the flags, no compiler or ninja, a failed build, or
``SPECFW_NO_KERNELS=1``. The build (~30 s) lands in torch's extension cache
(``TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``) and is reused afterwards.
"""

from __future__ import annotations

import logging
import os
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

logger = logging.getLogger(__name__)
_SOURCE = Path(__file__).with_name("bf16_dot.cpp")
_OPS_SOURCE = Path(__file__).with_name("cpu_ops.cpp")
_QUANT_SOURCE = Path(__file__).with_name("quant_ops.cpp")
_AMX_SOURCE = Path(__file__).with_name("bf16_amx.cpp")
_Q8_SOURCE = Path(__file__).with_name("q8_ops.cpp")
_W8A8_SOURCE = Path(__file__).with_name("w8a8_ops.cpp")
_cache: dict[str, object] = {}


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return set(line.split(":", 1)[-1].split())


def cpu_vendor() -> str:
    """``vendor_id`` of /proc/cpuinfo (``GenuineIntel``, ``AuthenticAMD``), or "" where unknown."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    line = next((ln for ln in text.splitlines() if ln.startswith("vendor_id")), "")
    return line.split(":", 1)[-1].strip()


def default_spread_prefetch() -> bool:
    """Whether a multi-tile linear of ``cpu_ops`` spreads its prefetches over the row tiles on this
    CPU (``engine.cpu_linear_prefetch=auto``): not on Intel, where the first tile alone was faster,
    elsewhere yes (docs/benchmarks.md, session 34)."""
    return cpu_vendor() != "GenuineIntel"


def default_prefetch_rows(isa: str) -> int:
    """From how many rows a multi-row linear of ``cpu_ops`` built for ``isa`` (fp32 weights, or bf16
    in the ``pack`` layout; ``pack_dot``'s tiles always prefetch) requests the next work item: on
    Intel from 2 with AVX-512 (3-4 rows 1.1x faster from DRAM, session 49) and AVX2 (2 rows of bf16
    weights 1.45x faster, of fp32 1.1x, session 51), elsewhere AVX-512 from 5; the portable build
    and AVX2 on other CPUs from 3 (docs/benchmarks.md, sessions 41, 49 and 51)."""
    if isa == "portable":
        return 3
    if cpu_vendor() == "GenuineIntel":
        return 2
    return 5 if isa == "avx512" else 3


ISAS = ("avx512", "avx2", "portable")
_ISA_FLAGS = {"avx512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma"], "avx2": ["-mavx2", "-mfma"], "portable": []}
_ISA_NEEDS = {"avx512": {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx2", "fma", "f16c"}, "avx2": {"avx2", "fma", "f16c"}, "portable": set()}


def isa_supported(isa: str) -> bool:
    """Whether this CPU can run ``isa``'s build (from /proc/cpuinfo's flags)."""
    return _ISA_NEEDS[isa] <= _cpu_flags()


def cpu_isa(forced: str | None = None) -> str:
    """The instruction set the CPU kernels use: ``forced`` (``engine.cpu_isa``), else
    ``SPECFW_CPU_ISA``, else the best this CPU supports. A forced ISA the CPU lacks is an error."""
    choice = forced if forced not in (None, "", "auto") else os.environ.get("SPECFW_CPU_ISA", "auto")
    if choice in ("", "auto"):
        return next(i for i in ISAS if isa_supported(i))
    if choice not in ISAS:
        raise ValueError(f"cpu isa {choice!r}: allowed are auto, {', '.join(ISAS)}")
    if not isa_supported(choice):
        raise ValueError(f"cpu isa {choice!r}: this CPU lacks {sorted(_ISA_NEEDS[choice] - _cpu_flags())}")
    return choice


def cpu_ops(isa: str | None = None):
    """``cpu_ops.cpp`` built for ``isa`` (default ``cpu_isa()``), or None where it cannot be built."""
    isa = isa or cpu_isa()
    key = f"cpu_ops_{isa}"
    if key not in _cache:
        # AVX512-BF16 where the CPU has it: bf16 models' linears on vdpbf16ps (bf16_dot_tiles.h);
        # the build's has_bf16_dot() then says True
        dot = ["-mavx512bf16"] if isa == "avx512" and "avx512_bf16" in _cpu_flags() else []
        # AMX-BF16 where the CPU has it: bf16 attention (head dim 64) on tiles (set_amx_attention;
        # SPECFW_AMX_ATTENTION=0 keeps the vector path: one setting per process, it changes the bits)
        amx = ["-mamx-tile", "-mamx-bf16", "-DSPECFW_AMX_ATTENTION"] if dot and cpu_has_amx_bf16() else []
        label = "cpu kernels " + isa + ("+bf16 dot" if dot else "") + ("+amx attention" if amx else "")
        ops = _load(_OPS_SOURCE, f"specfw_cpu_ops_{isa}", [*_ISA_FLAGS[isa], *dot, *amx], label)
        if ops is not None:  # this CPU's defaults for every user of the build (engine.cpu_linear_prefetch overrides one)
            ops.set_spread_prefetch(default_spread_prefetch())
            ops.set_linear_prefetch_rows(default_prefetch_rows(isa))
            ops.set_amx_attention(os.environ.get("SPECFW_AMX_ATTENTION", "1") != "0")
        _cache[key] = ops
    return _cache[key]


def quant_ops(isa: str | None = None):
    """``quant_ops.cpp`` (weight-only int8/int4/GGUF-block linears) built for ``isa``, or None.
    Built with ``-ffp-contract=off``: its dequantization must round like gguf-py's (no FMA)."""
    isa = isa or cpu_isa()
    key = f"quant_ops_{isa}"
    if key not in _cache:
        _cache[key] = _load(_QUANT_SOURCE, f"specfw_quant_ops_{isa}", [*_ISA_FLAGS[isa], "-ffp-contract=off"], "quantized kernels " + isa)
    return _cache[key]


# q8_ops' builds: AMX-INT8 tiles from 16 rows, AVX-512 (VNNI where present), AVX-512 without VNNI
# (what a CPU without it runs as avx512; forced on one with it so that the path is tested there too),
# AVX2, none
Q8_ISAS = ("amx", "avx512", "avx512bw", "avx2", "portable")


def q8_isa_supported(isa: str) -> bool:
    """Whether this CPU runs ``q8_ops``' ``isa`` build (``amx``: AVX512-VNNI and AMX-INT8;
    ``avx512bw``: the avx512 build without VNNI, on any AVX-512 CPU)."""
    if isa == "amx":
        return isa_supported("avx512") and {"avx512_vnni", "amx_tile", "amx_int8"} <= _cpu_flags()
    if isa == "avx512bw":
        return isa_supported("avx512")
    return isa_supported(isa)


def q8_isa(isa: str | None = None) -> str:
    """``q8_ops``' build for calls of many rows under the CPU kernels' ``isa`` (default
    ``cpu_isa()``): on an avx512 CPU with AMX-INT8 the ``amx`` build (calls from 16 rows on tiles;
    the backend gives it prompts and large trees, the avx512 build the rest), else ``isa``."""
    isa = isa or cpu_isa()
    return "amx" if isa == "avx512" and q8_isa_supported("amx") else isa


def q8_ops(isa: str | None = None):
    """``q8_ops.cpp`` (linears with int8 activations x 4/8-bit weight codes, integer dot products)
    built for ``isa`` (one of ``Q8_ISAS``; default ``cpu_isa()``), or None. ``-ffp-contract=off``:
    its builds must round alike (bit-equal). ``avx512bw`` is the avx512 build without VNNI (on a
    CPU without VNNI it is the avx512 build itself)."""
    isa = isa or cpu_isa()
    if isa == "avx512bw" and "avx512_vnni" not in _cpu_flags():
        return q8_ops("avx512")  # the same code: one build
    key = f"q8_ops_{isa}"
    if key not in _cache:
        base = "avx512" if isa in ("amx", "avx512bw") else isa
        f16c = ["-mf16c"] if isa != "portable" else []  # fp16 scales (vcvtph2ps): every AVX2 CPU has F16C
        # AVX512-VNNI where the CPU has it (vpdpbusd: the same integer sums, one instruction): the
        # avx512 build's isa() then says "avx512_vnni"
        vnni = ["-mavx512vnni"] if isa in ("avx512", "amx") and "avx512_vnni" in _cpu_flags() else []
        amx = ["-mamx-tile", "-mamx-int8", "-DSPECFW_Q8_AMX"] if isa == "amx" else []
        flags = [*_ISA_FLAGS[base], *f16c, *vnni, *amx, "-ffp-contract=off"]
        _cache[key] = _load(_Q8_SOURCE, f"specfw_q8_ops_{isa}", flags, "int8-activation kernels " + isa + ("+vnni" if vnni else ""))
    return _cache[key]


W8A8_ISAS = ("amx", "avx512", "avx2", "portable")  # w8a8_ops' builds: AMX-INT8 tiles, AVX512-VNNI, AVX2, none


def w8a8_isa_supported(isa: str) -> bool:
    """Whether this CPU runs ``w8a8_ops``' ``isa`` build (``avx512`` means AVX512-VNNI here)."""
    flags = _cpu_flags()
    if isa == "amx":
        return isa_supported("avx512") and {"amx_tile", "amx_int8"} <= flags
    if isa == "avx512":
        return isa_supported("avx512") and "avx512_vnni" in flags
    return isa_supported(isa)


def w8a8_isa(isa: str | None = None) -> str:
    """``w8a8_ops``' build for the CPU kernels' ``isa`` (default ``cpu_isa()``): on an avx512 CPU
    its AMX-INT8 tiles where it has them, else AVX512-VNNI, else the AVX2 build."""
    isa = isa or cpu_isa()
    if isa == "avx512":
        return next(i for i in ("amx", "avx512", "avx2") if w8a8_isa_supported(i))
    return isa


def w8a8_ops(isa: str | None = None):
    """``w8a8_ops.cpp`` (int8 activations with one scale per row x int8 weights with one per
    output channel) built for ``isa`` (one of ``W8A8_ISAS``; default ``w8a8_isa()``), or None.
    ``-ffp-contract=off``: its builds must round alike (bit-equal)."""
    isa = isa or w8a8_isa()
    key = f"w8a8_ops_{isa}"
    if key not in _cache:
        flags = {
            "amx": [*_ISA_FLAGS["avx512"], "-mavx512vnni", "-mamx-tile", "-mamx-int8", "-DSPECFW_W8A8_AMX"],
            "avx512": [*_ISA_FLAGS["avx512"], "-mavx512vnni"],
        }.get(isa, _ISA_FLAGS.get(isa, []))
        _cache[key] = _load(_W8A8_SOURCE, f"specfw_w8a8_ops_{isa}", [*flags, "-ffp-contract=off"], "w8a8 kernels " + isa)
    return _cache[key]


def _kernels_disabled() -> bool:
    return os.environ.get("SPECFW_NO_KERNELS", "").lower() in ("1", "true", "yes", "on")


def _load(source: Path, name: str, isa_flags: list[str], what: str):
    if _kernels_disabled():
        return None
    try:
        from torch.utils.cpp_extension import load
        import hashlib

        # loops aligned to 64 bytes: without it the speed of the 7-9-row linear tiles depended
        # on where the build happened to place them (20% apart between two builds of one source)
        cflags = ["-O3", "-fopenmp", "-falign-loops=64", *isa_flags]
        # the hash of the source and flags is in the name: an edited kernel never loads a stale build
        # (and of the headers beside it: bf16_dot_tiles.h is shared by two sources); and of the torch
        # installation it builds against: torch's build file names that venv's include and library
        # paths, so two venvs sharing the cache (a fresh clone's beside the working copy's) would
        # otherwise rewrite each other's build file and recompile on every load
        headers = b"".join(h.read_bytes() for h in sorted(source.parent.glob("*.h")))
        tag = hashlib.sha1(source.read_bytes() + headers + " ".join(cflags).encode() + _torch_dir().encode()).hexdigest()[:10]
        logger.info("%s: building or loading (first use compiles for ~30-60 s)", what)
        with exclusive_build(f"{name}_{tag}") as build_dir:
            return load(
                name=f"{name}_{tag}",
                sources=[str(_source_copy(source, build_dir))],
                extra_cflags=cflags,
                extra_ldflags=["-fopenmp"],
                verbose=False,
            )  # OpenMP: at::parallel_for's threads
    except Exception as e:  # no compiler, no ninja, a failed build: torch's ops still work
        logger.warning("%s unavailable (%s: %s); using torch's ops", what, type(e).__name__, str(e).splitlines()[0][:200])
        return None


def _torch_dir() -> str:
    """The torch installation the kernels build against (its headers and libraries)."""
    import torch

    return str(Path(torch.__file__).resolve().parent)


def _source_copy(source: Path, build_dir: Path | None) -> Path:
    """The copy of ``source`` (and the headers beside it) that a build compiles: inside the build
    directory, whose name already carries the content hash. torch's build file names its sources
    by absolute path, so two checkouts of one source on one torch installation (sharing
    ``~/.cache/torch_extensions``) used to rewrite each other's build file and recompile on every
    load; compiling the build directory's own copy makes them share one build."""
    if build_dir is None:  # no torch helper to name the directory: compile in place
        return source
    src_dir = build_dir / "src"
    src_dir.mkdir(parents=True, exist_ok=True)
    for f in [source, *sorted(source.parent.glob("*.h"))]:
        dest = src_dir / f.name
        data = f.read_bytes()
        if not dest.exists() or dest.read_bytes() != data:
            tmp = dest.with_suffix(dest.suffix + f".{os.getpid()}.tmp")
            tmp.write_bytes(data)
            tmp.replace(dest)  # atomic: a concurrent reader sees the old file or the whole new one
    return src_dir / source.name


@contextmanager
def exclusive_build(name: str):
    """Hold an OS file lock (``flock``: released when the process dies, however it dies) on
    ``<torch's build directory of name>.specfw-lock`` while torch builds or loads extension
    ``name``. torch marks a build in progress with a ``lock`` file in the build directory that
    outlives a killed build, and every later load of that extension then waits on it forever: a
    first ``specfw serve`` stopped with Ctrl-C while its kernels compiled made every later start
    hang. Every specfw load takes this lock first, so a ``lock`` file found while holding it is
    such a leftover, and is removed (torch then builds again). Yields the build directory (None
    where no lock can be taken)."""
    try:
        import fcntl

        from torch.utils.cpp_extension import _get_build_directory

        build_dir = Path(_get_build_directory(name, verbose=False))
        handle = open(f"{build_dir}.specfw-lock", "w")
    except (ImportError, AttributeError, OSError):  # no flock (not POSIX) or torch moved its helper: torch's own baton only
        yield None
        return
    with handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        stale = build_dir / "lock"
        if stale.exists():
            logger.warning("%s: removing the lock file a killed build left in %s", name, build_dir)
            stale.unlink(missing_ok=True)
        yield build_dir  # closing the file releases the lock


def cpu_has_avx512_bf16() -> bool:
    return "avx512_bf16" in _cpu_flags()


def bf16_dot_preferred() -> bool:
    """Whether bf16 linears should use one of specfw's bf16 kernels (``bf16_kernel()``) rather
    than oneDNN or the generic kernels on this CPU: where one runs."""
    return bf16_kernel() is not None


def bf16_kernel():
    """The bf16 linear kernel for this CPU: ``bf16_amx`` where it has AMX-BF16 (flat from 1 to 32
    rows: one TDPBF16PS pass per 16 rows), else ``bf16_dot`` with AVX512-BF16, else None. Both
    take the same packed layout family and are batch invariant by construction."""
    return bf16_amx() or bf16_dot()


def cpu_has_amx_bf16() -> bool:
    return {"amx_tile", "amx_bf16", "avx512_bf16"} <= _cpu_flags()


def bf16_amx():
    """The AMX-tile bf16 linear (``bf16_amx.cpp``: ``pack``, ``linear``; bf16_dot's weight layout),
    or None where it cannot run (no AMX-BF16, no compiler, a failed build, ``SPECFW_NO_KERNELS``)."""
    if "bf16_amx" not in _cache:
        _cache["bf16_amx"] = (
            _load(_AMX_SOURCE, "specfw_bf16_amx", ["-mamx-tile", "-mamx-bf16", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16"], "bf16 AMX kernel")
            if cpu_has_amx_bf16()
            else None
        )
    return _cache["bf16_amx"]


def bf16_dot():
    """The compiled kernel module (``pack``, ``linear``), or None."""
    if "bf16_dot" not in _cache:
        _cache["bf16_dot"] = _build()
    return _cache["bf16_dot"]


def _build():
    if not cpu_has_avx512_bf16():
        logger.info("bf16 dot kernel: this CPU has no avx512_bf16; using oneDNN")
        return None
    return _load(_SOURCE, "specfw_bf16_dot", ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16"], "bf16 dot kernel")


def build_all(every_isa: bool = False, workers: int | None = None) -> dict[str, bool]:
    """Build (or load from the cache) this CPU's kernels: the auto-picked ISA, the portable build
    and, where the CPU has AVX512-BF16, ``bf16_dot`` (``every_isa``: every ISA this CPU runs, as
    the tests force each one). For ``scripts/setup.sh`` and the test session's start, so that the
    first server start or test does not compile. The builds run side by side, ``workers`` at a
    time (default: one per core; a build is one compiler process, ~30 s of one core)."""
    isas = [i for i in ISAS if isa_supported(i)] if every_isa else list(dict.fromkeys([cpu_isa(), "portable"]))
    jobs = {}
    for isa in isas:
        jobs[isa] = lambda isa=isa: cpu_ops(isa)
        jobs[f"quant_{isa}"] = lambda isa=isa: quant_ops(isa)
    for isa in [i for i in Q8_ISAS if q8_isa_supported(i)] if every_isa else list(dict.fromkeys([cpu_isa(), q8_isa(), "portable"])):
        jobs[f"q8_{isa}"] = lambda isa=isa: q8_ops(isa)
    w8a8 = [i for i in W8A8_ISAS if w8a8_isa_supported(i)] if every_isa else list(dict.fromkeys([w8a8_isa(), "portable"]))
    for isa in w8a8:
        jobs[f"w8a8_{isa}"] = lambda isa=isa: w8a8_ops(isa)
    if cpu_has_avx512_bf16():
        jobs["bf16_dot"] = bf16_dot
    if cpu_has_amx_bf16():
        jobs["bf16_amx"] = bf16_amx
    with ThreadPoolExecutor(max_workers=workers or os.cpu_count() or 1) as pool:  # distinct cache keys: no two threads build one module
        done = {name: pool.submit(build) for name, build in jobs.items()}
        return {name: f.result() is not None for name, f in done.items()}

"""Kernel backends: one object per device kind owns the kernels of a forward (``base.py`` is
the contract). ``make_backend`` picks it from the device and the ``engine.*`` settings."""

from __future__ import annotations

import logging

import torch

from .base import AttentionPlan, Backend, HeadShape

logger = logging.getLogger(__name__)


def make_backend(
    device: torch.device | str = "cpu",
    batch_invariant: bool = True,
    cpu_isa: str = "auto",
    cpu_packed_gemm: bool = True,
    cpu_bf16_kernel: bool = True,
    quantization: str = "none",
    draft_quantization: str | None = None,
    activation_quantization: str = "none",
) -> Backend:
    """``CpuBackend`` on a CPU where specfw's kernels build for ``cpu_isa`` (``auto``: the best the
    CPU's flags allow; ``none``: torch's ops), else ``TorchBackend``. Quantized weights
    (``quantization`` / ``draft_quantization`` other than none, with ``activation_quantization``
    int8 on top) need the CPU backend."""
    from .torch_ops import TorchBackend

    device = torch.device(device)
    if device.type == "cpu" and cpu_isa != "none":
        from ..kernels import cpu_isa as pick_isa, cpu_ops

        isa = pick_isa(cpu_isa)
        ops = cpu_ops(isa)
        if ops is not None:
            from .cpu import CpuBackend

            return CpuBackend(ops, isa, batch_invariant, cpu_bf16_kernel, quantization, draft_quantization, activation_quantization)
        logger.warning("specfw's CPU kernels are unavailable here: using torch's ops")
    if quantization != "none" or draft_quantization not in (None, "none", "unquant"):
        raise ValueError("model.quantization: quantized weights run on specfw's CPU kernels only (a CPU device and engine.cpu_isa other than none)")
    return TorchBackend(device, batch_invariant, cpu_packed_gemm, cpu_bf16_kernel)


def default_backend(device: torch.device | str) -> Backend:
    """The best kernels for ``device`` with the engine's defaults, not batch invariant: for a
    runner built without an engine (drafts' own runners get ``Backend.for_drafting()``)."""
    return make_backend(device, False)


def plain_backend(device: torch.device | str) -> Backend:
    """Torch's plain ops, loose attention plans: for a model run without a ModelRunner."""
    from .torch_ops import TorchBackend

    return TorchBackend(device, batch_invariant=False, packed_gemm=False)


AUTO_INT8_DRAFT_BUILDS = ("avx512_vnni", "amx", "avx2")  # q8_ops builds (their isa()) where an auto draft runs on int8 weights and activations


def resolve_draft_quantization(draft: str | None, device: torch.device | str, cpu_isa: str, quantization: str, activations: str) -> str | None:
    """``speculative.draft_model_quantization`` with ``auto`` resolved (other values as given).

    ``auto`` (EAGLE-3's default): ``w8a8_int8`` where the draft runs on specfw's CPU kernels' avx512
    (or amx) build on a CPU with AVX512-VNNI, or on their avx2 build, the int8-activation kernels build
    and the target itself is unquantized; else null (the target's scheme: a quantized target's drafts
    follow it, a GPU's stay as the target; the portable build; an AVX-512 CPU without VNNI). An
    EAGLE-3 step reads its head's 576-wide layer and 8,192-row lm_head once per depth, 5-6 times a
    step: int8 codes halve a bf16 head's bytes and quarter an fp32 one's, and a draft's rounding
    changes what is accepted, never the output (MT-bench 1-24 x 64 on the Zen 4: 1.385x -> 1.445x
    plain in bf16, 1.448x -> 1.672x in fp32, session 56; on an AVX2-only Zen 3, fp32, session 68:
    1.190x -> 1.208x on 24 prompts, 1.303x -> 1.360x on 80, the whole tree's draft 3.2-3.5 ms -> 2.56;
    on the Zen 4's forced avx2 build it was neutral, 1.104x -> 1.099x; docs/benchmarks.md)."""
    if draft != "auto":
        return draft
    if torch.device(device).type != "cpu" or cpu_isa == "none" or quantization != "none" or activations != "none":
        return None
    from ..kernels import cpu_isa as pick_isa, q8_ops

    ops = q8_ops(pick_isa(cpu_isa))  # the build the backend's int8 drafts would run on
    return "w8a8_int8" if ops is not None and ops.isa() in AUTO_INT8_DRAFT_BUILDS else None


def target_quantization(cfg, device: torch.device | str) -> str:
    """``model.quantization`` with ``auto`` (the default) resolved: ``gguf`` where that scheme is the
    model's own arithmetic and runs here -- an fp32 target converted from a GGUF file (the demo),
    on specfw's CPU kernels, without int8 activations or dummy weights -- else ``none``.

    The GGUF file's blocks, dequantized in registers as gguf-py dequantizes them, give the bits of
    the fp32 checkpoint converted from that file (``quant_ops.cpp``; tests/engine/test_quant.py), so
    ``auto`` changes no output, only the bytes a step streams: the demo's Q4_1 layers are 66 MB of
    codes and scales against 425 MB of fp32 weights. On an AVX2-only Zen 3 (session 70) a plain
    forward took 0.55x / 0.61x / 0.84x the fp32 weights' time at 1 / 4 / 8 rows, ~1.0x at 12-16,
    and MT-bench decoding ran 1.68x faster. Other values are returned as given."""
    q = str(getattr(cfg.model, "quantization", "none"))
    if q != "auto":
        return q
    engine = cfg.engine
    dtype = str(getattr(cfg.model.dtype, "value", cfg.model.dtype))
    load_format = str(getattr(cfg.model, "load_format", "auto"))
    if torch.device(device).type != "cpu" or str(getattr(engine, "cpu_isa", "auto")) == "none" or dtype != "float32":
        return "none"
    if str(getattr(cfg.model, "activation_quantization", "none")) != "none" or load_format == "dummy":
        return "none"
    from ..model_loader import gguf_source, resolve_model_path

    if gguf_source(resolve_model_path(cfg.model.path, cfg.model.revision, load_format)) is None:
        return "none"
    from ..kernels import cpu_isa as pick_isa, cpu_ops, quant_ops

    isa = pick_isa(str(getattr(engine, "cpu_isa", "auto")))
    return "gguf" if cpu_ops(isa) is not None and quant_ops(isa) is not None else "none"


def backend_from_config(engine_cfg, device: torch.device, cfg=None) -> Backend:
    """``cfg`` (the whole config) adds ``model.quantization``, ``model.activation_quantization``,
    ``speculative.draft_model_quantization`` and the attention backends (``model.attention_backend``,
    ``speculative.draft_attention_backend``: checked here, where the device is known)."""
    quant, draft, act = "none", None, "none"
    attention, draft_attention = "auto", None
    if cfg is not None:
        from .attention_backends import check_attention_backend

        attention = str(getattr(cfg.model, "attention_backend", "auto"))
        draft_attention = getattr(getattr(cfg, "speculative", None), "draft_attention_backend", None)
        check_attention_backend(attention, device)
        check_attention_backend(draft_attention, device, "speculative.draft_attention_backend")
        quant = target_quantization(cfg, device)
        act = str(getattr(cfg.model, "activation_quantization", "none"))
        try:
            draft = getattr(cfg.speculative, "draft_model_quantization", None)
        except Exception:
            draft = None
    isa = str(getattr(engine_cfg, "cpu_isa", "auto"))
    # a target on its GGUF blocks by auto is the fp32 model: its drafts' defaults are an fp32 target's
    auto_gguf = cfg is not None and str(getattr(cfg.model, "quantization", "none")) == "auto"
    draft = resolve_draft_quantization(None if draft is None else str(draft), device, isa, "none" if auto_gguf else quant, act)
    backend = make_backend(device, engine_cfg.batch_invariant, isa, engine_cfg.cpu_packed_gemm, engine_cfg.cpu_bf16_kernel, quant, draft, act)
    backend.set_attention(attention, None if draft_attention is None else str(draft_attention))
    if hasattr(backend, "set_linear_prefetch"):
        backend.set_linear_prefetch(str(getattr(engine_cfg, "cpu_linear_prefetch", "auto")))
    if hasattr(backend, "greedy_heads"):
        backend.greedy_heads = bool(getattr(engine_cfg, "cpu_greedy_head", True))
        backend.greedy_head_proxy = str(getattr(engine_cfg, "cpu_greedy_head_proxy", "auto"))
    backend.cache_exact_prefills = bool(engine_cfg.batch_invariant) and not getattr(engine_cfg, "disable_radix_cache", False)
    if backend.attention == "flashinfer" and engine_cfg.batch_invariant:
        logger.warning(
            "model.attention_backend=flashinfer is not batch invariant: greedy speculative output can differ from plain at near-ties "
            "(model.attention_backend=triton is exact)"
        )
    return backend


__all__ = [
    "AttentionPlan",
    "Backend",
    "HeadShape",
    "backend_from_config",
    "default_backend",
    "make_backend",
    "plain_backend",
    "resolve_draft_quantization",
    "target_quantization",
]

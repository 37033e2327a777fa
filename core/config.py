"""Structured (dataclass) config schemas for Hydra. Field comments are the config reference.

The ``speculative`` group gets one option per registered algorithm (see ``plugins.py``); its
schema is that algorithm's dataclass, so typos and bad values fail at startup naming the key.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Optional

from omegaconf import MISSING


class ConfigError(ValueError):
    """A config value that passed type checks but is out of range; names the key."""

    def __init__(self, key: str, message: str):
        super().__init__(f"{key}: {message}")
        self.key = key


class DType(str, enum.Enum):
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


@dataclass
class ModelConfig:
    path: Optional[str] = None            # HF directory, hub id or .gguf file; null = demo model (SmolLM2-135M-Instruct)
    revision: Optional[str] = None        # hub revision when path is a hub id
    dtype: DType = DType.float32          # weights, activations and KV cache dtype
    quantization: str = "auto"            # auto (gguf for an fp32 target converted from a .gguf file, e.g. the demo, on the CPU kernels: the same bits as none, ~1.7x faster decoding; else none) | none | int8 (weight-only, per-output-channel scales) | int4 (weight-only, groups of 32, scale+min) | gguf (the .gguf file's own Q8_0/Q4_0/Q4_1 blocks, bit-identical to none); CPU kernels only (docs/quantization.md)
    activation_quantization: str = "none"  # none | int8: with quantized weights, activations rounded to int8 per block of 32 and integer dot products (llama.cpp's arithmetic; ~2-4x faster linears, outputs differ from weight-only) | int8_per_token: with quantization=int8, one int8 scale per row (SGLang's w8a8_int8 form; AMX-INT8 tiles where the CPU has them, flat over 1-16 rows); CPU kernels only
    device: str = "auto"                  # auto | cpu | cuda | cuda:N: where weights, KV cache and activations live (auto: CUDA when torch sees one)
    attention_backend: str = "auto"       # auto | torch | triton | flashinfer (SGLang's --attention-backend): auto = specfw's CPU kernel on a CPU, triton on CUDA (torch without triton installed); triton/flashinfer need CUDA and pip install 'specfw[gpu]' (docs/gpu.md)
    context_length: Optional[int] = None  # max tokens per sequence; null = the model's max_position_embeddings
    served_model_name: Optional[str] = None  # name reported by /v1/models; null = directory name
    load_format: str = "auto"             # auto (safetensors, else *.bin/*.pt; a .gguf path: GGUF) | safetensors | pt | gguf (path = a .gguf file or a directory with one) | dummy (random weights of the config's shapes, no weight file read: benchmarking); SGLang's --load-format
    tp_size: int = 1                      # tensor parallel ranks (SGLang's --tp-size): heads split by whole KV groups, the MLP by blocks of 32, vocabulary-parallel embedding and lm_head; spawned on this machine, or one per torchrun rank (docs/scale-out.md)
    tp_backend: str = "auto"              # collectives of the TP ranks: auto (nccl on CUDA; gloo on CPUs, with all-gathers through shared memory for ranks spawned on one x86 machine) | gloo | nccl
    trust_remote_code: bool = False       # let transformers run the config/tokenizer code a model directory ships (auto_map); refused with an error otherwise. The weights always run on specfw's own model code


@dataclass
class EngineConfig:
    max_running_requests: int = 16        # requests decoded together (continuous batching)
    max_prefill_tokens: int = 8192        # token budget of one prefill batch
    max_total_tokens: Optional[int] = None  # KV pool size in tokens; null = derived from kv_cache_memory_gb
    kv_cache_memory_gb: float = 1.0       # KV pool memory budget when max_total_tokens and mem_fraction_static are null
    mem_fraction_static: Optional[float] = None  # SGLang's --mem-fraction-static: weights + KV pool take this fraction of the device's memory (RAM on CPU); the KV pool gets what the loaded weights leave of it
    max_queued_requests: int = 0          # waiting-queue bound (0 = unbounded); beyond it requests get 503
    num_threads: Optional[int] = None     # torch intra-op threads; null = torch default
    decode_log_interval: int = 40         # log a "Decode batch" line every N decode steps
    cpu_isa: str = "auto"                 # CPU kernels' instruction set: auto (best of the CPU's flags) | avx512 | avx2 | portable | none (torch's ops)
    cpu_packed_gemm: bool = True          # CPU: fp32 MKL-packed + transposed weight copies (~2x weight memory); bf16 oneDNN-blocked weights
    cpu_bf16_kernel: bool = True          # CPU bf16 linears on specfw's own kernel: AMX tiles with AMX-BF16, else vdpbf16ps with AVX512-BF16 (in the avx512 cpu_ops build, so the one-call layers take them; compiled on first use, ~30 s; else the generic kernels' fp32 arithmetic); also the greedy head's bf16 products on vdpbf16ps
    cpu_linear_prefetch: str = "auto"     # CPU fp32/bf16-weight linears over more than one row tile (9+ rows): which tiles prefetch the next weight blocks: auto (from the CPU's vendor: first_tile on Intel, spread elsewhere) | spread (every tile in turn: faster on AMD EPYCs; AVX2 builds spread fp32 weights only) | first_tile (the first tile alone: 17% faster at 16 rows on an Intel Xeon with AMX); never changes a bit
    cpu_greedy_head: bool = True          # CPU fp32 lm_head of greedy rows (no logprobs/penalties): a bf16 copy (+56 MB on the demo) bounds every logit, the possible argmaxes are recomputed in fp32: the same tokens, ~half the head's bytes
    cpu_greedy_head_proxy: str = "auto"   # the greedy head's cheap copy: auto (int8 on the avx512 and avx2 builds, bf16 on the portable one) | bf16 (56 MB on the demo; a bf16 model's head has none) | int8 (8-bit codes per block of 32, int8 activations: 30 MB; q8_ops' linear; a bf16 model's head too, for calls of up to 8 rows: only when set, auto gives bf16 heads none; not where the bf16 head runs on AMX-BF16 tiles); the same tokens either way
    disable_radix_cache: bool = False     # SGLang's --disable-radix-cache: no prefix cache (finished requests' KV is freed, not kept for later requests sharing their first tokens)
    batch_invariant: bool = True          # a token's numerics never depend on batch or draft tree (exact greedy spec == plain, also in bf16)
    cuda_graph_max_bs: Optional[int] = None  # SGLang's --cuda-graph-max-bs: decode/verify forwards of up to this many requests replayed from CUDA graphs (x num_draft_tokens rows when speculative); null = auto (min(max_running_requests, 32)); 0 = off; CUDA with model.attention_backend=triton only (docs/gpu.md)
    disable_cuda_graph: bool = False      # SGLang's --disable-cuda-graph
    torch_compile: bool = False           # SGLang's --enable-torch-compile: decoder layers through torch.compile for forwards of up to torch_compile_max_bs rows (docs/gpu.md: measured slower on CPUs)
    torch_compile_max_bs: int = 32        # SGLang's --torch-compile-max-bs (rows here: requests x rows each verifies)
    overlap_schedule: bool = False        # SGLang's overlap scheduler (SpecV2; also SGLANG_ENABLE_SPEC_V2=True): step N computes on a thread while step N-1 is detokenized and streamed; speculative: topk=1 chains only; off by default (docs/overlap.md)


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"               # bind address
    port: int = 30000                     # bind port (SGLang's default)
    api_key: Optional[str] = None         # require "Authorization: Bearer <key>" when set (null: env SPECFW_API_KEY, if set)
    log_level: str = "info"               # debug | info | warning | error
    max_request_bytes: int = 4194304      # larger request bodies get 413 before parsing (4 MiB)


@dataclass
class SpeculativeConfig:
    """Base of every algorithm's schema; ``none`` is plain decoding."""
    algorithm: str = "none"               # registered algorithm name (equals the option name)
    draft_model_quantization: Optional[str] = None  # null (as model.quantization; gguf: only linears with GGUF blocks, the others int8 with int8 activations) | unquant | none | int8 | int4 | gguf (a draft converted from GGUF, e.g. the standalone self-draft: its blocks) | w8a8_int8 (int8 weights and int8 activations for the draft alone: its linears stream half a bf16 head's bytes through integer dot products; on a CPU every quantized draft runs int8 activations) | auto (EAGLE-3's default: w8a8_int8 on the CPU kernels' avx512 build with AVX512-VNNI or their avx2 build, with an unquantized target, else null)


@dataclass
class TunedConfig:
    """Tuned defaults (``specfw tune`` writes them, ``specfw serve`` reads them; core/tuned.py)."""
    use: bool = True                      # serve: apply the tuned tree keys for this model, machine and algorithm when none of num_steps, topk, num_draft_tokens, adaptive_draft is given
    dir: Optional[str] = None             # where tuned-defaults files live; null = $SPECFW_TUNED_DIR, else <cache>/tuned (~/.cache/specfw/tuned)
    batch_size: int = 1                   # serve: use the entry of the largest tuned batch-size bucket <= this (1 = the latency regime)


@dataclass
class SpecfwConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    speculative: Any = MISSING            # one of the registered algorithms' schemas
    tuned: TunedConfig = field(default_factory=TunedConfig)


@dataclass
class GenerateConfig(SpecfwConfig):
    prompt: str = "Write a haiku about speculative decoding."  # the prompt
    chat: bool = True                     # wrap the prompt in the tokenizer's chat template
    max_new_tokens: int = 128             # tokens to generate
    temperature: float = 0.0              # 0 = greedy
    top_p: float = 1.0                    # nucleus sampling mass
    top_k: int = -1                       # keep the k most likely tokens (-1 = off)
    min_p: float = 0.0                    # drop tokens below min_p x the top probability
    seed: Optional[int] = None            # sampling seed (reproducible output)


LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
LOAD_FORMATS = ("auto", "safetensors", "pt", "gguf", "dummy")  # model.load_format (SGLang's --load-format names)
DRAFT_LOAD_FORMATS = ("auto", "safetensors", "pt", "dummy")  # speculative.draft_load_format: drafts read no GGUF


def check_unknown_keys(node, prefix: str = "") -> None:
    """Hydra's ``+group.key=value`` adds a key even to a schema-typed node; reject any key its
    dataclass does not declare, naming it (``speculative.foo``) and the keys it does declare."""
    import dataclasses

    from omegaconf import DictConfig, OmegaConf
    if not isinstance(node, DictConfig):
        return
    schema = OmegaConf.get_type(node)
    fields = {f.name for f in dataclasses.fields(schema)} if dataclasses.is_dataclass(schema) else None
    for k in node.keys():
        if fields is not None and k not in fields:
            raise ConfigError(f"{prefix}{k}", f"is not a key of this schema ({schema.__name__}); "
                                              f"known keys: {sorted(fields)}")
        if OmegaConf.is_dict(node._get_node(k)):
            check_unknown_keys(node[k], f"{prefix}{k}.")


def validate(cfg) -> None:
    """Range checks Hydra's type checks cannot express; raise ConfigError naming the key."""
    check_unknown_keys(cfg)
    def positive(key, value, allow_none=False):
        if value is None and allow_none:
            return
        if value is None or value < 1:
            raise ConfigError(key, f"must be a positive integer, got {value!r}")
    e = cfg.engine
    positive("engine.max_running_requests", e.max_running_requests)
    positive("engine.max_prefill_tokens", e.max_prefill_tokens)
    positive("engine.max_total_tokens", e.max_total_tokens, allow_none=True)
    positive("engine.num_threads", e.num_threads, allow_none=True)
    positive("engine.decode_log_interval", e.decode_log_interval)
    positive("engine.torch_compile_max_bs", getattr(e, "torch_compile_max_bs", 32))
    cg = getattr(e, "cuda_graph_max_bs", None)
    if cg is not None and cg < 0:
        raise ConfigError("engine.cuda_graph_max_bs", f"must be >= 0 (0 = off) or null (auto), got {cg}")
    positive("model.context_length", cfg.model.context_length, allow_none=True)
    check_cpu_isa(str(getattr(e, "cpu_isa", "auto")))
    proxy = str(getattr(e, "cpu_greedy_head_proxy", "auto"))
    if proxy not in GREEDY_HEAD_PROXIES:
        raise ConfigError("engine.cpu_greedy_head_proxy", f"'{proxy}' is not one of {list(GREEDY_HEAD_PROXIES)}")
    prefetch = str(getattr(e, "cpu_linear_prefetch", "auto"))
    if prefetch not in CPU_LINEAR_PREFETCH:
        raise ConfigError("engine.cpu_linear_prefetch", f"'{prefetch}' is not one of {list(CPU_LINEAR_PREFETCH)}")
    lf = str(getattr(cfg.model, "load_format", "auto"))
    if lf not in LOAD_FORMATS:
        raise ConfigError("model.load_format", f"'{lf}' is not one of {list(LOAD_FORMATS)}")
    check_quantization(cfg)
    positive("model.tp_size", getattr(cfg.model, "tp_size", 1))
    tpb = str(getattr(cfg.model, "tp_backend", "auto"))
    if tpb not in TP_BACKENDS:
        raise ConfigError("model.tp_backend", f"'{tpb}' is not one of {list(TP_BACKENDS)}")
    from .device import check_device_name
    check_device_name(str(cfg.model.device), "model.device")
    from .backends.attention_backends import ATTENTION_BACKENDS

    for key, name in (("model.attention_backend", getattr(cfg.model, "attention_backend", "auto")), ("speculative.draft_attention_backend", getattr(cfg.speculative, "draft_attention_backend", None))):
        if name is not None and str(name) not in ATTENTION_BACKENDS:
            raise ConfigError(key, f"'{name}' is not one of {list(ATTENTION_BACKENDS)}")
    f = getattr(e, "mem_fraction_static", None)
    if f is not None and not 0 < f < 1:
        raise ConfigError("engine.mem_fraction_static", f"must be in (0, 1), got {f}")
    if e.kv_cache_memory_gb <= 0:
        raise ConfigError("engine.kv_cache_memory_gb", f"must be > 0, got {e.kv_cache_memory_gb}")
    if e.max_queued_requests < 0:
        raise ConfigError("engine.max_queued_requests", f"must be >= 0, got {e.max_queued_requests}")
    positive("server.max_request_bytes", cfg.server.max_request_bytes)
    tuned = getattr(cfg, "tuned", None)
    if tuned is not None:
        positive("tuned.batch_size", tuned.batch_size)
    if not 0 < cfg.server.port < 65536:
        raise ConfigError("server.port", f"must be in 1..65535, got {cfg.server.port}")
    if str(cfg.server.log_level).lower() not in LOG_LEVELS:
        raise ConfigError("server.log_level", f"'{cfg.server.log_level}' is not one of {list(LOG_LEVELS)}")
    from .overlap import check_overlap
    check_overlap(cfg)
    spec = speculative_config(cfg)
    if hasattr(spec, "resolve_shape"):
        spec.validate()
        spec.resolve_shape("")   # the shape rules; auto defaults are re-resolved for the real target


TP_BACKENDS = ("auto", "gloo", "nccl")
CPU_ISAS = ("auto", "avx512", "avx2", "portable", "none")
CPU_LINEAR_PREFETCH = ("auto", "spread", "first_tile")
GREEDY_HEAD_PROXIES = ("auto", "bf16", "int8")


def check_cpu_isa(isa: str) -> None:
    """``engine.cpu_isa``: one of ``CPU_ISAS``, and one this CPU can run."""
    if isa not in CPU_ISAS:
        raise ConfigError("engine.cpu_isa", f"'{isa}' is not one of {list(CPU_ISAS)}")
    if isa in ("avx512", "avx2"):
        from .kernels import isa_supported
        if not isa_supported(isa):
            raise ConfigError("engine.cpu_isa", f"this CPU cannot run '{isa}' code (see /proc/cpuinfo flags); "
                                                f"allowed here: {[i for i in CPU_ISAS if i not in ('avx512', 'avx2') or isa_supported(i)]}")


def check_quantization(cfg) -> None:
    """``model.quantization`` and ``speculative.draft_model_quantization``: known schemes."""
    from .backends.quant_linear import ACTIVATION_SCHEMES, DRAFT_SCHEMES, SCHEMES
    q = str(getattr(cfg.model, "quantization", "none"))
    if q not in (*SCHEMES, "auto"):
        raise ConfigError("model.quantization", f"'{q}' is not one of {[*SCHEMES, 'auto']}")
    a = str(getattr(cfg.model, "activation_quantization", "none"))
    if a not in ACTIVATION_SCHEMES:
        raise ConfigError("model.activation_quantization", f"'{a}' is not one of {list(ACTIVATION_SCHEMES)}")
    if a != "none" and q in ("none", "auto"):
        raise ConfigError("model.activation_quantization", f"'{a}' needs quantized weights: set model.quantization to one of {[s for s in SCHEMES if s != 'none']}")
    if a == "int8_per_token" and q != "int8":
        raise ConfigError("model.activation_quantization", f"'{a}' needs weights with one scale per output channel: model.quantization=int8 (not '{q}')")
    try:
        dq = getattr(cfg.speculative, "draft_model_quantization", None)
    except Exception:   # no speculative node yet (MISSING)
        dq = None
    if dq is not None and str(dq) not in (*DRAFT_SCHEMES, "auto"):
        raise ConfigError("speculative.draft_model_quantization", f"'{dq}' is not one of {[None, *DRAFT_SCHEMES, 'auto']}")


def speculative_config(cfg):
    """The ``speculative`` node as its dataclass instance (methods available)."""
    from omegaconf import DictConfig, OmegaConf
    spec = cfg.speculative
    return OmegaConf.to_object(spec) if isinstance(spec, DictConfig) else spec

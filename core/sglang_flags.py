"""``specfw serve --from-sglang "<sglang.launch_server flags>"``: SGLang's launch flags (and its
speculative-decoding environment variables) translated to specfw's Hydra overrides.

Every flag of the parameter tables in SGLang's speculative-decoding documentation, plus the
server flags its examples use, is either mapped to a specfw key, honoured as it stands (a flag
whose effect specfw already has), or reported as not honoured, by name and with the reason. A
flag outside the table is reported too: nothing is dropped silently.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field

# SGLang --speculative-algorithm values → specfw speculative options (NEXTN: the target's own
# NextN/MTP layers, which is specfw's mtp)
ALGORITHMS = {"EAGLE": "eagle", "EAGLE3": "eagle3", "STANDALONE": "standalone", "NGRAM": "ngram", "NEXTN": "mtp", "MTP": "mtp"}

# switch → specfw key set to true
SWITCH_KEYS = {
    "--trust-remote-code": "model.trust_remote_code",
    "--enable-torch-compile": "engine.torch_compile",
    "--disable-cuda-graph": "engine.disable_cuda_graph",
    "--disable-radix-cache": "engine.disable_radix_cache",
}
# flag → specfw key (the value passes through)
KEYS = {
    "--model-path": "model.path",
    "--model": "model.path",
    "--revision": "model.revision",
    "--quantization": "model.quantization",
    "--context-length": "model.context_length",
    "--served-model-name": "model.served_model_name",
    "--device": "model.device",
    "--host": "server.host",
    "--port": "server.port",
    "--api-key": "server.api_key",
    "--log-level": "server.log_level",
    "--max-running-requests": "engine.max_running_requests",
    "--max-prefill-tokens": "engine.max_prefill_tokens",
    "--max-total-tokens": "engine.max_total_tokens",
    "--mem-fraction-static": "engine.mem_fraction_static",
    "--tp-size": "model.tp_size",
    "--tp": "model.tp_size",
    "--speculative-draft-model-path": "speculative.draft_model_path",
    "--speculative-draft": "speculative.draft_model_path",
    "--speculative-draft-model-revision": "speculative.draft_model_revision",
    "--speculative-num-steps": "speculative.num_steps",
    "--speculative-eagle-topk": "speculative.topk",
    "--speculative-num-draft-tokens": "speculative.num_draft_tokens",
    "--speculative-accept-threshold-single": "speculative.accept_threshold_single",
    "--speculative-accept-threshold-acc": "speculative.accept_threshold_acc",
    "--speculative-token-map": "speculative.token_map",
    "--speculative-attention-mode": "speculative.attention_mode",
    "--speculative-draft-model-quantization": "speculative.draft_model_quantization",
    "--load-format": "model.load_format",
    "--cuda-graph-max-bs": "engine.cuda_graph_max_bs",
    "--torch-compile-max-bs": "engine.torch_compile_max_bs",
    "--speculative-draft-load-format": "speculative.draft_load_format",
    "--speculative-ngram-min-match-window-size": "speculative.min_match_window_size",
    "--speculative-ngram-max-match-window-size": "speculative.max_match_window_size",
    "--speculative-ngram-min-bfs-breadth": "speculative.min_bfs_breadth",
    "--speculative-ngram-max-bfs-breadth": "speculative.max_bfs_breadth",
    "--speculative-ngram-match-type": "speculative.match_type",
    "--speculative-ngram-branch-length": "speculative.branch_length",
    "--speculative-ngram-capacity": "speculative.capacity",
}

# flags specfw has no use for, each with why (value-taking unless listed in SWITCHES)
NOT_HONOURED = {
    "--speculative-moe-runner-backend": "specfw runs no MoE models",
    "--speculative-moe-a2a-backend": "specfw runs no MoE models",
    "--dp-size": "one engine per process: run replicas behind sglang-router (issue 22)",
    "--dp": "one engine per process: run replicas behind sglang-router (issue 22)",
    "--enable-dp-attention": "no data-parallel attention in specfw",
    "--chunked-prefill-size": "specfw prefills whole prompts within engine.max_prefill_tokens",
    "--stream-interval": "specfw streams every step's tokens",
    "--cuda-graph-bs": "specfw captures its own row buckets up to engine.cuda_graph_max_bs (docs/gpu.md)",
    "--ep-size": "specfw runs no MoE models",
}
# honoured as they stand: specfw already behaves so
ALREADY = {
    "--skip-server-warmup": "specfw does not warm the server up",
}
PARALLEL = {"--dp-size", "--dp", "--ep-size"}
SWITCHES = {
    "--enable-torch-compile",
    "--enable-multi-layer-eagle",
    "--enable-dp-attention",
    "--disable-cuda-graph",
    "--trust-remote-code",
    "--disable-radix-cache",
    "--disable-overlap-schedule",
    "--skip-server-warmup",
}
# SGLang --attention-backend / --speculative-draft-attention-backend values specfw has
ATTENTION = {"torch_native": "torch", "triton": "triton", "flashinfer": "flashinfer"}
ATTENTION_KEYS = {"--attention-backend": "model.attention_backend", "--speculative-draft-attention-backend": "speculative.draft_attention_backend"}
DTYPES = {
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "half": "float16",
    "fp16": "float16",
    "float32": "float32",
    "float": "float32",
    "fp32": "float32",
}


@dataclass
class Translation:
    overrides: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    environ: dict[str, str] = field(default_factory=dict)  # NAME=value items before the flags
    multi_layer: bool = False  # --enable-multi-layer-eagle was given (resolved once every flag is read)

    def command(self) -> str:
        return "specfw serve " + " ".join(shlex.quote(o) for o in self.overrides)


def translate(flags: str | list[str]) -> Translation:
    """SGLang launch flags (one string, shell-quoted, or argv items) → specfw overrides + warnings."""
    args = shlex.split(flags) if isinstance(flags, str) else list(flags)
    out = Translation()
    while args and "=" in args[0] and not args[0].startswith("-"):  # SGLANG_ENABLE_SPEC_V2=True python3 ...
        name, _, value = args.pop(0).partition("=")
        out.environ[name] = value
    launcher = ("python", "python3", "-m", "sglang.launch_server")
    while args and (args[0] in launcher or args[0].endswith("/python") or args[0].endswith("/python3")):
        args.pop(0)
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--"):
            out.warnings.append(f"{arg!r}: not a flag; ignored")
            i += 1
            continue
        flag, has_eq, value = arg.partition("=")
        flag = flag.replace("_", "-")
        takes_value = flag not in SWITCHES
        if takes_value and not has_eq:
            if i + 1 >= len(args) or args[i + 1].startswith("--"):
                out.warnings.append(f"{flag}: no value given; ignored")
                i += 1
                continue
            value = args[i + 1]
            i += 1
        i += 1
        _one(flag, value, out)
    if out.multi_layer:
        _multi_layer(out)
    return out


def _multi_layer(out: Translation) -> None:
    """``--enable-multi-layer-eagle``: SGLang runs it as EAGLE over the target's own NextN layers
    (no draft model path), which is specfw's mtp with ``speculative.multi_layer``."""
    algo = next((o.split("=", 1)[1] for o in out.overrides if o.startswith("speculative=")), None)
    has_draft = any(o.startswith("speculative.draft_model_path=") for o in out.overrides)
    if algo in ("eagle", "eagle3") and not has_draft:
        out.overrides[out.overrides.index(f"speculative={algo}")] = "speculative=mtp"
        algo = "mtp"
    if algo == "mtp":
        out.overrides.append("speculative.multi_layer=true")
    else:
        out.warnings.append(
            f"--enable-multi-layer-eagle: not honoured: it applies to the target's own NextN layers (speculative=mtp), not speculative={algo or 'none'}"
        )


def _one(flag: str, value: str, out: Translation) -> None:
    if flag == "--speculative-algorithm" or flag == "--speculative-algo":
        name = ALGORITHMS.get(value.upper())
        if name is None:
            out.warnings.append(f"{flag} {value}: unknown algorithm (SGLang's are {', '.join(ALGORITHMS)}); ignored")
        else:
            out.overrides.insert(0, f"speculative={name}")
    elif flag == "--dtype":
        if value == "auto":
            pass  # specfw's default (float32 on CPU) stands
        elif value in DTYPES:
            out.overrides.append(f"model.dtype={DTYPES[value]}")
        else:
            out.warnings.append(f"--dtype {value}: not one of auto, {', '.join(DTYPES)}; ignored")
    elif flag in ATTENTION_KEYS:
        if value in ATTENTION:
            out.overrides.append(f"{ATTENTION_KEYS[flag]}={ATTENTION[value]}")
        else:  # fa3, flashmla, aiter, ...: kernels specfw does not have; its own default stands
            out.warnings.append(f"{flag} {value}: not one of {', '.join(ATTENTION)}; specfw's default (auto) stands")
    elif flag in SWITCH_KEYS:
        out.overrides.append(f"{SWITCH_KEYS[flag]}=true")
    elif flag == "--disable-overlap-schedule":  # specfw's default too (docs/overlap.md); said explicitly
        out.overrides.append("engine.overlap_schedule=false")
    elif flag == "--enable-multi-layer-eagle":
        out.multi_layer = True
    elif flag == "--quantization" and value == "w8a8_int8":  # int8 weights per channel, int8 activations
        out.overrides += ["model.quantization=int8", "model.activation_quantization=int8"]
    elif flag in KEYS:
        out.overrides.append(f"{KEYS[flag]}={_hydra_value(value)}")
    elif flag in PARALLEL and value == "1":
        pass  # one engine, one rank: what specfw does
    elif flag in NOT_HONOURED:
        out.warnings.append(f"{flag}: not honoured: {NOT_HONOURED[flag]}")
    elif flag in ALREADY:
        pass  # already so in specfw
    else:
        out.warnings.append(f"{flag}: not an SGLang flag specfw knows; ignored")


def _hydra_value(value: str) -> str:
    """A value as a Hydra override literal (paths with '=' or ',' quoted)."""
    return value if value and not any(c in value for c in " ,=[]{}()'\"") else "'" + value.replace("'", "\\'") + "'"

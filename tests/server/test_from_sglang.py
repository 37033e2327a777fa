"""``specfw serve --from-sglang``: SGLang's launch flags translated; every launch command of SGLang's
speculative-decoding documentation, with the demo model and demo drafts substituted, starts a
real server that answers a chat completion through the ``openai`` client."""

from __future__ import annotations

import re

import openai
import pytest

from server_helpers import CliProcess, ServerThread, free_port
from specfw.sglang_flags import KEYS, NOT_HONOURED, SWITCHES, translate

pytestmark = pytest.mark.model

# the launch commands of SGLang's speculative-decoding guide (../shared/reference), as written
SGLANG_EXAMPLES = [
    "python3 -m sglang.launch_server --model meta-llama/Llama-2-7b-chat-hf --speculative-algorithm EAGLE "
    "--speculative-draft-model-path lmsys/sglang-EAGLE-llama2-chat-7B --speculative-num-steps 3 --speculative-eagle-topk 4 "
    "--speculative-num-draft-tokens 16 --mem-fraction-static 0.7 --cuda-graph-max-bs 8 --log-level warning",
    "python3 -m sglang.launch_server --model meta-llama/Llama-2-7b-chat-hf --speculative-algorithm EAGLE "
    "--speculative-draft-model-path lmsys/sglang-EAGLE-llama2-chat-7B --speculative-num-steps 3 --speculative-eagle-topk 4 "
    "--speculative-num-draft-tokens 16 --mem-fraction-static 0.7 --enable-torch-compile --torch-compile-max-bs 8 --log-level warning",
    "python3 -m sglang.launch_server --model meta-llama/Meta-Llama-3-8B-Instruct --speculative-algorithm EAGLE "
    "--speculative-draft-model-path lmsys/sglang-EAGLE-LLaMA3-Instruct-8B --speculative-num-steps 3 --speculative-eagle-topk 4 "
    "--speculative-num-draft-tokens 16 --speculative-token-map thunlp/LLaMA3-Instruct-8B-FR-Spec/freq_32768.pt "
    "--mem-fraction-static 0.7 --cuda-graph-max-bs 8 --dtype float16 --log-level warning",
    "python3 -m sglang.launch_server --model meta-llama/Meta-Llama-3.1-8B-Instruct --speculative-algorithm EAGLE3 "
    "--speculative-draft-model-path jamesliu1/sglang-EAGLE3-Llama-3.1-Instruct-8B --speculative-num-steps 3 "
    "--speculative-eagle-topk 4 --speculative-num-draft-tokens 16 --mem-fraction-static 0.7 --cuda-graph-max-bs 8 "
    "--dtype float16 --log-level warning",
    "python3 -m sglang.launch_server --model XiaomiMiMo/MiMo-7B-RL --host 0.0.0.0 --trust-remote-code "
    "--speculative-algorithm EAGLE --speculative-num-steps 1 --speculative-eagle-topk 1 --speculative-num-draft-tokens 2 "
    "--mem-fraction-static 0.7 --cuda-graph-max-bs 8 --log-level warning",
    "python3 -m sglang.launch_server --model Qwen/Qwen2.5-7B-Instruct --speculative-algorithm STANDALONE "
    "--speculative-draft-model-path Qwen/Qwen2.5-1.5B-Instruct --speculative-num-steps 4 --speculative-eagle-topk 2 "
    "--speculative-num-draft-tokens 7 --mem-fraction-static 0.7 --cuda-graph-max-bs 8 --log-level warning",
    "SGLANG_ENABLE_SPEC_V2=True python3 -m sglang.launch_server --model Qwen/Qwen2.5-7B-Instruct --speculative-algorithm "
    "STANDALONE --speculative-draft-model-path Qwen/Qwen2.5-1.5B-Instruct --speculative-num-steps 4 --speculative-eagle-topk 1 "
    "--speculative-num-draft-tokens 5 --mem-fraction-static 0.7 --cuda-graph-max-bs 8 --log-level warning",
    "python3 -m sglang.launch_server --model Qwen/Qwen2.5-7B-Instruct --speculative-algorithm NGRAM "
    "--speculative-num-draft-tokens 16 --speculative-ngram-max-match-window-size 12 --speculative-ngram-max-bfs-breadth 10 "
    "--mem-fraction-static 0.7 --cuda-graph-max-bs 8 --log-level warning",
    "python3 -m sglang.launch_server --model <your-model> --speculative-algorithm EAGLE --speculative-draft-model-path "
    "<your-draft-model> --speculative-num-steps 2 --speculative-eagle-topk 2 --speculative-num-draft-tokens 8 "
    "--cuda-graph-max-bs 2 --mem-fraction-static 0.5 --max-running-requests 4 --dtype float16 --log-level warning",
]


def demo_substituted(command: str) -> str:
    """The demo target (the default model) and the demo drafts (each algorithm's default for it)
    in place of the hub models: their path flags dropped."""
    return re.sub(r"--(model|speculative-draft-model-path|speculative-token-map) \S+", "", command)


# ---- the translation ---------------------------------------------------------------------------
def test_every_mapped_flag_lands_on_its_key():
    for flag, key in KEYS.items():
        t = translate(f"{flag} 7")
        assert t.overrides == [f"{key}=7"] and not t.warnings, flag


def test_algorithms_dtype_and_switches():
    t = translate("--speculative-algorithm EAGLE3 --dtype bfloat16 --speculative-eagle-topk=1 --disable-radix-cache")
    assert t.overrides == ["speculative=eagle3", "model.dtype=bfloat16", "speculative.topk=1", "engine.disable_radix_cache=true"] and not t.warnings
    assert translate("--speculative-algorithm NEXTN").overrides == ["speculative=mtp"]
    assert translate("--dtype auto").overrides == []
    assert translate("--dp 1").warnings == []  # one engine: what specfw does
    t = translate("--tp-size 2")
    assert t.warnings == [] and "model.tp_size=2" in t.overrides
    assert translate("--quantization w8a8_int8").overrides == ["model.quantization=int8", "model.activation_quantization=int8"]
    assert translate("--disable-overlap-schedule").overrides == ["engine.overlap_schedule=false"]
    t = translate("--cuda-graph-max-bs 8 --disable-cuda-graph --enable-torch-compile --torch-compile-max-bs 4")
    assert (
        t.overrides == ["engine.cuda_graph_max_bs=8", "engine.disable_cuda_graph=true", "engine.torch_compile=true", "engine.torch_compile_max_bs=4"]
        and not t.warnings
    )


def test_flags_not_honoured_are_named_and_nothing_is_dropped_silently():
    for flag in NOT_HONOURED:
        t = translate(flag if flag in SWITCHES else f"{flag} 2")
        assert len(t.warnings) == 1 and t.warnings[0].startswith(f"{flag}: not honoured"), flag
    t = translate("--no-such-flag 3 --speculative-algorithm BOGUS --port")
    assert [w.split(":")[0] for w in t.warnings] == ["--no-such-flag", "--speculative-algorithm BOGUS", "--port"]


def test_load_format_trust_remote_code_and_multi_layer_are_honoured():
    t = translate("--load-format dummy --speculative-draft-load-format pt --trust-remote-code")
    assert t.overrides == ["model.load_format=dummy", "speculative.draft_load_format=pt", "model.trust_remote_code=true"] and not t.warnings
    # SGLang runs multi-layer MTP as EAGLE over the target's own NextN layers: specfw's mtp
    t = translate("--speculative-algorithm EAGLE --enable-multi-layer-eagle --speculative-eagle-topk 1")
    assert t.overrides == ["speculative=mtp", "speculative.topk=1", "speculative.multi_layer=true"] and not t.warnings
    assert translate("--speculative-algorithm NEXTN --enable-multi-layer-eagle").overrides == ["speculative=mtp", "speculative.multi_layer=true"]
    t = translate("--speculative-algorithm EAGLE3 --speculative-draft-model-path d --enable-multi-layer-eagle")
    assert t.overrides == ["speculative=eagle3", "speculative.draft_model_path=d"]
    assert t.warnings == ["--enable-multi-layer-eagle: not honoured: it applies to the target's own NextN layers (speculative=mtp), not speculative=eagle3"]


def test_launcher_prefix_and_inline_environment():
    t = translate("SGLANG_ENABLE_SPEC_V2=True python3 -m sglang.launch_server --port 31000")
    assert t.environ == {"SGLANG_ENABLE_SPEC_V2": "True"} and t.overrides == ["server.port=31000"]


def test_values_with_hydra_syntax_are_quoted():
    assert translate("--model-path /m/a=b,c").overrides == ["model.path='/m/a=b,c'"]


# ---- every documented launch command, served --------------------------------------------------
@pytest.mark.parametrize("example", range(len(SGLANG_EXAMPLES)))
def test_documented_launch_command_serves_a_chat_completion(example, monkeypatch):
    from hydra import compose, initialize_config_module

    from specfw.config import validate
    from specfw.config_store import register_configs
    from specfw.engine import Engine
    from specfw.server.app import create_app

    t = translate(demo_substituted(SGLANG_EXAMPLES[example]))
    for k, v in t.environ.items():
        monkeypatch.setenv(k, v)
    register_configs()
    with initialize_config_module("specfw_conf", version_base="1.3"):
        # a small KV pool instead of SGLang's 50-70% of the machine (engine.max_total_tokens wins)
        cfg = compose("serve", overrides=t.overrides + ["engine.num_threads=2", "engine.max_total_tokens=2048"])
    validate(cfg)
    assert cfg.speculative.algorithm in ("eagle", "eagle3", "standalone", "ngram")
    engine = Engine(cfg)
    assert (engine.overlap is not None) == ("SGLANG_ENABLE_SPEC_V2" in t.environ)  # SpecV2: the overlap scheduler, a chain
    assert engine.overlap is None or engine.tree_shape.topk == 1
    with ServerThread(create_app(engine)) as server:
        c = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        r = c.chat.completions.create(model="default", messages=[{"role": "user", "content": "Count to five."}], max_tokens=6, temperature=0)
        assert r.usage.completion_tokens > 0 and r.choices[0].message.content


def test_mem_fraction_static_is_sglangs_rule():
    import torch

    from specfw.config import ConfigError
    from specfw.device import kv_budget_from_fraction, memory_info

    available, total = memory_info(torch.device("cpu"))
    want = 256 * 2**20
    budget = kv_budget_from_fraction(torch.device("cpu"), 1 - (available - want) / total)
    assert abs(budget - want) < 128 * 2**20  # other processes move MemAvailable a little
    with pytest.raises(ConfigError, match="engine.mem_fraction_static"):
        kv_budget_from_fraction(torch.device("cpu"), 1 - (available + 2**30) / total)


def test_cli_from_sglang_prints_the_equivalent_command_and_serves(tmp_path):
    port = free_port()
    flags = f"python3 -m sglang.launch_server --speculative-algorithm NGRAM --port {port} --speculative-num-draft-tokens 8 --cuda-graph-max-bs 8"
    with CliProcess(["serve", "--from-sglang", flags, "engine.max_total_tokens=2048"], tmp_path / "serve.log") as p:
        url = f"http://127.0.0.1:{port}"
        assert p.healthy(url), p.output()[-3000:]
        c = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        r = c.chat.completions.create(model="default", messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0)
        assert r.usage.completion_tokens > 0
    out = p.output()
    want = (
        f"equivalent: specfw serve speculative=ngram server.port={port} speculative.num_draft_tokens=8 engine.cuda_graph_max_bs=8 engine.max_total_tokens=2048"
    )
    assert want in out, out[-3000:]
    assert "not honoured" not in out  # CUDA graphs are a setting now (docs/gpu.md); on a CPU there are none to capture

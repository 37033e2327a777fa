"""`specfw train`: resumable checkpoints, loss plot, and a standalone draft that loads and keeps
greedy output identical."""

import json
import subprocess
import sys
from pathlib import Path

BIN = Path(sys.executable).parent


def _train(tiny_model_dir, tmp_path, steps, extra=()):
    (tmp_path / "p.jsonl").write_text("\n".join(json.dumps({"prompt": p}) for p in ["Hi there.", "Name a fruit."]))
    args = [
        str(BIN / "specfw"),
        "train",
        f"model.path={tiny_model_dir}",
        "draft=standalone",
        "draft.num_layers=1",
        "draft.hidden_size=32",
        "draft.intermediate_size=64",
        "draft.num_attention_heads=2",
        f"steps={steps}",
        "batch_size=2",
        "save_every=2",
        "data.source=jsonl",
        f"data.jsonl={tmp_path / 'p.jsonl'}",
        "data.num_prompts=2",
        "data.max_new_tokens=8",
        "data.max_len=48",
        "data.regen_dtype=float32",
        f"data.cache_dir={tmp_path}",
        f"output_dir={tmp_path / 'out'}",
        "target_dtype=float32",
        *extra,
    ]
    r = subprocess.run(args, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads((tmp_path / "out" / "history.json").read_text())


def test_resume_plot_and_export(tiny_model_dir, tmp_path):
    first = _train(tiny_model_dir, tmp_path, 2)
    assert [h["step"] for h in first] == [1, 2]
    again = _train(tiny_model_dir, tmp_path, 4)  # resumes at step 2 from checkpoints/last.pt
    assert [h["step"] for h in again] == [1, 2, 3, 4] and again[:2] == first
    out = tmp_path / "out"
    assert (out / "loss.png").stat().st_size > 0 and (out / "checkpoints" / "last.pt").exists()

    from conftest import make_cfg
    from specfw.engine import Engine
    from specfw.sampling import SamplingParams
    from specfw_plugins.standalone.config import StandaloneConfig

    params = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)
    plain = Engine(make_cfg(model_path=str(tiny_model_dir), max_total_tokens=1024)).generate([[5, 6, 7]], params)[0]
    spec = Engine(
        make_cfg(
            model_path=str(tiny_model_dir), max_total_tokens=1024, speculative=StandaloneConfig(algorithm="standalone", draft_model_path=str(out / "draft"))
        )
    )
    assert spec.generate([[5, 6, 7]], params)[0].token_ids == plain.token_ids


def test_bf16_autocast_defaults_to_where_bf16_matmuls_are_native(monkeypatch):
    """autocast_bf16=null: on for CUDA and for CPUs with AVX512-BF16, off on other CPUs (oneDNN
    emulates bf16 there); an explicit true/false wins everywhere."""
    import torch
    from omegaconf import OmegaConf
    import specfw.kernels as kernels
    from specfw.train.loop import autocast_bf16

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    for native in (True, False):
        monkeypatch.setattr(kernels, "cpu_has_avx512_bf16", lambda native=native: native)
        auto = OmegaConf.create({"autocast_bf16": None})
        assert autocast_bf16(auto, cpu) is native and autocast_bf16(auto, cuda) is True
        for explicit in (True, False):
            cfg = OmegaConf.create({"autocast_bf16": explicit})
            assert autocast_bf16(cfg, cpu) is explicit and autocast_bf16(cfg, cuda) is explicit


def test_bad_train_config_names_key(tmp_path):
    r = subprocess.run([str(BIN / "specfw"), "train", "draft=eagle3", "draft.ttt_steps=0"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "draft.ttt_steps" in r.stderr
    r = subprocess.run([str(BIN / "specfw"), "train", "draft=eagle4"], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "eagle3" in r.stderr
    r = subprocess.run([str(BIN / "specfw"), "train", "device=tpu"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "device" in r.stderr and "cuda" in r.stderr


def test_cuda_device_without_cuda_is_a_config_error():
    import pytest
    import torch
    from specfw.config import ConfigError
    from specfw.train.run import resolve_device

    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="device"):
            resolve_device("cuda")


def test_gpu_regeneration_path_matches_engine_greedy(tiny_model_dir):
    """HFGenerator (the regeneration backend on a GPU) left-pads a batch; its greedy responses
    must equal specfw's engine's, stop at eos included (checked here on CPU, float32)."""
    import torch
    from conftest import make_cfg
    from specfw.engine import Engine
    from specfw.sampling import SamplingParams
    from specfw.train.hf_regen import HFGenerator

    gen = HFGenerator(tiny_model_dir, torch.float32, torch.device("cpu"))
    prompts = [gen.tokenize_chat([{"role": "user", "content": c}]) for c in ["Hi.", "Name three fruits, please.", "Why?"]]
    params = SamplingParams(max_new_tokens=16, temperature=0)
    ref = Engine(make_cfg(model_path=str(tiny_model_dir), max_total_tokens=1024)).generate(prompts, params)
    assert [g.token_ids for g in gen.generate(prompts, params)] == [o.token_ids for o in ref]


def test_conversation_prompts_first_and_all_turns():
    from specfw.train import data

    conv = [
        {"role": "user", "content": "Q1"},
        {"role": "assistant", "content": "A1"},
        {"role": "user", "content": "Q2"},
        {"role": "assistant", "content": "A2"},
        {"role": "user", "content": "  "},
        {"role": "assistant", "content": "A3"},
        {"role": "user", "content": "Q4"},
    ]
    first = data.conversation_prompts(conv, "first")
    assert first == [{"messages": conv[:1], "response": "A1"}]
    every = data.conversation_prompts(conv, "all")
    assert [p["messages"] for p in every] == [conv[:1], conv[:3], conv[:7]]  # the blank turn is skipped
    assert [p["response"] for p in every] == ["A1", "A2", None]
    assert data.prompt_key(conv[:1]) == "Q1" and json.loads(data.prompt_key(conv[:3])) == conv[:3]


def test_long_context_keeps_the_latest_characters(monkeypatch):
    from specfw.train import data

    monkeypatch.setattr(data, "CONTEXT_CHARS", 10)
    conv = [{"role": "user", "content": "u" * 8}, {"role": "assistant", "content": "abcdefgh"}, {"role": "user", "content": "next"}]
    msgs = data.conversation_prompts(conv, "all")[1]["messages"]
    # the assistant turn (8 chars) fits whole; the oldest user turn is cut to its last 2 characters
    assert msgs == [{"role": "user", "content": "uu"}, conv[1], conv[2]]


def test_jsonl_messages_formats_and_errors(tmp_path):
    import pytest
    from specfw.datasets import jsonl_messages

    sep = "line\u2028separator"  # a Unicode line separator inside the text is not a record break
    lines = [json.dumps("plain"), json.dumps({"prompt": "p"}), json.dumps({"messages": [{"role": "user", "content": sep}]}, ensure_ascii=False)]
    (tmp_path / "m.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    assert jsonl_messages(tmp_path / "m.jsonl") == [
        [{"role": "user", "content": "plain"}],
        [{"role": "user", "content": "p"}],
        [{"role": "user", "content": sep}],
    ]
    (tmp_path / "bad.jsonl").write_text(json.dumps({"messages": [{"role": "assistant", "content": "x"}]}))
    with pytest.raises(ValueError, match="must end with a user turn"):
        jsonl_messages(tmp_path / "bad.jsonl")


def test_regenerate_resumes_past_a_cut_off_line(tmp_path):
    from specfw.train.data import regenerate

    class Echo:  # a stand-in engine: response = reversed prompt ids
        calls = 0

        def tokenize_chat(self, messages):
            return [len(m["content"]) for m in messages]

        def generate(self, prompts, params):
            Echo.calls += len(prompts)
            return [type("G", (), {"token_ids": p[::-1]}) for p in prompts]

    items = [{"messages": [{"role": "user", "content": "a" * n}], "prompt": "a" * n} for n in (1, 2, 3)]
    cache = tmp_path / "r.jsonl"
    regenerate(Echo(), items[:2], cache, 4, 8)
    cache.write_text(cache.read_text() + '{"prompt": "aaa", "prompt_i')  # a run killed mid-write
    recs = regenerate(Echo(), items, cache, 4, 8)
    assert Echo.calls == 3 and [r["prompt_ids"] for r in recs] == [[1], [2], [3]]


def test_init_draft_starts_from_a_published_draft(tiny_model_dir, tmp_path):
    """init_draft loads an exported draft (weights and, for EAGLE-3, its d2t vocabulary); a draft that
    does not fit is a config error naming the key."""
    import pytest
    import torch
    from types import SimpleNamespace
    from safetensors.torch import load_file
    from specfw.config import ConfigError
    from specfw.train.data import Example
    from specfw_plugins.eagle3.trainer import Eagle3Trainer
    from specfw.train.target import TargetTeacher

    teacher = TargetTeacher(tiny_model_dir, torch.float32, torch.device("cpu"))
    cfg = SimpleNamespace(draft=SimpleNamespace(aux_layers=None, draft_vocab_size=16, ttt_steps=2, ttt_decay=0.8), data=SimpleNamespace(max_len=32))
    torch.manual_seed(0)
    a = Eagle3Trainer(cfg, teacher, [Example(list(range(40, 60)), [1] * 20)])
    a.export(tmp_path / "a", torch.float32)
    torch.manual_seed(1)
    b = Eagle3Trainer(cfg, teacher, [Example(list(range(3, 30)), [1] * 27)])  # another vocabulary, other weights
    assert not torch.equal(a.draft_ids, b.draft_ids)
    b.init_from(load_file(str(tmp_path / "a" / "model.safetensors")))
    assert torch.equal(a.draft_ids, b.draft_ids)
    assert all(torch.equal(v, b.state_dict()[k]) for k, v in a.state_dict().items())
    cfg.draft.draft_vocab_size = 8
    c = Eagle3Trainer(cfg, teacher, [Example(list(range(40, 60)), [1] * 20)])
    with pytest.raises(ConfigError, match="draft.draft_vocab_size=16"):
        c.init_from(load_file(str(tmp_path / "a" / "model.safetensors")))


def test_init_draft_on_the_command_line(tiny_model_dir, tmp_path):
    (tmp_path / "a").mkdir()
    first = _train(tiny_model_dir, tmp_path / "a", 2)
    assert len(first) == 2
    out = tmp_path / "b"
    out.mkdir()
    # lr so small that one step leaves the bf16 export unchanged: the run must have started from draft a
    _train(tiny_model_dir, out, 1, [f"init_draft={tmp_path / 'a' / 'out' / 'draft'}", "lr=1e-12", "warmup_steps=1"])
    from safetensors.torch import load_file

    a = load_file(str(tmp_path / "a" / "out" / "draft" / "model.safetensors"))
    b = load_file(str(out / "out" / "draft" / "model.safetensors"))
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)
    r = subprocess.run([str(BIN / "specfw"), "train", f"init_draft={tmp_path / 'nowhere'}"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "init_draft" in r.stderr


def test_sharegpt_all_turns_from_the_package():
    """data.turns=all on the real salvaged ShareGPT: every later user turn becomes a prompt that ends
    with that turn, carries at most CONTEXT_CHARS of earlier text, and first turns keep their keys."""
    from specfw.train.data import CONTEXT_CHARS, load_prompts

    first = load_prompts("sharegpt", None, 10**9, 0, "first")
    every = load_prompts("sharegpt", None, 10**9, 0, "all")
    assert len(first) > 10_000 and len(every) > 3 * len(first)
    assert {it["prompt"] for it in first} <= {it["prompt"] for it in every}
    for it in every[:2000]:
        msgs = it["messages"]
        assert msgs[-1]["role"] == "user" and msgs[-1]["content"].strip()
        assert sum(len(m["content"]) for m in msgs[:-1]) <= CONTEXT_CHARS

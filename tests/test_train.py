"""`specfw train`: resumable checkpoints, loss plot, and a standalone draft that loads and keeps
greedy output identical."""
import json
import subprocess
import sys
from pathlib import Path

BIN = Path(sys.executable).parent


def _train(tiny_model_dir, tmp_path, steps, extra=()):
    (tmp_path / "p.jsonl").write_text("\n".join(json.dumps({"prompt": p}) for p in ["Hi there.", "Name a fruit."]))
    args = [str(BIN / "specfw"), "train", f"model.path={tiny_model_dir}", "draft=standalone", "draft.num_layers=1",
            "draft.hidden_size=32", "draft.intermediate_size=64", "draft.num_attention_heads=2",
            f"steps={steps}", "batch_size=2", "save_every=2", "data.source=jsonl", f"data.jsonl={tmp_path / 'p.jsonl'}",
            "data.num_prompts=2", "data.max_new_tokens=8", "data.max_len=48", "data.regen_dtype=float32",
            f"data.cache_dir={tmp_path}", f"output_dir={tmp_path / 'out'}", "target_dtype=float32", *extra]
    r = subprocess.run(args, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads((tmp_path / "out" / "history.json").read_text())


def test_resume_plot_and_export(tiny_model_dir, tmp_path):
    first = _train(tiny_model_dir, tmp_path, 2)
    assert [h["step"] for h in first] == [1, 2]
    again = _train(tiny_model_dir, tmp_path, 4)          # resumes at step 2 from checkpoints/last.pt
    assert [h["step"] for h in again] == [1, 2, 3, 4] and again[:2] == first
    out = tmp_path / "out"
    assert (out / "loss.png").stat().st_size > 0 and (out / "checkpoints" / "last.pt").exists()

    from conftest import make_cfg
    from specfw.engine import Engine
    from specfw.sampling import SamplingParams
    from specfw_plugins.standalone.config import StandaloneConfig
    params = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)
    plain = Engine(make_cfg(model_path=str(tiny_model_dir), max_total_tokens=1024)).generate([[5, 6, 7]], params)[0]
    spec = Engine(make_cfg(model_path=str(tiny_model_dir), max_total_tokens=1024,
                           speculative=StandaloneConfig(algorithm="standalone", draft_model_path=str(out / "draft"))))
    assert spec.generate([[5, 6, 7]], params)[0].token_ids == plain.token_ids


def test_bad_train_config_names_key(tmp_path):
    r = subprocess.run([str(BIN / "specfw"), "train", "draft=eagle3", "draft.ttt_steps=0"],
                       capture_output=True, text=True, timeout=120)
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

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.model
SPECFW = str(Path(sys.executable).with_name("specfw"))


def test_demo_tokenizer_is_repaired(demo_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(demo_dir)
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 2
    assert "token_type_ids" not in tok("hello")
    for s in ["Hello, wörld! 🙂", "def f(x):\n\treturn x ** 2  # comment", "  leading and trailing  ", "数学 and ñ"]:
        assert tok.decode(tok(s)["input_ids"]) == s
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat.endswith("<|im_start|>assistant\n")
    assert json.loads((demo_dir / "config.json").read_text())["num_hidden_layers"] == 30


def test_cli_generate_prints_text_and_stats(demo_dir):
    r = subprocess.run([SPECFW, "generate", "prompt=What is the capital of France?", "max_new_tokens=16"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout
    assert "generated tokens:" in r.stderr and "tokens/s" in r.stderr


def test_cli_rejects_bad_config_naming_key():
    r = subprocess.run([SPECFW, "generate", "engine.max_runing_requests=2"], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "max_runing_requests" in r.stderr
    r = subprocess.run([SPECFW, "generate", "engine.max_running_requests=0"], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "engine.max_running_requests" in r.stderr


def test_cli_usage_and_unknown_command():
    r = subprocess.run([SPECFW, "--help"], capture_output=True, text=True)
    assert r.returncode == 0 and "generate" in r.stdout and "serve" in r.stdout
    r = subprocess.run([SPECFW, "frobnicate"], capture_output=True, text=True)
    assert r.returncode == 2 and "unknown command" in r.stderr

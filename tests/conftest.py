import os
import shutil

import pytest

import specfw  # noqa: F401  (sets MKL_CBWR before anything starts MKL)
import torch

torch.set_num_threads(int(os.environ.get("SPECFW_TEST_THREADS", "2")))


def make_cfg(**engine_kw):
    from specfw.config import EngineConfig, ModelConfig, SpecfwConfig, SpeculativeConfig
    model_kw = {k[6:]: engine_kw.pop(k) for k in list(engine_kw) if k.startswith("model_")}
    spec = engine_kw.pop("speculative", None) or SpeculativeConfig()
    return SpecfwConfig(model=ModelConfig(**model_kw), engine=EngineConfig(**engine_kw), speculative=spec)


@pytest.fixture(scope="session")
def demo_dir():
    from specfw.demo_model import demo_model_dir
    return demo_model_dir()


@pytest.fixture(scope="session")
def demo_engine():
    from specfw.engine import Engine
    return Engine(make_cfg(max_running_requests=8, max_total_tokens=8192))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, demo_dir):
    """A 2-layer random Llama with the demo tokenizer (fast unit tests)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    out = tmp_path_factory.mktemp("tiny-llama")
    cfg = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      tie_word_embeddings=True, eos_token_id=2, bos_token_id=1)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():  # sharper distributions so greedy paths are stable and varied
        model.model.embed_tokens.weight.mul_(40)
    model.save_pretrained(out)
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (demo_dir / f).exists():
            shutil.copy(demo_dir / f, out / f)
    return out


@pytest.fixture
def tiny_engine(tiny_model_dir):
    from specfw.engine import Engine
    return Engine(make_cfg(model_path=str(tiny_model_dir), max_running_requests=8, max_total_tokens=4096))

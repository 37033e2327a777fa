"""EAGLE / EAGLE-3 loaders on synthetic checkpoints written in the published layouts."""

import json

import pytest
import torch
from safetensors.torch import save_file
from transformers import LlamaConfig

from specfw.config import ConfigError
from specfw.sdk import load_token_map
from specfw_plugins.eagle.model import load_eagle
from specfw_plugins.eagle3.model import aux_layer_ids, load_eagle3

H, I, NH, NKV, V, DV = 64, 128, 4, 2, 1000, 100


def target_cfg(hidden=H, vocab=V):
    return LlamaConfig(hidden_size=hidden, intermediate_size=I, num_attention_heads=NH, num_key_value_heads=NKV, vocab_size=vocab, num_hidden_layers=8)


def _layer(prefix, in_dim, with_input_norm=True):
    hd = H // NH
    t = {
        f"{prefix}self_attn.q_proj.weight": torch.randn(NH * hd, in_dim),
        f"{prefix}self_attn.k_proj.weight": torch.randn(NKV * hd, in_dim),
        f"{prefix}self_attn.v_proj.weight": torch.randn(NKV * hd, in_dim),
        f"{prefix}self_attn.o_proj.weight": torch.randn(H, NH * hd),
        f"{prefix}mlp.gate_proj.weight": torch.randn(I, H),
        f"{prefix}mlp.up_proj.weight": torch.randn(I, H),
        f"{prefix}mlp.down_proj.weight": torch.randn(H, I),
        f"{prefix}post_attention_layernorm.weight": torch.rand(H),
    }
    if with_input_norm:
        t[f"{prefix}input_layernorm.weight"] = torch.rand(H)
    return t


def write(path, tensors, config):
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(config))
    return path


def eagle3_ckpt(tmp_path, hidden=H, vocab=V, with_d2t=True, name="e3"):
    t = {
        "fc.weight": torch.randn(H, 3 * H),
        "norm.weight": torch.rand(H),
        "lm_head.weight": torch.randn(DV, H),
        "midlayer.hidden_norm.weight": torch.rand(H),
        **_layer("midlayer.", 2 * H),
    }
    if with_d2t:
        ids = torch.sort(torch.randperm(V)[:DV]).values
        t["d2t"] = ids - torch.arange(DV)
        t2d = torch.zeros(V, dtype=torch.bool)
        t2d[ids] = True
        t["t2d"] = t2d
    cfg = dict(
        architectures=["LlamaForCausalLMEagle3"],
        model_type="llama",
        hidden_size=hidden,
        intermediate_size=I,
        num_attention_heads=NH,
        num_key_value_heads=NKV,
        num_hidden_layers=1,
        vocab_size=vocab,
        draft_vocab_size=DV,
        target_hidden_size=hidden,
        rms_norm_eps=1e-5,
        eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 3, 5]},
    )
    return write(tmp_path / name, t, cfg), t


def test_eagle3_layout_loads(tmp_path):
    path, t = eagle3_ckpt(tmp_path)
    head = load_eagle3(path, target_cfg(), torch.float32)
    assert head.draft_vocab == DV
    assert torch.equal(head.midlayer.self_attn.q_proj.weight, t["midlayer.self_attn.q_proj.weight"])
    assert torch.equal(head.midlayer.hidden_norm.weight, t["midlayer.hidden_norm.weight"])
    ids = head.to_target_ids()
    assert torch.equal(ids, torch.nonzero(t["t2d"]).flatten())  # target id = i + d2t[i]
    assert aux_layer_ids(head.config, 8, None) == (2, 4, 6)  # published ids + 1 = layer inputs
    assert aux_layer_ids(head.config, 8, [1, 2, 3]) == (1, 2, 3)


def test_eagle3_default_taps():
    assert aux_layer_ids(LlamaConfig(), 30, None) == (2, 15, 27)


@pytest.mark.parametrize("kw,match", [(dict(hidden=32), "hidden size"), (dict(vocab=2000), "vocab_size"), (dict(with_d2t=False), "lacks d2t")])
def test_eagle3_misfit_is_a_clear_error(tmp_path, kw, match):
    path, _ = eagle3_ckpt(tmp_path, **kw)
    with pytest.raises(ConfigError, match=match) as e:
        load_eagle3(path, target_cfg(), torch.float32)
    assert e.value.key == "speculative.draft_model_path"


@pytest.mark.parametrize("prefix", ["", "model."])
def test_eagle_layout_loads_with_or_without_model_prefix(tmp_path, prefix):
    t = {
        f"{prefix}fc.weight": torch.randn(H, 2 * H),
        f"{prefix}fc.bias": torch.randn(H),
        **_layer(f"{prefix}layers.0.", H, with_input_norm=False),
        f"{prefix}embed_tokens.weight": torch.randn(V, H),
    }
    cfg = dict(
        architectures=["LlamaForCausalLMEagle"],
        model_type="llama",
        hidden_size=H,
        intermediate_size=I,
        num_attention_heads=NH,
        num_key_value_heads=NKV,
        num_hidden_layers=1,
        vocab_size=V,
        rms_norm_eps=1e-5,
    )
    head = load_eagle(write(tmp_path / f"e{prefix}", t, cfg), target_cfg(), torch.float32)
    assert torch.equal(head.fc.bias, t[f"{prefix}fc.bias"])
    assert torch.equal(head.layers[0].mlp.down_proj.weight, t[f"{prefix}layers.0.mlp.down_proj.weight"])


def test_eagle_misfit_and_wrong_layout(tmp_path):
    cfg = dict(hidden_size=H, intermediate_size=I, num_attention_heads=NH, num_key_value_heads=NKV, vocab_size=V)
    t = {"fc.weight": torch.randn(H, 2 * H), **_layer("layers.0.", H, False)}
    with pytest.raises(ConfigError, match="hidden_size"):
        load_eagle(write(tmp_path / "a", t, cfg), target_cfg(hidden=128), torch.float32)
    with pytest.raises(ConfigError, match="not an EAGLE checkpoint"):
        load_eagle(write(tmp_path / "b", {"x": torch.zeros(1)}, cfg), target_cfg(), torch.float32)


def test_token_map(tmp_path):
    torch.save(torch.tensor([5, 3, 3, 999]), tmp_path / "map.pt")
    assert load_token_map(str(tmp_path / "map.pt"), V).tolist() == [3, 5, 999]
    torch.save(torch.tensor([5, 1000]), tmp_path / "bad.pt")
    with pytest.raises(ConfigError, match="speculative.token_map"):
        load_token_map(str(tmp_path / "bad.pt"), V)

"""``speculative.multi_layer`` (SGLang's --enable-multi-layer-eagle): a checkpoint with two NextN
layers drafts a chain in which layer i proposes step i; greedy output stays plain greedy."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import make_cfg
from specfw.config import ConfigError
from specfw.sampling import SamplingParams
from specfw_plugins.mtp.config import MtpConfig

GREEDY = SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True)
N = 2  # the tiny target's layers: NextN layer i lives at model.layers.{N + i}


def _two_layers(src, out, zero_norm: int | None = None):
    """A NextN-only checkpoint with two layers, both the trained one of ``src``; layer
    ``zero_norm``'s output norm zeroed, so its logits are all 0 and greedy picks token 0."""
    out.mkdir(parents=True, exist_ok=True)
    one = load_file(str(src / "model.safetensors"))
    two = dict(one)
    for k, v in one.items():
        two[k.replace(f"model.layers.{N}.", f"model.layers.{N + 1}.")] = v.clone()
    if zero_norm is not None:
        two[f"model.layers.{N + zero_norm}.shared_head.norm.weight"].zero_()
    save_file(two, str(out / "model.safetensors"))
    raw = json.loads((src / "config.json").read_text())
    raw["num_nextn_predict_layers"] = 2
    (out / "config.json").write_text(json.dumps(raw))
    return out


@pytest.fixture(scope="module")
def two_layer_nextn(tiny_eagle_drafts, tmp_path_factory):
    return _two_layers(tiny_eagle_drafts["mtp"], tmp_path_factory.mktemp("nextn-2"))


@pytest.fixture(scope="module")
def chats(tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    return [
        list(tok.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True, tokenize=True)["input_ids"])
        for c in ["Count to ten.", "Name a color.", "What is two plus two?", "Count to ten."]
    ]


def _engine(target, draft, batch=4, **spec):
    from specfw.engine import Engine

    sp = MtpConfig(algorithm="mtp", draft_model_path=str(draft), multi_layer=True, adaptive_draft="false", **spec)
    return Engine(make_cfg(model_path=str(target), max_total_tokens=4096, max_running_requests=batch, speculative=sp))


def test_two_nextn_layers_greedy_equals_plain(tiny_model_dir, two_layer_nextn, chats):
    from specfw.engine import Engine

    plain = [o.token_ids for o in Engine(make_cfg(model_path=str(tiny_model_dir), max_total_tokens=4096)).generate(chats, GREEDY)]
    one = _engine(tiny_model_dir, two_layer_nextn, batch=1, num_steps=2, topk=1)
    assert [one.generate([p], GREEDY)[0].token_ids for p in chats] == plain
    four = _engine(tiny_model_dir, two_layer_nextn, num_steps=2, topk=1)
    assert [o.token_ids for o in four.generate(chats, GREEDY)] == plain
    for eng in (one, four):
        assert eng.stats.accepted_draft_tokens > 0
        rt = eng.worker.runtime
        assert rt.kv.allocator.num_used == 0 and all(kv.allocator.num_used == 0 for kv in rt.upper_kv)  # every layer's KV released


def _drafts(eng, prompts):
    """Every chain the drafter proposed while generating ``prompts``."""
    rt, seen = eng.worker.runtime, []
    draft = rt._draft

    def recording(reqs, plan):
        out = draft(reqs, plan)
        seen.extend(c.tokens.tolist() for c in out)
        return out

    rt._draft = recording
    eng.generate(prompts, GREEDY)
    return [d for d in seen if len(d) == 2]


@pytest.mark.parametrize("zeroed", [0, 1])
def test_layer_i_drafts_step_i(tiny_model_dir, tiny_eagle_drafts, chats, tmp_path, zeroed):
    """With layer ``zeroed``'s output norm zeroed, exactly step ``zeroed`` of every chain is token 0."""
    ckpt = _two_layers(tiny_eagle_drafts["mtp"], tmp_path / "ckpt", zero_norm=zeroed)
    chains = _drafts(_engine(tiny_model_dir, ckpt, num_steps=2, topk=1), chats)
    assert chains
    assert all(c[zeroed] == 0 for c in chains)
    assert any(c[1 - zeroed] != 0 for c in chains)


def test_multi_layer_config_errors_name_the_key(tiny_model_dir, two_layer_nextn):
    with pytest.raises(ConfigError, match="speculative.topk: speculative.multi_layer drafts a chain"):
        MtpConfig(algorithm="mtp", multi_layer=True, num_steps=2, topk=2, num_draft_tokens=4).validate()
    with pytest.raises(ConfigError, match=r"speculative.num_steps: .*num_steps=3 from mtp_layer=0 needs layers \[0, 1, 2\], .* has \[0, 1\]"):
        _engine(tiny_model_dir, two_layer_nextn, num_steps=3, topk=1)


def test_dummy_multi_layer_draft(tiny_model_dir, two_layer_nextn, chats):
    """draft_load_format=dummy: two random NextN layers from the config alone; output still plain."""
    from specfw.engine import Engine

    plain = [o.token_ids for o in Engine(make_cfg(model_path=str(tiny_model_dir), max_total_tokens=4096)).generate(chats, GREEDY)]
    eng = _engine(tiny_model_dir, two_layer_nextn, num_steps=2, topk=1, draft_load_format="dummy")
    assert [o.token_ids for o in eng.generate(chats, GREEDY)] == plain
    assert eng.stats.verify_forwards > 0 and len(eng.worker.runtime.uppers) == 1
    from specfw_plugins.mtp.model import load_mtp, mtp_layers

    cfg = eng.runner.hf_config
    assert sorted(mtp_layers(two_layer_nextn, cfg, "dummy")) == [0, 1]  # from num_nextn_predict_layers
    heads = [load_mtp(two_layer_nextn, cfg, torch.float32, i, "dummy") for i in (0, 1)]
    assert all(float(p.abs().max()) <= 1e-3 for h in heads for p in h.parameters())
    assert not torch.equal(heads[0].proj.weight, heads[1].proj.weight)  # seeded by each layer's checkpoint names
    assert not torch.equal(heads[0].proj.weight, load_mtp(two_layer_nextn, cfg, torch.float32, 0).proj.weight)

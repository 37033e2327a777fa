"""speculative=mtp: NextN layers read from the target checkpoint (DeepSeek-V3 and MiMo layouts) or
a NextN-only checkpoint; the layer computes the documented formula; errors name the key."""

import json
import shutil

import pytest
import torch
from safetensors.torch import save_file

from conftest import make_cfg
from specfw.config import ConfigError
from specfw.sampling import SamplingParams
from specfw_plugins.mtp.config import MtpConfig
from specfw_plugins.mtp.model import DEEPSEEK, MIMO, _names, find_mtp_layers, load_mtp

GREEDY = SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8], [1000, 20, 1000, 20, 1000], [9, 99, 999, 9999], [42] * 6]


def _target_cfg(tiny_model_dir):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(tiny_model_dir)


def _random_mtp(cfg, layout, seed=0):
    """Random NextN tensors for the tiny target, in ``layout``'s names at index 0."""
    from transformers import LlamaConfig
    from specfw_plugins.mtp.model import MtpHead

    torch.manual_seed(seed)
    head = MtpHead(LlamaConfig(**cfg.to_dict()), layout, has_head=False)
    with torch.no_grad():
        for p in head.parameters():
            p.copy_(torch.randn_like(p) * (0.3 if p.dim() == 1 else 0.1) + (1.0 if p.dim() == 1 else 0.0))
    prefix = f"model.layers.{cfg.num_hidden_layers}." if layout == DEEPSEEK else "model.mtp_layers.0."
    names = _names(layout, prefix, False)
    return {names[k]: v.contiguous() for k, v in head.state_dict().items()}, head


@pytest.fixture(scope="module")
def target_with_mtp(tiny_model_dir, tmp_path_factory):
    """The tiny target with a built-in DeepSeek-style NextN layer (an extra safetensors shard)."""
    out = tmp_path_factory.mktemp("tiny-mtp")
    for f in tiny_model_dir.iterdir():
        shutil.copy(f, out / f.name)
    cfg = _target_cfg(tiny_model_dir)
    tensors, _ = _random_mtp(cfg, DEEPSEEK)
    save_file(tensors, str(out / "model-mtp.safetensors"))
    raw = json.loads((out / "config.json").read_text())
    raw["num_nextn_predict_layers"] = 1
    (out / "config.json").write_text(json.dumps(raw))
    return out


@pytest.fixture(scope="module")
def trained_nextn(tiny_eagle_drafts):
    """A NextN-only checkpoint for the tiny target, trained on-policy with `specfw train draft=mtp`
    (the shared fixture: trained on TINY_DRAFT_CHATS, which hold the two chats below)."""
    return tiny_eagle_drafts["mtp"]


def _engine(model_dir, **spec):
    from specfw.engine import Engine

    sp = MtpConfig(algorithm="mtp", **spec) if spec is not None else None
    return Engine(make_cfg(model_path=str(model_dir), max_total_tokens=4096, max_running_requests=4, speculative=sp))


def _plain(model_dir):
    from specfw.engine import Engine

    return [o.token_ids for o in Engine(make_cfg(model_path=str(model_dir), max_total_tokens=4096)).generate(PROMPTS, GREEDY)]


@pytest.mark.parametrize("shape", [dict(), dict(num_steps=1, topk=1), dict(num_steps=3, topk=2, num_draft_tokens=6)])
def test_builtin_nextn_greedy_equals_plain(target_with_mtp, shape):
    plain = _plain(target_with_mtp)  # the NextN tensors do not disturb the target's own load
    eng = _engine(target_with_mtp, **shape)
    assert [eng.generate([p], GREEDY)[0].token_ids for p in PROMPTS] == plain
    assert [o.token_ids for o in eng.generate(PROMPTS, GREEDY)] == plain
    assert eng.stats.verify_forwards > 0 and eng.scheduler.kv_in_use == 0


def test_trained_nextn_checkpoint_is_accepted(tiny_model_dir, trained_nextn):
    """`specfw train draft=mtp` exports a NextN-only checkpoint that speculative=mtp loads by path;
    trained on these chats, its drafts are accepted, and output still equals plain greedy."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    chats = [
        list(tok.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True, tokenize=True)["input_ids"])
        for c in ["Count to ten.", "Name a color."]
    ]
    from specfw.engine import Engine

    plain = [o.token_ids for o in Engine(make_cfg(model_path=str(tiny_model_dir), max_total_tokens=4096)).generate(chats, GREEDY)]
    for shape in (dict(num_steps=1, topk=1), dict(num_steps=3, topk=2, num_draft_tokens=6)):
        eng = _engine(tiny_model_dir, draft_model_path=str(trained_nextn), **shape)
        assert [o.token_ids for o in eng.generate(chats, GREEDY)] == plain
        assert eng.stats.accepted_draft_tokens > 0
    from safetensors import safe_open

    with safe_open(str(trained_nextn / "model.safetensors"), "pt") as fh:
        assert find_mtp_layers(list(fh.keys()), 2) == {0: (DEEPSEEK, "model.layers.2.")}
    assert json.loads((trained_nextn / "config.json").read_text())["num_nextn_predict_layers"] == 1


@pytest.mark.parametrize("layout", [DEEPSEEK, MIMO])
def test_layer_computes_the_documented_formula(tiny_model_dir, tmp_path, layout):
    """The loaded head against a reference written from the layout description with transformers'
    own decoder layer: proj(cat(...)) (embedding first for DeepSeek, hidden first for MiMo) → decoder
    layer → final norm."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    cfg = _target_cfg(tiny_model_dir)
    tensors, _ = _random_mtp(cfg, layout, seed=3)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_dict()))
    head = load_mtp(tmp_path, cfg, torch.float32)
    assert head.layout == layout
    p = f"model.layers.{cfg.num_hidden_layers}." if layout == DEEPSEEK else "model.mtp_layers.0."
    n = {DEEPSEEK: ("enorm", "hnorm", "eh_proj", "shared_head.norm"), MIMO: ("token_layernorm", "hidden_layernorm", "input_proj", "final_layernorm")}[layout]
    torch.manual_seed(1)
    T = 7
    emb, hid = torch.randn(T, cfg.hidden_size), torch.randn(T, cfg.hidden_size)
    lcfg = LlamaConfig(**cfg.to_dict())

    def norm(name, x):  # RMSNorm by its definition
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps) * tensors[p + name + ".weight"]

    e, h = norm(n[0], emb), norm(n[1], hid)
    x = torch.cat([e, h] if layout == DEEPSEEK else [h, e], -1) @ tensors[p + n[2] + ".weight"].T
    ref_layer = LlamaDecoderLayer(lcfg, layer_idx=0).eval()
    ref_layer.load_state_dict(
        {
            k.removeprefix(p): v
            for k, v in tensors.items()
            if k.removeprefix(p).split(".")[0] in ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm")
        }
    )
    pos = torch.arange(T)[None]
    cos_sin = LlamaRotaryEmbedding(lcfg)(x[None], pos)
    mask = torch.full((T, T), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        ref = ref_layer(x[None], attention_mask=mask, position_embeddings=cos_sin, position_ids=pos)
        ref = ref[0] if isinstance(ref, tuple) else ref
        ref = norm(n[3], ref[0])
        from specfw.models.llama import Rotary

        rot = Rotary(head.config, 64, torch.float32)
        y = head.fuse(emb, hid)
        out = head.layer.forward_dense(head.input_layernorm(y)[None], y[None], pos, rot)[0]
        got = head.final_norm(out)
    torch.testing.assert_close(y, x, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


def test_errors_name_the_key(tiny_model_dir, target_with_mtp, tmp_path):
    with pytest.raises(ConfigError, match="speculative.draft_model_path.*no MTP/NextN layers"):
        _engine(tiny_model_dir)  # the plain tiny target has none
    with pytest.raises(ConfigError, match="speculative.mtp_layer"):
        _engine(target_with_mtp, mtp_layer=1)
    cfg = _target_cfg(tiny_model_dir)
    tensors, _ = _random_mtp(cfg, DEEPSEEK)
    tensors = {k: (torch.randn(v.shape[0], 2 * v.shape[1] + 2) if k.endswith("eh_proj.weight") else v) for k, v in tensors.items()}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_dict()))
    with pytest.raises(ConfigError, match="eh_proj.weight' has shape"):
        load_mtp(tmp_path, cfg, torch.float32)
    bad = cfg.to_dict() | {"hidden_size": 32}
    (tmp_path / "config.json").write_text(json.dumps(bad))
    with pytest.raises(ConfigError, match="hidden_size 32 != target hidden_size 64"):
        load_mtp(tmp_path, cfg, torch.float32)


def test_mimo_target_with_mtp_layers(demo_dir, tmp_path):
    """A MiMo-style target (``model_type: mimo``: Qwen2 with q/k/v biases, no transformers class)
    loads, and its ``model.mtp_layers.0`` (biases too) drafts: greedy == plain."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from transformers import LlamaConfig
    from specfw_plugins.mtp.model import MtpHead

    cfg = Qwen2Config(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg)
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(40)
    model.save_pretrained(tmp_path)
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (demo_dir / f).exists():
            shutil.copy(demo_dir / f, tmp_path / f)
    raw = json.loads((tmp_path / "config.json").read_text())
    raw.update(model_type="mimo", architectures=["MiMoForCausalLM"], num_nextn_predict_layers=1)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    head = MtpHead(LlamaConfig(**cfg.to_dict()), MIMO, has_head=False, attn_bias=True)
    with torch.no_grad():
        for p in head.parameters():
            p.copy_(torch.randn_like(p) * 0.1 + (1.0 if p.dim() == 1 and p.shape[0] == 64 else 0.0))
    names = _names(MIMO, "model.mtp_layers.0.", True)
    save_file({names[k]: v.contiguous() for k, v in head.state_dict().items()}, str(tmp_path / "model-mtp.safetensors"))
    loaded = load_mtp(tmp_path, cfg, torch.float32)
    assert loaded.layout == MIMO and loaded.layer.self_attn.q_proj.bias is not None
    assert torch.equal(loaded.layer.self_attn.q_proj.bias, head.layer.self_attn.q_proj.bias)
    plain = _plain(tmp_path)
    eng = _engine(tmp_path, num_steps=2, topk=2, num_draft_tokens=4)
    assert [o.token_ids for o in eng.generate(PROMPTS, GREEDY)] == plain
    assert eng.stats.verify_forwards > 0


def test_mtp_trainer_unrolls_the_chain(tiny_model_dir):
    """draft.ttt_steps: step 0 of the unroll is the plain causal layer (same numbers as the dense
    path), deeper steps add their own loss terms and agreement metrics."""
    from types import SimpleNamespace
    from specfw.train.common import unrolled_layer_step
    from specfw_plugins.mtp.trainer import MtpTrainer
    from specfw.train.target import TargetTeacher

    teacher = TargetTeacher(tiny_model_dir, torch.float32, torch.device("cpu"))
    ids = torch.randint(0, 49152, (2, 12))
    mask, valid = torch.ones(2, 12), torch.ones(2, 12, dtype=torch.bool)
    losses = {}
    for ttt in (1, 3):
        cfg = SimpleNamespace(draft=SimpleNamespace(ttt_steps=ttt, ttt_decay=0.8), data=SimpleNamespace(max_len=32))
        torch.manual_seed(0)
        tr = MtpTrainer(cfg, teacher, [])
        with torch.no_grad():
            losses[ttt], metrics = tr.loss(ids, mask, valid)
        assert sorted(k for k in metrics if k.startswith("acc")) == [f"acc{j}" for j in range(ttt)]
    assert losses[3] > losses[1] > 0
    x = torch.randn(2, 10, 64)
    with torch.no_grad():
        dense = tr.head.layer.forward_dense(tr.head.input_layernorm(x), x, torch.arange(10).expand(2, 10), tr.rotary)
        step0 = unrolled_layer_step(tr.head.layer, tr.head.input_layernorm(x), x, 0, [], [], tr.rotary)
    torch.testing.assert_close(step0, dense, rtol=1e-5, atol=1e-5)


def test_demo_target_drafts_with_the_committed_nextn_layer(demo_engine):
    """`specfw serve speculative=mtp` with no path on the demo target (which has no NextN layer of
    its own) loads plugins/mtp/demo_draft; greedy == plain on MT-bench chats, batch 1 and 2."""
    from specfw.datasets import mtbench_first_turns
    from specfw.engine import Engine
    from specfw_plugins.mtp.drafter import DEMO_DRAFT

    from specfw.sdk import committed_draft

    assert (DEMO_DRAFT / "config.json").exists() and (committed_draft(DEMO_DRAFT) / "model.safetensors").exists()
    params = SamplingParams(max_new_tokens=32, temperature=0)
    chats = [demo_engine.tokenize_chat([{"role": "user", "content": q}]) for q in mtbench_first_turns(2)]
    ref = [o.token_ids for o in demo_engine.generate(chats, params)]
    with Engine(make_cfg(max_total_tokens=4096, max_running_requests=2, speculative=MtpConfig(algorithm="mtp"))) as eng:
        assert eng.worker.runtime.path == committed_draft(DEMO_DRAFT)
        assert [eng.generate([c], params)[0].token_ids for c in chats] == ref
        assert [o.token_ids for o in eng.generate(chats, params)] == ref
        assert eng.stats.verify_forwards > 0

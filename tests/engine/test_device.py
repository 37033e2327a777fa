"""model.device: validation, and that a forward keeps the device's tensors on the device.

No GPU is lent to CI, so the placement rules are checked on PyTorch's ``meta`` device (shapes
only, no data) under a dispatch mode that rejects what CUDA rejects: an operation mixing device
tensors with host tensors that are not 0-dim scalars, except the ones CUDA accepts host indices
for (advanced indexing) and cross-device copies. The CUDA tests at the end run only where torch
sees a GPU.
"""

import json

import pytest
import torch
from safetensors.torch import save_file
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from conftest import make_cfg
from specfw.backends import make_backend
from specfw.config import ConfigError, validate
from specfw.device import check_device_name, resolve_device
from specfw.model_loader import load_model
from specfw.model_runner import ModelRunner, build_forward_batch

aten = torch.ops.aten
HOST_INDEX_OK = {aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_, aten.copy_, aten._to_copy}
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


class DeviceMixingChecker(TorchDispatchMode):
    """Fail any aten op that mixes ``meta`` tensors with non-scalar host tensors (CUDA's rule)."""

    def __init__(self):
        super().__init__()
        self.device_ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        on_device = any(t.device.type == "meta" for t in tensors)
        host = [t for t in tensors if t.device.type == "cpu" and t.dim() > 0]
        if on_device:
            self.device_ops += 1
            if host and func.overloadpacket not in HOST_INDEX_OK:
                raise AssertionError(f"{func} mixes device tensors with host tensors of shapes {[tuple(t.shape) for t in host]}")
        return func(*args, **kwargs)


def test_the_checker_catches_mixing():
    with pytest.raises(AssertionError, match="mixes"):
        with DeviceMixingChecker():
            torch.zeros(3, device="meta").index_select(0, torch.tensor([0, 1]))
    with DeviceMixingChecker():  # host indices in advanced indexing are fine on CUDA
        torch.zeros(3, 2, device="meta")[torch.tensor([0, 2])]


@pytest.mark.parametrize("name", ["gpu", "cuda:x", "tpu", ""])
def test_bad_device_names_list_the_allowed_ones(name):
    cfg = make_cfg(model_device=name)
    with pytest.raises(ConfigError) as e:
        validate(cfg)
    assert e.value.key == "model.device" and "cuda:N" in str(e.value) and "auto" in str(e.value)


def test_device_names_resolve():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    for ok in ("auto", "cpu", "cuda", "cuda:1"):
        check_device_name(ok)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_cuda_without_cuda_fails_at_startup_naming_the_key(tiny_model_dir):
    from specfw.engine import Engine

    with pytest.raises(ConfigError) as e:
        Engine(make_cfg(model_path=str(tiny_model_dir), model_device="cuda", max_total_tokens=256))
    assert e.value.key == "model.device" and "no CUDA device" in str(e.value)


@pytest.fixture(scope="module")
def meta_runner_factory(tiny_model_dir):
    def make(batch_invariant):
        lm = load_model(str(tiny_model_dir))
        lm.model.to("meta")
        lm.model.rotary.to("meta")
        return ModelRunner(lm.model, lm.hf_config, 256, torch.float32, backend=make_backend("meta", batch_invariant=batch_invariant))

    return make


@pytest.mark.parametrize("batch_invariant", [True, False])
def test_target_forwards_keep_device_tensors_on_the_device(meta_runner_factory, batch_invariant):
    """Prefill (one fresh prompt, one with a cached prefix), a decode batch and a draft tree, as the
    workers build them, run with every device tensor on the device."""
    r = meta_runner_factory(batch_invariant)
    assert r.device.type == "meta" and r.kv.k[0].device.type == "meta" and r.backend.name == "torch"
    a, b = r.allocator.alloc(6), r.allocator.alloc(4)
    b_new = r.allocator.alloc(3)
    chunks = [(torch.arange(10, 16), torch.arange(6), a, torch.empty(0, dtype=torch.long), None), (torch.arange(20, 23), torch.arange(4, 7), b_new, b, None)]
    tree_slots = r.allocator.alloc(4)
    tree = (
        torch.tensor([5, 6, 7, 8]),
        6 + torch.tensor([0, 1, 1, 2]),
        tree_slots,
        a,
        torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool),
    )
    one = r.allocator.alloc(2)
    decode = [(torch.tensor([3]), torch.tensor([6]), one[:1], a, None), (torch.tensor([4]), torch.tensor([7]), one[1:], torch.cat([b, b_new]), None)]
    with DeviceMixingChecker() as checker:
        prefill = r.forward(build_forward_batch(chunks, last_only=True, capture_layers=(0, 1)))
        verify = r.forward(build_forward_batch([tree]))
        step = r.forward(build_forward_batch(decode))
        r.kv.move(tree_slots[[0, 1]], tree_slots[:2])  # committing an accepted path
    assert checker.device_ops > 100
    assert prefill.logits.shape == (2, 49152) and prefill.logits.device.type == "meta"
    assert [a.shape for a in prefill.aux_hidden] == [(9, 64), (9, 64)]
    assert verify.logits.shape == (4, 49152) and verify.hidden.device.type == "meta"
    assert step.logits.shape == (2, 49152)


def _rand(g, *shape):
    return torch.randn(*shape, generator=g) * 0.1


def _draft_layer(g, prefix, in_dim, hidden=64, inter=128, heads=4, kv_heads=2, input_norm=True):
    hd = hidden // heads
    t = {
        f"{prefix}post_attention_layernorm.weight": torch.ones(hidden),
        f"{prefix}self_attn.q_proj.weight": _rand(g, heads * hd, in_dim),
        f"{prefix}self_attn.k_proj.weight": _rand(g, kv_heads * hd, in_dim),
        f"{prefix}self_attn.v_proj.weight": _rand(g, kv_heads * hd, in_dim),
        f"{prefix}self_attn.o_proj.weight": _rand(g, hidden, heads * hd),
        f"{prefix}mlp.gate_proj.weight": _rand(g, inter, hidden),
        f"{prefix}mlp.up_proj.weight": _rand(g, inter, hidden),
        f"{prefix}mlp.down_proj.weight": _rand(g, hidden, inter),
    }
    if input_norm:
        t[f"{prefix}input_layernorm.weight"] = torch.ones(hidden)
    return t


def _tiny_draft(kind, path, vocab=49152, hidden=64, draft_vocab=100):
    """A random EAGLE-3 (draft vocab 100, target id = 4 * i) or EAGLE checkpoint for the tiny target."""
    g = torch.Generator().manual_seed(0)
    if kind == "eagle3":
        t = {
            "fc.weight": _rand(g, hidden, 3 * hidden),
            "norm.weight": torch.ones(hidden),
            "lm_head.weight": _rand(g, draft_vocab, hidden),
            "midlayer.hidden_norm.weight": torch.ones(hidden),
            "d2t": torch.arange(draft_vocab) * 3,
            **_draft_layer(g, "midlayer.", 2 * hidden),
        }
        extra = dict(architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=draft_vocab, target_hidden_size=hidden)
    else:
        t = {"fc.weight": _rand(g, hidden, 2 * hidden), **_draft_layer(g, "layers.0.", hidden, input_norm=False)}
        extra = dict(architectures=["LlamaForCausalLMEagle"])
    path.mkdir(parents=True, exist_ok=True)
    save_file(t, str(path / "model.safetensors"))
    (path / "config.json").write_text(
        json.dumps(
            dict(
                model_type="llama",
                hidden_size=hidden,
                intermediate_size=128,
                num_attention_heads=4,
                num_key_value_heads=2,
                num_hidden_layers=1,
                vocab_size=vocab,
                rms_norm_eps=1e-5,
                **extra,
            )
        )
    )
    return path


@pytest.mark.parametrize("kind", ["eagle3", "eagle"])
def test_feature_draft_heads_run_on_the_targets_device(meta_runner_factory, tmp_path, kind):
    """The draft head, its KV pool and the target features it is fed live on the target's device;
    vocabulary maps (EAGLE-3 ``d2t``, EAGLE's FR-Spec token map) stay on the host, where beam
    search reads them per token, while the FR-Spec lm_head rows are gathered on the device."""
    from specfw.request import Request
    from specfw.sampling import SamplingParams
    from specfw.speculative.config import TreeShape
    from specfw.speculative.types import SpecContext

    runner = meta_runner_factory(False)
    path = _tiny_draft(kind, tmp_path / kind)
    if kind == "eagle3":
        from specfw_plugins.eagle3.config import Eagle3Config as Config
        from specfw_plugins.eagle3.drafter import Eagle3Drafter as Drafter

        cfg, out_vocab = Config(algorithm=kind, draft_model_path=str(path), aux_layers=[0, 1, 1]), 100
    else:
        from specfw_plugins.eagle.config import EagleConfig as Config
        from specfw_plugins.eagle.drafter import EagleDrafter as Drafter

        torch.save(torch.arange(0, 600, 3), tmp_path / "freq.pt")
        cfg, out_vocab = Config(algorithm=kind, draft_model_path=str(path), token_map=str(tmp_path / "freq.pt")), 200
    ctx = SpecContext(config=cfg, shape=TreeShape(num_steps=3, topk=2, num_draft_tokens=6), runner=runner, tokenizer=None, engine_config=make_cfg(), stats=None)
    drafter = Drafter(ctx)
    assert drafter.kv.k[0].device.type == "meta" and drafter.head.fc.weight.device.type == "meta"
    assert drafter.to_target.device.type == "cpu" and int(drafter.to_target[5]) == (20 if kind == "eagle3" else 15)
    req = Request(prompt_ids=list(range(30, 37)), params=SamplingParams(temperature=0))
    slots = runner.allocator.alloc(7)
    with DeviceMixingChecker() as checker:
        out = runner.forward(
            build_forward_batch(
                [(torch.tensor(req.prompt_ids), torch.arange(7), slots, torch.empty(0, dtype=torch.long), None)],
                last_only=True,
                capture_layers=ctx.capture_layers,
            )
        )
        drafter.specfw_on_prefill(ctx=ctx, reqs=[req], hidden=out.hidden, aux_hidden=out.aux_hidden, spans=[(0, 7)])
        req.output_ids.append(40)  # the token the prefill sampled: the drafter extends up to it
        logits, hidden = drafter._extend([req])
    assert checker.device_ops > 50
    assert logits.shape == (1, out_vocab) and logits.device.type == "meta" and hidden.shape == (1, 64)
    assert len(drafter.states[req.rid].slots) == 7


# ---- on a real GPU (skipped where torch sees none) ------------------------------------------


@needs_cuda
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_greedy_speculative_equals_plain(tiny_model_dir, tmp_path, dtype):
    from specfw.engine import Engine
    from specfw.sampling import SamplingParams
    from specfw_plugins.ngram.config import NgramConfig
    from specfw_plugins.standalone.config import StandaloneConfig
    from specfw_plugins.standalone.make_draft import truncate_model

    params = SamplingParams(max_new_tokens=32, temperature=0, ignore_eos=True)
    prompts = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [1000, 20, 1000, 20, 1000], [9, 99, 999, 9999], list(range(100, 140))]
    kw = dict(model_path=str(tiny_model_dir), model_device="cuda", model_dtype=dtype, max_total_tokens=4096, max_running_requests=4)
    plain = Engine(make_cfg(**kw))
    assert plain.runner.kv.k[0].device.type == "cuda"
    ref = [o.token_ids for o in plain.generate(prompts, params)]
    draft = truncate_model(tiny_model_dir, tmp_path / "draft", layers=1)
    for spec in (
        NgramConfig(algorithm="ngram"),
        StandaloneConfig(algorithm="standalone", draft_model_path=str(draft), num_steps=3, topk=2, num_draft_tokens=6),
    ):
        eng = Engine(make_cfg(speculative=spec, **kw))
        assert [eng.generate([p], params)[0].token_ids for p in prompts] == ref
        assert [o.token_ids for o in eng.generate(prompts, params)] == ref
        assert eng.scheduler.kv_in_use == 0 and eng.stats.verify_forwards > 0


@needs_cuda
def test_cuda_demo_eagle3_equals_plain_bf16():
    from specfw.engine import Engine
    from specfw.sampling import SamplingParams
    from specfw_plugins.eagle3.config import Eagle3Config

    params = SamplingParams(max_new_tokens=48, temperature=0)
    kw = dict(model_device="cuda", model_dtype="bfloat16", max_total_tokens=8192, max_running_requests=4)
    plain = Engine(make_cfg(**kw))
    prompts = [
        plain.tokenize_chat([{"role": "user", "content": q}]) for q in ("Write a haiku about rain.", "What is 17 times 3?", "Name three rivers in Europe.")
    ]
    ref = [o.token_ids for o in plain.generate(prompts, params)]
    eng = Engine(make_cfg(speculative=Eagle3Config(algorithm="eagle3"), **kw))
    assert [o.token_ids for o in eng.generate(prompts, params)] == ref
    assert eng.stats.accept_length > 1.2

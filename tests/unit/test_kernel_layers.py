"""All decoder layers in one kernel call (``KernelLayers``, ``cpu_ops.decoder_layers``): the same
bits as the per-layer path for decode rows, tree rows, extend chains and batches mixing them, with
the captured hidden states; prompt prefills and layers with other linears keep the per-layer path.
The portable build everywhere, each ISA build where the CPU has it."""

import pytest
import torch

from specfw.backends import make_backend
from specfw.backends.cpu import CpuBackend
from specfw.backends.kernel_layers import KernelLayers
from specfw.kernels import ISAS, bf16_amx, cpu_ops, isa_supported, q8_ops, w8a8_isa, w8a8_ops
from specfw.model_loader import load_model
from specfw.model_runner import ModelRunner, build_forward_batch

EMPTY = torch.empty(0, dtype=torch.long)


def _isas():
    return [pytest.param(i, marks=pytest.mark.skipif(not isa_supported(i), reason=f"this CPU lacks {i}")) for i in ISAS]


def _tree_mask(parents):
    mask = torch.eye(len(parents), dtype=torch.bool)
    for i, p in enumerate(parents):
        while p >= 0:
            mask[i, p] = True
            p = parents[p]
    return mask


def _runner(model_dir, isa, dtype, bf16_dot=False, codes=None, activations="int8", amx=False):
    """``codes``: int8 / int4 weights with int8 activations (``Q8Linear``: q8_ops' linears; with
    ``activations="int8_per_token"``, ``W8A8Linear``: w8a8_ops' linears). ``amx``: bf16 weights on
    AMX tiles (``DotBF16Linear`` on bf16_amx, whose linear cpu_ops calls by address)."""
    if cpu_ops(isa) is None or (codes and q8_ops(isa) is None) or (activations == "int8_per_token" and w8a8_ops(w8a8_isa(isa)) is None):
        pytest.skip("the CPU kernels cannot be built here")
    if bf16_dot and not cpu_ops(isa).has_bf16_dot():
        pytest.skip(f"the {isa} build has no vdpbf16ps path on this CPU")
    if bf16_dot and bf16_amx() is not None:
        pytest.skip("on an AMX CPU bf16 linears take AMX tiles (DotBF16Linear), not the build's vdpbf16ps path")
    if amx and bf16_amx() is None:
        pytest.skip("this CPU has no AMX-BF16 (or the AMX kernel cannot be built)")
    bf16_dot = bf16_dot or amx  # engine.cpu_bf16_kernel: AMX tiles where the CPU has them
    lm = load_model(str(model_dir), dtype=str(dtype).removeprefix("torch."))
    quant = dict(quantization=codes, activation_quantization=activations) if codes else {}
    backend = make_backend("cpu", batch_invariant=True, cpu_isa=isa, cpu_bf16_kernel=bf16_dot, **quant)
    return ModelRunner(lm.model, lm.hf_config, 512, dtype, backend=backend)


def _both_paths(runner, chunks, capture=()):
    """The forward with the one-call stack and with the per-layer path (same runner, same KV)."""
    outs = []
    for one_call in (True, False):
        runner.backend.one_call_layers = one_call
        with torch.inference_mode():
            outs.append(runner.forward(build_forward_batch(chunks, capture_layers=capture)))
    runner.backend.one_call_layers = CpuBackend.one_call_layers
    return outs


@pytest.mark.parametrize(
    "dtype",
    [
        torch.float32,
        torch.bfloat16,
        "bf16 vdpbf16ps",
        "bf16 amx",
        "int8 codes",
        "int4 codes",
        "int8 codes bf16",
        "int8 per token",
        "int8 weights",
        "int4 weights",
    ],
)
@pytest.mark.parametrize("isa", _isas())
def test_one_call_layers_equal_the_per_layer_path(tiny_model_dir, isa, dtype, monkeypatch):
    """Also with int8 activations x int8 / int4 codes (``cpu_ops`` calling q8_ops' linear), with
    int8 activations per token (w8a8_ops' linear: AMX tiles in the avx512 build where the CPU
    has AMX-INT8), with weight-only int8 / int4 codes (quant_ops' qlinear: one to six rows a
    register tile, so the 17-row tree runs 6 + 6 + 5) and with bf16 weights on AMX tiles
    (bf16_amx's linear, where the CPU has AMX-BF16)."""
    from specfw.backends.q8_linear import Q8Linear
    from specfw.backends.quant_linear import QuantLinear
    from specfw.backends.w8a8_linear import W8A8Linear
    from specfw.cpu_linear import DotBF16Linear

    dot = dtype == "bf16 vdpbf16ps"  # bf16 weights in bf16_dot's layout (AVX512-BF16 in the avx512 build)
    amx = dtype == "bf16 amx"
    per_token = dtype == "int8 per token"
    weight_only = isinstance(dtype, str) and dtype.endswith("weights")
    codes = dtype.split()[0] if isinstance(dtype, str) and ("codes" in dtype or per_token or weight_only) else None
    acts = "int8_per_token" if per_token else "none" if weight_only else "int8"
    bf16 = dot or amx or dtype == "int8 codes bf16"  # a bf16 model (codes: each linear's sums rounded to bf16)
    r = _runner(tiny_model_dir, isa, torch.bfloat16 if bf16 else torch.float32 if codes else dtype, bf16_dot=dot, codes=codes, activations=acts, amx=amx)
    if weight_only:
        assert all(type(getattr(layer, n)) is QuantLinear for layer in r.model.layers for n in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"))
        assert r.backend.decoder_stack(r.model).quant_linear == r.model.layers[0].qkv_proj.ops.linear_address() != 0
    elif codes:
        kind = W8A8Linear if per_token else Q8Linear
        assert all(type(getattr(layer, n)) is kind for layer in r.model.layers for n in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"))
        assert {layer.qkv_proj.q8.bits for layer in r.model.layers} == {8 if codes == "int8" else 4}
        tiles = None if per_token else r.backend.q8tiles  # q8_ops' amx build, on an AMX-INT8 CPU in the avx512 build
        assert r.backend.decoder_stack(r.model).q8_tile_linear == (tiles.linear_address() if tiles is not None else 0)
    elif amx:
        assert all(type(getattr(layer, n)) is DotBF16Linear for layer in r.model.layers for n in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"))
        assert r.backend.decoder_stack(r.model).packed_linear == bf16_amx().linear_address() != 0
    else:
        assert all(layer.qkv_proj.packed.shape[-1] == (32 if dot else 16) for layer in r.model.layers)
    calls = []
    real_call = KernelLayers.__call__
    monkeypatch.setattr(KernelLayers, "__call__", lambda self, *a: calls.append(1) or real_call(self, *a))
    prompts = [torch.tensor([11, 12, 13, 14, 15]), torch.tensor([21, 22, 23])]
    prefixes = []
    for p in prompts:  # prompt prefills: the per-layer path (causal SDPA)
        slots = r.allocator.alloc(len(p))
        with torch.inference_mode():
            r.forward(build_forward_batch([(p, torch.arange(len(p)), slots, EMPTY, None)]))
        prefixes.append(slots)
    assert calls == []
    tree = _tree_mask([-1, 0, 0, 1, 3])
    depth = tree.sum(1) - 1
    wide = _tree_mask([-1] + [0] * 8 + list(range(1, 9)))  # 17 rows: TILE_ROWS and more (the AMX build's calls, where there is one)
    batches = {
        "two decode rows": [(torch.tensor([7]), torch.tensor([5]), r.allocator.alloc(1), prefixes[0], None),
                            (torch.tensor([8]), torch.tensor([3]), r.allocator.alloc(1), prefixes[1], None)],
        "a tree": [(torch.tensor([30, 31, 32, 33, 34]), 5 + depth, r.allocator.alloc(5), prefixes[0], tree)],
        "an extend chain beside a tree": [(torch.tensor([40, 41, 42]), 3 + torch.arange(3), r.allocator.alloc(3), prefixes[1], None),
                                          (torch.tensor([30, 31, 32, 33, 34]), 5 + depth, r.allocator.alloc(5), prefixes[0], tree)],
        "a tree of 17 rows": [(torch.arange(50, 67), 5 + wide.sum(1) - 1, r.allocator.alloc(17), prefixes[0], wide)],
    }  # fmt: skip
    for name, chunks in batches.items():
        one, per_layer = _both_paths(r, chunks, capture=(0, 1, 2))
        assert torch.equal(one.logits, per_layer.logits), name
        assert torch.equal(one.hidden, per_layer.hidden), name
        assert len(one.aux_hidden) == 3 and all(torch.equal(a, b) for a, b in zip(one.aux_hidden, per_layer.aux_hidden)), name
    assert len(calls) == len(batches)


def test_a_tree_row_equals_the_decode_row_of_its_path(tiny_model_dir):
    """Batch invariance through the one-call path: a tree node's logits have the bits of the
    plain decode steps that feed the same tokens."""
    r = _runner(tiny_model_dir, "portable", torch.float32)
    prompt = torch.tensor([11, 12, 13, 14])
    ps = r.allocator.alloc(4)
    with torch.inference_mode():
        r.forward(build_forward_batch([(prompt, torch.arange(4), ps, EMPTY, None)]))
        tree = _tree_mask([-1, 0, 0, 1])
        logits = r.forward(build_forward_batch([(torch.tensor([50, 60, 70, 80]), 4 + tree.sum(1) - 1, r.allocator.alloc(4), ps, tree)])).logits
        s = r.allocator.alloc(3)
        steps = []
        for i, tok in enumerate([50, 60, 80]):  # the path root -> a -> c, one decode row at a time
            fb = build_forward_batch([(torch.tensor([tok]), torch.tensor([4 + i]), s[i : i + 1], torch.cat([ps, s[:i]]), None)])
            steps.append(r.forward(fb).logits[0])
    assert torch.equal(logits[0], steps[0]) and torch.equal(logits[1], steps[1]) and torch.equal(logits[3], steps[2])


def test_layers_with_other_linears_keep_the_per_layer_path(tiny_model_dir):
    r = _runner(tiny_model_dir, "portable", torch.float32)
    assert r.backend.decoder_stack(r.model) is not None
    quant = make_backend("cpu", batch_invariant=True, cpu_isa="portable", quantization="int8")
    lm = load_model(str(tiny_model_dir), dtype="bfloat16")
    q = ModelRunner(lm.model, lm.hf_config, 64, torch.bfloat16, backend=quant)
    assert q.backend.decoder_stack(q.model) is None  # weight-only codes in a bf16 model: each linear's sums rounded per op
    lm = load_model(str(tiny_model_dir))
    q = ModelRunner(lm.model, lm.hf_config, 64, torch.float32, backend=make_backend("cpu", batch_invariant=True, cpu_isa="portable", quantization="int8"))
    assert q.backend.decoder_stack(q.model).quant_linear == q.model.layers[0].qkv_proj.ops.linear_address() != 0  # fp32: one call
    a8 = make_backend("cpu", batch_invariant=True, cpu_isa="portable", quantization="int8", activation_quantization="int8")
    lm = load_model(str(tiny_model_dir))
    q = ModelRunner(lm.model, lm.hf_config, 64, torch.float32, backend=a8)
    assert q.backend.decoder_stack(q.model).q8_linear == q.model.layers[0].qkv_proj.ops.linear_address() != 0  # int8 activations: one call
    # a weight replaced after the stack was built: rebuilt from the layer's current weight
    stack = r.backend.decoder_stack(r.model)
    layer = r.model.layers[0].o_proj
    layer.packed = layer.packed.clone()
    assert stack.current() is False
    rebuilt = r.backend.decoder_stack(r.model)
    assert rebuilt is not stack and rebuilt.current()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, "w8a8_int8", "w8a8_int8 bf16", "bf16 amx"])
@pytest.mark.parametrize("isa", _isas())
def test_one_call_draft_layer_equals_the_per_op_path(isa, dtype, monkeypatch):
    """``KernelDraftLayer`` (``cpu_ops.draft_layer``): an EAGLE-3-shaped draft layer (attention
    input 2H, residual H) gives the per-op path's bits for extend rows, beam-step rows whose tree
    mask covers earlier drafted nodes, and two sequences at once; a prompt prefill keeps the per-op
    path. Also with int8 weights and activations and with bf16 weights on AMX tiles."""
    from transformers import LlamaConfig
    from specfw.backends.kernel_layers import KernelDraftLayer
    from specfw.kv_cache import KVPool
    from specfw.models.draft_layer import DraftDecoderLayer
    from specfw.models.llama import Rotary

    codes = isinstance(dtype, str) and dtype.startswith("w8a8_int8")  # int8 weights and activations (q8_ops' linear, called from cpu_ops)
    code_dtype = torch.bfloat16 if dtype == "w8a8_int8 bf16" else torch.float32  # a bf16 head: each linear's sums rounded to bf16
    amx = dtype == "bf16 amx"  # bf16 weights on AMX tiles (bf16_amx's linear, called from cpu_ops)
    if cpu_ops(isa) is None or (codes and q8_ops(isa) is None):
        pytest.skip("the CPU kernels cannot be built here")
    if amx and bf16_amx() is None:
        pytest.skip("this CPU has no AMX-BF16 (or the AMX kernel cannot be built)")
    dtype = code_dtype if codes else torch.bfloat16 if amx else dtype
    cfg = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128, rms_norm_eps=1e-5)
    torch.manual_seed(0)
    layer = DraftDecoderLayer(cfg, in_dim=128)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn_like(p) * 0.2)
    layer = layer.to(dtype).eval()
    backend = make_backend("cpu", batch_invariant=True, cpu_isa=isa, cpu_bf16_kernel=amx, draft_quantization="w8a8_int8" if codes else None)
    layer = backend.prepare_module(layer)
    assert (type(layer.qkv_fused).__name__ == "Q8Linear") == codes
    assert (type(layer.qkv_fused).__name__ == "DotBF16Linear") == amx
    kv = KVPool(1, 2, 16, 256, dtype=dtype)
    rotary = Rotary(cfg, 256, dtype)
    calls = []
    real_call = KernelDraftLayer.__call__
    monkeypatch.setattr(KernelDraftLayer, "__call__", lambda self, *a: calls.append(1) or real_call(self, *a))

    def both(chunks):
        outs = []
        for one_call in (True, False):
            backend.one_call_layers = one_call
            fb = build_forward_batch(chunks)
            T = fb.num_tokens
            g = torch.Generator().manual_seed(T)
            attn_in, residual = torch.randn(T, 128, generator=g).to(dtype), torch.randn(T, 64, generator=g).to(dtype)
            with torch.inference_mode():
                outs.append(layer(attn_in, residual, fb, kv, rotary))
        backend.one_call_layers = CpuBackend.one_call_layers
        return outs

    prompts = []
    for n in (6, 4):  # prompt prefills: causal SDPA, the per-op path
        slots = kv.allocator.alloc(n)
        one, per_op = both([(torch.arange(n), torch.arange(n), slots, EMPTY, None)])
        assert torch.equal(one, per_op)
        prompts.append(slots)
    assert calls == []
    drafted = kv.allocator.alloc(3)  # three earlier beam nodes (KV written by an extend below)
    both([(torch.arange(3), 6 + torch.arange(3), drafted, prompts[0], None)])
    mask = torch.tensor([[1, 0, 0, 1, 0], [1, 1, 0, 0, 1]], dtype=torch.bool)  # two beams over 3 drafted nodes + themselves
    batches = {
        "an extend chain": [(torch.arange(3), 4 + torch.arange(3), kv.allocator.alloc(3), prompts[1], None)],
        "a beam step over drafted nodes": [(torch.arange(2), torch.tensor([9, 10]), kv.allocator.alloc(2), torch.cat([prompts[0], drafted]), mask)],
        "two one-row sequences": [(torch.tensor([5]), torch.tensor([6]), kv.allocator.alloc(1), prompts[0], None),
                                  (torch.tensor([7]), torch.tensor([4]), kv.allocator.alloc(1), prompts[1], None)],
    }  # fmt: skip
    for name, chunks in batches.items():
        one, per_op = both(chunks)
        assert torch.equal(one, per_op), name
    assert len(calls) == len(batches) + 1  # + the extend that wrote the drafted nodes
    # the call reads rope's rows from the tables at each position: one past them is an error naming
    # it (the per-op path's gather raises too), never a read outside the tables
    backend.one_call_layers = True
    fb = build_forward_batch([(torch.tensor([5]), torch.tensor([rotary.cos.shape[0] + 3]), kv.allocator.alloc(1), prompts[0], None)])
    with pytest.raises(RuntimeError, match="position out of range"), torch.inference_mode():
        layer(torch.randn(1, 128).to(dtype), torch.randn(1, 64).to(dtype), fb, kv, rotary)
    backend.one_call_layers = CpuBackend.one_call_layers
    assert len(calls) == len(batches) + 2
    assert KernelDraftLayer.eligible(backend.ops, layer) and not KernelDraftLayer.eligible(backend.ops, DraftDecoderLayer(cfg, in_dim=128))  # unfused

"""The lean Llama forward: equals transformers' logits; tree-masked forwards equal chain forwards."""

import pytest
import torch

from specfw.model_loader import load_model
from specfw.model_runner import ModelRunner, build_forward_batch

EMPTY = torch.empty(0, dtype=torch.long)


def test_logits_match_transformers(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    lm = load_model(str(tiny_model_dir))
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    r = ModelRunner(lm.model, lm.hf_config, 256, torch.float32)
    ids = torch.tensor([3, 17, 400, 9, 23, 1000, 5])
    slots = r.allocator.alloc(7)
    ours = r.forward(build_forward_batch([(ids, torch.arange(7), slots, EMPTY, None)])).logits
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    assert torch.allclose(ours, ref, atol=1e-4, rtol=1e-4)


def test_tree_forward_equals_chain_forwards(tiny_model_dir):
    """Tree: root r; children a, b of r; child c of a. Each node's logits must equal the logits
    of the chain prefix+path forward (depth-based positions, ancestor mask)."""
    lm = load_model(str(tiny_model_dir))
    r = ModelRunner(lm.model, lm.hf_config, 512, torch.float32)
    prefix = torch.tensor([11, 12, 13, 14])
    pslots = r.allocator.alloc(4)
    r.forward(build_forward_batch([(prefix, torch.arange(4), pslots, EMPTY, None)]))
    tokens = torch.tensor([50, 60, 70, 80])  # r, a, b, c
    parents = [-1, 0, 0, 1]
    depth = torch.tensor([0, 1, 1, 2])
    mask = torch.eye(4, dtype=torch.bool)
    for i, p in enumerate(parents):
        while p >= 0:
            mask[i, p] = True
            p = parents[p]
    tslots = r.allocator.alloc(4)
    tree = r.forward(build_forward_batch([(tokens, 4 + depth, tslots, pslots, mask)])).logits
    paths = {0: [50], 1: [50, 60], 2: [50, 70], 3: [50, 60, 80]}
    for node, path in paths.items():
        s = r.allocator.alloc(len(path))
        chain = r.forward(build_forward_batch([(torch.tensor(path), 4 + torch.arange(len(path)), s, pslots, None)])).logits
        assert torch.allclose(tree[node], chain[-1], atol=1e-4), node
        r.allocator.free(s)


def test_ragged_batch_equals_separate(tiny_model_dir):
    lm = load_model(str(tiny_model_dir))
    r = ModelRunner(lm.model, lm.hf_config, 512, torch.float32)
    seqs = [torch.tensor([5, 6, 7]), torch.tensor([8, 9, 10, 11, 12]), torch.tensor([13])]
    sep = []
    for s in seqs:
        sl = r.allocator.alloc(len(s))
        sep.append(r.forward(build_forward_batch([(s, torch.arange(len(s)), sl, EMPTY, None)], last_only=True)).logits[0])
    chunks = [(s, torch.arange(len(s)), r.allocator.alloc(len(s)), EMPTY, None) for s in seqs]
    both = r.forward(build_forward_batch(chunks, last_only=True)).logits
    for i in range(3):
        assert torch.allclose(both[i], sep[i], atol=1e-5)


def test_rmsnorm_is_bitwise_hf_in_every_dtype():
    """specfw's RMSNorm takes fused paths; each must round exactly as transformers' LlamaRMSNorm."""
    import torch
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from specfw.models.llama import RMSNorm

    torch.manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        ours, ref = RMSNorm(576, 1e-5), LlamaRMSNorm(576, eps=1e-5)
        with torch.no_grad():
            ours.weight.copy_(torch.rand(576) + 0.5)
            ref.weight.copy_(ours.weight)
        ours, ref = ours.to(dtype), ref.to(dtype)
        for rows in (1, 3, 64):
            x = (torch.randn(rows, 576) * 4).to(dtype)
            with torch.no_grad():
                assert torch.equal(ours(x), ref(x)), f"{dtype}, {rows} rows"


@pytest.mark.parametrize("cpu_isa", ["none", "auto"])
def test_batch_invariant_runner_measures_its_kernels_at_startup(tiny_model_dir, caplog, cpu_isa):
    """The invariance probes run when the runner is built, not inside the first request: torch's ops
    (row plans per linear, grouped attention) and specfw's kernels (whose probe finds every linear
    row-independent: unpadded 64-row calls)."""
    import logging
    from specfw.backends import make_backend
    from specfw.backends.kernel_linear import KernelLinear
    from specfw.cpu_linear import FastLinear, mkl_packing_available

    lm = load_model(str(tiny_model_dir))
    backend = make_backend("cpu", batch_invariant=True, cpu_isa=cpu_isa)
    with caplog.at_level(logging.INFO, logger="specfw.model_runner"):
        ModelRunner(lm.model, lm.hf_config, 64, torch.float32, backend=backend)
    assert "batch invariance on cpu" in caplog.text
    if backend.name == "cpu":
        linears = [m for m in lm.model.modules() if isinstance(m, KernelLinear)]
        assert len(linears) == 4 * lm.model.num_layers + 1  # qkv, o, gate_up, down per layer; lm_head
        assert all(m.row_plan().block == 64 and not m.row_plan().pad for m in linears)
        assert "'64': %d" % len(linears) in caplog.text
        return
    assert "grouped_attention" in caplog.text
    linears = [m for m in lm.model.modules() if isinstance(m, FastLinear)]
    assert len(linears) > lm.model.num_layers if mkl_packing_available() else not linears  # qkv, o, gate_up, down, lm_head
    assert all(m._row_plan[0] == torch.get_num_threads() for m in linears)


def test_engine_times_linear_plans_for_its_typical_forward(tiny_model_dir):
    """Batch-invariant row plans are timed for the forwards the engine will run: one-row steps and
    the draft tree (num_draft_tokens rows) with a speculative algorithm, a batch of 8 plain decode
    rows without one."""
    from conftest import make_cfg
    from specfw.cpu_linear import FastLinear, mkl_packing_available
    from specfw.engine import Engine
    from specfw_plugins.ngram.config import NgramConfig

    if not mkl_packing_available():
        pytest.skip("no MKL packed GEMM: the linears are not swapped")
    for spec, rows in ((NgramConfig(algorithm="ngram", num_draft_tokens=6), 6), (None, 8)):
        eng = Engine(make_cfg(model_path=str(tiny_model_dir), max_total_tokens=256, batch_invariant=True, speculative=spec, cpu_isa="none"))
        linears = [m for m in eng.runner.model.modules() if isinstance(m, FastLinear)]
        assert linears and all(m.timed_rows == (1, rows) for m in linears)
        assert (eng.tree_shape.num_draft_tokens if spec else eng.tree_shape) == (6 if spec else None)

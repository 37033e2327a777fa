"""Attention plans: the batch-invariant plan gives every decode / tree row exactly the bits of a
one-row decode over the keys it may see."""

import pytest
import torch

from specfw.attention import Group, attend, plan_attention
from specfw.forward_batch import SeqSpan

H, HKV, D = 6, 2, 32


def _cache(dtype, slots=600):
    g = torch.Generator().manual_seed(0)
    return (torch.randn(slots, HKV, D, generator=g).to(dtype), torch.randn(slots, HKV, D, generator=g).to(dtype))


def _decode_row(q_row, k, v, slots):
    """The reference: a lone decode step of one token attending over ``slots``."""
    span = SeqSpan(q_start=0, q_len=1, kv_slots=slots)
    return attend(q_row[None], k, v, plan_attention([span], q_row.device, True), D**-0.5)[0]


@pytest.mark.parametrize("upcast", [None, True, False])
@pytest.mark.parametrize("group_rows", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tree_rows_equal_decode_rows_bitwise(dtype, group_rows, upcast, monkeypatch):
    """``upcast`` None: float32 SDPA for bf16 one-row queries where measured faster; True/False force it."""
    if upcast is not None:
        if dtype == torch.float32:
            pytest.skip("upcasting applies to bf16 only")
        monkeypatch.setattr("specfw.attention._upcast_one_row_queries", lambda *a: upcast)
    k, v = _cache(dtype)
    prefix = torch.arange(10, 310)  # committed context, one run
    tree = torch.tensor([400, 401, 402, 403, 404, 405])  # root, two children, grandchildren
    tree_mask = torch.tensor(
        [[1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [1, 0, 1, 0, 0, 0], [1, 1, 0, 1, 0, 0], [1, 0, 1, 0, 1, 0], [1, 1, 0, 1, 0, 1]], dtype=torch.bool
    )
    other = SeqSpan(q_start=0, q_len=1, kv_slots=torch.arange(320, 390))  # another request decoding
    span = SeqSpan(q_start=1, q_len=6, kv_slots=torch.cat([prefix, tree]), tree_mask=tree_mask)
    q = torch.randn(7, H, D).to(dtype)
    plan = plan_attention([other, span], q.device, batch_invariant=True, group_rows=group_rows)
    assert any(isinstance(p, Group) for p in plan) == group_rows  # rows of the same depth share a call
    out = attend(q, k, v, plan, D**-0.5)
    assert torch.equal(out[0], _decode_row(q[0], k, v, other.kv_slots))
    for i in range(6):
        visible = torch.cat([prefix, tree[tree_mask[i]]])
        assert torch.equal(out[1 + i], _decode_row(q[1 + i], k, v, visible)), i


def test_batch_invariant_plan_matches_masked_plan_numerically():
    k, v = _cache(torch.float32)
    spans = [
        SeqSpan(q_start=0, q_len=1, kv_slots=torch.arange(0, 50)),
        SeqSpan(q_start=1, q_len=1, kv_slots=torch.arange(100, 150)),
        SeqSpan(q_start=2, q_len=4, kv_slots=torch.arange(200, 240)),  # causal extend after a prefix
        SeqSpan(q_start=6, q_len=20, kv_slots=torch.arange(300, 320)),
    ]  # prompt prefill
    q = torch.randn(26, H, D)
    exact = attend(q, k, v, plan_attention(spans, q.device, True), D**-0.5)
    masked = attend(q, k, v, plan_attention(spans, q.device, False), D**-0.5)
    torch.testing.assert_close(exact, masked, rtol=1e-5, atol=1e-6)

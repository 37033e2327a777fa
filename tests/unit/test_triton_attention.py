"""specfw's Triton attention kernel (``triton/attention.py``) against a float64 reference, on the
CPU under Triton's interpreter (``TRITON_INTERPRET=1``, set by conftest where there is no CUDA)
or on CUDA; and the per-row key layout it reads (``backends/row_layout.py``, pure torch)."""

import pytest
import torch

from specfw import triton as tr
from specfw.backends.row_layout import RowLayout, reference_attention
from specfw.forward_batch import SeqSpan

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_triton = pytest.mark.skipif(not tr.available(DEVICE), reason=tr.unavailable_reason(DEVICE))


def _tree_mask(parents: list[int]) -> torch.Tensor:
    n = len(parents)
    m = torch.eye(n, dtype=torch.bool)
    for i in range(1, n):
        m[i] |= m[parents[i]]
    return m


def _batch(gen: torch.Generator):
    """A decode row, a tree (with a chain branch), a causal prompt, an extend after a prefix, a
    chain tree and a tree whose mask also covers two earlier drafted nodes."""
    perm = torch.randperm(200, generator=gen)
    take = iter(range(200))

    def slots(n):
        return torch.stack([perm[next(take)] for _ in range(n)])

    tree = [-1, 0, 0, 1, 1, 2, 5, 6]
    chain = [-1, 0, 1, 2, 3]
    wide = torch.zeros(3, 5, dtype=torch.bool)
    wide[:, :2] = True  # two earlier drafted nodes every row sees
    wide[:, 2:] = _tree_mask([-1, 0, 0])
    spans, q = [], 0
    for n_prefix, q_len, mask in [(17, 1, None), (37, 8, _tree_mask(tree)), (0, 9, None), (23, 4, None), (5, 5, _tree_mask(chain)), (11, 3, wide)]:
        m = 0 if mask is None else mask.shape[1] - q_len
        spans.append(SeqSpan(q, q_len, slots(n_prefix + m + q_len), mask))
        q += q_len
    return spans, q


def _kv(gen, dtype, slots=200, kv_heads=3, head_dim=64):
    k = torch.randn(slots, kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(slots, kv_heads, head_dim, generator=gen).to(dtype)
    return k.to(DEVICE), v.to(DEVICE)


def test_row_layout_lists_each_rows_keys_in_cache_order():
    s_tree = SeqSpan(0, 3, torch.tensor([7, 8, 9, 20, 21, 22]), _tree_mask([-1, 0, 0]))
    s_prompt = SeqSpan(3, 3, torch.tensor([30, 31, 32]))
    s_decode = SeqSpan(6, 1, torch.tensor([1, 2, 3, 4]))
    lay = RowLayout.build([s_tree, s_prompt, s_decode])
    assert lay.row_q.tolist() == [0, 1, 2, 3, 4, 5, 6]
    got = [lay.keys(r).tolist() for r in range(lay.rows)]
    assert got == [[7, 8, 9, 20], [7, 8, 9, 20, 21], [7, 8, 9, 20, 22], [30], [30, 31], [30, 31, 32], [1, 2, 3, 4]]


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 4, 48), (8, 2, 16)])
def test_row_attention_matches_float64_reference(dtype, heads, kv_heads, head_dim):
    from specfw.triton.attention import row_attention

    gen = torch.Generator().manual_seed(heads * 100 + head_dim)
    spans, T = _batch(gen)
    lay = RowLayout.build(spans)
    k, v = _kv(gen, dtype, kv_heads=kv_heads, head_dim=head_dim)
    q = torch.randn(T, heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    out = row_attention(q, k, v, torch.empty_like(q), head_dim**-0.5, lay.to(torch.device(DEVICE)), block_n=8)
    ref = reference_attention(q, k, v, head_dim**-0.5, lay)
    tol = 2e-5 if dtype == torch.float32 else 2e-2  # bf16: the output's own rounding
    assert (out.double().cpu() - ref).abs().max().item() < tol


@needs_triton
def test_a_rows_bits_do_not_depend_on_the_batch_or_where_its_prefix_ends():
    """Batch invariant by construction: a row alone == the same row in a batch; a tree node ==
    the plain decode row over the same keys (its prefix longer, its extras only itself)."""
    from specfw.triton.attention import row_attention

    gen = torch.Generator().manual_seed(3)
    spans, T = _batch(gen)
    k, v = _kv(gen, torch.float32)
    q = torch.randn(T, 9, 64, generator=gen).to(DEVICE)
    dev = torch.device(DEVICE)
    together = row_attention(q, k, v, torch.zeros_like(q), 0.125, RowLayout.build(spans).to(dev), block_n=8)
    tree = spans[1]  # rows 1..8; node 6's path is 0 -> 2 -> 5 -> 6
    alone = row_attention(q, k, v, torch.zeros_like(q), 0.125, RowLayout.build([tree]).to(dev), block_n=8)
    assert torch.equal(alone[1:9], together[1:9])
    node, path = 7, [0, 2, 5, 6, 7]  # tree row 7 = q row 8
    keys = torch.cat([tree.kv_slots[:37], tree.kv_slots[37:][path]])  # 37: the split is inside a block of 8
    q_plain = torch.zeros_like(q)
    q_plain[0] = q[1 + node]
    plain = row_attention(q_plain, k, v, torch.zeros_like(q), 0.125, RowLayout.build([SeqSpan(0, 1, keys)]).to(dev), block_n=8)
    assert torch.equal(plain[0], together[1 + node])


@needs_triton
def test_rows_no_layout_row_names_are_left_alone():
    from specfw.triton.attention import row_attention

    gen = torch.Generator().manual_seed(4)
    k, v = _kv(gen, torch.float32)
    q = torch.randn(3, 9, 64, generator=gen).to(DEVICE)
    out = torch.full_like(q, 7.0)
    row_attention(q, k, v, out, 0.125, RowLayout.build([SeqSpan(1, 1, torch.tensor([3, 4]))]).to(torch.device(DEVICE)))
    assert (out[0] == 7).all() and (out[2] == 7).all() and not (out[1] == 7).all()
    empty = RowLayout.build([])
    assert empty.rows == 0 and row_attention(q, k, v, out, 0.125, empty) is out


def test_row_layout_packs_into_one_aligned_buffer_for_the_device():
    """What ``RowLayout.to`` copies to a GPU in one go: every array at a 64-byte aligned start of
    one int32 buffer, each view equal to the host array (a decode row beside a tree's rows)."""
    from specfw.backends.row_layout import pack_aligned, unpack

    tree = torch.tril(torch.ones(4, 4, dtype=torch.bool))
    lay = RowLayout.build([SeqSpan(0, 1, torch.arange(300)), SeqSpan(1, 4, torch.arange(300, 404), tree)])
    parts = (lay.row_q, lay.seg_start, lay.seg_len, lay.ext_start, lay.ext_len, lay.slots, lay.ext_slots)
    flat, starts = pack_aligned(parts)
    views = unpack(flat, starts, parts)
    assert all(torch.equal(v, t) for v, t in zip(views, parts)) and flat.dtype == torch.int32
    assert all(v.storage_offset() % 16 == 0 for v in views) and len({v.storage_offset() for v in views}) == len(views)
    assert lay.ext_len.tolist() == [0, 1, 2, 3, 4] and lay.seg_len.tolist() == [300, 100, 100, 100, 100]

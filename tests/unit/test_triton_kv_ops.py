"""Moving accepted tree paths' KV in one Triton launch (``triton/kv_ops.py``) against the torch
path of ``KVPool.move`` (Triton's interpreter on a CPU; CUDA where there is one)."""

import pytest
import torch

from specfw import triton as tr
from specfw.kv_cache import KVPool

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(not tr.available(DEVICE), reason=tr.unavailable_reason(DEVICE))


@pytest.mark.parametrize("keep", [[0, 2, 3], [0, 1, 2], [0, 3, 5, 6, 7], [0]])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_move_kv_matches_the_torch_move_even_where_sources_and_destinations_overlap(keep, dtype):
    from specfw.triton.kv_ops import move_kv

    g = torch.Generator().manual_seed(len(keep))
    ref = KVPool(3, 2, 24, 40, dtype, "cpu")
    for t in (ref.k_all, ref.v_all):
        t.copy_(torch.randn(t.shape, generator=g).to(dtype))
    slots = torch.tensor([4, 5, 6, 7, 20, 21, 22, 23])  # a reservation: keep[i] >= i, so dst[i] <= src[i]
    src, dst = slots[torch.tensor(keep)], slots[: len(keep)]
    k_all, v_all = ref.k_all.clone().to(DEVICE), ref.v_all.clone().to(DEVICE)
    move_kv(k_all, v_all, src.to(DEVICE), dst.to(DEVICE), block=16)
    ref.move(src, dst)  # the torch path on a CPU pool
    assert torch.equal(k_all.cpu(), ref.k_all) and torch.equal(v_all.cpu(), ref.v_all)
    assert all(torch.equal(ref.k[i], ref.k_all[i]) for i in range(3))  # the per-layer tensors are views of one buffer

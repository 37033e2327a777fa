import pytest
import torch

from specfw.kv_cache import KVPool, KVPoolExhausted, SlotAllocator, SlotTable


def test_alloc_free_reuse():
    a = SlotAllocator(8)
    s1 = a.alloc(3)
    s2 = a.alloc(2)
    assert a.num_free == 3 and a.num_used == 5
    assert len(set(s1.tolist()) | set(s2.tolist())) == 5
    a.free(s1)
    assert a.num_free == 6
    s3 = a.alloc(6)
    assert set(s3.tolist()) == set(range(8)) - set(s2.tolist())  # freed slots are reused


def test_alloc_order_dtype_and_views():
    a = SlotAllocator(8)
    s = a.alloc(3)
    assert s.tolist() == [0, 1, 2] and s.dtype == torch.long and s.device.type == "cpu"
    a.free(s)
    assert torch.equal(a.alloc(3), s)  # a stack: the freed slots come back in the same order
    a.free(s)
    both = a.alloc(6).view(2, 3)
    a.free(both[:, ::2])  # a strided 2-d view: its slots go back
    assert a.num_free == 6 and sorted(a.alloc(6).tolist()) == [0, 2, 3, 5, 6, 7]


def test_exhaustion_raises_and_leaves_state_intact():
    a = SlotAllocator(4)
    a.alloc(3)
    with pytest.raises(KVPoolExhausted, match="asked for 2 slots, 1 free"):
        a.alloc(2)
    assert a.num_free == 1
    assert a.can_alloc(1) and not a.can_alloc(2)


def test_double_free_detected():
    a = SlotAllocator(2)
    s = a.alloc(2)
    a.free(s)
    with pytest.raises(RuntimeError, match="double free"):
        a.free(s)


def test_slot_table_grows_and_truncates():
    t = SlotTable(capacity=2)
    t.append(torch.tensor([5, 6]))
    t.append(torch.tensor([7, 8, 9]))
    assert t.slots().tolist() == [5, 6, 7, 8, 9]
    dropped = t.truncate(2)
    assert dropped.tolist() == [7, 8, 9] and t.slots().tolist() == [5, 6]


def test_pool_budget_and_write():
    n = KVPool.slots_for_budget(2**20, num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float32)
    assert n == 2**20 // (2 * 2 * 2 * 8 * 4)
    pool = KVPool(2, 2, 8, 16)
    slots = pool.allocator.alloc(3)
    k = torch.randn(3, 2, 8)
    pool.write(1, slots, k, -k)
    assert torch.equal(pool.k[1][slots], k) and torch.equal(pool.v[1][slots], -k)
    assert pool.usage() == 3 / 16


def test_no_leak_after_abort_and_finish(tiny_engine):
    from specfw.sampling import SamplingParams

    eng = tiny_engine
    free0 = eng.runner.allocator.num_free
    reqs = [eng.add_request(eng.make_request([10 + i] * (5 + i), SamplingParams(max_new_tokens=50, temperature=0, ignore_eos=True))) for i in range(4)]
    for _ in range(3):
        eng.step()
    assert eng.runner.allocator.num_free < free0
    out = eng.abort(reqs[1].rid)
    assert out.finished and out.finish_reason == "abort"
    assert eng.abort("no-such-request") is None
    while eng.has_work:
        eng.step()
    assert eng.runner.allocator.num_free + eng.scheduler.cache.size == free0 and eng.scheduler.kv_in_use == 0  # the rest is cached
    assert [r.finish_reason for r in reqs] == ["length", "abort", "length", "length"]


def test_move_copies_every_layer_and_allows_overlap():
    pool = KVPool(num_layers=3, num_kv_heads=2, head_dim=4, num_slots=16)
    for layer in range(3):
        pool.k[layer][:16] = torch.arange(16.0)[:, None, None] + layer * 100
        pool.v[layer][:16] = -pool.k[layer][:16]
    pool.move(torch.tensor([4, 6, 9]), torch.tensor([4, 5, 6]))  # slot 6 is read before it is overwritten
    for layer in range(3):
        assert pool.k[layer][4:7, 0, 0].tolist() == [4 + layer * 100, 6 + layer * 100, 9 + layer * 100]
        assert torch.equal(pool.v[layer][4:7], -pool.k[layer][4:7])


def test_commit_kv_keeps_a_request_in_one_run():
    """After a verify accepts a path off the first branch, the scheduler keeps the request's KV
    one ascending run of slots (attention reads it as a view) and nothing leaks."""
    from specfw.request import Request
    from specfw.sampling import SamplingParams
    from specfw.scheduler import ScheduledBatch, Scheduler
    from specfw.step import VerifyResult

    pool = KVPool(num_layers=2, num_kv_heads=1, head_dim=2, num_slots=32)
    sched = Scheduler(pool, 4, 64, 64, slots_per_decode=6)
    req = Request(prompt_ids=list(range(10)), params=SamplingParams(max_new_tokens=20))
    req.slots.append(pool.allocator.alloc(10))
    sched.running.append(req)
    tree = pool.allocator.alloc(6)
    for layer in range(2):
        pool.k[layer][tree] = tree.float()[:, None, None]
    sched.update(ScheduledBatch("decode", [req], [tree]), [VerifyResult([0, 2, 5], [7, 8, 9], 5)])
    slots = req.slots.slots()
    assert torch.equal(slots, torch.arange(int(slots[0]), int(slots[0]) + 13))
    assert pool.k[1][slots[10:], 0, 0].tolist() == [float(tree[0]), float(tree[2]), float(tree[5])]
    assert pool.allocator.num_used == 13
    assert req.output_ids == [7, 8, 9]
    nxt = pool.allocator.alloc(4)  # the next tree continues the run
    assert int(nxt[0]) == int(slots[-1]) + 1

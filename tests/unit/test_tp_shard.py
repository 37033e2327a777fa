"""What each tensor-parallel rank keeps (specfw.tp.shard), without starting ranks."""

from types import SimpleNamespace

import pytest
import torch

from specfw.backends.quant_linear import pack, quantize, unpack
from specfw.config import ConfigError
from specfw.tp.shard import even_split, partition, take_quant

DEMO = SimpleNamespace(num_attention_heads=9, num_key_value_heads=3, intermediate_size=1536, vocab_size=49152)


def test_even_split_covers_every_unit_once():
    for n, parts, unit in [(3, 2, 1), (1536, 2, 32), (100, 3, 1), (7, 7, 1), (96, 2, 32)]:
        spans = [even_split(n, parts, r, unit) for r in range(parts)]
        assert spans[0][0] == 0 and spans[-1][1] == n // unit * unit
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
        assert all(s % unit == 0 and e % unit == 0 and e > s for s, e in spans)
        sizes = [e - s for s, e in spans]
        assert max(sizes) - min(sizes) <= unit


def test_demo_model_over_two_ranks_splits_kv_groups_two_and_one():
    p0, p1 = partition(DEMO, 0, 2), partition(DEMO, 1, 2)
    assert (p0.kv_heads, p1.kv_heads) == ((0, 2), (2, 3))
    assert p0.q_per_kv == 3
    assert (p0.intermediate, p1.intermediate) == ((0, 768), (768, 1536))
    assert (p0.vocab_start, p1.vocab_start, p0.vocab_width) == (0, 24576, 24576)


def test_more_ranks_than_kv_heads_is_a_config_error_naming_the_key():
    with pytest.raises(ConfigError, match="model.tp_size") as e:
        partition(DEMO, 0, 4)
    assert "3" in str(e.value)


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_unpack_inverts_pack_and_take_quant_equals_quantizing_the_slice(scheme):
    torch.manual_seed(0)
    w = torch.randn(40, 128)
    qw = quantize(w, scheme)
    codes, scale, minv = unpack(qw)
    again = pack(codes, scale, minv, qw.bits, qw.offset, qw.group)
    assert torch.equal(again.codes, qw.codes) and torch.equal(again.scale, qw.scale) and torch.equal(again.minv, qw.minv)
    rows = torch.tensor([3, 4, 5, 30, 31, 39])
    part = take_quant(qw, rows, slice(32, 96) if scheme == "int4" else None)
    c, s, m = unpack(part)
    ref_c = codes[rows][:, 32:96] if scheme == "int4" else codes[rows]
    assert torch.equal(c, ref_c)
    assert torch.equal(s, scale[rows][:, 1:3] if scheme == "int4" else scale[rows])
    assert (m is None) == (scheme == "int8")


def test_a_shard_boundary_inside_a_quantization_group_is_refused():
    qw = quantize(torch.randn(16, 128), "int4")
    with pytest.raises(ConfigError, match="splits a quantization group"):
        take_quant(qw, None, slice(0, 48))


@pytest.mark.skipif(not __import__("specfw.tp.shm", fromlist=["supported"]).supported(), reason="shared-memory collectives are x86 + /dev/shm only")
def test_shared_memory_all_gather_between_two_ranks_over_many_rounds(tmp_path):
    """Two ranks (threads here, processes in use) mapping one file: every round each sees both
    tensors of that round, never a slot of the round before (parity double buffering)."""
    import threading

    from specfw.tp import shm

    path = str(tmp_path / "tp-shm")
    shm.create(path, 2)
    ranks = [shm.ShmCollectives(path, r, 2) for r in range(2)]
    seen = {0: [], 1: []}

    def run(r):
        for i in range(300):
            x = torch.full((3, 5), float(1000 * r + i))
            parts = ranks[r].all_gather(x)
            seen[r].append((float(parts[0][0, 0]), float(parts[1][2, 4])))

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    expected = [(float(i), float(1000 + i)) for i in range(300)]
    assert seen[0] == expected and seen[1] == expected
    big = torch.zeros(shm.SLOT_BYTES // 4 + 1)
    assert not ranks[0].fits(big)  # larger tensors go through gloo
    for r in ranks:
        r.close()

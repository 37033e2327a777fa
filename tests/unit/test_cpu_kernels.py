"""specfw's compiled CPU kernels (kernels/cpu_ops.cpp) on every instruction set this CPU runs:
the portable build everywhere, AVX2 and AVX-512 where the flags allow (skipped elsewhere).
Values against a float64 reference; every row's bits independent of the other rows, of the
thread count and of the tree it sits in (a tree row == the lone decode row of the same context)."""

from pathlib import Path

import pytest
import torch

from specfw.kernels import ISAS, cpu_isa, cpu_ops, isa_supported
from specfw.forward_batch import SeqSpan


def _ops(isa):
    if not isa_supported(isa):
        pytest.skip(f"this CPU cannot run {isa} code")
    ops = cpu_ops(isa)
    assert ops is not None, f"the {isa} build failed"  # gcc and ninja are on every machine here
    assert ops.isa() == isa
    return ops


isas = pytest.mark.parametrize("isa", ISAS)


def test_auto_isa_is_the_best_the_cpu_has(monkeypatch):
    monkeypatch.delenv("SPECFW_CPU_ISA", raising=False)
    best = next(i for i in ISAS if isa_supported(i))
    assert cpu_isa() == best and cpu_isa("auto") == best
    assert cpu_isa("portable") == "portable"
    monkeypatch.setenv("SPECFW_CPU_ISA", "portable")
    assert cpu_isa() == "portable"
    with pytest.raises(ValueError, match="allowed"):
        cpu_isa("sse9")


def test_build_all_builds_every_isa_the_cpu_runs_side_by_side(monkeypatch):
    """``build_all``: the auto ISA and the portable build by default, every ISA this CPU runs with
    ``every_isa``, each kernel family and the bf16 kernels where the CPU has them; the builds run
    on worker threads, one module per cache key."""
    import threading
    from specfw import kernels

    monkeypatch.delenv("SPECFW_CPU_ISA", raising=False)
    built = {}
    for fam in ("cpu_ops", "quant_ops", "q8_ops", "w8a8_ops"):
        monkeypatch.setattr(kernels, fam, lambda isa, fam=fam: built.setdefault((fam, isa), threading.current_thread().name))
    monkeypatch.setattr(kernels, "bf16_dot", lambda: built.setdefault(("bf16_dot", None), threading.current_thread().name))
    monkeypatch.setattr(kernels, "bf16_amx", lambda: None)  # a failed / impossible build reports False
    runs = [i for i in ISAS if isa_supported(i)]
    w8a8 = [i for i in kernels.W8A8_ISAS if kernels.w8a8_isa_supported(i)]  # its amx build where the CPU has AMX-INT8
    q8 = [i for i in kernels.Q8_ISAS if kernels.q8_isa_supported(i)]  # likewise
    every = kernels.build_all(every_isa=True, workers=2)
    want = {p + i for i in runs for p in ("", "quant_")} | {"q8_" + i for i in q8} | {"w8a8_" + i for i in w8a8}
    assert {k for k in every if not k.startswith("bf16")} == want
    want_built = {(f, i) for i in runs for f in ("cpu_ops", "quant_ops")} | {("q8_ops", i) for i in q8} | {("w8a8_ops", i) for i in w8a8}
    assert {(f, i) for f, i in built if f != "bf16_dot"} == want_built
    assert all(every[k] for k in every if k != "bf16_amx") and every.get("bf16_amx", False) is False
    assert ("bf16_dot" in every) == kernels.cpu_has_avx512_bf16()
    assert threading.main_thread().name not in built.values()  # on the pool's threads
    default = kernels.build_all()
    want = {p + i for i in dict.fromkeys([cpu_isa(), "portable"]) for p in ("", "quant_")}
    want |= {"q8_" + i for i in dict.fromkeys([cpu_isa(), kernels.q8_isa(), "portable"])}  # the amx build too, where the CPU has AMX-INT8
    assert {k for k in default if not k.startswith("bf16")} == want | {"w8a8_" + i for i in dict.fromkeys([kernels.w8a8_isa(), "portable"])}


def test_a_killed_builds_lock_file_does_not_hang_the_next_load(tmp_path, monkeypatch):
    """torch marks a build in progress with a ``lock`` file that outlives a killed build (a first
    ``specfw serve`` stopped while compiling); the next load used to wait on it forever. A load
    holds an OS lock (released when its process dies), and a ``lock`` file found while holding it
    is removed before torch looks; a second process cannot take the OS lock meanwhile."""
    import subprocess
    import sys

    import torch.utils.cpp_extension as cpp
    from specfw import kernels

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.delenv("SPECFW_NO_KERNELS", raising=False)
    seen = {}

    def another_process_can_lock(build_dir) -> bool:
        probe = f"import fcntl; f = open({str(build_dir) + '.specfw-lock'!r}, 'w'); fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)"
        return subprocess.run([sys.executable, "-c", probe], capture_output=True).returncode == 0

    def fake_load(name, **kw):
        build_dir = tmp_path / name
        seen["lock left"] = (build_dir / "lock").exists()
        seen["other process locked out"] = not another_process_can_lock(build_dir)
        return "module"

    monkeypatch.setattr(cpp, "load", fake_load)
    name = "specfw_q8_ops_portable"
    src = kernels._Q8_SOURCE
    tag_dirs_before = set(tmp_path.iterdir())
    # a killed build's leftover, in the directory the next load of this source uses
    kernels._load(src, name, [], "probe")  # creates the build directory (torch's helper)
    (build_dir,) = [d for d in tmp_path.iterdir() if d.is_dir() and d not in tag_dirs_before]
    (build_dir / "lock").write_text("")
    assert kernels._load(src, name, [], "probe") == "module"
    assert seen == {"lock left": False, "other process locked out": True}
    assert not (build_dir / "lock").exists()
    assert another_process_can_lock(build_dir)  # released once the load returned


def test_two_checkouts_of_one_source_compile_the_same_file(tmp_path, monkeypatch):
    """torch's build file names its sources, and the torch headers and libraries, by absolute path:
    two checkouts on one machine (a fresh clone beside a working copy) sharing the extension cache
    rewrote each other's build file and recompiled on every load. A load compiles the build
    directory's own copy of the source and its headers, so checkouts on one torch installation
    hand torch the same file; another installation (venv) gets a build of its own."""
    import shutil

    import torch.utils.cpp_extension as cpp
    from specfw import kernels

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    monkeypatch.delenv("SPECFW_NO_KERNELS", raising=False)
    compiled = []
    monkeypatch.setattr(cpp, "load", lambda name, sources, **kw: compiled.append((name, sources)) or "module")
    checkouts = []
    for clone in ("a", "b"):
        kdir = tmp_path / clone / "core" / "kernels"
        kdir.mkdir(parents=True)
        for f in [kernels._OPS_SOURCE, *kernels._OPS_SOURCE.parent.glob("*.h")]:
            shutil.copy(f, kdir / f.name)
        checkouts.append(kdir / kernels._OPS_SOURCE.name)
        assert kernels._load(checkouts[-1], "specfw_cpu_ops_portable", [], "probe") == "module"
    (name_a, [src_a]), (name_b, [src_b]) = compiled
    assert name_a == name_b and src_a == src_b
    assert Path(src_a).is_relative_to(tmp_path / "ext") and Path(src_a).read_bytes() == checkouts[0].read_bytes()
    for header in kernels._OPS_SOURCE.parent.glob("*.h"):  # #include "..." resolves beside the copy
        assert (Path(src_a).parent / header.name).read_bytes() == header.read_bytes()
    # another torch installation (a second venv: other include paths in torch's build file) is
    # another build, so two venvs never rebuild each other's
    monkeypatch.setattr(kernels, "_torch_dir", lambda: "/elsewhere/.venv/lib/python3.11/site-packages/torch")
    kernels._load(checkouts[0], "specfw_cpu_ops_portable", [], "probe")
    assert compiled[-1][0] != name_a
    monkeypatch.undo()
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    monkeypatch.delenv("SPECFW_NO_KERNELS", raising=False)
    monkeypatch.setattr(cpp, "load", lambda name, sources, **kw: compiled.append((name, sources)) or "module")
    # an edited source is another build (the hash in the name), never a stale copy
    checkouts[1].write_text(checkouts[1].read_text() + "\n// edited\n")
    kernels._load(checkouts[1], "specfw_cpu_ops_portable", [], "probe")
    name_c, [src_c] = compiled[-1]
    assert name_c != name_a and Path(src_c).read_text().endswith("// edited\n")


def test_forcing_an_isa_the_cpu_lacks_names_the_key(tiny_model_dir):
    from conftest import make_cfg
    from specfw.config import ConfigError, validate

    cfg = make_cfg(cpu_isa="avx9")
    with pytest.raises(ConfigError) as e:
        validate(cfg)
    assert e.value.key == "engine.cpu_isa" and "portable" in str(e.value)
    missing = [i for i in ("avx512", "avx2") if not isa_supported(i)]
    if missing:
        with pytest.raises(ConfigError) as e:
            validate(make_cfg(cpu_isa=missing[0]))
        assert e.value.key == "engine.cpu_isa" and "cannot run" in str(e.value)


@isas
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,k,bias", [(960, 576, False), (50, 577, True), (17, 64, True), (1536, 576, False)])
def test_linear_values_and_row_independence(isa, dtype, n, k, bias):
    ops = _ops(isa)
    g = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g) if bias else torch.empty(0)
    packed = ops.pack(w)
    for rows in (1, 2, 3, 5, 8, 13, 16, 33):
        x = torch.randn(rows, k, generator=g).to(dtype)
        y = ops.linear(x, packed, n, b)
        assert y.dtype == dtype and y.shape == (rows, n)
        ref = x.double() @ w.double().t() + (b.double() if bias else 0)
        tol = 1e-5 if dtype == torch.float32 else 8e-3  # bf16: one rounding of the fp32 sum
        assert (y.double() - ref).abs().max() <= tol * ref.abs().max()
        alone = torch.cat([ops.linear(x[i : i + 1], packed, n, b) for i in range(rows)])
        assert torch.equal(y, alone), f"{rows} rows: a row's bits depend on the other rows"


@isas
def test_linear_rows_do_not_depend_on_the_thread_count(isa):
    ops = _ops(isa)
    w, x = torch.randn(3072, 576), torch.randn(9, 576)
    packed = ops.pack(w)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = ops.linear(x, packed, 3072, torch.empty(0))
        torch.set_num_threads(2)
        two = ops.linear(x, packed, 3072, torch.empty(0))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


@isas
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_prefetch_setting_changes_no_bit(isa, dtype):
    """``set_spread_prefetch`` (``engine.cpu_linear_prefetch``) only moves prefetches between row
    tiles: the same bits at every row count, one and several tiles, fp32 and bf16 weights (8-lane
    builds spread fp32 weights' prefetches only), and bf16 weights in the vdpbf16ps layout where the
    build has it (``pack_dot``: its full 8-row tiles take turns)."""
    ops = _ops(isa)
    g = torch.Generator().manual_seed(7)
    w = torch.randn(100, 576, generator=g).to(dtype)
    layouts = [ops.pack(w)] + ([ops.pack_dot(w)] if dtype == torch.bfloat16 and ops.has_bf16_dot() else [])
    was = ops.spread_prefetch()
    try:
        for packed in layouts:
            for rows in (5, 9, 16, 24, 33):
                x = torch.randn(rows, 576, generator=g).to(dtype)
                ops.set_spread_prefetch(True)
                assert ops.spread_prefetch()
                spread = ops.linear(x, packed, 100, torch.empty(0))
                ops.set_spread_prefetch(False)
                assert not ops.spread_prefetch()
                assert torch.equal(spread, ops.linear(x, packed, 100, torch.empty(0)))
    finally:
        ops.set_spread_prefetch(was)


@isas
def test_the_prefetch_row_count_changes_no_bit(isa):
    """``set_linear_prefetch_rows``: from how many rows a linear prefetches the next work item. Every row
    count gives the same bits with prefetching from one row or never; the default follows the CPU."""
    from specfw import kernels

    ops = _ops(isa)
    g = torch.Generator().manual_seed(11)
    w = torch.randn(200, 576, generator=g)
    packed, was = ops.pack(w), ops.linear_prefetch_rows()
    assert was == kernels.default_prefetch_rows(isa)
    try:
        for rows in range(1, 10):
            x = torch.randn(rows, 576, generator=g)
            ops.set_linear_prefetch_rows(1)
            early = ops.linear(x, packed, 200, torch.empty(0))
            ops.set_linear_prefetch_rows(64)
            assert ops.linear_prefetch_rows() == 64
            assert torch.equal(early, ops.linear(x, packed, 200, torch.empty(0)))
    finally:
        ops.set_linear_prefetch_rows(was)


def test_prefetch_rows_default_by_cpu(monkeypatch):
    from specfw import kernels

    monkeypatch.setattr(kernels, "cpu_vendor", lambda: "GenuineIntel")
    assert [kernels.default_prefetch_rows(i) for i in ("avx512", "avx2", "portable")] == [2, 2, 3]
    monkeypatch.setattr(kernels, "cpu_vendor", lambda: "AuthenticAMD")
    assert [kernels.default_prefetch_rows(i) for i in ("avx512", "avx2", "portable")] == [5, 3, 3]


def test_linear_prefetch_follows_the_config_and_the_cpu_vendor(monkeypatch):
    """``auto``: the first tile alone on an Intel CPU, every tile in turn elsewhere (also the
    build's own setting when it loads, for users without a config); a value not allowed names the
    key and the allowed values."""
    from conftest import make_cfg
    from specfw import kernels
    from specfw.backends.cpu import CpuBackend
    from specfw.config import ConfigError, validate

    with pytest.raises(ConfigError) as e:
        validate(make_cfg(cpu_linear_prefetch="every"))
    assert e.value.key == "engine.cpu_linear_prefetch" and "first_tile" in str(e.value)
    ops = _ops("avx512")  # only AVX-512 builds spread
    backend = CpuBackend(ops, "avx512")
    was = ops.spread_prefetch()
    try:
        monkeypatch.setattr(kernels, "cpu_vendor", lambda: "GenuineIntel")
        assert backend.set_linear_prefetch("auto") is False and backend.set_linear_prefetch("spread") is True
        monkeypatch.setattr(kernels, "cpu_vendor", lambda: "AuthenticAMD")
        assert backend.set_linear_prefetch("auto") is True and backend.set_linear_prefetch("first_tile") is False
    finally:
        ops.set_spread_prefetch(was)
    monkeypatch.undo()
    assert kernels.cpu_vendor() in ("GenuineIntel", "AuthenticAMD", "")
    kernels._cache.pop("cpu_ops_avx512")  # loaded again (the build is cached on disk): the CPU's default
    assert kernels.cpu_ops("avx512").spread_prefetch() == kernels.default_spread_prefetch()


def test_avx2_and_avx512_linears_round_alike():
    """Both accumulate with FMA in k order: the same bits, so a machine's results do not depend on
    which of the two it runs."""
    a, b = _ops("avx2"), _ops("avx512")
    w, x = torch.randn(100, 300), torch.randn(5, 300)
    assert torch.equal(a.linear(x, a.pack(w), 100, torch.empty(0)), b.linear(x, b.pack(w), 100, torch.empty(0)))


def _reference(q, k_cache, v_cache, slots, scale):
    """[H, D] float64 attention of one query row over ``slots``."""
    H, Hkv = q.shape[0], k_cache.shape[1]
    k = k_cache[slots].double().repeat_interleave(H // Hkv, 1)
    v = v_cache[slots].double().repeat_interleave(H // Hkv, 1)
    s = torch.einsum("hd,khd->hk", q.double(), k) * scale
    return torch.einsum("hk,khd->hd", s.softmax(-1), v)


def _assert_rows_are_lone_decode_rows(ops, spans, q, out, k_cache, v_cache, scale, tol):
    """Every row of ``spans`` (decode rows, trees after a prefix) in ``out`` has exactly the bits of
    a lone decode row over the same visible keys, and the float64 reference's values within ``tol``."""
    from specfw.backends.kernel_attention import KernelAttentionPlan

    for s in spans:
        n = int(s.kv_slots.numel())
        tm = s.tree_mask if s.tree_mask is not None else torch.ones(1, 1, dtype=torch.bool)
        for i in range(s.q_len):
            visible = torch.cat([s.kv_slots[: n - s.q_len], s.kv_slots[n - s.q_len :][tm[i]]])
            row = s.q_start + i
            lone = KernelAttentionPlan(ops, [SeqSpan(0, 1, visible)])(q[row : row + 1], k_cache, v_cache, scale)
            assert torch.equal(lone[0], out[row]), (s.q_len, s.prefix_len, i)
            assert (out[row].double() - _reference(q[row], k_cache, v_cache, visible, scale)).abs().max() < tol


def _random_tree(n: int, g: torch.Generator, chain: bool = False) -> torch.Tensor:
    """An ancestor mask [n, n] (node 0 the root, parents earlier, self included)."""
    mask = torch.eye(n, dtype=torch.bool)
    for i in range(1, n):
        parent = i - 1 if chain else int(torch.randint(0, i, (1,), generator=g))
        mask[i] |= mask[parent]
    return mask


@pytest.fixture(params=[False, True], ids=["vector attention", "amx attention"])
def amx_attention(request):
    """Runs a test with bf16 attention on vector FMAs, then on AMX tiles (``set_amx_attention``;
    skipped where the build has no AMX-BF16); the build's setting restored after."""
    on = request.param
    builds = {}

    def apply(ops):
        if ops not in builds:
            builds[ops] = ops.amx_attention_on()
            request.addfinalizer(lambda: ops.set_amx_attention(builds[ops]))
        if ops.set_amx_attention(on) != on:
            pytest.skip("this build has no AMX-BF16 attention (needs the avx512 build on a CPU with AMX-BF16)")

    return apply


@isas
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 4, 32), (6, 2, 20)])
def test_attention_plan_values_and_tree_rows_equal_lone_decode_rows(isa, dtype, heads, kv_heads, head_dim, amx_attention):
    """A batch of: a prompt prefill, two plain decode rows, a tree (random or chain) after a
    prefix, a causal extend after a prefix, and a draft-style span whose mask also covers earlier drafted nodes. Every row matches
    the float64 reference, and every non-prefill row has exactly the bits of a lone decode row
    over the same keys."""
    from specfw.backends.kernel_attention import KernelAttentionPlan

    ops = _ops(isa)
    amx_attention(ops)
    g = torch.Generator().manual_seed(heads * 100 + head_dim)
    S = 1200
    k_cache = torch.randn(S, kv_heads, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(S, kv_heads, head_dim, generator=g).to(dtype)
    perm = torch.randperm(S, generator=g)
    take = iter(perm.split(1))
    slots = lambda n: torch.cat([next(take) for _ in range(n)])  # noqa: E731
    tree = _random_tree(7, g)
    chain = _random_tree(5, g, chain=True)
    earlier = torch.tensor([[True, False, True, False, True, False]] * 3, dtype=torch.bool)  # 3 new rows, 3 older nodes
    draft_mask = torch.cat([earlier[:, :3], torch.eye(3, dtype=torch.bool)], 1)
    spans, start = [], 0
    for q_len, prefix, mask in ((6, 0, None), (1, 300, None), (1, 17, None), (7, 250, tree), (4, 30, None), (5, 40, chain), (3, 60, draft_mask)):
        kv = slots(prefix + q_len)
        spans.append(SeqSpan(q_start=start, q_len=q_len, kv_slots=kv, tree_mask=mask))
        start += q_len
    q = torch.randn(start, heads, head_dim, generator=g).to(dtype)
    scale = head_dim**-0.5
    out = KernelAttentionPlan(ops, spans)(q, k_cache, v_cache, scale)
    tol = 2e-5 if dtype == torch.float32 else 3e-2
    for s in spans:
        n = int(s.kv_slots.numel())
        tm = s.tree_mask if s.tree_mask is not None else torch.ones(s.q_len, s.q_len, dtype=torch.bool).tril()
        m = tm.shape[1]
        for i in range(s.q_len):
            visible = torch.cat([s.kv_slots[: n - m], s.kv_slots[n - m :][tm[i]]])
            row = s.q_start + i
            ref = _reference(q[row], k_cache, v_cache, visible, scale)
            assert (out[row].double() - ref).abs().max() < tol, (s.q_len, i)
            if s.q_len == 1 or s.prefix_len > 0:
                lone = KernelAttentionPlan(ops, [SeqSpan(0, 1, visible)])(q[row : row + 1], k_cache, v_cache, scale)
                assert torch.equal(lone[0], out[row]), f"tree row {i} of a {s.q_len}-row span differs from a lone decode row"


@isas
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_long_causal_runs_in_the_kernel_equal_lone_decode_rows(isa, dtype, amx_attention):
    """With the prefix cache on, prompt prefills attend through the kernel too, and a causal run of
    more rows than ``CAUSAL_BLOCK`` is cut into groups: a prompt's row, a cached-prefix extend's row
    and the lone decode row over the same keys have the same bits (what makes a cache hit exact)."""
    from specfw.backends.kernel_attention import CAUSAL_BLOCK, KernelAttentionPlan

    ops = _ops(isa)
    amx_attention(ops)
    g = torch.Generator().manual_seed(7)
    k_cache, v_cache = torch.randn(400, 3, 64, generator=g).to(dtype), torch.randn(400, 3, 64, generator=g).to(dtype)
    slots = torch.randperm(400, generator=g)[:150]
    n = 2 * CAUSAL_BLOCK + 9  # three groups, the last one short
    prompt = SeqSpan(0, n, slots[:n])  # no prefix: a fresh prompt
    extend = SeqSpan(n, n, slots[: 40 + n])  # the same tokens' successors after a 40-slot cached prefix
    q = torch.randn(2 * n, 9, 64, generator=g).to(dtype)
    plan = KernelAttentionPlan(ops, [prompt, extend], prefills_in_kernel=True)
    assert not plan.prefills and plan.groups == 6
    out = plan(q, k_cache, v_cache, 0.125)
    tol = 2e-5 if dtype == torch.float32 else 3e-2
    for s in (prompt, extend):
        before = int(s.kv_slots.numel()) - s.q_len
        for i in range(0, s.q_len, 7):
            visible, row = s.kv_slots[: before + i + 1], s.q_start + i
            lone = KernelAttentionPlan(ops, [SeqSpan(0, 1, visible)])(q[row : row + 1], k_cache, v_cache, 0.125)
            assert torch.equal(lone[0], out[row]), (s.q_len, before, i)
            assert (out[row].double() - _reference(q[row], k_cache, v_cache, visible, 0.125)).abs().max() < tol


@isas
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_long_prefixes_give_the_same_bits_however_the_work_is_split(isa, dtype, amx_attention):
    """The kernel splits its work by what the call holds: alone, one or two rows over a long prefix
    and a larger tree over a very long one in three phases (key chunks, rows, halves of the head
    dims), a tree over a shorter prefix per query head; in a batch one task per (request, kv head)
    or per query head. Every split, and every thread count, gives each row the bits of every
    other, and the float64 reference's values."""
    from specfw.backends.kernel_attention import KernelAttentionPlan

    ops = _ops(isa)
    amx_attention(ops)
    g = torch.Generator().manual_seed(11)
    S, H, Hkv, D = 6000, 9, 3, 64
    k_cache = torch.randn(S, Hkv, D, generator=g).to(dtype)
    v_cache = torch.randn(S, Hkv, D, generator=g).to(dtype)
    perm = iter(torch.randperm(S, generator=g).split(1))
    slots = lambda n: torch.cat([next(perm) for _ in range(n)])  # noqa: E731
    spans, start = [], 0
    # (1, 300): alone, phased from 256 keys in the AVX-512 build (per query head in the others)
    spec = (
        (1, 1500, None),
        (2, 700, _random_tree(2, g, chain=True)),
        (6, 600, _random_tree(6, g)),
        (4, 2100, _random_tree(4, g)),
        (1, 40, None),
        (1, 300, None),
    )
    for q_len, prefix, mask in spec:
        spans.append(SeqSpan(q_start=start, q_len=q_len, kv_slots=slots(prefix + q_len), tree_mask=mask))
        start += q_len
    q = torch.randn(start, H, D, generator=g).to(dtype)
    scale = D**-0.5
    threads = torch.get_num_threads()
    try:
        batch = KernelAttentionPlan(ops, spans)(q, k_cache, v_cache, scale)
        alone = []
        for s in spans:
            plan = KernelAttentionPlan(ops, [SeqSpan(0, s.q_len, s.kv_slots, tree_mask=s.tree_mask)])
            alone.append(plan(q[s.q_start : s.q_start + s.q_len], k_cache, v_cache, scale))
        torch.set_num_threads(1)
        one_thread = KernelAttentionPlan(ops, spans)(q, k_cache, v_cache, scale)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(batch, one_thread)
    tol = 2e-5 if dtype == torch.float32 else 3e-2
    for s, out in zip(spans, alone):
        assert torch.equal(out, batch[s.q_start : s.q_start + s.q_len]), (s.q_len, s.prefix_len)
    _assert_rows_are_lone_decode_rows(ops, spans, q, batch, k_cache, v_cache, scale, tol)


@isas
def test_bf16_rows_straddling_32_key_blocks_equal_lone_decode_rows(isa, amx_attention):
    """bf16 attention on AMX tiles (rows of 128 keys or more; shorter ones on vector FMAs) sums
    values in blocks of 32 keys at fixed positions of a row's key list, a row's last partial block on
    vector FMAs: prefixes just below, at and above a multiple of 32, trees and chains whose rows end
    in the next block, a row with exactly 160 keys, 24 query rows of one kv head (two tile groups),
    groups whose rows lie on both sides of 128 keys, short rows, keys in consecutive slots (tiles
    loaded from the pool as it lies) and scattered. Every row has a lone decode row's bits and the
    float64 reference's values, in one batch of 13 requests (the vector path: the same checks)."""
    from specfw.backends.kernel_attention import KernelAttentionPlan

    ops = _ops(isa)
    amx_attention(ops)
    g = torch.Generator().manual_seed(32)
    S, H, Hkv, D = 4000, 9, 3, 64
    k_cache = torch.randn(S, Hkv, D, generator=g).bfloat16()
    v_cache = torch.randn(S, Hkv, D, generator=g).bfloat16()
    perm = iter(torch.randperm(S - 2000, generator=g).split(1))
    base = [S - 2000]

    def slots(n, consecutive):
        if consecutive:
            base[0] += n
            return torch.arange(base[0] - n, base[0])
        return torch.cat([next(perm) for _ in range(n)])

    spec = [
        (1, 159, None, True),
        (1, 160, None, False),
        (1, 191, None, True),
        (3, 158, _random_tree(3, g, chain=True), True),
        (8, 190, _random_tree(8, g), False),
        (12, 218, _random_tree(12, g, chain=True), True),
        (8, 224, _random_tree(8, g), True),
        (6, 300, _random_tree(6, g), False),
        (1, 0, None, True),
        (1, 40, None, False),
        # rows on both sides of 128 keys (tiles from there): the rows of one group on two paths
        (8, 122, _random_tree(8, g), True),
        (12, 118, _random_tree(12, g, chain=True), False),
        (3, 60, _random_tree(3, g), True),
    ]
    spans, start = [], 0
    for q_len, prefix, mask, consecutive in spec:
        spans.append(SeqSpan(q_start=start, q_len=q_len, kv_slots=slots(prefix + q_len, consecutive), tree_mask=mask))
        start += q_len
    q = torch.randn(start, H, D, generator=g).bfloat16()
    scale = D**-0.5
    out = KernelAttentionPlan(ops, spans)(q, k_cache, v_cache, scale)
    _assert_rows_are_lone_decode_rows(ops, spans, q, out, k_cache, v_cache, scale, 3e-2)


@isas
def test_attention_of_a_fully_drafted_span_without_prefix(isa):
    """Edge cases: a group with an empty prefix (a draft span whose visible keys are all its own),
    and a one-key row."""
    from specfw.backends.kernel_attention import KernelAttentionPlan

    ops = _ops(isa)
    k_cache, v_cache = torch.randn(10, 2, 16), torch.randn(10, 2, 16)
    q = torch.randn(3, 4, 16)
    mask = torch.tensor([[True, False, False], [True, True, False], [True, False, True]])
    spans = [SeqSpan(0, 2, torch.tensor([4, 7]), tree_mask=mask[:2, :2]), SeqSpan(2, 1, torch.tensor([9]))]
    plan = KernelAttentionPlan(ops, spans)
    out = plan(q, k_cache, v_cache, 0.25)
    assert torch.allclose(out[0].double(), _reference(q[0], k_cache, v_cache, torch.tensor([4]), 0.25), atol=1e-5)
    assert torch.allclose(out[1].double(), _reference(q[1], k_cache, v_cache, torch.tensor([4, 7]), 0.25), atol=1e-5)
    assert torch.allclose(out[2], v_cache[9].repeat_interleave(2, 0), atol=1e-6)  # one key: its value


@isas
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_layer_glue_matches_torch_and_is_per_row(isa, dtype):
    """add_rms_norm, rope_write and silu_mul against the model's torch formulas (HF's numerics)."""
    import torch.nn.functional as F
    from specfw.models.llama import RMSNorm, Rotary

    ops = _ops(isa)
    g = torch.Generator().manual_seed(3)
    rows, D, H, Hkv, hd, inter = 5, 96, 4, 2, 16, 64
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    x, res = (torch.randn(rows, D, generator=g).to(dtype) for _ in range(2))
    norm = RMSNorm(D, 1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(D, generator=g) + 0.5)
    xs = x.clone()
    summed, y = ops.add_rms_norm(xs, res, norm.weight.detach(), 1e-5)
    assert torch.equal(xs, x)  # the input is not modified
    with torch.inference_mode():
        ref_sum = x + res
        assert torch.allclose(summed.float(), ref_sum.float(), atol=tol)
        assert torch.allclose(y.float(), norm(ref_sum).float(), rtol=tol, atol=tol)
        alone = torch.cat([ops.add_rms_norm(ref_sum[i : i + 1].clone(), ref_sum.new_empty(0), norm.weight.detach(), 1e-5)[1] for i in range(rows)])
        assert torch.equal(alone, ops.add_rms_norm(ref_sum.clone(), ref_sum.new_empty(0), norm.weight.detach(), 1e-5)[1])
    # rope on q and k, k and v into the cache
    qkv = torch.randn(rows, (H + 2 * Hkv) * hd, generator=g).to(dtype)
    pos = torch.tensor([0, 3, 7, 100, 5])
    ang = pos[:, None].float() * torch.rand(hd // 2, generator=g)[None]
    cos, sin = (torch.cat([f(ang), f(ang)], -1).to(dtype)[:, None] for f in (torch.cos, torch.sin))
    kc, vc = torch.zeros(20, Hkv, hd, dtype=dtype), torch.zeros(20, Hkv, hd, dtype=dtype)
    slots = torch.tensor([4, 9, 0, 13, 2])
    q = ops.rope_write(qkv, cos, sin, kc, vc, slots, H, Hkv)
    qk = Rotary.apply(qkv[:, : (H + Hkv) * hd].view(rows, H + Hkv, hd), cos, sin)
    assert torch.allclose(q.float(), qk[:, :H].float(), atol=tol)
    assert torch.allclose(kc[slots].float(), qk[:, H:].float(), atol=tol)
    assert torch.equal(vc[slots], qkv[:, (H + Hkv) * hd :].view(rows, Hkv, hd))
    # silu(gate) * up
    gu = torch.randn(rows, 2 * inter, generator=g).to(dtype) * 4
    ref = F.silu(gu[:, :inter].float()) * gu[:, inter:].float()
    assert torch.allclose(ops.silu_mul(gu).float(), ref, rtol=tol * 2, atol=tol * 2)


@isas
@pytest.mark.parametrize("hd", [16, 32, 64, 72])
def test_bf16_rope_has_torch_bits(isa, hd):
    """bf16 rope_write rounds each op as torch's bf16 ops do (``Rotary.apply``: x * cos + rot * sin),
    bit for bit: in whole vectors where half a head is whole vectors (64 on every ISA, 16 on AVX2 and
    portable), lane by lane elsewhere; denormal products kept, signed zeros as torch signs them."""
    from specfw.models.llama import Rotary

    ops = _ops(isa)
    g = torch.Generator().manual_seed(11)
    rows, H, Hkv = 6, 3, 1
    qkv = (torch.randn(rows, (H + 2 * Hkv) * hd, generator=g) * 3).bfloat16()
    qkv[0, :4] = torch.tensor([1e-38, -2e-39, 0.0, -0.0]).bfloat16()  # denormal products, zeros' signs
    qkv[0, hd // 2 : hd // 2 + 4] = torch.tensor([3e-39, 0.0, -0.0, 0.0]).bfloat16()
    pos = torch.arange(rows) * 37
    ang = pos[:, None].float() * torch.rand(hd // 2, generator=g)[None]
    cos, sin = (torch.cat([f(ang), f(ang)], -1).bfloat16()[:, None] for f in (torch.cos, torch.sin))
    cos[0, 0, :4] = sin[0, 0, :4] = torch.tensor([0.5, 0.25, -1.0, 1.0]).bfloat16()
    kc, vc = torch.zeros(rows, Hkv, hd, dtype=torch.bfloat16), torch.zeros(rows, Hkv, hd, dtype=torch.bfloat16)
    slots = torch.arange(rows).flip(0)
    q = ops.rope_write(qkv, cos, sin, kc, vc, slots, H, Hkv)
    with torch.inference_mode():
        qk = Rotary.apply(qkv[:, : (H + Hkv) * hd].view(rows, H + Hkv, hd), cos, sin)
    assert torch.equal(q.view(torch.int16), qk[:, :H].contiguous().view(torch.int16))  # bits, signed zeros included
    assert torch.equal(kc[slots].view(torch.int16), qk[:, H:].contiguous().view(torch.int16))


@isas
def test_bf16_glue_rounds_each_op_as_the_scalar_path_does(isa):
    """The bf16 glue runs whole vectors and rounds each op to nearest even as ``to_bf16`` does:
    a residual sum has torch's bits (denormals kept, not flushed as vcvtneps2bf16 would), a lane in
    the vector part and one in the scalar tail with the same inputs give the same output, and a
    denormal silu survives."""
    ops = _ops(isa)
    g = torch.Generator().manual_seed(5)
    rows, D = 3, 3 * 16 + 5  # a scalar tail after the vectors on every ISA (8 or 16 lanes)
    x, res = (torch.randn(rows, D, generator=g).bfloat16() for _ in range(2))
    x[:, :4] = torch.tensor([1e-39, -3e-39, 2.0**-133, 5.0]).bfloat16()  # denormal sums
    res[:, :4] = torch.tensor([2e-39, 1e-39, 2.0**-133, -5.0]).bfloat16()
    x[:, -1], res[:, -1] = x[:, 5], res[:, 5]  # lane 5 (vector part) and lane D-1 (tail): the same inputs
    w = (torch.rand(D, generator=g) + 0.5).bfloat16()
    w[-1] = w[5]
    summed, y = ops.add_rms_norm(x, res, w, 1e-5)
    assert torch.equal(summed.view(torch.int16), (x + res).view(torch.int16))
    assert summed[0, 0] != 0 and summed[0, 2] != 0
    assert torch.equal(y[:, 5].view(torch.int16), y[:, -1].view(torch.int16))
    # silu(g) * u with g a bf16 denormal and u = 1: exp(-g) rounds to 1, so g / 2, still a denormal
    gate = torch.full((2, 16), 2.0**-130).bfloat16()
    gate[1] = -(2.0**-128)
    out = ops.silu_mul(torch.cat([gate, torch.ones_like(gate)], dim=1))
    assert torch.equal(out, (gate.float() / 2).bfloat16()) and bool((out != 0).all())


@isas
@pytest.mark.parametrize("vocab,k", [(8192, 4), (1000, 8), (37, 1), (5, 5)])
def test_top_logprobs_matches_log_softmax_topk(isa, vocab, k):
    """The draft loop's per-depth read-back: each row's k best log-probabilities, best first, ids
    exact, ties to the lower index, a row's result independent of the other rows."""
    ops = _ops(isa)
    g = torch.Generator().manual_seed(vocab + k)
    x = torch.randn(6, vocab, generator=g) * 4
    x[2, 7 % vocab] = x[2, 3 % vocab] = x[2].max() + 1  # a tie at the top of row 2
    x[3] = 0.5  # every value tied: the k lowest ids
    out = ops.top_logprobs(x, k)
    assert out.shape == (2, 6, k)
    ref = torch.log_softmax(x.double(), -1)
    for r in range(6):
        ids = out[1, r].long()
        assert torch.allclose(out[0, r].double(), ref[r, ids], atol=1e-5)
        assert torch.equal(out[0, r], out[0, r].sort(descending=True).values)  # best first
        assert torch.allclose(out[0, r].double(), ref[r].topk(k).values, atol=1e-5)  # they are the k best
        assert torch.equal(ops.top_logprobs(x[r : r + 1].clone(), k)[:, 0], out[:, r])
    tied = sorted({3 % vocab, 7 % vocab})
    assert out[1, 2, : min(len(tied), k)].tolist() == tied[:k]
    assert out[1, 3].tolist() == list(range(k))
    with pytest.raises(RuntimeError, match="k <= V"):
        ops.top_logprobs(x, vocab + 1)


def test_cpu_backend_top_logprobs_equals_the_torch_default():
    """The backend seam: the CPU backend's kernel and the base backend's torch ops agree (values to
    1e-5, the same ids on untied rows), so beam search proposes the same tokens either way."""
    from specfw.backends import default_backend
    from specfw.backends.base import Backend

    backend = default_backend("cpu")
    if type(backend).__name__ != "CpuBackend":
        pytest.skip("specfw's CPU kernels are unavailable here")
    x = torch.randn(4, 8192, generator=torch.Generator().manual_seed(0))
    got, ref = backend.top_logprobs(x, 4), Backend.top_logprobs(backend, x, 4)
    assert torch.equal(got[1], ref[1]) and torch.allclose(got[0], ref[0], atol=1e-5)


def test_kernel_linear_packs_bf16_valued_fp32_weights_as_bf16_with_the_same_bits():
    """fp32 weights holding bf16 values (a bf16 checkpoint in an fp32 engine) stream half the
    bytes and give exactly the fp32 weight's results; other fp32 weights stay fp32."""
    from torch import nn
    from specfw.backends.kernel_linear import KernelLinear

    ops = _ops(cpu_isa())
    lin = nn.Linear(200, 70)
    with torch.no_grad():
        lin.weight.copy_(lin.weight.to(torch.bfloat16).float())
    narrow = KernelLinear(lin, ops, cpu_isa())
    assert narrow.packed.dtype == torch.bfloat16 and torch.equal(narrow.weight.float(), lin.weight)
    wide_ref = ops.pack(lin.weight.detach())  # the same values packed as fp32
    x = torch.randn(6, 200)
    assert torch.equal(narrow(x), ops.linear(x, wide_ref, 70, lin.bias.detach()))
    lin2 = nn.Linear(200, 70)
    assert KernelLinear(lin2, ops, cpu_isa()).packed.dtype == torch.float32


@isas
def test_a_kernel_releases_the_gil_while_it_runs(isa):
    """Another Python thread runs during a kernel call (the overlap scheduler's output thread and
    the server's event loop rely on it): it records times in the middle third of the call, where
    a GIL-holding call leaves it none (with a 0.1 ms switch interval it can only run at the edges)."""
    import sys
    import threading
    import time

    ops = _ops(isa)
    w, x = torch.randn(4096, 4096), torch.randn(256, 4096)
    packed = ops.pack(w)
    ticks, stop = [], threading.Event()

    def spin():
        while not stop.is_set():
            ticks.append(time.perf_counter())

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-4)
    t = threading.Thread(target=spin)
    t.start()
    try:
        time.sleep(0.01)
        start = time.perf_counter()
        ops.linear(x, packed, 4096, torch.empty(0))
        end = time.perf_counter()
    finally:
        stop.set()
        t.join()
        sys.setswitchinterval(interval)
    third = (end - start) / 3
    assert third > 0.005, "the call was too short to tell"
    assert any(start + third < tick < end - third for tick in ticks), "no other thread ran during the kernel: it holds the GIL"


def _plan_reference(seqs):
    """KernelAttentionPlan's slot lists, written out in Python (prefix, rows, each row's own slots)."""
    prefix_ptr, prefix, row_ptr, row_q, extra_ptr, extra = [0], [], [0], [], [0], []
    for q_start, q_len, slots, mask in seqs:
        slots = slots.tolist()
        m = q_len if mask is None else mask.shape[1]
        prefix += slots[: len(slots) - m]
        prefix_ptr.append(len(prefix))
        for r in range(q_len):
            row_q.append(q_start + r)
            extra += [slots[len(slots) - m + j] for j in range(m) if (j <= r + m - q_len if mask is None else bool(mask[r, j]))]
            extra_ptr.append(len(extra))
        row_ptr.append(len(row_q))
    return [prefix_ptr, prefix, row_ptr, row_q, extra_ptr, extra]


@isas
def test_attention_plan_lists_every_rows_slots(isa):
    """``attention_plan``: decode rows, causal rows, tree masks over the new tokens and over
    earlier drafted nodes too (m > q_len), a non-contiguous slot list: the reference's lists."""
    ops = _ops(isa)
    g = torch.Generator().manual_seed(3)
    seqs, q = [], 0
    for q_len, m, extra_prefix in [(1, None, 40), (3, None, 7), (4, 4, 12), (3, 9, 30), (1, None, 0), (2, 5, 1)]:
        n = extra_prefix + (m or q_len)
        slots = torch.randperm(500, generator=g)[:n]
        if m is None:
            mask = None
        else:
            mask = torch.rand(q_len, m, generator=g) < 0.5
            mask[:, m - q_len :] |= torch.eye(q_len, dtype=torch.bool)  # each node sees itself
        seqs.append((q, q_len, slots, mask))
        q += q_len
    strided = torch.arange(0, 40, 2)  # a view with stride 2
    seqs.append((q, 1, strided[::2], None))
    got = ops.attention_plan(
        [s[2] for s in seqs], [torch.empty(0, dtype=torch.bool) if s[3] is None else s[3] for s in seqs], [s[0] for s in seqs], [s[1] for s in seqs]
    )
    assert [t.tolist() for t in got] == _plan_reference(seqs)
    assert all(t.dtype == torch.long for t in got)
    with pytest.raises(RuntimeError, match="mask covers more"):
        ops.attention_plan([torch.arange(3)], [torch.ones(1, 5, dtype=torch.bool)], [0], [1])


@isas
def test_bf16_dot_layout_in_the_cpu_ops_build(isa):
    """Where the avx512 build has AVX512-BF16 (``has_bf16_dot``): ``pack_dot`` + ``linear`` give
    ``bf16_dot``'s bits (the shared vdpbf16ps tiles), each row's bits alone for 1..16 rows, odd
    K and a bias, and ``KernelLinear`` unpacks the layout back to its weight; other builds say no
    and refuse the layout."""
    from specfw.backends.kernel_linear import KernelLinear
    from specfw.kernels import bf16_dot, cpu_has_avx512_bf16

    ops = _ops(isa)
    if not (isa == "avx512" and cpu_has_avx512_bf16()):
        assert not ops.has_bf16_dot()
        with pytest.raises(RuntimeError, match="AVX512-BF16"):
            ops.pack_dot(torch.zeros(16, 4, dtype=torch.bfloat16))
        return
    assert ops.has_bf16_dot()
    g = torch.Generator().manual_seed(7)
    lin = torch.nn.Linear(77, 50).to(torch.bfloat16)
    lin.weight.data.copy_(torch.randn(50, 77, generator=g))
    bias = torch.randn(50, generator=g)
    x = torch.randn(16, 77, generator=g).to(torch.bfloat16)
    packed = ops.pack_dot(lin.weight.data)
    assert packed.shape == (4, 39, 32)
    y = ops.linear(x, packed, 50, bias)
    ref = bf16_dot()
    assert torch.equal(y, ref.linear(x, ref.pack(lin.weight.data), 50, bias))
    want = x.double() @ lin.weight.double().T + bias.double()
    assert torch.allclose(y.double(), want, rtol=1e-2, atol=5e-2)
    for rows in (1, 2, 3, 5, 8, 9, 16):
        assert torch.equal(ops.linear(x[:rows], packed, 50, bias), y[:rows]), rows
    kl = KernelLinear(lin, ops, isa, bf16_dot=True)
    assert kl.packed.shape[-1] == 32 and torch.equal(kl.weight, lin.weight.data)
    assert KernelLinear(lin, ops, isa).packed.shape[-1] == 16  # not asked for: the fp32-arithmetic layout
    assert KernelLinear(lin.float(), ops, isa, bf16_dot=True).packed.shape[-1] == 16  # a bf16-valued fp32 weight keeps fp32 arithmetic

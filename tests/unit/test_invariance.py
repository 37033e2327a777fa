"""The invariance probes: a linear's row plan gives every row the same bits whatever else is in
the call, including for kernels that change their summation order with the row count."""

import torch

from specfw.invariance import MAX_ROW_BLOCK, RowPlan, grouped_attention_is_invariant, invariant_row_plan

W = torch.randn(96, 40, generator=torch.Generator().manual_seed(3))


def _switching_mm(x):
    """Sums over K in one order for up to 3 rows and in another (two halves) from 4 rows on,
    like MKL's packed sgemm on the EPYCs. Each order is exact in float64 and rounded once, so the
    rows' bits do not depend on how the host's BLAS treats 1, 2 or 3 rows (they do on the Xeons)."""

    def exact(a, b):
        return a.double() @ b.double()

    if x.shape[0] <= 3:
        return exact(x, W).float()
    return exact(x[:, :48], W[:48]).float() + exact(x[:, 48:], W[48:]).float()


def _rows_alone(plan, mm, x):
    return torch.cat([plan.run(mm, x[r : r + 1]) for r in range(x.shape[0])])


def test_probe_finds_the_kernel_switch_and_plans_around_it():
    x = torch.randn(50, 96)
    naive = torch.cat([_switching_mm(p) for p in x.split(8)])
    assert not torch.equal(naive, torch.cat([_switching_mm(x[r : r + 1]) for r in range(50)]))  # the switch shows
    plan = invariant_row_plan(_switching_mm, 96, torch.float32, ("switching", 40))
    assert plan in (RowPlan(3), RowPlan(8, pad=True), RowPlan(16, pad=True))
    for rows in (1, 2, 3, 4, 7, 8, 9, 16, 17, 50):
        assert torch.equal(plan.run(_switching_mm, x[:rows]), _rows_alone(plan, _switching_mm, x[:rows])), rows


def test_invariant_kernel_runs_unpadded_in_the_largest_block():
    def order_free(x):  # exact in float64: any row count gives the same bits
        return (x.double() @ W.double()).float()

    plan = invariant_row_plan(order_free, 96, torch.float32, ("exact", 40))
    assert plan == RowPlan(MAX_ROW_BLOCK)
    x = torch.randn(MAX_ROW_BLOCK + 5, 96)
    assert torch.equal(plan.run(order_free, x), order_free(x))


def test_padded_plan_appends_zero_rows_and_drops_their_outputs():
    seen = []

    def mm(x):
        seen.append(x.shape[0])
        return x @ W

    out = RowPlan(8, pad=True).run(mm, torch.randn(11, 96))
    assert out.shape == (11, 40) and seen == [8, 8]


def test_grouped_attention_probe_is_cached_per_shape():
    a = grouped_attention_is_invariant(torch.float32, 4, 2, 16)
    assert isinstance(a, bool) and grouped_attention_is_invariant(torch.float32, 4, 2, 16) is a


def test_one_row_workload_never_pays_for_padded_calls():
    """Timed for 1-row steps only, the unpadded block is kept (padding only pays for many rows)."""
    assert invariant_row_plan(_switching_mm, 96, torch.float32, ("switching", 40), timed_rows=(1,)) == RowPlan(3)


def _order_free(x):  # exact in float64: any row count gives the same bits
    return (x.double() @ W.double()).float()


def test_a_kernel_builds_bit_equality_verdict_is_kept_on_disk(tmp_path, monkeypatch):
    """With ``persist`` (a compiled kernel's file), a verdict no timing chose is written to
    ``<cache>/row_plans.json`` and a later process (an empty in-process cache) reads it instead of
    probing; another build, or a verdict a timing chose, is probed; a write drops the entries of
    builds no longer on disk."""
    from specfw import invariance

    monkeypatch.setenv("SPECFW_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(invariance, "_plans", {})
    build_a, build_b, build_c = (tmp_path / f"ops_{n}.so" for n in "abc")
    for build in (build_a, build_b, build_c):
        build.write_bytes(b"")
    a, b, c = str(build_a), str(build_b), str(build_c)
    assert invariant_row_plan(_order_free, 96, torch.float32, ("disk", 40), persist=a) == RowPlan(MAX_ROW_BLOCK)
    assert invariance.plans_file().exists()
    probed = []
    real_probe = invariance._probe

    def counting_probe(*args, **kw):
        probed.append(args[0])
        return real_probe(*args, **kw)

    monkeypatch.setattr(invariance, "_probe", counting_probe)
    monkeypatch.setattr(invariance, "_plans", {})  # a new process
    assert invariant_row_plan(_order_free, 96, torch.float32, ("disk", 40), persist=a) == RowPlan(MAX_ROW_BLOCK)
    assert probed == []  # read from disk
    assert invariant_row_plan(_order_free, 96, torch.float32, ("disk", 40), persist=b) == RowPlan(MAX_ROW_BLOCK)
    assert len(probed) == 1  # another build is probed
    assert a in invariance.plans_file().read_text() and b in invariance.plans_file().read_text()
    switching = invariant_row_plan(_switching_mm, 96, torch.float32, ("switching", 40), persist=a)
    assert switching in (RowPlan(3), RowPlan(8, pad=True), RowPlan(16, pad=True))
    monkeypatch.setattr(invariance, "_plans", {})
    invariant_row_plan(_switching_mm, 96, torch.float32, ("switching", 40), persist=a)
    assert len(probed) == 3  # a row-dependent kernel's plan (timed, or a short block) is never taken from disk
    build_b.unlink()  # a rebuilt kernel: the old file is gone
    assert invariant_row_plan(_order_free, 96, torch.float32, ("disk", 40), persist=c) == RowPlan(MAX_ROW_BLOCK)
    kept = invariance.plans_file().read_text()
    assert a in kept and c in kept and b not in kept  # the write dropped the removed build's verdict
    invariance.plans_file().write_text("not json")
    monkeypatch.setattr(invariance, "_plans", {})
    assert invariant_row_plan(_order_free, 96, torch.float32, ("disk", 40), persist=a) == RowPlan(MAX_ROW_BLOCK)
    assert len(probed) == 5  # an unreadable file: probed again, and rewritten
    assert '"block": 64' in invariance.plans_file().read_text()

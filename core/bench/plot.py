"""The summary plot: tokens/s and accept length against each swept key (one line per
algorithm), and speedup over plain decoding against concurrency (one line per run)."""

from __future__ import annotations

from pathlib import Path

from .records import BenchRecord

SETTING_KEYS = ("num_steps", "topk", "num_draft_tokens", "adaptive_draft")


def wrap(title: str, width: int = 110) -> str:
    import textwrap

    return "\n".join(textwrap.fill(line, width) for line in title.splitlines())


def swept_keys(records: list[BenchRecord]) -> list[str]:
    """Settings keys that take more than one value among the measured speculative runs."""
    runs = [r for r in records if not r.skipped and r.algorithm != "none"]
    keys = sorted({k for r in runs for k in r.settings if k != "shape"})
    return [k for k in keys if len({str(r.settings.get(k)) for r in runs}) > 1]


def _order(values):
    def key(v):
        try:
            return (0, float(v), "")
        except (TypeError, ValueError):
            return (1, 0.0, str(v))

    return sorted(values, key=key)


def _label(v) -> str:
    return "auto" if v is None or v == "None" else str(v)


def plot_summary(records: list[BenchRecord], path: Path, title: str) -> Path | None:
    """Write the plot to ``path``; None when there is nothing to draw or matplotlib is missing.
    A ``specfw tune`` run plots its grid (phase ``tune``); the held-out runs have ``plot_holdout``."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    runs = [r for r in records if not r.skipped and r.tok_s]
    phase = "tune" if any(r.phase == "tune" for r in runs) else "bench"
    runs = [r for r in runs if r.phase == phase]
    if not runs:
        return None
    sizes = sorted({r.batch_size for r in runs})
    keys = swept_keys(runs)
    nrows = len(keys) + (len(sizes) > 1)
    if nrows == 0:
        keys, nrows = ["num_draft_tokens"], 1
    fig, axes = plt.subplots(nrows, 2, figsize=(11, 3.6 * nrows + 0.6), squeeze=False)
    for row, key in enumerate(keys):
        _key_row(axes[row], runs, key, sizes[0])
    if len(sizes) > 1:
        _concurrency_row(axes[-1], runs, sizes)
    fig.suptitle(wrap(title), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _key_row(axes, runs: list[BenchRecord], key: str, bs: int) -> None:
    """tok/s and accept length against ``key`` at batch size ``bs``, one line per algorithm that
    takes more than one value of it (best run at each value)."""
    tok_ax, acc_ax = axes
    for algo in dict.fromkeys(r.algorithm for r in runs if r.algorithm != "none"):
        mine = [r for r in runs if r.algorithm == algo and r.batch_size == bs]
        xs = _order({_label(r.settings.get(key)) for r in mine})
        if len(xs) < 2:
            continue
        best = [max((r for r in mine if _label(r.settings.get(key)) == x), key=lambda r: r.tok_s) for x in xs]
        tok_ax.plot(xs, [r.tok_s for r in best], marker="o", label=algo)
        acc_ax.plot(xs, [r.accept_length or 0.0 for r in best], marker="o", label=algo)
    plain = [r.tok_s for r in runs if r.algorithm == "none" and r.batch_size == bs]
    if plain:
        tok_ax.axhline(plain[0], color="gray", lw=0.8, ls="--", label="plain")
    tok_ax.set_ylabel(f"tok/s (batch {bs})")
    acc_ax.set_ylabel("accept length")
    for ax in (tok_ax, acc_ax):
        ax.set_xlabel(f"speculative.{key}\n(best run at each value; auto = the default)", fontsize=8)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:  # an algorithm with one value of the key draws no line
            ax.legend(fontsize=7)


def _concurrency_row(axes, runs: list[BenchRecord], sizes: list[int]) -> None:
    """Speedup over plain and tok/s against concurrency, one line per run label."""
    spd, tps = axes
    for i, label in enumerate(dict.fromkeys(r.label for r in runs)):
        mine = sorted((r for r in runs if r.label == label), key=lambda r: r.batch_size)
        color = "gray" if mine[0].algorithm == "none" else f"C{i % 10}"  # one color per run in both panels
        tps.plot([r.batch_size for r in mine], [r.tok_s for r in mine], marker="o", color=color, label=label[:60])
        if mine[0].algorithm != "none" and all(r.speedup is not None for r in mine):
            spd.plot([r.batch_size for r in mine], [r.speedup for r in mine], marker="o", color=color, label=label[:60])
    spd.axhline(1.0, color="k", lw=0.5)
    spd.set_ylabel("speedup over plain decoding")
    tps.set_ylabel("tok/s")
    for ax in (spd, tps):
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [str(b) for b in sizes])
        ax.set_xlabel("concurrency (requests in flight)")
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=6)


def _median_run(runs: list[BenchRecord]) -> BenchRecord | None:
    """The run with the median tokens/s (the lower middle one of an even count)."""
    return sorted(runs, key=lambda r: r.tok_s)[(len(runs) - 1) // 2] if runs else None


def plot_holdout(records: list[BenchRecord], path: Path, title: str) -> Path | None:
    """``specfw tune``'s held-out comparison: tokens/s of plain, auto and tuned per algorithm and
    batch size, bars labelled with the speedup over plain and the accept length (with
    ``tune.holdout_rounds`` > 1: the median run of each, and the rounds' count)."""
    held = [r for r in records if r.phase == "holdout" and not r.skipped and r.tok_s]
    if not held:
        return None
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    groups = [(a, b) for a in dict.fromkeys(r.algorithm for r in held if r.algorithm != "none") for b in sorted({r.batch_size for r in held})]
    fig, ax = plt.subplots(figsize=(1.9 * len(groups) + 3, 4.2))
    colors = {"plain": "gray", "auto": "tab:blue", "tuned": "tab:orange"}
    for g, (algo, bs) in enumerate(groups):
        plain = _median_run([r for r in held if r.algorithm == "none" and r.batch_size == bs])
        autos = [r for r in held if r.algorithm == algo and r.batch_size == bs and "tuned" not in r.label]
        auto = _median_run(autos)
        tuned = _median_run([r for r in held if r.algorithm == algo and r.batch_size == bs and "tuned" in r.label]) or auto
        for i, (kind, r) in enumerate((("plain", plain), ("auto", auto), ("tuned", tuned))):
            if r is None:
                continue
            x = g * 4 + i
            ax.bar(x, r.tok_s, color=colors[kind], label=kind if g == 0 else None)
            note = f"{r.tok_s:.1f}" + (f"\n{r.speedup:.2f}x, acc {r.accept_length:.2f}" if r.speedup and r.accept_length else "")
            if kind != "plain" and len(autos) > 1:
                note += f"\nmedian of {len(autos)}"
            ax.text(x, r.tok_s, note, ha="center", va="bottom", fontsize=7)
    ax.set_xticks([g * 4 + 1 for g in range(len(groups))], [f"{a}\nbatch {b}" for a, b in groups])
    ax.set_ylabel("tok/s on held-out prompts")
    ax.set_title(wrap(title, 80 + 12 * len(groups)), fontsize=7)
    ax.legend(fontsize=8, loc="lower right")
    ax.margins(y=0.18)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path

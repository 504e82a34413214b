"""PNG chart for `kvctl bench replay --plot`: hit rate and fragmentation against block size."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from kvctl.daemon.replay.simulator import ReplayResult

from .errors import UserError
from .outputs import is_png, refuse_clobber


def check_plot_path(path: Path) -> None:
    """Refuse, before any work, a plot path that would overwrite something other than a plot."""
    refuse_clobber(path, "plot", is_png, "a PNG", suffix=".png")


def write_plot(path: Path, results: list[ReplayResult], title: str) -> None:
    check_plot_path(path)
    try:
        import matplotlib
    except ImportError:
        raise UserError("plot: matplotlib is not installed (pip install 'kvctl[plot]')") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from .replay_report import policy_names

    name = policy_names(results)  # (with its reservation where several were replayed)
    lines: dict[tuple[str, int, int], list[ReplayResult]] = defaultdict(list)
    for r in results:
        lines[(name(r), r.capacity_tokens, r.tier_tokens)].append(r)
    tiered = any(tier for _, _, tier in lines)  # then the hit line counts what the tier restored too
    fig, (hit_ax, frag_ax) = plt.subplots(1, 2, figsize=(11, 4.2))
    maxima: dict[int, float] = {}
    for (policy, capacity, tier), runs in sorted(lines.items()):
        runs.sort(key=lambda r: r.block_size)
        sizes = [r.block_size for r in runs]
        label = policy if len({c for _, c, _ in lines}) == 1 else f"{policy} @ {capacity:,} tokens"
        if tiered:
            label += f", tier {tier:,}" if tier else ", no tier"
        hit_ax.plot(sizes, [r.hit_ratio + r.restored_ratio for r in runs], marker="o", label=label)
        frag_ax.plot(sizes, [r.fragmentation for r in runs], marker="o", label=label)
        for r in runs:
            maxima[r.block_size] = r.max_hit_ratio
    if maxima:
        sizes = sorted(maxima)
        hit_ax.plot(sizes, [maxima[s] for s in sizes], linestyle="--", color="grey",
                    label="unbounded cache")
    hit_label = "(hit + restored tokens) / prompt tokens" if tiered else "hit tokens / prompt tokens"
    for ax, ylabel in ((hit_ax, hit_label), (frag_ax, "internal fragmentation")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("block size (tokens)")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle(f"kvctl bench replay: {title}")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp.png")
    fig.savefig(tmp, format="png", dpi=110)
    plt.close(fig)
    tmp.replace(path)

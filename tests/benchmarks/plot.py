"""The plot in docs/benchmarks.md: update + commit time vs rows, per contender."""

from __future__ import annotations

from pathlib import Path


def write(curves: dict[str, list[tuple[int, float]]], path: Path, subtitle: str) -> bool:
    """Write an SVG (log-log); False (and nothing written) without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams["svg.hashsalt"] = "sa-fence"  # stable ids: the file diffs cleanly
    fig, ax = plt.subplots(figsize=(7, 4.5))
    styles = {"plain": ("o-", "plain session"), "fenced": ("s-", "fenced (sa-fence)")}
    for name, points in curves.items():
        marker, label = styles.get(name, ("^--", name))
        ax.plot([n for n, _ in points], [t * 1e3 for _, t in points], marker, label=label)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("rows loaded, changed and committed (one flush)")
    ax.set_ylabel("median time per operation (ms)")
    ax.set_title(f"ORM update + commit: flush cost vs rows\n{subtitle}", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="svg", metadata={"Date": None})
    plt.close(fig)
    return True

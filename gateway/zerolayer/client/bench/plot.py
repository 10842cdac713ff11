"""PNG charts of a report (needs the optional ``bench`` extra: matplotlib).

Per run: ``ttft.png`` (TTFT distribution), ``itl.png`` (ITL distribution, per token, from the
report's per-request ITLs when it has them, else from TPOT), ``throughput.png`` (output tokens/s
over time). For a sweep: ``sweep.png`` (output throughput against P99 TTFT and P99 ITL, one point
per concurrency level) and the per-run charts of its highest level.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


class PlotError(RuntimeError):
    """matplotlib is missing (install the ``bench`` extra)."""


def _pyplot() -> Any:  # matplotlib.pyplot, imported on first use
    try:
        import matplotlib
    except ImportError:
        raise PlotError(
            "--plot needs matplotlib: pip install 'zerolayer[bench]' (or '.[bench]')"
        ) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    return path


def _hist(plt: Any, values_ms: list[float], title: str, path: Path) -> Path:
    """A histogram with a log count axis, so the tail shows next to the bulk."""
    fig, ax = plt.subplots(figsize=(5, 3.2))
    if values_ms:
        ax.hist(values_ms, bins=60, color="#3b6ea8", log=True)
    ax.set(title=title, xlabel="ms", ylabel="count (log)")
    path = _save(fig, path)
    plt.close(fig)
    return path


def plot_run(report: dict[str, Any], out: Path, plt: Any = None) -> list[Path]:
    plt = plt or _pyplot()
    out.mkdir(parents=True, exist_ok=True)
    label = report.get("label") or report["endpoint"]
    ttfts = [t * 1000 for t in report["ttfts"] if t is not None]
    if "itls" in report:
        itls = [g * 1000 for row in report["itls"] for g in row]
        itl_title = f"ITL per token, {label}"
    else:
        itls, itl_title = [], f"ITL per token (run with --detailed), {label}"
    paths = [
        _hist(plt, ttfts, f"TTFT, {label}", out / "ttft.png"),
        _hist(plt, itls, itl_title, out / "itl.png"),
    ]
    fig, ax = plt.subplots(figsize=(5, 3.2))
    timeline = report["tokens_per_s_timeline"]
    if timeline:
        ax.step([t for t, _ in timeline], [v for _, v in timeline], where="post")
    ax.set(title=f"Output tokens/s, {label}", xlabel="s since start", ylabel="tokens/s")
    paths.append(_save(fig, out / "throughput.png"))
    plt.close(fig)
    return paths


def plot_sweep(report: dict[str, Any], out: Path) -> list[Path]:
    plt = _pyplot()
    out.mkdir(parents=True, exist_ok=True)
    runs = report["sweep"]
    fig, ax = plt.subplots(figsize=(5, 3.2))
    x = [r["output_throughput"] for r in runs]
    for key, name in (("p99_ttft_ms", "P99 TTFT"), ("p99_itl_ms", "P99 ITL")):
        y = [r[key] if r[key] is not None else float("nan") for r in runs]
        ax.plot(x, y, marker="o", label=name)
        for xi, yi, r in zip(x, y, runs, strict=True):
            ax.annotate(str(r["max_concurrency"]), (xi, yi), fontsize=7)
    ax.set(title="Throughput vs P99 latency", xlabel="output tokens/s", ylabel="ms")
    ax.set_yscale("log")
    ax.legend()
    paths = [_save(fig, out / "sweep.png")]
    plt.close(fig)
    return paths + plot_run(runs[-1], out, plt)


def plot(report: dict[str, Any], out: str | Path) -> list[Path]:
    out = Path(out)
    return plot_sweep(report, out) if "sweep" in report else plot_run(report, out)

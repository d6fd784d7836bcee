"""The suite's figure: one panel per workload, one bar per method, time on a log axis.

Bars are coloured by family (torch_vjp, torch.func, torch.autograd, jax); the fastest
correct method of each panel is outlined and labelled; each bar carries its ratio to that
fastest one; a method that failed or gave a wrong result has no bar but a red "FAILED" or
"WRONG" label with the start of its error. Needs matplotlib (the ``bench`` extra); the Agg
backend is used, so no display is needed.
"""

from __future__ import annotations

import math
import os
import textwrap
from pathlib import Path

from torch_vjp.bench.suite import SuiteResult, jax_note

__all__ = ["plot_suite", "FAMILY_COLORS"]

#: Bar colour of each method family.
FAMILY_COLORS = {
    "torch_vjp": "#d9480f",
    "torch.func": "#1c7ed6",
    "torch.autograd": "#868e96",
    "jax": "#2f9e44",
}


def plot_suite(result: SuiteResult, path: str | os.PathLike[str], *, columns: int = 2,
               title: str | None = None) -> Path:
    """Draws ``result`` to an image file (PNG, or the format the extension names).

    Workloads that ran no method have no panel.

    Args:
        result: A :class:`~torch_vjp.bench.suite.SuiteResult`.
        path: Where to write the figure (folders are created); its extension chooses the
            format, one of those matplotlib can write (``.png``, ``.pdf``, ``.svg``, ...).
        columns: Panels per row.
        title: First line of the figure's title; default names torch_vjp and the families
            of methods compared.

    Returns:
        The path written.

    Raises:
        JacobianOptionError: ``result`` holds no method's result, so there is nothing to
            draw.
        ValueError: matplotlib cannot write the format of ``path`` (matplotlib's own).
        OSError: the file cannot be written.
    """
    workloads = [w for w in result.workloads if w.results]
    if not workloads:
        from torch_vjp._errors import JacobianOptionError

        raise JacobianOptionError(
            f"torch_vjp.bench.plot_suite: the result holds {len(result.workloads)} "
            f"workload{'s' if len(result.workloads) != 1 else ''} and no method's result, so "
            f"there is nothing to draw. Fix: run_suite with methods that serve the "
            f"workloads' kinds (torch_vjp.bench.get_methods(kind) lists them)."
        )
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    n = len(workloads)
    columns = max(1, min(columns, n))
    rows = math.ceil(n / columns)
    heights = [max(len(w.results) for w in workloads[r * columns:(r + 1) * columns])
               for r in range(rows)]
    fig_height = sum(0.28 * h + 1.3 for h in heights) + 1.2
    fig, axes = plt.subplots(rows, columns, figsize=(8.2 * columns, fig_height),
                             gridspec_kw={"height_ratios": heights}, squeeze=False)
    times = [r.time_s for w in workloads for r in w.results if r.time_s]
    lo = min(times) if times else 1e-5
    hi = max(times) if times else 1.0
    for index, ax in enumerate(axes.flat):
        if index >= n:
            ax.axis("off")
            continue
        w = workloads[index]
        best = w.best
        labels = [r.method for r in w.results]
        y = list(range(len(labels)))
        ax.set_yticks(y)
        ax.set_yticklabels(labels, fontsize=8)
        # Same bar thickness in every panel of a row: the axis spans the row's longest list.
        ax.set_ylim(heights[index // columns] - 0.5, -0.5)
        ax.set_xscale("log")
        ax.set_xlim(lo / 3, hi * 12)
        ax.grid(axis="x", which="major", alpha=0.3)
        for yi, r in zip(y, w.results):
            if r.time_s is not None and r.status != "failed":
                color = FAMILY_COLORS.get(r.family, "#495057")
                is_best = best is not None and r is best
                ax.barh(yi, r.time_s - lo / 3, left=lo / 3, color=color,
                        hatch="//" if r.status == "wrong" else None,
                        edgecolor="black" if is_best else color, linewidth=1.6 if is_best else 0.5,
                        height=0.75)
                text = f"{r.ratio:.2f}x" if r.ratio is not None else ""
                if r.status == "wrong":
                    text = "WRONG " + text
                if is_best:
                    text = f"fastest, {_time(r.time_s)}"
                ax.text(r.time_s * 1.12, yi, text, va="center", fontsize=7.5,
                        color="#c92a2a" if r.status == "wrong" else "black",
                        fontweight="bold" if is_best else "normal")
            else:
                reason = (r.error or "").split(":", 1)[0]
                ax.text(lo / 2.5, yi, f"FAILED: {reason} (see the table)", va="center",
                        fontsize=7.5, color="#c92a2a", fontweight="bold")
            if r.method == (w.headline.method if w.headline else None):
                ax.get_yticklabels()[yi].set_fontweight("bold")
        ax.set_title(f"{w.name}\n{textwrap.fill(w.title, 70)}", fontsize=8.5, loc="left")
        ax.set_xlabel("median time per call, seconds (log scale; lower is better)", fontsize=8)
        ax.tick_params(axis="x", labelsize=8)
    env = result.environment
    device = env["gpu"] if env.get("gpu") else env["cpu"]
    families = [f for f in FAMILY_COLORS if f != "torch_vjp"
                and any(r.family == f for w in workloads for r in w.results)]
    if title is None:
        title = f"Jacobian benchmark: torch_vjp {env['torch_vjp']} vs {', '.join(families)}"
        title += f", {'quick' if env['quick'] else 'full'} suite"
    fig.suptitle(
        f"{title}\n"
        f"torch {env['torch']}, {jax_note(env)}, {env['device']} ({device}), "
        f"{env['threads']} threads, {env['dtype']}, {env['date']}",
        fontsize=11,
    )
    handles = [Patch(color=c, label=f) for f, c in FAMILY_COLORS.items()
               if any(r.family == f for w in workloads for r in w.results)]
    handles.append(Patch(facecolor="white", edgecolor="black", linewidth=1.6,
                         label="fastest correct method"))
    handles.append(Patch(facecolor="white", edgecolor="white",
                         label="red label: failed or wrong; bold name: torch_vjp's default"))
    fig.legend(handles=handles, loc="upper center", ncol=len(handles), fontsize=8.5,
               bbox_to_anchor=(0.5, 1 - 0.85 / fig_height), frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 1 - 1.2 / fig_height))
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=110)
    finally:
        plt.close(fig)  # also when the file cannot be written
    return path


def _time(seconds: float) -> str:
    from torch_vjp._measure import format_time

    return format_time(seconds)

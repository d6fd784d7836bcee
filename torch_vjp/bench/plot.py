"""The suite's figure: the rule of thumb on top, then one panel per workload.

The first panel is the rule of thumb, from the run's own measurements: each Jacobian
workload is a point at its input and output size (per example for ``batch_jacobian``),
coloured by which of torch_vjp's modes was faster on it, reverse (``"rev"``) or forward
(``"fwd"``), and by how much; the shading shows where ``strategy="auto"`` picks each.

Below it, one panel per workload, one bar per method, time on a log axis. Bars are
coloured by family (torch_vjp, torch.func, torch.autograd, jax) and end at the method's
median time; the whisker spans its interquartile range. The fastest correct method of each
panel is outlined and labelled; each other bar carries its ratio to that fastest one, and
a noisy one (IQR too wide to rank) says so. A torch_vjp method that failed or gave a wrong
result has a red "FAILED" or "WRONG" label; a method that torch (or jax) itself does not
support on the workload has a grey "not supported by torch" label. Needs matplotlib (the
``bench`` extra); the Agg backend is used, so no display is needed.
"""

from __future__ import annotations

import math
import os
import textwrap
from collections import defaultdict
from pathlib import Path
from typing import Any

from torch_vjp.bench.suite import MethodResult, SuiteResult, WorkloadResult, jax_note, suite_name

__all__ = ["plot_suite", "FAMILY_COLORS", "MODE_COLORS", "mode_points"]

#: Bar colour of each method family.
FAMILY_COLORS = {
    "torch_vjp": "#d9480f",
    "torch.func": "#1c7ed6",
    "torch.autograd": "#868e96",
    "jax": "#2f9e44",
}
#: Colour of each mode on the rule-of-thumb panel (points, and lighter, the shading).
MODE_COLORS = {"rev": "#7048e8", "fwd": "#0c8599"}
_SHADE = {"rev": "#e5dbff", "fwd": "#c5f6fa"}
_RED = "#c92a2a"
_NEUTRAL = "#495057"  # "not supported by torch": neither a result nor a failure of ours
# The methods compared on the rule-of-thumb panel, by workload kind.
_MODES = {
    "jacobian": ("torch_vjp rev", "torch_vjp fwd"),
    "batch_jacobian": ("torch_vjp batch_jacobian rev", "torch_vjp batch_jacobian fwd"),
}


def mode_points(result: SuiteResult) -> list[dict[str, Any]]:
    """The rule-of-thumb panel's points: per workload where both of torch_vjp's modes ran
    correctly, its sizes and which mode won.

    Returns:
        One dict per such workload: ``name``, ``n_in``, ``n_out``, ``winner`` (``"rev"``
        or ``"fwd"``), ``ratio`` (the slower mode's time over the faster's) and ``tie``
        (the two interquartile ranges overlap: the run cannot tell them apart).
    """
    points = []
    for w in result.workloads:
        names = _MODES.get(w.kind)
        if names is None or not w.n_in or not w.n_out:
            continue
        rev, fwd = (w.result(n) for n in names)
        if not all(r is not None and r.status == "ok" and r.time_s for r in (rev, fwd)):
            continue
        winner, loser = (rev, fwd) if rev.time_s <= fwd.time_s else (fwd, rev)
        tie = (winner.q3_s or winner.time_s) >= (loser.q1_s or loser.time_s)
        points.append({
            "name": w.name, "n_in": w.n_in, "n_out": w.n_out,
            "winner": "rev" if winner is rev else "fwd",
            "ratio": loser.time_s / winner.time_s, "tie": tie,
        })
    return points


def plot_suite(result: SuiteResult, path: str | os.PathLike[str], *, columns: int = 2,
               title: str | None = None) -> Path:
    """Draws ``result`` to an image file (PNG, or the format the extension names).

    Workloads that ran no method have no panel; the rule-of-thumb panel is drawn when at
    least one workload has both of torch_vjp's modes measured.

    Args:
        result: A :class:`~torch_vjp.bench.suite.SuiteResult`.
        path: Where to write the figure (folders are created); its extension chooses the
            format, one of those matplotlib can write (``.png``, ``.pdf``, ``.svg``, ...).
        columns: Workload panels per row (1 makes a figure readable at a page's width).
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

    points = mode_points(result)
    n = len(workloads)
    columns = max(1, min(columns, n))
    rows = math.ceil(n / columns)
    heights = [max(len(w.results) for w in workloads[r * columns:(r + 1) * columns])
               for r in range(rows)]
    panel_heights = [0.3 * h + 1.4 for h in heights]
    rule_height = 5.2 if points else 0.0
    head = 1.5
    fig_height = head + rule_height + sum(panel_heights)
    width = 8.6 * columns
    fig = plt.figure(figsize=(width, fig_height))
    grid = fig.add_gridspec(
        rows + (1 if points else 0), columns,
        height_ratios=([rule_height] if points else []) + panel_heights,
        top=1 - head / fig_height, bottom=0.55 / fig_height, left=0.34 / columns,
        right=0.97, hspace=0.9 / max(1, rows), wspace=0.75,
    )
    if points:
        rule = fig.add_subplot(grid[0, :])
        _draw_rule(rule, points, result, one_column=columns == 1)
    times = [t for w in workloads for r in w.results
             for t in (r.time_s, r.q1_s, r.q3_s) if t]
    lo = min(times) if times else 1e-5
    hi = max(times) if times else 1.0
    for index, w in enumerate(workloads):
        row, col = divmod(index, columns)
        ax = fig.add_subplot(grid[row + (1 if points else 0), col])
        _draw_workload(ax, w, lo, hi, heights[row])
    env = result.environment
    device = env["gpu"] if env.get("gpu") else env["cpu"]
    families = [f for f in FAMILY_COLORS if f != "torch_vjp"
                and any(r.family == f for w in workloads for r in w.results)]
    if title is None:
        title = f"Jacobian benchmark: torch_vjp {env['torch_vjp']} vs {', '.join(families)}"
        title += f", {suite_name(env)}"
    rounds = env.get("rounds", 1)
    fig.suptitle(
        "\n".join(textwrap.wrap(title, 95 * columns))
        + f"\ntorch {env['torch']}, {jax_note(env)}, {env['device']} ({device}), "
        f"{env['threads']} threads, {env['dtype']}, {rounds} round{'s' if rounds != 1 else ''}, "
        f"{env['date']}",
        fontsize=11, y=1 - 0.12 / fig_height, va="top",
    )
    _legend(fig, workloads, fig_height, columns)
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=110)
    finally:
        plt.close(fig)  # also when the file cannot be written
    return path


def _legend(fig: Any, workloads: list[WorkloadResult], fig_height: float, columns: int) -> None:
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    handles = [Patch(color=c, label=f) for f, c in FAMILY_COLORS.items()
               if any(r.family == f for w in workloads for r in w.results)]
    handles.append(Patch(facecolor="white", edgecolor="black", linewidth=1.6,
                         label="fastest correct method"))
    handles.append(Line2D([], [], color="black", marker="|", linestyle="-", linewidth=1,
                          label="whisker: interquartile range"))
    handles.append(Patch(facecolor="white", edgecolor="white",
                         label="red: torch_vjp failed or wrong; grey: not supported by torch; "
                         "bold name: torch_vjp's default"))
    fig.legend(handles=handles, loc="upper center", ncol=3 if columns == 1 else len(handles),
               fontsize=8.5, bbox_to_anchor=(0.5, 1 - 0.72 / fig_height), frameon=False)


def _draw_workload(ax: Any, w: WorkloadResult, lo: float, hi: float, slots: int) -> None:
    best = w.best
    labels = [r.method for r in w.results]
    y = list(range(len(labels)))
    ax.set_yticks(y)
    ax.set_yticklabels(labels, fontsize=8)
    # Same bar thickness in every panel of a row: the axis spans the row's longest list.
    ax.set_ylim(slots - 0.5, -0.5)
    ax.set_xscale("log")
    left = lo / 3
    ax.set_xlim(left, hi * 14)
    ax.grid(axis="x", which="major", alpha=0.3)
    headline = w.headline.method if w.headline else None
    for yi, r in zip(y, w.results):
        if r.time_s is not None and r.status in ("ok", "wrong"):
            _bar(ax, yi, r, best, left)
        else:
            _refusal(ax, yi, r, left)
        if r.method == headline:
            ax.get_yticklabels()[yi].set_fontweight("bold")
    ax.set_title(f"{w.name}\n{textwrap.fill(w.title, 72)}", fontsize=8.5, loc="left")
    ax.set_xlabel("median time per call, seconds (log scale; lower is better)", fontsize=8)
    ax.tick_params(axis="x", labelsize=8)


def _bar(ax: Any, yi: int, r: MethodResult, best: MethodResult | None, left: float) -> None:
    color = FAMILY_COLORS.get(r.family, _NEUTRAL)
    is_best = best is not None and r is best
    ax.barh(yi, r.time_s - left, left=left, color=color,
            alpha=0.45 if r.noisy else 1.0,
            hatch="//" if r.status == "wrong" else None,
            edgecolor="black" if is_best else color, linewidth=1.6 if is_best else 0.5,
            height=0.75)
    q1, q3 = r.q1_s, r.q3_s
    if q1 is not None and q3 is not None and q3 > q1:
        # From q1 to q3 (the median need not lie halfway, nor between them at all).
        ax.errorbar((q1 + q3) / 2, yi, xerr=(q3 - q1) / 2, fmt="none",
                    ecolor="black", elinewidth=0.9, capsize=2.5)
    end = max(r.time_s, q3 or r.time_s)
    text = f"{r.ratio:.2f}x" if r.ratio is not None else ""
    if is_best:
        text = f"fastest, {_time(r.time_s)}"
    if r.noisy:
        spread = r.timing.spread if r.timing is not None else None
        text += f" (noisy: IQR {100 * spread:.0f}%)" if spread is not None else " (noisy)"
    if r.status == "wrong":
        text = "WRONG " + text
    ax.text(end * 1.12, yi, text, va="center", fontsize=7.5,
            color=_RED if r.status == "wrong" else "black",
            fontweight="bold" if is_best else "normal")


def _refusal(ax: Any, yi: int, r: MethodResult, left: float) -> None:
    if r.status == "unsupported":
        ax.text(left * 1.25, yi, textwrap.shorten(
            f"not supported by {r.tool} ({r.error or ''})", 92, placeholder="...)"),
            va="center", fontsize=7.5, color=_NEUTRAL, style="italic")
        return
    why = (r.error or "").split(":", 1)[0]
    ax.text(left * 1.25, yi, f"FAILED: {why} (see the table)", va="center",
            fontsize=7.5, color=_RED, fontweight="bold")


def _draw_rule(ax: Any, points: list[dict[str, Any]], result: SuiteResult, *,
               one_column: bool) -> None:
    """The rule-of-thumb panel: measured winners over ``"auto"``'s regions."""
    import numpy as np
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    from torch_vjp._strategies import FWD_OFFSET, FWD_OUT_IN_RATIO, choose_mode

    sizes = [p["n_in"] for p in points] + [p["n_out"] for p in points]
    lo, hi = min(sizes) / 3, max(sizes) * 3
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(lo, hi)
    ax.set_ylim(lo, hi)
    grid = np.geomspace(lo, hi, 240)
    modes = np.array([[1.0 if choose_mode(int(x), int(yv)) == "fwd" else 0.0 for x in grid]
                      for yv in grid])
    from matplotlib.colors import ListedColormap

    ax.pcolormesh(grid, grid, modes, cmap=ListedColormap([_SHADE["rev"], _SHADE["fwd"]]),
                  shading="nearest", rasterized=True, zorder=0)
    ax.plot(grid, FWD_OUT_IN_RATIO * grid + FWD_OFFSET, color="#343a40", linewidth=1,
            linestyle="--", zorder=1)
    ax.plot(grid, grid, color="#adb5bd", linewidth=0.8, linestyle=":", zorder=1)
    seen: dict[tuple[int, int], int] = defaultdict(int)
    for p in sorted(points, key=lambda p: (p["n_in"], p["n_out"], p["name"])):
        key = (p["n_in"], p["n_out"])
        k = seen[key]
        seen[key] += 1
        x = p["n_in"] * 1.12 ** k  # points at the same sizes side by side
        color = MODE_COLORS[p["winner"]]
        ax.scatter([x], [p["n_out"]], s=70, zorder=3, color="white" if p["tie"] else color,
                   edgecolors=color, linewidths=1.8)
        if p["tie"]:
            label = f"{p['name']}: rev ~ fwd (within the spread)"
        else:
            label = f"{p['name']}: {p['winner']} {p['ratio']:.1f}x faster"
        ax.annotate(label, (x, p["n_out"]), xytext=(8, -11 * k + 3), textcoords="offset points",
                    fontsize=8, color="black", va="center", zorder=4)
    ax.set_xlabel("input elements n_in (the Jacobian's columns; per example for batch_jacobian)",
                  fontsize=8.5)
    ax.set_ylabel("output elements n_out (rows)", fontsize=8.5)
    ax.tick_params(labelsize=8)
    rule = (f"auto picks fwd where n_out > {FWD_OUT_IN_RATIO:g} n_in + {FWD_OFFSET} "
            f"(dashed), rev elsewhere")
    ax.set_title(
        "Rule of thumb, measured on this run: which of torch_vjp's modes was faster "
        "on each workload\n"
        "reverse mode (rev, one VJP per output) wins on wide Jacobians (few outputs), "
        "forward mode (fwd, one JVP per input) on tall ones",
        fontsize=9.5, loc="left",
    )
    handles = [
        Line2D([], [], marker="o", linestyle="", color=MODE_COLORS["rev"], label="rev faster"),
        Line2D([], [], marker="o", linestyle="", color=MODE_COLORS["fwd"], label="fwd faster"),
        Line2D([], [], marker="o", linestyle="", markerfacecolor="white",
               markeredgecolor="#495057", label="tie: the IQRs overlap"),
        Patch(color=_SHADE["rev"], label="auto picks rev"),
        Patch(color=_SHADE["fwd"], label="auto picks fwd"),
        Line2D([], [], color="#343a40", linestyle="--", label=rule),
    ]
    ax.legend(handles=handles, loc="upper left", fontsize=7.5, ncol=1 if one_column else 2,
              framealpha=0.9)


def _time(seconds: float) -> str:
    from torch_vjp._measure import format_time

    return format_time(seconds)

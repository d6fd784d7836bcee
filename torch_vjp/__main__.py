"""The command line: ``python -m torch_vjp bench`` (also installed as ``torch-vjp bench``).

``bench`` runs the built-in suite of Jacobian workloads (:mod:`torch_vjp.bench`), comparing
torch_vjp's strategies with ``torch.func``, ``torch.autograd.functional`` and, when it is
installed, jax. Every method is checked against a float64 reference before it is timed; a
method that fails or gives a wrong result shows its error in the table, and one that torch
(or jax) itself refuses on a workload is shown as not supported by it. The Python-loop and
full-then-diagonal methods run only with ``--all``. The table is printed at the end and
also written, with the JSON and the plot, to ``bench-results/`` (``--out``); the last lines
say where each went, the plot's last. ``--version`` prints the version.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

__all__ = ["main"]

#: Where the results go when ``--out`` is not given (relative to the current directory).
DEFAULT_OUT = "bench-results"
#: The files written there: the JSON, the tables as Markdown and the plot.
STEM = "jacobian_suite"
DEFAULT_PLOT = os.path.join(DEFAULT_OUT, STEM + ".png")
QUICK_MIN_RUN_TIME = 0.01
FULL_MIN_RUN_TIME = 0.1
DEFAULT_ROUNDS = 3
#: The exit status of a run interrupted with Ctrl-C: 128 + SIGINT, as the shells report it.
INTERRUPTED = 130


def _seconds(text: str) -> float:
    """``--min-run-time``: a finite number of seconds > 0 (argparse reports anything else)."""
    try:
        value = float(text)
    except ValueError:
        value = None
    if value is None or not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a valid time: it must be a finite number of seconds > 0, the "
            f"timing budget of each method per round (Timer.blocked_autorange repeats the "
            f"call until it is spent, so nan or inf would never end); e.g. "
            f"{FULL_MIN_RUN_TIME}, or {QUICK_MIN_RUN_TIME} for a quick look"
        )
    return value


def _plot_formats() -> dict[str, str] | None:
    """The file formats matplotlib can write, by extension; ``None`` without matplotlib."""
    if importlib.util.find_spec("matplotlib") is None:
        return None
    from matplotlib.figure import Figure

    return dict(Figure().canvas.get_supported_filetypes())


def _check_plot_path(path: str, parser: argparse.ArgumentParser) -> None:
    """The figure's format is its extension: one matplotlib can write, checked before the
    run. Without matplotlib nothing is checked here (:func:`_check_matplotlib`)."""
    formats = _plot_formats()
    if formats is None:
        return
    suffix = Path(path).suffix
    supported = ", ".join(f".{ext}" for ext in sorted(formats))
    if not suffix:
        parser.error(f"--plot {path}: the file name has no extension, and the extension "
                     f"chooses the format (matplotlib would write {path}.png instead). "
                     f"Supported: {supported}. Fix: --plot {path}.png")
    if suffix[1:].lower() not in formats:
        parser.error(f"--plot {path}: matplotlib cannot write {suffix} files; the extension "
                     f"chooses the format. Supported: {supported}. "
                     f"Fix: --plot {Path(path).with_suffix('.png')}")


def _check_matplotlib(path: str, parser: argparse.ArgumentParser) -> None:
    """A figure asked for by ``--plot`` without matplotlib: a usage error before the run (not
    a missing file minutes later). The default figure is left out instead, and the run says
    so at its end."""
    if _plot_formats() is None:
        parser.error(f"--plot {path}: matplotlib is not installed, so no figure can be "
                     f"drawn. Fix: pip install 'torch_vjp[bench]', or leave --plot out "
                     f"(the table and the JSON need no matplotlib)")


def _check_output_path(option: str, path: str, parser: argparse.ArgumentParser) -> None:
    """Fails before the run if ``path`` can visibly not be written: it is a folder, or the
    folder it goes in cannot be created (a file is in the way) or is not writable."""
    target = Path(path)
    if target.is_dir():
        parser.error(f"{option} {path}: is a folder, but a file name is expected, e.g. "
                     f"{option} {target / ('results' + (target.suffix or _SUFFIX[option]))}")
    folder = target.absolute().parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    if not folder.is_dir():
        parser.error(f"{option} {path}: cannot be written: {folder} is a file, not a folder, "
                     f"so the folder for {target.name} cannot be created there")
    if not os.access(folder, os.W_OK | os.X_OK):
        parser.error(f"{option} {path}: cannot be written: the folder {folder} is not "
                     f"writable")
    # (os.access answers yes to root everywhere, and nothing of a file system that refuses
    # files, such as /proc: a file is made and removed there, the folder made if need be,
    # and removed again: a usage error, a failed or interrupted run, a plot left unwritten
    # leave no empty folders behind; the writes after the run make them)
    parent = target.absolute().parent
    made = [parent, *parent.parents]
    made = made[:made.index(folder)] if folder in made else []
    try:
        os.makedirs(parent, exist_ok=True)
        with tempfile.TemporaryFile(dir=parent):
            pass
    except OSError as exc:
        parser.error(f"{option} {path}: cannot be written: a file could not be made in "
                     f"{parent} ({type(exc).__name__}: {exc})")
    finally:
        for made_folder in made:  # (deepest first; one the run's files are in stays)
            try:
                made_folder.rmdir()
            except OSError:
                break


_SUFFIX = {"--json": ".json", "--markdown": ".md", "--plot": ".png"}


def _not_written(what: str, path: str, exc: BaseException) -> None:
    print(f"{what}: not written: could not write {path}: {type(exc).__name__}: {exc}",
          file=sys.stderr)


def _version() -> str:
    import torch

    from torch_vjp import __version__

    return f"torch_vjp {__version__} (torch {torch.__version__})"


class _VersionAction(argparse.Action):
    """``--version``: prints the versions of torch_vjp and torch, and exits."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: object) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS,
                         help="print the version of torch_vjp (and of torch) and exit")

    def __call__(self, parser: argparse.ArgumentParser, *args: object, **kwargs: object) -> None:
        print(_version())
        parser.exit()


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="torch-vjp",
        description="torch_vjp: explicit Jacobians, batched VJPs/JVPs, per-sample gradients.",
    )
    parser.add_argument("--version", action=_VersionAction)
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    bench = commands.add_parser(
        "bench",
        help="run the Jacobian benchmark suite and print a table",
        description="Runs the built-in Jacobian benchmark suite: torch_vjp's strategies against "
        "torch.func.jacrev/jacfwd, torch.autograd.functional.jacobian and (when installed) "
        "jax. Every method is checked against a float64 reference before it is timed. "
        "Under 2 minutes on 2 cores; --all adds the Python-loop and full-then-diagonal "
        "methods (several minutes more).",
    )
    bench.add_argument("--quick", action="store_true",
                       help="a reduced suite (small workloads, "
                       f"min_run_time {QUICK_MIN_RUN_TIME} s): well under 30 s on 2 cores")
    bench.add_argument("--all", action="store_true", dest="all_methods",
                       help="also run the Python-loop methods (a loop of torch.autograd.grad, "
                       "torch_vjp's rev-loop and fwd-loop, autograd.functional.jacobian's "
                       "default) and the full Jacobian cut to its diagonal blocks: 20 to "
                       "30,000 times slower than the vectorised methods")
    bench.add_argument("--out", metavar="DIR", default=DEFAULT_OUT,
                       help=f"where the results go: DIR/{STEM}.json, .md and .png, unless "
                       f"--json, --markdown or --plot name other files (default {DEFAULT_OUT})")
    bench.add_argument("--no-save", action="store_true",
                       help="write no file to --out: only the table is printed (files "
                       "named by --json, --markdown or --plot are still written)")
    bench.add_argument("--json", metavar="PATH",
                       help=f"write the results as JSON here (default DIR/{STEM}.json)")
    bench.add_argument("--markdown", metavar="PATH",
                       help=f"write the tables as Markdown here (default DIR/{STEM}.md)")
    bench.add_argument("--plot", metavar="PATH", default=None,
                       help="write the figure here; its extension chooses the format "
                       f"(.png, .pdf, .svg, ...); default DIR/{STEM}.png")
    bench.add_argument("--no-plot", action="store_true", help="do not draw the figure")
    bench.add_argument("--plot-columns", type=int, default=2, metavar="N",
                       help="workload panels per row of the figure (default 2; 1 makes a "
                       "figure readable at the width of a page)")
    bench.add_argument("--device", default="cpu", help="cpu (default) or cuda[:N]")
    bench.add_argument("--threads", type=int, default=None,
                       help="torch.set_num_threads for the run; default: the usable cores")
    bench.add_argument("--only", metavar="NAMES",
                       help="comma-separated workload names or parts of names, in any "
                       "case, e.g. mlp_8x512,batch")
    bench.add_argument("--methods", metavar="NAMES",
                       help="comma-separated exact method names to run (default: all)")
    bench.add_argument("--no-jax", action="store_true", help="leave jax out even if installed")
    bench.add_argument("--min-run-time", type=_seconds, default=None,
                       help="seconds of timing per method and round, > 0 "
                       f"(default {FULL_MIN_RUN_TIME}; {QUICK_MIN_RUN_TIME} with --quick)")
    bench.add_argument("--rounds", type=int, default=DEFAULT_ROUNDS,
                       help="time each method this many times, interleaved; its time is the "
                       "median of the rounds' medians, its spread the IQR of all timed "
                       f"blocks (default {DEFAULT_ROUNDS}: on a shared or small machine one "
                       "round can be slowed by 10-30%%)")
    bench.set_defaults(subparser=bench)  # usage errors then name "torch-vjp bench"
    bench.add_argument("--no-progress", action="store_true", help="no progress bar")
    bench.add_argument("--list", action="store_true", help="list workloads and methods, then exit")
    return parser


def _bench(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    import torch

    from torch_vjp.bench import (
        METHODS,
        WORKLOADS,
        get_workloads,
        jax_available,
        jax_runs_on,
        run_suite,
    )

    if args.list:
        print("workloads:")
        for w in WORKLOADS:
            print(f"  {w.name:<18} {w.kind:<15}{'quick ' if w.quick else '      '}{w.title}")
        print("methods:")
        for m in METHODS:
            notes = [n for n, on in (("needs jax", m.needs_jax), ("only with --all", m.slow))
                     if on]
            note = f" ({', '.join(notes)})" if notes else ""
            print(f"  {m.name:<58} {m.kind}{note}")
        return 0
    device = args.device
    try:
        device_type = torch.device(device).type
    except RuntimeError as exc:
        device_type = None
        if device.strip().lower().startswith(("cpu", "cuda")):
            # ('cuda:x', 'CPU', 'cuda0': cpu or cuda meant, written as torch does not read it)
            parser.error(f"--device {device}: not a device torch can read ({exc}); expected "
                         f"cpu, cuda or cuda:N, N the index of a GPU (lower case, no spaces), "
                         f"e.g. --device cuda:0")
    if device_type not in ("cpu", "cuda"):
        parser.error(f"--device {device}: only cpu and cuda are supported")
    if device_type == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device {device}: torch.cuda.is_available() is False on this machine "
                     f"(torch {torch.__version__})")
    if device_type == "cuda" and torch.device(device).index is not None:
        count = torch.cuda.device_count()
        if torch.device(device).index >= count:
            parser.error(f"--device {device}: this machine has {count} CUDA device"
                         f"{'s' if count != 1 else ''} (cuda:0..cuda:{count - 1})")
    if args.threads is not None and args.threads < 1:
        parser.error(f"--threads {args.threads}: must be at least 1")
    if args.rounds < 1:
        parser.error(f"--rounds {args.rounds}: must be at least 1")
    if args.plot_columns < 1:
        parser.error(f"--plot-columns {args.plot_columns}: must be at least 1")
    try:
        workloads = get_workloads(args.only, quick=args.quick)
    except ValueError as exc:
        parser.error(f"--only: {exc}")
    if not workloads:
        parser.error(f"--only {args.only!r}: names no workload; pass names or parts of names "
                     f"separated by commas, e.g. --only mlp_8x512,batch (see --list)")
    methods = None
    if args.methods is not None:
        methods = [m.strip() for m in args.methods.split(",") if m.strip()]
        unknown = [m for m in methods if m not in {x.name for x in METHODS}]
        if unknown:
            parser.error(f"--methods: unknown method(s) {unknown}; see --list"
                         + _method_hint(unknown, [x.name for x in METHODS]))
        if not methods:
            parser.error(f"--methods {args.methods!r}: names no method; pass exact method "
                         f"names separated by commas (see --list), or leave --methods out "
                         f"to run them all")
    use_jax = not args.no_jax
    workloads = _served(workloads, methods, parser, jax=use_jax and jax_runs_on(args.device))
    min_run_time = args.min_run_time
    if min_run_time is None:
        min_run_time = QUICK_MIN_RUN_TIME if args.quick else FULL_MIN_RUN_TIME
    out = None if args.no_save else Path(args.out)
    json_path = args.json or (str(out / f"{STEM}.json") if out else None)
    markdown_path = args.markdown or (str(out / f"{STEM}.md") if out else None)
    plot_path = None if args.no_plot else args.plot or (str(out / f"{STEM}.png") if out else None)
    # Every output path is checked before the run, which can take minutes.
    _check_distinct((("--json", json_path), ("--markdown", markdown_path),
                     ("--plot", plot_path)), parser)
    if plot_path:
        _check_plot_path(plot_path, parser)
    for option, path in (("--json", json_path), ("--markdown", markdown_path),
                         ("--plot", plot_path)):
        if path:
            _check_output_path(option, path, parser)
    if plot_path and args.plot:
        _check_matplotlib(plot_path, parser)

    if use_jax and not jax_available():
        print("jax is not installed: its methods are left out (pip install jax jaxlib to add them)")
    elif use_jax and not jax_runs_on(device):
        print(f"jax has no {device_type} device here: its methods are left out (a jax with GPU "
              f"support, e.g. pip install 'jax[cuda13]', adds them on --device cuda)")
    start = time.perf_counter()
    try:
        result = run_suite(workloads, methods=methods, device=device, threads=args.threads,
                           min_run_time=min_run_time, rounds=args.rounds, quick=args.quick,
                           use_jax=use_jax, progress=not args.no_progress,
                           drop_slow=not args.all_methods)
    except KeyboardInterrupt as exc:
        # (a line, not a traceback through whichever method was running; the suite has
        # already put torch's thread count back)
        partial = getattr(exc, "result", None)  # (SuiteInterrupted: workloads finished)
        if partial is None:
            print(f"\ntorch-vjp bench: interrupted (Ctrl-C) after "
                  f"{time.perf_counter() - start:.1f} s, before the first workload finished: "
                  f"no table, and no file was written. For a shorter run: --quick, --only "
                  f"NAMES, --methods NAMES or a lower --min-run-time.", file=sys.stderr)
            return INTERRUPTED
        result = partial
        print(f"\ntorch-vjp bench: interrupted (Ctrl-C) after "
              f"{time.perf_counter() - start:.1f} s: the {result.environment['interrupted']} "
              f"that finished are reported and written below, the others left out.",
              file=sys.stderr)
    elapsed = time.perf_counter() - start
    print(result.table())
    print(f"\n{len(result.workloads)} workloads in {elapsed:.1f} s")
    # From here on the results exist: a file that cannot be written is reported and the
    # others are still written; the exit status is then 1. The last lines say where the
    # table, the JSON and the plot went, the plot's last.
    status = 0
    written: dict[str, str] = {}
    if json_path:
        try:
            written["json"] = str(result.write_json(json_path))
        except OSError as exc:
            _not_written("json", json_path, exc)
            status = 1
    if plot_path:
        try:
            from torch_vjp.bench.plot import plot_suite

            written["plot"] = str(plot_suite(result, plot_path, columns=args.plot_columns))
        except ImportError as exc:
            if args.plot:
                print(f"plot: not written: {exc} (pip install 'torch_vjp[bench]')", file=sys.stderr)
                status = 1
            else:
                print(f"plot: not written ({exc.name} is not installed: "
                      "pip install 'torch_vjp[bench]')")
        except (OSError, ValueError) as exc:
            _not_written("plot", plot_path, exc)
            status = 1
    if markdown_path:
        image = None
        if "plot" in written:
            image = os.path.relpath(os.path.abspath(written["plot"]),
                                    os.path.dirname(os.path.abspath(markdown_path)))
        try:
            os.makedirs(os.path.dirname(os.path.abspath(markdown_path)), exist_ok=True)
            with open(markdown_path, "w", encoding="utf-8") as fh:
                fh.write(result.markdown(image=image))
            written["markdown"] = markdown_path
        except OSError as exc:
            _not_written("markdown", markdown_path, exc)
            status = 1
    if "markdown" in written:
        print(f"table: printed above; as Markdown in {written['markdown']}")
    else:
        print("table: printed above")
    for what in ("json", "plot"):
        if what in written:
            print(f"{what}: {written[what]}")
    return INTERRUPTED if result.environment.get("interrupted") else status


def _method_hint(unknown: list[str], names: list[str]) -> str:
    """What the unknown ``--methods`` names may have meant: the method names that contain
    one (case aside), or are close to it; a hint on exact names if none is."""
    import difflib

    lowered = {name.lower(): name for name in names}
    meant: list[str] = []
    for given in unknown:
        found = [name for name in names if given.lower() in name.lower()]
        found = found or [lowered[m] for m in difflib.get_close_matches(
            given.lower(), list(lowered), n=3, cutoff=0.6)]
        meant += [name for name in found if name not in meant]
    if meant:
        return (f". Method names are exact and whole (--only takes parts of workload names, "
                f"--methods does not); did you mean "
                f"{', '.join(repr(name) for name in meant[:6])}? e.g. --methods "
                f"{meant[0]!r}")
    return (". Method names are exact and whole, as --list prints them, e.g. --methods "
            "'torch_vjp rev,torch.func.jacrev'")


def _check_distinct(paths: Sequence[tuple[str, str | None]],
                    parser: argparse.ArgumentParser) -> None:
    """Two result files at one path: the one written last would replace the other, and the
    command would still say where both went."""
    seen: dict[str, str] = {}
    for option, path in paths:
        if not path:
            continue
        key = os.path.normcase(os.path.realpath(path))
        if key in seen:
            parser.error(
                f"{option} {path}: {seen[key]} writes the same file, and the one written last "
                f"would replace the other. Give each its own file, e.g. --json results.json "
                f"--markdown results.md --plot results.png")
        seen[key] = option


def _served(workloads: list, methods: list[str] | None, parser: argparse.ArgumentParser, *,
            jax: bool) -> list:
    """The workloads that at least one selected method serves; the others are left out
    with a notice, and a selection that leaves none is a usage error."""
    if methods is None:
        return workloads
    from torch_vjp.bench import METHODS, get_methods

    kept = [w for w in workloads if get_methods(w.kind, names=methods, jax=jax)]
    if not kept:
        chosen = [m for m in METHODS if m.name in methods]
        kinds = sorted({w.kind for w in workloads})
        why = []
        if not any(m.kind in kinds for m in chosen):
            why.append(f"they serve {', '.join(sorted({m.kind for m in chosen}))} workloads, "
                       f"and the selected workloads are {', '.join(kinds)}")
        if not jax and any(m.needs_jax for m in chosen if m.kind in kinds):
            why.append("jax's methods run only with jax installed, without --no-jax, on "
                       "--device cpu or on a GPU that jax sees")
        if not why:  # pragma: no cover - every case is named above
            why.append("no selected method serves them")
        parser.error(f"--methods: none of {methods} runs on the selected workloads "
                     f"({', '.join(w.name for w in workloads)}): {'; '.join(why)}. See --list "
                     f"for which method serves which kind of workload")
    left_out = [w.name for w in workloads if w not in kept]
    if left_out:
        print(f"left out (no selected method serves them): {', '.join(left_out)}")
    return kept


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m torch_vjp`` and the ``torch-vjp`` console script.

    Args:
        argv: The arguments after the program name; default ``sys.argv[1:]``.

    Returns:
        The exit status: 0 on success, 2 for a usage error (argparse's convention, found
        before the run; ``--version`` exits with 0), 1 when the run finished but a result
        file (the JSON, the Markdown or the plot) could not be written; the table is
        printed and the other files are written all the same; 130 (the shells' 128 +
        SIGINT) when the run was interrupted with Ctrl-C, said in one line on stderr; the
        workloads that had finished are then printed and written, marked as interrupted.
    """
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command == "bench":
        return _bench(args, args.subparser)
    parser.print_help()
    return 2


if __name__ == "__main__":
    sys.exit(main())

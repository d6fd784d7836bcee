"""The command line: ``python -m torch_vjp bench`` (also installed as ``torch-vjp bench``).

``bench`` runs the built-in suite of Jacobian workloads (:mod:`torch_vjp.bench`), comparing
torch_vjp's strategies with ``torch.func``, ``torch.autograd.functional`` and, when it is
installed, jax. Every method is checked against a float64 reference before it is timed; a
method that fails or gives a wrong result shows its error in the table. The table is
printed at the end, and the last line of output is the path of the plot.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence

__all__ = ["main"]

#: Where the plot goes when ``--plot`` is not given (relative to the current directory).
DEFAULT_PLOT = os.path.join("bench-results", "jacobian_suite.png")
QUICK_MIN_RUN_TIME = 0.01
FULL_MIN_RUN_TIME = 0.1
DEFAULT_ROUNDS = 3


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="torch-vjp",
        description="torch_vjp: explicit Jacobians, batched VJPs/JVPs, per-sample gradients.",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    bench = commands.add_parser(
        "bench",
        help="run the Jacobian benchmark suite and print a table",
        description="Runs the built-in Jacobian benchmark suite: torch_vjp's strategies against "
        "torch.func.jacrev/jacfwd, torch.autograd.functional.jacobian and (when installed) "
        "jax. Every method is checked against a float64 reference before it is timed.",
    )
    bench.add_argument("--quick", action="store_true",
                       help="a reduced suite (small workloads, no Python-loop methods, "
                       f"min_run_time {QUICK_MIN_RUN_TIME} s): well under 30 s on 2 cores")
    bench.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    bench.add_argument("--markdown", metavar="PATH", help="also write the tables as Markdown")
    bench.add_argument("--plot", metavar="PATH", default=None,
                       help=f"where to write the figure (PNG); default {DEFAULT_PLOT}")
    bench.add_argument("--no-plot", action="store_true", help="do not draw the figure")
    bench.add_argument("--device", default="cpu", help="cpu (default) or cuda[:N]")
    bench.add_argument("--threads", type=int, default=None,
                       help="torch.set_num_threads for the run; default: the usable cores")
    bench.add_argument("--only", metavar="NAMES",
                       help="comma-separated workload names or parts of names, "
                       "e.g. mlp_8x512,batch")
    bench.add_argument("--methods", metavar="NAMES",
                       help="comma-separated exact method names to run (default: all)")
    bench.add_argument("--no-jax", action="store_true", help="leave jax out even if installed")
    bench.add_argument("--min-run-time", type=float, default=None,
                       help="seconds of timing per method and round "
                       f"(default {FULL_MIN_RUN_TIME}; {QUICK_MIN_RUN_TIME} with --quick)")
    bench.add_argument("--rounds", type=int, default=DEFAULT_ROUNDS,
                       help="time each method this many times, interleaved, and keep the "
                       f"smallest of the rounds' medians (default {DEFAULT_ROUNDS}: on a "
                       "shared or small machine one round can be slowed by 10-30%%)")
    bench.add_argument("--no-progress", action="store_true", help="no progress bar")
    bench.add_argument("--list", action="store_true", help="list workloads and methods, then exit")
    return parser


def _bench(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    import torch

    from torch_vjp.bench import METHODS, WORKLOADS, get_workloads, jax_available, run_suite

    if args.list:
        print("workloads:")
        for w in WORKLOADS:
            print(f"  {w.name:<18} {'quick ' if w.quick else '      '}{w.title}")
        print("methods:")
        for m in METHODS:
            print(f"  {m.name:<58} {m.kind}{' (needs jax)' if m.needs_jax else ''}")
        return 0
    device = args.device
    try:
        device_type = torch.device(device).type
    except RuntimeError:
        device_type = None
    if device_type not in ("cpu", "cuda"):
        parser.error(f"--device {device}: only cpu and cuda are supported")
    if device_type == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device {device}: torch.cuda.is_available() is False on this machine "
                     f"(torch {torch.__version__})")
    if args.threads is not None and args.threads < 1:
        parser.error(f"--threads {args.threads}: must be at least 1")
    if args.rounds < 1:
        parser.error(f"--rounds {args.rounds}: must be at least 1")
    try:
        workloads = get_workloads(args.only, quick=args.quick)
    except ValueError as exc:
        parser.error(f"--only: {exc}")
    methods = None
    if args.methods:
        methods = [m.strip() for m in args.methods.split(",") if m.strip()]
        unknown = [m for m in methods if m not in {x.name for x in METHODS}]
        if unknown:
            parser.error(f"--methods: unknown method(s) {unknown}; see --list")
    min_run_time = args.min_run_time
    if min_run_time is None:
        min_run_time = QUICK_MIN_RUN_TIME if args.quick else FULL_MIN_RUN_TIME

    use_jax = not args.no_jax
    if use_jax and not jax_available():
        print("jax is not installed: its methods are left out (pip install jax jaxlib to add them)")
    start = time.perf_counter()
    result = run_suite(workloads, methods=methods, device=device, threads=args.threads,
                       min_run_time=min_run_time, rounds=args.rounds, quick=args.quick,
                       use_jax=use_jax, progress=not args.no_progress)
    elapsed = time.perf_counter() - start
    print(result.table())
    print(f"\n{len(workloads)} workloads in {elapsed:.1f} s")
    if args.json:
        print(f"json: {result.write_json(args.json)}")
    plot_path = None
    if not args.no_plot:
        plot_path = args.plot or DEFAULT_PLOT
        try:
            from torch_vjp.bench.plot import plot_suite

            plot_suite(result, plot_path)
        except ImportError as exc:
            if args.plot:
                print(f"plot: not written: {exc} (pip install 'torch_vjp[bench]')", file=sys.stderr)
                return 1
            print(f"plot: not written ({exc.name} is not installed: "
                  "pip install 'torch_vjp[bench]')")
            plot_path = None
    if args.markdown:
        image = None
        if plot_path:
            image = os.path.relpath(os.path.abspath(plot_path),
                                    os.path.dirname(os.path.abspath(args.markdown)))
        os.makedirs(os.path.dirname(os.path.abspath(args.markdown)), exist_ok=True)
        with open(args.markdown, "w", encoding="utf-8") as fh:
            fh.write(result.markdown(image=image))
        print(f"markdown: {args.markdown}")
    if plot_path:
        print(f"plot: {plot_path}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m torch_vjp`` and the ``torch-vjp`` console script.

    Args:
        argv: The arguments after the program name; default ``sys.argv[1:]``.

    Returns:
        The exit status: 0 on success, 2 for a usage error (argparse's convention).
    """
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command == "bench":
        return _bench(args, parser)
    parser.print_help()
    return 2


if __name__ == "__main__":
    sys.exit(main())

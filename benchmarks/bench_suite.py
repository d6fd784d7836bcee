"""Runs the ``torch-vjp bench`` suite and puts the committed results on the docs page.

This is ``python -m torch_vjp bench`` with fixed output paths and a one-column figure
(readable at the width of the docs page, where it links to its full-size image):

* ``results/jacobian_suite_<device>.json``, ``.md`` and ``.png`` next to this file;
* ``docs/pages/img/jacobian_suite_<device>.png`` and, on ``docs/pages/benchmarks.md``,
  the tables between the markers ``<!-- suite:<device>:start -->`` and
  ``<!-- suite:<device>:end -->``.

It then refreshes every other ``<!-- include:NAME:start -->`` ... ``<!-- include:NAME:end
-->`` block of that page with ``results/NAME`` (a Markdown file written by another script
here, its title dropped, its images copied to ``docs/pages/img/``). The rest of the page
is left as it is.

Run: ``python benchmarks/bench_suite.py [--threads 2] [--device cpu]``; other arguments go
to ``torch-vjp bench`` (e.g. ``--rounds 5``, or ``--all`` for the Python-loop and
full-then-diagonal methods too). ``--docs-only`` refreshes the page from the
results already committed, without running anything.
"""

from __future__ import annotations

import argparse
import math
import re
import shutil
import sys
from pathlib import Path

from torch_vjp.__main__ import main as bench_main
from torch_vjp._measure import format_time
from torch_vjp.bench import load_json

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
RESULTS = HERE / "results"
DOCS_PAGE = REPO / "docs" / "pages" / "benchmarks.md"
DOCS_IMG = REPO / "docs" / "pages" / "img"


def docs_block(json_path: Path, image: str) -> str:
    """The Markdown shown on the docs page for one suite result."""
    result = load_json(json_path)
    md = result.markdown(image=image)
    # The page has its own title: drop the results file's "# ..." heading, demote the rest.
    body = md.split("\n", 1)[1].lstrip("\n")
    return re.sub(r"^## ", "### ", body, flags=re.MULTILINE).rstrip("\n")


def _replace(page: str, start: str, end: str, block: str) -> str:
    if start not in page or end not in page:
        raise SystemExit(f"a docs page has no {start} ... {end} markers")
    before, rest = page.split(start, 1)
    _, after = rest.split(end, 1)
    return f"{before}{start}\n{block}\n{end}{after}"


def _included(name: str) -> str:
    """``results/NAME`` for the docs page: title dropped, headings demoted, images copied."""
    text = (RESULTS / name).read_text(encoding="utf-8")
    if text.startswith("# "):
        text = text.split("\n", 1)[1].lstrip("\n")
    text = re.sub(r"^(#+) ", r"\1## ", text, flags=re.MULTILINE)

    def image(match: re.Match[str]) -> str:
        source = RESULTS / match.group(2)
        if not source.is_file():
            return f"(figure `{match.group(2)}` not committed)"
        shutil.copyfile(source, DOCS_IMG / source.name)
        return f"![{match.group(1)}](img/{source.name})"

    return re.sub(r"!\[([^\]]*)\]\(([^)]+)\)", image, text).rstrip("\n")


def breakeven_markdown(json_path: Path) -> str:
    """When ``compile=True`` pays, from a suite result: per workload, the eager default's
    time, the compiled time, the compiled method's first call (compiling included), and the
    number of calls ``n`` from which ``first + (n - 1) * compiled <= n * eager``."""
    result = load_json(json_path)
    env = result.environment
    lines = [
        f"# When compiling pays ({env['device']}, {env['threads']} threads, {env['dtype']})",
        "",
        f"From `{json_path.name}` ({env['date']}): *default* is the eager `strategy='auto'` "
        "call, *compiled* the same with `compile=True` (steady state), *first call* the "
        "compiled method's first call (one eager call, compiling, one compiled call). "
        "*Break-even*: the number of calls from which compiling has cost less in total. "
        "The first workload's first call also pays what torch.compile does once per process "
        "(importing and starting its compiler), the suite ran with an empty inductor cache, "
        "and a later process finds its programs in that cache and compiles faster.",
        "",
        "| workload | default | compiled | compiled / default | first call | break-even |",
        "|---|---|---|---|---|---|",
    ]
    for w in result.workloads:
        head, comp = w.headline, w.compiled
        if comp is None or head is None or comp.time_s is None or head.time_s is None \
                or comp.status != "ok" or comp.first_call_s is None:
            continue
        gain = head.time_s - comp.time_s
        calls = ("never (no faster)" if gain <= 0 else
                 f"{max(1, math.ceil((comp.first_call_s - comp.time_s) / gain)):,} calls")
        lines.append(f"| {w.name} | {format_time(head.time_s)} | {format_time(comp.time_s)} | "
                     f"{comp.time_s / head.time_s:.2f} | {format_time(comp.first_call_s)} | "
                     f"{calls} |")
    return "\n".join(lines) + "\n"


#: The docs pages whose ``<!-- include:NAME:start -->`` blocks are refreshed.
INCLUDING_PAGES = (DOCS_PAGE, *(REPO / "docs" / "pages" / f"{name}.md"
                                for name in ("strategies", "per-sample")))


def update_docs(devices: list[str]) -> None:
    """Rewrites the generated blocks of ``docs/pages/benchmarks.md`` (and the included
    results on the strategies page) from ``results/``."""
    DOCS_IMG.mkdir(parents=True, exist_ok=True)
    page = DOCS_PAGE.read_text(encoding="utf-8")
    for device in devices:
        stem = RESULTS / f"jacobian_suite_{device}"
        image = DOCS_IMG / f"jacobian_suite_{device}.png"
        shutil.copyfile(stem.with_suffix(".png"), image)
        page = _replace(page, f"<!-- suite:{device}:start -->", f"<!-- suite:{device}:end -->",
                        docs_block(stem.with_suffix(".json"), f"img/{image.name}"))
        (RESULTS / f"compile_breakeven_{device}.md").write_text(
            breakeven_markdown(stem.with_suffix(".json")), encoding="utf-8")
    DOCS_PAGE.write_text(page, encoding="utf-8")
    for path in INCLUDING_PAGES:
        page = path.read_text(encoding="utf-8")
        for name in re.findall(r"<!-- include:([\w.-]+):start -->", page):
            if (RESULTS / name).is_file():
                page = _replace(page, f"<!-- include:{name}:start -->",
                                f"<!-- include:{name}:end -->", _included(name))
        path.write_text(page, encoding="utf-8")
        print(f"docs: {path}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", default="2")
    parser.add_argument("--no-docs", action="store_true", help="do not touch docs/pages")
    parser.add_argument("--docs-only", action="store_true",
                        help="only refresh docs/pages/benchmarks.md from results/")
    args, extra = parser.parse_known_args(argv)
    committed = sorted(p.stem.removeprefix("jacobian_suite_")
                       for p in RESULTS.glob("jacobian_suite_*.json"))
    if args.docs_only:
        update_docs(committed)
        return 0
    device = args.device.split(":")[0]
    stem = RESULTS / f"jacobian_suite_{device}"
    json_path, png_path, md_path = (stem.with_suffix(s) for s in (".json", ".png", ".md"))
    status = bench_main(["bench", "--device", args.device, "--threads", args.threads,
                         "--json", str(json_path), "--markdown", str(md_path),
                         "--plot", str(png_path), "--plot-columns", "1", *extra])
    if status == 0 and not args.no_docs:
        update_docs(sorted({*committed, device}))
    return status


if __name__ == "__main__":
    sys.exit(main())

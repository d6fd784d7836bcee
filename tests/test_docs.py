"""The documentation site builds in strict mode, and every example on its pages runs.

Two checks:

* ``mkdocs build --strict -f docs/mkdocs.yml`` succeeds (into a temporary folder, so the
  working tree is untouched), no page shows a raw docstring role such as ``:func:`` (the
  API page's come from docstrings; ``docs/roles.py`` renders them as code), and output
  listings wrap their long lines (``docs/pages/stylesheets/extra.css``). Skipped, with the
  reason, only when the docs toolchain (the ``docs`` extra: mkdocs, mkdocs-material,
  mkdocstrings[python]) is not installed.
* Every ```python block of every page under ``docs/pages/`` runs, top to bottom, in one
  fresh namespace per page. A failing block is reported with its page, block number,
  line and source. Output listings are ```text blocks and are not run; a ```text block
  right after a ``<!-- printed -->`` line must equal what the ```python block before it
  printed, so that listed messages cannot go stale. To rewrite those listings from the
  current output, run ``python tests/test_docs.py docs/pages/<page>.md``.
"""

from __future__ import annotations

import contextlib
import difflib
import importlib.util
import io
import os
import re
import subprocess
import sys
import textwrap
import traceback
import types
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from torch_vjp import _errors

REPO = Path(__file__).resolve().parent.parent
DOCS = REPO / "docs"
PAGES = DOCS / "pages"
CONFIG = DOCS / "mkdocs.yml"

# The modules that the ``docs`` extra provides and mkdocs.yml uses.
DOCS_TOOLCHAIN = {
    "mkdocs": "mkdocs",
    "material": "mkdocs-material",
    "mkdocstrings": "mkdocstrings",
    "mkdocstrings_handlers.python": "mkdocstrings-python",
}

# A fenced block opened by ```python (optionally with attributes) and closed by ``` at the
# same indentation; the indentation allows blocks nested in admonitions or lists.
_PYTHON = re.compile(
    r"^(?P<indent>[ \t]*)```[ \t]*python\b[^\n]*\n(?P<body>.*?)^(?P=indent)```[ \t]*$",
    re.MULTILINE | re.DOTALL,
)
# A ```text block that lists what the python block before it prints.
PRINTED_MARK = "<!-- printed -->"
_PRINTED = re.compile(
    r"^(?P<indent>[ \t]*)<!-- printed -->[ \t]*\n(?P=indent)```[ \t]*text[^\n]*\n"
    r"(?P<body>.*?)^(?P=indent)```[ \t]*$",
    re.MULTILINE | re.DOTALL,
)


@dataclass(frozen=True)
class Block:
    """One ```python block: its number on the page (from 1), first line, and source; and
    the listing of its printed output that follows it, if the page has one."""

    number: int
    line: int
    source: str
    printed: str | None = None
    printed_line: int | None = None
    printed_span: tuple[int, int] | None = None  # character span of the listing's body


def _line_of(text: str, pos: int) -> int:
    return text.count("\n", 0, pos) + 1


def python_blocks(text: str) -> list[Block]:
    """Returns the ```python blocks of a Markdown page, in order, each with the
    ``<!-- printed -->`` listing that follows it (before the next python block), if any."""
    matches = list(_PYTHON.finditer(text))
    listings = list(_PRINTED.finditer(text))
    blocks = []
    for number, match in enumerate(matches, start=1):
        stop = matches[number].start() if number < len(matches) else len(text)
        mine = [m for m in listings if match.end() <= m.start() < stop]
        if len(mine) > 1:
            raise ValueError(
                f"python block {number} (line {_line_of(text, match.start('body'))}) is "
                f"followed by {len(mine)} {PRINTED_MARK} listings; at most one is allowed"
            )
        printed = printed_line = printed_span = None
        if mine:
            indent = mine[0].group("indent")
            body = mine[0].group("body")
            printed = "\n".join(l[len(indent):] if l.startswith(indent) else l
                                 for l in body.split("\n"))
            printed_line = _line_of(text, mine[0].start("body"))
            printed_span = mine[0].span("body")
        blocks.append(
            Block(
                number=number,
                line=_line_of(text, match.start("body")),
                source=textwrap.dedent(match.group("body")),
                printed=printed,
                printed_line=printed_line,
                printed_span=printed_span,
            )
        )
    return blocks


def normalize_output(text: str) -> str:
    """Output compared line by line, ignoring trailing spaces and surrounding blank lines."""
    return "\n".join(line.rstrip() for line in text.strip("\n").split("\n")).strip("\n")


def _missing_toolchain() -> list[str]:
    missing = []
    for module, dist in DOCS_TOOLCHAIN.items():
        try:
            found = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:  # parent package missing
            found = False
        if not found:
            missing.append(dist)
    return missing


def _pages() -> list[Path]:
    return sorted(PAGES.rglob("*.md"))


def _page_id(page: Path) -> str:
    return page.relative_to(PAGES).as_posix()


def test_pages_exist():
    assert CONFIG.is_file(), f"missing {CONFIG}"
    assert _pages(), f"no pages under {PAGES}"


def test_block_parser():
    text = (
        "intro\n```python\nx = 1\n```\n\n```text\nnot run\n```\n"
        "!!! note\n    ```python\n    print(2)\n    ```\n\n"
        "    <!-- printed -->\n    ```text\n    2\n    ```\n"
    )
    blocks = python_blocks(text)
    assert [b.source for b in blocks] == ["x = 1\n", "print(2)\n"]
    assert [(b.number, b.line) for b in blocks] == [(1, 3), (2, 11)]
    assert [b.printed for b in blocks] == [None, "2\n"]
    assert blocks[1].printed_line == 16


def test_block_parser_rejects_two_listings():
    text = "```python\nprint(1)\n```\n" + "<!-- printed -->\n```text\n1\n```\n" * 2
    with pytest.raises(ValueError, match="followed by 2"):
        python_blocks(text)


def test_site_builds_strict(tmp_path):
    missing = _missing_toolchain()
    if missing:
        pytest.skip(
            "docs toolchain not installed (missing: "
            + ", ".join(missing)
            + "); install it with: pip install -e '.[docs]'"
        )
    site = tmp_path / "site"
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(CONFIG), "-d", str(site)],
        cwd=REPO,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, (
        f"mkdocs build --strict failed (exit {result.returncode}):\n"
        f"{result.stdout}\n{result.stderr}"
    )
    assert (site / "index.html").is_file()
    for page in _pages():
        rel = page.relative_to(PAGES).with_suffix("")
        # mkdocs' directory URLs: foo.md -> foo/index.html, sub/index.md -> sub/index.html.
        html = site / (rel.parent if rel.name == "index" else rel) / "index.html"
        assert html.is_file(), f"{_page_id(page)} was not rendered (expected {html})"
    # No page shows a docstring role unrendered (the API page's come from docstrings).
    for page in sorted(site.rglob("index.html")):
        raw = sorted(set(RAW_ROLE.findall(page.read_text(encoding="utf-8"))))
        assert not raw, f"{page.relative_to(site)} shows roles unrendered: {raw[:10]}"
    # Output listings wrap their long lines (the explanation and the fix are at their end).
    home = (site / "index.html").read_text(encoding="utf-8")
    assert '<div class="language-text highlight">' in home
    assert 'href="stylesheets/extra.css"' in home
    css = (site / "stylesheets" / "extra.css").read_text(encoding="utf-8")
    assert re.search(r"\.language-text pre > code[^{]*\{[^}]*white-space: pre-wrap", css)


# A Sphinx role as it shows when nothing renders it: ``:func:`` followed by a name.
RAW_ROLE = re.compile(r":(?:func|class|meth|mod|data|attr|exc|obj):\S*")


def test_roles_render_as_code():
    if _missing_toolchain():
        pytest.skip("docs toolchain not installed; install it with: pip install -e '.[docs]'")
    spec = importlib.util.spec_from_file_location("docs_roles", DOCS / "roles.py")
    roles = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(roles)
    text = (
        "Like :func:`torch.autograd.grad`; raises :class:`~torch_vjp.JacobianCallError`; "
        "see :mod:`torch_vjp.compare` and :py:meth:`Tensor.backward`. ``x`` stays."
    )
    assert roles.render_roles(text) == (
        "Like `torch.autograd.grad`; raises `JacobianCallError`; see `torch_vjp.compare` "
        "and `Tensor.backward`. ``x`` stays."
    )


def test_home_page_states_the_torch_requirement_of_setup_py():
    setup = (REPO / "setup.py").read_text(encoding="utf-8")
    (required,) = re.findall(r'"torch>=([\d.]+)', setup)
    home = (PAGES / "index.md").read_text(encoding="utf-8")
    assert re.findall(r"torch ≥ ([\d.]+)", home) == [required]


class BlockFailed(Exception):
    """A python block of a page raised."""


def run_page(page: Path) -> list[tuple[Block, str]]:
    """Runs a page's python blocks in one fresh namespace; returns each block's output.

    Raises:
        BlockFailed: with the page, block number, line, source and traceback.
    """
    blocks = python_blocks(page.read_text(encoding="utf-8"))
    # the page's code runs in a module of its own, importable as a user's script is (as
    # torch.compile, which an example may call, looks functions' modules up)
    module = types.ModuleType("__docs__")
    sys.modules["__docs__"] = module
    namespace: dict[str, object] = module.__dict__
    saved_env = dict(os.environ)
    saved_dtype = torch.get_default_dtype()
    saved_grad = torch.is_grad_enabled()
    # a page runs as in a fresh process: the warnings shown once per process show on it
    saved_warned = set(_errors._WARNED)
    _errors._WARNED.clear()
    outputs = []
    torch.manual_seed(0)
    try:
        for block in blocks:
            filename = f"docs/pages/{_page_id(page)}, block {block.number} (line {block.line})"
            buffer = io.StringIO()
            try:
                code = compile(block.source, filename, "exec")
                with contextlib.redirect_stdout(buffer):
                    exec(code, namespace)
            except (Exception, SystemExit) as exc:  # reported with the block's source
                raise BlockFailed(
                    f"{_page_id(page)}: python block {block.number} of {len(blocks)} "
                    f"(line {block.line}) raised {type(exc).__name__}: {exc}\n\n"
                    f"{_numbered(block)}\n\nprinted before failing:\n{buffer.getvalue()}\n"
                    f"{traceback.format_exc()}"
                ) from exc
            outputs.append((block, buffer.getvalue()))
    finally:
        sys.modules.pop("__docs__", None)
        os.environ.clear()
        os.environ.update(saved_env)
        torch.set_default_dtype(saved_dtype)
        torch.set_grad_enabled(saved_grad)
        _errors._WARNED.clear()
        _errors._WARNED.update(saved_warned)
    return outputs


def _numbered(block: Block) -> str:
    return "\n".join(
        f"{block.line + i:5d} | {src}"
        for i, src in enumerate(block.source.rstrip("\n").split("\n"))
    )


def _checks_forced_on() -> bool:
    import torch_vjp.autograd

    return bool(getattr(torch_vjp.autograd, "is_checked", lambda: False)())


@pytest.mark.parametrize("page", _pages(), ids=_page_id)
def test_page_examples_run(page: Path):
    blocks = python_blocks(page.read_text(encoding="utf-8"))
    if not blocks:
        pytest.skip(f"{_page_id(page)} has no ```python blocks")
    if _checks_forced_on():
        pytest.skip(
            "torch_vjp checking is on for the whole process (TORCH_VJP_CHECKED=1): the "
            "pages contrast torch's own messages with torch_vjp's, so run them without it"
        )
    try:
        outputs = run_page(page)
    except BlockFailed as exc:
        pytest.fail(str(exc), pytrace=False)
    for block, printed in outputs:
        if block.printed is None:
            continue
        want, got = normalize_output(block.printed), normalize_output(printed)
        if not same_listing(want, got):
            diff = "\n".join(
                difflib.unified_diff(
                    want.split("\n"), got.split("\n"), "listed on the page", "printed",
                    lineterm="",
                )
            )
            pytest.fail(
                f"{_page_id(page)}: the listing at line {block.printed_line} does not match "
                f"what python block {block.number} (line {block.line}) prints:\n{diff}\n\n"
                f"{_numbered(block)}\n\nTo update the listing: python tests/test_docs.py "
                f"docs/pages/{_page_id(page)}",
                pytrace=False,
            )


#: A number in scientific notation, with its sign (a listing's errors and residuals).
_SCIENTIFIC = re.compile(r"-?\d+(?:\.\d+)?e[+-]?\d+")
#: Below this, a printed number is a rounding residue (a float64 error of 1e-10, a Newton
#: residual of 4e-15): its digits depend on the CPU's kernels, not on torch_vjp.
RESIDUE = 1e-6


def same_listing(want: str, got: str) -> bool:
    """Whether a page's listing and what its block printed agree: the same text, except
    that two numbers in scientific notation that are both rounding residues (under
    :data:`RESIDUE`) match whatever their digits. (The same float64 computation rounds
    differently on CPUs with other vector units: a listing of an error of 9.06e-11 printed
    1.94e-10 on another machine.)"""
    if want == got:
        return True
    if _SCIENTIFIC.sub("#", want) != _SCIENTIFIC.sub("#", got):
        return False
    return all(a == b or max(abs(float(a)), abs(float(b))) < RESIDUE
               for a, b in zip(_SCIENTIFIC.findall(want), _SCIENTIFIC.findall(got)))


def update_listings(page: Path) -> int:
    """Rewrites the ``<!-- printed -->`` listings of a page from the current output.

    Returns:
        The number of listings that changed.
    """
    text = page.read_text(encoding="utf-8")
    changed = 0
    # Replace from the end so that earlier spans stay valid. A span covers whole lines,
    # indentation included, up to the closing fence's line.
    for block, printed in reversed(run_page(page)):
        if block.printed is None or block.printed_span is None:
            continue
        if normalize_output(block.printed) == normalize_output(printed):
            continue
        start, end = block.printed_span
        line_start = text.rfind("\n", 0, start) + 1
        fence_line = text[text.rfind("\n", 0, line_start - 1) + 1 : line_start]
        indent = fence_line[: len(fence_line) - len(fence_line.lstrip(" \t"))]
        body = "".join(
            (indent + line).rstrip() + "\n" for line in normalize_output(printed).split("\n")
        )
        text = text[:start] + body + text[end:]
        changed += 1
    page.write_text(text, encoding="utf-8")
    return changed


if __name__ == "__main__":  # python tests/test_docs.py docs/pages/<page>.md ...
    for arg in sys.argv[1:]:
        n = update_listings(Path(arg).resolve())
        print(f"{arg}: {n} listing(s) updated")


def test_readme_first_example_lists_the_error_it_raises():
    # the README's first example lists the error as a comment; it had gone stale (it showed
    # the explanation where torch's own sentence comes first)
    text = (REPO / "README.md").read_text()
    block = re.search(r"```python\n(.*?)```", text, re.S).group(1)
    code = "\n".join(line for line in block.splitlines() if not line.startswith("#"))
    listed = " ".join(line.lstrip("#").strip() for line in block.splitlines()
                      if line.startswith("#"))
    with pytest.raises(Exception) as info:  # noqa: PT011 - the listing names the class
        exec(compile(code, "README.md", "exec"), {})
    err = info.value
    shown = "".join(traceback.format_exception_only(type(err), err))
    shown = shown.replace(f"{type(err).__module__}.{type(err).__qualname__}",
                          f"torch_vjp.{type(err).__qualname__}")
    assert listed == " ".join(shown.split())


def _markdown_rows(text: str, header_start: str) -> list[list[str]]:
    """The body rows of the Markdown table whose header line starts with ``header_start``."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header_start))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    return rows


def test_strategies_page_shows_the_committed_crossover_results():
    # the page says its tables are the committed results of benchmarks/crossover.py; they
    # had stayed those of an earlier run (1 thread, 5 rounds, 2026-11-21) after the results
    # were measured again (2 threads, 3 rounds, 2026-11-23)
    import json

    results = json.loads((REPO / "benchmarks" / "results" / "crossover.json").read_text())
    page = (PAGES / "strategies.md").read_text(encoding="utf-8")
    env = results["environment"]
    date = env["date"].split()[0]
    assert f"Measured {date} with torch {env['torch']}" in page
    assert f"{env['threads']} thread{'s' if env['threads'] > 1 else ''}," in page
    assert f"{env['rounds']} interleaved rounds" in page
    assert f"({env['clock']} clock)" in page

    sweep = _markdown_rows(page, "| n_in \\ n_out")
    columns = sorted({r["n_out"] for r in results["sweep"]})
    assert [int(row[0]) for row in sweep] == sorted({r["n_in"] for r in results["sweep"]})
    for row in sweep:
        for n_out, cell in zip(columns, row[1:]):
            (entry,) = [r for r in results["sweep"]
                        if r["n_in"] == int(row[0]) and r["n_out"] == n_out]
            picks_fwd = n_out > results["FWD_OUT_IN_RATIO"] * int(row[0]) + results["FWD_OFFSET"]
            assert cell == (f"**{entry['fwd_over_rev']:.2f}**" if picks_fwd
                            else f"{entry['fwd_over_rev']:.2f}"), (row[0], n_out)

    grid = _markdown_rows(page, "| case | n_in -> n_out")
    assert [row[0] for row in grid] == [r["case"] for r in results["grid"]]
    for row, entry in zip(grid, results["grid"]):
        assert row[1] == f"{entry['n_in']} -> {entry['n_out']}"
        assert row[2:] == [f"`{entry['auto_picks']}`", f"`{entry['best']}`",
                           f"{entry['auto_over_best']:.2f}"], entry["case"]


_NUMBER = re.compile(r"\d+(?:\.\d+)?(?:e[+-]?\d+)?(?:\s*(?:ns|us|ms|s|B|kB|MB|GB|x|%))?")


def _report_shape(listing: str) -> list[str]:
    """A compare_strategies table with its measurements left out: the header lines (numbers
    as ``#``), then per row the strategy and its outcome (``ok`` for ok and best, since which
    strategy is fastest depends on the machine; ``failed: <exception class>``)."""
    lines = normalize_output(listing).split("\n")
    sep = next(i for i, line in enumerate(lines) if line.startswith("--------"))
    shape = [" ".join(re.sub("-+", "-", _NUMBER.sub("#", line)).split())
             for line in lines[: sep + 1]]
    for row in lines[sep + 1:]:
        strategy, rest = row.split(None, 1)
        failed = re.search(r"\bfailed: (\w+)", rest)
        shape.append(f"{strategy} failed: {failed.group(1)}" if failed else f"{strategy} ok")
    return shape


def test_benchmarks_page_lists_reports_as_compare_strategies_prints_them():
    # the listings after the compare_strategies examples are not exact (times vary), but
    # their columns, header lines and outcomes must be what str(report) prints: they had
    # gone stale (no IQR column, no 'time:' line, failures of torch's classes where the
    # strategies now raise torch_vjp's)
    page = PAGES / "benchmarks.md"
    text = page.read_text(encoding="utf-8")
    listings = re.findall(r"^```text\n(compare_strategies:.*?)^```", text, re.M | re.S)
    assert len(listings) == 2
    printed = [out for _, out in run_page(page) if out.startswith("compare_strategies:")]
    assert len(printed) == 2
    for listed, got in zip(listings, printed):
        assert _report_shape(listed) == _report_shape(got)


def test_pages_have_no_one_word_sentence_left_over_from_an_edit():
    # per-sample.md read "... for such a model. rules. Every row is then tested ...": the
    # end of a sentence that an edit had moved away
    for page in [*_pages(), REPO / "README.md"]:
        prose = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
        prose = " ".join(re.sub(r"`[^`]*`", "``", prose).split())
        fragments = [prose[max(0, m.start() - 60): m.end() + 30]
                     for m in re.finditer(r"[a-z)\]]\. [a-z]\w*\. ", prose)]
        assert not fragments, f"{page.name}: {fragments}"


def test_dp_sgd_loops_on_the_pages_sample_as_the_accountant_assumes():
    # per-sample.md's "DP-SGD training loop" drew fixed-size batches with torch.randint
    # (with replacement) and divided by that size; the accountants the docs recommend assume
    # Poisson sampling and a division by the expected batch size
    loops = [(page, block) for page in _pages()
             for block in python_blocks(page.read_text(encoding="utf-8"))
             if "accumulate_clipped_grads(" in block.source and ".step()" in block.source]
    assert len(loops) >= 3
    for page, block in loops:
        where = f"{_page_id(page)}, block {block.number} (line {block.line})"
        assert "torch.randint" not in block.source and "randperm" not in block.source, where
        assert re.search(r"torch\.rand\(.*\) < q\b", block.source), where


def test_a_listing_right_after_a_python_block_is_checked():
    # grad-outputs.md listed what its outer-product example prints without the mark, so the
    # listing was never compared; the compare_strategies tables (times vary) are checked by
    # test_benchmarks_page_lists_reports_as_compare_strategies_prints_them
    for page in _pages():
        lines = page.read_text(encoding="utf-8").split("\n")
        in_python = False
        for n, line in enumerate(lines):
            if re.match(r"\s*```\s*python\b", line):
                in_python = True
            elif in_python and line.strip() == "```":
                in_python = False
                after = n + 1
                while after < len(lines) and not lines[after].strip():
                    after += 1
                if (after < len(lines) and lines[after].strip().startswith("```text")
                        and not lines[after + 1].startswith("compare_strategies:")):
                    raise AssertionError(
                        f"{_page_id(page)}:{after + 1}: a ```text listing follows a python "
                        f"block without a {PRINTED_MARK} line, so it is not checked")


def test_the_jacobian_signature_listed_on_the_scaling_page_is_the_real_one():
    # it had not gained compile=False
    import inspect

    import torch_vjp as tv

    page = (PAGES / "scaling.md").read_text(encoding="utf-8")
    listed = re.search(r"^tv\.jacobian\((.*?)\)\n```", page, re.M | re.S).group(1)
    listed = [p.strip() for p in " ".join(listed.split()).split(",")]
    real = []
    for p in inspect.signature(tv.jacobian).parameters.values():
        name = {p.VAR_POSITIONAL: f"*{p.name}"}.get(p.kind, p.name)
        real.append(name if p.default is p.empty else f"{name}={p.default!r}".replace("'", '"'))
    assert listed == real


def test_the_readme_layout_names_every_module_of_the_package():
    # (modules added later, _nested_messages.py, _per_sample/keep.py and others, were missing
    # from the Layout section: a newcomer looking for them there did not find them)
    text = (REPO / "README.md").read_text()
    layout = text[text.index("## Layout"):]
    layout = layout[:layout.index("```", layout.index("```") + 3)]
    missing = [
        str(path.relative_to(REPO / "torch_vjp"))
        for path in sorted((REPO / "torch_vjp").rglob("*.py"))
        if path.name != "__init__.py" and not re.search(rf"\b{re.escape(path.stem)}\b", layout)
    ]
    assert missing == [], f"the README's Layout section does not name {missing}"


@pytest.mark.parametrize("want, got, same", [
    ("err 9.06e-11", "err 1.94e-10", True),     # residues: the CPU's rounding
    ("|r| = 4.567e-15", "|r| = 4.378e-15", True),
    ("|r| = 1.585e-08", "|r| = 1.586e-08", True),
    ("|r| = 9.330e-03", "|r| = 9.331e-03", False),  # a real value must match
    ("err 9.06e-11 ok", "err 9.06e-11 wrong", False),
    ("max u = 0.555732", "max u = 0.555733", False),
    ("err 1e-3", "err 1e-7", False),
])
def test_listings_match_up_to_rounding_residues_only(want, got, same):
    assert same_listing(want, got) is same

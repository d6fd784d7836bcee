"""Tests of ``python -m torch_vjp bench`` and the suite behind it (torch_vjp.bench).

The runs here use ``--only`` on two small workloads and a tiny ``--min-run-time`` so that
they take seconds; they check what the command prints, the JSON it writes, the Markdown
and the PNG, not any timing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from torch_vjp.__main__ import DEFAULT_PLOT, main
from torch_vjp.bench import (
    HEADLINE,
    METHODS,
    SCHEMA,
    WORKLOADS,
    get_methods,
    get_workloads,
    jax_available,
    load_json,
    reference,
)

REPO = Path(__file__).resolve().parent.parent
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
SMALL = ["--only", "two_input,jacobian_of", "--min-run-time", "0.002", "--no-progress"]
TORCH_2_13 = torch.__version__.startswith("2.13.")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One small run of the command, shared by the tests that read its outputs."""
    pytest.importorskip("matplotlib")
    out = tmp_path_factory.mktemp("bench")
    argv = ["bench", "--quick", *SMALL, "--json", str(out / "r.json"),
            "--plot", str(out / "r.png"), "--markdown", str(out / "r.md")]
    import contextlib
    import io

    buffer = io.StringIO()
    threads = torch.get_num_threads()
    with contextlib.redirect_stdout(buffer):
        status = main(argv)
    assert torch.get_num_threads() == threads, "the run must restore torch's thread count"
    return status, buffer.getvalue(), out


def test_exit_status_and_last_line(run):
    status, stdout, out = run
    assert status == 0
    lines = stdout.rstrip("\n").splitlines()
    assert lines[-1] == f"plot: {out / 'r.png'}"
    assert f"json: {out / 'r.json'}" in lines
    assert f"markdown: {out / 'r.md'}" in lines


def test_table_content(run):
    _, stdout, _ = run
    # Without jax, one notice line says its methods are left out; the table header follows.
    lines = stdout.splitlines()
    if lines[0].startswith("jax is not installed"):
        lines = lines[1:]
    assert lines[0].startswith("torch_vjp ")
    assert f"torch {torch.__version__}" in stdout
    assert "two_input: two inputs" in stdout
    assert "jacobian_of_256: Jacobian of an already computed output" in stdout
    for method in ("torch_vjp auto", "torch.func.jacrev", "torch.func.jacfwd",
                   "autograd.functional.jacobian(vectorize=True)", "torch_vjp jacobian_of",
                   "autograd.grad(is_grads_batched=True)"):
        assert method in stdout
    # torch.autograd.functional's forward mode fails on this network in torch 2.13: the
    # table shows its error instead of a time.
    forward = next(line for line in stdout.splitlines()
                   if "autograd.functional.jacobian(forward-mode)" in line)
    if TORCH_2_13:
        assert "FAILED: RuntimeError: Trying to set a forward gradient" in forward
    # The summary: one line per workload, the fastest method and torch_vjp's ratio to it.
    summary = stdout[stdout.index("summary"):].splitlines()
    assert summary[1].split()[:3] == ["workload", "fastest", "method"]
    assert [line.split()[0] for line in summary[3:5]] == ["two_input", "jacobian_of_256"]
    # Exactly one row per block is marked fastest.
    blocks = stdout.split("\n\n")
    for block in blocks:
        if block.startswith(("two_input:", "jacobian_of_256:")):
            assert sum(line.lstrip().startswith("*") for line in block.splitlines()) == 1


def test_json_schema(run):
    _, stdout, out = run
    data = json.loads((out / "r.json").read_text())
    assert data["schema"] == SCHEMA
    env = data["environment"]
    for key in ("torch", "jax", "python", "cpu", "threads", "device", "dtype", "quick",
                "min_run_time", "date"):
        assert key in env
    assert env["torch"] == torch.__version__ and env["device"] == "cpu" and env["quick"] is True
    assert env["threads"] >= 1 and env["dtype"] == "float32"
    assert [w["name"] for w in data["workloads"]] == ["two_input", "jacobian_of_256"]
    for w in data["workloads"]:
        assert set(w) >= {"name", "title", "kind", "jacobian_shapes", "tolerance", "results",
                          "best", "headline", "headline_over_best"}
        assert w["headline"] == HEADLINE[w["kind"]]
        names = [r["method"] for r in w["results"]]
        assert names == [m.name for m in get_methods(w["kind"], jax=env["jax"] is not None,
                                                      quick=True)]
        for r in w["results"]:
            assert r["status"] in ("ok", "wrong", "failed")
            if r["status"] == "failed":
                assert r["time_s"] is None and r["error"]
            else:
                assert r["time_s"] > 0 and r["ratio"] >= 1.0 and r["max_abs_error"] is not None
        best = min((r for r in w["results"] if r["status"] == "ok"), key=lambda r: r["time_s"])
        assert w["best"] == best["method"]
    two = data["workloads"][0]
    assert two["jacobian_shapes"] == [[256, 128], [256, 64]]
    statuses = {r["method"]: r["status"] for r in two["results"]}
    assert statuses["torch_vjp auto"] == "ok"
    if TORCH_2_13:
        assert statuses["autograd.functional.jacobian(forward-mode)"] == "failed"
    if env["jax"] is not None:
        assert statuses["jax.jit(jax.jacrev)"] == "ok" and statuses["jax.jit(jax.jacfwd)"] == "ok"
    # The file reads back into the very table that was printed.
    assert load_json(out / "r.json").table() in stdout


def test_markdown_and_png(run):
    _, _, out = run
    md = (out / "r.md").read_text()
    assert md.startswith("# torch_vjp Jacobian benchmark")
    assert "![suite results](r.png)" in md
    assert "| workload | fastest method | its time |" in md
    assert "## two_input" in md and "(fastest)" in md
    png = (out / "r.png").read_bytes()
    assert png[:8] == PNG_MAGIC and len(png) > 10_000


def test_default_plot_path(tmp_path, monkeypatch, capsys):
    pytest.importorskip("matplotlib")
    monkeypatch.chdir(tmp_path)
    status = main(["bench", *SMALL, "--only", "jacobian_of", "--no-jax"])
    assert status == 0
    assert capsys.readouterr().out.rstrip().splitlines()[-1] == f"plot: {DEFAULT_PLOT}"
    assert (tmp_path / DEFAULT_PLOT).read_bytes()[:8] == PNG_MAGIC


@pytest.mark.parametrize("argv,message", [
    (["bench", "--only", "nope"], "--only: no workload matches 'nope'; workloads: mlp_8x512"),
    (["bench", "--methods", "jacrevv"], "--methods: unknown method(s) ['jacrevv']; see --list"),
    (["bench", "--threads", "0"], "--threads 0: must be at least 1"),
    (["bench", "--device", "tpu"], "--device tpu: only cpu and cuda are supported"),
], ids=["unknown-workload", "unknown-method", "zero-threads", "unknown-device"])
def test_usage_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_without_a_gpu_is_a_usage_error(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "--device", "cuda"])
    assert "--device cuda: torch.cuda.is_available() is False" in capsys.readouterr().err


def test_no_command_prints_help(capsys):
    assert main([]) == 2
    assert "bench" in capsys.readouterr().out


def test_list(capsys):
    assert main(["bench", "--list"]) == 0
    out = capsys.readouterr().out
    for w in WORKLOADS:
        assert w.name in out
    for m in METHODS:
        assert m.name in out


def test_module_entry_point():
    """``python -m torch_vjp`` runs main() (the console script ``torch-vjp`` targets it too)."""
    result = subprocess.run([sys.executable, "-m", "torch_vjp", "bench", "--list"],
                            capture_output=True, text=True, timeout=120, cwd=REPO,
                            env={**os.environ, "TORCH_VJP_AUTOLOAD": "0"})
    assert result.returncode == 0, result.stderr
    assert "mlp_8x512" in result.stdout


# ---- the suite's definitions -----------------------------------------------------------


def test_workload_selection():
    quick = get_workloads(quick=True)
    assert all(w.quick for w in quick) and len(quick) < len(WORKLOADS)
    assert [w.name for w in get_workloads("mlp_1024")] == ["mlp_1024x1024"]
    names = {w.name for w in WORKLOADS}
    # The grid and the extra workloads are all there.
    assert {"mlp_8x512", "mlp_512x8", "mlp_256x256", "mlp_1024x1024", "elementwise_4096",
            "two_input", "batch_mlp_64x32", "conv_input", "module_params",
            "jacobian_of_256"} <= names
    with pytest.raises(ValueError, match="no workload matches 'zzz'"):
        get_workloads("zzz")


@pytest.mark.parametrize("workload", WORKLOADS, ids=lambda w: w.name)
def test_workload_builds_the_same_numbers_in_every_dtype(workload):
    c32 = workload.build(torch.float32)
    c64 = workload.build(torch.float64)
    for k in c64.params:
        torch.testing.assert_close(c32.params[k], c64.params[k].float())
    out32 = c32.f(*c32.primals)
    out64 = c64.f(*c64.primals)
    torch.testing.assert_close(out32, out64.float(), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("workload", [w for w in WORKLOADS if w.jax_fn is not None],
                         ids=lambda w: w.name)
def test_jax_version_is_the_same_function(workload):
    if not jax_available():
        pytest.skip("jax is not installed (it is optional)")
    import jax.numpy as jnp
    import numpy as np
    from jax import lax

    case = workload.build(torch.float32)
    params = {k: jnp.asarray(v.numpy()) for k, v in case.params.items()}
    inputs = [jnp.asarray(x.numpy()) for x in case.inputs]
    got = np.array(workload.jax_fn(jnp, lax, params, *inputs))
    want = workload.torch_fn(case.params, *case.inputs)
    torch.testing.assert_close(torch.from_numpy(got), want, rtol=1e-4, atol=1e-5)


def test_reference_of_a_batch_workload_is_the_per_example_blocks():
    (w,) = get_workloads("batch_mlp")
    ref = reference(w)
    case = w.build(torch.float64)
    x = case.primals[0]
    assert ref.shape == (64, 32, 32)
    torch.testing.assert_close(ref[5], torch.func.jacrev(case.f_single)(x[5]))


# ---- usage errors are found before the run -----------------------------------------------


@pytest.fixture
def no_run(monkeypatch):
    """Fails the test if the suite starts: a usage error must be reported before it."""
    import torch_vjp.bench

    def run_suite(*args, **kwargs):
        raise AssertionError("the suite ran although the command line was wrong")

    monkeypatch.setattr(torch_vjp.bench, "run_suite", run_suite)


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "0", "-1", "abc"])
def test_bad_min_run_time_is_a_usage_error(value, capsys, no_run):
    with pytest.raises(SystemExit) as info:
        main(["bench", f"--min-run-time={value}"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "torch-vjp bench: error: argument --min-run-time: " in err
    assert (f"{value!r} is not a valid time: it must be a finite number of seconds > 0, the "
            "timing budget of each method per round") in err


@pytest.mark.parametrize("path,message", [
    ("out.txt", "--plot {path}: matplotlib cannot write .txt files; the extension chooses "
                "the format. Supported: "),
    ("out", "--plot {path}: the file name has no extension, and the extension chooses the "
            "format (matplotlib would write {path}.png instead). Supported: "),
], ids=["unsupported-extension", "no-extension"])
def test_plot_format_is_checked_before_the_run(path, message, tmp_path, capsys, no_run):
    pytest.importorskip("matplotlib")
    path = str(tmp_path / path)
    with pytest.raises(SystemExit) as info:
        main(["bench", "--plot", path])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert message.format(path=path) in err
    from matplotlib.figure import Figure

    for ext in Figure().canvas.get_supported_filetypes():
        assert f".{ext}" in err
    assert f"Fix: --plot {tmp_path / 'out.png'}" in err


def test_plot_format_is_not_checked_with_no_plot(monkeypatch, capsys):
    import torch_vjp.bench

    ran = []
    monkeypatch.setattr(torch_vjp.bench, "run_suite", lambda *a, **k: ran.append(1) or _empty())
    assert main(["bench", "--no-plot", "--plot", "out.txt", "--only", "jacobian_of"]) == 0
    assert ran


def _empty():
    from torch_vjp.bench import SuiteResult

    class _Result(SuiteResult):
        def table(self):
            return "table"

    return _Result({}, [])


@pytest.mark.parametrize("option", ["--json", "--markdown", "--plot"])
def test_output_path_that_cannot_be_written_is_a_usage_error(option, tmp_path, capsys, no_run):
    (tmp_path / "file").write_text("in the way")
    path = tmp_path / "file" / "sub" / "out.png"
    with pytest.raises(SystemExit) as info:
        main(["bench", option, str(path)])
    assert info.value.code == 2
    assert (f"{option} {path}: cannot be written: {tmp_path / 'file'} is a file, not a "
            f"folder") in capsys.readouterr().err


def test_output_path_that_is_a_folder_is_a_usage_error(tmp_path, capsys, no_run):
    with pytest.raises(SystemExit):
        main(["bench", "--json", str(tmp_path)])
    assert (f"--json {tmp_path}: is a folder, but a file name is expected, e.g. --json "
            f"{tmp_path / 'results.json'}") in capsys.readouterr().err


@pytest.mark.parametrize("argv,message", [
    (["--only", ","], "--only ',': names no workload; pass names or parts of names"),
    (["--methods", ","], "--methods ',': names no method; pass exact method names"),
    (["--methods", ""], "--methods '': names no method"),
    (["--only", "jacobian_of", "--methods", "torch.func.jacrev"],
     "--methods: none of ['torch.func.jacrev'] runs on the selected workloads "
     "(jacobian_of_256): they serve jacobian workloads, and the selected workloads are "
     "jacobian_of. See --list"),
    (["--quick", "--methods", "autograd.grad loop"],
     "--methods: none of ['autograd.grad loop'] runs on the selected workloads "
     "(mlp_8x512, mlp_512x8, two_input, batch_mlp_64x32, jacobian_of_256): --quick leaves "
     "out the Python-loop methods."),
    (["--no-jax", "--only", "two_input", "--methods", "jax.jit(jax.jacrev)"],
     "jax's methods run only with jax installed, on --device cpu, without --no-jax"),
], ids=["no-workload", "no-method", "empty-methods", "kind-mismatch", "quick-drops-slow",
        "no-jax"])
def test_selection_that_runs_nothing_is_a_usage_error(argv, message, capsys, no_run):
    with pytest.raises(SystemExit) as info:
        main(["bench", *argv])
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_cuda_device_index_out_of_range_is_a_usage_error(monkeypatch, capsys, no_run):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(SystemExit):
        main(["bench", "--device", "cuda:3"])
    assert ("torch-vjp bench: error: --device cuda:3: this machine has 1 CUDA device "
            "(cuda:0..cuda:0)") in capsys.readouterr().err


# ---- after the run, a file that cannot be written is reported, not a traceback --------------

TINY = ["bench", "--only", "two_input,jacobian_of", "--methods", "torch_vjp jacobian_of",
        "--min-run-time", "0.002", "--rounds", "1", "--no-progress", "--no-jax"]


def test_workloads_no_selected_method_serves_are_left_out(tmp_path, capsys):
    assert main([*TINY, "--no-plot", "--json", str(tmp_path / "r.json")]) == 0
    out = capsys.readouterr().out
    assert "left out (no selected method serves them): two_input" in out
    data = json.loads((tmp_path / "r.json").read_text())
    assert [w["name"] for w in data["workloads"]] == ["jacobian_of_256"]


def test_plot_that_cannot_be_saved_after_the_run(tmp_path, monkeypatch, capsys):
    pytest.importorskip("matplotlib")
    import torch_vjp.bench.plot

    def plot_suite(result, path):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(torch_vjp.bench.plot, "plot_suite", plot_suite)
    plot, js, md = tmp_path / "r.png", tmp_path / "r.json", tmp_path / "r.md"
    status = main([*TINY, "--plot", str(plot), "--json", str(js), "--markdown", str(md)])
    captured = capsys.readouterr()
    assert status == 1
    assert (f"plot: not written: could not write {plot}: PermissionError: [Errno 13] "
            f"Permission denied") in captured.err
    assert "Traceback" not in captured.err
    # The table, the JSON and the Markdown (without the picture) are all there.
    assert "jacobian_of_256: Jacobian of an already computed output" in captured.out
    assert f"json: {js}" in captured.out and f"markdown: {md}" in captured.out
    assert not captured.out.rstrip().splitlines()[-1].startswith("plot:")
    assert json.loads(js.read_text())["schema"] == SCHEMA
    assert "![suite results]" not in md.read_text()


def test_json_that_cannot_be_written_after_the_run(tmp_path, monkeypatch, capsys):
    from torch_vjp.bench import SuiteResult

    def write_json(self, path):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(SuiteResult, "write_json", write_json)
    js, md = tmp_path / "r.json", tmp_path / "r.md"
    status = main([*TINY, "--no-plot", "--json", str(js), "--markdown", str(md)])
    captured = capsys.readouterr()
    assert status == 1
    assert (f"json: not written: could not write {js}: OSError: [Errno 28] No space left on "
            f"device") in captured.err
    assert "jacobian_of_256" in captured.out and md.read_text().startswith("# torch_vjp")


def test_without_matplotlib_the_plot_is_not_checked_and_not_written(tmp_path, monkeypatch,
                                                                    capsys):
    import torch_vjp.__main__ as cli

    monkeypatch.setattr(cli, "_plot_formats", lambda: None)  # as without matplotlib
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    js = tmp_path / "r.json"
    status = main([*TINY, "--plot", str(tmp_path / "r.txt"), "--json", str(js)])
    captured = capsys.readouterr()
    assert status == 1
    assert "plot: not written: " in captured.err
    assert "pip install 'torch_vjp[bench]'" in captured.err
    assert js.is_file()


# ---- the library entry points check their options too ------------------------------------


@pytest.mark.parametrize("kwargs,message", [
    ({"min_run_time": float("nan")}, r"min_run_time=nan, but it must be a finite number of "
                                     r"seconds > 0"),
    ({"min_run_time": float("inf")}, r"min_run_time=inf, but it must be a finite number"),
    ({"rounds": 0}, r"rounds=0, but it must be an int >= 1: how many times each method is "
                    r"timed"),
    ({"threads": 0}, r"threads=0, but it must be an int >= 1: the torch\.set_num_threads"),
    ({"aggregate": "mean"}, r"aggregate='mean', but it must be 'min' .* or 'median'"),
], ids=["nan", "inf", "rounds", "threads", "aggregate"])
def test_run_suite_option_errors(kwargs, message):
    from torch_vjp._errors import JacobianOptionError
    from torch_vjp.bench import run_suite

    with pytest.raises(JacobianOptionError, match=r"torch_vjp\.bench\.run_suite: " + message):
        run_suite(get_workloads("jacobian_of"), progress=False, **kwargs)


def test_plot_suite_of_an_empty_result_raises():
    from torch_vjp._errors import JacobianOptionError
    from torch_vjp.bench import plot_suite, run_suite

    result = run_suite(get_workloads("jacobian_of"), methods=["torch.func.jacrev"],
                       min_run_time=0.002, progress=False, use_jax=False)
    assert result.workloads[0].results == []
    with pytest.raises(JacobianOptionError, match=r"torch_vjp\.bench\.plot_suite: the result "
                       r"holds 1 workload and no method's result, so there is nothing to draw"):
        plot_suite(result, "never-written.png")

"""Tests of ``python -m torch_vjp bench`` and the suite behind it (torch_vjp.bench).

The runs here use ``--only`` on two small workloads and a tiny ``--min-run-time`` so that
they take seconds; they check what the command prints, the JSON it writes, the Markdown
and the PNG, not any timing.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
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
    jax_runs_on,
    load_json,
    reference,
)
from torch_vjp.bench.suite import machine_note
from torch_vjp._measure import NOISY_SPREAD

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

    from torch_vjp._engine import compile_checks

    buffer = io.StringIO()
    threads = torch.get_num_threads()
    # (the compiled method's program built with aot_eager, NOTE [the backend of the tests]:
    # these tests read the outputs, not what inductor's C++ costs)
    backend, compile_checks.BACKEND = compile_checks.BACKEND, "aot_eager"
    try:
        with contextlib.redirect_stdout(buffer):
            status = main(argv)
    finally:
        compile_checks.BACKEND = backend
    assert torch.get_num_threads() == threads, "the run must restore torch's thread count"
    return status, buffer.getvalue(), out


def test_exit_status_and_where_the_results_went(run):
    status, stdout, out = run
    assert status == 0
    lines = stdout.rstrip("\n").splitlines()
    assert lines[-3:] == [f"table: printed above; as Markdown in {out / 'r.md'}",
                          f"json: {out / 'r.json'}", f"plot: {out / 'r.png'}"]


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
    # torch.autograd.functional's forward mode fails on this network in torch 2.13: torch
    # itself does not support it there, which the table says instead of a time (and not
    # as a failure, which is what a torch_vjp method that raised would show).
    forward = next(line for line in stdout.splitlines()
                   if "autograd.functional.jacobian(forward-mode)" in line)
    if TORCH_2_13:
        assert "not supported by torch (RuntimeError: Trying to set a forward gradient" in forward
        assert "FAILED" not in forward
    # Every time comes with its spread, and the header says how both were obtained.
    assert "time: the median of the rounds' medians" in stdout
    assert "IQR: interquartile range of every timed block" in stdout
    assert "noisy: IQR over 25% of the time, too wide to rank" in stdout
    block = stdout[stdout.index("two_input:"):].split("\n\n")[0].splitlines()
    assert block[1].split()[:5] == ["method", "time", "IQR", "x", "best"]
    auto = next(line for line in block if line.lstrip("* ").startswith("torch_vjp auto"))
    assert re.search(r"\d%", auto)
    # The summary: one line per workload, the fastest method and torch_vjp's ratio to it.
    summary = stdout[stdout.index("summary"):].splitlines()
    assert summary[1].split()[:3] == ["workload", "fastest", "method"]
    assert [line.split()[0] for line in summary[3:5]] == ["two_input", "jacobian_of_256"]
    assert re.search(r"\(IQR \d+%(, noisy)?\)", summary[3])
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
    assert env["all_methods"] is False and env["aggregate"] == "median"
    assert env["noisy_spread"] == NOISY_SPREAD
    assert [w["name"] for w in data["workloads"]] == ["two_input", "jacobian_of_256"]
    assert [(w["n_in"], w["n_out"]) for w in data["workloads"]] == [(192, 256), (64, 256)]
    for w in data["workloads"]:
        assert set(w) >= {"name", "title", "kind", "jacobian_shapes", "tolerance", "results",
                          "best", "headline", "headline_over_best"}
        assert w["headline"] == HEADLINE[w["kind"]]
        names = [r["method"] for r in w["results"]]
        assert names == [m.name for m in get_methods(w["kind"], jax=env["jax"] is not None)]
        assert not any(m.slow for m in METHODS if m.name in names)  # only with --all
        for r in w["results"]:
            assert r["status"] in ("ok", "wrong", "failed", "unsupported")
            if r["status"] in ("failed", "unsupported"):
                assert r["time_s"] is None and r["error"]
            else:
                assert r["time_s"] > 0 and r["ratio"] >= 1.0 and r["max_abs_error"] is not None
                assert r["samples"] >= 2 and len(r["round_times_s"]) == env["rounds"]
                assert r["q1_s"] <= r["q3_s"] and r["iqr_s"] == pytest.approx(
                    r["q3_s"] - r["q1_s"])
                assert r["noisy"] == (r["iqr_s"] / r["time_s"] > NOISY_SPREAD)
        best = min((r for r in w["results"] if r["status"] == "ok"), key=lambda r: r["time_s"])
        assert w["best"] == best["method"]
    two = data["workloads"][0]
    assert two["jacobian_shapes"] == [[256, 128], [256, 64]]
    statuses = {r["method"]: r["status"] for r in two["results"]}
    assert statuses["torch_vjp auto"] == "ok"
    assert statuses["torch_vjp compiled"] == "ok"  # compile=True, checked like the others
    compiled = next(r for r in two["results"] if r["method"] == "torch_vjp compiled")
    assert compiled["first_call_s"] > compiled["time_s"]  # compiling is in the first call
    if TORCH_2_13:
        assert statuses["autograd.functional.jacobian(forward-mode)"] == "unsupported"
    if env["jax"] is not None:
        assert statuses["jax.jit(jax.jacrev)"] == "ok" and statuses["jax.jit(jax.jacfwd)"] == "ok"
    # The file reads back into the very table that was printed.
    assert load_json(out / "r.json").table() in stdout


def test_markdown_and_png(run):
    _, _, out = run
    md = (out / "r.md").read_text()
    assert md.startswith("# torch_vjp Jacobian benchmark")
    assert "[![suite results](r.png)](r.png)" in md  # the figure links to its full size
    assert "| workload | fastest method | its time |" in md
    assert ("| workload | fastest method | its time | torch_vjp default | default / fastest | "
            "default / fastest torch | torch_vjp compiled | compiled / fastest jax |") in md
    assert "| method | time | IQR | x best | max abs err | first call | note |" in md
    assert "| torch_vjp compiled | " in md
    assert "## two_input" in md and "(fastest)" in md
    if TORCH_2_13:
        assert "| not supported by torch (RuntimeError: Trying to set a forward" in md
    png = (out / "r.png").read_bytes()
    assert png[:8] == PNG_MAGIC and len(png) > 10_000


def test_default_outputs(tmp_path, monkeypatch, capsys):
    """Without options the table, the JSON and the plot go to bench-results/, and the last
    three lines say so."""
    pytest.importorskip("matplotlib")
    monkeypatch.chdir(tmp_path)
    status = main(["bench", *SMALL, "--only", "jacobian_of", "--no-jax"])
    assert status == 0
    folder = Path(DEFAULT_PLOT).parent
    assert capsys.readouterr().out.rstrip().splitlines()[-3:] == [
        f"table: printed above; as Markdown in {folder / 'jacobian_suite.md'}",
        f"json: {folder / 'jacobian_suite.json'}",
        f"plot: {DEFAULT_PLOT}",
    ]
    assert (tmp_path / DEFAULT_PLOT).read_bytes()[:8] == PNG_MAGIC
    assert load_json(tmp_path / folder / "jacobian_suite.json").workloads[0].name == \
        "jacobian_of_256"
    assert (tmp_path / folder / "jacobian_suite.md").read_text().startswith("# torch_vjp")


def test_out_and_no_save(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main([*TINY, "--out", "elsewhere", "--no-plot"]) == 0
    out = capsys.readouterr().out
    assert f"json: {Path('elsewhere') / 'jacobian_suite.json'}" in out
    assert (tmp_path / "elsewhere" / "jacobian_suite.md").is_file()
    assert main([*TINY, "--no-save"]) == 0
    assert capsys.readouterr().out.rstrip().splitlines()[-1] == "table: printed above"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["elsewhere"]


def test_version(capsys):
    import torch_vjp

    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out == (f"torch_vjp {torch_vjp.__version__} "
                                       f"(torch {torch.__version__})\n")


@pytest.mark.parametrize("command", ["module", "console-script"])
def test_version_from_the_command_line(command):
    import torch_vjp

    if command == "module":
        argv = [sys.executable, "-m", "torch_vjp", "--version"]
    else:
        # setup.py's console script; it exists where the package is installed.
        script = Path(sys.executable).parent / "torch-vjp"
        if not script.is_file():
            pytest.skip(f"the torch-vjp console script is not installed next to "
                        f"{sys.executable} (pip install -e . installs it)")
        argv = [str(script), "--version"]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=REPO,
                            env={**os.environ, "TORCH_VJP_AUTOLOAD": "0"})
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"torch_vjp {torch_vjp.__version__} (torch ")


@pytest.mark.parametrize("argv,message", [
    (["bench", "--only", "nope"], "--only: no workload matches 'nope'; workloads: mlp_8x512"),
    (["bench", "--methods", "jacrevv"], "--methods: unknown method(s) ['jacrevv']; see --list"),
    (["bench", "--threads", "0"], "--threads 0: must be at least 1"),
    (["bench", "--device", "tpu"], "--device tpu: only cpu and cuda are supported"),
    (["bench", "--rounds", "0"], "--rounds 0: must be at least 1"),
    (["bench", "--plot-columns", "0"], "--plot-columns 0: must be at least 1"),
], ids=["unknown-workload", "unknown-method", "zero-threads", "unknown-device", "zero-rounds",
        "zero-columns"])
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
    # in any case (--only MLP was 'no workload matches')
    assert [w.name for w in get_workloads("MLP_1024, Batch_MLP")] == ["mlp_1024x1024",
                                                                     "batch_mlp_64x32"]
    with pytest.raises(ValueError, match="no workload matches 'Zzz'"):
        get_workloads("Zzz")


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
    assert main(["bench", "--no-plot", "--plot", "out.txt", "--only", "jacobian_of",
                 "--no-save"]) == 0
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


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux's /proc")
@pytest.mark.parametrize("option", ["--json", "--out"])
def test_output_folder_that_refuses_files_is_a_usage_error(option, capsys, no_run):
    # /proc refuses new files, though os.access says it is writable to root (CI): the
    # suite ran for minutes and then wrote nothing
    with pytest.raises(SystemExit) as info:
        main(["bench", option, "/proc/torch_vjp_results/r.json" if option == "--json"
              else "/proc/torch_vjp_results"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "cannot be written" in err
    if os.geteuid() == 0:  # (os.access answers yes: the file made there fails)
        assert "cannot be written: a file could not be made in /proc" in err


def test_the_output_check_leaves_no_folder_behind(tmp_path, capsys, no_run):
    # the check made the folders of a path to test a file in them, and left them: a usage
    # error on another path, or a run that failed, left empty folders
    (tmp_path / "file").write_text("in the way")
    with pytest.raises(SystemExit) as info:
        main(["bench", "--json", str(tmp_path / "new" / "sub" / "r.json"),
              "--markdown", str(tmp_path / "file" / "r.md")])
    assert info.value.code == 2
    with pytest.raises(AssertionError, match="the suite ran"):
        main(["bench", "--out", str(tmp_path / "out" / "sub"), "--no-plot"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


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
    (["--no-jax", "--only", "two_input", "--methods", "jax.jit(jax.jacrev)"],
     "jax's methods run only with jax installed, without --no-jax, on --device cpu or on a "
     "GPU that jax sees"),
], ids=["no-workload", "no-method", "empty-methods", "kind-mismatch", "no-jax"])
def test_selection_that_runs_nothing_is_a_usage_error(argv, message, capsys, no_run):
    with pytest.raises(SystemExit) as info:
        main(["bench", *argv])
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_jax_runs_on_the_device_of_torch_where_jax_has_one():
    # jax is installed with its CPU backend alone here (a CUDA jax runs the suite's jax
    # methods on the GPU, which the GPU results record).
    pytest.importorskip("jax")
    import jax

    assert jax_runs_on("cpu") and jax_runs_on(torch.device("cpu"))
    try:
        gpus = len(jax.devices("gpu"))
    except RuntimeError:
        gpus = 0
    assert jax_runs_on("cuda") == (gpus > 0)
    assert jax_runs_on("cuda:1") == (gpus > 1)
    assert not jax_runs_on("meta")


def test_results_of_a_gpu_run_name_the_gpu_and_the_host():
    env = {"device": "cuda", "gpu": "NVIDIA H200", "cpu": "AMD EPYC 9554"}
    assert machine_note(env) == "cuda (NVIDIA H200; host AMD EPYC 9554)"
    assert machine_note({"device": "cpu", "gpu": None, "cpu": "AMD EPYC 9554"}) == \
        "cpu (AMD EPYC 9554)"


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
    assert main([*TINY, "--no-save", "--json", str(tmp_path / "r.json")]) == 0
    out = capsys.readouterr().out
    assert "left out (no selected method serves them): two_input" in out
    data = json.loads((tmp_path / "r.json").read_text())
    assert [w["name"] for w in data["workloads"]] == ["jacobian_of_256"]


def test_plot_that_cannot_be_saved_after_the_run(tmp_path, monkeypatch, capsys):
    pytest.importorskip("matplotlib")
    import torch_vjp.bench.plot

    def plot_suite(result, path, columns):
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
    assert captured.out.rstrip().splitlines()[-2:] == [
        f"table: printed above; as Markdown in {md}", f"json: {js}"]
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


def test_without_matplotlib_an_asked_plot_is_refused_before_the_run(tmp_path, monkeypatch,
                                                                     capsys):
    # (it ran the whole suite first, then said the figure could not be drawn)
    import torch_vjp.__main__ as cli

    monkeypatch.setattr(cli, "_plot_formats", lambda: None)  # as without matplotlib
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    import torch_vjp.bench as bench

    ran = []
    monkeypatch.setattr(bench, "run_suite", lambda *a, **k: ran.append(1))
    js = tmp_path / "r.json"
    with pytest.raises(SystemExit) as exc:
        main([*TINY, "--plot", str(tmp_path / "r.png"), "--json", str(js), "--no-save"])
    assert exc.value.code == 2 and not ran and not js.exists()
    assert (f"--plot {tmp_path / 'r.png'}: matplotlib is not installed, so no figure can be "
            f"drawn. Fix: pip install 'torch_vjp[bench]', or leave --plot out"
            in capsys.readouterr().err)


def test_without_matplotlib_the_default_plot_is_left_out(tmp_path, monkeypatch, capsys):
    import torch_vjp.__main__ as cli

    monkeypatch.setattr(cli, "_plot_formats", lambda: None)  # as without matplotlib
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    status = main([*TINY, "--out", str(tmp_path)])
    captured = capsys.readouterr()
    assert status == 0
    assert "plot: not written (matplotlib is not installed" in captured.out
    assert (tmp_path / "jacobian_suite.json").is_file()
    assert not list(tmp_path.glob("*.png"))


# ---- the library entry points check their options too ------------------------------------


@pytest.mark.parametrize("kwargs,message", [
    ({"min_run_time": float("nan")}, r"min_run_time=nan, but it must be a finite number of "
                                     r"seconds > 0"),
    ({"min_run_time": float("inf")}, r"min_run_time=inf, but it must be a finite number"),
    ({"rounds": 0}, r"rounds=0, but it must be an int >= 1: how many times each method is "
                    r"timed"),
    ({"threads": 0}, r"threads=0, but it must be an int >= 1: the torch\.set_num_threads"),
    ({"aggregate": "mean"}, r"aggregate='mean', but it must be 'median' \(the median of the "
                            r"rounds' medians, the default\) or 'min'"),
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


# ---- what the tables say: unsupported, noisy, robust ranking ------------------------------


def _fake_methods(monkeypatch, specs):
    """Replaces the suite's methods on ``two_input`` by ``specs``: (name, family, behaviour),
    behaviour ``"ok"`` (computes the Jacobian) or an exception to raise. Returns the
    prepared callables by name, so that a test can give each its own timings."""
    import torch_vjp.bench.runner as runner
    from torch_vjp.bench.methods import Method, Prepared

    runs = {}

    def prepare_for(name, behaviour):
        def prepare(case):
            def run():
                if isinstance(behaviour, Exception):
                    raise behaviour
                return torch.func.jacrev(case.f, argnums=case.argnums)(*case.primals)

            runs[name] = run
            return Prepared(run)

        return prepare

    methods = [Method(name, family, "jacobian", prepare_for(name, b))
               for name, family, b in specs]
    monkeypatch.setattr(runner, "get_methods", lambda kind, **kw: methods)
    return runs


def test_a_method_torch_refuses_is_unsupported_and_a_torch_vjp_error_is_a_failure(
        monkeypatch, tmp_path):
    from torch_vjp.bench import run_suite

    _fake_methods(monkeypatch, [
        ("torch_vjp broken", "torch_vjp", RuntimeError("an engine bug")),
        ("torch.func refuses", "torch.func", RuntimeError("not implemented for this op")),
        ("jax refuses", "jax", NotImplementedError("no such primitive")),
        ("torch_vjp auto", "torch_vjp", "ok"),
    ])
    result = run_suite(get_workloads("two_input"), min_run_time=0.002, progress=False)
    w = result.workloads[0]
    assert [r.status for r in w.results] == ["failed", "unsupported", "unsupported", "ok"]
    table = result.table()
    assert "FAILED: RuntimeError: an engine bug" in table
    assert "not supported by torch (RuntimeError: not implemented for this op)" in table
    assert "not supported by jax (NotImplementedError: no such primitive)" in table
    assert "not supported by torch" in result.markdown()
    pytest.importorskip("matplotlib")
    from torch_vjp.bench import plot_suite

    assert plot_suite(result, tmp_path / "p.png").read_bytes()[:8] == PNG_MAGIC


def test_ranking_is_by_the_median_of_the_rounds_not_the_luckiest_round(monkeypatch):
    import torch_vjp.bench.runner as runner
    from torch_vjp.bench import run_suite

    runs = _fake_methods(monkeypatch, [("torch_vjp auto", "torch_vjp", "ok"),
                                       ("torch.func.jacrev", "torch.func", "ok")])
    # Seconds per call of each timed block, per round: auto had one quiet round.
    rounds = {"torch_vjp auto": [[0.5, 0.5, 0.5], [2.0, 2.1, 1.9], [2.0, 2.2, 1.8]],
              "torch.func.jacrev": [[1.0, 1.1, 0.9], [1.0, 1.0, 1.0], [1.1, 1.0, 0.9]]}
    names = {}

    def block_times(fn, min_run_time):
        if not names:
            names.update({id(run): name for name, run in runs.items()})
        return rounds[names[id(fn)]].pop(0)

    monkeypatch.setattr(runner, "block_times", block_times)
    result = run_suite(get_workloads("two_input"), rounds=3, min_run_time=0.01, progress=False,
                       once_over=10.0)
    w = result.workloads[0]
    lucky, steady = w.result("torch_vjp auto"), w.result("torch.func.jacrev")
    assert lucky.round_times_s == [0.5, 2.0, 2.0] and lucky.time_s == 2.0
    assert steady.time_s == 1.0 and w.best is steady and lucky.ratio == 2.0
    # The spread covers the lucky round: too wide to rank, and said so.
    assert lucky.noisy and not steady.noisy
    assert (lucky.q1_s, lucky.q3_s) == (0.5, 2.0) and lucky.iqr_s == 1.5
    table = result.table()
    assert "noisy: IQR 75% of the median, too wide to rank" in table
    summary = table[table.index("summary"):]
    assert "2 s (IQR 75%, noisy)" in summary and "2.00 (noisy)" in summary


def _small_mlp(gen):
    """The parameters and input of the jacobian_of workload's tanh MLP (w0, b0 ... b2), small."""
    sizes = [4, 8, 8, 8]
    params = {}
    for i in range(3):
        params[f"w{i}"] = torch.randn(sizes[i + 1], sizes[i], generator=gen, dtype=torch.float64)
        params[f"b{i}"] = torch.randn(sizes[i + 1], generator=gen, dtype=torch.float64)
    return params, (torch.randn(sizes[0], generator=gen, dtype=torch.float64),)


def test_slow_methods_run_only_on_request():
    from torch_vjp.bench import run_suite

    slow = [m.name for m in METHODS if m.slow]
    assert {"torch_vjp rev-loop", "torch_vjp fwd-loop", "autograd.functional.jacobian",
            "autograd.grad loop", "torch_vjp jacobian + diagonal"} <= set(slow)
    assert not set(slow) & {m.name for kind in HEADLINE for m in get_methods(kind)}
    assert "autograd.grad loop" in [m.name for m in get_methods("jacobian_of", include_slow=True)]
    # Named explicitly, a slow method runs without --all.
    assert [m.name for m in get_methods("jacobian_of", names=["autograd.grad loop"])] == [
        "autograd.grad loop"]
    # (the jacobian_of workload's MLP made small, 4 -> 8 -> 8 -> 8: the autograd.grad loop
    # over its 256 outputs was most of this file's time, and the size asserts nothing here)
    (of,) = get_workloads("jacobian_of")
    result = run_suite([dataclasses.replace(of, make=_small_mlp)], min_run_time=0.002,
                       progress=False, drop_slow=False, use_jax=False)
    assert [(r.method, r.status) for r in result.workloads[0].results] == [
        ("torch_vjp jacobian_of", "ok"), ("autograd.grad loop", "ok"),
        ("autograd.grad(is_grads_batched=True)", "ok")]
    assert result.environment["all_methods"] is True
    assert "full suite with the loop and full-then-diagonal methods" in result.table()


def test_mode_points_say_which_mode_won_where():
    from torch_vjp.bench import MethodResult, SuiteResult, WorkloadResult
    from torch_vjp.bench.plot import mode_points

    def r(name, t, q1, q3):
        return MethodResult(name, "torch_vjp", "ok", time_s=t, q1_s=q1, q3_s=q3, samples=9)

    def w(name, kind, n_in, n_out, rev, fwd):
        prefix = "torch_vjp " if kind == "jacobian" else "torch_vjp batch_jacobian "
        return WorkloadResult(name, name, kind, [[n_out, n_in]], 1e-6,
                              [r(prefix + "rev", *rev), r(prefix + "fwd", *fwd)], n_in, n_out)

    result = SuiteResult({}, [
        w("tall", "jacobian", 8, 512, (2.0, 1.9, 2.1), (1.0, 0.9, 1.1)),
        w("wide", "batch_jacobian", 512, 8, (1.0, 0.9, 1.1), (3.0, 2.9, 3.1)),
        w("square", "jacobian", 256, 256, (1.0, 0.8, 1.2), (1.1, 0.9, 1.3)),
        WorkloadResult("of", "of", "jacobian_of", [[256, 64]], 1e-6,
                       [r("torch_vjp jacobian_of", 1.0, 1.0, 1.0)], 64, 256),
    ])
    assert [(p["name"], p["winner"], round(p["ratio"], 2), p["tie"])
            for p in mode_points(result)] == [
        ("tall", "fwd", 2.0, False), ("wide", "rev", 3.0, False), ("square", "rev", 1.1, True)]


def test_load_json_reads_the_previous_schema_and_refuses_other_files(tmp_path):
    old = {"schema": "torch_vjp.bench/1", "environment": {"quick": False}, "workloads": [{
        "name": "two_input", "title": "t", "kind": "jacobian", "jacobian_shapes": [[2, 3]],
        "tolerance": 1e-6, "results": [{"method": "torch_vjp auto", "family": "torch_vjp",
                                        "status": "ok", "time_s": 1e-3, "timed_once": False}]}]}
    (tmp_path / "old.json").write_text(json.dumps(old))
    result = load_json(tmp_path / "old.json")
    (r,) = result.workloads[0].results
    assert r.time_s == 1e-3 and r.iqr_s is None and not r.noisy
    assert result.workloads[0].n_in is None
    (tmp_path / "other.json").write_text(json.dumps({"schema": "something/1"}))
    with pytest.raises(ValueError, match=r"other\.json: not a torch_vjp suite result \(schema "
                       r"'something/1'; this version reads torch_vjp\.bench/1, "
                       r"torch_vjp\.bench/2\)"):
        load_json(tmp_path / "other.json")


def test_a_slow_first_call_alone_does_not_time_a_method_by_single_calls(monkeypatch):
    """A first call that pays the process's one-time costs (imports, caches) is not a slow
    method: the decision to time one call per round is confirmed on a warm call."""
    import time as time_module

    from torch_vjp.bench import run_suite

    import torch_vjp.bench.runner as runner
    from torch_vjp.bench.methods import Method, Prepared

    calls = {"n": 0}

    def prepare(case):
        def run():
            calls["n"] += 1
            if calls["n"] == 1:
                time_module.sleep(1.5)  # the cold first call, over once_over below
            return torch.func.jacrev(case.f, argnums=case.argnums)(*case.primals)

        return Prepared(run)

    methods = [Method("torch_vjp auto", "torch_vjp", "jacobian", prepare)]
    monkeypatch.setattr(runner, "get_methods", lambda kind, **kw: methods)
    result = run_suite(get_workloads("two_input"), rounds=1, min_run_time=0.01,
                       progress=False, once_over=1.0)  # wide: load slows the warm calls
    auto = result.workloads[0].result("torch_vjp auto")
    assert auto.status == "ok" and auto.first_call_s >= 0.05
    assert not auto.timed_once and "one call per round" not in result.table()
    assert calls["n"] > 3  # timed in blocks of calls, not once per round


BENCH_SCRIPTS = sorted((Path(__file__).resolve().parents[1] / "benchmarks").glob("*.py"))


@pytest.mark.parametrize("script", BENCH_SCRIPTS, ids=lambda p: p.name)
def test_every_benchmark_script_imports(script, monkeypatch):
    # bench_sparse.py imported a name _measure no longer had (tolerance, now check_result):
    # the script failed at its first line, and no test ran it
    import importlib.util

    monkeypatch.syspath_prepend(str(script.parent))
    name = f"_bench_{script.stem}"
    spec = importlib.util.spec_from_file_location(name, script)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, module)
    spec.loader.exec_module(module)  # (their __main__ guard keeps them from running)
    assert callable(getattr(module, "main", None)) or module.__doc__


def test_ctrl_c_during_the_run_is_one_line_and_exit_status_130(monkeypatch, tmp_path, capsys):
    # Ctrl-C printed a traceback through whichever method was running (torch._dynamo's
    # frames for the compiled one) and nothing said what was left; now one line on stderr
    import torch_vjp.bench

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(torch_vjp.bench, "run_suite", interrupted)
    status = main(["bench", "--only", "jacobian_of", "--no-plot", "--out", str(tmp_path / "o")])
    assert status == 130
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    assert re.search(r"torch-vjp bench: interrupted \(Ctrl-C\) after \d+\.\d s, before the "
                     r"first workload finished: no table, and no file was written\. For a "
                     r"shorter run: --quick, --only NAMES, --methods NAMES or a lower "
                     r"--min-run-time\.", captured.err)
    assert not (tmp_path / "o").exists()


def test_ctrl_c_after_a_workload_finished_reports_and_writes_it(monkeypatch, tmp_path,
                                                                capsys):
    # (the finished workloads were thrown away with the rest: no table, no file)
    import torch_vjp.bench.runner as runner

    real = runner._run_workload
    calls = []

    def second_interrupted(*args, **kwargs):
        calls.append(args[0].name)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(runner, "_run_workload", second_interrupted)
    threads = torch.get_num_threads()
    out = tmp_path / "o"
    two = ["--methods", "torch_vjp rev,torch_vjp jacobian_of"]  # (one for each workload)
    status = main([*TINY, *two, "--no-plot", "--out", str(out)])
    assert status == 130 and torch.get_num_threads() == threads
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    assert re.search(r"torch-vjp bench: interrupted \(Ctrl-C\) after \d+\.\d s: the 1 of 2 "
                     r"workloads that finished are reported and written below, the others "
                     r"left out\.", captured.err)
    first, second = calls
    assert f"{first}:" in captured.out and f"{second}:" not in captured.out
    assert "interrupted (Ctrl-C) after 1 of 2 workloads" in captured.out
    data = json.loads((out / "jacobian_suite.json").read_text())
    assert [w["name"] for w in data["workloads"]] == [first]
    assert data["environment"]["interrupted"] == "1 of 2 workloads"
    assert "interrupted (Ctrl-C) after 1 of 2 workloads" in (out / "jacobian_suite.md").read_text()
    # the library's caller gets a KeyboardInterrupt still, with the finished workloads
    calls.clear()
    from torch_vjp.bench import get_workloads, run_suite
    with pytest.raises(KeyboardInterrupt) as exc:
        run_suite(get_workloads("two_input,jacobian_of"),
                  methods=["torch_vjp rev", "torch_vjp jacobian_of"],
                  min_run_time=0.002, rounds=1, progress=False, use_jax=False)
    assert [w.name for w in exc.value.result.workloads] == calls[:1]


def test_an_unknown_method_that_is_part_of_names_says_which(capsys, no_run):
    # '--methods jacrev' said only "unknown method(s) ['jacrev']; see --list": nothing told
    # that names are exact, unlike --only's parts of names, nor which name was meant
    with pytest.raises(SystemExit) as info:
        main(["bench", "--methods", "jacfwd"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert ("--methods: unknown method(s) ['jacfwd']; see --list. Method names are exact and "
            "whole (--only takes parts of workload names, --methods does not); did you mean "
            "'torch.func.jacfwd', ") in err
    assert "e.g. --methods 'torch.func.jacfwd'" in err
    with pytest.raises(SystemExit):
        main(["bench", "--methods", "xyzzy"])
    assert ("Method names are exact and whole, as --list prints them, e.g. --methods "
            "'torch_vjp rev,torch.func.jacrev'") in capsys.readouterr().err


@pytest.mark.parametrize("device", ["cuda:x", "CPU"])
def test_a_device_torch_cannot_read_says_so(device, capsys, no_run):
    # 'cuda:x' was told "only cpu and cuda are supported", although it names cuda
    with pytest.raises(SystemExit) as info:
        main(["bench", "--device", device])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert f"--device {device}: not a device torch can read (" in err
    assert ("); expected cpu, cuda or cuda:N, N the index of a GPU (lower case, no spaces), "
            "e.g. --device cuda:0") in err
    assert "only cpu and cuda are supported" not in err


@pytest.mark.parametrize("argv,option,other", [
    (["--json", "{d}/same.out", "--markdown", "{d}/./same.out"], "--markdown", "--json"),
    (["--out", "{d}", "--json", "{d}/jacobian_suite.png"], "--plot", "--json"),
], ids=["json-and-markdown", "json-and-default-plot"])
def test_two_result_files_at_one_path_are_a_usage_error(argv, option, other, tmp_path, capsys,
                                                        no_run):
    # --json x --markdown x wrote the Markdown over the JSON and still printed "json: x"
    argv = [a.format(d=tmp_path) for a in argv]
    with pytest.raises(SystemExit) as info:
        main(["bench", *argv])
    assert info.value.code == 2
    assert (f": {other} writes the same file, and the one written last would replace the "
            f"other. Give each its own file, e.g. --json results.json --markdown results.md "
            f"--plot results.png") in capsys.readouterr().err
    assert not (tmp_path / "same.out").exists()


def test_run_suite_under_no_grad_measures_what_it_measures_with_grad():
    # under torch.no_grad() the jacobian_of workload's graph was never recorded: torch_vjp's
    # jacobian_of returned zeros and was "wrong" (abs error 0.27), autograd.grad's method
    # "unsupported" (element 0 of tensors does not require grad)
    from torch_vjp.bench import run_suite

    with torch.no_grad():
        result = run_suite(get_workloads("jacobian_of", quick=True), min_run_time=0.002,
                           rounds=1, progress=False, use_jax=False)
        assert not torch.is_grad_enabled()
    statuses = {r.method: r.status for r in result.workloads[0].results}
    assert statuses == {"torch_vjp jacobian_of": "ok",
                        "autograd.grad(is_grads_batched=True)": "ok"}, statuses

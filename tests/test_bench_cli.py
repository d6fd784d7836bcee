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

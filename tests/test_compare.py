"""Tests of torch_vjp.compare: compare_strategies, its report, and the memory counter."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch

import torch_vjp as tv
from torch_vjp._errors import (
    JacobianCallError,
    JacobianOptionError,
    StrategyError,
    StrategyTypeError,
    TorchVJPError,
)
from torch_vjp._measure import NOISY_SPREAD, LiveTensorBytes, measure_peak
from torch_vjp._strategies import STRATEGIES
from torch_vjp.compare import StrategyComparison, StrategyRow, compare_strategies

FAST = 0.002  # seconds of timing per strategy: enough to get a median, fast in CI
ALL = tuple([n for n in STRATEGIES if n != "auto"] + ["auto"])


class _Branchy(torch.autograd.Function):
    """``3 x`` whose backward branches on the cotangent's values: vmap cannot batch it, a
    Python loop can; it has no forward-mode rule (``jvp``)."""

    @staticmethod
    def forward(x):
        return x * 3

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, grad):
        if grad.sum() > -1e30:  # data-dependent control flow on a batched tensor under vmap
            return grad * 3
        return grad * 3  # pragma: no cover


def _branchy(x):
    return _Branchy.apply(x).sin()


W = torch.randn(6, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))

def _f64(*shape):
    return torch.randn(*shape, dtype=torch.float64)


CASES = [
    # id, f, primals, argnums
    ("tall_mlp", lambda x: torch.tanh(W @ x).repeat(3), (_f64(4),), 0),
    ("wide", lambda x: torch.tanh(x.reshape(2, 8)).sum(0), (_f64(16),), 0),
    ("two_inputs", lambda x, y: torch.outer(x, y).sin(), (_f64(3), _f64(2)), (0, 1)),
    ("second_arg", lambda x, y: x * y.exp(), (_f64(5), _f64(5)), 1),
    ("scalar_out", lambda x: (x**2).sum(), (_f64(3, 2),), 0),
    ("float32", lambda x: torch.tanh(x) * 2, (torch.randn(7),), 0),
]


@pytest.mark.parametrize("name,f,primals,argnums", CASES, ids=[c[0] for c in CASES])
def test_rows_for_every_strategy(name, f, primals, argnums):
    report = compare_strategies(f, *primals, argnums=argnums, min_run_time=FAST)
    assert [row.strategy for row in report.rows] == list(ALL)
    for row in report.rows:
        assert row.status == "ok", (row.strategy, row.reason)
        assert row.time is not None and row.time > 0
        assert row.error is not None and row.error <= report.tolerance
        # The peak includes the returned Jacobian itself.
        ref = torch.func.jacrev(f, argnums=argnums)(*primals)
        blocks = ref if isinstance(ref, tuple) else (ref,)
        assert row.peak_memory >= sum(b.numel() * b.element_size() for b in blocks)
    assert "float64" in report.reference


def test_failing_strategy_is_a_row_not_an_exception():
    x = torch.randn(4, dtype=torch.float64)
    report = compare_strategies(_branchy, x, min_run_time=FAST)
    assert report["rev"].status == "failed"
    assert "data-dependent control flow" in report["rev"].reason
    assert report["rev"].reason.startswith("RuntimeError: ")
    assert report["rev"].time is None and report["rev"].peak_memory is None
    assert report["fwd-loop"].status == "failed"
    assert report["fwd-loop"].reason.startswith("StrategyNotImplementedError: ")
    assert "no forward-mode formula" in report["fwd-loop"].reason
    assert report["rev-loop"].status == "ok"
    assert report["auto"].status == "ok"
    # The reference is a loop of autograd.grad: no vmap.
    assert "loop of torch.autograd.grad" in report.reference
    assert report.best is not None and report.best.strategy in ("rev-loop", "auto")
    text = str(report)
    assert "failed: RuntimeError: vmap: It looks like" in text


def test_failing_strategy_records_the_fallback_warning():
    def own(x):  # a fresh function: the fallback warning is shown once per function
        return _Branchy.apply(x).cos()

    report = compare_strategies(own, torch.randn(3, dtype=torch.float64),
                                strategies=["auto"], min_run_time=FAST)
    (row,) = report.rows
    assert row.ok
    assert any("rev-loop" in w for w in row.warnings)
    assert "(warned: torch_vjp.jacobian" in str(report)


def test_a_fallback_warning_is_recorded_on_every_report():
    # the warning is shown once per function: a second report (or a call of f before the
    # first) recorded nothing, and the row read plain "ok" though auto had fallen back
    def own(x):
        return _Branchy.apply(x).sin()

    x = torch.randn(3, dtype=torch.float64)
    for _ in range(2):
        report = compare_strategies(own, x, strategies=["auto"], min_run_time=FAST)
        assert any("rev-loop" in w for w in report["auto"].warnings)


class _NanTangent(torch.autograd.Function):
    """sin, with a right backward and a forward-mode rule that returns NaN."""

    @staticmethod
    def forward(x):
        return x.sin()

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[0])
        ctx.save_for_forward(inputs[0])

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * x.cos()

    @staticmethod
    def jvp(ctx, t):
        return t * float("nan")

    @staticmethod
    def vmap(info, in_dims, x):
        return _NanTangent.apply(x), in_dims[0]


def test_a_nan_result_is_wrong_not_ok():
    # max(0.0, nan) is 0.0: the NaN Jacobian was reported "ok" with error 0
    report = compare_strategies(_NanTangent.apply, torch.randn(3, dtype=torch.float64),
                                strategies=["rev", "fwd"], min_run_time=FAST)
    assert report["rev"].ok
    assert report["fwd"].status == "wrong" and math.isnan(report["fwd"].error)
    assert report.best.strategy == "rev"
    # strict JSON has no NaN: json.dumps wrote a bare NaN, which JSON.parse refuses
    data = json.loads(json.dumps(report.to_dict(), allow_nan=False))
    assert data["rows"][1]["max_abs_error"] == "nan" and data["rows"][0]["max_abs_error"] == 0


class _WrongUnderVmap(torch.autograd.Function):
    """x * 2, whose vmap rule (a user's, wrong on purpose) doubles the batched result again:
    unbatched it is right, so only what runs under vmap sees the mistake."""

    @staticmethod
    def forward(x):
        return x * 2

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, g):
        return _WrongUnderVmap.apply(g)

    @staticmethod
    def vmap(info, in_dims, x):
        return x * 4, in_dims[0]


def test_the_reference_does_not_share_vmaps_batching_rules():
    # a wrong batching rule in f's backward: with torch.func.jacrev as the reference, the wrong
    # 'rev' would be "ok" and best, the right 'rev-loop' "wrong"
    x = torch.randn(3, dtype=torch.float64)
    f = lambda x: _WrongUnderVmap.apply(x.sin())  # noqa: E731
    report = compare_strategies(f, x, strategies=["rev", "rev-loop"], min_run_time=FAST)
    assert report.reference == "a loop of torch.autograd.grad in float64"
    assert report["rev"].status == "wrong" and report["rev-loop"].ok
    assert report.best.strategy == "rev-loop"
    # the premise: torch.func.jacrev is wrong here, a loop of torch.autograd.grad right
    expected = torch.diag(2 * x.cos())
    assert not torch.allclose(torch.func.jacrev(f)(x), expected)


def _row(name, status, time, error=0.0):
    return StrategyRow(name, status, time=time, peak_memory=8, error=error,
                       reason=None if status == "ok" else "why")


def _report(rows):
    return StrategyComparison(rows=tuple(rows), reference="test", tolerance=1e-6, device="cpu",
                              threads=1, memory_method="test", description="test")


def test_best_is_the_fastest_correct_row():
    report = _report([
        _row("rev", "ok", 3e-3),
        _row("fwd", "wrong", 1e-3, error=1.0),  # faster, but wrong
        StrategyRow("rev-loop", "failed", reason="RuntimeError: no"),
        _row("fwd-loop", "ok", 2e-3),
        _row("auto", "ok", 2.5e-3),
    ])
    assert report.best.strategy == "fwd-loop"
    text = str(report)
    best_line = next(line for line in text.splitlines() if line.startswith("fwd-loop"))
    assert best_line.rstrip().endswith("best")
    assert "1.00x" in best_line
    assert "1.50x" in next(line for line in text.splitlines() if line.startswith("rev "))
    assert "wrong: why" in text and "failed: RuntimeError: no" in text


def test_best_is_none_when_nothing_is_correct():
    report = _report([_row("rev", "wrong", 1e-3, error=1.0),
                      StrategyRow("fwd", "failed", reason="x")])
    assert report.best is None
    assert "-" in str(report)
    assert report.to_dict()["best"] is None


def test_best_on_a_measured_report():
    report = compare_strategies(lambda x: x.sin() * x, torch.randn(5, dtype=torch.float64),
                                min_run_time=FAST)
    correct = [row for row in report.rows if row.ok]
    assert report.best is min(correct, key=lambda r: r.time)


def test_table_renders():
    report = compare_strategies(lambda x: torch.tanh(x) ** 2, _f64(4, 3),
                                strategies=("rev", "fwd"), min_run_time=FAST)
    lines = str(report).splitlines()
    assert lines[0] == "compare_strategies: f(primals[0]: (4, 3)) -> (4, 3), argnums=0, float64"
    header = next(i for i, line in enumerate(lines) if line.startswith("strategy"))
    assert lines[header].split() == ["strategy", "median", "time", "IQR", "vs", "best", "peak",
                                     "extra", "memory", "max", "abs", "error", "status"]
    assert ("time: median of blocked_autorange's blocks; IQR: their interquartile range, as a "
            "percentage of the median (noisy: over 25%, too wide to rank)") in lines
    assert set(lines[header + 1]) == {"-", " "}
    rows = lines[header + 2:]
    assert [line.split()[0] for line in rows] == ["rev", "fwd"]
    # Columns are aligned: every row's "x" ratio ends where the header's "vs best" ends.
    end = lines[header].index("vs best") + len("vs best")
    iqr_end = lines[header].index("IQR") + len("IQR")
    for line in rows:
        assert line[end - 1] == "x"
        assert line[iqr_end - 1] == "%"  # every time carries its spread
    assert repr(report).startswith("StrategyComparison(2 strategies, best=")


def test_to_dict_is_json_serialisable():
    report = compare_strategies(lambda x, y: x * y, torch.randn(3, dtype=torch.float64),
                                torch.randn(3, dtype=torch.float64), argnums=(0, 1),
                                strategies=["rev", "fwd-loop"], min_run_time=FAST)
    data = json.loads(json.dumps(report.to_dict()))
    assert data["best"] in ("rev", "fwd-loop")
    assert data["device"] == "cpu" and data["threads"] == torch.get_num_threads()
    assert [r["strategy"] for r in data["rows"]] == ["rev", "fwd-loop"]
    for r in data["rows"]:
        assert set(r) == {"strategy", "status", "time_s", "iqr_s", "noisy", "peak_memory_bytes",
                          "max_abs_error", "reason", "warnings"}
        assert r["status"] == "ok" and r["time_s"] > 0 and r["peak_memory_bytes"] > 0
        assert r["iqr_s"] >= 0 and r["noisy"] == (r["iqr_s"] / r["time_s"] > NOISY_SPREAD)


def test_noisy_timing_is_flagged_in_words(monkeypatch):
    import torch_vjp.compare

    # blocks of one quiet and several disturbed calls: an IQR of 60% of the median
    samples = {"rev": [1.0, 1.0, 1.0, 1.0, 1.0], "fwd": [0.5, 0.6, 1.0, 1.1, 1.2]}
    order = iter(["rev", "fwd"])
    monkeypatch.setattr(torch_vjp.compare, "block_times",
                        lambda fn, min_run_time, min_blocks: [t * 1e-3
                                                              for t in samples[next(order)]])
    report = compare_strategies(lambda x: torch.tanh(x) ** 2, _f64(4, 3),
                                strategies=("rev", "fwd"), min_run_time=FAST, memory=False)
    rev, fwd = report["rev"], report["fwd"]
    assert (rev.time, rev.iqr, rev.noisy) == (1e-3, 0.0, False)
    assert fwd.time == pytest.approx(1e-3) and fwd.iqr == pytest.approx(0.5e-3) and fwd.noisy
    text = str(report)
    fwd_line = next(line for line in text.splitlines() if line.startswith("fwd"))
    assert "50%" in fwd_line and "ok (noisy: IQR 50% of the median, too wide to rank)" in fwd_line
    assert report.to_dict()["rows"][1]["noisy"] is True


def test_single_strategy_name_as_string():
    report = compare_strategies(torch.sin, torch.randn(3, dtype=torch.float64), strategies="fwd",
                                min_run_time=FAST)
    assert [r.strategy for r in report.rows] == ["fwd"]


def test_unknown_strategy_raises():
    with pytest.raises(StrategyError, match=r"torch_vjp\.compare_strategies: unknown strategy "
                       r"'revv'\. Supported: \('auto', 'rev', 'fwd', 'rev-loop', 'fwd-loop'\)"):
        compare_strategies(torch.sin, torch.randn(3), strategies=["rev", "revv"])
    with pytest.raises(StrategyError, match="Did you mean 'rev'"):
        compare_strategies(torch.sin, torch.randn(3), strategies="reverse")


def test_strategies_of_the_wrong_type_raise():
    with pytest.raises(StrategyTypeError, match=r"torch_vjp\.compare_strategies: strategies "
                       r"must be a strategy name or a sequence of them, got int\. Valid "
                       r"strategies: ") as info:
        compare_strategies(torch.sin, torch.randn(3), strategies=3)
    assert isinstance(info.value, TypeError) and isinstance(info.value, TorchVJPError)


# ---- mistakes in the arguments raise before anything runs --------------------------------


def _never_called(x):
    raise AssertionError("f must not run when an argument is wrong")


@pytest.mark.parametrize("strategies,message", [
    ([], r"strategies=\[\] names no strategy, so there is nothing to compare\. Fix: leave "
         r"strategies=None to compare every strategy \('rev', 'fwd', 'rev-loop', 'fwd-loop', "
         r"'auto'\), or name some"),
    ((), r"strategies=\(\) names no strategy"),
    (["rev", "fwd", "rev"], r"strategies=\['rev', 'fwd', 'rev'\] names 'rev' twice; each "
                            r"strategy may appear once .* Fix: strategies=\('rev', 'fwd'\)\."),
], ids=["empty-list", "empty-tuple", "repeated"])
def test_strategies_naming_no_or_repeated_strategies_raise(strategies, message):
    with pytest.raises(StrategyError, match=r"torch_vjp\.compare_strategies: " + message):
        compare_strategies(_never_called, _f64(3), strategies=strategies)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), 0, 0.0, -1.0, "0.1", None, True],
                         ids=["nan", "inf", "zero-int", "zero", "negative", "str", "none", "bool"])
def test_bad_min_run_time_raises(value):
    with pytest.raises(JacobianOptionError, match=(
            r"torch_vjp\.compare_strategies: min_run_time=.*, but it must be a finite number "
            r"of seconds > 0: the time budget of torch\.utils\.benchmark\.Timer\."
            r"blocked_autorange.*Fix: .* such as 0\.01")) as info:
        compare_strategies(_never_called, _f64(3), min_run_time=value)
    assert isinstance(info.value, ValueError) and isinstance(info.value, TorchVJPError)


@pytest.mark.parametrize("name,value,shown", [
    ("atol", -1e-6, "atol=-1e-06"),
    ("atol", float("nan"), "atol=nan"),
    ("atol", float("inf"), "atol=inf"),
    ("atol", "1e-6", r"atol='1e-6' \(a str\)"),
    ("atol", torch.tensor(1e-6), r"atol=tensor\(1\.0000e-06\) \(a Tensor\)"),
    ("rtol", -1, "rtol=-1"),
    ("rtol", float("nan"), "rtol=nan"),
], ids=["atol-negative", "atol-nan", "atol-inf", "atol-str", "atol-tensor", "rtol-negative",
        "rtol-nan"])
def test_bad_tolerance_raises(name, value, shown):
    with pytest.raises(JacobianOptionError, match=(
            rf"torch_vjp\.compare_strategies: {shown}, but it must be None or a finite number "
            rf">= 0: a row is 'ok' when each entry's abs error is at most atol \+ rtol \* "
            rf"max\(\|its reference entry\|, 0\.1 \* max\|reference\|\).*Fix: leave "
            rf"{name}=None")):
        compare_strategies(_never_called, _f64(3), **{name: value})


def test_zero_tolerances_are_accepted():
    report = compare_strategies(lambda x: 2 * x, _f64(3), strategies="rev", atol=0, rtol=0.0,
                                min_run_time=FAST)
    assert report["rev"].ok and report.tolerance == 0.0


def _jacobian_error(f, *primals, **kwargs):
    with pytest.raises(TorchVJPError) as info:
        tv.jacobian(f, *primals, **kwargs)
    return info.value


@pytest.mark.parametrize("primals,argnums,message", [
    ((_f64(3),), (0, 0), r"argnums=\(0, 0\) names a primal twice; each may appear once\."),
    ((_f64(3),), 1, r"argnums=1, but f was given 1 primal, so argnums must lie in -1\.\.0\."),
    ((_f64(3), _f64(3)), (0, -3), r"argnums=\(0, -3\), but f was given 2 primals"),
    ((_f64(3),), (), r"argnums=\(\), but it must be an int or a non-empty tuple of ints"),
    ((_f64(3),), [0], r"argnums=\[0\], but it must be an int .* Fix: argnums=\(0,\)\."),
    ((torch.arange(3),), 0, r"primals\[0\] has dtype torch\.int64, but only floating-point "
                            r"tensors can be differentiated"),
    ((3.0,), 0, r"primals\[0\] is a float, but argnums selects it for differentiation"),
    ((), 0, r"no primals were given"),
], ids=["argnums-repeated", "argnums-out-of-range", "argnums-negative-out-of-range",
        "argnums-empty", "argnums-list", "integer-primal", "python-float-primal", "no-primals"])
def test_argnums_and_primals_raise_as_jacobian_does(primals, argnums, message):
    with pytest.raises(JacobianCallError,
                       match=r"torch_vjp\.compare_strategies: " + message) as info:
        compare_strategies(_never_called, *primals, argnums=argnums, min_run_time=FAST)
    # The same class and the same sentence as torch_vjp.jacobian's own.
    theirs = _jacobian_error(_never_called, *primals, argnums=argnums)
    assert type(info.value) is type(theirs)
    assert str(info.value) == str(theirs).replace("torch_vjp.jacobian", "torch_vjp."
                                                  "compare_strategies")


def test_integer_output_raises_as_jacobian_does():
    def f(x):
        return (x > 0).long()

    with pytest.raises(JacobianCallError, match=r"torch_vjp\.compare_strategies: the output of "
                       r"f has dtype torch\.int64; only real floating-point outputs have a "
                       r"Jacobian here"):
        compare_strategies(f, _f64(3), min_run_time=FAST)


def test_error_of_the_users_function_passes_through():
    class Boom(Exception):
        pass

    raised = Boom("from f")

    def f(x):
        raise raised

    with pytest.raises(Boom) as info:
        compare_strategies(f, torch.randn(3), min_run_time=FAST)
    assert info.value is raised


def test_reference_falls_back_to_the_inputs_dtype():
    w = torch.randn(3, 4)  # float32 weights: float64 inputs cannot be multiplied by them

    report = compare_strategies(lambda x: w @ x, torch.randn(4), strategies=["rev"],
                                min_run_time=FAST)
    assert report.reference == "a loop of torch.autograd.grad in the inputs' own dtype"
    assert report["rev"].ok


def test_nothing_is_mutated():
    x = torch.randn(5, dtype=torch.float64)
    y = torch.randn(5, dtype=torch.float64, requires_grad=True)
    x0, y0 = x.clone(), y.detach().clone()
    compare_strategies(lambda a, b: a * b, x, y, argnums=(0, 1), min_run_time=FAST)
    assert torch.equal(x, x0) and torch.equal(y.detach(), y0)
    assert not x.requires_grad and y.requires_grad and y.grad is None


def test_an_argument_that_f_writes_into_is_not_mutated():
    # the reference called f with the caller's own tensor for an argument not
    # differentiated (x.to(torch.float64) of a float64 tensor is x itself; a float32 one was
    # passed as is to the second attempt, after the float64 one failed): an f that counts
    # its calls in a buffer left the caller's buffer at 1
    w32 = torch.eye(4)

    def f(x, calls):
        calls.add_(1)
        return x.sin() * 2

    def f32(x, calls):
        calls.add_(1)
        return w32 @ x  # float32 weights: the float64 reference fails, then its own dtype

    for fn, dtype in ((f, torch.float64), (f32, torch.float32)):
        calls = torch.zeros(4, dtype=dtype)
        report = compare_strategies(fn, torch.randn(4, dtype=dtype), calls,
                                    strategies=("rev", "fwd"), min_run_time=FAST,
                                    memory=False)
        assert torch.equal(calls, torch.zeros(4, dtype=dtype)), calls
        assert all(row.ok for row in report.rows), str(report)


def _training_batchnorm():
    torch.manual_seed(0)
    bn = torch.nn.BatchNorm1d(4).double()
    with torch.no_grad():  # running statistics that one update would visibly change
        bn.running_mean.fill_(0.5)
        bn.running_var.fill_(2.0)
    return bn


def _assert_buffers_unchanged(bn, before):
    assert bn.training
    for name, buf in bn.named_buffers():
        assert torch.equal(buf, before[name]), name
    assert int(bn.num_batches_tracked) == 0


def test_batchnorm_buffers_are_kept_for_a_module():
    bn = _training_batchnorm()
    before = {name: b.clone() for name, b in bn.named_buffers()}
    report = compare_strategies(bn, _f64(8, 4), min_run_time=FAST)
    _assert_buffers_unchanged(bn, before)
    assert report["rev-loop"].ok and report["auto"].ok


def test_batchnorm_buffers_are_kept_through_a_lambda():
    bn = _training_batchnorm()
    before = {name: b.clone() for name, b in bn.named_buffers()}
    compare_strategies(lambda t: bn(t), _f64(8, 4), min_run_time=FAST)
    _assert_buffers_unchanged(bn, before)


def test_batchnorm_buffers_are_kept_when_f_raises():
    bn = _training_batchnorm()
    before = {name: b.clone() for name, b in bn.named_buffers()}

    class Boom(Exception):
        pass

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.bn = bn

        def forward(self, x):
            self.bn(x)
            raise Boom("from f")

    with pytest.raises(Boom):
        compare_strategies(Model(), _f64(8, 4), min_run_time=FAST)
    _assert_buffers_unchanged(bn, before)


def test_memory_can_be_skipped():
    report = compare_strategies(torch.sin, torch.randn(3), strategies=["rev"], memory=False,
                                min_run_time=FAST)
    assert report["rev"].peak_memory is None
    assert report.memory_method.startswith("not measured")


def test_unknown_row_name_raises_keyerror():
    report = _report([_row("rev", "ok", 1e-3)])
    with pytest.raises(KeyError, match="no row for strategy 'fwd'"):
        report["fwd"]


# ---- the CPU memory counter ----------------------------------------------------------


def test_live_bytes_counts_a_temporary_and_the_result():
    # ones(1000) (4000 B) is alive while the product (4000 B) is made: a peak of 8000 B.
    assert measure_peak(lambda: torch.ones(1000) * 2, torch.device("cpu")) == 8000


def test_live_bytes_ignores_views_inplace_and_existing_tensors():
    base = torch.ones(1000)
    with LiveTensorBytes() as mode:
        view = base[:10].t()
        base.add_(1)
        del view
    assert mode.peak == 0


def test_live_bytes_follows_frees():
    with LiveTensorBytes() as mode:
        a = torch.empty(250, dtype=torch.float64)  # 2000 B
        b = a + 1  # 2000 B
        del a, b
        c = torch.empty(100, dtype=torch.float64)  # 800 B
    assert mode.peak == 4000
    assert mode.live == 800
    del c
    assert mode.live == 0


def test_peak_counts_vmapped_intermediates():
    x = torch.randn(64, dtype=torch.float64)
    jac_bytes = 64 * 64 * 8
    # jacrev builds a (64, 64) basis and the (64, 64) Jacobian: at least twice J's size.
    peak = measure_peak(lambda: torch.func.jacrev(torch.sin)(x), torch.device("cpu"))
    assert peak >= 2 * jac_bytes


@pytest.mark.cuda
def test_cuda_peak_uses_the_allocator():
    x = torch.randn(64, device="cuda")
    peak = measure_peak(lambda: torch.func.jacrev(torch.sin)(x), x.device)
    assert peak >= 64 * 64 * 4
    report = compare_strategies(torch.sin, x, strategies=["rev"], min_run_time=FAST)
    assert report.device.startswith("cuda") and "max_memory_allocated" in report.memory_method


def test_one_large_entry_does_not_hide_wrong_small_ones():
    # the tolerance was atol + rtol * max|reference| over the whole Jacobian: a row of 1e4
    # let reverse mode's wrong block (a wrong batching rule, errors of 100%) pass as "ok"
    # and be ranked best
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 2, generator=g)

    def f(x):
        return torch.cat([1e4 * x.sum().reshape(1), _WrongUnderVmap.apply(x.sin()).flatten()])

    report = compare_strategies(f, x, strategies=("rev", "rev-loop"), min_run_time=0.01,
                                memory=False)
    assert report["rev"].status == "wrong", report["rev"]
    assert re.search(r"abs error .* \(entry \d+\) > its tolerance", report["rev"].reason)
    assert report["rev-loop"].status == "ok" and report.best.strategy == "rev-loop"


def test_a_random_f_is_named_in_the_report():
    # every strategy of a dropout f was marked wrong, and nothing said f is random
    W = torch.randn(6, 3, dtype=torch.float64)
    f = lambda x: torch.nn.functional.dropout(W @ x, 0.5)  # noqa: E731
    report = compare_strategies(f, torch.randn(3, dtype=torch.float64), strategies=("rev",),
                                min_run_time=0.01, memory=False)
    assert "f is random (two calls at the same point differ" in report.reference
    plain = compare_strategies(lambda x: W @ x, torch.randn(3, dtype=torch.float64),
                               strategies=("rev",), min_run_time=0.01, memory=False)
    assert "random" not in plain.reference
    # (a NaN at the same point twice is the same value: log of a negative entry)
    logs = compare_strategies(torch.log, torch.tensor([1.0, -1.0, 2.0], dtype=torch.float64),
                              strategies=("rev",), min_run_time=0.01, memory=False)
    assert "random" not in logs.reference


def test_a_random_f_gives_the_reference_and_each_strategy_the_same_draws():
    # every strategy of a dropout f was marked wrong against a reference with draws of its
    # own, and the draws moved the caller's global generator
    W = torch.randn(6, 3, dtype=torch.float64)
    f = lambda x: torch.nn.functional.dropout(W @ x, 0.5)  # noqa: E731
    torch.manual_seed(1)
    state = torch.random.get_rng_state()
    report = compare_strategies(f, torch.randn(3, dtype=torch.float64, generator=torch.Generator()
                                               .manual_seed(0)),
                                strategies=("rev", "rev-loop"), min_run_time=FAST, memory=False)
    assert [row.status for row in report.rows] == ["ok", "ok"], str(report)
    assert torch.equal(torch.random.get_rng_state(), state)
    assert "the reference and each strategy start from the same generator state" in \
        report.reference

def test_a_random_f_drawing_from_its_own_generator_gets_the_same_draws_too():
    # a dropout drawing from a torch.Generator in f's closure: the reference and every
    # strategy drew other masks (each row "wrong"), and the caller's generator moved
    W = torch.randn(4, 4, dtype=torch.float64)
    gen = torch.Generator().manual_seed(3)
    state = gen.get_state()

    def f(x):
        return torch.tanh(W @ (x * (torch.rand(x.shape, generator=gen, dtype=x.dtype) > 0.5)))

    report = compare_strategies(f, torch.randn(4, dtype=torch.float64), strategies=(
        "rev", "rev-loop"), min_run_time=FAST, memory=False)
    assert [row.status for row in report.rows] == ["ok", "ok"], str(report)
    assert torch.equal(gen.get_state(), state)


class _GrowingScale(torch.nn.Module):
    """sin times a buffer that forward replaces in training mode."""

    def __init__(self):
        super().__init__()
        self.register_buffer("scale", torch.ones((), dtype=torch.float64))

    def forward(self, x):
        out = x.sin() * self.scale
        if self.training:
            self.scale = self.scale * 1.1
        return out


def test_a_buffer_f_replaces_is_put_back():
    # f replaced a module's buffer on every call: the module was left holding a
    # GradTrackingTensor of torch.func's, of value 8.8e20, and the reference and the
    # strategies were of other scales (every row wrong)
    model = _GrowingScale()
    scale = model.scale
    report = compare_strategies(model, torch.randn(3, dtype=torch.float64), strategies=(
        "rev", "rev-loop"), min_run_time=FAST, memory=False)
    assert model.scale is scale and float(scale) == 1.0
    assert [row.status for row in report.rows] == ["ok", "ok"], str(report)


def test_a_wrong_entry_at_a_zero_tolerance_is_wrong():
    # the ratio error / tolerance was 0 / 0 = nan at an exact entry of tolerance 0, and the
    # argmax took that nan: a result wrong by 1 passed with atol = rtol = 0
    from torch_vjp._measure import check_result

    ref = torch.tensor([0.0, 1.0], dtype=torch.float64)
    error, tol, why = check_result(torch.tensor([0.0, 2.0], dtype=torch.float64), ref, 0.0,
                                   0.0)
    assert error == 1.0 and why is not None and "entry 1" in why
    assert check_result(ref.clone(), ref, 0.0, 0.0)[2] is None
    # the tolerance reported is the largest of any entry: an ok row's error is within it
    big = torch.tensor([1e4, 1.0], dtype=torch.float64)
    error, tol, why = check_result(big + torch.tensor([5e-4, 9e-5]), big, 1e-7, 0.0)
    assert why is None and error <= tol


def test_a_reference_with_an_infinite_entry_still_judges_the_finite_ones():
    # one infinite reference entry made every entry's tolerance infinite: a result wrong by
    # 4 in a finite entry passed; and inf - inf = nan marked a result equal to it wrong
    from torch_vjp._measure import check_result

    inf = float("inf")
    ref = torch.tensor([inf, 1.0, 2.0], dtype=torch.float64)
    error, tol, why = check_result(torch.tensor([inf, 5.0, 2.0]), ref, None, None)
    assert error == 4.0 and math.isfinite(tol) and why is not None and "entry 1" in why
    error, tol, why = check_result(ref.clone(), ref, None, None)
    assert error == 0.0 and why is None and tol < 1e-6
    error, _, why = check_result(torch.tensor([3.0, 1.0, 2.0]), ref, None, None)
    assert error == inf and why.startswith("value 3.00e+00 (entry 0) where the reference "
                                           "has inf")


def test_a_nan_where_the_reference_has_a_nan_is_right():
    # sqrt at 0: the reference loop's Jacobian is NaN where 0 * inf meets, and rev's is the
    # same; the NaN made every entry's tolerance NaN, so every strategy was "wrong" (error
    # nan) and best was None
    x = torch.tensor([0.0, 1.0, 4.0], dtype=torch.float64)
    report = compare_strategies(torch.sqrt, x, strategies=("rev", "rev-loop"),
                                min_run_time=FAST, memory=False)
    assert [row.status for row in report.rows] == ["ok", "ok"], str(report)
    assert report.rows[0].error == 0.0 and report.best is not None
    assert math.isfinite(report.tolerance)
    # a NaN where the reference has a number is still wrong
    from torch_vjp._measure import check_result

    ref = torch.tensor([float("nan"), 1.0], dtype=torch.float64)
    assert check_result(torch.tensor([float("nan"), 1.5]), ref, None, None)[2] is not None
    assert "reference has nan" in check_result(torch.ones(2), ref, None, None)[2]


class _BufferRewriter(torch.nn.Module):
    """sin times a buffer that forward makes a Parameter, in any mode, and a buffer it
    registers on every call."""

    def __init__(self):
        super().__init__()
        self.register_buffer("scale", torch.ones((), dtype=torch.float64))

    def forward(self, x):
        out = x.sin() * self.scale
        self.scale = torch.nn.Parameter(self.scale.detach() * 1.1, requires_grad=False)
        self.register_buffer(f"seen{len(self._buffers)}", x.detach().clone())
        return out


@pytest.mark.parametrize("training", [True, False])
def test_a_buffer_f_makes_a_parameter_is_put_back(training):
    # the module was left holding both the buffer and a Parameter of the same name (of
    # value 4.8e47 after the timing loops), and the buffers f registered; in eval mode the
    # buffer was not put back before the reference and the strategies
    model = _BufferRewriter().train(training)
    scale = model.scale
    report = compare_strategies(model, torch.randn(3, dtype=torch.float64), strategies=(
        "rev-loop",), min_run_time=FAST, memory=False)
    assert model.scale is scale and float(scale) == 1.0
    assert dict(model._parameters) == {} and list(model._buffers) == ["scale"]
    assert [row.status for row in report.rows] == ["ok"], str(report)


def test_an_integer_output_is_not_told_to_use_has_aux_which_compare_has_not():
    # the error's fix read "or move it to aux with has_aux=True", but compare_strategies has
    # no has_aux (passing it is a TypeError)
    x = torch.randn(3, dtype=torch.float64)
    with pytest.raises(JacobianCallError) as info:
        compare_strategies(lambda a: (a * 2, a.argmax()), x, min_run_time=FAST)
    message = str(info.value)
    assert "has_aux" not in message
    assert message.startswith("torch_vjp.compare_strategies: the output of f[1] has dtype "
                              "torch.int64; only real floating-point outputs have a Jacobian")
    assert message.endswith("Fix: return it as .double() or .float() if it is "
                            "differentiable, or leave it out of f's output.")
    with pytest.raises(JacobianCallError) as info:
        compare_strategies(lambda a: (a * 2, None), x, min_run_time=FAST)
    assert "has_aux" not in str(info.value)


@pytest.mark.parametrize("memory", ["no", None, 0])
def test_memory_that_is_not_a_bool_is_refused(memory):
    # memory="no" is truthy: memory was measured although the caller asked not to
    with pytest.raises(JacobianOptionError) as info:
        compare_strategies(torch.sin, torch.randn(3, dtype=torch.float64), memory=memory,
                           min_run_time=FAST)
    assert str(info.value) == (
        f"torch_vjp.compare_strategies: memory={memory!r}, but it must be True or False: "
        f"whether to measure each strategy's peak extra memory (one more call per strategy). "
        f"Fix: memory=False to skip the measurement, or leave the default True.")


@pytest.mark.parametrize("flag", [False, True])
def test_memory_as_a_numpy_bool_is_taken_as_the_bool(flag):
    # memory must be a bool (fdf179f) refused numpy's bool (np.False_, as read from an
    # array or a config), which was taken for its truth value before
    np = pytest.importorskip("numpy")
    report = compare_strategies(torch.sin, torch.randn(3, dtype=torch.float64),
                                strategies=("rev",), memory=np.bool_(flag), min_run_time=FAST)
    assert report.rows[0].ok
    assert (report.rows[0].peak_memory is not None) == flag


def test_a_strategy_entry_that_is_not_a_str_is_a_type_error():
    # ("rev", 1) raised StrategyError "unknown strategy 1", as if 1 were a misspelt name
    with pytest.raises(StrategyTypeError) as info:
        compare_strategies(torch.sin, torch.randn(3, dtype=torch.float64),
                           strategies=("rev", 1), min_run_time=FAST)
    assert str(info.value) == (
        f"torch_vjp.compare_strategies: strategies[1] is 1 (int), but each entry must be a "
        f"strategy name, a str. Valid strategies: {ALL}; e.g. strategies=('rev', 'fwd').")


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
def test_a_caller_in_no_grad_gets_a_true_reference(mode):
    # under torch.no_grad() the reference loop read its rows off an output that recorded no
    # graph: the reference was all zeros and every strategy (right, |error| = |cos x|) was
    # "wrong", best None
    x = torch.randn(4, dtype=torch.float64)
    with mode():
        report = compare_strategies(torch.sin, x, strategies=("rev", "rev-loop"),
                                    min_run_time=FAST, memory=False)
    assert [row.status for row in report.rows] == ["ok", "ok"], str(report)
    assert report.best is not None and report.rows[0].error == 0.0
    assert torch.is_grad_enabled() and not torch.is_inference_mode_enabled()


def test_a_float32_step_inside_a_float64_function_is_judged_at_float32s_tolerance(
        float32_step):
    # Llama's and T5's RMSNorm cast to float32 inside a float64 model: every strategy then
    # rounds at float32's, and rev, fwd, fwd-loop and auto were marked "wrong" (abs error
    # 2.36e-07 > its tolerance 3.87e-08) although all were right to that precision.
    f, x = float32_step
    report = tv.compare_strategies(f, x, min_run_time=0.01, memory=False)
    assert {row.strategy: row.reason for row in report.rows if row.status != "ok"} == {}
    assert "f computes in float32 inside" in report.reference


def test_python_state_f_changes_is_not_undone_as_documented():
    # compare_strategies puts back tensors (buffers, generators), not plain Python state:
    # the docstring says so, and each of f's calls sees what the calls before it left
    seen = []
    W = torch.randn(3, 3, dtype=torch.float64)

    def f(x):
        seen.append(len(seen))
        return torch.tanh(W @ x)

    report = compare_strategies(f, torch.randn(3, dtype=torch.float64), strategies=["rev"],
                                min_run_time=0.01, memory=False)
    assert report.rows[0].status == "ok"
    assert len(seen) > 3 and seen == list(range(len(seen)))  # reference, check, timed calls


def test_float32_primals_are_not_described_as_a_cast_inside_f():
    # a float32 sin was described as "f computes in float32 inside (a cast in its graph)": the
    # reference is float64, but f computes in its primals' own dtype and casts nothing
    x = torch.randn(3)
    report = tv.compare_strategies(torch.sin, x, strategies="rev", min_run_time=FAST,
                                   memory=False)
    assert report.rows[0].status == "ok"
    assert "cast" not in report.reference and "computes in" not in report.reference
    assert "float64" in report.reference  # (the reference itself is still float64)

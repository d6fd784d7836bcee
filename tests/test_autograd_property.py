"""Property: ``tv.grad`` rejects exactly what ``torch.autograd.grad`` rejects, else agrees bitwise.

Random outputs (count, shapes, dtypes, whether they require grad) and random grad_outputs
(None, a single tensor, lists of the right or wrong length; each entry None or a tensor of
the right shape, a perturbed shape, a batched shape, another dtype) with random
``is_grads_batched``. For each draw, both functions run on the same graph:

- torch raises (for any reason: every failure here is a grad_outputs reason, since the
  outputs and inputs themselves are valid)  <=>  torch_vjp raises GradOutputsError;
- otherwise the results are bitwise identical (same dtype, shape and bits; None alike).
"""

from __future__ import annotations

import warnings

import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import torch_vjp as tv  # noqa: E402

EXAMPLES = {"count": 0, "torch_raised": 0}

DTYPES = [torch.float32, torch.float64, torch.complex64]
GO_DTYPES = [torch.float32, torch.float64, torch.complex64, torch.int64, torch.bool]
shapes = st.lists(st.integers(1, 3), min_size=0, max_size=3).map(tuple)


@st.composite
def grad_problem(draw):
    n = draw(st.integers(1, 3))
    outs = [
        {
            "shape": draw(shapes),
            "dtype": draw(st.sampled_from(DTYPES)),
            "requires_grad": draw(st.integers(0, 19)) > 0,
        }
        for _ in range(n)
    ]
    batched = draw(st.booleans())
    k = draw(st.integers(1, 3))
    form = draw(st.sampled_from(["none"] * 2 + ["list"] * 6 + ["tuple"] * 3 + ["single"] * 2))
    entries = []
    if form != "none":
        count = n if form == "single" else n + draw(st.sampled_from([0] * 8 + [-1, 1]))
        for j in range(max(count, 0)):
            base = outs[j]["shape"] if j < n else draw(shapes)
            kind = draw(st.sampled_from(
                ["exact"] * 12 + ["none", "perturb", "extra", "drop"]))
            if kind == "none":
                entries.append(None)
                continue
            shape = tuple(base)
            if kind == "perturb" and shape:
                i = draw(st.integers(0, len(shape) - 1))
                shape = shape[:i] + (shape[i] % 3 + 1,) + shape[i + 1:]
            elif kind == "extra":
                shape = (draw(st.integers(1, 3)),) + shape
            elif kind == "drop" and shape:
                shape = shape[1:]
            if batched and kind != "extra" and draw(st.integers(0, 19)) > 0:
                shape = (k,) + shape
            dtype = outs[j]["dtype"] if j < n and draw(st.integers(0, 9)) > 0 else draw(
                st.sampled_from(GO_DTYPES))
            entries.append({"shape": shape, "dtype": dtype, "seed": draw(st.integers(0, 99))})
    return outs, form, entries, batched


def _build(outs, form, entries):
    x = torch.linspace(-1.0, 1.0, 3, dtype=torch.float64, requires_grad=True)
    outputs = []
    for spec in outs:
        g = torch.Generator().manual_seed(len(outputs))
        base = torch.randn(spec["shape"], generator=g, dtype=torch.float64)
        if spec["requires_grad"]:
            t = (x.sin().sum() * base + x[0] ** 2).to(spec["dtype"])
        else:
            t = base.to(spec["dtype"])
        outputs.append(t)
    gos = []
    for e in entries:
        if e is None:
            gos.append(None)
            continue
        g = torch.Generator().manual_seed(e["seed"])
        v = torch.randn(e["shape"], generator=g, dtype=torch.float64) * 3
        if e["dtype"] is torch.bool:
            v = v > 0
        elif not (e["dtype"].is_floating_point or e["dtype"].is_complex):
            v = v.round()
        gos.append(v.to(e["dtype"]))
    if form == "none":
        grad_outputs = None
    elif form == "single":
        grad_outputs = gos[0]
    elif form == "tuple":
        grad_outputs = tuple(gos)
    else:
        grad_outputs = gos
    return x, outputs, grad_outputs


def _run(fn, problem):
    outs, form, entries, batched = problem
    x, outputs, grad_outputs = _build(outs, form, entries)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return fn(outputs, x, grad_outputs, allow_unused=True, is_grads_batched=batched), None
    except Exception as e:  # noqa: BLE001 - the property is about which calls fail
        return None, e


@settings(max_examples=3000, suppress_health_check=[HealthCheck.too_slow])
@given(grad_problem())
def test_grad_rejects_exactly_what_torch_rejects(problem):
    expected, torch_error = _run(torch.autograd.grad, problem)
    got, our_error = _run(tv.grad, problem)
    EXAMPLES["count"] += 1
    if torch_error is not None:
        EXAMPLES["torch_raised"] += 1
        assert isinstance(our_error, tv.GradOutputsError), (
            f"torch raised {type(torch_error).__name__}: {torch_error}\n"
            f"torch_vjp gave {our_error!r} / {got!r}"
        )
        return
    assert our_error is None, f"torch accepted the call, torch_vjp raised: {our_error}"
    assert len(got) == len(expected)
    for a, b in zip(got, expected):
        if b is None:
            assert a is None
        else:
            assert a.dtype == b.dtype and a.shape == b.shape
            assert torch.equal(_bits(a), _bits(b))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def test_property_ran_both_kinds_of_example():
    """Runs after the property (file order): it drew both accepted and rejected calls."""
    if EXAMPLES["count"] == 0:
        pytest.skip("the property test did not run in this session")
    print(f"\nproperty examples: {EXAMPLES}")
    assert 0 < EXAMPLES["torch_raised"] < EXAMPLES["count"]

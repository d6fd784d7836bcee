"""``compile=True``: later calls whose state differs from the first call's in ways the cache
key or the noted key of a function called again must tell apart, each checked in float64
against torch.func at that moment."""

from __future__ import annotations

import math

import pytest
import torch

import torch_vjp as tv

D = torch.float64

pytestmark = pytest.mark.usefixtures("fresh_dynamo", "aot_eager_unless_inductor")  # conftest


def test_a_zero_of_the_other_sign_is_another_number():
    # (0.0 == -0.0, but a program traced for one bakes its sign in: copysign, 1 / s)
    x = torch.randn(3, dtype=D)
    s = 0.0

    def f(x):
        return x.sin() * math.copysign(1.0, s)

    def g(x, t):
        return x.sin() * math.copysign(1.0, t)

    for value in (0.0, 0.0, 0.0, -0.0, -0.0, 0.0):
        s = value  # (the same function, its closure rebound: the noted key)
        torch.testing.assert_close(tv.jacobian(f, x, compile=True), torch.func.jacrev(f)(x))
        # (a new function each call: the full key; and the value as an argument)
        h = lambda x, s=value: x.sin() * math.copysign(1.0, s)  # noqa: E731
        torch.testing.assert_close(tv.jacobian(h, x, compile=True), torch.func.jacrev(h)(x))
        torch.testing.assert_close(tv.jacobian(g, x, value, compile=True),
                                   torch.func.jacrev(g)(x, value))
        c = complex(1.0, value)
        k = lambda x, c=c: x.sin() * math.copysign(1.0, c.imag)  # noqa: E731
        torch.testing.assert_close(tv.jacobian(k, x, compile=True), torch.func.jacrev(k)(x))


def test_a_call_traced_by_dynamo_or_export_still_takes_the_plain_form():
    x = torch.randn(3, dtype=D)

    def f(x):
        return tv.jacobian(lambda x: x.sin() * x, x)

    ref = torch.func.jacrev(lambda x: x.sin() * x)(x)
    torch.testing.assert_close(torch.compile(f, fullgraph=True, backend="eager")(x), ref)

    from torch_vjp._engine.compiled import tracing

    seen = []

    class M(torch.nn.Module):
        def forward(self, x):
            seen.append(tracing())  # (non-strict export runs forward for real)
            return x * 2

    torch.export.export(M(), (x,), strict=False)
    assert seen and all(seen)
    assert not tracing()


def test_a_call_that_recompiles_into_a_program_that_writes_changes_no_buffer():
    # (the noted entry writes nothing, so its calls run without buffers_kept; a
    # parametrization registered afterwards makes dynamo recompile it into a program that
    # runs spectral norm's power iteration, into the module's buffers)
    import copy

    x = torch.randn(3, dtype=D)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(),
                                torch.nn.Linear(4, 3)).to(D)
    for _ in range(3):
        torch.testing.assert_close(tv.jacobian(model, x, compile=True),
                                   torch.func.jacrev(model)(x))
    torch.nn.utils.parametrizations.spectral_norm(model[2])
    norm = model[2].parametrizations.weight[0]
    for _ in range(3):
        u, v, twin = norm._u.clone(), norm._v.clone(), copy.deepcopy(model)
        got = tv.jacobian(model, x, compile=True)
        assert torch.equal(norm._u, u) and torch.equal(norm._v, v)
        torch.testing.assert_close(got, torch.func.jacrev(twin)(x))


def test_a_list_of_modules_in_the_closure_is_not_kept_alive_and_stays_right():
    import gc
    import weakref

    x = torch.randn(3, dtype=D)

    def run(box):
        f = lambda x: torch.tanh(box[0](x)) * box[1]  # noqa: E731
        for _ in range(3):
            torch.testing.assert_close(tv.jacobian(f, x, compile=True),
                                       torch.func.jacrev(f)(x))

    model = torch.nn.Linear(3, 3).to(D)
    ref = weakref.ref(model)
    run([model, 2.0])
    run({0: model, 1: 3.0})  # (a dict whose keys are no strings)
    other = torch.nn.Linear(3, 3).to(D)
    box = [other, 2.0]
    f = lambda x: torch.tanh(box[0](x)) * box[1]  # noqa: E731
    for i in range(4):
        if i == 2:
            box[0] = model  # (replaced in place: the same list and function)
        torch.testing.assert_close(tv.jacobian(f, x, compile=True), torch.func.jacrev(f)(x))
    del model, box, f, other
    gc.collect()
    assert ref() is None


def test_a_partial_with_keywords_is_found_again_and_sees_them_changed(monkeypatch):
    import functools

    from torch_vjp._engine import compiled

    walks = [0]
    real = compiled.reached

    def counting(f, *a, **k):
        walks[0] += 1
        return real(f, *a, **k)

    monkeypatch.setattr(compiled, "reached", counting)
    x = torch.randn(3, dtype=D)

    def g(x, w, s=1.0):
        return torch.tanh(w @ x) * s

    p = functools.partial(g, w=torch.randn(3, 3, dtype=D), s=2.0)
    for i in range(6):
        torch.testing.assert_close(tv.jacobian(p, x, compile=True), torch.func.jacrev(p)(x))
        if i == 2:
            before = walks[0]
    assert walks[0] == before  # (calls 4-6 found the key noted by call 3)
    p.keywords["s"] = 5.0  # (in place: the same partial)
    torch.testing.assert_close(tv.jacobian(p, x, compile=True), torch.func.jacrev(p)(x))
    p.keywords["w"] = torch.randn(3, 3, dtype=D)
    torch.testing.assert_close(tv.jacobian(p, x, compile=True), torch.func.jacrev(p)(x))


def test_keyword_only_defaults_are_in_the_key():
    x = torch.randn(3, dtype=D)
    for value in (0.0, 0.0, 0.0, -0.0, -0.0, 0.0):
        def f(x, *, s=value):  # (a function made anew for each call)
            return x.sin() * math.copysign(1.0, s)

        torch.testing.assert_close(tv.jacobian(f, x, compile=True), torch.func.jacrev(f)(x))

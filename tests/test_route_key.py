"""What a route that strategy="auto" remembers is for (NOTE [what a route key covers]): a
function whose layer was replaced, or whose global helper was defined again, is checked
again rather than given the route checked for what it ran before."""

from __future__ import annotations

import warnings

import torch

import torch_vjp as tv
from torch_vjp._engine.fwdcheck import route_key

D = torch.float64


def _trisolve_point() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    A = torch.randn(3, 3, dtype=D, generator=gen).triu() + 3 * torch.eye(3, dtype=D)
    b = torch.randn(3, 200, dtype=D, generator=gen)
    return A, b


def _layers(b: torch.Tensor) -> tuple[type, type]:
    """Two layer classes over ``b``: one whose forward-mode formula is right in torch, and
    one whose formula (triangular_solve's) is wrong."""

    class Sin(torch.nn.Module):
        def forward(self, A):
            return A.sin() @ b

    class TriSolve(torch.nn.Module):
        def forward(self, A):
            return torch.triangular_solve(b, A).solution

    return Sin, TriSolve


def _jacobian_quietly(f, A):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the check's one-time warning; deprecation)
        return tv.jacobian(f, A)


def test_a_replaced_layer_is_checked_again():
    # A tall Jacobian: "auto" takes forward mode, whose formula for triangular_solve is wrong
    # in torch; the first call's check catches it. A route remembered for the layer before
    # (forward mode, right for it) must not be taken for the layer that replaced it.
    A, b = _trisolve_point()
    Sin, TriSolve = _layers(b)

    model = torch.nn.Sequential(Sin())
    torch.testing.assert_close(_jacobian_quietly(model, A), torch.func.jacrev(model)(A))
    model[0] = TriSolve()
    torch.testing.assert_close(_jacobian_quietly(model, A), torch.func.jacrev(model)(A))


def test_a_layer_in_a_plain_list_replaced_is_checked_again():
    A, b = _trisolve_point()
    Sin, TriSolve = _layers(b)

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = [Sin()]  # (a plain list: nn.Module does not register it)

        def forward(self, A):
            return self.layers[0](A)

    net = Net()
    _jacobian_quietly(net, A)
    net.layers[0] = TriSolve()
    torch.testing.assert_close(_jacobian_quietly(net, A), torch.func.jacrev(net)(A))


_NS: dict = {}
_SOURCE = """
def helper(A):
    return A.sin() @ b

def f(A):
    return helper(A)
"""
_REDEFINED = """
def helper(A):
    return torch.triangular_solve(b, A).solution
"""


def test_a_global_helper_defined_again_is_checked_again():
    # (a notebook cell run again: f is the same object, the helper it names is another)
    A, b = _trisolve_point()
    ns = {"torch": torch, "b": b}
    exec(_SOURCE, ns)
    f = ns["f"]
    _jacobian_quietly(f, A)
    exec(_REDEFINED, ns)
    torch.testing.assert_close(_jacobian_quietly(f, A), torch.func.jacrev(f)(A))


def test_the_key_reads_globals_layers_and_modes():
    A, b = _trisolve_point()
    ns = {"torch": torch, "b": b}
    exec(_SOURCE, ns)
    f = ns["f"]
    before = route_key(f)
    assert route_key(f) == before  # (the same function, nothing changed: the same key)
    exec(_REDEFINED, ns)
    assert route_key(f) != before
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Tanh())
    key = route_key(model)
    assert route_key(model) == key
    model[1] = torch.nn.Tanh()  # (another object of the same type)
    assert route_key(model) != key
    key = route_key(model)
    model.eval()
    assert route_key(model) != key
    # a module named by a lambda's closure, and a bound method of one, are keyed the same way
    lam = lambda t: model(t)  # noqa: E731
    key = route_key(lam), route_key(model.forward)
    model[0] = torch.nn.Linear(2, 2)
    assert route_key(lam) != key[0] and route_key(model.forward) != key[1]


def test_the_module_tree_is_walked_once_per_call(monkeypatch):
    # (NOTE [one walk per call]: the route key reads the walk of buffers_kept; two walks of
    # a model of 501 modules cost 0.9 ms per call)
    from torch_vjp._engine import context

    walks = []
    real = context.module_tree

    def counted(roots):
        roots = list(roots)
        walks.append(roots)
        return real(roots)

    monkeypatch.setattr(context, "module_tree", counted)
    model = torch.nn.Sequential(*[torch.nn.Linear(3, 3).double() for _ in range(5)]).eval()
    x = torch.randn(3, dtype=D)
    for f in (model, lambda t: model[-1](t)):
        tv.jacobian(f, x)
        walks.clear()
        J = tv.jacobian(f, x)
        assert len(walks) == 1, walks
        torch.testing.assert_close(J, torch.func.jacrev(f)(x))


def test_a_module_whose_class_defines_eq_has_a_key():
    # (a class with __eq__ has no __hash__: a key holding a weak reference to it could not
    # be looked up)
    class Scaled(torch.nn.Module):
        def __init__(self, k):
            super().__init__()
            self.k = k
            self.lin = torch.nn.Linear(3, 3).double()

        def __eq__(self, other):
            return isinstance(other, Scaled) and self.k == other.k

        def forward(self, x):
            return self.k * self.lin(x)

    m = Scaled(2.0)
    x = torch.randn(3, dtype=D)
    for f in (m, lambda t: m(t).sin()):
        torch.testing.assert_close(tv.jacobian(f, x), torch.func.jacrev(f)(x))
    _, vjp_fn = tv.vjp(m, x)
    V = torch.randn(4, 3, dtype=D)
    (got,) = vjp_fn(V, batched=True)
    torch.testing.assert_close(got, V @ (2.0 * m.lin.weight.detach()))


def test_a_user_module_inside_torch_containers_is_still_searched():
    # (torch.nn's own classes have no plain attribute to search; a user module's list is
    # searched wherever it sits)
    from torch_vjp._engine.context import module_tree

    class Holder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norms = [torch.nn.BatchNorm1d(3)]

    h = Holder()
    tree = module_tree([torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.ModuleList([h]))])
    assert h in tree and h.norms[0] in tree


_SKIP = {3, 7}  # (a set: held by a weak reference)
_VOCAB = {f"w{i}": i for i in range(2000)}  # (a dict over _CONTENTS items)
_W64 = torch.randn(6, 6, dtype=D)


def _uses_a_set(x):
    if 3 in _SKIP:
        x = x * 2
    return torch.tanh(_W64 @ x)


def _uses_a_big_dict(x):
    return torch.tanh(_W64 @ x) * len(_VOCAB)


def test_a_global_that_cannot_be_weakly_referenced_keeps_its_route():
    # (it had a new token per call: every call was a first one, checked again, and CHECKED
    # grew by one entry per call)
    from torch_vjp._engine import fwdcheck

    saved = dict(fwdcheck.CHECKED)
    x = torch.randn(6, dtype=D)
    try:
        for f in (_uses_a_set, _uses_a_big_dict):
            fwdcheck.CHECKED.clear()
            for _ in range(4):
                torch.testing.assert_close(tv.jacobian(f, x), torch.func.jacrev(f)(x))
            assert len(fwdcheck.CHECKED) == 1
    finally:
        fwdcheck.CHECKED.clear()
        fwdcheck.CHECKED.update(saved)
    import decimal
    import operator

    import numpy as np

    from torch_vjp._engine.context import _held

    for v in (np.float32(1.0), torch.finfo(torch.float32), decimal.Decimal(1),
              operator.itemgetter(0), bytearray(b"x"), tuple(range(2000)), set(_SKIP)):
        assert _held(v, 2) == _held(v, 2), v


def test_a_function_with_a_new_key_each_call_does_not_push_out_the_others(monkeypatch):
    from torch_vjp._engine import fwdcheck

    monkeypatch.setattr(fwdcheck, "_MAX_ENTRIES", 4)
    saved = dict(fwdcheck.CHECKED)
    fwdcheck.CHECKED.clear()
    try:
        class Slotted:
            __slots__ = ()

        calls = []

        def steady(x):
            calls.append(1)
            return torch.tanh(_W64 @ x)

        x = torch.randn(6, dtype=D)
        tv.jacobian(steady, x)  # (checked: one more call of f)
        (kept,) = fwdcheck.CHECKED
        before = len(calls)
        tv.jacobian(steady, x)
        unchecked = len(calls) - before
        for _ in range(10):
            o = Slotted()  # (a new object each step: a new key)
            tv.jacobian(lambda t, o=o: torch.sin(_W64 @ t), x)
            before = len(calls)
            tv.jacobian(steady, x)
            assert len(calls) - before == unchecked  # (its route taken, not checked again)
            assert kept in fwdcheck.CHECKED
        assert len(fwdcheck.CHECKED) == 4
    finally:
        fwdcheck.CHECKED.clear()
        fwdcheck.CHECKED.update(saved)

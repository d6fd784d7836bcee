"""The walk of what f reaches, read again along its recorded path (NOTE [a walk read again]
in torch_vjp/_engine/reach.py): the same answer as a full walk after every kind of change
on the path, and no full walk where nothing changed."""

from __future__ import annotations

import functools
import warnings

import pytest
import torch
import torch.nn.functional as F

import torch_vjp as tv
from torch_vjp._engine import reach

D = torch.float64

rm_global = torch.zeros(3, dtype=D)
scale_global = torch.ones(3, dtype=D)


def _same(got, want):
    assert [id(m) for m in got[0]] == [id(m) for m in want[0]]
    assert [id(t) for t in got[1]] == [id(t) for t in want[1]]


def _check(f, depth=6):
    """reached(f) agrees with a full walk, by identity and order."""
    _same(reach.reached(f, depth), reach._walk(f, depth)[0])


class _Holder:
    def __init__(self):
        self.w = torch.ones(2, dtype=D)
        self.net = torch.nn.Linear(2, 2)

    def __call__(self, x):
        return self.net(x) * self.w


def test_an_unchanged_function_is_not_walked_again(monkeypatch):
    params = {"w": torch.ones(3, dtype=D), "b": torch.zeros(3, dtype=D)}
    net = torch.nn.Linear(3, 3)

    def f(x):
        return net(x * params["w"] + params["b"])

    first = reach.reached(f)
    walks = []
    full = reach._walk
    monkeypatch.setattr(reach, "_walk", lambda *a: walks.append(a) or full(*a))
    again = reach.reached(f)
    _same(again, first)
    assert walks == []
    assert again[0] is not first[0] and again[1] is not first[1]  # (the caller's own lists)


def test_every_change_on_the_path_is_seen():
    params = {"w": torch.ones(3, dtype=D)}
    holder = _Holder()
    items = [torch.ones(1, dtype=D)]
    cell = torch.ones(3, dtype=D)

    def f(x, k=torch.zeros(1, dtype=D)):
        return x * params["w"] + holder(x[:2]).sum() + items[0] + cell + rm_global + k

    def set_cell(t):
        nonlocal cell
        cell = t

    _check(f)
    params["w"] = torch.full((3,), 2.0, dtype=D)  # a dict item replaced
    _check(f)
    params["v"] = torch.nn.Linear(1, 1)  # a dict item added
    _check(f)
    holder.w = torch.zeros(2, dtype=D)  # an attribute rebound
    _check(f)
    holder.net = torch.nn.Linear(2, 2)  # a module replaced
    _check(f)
    items.append(torch.nn.BatchNorm1d(2))  # a list item added
    _check(f)
    set_cell(torch.zeros(3, dtype=D))  # a closure cell set
    _check(f)
    f.__defaults__ = (torch.ones(1, dtype=D),)  # a default replaced
    _check(f)
    global rm_global
    old, rm_global = rm_global, torch.ones(3, dtype=D)  # a global rebound
    try:
        _check(f)
    finally:
        rm_global = old
    _check(f)
    holder.__dict__["extra"] = [torch.nn.ReLU()]  # a new attribute
    _check(f)


@pytest.mark.parametrize("make", [
    lambda t, m: functools.partial(lambda x, a, b: x * a, a=t, b=m),
    lambda t, m: _Holder().__call__,
    lambda t, m: [lambda x: x * t, m],
    lambda t, m: (lambda x: m(x) * t),
])
def test_other_kinds_of_callables(make):
    t, m = torch.ones(2, dtype=D), torch.nn.Linear(2, 2)
    f = make(t, m)
    _check(f)
    _check(f)
    _check(f, depth=2)


def test_a_new_object_at_the_same_place_is_walked_by_what_it_holds():
    # (a lambda made anew per call may take the address of the last one: its children
    # are read again, and another closure gives another answer)
    results = []
    for k in range(5):
        t = torch.full((2,), float(k), dtype=D)
        f = (lambda x: x * t) if k % 2 else (lambda x: x + t + rm_global)
        got = reach.reached(f)
        _same(got, reach._walk(f, 6)[0])
        results.append(got[1][0] is t)
        del f
    assert all(results)


def test_a_global_state_rebound_between_calls_is_put_back():
    # (the walk finds the global running statistics anew: the second call's are put back)
    global rm_global
    x = torch.randn(4, 3, dtype=D)

    def f(t):
        return F.batch_norm(t, rm_global, scale_global, training=True)

    old = rm_global
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tv.jacobian(f, x, strategy="rev")
            rm_global = torch.full((3,), 5.0, dtype=D)
            tv.jacobian(f, x, strategy="rev")
        assert torch.equal(rm_global, torch.full((3,), 5.0, dtype=D))
        assert torch.equal(scale_global, torch.ones(3, dtype=D))
    finally:
        rm_global = old

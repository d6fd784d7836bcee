"""A ``compile=True`` call of the same function found again without walking it (NOTE [a
function called again] in torch_vjp/_engine/compile_memo.py): every later call still right,
in float64 against torch.func, whatever changed between calls."""

from __future__ import annotations

import gc
import warnings
import weakref

import pytest
import torch

import torch_vjp as tv
from torch_vjp._engine import compiled

D = torch.float64

pytestmark = pytest.mark.usefixtures("fresh_dynamo", "aot_eager_unless_inductor")  # conftest


def _walks(monkeypatch):
    """Counts the walks of what ``f`` reaches that compiled calls make."""
    count = [0]
    real = compiled.reached

    def counting(f, *a, **k):
        count[0] += 1
        return real(f, *a, **k)

    monkeypatch.setattr(compiled, "reached", counting)
    return count


def test_a_steady_call_walks_nothing_and_stays_right(monkeypatch):
    model = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Tanh(),
                                torch.nn.Linear(5, 2)).to(D)

    def f(x):
        return model(x)

    walks = _walks(monkeypatch)
    for i in range(6):
        x = torch.randn(3, dtype=D)
        got = tv.jacobian(f, x, compile=True)
        torch.testing.assert_close(got, torch.func.jacrev(f)(x))
        if i == 2:
            before = walks[0]
    assert walks[0] == before  # (calls 4-6 found the key noted by call 3)
    with torch.no_grad():
        model[0].weight.mul_(2)  # (a weight changed in place: the program reads it)
    x = torch.randn(3, dtype=D)
    torch.testing.assert_close(tv.jacobian(f, x, compile=True), torch.func.jacrev(f)(x))


def test_a_closure_rebound_to_a_tensor_of_another_shape():
    w = torch.randn(4, 3, dtype=D)

    def f(x):
        return torch.tanh(w @ x)

    for n in (4, 4, 4, 6, 6, 4, 6):
        w = torch.randn(n, 3, dtype=D)  # noqa: F841 - (f reads it)
        x = torch.randn(3, dtype=D)
        got = tv.jacobian(f, x, compile=True)
        assert got.shape == (n, 3)
        torch.testing.assert_close(got, torch.func.jacrev(f)(x))


def test_a_closure_tensor_resized_in_place_and_a_number_rebound():
    w = torch.randn(4, 3, dtype=D)
    scale = 2.0

    def f(x):
        return scale * torch.sin(w @ x)

    for i in range(8):
        if i == 3:
            w.data = torch.randn(7, 3, dtype=D)  # (the same object, another shape)
        if i == 5:
            scale = 3.0  # noqa: F841 - (f reads it)
        x = torch.randn(3, dtype=D)
        torch.testing.assert_close(tv.jacobian(f, x, compile=True),
                                   torch.func.jacrev(f)(x))


class _Holder:
    def __init__(self, n_out):
        self.layer = torch.nn.Linear(3, n_out).to(D)


def test_a_module_replaced_on_an_object_the_function_reaches():
    holder = _Holder(4)

    def f(x):
        return torch.tanh(holder.layer(x))

    for n in (4, 4, 4, 5, 5, 5, 4):
        if holder.layer.out_features != n:
            holder.layer = torch.nn.Linear(3, n).to(D)
        x = torch.randn(3, dtype=D)
        got = tv.jacobian(f, x, compile=True)
        assert got.shape == (n, 3)
        torch.testing.assert_close(got, torch.func.jacrev(f)(x))


class _Moded(torch.nn.Module):
    """Computes another function in eval mode, with nothing random: both modes compile."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 3).to(D)

    def forward(self, x):
        y = self.lin(x)
        return torch.sin(y) if self.training else torch.cos(y)


def test_train_and_eval_alternated_find_their_own_programs():
    outer = torch.nn.Sequential(_Moded(), torch.nn.Tanh())
    f = outer.__call__  # (a bound method: a new object on every access, held here)

    def g(x):
        return outer(x)

    start = compiled.builds()
    with warnings.catch_warnings():
        warnings.simplefilter("error", tv.JacobianWarning)
        for i in range(10):
            outer[0].train(i % 2 == 0)  # (a submodule switched on its own)
            x = torch.randn(3, dtype=D)
            for fn in (f, g):
                torch.testing.assert_close(tv.jacobian(fn, x, compile=True),
                                           torch.func.jacrev(fn)(x))
    assert compiled.builds() - start == 4  # (two functions, two modes: never rebuilt)


def test_code_and_defaults_replaced_on_the_same_function():
    def f(x, k=2.0):
        return torch.sin(k * x)

    def other(x, k=2.0):
        return torch.cos(k * x) * x

    for i in range(9):
        if i == 3:
            f.__defaults__ = (5.0,)
        if i == 6:
            f.__code__ = other.__code__
        x = torch.randn(4, dtype=D)
        torch.testing.assert_close(tv.jacobian(f, x, compile=True),
                                   torch.func.jacrev(f)(x))


def test_a_noted_call_keeps_neither_the_function_nor_its_model_alive():
    model = torch.nn.Linear(3, 2).to(D)
    gone = weakref.ref(model)

    def f(x):
        return model(x)

    for _ in range(4):
        tv.jacobian(f, torch.randn(3, dtype=D), compile=True)
    del f, model
    gc.collect()
    assert gone() is None


def test_a_noted_call_of_a_dead_function_is_not_found_by_a_new_one():
    # (a new function may take a dead one's id: its own closure decides its result)
    results = []
    for n in (2, 3, 4, 5):
        w = torch.randn(n, 3, dtype=D)

        def f(x, w=w):
            return torch.tanh(w @ x)

        x = torch.randn(3, dtype=D)
        for _ in range(3):
            got = tv.jacobian(f, x, compile=True)
            torch.testing.assert_close(got, torch.func.jacrev(f)(x))
        results.append(got.shape)
        del f
        gc.collect()
    assert results == [(n, 3) for n in (2, 3, 4, 5)]


def test_a_module_called_again_after_a_submodule_changed(monkeypatch):
    model = torch.nn.Sequential(_Moded(), torch.nn.Linear(3, 4).to(D))
    walks = _walks(monkeypatch)
    counts = []
    with warnings.catch_warnings():
        warnings.simplefilter("error", tv.JacobianWarning)
        for i in range(12):
            if i == 6:
                model[1] = torch.nn.Linear(3, 5).to(D)  # (replaced: dynamo's guards see it)
            model[0].train(i % 3 != 0)  # (eval, train, train, eval, ...)
            x = torch.randn(3, dtype=D)
            got = tv.jacobian(model, x, compile=True)
            torch.testing.assert_close(got, torch.func.jacrev(model)(x))
            counts.append(walks[0])
    # (the first two calls of each mode walk; from the fourth call of each round of six
    # on, either mode finds its noted key)
    assert counts[3] == counts[5] and counts[9] == counts[11]


def test_an_entry_pushed_out_of_the_cache_is_not_kept_by_its_note(monkeypatch):
    # (a note held its entry, and with it the compiled program, after the cache had let it
    # go: up to NOTES_PER_CALL programs for each of MEMO_MAX calls beyond CACHE_MAX)
    monkeypatch.setattr(compiled, "CACHE_MAX", 1)
    x = torch.randn(3, dtype=D)

    def f(x):
        return x.sin() * x

    def g(x):
        return x.cos() * x

    for _ in range(2):  # (the second call is noted)
        tv.jacobian(f, x, compile=True)
    (entry,) = compiled._CACHE.values()
    program = weakref.ref(entry.run)
    del entry
    tv.jacobian(g, x, compile=True)  # (f's entry out of the cache)
    gc.collect()
    assert program() is None
    for h in (f, g):  # (each call right, f's compiled again)
        for _ in range(2):
            torch.testing.assert_close(tv.jacobian(h, x, compile=True),
                                       torch.func.jacrev(h)(x))


def test_a_bound_method_called_again_is_found_and_stays_right(monkeypatch):
    # (model.forward is a new object on each access: it was never noted, and every call
    # walked; noted by its object and function, every change below is still seen)
    model = torch.nn.Sequential(_Moded(), torch.nn.Linear(3, 4).to(D))
    walks = _walks(monkeypatch)
    counts = []
    with warnings.catch_warnings():
        warnings.simplefilter("error", tv.JacobianWarning)
        for i in range(16):
            if i == 6:
                model[1] = torch.nn.Linear(3, 5).to(D)  # (a submodule swapped)
            if i == 10:
                model[1].weight = torch.nn.Parameter(torch.randn(5, 3, dtype=D))
            if i == 13:
                model[0].lin.bias = None  # (a parameter removed)
            model[0].train(i % 3 != 0)  # (eval, train, train, eval, ...)
            x = torch.randn(3, dtype=D)
            got = tv.jacobian(model.forward, x, compile=True)
            torch.testing.assert_close(got, torch.func.jacrev(model)(x))
            counts.append(walks[0])
    assert counts[3] == counts[5]  # (calls 5 and 6 found the noted key of each mode)
    other = torch.nn.Sequential(_Moded(), torch.nn.Linear(3, 4).to(D))  # (another object)
    other.train(False)
    x = torch.randn(3, dtype=D)
    torch.testing.assert_close(tv.jacobian(other.forward, x, compile=True),
                               torch.func.jacrev(other)(x))


def test_a_noted_bound_method_does_not_keep_its_object_alive():
    model = torch.nn.Sequential(torch.nn.Linear(3, 2)).to(D)
    x = torch.randn(3, dtype=D)
    for _ in range(3):
        tv.jacobian(model.forward, x, compile=True)
    dead = weakref.ref(model)
    del model
    gc.collect()
    assert dead() is None


def test_a_call_computes_its_arguments_signature_once(monkeypatch):
    # (the note's lookup and the full key each computed it: twice on every call of a
    # function made anew, whose note is never found)
    from torch_vjp._engine import compile_key

    w = torch.randn(4, 3, dtype=D)
    count = [0]
    real = compile_key.global_state

    def counting():
        count[0] += 1
        return real()

    for steady in (False, True):
        g = (lambda x: torch.tanh(w @ x))
        for i in range(3):
            f = g if steady else (lambda x: torch.tanh(w @ x))  # (new on each call)
            x = torch.randn(3, dtype=D)
            if i == 2:
                monkeypatch.setattr(compile_key, "global_state", counting)
            got = tv.jacobian(f, x, compile=True)
            torch.testing.assert_close(got, torch.func.jacrev(f)(x))
        monkeypatch.setattr(compile_key, "global_state", real)
        assert count[0] == 1, (steady, count[0])
        count[0] = 0

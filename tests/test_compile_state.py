"""``compile=True``: what a function reads besides its arguments and closure (a global
tensor, number or flag, one a helper reads; an attribute) changed between calls. Every
result is checked in float64 against torch.func at that moment, and each state is compiled
once (NOTE [the globals a program reads] in torch_vjp/_engine/compile_key.py)."""

from __future__ import annotations

import warnings

import pytest
import torch

import torch_vjp as tv
from torch_vjp._engine import compiled

D = torch.float64

pytestmark = pytest.mark.usefixtures("fresh_dynamo", "aot_eager_unless_inductor")  # conftest


W = torch.randn(3, 3, dtype=D)
SCALE = 1.0
MASK = torch.ones(2, dtype=D)


def _w_f(x):
    return torch.tanh(W @ x)


def _scale_f(x):
    return SCALE * torch.sin(x)


def _calls(f, x, states, set_state):
    """Calls ``jacobian(f, compile=True)`` once per state, each checked against torch.func;
    returns how many programs were built."""
    before = compiled.builds()
    with warnings.catch_warnings():
        warnings.simplefilter("error", tv.JacobianWarning)  # (never eager, never warned)
        for state in states:
            set_state(state)
            torch.testing.assert_close(tv.jacobian(f, x, compile=True),
                                       torch.func.jacrev(f)(x))
    return compiled.builds() - before


def test_a_global_tensor_whose_requires_grad_alternates_compiles_each_state_once():
    x = torch.randn(3, dtype=D)
    try:
        built = _calls(_w_f, x, [False, True] * 3, W.requires_grad_)
    finally:
        W.requires_grad_(False)
    assert built == 2


def test_a_global_number_switched_back_and_forth_compiles_each_value_once():
    global SCALE

    def set_scale(v):
        global SCALE
        SCALE = v

    x = torch.randn(3, dtype=D)
    try:
        built = _calls(_scale_f, x, [1.0, 2.0] * 3, set_scale)
    finally:
        SCALE = 1.0
    assert built == 2


class _Masked(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 2).to(D)

    def forward(self, x):
        return torch.tanh(self.lin(x)) * MASK


def test_a_global_tensor_a_models_forward_reads_per_sample():
    model = _Masked()
    x, y = torch.randn(4, 3, dtype=D), torch.randn(4, 2, dtype=D)

    def loss(out, t):
        return ((out - t) ** 2).sum()

    def reference():
        rows = [torch.func.grad(lambda p: loss(torch.func.functional_call(
            model, p, (x[i:i + 1],)), y[i:i + 1]))(dict(model.named_parameters()))
            for i in range(4)]
        return {k: torch.stack([r[k] for r in rows]) for k in rows[0]}

    before = compiled.builds()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", tv.JacobianWarning)
            for flag in [False, True] * 3:
                MASK.requires_grad_(flag)
                got = tv.per_sample_grads(model, loss, x, y, compile=True)
                torch.testing.assert_close(got, reference())
    finally:
        MASK.requires_grad_(False)
    assert compiled.builds() - before == 2


SHIFT = 0.5


def _shifted(x):
    return torch.cos(x + SHIFT)


def _calls_a_helper(x):
    return 2 * _shifted(x)


def test_a_global_number_a_helper_function_reads_switched():
    def set_shift(v):
        global SHIFT
        SHIFT = v

    x = torch.randn(3, dtype=D)
    try:
        built = _calls(_calls_a_helper, x, [0.5, -1.0] * 3, set_shift)
    finally:
        set_shift(0.5)
    assert built == 2


def test_an_attribute_that_changes_on_every_call_stays_eager_with_a_warning():
    # (an attribute the program reads is in its key once its first program is built, NOTE
    # [what a program read beyond its key]: each value a key of its own; once
    # REBUILD_WARN_AT of them were compiled and none used again, a new one runs eagerly,
    # NOTE [closures over new objects] in compiled.py)
    class Cfg:
        step = 0

    cfg = Cfg()

    def f(x):
        return torch.sin(x) * cfg.step

    x = torch.randn(3, dtype=D)
    before = compiled.builds()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(1, 3 * compiled.REBUILD_WARN_AT):
            cfg.step = step
            torch.testing.assert_close(tv.jacobian(f, x, compile=True),
                                       torch.func.jacrev(f)(x))
    assert compiled.builds() - before <= compiled.REBUILD_WARN_AT + 1
    msgs = [str(w.message) for w in caught if issubclass(w.category, tv.JacobianWarning)]
    assert len(msgs) == 1, msgs
    assert "torch_vjp.jacobian: compile=True has compiled" in msgs[0]
    assert "or an attribute or item it reads from an object, a dict or a list" in msgs[0]
    assert "Fix: pass what changes from call to call as an argument" in msgs[0]


_TICK = 0


class _Ticker:
    def f(self, x):
        return torch.sin(x) * _TICK


@pytest.mark.parametrize("kind", ["function", "bound method"])
def test_a_global_that_changes_on_every_call_is_not_compiled_on_every_call(kind):
    # (each value is a key of its own; once REBUILD_WARN_AT of them were compiled and none
    # used again, a new one runs eagerly: NOTE [closures over new objects] in compiled.py)
    global _TICK

    def g(x):
        return torch.sin(x) * _TICK

    f = g if kind == "function" else _Ticker().f
    x = torch.randn(3, dtype=D)
    before = compiled.builds()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _TICK in range(1, 3 * compiled.REBUILD_WARN_AT):
                torch.testing.assert_close(tv.jacobian(f, x, compile=True),
                                           torch.func.jacrev(f)(x))
    finally:
        _TICK = 0
    assert compiled.builds() - before <= compiled.REBUILD_WARN_AT + 1
    msgs = [str(w.message) for w in caught if issubclass(w.category, tv.JacobianWarning)]
    assert len(msgs) == 1, msgs
    assert "a global the function reads held a new value" in msgs[0]


# NOTE [what a program read beyond its key] (torch_vjp/_engine/compile_key.py): what the
# program reads through an object, a global dict or list, or a helper of another module.


class _Holder:
    def __init__(self):
        self.w = torch.randn(3, dtype=D)

    def f(self, x):
        return torch.sin(x) * self.w


def _programs(f, x, states, set_state):
    """:func:`_calls`, and how many graphs dynamo compiled meanwhile."""
    from torch._dynamo.utils import counters

    before = counters["stats"]["unique_graphs"]
    built = _calls(f, x, states, set_state)
    return built, counters["stats"]["unique_graphs"] - before


@pytest.mark.parametrize("where", ["bound method's object", "object in a closure"])
def test_a_tensor_attribute_whose_requires_grad_alternates_compiles_each_state_once(where):
    holder = _Holder()
    f = holder.f if where == "bound method's object" else (lambda x: torch.cos(x) * holder.w)
    x = torch.randn(3, dtype=D)
    assert _programs(f, x, [False, True] * 3, holder.w.requires_grad_) == (2, 2)


CFG = {"scale": 2.0}
FACTORS = [1.0, torch.ones(3, dtype=D)]


def _reads_cfg(x):
    return CFG["scale"] * torch.sin(x) * FACTORS[1]


def test_a_global_dicts_item_switched_back_and_forth_compiles_each_value_once():
    def set_scale(v):
        CFG["scale"] = v

    x = torch.randn(3, dtype=D)
    try:
        assert _programs(_reads_cfg, x, [2.0, -3.0] * 3, set_scale) == (2, 2)
    finally:
        CFG["scale"] = 2.0


def test_a_global_lists_tensor_whose_requires_grad_alternates_compiles_each_state_once():
    x = torch.randn(3, dtype=D)
    try:
        assert _programs(_reads_cfg, x, [False, True] * 3, FACTORS[1].requires_grad_) == (2, 2)
    finally:
        FACTORS[1].requires_grad_(False)


@pytest.fixture
def elsewhere(monkeypatch):
    """A helper defined in another module, which reads that module's globals."""
    import sys
    import types

    mod = types.ModuleType("torch_vjp_tests_elsewhere")
    exec("import torch\nSCALE = 2.0\nT = torch.ones(3, dtype=torch.float64)\n"
         "def helper(x):\n    return torch.sin(x) * SCALE * T\n", mod.__dict__)
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    return mod


def test_globals_a_helper_of_another_module_reads_switched_compile_each_state_once(elsewhere):
    def f(x):
        return elsewhere.helper(x) + x

    def set_state(v):
        elsewhere.SCALE = v
        elsewhere.T.requires_grad_(v < 0)

    x = torch.randn(3, dtype=D)
    assert _programs(f, x, [2.0, -1.0] * 3, set_state) == (2, 2)


def test_an_attribute_read_beyond_the_key_changed_in_place_in_shape_is_followed():
    holder = _Holder()
    x = torch.randn(3, dtype=D)
    for w in (torch.randn(3, dtype=D), torch.randn(1, dtype=D), torch.randn(3, dtype=D)):
        holder.w = w
        torch.testing.assert_close(tv.jacobian(holder.f, x, compile=True),
                                   torch.func.jacrev(holder.f)(x))


def test_what_a_program_reads_beyond_its_key_is_evaluated_at_once(monkeypatch):
    # (a steady call evaluated each guard expression apart: the six items of the dict of
    # weights a closure holds, the suite's MLP, were six evaluations on every call)
    from torch_vjp._engine import compile_key

    params = {k: torch.randn(3, 3, dtype=D) for k in ("a", "b", "c")}

    def f(x):
        return torch.tanh(params["c"] @ torch.tanh(params["b"] @ (params["a"] @ x)))

    for _ in range(3):
        x = torch.randn(3, dtype=D)
        torch.testing.assert_close(tv.jacobian(f, x, compile=True), torch.func.jacrev(f)(x))
    entry = next(e for e in compiled._CACHE.values() if e.run is not None)
    assert entry.reads is not None and len(entry.reads.names) == 3
    count = [0]

    def counting(*a):
        count[0] += 1
        return eval(*a)  # noqa: S307 - the guard text, as the real one

    monkeypatch.setattr(compile_key, "eval", counting, raising=False)
    before = compiled.builds()
    x = torch.randn(3, dtype=D)
    torch.testing.assert_close(tv.jacobian(f, x, compile=True), torch.func.jacrev(f)(x))
    assert count[0] == 1 and compiled.builds() == before
    params["b"] = torch.randn(3, 3, dtype=D).t()  # (another layout: its own program)
    torch.testing.assert_close(tv.jacobian(f, x, compile=True), torch.func.jacrev(f)(x))
    assert compiled.builds() == before + 1


def test_reads_of_which_one_is_gone_say_which():
    from torch_vjp._engine import compile_key
    from torch_vjp._engine.compile_key import Reads

    class Holder:
        def __init__(self):
            self.a = torch.zeros(2, dtype=D)

    h = Holder()
    reads = Reads(("args[0].a", "args[0].b", "args[1]"), {})
    got = reads.signature(h, (3,))
    assert got[0] == "reads" and got[1][1] == ("unread",)
    signature = compile_key._leaf_signature
    assert got[1][0] == signature(h.a) and got[1][2] == signature(3)
    h.b = 1.5
    assert reads.signature(h, (3,))[1] == (signature(h.a), signature(1.5), signature(3))

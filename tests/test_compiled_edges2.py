"""compile=True against state that changes between calls (NOTE [compiled Jacobians] in
torch_vjp/_engine/compiled.py): every result in float64 against torch.func."""

from __future__ import annotations

import warnings

import pytest
import torch

import torch_vjp as tv
from torch_vjp._engine import compiled

D = torch.float64

pytestmark = pytest.mark.usefixtures("fresh_dynamo", "aot_eager_unless_inductor")  # conftest


def _sin2(x):
    return x.sin() * 2


# (dynamo guards the autocast state of every device type, and whether autocast caches its
# casts: keyed on cpu and cuda's autocast alone, each switch recompiled the entry, and it
# went eager with a warning blaming a global)
_SWITCHES = {
    "xpu autocast": (lambda on: torch.set_autocast_enabled("xpu", on), False),
    "mps autocast": (lambda on: torch.set_autocast_enabled("mps", on), False),
    "autocast cache": (torch.set_autocast_cache_enabled, True),
}


@pytest.mark.parametrize("switch", list(_SWITCHES))
def test_a_global_setting_dynamo_guards_switched_keeps_both_programs(switch):
    turn, default = _SWITCHES[switch]
    x = torch.randn(3, dtype=D)
    want = torch.func.jacrev(_sin2)(x)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", tv.JacobianWarning)
            for i in range(2 * compiled.REBUILD_WARN_AT + 2):
                turn(i % 2 == 1)
                torch.testing.assert_close(tv.jacobian(_sin2, x, compile=True), want)
    finally:
        turn(default)
    assert len(compiled._CACHE) == 2
    assert all(e.run is not None and e.recompiles == 0 for e in compiled._CACHE.values())


def _jac_twice(x):
    return tv.jacobian(_sin2, x, compile=True) * 2


def test_a_call_in_the_users_eager_run_under_another_stance_stays_compilable():
    # (the first call of the user's compiled function under "eager_then_compile" runs it
    # eagerly inside dynamo's frame callback, where torch refuses to change the stance)
    x = torch.randn(3, dtype=D)
    want = torch.func.jacrev(_sin2)(x)
    with warnings.catch_warnings():
        warnings.simplefilter("error", tv.JacobianWarning)
        with torch.compiler.set_stance("eager_then_compile"):
            torch.testing.assert_close(torch.compile(_jac_twice)(x), want * 2)
        for _ in range(2):
            torch.testing.assert_close(tv.jacobian(_sin2, x, compile=True), want)
    (entry,) = compiled._CACHE.values()
    assert entry.run is not None


class _Scale:
    op = torch.sin


def _scaled(x):
    return _Scale.op(x) * 2.0


def test_a_recompile_while_dynamo_is_disabled_leaves_the_signature_compilable(monkeypatch):
    # (an entry whose guard fails once dynamo's config.disable is set cannot recompile:
    # that call runs eagerly, and after dynamo is back the signature compiles again. The
    # function read through a class, which dynamo guards by identity, is not in the key: a
    # number read there is, NOTE [what a program read beyond its key], and would find a
    # key of its own instead of recompiling)
    monkeypatch.setattr(_Scale, "op", torch.sin)
    x = torch.randn(3, dtype=D)
    tv.jacobian(_scaled, x, compile=True)
    _Scale.op = torch.cos
    with warnings.catch_warnings():
        warnings.simplefilter("error", tv.JacobianWarning)
        with torch._dynamo.config.patch(disable=True):
            torch.testing.assert_close(tv.jacobian(_scaled, x, compile=True),
                                       torch.func.jacrev(_scaled)(x))
        assert not compiled._CACHE
        for _ in range(2):
            torch.testing.assert_close(tv.jacobian(_scaled, x, compile=True),
                                       torch.func.jacrev(_scaled)(x))
    (entry,) = compiled._CACHE.values()
    assert entry.run is not None


_IDX = torch.tensor([0, 1, 0, 2, 1, 0])


def _index_added(x):
    return torch.zeros(3, dtype=x.dtype).index_add(0, _IDX, x.sin())


@pytest.mark.usefixtures("inductor")
def test_an_index_add_in_forward_mode_compiles():
    # (its zero tangent is an efficient zero tensor expanded over the basis: inductor added
    # every row into the one row the expand shares, through the zero tensor's missing
    # memory, and the process died)
    x = torch.randn(6, dtype=D)
    with warnings.catch_warnings():
        warnings.simplefilter("error", tv.JacobianWarning)
        for _ in range(2):
            got = tv.jacobian(_index_added, x, strategy="fwd", compile=True)
            torch.testing.assert_close(got, torch.func.jacrev(_index_added)(x))
    (entry,) = compiled._CACHE.values()
    assert entry.run is not None


def _scaled_by(w):
    return lambda x: (x * w).sin()


def test_a_closure_tensor_whose_requires_grad_alternates_keeps_both_programs():
    # (the note of a function called again saw the same tensor: its entry, of the other
    # flag, recompiled, was dropped, and the program was built anew every other call)
    w = torch.randn(3, dtype=D)
    f = _scaled_by(w)
    x = torch.randn(3, dtype=D)
    before = compiled.builds()
    with warnings.catch_warnings():
        warnings.simplefilter("error", tv.JacobianWarning)
        for i in range(2 * compiled.REBUILD_WARN_AT + 2):
            w.requires_grad_(i % 2 == 1)
            want = torch.func.jacrev(_scaled_by(w.detach()))(x)
            torch.testing.assert_close(tv.jacobian(f, x, compile=True), want)
    assert compiled.builds() - before == 2
    assert len(compiled._CACHE) == 2


def test_a_model_frozen_on_alternate_calls_keeps_both_programs():
    # (dynamo guards each parameter's requires_grad: keyed on the training flags alone,
    # each switch recompiled the one entry, and it went eager with a warning)
    m = torch.nn.Linear(3, 2, dtype=D)
    x = torch.randn(3, dtype=D)
    with warnings.catch_warnings():
        warnings.simplefilter("error", tv.JacobianWarning)
        for i in range(2 * compiled.REBUILD_WARN_AT + 2):
            m.requires_grad_(i % 2 == 1)
            torch.testing.assert_close(tv.jacobian(m, x, compile=True), m.weight.detach())
    assert len(compiled._CACHE) == 2
    assert all(e.run is not None and e.recompiles == 0 for e in compiled._CACHE.values())


def _sin_ones(x):
    return (x * torch.ones(3, dtype=D)).sin()


def test_calls_inside_and_outside_a_default_device_keep_both_programs():
    # (dynamo guards the torch function mode stack: each switch recompiled the one entry)
    x = torch.randn(3, dtype=D)
    want = torch.func.jacrev(_sin_ones)(x)
    with warnings.catch_warnings():
        warnings.simplefilter("error", tv.JacobianWarning)
        for i in range(2 * compiled.REBUILD_WARN_AT + 2):
            if i % 2:
                with torch.device("cpu"):
                    got = tv.jacobian(_sin_ones, x, compile=True)
            else:
                got = tv.jacobian(_sin_ones, x, compile=True)
            torch.testing.assert_close(got, want)
    assert len(compiled._CACHE) == 2
    assert all(e.run is not None and e.recompiles == 0 for e in compiled._CACHE.values())

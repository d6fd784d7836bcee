"""Jacobians (SPEC §3): every strategy against torch.func in float64, chunking, the memory
budget, the auto fallback, disconnected outputs, and errors that explain themselves."""

from __future__ import annotations

import contextlib
import functools
import re
import textwrap
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.utils._pytree import tree_flatten, tree_leaves, tree_structure

import torch_vjp as tv
from torch_vjp._engine.jacobian import jacobian_blocks
from torch_vjp._engine.memory import parse_max_memory
from torch_vjp._engine.problem import Problem
from torch_vjp._errors import JacobianCallError, JacobianOptionError
from torch_vjp._strategies import STRATEGIES, choose_mode
from torch_vjp.jacobians import batch_jacobian, hessian, jacobian, jacobian_of

D = torch.float64
ALL = tuple(STRATEGIES)  # auto, rev, fwd, rev-loop, fwd-loop


def assert_tree_close(got, want):
    got_flat, got_spec = tree_flatten(got)
    want_flat, want_spec = tree_flatten(want)
    assert got_spec == want_spec, f"structure {got_spec} != {want_spec}"
    for g, w in zip(got_flat, want_flat):
        assert g.shape == w.shape, f"{tuple(g.shape)} != {tuple(w.shape)}"
        torch.testing.assert_close(g, w)


@contextlib.contextmanager
def no_jacobian_warnings():
    """A context in which any JacobianWarning fails the test."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", tv.JacobianWarning)
        yield


# --------------------------------------------------------------------------------------
# The case table: (f, primals, options) in float64
# --------------------------------------------------------------------------------------


def _mlp(n_in=4, hidden=6, n_out=3):
    W1, W2 = torch.randn(hidden, n_in, dtype=D), torch.randn(n_out, hidden, dtype=D)
    return lambda x: W2 @ torch.tanh(W1 @ x)


CASES = {
    "elementwise": lambda: (lambda x: x.sin() * x, (torch.randn(5, dtype=D),), {}),
    "mlp": lambda: (_mlp(), (torch.randn(4, dtype=D),), {}),
    "outer": lambda: (lambda x: torch.outer(x, x), (torch.randn(4, dtype=D),), {}),
    "matrix-in-out": lambda: (lambda x: (x @ x.T).tanh(), (torch.randn(2, 3, dtype=D),), {}),
    "two-inputs-tuple-argnums": lambda: (
        lambda x, W: torch.tanh(W @ x) + x.sum(),
        (torch.randn(4, dtype=D), torch.randn(3, 4, dtype=D)),
        {"argnums": (0, 1)},
    ),
    "three-inputs-argnums-2-0": lambda: (
        lambda x, s, y: s * x * y.sum() + x.sin(),
        (torch.randn(3, dtype=D), 2.5, torch.randn(2, dtype=D)),
        {"argnums": (2, 0)},
    ),
    "negative-argnums": lambda: (
        lambda x, y: x * y.exp(), (torch.randn(3, dtype=D), torch.randn(3, dtype=D)),
        {"argnums": -1},
    ),
    "dict-output": lambda: (
        lambda x: {"a": x.sin(), "b": (x * x).sum(), "c": torch.outer(x, x)},
        (torch.randn(3, dtype=D),), {},
    ),
    "tuple-output-two-inputs": lambda: (
        lambda x, y: (x * y, torch.outer(x, y).sum(0)),
        (torch.randn(3, dtype=D), torch.randn(3, dtype=D)), {"argnums": (0, 1)},
    ),
    "pytree-input": lambda: (
        lambda p, x: torch.tanh(p["w"] @ x + p["b"]),
        ({"w": torch.randn(2, 3, dtype=D), "b": torch.randn(2, dtype=D)},
         torch.randn(3, dtype=D)), {},
    ),
    "0d-input": lambda: (
        lambda s: torch.stack([s.sin(), s * s, s.exp()]), (torch.tensor(0.7, dtype=D),), {}
    ),
    "0d-output": lambda: (lambda x: (x.sin() * x).sum(), (torch.randn(4, dtype=D),), {}),
    "0d-both": lambda: (lambda s: s.sin() * s, (torch.tensor(0.3, dtype=D),), {}),
    "has-aux": lambda: (
        lambda x: (x.sin() * x, {"cos": x.cos(), "n": torch.tensor(3)}), (torch.randn(4, dtype=D),),
        {"has_aux": True},
    ),
    "tall": lambda: (lambda x: torch.outer(x, x).reshape(-1).repeat(2),
                     (torch.randn(3, dtype=D),), {}),
    "middle-argnum-of-three": lambda: (
        lambda a, x, s: torch.tanh(a @ x) * s,
        (torch.randn(3, 4, dtype=D), torch.randn(4, dtype=D), 1.5), {"argnums": 1},
    ),
    "tuple-argnums-subset": lambda: (
        lambda x, y, z: torch.outer(x, z).sum(1) * y.sum(),
        (torch.randn(3, dtype=D), torch.randn(2, dtype=D), torch.randn(4, dtype=D)),
        {"argnums": (2, 0)},
    ),
}


def _reference(f, primals, opts):
    return torch.func.jacrev(f, argnums=opts.get("argnums", 0),
                             has_aux=opts.get("has_aux", False))(*primals)


@pytest.mark.parametrize("strategy", ALL)
@pytest.mark.parametrize("case", CASES)
def test_matches_jacrev(case, strategy):
    f, primals, opts = CASES[case]()
    want = _reference(f, primals, opts)
    with no_jacobian_warnings():
        got = jacobian(f, *primals, strategy=strategy, **opts)
    if opts.get("has_aux"):
        assert_tree_close(got[0], want[0])
        assert int(got[1]["n"]) == 3
        torch.testing.assert_close(got[1]["cos"], want[1]["cos"])
        assert not got[1]["cos"].requires_grad
    else:
        assert_tree_close(got, want)


@pytest.mark.parametrize("strategy", ALL)
@pytest.mark.parametrize("chunk_size", (1, 2, 3, 7, 1000))
@pytest.mark.parametrize("case", ("mlp", "outer", "dict-output", "two-inputs-tuple-argnums"))
def test_chunk_sizes(case, chunk_size, strategy):
    f, primals, opts = CASES[case]()
    got = jacobian(f, *primals, strategy=strategy, chunk_size=chunk_size, **opts)
    assert_tree_close(got, _reference(f, primals, opts))


@pytest.mark.parametrize("case", ("mlp", "tuple-output-two-inputs", "pytree-input"))
def test_strategies_agree(case):
    f, primals, opts = CASES[case]()
    results = {s: jacobian(f, *primals, strategy=s, **opts) for s in ALL}
    for s in ALL[1:]:
        assert_tree_close(results[s], results["rev"])


@pytest.mark.parametrize("strategy", ALL)
def test_dot_product_against_finite_differences(strategy):
    """<J t, c> from central differences equals <t, J^T c> from the Jacobian."""
    f = _mlp(5, 7, 4)
    x = torch.randn(5, dtype=D)
    J = jacobian(f, x, strategy=strategy)
    t, c = torch.randn(5, dtype=D), torch.randn(4, dtype=D)
    eps = 1e-6
    jt_fd = (f(x + eps * t) - f(x - eps * t)) / (2 * eps)
    lhs = torch.dot(jt_fd, c)
    rhs = torch.dot(t, J.T @ c)
    torch.testing.assert_close(lhs, rhs, atol=1e-7, rtol=1e-7)


def test_layout_outer_product():
    x = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=D)
    J = jacobian(lambda x: torch.outer(x, x), x)
    assert J.shape == (4, 4, 4)
    assert J[1, 2].tolist() == [0.0, 3.0, 2.0, 0.0]


@pytest.mark.parametrize("strategy", ALL)
def test_inputs_of_different_dtypes_match_torch_func(strategy):
    """Each input's basis has that input's dtype: reverse mode returns blocks in the input's
    dtype (as jacrev), forward mode in the output's (as jacfwd)."""
    W = torch.randn(3, 4, dtype=D)
    f = lambda x, y: torch.tanh(W @ x.double()) * y.sum()  # noqa: E731
    x, y = torch.randn(4, dtype=torch.float32), torch.randn(2, dtype=D)
    transform = torch.func.jacrev if strategy.startswith("rev") else torch.func.jacfwd
    want = transform(f, argnums=(0, 1))(x, y)
    if strategy == "auto":
        want = torch.func.jacrev(f, argnums=(0, 1))(x, y)  # 3 outputs, 6 inputs: reverse
    got = jacobian(f, x, y, argnums=(0, 1), strategy=strategy)
    assert [g.dtype for g in got] == [w.dtype for w in want]
    assert_tree_close(got, want)


@pytest.mark.parametrize("strategy", ("rev", "fwd", "auto"))
def test_blocks_are_views_of_one_result_like_jacrev(strategy):
    """Computed in one chunk, the blocks are views of the stacked products (no copy into a
    second buffer), as in torch.func.jacrev."""
    f = lambda x: {"a": x.sin(), "b": torch.outer(x, x)}  # noqa: E731
    x = torch.randn(3, dtype=D)
    got = jacobian(f, x, strategy=strategy)
    assert_tree_close(got, torch.func.jacrev(f)(x))
    if strategy == "fwd":  # one stacked result per output
        assert got["a"].untyped_storage().data_ptr() != got["b"].untyped_storage().data_ptr()
        two = jacobian(lambda x, y: x * y, x, x.cos(), argnums=(0, 1), strategy=strategy)
        assert two[0].untyped_storage().data_ptr() == two[1].untyped_storage().data_ptr()
    else:  # one stacked result per input
        assert got["a"].untyped_storage().data_ptr() == got["b"].untyped_storage().data_ptr()


def test_single_element_tuple_and_list_outputs_keep_their_structure():
    x = torch.randn(3, dtype=D)
    for f in (lambda x: (x.sin(),), lambda x: [x.sin()]):
        for s in ALL:
            got = jacobian(f, x, strategy=s)
            assert type(got) is type(f(x))
            torch.testing.assert_close(got[0], torch.diag(x.cos()))


# --------------------------------------------------------------------------------------
# auto: the choice, and the fallback when vmap cannot batch f
# --------------------------------------------------------------------------------------


def test_auto_picks_by_size():
    assert choose_mode(8, 512) == "fwd"
    assert choose_mode(512, 8) == "rev"
    assert choose_mode(256, 256) == "rev"
    assert choose_mode(1, 1) == "rev"
    for n_in, n_out, mode in ((8, 512, "fwd"), (512, 8, "rev"), (64, 64, "rev")):
        W = torch.randn(n_out, n_in, dtype=D)
        prob = Problem(lambda x: torch.tanh(W @ x), (torch.randn(n_in, dtype=D),), 0,
                       has_aux=False, call="t")
        res = jacobian_blocks(prob, None, vectorized=True, fallback=True, chunk_size=None,
                              max_memory=None)
        assert res.mode == mode


def _counting(f):
    calls = {"n": 0}

    @functools.wraps(f)
    def wrapped(*args):
        calls["n"] += 1
        return f(*args)

    return wrapped, calls


class _ClipBackward(torch.autograd.Function):
    """Doubles x; its backward rescales large gradients with Python control flow, which
    torch.vmap cannot batch; no vmap rule, so forward mode cannot be batched either."""

    @staticmethod
    def forward(x):
        return 2 * x

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, g):
        if g.abs().max() > 1e6:
            g = g / g.abs().max()
        return 2 * g

    @staticmethod
    def jvp(ctx, t):
        return 2 * t


class _OldStyle(torch.autograd.Function):
    """exp(x) without setup_context: torch.func transforms refuse it."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.exp()

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * x.exp()


def _fallback_warnings(f, x, times=2):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        results = [jacobian(f, x) for _ in range(times)]
    return results, [w for w in caught if issubclass(w.category, tv.JacobianWarning)]


def test_auto_falls_back_to_rev_loop_once():
    x = torch.randn(4, dtype=D)

    def f(x):  # square: reverse mode, whose vmapped backward fails
        return _ClipBackward.apply(x) * x

    (J1, J2), caught = _fallback_warnings(f, x)
    want = torch.diag(4 * x)
    torch.testing.assert_close(J1, want)
    torch.testing.assert_close(J2, want)
    assert len(caught) == 1, [str(w.message) for w in caught]
    msg = str(caught[0].message)
    assert re.search(r"could not vectorise the Jacobian of .*f.*strategy='rev-loop'", msg)
    assert "data-dependent control flow" in msg  # vmap's own words, quoted
    assert "slower" in msg and "once per function" in msg


def test_auto_fallback_names_a_known_refusal_rather_than_the_typical_causes():
    # the warning listed vmap's typical causes (custom Functions, NumPy, batching rules),
    # none of them f's: it changes a tensor it captured
    count = torch.zeros((), dtype=D)

    def f(x):
        with torch.no_grad():
            count.add_(1)
        return x.sin()

    x = torch.randn(3, dtype=D)
    _, caught = _fallback_warnings(f, x, times=1)
    said = [str(w.message) for w in caught if "could not vectorise" in str(w.message)]
    assert len(said) == 1, [str(w.message) for w in caught]
    assert ("  That is: f changes a tensor it captured in place (a module in training mode "
            "updating its running statistics, say). Pass strategy='rev-loop'") in said[0]
    assert "Typical causes" not in said[0]
    assert count.item() == 0  # (put back)


def test_auto_falls_back_to_fwd_loop_once():
    x = torch.randn(2, dtype=D)

    def f(x):  # tall (2 -> 200): forward mode, and vmap of the custom Function fails
        return _ClipBackward.apply(x).repeat(100)

    assert choose_mode(2, 200) == "fwd"
    (J1, _), caught = _fallback_warnings(f, x)
    torch.testing.assert_close(J1, 2 * torch.eye(2, dtype=D).repeat(100, 1))
    assert len(caught) == 1
    assert "strategy='fwd-loop'" in str(caught[0].message)
    assert "does not have vmap support" in str(caught[0].message)


def test_auto_handles_old_style_autograd_function():
    x = torch.randn(3, dtype=D)

    def f(x):
        return _OldStyle.apply(x) * 2

    (J, _), caught = _fallback_warnings(f, x)
    torch.testing.assert_close(J, torch.diag(2 * x.exp()))
    assert len(caught) == 1 and "setup_context" in str(caught[0].message)
    # forward mode has no formula for it: "auto" on a tall Jacobian switches to reverse
    def g(x):
        return _OldStyle.apply(x).repeat(100)

    assert choose_mode(3, 300) == "fwd"
    (J,), caught = _fallback_warnings(g, x, times=1)
    torch.testing.assert_close(J, torch.diag(x.exp()).repeat(100, 1))
    assert any("uses reverse mode instead" in str(w.message) for w in caught)


def test_explicit_strategies_explain_what_they_cannot_run():
    # a Function whose forward takes ctx: torch.func cannot run it, forward mode has no
    # formula for it (raw RuntimeError and NotImplementedError came through)
    x = torch.randn(3, dtype=D)
    with pytest.raises(tv.StrategyError, match=(
            r"^torch_vjp\.jacobian: the vectorised strategies compute with torch\.func, which "
            r"cannot run f \(_OldStyle\.apply\) in rev-mode products: f uses a custom "
            r"torch\.autograd\.Function whose forward takes ctx \(no setup_context "
            r"staticmethod\), which torch\.func's transforms cannot run\n  torch\.func said: "
            r"RuntimeError: .*\n  Fix: strategy='auto', 'rev-loop' or 'fwd-loop'")):
        jacobian(_OldStyle.apply, x, strategy="rev")
    # (a missing forward-mode formula is torch's NotImplementedError: still one)
    with pytest.raises(tv.StrategyNotImplementedError, match=(
            r"^torch_vjp\.jacobian: strategy='fwd-loop' computes with forward-mode AD, and an "
            r"operator in f has no forward-mode formula \(a custom torch\.autograd\.Function "
            r"without a jvp staticmethod\)\.\n  torch said: "
            r"NotImplementedError: .*\n  Fix: strategy='rev-loop' or 'auto' \(reverse mode "
            r"needs only backward formulas\), or give the Function a jvp staticmethod\.$")):
        jacobian(_OldStyle.apply, x, strategy="fwd-loop")
    with pytest.raises(tv.StrategyNotImplementedError, match=(
            r"^torch_vjp\.jacobian: strategy='fwd' computes with forward-mode AD, and an "
            r"operator in f has no forward-mode formula .*\n  torch said: NotImplementedError: "
            r"Trying to use forward AD with _cdist_forward .*\n  Fix: strategy='rev' or "
            r"'auto'")):
        jacobian(lambda v: torch.cdist(v.view(3, 1), torch.ones(2, 1, dtype=D)), x,
                 strategy="fwd")
    torch.testing.assert_close(jacobian(_OldStyle.apply, x, strategy="rev-loop"),
                               torch.diag(x.exp()))
    for strategy in ("fwd", "fwd-loop"):  # (code written against torch.func keeps working)
        with pytest.raises(NotImplementedError) as info:
            jacobian(lambda v: torch.cdist(v.view(3, 1), torch.ones(2, 1, dtype=D)), x,
                     strategy=strategy)
        assert isinstance(info.value, tv.StrategyError)
        assert isinstance(info.value, ValueError)


def test_vjp_and_jvp_explain_a_function_torch_func_cannot_run():
    x = torch.randn(3, dtype=D)
    for call in (lambda: tv.vjp(_OldStyle.apply, x), lambda: tv.jvp(_OldStyle.apply, (x,), (x,))):
        with pytest.raises(tv.JacobianCallError, match=(
                r"^torch_vjp\.(vjp|jvp): f uses a custom torch\.autograd\.Function whose "
                r"forward takes ctx \(no setup_context staticmethod\), which torch\.func's "
                r"transforms cannot run\.\n  torch\.func said: RuntimeError: .*\n  Fix: give "
                r"the Function a setup_context staticmethod")):
            call()


@pytest.mark.parametrize("strategy", ALL)
def test_aux_carries_a_graph_only_with_create_graph(strategy):
    # forward mode's aux kept a graph (through a chunk's batched copy of the forward pass)
    # where reverse mode's was detached: no graph outlives the call without create_graph
    W = torch.randn(4, 4, dtype=D, requires_grad=True)
    x = torch.randn(4, dtype=D)
    f = lambda z: (torch.tanh(W @ z) * z, (W.sum() * z, [W.sum()]))  # noqa: E731
    for chunk in (None, 2):
        _, aux = jacobian(f, x, strategy=strategy, has_aux=True, chunk_size=chunk)
        assert not aux[0].requires_grad and not aux[1][0].requires_grad
        torch.testing.assert_close(aux[0], W.detach().sum() * x)
        _, aux = jacobian(f, x, strategy=strategy, has_aux=True, chunk_size=chunk,
                          create_graph=True)
        (g,) = torch.autograd.grad(aux[0].sum(), W)
        torch.testing.assert_close(g, torch.full_like(W, float(x.sum())))


def test_explicit_vectorised_strategy_does_not_fall_back():
    x = torch.randn(4, dtype=D)
    with pytest.raises(RuntimeError, match="data-dependent control flow") as info:
        jacobian(lambda x: _ClipBackward.apply(x), x, strategy="rev")
    assert not isinstance(info.value, tv.TorchVJPError)  # torch's error, as raised
    torch.testing.assert_close(
        jacobian(lambda x: _ClipBackward.apply(x), x, strategy="rev-loop"),
        2 * torch.eye(4, dtype=D),
    )


@pytest.mark.parametrize("strategy", ALL)
def test_data_dependent_control_flow_and_item_are_correct(strategy):
    """Control flow and .item() on primal values batch fine (vmap maps only the basis)."""
    x = torch.tensor([0.5, -1.0, 2.0], dtype=D)

    def branchy(x):
        if x.sum() > 0:
            return x * x
        return -x

    def scaled(x):
        return x.sin() * float(x.abs().max().item() > 1.0)

    with no_jacobian_warnings():
        torch.testing.assert_close(jacobian(branchy, x, strategy=strategy), torch.diag(2 * x))
        torch.testing.assert_close(jacobian(scaled, x, strategy=strategy), torch.diag(x.cos()))


# --------------------------------------------------------------------------------------
# Outputs that do not depend on an input through autograd
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("strategy", ALL)
def test_disconnected_output_warns_naming_the_input(strategy):
    x = torch.randn(3, dtype=D)

    def through_item(x):
        return torch.full((2,), x.sum().item(), dtype=D)

    with tv.checked(), pytest.warns(tv.JacobianWarning, match=r"the output of f does not "
                                    r"depend on primals\[0\] through autograd, although its "
                                    r"value changes"):
        J = jacobian(through_item, x, strategy=strategy)
    assert J.shape == (2, 3) and not J.any()


@pytest.mark.parametrize("strategy", ALL)
def test_disconnected_second_input_is_named_by_argnums(strategy):
    x, y = torch.randn(3, dtype=D), torch.randn(2, dtype=D)

    def f(x, y):
        return {"out": x * y.detach().sum()}

    with tv.checked(), pytest.warns(
        tv.JacobianWarning, match=r"output\['out'\] does not depend on primals\[1\] "
                                  r"\(argnums\[1\]\)"
    ):
        Jx, Jy = jacobian(f, x, y, argnums=(0, 1), strategy=strategy)["out"]
    torch.testing.assert_close(Jx, torch.eye(3, dtype=D) * y.sum())


def test_numpy_inside_f_warns_instead_of_failing():
    import numpy as np

    x = torch.randn(3, dtype=D)

    def f(x):
        return torch.from_numpy(np.sin(x.detach().numpy()))

    with warnings.catch_warnings(record=True) as caught, tv.checked():
        warnings.simplefilter("always")
        J = jacobian(f, x)
    messages = [str(w.message) for w in caught if issubclass(w.category, tv.JacobianWarning)]
    assert not J.any()
    assert any("does not depend on primals[0] through autograd" in m for m in messages)


@pytest.mark.parametrize("strategy", ALL)
def test_true_zeros_do_not_warn(strategy):
    """Outputs that do not use an input, constants and dead ReLUs have zero blocks for
    real: no warning."""
    x, y = torch.randn(3, dtype=D), torch.randn(3, dtype=D)
    with no_jacobian_warnings(), tv.checked():
        J = jacobian(lambda x, y: {"a": x.sin(), "b": y.cos()}, x, y, argnums=(0, 1),
                     strategy=strategy)
        assert not J["a"][1].any() and not J["b"][0].any()
        assert not jacobian(lambda x: torch.ones(2, dtype=D), x, strategy=strategy).any()
        assert not jacobian(torch.relu, -x.abs() - 1, strategy=strategy).any()
        assert not jacobian(torch.round, x, strategy=strategy).any()


# --------------------------------------------------------------------------------------
# Errors of f pass through untouched; nothing is mutated
# --------------------------------------------------------------------------------------


class UserError(Exception):
    pass


@pytest.mark.parametrize("strategy", ALL)
def test_errors_of_f_pass_through_untouched(strategy):
    raised = []

    def f(x):
        err = UserError("boom from f")
        raised.append(err)
        raise err

    with pytest.raises(UserError) as info:
        jacobian(f, torch.randn(3, dtype=D), strategy=strategy)
    assert info.value is raised[-1]  # the very object f raised, not a wrapper
    assert str(info.value) == "boom from f"


@pytest.mark.parametrize("strategy", ("auto", "fwd", "fwd-loop"))
def test_value_error_of_f_during_products_passes_through(strategy):
    """f that fails only on its second call: the products, after the probe that measures
    the output (reverse mode calls f once)."""
    calls = {"n": 0}

    def f(x):
        calls["n"] += 1
        if calls["n"] >= 2:
            raise ValueError("second call")
        return x * 2

    with pytest.raises(ValueError, match="^second call$") as info:
        jacobian(f, torch.randn(3, dtype=D), strategy=strategy)
    assert type(info.value) is ValueError


@pytest.mark.parametrize("strategy", ALL)
def test_nothing_is_mutated(strategy):
    model = torch.nn.Sequential(
        torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 2)
    ).double()
    model(torch.randn(8, 3, dtype=D))  # non-trivial running statistics
    model.eval()
    model[0].weight.grad = torch.ones_like(model[0].weight)
    x = torch.randn(5, 3, dtype=D)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x_before = x.clone()
    J = jacobian(model, x, strategy=strategy)
    assert J.shape == (5, 2, 5, 3)
    assert not model.training and not any(m.training for m in model)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k  # BatchNorm running stats untouched
    assert all(p.requires_grad for p in model.parameters())
    assert torch.equal(model[0].weight.grad, torch.ones_like(model[0].weight))
    assert model[2].weight.grad is None
    assert torch.equal(x, x_before) and not x.requires_grad and x.grad is None
    x.requires_grad_()
    jacobian(lambda x: x.sin(), x, strategy=strategy)
    assert x.requires_grad and x.grad is None


def test_module_in_training_mode_keeps_its_buffers():
    """BatchNorm in training mode updates its running statistics on every call; the
    Jacobian calls f more than once, and puts them back."""
    import copy

    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4)).double()
    model.train()
    twin = copy.deepcopy(model)
    x = torch.randn(5, 3, dtype=D)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tv.JacobianWarning)  # torch.func refuses: fallback
        J = jacobian(model, x)
    want = torch.autograd.functional.jacobian(twin, x)  # mutates twin's statistics
    torch.testing.assert_close(J, want)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert model.training


@pytest.mark.parametrize("strategy", ALL)
def test_result_is_differentiable_with_create_graph(strategy):
    x = torch.randn(3, dtype=D, requires_grad=True)
    f = lambda x: x.sin() * x.sum()  # noqa: E731
    (want,) = torch.autograd.grad(torch.func.jacrev(f)(x).pow(2).sum(), x)
    J = jacobian(f, x, strategy=strategy, create_graph=True)
    (got,) = torch.autograd.grad(J.pow(2).sum(), x)
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("strategy", ALL)
def test_result_is_detached_by_default(strategy):
    x = torch.randn(3, dtype=D, requires_grad=True)
    w = torch.randn(3, dtype=D, requires_grad=True)  # closed over, like a parameter
    f = lambda x: x.sin() * w  # noqa: E731
    J = jacobian(f, x, strategy=strategy)
    assert J.grad_fn is None and not J.requires_grad
    torch.testing.assert_close(J, torch.func.jacrev(f)(x).detach())
    H = tv.hessian(lambda x: (x.sin() * w).sum(), x)
    assert H.grad_fn is None


def test_create_graph_must_be_a_bool():
    with pytest.raises(tv.JacobianOptionError, match=r"create_graph='yes', but it must be True "
                       r"or False"):
        jacobian(torch.sin, torch.ones(2, dtype=D), create_graph="yes")


# --------------------------------------------------------------------------------------
# Errors of the call
# --------------------------------------------------------------------------------------


def test_unknown_strategy():
    with pytest.raises(tv.StrategyError, match=re.escape(
        "torch_vjp.jacobian: unknown strategy 'bogus'. Supported: "
        "('auto', 'rev', 'fwd', 'rev-loop', 'fwd-loop')."
    )) as info:
        jacobian(torch.sin, torch.randn(3), strategy="bogus")
    assert isinstance(info.value, ValueError)
    with pytest.raises(tv.StrategyError, match=r"unknown strategy 'reverse'.*Did you mean 'rev'\?"):
        jacobian(torch.sin, torch.randn(3), strategy="reverse")
    with pytest.raises(tv.StrategyError, match="torch_vjp.batch_jacobian: unknown strategy"):
        batch_jacobian(torch.sin, torch.randn(2, 3), strategy="jacrev2")
    with pytest.raises(tv.StrategyError, match="torch_vjp.hessian: unknown strategy"):
        hessian(lambda x: x.sum(), torch.randn(3), strategy=None)


@pytest.mark.parametrize("chunk_size", (0, -2, 1.5, True, "4"))
def test_bad_chunk_size(chunk_size):
    with pytest.raises(JacobianOptionError, match=r"chunk_size=.*must be None or an int >= 1"):
        jacobian(torch.sin, torch.randn(3), chunk_size=chunk_size)


@pytest.mark.parametrize(
    "value, expected",
    [(1000, 1000), (2.5e9, 2_500_000_000), ("2GB", 2 * 10**9), ("512MiB", 512 * 2**20),
     ("1.5 GB", 1_500_000_000), ("64 kB", 64_000), ("3KiB", 3072), ("100", 100),
     ("1e3 B", 1000), ("2gib", 2 * 2**30)],
    ids=str,
)
def test_max_memory_units(value, expected):
    assert parse_max_memory(value, call="t") == expected


def test_max_memory_of_numpy_and_huge_integers():
    np = pytest.importorskip("numpy")
    assert parse_max_memory(np.int64(2_000), call="t") == 2_000
    assert parse_max_memory(np.float32(2e3), call="t") == 2_000
    assert parse_max_memory(10 ** 400, call="t") == 10 ** 400


@pytest.mark.parametrize("strategy", ALL)
def test_batch_jacobian_of_an_empty_batch(strategy):
    # 'auto' raised a raw IndexError from its check of the first call
    J = batch_jacobian(torch.sin, torch.randn(0, 3, dtype=D), strategy=strategy)
    assert J.shape == (0, 3, 3)


@pytest.mark.parametrize(
    "value, match",
    [("2G", r"'2G' is ambiguous: write '2GB' \(powers of 1000\) or '2GiB'"),
     ("lots", r"'lots' is not a memory size. Pass a number of bytes"),
     (-5, r"must be a positive, finite number of bytes \(None sets no budget\)"),
     (0, "positive"), (True, "not a memory size"),
     (float("inf"), r"max_memory=inf, but it must be a positive, finite number of bytes"),
     ("0 MB", "zero bytes"), ([1], "not a memory size"),
     # (an OverflowError came out of these, and '-1' was "not a memory size")
     ("1e400", "too large a number"), ("1e309 B", "too large a number"),
     ("-1", "is negative"), ("-2GB", "is negative"), (float("nan"), "positive, finite")],
    ids=str,
)
def test_bad_max_memory(value, match):
    with pytest.raises(JacobianOptionError, match=match):
        jacobian(torch.sin, torch.randn(3), max_memory=value)


def test_max_memory_digits_grouped_with_underscores_as_the_message_shows():
    # the message's own example, 2_000_000_000, was refused when written as a string
    from torch_vjp._engine.memory import parse_max_memory

    assert parse_max_memory("2_000_000_000", call="c") == 2_000_000_000
    assert parse_max_memory("1_500 MB", call="c") == 1_500_000_000



@pytest.mark.parametrize(
    "f, primals, kwargs, match",
    [
        (torch.sin, (torch.randn(3),), {"argnums": 1},
         r"argnums=1, but f was given 1 primal, so argnums must lie in -1..0"),
        (torch.mul, (torch.randn(3), torch.randn(3)), {"argnums": [0, 1]},
         r"must be an int or a non-empty tuple of ints.*Fix: argnums=\(0, 1\)"),
        (torch.mul, (torch.randn(3), torch.randn(3)), {"argnums": (0, -2)},
         "names a primal twice"),
        (torch.mul, (torch.randn(3), 2.0), {"argnums": 1},
         r"primals\[1\] is a float, but argnums selects it"),
        (lambda x: x * 2, (torch.arange(3),), {},
         r"primals\[0\] has dtype torch.int64, but only floating-point tensors"),
        (lambda x: x.abs(), (torch.randn(3, dtype=torch.complex64),), {},
         r"primals\[0\] has dtype torch.complex64"),
        (lambda x: (x, 1), (torch.randn(3),), {},
         r"the output of f\[1\] is an int.*If f returns \(output, aux\), pass has_aux=True"),
        (lambda x: x.argmax(), (torch.randn(3),), {},
         r"the output of f has dtype torch.int64; only real floating-point outputs"),
        (lambda x: x.sin(), (torch.randn(3),), {"has_aux": True},
         r"with has_aux=True, f must return a pair \(output, aux\), but it returned a Tensor"),
        (lambda x: (), (torch.randn(3),), {}, "holds no tensors"),
        (torch.sin, (), {}, "no primals were given"),
    ],
    ids=["argnums-range", "argnums-list", "argnums-twice", "float-primal", "int-primal",
         "complex-primal", "non-tensor-output", "int-output", "has-aux-no-pair",
         "empty-output", "no-primals"],
)
def test_call_errors(f, primals, kwargs, match):
    for strategy in ("auto", "rev", "fwd-loop"):
        with pytest.raises(JacobianCallError, match=match) as info:
            jacobian(f, *primals, strategy=strategy, **kwargs)
        assert isinstance(info.value, RuntimeError)


# --------------------------------------------------------------------------------------
# Memory: the budget, chunking from it, and failing before allocating
# --------------------------------------------------------------------------------------


def test_chunk_size_derived_from_max_memory():
    """64 -> 64 in float64: J is 32 kB, one product is modelled at 4 kB; a budget of
    J + 8 products runs 8 chunks of 8 (counted as calls of f in forward mode, + 1 probe for
    the output size)."""
    W = torch.randn(64, 64, dtype=D)
    plain = lambda x: torch.tanh(W @ x)  # noqa: E731
    f, calls = _counting(plain)
    x = torch.randn(64, dtype=D)
    J = jacobian(f, x, strategy="fwd", max_memory=64 * 64 * 8 + 8 * 4 * 8 * 128)
    torch.testing.assert_close(J, torch.func.jacrev(plain)(x))
    assert calls["n"] == 1 + 8
    calls["n"] = 0
    jacobian(f, x, strategy="fwd", max_memory="1GB")
    assert calls["n"] == 1  # one chunk; the output size is remembered from the first call


def test_output_sizes_are_remembered_and_checked():
    """Forward mode probes f for its output size once per function and input shapes; if
    f's output changes for the same input shapes, the stale size is noticed."""
    width = {"n": 300}
    W = torch.randn(400, 2, dtype=D)
    plain = lambda x: torch.tanh(W[: width["n"]] @ x)  # noqa: E731
    f, calls = _counting(plain)
    x = torch.randn(2, dtype=D)
    # probe + products + the one-time check of forward mode (NOTE [auto, checked
    # once]), then the products only
    for expected_calls in (3, 1):
        calls["n"] = 0
        torch.testing.assert_close(jacobian(f, x), torch.func.jacrev(plain)(x))
        assert calls["n"] == expected_calls
    width["n"] = 400
    for strategy in ("fwd", "fwd-loop", "auto"):
        J = jacobian(f, x, strategy=strategy)
        assert J.shape == (width["n"], 2)
        torch.testing.assert_close(J, torch.func.jacrev(plain)(x))
        width["n"] = 350 if width["n"] == 400 else 400


@pytest.mark.parametrize("strategy", ["fwd", "fwd-loop"])
def test_remembered_output_sizes_are_checked_for_an_empty_input(strategy):
    # with no input element no product calls f, and remembered sizes went unchecked: the
    # Jacobian kept the old output's shape, silently
    width = {"n": 2}
    f = lambda x: torch.cat([x, torch.ones(width["n"], dtype=D)]).sin()  # noqa: E731
    x = torch.randn(0, dtype=D)
    assert jacobian(f, x, strategy=strategy).shape == (2, 0)
    width["n"] = 5
    assert jacobian(f, x, strategy=strategy).shape == (5, 0)
    g = lambda x: torch.cat([x, torch.ones(4, width["n"], dtype=D)], 1).sin()  # noqa: E731
    xb = torch.randn(4, 0, dtype=D)
    assert batch_jacobian(g, xb, strategy=strategy).shape == (4, 5, 0)
    width["n"] = 3
    assert batch_jacobian(g, xb, strategy=strategy).shape == (4, 3, 0)


def test_output_sizes_are_remembered_for_pytree_primals():
    """A dict of parameters (the functional_call pattern) is keyed by its structure and
    its leaves' sizes: the second call skips the probe; a different structure probes again."""
    W = torch.randn(3, 4, dtype=D)

    def plain(params, x):
        return torch.tanh(params["w"] @ x + params["b"]).repeat(40)

    f, calls = _counting(plain)
    params = {"w": W, "b": torch.randn(3, dtype=D)}
    x = torch.randn(4, dtype=D)
    for expected_calls in (2, 1):  # probe + products, then the products only
        calls["n"] = 0
        J = jacobian(f, params, x, argnums=0, strategy="fwd")
        torch.testing.assert_close(J, torch.func.jacrev(plain)(params, x))
        assert calls["n"] == expected_calls
    calls["n"] = 0
    params2 = {"w": W, "b": torch.randn(1, dtype=D)}  # other leaf sizes: a new key
    torch.testing.assert_close(jacobian(f, params2, x, argnums=0, strategy="fwd"),
                               torch.func.jacrev(plain)(params2, x))
    assert calls["n"] == 2


@pytest.mark.parametrize("strategy", ALL)
def test_jacobian_over_budget_raises_before_allocating(strategy):
    x = torch.randn(100_000)  # J would be 1e10 float32 elements: 40 GB
    with pytest.raises(tv.JacobianMemoryError) as info:
        jacobian(torch.sin, x, strategy=strategy, max_memory="1GB")
    msg = str(info.value)
    assert msg.startswith("torch_vjp.jacobian: the result needs 40 GB: 10,000,000,000 float32 "
                          "elements, 100,000 output elements times 100,000 input elements.")
    assert "more than max_memory=1 GB" in msg
    assert "nothing large was allocated" in msg
    for alternative in ("torch_vjp.vjp / torch_vjp.jvp", "torch_vjp.batch_jacobian",
                        "a smaller argnums"):
        assert alternative in msg
    assert isinstance(info.value, MemoryError)


def test_jacobian_larger_than_free_memory_fails_fast_without_allocating():
    """Default budget: the free memory. Checked in a process of its own by its peak RSS (a
    child of the fork server the distributed tests' ranks share, torch and torch_vjp
    imported there once)."""
    from _shared_functions import run_forked

    code = textwrap.dedent("""
        import resource, time, torch, torch_vjp as tv
        from torch_vjp.jacobians import jacobian
        x = torch.randn(300_000, dtype=torch.float64)   # J: 9e10 elements, 720 GB
        jacobian(torch.sin, torch.randn(3))              # warm up imports
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        t0 = time.perf_counter()
        for strategy in ("auto", "rev", "fwd", "rev-loop", "fwd-loop"):
            try:
                jacobian(torch.sin, x, strategy=strategy)
            except tv.JacobianMemoryError as e:
                assert "720 GB" in str(e) and "the default budget" in str(e), str(e)
            else:
                raise SystemExit("no JacobianMemoryError")
        elapsed = time.perf_counter() - t0
        grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
        print(grown, elapsed)
    """)
    printed, error = run_forked(code, timeout=120)
    assert not error, error
    grown_kb, _elapsed = printed.split()
    assert int(grown_kb) < 100_000, f"peak RSS grew by {grown_kb} kB"


def test_result_fits_but_one_product_does_not():
    with pytest.raises(tv.JacobianMemoryError,
                       match=r"the result needs 800 B and at least 640 B of working memory "
                             r"for one product, 1\.44 kB in all: .* That is more than "
                             r"max_memory=1 kB\."):
        jacobian(torch.sin, torch.randn(10, dtype=D), max_memory=1000)


# --------------------------------------------------------------------------------------
# batch_jacobian
# --------------------------------------------------------------------------------------


def _per_example(f_single, x):
    return torch.vmap(torch.func.jacrev(f_single))(x)


@pytest.mark.parametrize("chunk_size", (None, 1, 3))
@pytest.mark.parametrize("strategy", ALL)
def test_batch_jacobian_matches_vmap_jacrev(strategy, chunk_size):
    W1, W2 = torch.randn(6, 4, dtype=D), torch.randn(3, 6, dtype=D)
    single = lambda xi: W2 @ torch.tanh(W1 @ xi)  # noqa: E731
    batched = lambda x: torch.tanh(x @ W1.T) @ W2.T  # noqa: E731
    x = torch.randn(5, 4, dtype=D)
    with no_jacobian_warnings():
        got = batch_jacobian(batched, x, strategy=strategy, chunk_size=chunk_size)
    assert got.shape == (5, 3, 4)
    torch.testing.assert_close(got, _per_example(single, x))


@pytest.mark.parametrize("strategy", ALL)
def test_batch_jacobian_rows_of_matrices_and_pytree_output(strategy):
    x = torch.randn(4, 2, 3, dtype=D)

    def batched(x):
        return {"m": x @ x.transpose(1, 2), "s": x.sin().sum((1, 2))}

    def single(xi):
        return {"m": xi @ xi.T, "s": xi.sin().sum()}

    got = batch_jacobian(batched, x, strategy=strategy)
    assert got["m"].shape == (4, 2, 2, 2, 3) and got["s"].shape == (4, 2, 3)
    assert_tree_close(got, _per_example(single, x))


def test_batch_jacobian_is_the_diagonal_of_the_full_jacobian():
    W = torch.randn(3, 3, dtype=D)
    f = lambda x: torch.tanh(x @ W)  # noqa: E731
    x = torch.randn(4, 3, dtype=D)
    full = jacobian(f, x)  # (4, 3, 4, 3)
    diag = torch.stack([full[b, :, b, :] for b in range(4)])
    torch.testing.assert_close(batch_jacobian(f, x), diag)


def test_batch_jacobian_errors():
    with pytest.raises(JacobianCallError, match=r"(?s)the output of f has shape \(\), but x "
                       r"has shape \(8, 3\): f must map a batch row by row.*B = 8.*use torch_vjp.jacobian"):
        batch_jacobian(lambda x: x.sin().sum(), torch.randn(8, 3))
    with pytest.raises(JacobianCallError, match=r"the output of f\[1\] has shape \(3,\)"):
        batch_jacobian(lambda x: (x.sin(), x.sum(0)), torch.randn(8, 3))
    with pytest.raises(JacobianCallError, match=r"x is a 0-d tensor, but it must be a tensor "
                       r"whose first dimension is the batch"):
        batch_jacobian(torch.sin, torch.tensor(1.0))


# --------------------------------------------------------------------------------------
# hessian
# --------------------------------------------------------------------------------------

HESSIAN_CASES = {
    "scalar-of-vector": lambda: (
        lambda x: (x.sin() * x.sum()).sum(), (torch.randn(4, dtype=D),), {}
    ),
    "mlp-loss": lambda: (
        (lambda net: lambda x: net(x).pow(2).sum())(_mlp(4, 5, 1)), (torch.randn(4, dtype=D),), {}
    ),
    "vector-output": lambda: (lambda x: torch.stack([x.prod(), (x ** 3).sum()]),
                              (torch.randn(3, dtype=D),), {}),
    "tuple-argnums": lambda: (lambda x, y: (x.sin() * y.exp()).sum() + (x * x).sum() * y[0],
                              (torch.randn(3, dtype=D), torch.randn(3, dtype=D)),
                              {"argnums": (0, 1)}),
    "matrix-input": lambda: (lambda X: torch.logdet(X @ X.T + torch.eye(2, dtype=D)),
                             (torch.randn(2, 3, dtype=D),), {}),
}


@pytest.mark.parametrize("strategy", ALL)
@pytest.mark.parametrize("case", HESSIAN_CASES)
def test_hessian_matches_torch_func(case, strategy):
    f, primals, opts = HESSIAN_CASES[case]()
    want = torch.func.hessian(f, argnums=opts.get("argnums", 0))(*primals)
    with no_jacobian_warnings():
        got = hessian(f, *primals, strategy=strategy, **opts)
    assert_tree_close(got, want)


def test_hessian_of_linear_function_is_zero_without_warning():
    with no_jacobian_warnings():
        H = hessian(lambda x: (3 * x).sum(), torch.randn(3, dtype=D))
    assert H.shape == (3, 3) and not H.any()


# --------------------------------------------------------------------------------------
# jacobian_of
# --------------------------------------------------------------------------------------


def test_jacobian_of_outer_product():
    x = torch.tensor([1.0, 2.0, 3.0, 4.0], requires_grad=True)
    J = jacobian_of(torch.outer(x, x), x)
    assert J.shape == (4, 4, 4)
    torch.testing.assert_close(J, torch.func.jacrev(lambda x: torch.outer(x, x))(x.detach()))


@pytest.mark.parametrize("chunk_size", (None, 1, 2, 3, 7, 1000))
def test_jacobian_of_tuples_and_chunks(chunk_size):
    x = torch.randn(3, dtype=D, requires_grad=True)
    W = torch.randn(2, 3, dtype=D, requires_grad=True)
    f = lambda x, W: (torch.tanh(W @ x), (x * x).sum())  # noqa: E731
    outs = f(x, W)
    got = jacobian_of(outs, (x, W), chunk_size=chunk_size, retain_graph=True)
    want = torch.func.jacrev(f, argnums=(0, 1))(x.detach(), W.detach())
    assert_tree_close(got, want)
    assert x.grad is None and W.grad is None
    # retain_graph=True: the graph can still be used
    outs[1].backward()
    torch.testing.assert_close(x.grad, 2 * x.detach())


def test_jacobian_of_create_graph_gives_second_derivatives():
    x = torch.randn(3, dtype=D, requires_grad=True)
    J = jacobian_of((x ** 3).sum(), x, create_graph=True)  # 3 x^2
    (H,) = torch.autograd.grad(J.sum(), x)
    torch.testing.assert_close(H, 6 * x.detach())


def test_jacobian_of_unused_input_and_output_without_grad_warn():
    x = torch.randn(3, dtype=D, requires_grad=True)
    z = torch.randn(2, dtype=D, requires_grad=True)
    with pytest.warns(tv.JacobianWarning, match=r"outputs\[0\] has no autograd path to "
                      r"inputs\[1\], so that Jacobian block is all zeros"):
        Jx, Jz = jacobian_of((x.sin(),), (x, z))[0]
    torch.testing.assert_close(Jx, torch.diag(x.detach().cos()))
    assert Jz.shape == (3, 2) and not Jz.any()
    with pytest.warns(tv.JacobianWarning, match=r"outputs\[1\] \(shape \(2,\)\) does not require "
                      r"grad"):
        J = jacobian_of((x.sin(), torch.tensor([x.sum().item()] * 2, dtype=D)), x)
    assert J[1].shape == (2, 3) and not J[1].any()


def test_jacobian_of_input_without_grad():
    x = torch.randn(3)
    with pytest.raises(JacobianCallError, match=r"inputs \(shape \(3,\)\) does not require grad"):
        jacobian_of(x * 2, x)
    with pytest.raises(JacobianCallError, match=r"inputs must be a tensor or a non-empty sequence"):
        jacobian_of(x * 2, [])


def test_jacobian_of_falls_back_to_a_loop_once():
    x = torch.randn(4, dtype=D, requires_grad=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            J = jacobian_of(_ClipBackward.apply(x) * x, x)
            torch.testing.assert_close(J, torch.diag(4 * x.detach()))
    messages = [str(w.message) for w in caught if issubclass(w.category, tv.JacobianWarning)]
    assert len(messages) <= 1  # once per process: an earlier test may have shown it
    assert all("vectorised backward pass" in m and "data-dependent control flow" in m
               for m in messages)


def test_jacobian_of_memory_error():
    x = torch.randn(300_000, dtype=D, requires_grad=True)
    with pytest.raises(tv.JacobianMemoryError, match=r"(?s)torch_vjp.jacobian_of: the result needs "
                       r"720 GB.*Alternatives: torch_vjp.grad with grad_outputs"):
        jacobian_of(x.sin(), x)


# --------------------------------------------------------------------------------------
# CUDA
# --------------------------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.parametrize("strategy", ALL)
def test_cuda_matches_cpu(strategy):
    from torch_vjp._engine.memory import free_memory

    cuda = torch.device("cuda")
    f, (x,), _ = CASES["mlp"]()
    W1, W2 = torch.randn(6, 4, dtype=D), torch.randn(3, 6, dtype=D)

    def g(x):
        return W2.to(x.device) @ torch.tanh(W1.to(x.device) @ x)

    J = jacobian(g, x.to(cuda), strategy=strategy, max_memory="1MB")
    assert J.device.type == "cuda"
    torch.testing.assert_close(J.cpu(), jacobian(g, x, strategy=strategy))
    xb = torch.randn(5, 4, dtype=D)
    model = lambda xb: torch.tanh(xb @ W1.T.to(xb.device))  # noqa: E731
    Jb = batch_jacobian(model, xb.to(cuda), strategy=strategy)
    torch.testing.assert_close(Jb.cpu(), batch_jacobian(model, xb, strategy=strategy))
    free = free_memory(cuda)
    assert free is not None and free[0] > 0 and "cuda" in free[1]


@pytest.mark.cuda
def test_cuda_jacobian_of_and_memory_error():
    x = torch.randn(4, dtype=D, device="cuda", requires_grad=True)
    J = jacobian_of(torch.outer(x, x), x)
    torch.testing.assert_close(J, torch.func.jacrev(lambda x: torch.outer(x, x))(x.detach()))
    big = torch.randn(10**6, device="cuda")  # J: 4 TB
    with pytest.raises(tv.JacobianMemoryError, match=r"free on cuda.*torch.cuda.mem_get_info"):
        jacobian(torch.sin, big)


# --------------------------------------------------------------------------------------
# Memory: no autograd graph outlives its chunk (NOTE [no graph outlives its chunk])
# --------------------------------------------------------------------------------------


def _mlp_with_grad_parameters(n_in: int, hidden: int, n_out: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(  # parameters require grad, as in any module
        torch.nn.Linear(n_in, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, hidden),
        torch.nn.Tanh(), torch.nn.Linear(hidden, n_out),
    ).double()


@pytest.mark.parametrize("strategy", ["fwd", "rev", "fwd-loop", "rev-loop", "auto"])
def test_max_memory_bounds_the_peak_when_parameters_require_grad(strategy):
    from torch_vjp._measure import measure_peak  # live tensor bytes, counted per operator

    model = _mlp_with_grad_parameters(256, 256, 256)
    x = torch.randn(256, dtype=D)
    jac_bytes = 256 * 256 * 8
    budget = jac_bytes + 300_000  # several chunks of products
    peak = measure_peak(lambda: jacobian(model, x, strategy=strategy, max_memory=budget),
                         torch.device("cpu"))
    assert peak <= budget
    # the same call keeping every chunk's graph (create_graph=True) would not fit: the check
    # above can fail
    kept = measure_peak(
        lambda: jacobian(model, x, strategy=strategy, max_memory=budget, create_graph=True),
        torch.device("cpu"),
    )
    assert kept > 2 * budget


@pytest.mark.parametrize("strategy", ["fwd", "rev", "fwd-loop", "rev-loop"])
def test_batch_jacobian_chunks_free_their_graphs(strategy):
    from torch_vjp._measure import measure_peak

    model = _mlp_with_grad_parameters(64, 256, 32)
    x = torch.randn(16, 64, dtype=D)
    cpu = torch.device("cpu")
    peak = measure_peak(lambda: tv.batch_jacobian(model, x, strategy=strategy, chunk_size=8),
                         cpu)
    with torch.no_grad():  # the least the computation needs
        least = measure_peak(
            lambda: tv.batch_jacobian(model, x, strategy=strategy, chunk_size=8), cpu)
    kept = measure_peak(
        lambda: tv.batch_jacobian(model, x, strategy=strategy, chunk_size=8, create_graph=True),
        cpu,
    )
    assert peak <= 2.5 * least < kept


# --------------------------------------------------------------------------------------
# Mutation: modules reached through f, and f writing its own arguments
# --------------------------------------------------------------------------------------


def _training_bn():
    torch.manual_seed(0)
    bn = torch.nn.BatchNorm1d(3).double()
    bn.train()
    return bn


def _reach_bn(bn):
    """The ways users hand a module to a Jacobian call."""
    import functools

    def closure(t):
        return bn(t) * 2

    class Holder:  # a plain object holding the module, as a training script's class does
        def __init__(self):
            self.model = bn

        def __call__(self, t):
            return self.model(t)

        def as_lambda(self):
            return lambda t: self.model(t)

    held = [bn]
    nested = {"a": {"b": {"net": bn}}}

    class Scaler:
        def __init__(self):
            self.m = bn

        def go(self, t, scale):
            return self.m(t) * scale

    return {
        "module": bn,
        "lambda": lambda t: bn(t),
        "closure": closure,
        "partial": functools.partial(lambda m, t: m(t), bn),
        "bound-method": bn.forward,
        "callable-object": Holder(),
        "lambda-over-self": Holder().as_lambda(),
        "list": lambda t: held[0](t),
        "nested-dict": lambda t: nested["a"]["b"]["net"](t),
        "partial-of-a-method": functools.partial(Scaler().go, scale=2.0),
    }


_REACH = ["module", "lambda", "closure", "partial", "bound-method", "callable-object",
          "lambda-over-self", "list", "nested-dict", "partial-of-a-method"]


@pytest.mark.parametrize("how", _REACH)
@pytest.mark.parametrize("call", ["jacobian", "batch_jacobian", "hessian"])
def test_batchnorm_buffers_never_move(how, call):
    bn = _training_bn()
    f = _reach_bn(bn)[how]
    x = torch.randn(5, 3, dtype=D)
    before = {k: v.clone() for k, v in bn.state_dict().items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tv.JacobianWarning)  # vmap refuses: loops
        for strategy in ("auto", "fwd-loop", "rev-loop"):
            if call == "jacobian":
                jacobian(f, x, strategy=strategy)
            elif call == "batch_jacobian" and strategy == "auto":
                # (BatchNorm in training mode mixes the rows: NOTE [a batch that mixes rows])
                with pytest.raises(tv.JacobianCallError, match="mixes examples of the batch"):
                    tv.batch_jacobian(f, x, strategy=strategy)
            elif call == "batch_jacobian":
                tv.batch_jacobian(f, x, strategy=strategy)
            else:  # torch.func refuses the in-place update: plain autograd computes it
                got = tv.hessian(lambda t: f(t).pow(3).sum(), x, strategy=strategy)
                for k, v in before.items():  # the reference from the same statistics
                    bn.state_dict()[k].copy_(v)
                ref = torch.autograd.functional.hessian(lambda t: f(t).pow(3).sum(), x)
                for k, v in before.items():
                    bn.state_dict()[k].copy_(v)
                torch.testing.assert_close(got, ref)
    if call == "hessian":  # the vectorised strategies are torch.func's transforms alone
        for strategy in ("rev", "fwd"):
            with pytest.raises(tv.StrategyError, match="mutate a captured Tensor"):
                tv.hessian(lambda t: f(t).pow(3).sum(), x, strategy=strategy)
    for k, v in bn.state_dict().items():
        assert torch.equal(v, before[k]), (k, v, before[k])
    assert bn.training


def test_hessian_of_a_training_module_by_plain_autograd_keeps_its_structure():
    bn = _training_bn()
    x, w = torch.randn(5, 3, dtype=D), torch.randn(3, dtype=D)
    g = lambda z, v: (bn(z) * v).pow(2).sum(0)  # noqa: E731 - a vector output
    before = {k: v.clone() for k, v in bn.state_dict().items()}
    with pytest.warns(tv.JacobianWarning, match="computed with plain autograd"):
        got = tv.hessian(g, x, w, argnums=(0, 1))
    for k, v in bn.state_dict().items():
        assert torch.equal(v, before[k]), k
    ref = torch.autograd.functional.jacobian(
        lambda a, b: torch.autograd.functional.jacobian(g, (a, b), create_graph=True), (x, w))
    for i in range(2):
        for j in range(2):
            torch.testing.assert_close(got[i][j], ref[i][j])
    assert got[0][1].shape == (3, 5, 3, 3)
    before = {k: v.clone() for k, v in bn.state_dict().items()}  # (ref's forward moved them)
    with warnings.catch_warnings():  # (pytrees, which the fallback refused)
        warnings.simplefilter("ignore", tv.JacobianWarning)
        pair = tv.hessian(lambda z: ((bn(z) ** 2 * w).sum(), bn(z).pow(3).sum()), x)
        in_dict = tv.hessian(lambda d: (bn(d["x"]) ** 3).sum(), {"x": x})
    for k, v in bn.state_dict().items():
        assert torch.equal(v, before[k]), k
    hess = torch.autograd.functional.hessian
    torch.testing.assert_close(pair[0], hess(lambda z: (bn(z) ** 2 * w).sum(), x))
    torch.testing.assert_close(pair[1], hess(lambda z: bn(z).pow(3).sum(), x))
    assert list(in_dict) == ["x"] and list(in_dict["x"]) == ["x"]
    torch.testing.assert_close(in_dict["x"]["x"], hess(lambda z: (bn(z) ** 3).sum(), x))


def test_modules_reached_finds_modules_behind_f():
    from torch_vjp._engine.context import modules_reached

    bn = _training_bn()
    for how, f in _reach_bn(bn).items():
        assert modules_reached(f) == [bn], how
    assert modules_reached(torch.sin) == []


@pytest.mark.parametrize("strategy", ["fwd", "fwd-loop"])
def test_f_writing_its_argument_leaves_the_caller_tensor_alone(strategy):
    def f(t):
        t.mul_(2)  # writes its own argument
        return t ** 2

    x = torch.tensor([1.0, 2.0, 3.0], dtype=D)
    J = jacobian(f, x, strategy=strategy)
    assert torch.equal(x, torch.tensor([1.0, 2.0, 3.0], dtype=D))
    # every product starts from the caller's point: d(2t)^2/dt = 8t there
    torch.testing.assert_close(J, torch.diag(8 * x))


@pytest.mark.parametrize("strategy", ["rev", "rev-loop", "auto"])  # auto: reverse (3 x 3)
def test_f_writing_its_argument_in_reverse_mode_is_computed(strategy):
    # torch.func.jacrev refuses it (and this raised the same error before NOTE [f writes
    # into its input]); the derivative is well defined, and forward mode computes it
    x = torch.tensor([1.0, 2.0, 3.0], dtype=D)
    with pytest.raises(RuntimeError, match="in-place operation"):
        torch.func.jacrev(lambda t: t.mul_(2) * 1)(x.clone())
    J = jacobian(lambda t: t.mul_(2) * 1, x, strategy=strategy)
    torch.testing.assert_close(J, 2 * torch.eye(3, dtype=D))
    assert torch.equal(x, torch.tensor([1.0, 2.0, 3.0], dtype=D))


def test_f_writing_a_non_differentiated_argument():
    x = torch.tensor([1.0, 2.0], dtype=D)
    y = torch.zeros(2, dtype=D)
    J = jacobian(lambda a, b: b.add_(a) * a, x, y, argnums=0, strategy="fwd-loop")
    assert torch.equal(y, torch.zeros(2, dtype=D))
    torch.testing.assert_close(J, torch.diag(2 * x))


# --------------------------------------------------------------------------------------
# Foreseeable mistakes raise a TorchVJPError naming the problem
# --------------------------------------------------------------------------------------

_X3 = torch.tensor([1.0, 2.0, 3.0], dtype=D)
CALL_MISTAKES = {
    # name: (call, class, message fragment)
    "f-not-callable": (lambda s: jacobian("sin", _X3, strategy=s), tv.JacobianCallTypeError,
                       r"f is a str, but it must be a callable"),
    "sparse-primal": (lambda s: jacobian(torch.sin, _X3.to_sparse(), strategy=s),
                      tv.JacobianCallError, r"primals\[0\] is a sparse tensor \(layout "
                      r"torch.sparse_coo\).*x.to_dense\(\)"),
    "nested-primal": (lambda s: jacobian(torch.sin, torch.nested.nested_tensor(
        [_X3, _X3[:2]]), strategy=s), tv.JacobianCallError, r"primals\[0\] is a nested tensor"),
    "non-tensor-aux": (lambda s: jacobian(lambda t: (t.sin(), 1.5), _X3, has_aux=True,
                                          strategy=s), tv.JacobianCallError,
                       r"aux is a float, but with has_aux=True the aux value f returns must be "
                       r"a tensor"),
    "non-tensor-aux-leaf": (lambda s: jacobian(lambda t: (t.sin(), {"a": [t, "s"]}), _X3,
                                               has_aux=True, strategy=s),
                            tv.JacobianCallError, r"aux\['a'\]\[1\] is a str"),
}


@pytest.mark.parametrize("case", CALL_MISTAKES, ids=list(CALL_MISTAKES))
@pytest.mark.parametrize("strategy", ALL)
def test_call_mistakes_raise_for_every_strategy(case, strategy):
    call, cls, match = CALL_MISTAKES[case]
    with warnings.catch_warnings():
        warnings.simplefilter("error", tv.JacobianWarning)  # no "could not vectorise" detour
        with pytest.raises(cls, match=match):
            call(strategy)


def test_non_tensor_aux_in_vjp_and_jvp_is_named():
    with pytest.raises(RuntimeError, match="Expected tensors"):  # torch.func refuses it too
        torch.func.vjp(lambda t: (t.sin(), 1.5), _X3, has_aux=True)
    with pytest.raises(tv.JacobianCallError, match=r"torch_vjp.vjp: aux is a float"):
        tv.vjp(lambda t: (t.sin(), 1.5), _X3, has_aux=True)
    with pytest.raises(tv.JacobianCallError, match=r"torch_vjp.jvp: aux is a float"):
        tv.jvp(lambda t: (t.sin(), 1.5), (_X3,), (_X3,), has_aux=True)


@pytest.mark.parametrize("dtype", [torch.int64, torch.bool])
def test_integer_tangents_are_refused_with_a_reason(dtype):
    tangent = torch.ones(3, dtype=dtype)
    with pytest.raises(ValueError, match="Expected tangent to be floating point"):
        torch.func.jvp(torch.sin, (_X3,), (tangent,))
    with pytest.raises(tv.GradOutputsValueError, match=rf"(?s)tangents\[0\] has dtype {dtype}.*"
                       r"must be floating point too") as info:
        tv.jvp(torch.sin, (_X3,), (tangent,))
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize("strategy", ["auto", "rev", "fwd", "rev-loop", "fwd-loop"])
def test_inside_inference_mode(strategy):
    """torch.func's transforms work inside torch.inference_mode; so do torch_vjp's, with the
    point made inside it (an inference tensor, without a version counter) or outside."""
    x = torch.randn(3, dtype=torch.float64)
    with torch.inference_mode():
        xi = torch.randn(3, dtype=torch.float64)
        for point in (x, xi):
            got = tv.jacobian(lambda v: v ** 2 * point.sum(), point, strategy=strategy)
            ref = torch.func.jacrev(lambda v: v ** 2 * point.sum())(point)
            torch.testing.assert_close(got, ref)
            torch.testing.assert_close(
                tv.hessian(lambda v: (v ** 3).sum(), point, strategy=strategy),
                torch.diag(6 * point))
        torch.testing.assert_close(tv.batch_jacobian(torch.sin, xi.reshape(3, 1)),
                                   torch.cos(xi).reshape(3, 1, 1))
        pattern = tv.jacobian_sparsity(lambda v: v ** 2, xi).to_dense()
        torch.testing.assert_close(
            tv.sparse_jacobian(lambda v: v ** 2, xi, pattern=pattern).to_dense(),
            torch.diag(2 * xi))


def test_auto_inside_inference_mode_is_not_checked_against_nothing(monkeypatch):
    # Plain autograd records nothing in inference mode: "auto"'s reverse product (NOTE
    # [auto, checked once]) was all zeros there, so every route "disagreed" with it, a false
    # warning (and for batch_jacobian, NOTE [a batch that mixes rows], a false error).
    from torch_vjp import _errors

    monkeypatch.setattr(_errors, "_WARNED", set())
    with torch.inference_mode():
        xi = torch.randn(3, dtype=D)
        with warnings.catch_warnings():
            warnings.simplefilter("error", tv.JacobianWarning)
            got = tv.batch_jacobian(torch.sin, xi.reshape(3, 1))
            full = tv.jacobian(torch.sin, xi)
    torch.testing.assert_close(got, torch.cos(xi).reshape(3, 1, 1))
    torch.testing.assert_close(full, torch.func.jacrev(torch.sin)(xi.clone()))


@pytest.mark.parametrize("strategy", ["fwd-loop", "rev-loop", "rev", "auto"])
def test_loop_columns_are_of_one_call_of_a_random_function(strategy):
    # Dropout in training mode: each column of a forward-mode loop calls f once, and every
    # column must be of the same function (the same mask), as reverse mode's one call is.
    W = torch.randn(6, 6, dtype=D)
    drop = torch.nn.Dropout(0.5).train()
    x = torch.randn(6, dtype=D)
    torch.manual_seed(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tv.JacobianWarning)
        J = jacobian(lambda x: drop(x @ W.T), x, strategy=strategy)
    kept = (J != 0).any(1).to(D)
    torch.testing.assert_close(J, 2 * kept[:, None] * W)
    assert 0 < int(kept.sum()) < 6  # (seed 1 drops some rows and keeps others)


def test_chunks_of_one_column_are_of_one_call_of_a_random_function():
    # chunk_size=1 runs each product as a plain call of f, without vmap: every column (and
    # every direction of a batched jvp, every colour of a sparse Jacobian) must be of the
    # same draws, as in the loop strategies
    x = torch.randn(4, dtype=D)
    g = lambda x: torch.rand(5, dtype=D) * x.sum()  # noqa: E731 - J[i, j] = r[i]
    J = jacobian(g, x, strategy="fwd", chunk_size=1)
    torch.testing.assert_close(J, J[:, :1].expand_as(J))
    xb = torch.randn(3, 4, dtype=D)
    Jb = tv.batch_jacobian(lambda x: torch.rand(3, 5, dtype=D) * x.sum(1, keepdim=True), xb,
                           strategy="fwd", chunk_size=1)
    torch.testing.assert_close(Jb, Jb[..., :1].expand_as(Jb))
    T = torch.randn(3, 4, dtype=D)
    out, tangents = tv.jvp(g, (x,), (T,), batched=True, chunk_size=1)
    torch.testing.assert_close(tangents, (out / x.sum()) * T.sum(1, keepdim=True))
    h = lambda x: F.dropout(x, 0.5, training=True) * x.roll(1)  # noqa: E731
    S = tv.sparse_jacobian(h, x, mode="fwd", chunk_size=1, layout=torch.strided)
    kept = (S.diagonal() != 0).to(D)  # one mask: row i is kept or dropped as a whole
    torch.testing.assert_close(S, torch.autograd.functional.jacobian(
        lambda v: 2 * kept * v * v.roll(1), x))


def test_jacobian_of_refuses_complex_tensors():
    x = torch.randn(3, dtype=D, requires_grad=True)
    with pytest.raises(JacobianCallError, match=r"outputs has dtype torch.complex128; Jacobians "
                                                r"here .* real part alone\. Fix: .*view_as_real"):
        jacobian_of(x * (1 + 2j), x)
    z = torch.randn(3, dtype=torch.complex128, requires_grad=True)
    with pytest.raises(JacobianCallError, match=r"inputs has dtype torch.complex128"):
        jacobian_of((z * z).abs(), z)


@pytest.mark.parametrize("make", [lambda x: (x * 2).long(), lambda x: x > 0,
                                  lambda x: (x.sin(), x.argmax())],
                         ids=["long", "comparison", "argmax-in-a-tuple"])
def test_jacobian_of_refuses_integer_and_boolean_outputs(make):
    # as torch_vjp.jacobian and torch.func.jacrev do; it returned zeros with a warning that
    # blamed .item(), .detach() or torch.no_grad()
    x = torch.randn(3, dtype=D, requires_grad=True)
    outputs = make(x)
    name = r"outputs\[1\]" if isinstance(outputs, tuple) else "outputs"
    with warnings.catch_warnings():
        warnings.simplefilter("error", tv.JacobianWarning)
        with pytest.raises(JacobianCallError, match=name + r" has dtype torch\.(int64|bool); "
                           r"only floating-point outputs have a Jacobian here .* Fix: leave it "
                           r"out of outputs"):
            jacobian_of(outputs, x)


# (dropout in training mode is computed by both, at its one draw: test_engine_randomness.py)
@pytest.mark.parametrize("case", ["batchnorm-train"])
@pytest.mark.parametrize("strategy", ["rev", "fwd"])
def test_vectorised_strategies_explain_what_torch_func_refuses(case, strategy):
    x = torch.randn(5, 3, dtype=D)
    module = torch.nn.BatchNorm1d(3).to(D).train()
    why = "changes a tensor it captured in place"
    with pytest.raises(tv.StrategyError, match=rf"(?s)torch_vjp.jacobian: the vectorised "
                                               rf"strategies compute with torch.func, which "
                                               rf"cannot run f \(.*\) in {strategy}-mode "
                                               rf"products: f {why}.*Fix: strategy='auto'"):
        jacobian(module, x, strategy=strategy)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tv.JacobianWarning)
        jacobian(module, x, strategy="auto")  # computes


def _calls_backward(x):
    w = torch.ones(3, dtype=D, requires_grad=True)
    (w * 2).sum().backward()  # (plain autograd of f's own, which torch.func refuses)
    return x.sin()


def _cube_sum_running_backward(x):
    w = x.detach().requires_grad_()
    (w * w).sum().backward()  # (plain autograd of f's own, which torch.func refuses)
    return (x ** 3).sum()


@pytest.mark.parametrize("strategy", ["rev", "fwd"])
@pytest.mark.parametrize("call", ["jacobian", "hessian"])
def test_vectorised_strategies_explain_plain_autograd_inside_f(call, strategy):
    # torch.func's raw "backward() called inside a functorch transform" passed through,
    # without the strategies that compute such an f; hessian(strategy="fwd") raised it
    # (requires_grad_() inside a transform) from the output-size probe
    x = torch.randn(3, dtype=D)
    fn, f = ((jacobian, _calls_backward) if call == "jacobian"
             else (hessian, _cube_sum_running_backward))
    with pytest.raises(tv.StrategyError, match=rf"(?s)^torch_vjp\.{call}: the vectorised "
                       rf"strategies compute with torch\.func, which cannot run f "
                       rf"\({f.__name__}\) in {strategy}-mode products: f runs plain "
                       rf"autograd itself \(\.backward\(\).*Fix: strategy='auto'"):
        fn(f, x, strategy=strategy)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tv.JacobianWarning)
        torch.testing.assert_close(fn(f, x), torch.diag(x.cos() if call == "jacobian"
                                                        else 6 * x))


@pytest.mark.parametrize("call", [
    lambda f, x: jacobian(f, x), lambda f, x: jacobian(f, x, strategy="rev"),
    lambda f, x: tv.batch_jacobian(f, x[None]), lambda f, x: tv.hessian(f, x),
    lambda f, x: tv.vjp(f, x), lambda f, x: tv.jvp(f, (x,), (x,)),
], ids=["jacobian", "jacobian-rev", "batch_jacobian", "hessian", "vjp", "jvp"])
def test_f_that_returns_none_is_told_about_its_return_statement(call):
    # the message said "the output of f is a NoneType", without the likely cause
    def f(x):
        x.sin()  # (no return)

    with pytest.raises(JacobianCallError, match=r"the output of f is None, but every output "
                       r"of f must be a Tensor.* f returned None: if it ends without a return "
                       r"statement \(or with a bare return\), return its result\."):
        call(f, torch.randn(3, dtype=D))


def test_auto_computes_an_f_that_takes_the_gradient_of_its_own_input():
    # NOTE [a probe f cannot answer]: a physics-informed f, torch.autograd.grad of its input,
    # answers only when differentiated; "auto" raised "element 0 of tensors does not require
    # grad" from its plain shape probe, where "rev" and torch.func.jacrev compute it
    W = torch.randn(3, 3, dtype=D)

    def u(x):
        return torch.tanh(x @ W).sum()

    def du(x):
        return torch.autograd.grad(u(x), x, create_graph=True)[0]

    x, xs = torch.randn(3, dtype=D), torch.randn(4, 3, dtype=D)
    before = x.clone()
    with warnings.catch_warnings():
        warnings.simplefilter("error", tv.JacobianWarning)
        torch.testing.assert_close(jacobian(du, x), torch.func.jacrev(torch.func.grad(u))(x))
        torch.testing.assert_close(tv.batch_jacobian(du, xs),
                                   torch.func.vmap(torch.func.jacrev(torch.func.grad(u)))(xs))
    assert torch.equal(x, before) and not x.requires_grad

    class Mine(Exception):
        pass

    def fails(x):
        raise Mine("f's own")

    with pytest.raises(Mine, match="^f's own$"):  # (from reverse mode, untouched)
        jacobian(fails, x)


def test_a_none_output_beside_aux_is_not_blamed_on_a_missing_return():
    # ef77185 named a missing return statement for every output that is None; an f with
    # has_aux=True that returns (None, aux) has its return statement
    x = torch.randn(3, dtype=D)
    with pytest.raises(JacobianCallError) as info:
        jacobian(lambda x: (None, x), x, has_aux=True)
    assert "return statement" not in str(info.value)
    assert ("f returned (None, aux): the output, the first of the (output, aux) pair that "
            "has_aux=True reads, is None.") in str(info.value)
    with pytest.raises(JacobianCallError, match="return statement"):
        jacobian(lambda x: None, x)
    with pytest.raises(JacobianCallError, match="returned None. .*return statement"):
        jacobian(lambda x: None, x, has_aux=True)  # (it said "returned a NoneType")


class _Mine(Exception):
    """An error of f's own (NOTE [a probe f cannot answer])."""


def _failing_with_its_own_error(calls):
    def fails(x):
        calls.append(1)
        raise _Mine("f's own")

    return fails


@pytest.mark.parametrize("call", ["jacobian", "batch_jacobian"])
def test_auto_calls_f_twice_for_an_error_of_its_own(call):
    # NOTE [a probe f cannot answer]: an error of f's own comes from reverse mode again, one
    # more call of f; the retry fell back to the functorch loop and the plain loop as if the
    # error were vmap's, and called f four times (a costly f, or one that counts or logs)
    calls = []
    fails = _failing_with_its_own_error(calls)
    x = torch.randn(4, 3, dtype=D)
    with warnings.catch_warnings():
        warnings.simplefilter("error", tv.JacobianWarning)
        with pytest.raises(_Mine, match="^f's own$"):
            getattr(tv, call)(fails, x)
    assert len(calls) == 2


@pytest.mark.parametrize("strategy", ["auto", "fwd", "fwd-loop"])
def test_hessian_calls_f_twice_for_an_error_of_its_own(strategy):
    # NOTE [a probe f cannot answer]: the shape probe's retry in the gradient's reverse mode
    # raises f's own error again; "auto" then tried plain autograd too, a third call of f
    calls = []
    fails = _failing_with_its_own_error(calls)
    with pytest.raises(_Mine, match="^f's own$"):
        hessian(fails, torch.randn(3, dtype=D), strategy=strategy)
    assert len(calls) <= 2


@pytest.mark.parametrize("strategy", ALL)
def test_hessian_of_an_f_that_takes_the_gradient_of_its_own_input(strategy):
    # "fwd" (forward over reverse, as torch.func.hessian) raised "element 0 of tensors does
    # not require grad" from its plain shape probe (NOTE [a probe f cannot answer])
    W = torch.randn(3, 3, dtype=D)

    def u(x):
        return torch.tanh(x @ W).sum()

    def f(x):
        return torch.autograd.grad(u(x), x, create_graph=True)[0].pow(2).sum()

    x = torch.randn(3, dtype=D)
    ref = torch.func.hessian(lambda x: torch.func.grad(u)(x).pow(2).sum())(x)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tv.JacobianWarning)
        torch.testing.assert_close(tv.hessian(f, x, strategy=strategy), ref)


@pytest.mark.parametrize("shape", [(2, 40), (40, 2)], ids=["wide-fwd", "tall-rev"])
def test_auto_differentiates_a_random_f_at_the_first_draw(shape):
    # NOTE [auto's extra calls draw what the products draw]: the first call of a signature
    # differentiated the second draw (the probe drew the first), warned "disagrees with a
    # reverse product ... no other route agrees" (its check drew a third), and left the
    # generator three calls on; later calls (probe and check remembered) did neither
    n_in, n_out = shape
    W = torch.randn(n_out, n_in, dtype=D)
    x = torch.randn(n_in, dtype=D)

    def f(x):
        return torch.nn.functional.dropout(W @ x, 0.5, training=True)

    for _ in range(2):  # the first call of the signature, then a remembered one
        torch.manual_seed(0)
        with warnings.catch_warnings():
            warnings.simplefilter("error", tv.JacobianWarning)
            J = jacobian(f, x)
        after = torch.rand(1)
        torch.manual_seed(0)
        torch.testing.assert_close(J, torch.func.jacrev(f)(x))  # one call: the first draw
        assert torch.equal(after, torch.rand(1))


@pytest.mark.parametrize("strategy", ["auto", "fwd-loop", "rev", "rev-loop"])
def test_hessian_of_a_random_f_at_the_first_draw(strategy):
    # forward over reverse probed f's output sizes with a call of f on every call: the
    # Hessian was of the second draw, and the generator ended two calls on
    W = torch.randn(5, 5, dtype=D)

    def f(x):
        return torch.nn.functional.dropout(torch.tanh(W @ x), 0.5).pow(2).sum()

    x = torch.randn(5, dtype=D)
    for _ in range(2):
        torch.manual_seed(0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", tv.JacobianWarning)  # (vmap's fallback)
            H = tv.hessian(f, x, strategy=strategy)
        after = torch.rand(1)
        torch.manual_seed(0)  # (reverse over reverse: one call of f)
        torch.testing.assert_close(H, torch.func.jacrev(torch.func.jacrev(f))(x))
        assert torch.equal(after, torch.rand(1))


@pytest.mark.parametrize("source", ["generator", "numpy", "random"])
@pytest.mark.parametrize("shape", [(2, 40), (40, 2)], ids=["wide-fwd", "tall-rev"])
def test_auto_differentiates_f_at_the_first_draw_of_its_own_generator(shape, source):
    # NOTE [auto's extra calls draw what the products draw]: an f drawing from a
    # torch.Generator of its own, or from NumPy's or Python's global generator, had the
    # first call of a signature differentiate the probe's next draw and warn that no route
    # agreed (the check drew a third), and moved the generator three calls on
    import random

    import numpy as np

    n_in, n_out = shape
    W = torch.randn(n_out, n_in, dtype=D)
    x = torch.randn(n_in, dtype=D)
    g = torch.Generator()

    def seed():
        g.manual_seed(0)
        np.random.seed(0)
        random.seed(0)

    def draw():
        if source == "generator":
            return torch.rand(n_out, generator=g, dtype=D)
        if source == "numpy":
            return torch.from_numpy(np.random.rand(n_out))
        return torch.tensor([random.random() for _ in range(n_out)], dtype=D)

    def f(x):
        return (W @ x) ** 2 * draw()

    for _ in range(2):  # the first call of the signature, then a remembered one
        seed()
        with warnings.catch_warnings():
            warnings.simplefilter("error", tv.JacobianWarning)
            J = jacobian(f, x)
        after = draw()
        seed()
        torch.testing.assert_close(J, torch.func.jacrev(f)(x))  # one call: the first draw
        torch.testing.assert_close(after, draw())


def test_auto_under_inference_mode_searches_no_generators_per_call(monkeypatch):
    # NOTE [auto's extra calls draw what the products draw]: under inference mode "auto"'s
    # check neither runs nor is remembered, so every call reaches it; the search of f's
    # objects for generators (~1 ms for a 20-layer model) ran on every call there
    import torch_vjp._engine.jacobian as engine

    searched = []
    monkeypatch.setattr(engine, "own_generators",
                        lambda prob: searched.append(1) or [], raising=False)
    lin = torch.nn.Linear(3, 2).to(D)
    x = torch.randn(3, dtype=D)
    with torch.inference_mode():
        for _ in range(3):
            J = jacobian(lin, x)
    torch.testing.assert_close(J, lin.weight)
    assert len(searched) == 0


@pytest.mark.parametrize("strategy", ["fwd-loop", "rev-loop"])
def test_a_loop_strategy_differentiates_a_random_f_at_the_first_draw(strategy):
    n_in, n_out = (3, 7) if strategy == "fwd-loop" else (4, 6)
    W = torch.randn(n_out, n_in, dtype=D)

    def f(x):
        return torch.nn.functional.dropout(W @ x, 0.5, training=True)

    x = torch.randn(n_in, dtype=D)
    torch.manual_seed(0)
    J = jacobian(f, x, strategy=strategy)
    torch.manual_seed(0)
    torch.testing.assert_close(J, torch.func.jacrev(f)(x))


def test_hessian_with_a_vectorised_strategy_explains_a_captured_update():
    bn = torch.nn.BatchNorm1d(3).to(D).train()
    x = torch.randn(5, 3, dtype=D)
    with pytest.raises(tv.StrategyError, match=r"(?s)torch_vjp.hessian: .* f changes a tensor it "
                                               r"captured in place"):
        tv.hessian(lambda x: bn(x).pow(2).sum(), x, strategy="fwd")


def test_batch_jacobian_of_rows_that_mix_gives_the_documented_sums():
    # Not a per-example Jacobian: reverse mode sums over the outputs, forward mode over the
    # inputs (the docstring says which), each against the full Jacobian.
    def f(x):
        return x + 2 * x[:1]

    x = torch.randn(4, 1, dtype=D)
    full = torch.func.jacrev(f)(x)[:, 0, :, 0]  # (b', b): d f[b'] / d x[b]
    by_rev = full.sum(0)  # sum over b'
    by_fwd = full.sum(1)  # sum over b'
    for strategy, want in (("rev", by_rev), ("rev-loop", by_rev), ("fwd", by_fwd),
                           ("fwd-loop", by_fwd)):
        got = batch_jacobian(f, x, strategy=strategy)[:, 0, 0]
        torch.testing.assert_close(got, want, msg=strategy)


@pytest.mark.parametrize("strategy", ["auto", "fwd-loop", "rev-loop"])
def test_a_function_that_changes_a_captured_tensor_is_warned_about(strategy, monkeypatch):
    from torch_vjp import _errors

    monkeypatch.setattr(_errors, "_WARNED", set())  # (once per function otherwise)
    # The Jacobian calls f more than once (a shape probe, the products): each call starts
    # from the state the caller holds (NOTE [every call from the caller's state]), so the
    # result is the one call's Jacobian; the side effect must not pass silently.
    g = torch.zeros(1, dtype=D)
    counted = []

    def f(x):
        g.add_(1.0)  # a step counter, a functional running statistic
        counted.append(1)  # (after: torch.func refuses the write, under rev-loop, say)
        return x * g

    x = torch.ones(3, dtype=D)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        J = jacobian(f, x, strategy=strategy)
    said = [str(w.message) for w in caught if issubclass(w.category, tv.JacobianWarning)
            and "changes a tensor it captures in place" in str(w.message)]
    calls = len(counted)
    assert (len(said) == 1) == (calls > 1), (strategy, calls, said)
    if said:
        assert "Fix: keep f free of side effects" in said[0]
        assert "every call starts from the tensor as the caller holds it" in said[0]
    # (every strategy: the Jacobian of the one call f makes from g = 0, that is x * 1)
    torch.testing.assert_close(J, torch.eye(3, dtype=D))
    # (NOTE [what a call puts back]: the counter is as it was before the call)
    assert g.item() == 0.0


class _OldStyleCube(torch.autograd.Function):
    """A custom Function without setup_context: torch.func cannot run it."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x ** 3

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return 3 * x ** 2 * grad


@pytest.mark.parametrize("strategy", ["auto", "rev-loop", "fwd-loop"])
def test_hessian_of_an_old_style_function_takes_plain_autograd(strategy):
    # torch.autograd.functional.hessian computes it; the hessian raised torch.func's
    # RuntimeError (must override the setup_context staticmethod)
    x = torch.randn(3, dtype=D)
    f = lambda x: _OldStyleCube.apply(x).sum()  # noqa: E731
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tv.JacobianWarning)
        H = hessian(f, x, strategy=strategy)
    torch.testing.assert_close(H, torch.diag(6 * x))
    torch.testing.assert_close(H, torch.autograd.functional.hessian(f, x))


def test_hessian_with_plain_autograd_says_why():
    f = lambda x: _OldStyleCube.apply(x).sum() * 2  # noqa: E731
    with pytest.warns(tv.JacobianWarning, match=r"^torch_vjp\.hessian: torch\.func cannot run f "
                      r"\(.*setup_context.*\), so the Hessian was computed with plain autograd, "
                      r"one backward pass per row: usually many times slower .* A custom "
                      r"autograd\.Function with setup_context \(and vmap support\)"):
        hessian(f, torch.randn(3, dtype=D), strategy="rev-loop")


@pytest.mark.parametrize("strategy", ["auto", "rev", "rev-loop", "fwd-loop"])
def test_hessian_of_f_drawing_from_its_own_generator_is_of_one_draw(strategy):
    # the output-size probe drew from f's generator first, so forward over reverse
    # differentiated the next draw (4.7 off, with "auto" too), and the generator ended one
    # draw further than one call of f leaves it
    gen = torch.Generator()

    def f(x):
        return (torch.rand(x.shape, generator=gen, dtype=D) * x ** 3).sum()

    x = torch.randn(4, dtype=D)
    gen.manual_seed(3)
    mask = torch.rand(x.shape, generator=gen, dtype=D)
    after_one_call = gen.get_state()
    gen.manual_seed(3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tv.JacobianWarning)  # ("auto": vmap refuses rand)
        H = hessian(f, x, strategy=strategy)
    torch.testing.assert_close(H, torch.diag(6 * mask * x))
    assert torch.equal(gen.get_state(), after_one_call)


def test_hessian_passes_fs_own_error_through_after_the_fallback():
    def f(x):
        raise ValueError("f's own")

    with pytest.raises(ValueError, match="^f's own$"):
        hessian(f, torch.randn(3, dtype=D))


def _writes_into_input(x):
    x[0] = x[1]
    x.mul_(2)
    return x.sin()


@pytest.mark.parametrize("strategy", ALL)
def test_f_that_writes_into_its_differentiated_input(strategy):
    # NOTE [f writes into its input]: reverse mode raised autograd's "a view of a leaf
    # Variable that requires grad is being used in an in-place operation" (torch.func.jacrev
    # does too); jacfwd computes it
    x = torch.randn(4, 3, dtype=D)
    x0 = x.clone()
    ref = torch.autograd.functional.jacobian(lambda u: _writes_into_input(u.clone()), x)
    torch.testing.assert_close(torch.func.jacfwd(_writes_into_input)(x.clone()), ref)
    torch.testing.assert_close(jacobian(_writes_into_input, x, strategy=strategy), ref)
    assert torch.equal(x, x0)


def test_hessian_batch_and_sparse_jacobians_of_f_that_writes_into_its_input():
    x = torch.randn(4, 3, dtype=D)
    x0 = x.clone()
    h = lambda u: _writes_into_input(u).pow(2).sum()  # noqa: E731
    for strategy in ("auto", "rev", "fwd"):
        torch.testing.assert_close(
            hessian(h, x, strategy=strategy),
            torch.autograd.functional.hessian(lambda u: h(u.clone()), x))
    ref = torch.autograd.functional.jacobian(lambda u: _writes_into_input(u.clone()), x)
    for mode in ("auto", "rev", "fwd"):
        S = tv.sparse_jacobian(_writes_into_input, x, mode=mode, layout=torch.strided)
        torch.testing.assert_close(S, ref.reshape(12, 12))
    rows = lambda u: _writes_into_input(u.T).T  # noqa: E731 - (B, 4) -> (B, 4), row-wise
    torch.testing.assert_close(
        batch_jacobian(rows, x.T.contiguous(), strategy="rev"),
        torch.stack([torch.autograd.functional.jacobian(
            lambda r: rows(r.unsqueeze(0).clone()).squeeze(0), row) for row in x.T]))
    assert torch.equal(x, x0)


@pytest.mark.parametrize("case", ["tuple_out", "dict_primal", "tuple_argnums_dict_out",
                                  "list_primal"])
@pytest.mark.parametrize("strategy", ["auto", "rev-loop", "fwd-loop"])
def test_hessian_plain_autograd_fallback_takes_pytrees(case, strategy):
    # where torch.func cannot run f and plain autograd takes over, the fallback refused
    # (JacobianCallError) an f returning a tuple or dict and primals that are dicts or lists,
    # which the vectorised path and torch.func.hessian take
    x, y = torch.randn(4, dtype=D), torch.randn(3, dtype=D)

    def make(cube):
        return {
            "tuple_out": (lambda a: (cube(a).sum(), (a**2).sum() * a[0]), (x,), 0),
            "dict_primal": (lambda d: cube(d["a"]).sum() * d["b"].sum(),
                            ({"a": x, "b": y},), 0),
            "tuple_argnums_dict_out": (lambda a, b: {"p": cube(a[:3]) * b,
                                                     "q": cube(b).sum()}, (x, y), (0, 1)),
            "list_primal": (lambda l, b: cube(l[0]).sum() * l[1].sum() * b.sum(),
                            ([x, y], y), (1, 0)),
        }[case]

    f, primals, argnums = make(_OldStyleCube.apply)
    ref = torch.func.hessian(make(lambda a: a**3)[0], argnums=argnums)(*primals)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tv.JacobianWarning)
        H = hessian(f, *primals, argnums=argnums, strategy=strategy)
    assert tree_structure(H) == tree_structure(ref)
    for got, want in zip(tree_leaves(H), tree_leaves(ref)):
        torch.testing.assert_close(got, want)


def test_hessian_plain_autograd_fallback_says_what_it_cannot_take():
    # the fallback needs an f of floating-point tensors: the message says which refusal led
    # there
    x = torch.randn(3, dtype=D)
    for out, got in ((lambda u: (u, 3)), "a value of type int"), ((lambda u: []), "no tensor"):
        with pytest.raises(JacobianCallError, match=(
                r"^torch_vjp\.hessian: torch\.func cannot run f \(.*setup_context.*\), and "
                r"the plain autograd fallback takes an f that returns floating-point tensors "
                r"\(one, or a tuple, list or dict of them\), but f returned " + got + r"\. "
                r"Fix: return only the differentiable results, as floating-point tensors\. A "
                r"custom autograd\.Function with setup_context")):
            hessian(lambda x: out(_OldStyleCube.apply(x).sum()), x, strategy="rev-loop")


def test_messages_name_only_the_options_the_function_has():
    # batch_jacobian, hessian and sparse_jacobian have no has_aux (and the first and last no
    # argnums): their messages told the user to pass has_aux=True or to leave a position out
    # of argnums, and named x "primals[0]"
    x = torch.randn(3, 2, dtype=D)
    cases = [
        (lambda: tv.batch_jacobian(lambda r: r.long(), x), "torch_vjp.batch_jacobian"),
        (lambda: tv.hessian(lambda r: (r.sum().long(), r), x[0]), "torch_vjp.hessian"),
        (lambda: tv.sparse_jacobian(lambda r: (r, None), x[0]), "torch_vjp.sparse_jacobian"),
        (lambda: tv.sparse_jacobian(torch.sin, torch.ones(3, dtype=torch.int64)),
         "torch_vjp.sparse_jacobian: x has dtype torch.int64"),
        (lambda: tv.sparse_jacobian(lambda d: d["a"] * 2, {"a": x[0], "b": 1.0}),
         "torch_vjp.sparse_jacobian: x['b'] is a float, but all of x is differentiated"),
    ]
    for run, start in cases:
        with pytest.raises(JacobianCallError) as info:
            run()
        msg = str(info.value)
        assert msg.startswith(start), msg
        assert "has_aux" not in msg and "argnums" not in msg and "primals[" not in msg, msg
    with pytest.raises(JacobianCallError, match=r"if it is differentiable, or leave it out "
                       r"of f's output\.$"):
        tv.batch_jacobian(lambda r: r.long(), x)


def test_a_module_passed_as_a_primal_keeps_its_buffers():
    # modules were searched for in f only: a BatchNorm passed as a non-differentiated primal
    # had its running statistics moved by the probe and the products
    def apply(x, m):
        return m(x)

    x = torch.randn(4, 3, dtype=D)
    for strategy in ("rev-loop", "fwd-loop"):
        bn = torch.nn.BatchNorm1d(3).to(D)
        J = tv.jacobian(apply, x, bn, strategy=strategy)
        assert int(bn.num_batches_tracked) == 0 and torch.equal(bn.running_mean,
                                                                 torch.zeros(3, dtype=D))
        torch.testing.assert_close(J, torch.autograd.functional.jacobian(
            lambda t: torch.nn.BatchNorm1d(3).to(D)(t), x))
    bn = torch.nn.BatchNorm1d(3).to(D)
    tv.compare_strategies(apply, x, bn, strategies=("rev-loop",), min_run_time=0.01,
                          memory=False)
    assert int(bn.num_batches_tracked) == 0


def test_explicit_reverse_mode_explains_checkpointing():
    # torch.func's reverse mode refuses saved tensor hooks: strategy='rev' let torch's raw
    # RuntimeError through (sparse_jacobian explained it; the refusal is now known to both)
    def f(x):
        return torch.utils.checkpoint.checkpoint(lambda v: v.sin() * v.roll(1), x,
                                                 use_reentrant=False)

    x = torch.randn(4, dtype=D)
    with pytest.raises(tv.StrategyError, match=(
            r"(?s)^torch_vjp\.jacobian: the vectorised strategies compute with torch\.func, "
            r"which cannot run f \(.*\) in rev-mode products: f uses saved tensor hooks "
            r"\(torch\.utils\.checkpoint, .*\n  Fix: strategy='auto', 'rev-loop' or 'fwd-loop'")):
        jacobian(f, x, strategy="rev")
    torch.testing.assert_close(jacobian(f, x), torch.autograd.functional.jacobian(f, x))


def test_loops_draw_from_fs_own_generator_what_one_call_draws():
    # a loop calls f once per column: f's own torch.Generator drew anew for each, so the
    # columns came from different functions (fwd-loop Jacobian, hessian's forward over
    # reverse, batched jvp one direction at a time), silently; each now replays one draw
    g = torch.Generator()
    x = torch.randn(4, dtype=D)

    def f(x):
        return x ** 2 * torch.rand(4, generator=g, dtype=D)

    def h(x):
        return (x ** 3 * torch.rand(4, generator=g, dtype=D)).sum()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tv.JacobianWarning)
        g.manual_seed(0)
        J = tv.jacobian(f, x, strategy="fwd-loop")
        after = torch.rand(1, generator=g, dtype=D)
        g.manual_seed(0)
        torch.testing.assert_close(J, torch.func.jacrev(f)(x))
        assert torch.equal(after, torch.rand(1, generator=g, dtype=D))  # (one call on)
        g.manual_seed(0)
        _, T = tv.jvp(f, (x,), (torch.eye(4, dtype=D),), batched=True, chunk_size=1)
        g.manual_seed(0)
        torch.testing.assert_close(T, torch.func.jacrev(f)(x).T)
        for strategy in ("auto", "fwd-loop"):
            H = tv.hessian(h, x, strategy=strategy)
            # the Hessian of one draw r: diagonal 6 x r, r the same numbers in every column
            # (before, each column's came from another draw)
            r = H.diagonal() / (6 * x)
            g.manual_seed(0)
            draws = [torch.rand(4, generator=g, dtype=D) for _ in range(6)]
            assert any(torch.allclose(r, d) for d in draws), strategy
            assert torch.equal(H, torch.diag(H.diagonal()))
            g.manual_seed(0)


def _roll_times(x):
    return x.roll(1) * x


@pytest.mark.parametrize("call", ["jacobian", "sparse_jacobian"])
def test_auto_at_a_nan_input_is_not_read_as_a_wrong_formula(call):
    # a NaN in x gives NaN in the same entries of the vectorised products and of the check's
    # reverse product: the check read NaN - NaN as a disagreement, warned of a wrong batching
    # rule ("by up to nan"), and remembered the one-product-at-a-time route for this
    # function and input shapes, for every later call at finite points too
    from torch_vjp._engine import fwdcheck

    fwdcheck.CHECKED.clear()
    tv.sparse.clear_cache()
    x = torch.tensor([float("nan"), 1.0, 2.0], dtype=D)
    fn = jacobian if call == "jacobian" else (lambda f, x: tv.sparse_jacobian(f, x).to_dense())
    with warnings.catch_warnings():
        warnings.simplefilter("error", tv.JacobianWarning)
        got = fn(_roll_times, x)
        fn(_roll_times, torch.tensor([float("inf"), 1.0, 2.0], dtype=D))
        assert not fwdcheck.CHECKED  # (nothing compared, nothing remembered)
        fn(_roll_times, torch.tensor([0.5, 1.0, 2.0], dtype=D))
    assert "rev-loop" not in fwdcheck.CHECKED.values()
    if call == "jacobian":
        torch.testing.assert_close(got, torch.func.jacrev(_roll_times)(x), equal_nan=True)
    else:  # (rows 0 and 1 as reverse mode gives them, row 2 of f's other entries)
        assert got[0, 0] == 2.0 and got[1, 0] == 1.0 and got[2, 0] == 0.0


def test_the_check_counts_a_nan_on_one_side_only_as_a_disagreement():
    from torch_vjp._engine.fwdcheck import gap

    nan, inf = float("nan"), float("inf")
    assert gap(torch.tensor([1.0, nan, inf]), torch.tensor([1.0, nan, inf])) == (0.0, 1.0)
    d, _ = gap(torch.tensor([1.0, nan]), torch.tensor([1.0, 2.0]))
    assert d != d  # (NaN: a disagreement)
    assert gap(torch.tensor([1.0, inf]), torch.tensor([1.0, 5.0]))[0] == inf
    assert gap(torch.tensor([1.0, -inf]), torch.tensor([1.0, inf]))[0] == inf


def _cdist_rows(x):
    return torch.cdist(x.reshape(4, 3), x.reshape(4, 3)[:2]).reshape(-1)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_batch_jacobian_of_a_mixing_f_at_a_nan_point_still_raises(bad):
    # 'auto' compares no route at a NaN or infinite point, so the mixing test that a failed
    # comparison leads to never ran: x - x.mean(0) with one NaN in x returned all-zero blocks
    # (the sums of its cross-example blocks; the true ones are 0.75 I), without a word
    from torch_vjp._engine import fwdcheck

    fwdcheck.CHECKED.clear()
    x = torch.randn(4, 3, dtype=D, generator=torch.Generator().manual_seed(0))
    x[0, 0] = bad
    with pytest.raises(tv.JacobianCallError, match=r"(?s)f \(\S*<lambda>\) mixes examples of "
                       r"the batch.*\(no route was compared: a NaN or an infinity is in the "
                       r"products here\)"):
        batch_jacobian(lambda x: x - x.mean(0), x)
    # a row-wise f at the same point: no error, its blocks
    got = batch_jacobian(lambda x: x.sin() * x, x)
    want = torch.func.vmap(torch.func.jacrev(lambda r: r.sin() * r))(x)
    torch.testing.assert_close(got[1:], want[1:])


def test_auto_with_an_infinity_in_a_tensor_not_differentiated_warns_and_remembers_nothing():
    # 6d660f0 skipped the check where x is not finite, but an infinity in an argument not
    # differentiated (argnums=0) or in a captured tensor reaches the products too: 'auto'
    # warned 'reverse mode under torch.vmap disagrees ... (by up to nan, at a scale of 0)'
    # and remembered the one-product-at-a-time loop for the function and shapes
    from torch_vjp._engine import fwdcheck

    fwdcheck.CHECKED.clear()
    x = torch.randn(3, dtype=D, generator=torch.Generator().manual_seed(0))
    y = torch.tensor([1.0, float("inf"), -2.0, 0.5], dtype=D)
    w = y.clone()
    with warnings.catch_warnings():
        warnings.simplefilter("error", tv.JacobianWarning)
        jacobian(lambda x, y: torch.outer(x, y) * x.sum(), x, y, argnums=0)
        jacobian(lambda x: torch.outer(x, w) * x.sum(), x)
    assert not fwdcheck.CHECKED


def test_auto_checks_at_the_first_finite_point_after_a_nan_one():
    # a route taken unchecked at a NaN point is not remembered: the wrong batching rule of
    # cdist's backward is still caught at the next, finite, point
    from torch_vjp._engine import fwdcheck

    fwdcheck.CHECKED.clear()
    x = torch.randn(12, dtype=D, generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tv.JacobianWarning)
        jacobian(_cdist_rows, torch.where(torch.arange(12) == 0, float("nan"), x))
    with pytest.warns(tv.JacobianWarning, match=r"reverse mode under torch\.vmap disagrees"):
        got = jacobian(_cdist_rows, x)
    torch.testing.assert_close(got, torch.autograd.functional.jacobian(_cdist_rows, x))


def test_auto_check_allows_a_float32_step_inside_a_float64_function(float32_step):
    # An RMSNorm-like step in float32 (as Llama's and T5's norms cast) rounds every route
    # at float32's: vectorised and single reverse products differ by ~1e-7 relative there,
    # which is rounding, not a wrong formula or a random f; "auto" warned that no route
    # agreed (by 1.53e-06 at a scale of 17.4).
    f, x = float32_step
    with no_jacobian_warnings():
        got = jacobian(f, x)
    torch.testing.assert_close(got, torch.func.jacrev(f)(x), rtol=0, atol=1e-12)


def test_hessian_auto_allows_a_float32_step_inside_a_float64_function(float32_step):
    # forward-over-reverse and reverse-over-reverse both round at float32's there: "auto"
    # warned of "a wrong forward-mode derivative" (asymmetry 4.33e-07 at a scale of 5.58)
    # and returned reverse-over-reverse.
    step, x = float32_step

    def f(x):
        return step(x).tanh().sum()

    with no_jacobian_warnings():
        got = hessian(f, x)
    torch.testing.assert_close(got, torch.func.hessian(f)(x), rtol=0, atol=1e-12)


def test_auto_after_the_vmap_fallback_names_the_loop():
    # a vmap that could not run f (NumPy) left 'auto' with the Jacobian of its loop, but the
    # result went on as "rev": the check's warning blamed "reverse mode under torch.vmap"
    # and a wrong batching rule, though vmap never ran
    W = torch.randn(3, 5, dtype=D)
    vmapped, calls = [], []

    def f(x):
        try:
            x.detach().numpy()
        except RuntimeError:  # (a tensor under torch.vmap holds no storage)
            vmapped.append(1)
            raise
        calls.append(1)
        return torch.tanh(W @ x) * (1 + 0.1 * len(calls))  # computes otherwise each call

    x = torch.randn(5, dtype=D)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        jacobian(f, x)
    said = [str(w.message) for w in said if issubclass(w.category, tv.JacobianWarning)]
    check = [m for m in said if "disagrees with a reverse product" in m]
    assert len(check) == 1, said
    assert check[0].startswith("torch_vjp.jacobian: reverse mode one product at a time "
                               "(torch.vmap could not run f) disagrees"), check[0]
    assert "under torch.vmap" not in check[0] and "no other route" not in check[0]
    assert vmapped  # (torch.func did try f)
    with warnings.catch_warnings():
        warnings.simplefilter("error", tv.JacobianWarning)  # each warning was shown once
        J = jacobian(f, x)
    ref = torch.func.jacrev(lambda x: torch.tanh(W @ x) * (1 + 0.1 * len(calls)))(x)
    torch.testing.assert_close(J, ref)  # the Jacobian of the call that computed it


@pytest.mark.parametrize("earlier", ["backward", "autograd.grad"])
def test_jacobian_of_a_graph_an_earlier_backward_freed_says_so(earlier):
    # torch's "Trying to backward through the graph a second time ... Specify
    # retain_graph=True" came out bare, not saying which call freed it: the user's own
    # backward before jacobian_of. torch's class and sentence stay, with a note.
    W = torch.randn(4, 3, dtype=D)
    x = torch.randn(3, dtype=D, requires_grad=True)
    y = torch.tanh(W @ x)
    if earlier == "backward":
        y.sum().backward()
    else:
        torch.autograd.grad(y.sum(), x)
    with pytest.raises(RuntimeError, match="^Trying to backward through the graph a second "
                                           "time") as info:
        jacobian_of(y, x)
    (note,) = info.value.__notes__
    assert note.startswith("torch_vjp.jacobian_of: the Jacobian is read from the graph that "
                           "computed outputs, and part of it was freed by an earlier "
                           "backward pass"), note
    assert "Fix: pass retain_graph=True to that earlier call, or call jacobian_of before " \
           "it, or compute outputs again." in note
    # the fix: retain_graph=True on the earlier call
    y = torch.tanh(W @ x)
    y.sum().backward(retain_graph=True)
    torch.testing.assert_close(jacobian_of(y, x),
                               torch.func.jacrev(lambda x: torch.tanh(W @ x))(x.detach()))

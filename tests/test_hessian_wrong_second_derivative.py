"""Hessians through a custom autograd.Function whose backward autograd cannot differentiate
right: "auto" neither returns reverse over reverse's zeros over a right forward-over-reverse
Hessian (NOTE [reverse over reverse, outvoted] in torch_vjp/_engine/symmetry.py), nor
returns an asymmetric Hessian without a word (NOTE [an asymmetric Hessian, said]).
Checked against torch.func.hessian of the same function written with plain operations."""

import warnings

import pytest
import torch

import torch_vjp as tv

D = torch.float64


class _Once(torch.autograd.Function):
    """``a * b**2`` with a right first derivative, marked once_differentiable."""

    generate_vmap_rule = True

    @staticmethod
    def forward(a, b):
        return a * b * b

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs)
        ctx.save_for_forward(*inputs)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        return g * b * b, g * 2 * a * b

    @staticmethod
    def jvp(ctx, ta, tb):
        a, b = ctx.saved_tensors
        return ta * b * b + tb * 2 * a * b


class _Detached(_Once):
    """The same, whose backward for ``a`` detaches ``b``: its Hessian lacks d2/da db there."""

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        return g * b.detach() * b.detach(), g * 2 * a * b


class _DetachedNoJvp(_Detached):
    @staticmethod
    def jvp(ctx, ta, tb):
        raise NotImplementedError("no forward-mode formula")


def _true(x):
    return (x[:2] * x[2:] ** 2).sum()


def _x():
    return torch.randn(4, dtype=D, generator=torch.Generator().manual_seed(3))


def test_auto_keeps_forward_over_reverse_where_reverse_over_reverse_gives_zeros():
    def f(x):
        return _Once.apply(x[:2], x[2:]).sum()

    x = _x()
    expected = torch.func.hessian(_true)(x)
    rev = tv.hessian(f, x, strategy="rev")
    assert rev.abs().max() == 0  # (torch: once_differentiable's second derivative)
    with pytest.warns(tv.JacobianWarning, match=(
            r"^torch_vjp\.hessian: forward-over-reverse \(strategy='auto'\) and "
            r"reverse-over-reverse give different Hessians of \S*\.f \(by up to .*\), and a "
            r"difference quotient of f's gradient agrees with forward over reverse: "
            r"autograd cannot differentiate f's backward a second time in reverse mode, "
            r"(?s:.*)once_differentiable(?s:.*)returned the forward-over-reverse Hessian."
            r"\n  Pass strategy='fwd'")):
        H = tv.hessian(f, x)
    torch.testing.assert_close(H, expected)
    torch.testing.assert_close(tv.hessian(f, x, strategy="fwd"), expected)


def test_the_quotient_still_lets_reverse_over_reverse_win_where_forward_mode_is_wrong():
    # torch.scatter_reduce(..., reduce='prod')'s forward-mode formula is wrong (torch 2.13)
    idx = torch.tensor([0, 0, 1, 1, 1])

    def f(x):
        y = torch.zeros(2, dtype=x.dtype).scatter_reduce(0, idx, x, "prod",
                                                          include_self=False)
        return (y * y).sum()

    x = torch.rand(5, dtype=D, generator=torch.Generator().manual_seed(0)) + 0.5
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tv.JacobianWarning)
        H = tv.hessian(f, x)
    torch.testing.assert_close(H, tv.hessian(f, x, strategy="rev"))


def test_an_asymmetric_hessian_of_both_routes_is_said():
    def g(x):
        return _Detached.apply(x[:2], x[2:]).sum()

    x = _x()
    with pytest.warns(tv.JacobianWarning, match=(
            r"^torch_vjp\.hessian: the Hessian of \S*\.g is not symmetric \(entries that must be "
            r"equal differ by up to .*, at a scale of .*\), computed by forward over "
            r"reverse and reverse over reverse alike: either f is not twice differentiable "
            r"at this point, or autograd differentiates f's gradient wrongly(?s:.*)"
            r"returned the Hessian as computed.\n  Fix: (?s:.*)not detached "
            r"\(torch\.autograd\.gradgradcheck checks it\)")):
        H = tv.hessian(g, x)
    torch.testing.assert_close(H, tv.hessian(g, x, strategy="rev"))


def test_an_asymmetric_hessian_of_reverse_over_reverse_alone_is_said():
    def h(x):
        return _DetachedNoJvp.apply(x[:2], x[2:]).sum()

    x = _x()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tv.hessian(h, x)
    said = [str(w.message) for w in caught if issubclass(w.category, tv.JacobianWarning)]
    assert any(m.startswith("torch_vjp.hessian: the Hessian of ") and ".h is not symmetric" in m
               and "computed by reverse over reverse (forward mode could not run f)" in m
               for m in said), said


def test_a_symmetric_hessian_through_a_right_function_says_nothing():
    def k(x):
        return (x[:2] * x[2:] ** 2).sum() + x.relu().sum()

    x = _x()
    with warnings.catch_warnings():
        warnings.simplefilter("error", tv.JacobianWarning)
        H = tv.hessian(k, x)
    torch.testing.assert_close(H, torch.func.hessian(k)(x))


def test_a_vectorised_hessian_wrong_alike_by_both_routes_is_replaced_by_the_loop(
        monkeypatch, fresh_route_checks):
    # NOTE [vectorised, outvoted]: a batching rule wrong in GPT-2's second derivatives gave
    # both vectorised routes (and torch.func.hessian) the same asymmetric, wrong cross block
    # (layer_norm's backward with a weight: NOTE [a single product batched wrongly] in
    # torch_vjp/_engine/hessian.py, which computes it right without the fallback; the
    # fallback is checked here with that reading turned off)
    transformers = pytest.importorskip("transformers")
    from torch.func import functional_call

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=8, vocab_size=11,
                                  n_positions=8, resid_pdrop=0.0, embd_pdrop=0.0,
                                  attn_pdrop=0.0, attn_implementation="eager")
    model = transformers.GPT2LMHeadModel(cfg).double().eval()
    ids = torch.randint(0, 11, (2, 5))
    names = ["transformer.h.0.attn.c_attn.bias", "transformer.h.1.ln_1.weight"]
    params = {k: v.detach().clone() for k, v in model.named_parameters() if k in names}

    def gpt2_loss(p):
        return functional_call(model, p, (ids,), {"labels": ids}).loss

    sizes = [params[k].numel() for k in names]

    def flat_loss(flat):
        parts = flat.split(sizes)
        return gpt2_loss({k: t.view_as(params[k]) for k, t in zip(names, parts)})

    flat = torch.cat([params[k].reshape(-1) for k in names])
    expected = torch.autograd.functional.hessian(flat_loss, flat)  # (plain autograd rows)

    def flat_hessian(H):
        return torch.cat([torch.cat([H[a][b].reshape(params[a].numel(), params[b].numel())
                                     for b in names], 1) for a in names])

    with warnings.catch_warnings():
        warnings.simplefilter("error", tv.JacobianWarning)
        torch.testing.assert_close(flat_hessian(tv.hessian(gpt2_loss, params)), expected)
        torch.testing.assert_close(
            flat_hessian(tv.hessian(gpt2_loss, params, strategy="fwd")), expected)
    monkeypatch.setattr("torch_vjp._engine.hessian._SINGLE_BATCHED_WRONGLY", {})
    with pytest.warns(tv.JacobianWarning, match=(
            r"^torch_vjp\.hessian: the vectorised Hessian of \S*gpt2_loss \(strategy='auto'\)"
            r" is not symmetric (?s:.*)the Hessian computed in a Python loop, without "
            r"torch\.vmap, is symmetric: an operator in f has a wrong batching rule in its "
            r"derivatives\. strategy='auto' returned the loop's Hessian\.\n  Pass "
            r"strategy='rev-loop'")):
        H = tv.hessian(gpt2_loss, params)
    torch.testing.assert_close(flat_hessian(H), expected)


def test_layer_norm_with_a_weight_takes_the_loop_under_auto(monkeypatch, fresh_route_checks):
    # the smallest case found of NOTE [vectorised, outvoted]: torch.func.hessian of it is
    # off by 10.3 at a scale of 26.7 (torch 2.13), and asymmetric; computed right without
    # the fallback (NOTE [a single product batched wrongly]), which is checked here with
    # that reading turned off
    x = torch.randn(3, 4, dtype=D, generator=torch.Generator().manual_seed(0))

    def normed(p):
        return (torch.nn.functional.layer_norm(x * p[:4], (4,), p[4:]) ** 3).sum()

    p = torch.randn(8, dtype=D, generator=torch.Generator().manual_seed(1))
    expected = torch.autograd.functional.hessian(normed, p)  # (plain autograd rows)
    with warnings.catch_warnings():
        warnings.simplefilter("error", tv.JacobianWarning)
        torch.testing.assert_close(tv.hessian(normed, p), expected)
    monkeypatch.setattr("torch_vjp._engine.hessian._SINGLE_BATCHED_WRONGLY", {})
    with pytest.warns(tv.JacobianWarning, match=r"returned the loop's Hessian"):
        H = tv.hessian(normed, p)
    torch.testing.assert_close(H, expected)
    torch.testing.assert_close(tv.hessian(normed, p, strategy="rev-loop"), expected)

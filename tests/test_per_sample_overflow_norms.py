"""Per-sample norms whose squares leave the parameters' dtype (NOTE [norms past the square]):
an example whose gradient is finite, of a norm its dtype holds but whose square it does not
(float32 and bfloat16 above 1.8e19, float16 above 256), gets its norm, and its clipped
contribution has norm ``max_norm``, not 0 (it was dropped from the clipped sum without a
word). Every strategy, through each kind of factor (a Linear on vectors, on sequences by
the ghost identity and directly, a convolution both ways, an embedding, a bag, a
normalisation layer), against the per-example loop in float64. Also the norms themselves,
and what an inf or NaN gradient keeps."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.func import functional_call, grad

import torch_vjp as tv
from torch_vjp._per_sample.norms_wide import SMALL, clip_factors, row_norms, wide_sq_rows

STRATEGIES = ("auto", "hooks", "vmap", "loop")
BIG = 1e19


def _mse(out, t):
    return (out - t).pow(2).sum()


def _reference(model, loss_fn, xs, t):
    """Each example's gradient, alone, in float64: ``{name: (B, ...)}``."""
    model = model.double()
    params = {n: p.detach() for n, p in model.named_parameters()}

    def one(ps, xi, ti):
        out = functional_call(model, ps, tuple(x.unsqueeze(0) for x in xi))
        return loss_fn(out, ti.unsqueeze(0))

    xs64 = tuple(x.double() if x.is_floating_point() else x for x in xs)
    t = t.double() if t.is_floating_point() else t
    rows = [grad(one)(params, tuple(x[i] for x in xs64), t[i])
            for i in range(t.shape[0])]
    return {n: torch.stack([r[n] for r in rows]) for n in params}


def _norms(ref):
    return torch.stack([g.flatten(1).pow(2).sum(1) for g in ref.values()]).sum(0).sqrt()


class _Seq(nn.Module):
    """A Linear over a sequence of ``T`` positions (ghost norms for short sequences of wide
    layers, the per-sample gradients directly for long ones)."""

    def __init__(self, p, q):
        super().__init__()
        self.lin = nn.Linear(p, q)

    def forward(self, x):
        return self.lin(x).sum(1)


class _Bag(nn.Module):
    def __init__(self):
        super().__init__()
        self.bag = nn.EmbeddingBag(7, 3, mode="sum")

    def forward(self, idx):
        return self.bag(idx)


def _case(kind):
    """(model, inputs, output shape): example 1's target is about ``BIG``, its gradient's
    norm about 1e20."""
    torch.manual_seed(0)
    if kind == "linear":
        return nn.Linear(4, 3), (torch.randn(3, 4),), (3,)
    if kind == "ghost":  # T (p + q) = 4 * 32 <= p q = 256
        return _Seq(16, 16), (torch.randn(3, 4, 16),), (16,)
    if kind == "direct":  # T (p + q) = 40 * 8 > p q = 16
        return _Seq(4, 4), (torch.randn(3, 40, 4),), (4,)
    if kind == "conv_direct":
        return nn.Sequential(nn.Conv2d(2, 3, 3), nn.Flatten()), (torch.randn(3, 2, 5, 5),), (27,)
    if kind == "conv_ghost":  # few output positions, wide patches: the ghost identity
        return (nn.Sequential(nn.Conv2d(16, 16, 3), nn.Flatten()),
                (torch.randn(3, 16, 4, 4),), (64,))
    if kind == "embedding":
        return (nn.Sequential(nn.Embedding(6, 3), nn.Flatten()),
                (torch.tensor([[0, 1, 1], [2, 5, 2], [4, 0, 3]]),), (9,))
    if kind == "bag":
        return _Bag(), (torch.tensor([[0, 1, 1], [2, 6, 2], [4, 0, 3]]),), (3,)
    if kind == "layernorm":
        return nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4)), (torch.randn(3, 4),), (4,)
    raise AssertionError(kind)


KINDS = ("linear", "ghost", "direct", "conv_direct", "conv_ghost", "embedding", "bag",
         "layernorm")


def _targets(shape, dtype, big=BIG):
    t = torch.randn(3, *shape)
    t[1] = big
    return t.to(dtype)


def _clipped(ref, norms, max_norm):
    c = (max_norm / norms).clamp(max=1.0)
    return {n: torch.einsum("b,b...->...", c, g) for n, g in ref.items()}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_float32_norms_and_clipped_sum_past_the_square(kind, strategy):
    model, xs, shape = _case(kind)
    t = _targets(shape, torch.float32)
    ref = _reference(_case(kind)[0], _mse, xs, t)
    want = _norms(ref)
    assert torch.isfinite(want).all() and want[1] > 1e19 and want[1] ** 2 > 3.5e38
    got = tv.per_sample_grad_norms(model, _mse, xs, t, strategy=strategy)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=0.0)
    clipped = tv.accumulate_clipped_grads(model, _mse, xs, t, max_norm=1.0, strategy=strategy)
    torch.testing.assert_close(clipped.double(), want, rtol=1e-4, atol=0.0)
    expected = _clipped(ref, want, 1.0)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad.double(), expected[n], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("loss", ("mse", "cross_entropy"))
def test_float32_input_scaled_by_1e10(strategy, loss):
    """The issue's case: a float32 Linear(4, 3), example 1's input times 1e10."""
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    x = torch.randn(3, 4)
    x[1] *= 1e10
    if loss == "mse":
        t, loss_fn = torch.randn(3, 3), _mse
    else:
        t = torch.tensor([0, 2, 1])

        def loss_fn(out, y):
            return nn.functional.cross_entropy(out, y, reduction="sum")
    ref = _reference(_copy(model), loss_fn, (x,), t)
    want = _norms(ref)
    got = tv.per_sample_grad_norms(model, loss_fn, x, t, strategy=strategy)
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=0.0)
    tv.accumulate_clipped_grads(model, loss_fn, x, t, max_norm=1.0, strategy=strategy)
    expected = _clipped(ref, want, 1.0)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad.double(), expected[n], rtol=1e-4, atol=1e-5)


def _copy(model):
    other = type(model)(model.in_features, model.out_features)
    other.load_state_dict(model.state_dict())
    return other


@pytest.mark.parametrize("dtype,big", ((torch.float16, 300.0), (torch.bfloat16, BIG)))
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_half_norms_past_the_square(strategy, dtype, big):
    """float16 squares leave its range at a norm of 256; bfloat16's at float32's."""
    torch.manual_seed(0)
    model = nn.Linear(4, 3).to(dtype)
    x = torch.randn(3, 4).to(dtype)
    t = _targets((3,), dtype, big)
    ref = _reference(_copy(model), _mse, (x,), t)
    want = _norms(ref)
    got = tv.per_sample_grad_norms(model, _mse, x, t, strategy=strategy)
    assert got.dtype == dtype
    tol = 1e-2 if dtype == torch.float16 else 2e-2
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=0.0)
    tv.accumulate_clipped_grads(model, _mse, x, t, max_norm=1.0, strategy=strategy)
    expected = _clipped(ref, want, 1.0)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad.double(), expected[n], rtol=tol, atol=tol)


@pytest.mark.parametrize("strategy", ("auto", "vmap", "loop"))
def test_inf_and_nan_gradients_keep_their_norms(strategy):
    """An example whose gradient is itself inf has norm inf and clip factor 0; one with a NaN
    has norm NaN: as the squared norms in the parameters' dtype gave. (strategy='hooks'
    refuses such a batch: its probe cannot tell the examples' rows apart.)"""
    torch.manual_seed(0)
    model = nn.Linear(4, 3, bias=False)
    x = torch.randn(4, 4).abs() + 0.5
    t = torch.randn(4, 3)
    t[1] = float("inf")
    t[2, 0] = float("nan")
    got = tv.per_sample_grad_norms(model, _mse, x, t, strategy=strategy)
    assert got[1].isinf() and got[2].isnan() and torch.isfinite(got[[0, 3]]).all()


@pytest.mark.parametrize("width", (300, SMALL // 4))
def test_row_norms_past_the_square(width):
    """Small float32 tensors: their norms in float64; larger ones: rows whose squares fit
    get the plain float32 norm bit for bit, the others that of the rows scaled."""
    torch.manual_seed(0)
    v = torch.randn(5, width)
    v[1] *= 1e20
    v[3] *= 1e36
    assert (v.numel() > SMALL) == (width > 300)
    want = v.double().norm(dim=1)
    got = row_norms(v)
    assert got.dtype == (torch.float32 if width > 300 else torch.float64)
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=0.0)
    if width > 300:
        plain = torch.linalg.vector_norm(v, dim=1)
        assert torch.equal(got[[0, 2, 4]], plain[[0, 2, 4]])
    sq = wide_sq_rows(v.view(5, 4, -1))
    assert sq.dtype == torch.float64
    torch.testing.assert_close(sq, want.square(), rtol=1e-6, atol=0.0)
    # complex rows: their real norms
    z = torch.complex(v, -v)
    torch.testing.assert_close(row_norms(z).double(), want * 2 ** 0.5, rtol=1e-5, atol=0.0)
    # a row with inf: inf; with NaN: NaN
    w = torch.ones(2, width)
    w[0, 1], w[1, 2] = float("inf"), float("nan")
    n = row_norms(w)
    assert n[0].isinf() and n[1].isnan()


def test_row_norms_of_half_tensors():
    # float16: norms past float16's range, in float32; bfloat16: past the square of float32's
    h = torch.full((2, 4), 60000.0, dtype=torch.float16)
    torch.testing.assert_close(row_norms(h), torch.full((2,), 120000.0), rtol=1e-3, atol=0)
    b = torch.full((2, 4), 1e30, dtype=torch.bfloat16)
    want = b.double().norm(dim=1)
    torch.testing.assert_close(row_norms(b).double(), want, rtol=1e-3, atol=0)


def test_clip_factors_in_float32_from_float64_squares():
    sq = torch.tensor([4.0, 3.2e40, 0.0, float("inf")], dtype=torch.float64)
    c = clip_factors(sq, 1.0, torch.float32)
    assert c.dtype == torch.float32
    torch.testing.assert_close(c, torch.tensor([0.5, 1 / 1.788854e20, 1.0, 0.0]), rtol=1e-6,
                               atol=0.0)
    assert clip_factors(sq, 1.0, torch.float64).dtype == torch.float64

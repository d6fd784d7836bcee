"""Results follow the device of the inputs: every public entry point, on the CPU and (where
one is present) on a CUDA GPU, against float64 references computed on the CPU.

The CUDA cases carry the ``cuda`` marker and are skipped where no GPU is present; the CPU
cases check the same assertions everywhere, so that the GPU run tests what CI tests.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import torch_vjp as tv

D = torch.float64
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
# compile=True is tested on the CPU in test_compiled.py and test_per_sample_compiled.py
GPU = [pytest.param("cuda", marks=pytest.mark.cuda)]
PER_SAMPLE = ("auto", "hooks", "vmap", "loop")


def _close(actual, expected, **kw):
    """``actual`` on the device under test, ``expected`` a CPU reference."""
    torch.testing.assert_close(actual.cpu(), expected, **kw)


def _mlp(x, W1, W2):
    return W2 @ torch.tanh(W1 @ x)


def _weights():
    torch.manual_seed(0)
    return torch.randn(6, 4, dtype=D), torch.randn(3, 6, dtype=D)


# ---- Jacobians ------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("strategy", ["auto", "rev", "fwd", "rev-loop", "fwd-loop"])
def test_jacobian_family_on_device(device, strategy):
    W1, W2 = _weights()
    x = torch.randn(4, dtype=D)
    ref = torch.func.jacrev(lambda x: _mlp(x, W1, W2))(x)
    W1d, W2d, xd = W1.to(device), W2.to(device), x.to(device)

    J = tv.jacobian(lambda x: _mlp(x, W1d, W2d), xd, strategy=strategy)
    assert J.device.type == device
    _close(J, ref)

    xb = torch.randn(5, 4, dtype=D)
    Jb = tv.batch_jacobian(lambda b: torch.tanh(b @ W1d.T), xb.to(device), strategy=strategy)
    assert Jb.device.type == device
    _close(Jb, torch.func.vmap(torch.func.jacrev(lambda r: torch.tanh(W1 @ r)))(xb))

    H = tv.hessian(lambda x: _mlp(x, W1d, W2d).pow(2).sum(), xd, strategy=strategy)
    assert H.device.type == device
    _close(H, torch.func.hessian(lambda x: _mlp(x, W1, W2).pow(2).sum())(x))


@pytest.mark.parametrize("device", DEVICES)
def test_jacobian_of_and_transforms_on_device(device):
    W1, W2 = _weights()
    x = torch.randn(4, dtype=D)
    ref = torch.func.jacrev(lambda x: _mlp(x, W1, W2))(x)
    W1d, W2d = W1.to(device), W2.to(device)

    xd = x.to(device).requires_grad_()
    J = tv.jacobian_of(_mlp(xd, W1d, W2d), xd)
    assert J.device.type == device
    _close(J, ref)

    out, vjp_fn = tv.vjp(lambda x: _mlp(x, W1d, W2d), x.to(device))
    _close(out, _mlp(x, W1, W2))
    (g,) = vjp_fn(torch.eye(3, dtype=D, device=device), batched=True)
    assert g.device.type == device
    _close(g, ref)

    _, t = tv.jvp(lambda x: _mlp(x, W1d, W2d), (x.to(device),),
                  (torch.eye(4, dtype=D, device=device),), batched=True)
    assert t.device.type == device
    _close(t, ref.T)


@pytest.mark.parametrize("device", GPU)
def test_compiled_jacobian_on_device(device):
    W1, W2 = _weights()
    x = torch.randn(4, dtype=D)
    W1d, W2d = W1.to(device), W2.to(device)

    def f(x):
        return _mlp(x, W1d, W2d)

    ref = torch.func.jacrev(lambda x: _mlp(x, W1, W2))(x)
    for _ in range(2):  # the first call runs eagerly and compiles, the second is compiled
        J = tv.jacobian(f, x.to(device), compile=True)
        assert J.device.type == device
        _close(J, ref)


@pytest.mark.parametrize("device", DEVICES)
def test_sparse_jacobian_on_device(device):
    x = torch.randn(12, dtype=D)

    def f(x):
        return x.sin() * x.roll(1)

    S = tv.sparse_jacobian(f, x.to(device))
    assert S.device.type == device
    _close(S.to_dense(), torch.func.jacrev(f)(x))


# ---- grad_outputs checks --------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_checked_grad_on_device(device):
    x = torch.randn(3, 4, dtype=D, device=device, requires_grad=True)
    v = torch.randn(3, 4, dtype=D, device=device)
    (g,) = tv.grad(x.sin(), x, v)
    _close(g, (x.detach().cos() * v).cpu())
    with pytest.raises(tv.GradOutputsError, match=r"grad_outputs\[0\] has shape \(4, 3\)"):
        tv.grad(x.sin(), x, v.T.contiguous())


# ---- per-sample gradients ---------------------------------------------------------------


class _CNN(nn.Module):
    # vmap has no batching rule for the stock recurrent layers: the LSTM is left out there
    def __init__(self, recurrent=True):
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, padding=1)
        self.norm = nn.GroupNorm(2, 4)
        self.emb = nn.Embedding(7, 4)
        self.ln = nn.LayerNorm(4)
        self.lstm = nn.LSTM(4, 5, batch_first=True) if recurrent else None
        self.proj = None if recurrent else nn.Linear(4, 5)
        self.fc = nn.Linear(4 * 5 * 5 + 5, 3)

    def forward(self, x, tokens):
        h = F.relu(self.norm(self.conv(x))).flatten(1)
        seq = self.ln(self.emb(tokens))
        last = self.lstm(seq)[0][:, -1] if self.lstm is not None else self.proj(seq[:, -1]).tanh()
        return self.fc(torch.cat([h, last], 1))


def _per_sample_case(device, recurrent=True):
    torch.manual_seed(0)
    model = _CNN(recurrent).to(D)
    x, tokens = torch.randn(6, 2, 5, 5, dtype=D), torch.randint(0, 7, (6, 3))
    targets = torch.randint(0, 3, (6,))
    names = [n for n, _ in model.named_parameters()]
    rows = {n: [] for n in names}
    for i in range(6):  # per-example gradients by definition, on the CPU
        loss = F.cross_entropy(model(x[i:i + 1], tokens[i:i + 1]), targets[i:i + 1])
        for n, g in zip(names, torch.autograd.grad(loss, list(model.parameters()))):
            rows[n].append(g)
    ref = {n: torch.stack(v) for n, v in rows.items()}
    moved = copy.deepcopy(model).to(device)
    return moved, (x.to(device), tokens.to(device)), targets.to(device), ref


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("strategy", PER_SAMPLE)
def test_per_sample_on_device(device, strategy):
    model, inputs, targets, ref = _per_sample_case(device, recurrent=strategy != "vmap")
    grads = tv.per_sample_grads(model, F.cross_entropy, inputs, targets, strategy=strategy)
    assert set(grads) == set(ref)
    for n, g in grads.items():
        assert g.device.type == device, n
        _close(g, ref[n], msg=n)

    ref_norms = torch.cat([g.flatten(1) for g in ref.values()], 1).norm(dim=1)
    norms = tv.per_sample_grad_norms(model, F.cross_entropy, inputs, targets,
                                     strategy=strategy)
    assert norms.device.type == device
    _close(norms, ref_norms)

    max_norm = float(ref_norms.median())
    scale = (max_norm / ref_norms).clamp(max=1.0)
    model.zero_grad(set_to_none=True)
    before = tv.accumulate_clipped_grads(model, F.cross_entropy, inputs, targets,
                                         max_norm=max_norm, strategy=strategy)
    _close(before, ref_norms)
    for n, p in model.named_parameters():
        assert p.grad.device.type == device, n
        expected = torch.einsum("b,b...->...", scale, ref[n])
        _close(p.grad, expected, msg=n)


@pytest.mark.parametrize("device", GPU)
def test_compiled_per_sample_on_device(device):
    model, inputs, targets, ref = _per_sample_case(device, recurrent=False)
    for _ in range(2):  # compiling call, then the compiled program
        grads = tv.per_sample_grads(model, F.cross_entropy, inputs, targets, compile=True)
        for n, g in grads.items():
            assert g.device.type == device, n
            _close(g, ref[n], msg=n)


def test_auto_jacobians_on_the_meta_device():
    # the check of "auto" (NOTE [auto, checked once]) compares numbers, which a tensor on
    # the meta device does not hold: it raised "Cannot copy out of meta tensor", where every
    # explicit strategy gives the Jacobian's shape
    W = torch.randn(5, 3, device="meta")
    x = torch.randn(3, device="meta")
    for f, shape in ((lambda v: torch.tanh(W @ v), (5, 3)),  # tall: forward mode
                     (lambda v: (torch.tanh(W @ v) ** 2).sum(0, keepdim=True), (1, 3))):
        J = tv.jacobian(f, x)
        assert J.device.type == "meta" and J.shape == shape
    J = tv.batch_jacobian(lambda v: torch.tanh(v @ W.T), torch.randn(4, 3, device="meta"))
    assert J.device.type == "meta" and J.shape == (4, 5, 3)
    xr = torch.randn(3, device="meta", requires_grad=True)
    J = tv.jacobian_of(torch.outer(xr, xr), xr)
    assert J.device.type == "meta" and J.shape == (3, 3, 3)
    H = tv.hessian(lambda v: (v ** 3).sum(), torch.randn(5, device="meta"))  # (its symmetry)
    assert H.device.type == "meta" and H.shape == (5, 5)

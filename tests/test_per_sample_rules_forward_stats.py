"""LayerNorm's rule reads the mean and reciprocal standard deviation its forward's kernel
saved (NOTE [the forward's statistics] in ``rules/norm.py``) where they are the recorded
input's, and normalises again otherwise: per-sample gradients, norms and clipped sums in
float64 against the per-example loop on both paths, and the count of normalisations."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import torch_vjp as tv


def _loop(model, loss_fn, x, y, bdim=0):
    out = {n: [] for n, _ in model.named_parameters()}
    for i in range(x.shape[bdim]):
        model.zero_grad()
        xi = x.narrow(bdim, i, 1)
        loss_fn(model(xi), y[i:i + 1]).backward()
        for n, p in model.named_parameters():
            out[n].append(p.grad.clone())
    model.zero_grad()
    return {n: torch.stack(v) for n, v in out.items()}


class Net(nn.Module):
    def __init__(self, norm=nn.LayerNorm, shape=(6,), seq_first=False):
        super().__init__()
        self.lin = nn.Linear(5, 6)
        self.norm = norm(shape)
        self.head = nn.Linear(6, 3)
        self.seq_first = seq_first

    def forward(self, x):  # (B, T, 5), or (T, B, 5) with seq_first, or (B, 5)
        h = self.lin(x)
        if self.seq_first:
            h = self.norm(h.transpose(0, 1)).transpose(0, 1)
        elif isinstance(self.norm.normalized_shape, tuple) and len(self.norm.normalized_shape) == 2:
            h = self.norm(h.unsqueeze(1).expand(-1, 2, -1, -1)).sum(1)
        else:
            h = self.norm(h)
        h = torch.tanh(h)
        return self.head(h.mean(1) if h.dim() == 3 else h)


CASES = {
    "rows": dict(net=dict(), x=(7, 4, 5)),
    "vectors": dict(net=dict(), x=(7, 5)),
    "batch_second": dict(net=dict(seq_first=True), x=(7, 4, 5)),
    "two_dims": dict(net=dict(shape=(4, 6)), x=(7, 4, 5)),
}


def _data(case):
    torch.manual_seed(0)
    model = Net(**CASES[case]["net"]).double()
    for p in model.norm.parameters():  # (not the 1 and 0 they start at)
        p.data.normal_()
    x = torch.randn(*CASES[case]["x"], dtype=torch.float64)
    return model, nn.CrossEntropyLoss(), x, torch.randint(0, 3, (7,))


@pytest.mark.parametrize("case", list(CASES))
def test_layer_norm_per_sample_results_against_the_loop(case):
    model, loss_fn, x, y = _data(case)
    ref = _loop(model, loss_fn, x, y)
    names = [n for n, _ in model.named_parameters()]
    sq = sum(ref[n].flatten(1).pow(2).sum(1) for n in names)
    c = (0.3 / sq.sqrt()).clamp(max=1.0)
    for _ in range(3):  # (the first call plans and checks; the later ones use the plan)
        grads = tv.per_sample_grads(model, loss_fn, x, y, strategy="hooks")
        for n in names:
            torch.testing.assert_close(grads[n], ref[n], rtol=1e-10, atol=1e-12)
        norms = tv.per_sample_grad_norms(model, loss_fn, x, y, strategy="hooks")
        torch.testing.assert_close(norms, sq.sqrt(), rtol=1e-10, atol=1e-12)
        model.zero_grad(set_to_none=True)
        tv.accumulate_clipped_grads(model, loss_fn, x, y, max_norm=0.3, strategy="hooks")
        for n, p in model.named_parameters():
            torch.testing.assert_close(p.grad, torch.tensordot(c, ref[n], dims=1),
                                       rtol=1e-10, atol=1e-12)


def _normalisations(monkeypatch, case, autocast=False):
    model, loss_fn, x, y = _data(case)
    if autocast:
        model, x = model.float(), x.float()
    ctx = torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast)
    with ctx:
        tv.accumulate_clipped_grads(model, loss_fn, x, y, max_norm=0.3, strategy="hooks")
    count = [0]
    real = F.layer_norm

    def counted(*args, **kwargs):
        count[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(F, "layer_norm", counted)
    with ctx:
        tv.accumulate_clipped_grads(model, loss_fn, x, y, max_norm=0.3, strategy="hooks")
    return count[0]


def test_the_rule_reads_the_forwards_statistics_instead_of_normalising_again(monkeypatch):
    # one normalisation per call: the forward's (a second one was the rule's own)
    assert _normalisations(monkeypatch, "rows") == 1


def test_under_autocast_the_rule_normalises_again(monkeypatch):
    # autocast runs the kernel in float32 on a copy of the bfloat16 input: its statistics
    # are not the recorded tensor's, and the rule normalises that itself
    assert _normalisations(monkeypatch, "rows", autocast=True) == 2


def test_under_autocast_the_norms_agree_with_the_loop():
    model, loss_fn, x, y = _data("rows")
    model, x = model.float(), x.float()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = _loop(model, loss_fn, x, y)
        norms = tv.per_sample_grad_norms(model, loss_fn, x, y, strategy="hooks")
    sq = sum(g.flatten(1).float().pow(2).sum(1) for g in ref.values())
    torch.testing.assert_close(norms, sq.sqrt(), rtol=2e-2, atol=1e-4)


@pytest.mark.usefixtures("fresh_dynamo", "aot_eager_unless_inductor")  # conftest
def test_compiled_layer_norm_results_against_the_loop():
    model, loss_fn, x, y = _data("rows")
    ref = _loop(model, loss_fn, x, y)
    sq = sum(g.flatten(1).pow(2).sum(1) for g in ref.values())
    for _ in range(2):
        grads = tv.per_sample_grads(model, loss_fn, x, y, compile=True)
        for n, g in ref.items():
            torch.testing.assert_close(grads[n], g, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(tv.per_sample_grad_norms(model, loss_fn, x, y, compile=True),
                                   sq.sqrt(), rtol=1e-10, atol=1e-12)

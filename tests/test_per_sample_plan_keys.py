"""A per-sample plan is reused by later calls with the same key (NOTE [the structure a plan
is for]); these are changes a DP-SGD loop makes between calls that the key once missed, so
that a stale plan gave silently wrong per-sample gradients. Every call is compared in
float64 with the definition, one example at a time."""

from __future__ import annotations

import functools
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import torch_vjp as tv

DT = torch.float64


def loop_reference(model, loss_fn, x, t, names):
    params = dict(model.named_parameters())
    out = {n: [] for n in names}
    for i in range(x.shape[0]):
        gs = torch.autograd.grad(loss_fn(model(x[i:i + 1]), t[i:i + 1]),
                                 [params[n] for n in names], allow_unused=True)
        for n, g in zip(names, gs):
            out[n].append(torch.zeros_like(params[n]) if g is None else g)
    return {n: torch.stack(v) for n, v in out.items()}


def _weight_decayed(out, target, *, l2, model):
    loss = F.cross_entropy(out, target)
    if l2:  # (an L2 term in the loss, switched on by the partial's argument)
        loss = loss + l2 * model[2].weight.pow(2).sum()
    return loss


class _Decayed:
    """A callable loss object whose L2 term reads the parameters it holds."""

    def __init__(self, params):
        self.params = params

    def __call__(self, out, target):
        return F.cross_entropy(out, target) + sum(p.pow(2).sum() for p in self.params)


@pytest.mark.parametrize("kind", ["partial", "object"])
@pytest.mark.parametrize("fn", ["grads", "norms"])
def test_a_loss_made_anew_each_step_is_keyed_by_what_it_runs_not_its_address(kind, fn):
    # a loss made for each step (functools.partial over a schedule's coefficient, or a
    # loss object) may take the address of an earlier step's loss, which had died: a plan
    # keyed by that address was reused for a loss that reads another parameter
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).to(DT)
    x, y = torch.randn(6, 4, dtype=DT), torch.randint(0, 3, (6,))
    names = [n for n, _ in model.named_parameters()]
    if kind == "partial":
        steps = [0.0, 0.0, 0.0, 0.5, 0.5, 0.5]
        make = lambda l2: functools.partial(_weight_decayed, l2=l2, model=model)  # noqa: E731
    else:
        steps = [[], [], [], [model[2].weight], [model[0].weight], [model[2].bias]]
        make = _Decayed
    for step, arg in enumerate(steps):
        loss_fn = make(arg)
        ref = loop_reference(model, loss_fn, x, y, names)
        if fn == "grads":
            got = tv.per_sample_grads(model, loss_fn, x, y)
            for n in names:
                torch.testing.assert_close(got[n], ref[n], msg=f"step {step}, {n}")
        else:
            want = torch.cat([g.flatten(1) for g in ref.values()], 1).norm(dim=1)
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # (no check made again finds it stale)
                got = tv.per_sample_grad_norms(model, loss_fn, x, y)
            torch.testing.assert_close(got, want, msg=f"step {step}")
        del loss_fn  # (the step's loss dies, as in a training loop)


def test_a_partial_loss_made_anew_each_step_keeps_its_plan():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).to(DT)
    x, y = torch.randn(6, 4, dtype=DT), torch.randint(0, 3, (6,))
    # (each kept alive: a plan per address was a plan made for every step)
    losses = [functools.partial(F.cross_entropy, label_smoothing=s) for s in (0.1, 0.2, 0.3)]
    for loss_fn in losses:
        tv.per_sample_plan(model, loss_fn, x, y)
    from torch_vjp._per_sample import probe
    assert len(probe._PLANS[model]) == 1


class _Gated(nn.Module):
    """``h + gate * h.mean(0)``: mixes examples once the gate is off zero."""

    def __init__(self):
        super().__init__()
        self.l1, self.l2 = nn.Linear(4, 5), nn.Linear(5, 3)
        self.gate = nn.Parameter(torch.zeros(()))

    def forward(self, x):
        h = torch.tanh(self.l1(x))
        return self.l2(h + self.gate * h.mean(0, keepdim=True))


@pytest.mark.parametrize("strategy", ["auto", "hooks"])
def test_a_parameter_left_out_of_params_and_unfrozen_makes_a_new_plan(strategy):
    # planned with the gate frozen at zero (which the plan keeps there: NOTE [probes at a
    # generic point]); then unfrozen and trained by another loss: the plan made for the
    # frozen gate trusted rules across a layer that now mixes examples
    torch.manual_seed(0)
    model = _Gated().to(DT)
    x, y = torch.randn(6, 4, dtype=DT), torch.randint(0, 3, (6,))
    names = ["l1.weight", "l1.bias", "l2.weight", "l2.bias"]
    model.gate.requires_grad_(False)
    got = tv.per_sample_grads(model, F.cross_entropy, x, y, params=names, strategy=strategy)
    ref = loop_reference(model, F.cross_entropy, x, y, names)
    for n in names:
        torch.testing.assert_close(got[n], ref[n])
    model.gate.requires_grad_(True)
    with torch.no_grad():
        model.gate.fill_(0.5)  # (as the other loss's optimizer step moves it)
    with pytest.raises(tv.PerSampleError, match=r"the model's own forward \(_Gated\) mixes"):
        tv.per_sample_grads(model, F.cross_entropy, x, y, params=names, strategy=strategy)


@pytest.mark.parametrize("strategy", ["auto", "hooks"])
def test_a_dropout_raised_from_zero_between_calls_is_planned_for(strategy):
    # a dropout schedule that starts at p=0: planned while the layer drew nothing, the plan
    # took the rules' draws for a mismatch when it was checked again, which strategy='hooks'
    # raised for on that call and every later one
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.0), nn.Tanh(), nn.Linear(8, 3)).to(DT)
    x, y = torch.randn(6, 4, dtype=DT), torch.randint(0, 3, (6,))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for step in range(10):
            model[1].p = 0.0 if step < 2 else 0.3
            norms = tv.accumulate_clipped_grads(model, F.cross_entropy, x, y, max_norm=1.0,
                                                strategy=strategy)
            assert norms.shape == (6,) and bool(norms.isfinite().all())
    model.eval()  # (no draws: the definition can be compared)
    names = [n for n, _ in model.named_parameters()]
    got = tv.per_sample_grads(model, F.cross_entropy, x, y, strategy=strategy)
    ref = loop_reference(model, F.cross_entropy, x, y, names)
    for n in names:
        torch.testing.assert_close(got[n], ref[n])


def test_a_softmax_moved_onto_the_batch_between_calls_is_refused():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Softmax(dim=1)).to(DT)
    x, y = torch.randn(6, 4, dtype=DT), torch.randint(0, 3, (6,))

    def nll(p, t):
        return -p.gather(1, t[:, None]).log().sum()

    names = ["0.weight", "0.bias"]
    got = tv.per_sample_grads(model, nll, x, y)
    ref = loop_reference(model, nll, x, y, names)
    for n in names:
        torch.testing.assert_close(got[n], ref[n])
    model[1].dim = 0  # (normalises over the examples: mixes them)
    with pytest.raises(tv.PerSampleError, match=r"module '1' \(Softmax\) mixes examples"):
        tv.per_sample_grads(model, nll, x, y)

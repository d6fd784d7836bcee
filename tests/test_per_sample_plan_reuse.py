"""A plan made on a first call is reused by later calls on the same structure (NOTE [the
structure a plan is for]); these are changes between calls that once left a stale plan in
use, with silently wrong results. Every result is compared in float64 with the definition,
one example at a time."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import torch_vjp as tv

DT = torch.float64
pytestmark = pytest.mark.filterwarnings("ignore:Full backward hook is firing")


def loop_reference(model, loss_fn, x, t):
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    params = [p for _, p in model.named_parameters() if p.requires_grad]
    out = {n: [] for n in names}
    for i in range(x.shape[0]):
        gs = torch.autograd.grad(loss_fn(model(x[i:i + 1]), t[i:i + 1]), params,
                                 allow_unused=True)
        for n, g, p in zip(names, gs, params):
            out[n].append(torch.zeros_like(p) if g is None else g)
    return {n: torch.stack(v) for n, v in out.items()}


def ref_norms(ref):
    return torch.cat([g.flatten(1) for g in ref.values()], 1).norm(dim=1)


def _batch_normalised(module, grad_input, grad_output):
    # divides the gradient reaching the layer below by the norm over the whole batch
    return (grad_input[0] / grad_input[0].norm(),)


def _batch_normalised_pre(module, grad_output):
    return (grad_output[0] / grad_output[0].norm(),)


@pytest.mark.parametrize("strategy", ["auto", "hooks"])
@pytest.mark.parametrize("how", ["module", "module_pre", "global", "global_pre"])
def test_a_backward_hook_registered_after_the_first_call_makes_a_new_plan(how, strategy):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).to(DT)
    loss_fn = nn.CrossEntropyLoss(reduction="sum")
    x, y = torch.randn(5, 4, dtype=DT), torch.randint(0, 3, (5,))
    tv.per_sample_grads(model, loss_fn, x, y, strategy=strategy)  # the plan, without hook
    glob = nn.modules.module
    if how == "module":
        handle = model[2].register_full_backward_hook(_batch_normalised)
    elif how == "module_pre":
        handle = model[2].register_full_backward_pre_hook(_batch_normalised_pre)
    elif how == "global":
        handle = glob.register_module_full_backward_hook(
            lambda m, gi, go: _batch_normalised(m, gi, go) if m is model[2] else None)
    else:
        handle = glob.register_module_full_backward_pre_hook(
            lambda m, go: _batch_normalised_pre(m, go) if m is model[2] else None)
    try:
        ref = loop_reference(model, loss_fn, x, y)
        if strategy == "hooks":
            # the rules read the gradients the hook changes across the batch: refused
            with pytest.raises(tv.StrategyError, match=r"'0.weight'"):
                tv.per_sample_grad_norms(model, loss_fn, x, y, strategy=strategy)
            return
        got = tv.per_sample_grads(model, loss_fn, x, y, strategy=strategy)
        for n in ref:
            torch.testing.assert_close(got[n], ref[n], msg=n)
        torch.testing.assert_close(
            tv.per_sample_grad_norms(model, loss_fn, x, y, strategy=strategy), ref_norms(ref))
    finally:
        handle.remove()

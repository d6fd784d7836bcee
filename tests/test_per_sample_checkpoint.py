"""Models that run torch.utils.checkpoint with use_reentrant=True on a block whose input
requires grad (NOTE [reentrant checkpoints] in torch_vjp._per_sample.fallback): only
backward() differentiates them; the loop does so, 'auto' uses it, and the strategies that
cannot say why and what to change. Compared in float64 with the definition, one example at
a time (by backward, as autograd.grad is refused)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import torch_vjp as tv

DT = torch.float64
pytestmark = pytest.mark.filterwarnings("ignore:None of the inputs have requires_grad")


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(4, 5)
        self.block = nn.Sequential(nn.Linear(5, 5), nn.Tanh())
        self.out = nn.Linear(5, 3)

    def forward(self, x):
        return self.out(checkpoint(self.block, self.inp(x), use_reentrant=True))


def _setup():
    torch.manual_seed(0)
    return _Net().to(DT), nn.CrossEntropyLoss(), torch.randn(5, 4, dtype=DT), \
        torch.randint(0, 3, (5,))


def backward_reference(model, loss_fn, x, y):
    out = {n: [] for n, _ in model.named_parameters()}
    for i in range(x.shape[0]):
        model.zero_grad(set_to_none=True)
        loss_fn(model(x[i:i + 1]), y[i:i + 1]).backward()
        for n, p in model.named_parameters():
            out[n].append(p.grad.clone())
    model.zero_grad(set_to_none=True)
    return {n: torch.stack(v) for n, v in out.items()}


@pytest.mark.parametrize("strategy", ["auto", "loop"])
def test_a_reentrant_checkpoint_after_the_first_layer_gives_the_definition(strategy):
    model, loss_fn, x, y = _setup()
    ref = backward_reference(model, loss_fn, x, y)
    norms = torch.cat([g.flatten(1) for g in ref.values()], 1).norm(dim=1)
    # a .grad and an optimizer-in-backward hook of the caller's, which the per-example
    # backward passes must neither change nor run
    fired = []
    for p in model.parameters():
        p.grad = torch.ones_like(p)
        p.register_post_accumulate_grad_hook(lambda p: fired.append(p))
    got = tv.per_sample_grads(model, loss_fn, x, y, strategy=strategy)
    for n in ref:
        torch.testing.assert_close(got[n], ref[n], msg=n)
    torch.testing.assert_close(tv.per_sample_grad_norms(model, loss_fn, x, y,
                                                        strategy=strategy), norms)
    assert all(bool((p.grad == 1).all()) for p in model.parameters()) and not fired
    clip = (1.0 / norms).clamp(max=1.0)
    torch.testing.assert_close(tv.accumulate_clipped_grads(model, loss_fn, x, y, max_norm=1.0,
                                                           strategy=strategy), norms)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, 1 + torch.einsum("b,b...->...", clip, ref[n]),
                                   msg=n)
    assert len(fired) == len(list(model.parameters()))  # once each, as after backward


def test_inputs_that_require_grad_get_no_grad():
    model, loss_fn, x, y = _setup()
    ref = backward_reference(model, loss_fn, x, y)
    x.requires_grad_(True)
    got = tv.per_sample_grads(model, loss_fn, x, y)
    for n in ref:
        torch.testing.assert_close(got[n], ref[n], msg=n)
    assert x.grad is None


def test_the_plan_and_hooks_name_the_checkpoint_and_the_fix():
    model, loss_fn, x, y = _setup()
    plan = tv.per_sample_plan(model, loss_fn, x, y)
    assert {r.method for r in plan} == {"loop"}
    why = (r"the model runs torch.utils.checkpoint with use_reentrant=True on a block whose "
           r"input requires grad, which only backward\(\) differentiates .*Fix: "
           r"use_reentrant=False in torch.utils.checkpoint")
    assert "use_reentrant=False" in plan["block.0.weight"].reason
    with pytest.raises(tv.StrategyError, match=r"'block.0.weight': " + why):
        tv.per_sample_grad_norms(model, loss_fn, x, y, strategy="hooks")


def test_vmap_names_the_checkpoint():
    model, loss_fn, x, y = _setup()
    with pytest.raises(tv.StrategyError, match=r"strategy='vmap' cannot batch this model .*"
                       r"it runs torch.utils.checkpoint with use_reentrant=True, whose "
                       r"autograd Function torch.func cannot transform; nor can it run the "
                       r"saved-tensor hooks of use_reentrant=False, which the other strategies "
                       r"differentiate\)"):
        tv.per_sample_grads(model, loss_fn, x, y, strategy="vmap")


class _NonReentrant(_Net):
    def forward(self, x):
        return self.out(checkpoint(self.block, self.inp(x), use_reentrant=False))


def test_vmap_refusal_of_a_non_reentrant_checkpoint_names_saved_tensor_hooks():
    # the reentrant refusal advised use_reentrant=False, "which every strategy
    # differentiates": strategy='vmap' then failed on torch.func's "don't yet support saved
    # tensor hooks", with a message about batching rules
    torch.manual_seed(0)
    model = _NonReentrant().to(DT)
    _, loss_fn, x, y = _setup()
    with pytest.raises(tv.StrategyError, match=r"(?s)strategy='vmap' cannot batch this model.*"
                       r"torch.func does not run saved-tensor hooks, which "
                       r"torch.utils.checkpoint \(use_reentrant=False\)"):
        tv.per_sample_grads(model, loss_fn, x, y, strategy="vmap")
    ref = backward_reference(model, loss_fn, x, y)
    for strategy in ("auto", "hooks", "loop"):
        got = tv.per_sample_grads(model, loss_fn, x, y, strategy=strategy)
        for n, g in ref.items():
            torch.testing.assert_close(got[n], g)


@pytest.mark.parametrize("strategy", ["auto", "loop"])
def test_a_frozen_parameter_named_in_params_gets_its_gradient(strategy):
    # its stand-in (functional_call) is gone when the checkpoint recomputes the block:
    # zeros, silently
    model, loss_fn, x, y = _setup()
    ref = backward_reference(model, loss_fn, x, y)
    model.block[0].weight.requires_grad_(False)
    names = ["block.0.weight", "out.weight"]
    got = tv.per_sample_grads(model, loss_fn, x, y, params=names, strategy=strategy)
    for n in names:
        torch.testing.assert_close(got[n], ref[n], msg=n)
    assert not model.block[0].weight.requires_grad and model.block[0].weight.grad is None


@pytest.mark.skipif(not torch.distributed.is_available()
                    or not torch.distributed.is_gloo_available(), reason="no gloo")
def test_a_ddp_model_is_refused_with_the_fix(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0,
                            world_size=1)
    try:
        model, loss_fn, x, y = _setup()
        ddp = nn.parallel.DistributedDataParallel(model)
        with pytest.raises(tv.PerSampleError, match=(
                r"(?s)use_reentrant=True on a block whose input requires grad.*and the model "
                r"is wrapped in DistributedDataParallel, whose reducer would fire on each "
                r"example's backward\(\).*Fix: pass use_reentrant=False")):
            tv.per_sample_grad_norms(ddp, loss_fn, x, y)
        assert all(p.grad is None for p in model.parameters())
        del ddp  # its reducer holds the process group: free it before destroying the group
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("strategy", ["auto", "loop"])
def test_a_selection_of_the_block_and_later_layers_gets_the_blocks_gradients(strategy):
    # none of the asked tensors lies below the checkpoint's node: autograd.grad raised
    # nothing and skipped the block, whose parameters got zeros, silently
    model, loss_fn, x, y = _setup()
    ref = backward_reference(model, loss_fn, x, y)
    names = ["block.0.weight", "block.0.bias", "out.weight"]
    got = tv.per_sample_grads(model, loss_fn, x, y, params=names, strategy=strategy)
    for n in names:
        torch.testing.assert_close(got[n], ref[n], msg=n)
    norms = torch.cat([ref[n].flatten(1) for n in names], 1).norm(dim=1)
    torch.testing.assert_close(
        tv.per_sample_grad_norms(model, loss_fn, x, y, params=names, strategy=strategy), norms)


class _FirstBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = nn.Sequential(nn.Linear(4, 5), nn.Tanh())
        self.out = nn.Linear(5, 3)

    def forward(self, x):
        return self.out(checkpoint(self.block, x, use_reentrant=True))


@pytest.mark.parametrize("strategy", ["auto", "loop"])
def test_inputs_that_require_grad_after_a_plan_made_without_give_the_blocks_gradients(
        strategy):
    # a checkpoint on the first block has a gradient only where the input requires grad;
    # the plan made with plain inputs was kept for inputs that require grad (zeros)
    torch.manual_seed(0)
    model, loss_fn = _FirstBlock().to(DT), nn.CrossEntropyLoss()
    x, y = torch.randn(5, 4, dtype=DT), torch.randint(0, 3, (5,))
    tv.per_sample_grad_norms(model, loss_fn, x, y, strategy=strategy)
    xr = x.clone().requires_grad_(True)
    ref = backward_reference(model, loss_fn, x.clone().requires_grad_(True), y)
    got = tv.per_sample_grads(model, loss_fn, xr, y, strategy=strategy)
    for n in ref:
        torch.testing.assert_close(got[n], ref[n], msg=n)
    assert xr.grad is None


class _WithLeaf(_Net):
    def __init__(self):
        super().__init__()
        self.shift = torch.zeros(5, dtype=DT, requires_grad=True)  # a plain leaf attribute

    def forward(self, x):
        return self.out(checkpoint(self.block, self.inp(x), use_reentrant=True) + self.shift)


@pytest.mark.parametrize("strategy", ["auto", "loop"])
def test_leaves_that_are_not_parameters_keep_their_grad(strategy):
    # each example's backward() accumulated into a leaf of the loss's closure and a plain
    # leaf attribute of the model
    torch.manual_seed(0)
    model = _WithLeaf().to(DT)
    scale = torch.ones(3, dtype=DT, requires_grad=True)
    fired = []
    scale.register_post_accumulate_grad_hook(lambda t: fired.append(t))

    def loss_fn(o, t):
        return nn.functional.cross_entropy(o * scale, t)

    x, y = torch.randn(5, 4, dtype=DT), torch.randint(0, 3, (5,))
    ref = backward_reference(model, loss_fn, x, y)
    scale.grad = None
    model.shift.grad = torch.full((5,), 7.0, dtype=DT)
    fired.clear()
    got = tv.per_sample_grads(model, loss_fn, x, y, strategy=strategy)
    for n in ref:
        torch.testing.assert_close(got[n], ref[n], msg=n)
    assert scale.grad is None and not fired
    assert torch.equal(model.shift.grad, torch.full((5,), 7.0, dtype=DT))

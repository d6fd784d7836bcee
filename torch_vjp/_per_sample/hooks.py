"""The rules' pass: one forward and one backward of the whole batch, under a plan.

The recorder records the layer calls the plan trusts; one ``torch.autograd.grad`` of the sum
of the examples' own losses gives their output gradients; each call's rule turns them into
factors (NOTE [Factors]) for the parameters the plan computes by rules.
"""

from __future__ import annotations

import contextlib

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from torch_vjp._engine.context import grad_enabled
from torch_vjp._errors import StrategyError, TorchVJPError
from torch_vjp._per_sample.args import Job
from torch_vjp._per_sample.factors import Factor, SmallFactor, full_precision, widened
from torch_vjp._per_sample.losses import check_connected, scaled_loss_sum
from torch_vjp._per_sample.plan import CallPlan, Plan, aliases_of, call_key, forward
from torch_vjp._per_sample.recorder import Recorder, edge_of, layers_of
from torch_vjp._per_sample.registry import Call, Declined, UserRule

__all__ = ["HooksResult", "hooks_pass", "RuleRaised"]


class RuleRaised(Exception):
    """Carries an exception a user's rule raised (``err``, a note added) past the
    handlers of the rules' pass, which re-raise ``err`` itself (SPEC §0)."""

    def __init__(self, err: Exception) -> None:
        super().__init__(str(err))
        self.err = err

if hasattr(torch.autograd, "_engine_run_backward"):  # the engine entry autograd.grad calls

    def _engine(*args: Any, **kwargs: Any) -> Any:
        return torch.autograd._engine_run_backward(*args, **kwargs)  # (patched by tracing)

else:  # pragma: no cover - an older torch

    def _engine(outputs, grad_outputs, retain, create, inputs, allow_unused, **_):
        return torch.autograd.grad(outputs, inputs, grad_outputs, retain_graph=retain,
                                   create_graph=create, allow_unused=allow_unused)


@dataclass
class HooksResult:
    """The factors of the parameters the plan computes by rules; ``moved`` holds those that
    this call had to leave to the fallback (and why); ``mismatch`` says the layer calls were
    not the plan's."""

    factors: dict[str, list[Factor]] = field(default_factory=dict)
    moved: dict[str, str] = field(default_factory=dict)
    mismatch: bool = False


# NOTE [a batch of one]
# For a batch of one example, the example's gradient is the gradient of the batch's loss.
# A parameter used outside the layers with rules (directly in a forward, by a layer without
# a rule, by the loss), which a larger batch leaves to vmap or the loop, is then taken whole
# from the rules' one backward, by its own edge (``Plan.whole``): no other pass is run,
# and strategy='hooks' computes a batch of one for every model it computes larger batches
# for (the last, short batch of an epoch; a Poisson-sampled batch of one).


def hooks_pass(job: Job, plan: Plan) -> HooksResult:
    """Runs the batch once forward and backward with the plan's rules (grad mode on)."""
    model, sel, batch = job.model, job.sel, job.batch
    result = HooksResult()
    names = plan.rule_params
    zero = plan.zero_params
    if not names and not zero:
        return result
    aliases = aliases_of(sel)  # stand-ins for selected tensors that do not require grad
    if aliases is not None:
        tracked = {id(t): n for n, t in aliases.items()}
    else:
        tracked = sel.tracked
    layers = plan.layers
    if layers is None:
        layers = layers_of(model, plan.wanted)
        if not any(m is model for _, m in layers.hooked + layers.attention):
            plan.layers = layers  # (a plan that held its model would keep it alive in the
            # cache, which is weak in the model: a model that is one layer finds it anew)
    rec = Recorder(model, tracked, batch, wanted=plan.wanted, expand_shared=plan.expand,
                   direct=plan.direct, layers=layers)
    with grad_enabled(True):
        with rec:
            out = forward(model, job.xs, aliases)
        calls = rec.calls
        if not _as_planned(calls, plan, batch):
            result.mismatch = True
            return result
        total, scale = scaled_loss_sum(job.fn, job.loss_fn, out, job.targets, batch,
                                       plan.out_dims)
        check_connected(job.fn, total, out)
        covered = plan.rule_set()
        whole = [n for n in plan.whole if n in covered]  # (NOTE [a batch of one])
        if whole:
            covered = covered - frozenset(whole)
        needed: list[tuple[Call, CallPlan]] = []
        for c, cp in zip(calls, plan.calls):
            if not cp.valid:
                continue
            own = cp.names
            if own is None:
                own = cp.names = frozenset(
                    tracked[id(t)] for t, _ in c.params.values() if id(t) in tracked)
            if covered.isdisjoint(own):
                continue
            if isinstance(c.x, Tensor) and c.x._version != c.x_version:
                for n in own & covered:
                    result.moved.setdefault(
                        n, f"in '{c.path}', its input was modified in place after the layer "
                           f"used it")
                continue
            c.bdim = None if batch == 1 else cp.bdim
            needed.append((c, cp))
        if result.moved:
            covered = covered - set(result.moved)
        edges = []
        slots: list[list[int | None]] = []
        for c, _ in needed:
            row = []
            for e in c.out_edges:
                if e is None:
                    row.append(None)
                else:
                    row.append(len(edges))
                    edges.append(e)
            slots.append(row)
        # the parameters the plan found no gradient reaching: one that this forward reaches
        # (a branch taken on a value that is one for the whole batch, a task id) is given
        # zeros by the plan, so the plan is made again, as for layer calls that changed
        held = aliases if aliases is not None else sel.tensors
        first_whole = len(edges)
        edges.extend(edge_of(held[n]) for n in whole)
        first_zero = len(edges)
        edges.extend(edge_of(held[n]) for n in zero if held[n].requires_grad)
        if edges and total.requires_grad:
            # the engine call of torch.autograd.grad, which would first validate the
            # grad_outputs (there are none: the loss is a scalar)
            grads = _engine((total,), (torch.full_like(total, scale),), False, False,
                            tuple(edges), True, accumulate_grad=False)
        else:
            grads = [None] * len(edges)
        if any(g is not None for g in grads[first_zero:]):
            result.mismatch = True
            return result
        whole_grads = grads[first_whole:first_zero]
    del total, out
    # (norms and clipped sums at float32's precision at least: NOTE [norms at float32's
    # precision] in torch_vjp._per_sample.factors)
    norms = job.fn != "per_sample_grads"
    wide = widened if norms else (lambda t: t)
    device = next(iter(sel.tensors.values())).device
    with grad_enabled(False), (full_precision(device) if norms else contextlib.nullcontext()):
        for n, g in zip(whole, whole_grads):
            if g is not None:  # (None: no gradient reaches it, zeros)
                result.factors[n] = [SmallFactor(wide(g).unsqueeze(0))]
        for (c, cp), row in zip(needed, slots):
            gs = []
            for j, slot in enumerate(row):
                g = None if slot is None else grads[slot]
                if g is not None and g.shape != c.outputs[j].shape:
                    g = g.reshape(c.outputs[j].shape)
                gs.append(wide(g))
            roles = cp.roles if not result.moved else None
            if roles is None:
                roles = {r for r, (t, _) in c.params.items() if tracked.get(id(t)) in covered}
                if not result.moved:
                    cp.roles = roles
            if not roles:
                continue
            args = tuple([wide(a.detach()) if isinstance(a, Tensor) else a for a in c.args])
            c.args = args
            try:
                found = c.rule.factors(c, gs, roles, batch)
            except Declined as err:
                # a call the rule cannot split into examples: its parameters go to the
                # fallback for this call (the rule says so itself, rather than give no
                # factors, which would read as a zero gradient)
                own = {tracked[id(c.params[r][0])] for r in roles}
                if job.strategy == "hooks":
                    raise _declined_error(job.fn, c, own, str(err),
                                          plan.vmap_randomness is not None) from None
                for n in own:
                    result.moved.setdefault(
                        n, f"the {c.rule.name} rule in '{c.path}' cannot compute this call: "
                           f"{err}")
                    result.factors.pop(n, None)
                continue
            except Exception as err:
                if isinstance(c.rule, UserRule) and not isinstance(err, TorchVJPError):
                    # (a bug in the user's rule is theirs to see, as it is (SPEC §0): never
                    # left to the fallback, where it would vanish, nor blamed on the forward)
                    err.add_note(_user_rule_note(job.fn, c))
                    raise RuleRaised(err) from None
                raise
            for role, factor in found:
                name = tracked[id(c.params[role][0])]
                if name in result.moved:
                    continue
                result.factors.setdefault(name, []).append(factor)
    return result


def _user_rule_note(fn: str, c: Call) -> str:
    kind = type(c.module).__name__ if c.module is not None else "layer"
    return (
        f"(raised in torch_vjp.{fn} by the per-sample rule {c.rule.name} on the layer "
        f"'{c.path}' ({kind}). A rule registered with torch_vjp.register_per_sample_rule "
        f"computes the per-sample gradients of its layer's parameters under strategy='auto' "
        f"and 'hooks', from (module, inputs, grad_output), each with the examples along "
        f"dimension 0; a rule declines a call it cannot compute by raising "
        f"NotImplementedError. Fix the rule, or pass strategy='vmap' or strategy='loop', "
        f"which do not use it.)")


def _declined_error(fn: str, c: Call, names: set[str], why: str, vmap: bool) -> StrategyError:
    listed = ", ".join(repr(n) for n in sorted(names))
    # (vmap only where it can run the model: not a stock recurrent layer, NOTE
    # [one draw per example] and plan.vmap_blockers)
    fix = ("strategy='auto' (which computes these parameters with vmap or the loop), or "
           "strategy='vmap' or strategy='loop'" if vmap else
           "strategy='auto' (which computes these parameters with the per-example loop, as "
           "vmap cannot run this model) or strategy='loop'")
    return StrategyError(
        f"torch_vjp.{fn}: strategy='hooks' cannot compute {listed}: the {c.rule.name} rule in "
        f"'{c.path}' cannot compute this call of the layer ({why}).\n"
        f"  Fix: {fix}.")


def _as_planned(calls: list[Call], plan: Plan, batch: int) -> bool:
    """Whether the recorded layer calls are the plan's, in order, each with the examples
    where the plan found them (one loop: this runs on every call)."""
    signature = plan.signature()
    if len(calls) != len(signature):
        return False
    for c, k, cp in zip(calls, signature, plan.calls):
        if call_key(c) != k or _moved_batch(c, cp, batch):
            return False
    return True


def _moved_batch(c: Call, cp: CallPlan, batch: int) -> bool:
    """Whether a layer's output no longer holds the examples along the dimension the plan
    found them in (a model attribute that changes the layout, ``(B, T, D)`` to ``(T, B,
    D)``): the plan is made again. (A layout whose sizes agree by chance is not seen: NOTE
    [the per-sample plan].)"""
    if batch == 1 or not cp.valid or cp.bdim is None or c.module is None or not c.outputs:
        return False
    y = c.outputs[0]
    return isinstance(y, Tensor) and (y.dim() <= cp.bdim or y.shape[cp.bdim] != batch)

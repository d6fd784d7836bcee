"""The check of a plan's first results against the per-example loop (NOTE [the per-sample
plan] in :mod:`torch_vjp._per_sample.plan`): three examples' squared norms per parameter,
compared with the loop's; a model that draws from the global generator is checked with its
dropout layers (and attention's dropout) in eval mode."""

from __future__ import annotations

import warnings

import torch
from torch import Tensor, nn

from torch_vjp._errors import PerSampleError, TorchVJPWarning, user_stacklevel, warn_once
from torch_vjp._per_sample.args import Job
from torch_vjp._per_sample.factors import sq_norms_rows
from torch_vjp._per_sample.fallback import loop_grads
from torch_vjp._per_sample.plan import Plan
from torch_vjp._per_sample.run import grads, norms_and_sums
from torch_vjp._per_sample.structure import numbers_of, restore_numbers

__all__ = ["verify", "checked"]


_RTOL = {torch.float64: 1e-7, torch.float32: 1e-3, torch.float16: 3e-2, torch.bfloat16: 5e-2}


def _autocast_rtol(device: torch.device) -> float:
    """The tolerance of the dtype autocast computes in on ``device`` (0 where autocast is
    off): the rules and the loop then round at bfloat16's or float16's precision, whatever
    the dtype of the tensors."""
    kind = device.type
    try:
        if not torch.is_autocast_enabled(kind):
            return 0.0
        return _RTOL.get(torch.get_autocast_dtype(kind), 5e-2)
    except (RuntimeError, TypeError):  # a device type autocast does not know
        return 0.0


# NOTE [checked again]
# A plan is kept under a key of what the model and the loss run (NOTE [the structure a plan
# is for] in ``structure``), and checked against the loop on its first call. What the key
# does not hold can change under it: a hook's flag kept in a list (``state[0]``), a tensor a
# hook reads (``out + w * out.mean(0)`` with ``w`` at 0 when planned), a flag two levels
# deep. A plan that then mixes examples, or misplaces them, would be silently wrong from that
# call on. So the check is made again on the plan's 4th, 8th, 16th, ... use after the first
# check, then on every 1024th (the three examples' loop costs about 3/B of a call; on average
# under 0.1% of a call from there). A disagreement computes the call again as the first check
# does (the parameters concerned on vmap, then the loop, which is the definition), warns that
# the calls since the last agreeing check may be wrong, and marks the plan stale: the next
# call makes a new one (which, for a model that now mixes examples, refuses it as for any
# such model). A strategy named explicitly raises, as on the first call.
#
# NOTE [checked at each batch size]
# The key holds no batch size (NOTE [plans of one batch size] in ``plan``), and a forward
# can branch on it (``if x.shape[0] > 4: h = h - h.mean(0)``): a plan made and checked at a
# size where the model is per-example would be silently wrong at a size where it mixes. So
# a plan whose results come from the batch's own forward (rule or zero parameters) is
# checked again at the first call of each batch size it has not been checked at; vmap and
# the loop run one example at a time and are not. Under Poisson sampling the sizes stay
# near the expected one: a few dozen checks over a training run, each about 3/B of a call.
#: After this many uses, the plan is checked again every this many uses.
RECHECK_EVERY = 1024
#: The first use checked again.
_FIRST_RECHECK = 4


def _recheck_due(plan: Plan) -> bool:
    """Counts a use of the checked ``plan``; whether the check is due again (NOTE [checked
    again]), and if so starts it."""
    plan.uses = n = plan.uses + 1
    due = (n % RECHECK_EVERY == 0) if n > RECHECK_EVERY else (
        n >= _FIRST_RECHECK and n & (n - 1) == 0)
    plan.new_batch = _new_batch(plan)
    if due or plan.new_batch:
        plan.rechecking = True
        plan.verified = plan.verified_one_run = False
    return due or plan.new_batch


def _new_batch(plan: Plan) -> bool:
    """Whether this call's batch size is one the plan's rules were not checked at (NOTE
    [checked at each batch size])."""
    return plan.batch_now not in plan.batches and bool(plan.rule_params or plan.zero_params)


def _passed(plan: Plan, flag: str) -> None:
    setattr(plan, flag, True)
    plan.rechecking = plan.new_batch = False
    plan.checked_at = plan.uses
    plan.batches.add(plan.batch_now)


def checked(plan: Plan, one_run: bool = False) -> bool:
    """Whether results under ``plan`` were checked against the loop already (and need not be
    again on this call: NOTE [checked again])."""
    if not (plan.verified_one_run if one_run else plan.verified):
        return False
    return not _recheck_due(plan)


def verify(job: Job, plan: Plan, sq: dict[str, Tensor], one_run: bool = False) -> list[str]:
    """Compares the per-parameter squared norms ``sq`` of three examples with the per-example
    loop (NOTE [the per-sample plan]); returns the parameters that disagree, after routing
    them off their method (or raising, for an explicit strategy). ``one_run``: the result
    came from one vmap run (NOTE [one run]), which is checked apart from the rules."""
    flag = "verified_one_run" if one_run else "verified"
    if getattr(plan, flag) and not _recheck_due(plan):
        return []
    if job.strategy == "loop":
        _passed(plan, flag)
        return []
    numbers = numbers_of(job.model)  # (the check's forwards do not count: restore_numbers)
    try:
        return _verify(job, plan, sq, one_run, flag)
    finally:
        restore_numbers(numbers)


def _verify(job: Job, plan: Plan, sq: dict[str, Tensor], one_run: bool, flag: str
            ) -> list[str]:
    sel, batch = job.sel, job.batch
    # (the first example too: a forward whose control flow reads the whole batch, ``if
    # (x[:, 0] > 0).all()``, takes for the batch the branch the last ones take alone)
    ks = sorted({0, batch - 1, batch // 2})
    names = list(sel.canonical)
    ref = {n: sel.tensors[n].new_empty((len(ks), *sel.tensors[n].shape)) for n in names}
    if plan.random_global:
        # The draws of the batch's pass cannot be replayed example by example. Dropout
        # layers draw independently per element, so the plan's computation and the loop are
        # both made again with them off; what the model still draws (an F.dropout of its
        # own, torch.randn in a forward) leaves the check undone, as it must.
        recomputed = _without_dropout(job, plan, ks, names, ref, one_run)
        if recomputed is None:
            _passed(plan, flag)
            return []
        sq = recomputed
    else:
        _loop_reference(job, ks, names, ref)
    bad: dict[str, str] = {}
    wants = {n: sq_norms_rows(ref[n]) for n in names}
    # each example's whole gradient (all the parameters): a parameter whose true gradient is
    # zero but for rounding is compared against that scale, not against its own
    whole = torch.stack([w.to(torch.float64) for w in wants.values()]).sum(0).sqrt()
    for n in names:
        want = wants[n].sqrt()
        got = sq[n][ks].clamp_min(0).sqrt()
        rtol = max(_RTOL.get(want.dtype, 1e-3), _autocast_rtol(want.device))
        scale = float(want.max()) if want.numel() else 0.0
        err = (got - want).abs()
        floor = rtol * 1e-3 * whole.to(want.dtype)
        if bool((err > rtol * want + rtol * 1e-3 * scale + floor + 1e-30).any()):
            j = int(err.argmax())
            method = "vmap" if one_run and plan.params[n].method == "rule" else (
                plan.params[n].method)
            bad[n] = (
                f"the {method} result disagreed with the per-example loop on "
                f"example {ks[j]} (gradient norm {float(got[j]):.6g} against "
                f"{float(want[j]):.6g})"
            )
    if not bad:
        _passed(plan, flag)
        return []
    if job.strategy != "auto":
        n, why = next(iter(bad.items()))
        user = plan.params[n].user
        raise PerSampleError(
            f"torch_vjp.{job.fn}: strategy={job.strategy!r} gives wrong per-sample gradients "
            f"for this model: for {n!r}, {why}.\n"
            + (f"  The per-layer rule ({plan.params[n].how or 'its layer'}) does not "
               f"reproduce what each example computes alone: the model reorders or mixes "
               f"examples in a way the plan cannot see, or the layer's call is one the rule "
               f"cannot replay (a forward other than the stock one, say)"
               + (f"; or the rule you registered, {user}, gives a wrong gradient for it, or "
                  f"none (a parameter left out of the dict it returns gets none, norm 0): "
                  f"check it against strategy='loop'. " if user else ". ")
               if plan.params[n].method == "rule" else
               "  No gradient reaches it when the model runs on the batch, but one does when "
               "the example runs alone: the forward takes another branch for the batch than "
               "for the example (control flow on values of the whole batch, such as "
               "`if (x > 0).all()`), so it mixes examples. "
               if plan.params[n].method == "zero" else
               "  vmap does not reproduce what each example computes alone (randomness "
               "drawn with a generator of the model's own, or a parameter the loss function "
               "reads itself, which vmap's copies of the parameters do not reach). ")
            + (_since(plan) if plan.rechecking else "")
            + "Fix: strategy='auto' (which routes such parameters to a strategy that is "
              "right) or strategy='loop'."
        )
    # (the loop is the definition: a parameter already on it that disagrees with it, a
    # nondeterministic forward, stays there; rerouting the others always ends on the loop)
    bad = {n: why for n, why in bad.items() if plan.params[n].method != "loop"}
    if not bad:
        _passed(plan, flag)
        return []
    for n, why in bad.items():
        user = plan.params[n].user if plan.params[n].method == "rule" else ""
        if user:  # (the user's own rule is the likely culprit: say so, once per rule)
            warn_once(
                ("per-sample-user-rule", user),
                f"torch_vjp.{job.fn}: the per-sample rule you registered, {user}, gives "
                f"wrong per-sample gradients for {n!r}: {why}. strategy='auto' computes it "
                f"with vmap or the per-example loop instead, which is slower.\n  Check the "
                f"rule against strategy='loop': it must return every parameter of the layer "
                f"(a parameter left out of its dict gets none, norm 0), each of shape "
                f"(B, *parameter.shape). This warning is shown once per rule.",
                TorchVJPWarning,
            )
        plan.route([n], why + "; rerouted")
    if plan.rechecking and not plan.stale:
        plan.stale = True  # (the next call makes a new plan: NOTE [checked again])
        n, why = next(iter(bad.items()))
        warnings.warn(
            f"torch_vjp.{job.fn}: the per-sample gradients planned for this model disagree "
            f"with the per-example loop: for {n!r}, {why}.\n  " + _since(plan)
            + "This call is computed again with vmap or the per-example loop, and is right; "
              "the next call makes a new plan"
            + (" (for this batch size: one that mixes examples there is refused, as any "
               "such model is). Fix: make the forward per-example at every batch size, or "
               "use strategy='loop'." if plan.new_batch else
               ". Fix: keep a switch that changes what the "
               "model computes as a plain attribute of a module (self.mix = True) or a bool "
               "a hook reads from its closure, which the plan sees; or use strategy='loop' "
               "while such a switch changes."),
            TorchVJPWarning, stacklevel=user_stacklevel())
    return list(bad)


def _since(plan: Plan) -> str:
    """What a check made again (NOTE [checked again]) says of the calls before it."""
    if plan.new_batch:  # (NOTE [checked at each batch size])
        sizes = ", ".join(map(str, sorted(plan.batches)[:8]))
        return (f"It agreed at the batch size(s) it was checked at ({sizes}), not at this "
                f"batch of {plan.batch_now}: the model computes otherwise at this batch size "
                f"(control flow on x.shape[0], say), which the plan, made at another size, "
                f"cannot see. ")
    between = plan.uses - plan.checked_at - 1
    return (f"It agreed when checked {plan.uses - plan.checked_at} call(s) before this one: "
            f"something the plan cannot see changed since (a flag kept in a list, a tensor "
            f"that a hook or forward reads, a setting two levels into a config), and the "
            f"{between} call(s) between the two checks may have given wrong results. "
            if between >= 0 else "")


def _loop_reference(job: Job, ks: list[int], names: list[str], ref: dict[str, Tensor]
                    ) -> None:
    """The per-example loop's gradients of the examples ``ks``, written into ``ref``."""
    for j, k in enumerate(ks):
        loop_grads(job, names, k, k + 1, {n: ref[n][j:j + 1] for n in names})


def _rng_states(devices: set[torch.device]) -> list[Tensor]:
    states = [torch.get_rng_state()]
    for d in sorted({d.index or 0 for d in devices if d.type == "cuda"}):
        states.append(torch.cuda.get_rng_state(d))
    return states


def _without_dropout(job: Job, plan: Plan, ks: list[int], names: list[str],
                     ref: dict[str, Tensor], one_run: bool) -> dict[str, Tensor] | None:
    """For :func:`verify` of a model that draws from the global generator: with the model's
    dropout layers in eval mode, the squared norms of the plan's computation (the whole batch,
    as the call made it), with the loop's gradients of the examples ``ks`` written into
    ``ref``; None where the model still draws random numbers (or has no dropout layer)."""
    # (and attention's own dropout, of nn.MultiheadAttention in training mode: a
    # TransformerEncoderLayer with dropout > 0 draws there too, and went unchecked)
    drops = [m for m in job.model.modules()
             if m.training and (isinstance(m, nn.modules.dropout._DropoutNd) or (
                 isinstance(m, nn.MultiheadAttention) and m.dropout > 0))]
    if not drops:
        return None
    devices = {t.device for t in job.sel.tensors.values()}
    devices.update(x.device for x in job.xs if isinstance(x, Tensor))
    before = _rng_states(devices)
    try:
        for m in drops:
            m.training = False
        if job.reset is not None:
            job.reset()
        if one_run:
            results, _ = grads(job, plan, None)
            sq = {n: sq_norms_rows(g) for n, g in results.items()}
        else:
            sq = norms_and_sums(job, plan, None)[2]
        _loop_reference(job, ks, names, ref)
        if job.reset is not None:
            job.reset()
    finally:
        for m in drops:
            m.training = True
    after = _rng_states(devices)
    if any(not torch.equal(a, b) for a, b in zip(before, after)):
        # randomness other than the dropout layers': no check, and the caller's generators
        # as the check found them (its forwards drew for nothing)
        torch.set_rng_state(before[0])
        for d, state in zip(sorted({d.index or 0 for d in devices if d.type == "cuda"}),
                            before[1:]):
            torch.cuda.set_rng_state(state, d)
        return None
    return sq

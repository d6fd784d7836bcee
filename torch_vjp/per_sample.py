"""Per-sample gradients, their norms, and the DP-SGD clipped-sum step.

Shape convention: for a batch of ``B`` examples, the per-sample gradient of a parameter of
shape ``S`` has shape ``(B, *S)``; entry ``[i]`` is the gradient of
``loss_fn(model(inputs[i:i+1]), targets[i:i+1])``, the gradient example ``i`` gives alone.

Strategies:

- ``"hooks"``: per-layer rules (``torch_vjp._per_sample.rules``) applied to the activations and
  output gradients of one ordinary forward and backward pass of the whole batch. Fastest, and
  the only one that can give norms and clipped sums without forming per-sample gradients.
- ``"vmap"``: ``torch.func.vmap(torch.func.grad(...))`` over ``functional_call``, one example
  per vmapped call (the torch.func recipe).
- ``"loop"``: one forward and backward per example.
- ``"auto"``: ``"hooks"`` for every parameter a rule covers, ``"vmap"`` for the rest (``"loop"``
  where vmap cannot batch the model). No parameter is ever skipped.

Which parameter is computed how is decided once per model structure, from the data flow of
the model, and checked against the per-example loop (NOTE [the per-sample plan] in
``torch_vjp._per_sample.plan``); :func:`per_sample_plan` shows it.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from torch_vjp._core import check_chunk_size
from torch_vjp._errors import (
    PerSampleError,
    PerSampleTypeError,
    PerSampleValueError,
    StrategyError,
    shape_str,
)
from torch_vjp._per_sample import rules as _rules  # noqa: F401 - registers the rules
from torch_vjp._per_sample.args import (
    Selection,
    as_inputs,
    check_max_norm,
    check_model,
    check_static_mixing,
    check_targets,
    select,
)
from torch_vjp._per_sample.factors import (
    CHUNK_ELEMENTS,
    region_sq_norms,
    region_weighted_sum,
    sq_norms_rows,
    write_region,
)
from torch_vjp._per_sample.fallback import fallback_grads, loop_grads
from torch_vjp._per_sample.hooks import HooksResult, hooks_pass
from torch_vjp._per_sample.plan import (
    Plan,
    forget_plans,
    mixing_error,
    plan_for,
)
from torch_vjp._per_sample.registry import register_user_rule, registered_types
from torch_vjp._strategies import PerSampleStrategyName, get_per_sample_strategy

__all__ = [
    "per_sample_grads",
    "per_sample_grad_norms",
    "accumulate_clipped_grads",
    "per_sample_plan",
    "PerSamplePlan",
    "register_per_sample_rule",
    "PerSampleValueError",
    "PerSampleTypeError",
]


# ============================================================================================
# Shared steps
# ============================================================================================


# Per model: the selection of parameters and the static checks, for the same parameters
# (and requires_grad flags) and training flags; what every call would otherwise recompute.
_STATIC: weakref.WeakKeyDictionary[nn.Module, dict[Any, Selection]] = weakref.WeakKeyDictionary()


def _prepare(fn: str, model: Any, inputs: Any, targets: Any, params: Any, strategy: Any):
    strategy = get_per_sample_strategy(strategy, call=f"torch_vjp.{fn}")
    check_model(fn, model)
    xs, batch = as_inputs(fn, inputs)
    check_targets(fn, targets, batch)
    training = tuple(m.training for m in model.modules())
    key = _static_key(model, params, training)
    cache = _STATIC.setdefault(model, {}) if key is not None else {}
    sel = cache.get(key)
    if sel is None:
        sel = select(fn, model, params)
        check_static_mixing(fn, model)
        sel.training = training
        sel.sparse = frozenset(_sparse_tables(model)) & frozenset(map(id, sel.tensors.values()))
        if key is not None:
            if len(cache) >= 8:
                cache.clear()
            cache[key] = sel
    return strategy, xs, batch, sel


def _static_key(model: nn.Module, params: Any, training: tuple[bool, ...]) -> Any:
    if params is None:
        names: Any = None
    elif isinstance(params, str):
        names = (params,)
    elif isinstance(params, (list, tuple)) and all(isinstance(n, str) for n in params):
        names = tuple(params)
    else:
        return None  # a generator, or something select() reports
    return (names, tuple((id(p), p.requires_grad) for p in model.parameters()), training)


@contextlib.contextmanager
def _buffers_kept(model: nn.Module, names: Sequence[str]) -> Any:
    """Puts back the buffers the plan found a forward changes (spectral normalisation's
    vectors in training mode): no buffer of the model changes (SPEC §0). Yields the function
    that puts them back, or None: the per-example runs call it before each example, so that
    every example runs alone from the caller's state, as the definition says."""
    if not names:
        yield None
        return
    saved = []
    for n in names:
        try:
            b = model.get_buffer(n)
        except AttributeError:
            continue
        saved.append((b, b.detach().clone()))

    def reset() -> None:
        with torch.no_grad():
            for b, copy in saved:
                b.copy_(copy)

    try:
        yield reset
    finally:
        reset()


def _plan(
    fn: str, model: nn.Module, loss_fn: Callable, xs: tuple[Tensor, ...], targets: Any,
    sel: Selection, batch: int, strategy: str, rebuild: bool = False,
) -> Plan:
    """The plan for this call; refuses what the strategy cannot compute right."""
    plan = plan_for(fn, model, loss_fn, xs, targets, sel, batch, strategy, rebuild=rebuild)
    if plan.mixing is not None and strategy in ("auto", "hooks"):
        raise mixing_error(fn, plan.mixing, strategy)
    if strategy == "hooks":
        missing = {n: p.reason for n, p in plan.params.items() if p.method in ("vmap", "loop")}
        if missing:
            raise _no_rule_error(fn, missing)
    return plan


def _no_rule_error(fn: str, missing: dict[str, str]) -> StrategyError:
    lines = "\n".join(f"    {n!r}: {why}" for n, why in missing.items())
    return StrategyError(
        f"torch_vjp.{fn}: strategy='hooks' has no per-layer rule for {len(missing)} "
        f"parameter(s):\n{lines}\n"
        f"  Rules exist for {', '.join(registered_types())} and nn.MultiheadAttention, and "
        f"for parameters added to (or expanded over) the batch; add one for a layer of your "
        f"own with torch_vjp.register_per_sample_rule. Or use strategy='auto', which "
        f"computes the other parameters with vmap (or the loop), or strategy='vmap'."
    )


def _hooks(fn, model, loss_fn, xs, targets, sel, batch, strategy, plan) -> tuple[Plan, HooksResult]:
    """The rules' pass; a model whose layer calls are not the plan's gets a new plan, once."""
    res = hooks_pass(fn, model, loss_fn, xs, targets, sel, batch, plan)
    if res.mismatch:
        plan = _plan(fn, model, loss_fn, xs, targets, sel, batch, strategy, rebuild=True)
        res = hooks_pass(fn, model, loss_fn, xs, targets, sel, batch, plan)
        if res.mismatch:  # the layers called change from call to call: no rules this time
            why = "the layers the model calls change from one call to the next"
            if strategy == "hooks":
                raise _no_rule_error(fn, {n: why for n in plan.rule_params})
            res = HooksResult(moved={n: why for n in plan.rule_params})
    return plan, res


def _fallback_names(plan: Plan, res: HooksResult) -> tuple[list[str], list[str]]:
    """The parameters left to vmap and to the loop in this call."""
    vmap_names, loop_names = [], []
    for n, p in plan.params.items():
        method = "vmap" if n in res.moved else p.method
        if method == "vmap" and plan.vmap_randomness is not None:
            vmap_names.append(n)
        elif method in ("vmap", "loop"):
            loop_names.append(n)
    return vmap_names, loop_names


def _fallback(fn, strategy, model, loss_fn, xs, targets, sel, names, start, stop, chunk,
              randomness, reset=None):
    if not names:
        return {}
    return fallback_grads(fn, strategy, model, loss_fn, xs, targets, sel, names, start, stop,
                          chunk, randomness, reset)


def _verify(
    fn: str, model: nn.Module, loss_fn: Callable, xs: tuple[Tensor, ...], targets: Any,
    sel: Selection, batch: int, strategy: str, plan: Plan, sq: dict[str, Tensor],
    reset: Callable[[], None] | None = None,
) -> list[str]:
    """Compares the per-parameter squared norms of two examples with the per-example loop
    (NOTE [the per-sample plan]); returns the parameters that disagree, after routing them
    off their method (or raising, for an explicit strategy)."""
    if plan.verified:
        return []
    if plan.random_global or strategy == "loop":
        plan.verified = True
        return []
    ks = sorted({batch - 1, batch // 2})
    names = list(sel.canonical)
    ref = {n: sel.tensors[n].new_empty((len(ks), *sel.tensors[n].shape)) for n in names}
    for j, k in enumerate(ks):
        one = {n: ref[n][j:j + 1] for n in names}
        loop_grads(fn, model, loss_fn, xs, targets, sel, names, k, k + 1, one, reset)
    bad: dict[str, str] = {}
    wants = {n: sq_norms_rows(ref[n]) for n in names}
    # each example's whole gradient (all the parameters): a parameter whose true gradient is
    # zero but for rounding is compared against that scale, not against its own
    whole = torch.stack([w.to(torch.float64) for w in wants.values()]).sum(0).sqrt()
    for n in names:
        want = wants[n].sqrt()
        got = sq[n][ks].clamp_min(0).sqrt()
        rtol = _RTOL.get(want.dtype, 1e-3)
        scale = float(want.max()) if want.numel() else 0.0
        err = (got - want).abs()
        floor = rtol * 1e-3 * whole.to(want.dtype)
        if bool((err > rtol * want + rtol * 1e-3 * scale + floor + 1e-30).any()):
            j = int(err.argmax())
            bad[n] = (
                f"the {plan.params[n].method} result disagreed with the per-example loop on "
                f"example {ks[j]} (gradient norm {float(got[j]):.6g} against "
                f"{float(want[j]):.6g})"
            )
    if not bad:
        plan.verified = True
        return []
    if strategy != "auto":
        n, why = next(iter(bad.items()))
        raise PerSampleError(
            f"torch_vjp.{fn}: strategy={strategy!r} gives wrong per-sample gradients for this "
            f"model: for {n!r}, {why}.\n"
            + (f"  The per-layer rule ({plan.params[n].how or 'its layer'}) does not "
               f"reproduce what each example computes alone: the model reorders or mixes "
               f"examples in a way the plan cannot see, or the layer's call is one the rule "
               f"cannot replay (a forward other than the stock one, say). "
               if plan.params[n].method == "rule" else
               "  vmap does not reproduce what each example computes alone (randomness "
               "drawn with a generator of the model's own, say). ")
            + "Fix: strategy='auto' (which routes such parameters to a strategy that is "
              "right) or strategy='loop'."
        )
    for n, why in bad.items():
        plan.route([n], why + "; rerouted")
    return list(bad)


_RTOL = {torch.float64: 1e-7, torch.float32: 1e-3, torch.float16: 3e-2, torch.bfloat16: 5e-2}


# ============================================================================================
# Public functions
# ============================================================================================


def per_sample_grads(
    model: nn.Module,
    loss_fn: Callable[..., Tensor],
    inputs: Tensor | Sequence[Tensor],
    targets: Any = None,
    *,
    params: Iterable[str] | None = None,
    strategy: PerSampleStrategyName = "auto",
    chunk_size: int | None = None,
) -> dict[str, Tensor]:
    """Per-sample gradients: one forward and backward of the batch plus per-layer rules.

    Entry ``[i]`` of each result equals the gradient of
    ``loss_fn(model(inputs[i:i+1]), targets[i:i+1])`` (or ``loss_fn(model(inputs[i:i+1]))``
    when ``targets`` is None): the gradient example ``i`` gives alone. With a mean-reduced
    loss this is the gradient of that example's own loss, not ``1/B`` of it.

    Args:
        model: the module; its parameters are the variables. It is not modified: parameters,
            buffers, train/eval flags and ``.grad`` are left as they were.
        loss_fn: ``loss_fn(output, targets) -> scalar`` (``loss_fn(output)`` when ``targets``
            is None), called as on a batch of one.
        inputs: a tensor, or a tuple of tensors passed as ``model(*inputs)``, each with the
            batch along dimension 0.
        targets: None, or a tensor (or pytree of tensors) with the batch along dimension 0.
        params: names (as in ``model.named_parameters()``) to differentiate; default every
            parameter that requires grad.
        strategy: ``"auto"`` (rules where every use of a parameter has one, ``"vmap"`` for the
            rest, ``"loop"`` where vmap fails), ``"hooks"`` (rules only; raises
            ``StrategyError`` naming the parameters without one), ``"vmap"``, or ``"loop"``.
        chunk_size: examples per vectorised chunk for ``"vmap"`` (and for the fallback of
            ``"auto"``), and per rule invocation for ``"hooks"``; None: all at once.

    Returns:
        ``dict[name, Tensor]``, each of shape ``(B, *param.shape)``, in the order of ``params``
        (or of ``model.named_parameters()``). Every result owns its memory. An empty batch
        gives ``(0, *param.shape)`` tensors.

    Raises:
        StrategyError: unknown strategy, or ``"hooks"`` for a parameter no rule covers.
        PerSampleError: a layer mixes examples (BatchNorm in training mode, attention across
            the batch); the message names the module and the fixes. Subclasses
            ``PerSampleValueError`` / ``PerSampleTypeError`` for malformed arguments.

    Examples:
        >>> import torch, torch_vjp as tv
        >>> model = torch.nn.Linear(3, 2).double()
        >>> x, y = torch.randn(4, 3, dtype=torch.float64), torch.tensor([0, 1, 1, 0])
        >>> loss_fn = torch.nn.CrossEntropyLoss()
        >>> g = tv.per_sample_grads(model, loss_fn, x, y)
        >>> g["weight"].shape
        torch.Size([4, 2, 3])
        >>> ref = torch.autograd.grad(loss_fn(model(x[2:3]), y[2:3]), model.weight)[0]
        >>> torch.allclose(g["weight"][2], ref)
        True
    """
    fn = "per_sample_grads"
    strategy, xs, batch, sel = _prepare(fn, model, inputs, targets, params, strategy)
    chunk = check_chunk_size(chunk_size, call=f"torch_vjp.{fn}", what="examples",
                             cls=PerSampleValueError)
    if batch == 0:
        return {n: sel.tensors[sel.key_of[n]].new_zeros((0, *sel.tensors[sel.key_of[n]].shape))
                for n in sel.names}
    plan = _plan(fn, model, loss_fn, xs, targets, sel, batch, strategy)
    with _buffers_kept(model, plan.mutable_buffers) as reset:
        while True:
            results = _grads(fn, model, loss_fn, xs, targets, sel, batch, strategy, chunk, plan,
                             reset)
            sq = {n: sq_norms_rows(g) for n, g in results.items()}
            if reset is not None:
                reset()
            if not _verify(fn, model, loss_fn, xs, targets, sel, batch, strategy, plan, sq,
                           reset):
                break
    return {n: results[sel.key_of[n]] for n in sel.names}


def _grads(fn, model, loss_fn, xs, targets, sel, batch, strategy, chunk, plan,
           reset=None) -> dict[str, Tensor]:
    """Per-sample gradients of every canonical parameter, under the plan."""
    if plan.rule_params:
        plan, res = _hooks(fn, model, loss_fn, xs, targets, sel, batch, strategy, plan)
    else:
        res = HooksResult()
    results: dict[str, Tensor] = {}
    with torch.no_grad():
        for n in plan.rule_params:
            if n in res.moved:
                continue
            p = sel.tensors[n]
            out = p.new_empty((batch, *p.shape))
            fs = res.factors.get(n)
            if fs:
                write_region(fs, out, chunk)
            else:
                out.zero_()
            results[n] = out
        for n in plan.zero_params:
            results[n] = sel.tensors[n].new_zeros((batch, *sel.tensors[n].shape))
    vmap_names, loop_names = _fallback_names(plan, res)
    if reset is not None:
        reset()
    results.update(_fallback(fn, "auto" if strategy == "hooks" else strategy, model, loss_fn,
                             xs, targets, sel, vmap_names, 0, batch, chunk,
                             plan.vmap_randomness, reset))
    results.update(_fallback(fn, "loop", model, loss_fn, xs, targets, sel, loop_names, 0,
                             batch, chunk, None, reset))
    return results


def _fallback_chunk(sel: Selection, names: list[str], batch: int) -> int:
    per_example = sum(sel.tensors[n].numel() for n in names)
    return max(1, min(batch, (CHUNK_ELEMENTS * 2) // max(1, per_example)))


def _norms_and_sums(
    fn: str, model: nn.Module, loss_fn: Callable, xs: tuple[Tensor, ...], targets: Any,
    sel: Selection, batch: int, strategy: str, max_norm: float | None, plan: Plan,
    reset: Callable[[], None] | None = None,
) -> tuple[Tensor, dict[str, Tensor] | None, dict[str, Tensor]]:
    """Per-sample gradient norms (and with ``max_norm`` the clipped sums), and each
    parameter's squared norms."""
    if plan.rule_params:
        plan, res = _hooks(fn, model, loss_fn, xs, targets, sel, batch, strategy, plan)
    else:
        res = HooksResult()
    like = next(iter(sel.tensors.values()))
    per_param: dict[str, Tensor] = {}
    with torch.no_grad():
        for n in plan.rule_params:
            if n in res.moved:
                continue
            fs = res.factors.get(n)
            if fs and len(fs) == 1 and fs[0].rows is None:  # the common case
                per_param[n] = fs[0].sq_norms(None)
            else:
                per_param[n] = (
                    region_sq_norms(fs, tuple(sel.tensors[n].shape), batch, like)
                    if fs else like.new_zeros(batch)
                )
        for n in plan.zero_params:
            per_param[n] = like.new_zeros(batch)
    sq = _total(per_param.values(), like, batch)
    sums: dict[str, Tensor] | None = {} if max_norm is not None else None
    vmap_names, loop_names = _fallback_names(plan, res)
    groups = [(names, method) for names, method in ((vmap_names, "vmap"), (loop_names, "loop"))
              if names]

    def chunked(names: list[str], method: str):
        step = _fallback_chunk(sel, names, batch)
        for s in range(0, batch, step):
            e = min(batch, s + step)
            if reset is not None:
                reset()
            g = _fallback(fn, "auto" if method == "vmap" else "loop", model, loss_fn, xs,
                          targets, sel, names, s, e, None,
                          plan.vmap_randomness if method == "vmap" else None, reset)
            yield s, e, g

    def add_sums(s: int, e: int, g: dict[str, Tensor]) -> None:
        c = _clip_factors(sq[s:e], max_norm)  # type: ignore[arg-type]
        for n, gn in g.items():
            w = torch.tensordot(c.to(gn.dtype), gn, dims=1)
            sums[n] = w if n not in sums else sums[n] + w  # type: ignore[index]

    # The clip factor of an example needs its full norm: with one fallback group it is
    # known chunk by chunk (the rules' part is known already); with two, the second group's
    # chunks come after the first's, so the sums take a second pass.
    for names, method in groups:
        for n in names:
            per_param[n] = like.new_zeros(batch)
        for s, e, g in chunked(names, method):
            with torch.no_grad():
                for n in names:
                    per_param[n][s:e] = sq_norms_rows(g[n])
                    sq[s:e] += per_param[n][s:e].to(sq.dtype)
                if sums is not None and len(groups) == 1:
                    add_sums(s, e, g)
            del g
    if sums is not None and len(groups) == 2:
        for names, method in groups:
            for s, e, g in chunked(names, method):
                with torch.no_grad():
                    add_sums(s, e, g)
    norms = sq.clamp_min_(0).sqrt()  # (ghost norms can round to a hair below zero)
    if sums is not None:
        c = _clip_factors(sq, max_norm)  # type: ignore[arg-type]
        with torch.no_grad():
            for n in plan.rule_params:
                fs = res.factors.get(n)
                if n in res.moved or not fs:
                    continue
                sums[n] = region_weighted_sum(fs, c, sel.tensors[n])
    return norms, sums, per_param


def _total(values: Iterable[Tensor], like: Tensor, batch: int) -> Tensor:
    """The sum of the parameters' squared norms, in a new tensor of ``like``'s dtype."""
    total = None
    for v in values:
        if total is None:
            total = v.to(like.dtype, copy=True)
        else:
            total.add_(v)
    return like.new_zeros(batch) if total is None else total


def _clip_factors(sq: Tensor, max_norm: float) -> Tensor:
    """``min(1, max_norm / ||g_i||)`` from the squared norms, 1 for a zero gradient."""
    return sq.rsqrt().mul_(max_norm).clamp_(max=1.0)


def per_sample_grad_norms(
    model: nn.Module,
    loss_fn: Callable[..., Tensor],
    inputs: Tensor | Sequence[Tensor],
    targets: Any = None,
    *,
    params: Iterable[str] | None = None,
    strategy: PerSampleStrategyName = "auto",
) -> Tensor:
    """L2 norms of the per-sample gradients over all selected parameters, ``(B,)``.

    With the hooks rules no per-sample gradient is formed: Linear layers use
    ``||a_i||^2 ||g_i||^2`` for 2-D inputs and the ghost-norm identity
    ``<a_i a_i^T, g_i g_i^T>`` over the sequence dimension when that is cheaper than forming
    ``g_i^T a_i``; Conv layers the same through unfold; Embedding an index_add over each
    example's distinct indices; normalisation layers their small per-sample gradients.

    Args:
        model: as for :func:`per_sample_grads`.
        loss_fn: as for :func:`per_sample_grads`.
        inputs: as for :func:`per_sample_grads`.
        targets: as for :func:`per_sample_grads`.
        params: as for :func:`per_sample_grads`.
        strategy: as for :func:`per_sample_grads`.

    Returns:
        A ``(B,)`` tensor: entry ``i`` is the L2 norm of example ``i``'s gradient, all selected
        parameters together (``(0,)`` for an empty batch).

    Raises:
        StrategyError, PerSampleError: as for :func:`per_sample_grads`.

    Examples:
        >>> import torch, torch_vjp as tv
        >>> model = torch.nn.Linear(3, 2).double()
        >>> x, y = torch.randn(4, 3, dtype=torch.float64), torch.tensor([0, 1, 1, 0])
        >>> loss_fn = torch.nn.CrossEntropyLoss()
        >>> norms = tv.per_sample_grad_norms(model, loss_fn, x, y)
        >>> g = tv.per_sample_grads(model, loss_fn, x, y)
        >>> ref = (g["weight"].flatten(1).norm(dim=1) ** 2 + g["bias"].norm(dim=1) ** 2).sqrt()
        >>> torch.allclose(norms, ref)
        True
    """
    norms, _, _ = _norms_run("per_sample_grad_norms", model, loss_fn, inputs, targets, params,
                             strategy, None)
    return norms


def _norms_run(fn, model, loss_fn, inputs, targets, params, strategy, max_norm):
    strategy, xs, batch, sel = _prepare(fn, model, inputs, targets, params, strategy)
    like = next(iter(sel.tensors.values()))
    if batch == 0:
        return like.new_zeros(0), ({} if max_norm is not None else None), sel
    plan = _plan(fn, model, loss_fn, xs, targets, sel, batch, strategy)
    with _buffers_kept(model, plan.mutable_buffers) as reset:
        while True:
            norms, sums, per_param = _norms_and_sums(fn, model, loss_fn, xs, targets, sel, batch,
                                                     strategy, max_norm, plan, reset)
            if reset is not None:
                reset()
            if not _verify(fn, model, loss_fn, xs, targets, sel, batch, strategy, plan,
                           per_param, reset):
                break
    return norms, sums, sel


def accumulate_clipped_grads(
    model: nn.Module,
    loss_fn: Callable[..., Tensor],
    inputs: Tensor | Sequence[Tensor],
    targets: Any = None,
    *,
    max_norm: float,
    params: Iterable[str] | None = None,
    strategy: PerSampleStrategyName = "auto",
) -> Tensor:
    """The DP-SGD step: adds ``sum_i min(1, max_norm / ||g_i||) g_i`` to each ``param.grad``.

    One forward and one backward pass where the rules cover the layers (book-keeping, Bu et
    al., ICML 2023): the activations and output gradients of that pass give the norms, then
    each layer's clipped sum ``sum_i c_i g_i^T a_i`` is one matrix product. Per-sample
    gradients are formed only for parameters that no rule covers (by vmap, in chunks).

    Args:
        model: as for :func:`per_sample_grads`.
        loss_fn: as for :func:`per_sample_grads`.
        inputs: as for :func:`per_sample_grads`.
        targets: as for :func:`per_sample_grads`.
        params: as for :func:`per_sample_grads`; each must require grad (this adds to
            ``.grad``, as ``backward`` does, and backward never gives a tensor that does not
            require grad a ``.grad``).
        strategy: as for :func:`per_sample_grads`.
        max_norm: each example's gradient is scaled to L2 norm at most ``max_norm`` (over all
            selected parameters together) before the sum.

    Returns:
        The ``(B,)`` per-sample gradient norms before clipping. An empty batch (Poisson
        sampling draws them) adds nothing: a ``.grad`` that is None becomes zeros, as
        ``backward`` of a loss over no examples gives, and ``(0,)`` is returned.

    Raises:
        StrategyError, PerSampleError: as for :func:`per_sample_grads`; PerSampleValueError
            for a ``max_norm`` that is not a positive finite number, or a selected parameter
            that does not require grad.

    Examples:
        >>> import torch, torch_vjp as tv
        >>> model = torch.nn.Linear(3, 2).double()
        >>> x, y = torch.randn(4, 3, dtype=torch.float64), torch.tensor([0, 1, 1, 0])
        >>> loss_fn = torch.nn.CrossEntropyLoss()
        >>> g = tv.per_sample_grads(model, loss_fn, x, y)
        >>> norms = tv.accumulate_clipped_grads(model, loss_fn, x, y, max_norm=0.1)
        >>> c = (0.1 / norms).clamp(max=1.0)
        >>> torch.allclose(model.weight.grad, torch.einsum("b,bij->ij", c, g["weight"]))
        True
    """
    fn = "accumulate_clipped_grads"
    max_norm = check_max_norm(fn, max_norm)
    if isinstance(model, nn.Module):
        _check_trainable(fn, model, params)
    norms, sums, sel = _norms_run(fn, model, loss_fn, inputs, targets, params, strategy,
                                  max_norm)
    assert sums is not None
    sparse = sel.sparse
    with torch.no_grad():
        for n, p in sel.tensors.items():
            s = sums.get(n)
            if s is None:
                s = torch.zeros_like(p)
            if s.dtype != p.dtype:
                s = s.to(p.dtype)
            if s.shape != p.shape:
                s = s.reshape(p.shape)
            if sparse and id(p) in sparse:
                s = s.to_sparse()
            if p.grad is None:
                p.grad = s
            elif p.grad.layout != s.layout:
                p.grad = p.grad + s
            else:
                p.grad.add_(s)
    return norms


def _check_trainable(fn: str, model: nn.Module, params: Any) -> None:
    if params is None:
        return
    named = dict(model.named_parameters(remove_duplicate=False))
    names = [params] if isinstance(params, str) else params
    try:
        names = list(names)
    except TypeError:
        return  # select() reports it
    for n in names:
        t = named.get(n) if isinstance(n, str) else None
        if t is not None and not t.requires_grad:
            raise PerSampleValueError(
                f"torch_vjp.{fn}: params names {n!r}, which does not require grad. This call "
                f"adds the clipped gradients to .grad, as backward does, and backward never "
                f"gives a tensor that does not require grad a .grad (an optimizer would then "
                f"move a frozen parameter).\n  Fix: leave {n!r} out of params, or set its "
                f"requires_grad to True if it is meant to train; per_sample_grad_norms and "
                f"per_sample_grads accept it."
            )


def _sparse_tables(model: nn.Module) -> set[int]:
    """ids of the weights of Embedding layers with ``sparse=True`` (whose ``.grad`` backward
    makes sparse)."""
    return {
        id(m.weight) for m in model.modules()
        if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and getattr(m, "sparse", False)
    }


# ============================================================================================
# The plan, shown; rules, added
# ============================================================================================


@dataclass(frozen=True)
class PerSamplePlanRow:
    """One parameter of a :class:`PerSamplePlan`."""

    name: str
    method: str
    how: str
    reason: str


class PerSamplePlan:
    """Which parameter a per-sample call computes how, and why (see
    :func:`per_sample_plan`).

    Attributes:
        rows: one :class:`PerSamplePlanRow` per selected parameter: ``method`` is
            ``"rule"`` (per-layer rules, ``how`` names them), ``"vmap"``, ``"loop"`` or
            ``"zero"`` (no gradient reaches it); ``reason`` says why a parameter is not
            computed by rules.
        mixing: where the model mixes examples, or None.
        strategy: the strategy planned for.
    """

    def __init__(self, plan: Plan, names: Sequence[str], key_of: dict[str, str]):
        self.strategy = plan.strategy
        self.mixing = plan.mixing
        self.rows = [
            PerSamplePlanRow(n, plan.params[key_of[n]].method, plan.params[key_of[n]].how,
                             plan.params[key_of[n]].reason)
            for n in names
        ]

    def __getitem__(self, name: str) -> PerSamplePlanRow:
        if not isinstance(name, str):
            raise TypeError(
                f"PerSamplePlan is indexed by parameter name (a str), got "
                f"{type(name).__name__}; iterate over the plan (or plan.rows) for the rows"
            )
        for r in self.rows:
            if r.name == name:
                return r
        raise KeyError(name)

    def __iter__(self) -> Iterator[PerSamplePlanRow]:
        return iter(self.rows)

    def __len__(self) -> int:
        return len(self.rows)

    def __str__(self) -> str:
        head = f"per-sample plan (strategy={self.strategy!r})"
        if self.mixing:
            head += f"; {self.mixing} mixes examples: rules and 'auto' refuse this model"
        width = max([len(r.name) for r in self.rows] + [9])
        lines = [head, f"{'parameter':<{width}}  method  how / why"]
        for r in self.rows:
            lines.append(f"{r.name:<{width}}  {r.method:<6}  {r.how or r.reason}")
        return "\n".join(lines)

    __repr__ = __str__


def per_sample_plan(
    model: nn.Module,
    loss_fn: Callable[..., Tensor],
    inputs: Tensor | Sequence[Tensor],
    targets: Any = None,
    *,
    params: Iterable[str] | None = None,
    strategy: PerSampleStrategyName = "auto",
) -> PerSamplePlan:
    """Which parameter the per-sample functions compute how (rules, vmap, the loop), and why.

    Builds (or reuses) the plan those functions use for this model structure: from the data
    flow of one batch it finds, for every layer call that has a rule, the dimension that
    holds the examples, and for every parameter whether all its uses are such calls (NOTE
    [the per-sample plan]). Nothing of the model changes.

    Args:
        model: as for :func:`per_sample_grads`.
        loss_fn: as for :func:`per_sample_grads`.
        inputs: as for :func:`per_sample_grads` (a batch of at least two examples shows the
            most).
        targets: as for :func:`per_sample_grads`.
        params: as for :func:`per_sample_grads`.
        strategy: as for :func:`per_sample_grads`.

    Returns:
        A :class:`PerSamplePlan`; ``str(plan)`` is a table.

    Example:
        >>> import torch, torch_vjp as tv
        >>> model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(),
        ...                             torch.nn.Linear(4, 2))
        >>> plan = tv.per_sample_plan(model, torch.nn.MSELoss(), torch.randn(8, 3),
        ...                           torch.randn(8, 2))
        >>> plan["0.weight"].method, plan["0.weight"].how
        ('rule', "Linear rule in '0'")
    """
    fn = "per_sample_plan"
    strategy, xs, batch, sel = _prepare(fn, model, inputs, targets, params, strategy)
    if batch == 0:
        raise PerSampleValueError(
            f"torch_vjp.{fn}: the batch is empty (inputs[0] has shape "
            f"{shape_str(xs[0].shape)}); a plan is found from at least one example."
        )
    plan = plan_for(fn, model, loss_fn, xs, targets, sel, batch, strategy)
    return PerSamplePlan(plan, sel.names, sel.key_of)


def register_per_sample_rule(
    module_type: type[nn.Module],
    rule: Callable[..., dict[Any, Tensor]] | None = None,
    *,
    batch_dims: Callable[[Tensor], Sequence[int]] | None = None,
) -> Any:
    """Registers a per-layer rule for a module type of your own (usable as a decorator).

    The rule computes the per-sample gradients of the layer's own parameters from what one
    ordinary forward and backward pass of the batch gives: ``rule(module, inputs,
    grad_output)`` receives the layer, its positional inputs (a tuple) and the gradient of
    the examples' own losses with respect to its (first) output, each with the examples
    along dimension 0, and returns ``{parameter or its attribute name: (B, *param.shape)}``.
    With a rule registered, ``strategy="auto"`` and ``"hooks"`` compute the layer's
    parameters in the one pass instead of with vmap; the plan still checks, from the data
    flow, that the layer's rows belong to single examples, and the first result against the
    per-example loop.

    Args:
        module_type: the ``nn.Module`` subclass (its subclasses get the rule too).
        rule: the function; omit it to use this as a decorator.
        batch_dims: ``batch_dims(x)`` gives the dimensions of the layer's first input that
            may hold the examples (default: dimension 0).

    Returns:
        ``rule`` (or, as a decorator, a function that registers and returns it).

    Raises:
        PerSampleTypeError: ``module_type`` is not an ``nn.Module`` subclass, or ``rule``
            cannot be called as ``rule(module, inputs, grad_output)``.

    Example:
        >>> import torch, torch_vjp as tv
        >>> class Scale(torch.nn.Module):                 # y = x * w, elementwise
        ...     def __init__(self, n):
        ...         super().__init__()
        ...         self.w = torch.nn.Parameter(torch.ones(n))
        ...     def forward(self, x):
        ...         return x * self.w
        >>> @tv.register_per_sample_rule(Scale)
        ... def scale_rule(module, inputs, grad_output):
        ...     (x,) = inputs                             # (B, n), like grad_output
        ...     return {"w": x * grad_output}
        >>> model = torch.nn.Sequential(Scale(3), torch.nn.Linear(3, 1)).double()
        >>> x = torch.randn(5, 3, dtype=torch.float64)
        >>> tv.per_sample_plan(model, lambda o: o.sum(), x)["0.w"].method
        'rule'
        >>> g = tv.per_sample_grads(model, lambda o: o.sum(), x, strategy="hooks")
        >>> ref = tv.per_sample_grads(model, lambda o: o.sum(), x, strategy="loop")
        >>> torch.allclose(g["0.w"], ref["0.w"])
        True
    """

    def register(fn: Callable[..., Any]) -> Callable[..., Any]:
        register_user_rule(module_type, fn, batch_dims)
        forget_plans()
        return fn

    if rule is None:
        return register
    return register(rule)


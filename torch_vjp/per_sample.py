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

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn

from torch_vjp._engine.compiled import check_compile, tracing
from torch_vjp._engine.memory import check_chunk_size
from torch_vjp._errors import PerSampleTypeError, PerSampleValueError, shape_str
from torch_vjp._per_sample.args import check_max_norm, check_trainable, params_once
from torch_vjp._per_sample.compiled import compilable, run_compiled, run_traced
from torch_vjp._per_sample.distributed import failure_shared
from torch_vjp._per_sample.factors import sq_norms_rows
from torch_vjp._per_sample.plan import Plan, parametrize_cache_off
from torch_vjp._per_sample.probe import forget_plans, plan_for
from torch_vjp._per_sample.registry import register_user_rule
from torch_vjp._per_sample.run import (
    BuffersKept,
    add_to_grads,
    grads,
    norms_and_sums,
    param_sums,
    plan_of,
    prepare,
)
from torch_vjp._per_sample.verify import checked, verify
from torch_vjp._strategies import PerSampleStrategyName

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
# Public functions
# ============================================================================================


@parametrize_cache_off
def per_sample_grads(
    model: nn.Module,
    loss_fn: Callable[..., Tensor],
    inputs: Tensor | Sequence[Tensor],
    targets: Any = None,
    *,
    params: Iterable[str] | None = None,
    strategy: PerSampleStrategyName = "auto",
    chunk_size: int | None = None,
    compile: bool = False,
) -> dict[str, Tensor]:
    """Per-sample gradients: one forward and backward of the batch plus per-layer rules.

    Entry ``[i]`` of each result equals the gradient of
    ``loss_fn(model(inputs[i:i+1]), targets[i:i+1])`` (or ``loss_fn(model(inputs[i:i+1]))``
    when ``targets`` is None): the gradient example ``i`` gives alone. With a mean-reduced
    loss this is the gradient of that example's own loss, not ``1/B`` of it.

    Args:
        model: the module; its parameters are the variables. It is not modified: parameters,
            buffers, train/eval flags and ``.grad`` are left as they were. Python state its
            forward keeps (a step counter attribute, ``self.steps += 1``) moves with the
            forwards that compute the result: once per call under ``"hooks"``, ``"vmap"``
            (once per chunk with ``chunk_size``) and ``"auto"``, once per example under
            ``"loop"``; the forwards that plan the computation and check it against the
            per-example loop put back the int and float attributes of the model's modules.
        loss_fn: ``loss_fn(output, targets) -> scalar`` (``loss_fn(output)`` when ``targets``
            is None), called as on a batch of one.
        inputs: a tensor, or a tuple of tensors passed as ``model(*inputs)``, each with the
            batch along dimension 0 (a None among them, an optional argument left out, is
            passed to every call as it is).
        targets: None, or a tensor (or pytree of tensors) with the batch along dimension 0.
        params: names (as in ``model.named_parameters()``) to differentiate; default every
            parameter that requires grad.
        strategy: ``"auto"`` (rules where every use of a parameter has one, ``"vmap"`` for the
            rest, ``"loop"`` where vmap fails), ``"hooks"`` (rules only; raises
            ``StrategyError`` naming the parameters without one), ``"vmap"``, or ``"loop"``.
        chunk_size: examples per vectorised chunk for ``"vmap"`` (and for the fallback of
            ``"auto"``), and per rule invocation for ``"hooks"``; None: all at once.
        compile: compute with a program compiled by ``torch.compile`` (the ``"vmap"``
            computation, vmap of grad), once per model, options and batch signature, and
            reused; the first call of a signature also runs eagerly (``strategy``) and the
            two results are compared, and a signature that cannot be compiled stays eager
            with a one-time JacobianWarning (see the docs page "Per-sample gradients").
            An empty batch, a DistributedDataParallel model and a sparse Embedding run
            eagerly.

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
    params = params_once(params)
    do_compile = check_compile(compile, call=f"torch_vjp.{fn}", cls=PerSampleValueError)
    if tracing():  # NOTE [compiled Jacobians] (None: the job runs eagerly)
        traced = run_traced("grads", fn, model, loss_fn, inputs, targets, params, strategy,
                            check_chunk_size(chunk_size, call=f"torch_vjp.{fn}",
                                             what="examples", cls=PerSampleValueError))
        if traced is not None:
            return traced
    job = prepare(fn, model, loss_fn, inputs, targets, params, strategy)
    chunk = check_chunk_size(chunk_size, call=f"torch_vjp.{fn}", what="examples",
                             cls=PerSampleValueError)
    if do_compile and compilable(job) and not tracing():
        return _own_tensors(run_compiled("grads", job, chunk, None, lambda: per_sample_grads(
            model, loss_fn, inputs, targets, params=params, strategy=strategy,
            chunk_size=chunk_size)))
    sel = job.sel
    if job.batch == 0:
        return {n: sel.tensors[sel.key_of[n]].new_zeros((0, *sel.tensors[sel.key_of[n]].shape))
                for n in sel.names}
    plan = plan_of(job)
    with BuffersKept(job, plan):
        while True:
            results, one_run = grads(job, plan, chunk)
            if job.reset is not None:
                job.reset()
            plan, job.replanned = job.replanned or plan, None  # (made anew by the call)
            if checked(plan, one_run):
                break
            sq = {n: sq_norms_rows(g) for n, g in results.items()}
            if not verify(job, plan, sq, one_run):
                break
    return _own_tensors({n: results[sel.key_of[n]] for n in sel.names})


def _own_tensors(grads: dict[str, Tensor]) -> dict[str, Tensor]:
    """Each name's result in memory of its own: names of one tied parameter (an embedding
    and the output head that shares it) would otherwise hold one tensor, and an in-place
    change through one name (clipping each entry in a loop) would change the other."""
    seen: set[object] = set()
    out = {}
    for n, g in grads.items():
        where = (g.data_ptr(), tuple(g.shape), g.stride(), g.dtype) if g.numel() else id(g)
        out[n] = g.clone() if where in seen else g
        seen.add(where)
    return out


@parametrize_cache_off
def per_sample_grad_norms(
    model: nn.Module,
    loss_fn: Callable[..., Tensor],
    inputs: Tensor | Sequence[Tensor],
    targets: Any = None,
    *,
    params: Iterable[str] | None = None,
    strategy: PerSampleStrategyName = "auto",
    compile: bool = False,
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
        compile: as for :func:`per_sample_grads`; the norms are computed in the compiled
            program from the per-sample gradients, which it forms.

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
    fn = "per_sample_grad_norms"
    params = params_once(params)
    if tracing():  # NOTE [compiled Jacobians] (None: the job runs eagerly)
        check_compile(compile, call=f"torch_vjp.{fn}", cls=PerSampleValueError)
        traced = run_traced("norms", fn, model, loss_fn, inputs, targets, params, strategy)
        if traced is not None:
            return traced
    if check_compile(compile, call=f"torch_vjp.{fn}", cls=PerSampleValueError) and not tracing():
        job = prepare(fn, model, loss_fn, inputs, targets, params, strategy)
        if compilable(job):
            return run_compiled("norms", job, None, None, lambda: _norms_run(
                fn, model, loss_fn, inputs, targets, params, strategy, None)[0])
    norms, _, _ = _norms_run(fn, model, loss_fn, inputs, targets, params, strategy, None)
    return norms


def _norms_run(
    fn: str, model: Any, loss_fn: Any, inputs: Any, targets: Any, params: Any, strategy: Any,
    max_norm: float | None,
) -> tuple[Tensor, dict[str, Tensor] | None, Any]:
    job = prepare(fn, model, loss_fn, inputs, targets, params, strategy)
    like = next(iter(job.sel.tensors.values()))
    if job.batch == 0:
        return like.new_zeros(0), ({} if max_norm is not None else None), job
    plan = plan_of(job)
    with BuffersKept(job, plan):
        while True:
            norms, sums, per_param = norms_and_sums(job, plan, max_norm)
            if job.reset is not None:
                job.reset()
            plan, job.replanned = job.replanned or plan, None  # (made anew by the call)
            if not verify(job, plan, per_param):
                break
    return norms, sums, job


@parametrize_cache_off
def accumulate_clipped_grads(
    model: nn.Module,
    loss_fn: Callable[..., Tensor],
    inputs: Tensor | Sequence[Tensor],
    targets: Any = None,
    *,
    max_norm: float,
    params: Iterable[str] | None = None,
    strategy: PerSampleStrategyName = "auto",
    compile: bool = False,
) -> Tensor:
    """The DP-SGD step: adds ``sum_i min(1, max_norm / ||g_i||) g_i`` to each ``param.grad``.

    One forward and one backward pass where the rules cover the layers (book-keeping, Bu et
    al., ICML 2023): the activations and output gradients of that pass give the norms, then
    each layer's clipped sum ``sum_i c_i g_i^T a_i`` is one matrix product. Per-sample
    gradients are formed only for parameters that no rule covers (by vmap, in chunks), and
    where a layer's norms are cheapest from them (then kept for its sum, up to a fixed
    budget of 4M numbers in all, instead of a second weight gradient). Each parameter's
    ``register_post_accumulate_grad_hook`` hooks run once its ``.grad`` is written, as after
    ``backward``.

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
        compile: as for :func:`per_sample_grads`: the compiled program computes the norms,
            clip factors and clipped sums (from per-sample gradients, which it forms), and
            the sums are added to ``.grad`` eagerly, as without it.

    Returns:
        The ``(B,)`` per-sample gradient norms before clipping. An empty batch (Poisson
        sampling draws them) adds nothing: a ``.grad`` that is None becomes zeros, as
        ``backward`` of a loss over no examples gives, and ``(0,)`` is returned.

    Raises:
        StrategyError, PerSampleError: as for :func:`per_sample_grads`; PerSampleValueError
            for a ``max_norm`` that is not a positive finite number, or a selected parameter
            that does not require grad.
        PerSampleError: for a model wrapped in DistributedDataParallel (outside ``no_sync``),
            on every rank but those that failed, when another rank of its group failed while
            computing its clipped sums (NOTE [DDP]); the failing ranks raise their own error.

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
    params = params_once(params)
    do_compile = check_compile(compile, call=f"torch_vjp.{fn}", cls=PerSampleValueError)
    max_norm = check_max_norm(fn, max_norm)
    if isinstance(model, nn.Module):
        check_trainable(fn, model, params)
    if tracing():  # NOTE [compiled Jacobians] (None: the job runs eagerly)
        traced = run_traced("clipped", fn, model, loss_fn, inputs, targets, params, strategy,
                            max_norm=max_norm)
        if traced is not None:
            return traced
    # (under DDP, an error on one rank reaches the others before the reducer's all-reduce)
    with failure_shared(fn, model, strategy):
        done = None
        if do_compile and not tracing():
            job = prepare(fn, model, loss_fn, inputs, targets, params, strategy)
            if compilable(job):
                def eager() -> tuple[Tensor, dict[str, Tensor]]:
                    norms, sums, _ = _norms_run(fn, model, loss_fn, inputs, targets, params,
                                                strategy, max_norm)
                    return norms, param_sums(job, sums or {})

                done = run_compiled("clipped", job, None, max_norm, eager)
        if done is None:
            norms, sums, job = _norms_run(fn, model, loss_fn, inputs, targets, params,
                                          strategy, max_norm)
        else:
            norms, sums = done
    assert sums is not None
    add_to_grads(job, sums)
    return norms


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
            ``"zero"`` (no gradient reaches it), and under ``strategy="hooks"``
            ``"refused"`` for a parameter no rule covers (the per-sample functions raise
            StrategyError for it); ``reason`` says why a parameter is not computed by
            rules.
        mixing: where the model mixes examples, or None.
        strategy: the strategy planned for.
        one_run: under ``"auto"``, some parameters go to rules and others to vmap:
            :func:`per_sample_grads` then computes all of them with vmap in one run of the
            model (its result is ``B x P`` either way), while the norms and the clipped step
            keep the rules.
    """

    def __init__(self, plan: Plan, names: Sequence[str], key_of: dict[str, str]):
        self.strategy = plan.strategy
        self.mixing = plan.mixing
        methods = {p.method for p in plan.params.values()}
        self.one_run = (plan.strategy == "auto" and "rule" in methods and "vmap" in methods
                        and plan.vmap_randomness is not None)
        # (strategy='hooks' never falls back: what no rule covers, it refuses)
        refused = ("vmap", "loop") if plan.strategy == "hooks" else ()
        self.rows = [
            PerSamplePlanRow(n, "refused" if p.method in refused else p.method, p.how,
                             p.reason)
            for n in names for p in (plan.params[key_of[n]],)
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
        if self.one_run:
            lines.append("(per_sample_grads computes the 'rule' parameters with vmap too: the "
                         "model runs under vmap anyway, and one run is faster than two)")
        return "\n".join(lines)

    __repr__ = __str__


@parametrize_cache_off
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
    params = params_once(params)
    job = prepare(fn, model, loss_fn, inputs, targets, params, strategy)
    if job.batch == 0:
        k, x = next((k, x) for k, x in enumerate(job.xs) if x is not None)
        raise PerSampleValueError(
            f"torch_vjp.{fn}: the batch is empty (inputs[{k}] has shape "
            f"{shape_str(x.shape)}); a plan is found from at least one example."
        )
    plan = plan_for(job)
    return PerSamplePlan(plan, job.sel.names, job.sel.key_of)


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
            may hold the examples, a sequence of ints or one int (negative ones count from
            the end); default: dimension 0.

    Returns:
        ``rule`` (or, as a decorator, a function that registers and returns it).

    Raises:
        PerSampleTypeError: ``module_type`` is not an ``nn.Module`` subclass, or ``rule``
            cannot be called as ``rule(module, inputs, grad_output)``.

    A rule declines a call it cannot compute (a configuration of the layer it does not
    cover) by raising ``NotImplementedError``: under ``"auto"`` that call's parameters are
    computed by vmap or the loop instead, and ``"hooks"`` raises ``tv.StrategyError`` with
    the rule's message. Any other exception the rule raises reaches the caller of the
    per-sample function as it is (not wrapped; strategy ``"auto"`` does not hide it behind
    vmap), with a note (``__notes__``) naming the rule and the layer.

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


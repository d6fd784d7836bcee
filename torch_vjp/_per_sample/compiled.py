"""``compile=True`` for the per-sample functions: the vmap-of-grad computation of every
selected parameter, compiled once per model, options and batch signature (NOTE [compiled
Jacobians] in :mod:`torch_vjp._engine.compiled`, whose cache, first-call check and eager
fallback this uses).

The compiled program is the ``"vmap"`` strategy's (``torch.func.vmap`` of ``grad`` of the
model called functionally on one example), followed, for the norms and the clipped step, by
the norms, the clip factors and the clipped sums: torch.compile fuses those with the
per-sample gradients. The eager call (any strategy) runs first and checks every argument;
its result and the compiled one are compared on the first call of a signature. The model's
parameters are read inside the program, so an optimizer's in-place updates are seen without
recompiling. The loss function is an argument of the program, keyed as a closure is
(:func:`~torch_vjp._engine.compile_key.held_key`): a loss module made for each batch runs the
same program. What runs eagerly: an empty batch, a model wrapped in DistributedDataParallel,
and a sparse Embedding (its sparse gradient has no compiled form here).

Inside the user's own ``torch.compile``, the per-sample functions return the same program's
result (:func:`run_traced`), traced by the user's compile, as the Jacobian functions return
their plain forms (NOTE [compiled Jacobians]).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import grad, vmap
from torch.nn.utils.stateless import _reparametrize_module
from torch.utils._pytree import tree_map

from torch_vjp._engine.compiled import compiled_call
from torch_vjp._per_sample.args import Job
from torch_vjp._per_sample.fallback import functional_state
from torch_vjp._per_sample.losses import call_loss, scalar_loss, targets_in_dims
from torch_vjp._per_sample.norms_wide import wide_sq_rows
from torch_vjp._per_sample.run import add_to_grads, clip_factors, prepare

__all__ = ["compilable", "run_compiled", "run_traced"]


def compilable(job: Job) -> bool:
    """Whether the job can take the compiled path (else it runs eagerly, silently: see the
    module docstring). A parameter with a gradient hook takes the loop (NOTE [gradient hooks
    on a parameter] in :mod:`torch_vjp._per_sample.probe`)."""
    return (job.batch > 0 and job.ddp is None and not job.sel.sparse
            and not any(t._backward_hooks for t in job.sel.tensors.values()))


def run_compiled(
    kind: str, job: Job, chunk: int | None, max_norm: float | None, eager: Callable[[], Any]
) -> Any:
    """The compiled result of ``kind`` (``"grads"``: the named dict; ``"norms"``: ``(B,)``;
    ``"clipped"``: ``(norms, sums)`` with the sums by canonical name, not yet added)."""
    sel = job.sel
    options = (kind, tuple(sel.names), job.strategy, chunk, sel.training,
               tuple(map(id, sel.tensors.values())))
    # (the bound an argument, a 0-d tensor: adaptive clipping sets it anew each step, and
    # a constant of the program compiled one program per value)
    bound = None
    if max_norm is not None:
        like = next(iter(sel.tensors.values()))
        bound = torch.tensor(max_norm, device=like.device,
                             dtype=torch.float64 if like.dtype == torch.float64 else None)
    return compiled_call(f"torch_vjp.{job.fn}", job.model, options,
                         (job.xs, job.targets, bound), eager,
                         lambda: _program(kind, job, chunk), passed=(job.loss_fn,))


def run_traced(
    kind: str, fn: str, model: Any, loss_fn: Any, inputs: Any, targets: Any, params: Any,
    strategy: Any, chunk: int | None = None, max_norm: float | None = None,
) -> Any:
    """A per-sample function inside the user's own ``torch.compile`` (NOTE [compiled
    Jacobians]): the plain program that ``compile=True`` compiles, traced by the user's
    compile, after the eager path's argument checks. The eager computation (plans, hooks,
    rules, checks) is Python that dynamo cannot trace. ``kind`` as for :func:`run_compiled`;
    ``"clipped"`` adds the sums to ``.grad`` and returns the norms. None where the job takes
    no compiled path (the module docstring): the caller runs the eager path then."""
    job = prepare(fn, model, loss_fn, inputs, targets, params, strategy)
    if not compilable(job):
        return None
    out = _program(kind, job, chunk)(job.model, job.xs, job.targets, max_norm, job.loss_fn)
    if kind == "grads":  # (each name its own tensor, as the eager result: tied parameters)
        seen: set[int] = set()
        own = {}
        for n, g in out.items():
            own[n] = g.clone() if id(g) in seen else g
            seen.add(id(g))
        return own
    if kind == "clipped":
        add_to_grads(job, out[1])
        return out[0]
    return out


def _program(kind: str, job: Job, chunk: int | None) -> Callable[..., Any]:
    fn, sel = job.fn, job.sel
    keys = list(sel.tensors)
    names, key_of = list(sel.names), dict(sel.key_of)

    # (compiled_call passes the model first: the same object, its identity is in the key;
    # the program reads it from there, so that the cache does not keep the model alive; the
    # loss function last, keyed as a closure is, so that a loss made for each batch, or a
    # lambda over per-batch weights, runs the same program; the clipping bound before it)
    def program(model: nn.Module, xs: tuple[Tensor, ...], targets: Any,
                max_norm: Tensor | float | None, loss_fn: Any) -> Any:
        def one(d: dict[str, Tensor], state: dict[str, Any], xi: tuple[Tensor, ...],
                ti: Any) -> Tensor:
            ti = tree_map(lambda z: z.unsqueeze(0) if isinstance(z, Tensor) else z, ti)
            # (the loss inside the substitution, as torch.func.functional_call's forward: a
            # loss that reads a parameter through the model, an L2 term on
            # model.fc.weight, reads the tensor differentiated; read after it, the
            # parameter itself, that term's gradient was left out)
            with _reparametrize_module(model, {**state, **d}, tie_weights=True, strict=False):
                out = model(*(None if x is None else x.unsqueeze(0) for x in xi))
                return scalar_loss(fn, call_loss(loss_fn, out, ti))

        state = functional_state(model)
        diff = {k: state.pop(k) for k in keys}
        # (an input None, an optional argument left out, is passed to every call as it is)
        in_dims = (None, None, tuple(None if x is None else 0 for x in xs),
                   targets_in_dims(targets))
        per_sample = vmap(grad(one), in_dims=in_dims, randomness="different",
                          chunk_size=chunk)(diff, state, xs, targets)
        if kind == "grads":
            return {n: per_sample[key_of[n]] for n in names}
        # (squared norms, their total and the clip factors in float64, sync-free: NOTE
        # [norms past the square] in norms_wide; in the parameters' real dtype, a float32
        # norm above 1.8e19 was inf and its example dropped from the clipped sum)
        real = next(iter(per_sample.values())).real.dtype
        sq = sum(wide_sq_rows(g) for g in per_sample.values())
        norms = sq.sqrt().to(real)
        if kind == "norms":
            return norms
        factors = clip_factors(sq, max_norm)  # type: ignore[arg-type]  (None: not here)
        factors = factors.to(real)
        sums = {k: torch.einsum("b,b...->...", factors, g) for k, g in per_sample.items()}
        return norms, sums

    return program

"""Per-sample gradients of a model wrapped for data-parallel training.

NOTE [DDP]
A model wrapped in ``DistributedDataParallel`` is computed on its ``.module``: each rank's
per-sample gradients and norms are those of its own examples. The one communication before
them is DDP's own first step: where DDP broadcasts buffers before its forward
(``broadcast_buffers=True`` and the model has buffers), rank 0's buffers (BatchNorm's running
statistics) are broadcast first, as a forward of the DDP model does, so that every rank
computes with the statistics its DDP forward would use; like that forward, every rank of the
group must then make the call (a call on one rank alone waits for the others). The
clipped step adds the rank's clipped sum to ``.grad`` through DDP's own machinery: a pass of
DDP's forward whose module returns ``sum_p <p, s_p>`` (``s_p`` the rank's clipped sum of
parameter ``p``), then its backward. The gradient of that sum is exactly ``s_p``, accumulated
into ``.grad`` as backward accumulates, and DDP's reducer then does what it does after every
backward: all-reduces ``.grad`` in its buckets (with a registered communication hook, if
any) and divides by the world size, so ``.grad`` is the same on every rank: the clipped
per-example sum over the whole global batch divided by the world size (DDP's convention for
gradients). Under ``ddp.no_sync()`` the reducer stays out, and the sums accumulate on each
rank until the next synchronised step, as DDP's gradient accumulation does (but the pass's
forward still broadcasts the buffers where DDP's next forward would: the first ``no_sync``
step after a synchronised one, on a model with buffers). A rank with no
example (Poisson sampling) still takes part, with zero sums. The forward of the wrapped
module is not run by that pass, only DDP's book-keeping (its buffer broadcast included).

Before that pass, where the reducer will all-reduce (outside ``no_sync``) or the pass will
broadcast buffers, one ``all_reduce`` (MAX) of a status flag over DDP's process group tells
every rank whether some rank failed while computing its norms and sums (a target out of
range in its own examples): then every rank raises (the failing ranks their own error, the
others a ``PerSampleError`` naming the rank and quoting its error), and none waits for ever
in the reducer's all-reduce, or the broadcast, for a rank that will not come. (The
arguments are checked before any exchange: the same on every rank. Not inside
``ddp.join()``, whose joined ranks shadow DDP's own collectives only.)
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.modules.module as _module_mod
from torch import Tensor, nn

from torch_vjp._engine.compiled import tracing
from torch_vjp._errors import (
    PerSampleError,
    PerSampleTypeError,
    PerSampleValueError,
    failing_rank,
)
from torch_vjp._sharded import all_max, comm_device
from torch_vjp._strategies import get_per_sample_strategy

__all__ = ["unwrap", "strip_prefix", "ddp_add_to_grads", "failure_shared"]

_FSDP_TYPES: dict[type, bool] = {}


def _is_fsdp(model: nn.Module) -> bool:
    kind = type(model)
    known = _FSDP_TYPES.get(kind)
    if known is None:  # once per class: the walk over the MRO costs more than the call
        known = any(
            f"{cls.__module__}.{cls.__qualname__}".startswith("torch.distributed.fsdp")
            or cls.__name__.startswith("FSDP")
            for cls in kind.__mro__
        )
        if len(_FSDP_TYPES) < 1024:
            _FSDP_TYPES[kind] = known
    return known


def _compiled_inner(model: nn.Module) -> Any:
    """``model._orig_mod`` (torch.compile registers the module it compiled as a submodule),
    or None; read from ``_modules`` where that is a dict, which spares Module.__getattr__'s
    failed lookup on every other module."""
    mods = model.__dict__.get("_modules")
    if type(mods) is dict:
        return mods.get("_orig_mod")
    return getattr(model, "_orig_mod", None)


def unwrap(fn: str, model: Any) -> tuple[Any, Any, str]:
    """``(module to compute on, the DDP wrapper or None, the prefix the wrappers add to
    parameter names)``. ``torch.compile(model)`` is computed on the module it compiled (the
    per-sample computation runs its own forward passes, hooks and vmap, eagerly), and DDP as
    NOTE [DDP] says, in either order; the wrappers that are not supported are refused,
    naming what is."""
    ddp = None
    prefix = ""
    while True:
        if isinstance(model, nn.parallel.DistributedDataParallel):
            if model._forward_hooks or model._forward_pre_hooks:
                # (the per-sample computation runs on ddp.module, where the wrapper's hooks
                # never run; the clipped step's synchronising pass runs through the wrapper,
                # where they do: the result would match neither)
                raise PerSampleTypeError(
                    f"torch_vjp.{fn}: the DistributedDataParallel wrapper itself has forward "
                    f"hooks or pre-hooks; the per-sample computation runs on its module "
                    f"(ddp.module), where those would not run.\n  Fix: register them on "
                    f"ddp.module (ddp.module.register_forward_hook(...)): DDP's forward calls "
                    f"the module, so they run in ordinary training steps as before."
                )
            if ddp is None:
                ddp = model
            model, prefix = model.module, prefix + "module."
        elif isinstance(model, nn.Module) and isinstance(_compiled_inner(model), nn.Module):
            model, prefix = model._orig_mod, prefix + "_orig_mod."  # torch.compile(model)
        else:
            break
    if isinstance(model, nn.DataParallel):
        raise PerSampleTypeError(
            f"torch_vjp.{fn}: model is wrapped in nn.DataParallel, which splits each batch "
            f"over devices inside one process; per-sample gradients need the module itself.\n"
            f"  Fix: pass model.module (one device), or train with "
            f"DistributedDataParallel, which torch_vjp supports (one process per device)."
        )
    if isinstance(model, nn.Module) and _is_fsdp(model):
        raise PerSampleTypeError(
            f"torch_vjp.{fn}: model is sharded with FSDP ({type(model).__name__}): its "
            f"parameters are split across ranks, so no rank holds a whole per-sample "
            f"gradient.\n  Supported: an unwrapped module, or one wrapped in "
            f"DistributedDataParallel (every rank holds the whole model)."
        )
    return model, ddp, prefix


def strip_prefix(params: Any, prefix: str) -> Any:
    """Parameter names of a wrapper (``module.fc.weight``) as names of its module."""
    if params is None or not prefix:
        return params
    if isinstance(params, str):
        params = [params]
    try:
        names = list(params)
    except TypeError:
        return params  # select() reports it
    return [n[len(prefix):] if isinstance(n, str) and n.startswith(prefix) else n
            for n in names]


def ddp_add_to_grads(
    fn: str, ddp: nn.parallel.DistributedDataParallel, tensors: dict[str, Tensor],
    sums: dict[str, Tensor], sparse: frozenset[int],
) -> None:
    """Adds the rank's clipped sums to ``.grad`` through DDP's forward and backward (NOTE
    [DDP])."""
    if sparse:
        raise PerSampleValueError(
            f"torch_vjp.{fn}: an Embedding with sparse=True under DistributedDataParallel is "
            f"not supported by the clipped step (its gradient would reach DDP dense).\n"
            f"  Fix: build the Embedding with sparse=False."
        )
    module = ddp.module
    owned = {id(p) for p in module.parameters() if p.requires_grad}
    pairs = [(p, sums.get(n)) for n, p in tensors.items() if id(p) in owned]
    selected = {id(p) for p, _ in pairs}
    first_step = None
    if getattr(ddp, "static_graph", False):
        first_step = _static_first_step(fn, ddp, module, selected)
        if any(s is not None for _, s in pairs):  # (NOTE [DDP with static_graph], per rank)
            pairs = [(p, s) for p, s in pairs if s is not None]
    elif not ddp.find_unused_parameters:
        missing = [n for n, p in _reduced(ddp, module) if id(p) not in selected]
        if missing:
            raise PerSampleValueError(
                f"torch_vjp.{fn}: params leaves out {len(missing)} trainable parameter(s) of "
                f"the DistributedDataParallel module (first: {missing[0]!r}), and DDP was "
                f"built with find_unused_parameters=False, so its reducer would wait for "
                f"their gradients.\n  Fix: select every trainable parameter (params=None), "
                f"or wrap the model with find_unused_parameters=True."
            )

    def surrogate(*_: Any, **__: Any) -> Tensor:
        total = None
        for p, s in pairs:
            s = torch.zeros_like(p) if s is None else s.detach().to(p.dtype).reshape(p.shape)
            term = (p * s).sum()
            total = term if total is None else total + term
        assert total is not None
        return total

    had = "forward" in module.__dict__
    saved = module.__dict__.get("forward")
    module.forward = surrogate  # type: ignore[method-assign]
    with _without_grad_hooks([p for p, _ in pairs]):
        try:
            with torch.enable_grad(), _without_hooks(module):
                out = ddp()
        finally:
            if had:
                module.forward = saved  # type: ignore[method-assign]
            else:
                del module.forward
        out.backward()
    if first_step:  # (this pass was DDP's first step: it fixed the parameters, NOTE
        _FIRST_STEP[ddp] = frozenset(  # [DDP with static_graph])
            selected & {id(p) for _, p in _reduced(ddp, module)})


@contextlib.contextmanager
def failure_shared(fn: str, model: Any, strategy: Any) -> Iterator[None]:
    """Around the clipped step's computation on a model wrapped in DDP that will synchronise:
    an error on some rank reaches every rank before the reducer's all-reduce, where the
    others would wait for it for ever (NOTE [DDP]). Raises the errors of ``unwrap`` and of
    ``strategy`` first, before any exchange (DDP's buffer broadcast opens the computation)."""
    ddp = unwrap(fn, model)[1]
    # (under no_sync the reducer stays out, but the synchronising pass's DDP forward still
    # broadcasts rank 0's buffers where DDP's next forward would: the first no_sync step
    # after a synchronised one, on a model with buffers. A rank that failed before it left
    # the others waiting in that broadcast)
    if (ddp is None or tracing()
            or not (ddp.require_backward_grad_sync or _syncs_buffers(ddp))
            or torch.is_inference_mode_enabled()
            or getattr(getattr(ddp, "_join_config", None), "enable", False)):
        # (in inference mode every rank raises before its first exchange; inside
        # ddp.join(), a rank that has joined shadows DDP's own collectives only)
        yield
        return
    get_per_sample_strategy(strategy, call=f"torch_vjp.{fn}")
    try:
        yield
    except Exception as err:
        _tell(fn, ddp, err)
        raise
    _tell(fn, ddp, None)


def _syncs_buffers(ddp: nn.parallel.DistributedDataParallel) -> bool:
    """Whether DDP's next forward broadcasts its buffers (a collective), as DDP decides."""
    try:
        return bool(ddp.will_sync_module_buffers())
    except Exception:  # noqa: BLE001 - (DDP's internals moved: taken to broadcast)
        return True


def _tell(fn: str, ddp: nn.parallel.DistributedDataParallel, err: BaseException | None
          ) -> None:
    """Every rank's status; raises on a rank that did not fail where some rank did."""
    import torch.distributed as dist

    group = ddp.process_group
    if not all_max(0 if err is None else 1, group, comm_device(group, torch.device("cpu"))):
        return
    found = failing_rank(err, group, dist.get_world_size(group))
    if err is not None or found is None:
        return  # (the caller raises its own error)
    first, quoted = found
    raise PerSampleError(
        f"torch_vjp.{fn}: rank {first} of the DistributedDataParallel process group failed "
        f"while computing its clipped sums, so no rank adds its sums to .grad (DDP's "
        f"collectives in that pass, the reducer's all-reduce or the broadcast of the "
        f"buffers, would wait for rank {first} for ever). Rank {first} said: "
        f"{quoted}\n  The cause and its fix are in rank {first}'s traceback."
    )


# NOTE [DDP with static_graph]
# With static_graph=True, DDP's first step fixes which parameters get gradients, whatever
# find_unused_parameters says: in every later step its reducer waits for those. A clipped
# step that leaves one of them out (a params subset after an ordinary step) never starts
# the all-reduce of its bucket: .grad kept each rank's own unreduced sums, silently, and
# the next forward raised. So the selection must be that of the first step: where the
# clipped step itself was the first (recorded here), its selection; where the first was
# the model's own step, every trainable parameter its forward used (DDP's reducer records
# which: a parameter the forward never used gets no gradient in any later step, and a
# selection that holds one is refused, where DDP's own error said only that the graph
# changed).
# Which parameters the first step used is also a matter of each rank: DDP's reducer records
# the parameters whose gradient hooks fired on the rank itself, and a forward that uses a
# parameter on some ranks only (a branch taken by rank, an expert no example of the rank
# reaches) is a static graph still. The pass that adds the sums gave every selected parameter
# a gradient, a zero one where the rank's examples never reach it: on such a rank DDP raised
# that the graph changed (after an ordinary first step), while the other ranks waited in the
# reducer's all-reduce until the group's timeout; or it recorded the parameter as used (where
# the pass was the first step), and the next ordinary step parted the ranks. So under
# static_graph the pass gives a gradient to the parameters the rank's own examples reach
# (those with a sum), as the rank's ordinary forward does. A rank with no example reaches
# none: it gives every selected parameter a zero gradient, as before.
_FIRST_STEP: weakref.WeakKeyDictionary[Any, frozenset[int]] = weakref.WeakKeyDictionary()


def _static_first_step(fn: str, ddp: Any, module: nn.Module, selected: set[int]) -> bool:
    """Whether this clipped step is the first step of a DDP model built with
    ``static_graph=True``; raises where its selection of parameters differs from that of the
    first step (NOTE [DDP with static_graph])."""
    if not getattr(ddp, "_static_graph_delay_allreduce_enqueued", True):
        return True
    trainable = _reduced(ddp, module)
    selected = selected & {id(p) for _, p in trainable}  # (DDP ignores the others)
    first = _FIRST_STEP.get(ddp)
    if first is None:
        unused = _unused_in_first_step(ddp)
        first = frozenset(id(p) for _, p in trainable if id(p) not in unused)
        never = [n for n, p in trainable if id(p) in unused and id(p) in selected]
        if never:
            raise PerSampleValueError(
                f"torch_vjp.{fn}: DDP was built with static_graph=True, and its first step, "
                f"an ordinary one, never used {len(unused)} trainable parameter(s) of the "
                f"module (first: {never[0]!r}), so its reducer takes them to get no gradient "
                f"in any step; params selects them (params=None selects every trainable "
                f"parameter), and the clipped step adds a sum to each selected parameter's "
                f".grad, which DDP refuses as a changed graph.\n"
                f"  Fix: select only the parameters the forward uses (params=[...] without "
                f"{never[0]!r}), or set requires_grad=False on those it never uses before "
                f"wrapping the model, or wrap the model without static_graph=True and with "
                f"find_unused_parameters=True."
            )
    if selected == first:
        return False
    left = [n for n, p in trainable if id(p) in first and id(p) not in selected]
    more = [n for n, p in trainable if id(p) in selected and id(p) not in first]
    how = (f"leaves out {len(left)} of them (first: {left[0]!r})" if left
           else f"adds {len(more)} (first: {more[0]!r})")
    raise PerSampleValueError(
        f"torch_vjp.{fn}: DDP was built with static_graph=True, so its first step fixed the "
        f"parameters whose gradients its reducer waits for in every step, and params "
        f"{how}: the all-reduce would never start, leaving each rank's own sums in .grad "
        f"(find_unused_parameters does not change that under static_graph).\n"
        f"  Fix: select the parameters of the first step in every step (params=None where "
        f"it was an ordinary step), or wrap the model without static_graph=True and with "
        f"find_unused_parameters=True."
    )


def _reduced(ddp: Any, module: nn.Module) -> list[tuple[str, Tensor]]:
    """The trainable parameters whose gradients DDP's reducer waits for: every one but those
    DDP was told to ignore (``parameters_to_ignore``: its ``_ddp_params_and_buffers_to_ignore``
    and ``delay_all_reduce_named_params``), which it never reduces, so leaving them out of
    ``params`` leaves no bucket waiting (their ``.grad``, where selected, is the rank's own
    sum, as in DDP's own backward)."""
    ignored = getattr(ddp, "parameters_to_ignore", None) or ()
    return [(n, p) for n, p in module.named_parameters()
            if p.requires_grad and n not in ignored]


def _unused_in_first_step(ddp: Any) -> set[int]:
    """The ids of the parameters DDP's first step (under static_graph) found unused on every
    rank: its reducer's map of used parameters, all-reduced in that step, in the order of the
    parameters it was built with; none where torch does not expose it."""
    try:
        params = ddp._build_params_for_reducer()[0]
        used = ddp.reducer._get_local_used_map().tolist()
    except Exception:  # noqa: BLE001 - (DDP's internals moved: DDP's own error stands)
        return set()
    if len(used) != len(params):
        return set()
    return {id(p) for p, u in zip(params, used) if not u}


@contextlib.contextmanager
def _without_grad_hooks(params: list[Tensor]) -> Iterator[None]:
    """The surrogate's backward without the parameters' gradient hooks
    (``Tensor.register_hook``): each per-example gradient has been through them already
    (NOTE [gradient hooks on a parameter] in ``torch_vjp._per_sample.probe``), so on the
    clipped sum they ran a second time (a hook that triples the gradient tripled .grad),
    where the clipped step without DDP adds the sum as it is. The dicts are emptied and
    filled again in place: torch reads them at backward, and the handles that remove a hook
    refer to them."""
    saved = [(p._backward_hooks, list(p._backward_hooks.items())) for p in params
             if p._backward_hooks]
    for hooks, _ in saved:
        hooks.clear()
    try:
        yield
    finally:
        for hooks, items in saved:
            hooks.update(items)


#: The hook dicts ``Module.__call__`` runs: the module's own and the global ones.
_HOOK_DICTS = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks",
               "_forward_hooks_with_kwargs", "_forward_hooks_always_called",
               "_backward_hooks", "_backward_pre_hooks")
_GLOBAL_HOOK_DICTS = ("_global_forward_pre_hooks", "_global_forward_hooks",
                      "_global_backward_hooks", "_global_backward_pre_hooks",
                      "_global_forward_hooks_with_kwargs", "_global_forward_hooks_always_called")


@contextlib.contextmanager
def _without_hooks(module: nn.Module) -> Iterator[None]:
    """The surrogate forward runs as the module's forward without its hooks (nor the global
    ones): they are the model's, for its real forward; on the surrogate, a hook that scales
    the output scaled the clipped sums, and a pre-hook that reads the inputs found none."""
    own = {name: getattr(module, name) for name in _HOOK_DICTS if hasattr(module, name)}
    glob = {name: getattr(_module_mod, name) for name in _GLOBAL_HOOK_DICTS
            if hasattr(_module_mod, name)}
    for name, hooks in own.items():
        setattr(module, name, type(hooks)())
    for name, hooks in glob.items():
        setattr(_module_mod, name, type(hooks)())
    try:
        yield
    finally:
        for name, hooks in own.items():
            setattr(module, name, hooks)
        for name, hooks in glob.items():
            setattr(_module_mod, name, hooks)

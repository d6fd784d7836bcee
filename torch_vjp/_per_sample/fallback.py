"""The strategies that follow the definition literally: vmap and the per-example loop.

``vmap`` is the torch.func recipe: ``vmap(grad(loss of one example))`` over
``functional_call``; ``loop`` runs one forward and backward per example. They compute the
parameters no rule covers (and every parameter under those strategies).

The vmap-then-loop choice is the package's one policy, ``torch_vjp._engine.rows.
run_with_fallback`` (NOTE [one fallback policy] there): under ``"auto"`` a failure of vmap is
followed by one example through the loop; if that raises too, the error is the model's (or
the loss's) own and propagates untouched; if not, vmap could not batch the model, a one-time
warning says so, and the loop computes the rest. Under ``"vmap"`` the same test decides
between passing the model's own error through and a :class:`~torch_vjp.StrategyError` that
names the strategy, the layer vmap failed in, and the alternatives.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map

from torch_vjp._engine.memory import new_buffer
from torch_vjp._engine.rows import run_with_fallback
from torch_vjp._errors import (
    PerSampleError,
    StrategyError,
    TorchVJPError,
    TorchVJPWarning,
    a_type,
    first_time,
    quote_error,
    user_stacklevel,
    with_article,
)
from torch_vjp._per_sample.args import Job, Selection
from torch_vjp._per_sample.losses import (call_loss, check_connected, scalar_loss, slice_tree,
                                         targets_in_dims)
from torch_vjp._per_sample.plan import functional_call
from torch_vjp._per_sample.registry import declining_rule, hidden_rule, rule_for
from torch_vjp._per_sample.rules.attention import is_attention

__all__ = ["vmap_grads", "loop_grads", "fallback_grads", "functional_state", "CannotBatch",
           "warn_loop", "REENTRANT", "outside_reason"]


class CannotBatch(Exception):
    """vmap cannot batch the model (the model's own computation is fine): raised by
    :func:`fallback_grads` with ``strict`` so that the caller chooses what to do instead."""

    def __init__(self, failure: BaseException):
        super().__init__(str(failure))
        self.failure = failure


def functional_state(model: nn.Module) -> dict[str, Tensor]:
    state = {n: p.detach() for n, p in model.named_parameters()}
    state.update({n: b.detach() if isinstance(b, Tensor) else b for n, b in model.named_buffers()})
    return state


def vmap_grads(
    job: Job,
    names: list[str],
    start: int,
    stop: int,
    chunk_size: int | None,
    randomness: str = "different",
) -> dict[str, Tensor]:
    """Per-sample gradients of the canonical ``names`` for examples ``start:stop`` with
    torch.func (vmap of grad).

    ``randomness`` is vmap's: ``"different"`` gives each example its own draws from the
    global generator (dropout masks), ``"same"`` one draw for all (a generator seeded inside
    the forward, which every example's own call would replay).
    """
    model, loss_fn, sel, fn = job.model, job.loss_fn, job.sel, job.fn
    xs = tuple(None if x is None else _plain_strides(x[start:stop]) for x in job.xs)
    targets = slice_tree(job.targets, start, stop)
    state = functional_state(model)
    diff = {n: sel.tensors[n].detach() for n in names}
    for n in names:
        state.pop(n, None)

    def one(d: dict[str, Tensor], xi: tuple[Tensor, ...], ti: Any) -> Tensor:
        ti = tree_map(lambda z: z.unsqueeze(0) if isinstance(z, Tensor) else z, ti)
        return scalar_loss(fn, functional_call(  # (the loss too reads the stand-ins)
            model, {**state, **d}, tuple(None if x is None else x.unsqueeze(0) for x in xi),
            lambda out: call_loss(loss_fn, out, ti)))

    in_dims = (None, tuple(None if x is None else 0 for x in xs), targets_in_dims(targets))
    run = torch.func.vmap(
        torch.func.grad(one), in_dims=in_dims, randomness=randomness, chunk_size=chunk_size)
    try:
        return run(diff, xs, targets)
    except RuntimeError as err:
        if _CONV_STRIDES not in str(err):
            raise
    if job.reset is not None:  # (the failed run's forward may have changed buffers)
        job.reset()
    with _PlainConvInputs():
        return run(diff, xs, targets)


#: What vmap's backward of a convolution says of an input with the strides of a transposed
#: tensor (NOTE at :func:`_plain_strides`).
_CONV_STRIDES = "grad_weight must be contiguous"


class _PlainConvInputs(TorchFunctionMode):
    """Gives every convolution a copy of its input with a fresh tensor's strides: where the
    model makes such an input itself (``conv(h.transpose(1, 2))`` with a length of one),
    vmap's backward of the convolution fails as :func:`_plain_strides` says. Only for a
    run that failed so: a copy per convolution."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        if func in _CONVS and args and isinstance(args[0], Tensor):
            args = (args[0].clone(memory_format=torch.contiguous_format), *args[1:])
        return func(*args, **(kwargs or {}))


_CONVS = frozenset({torch.conv1d, torch.conv2d, torch.conv3d, torch.conv_transpose1d,
                    torch.conv_transpose2d, torch.conv_transpose3d})


def _plain_strides(x: Tensor) -> Tensor:
    """``x``, or a copy of it where an example's strides are not those of a fresh tensor of
    its shape (a transposed ``(B, 1, C)`` as ``(B, C, 1)``, which ``is_contiguous`` calls
    contiguous: it skips the strides of dimensions of size one). vmap's rule for the
    backward of a convolution fails on such an example ("slow_conv2d: grad_weight must be
    contiguous") that runs without vmap. (The batch dimension's stride is the example's
    offset, kept: an input expanded along the batch is not copied.)"""
    if x.layout != torch.strided or x.dim() < 2:
        return x
    step = 1
    for n, s in zip(reversed(x.shape[1:]), reversed(x.stride()[1:])):
        if s != step:
            return x.clone(memory_format=torch.contiguous_format)
        step *= n
    return x


def loop_grads(job: Job, names: list[str], start: int, stop: int, out: dict[str, Tensor]) -> None:
    """Writes the per-sample gradients of examples ``start:stop`` into ``out[name][i - start]``:
    one forward and one backward per example. ``job.reset`` puts back, before each example,
    the buffers a forward changes, so that every example runs alone from the same state."""
    at = [start]  # (the example running)
    try:
        _loop(job, names, start, stop, out, at)
    except Exception as err:
        if job.batch_failure is not None and not isinstance(err, TorchVJPError):
            err.add_note(_on_one_example(job, at[0]))  # (the error itself untouched)
        raise


def _on_one_example(job: Job, i: int) -> str:
    """Where an error of the loop was raised, for a model planned after it failed on the
    whole batch: the error the user sees is of one example's run, not of their batch."""
    return (f"(raised by the model's forward or the loss on example {i} alone, run by the "
            f"per-example computation of torch_vjp.{job.fn}: the model had failed on the whole "
            f"batch first ({job.batch_failure}), so every parameter is computed one example at "
            f"a time; the error above is that of the example, whose shapes are those of a "
            f"batch of one.)")


def _loop(job: Job, names: list[str], start: int, stop: int, out: dict[str, Tensor],
          at: list[int]) -> None:
    model, loss_fn, sel, fn, xs, targets, reset = (
        job.model, job.loss_fn, job.sel, job.fn, job.xs, job.targets, job.reset)
    frozen = any(not sel.tensors[n].requires_grad for n in names)
    for i in range(start, stop):
        at[0] = i
        if reset is not None:
            reset()
        xi = tuple(None if x is None else x[i : i + 1] for x in xs)
        grads = None
        if not job.by_backward:
            try:
                with torch.enable_grad():
                    ti = slice_tree(targets, i, i + 1)
                    if frozen:
                        leaves = {n: sel.tensors[n].detach().requires_grad_(True)
                                  for n in names}
                        o, loss = functional_call(  # (the loss too reads the stand-ins)
                            model, leaves, xi, lambda out: (out, call_loss(loss_fn, out, ti)))
                        wrt = [leaves[n] for n in names]
                    else:
                        o = model(*xi)
                        loss = call_loss(loss_fn, o, ti)
                        wrt = [sel.tensors[n] for n in names]
                    loss = scalar_loss(fn, loss)
                    check_connected(fn, loss, o)
                    if loss.requires_grad and _reentrant_in(loss):
                        grads = None  # (autograd.grad would skip its block: backward())
                    else:
                        grads = (
                            torch.autograd.grad(loss, wrt, allow_unused=True)
                            if loss.requires_grad else [None] * len(wrt)
                        )
            except RuntimeError as err:
                if REENTRANT not in str(err):
                    raise
            if grads is None:
                job.by_backward = True
                if reset is not None:
                    reset()
        if grads is None:
            grads = _by_backward(job, names, xi, i)
        for n, g in zip(names, grads):
            if g is None:
                out[n][i - start].zero_()
            else:
                out[n][i - start].copy_(g.to_dense() if g.layout != torch.strided else g)


#: What torch says where a reentrant checkpoint meets ``torch.autograd.grad``.
REENTRANT = "use_reentrant=True"

# NOTE [reentrant checkpoints]
# ``torch.utils.checkpoint(fn, x, use_reentrant=True)`` runs its backward only under
# ``backward()`` without ``inputs=``: ``torch.autograd.grad``, which every strategy uses,
# raises "When use_reentrant=True, torch.utils.checkpoint is incompatible with .grad()"
# once the block's input requires grad (a block after the first layer), where ``inputs``
# lie below the checkpoint's node; where none does (only the block's parameters, or those
# of layers after it, are asked for), ``autograd.grad`` raises nothing and skips the node,
# giving the block's parameters no gradient, silently (the block's parameters are not
# edges of its node: its backward reaches them by a backward() of its own). The plan then
# gives every parameter to the loop (``probe``; whether the inputs require grad is part of
# the plan's key), and the loop, which looks for the checkpoint's node in every example's
# graph before it differentiates (a walk of one example's graph: small beside its forward
# and backward), differentiates each example with ``backward()`` (``Job.by_backward``)
# wherever the graph holds one: before each
# example the ``.grad`` of the model's parameters (and of a loss module's) are set aside
# and their post-accumulate-grad hooks unhooked (an optimizer step in backward must not
# run per example); the selected parameters' ``.grad`` is the example's gradient; then
# everything is put back as it was, on an error too. The inputs and targets of the example
# are detached (inputs made leaves that require grad as before), so that the backward
# stops at them and never reaches, frees or accumulates into a graph of the caller's. The
# leaves set aside are the model's parameters, a loss module's, the modules' plain tensor
# attributes that are leaves requiring grad, and every other leaf the example's loss graph
# reaches (one a loss function's closure holds), found by a walk of that graph before
# ``backward()``. A leaf used only inside the checkpointed block that is none of those (a
# closure's, read by the block) is not in that graph (the block's graph is recomputed in
# the backward pass) and would still receive a ``.grad``. Selected parameters that do not require grad are differentiated
# elsewhere through stand-ins (``functional_call``), which are gone by the time the
# checkpoint recomputes its block in the backward pass; under ``backward()`` those
# parameters are made to require grad for the example (and their flags put back). A model wrapped in DistributedDataParallel (whose reducer fires on
# ``backward()``) cannot be computed so: PerSampleError, with the fix use_reentrant=False.


def _graph_nodes(loss: Tensor) -> Iterator[Any]:
    """The nodes of the graph of ``loss``, each once (an AccumulateGrad node's inputs are
    not followed: it has none)."""
    seen, stack = set(), [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        yield node
        stack.extend(n for n, _ in node.next_functions)


def _reentrant_in(loss: Tensor) -> bool:
    """Whether the graph of ``loss`` holds a reentrant checkpoint's node."""
    return any(type(node).__name__ == "CheckpointFunctionBackward"
               for node in _graph_nodes(loss))


def _reentrant_error(job: Job, why: str) -> PerSampleError:
    return PerSampleError(
        f"torch_vjp.{job.fn}: the model runs torch.utils.checkpoint with use_reentrant=True "
        f"on a block whose input requires grad, whose backward runs only under backward() "
        f"(torch.autograd.grad refuses it), and {why}.\n"
        f"  Fix: pass use_reentrant=False to torch.utils.checkpoint (torch's recommended "
        f"setting), which strategies 'auto', 'hooks' and 'loop' differentiate ('vmap' "
        f"cannot: torch.func runs no saved-tensor hooks).")


def _by_backward(job: Job, names: list[str], xi: tuple[Tensor, ...], i: int
                 ) -> list[Tensor | None]:
    """One example's gradients of ``names`` by ``backward()`` (NOTE [reentrant
    checkpoints])."""
    sel = job.sel
    if job.ddp is not None:
        raise _reentrant_error(job, "the model is wrapped in DistributedDataParallel, whose "
                                    "reducer would fire on each example's backward()")
    frozen = [sel.tensors[n] for n in names if not sel.tensors[n].requires_grad]
    leaves = {id(p): p for p in job.model.parameters()}
    leaves.update((id(p), p) for p in frozen)
    if isinstance(job.loss_fn, nn.Module):
        leaves.update((id(p), p) for p in job.loss_fn.parameters())
    for m in job.model.modules():  # (plain tensor attributes that are leaves requiring grad)
        leaves.update((id(t), t) for t in m.__dict__.values()
                      if isinstance(t, Tensor) and t.requires_grad and t.is_leaf)
    xi = tuple(None if x is None else x.detach().requires_grad_(x.requires_grad) for x in xi)
    ti = tree_map(lambda t: t.detach() if isinstance(t, Tensor) else t,
                  slice_tree(job.targets, i, i + 1))
    saved: list[tuple[Tensor, Any]] = []
    hooks: list[tuple[dict, dict]] = []

    def set_aside(ts: Any) -> None:
        for p in ts:
            saved.append((p, p.grad))
            p.grad = None
            if p._post_accumulate_grad_hooks:  # (emptied in place: autograd holds the dict)
                live = p._post_accumulate_grad_hooks
                hooks.append((live, dict(live)))
                live.clear()

    try:
        set_aside(leaves.values())
        for p in frozen:  # (for this example only: stand-ins would be gone by the time
            p.requires_grad_(True)  # the checkpoint recomputes its block)
        with torch.enable_grad():
            out = job.model(*xi)
            loss = scalar_loss(job.fn, call_loss(job.loss_fn, out, ti))
            check_connected(job.fn, loss, out)
            if loss.requires_grad:
                # every other leaf the loss's graph reaches (one a loss function's closure
                # holds): its .grad is set aside too
                set_aside(_graph_leaves(loss, leaves, {id(x) for x in xi}))
                loss.backward()
        return [sel.tensors[n].grad for n in names]
    finally:
        for p in frozen:
            p.requires_grad_(False)
        for p, g in saved:
            p.grad = g
        for live, own in hooks:
            live.update(own)


def _graph_leaves(loss: Tensor, known: dict[int, Tensor], skip: set[int]) -> list[Tensor]:
    """The leaves the graph of ``loss`` accumulates into, but those in ``known`` or
    ``skip`` (by ``id``)."""
    found: dict[int, Tensor] = {}
    for node in _graph_nodes(loss):
        var = getattr(node, "variable", None)
        if isinstance(var, Tensor) and id(var) not in known and id(var) not in skip:
            found[id(var)] = var
    return list(found.values())


def _new_outputs(sel: Selection, names: list[str], n: int) -> dict[str, Tensor]:
    return {name: new_buffer(sel.tensors[name], (n, *sel.tensors[name].shape)) for name in names}


def fallback_grads(
    job: Job,
    mode: str,
    names: list[str],
    start: int,
    stop: int,
    chunk_size: int | None,
    randomness: str | None = "different",
    *,
    strict: bool = False,
) -> dict[str, Tensor]:
    """Per-sample gradients of ``names`` for examples ``start:stop``: vmap, else the loop
    (``mode`` ``"loop"``: the loop only; ``"vmap"``: no loop but to classify a failure).
    With ``strict``, a model vmap cannot batch raises :class:`CannotBatch` instead of
    going to the loop.

    ``randomness`` None means the plan found that only the loop is right (NOTE [randomness]
    in ``plan``). See NOTE [one fallback policy].
    """
    if not names:
        return {}
    if job.reset is not None:  # from the caller's state (the rules' pass ran before)
        job.reset()

    def loop() -> dict[str, Tensor]:
        out = _new_outputs(job.sel, names, stop - start)
        loop_grads(job, names, start, stop, out)
        return out

    if mode not in ("auto", "vmap", "hooks") or randomness is None:
        return loop()

    # Where vmap failed, the examples run without vmap before vmap is blamed: an error there
    # is the model's own and propagates untouched. Named "vmap" runs every example (any of
    # them may hold what the model refuses: an id beyond an embedding's table), "auto" lets
    # the loop it falls back to decide, and strict (whose caller computes otherwise) checks
    # one.
    def check_all() -> None:
        loop_grads(job, names, start, stop, _new_outputs(job.sel, names, stop - start))

    def check_first() -> None:
        loop_grads(job, names, start, start + 1, _new_outputs(job.sel, names, 1))

    def on_fallback(failure: Exception) -> None:
        if mode == "vmap":
            raise _vmap_error(job, names, start, stop, failure) from failure
        if strict:
            raise CannotBatch(failure) from failure
        warn_loop(job.fn, job.model, failure)

    return run_with_fallback(
        lambda: vmap_grads(job, names, start, stop, chunk_size, randomness), loop,
        on_fallback=on_fallback,
        check_one=check_all if mode == "vmap" else check_first if strict else None,
    )


def _vmap_error(job: Job, names: list[str], start: int, stop: int,
                failure: BaseException) -> StrategyError:
    """A StrategyError for strategy='vmap', naming the layer vmap failed in."""
    fn = job.fn
    where = _failing_layer(job, names, start, stop)
    place = f" in {where}" if where else ""
    if job.by_backward:  # (the example without vmap needed backward(): NOTE [reentrant ...])
        place += (" (it runs torch.utils.checkpoint with use_reentrant=True, whose autograd "
                  "Function torch.func cannot transform; nor can it run the saved-tensor "
                  "hooks of use_reentrant=False, which the other strategies differentiate)")
    if "saved tensor hooks" in str(failure):
        cause = ("torch.func does not run saved-tensor hooks, which torch.utils.checkpoint "
                 "(use_reentrant=False), torch.autograd.graph.save_on_cpu and activation "
                 "offloading install")
    else:
        cause = ("vmap lacks a batching rule for an operation it uses (stock recurrent "
                 "layers, autograd Functions without vmap support: your own, "
                 "torch.utils.checkpoint with use_reentrant=True, full backward hooks; "
                 "in-place updates of buffers, .item() on tensors)")
    return StrategyError(
        f"torch_vjp.{fn}: strategy='vmap' cannot batch this model{place}: torch.func.vmap "
        f"said {quote_error(failure)}\n"
        f"  The same example runs without vmap, so the model itself is fine; {cause}.\n"
        f"  Alternatives: strategy='loop' (one backward per example, always works), or "
        f"strategy='auto' (per-layer rules where they exist, vmap or the loop for the rest)."
    )


def _failing_layer(job: Job, names: list[str], start: int, stop: int) -> str:
    """The innermost module that was running when vmap failed, by running two examples again
    with a module stack (only on this failure path)."""
    model = job.model
    stack: list[str] = []
    failed: list[str] = []
    left: list[str] = []  # the module whose forward hooks ran last, if no call began since
    why = ""
    paths = {id(m): p for p, m in model.named_modules()}

    def push(module: nn.Module, args: Any) -> None:
        if id(module) in paths:
            stack.append(paths[id(module)])
            left.clear()

    def pop(module: nn.Module, args: Any, output: Any) -> None:
        if id(module) in paths and stack:
            left[:] = [stack.pop()]

    # (no always_call: a module whose forward raises keeps its place on the stack)
    pre = torch.nn.modules.module.register_module_forward_pre_hook(push)
    post = torch.nn.modules.module.register_module_forward_hook(pop)
    try:
        vmap_grads(job, names, start, min(stop, start + 2), None)
    except Exception as err:  # noqa: BLE001 - only the module stack at the failure is wanted
        failed, why = list(stack), str(err)
    finally:
        pre.remove()
        post.remove()
    if not failed:  # it failed in the backward pass: a layer vmap is known not to batch
        for path, m in model.named_modules():
            if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and getattr(m, "sparse", False):
                return (f"{f'module {path!r}' if path else 'the model itself'} "
                        f"({type(m).__name__} with sparse=True, whose sparse gradients vmap "
                        f"cannot batch)")
        return ""
    path = failed[-1]
    hooked = [p or "the model" for p in failed if _full_backward_hooked(model, p)]
    if not hooked and left and "autograd.Function" in why and _full_backward_hooked(
            model, left[0]):
        # (torch wraps a hooked module's outputs after its forward hooks ran: the failure
        # comes from the module that just returned, no longer on the stack)
        path = left[0]
        hooked = [path or "the model"]
    module = model.get_submodule(path) if path else model
    where = f"module '{path}' ({type(module).__name__})" if path else (
        f"the model's own forward ({type(module).__name__})")
    glob = torch.nn.modules.module
    if glob._global_backward_pre_hooks or (glob._global_backward_hooks
                                           and glob._global_is_full_backward_hook):
        owner = ("every module has a full backward hook, through a global one "
                 "(register_module_full_backward_hook or _pre_hook),")
    elif hooked:
        owner = (f"'{hooked[-1]}' has a full backward hook (register_full_backward_hook or "
                 f"register_full_backward_pre_hook),")
    else:
        owner = ""
    if owner:  # (torch wraps such a module's inputs and outputs in BackwardHookFunction)
        where += (f"; {owner} which torch runs through an autograd Function that torch.func "
                  f"cannot transform: remove the hook for vmap, or keep it with "
                  f"strategy='loop' or 'auto'")
    return where


def _full_backward_hooked(model: nn.Module, path: str) -> bool:
    m = model.get_submodule(path) if path else model
    return bool(m._backward_pre_hooks or (m._backward_hooks and m._is_full_backward_hook))


def warn_loop(fn: str, model: nn.Module, err: BaseException) -> None:
    """One warning per function and model class when ``"auto"`` had to loop over examples."""
    if not first_time(("per-sample-loop", fn, type(model))):
        return
    warnings.warn(
        f"torch_vjp.{fn}: strategy='auto' could not vectorise the per-sample gradients of "
        f"{type(model).__name__} with vmap, so it used one backward pass per example, usually "
        f"many times slower.\n"
        f"  The vectorised attempt said: {quote_error(err)}\n"
        f"  Typical causes: .item() or Python control flow on tensor values in the model, "
        f"NumPy calls, an operator without a batching rule. Pass strategy='loop' to skip the "
        f"vectorised attempt. This warning is shown once per model class.",
        TorchVJPWarning,
        stacklevel=user_stacklevel(),
    )


def _computed(owner: nn.Module) -> tuple[list[str], str]:
    """The tensors a layer is called with that are computed from parameters, rather than
    held as parameters, and by what: a parametrization (``torch.nn.utils.parametrize``, and
    the ``parametrizations`` weight_norm, orthogonal, spectral_norm) or a forward pre-hook
    that sets them as plain attributes (the older ``torch.nn.utils.weight_norm`` and
    ``spectral_norm``)."""
    lists = owner._modules.get("parametrizations")
    if isinstance(lists, nn.ModuleDict) and len(lists):
        return list(lists.keys()), "a parametrization, torch.nn.utils.parametrize"
    plain = [k for k, v in vars(owner).items()
             if k[:1] != "_" and isinstance(v, Tensor) and not isinstance(v, nn.Parameter)]
    return plain, "weight_norm's or spectral_norm's forward pre-hook"


def _has_rule(m: nn.Module) -> bool:
    return rule_for(m) is not None or is_attention(m)


def outside_reason(model: nn.Module, name: str, used: list[Any]) -> str:
    """Why parameter ``name`` falls back to vmap or the loop (no rule computes it): the
    reason a plan shows for it."""
    path = name.rpartition(".")[0]
    # (a parametrized tensor lives in '<layer>.parametrizations.<name>': the layer owns it)
    dotted = "." + path
    param = ".parametrizations" in dotted
    owner_path = dotted.partition(".parametrizations")[0][1:] if param else path
    try:
        owner = model.get_submodule(owner_path)
    except AttributeError:
        owner = None
    if owner is not None and _has_rule(owner):
        computed, how = _computed(owner)
        where = f"module '{owner_path}'" if owner_path else "the model itself"
        head = f"{where} is {a_type(owner)}, which has a rule, but the layer is called with "
        leaf = name.rpartition(".")[2]
        # (the older weight_norm and spectral_norm keep what they compute 'weight' from as
        # 'weight_g', 'weight_v', 'weight_orig')
        source = [c for c in computed if leaf.startswith(c + "_")]
        if param or source:
            # this parameter is what a tensor the layer is called with is computed from
            tensor = (dotted.partition(".parametrizations.")[2].partition(".")[0] if param
                      else source[0]) or "weight"
            return (head + f"{with_article(tensor)} computed from its parameters ({how}), and the rule "
                    f"gives per-sample gradients for the tensors a layer is called with, not "
                    f"for what they are computed from")
        if computed:
            what = (with_article(computed[0]) if len(computed) == 1 else
                    f"its {', '.join(computed[:-1])} and {computed[-1]}")
            return (head + f"{what} computed from its parameters ({how}), so the call is "
                    f"not one the rule computes whole, and this parameter's use in it is not "
                    f"told apart from that computation: it takes the fallback with them")
    if used:
        return ("it is used outside the layers that have rules (directly in a forward or "
                "in the loss function, an L2 term say, or by a layer without one)")
    try:
        m = model.get_submodule(path)
    except AttributeError:
        return "it has no per-layer rule"
    replaced = hidden_rule(m)
    if replaced is not None:
        where = f"its module '{path}'" if path else "the model itself"
        return f"{where} is {a_type(m)}, {replaced}"
    declining = declining_rule(m)
    if declining is not None:
        where = f"module '{path}'" if path else "the model itself"
        return f"{declining.declined(m)} ({where}: {type(m).__name__})"
    if rule_for(m) is not None:
        return (f"its module '{path}' ({type(m).__name__}) has a rule but is not called: the "
                f"parameter is read directly (by a forward, or by the loss function)")
    if not path:
        return (f"it belongs to the model itself, {a_type(m)}, which has no per-layer "
                f"rule")
    return f"its module '{path}' is {a_type(m)}, which has no per-layer rule"

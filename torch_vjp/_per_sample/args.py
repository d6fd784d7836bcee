"""Arguments of the per-sample functions: their checks, and the selection of parameters
(the structure a plan is for lives in :mod:`torch_vjp._per_sample.structure`).

Every check raises a :class:`~torch_vjp.PerSampleError` subclass (``PerSampleValueError``,
``PerSampleTypeError``) naming the call, what it got, and what it must be.
"""

from __future__ import annotations

import functools
import numbers
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn
from torch.utils._pytree import keystr, tree_flatten_with_path, tree_leaves

from torch_vjp._errors import (
    PerSampleError,
    PerSampleTypeError,
    PerSampleValueError,
    a_type,
    shape_str,
)

__all__ = [
    "check_model",
    "check_opacus_hooks",
    "check_trainable",
    "as_inputs",
    "check_targets",
    "check_max_norm",
    "params_once",
    "check_static_mixing",
    "Selection",
    "select",
    "access",
    "Job",
]


def check_model(fn: str, model: Any) -> None:
    if not isinstance(model, nn.Module):
        raise PerSampleTypeError(
            f"torch_vjp.{fn}: model must be a torch.nn.Module, got {type(model).__name__}.\n"
            f"  Per-sample gradients are taken with respect to the module's parameters; wrap a "
            f"function in an nn.Module that owns its parameters."
        )
    if isinstance(model, torch.jit.ScriptModule):
        raise PerSampleTypeError(
            f"torch_vjp.{fn}: model is a TorchScript module ({type(model).__name__}), but "
            f"per-sample gradients need the Python module: its layers' forward hooks (strategy "
            f"'hooks'), torch.func.functional_call (strategy 'vmap') and per-example calls "
            f"all run the Python modules. Fix: pass the module before torch.jit.script (or "
            f"torch.jit.trace), and script it for inference only."
        )


def _opacus_class(cls: type) -> bool:
    """Whether ``cls`` is one of Opacus's GradSampleModule classes."""
    return any(c.__module__.startswith("opacus.grad_sample") for c in cls.__mro__)


# (per class, once: the check runs on every call; traced by the user's torch.compile, the
# walk of the class's bases instead: dynamo warns of every lru_cache it traces through)
_is_opacus_cached = functools.lru_cache(maxsize=256)(_opacus_class)


def _is_opacus(cls: type) -> bool:
    return _opacus_class(cls) if torch.compiler.is_compiling() else _is_opacus_cached(cls)


def check_opacus_hooks(fn: str, path: str, module: nn.Module) -> None:
    """Refuses an Opacus GradSampleModule whose hooks are on (by name: opacus is never
    imported here)."""
    if not _is_opacus(type(module)) or not getattr(module, "hooks_enabled", False):
        return
    where = f"module '{path}'" if path else "model"
    raise PerSampleTypeError(
        f"torch_vjp.{fn}: {where} is an Opacus {type(module).__name__} with its hooks on: "
        f"they compute .grad_sample on every backward pass, and the per-sample functions "
        f"run the model more than once (the plan runs the batch and the batch without its "
        f"last example), which breaks their bookkeeping (an einsum over mismatched batch "
        f"sizes) and leaves .grad_sample on the parameters.\n  Fix: pass the module it "
        f"wraps, {access(path)}._module (torch_vjp computes the per-sample gradients "
        f"itself), or call {access(path)}.disable_hooks() first."
    )


def _flat_bags(model: nn.Module | None, xs: tuple[Tensor, ...]) -> bool:
    """Whether two 1-D inputs of unequal lengths are an ``nn.EmbeddingBag``'s flat indices
    and offsets: the model holds an EmbeddingBag, and the shorter one, of integers, starts
    at 0 and never decreases nor passes the other's length (an error path: the values may
    be read)."""
    if model is None or len(xs) != 2 or not any(
            isinstance(m, nn.EmbeddingBag) for m in model.modules()):
        return False
    if not all(t.dim() == 1 and not t.is_floating_point() and not t.is_complex()
               and t.dtype != torch.bool and not t.is_meta for t in xs):
        return False
    idx, offs = sorted(xs, key=lambda t: t.shape[0], reverse=True)
    if offs.numel() == 0:
        return False
    offs = offs.detach().long().cpu()
    return bool(offs[0] == 0) and bool((offs[1:] >= offs[:-1]).all()) and bool(
        offs[-1] <= idx.shape[0])


def as_inputs(fn: str, inputs: Any, model: nn.Module | None = None
              ) -> tuple[tuple[Tensor, ...], int]:
    """Normalises ``inputs`` to a tuple of tensors and returns the batch size (``model``
    only words an error)."""
    xs = (inputs,) if isinstance(inputs, Tensor) else inputs
    if not isinstance(xs, (tuple, list)) or len(xs) == 0:
        got = (f"an empty {type(xs).__name__}" if isinstance(xs, (tuple, list))
               else a_type(inputs))
        if isinstance(inputs, dict):
            fix = (" Keyword inputs are not passed as such: pass the tensors as a tuple in "
                   "the order of the model's forward, or wrap the model in a module whose "
                   "forward takes them positionally and calls it by keyword.")
        elif isinstance(xs, (tuple, list)):
            fix = (" The examples are counted along the first dimension of inputs[0], so at "
                   "least one tensor is needed; a model without inputs has no examples.")
        else:
            fix = ""
        raise PerSampleTypeError(
            f"torch_vjp.{fn}: inputs must be a tensor or a tuple of tensors, got {got}.\n"
            f"  Each tensor holds the batch along its first dimension and is passed as "
            f"model(*inputs).{fix}"
        )
    for k, x in enumerate(xs):
        if x is None and any(isinstance(t, Tensor) for t in xs):
            continue  # (an optional argument left out, model(x, None): passed as it is)
        if x is None and all(t is None for t in xs):
            raise PerSampleTypeError(
                f"torch_vjp.{fn}: every input is None, so no input holds the examples.\n"
                f"  The examples are counted along the first dimension of the inputs' "
                f"tensors (an input None is passed to the model as it is): pass at least "
                f"one tensor."
            )
        if not isinstance(x, Tensor):
            raise PerSampleTypeError(
                f"torch_vjp.{fn}: inputs[{k}] is {a_type(x)}, not a tensor.\n"
                f"  inputs must be a tensor or a tuple of tensors (or None, passed as it is), "
                f"each with the batch along its first dimension; bind other arguments of the "
                f"model in the module."
            )
        if x.dim() == 0:
            raise PerSampleValueError(
                f"torch_vjp.{fn}: inputs[{k}] is a 0-dimensional tensor, so it has no batch "
                f"dimension.\n  Per-sample gradients split every input along its first "
                f"dimension, one example per row. "
                f"{_SHARED_INPUT_FIX.replace('t.expand(B, *t.shape[1:])', 't.expand(B)')}"
            )
    first = next(k for k, x in enumerate(xs) if x is not None)
    B = xs[first].shape[0]
    for k, x in enumerate(xs[first + 1:], first + 1):
        if x is not None and x.shape[0] != B:
            flat = _flat_bags(model, (xs[first], x))
            hint = (" Flat indices and offsets (as nn.EmbeddingBag takes them) hold no batch "
                    "dimension: pass the indices padded to (B, L) (with the layer's "
                    "padding_idx, which every mode leaves out), and let the layer take the "
                    "2-D input." if flat else "")
            raise PerSampleValueError(
                f"torch_vjp.{fn}: inputs[{k}] has shape {shape_str(x.shape)}, but "
                f"inputs[{first}] has shape {shape_str(xs[first].shape)}: their first "
                f"dimensions (the batch) differ, "
                f"{x.shape[0]} vs {B}.\n  Every input must hold the same examples along its "
                f"first dimension, since example i is model(*(x[i:i+1] for x in inputs)).{hint}"
                f"{'' if hint else ' ' + _SHARED_INPUT_FIX.replace('(B,', f'({B},')}"
            )
    return tuple(xs), B


_SHARED_INPUT_FIX = (
    "Fix: a tensor that every example shares (position ids or a mask of shape (1, T), a "
    "scale) is not an input: expand it to the batch (t.expand(B, *t.shape[1:])) or hold it "
    "in the model (a buffer or attribute its forward reads)."
)


def check_targets(fn: str, targets: Any, B: int) -> None:
    if targets is None:
        return
    leaves = (targets,) if isinstance(targets, Tensor) else tree_leaves(targets)
    if all(not isinstance(t, Tensor) or t.dim() and t.shape[0] == B for t in leaves):
        return  # (the common case, without the paths, which cost microseconds per call)
    for path, leaf in tree_flatten_with_path(targets)[0]:
        if isinstance(leaf, Tensor) and (leaf.dim() == 0 or leaf.shape[0] != B):
            where = f"targets{keystr(path)}"
            why = ("it has no batch dimension (a 0-d tensor)" if leaf.dim() == 0 else
                   f"its first dimension (the batch) is {leaf.shape[0]}")
            raise PerSampleValueError(
                f"torch_vjp.{fn}: {where} has shape {shape_str(leaf.shape)}, but the batch has "
                f"{B} examples (inputs[0] has {B} rows): {why}.\n  targets[i] must belong to "
                f"inputs[i]: every tensor in targets is split along its first dimension, "
                f"which must be {B}. Fix: a value shared by all examples (a weight, a "
                f"temperature) belongs in loss_fn (a closure or functools.partial) or in "
                f"targets as a Python number, not as a tensor without the batch."
            )


def check_max_norm(fn: str, max_norm: Any) -> float:
    if isinstance(max_norm, Tensor) and max_norm.numel() == 1:
        max_norm = max_norm.item()
    if isinstance(max_norm, Tensor):
        raise PerSampleTypeError(
            f"torch_vjp.{fn}: max_norm must be one positive number, got a tensor of shape "
            f"{shape_str(max_norm.shape)}.\n  Every example's gradient (all selected "
            f"parameters together) is scaled to the one L2 norm max_norm; pass a float, or "
            f"a tensor of one element."
        )
    # (numbers.Real: numpy's scalars too, np.float32 from a config or a sweep)
    if isinstance(max_norm, (bool, np.bool_)) or not isinstance(max_norm, numbers.Real):
        raise PerSampleTypeError(
            f"torch_vjp.{fn}: max_norm must be a positive number, got "
            f"{type(max_norm).__name__}.\n  Pass the clipping bound as a float (each "
            f"example's gradient is scaled to L2 norm at most max_norm)."
        )
    max_norm = float(max_norm)
    if not (max_norm > 0) or max_norm == float("inf"):
        raise PerSampleValueError(
            f"torch_vjp.{fn}: max_norm must be a positive finite number, got {max_norm}.\n"
            f"  Each example's gradient is scaled to L2 norm at most max_norm, so it must be "
            f"above 0 (0 would zero every gradient); for the plain sum without clipping, "
            f"call backward on the summed loss instead."
        )
    return max_norm


_BN_FIX = (
    "  Fix: put it in eval mode so that it uses its running statistics (model.eval(), or "
    "{access}.eval() for this module alone), or replace it with nn.GroupNorm(num_groups, {c}), "
    "which normalises each example on its own."
)


def access(path: str) -> str:
    if not path:
        return "model"
    out = "model"
    for part in path.split("."):
        out += f"[{part}]" if part.isdigit() else f".{part}"
    return out


def check_static_mixing(fn: str, model: nn.Module, batch: int) -> bool:
    """Raises PerSampleError for layers whose output for one example depends on the others
    (a BatchNorm that normalises with the batch's statistics). With one example there is no
    other example to depend on: nothing is raised, and False says the answer may differ at
    another batch size (the caller does not cache it); True where the model has no such layer."""
    for path, m in model.named_modules():
        check_opacus_hooks(fn, path, m)
        where = f"module '{path}'" if path else "the model itself"
        kind = type(m).__name__
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            c = getattr(m, "num_features", "C")
            if m.running_mean is None or m.running_var is None:
                if batch <= 1:
                    return False
                raise PerSampleError(
                    f"torch_vjp.{fn}: {where} ({kind}) has no running statistics "
                    f"(track_running_stats=False), so it normalises each example with the "
                    f"statistics of the whole batch in training and in eval mode alike, and "
                    f"per-sample gradients are not defined.\n  Fix: replace it with "
                    f"nn.GroupNorm(num_groups, {c}), which normalises each example on its own, "
                    f"or build it with track_running_stats=True and use it in eval mode."
                )
            if m.training:
                if batch <= 1:
                    return False
                raise PerSampleError(
                    f"torch_vjp.{fn}: {where} ({kind}) is in training mode, where it normalises "
                    f"each example with the mean and variance of the whole batch, so one "
                    f"example's gradient depends on every other example and per-sample "
                    f"gradients are not defined.\n" + _BN_FIX.format(access=access(path), c=c)
                )
    return True


@dataclass
class Selection:
    names: list[str]  # output keys, in order
    key_of: dict[str, str]  # output name -> canonical name of its tensor
    tensors: dict[str, Tensor]  # canonical name -> parameter
    owners: set[str]  # paths of modules that own a selected tensor (under any alias)
    frozen: bool  # some selected tensor does not require grad
    #: every module's training flag when the selection was made (set by the caller)
    training: tuple[bool, ...] = ()
    #: ``id`` of the selected weights of Embedding(Bag) layers with ``sparse=True`` (read
    #: from ``tables`` on every call: the flag is a plain attribute a user may switch)
    sparse: frozenset[int] = frozenset()
    #: the Embedding(Bag) layers whose weight is selected (weak references)
    tables: tuple[Any, ...] = ()

    @property
    def canonical(self) -> list[str]:
        return list(self.tensors)

    @property
    def tracked(self) -> dict[int, str]:
        """``id(tensor)`` of every selected tensor -> its canonical name (made once)."""
        found = self.__dict__.get("_tracked")
        if found is None:
            found = self.__dict__["_tracked"] = {id(t): n for n, t in self.tensors.items()}
        return found


def select(fn: str, model: nn.Module, params: Any) -> Selection:
    all_named = list(model.named_parameters(remove_duplicate=False))
    lazy = [n for n, p in all_named if isinstance(p, nn.parameter.UninitializedParameter)]
    if lazy:
        raise PerSampleValueError(
            f"torch_vjp.{fn}: the model has parameters that a lazy module has not created yet "
            f"({', '.join(repr(n) for n in lazy[:4])}{', ...' if len(lazy) > 4 else ''}): "
            f"they take their shapes from the first forward pass, and the per-sample "
            f"functions need the parameters before they run the model (to select them and "
            f"to keep the model as it was).\n  Fix: run the model once first, "
            f"model(inputs) under torch.no_grad() (in eval mode if it has batch norm), as "
            f"torch's own docs advise before an optimizer is made."
        )
    by_name = dict(all_named)
    if params is None:
        names = [n for n, p in model.named_parameters() if p.requires_grad]
        if not names:
            raise PerSampleValueError(
                f"torch_vjp.{fn}: the model has no parameter that requires grad, so there is "
                f"nothing to differentiate.\n  Pass params=[...] with the names of the "
                f"parameters you want (see model.named_parameters())."
            )
    else:
        if isinstance(params, str):
            params = [params]
        try:
            names = list(params)
        except TypeError:
            raise PerSampleTypeError(
                f"torch_vjp.{fn}: params must be None or a list of parameter names, got "
                f"{type(params).__name__}."
            ) from None
        for n in names:
            if not isinstance(n, str):
                raise PerSampleTypeError(
                    f"torch_vjp.{fn}: params must hold parameter names (str), got a "
                    f"{type(n).__name__}.\n  Use the names of model.named_parameters(), e.g. "
                    f"params=[name for name, _ in model.named_parameters()]."
                )
            if n not in by_name:
                known = ", ".join(repr(k) for k in list(by_name)[:8])
                more = ", ..." if len(by_name) > 8 else ""
                buffers = dict(model.named_buffers())
                what = (" It is a buffer (a state the forward reads or updates, such as "
                        "BatchNorm's running statistics), which has no gradient."
                        if n in buffers else "")
                raise PerSampleValueError(
                    f"torch_vjp.{fn}: params names {n!r}, which is not a parameter of the "
                    f"model.{what}\n  Its parameters are: {known}{more}."
                )
        if not names:
            raise PerSampleValueError(f"torch_vjp.{fn}: params is empty; name at least one parameter.")
        names = list(dict.fromkeys(names))
    canon_of_id: dict[int, str] = {}
    for n, p in all_named:
        canon_of_id.setdefault(id(p), n)
    key_of = {n: canon_of_id[id(by_name[n])] for n in names}
    tensors = {}
    for n in names:
        c = key_of[n]
        tensors.setdefault(c, by_name[c])
    ids = {id(t) for t in tensors.values()}
    owners = {n.rpartition(".")[0] for n, p in all_named if id(p) in ids}
    frozen = any(not t.requires_grad for t in tensors.values())
    return Selection(names, key_of, tensors, owners, frozen)


@dataclass
class Job:
    """One call of a public per-sample function, its arguments checked: what every step of
    the computation (planning, the rules' pass, the fallbacks, the check) works on.

    Attributes:
        fn: the public function's name, for messages.
        model, loss_fn: as given.
        xs: the inputs as a tuple of tensors, the examples along dimension 0.
        targets: as given (None, or a pytree of tensors with the examples along dimension 0).
        sel: the selected parameters.
        batch: the number of examples B.
        strategy: the strategy asked for.
        reset: puts back the buffers a forward changes (None where none does); the
            per-example runs call it before each example.
        ddp: the DistributedDataParallel wrapper the caller passed (``model`` is then its
            module), or None (NOTE [DDP] in ``distributed``).
        structure: :func:`~torch_vjp._per_sample.structure.structure_of` the model.
        by_backward: the per-example loop differentiates with ``backward()`` (a reentrant
            checkpoint refused ``autograd.grad``: NOTE [reentrant checkpoints] in
            ``fallback``).
        batch_failure: the error the model raised on the whole batch when the plan was
            made (its parameters then go to the fallback), quoted, for the note on an error
            the model raises on one example (:func:`~torch_vjp._per_sample.fallback.loop_grads`).
        replanned: the plan made anew during the call (the layers called were not the
            plan's), which the call's results came from and the check must judge; or None.
    """

    fn: str
    model: nn.Module
    loss_fn: Callable[..., Any]
    xs: tuple[Tensor, ...]
    targets: Any
    sel: Selection
    batch: int
    strategy: str
    reset: Callable[[], None] | None = None
    ddp: Any = None
    structure: Any = None
    by_backward: bool = False
    replanned: Any = None
    batch_failure: str | None = None


def params_once(params: Any) -> Any:
    """``params`` as a list where it is an iterable of names other than a str: a generator
    or iterator is read once, and several steps of a call read the names (the check of
    what requires grad, the selection, a compiled run and its eager twin)."""
    if params is None or isinstance(params, (str, list, tuple)):
        return params
    try:
        return list(params)
    except TypeError:
        return params  # (select() reports it)


def check_trainable(fn: str, model: nn.Module, params: Any) -> None:
    """Refuses a selected parameter that does not require grad where ``.grad`` is written."""
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

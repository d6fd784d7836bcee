"""Per-sample gradients, their norms, and the DP-SGD clipped-sum step.

Shape convention: for a batch of ``B`` examples, the per-sample gradient of a parameter of
shape ``S`` has shape ``(B, *S)``; entry ``[i]`` is the gradient of
``loss_fn(model(inputs[i:i+1]), targets[i:i+1])``, the gradient example ``i`` gives alone.

Strategies:

- ``"hooks"``: per-layer rules (``torch_vjp._per_sample_rules``) applied to the activations and
  output gradients of one ordinary forward and backward pass of the whole batch. Fastest, and
  the only one that can give norms and clipped sums without forming per-sample gradients.
- ``"vmap"``: ``torch.func.vmap(torch.func.grad(...))`` over ``functional_call``, one example
  per vmapped call (the torch.func recipe).
- ``"loop"``: one forward and backward per example.
- ``"auto"``: ``"hooks"`` for every parameter a rule covers, ``"vmap"`` for the rest (``"loop"``
  where vmap cannot batch the model). No parameter is ever skipped.
"""

from __future__ import annotations

import threading
import warnings
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten, tree_map

from torch_vjp import _per_sample_rules as rules
from torch_vjp._core import _passes_through, _quote, _user_stacklevel
from torch_vjp._errors import PerSampleError, StrategyError, TorchVJPWarning, shape_str

__all__ = [
    "per_sample_grads",
    "per_sample_grad_norms",
    "accumulate_clipped_grads",
    "release_cached_buffers",
    "PerSampleValueError",
    "PerSampleTypeError",
]

Strategy = Literal["auto", "hooks", "vmap", "loop"]
STRATEGIES: tuple[str, ...] = ("auto", "hooks", "vmap", "loop")


class PerSampleValueError(PerSampleError, ValueError):
    """A per-sample call got an argument of the right type but a wrong value or shape."""


class PerSampleTypeError(PerSampleError, TypeError):
    """A per-sample call got an argument of the wrong type."""


# ============================================================================================
# Argument checks
# ============================================================================================


def _check_strategy(fn: str, strategy: Any) -> str:
    if strategy not in STRATEGIES:
        raise StrategyError(
            f"torch_vjp.{fn}: invalid strategy {strategy!r}. Supported: {STRATEGIES}.\n"
            f"  'auto' uses the per-layer rules ('hooks') where every layer with parameters has "
            f"one and 'vmap' for the rest; 'loop' runs one backward per example."
        )
    return strategy


def _check_model(fn: str, model: Any) -> None:
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


def _as_inputs(fn: str, inputs: Any) -> tuple[tuple[Tensor, ...], int]:
    """Normalises ``inputs`` to a tuple of tensors and returns the batch size."""
    xs = (inputs,) if isinstance(inputs, Tensor) else inputs
    if not isinstance(xs, (tuple, list)) or len(xs) == 0:
        raise PerSampleTypeError(
            f"torch_vjp.{fn}: inputs must be a tensor or a tuple of tensors, got "
            f"{type(inputs).__name__}.\n"
            f"  Each tensor holds the batch along its first dimension and is passed as "
            f"model(*inputs)."
        )
    for k, x in enumerate(xs):
        if not isinstance(x, Tensor):
            raise PerSampleTypeError(
                f"torch_vjp.{fn}: inputs[{k}] is a {type(x).__name__}, not a tensor.\n"
                f"  inputs must be a tensor or a tuple of tensors, each with the batch along "
                f"its first dimension; bind other arguments of the model in the module."
            )
        if x.dim() == 0:
            raise PerSampleValueError(
                f"torch_vjp.{fn}: inputs[{k}] is a 0-dimensional tensor, so it has no batch "
                f"dimension.\n  Per-sample gradients split every input along its first "
                f"dimension, one example per row."
            )
    B = xs[0].shape[0]
    for k, x in enumerate(xs[1:], 1):
        if x.shape[0] != B:
            raise PerSampleValueError(
                f"torch_vjp.{fn}: inputs[{k}] has shape {shape_str(x.shape)}, but inputs[0] has "
                f"shape {shape_str(xs[0].shape)}: their first dimensions (the batch) differ, "
                f"{x.shape[0]} vs {B}.\n  Every input must hold the same examples along its "
                f"first dimension."
            )
    if B == 0:
        raise PerSampleValueError(f"torch_vjp.{fn}: the batch is empty (inputs[0] has shape "
                                  f"{shape_str(xs[0].shape)}).")
    return tuple(xs), B


def _check_targets(fn: str, targets: Any, B: int) -> None:
    if targets is None:
        return
    leaves, _ = tree_flatten(targets)
    for leaf in leaves:
        if isinstance(leaf, Tensor) and (leaf.dim() == 0 or leaf.shape[0] != B):
            raise PerSampleValueError(
                f"torch_vjp.{fn}: targets has shape {shape_str(leaf.shape)}, but the batch has "
                f"{B} examples (inputs[0] has {B} rows).\n  targets[i] must belong to "
                f"inputs[i]: the first dimension of targets must be {B}."
            )


def _check_max_norm(fn: str, max_norm: Any) -> float:
    if isinstance(max_norm, Tensor) and max_norm.numel() == 1:
        max_norm = max_norm.item()
    if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)):
        raise PerSampleTypeError(
            f"torch_vjp.{fn}: max_norm must be a positive number, got "
            f"{type(max_norm).__name__}."
        )
    if not (max_norm > 0) or max_norm == float("inf"):
        raise PerSampleValueError(
            f"torch_vjp.{fn}: max_norm must be a positive finite number, got {max_norm}.\n"
            f"  Each example's gradient is scaled to L2 norm at most max_norm."
        )
    return float(max_norm)


def _check_chunk_size(fn: str, chunk_size: Any) -> int | None:
    if chunk_size is None:
        return None
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise PerSampleValueError(
            f"torch_vjp.{fn}: chunk_size must be None or a positive int, got {chunk_size!r}."
        )
    return chunk_size


_BN_FIX = (
    "  Fix: put it in eval mode so that it uses its running statistics (model.eval(), or "
    "{access}.eval() for this module alone), or replace it with nn.GroupNorm(num_groups, {c}), "
    "which normalises each example on its own."
)


def _access(path: str) -> str:
    if not path:
        return "model"
    out = "model"
    for part in path.split("."):
        out += f"[{part}]" if part.isdigit() else f".{part}"
    return out


def _check_mixing(fn: str, model: nn.Module) -> None:
    """Raises PerSampleError for layers whose output for one example depends on the others."""
    for path, m in model.named_modules():
        where = f"module '{path}'" if path else "the model itself"
        kind = type(m).__name__
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            c = getattr(m, "num_features", "C")
            if m.training:
                raise PerSampleError(
                    f"torch_vjp.{fn}: {where} ({kind}) is in training mode, where it normalises "
                    f"each example with the mean and variance of the whole batch, so one "
                    f"example's gradient depends on every other example and per-sample "
                    f"gradients are not defined.\n" + _BN_FIX.format(access=_access(path), c=c)
                )
            if m.running_mean is None or m.running_var is None:
                raise PerSampleError(
                    f"torch_vjp.{fn}: {where} ({kind}) has no running statistics "
                    f"(track_running_stats=False), so it normalises each example with the "
                    f"statistics of the whole batch even in eval mode, and per-sample "
                    f"gradients are not defined.\n  Fix: replace it with "
                    f"nn.GroupNorm(num_groups, {c}), which normalises each example on its own, "
                    f"or build it with track_running_stats=True and use it in eval mode."
                )
        elif isinstance(m, nn.modules.instancenorm._InstanceNorm):
            if m.training and m.track_running_stats:
                raise PerSampleError(
                    f"torch_vjp.{fn}: {where} ({kind}) is in training mode with "
                    f"track_running_stats=True, so every forward pass updates its running "
                    f"statistics from the whole batch; computing per-sample gradients would "
                    f"change the model.\n  Fix: put it in eval mode "
                    f"({_access(path)}.eval()), or build it with track_running_stats=False."
                )


# ============================================================================================
# Parameter selection
# ============================================================================================


@dataclass
class _Selection:
    names: list[str]  # output keys, in order
    key_of: dict[str, str]  # output name -> canonical name of its tensor
    tensors: dict[str, Tensor]  # canonical name -> parameter
    owners: set[str]  # paths of modules that own a selected tensor (under any alias)
    frozen: bool  # some selected tensor does not require grad

    @property
    def canonical(self) -> list[str]:
        return list(self.tensors)


def _select(fn: str, model: nn.Module, params: Any) -> _Selection:
    all_named = list(model.named_parameters(remove_duplicate=False))
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
                raise PerSampleValueError(
                    f"torch_vjp.{fn}: params names {n!r}, which is not a parameter of the model.\n"
                    f"  Its parameters are: {known}{more}."
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
    return _Selection(names, key_of, tensors, owners, frozen)


# ============================================================================================
# Reusable output memory
# ============================================================================================

# NOTE [Output buffer reuse]
# Materialised per-sample gradients are B times the model's size. On CPU, a fresh allocation of
# that size is served by mmap and costs a page fault per 4 KiB page on first write, which
# dominates the whole computation (about 8x the arithmetic on an MLP). The hooks and loop
# strategies therefore write into one flat buffer per call, and keep the most recent buffer.
# When the caller has dropped every tensor of an earlier result (the buffer's storage has no
# user other than this pool), the next call of the same dtype and device reuses it; while
# any of the results is alive, a fresh buffer is taken. Results are never overwritten behind
# the caller's back. ``release_cached_buffers()`` gives the memory back.

_MIN_POOLED_BYTES = 1 << 20


class _BufferPool:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._buffers: dict[tuple[torch.dtype, torch.device], Tensor] = {}
        self._use_count = getattr(torch._C, "_storage_Use_Count", None)

    def _free(self, buf: Tensor) -> bool:
        if self._use_count is None:
            return False
        # One reference is the pool's tensor, one the temporary storage object of this query.
        return self._use_count(buf.untyped_storage()._cdata) <= 2

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> Tensor:
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        if device.type != "cpu" or nbytes < _MIN_POOLED_BYTES or self._use_count is None:
            return torch.empty(numel, dtype=dtype, device=device)
        key = (dtype, device)
        with self._lock:
            buf = self._buffers.get(key)
            if buf is not None and buf.numel() >= numel and self._free(buf):
                return buf[:numel]
            new = torch.empty(numel, dtype=dtype, device=device)
            self._buffers[key] = new
            return new[:numel]

    def clear(self) -> None:
        with self._lock:
            self._buffers.clear()


_POOL = _BufferPool()


def release_cached_buffers() -> None:
    """Frees the output memory kept for reuse between calls (see NOTE [Output buffer reuse]).

    Results already returned stay valid; only the pool's own reference is dropped.

    Examples:
        >>> import torch_vjp.per_sample as ps
        >>> ps.release_cached_buffers()
    """
    _POOL.clear()


# ============================================================================================
# Per-example losses
# ============================================================================================

# Loss modules whose batch value is the mean (or sum) of the per-example values computed on
# single-example slices, for any layout with the batch first. CrossEntropy / NLL qualify only
# without class weights and with no ignored target (their mean divides by the kept weight).
_SEPARABLE_LOSSES: tuple[type, ...] = (
    nn.CrossEntropyLoss,
    nn.NLLLoss,
    nn.MSELoss,
    nn.L1Loss,
    nn.SmoothL1Loss,
    nn.HuberLoss,
    nn.BCELoss,
    nn.BCEWithLogitsLoss,
)
_SEPARABLE_FUNCTIONS: dict[Any, bool] = {
    F.cross_entropy: True,
    F.nll_loss: True,
    F.mse_loss: False,
    F.l1_loss: False,
}


def _separable_function(loss_fn: Any) -> bool | None:
    """Whether ``loss_fn`` is one of the functional losses of ``_SEPARABLE_FUNCTIONS`` (and
    whether it ignores target -100), or None; by identity, since a loss object need not be
    hashable."""
    for known, ignores in _SEPARABLE_FUNCTIONS.items():
        if loss_fn is known:
            return ignores
    return None


def _reduction_scale(loss_fn: Any, out: Any, targets: Any, B: int) -> float | None:
    """Scale turning ``loss_fn(out, targets)`` into the sum of the per-example losses, or None."""
    if not isinstance(out, Tensor) or not isinstance(targets, Tensor) or out.dim() == 0:
        return None
    if out.shape[0] != B or targets.shape[0] != B:
        return None
    ignore: int | None = None
    if type(loss_fn) in _SEPARABLE_LOSSES:
        if getattr(loss_fn, "weight", None) is not None:
            return None
        reduction = loss_fn.reduction
        ignore = getattr(loss_fn, "ignore_index", None)
    elif _separable_function(loss_fn) is not None:
        reduction = "mean"
        if _separable_function(loss_fn):
            ignore = -100
    else:
        return None
    if ignore is not None and not targets.is_floating_point():
        if bool((targets == ignore).any()):
            return None
    if reduction == "mean":
        return float(B)
    if reduction == "sum":
        return 1.0
    return None


def _scalar_loss(fn: str, loss: Any) -> Tensor:
    if not isinstance(loss, Tensor) or loss.numel() != 1 or not loss.is_floating_point():
        got = (
            f"a tensor of shape {shape_str(loss.shape)} and dtype {loss.dtype}"
            if isinstance(loss, Tensor)
            else f"a {type(loss).__name__}"
        )
        raise PerSampleValueError(
            f"torch_vjp.{fn}: loss_fn returned {got} for one example; it must return one "
            f"floating-point number per example (the loss of that example).\n  The gradient of "
            f"a loss is only defined for a scalar: use reduction='mean' or 'sum' rather than "
            f"'none'."
        )
    return loss.reshape(())


def _unsqueeze0(t: Any) -> Any:
    return t.unsqueeze(0) if isinstance(t, Tensor) else t


def _slice(t: Any, s: int, e: int) -> Any:
    return tree_map(lambda z: z[s:e] if isinstance(z, Tensor) else z, t)


def _call_loss(loss_fn: Callable, out: Any, targets: Any) -> Any:
    return loss_fn(out) if targets is None else loss_fn(out, targets)


def _loss_sum(fn: str, loss_fn: Callable, out: Any, targets: Any, B: int) -> Tensor:
    """``sum_i loss_fn(out[i:i+1], targets[i:i+1])``, whose gradient w.r.t. ``out`` holds every
    example's own output gradient."""
    scale = _reduction_scale(loss_fn, out, targets, B)
    if scale is not None:
        loss = _scalar_loss(fn, loss_fn(out, targets))
        return loss * scale if scale != 1.0 else loss

    def one(o: Any, t: Any) -> Tensor:
        return _scalar_loss(fn, _call_loss(loss_fn, tree_map(_unsqueeze0, o), tree_map(_unsqueeze0, t)))

    try:
        losses = torch.func.vmap(one, in_dims=(0, 0 if targets is not None else None),
                                 randomness="different")(out, targets)
        return losses.sum()
    except Exception as err:
        if _passes_through(err):
            raise
        # loss_fn cannot be vmapped: call it on each example's slice (its own errors surface).
        total = None
        for i in range(B):
            li = _scalar_loss(fn, _call_loss(loss_fn, _slice(out, i, i + 1), _slice(targets, i, i + 1)))
            total = li if total is None else total + li
        assert total is not None
        return total


# ============================================================================================
# The hooks strategy
# ============================================================================================


@dataclass
class _HooksResult:
    factors: dict[str, list[rules.Factor]] = field(default_factory=dict)  # covered names
    zero: list[str] = field(default_factory=list)  # selected, no gradient reaches them
    uncovered: dict[str, str] = field(default_factory=dict)  # name -> why no rule applies


# Probe results, per model and per signature of the recorded calls (see _resolve_batch_dims).
_PROBES: weakref.WeakKeyDictionary[nn.Module, dict[Any, Any]] = weakref.WeakKeyDictionary()


def _forward(model: nn.Module, xs: tuple[Tensor, ...], aliases: dict[str, Tensor] | None) -> Any:
    if aliases is None:
        return model(*xs)
    return torch.func.functional_call(model, aliases, xs, strict=False, tie_weights=True)


def _resolve_batch_dims(
    rec: rules.Recorder,
    model: nn.Module,
    xs: tuple[Tensor, ...],
    aliases: dict[str, Tensor] | None,
    B: int,
) -> None:
    """Finds the dimension that holds the examples in each recorded call's input.

    A call is clear when its input's first dimension is the only allowed one of size B (or
    attention's batch dimension has size B). Otherwise the model is run once more on the first
    example alone and the dimension that went from B to 1 is the batch dimension; calls for
    which no single such dimension exists are left to the fallback.
    """
    module_calls = [c for c in rec.calls if not c.fixed]
    ambiguous = []
    for c in rec.calls:
        shape = c.x_shape
        if c.fixed:
            d = c.allowed[0]
            if len(shape) > d and shape[d] == B:
                c.bdim = d
            else:
                c.valid, c.reason = False, "its attention input does not hold the batch in the dimension nn.MultiheadAttention expects"
            continue
        if B == 1:
            if 0 in c.allowed and shape[0] == 1:
                c.bdim = 0
            elif isinstance(c.rule, (rules.LinearRule, rules.EmbeddingRule, rules.LayerNormRule,
                                     rules.RMSNormRule)):
                c.bdim = None  # one example: every position belongs to it
            else:
                c.valid, c.reason = False, f"its input of shape {shape_str(shape)} has no batch dimension"
            continue
        cands = [d for d in c.allowed if shape[d] == B]
        if cands == [0]:
            c.bdim = 0
        else:
            ambiguous.append(c)
    if not ambiguous:
        return
    signature = (model.training, tuple((id(c.module), c.x_shape) for c in module_calls))
    cache = _PROBES.setdefault(model, {})
    probe = cache.get(signature)
    if probe is None:
        rec.shapes = []
        rec.probing = True
        rec.capturing = True
        try:
            with torch.enable_grad():
                _forward(model, tuple(x[:1] for x in xs), aliases)
        finally:
            rec.probing = False
            rec.capturing = False
        probe = list(rec.shapes)
        if len(cache) > 16:
            cache.clear()
        cache[signature] = probe
    aligned = len(probe) == len(module_calls) and all(
        pid == id(c.module) for (pid, _), c in zip(probe, module_calls)
    )
    where = {id(c): k for k, c in enumerate(module_calls)}
    for c in ambiguous:
        found: list[int] = []
        if aligned:
            sp = probe[where[id(c)]][1]
            sf = c.x_shape
            if len(sp) == len(sf):
                for d in c.allowed:
                    if sf[d] == B and sp[d] == 1 and all(
                        sf[j] == sp[j] for j in range(len(sf)) if j != d
                    ):
                        found.append(d)
        if len(found) == 1:
            c.bdim = found[0]
        else:
            c.valid = False
            c.reason = (
                f"no single dimension of its input (shape {shape_str(c.x_shape)}) holds the "
                f"examples"
            )


def _owner_reason(model: nn.Module, name: str) -> str:
    path = name.rpartition(".")[0]
    try:
        m = model.get_submodule(path)
    except AttributeError:
        return "it has no per-layer rule"
    if not path:
        return f"it belongs to the model itself, a {type(m).__name__}, which has no per-layer rule"
    return f"its module '{path}' is a {type(m).__name__}, which has no per-layer rule"


def _hooks_pass(*args: Any, **kwargs: Any) -> _HooksResult:
    """Runs :func:`_hooks_pass_impl` with grad mode on (the caller may be under no_grad)."""
    with torch.enable_grad():
        return _hooks_pass_impl(*args, **kwargs)


def _hooks_pass_impl(
    fn: str,
    model: nn.Module,
    loss_fn: Callable,
    xs: tuple[Tensor, ...],
    targets: Any,
    sel: _Selection,
    B: int,
    guard_user_errors: bool,
) -> _HooksResult:
    """One forward and backward of the whole batch; returns factors for the covered parameters.

    With ``guard_user_errors`` (strategy ``"auto"``), an exception raised by the model or the
    loss on the whole batch makes every parameter uncovered instead of propagating: the
    fallback strategies run the model one example at a time, as the definition does.
    """
    result = _HooksResult()
    aliases = None
    if sel.frozen:
        aliases = {n: t.detach().requires_grad_(True) for n, t in sel.tensors.items()}
        tracked = {id(t): n for n, t in aliases.items()}
    else:
        tracked = {id(t): n for n, t in sel.tensors.items()}
    rec = rules.Recorder(model, tracked, B, sel.owners)
    try:
        rec.install()
        rec.capturing = True
        try:
            out = _forward(model, xs, aliases)
        except Exception as err:
            if not guard_user_errors or _passes_through(err):
                raise
            result.uncovered = {n: "the model failed on the whole batch" for n in sel.canonical}
            return result
        finally:
            rec.capturing = False
        leaves = [t for t in tree_flatten(out)[0] if isinstance(t, Tensor)]
        if not leaves or any(t.dim() == 0 or t.shape[0] != B for t in leaves):
            shapes = ", ".join(shape_str(t.shape) for t in leaves) or "no tensor"
            reason = f"the model's output ({shapes}) does not hold the {B} examples along its first dimension"
            result.uncovered = {n: reason for n in sel.canonical}
            return result
        _resolve_batch_dims(rec, model, xs, aliases, B)
    finally:
        rec.remove()

    try:
        total = _loss_sum(fn, loss_fn, out, targets, B)
    except Exception as err:
        if not guard_user_errors or _passes_through(err):
            raise
        result.uncovered = {n: "the loss failed on the whole batch" for n in sel.canonical}
        return result
    if not total.requires_grad:
        result.zero = list(sel.canonical)
        return result

    # Which parameters every use of goes through a rule? Invalid calls disqualify theirs.
    calls = rec.calls
    for c in calls:
        if c.valid and c.x._version != c.x_version:
            c.valid = False
            c.reason = "its input was modified in place after the layer used it"
    bad: dict[str, str] = {}
    for c in calls:
        if not c.valid:
            for t, _ in c.params.values():
                bad.setdefault(tracked[id(t)], f"in '{c.path}', {c.reason}")
    outside = _walk(total, calls, tracked)
    with_calls = {tracked[id(t)] for c in calls if c.valid for t, _ in c.params.values()}
    for n in sel.canonical:
        if n in bad:
            result.uncovered[n] = bad[n]
        elif n in outside:
            result.uncovered[n] = (
                "it is used outside the layers that have rules"
                if n in with_calls
                else _owner_reason(model, n)
            )
        elif n not in with_calls:
            result.zero.append(n)
    covered = {n for n in with_calls if n not in result.uncovered}
    needed = [
        c for c in calls
        if c.valid and c.out_edge is not None
        and any(tracked[id(t)] in covered for t, _ in c.params.values())
    ]
    if needed:
        grads = torch.autograd.grad(total, [c.out_edge for c in needed], allow_unused=True)
    else:
        grads = ()
    del total, out
    with torch.no_grad():
        for c, g in zip(needed, grads):
            if g is None:
                continue
            roles = {r for r, (t, _) in c.params.items() if tracked[id(t)] in covered}
            c.x = c.x.detach()
            if tuple(g.shape) != c.out_shape:
                g = g.reshape(c.out_shape)
            for role, factor in c.rule.factors(c, g, roles, B):
                result.factors.setdefault(tracked[id(c.params[role][0])], []).append(factor)
    for n in covered:
        if n not in result.factors:
            result.zero.append(n)
    return result


def _walk(total: Tensor, calls: list[rules.Call], tracked: dict[int, str]) -> set[str]:
    """Names of tracked parameters the loss reaches other than through a valid rule call.

    Walks the autograd graph from the loss; at the output node of a valid call it continues
    only into the call's input, skipping the layer's own use of its parameters. A call whose
    weight is computed from a parameter (a parametrization) is walked through, so that
    parameter is found and left to the fallback rather than mistaken for unused.
    """
    jump: dict[Any, list[Any]] = {}
    for c in calls:
        if c.valid and c.complete and c.out_edge is not None:
            jump[c.out_edge.node] = [e.node for e in c.in_edges]
    found: set[str] = set()
    seen: set[Any] = set()
    stack = [total.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        nxt = jump.get(node)
        if nxt is not None:
            stack.extend(nxt)
            continue
        var = getattr(node, "variable", None)
        if var is not None:
            name = tracked.get(id(var))
            if name is not None:
                found.add(name)
            continue
        stack.extend(n for n, _ in node.next_functions)
    return found


# --------------------------------------------------------------------------------------------
# Combining the factors of one parameter
# --------------------------------------------------------------------------------------------


def _rows_key(rows: slice | None) -> tuple[int, int] | None:
    return None if rows is None else (rows.start, rows.stop)


def _write_param(factors: list[rules.Factor], out: Tensor, chunk_size: int | None) -> None:
    """Writes the per-sample gradients of one parameter into ``out`` ``(B, *shape)``."""
    whole_first = factors[0].rows is None
    if not whole_first:
        out.zero_()
    for k, f in enumerate(factors):
        region = out if f.rows is None else out[:, f.rows]
        f.write(region, accumulate=k > 0 or not whole_first, chunk_size=chunk_size)


def _param_sq_norms(factors: list[rules.Factor], shape: tuple[int, ...], B: int, like: Tensor) -> Tensor:
    """Squared per-sample norms of one parameter, without materialising where factors allow."""
    groups: dict[Any, list[rules.Factor]] = {}
    for f in factors:
        groups.setdefault(_rows_key(f.rows), []).append(f)
    keys = list(groups)
    disjoint = len(keys) == 1 or (
        None not in keys
        and all(a[1] <= b[0] for a, b in zip(sorted(keys), sorted(keys)[1:]))  # type: ignore[index]
    )
    if disjoint:
        merged = [rules.merge_factors(g) for g in groups.values()]
        if all(m is not None for m in merged):
            total = None
            for m in merged:
                sq = m.sq_norms(None)  # type: ignore[union-attr]
                total = sq if total is None else total + sq
            return total  # type: ignore[return-value]
    # Factors of different kinds share a region (e.g. tied weights): materialise this one.
    buf = like.new_empty((B, *shape))
    _write_param(factors, buf, None)
    return rules.sq_norms_rows(buf)


def _param_weighted_sum(factors: list[rules.Factor], c: Tensor, param: Tensor) -> Tensor:
    if len(factors) == 1 and factors[0].rows is None:
        return factors[0].weighted_sum(c).reshape(param.shape)
    total = torch.zeros(param.shape, dtype=c.dtype, device=c.device)
    for f in factors:
        region = total if f.rows is None else total[f.rows]
        region.add_(f.weighted_sum(c).reshape(region.shape))
    return total


# ============================================================================================
# The vmap and loop strategies
# ============================================================================================


def _functional_state(model: nn.Module) -> dict[str, Tensor]:
    state = {n: p.detach() for n, p in model.named_parameters()}
    state.update({n: b.detach() if isinstance(b, Tensor) else b for n, b in model.named_buffers()})
    return state


def _vmap_grads(
    fn: str,
    model: nn.Module,
    loss_fn: Callable,
    xs: tuple[Tensor, ...],
    targets: Any,
    sel: _Selection,
    names: list[str],
    chunk_size: int | None,
) -> dict[str, Tensor]:
    """Per-sample gradients of the canonical ``names`` with torch.func (vmap of grad)."""
    state = _functional_state(model)
    diff = {n: sel.tensors[n].detach() for n in names}
    for n in names:
        state.pop(n, None)

    def one(d: dict[str, Tensor], xi: tuple[Tensor, ...], ti: Any) -> Tensor:
        out = torch.func.functional_call(
            model, {**state, **d}, tuple(x.unsqueeze(0) for x in xi), strict=False, tie_weights=True
        )
        return _scalar_loss(fn, _call_loss(loss_fn, out, tree_map(_unsqueeze0, ti)))

    in_dims = (None, 0, 0 if targets is not None else None)
    return torch.func.vmap(
        torch.func.grad(one), in_dims=in_dims, randomness="different", chunk_size=chunk_size
    )(diff, xs, targets)


def _loop_grads(
    fn: str,
    model: nn.Module,
    loss_fn: Callable,
    xs: tuple[Tensor, ...],
    targets: Any,
    sel: _Selection,
    names: list[str],
    start: int,
    stop: int,
    out: dict[str, Tensor],
) -> None:
    """Writes the per-sample gradients of examples ``start:stop`` into ``out[name][i - start]``."""
    frozen = any(not sel.tensors[n].requires_grad for n in names)
    for i in range(start, stop):
        xi = tuple(x[i : i + 1] for x in xs)
        with torch.enable_grad():
            if frozen:
                leaves = {n: sel.tensors[n].detach().requires_grad_(True) for n in names}
                o = torch.func.functional_call(model, leaves, xi, strict=False, tie_weights=True)
                wrt = [leaves[n] for n in names]
            else:
                o = model(*xi)
                wrt = [sel.tensors[n] for n in names]
            loss = _scalar_loss(fn, _call_loss(loss_fn, o, _slice(targets, i, i + 1)))
            grads = torch.autograd.grad(loss, wrt, allow_unused=True) if loss.requires_grad else [None] * len(wrt)
        for n, g in zip(names, grads):
            if g is None:
                out[n][i - start].zero_()
            else:
                out[n][i - start].copy_(g)


def _fallback_grads(
    fn: str,
    strategy: str,
    model: nn.Module,
    loss_fn: Callable,
    xs: tuple[Tensor, ...],
    targets: Any,
    sel: _Selection,
    names: list[str],
    start: int,
    stop: int,
    chunk_size: int | None,
) -> dict[str, Tensor]:
    """Per-sample gradients of ``names`` for examples ``start:stop`` by vmap, else the loop."""
    xs_c = tuple(x[start:stop] for x in xs)
    t_c = _slice(targets, start, stop)
    if strategy in ("auto", "vmap"):
        try:
            return _vmap_grads(fn, model, loss_fn, xs_c, t_c, sel, names, chunk_size)
        except Exception as err:
            if strategy == "vmap" or _passes_through(err):
                raise
            vmap_error = err
    else:
        vmap_error = None
    out = {n: sel.tensors[n].new_empty((stop - start, *sel.tensors[n].shape)) for n in names}
    _loop_grads(fn, model, loss_fn, xs, targets, sel, names, start, stop, out)
    if vmap_error is not None:
        _warn_loop(fn, model, vmap_error)
    return out


_WARNED: set[tuple[str, type]] = set()


def _warn_loop(fn: str, model: nn.Module, err: BaseException) -> None:
    """One warning per function and model class when ``"auto"`` had to loop over examples."""
    key = (fn, type(model))
    if key in _WARNED:
        return
    _WARNED.add(key)
    warnings.warn(
        f"torch_vjp.{fn}: strategy='auto' could not vectorise the per-sample gradients of "
        f"{type(model).__name__} with vmap, so it used one backward pass per example, usually "
        f"many times slower.\n"
        f"  The vectorised attempt said: {_quote(err)}\n"
        f"  Typical causes: .item() or Python control flow on tensor values in the model, "
        f"NumPy calls, an operator without a batching rule. Pass strategy='loop' to skip the "
        f"vectorised attempt. This warning is shown once per model class.",
        TorchVJPWarning,
        stacklevel=_user_stacklevel(),
    )


def _fallback_chunk(sel: _Selection, names: list[str], B: int) -> int:
    per_example = sum(sel.tensors[n].numel() for n in names)
    return max(1, min(B, (rules.CHUNK_ELEMENTS * 2) // max(1, per_example)))


# ============================================================================================
# Public functions
# ============================================================================================


def _prepare(fn: str, model: Any, inputs: Any, targets: Any, params: Any, strategy: Any):
    _check_strategy(fn, strategy)
    _check_model(fn, model)
    xs, B = _as_inputs(fn, inputs)
    _check_targets(fn, targets, B)
    sel = _select(fn, model, params)
    _check_mixing(fn, model)
    return xs, B, sel


def _hooks_or_none(fn, strategy, model, loss_fn, xs, targets, sel, B) -> _HooksResult | None:
    if strategy not in ("auto", "hooks"):
        return None
    res = _hooks_pass(fn, model, loss_fn, xs, targets, sel, B, guard_user_errors=strategy == "auto")
    if strategy == "hooks" and res.uncovered:
        lines = "\n".join(f"    {n!r}: {why}" for n, why in res.uncovered.items())
        raise StrategyError(
            f"torch_vjp.{fn}: strategy='hooks' has no per-layer rule for {len(res.uncovered)} "
            f"parameter(s):\n{lines}\n  Rules exist for nn.Linear, nn.Conv1d, nn.Conv2d, "
            f"nn.Embedding, nn.LayerNorm, nn.RMSNorm, nn.GroupNorm, BatchNorm in eval mode and "
            f"nn.MultiheadAttention, used as modules. Use strategy='auto', which computes the "
            f"other parameters with vmap, or strategy='vmap'."
        )
    return res


def per_sample_grads(
    model: nn.Module,
    loss_fn: Callable[..., Tensor],
    inputs: Tensor | Sequence[Tensor],
    targets: Any = None,
    *,
    params: Iterable[str] | None = None,
    strategy: Strategy = "auto",
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
        (or of ``model.named_parameters()``). The hooks and loop strategies return views into
        one buffer that a later call reuses once all of them have been dropped (see
        :func:`release_cached_buffers`).

    Raises:
        StrategyError: unknown strategy, or ``"hooks"`` for a parameter no rule covers.
        PerSampleError: a layer mixes examples (BatchNorm in training mode); the message names
            the module and the fixes. Subclasses ``PerSampleValueError`` /
            ``PerSampleTypeError`` for malformed arguments.

    Examples:
        >>> import torch, torch_vjp.per_sample as ps
        >>> model = torch.nn.Linear(3, 2).double()
        >>> x, y = torch.randn(4, 3, dtype=torch.float64), torch.tensor([0, 1, 1, 0])
        >>> loss_fn = torch.nn.CrossEntropyLoss()
        >>> g = ps.per_sample_grads(model, loss_fn, x, y)
        >>> g["weight"].shape
        torch.Size([4, 2, 3])
        >>> ref = torch.autograd.grad(loss_fn(model(x[2:3]), y[2:3]), model.weight)[0]
        >>> torch.allclose(g["weight"][2], ref)
        True
    """
    fn = "per_sample_grads"
    chunk_size = _check_chunk_size(fn, chunk_size)
    xs, B, sel = _prepare(fn, model, inputs, targets, params, strategy)
    hooks = _hooks_or_none(fn, strategy, model, loss_fn, xs, targets, sel, B)
    if hooks is None:
        rest = list(sel.canonical)
        here = [] if strategy == "vmap" else list(sel.canonical)
    else:
        rest = list(hooks.uncovered)
        here = [n for n in sel.canonical if n not in hooks.uncovered]

    results: dict[str, Tensor] = {}
    if here:
        views: dict[str, Tensor] = {}
        groups: dict[tuple[torch.dtype, torch.device], list[str]] = {}
        for n in here:
            p = sel.tensors[n]
            groups.setdefault((p.dtype, p.device), []).append(n)
        for (dtype, device), names in groups.items():
            flat = _POOL.take(sum(B * sel.tensors[n].numel() for n in names), dtype, device)
            off = 0
            for n in names:
                p = sel.tensors[n]
                views[n] = flat[off : off + B * p.numel()].view(B, *p.shape)
                off += B * p.numel()
            del flat
        if hooks is not None:
            with torch.no_grad():
                for n in here:
                    if n in hooks.factors:
                        _write_param(hooks.factors[n], views[n], chunk_size)
                    else:
                        views[n].zero_()
        else:
            _loop_grads(fn, model, loss_fn, xs, targets, sel, here, 0, B, views)
        results.update(views)
    if rest:
        results.update(
            _fallback_grads(fn, strategy, model, loss_fn, xs, targets, sel, rest, 0, B, chunk_size)
        )
    return {n: results[sel.key_of[n]] for n in sel.names}


def _norms_and_sums(
    fn: str,
    model: nn.Module,
    loss_fn: Callable,
    inputs: Any,
    targets: Any,
    params: Any,
    strategy: Any,
    max_norm: float | None,
) -> tuple[Tensor, dict[str, Tensor] | None, _Selection]:
    """Per-sample gradient norms, and with ``max_norm`` the clipped sums (canonical names)."""
    xs, B, sel = _prepare(fn, model, inputs, targets, params, strategy)
    hooks = _hooks_or_none(fn, strategy, model, loss_fn, xs, targets, sel, B)
    like = next(iter(sel.tensors.values()))
    sq = torch.zeros(B, dtype=like.dtype, device=like.device)
    if hooks is not None:
        with torch.no_grad():
            for n, fs in hooks.factors.items():
                sq += _param_sq_norms(fs, tuple(sel.tensors[n].shape), B, like)
        rest = list(hooks.uncovered)
    else:
        rest = list(sel.canonical)
    sums: dict[str, Tensor] | None = {} if max_norm is not None else None
    if rest:
        step = _fallback_chunk(sel, rest, B)
        # The clip factor of an example needs its full norm: the rules' part is known above.
        for s in range(0, B, step):
            e = min(B, s + step)
            g = _fallback_grads(fn, strategy if strategy != "hooks" else "auto", model, loss_fn,
                                xs, targets, sel, rest, s, e, None)
            with torch.no_grad():
                part = torch.zeros(e - s, dtype=sq.dtype, device=sq.device)
                for n in rest:
                    part += rules.sq_norms_rows(g[n])
                sq[s:e] += part
                if sums is not None:
                    c = _clip_factors(sq[s:e], max_norm)  # type: ignore[arg-type]
                    for n in rest:
                        w = torch.tensordot(c, g[n], dims=1)
                        sums[n] = w if n not in sums else sums[n] + w
            del g
    norms = sq.clamp_min_(0).sqrt_()
    if sums is not None:
        c = _clip_factors(norms * norms, max_norm)  # type: ignore[arg-type]
        with torch.no_grad():
            if hooks is not None:
                for n, fs in hooks.factors.items():
                    sums[n] = _param_weighted_sum(fs, c, sel.tensors[n])
    return norms, sums, sel


def _clip_factors(sq: Tensor, max_norm: float) -> Tensor:
    """``min(1, max_norm / ||g_i||)``, 1 for a zero gradient."""
    return (max_norm / sq.sqrt()).clamp_(max=1.0)


def per_sample_grad_norms(
    model: nn.Module,
    loss_fn: Callable[..., Tensor],
    inputs: Tensor | Sequence[Tensor],
    targets: Any = None,
    *,
    params: Iterable[str] | None = None,
    strategy: Strategy = "auto",
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
        parameters together.

    Raises:
        StrategyError, PerSampleError: as for :func:`per_sample_grads`.

    Examples:
        >>> import torch, torch_vjp.per_sample as ps
        >>> model = torch.nn.Linear(3, 2).double()
        >>> x, y = torch.randn(4, 3, dtype=torch.float64), torch.tensor([0, 1, 1, 0])
        >>> loss_fn = torch.nn.CrossEntropyLoss()
        >>> norms = ps.per_sample_grad_norms(model, loss_fn, x, y)
        >>> g = ps.per_sample_grads(model, loss_fn, x, y)
        >>> ref = (g["weight"].flatten(1).norm(dim=1) ** 2 + g["bias"].norm(dim=1) ** 2).sqrt()
        >>> torch.allclose(norms, ref)
        True
    """
    norms, _, _ = _norms_and_sums(
        "per_sample_grad_norms", model, loss_fn, inputs, targets, params, strategy, None
    )
    return norms


def accumulate_clipped_grads(
    model: nn.Module,
    loss_fn: Callable[..., Tensor],
    inputs: Tensor | Sequence[Tensor],
    targets: Any = None,
    *,
    max_norm: float,
    params: Iterable[str] | None = None,
    strategy: Strategy = "auto",
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
        params: as for :func:`per_sample_grads`.
        strategy: as for :func:`per_sample_grads`.
        max_norm: each example's gradient is scaled to L2 norm at most ``max_norm`` (over all
            selected parameters together) before the sum.

    Returns:
        The ``(B,)`` per-sample gradient norms before clipping.

    Raises:
        StrategyError, PerSampleError: as for :func:`per_sample_grads`; PerSampleValueError
            for a ``max_norm`` that is not a positive finite number.

    Examples:
        >>> import torch, torch_vjp.per_sample as ps
        >>> model = torch.nn.Linear(3, 2).double()
        >>> x, y = torch.randn(4, 3, dtype=torch.float64), torch.tensor([0, 1, 1, 0])
        >>> loss_fn = torch.nn.CrossEntropyLoss()
        >>> g = ps.per_sample_grads(model, loss_fn, x, y)
        >>> norms = ps.accumulate_clipped_grads(model, loss_fn, x, y, max_norm=0.1)
        >>> c = (0.1 / norms).clamp(max=1.0)
        >>> torch.allclose(model.weight.grad, torch.einsum("b,bij->ij", c, g["weight"]))
        True
    """
    fn = "accumulate_clipped_grads"
    max_norm = _check_max_norm(fn, max_norm)
    norms, sums, sel = _norms_and_sums(fn, model, loss_fn, inputs, targets, params, strategy, max_norm)
    assert sums is not None
    with torch.no_grad():
        for n, p in sel.tensors.items():
            s = sums.get(n)
            if s is None:
                s = torch.zeros_like(p)
            s = s.to(p.dtype).reshape(p.shape)
            if p.grad is None:
                p.grad = s
            else:
                p.grad.add_(s)
    return norms

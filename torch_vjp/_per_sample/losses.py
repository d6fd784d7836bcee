"""Per-example losses: the sum over examples of the loss each example gives alone.

By definition, example ``i``'s gradient is that of ``loss_fn(model(inputs[i:i+1]),
targets[i:i+1])``. When the batch's output holds each example's output as a slice along its
batch dimension (the plan checks this), the sum over ``i`` of ``loss_fn`` on those slices is a
scalar whose gradient with respect to any activation holds every example's own gradient in
that example's rows. :func:`loss_sum` computes it: with one call of ``loss_fn`` where its
reduction is known to be a mean or a sum over examples (the common losses), else with vmap
over the examples, else one call per example.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten, tree_leaves, tree_map, tree_unflatten

from torch_vjp._engine.rows import run_with_fallback
from torch_vjp._errors import PerSampleValueError, a_type, shape_str

__all__ = ["loss_sum", "scaled_loss_sum", "example_loss", "scalar_loss", "call_loss", "slice_tree"]

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
# elementwise losses: separable only where output and targets have one shape (a (B, 1)
# output against (B,) targets broadcasts to (B, B) and pairs every output with every target)
_ELEMENTWISE = frozenset({nn.MSELoss, nn.L1Loss, nn.SmoothL1Loss, nn.HuberLoss, nn.BCELoss,
                          nn.BCEWithLogitsLoss})
# functional losses, and whether they ignore target -100 by default
_SEPARABLE_FUNCTIONS: tuple[tuple[Any, bool], ...] = (
    (F.cross_entropy, True),
    (F.nll_loss, True),
    (F.mse_loss, False),
    (F.l1_loss, False),
)


def _separable_function(loss_fn: Any) -> bool | None:
    """Whether ``loss_fn`` is one of the separable functional losses (and whether it ignores
    target -100), or None; by identity, since a loss object need not be hashable."""
    for known, ignores in _SEPARABLE_FUNCTIONS:
        if loss_fn is known:
            return ignores
    return None


def _reduction_scale(loss_fn: Any, out: Any, targets: Any, batch: int) -> float | None:
    """Scale turning ``loss_fn(out, targets)`` into the sum of the per-example losses, or
    None (then the per-example losses are computed one by one, under vmap)."""
    if not isinstance(out, Tensor) or not isinstance(targets, Tensor) or out.dim() == 0:
        return None
    if out.shape[0] != batch or targets.shape[0] != batch:
        return None
    ignore: int | None = None
    if (type(loss_fn) in _ELEMENTWISE or loss_fn is F.mse_loss or loss_fn is F.l1_loss) and (
            out.shape != targets.shape):
        return None
    if type(loss_fn) in _SEPARABLE_LOSSES:
        # (torch's weighted losses register ``weight`` as a buffer, and a user may assign
        # an nn.Parameter in its place, which moves it to the parameters; reading both dicts
        # directly spares Module.__getattr__'s failed lookup on the losses without one)
        d = loss_fn.__dict__
        if (d.get("_buffers", {}).get("weight") is not None
                or d.get("_parameters", {}).get("weight") is not None
                or d.get("weight") is not None):
            return None
        reduction = loss_fn.reduction
        ignore = getattr(loss_fn, "ignore_index", None)
    else:
        ignores = _separable_function(loss_fn)
        if ignores is None:
            return None
        reduction = "mean"
        if ignores:
            ignore = -100
    if ignore is not None and not targets.is_floating_point() and targets.numel():
        # (one reduction and one read: the common ignore_index of -100 lies below every class)
        if (int(targets.min()) <= ignore) if ignore < 0 else bool((targets == ignore).any()):
            return None
    if reduction == "mean":
        return float(batch)
    if reduction == "sum":
        return 1.0
    return None


def scalar_loss(fn: str, loss: Any) -> Tensor:
    """The one example's loss as a 0-d tensor; raises unless it is one number."""
    if isinstance(loss, Tensor) and loss.numel() == 1 and loss.is_floating_point():
        return loss if loss.dim() == 0 else loss.reshape(())
    if isinstance(loss, Tensor):
        got = f"a tensor of shape {shape_str(loss.shape)} and dtype {loss.dtype}"
    if isinstance(loss, Tensor) and loss.numel() != 1:
        fix = ("  The gradient of a loss is only defined for a scalar: use reduction='mean' "
               "or 'sum' rather than 'none'.")
    elif isinstance(loss, Tensor) and loss.is_complex():
        fix = ("  A loss is minimised, so it must be real: return a real number computed from "
               "the complex one (its .abs() or .real).")
    elif isinstance(loss, Tensor):
        fix = ("  Gradients flow only through floating-point values: an integer or boolean "
               "result (a count of correct predictions, an argmax) has no gradient. Fix: "
               "return the floating-point loss the model is trained on.")
    elif isinstance(loss, (tuple, list)):
        got = f"{a_type(loss)} of {len(loss)} items"
        fix = ("  The per-sample functions take the loss alone, without auxiliary outputs "
               "(a (loss, aux) pair). Fix: return only the loss, e.g. "
               "loss_fn=lambda out, t: my_loss(out, t)[0], and compute the auxiliary values "
               "outside.")
    elif loss is None:
        got = "None"
        fix = ("  A function without a return statement returns None. Fix: return the loss "
               "tensor loss_fn computes.")
    elif isinstance(loss, Mapping):
        got = f"{a_type(loss)} with keys {list(loss)[:4]}"
        fix = ("  The per-sample functions take the loss alone, not a dict of outputs. Fix: "
               "return its loss entry, e.g. loss_fn=lambda out, t: my_loss(out, t)['loss'], "
               "and compute the other values outside.")
    else:
        got = a_type(loss)
        fix = ("  A number that is not a tensor has no autograd graph back to the parameters: "
               "compute the loss with torch operations on the output and return that tensor "
               "(not .item() or float(...)).")
    raise PerSampleValueError(
        f"torch_vjp.{fn}: loss_fn returned {got} for one example; it must return one "
        f"floating-point number per example (the loss of that example).\n{fix}"
    )


def check_connected(fn: str, loss: Tensor, out: Any) -> None:
    """Raises where ``loss`` has no graph back to the model's output ``out`` though ``out``
    has one (``.detach()``, a number turned back into a tensor, ``torch.no_grad`` inside
    loss_fn): every per-sample gradient would be zero, where ``torch.autograd.grad`` raises.
    One attribute read where the loss is connected."""
    if loss.requires_grad or not any(isinstance(t, Tensor) and t.requires_grad
                                     for t in tree_leaves(out)):
        return
    raise PerSampleValueError(
        f"torch_vjp.{fn}: loss_fn returned a loss with no autograd graph back to the model's "
        f"output (it does not require grad, though the output does), so every per-sample "
        f"gradient would be zero; torch.autograd.grad refuses such a loss too.\n  Fix: "
        f"compute the loss from the output with torch operations, without .detach(), "
        f".item() or torch.no_grad() inside loss_fn."
    )


def call_loss(loss_fn: Callable, out: Any, targets: Any) -> Any:
    return loss_fn(out) if targets is None else loss_fn(out, targets)


def targets_in_dims(targets: Any) -> Any:
    """vmap's ``in_dims`` for ``targets``: the examples along dimension 0 of each tensor leaf;
    a leaf that is not a tensor (a Python number shared by every example) is passed as it
    is, None."""
    if targets is None:
        return None
    return tree_map(lambda z: 0 if isinstance(z, Tensor) else None, targets)


def slice_tree(tree: Any, start: int, stop: int, dims: Sequence[int] | None = None) -> Any:
    """Examples ``start:stop`` of every tensor leaf of ``tree`` (along ``dims[j]`` for leaf
    ``j``, dimension 0 by default)."""
    if dims is None:
        return tree_map(lambda z: z[start:stop] if isinstance(z, Tensor) else z, tree)
    leaves, spec = tree_flatten(tree)
    out, j = [], 0
    for leaf in leaves:
        if isinstance(leaf, Tensor):
            leaf = leaf.narrow(dims[j], start, stop - start)
            j += 1
        out.append(leaf)
    return tree_unflatten(out, spec)


def example_loss(
    fn: str, loss_fn: Callable, out: Any, targets: Any, index: int, dims: Sequence[int] | None
) -> Tensor:
    """Example ``index``'s own loss, from its slice of the batch's output."""
    return scalar_loss(fn, call_loss(
        loss_fn, slice_tree(out, index, index + 1, dims),
        None if targets is None else slice_tree(targets, index, index + 1),
    ))


def loss_sum(
    fn: str,
    loss_fn: Callable,
    out: Any,
    targets: Any,
    batch: int,
    dims: Sequence[int] | None = None,
) -> Tensor:
    """``sum_i loss_fn(out_i, targets[i:i+1])``, with ``out_i`` example ``i``'s slice of every
    output tensor (along ``dims``, dimension 0 by default), whose gradient with respect to
    ``out`` holds every example's own output gradient."""
    loss, scale = scaled_loss_sum(fn, loss_fn, out, targets, batch, dims)
    return loss * scale if scale != 1.0 else loss


def scaled_loss_sum(
    fn: str,
    loss_fn: Callable,
    out: Any,
    targets: Any,
    batch: int,
    dims: Sequence[int] | None = None,
) -> tuple[Tensor, float]:
    """``(loss, scale)`` with ``scale * loss`` the :func:`loss_sum` (the caller folds the
    scale into the gradient it starts the backward pass from: one operation fewer)."""
    if batch == 1:  # (the batch is the one example: its output as it is, which a forward
        # that squeezes its output, ``.squeeze()`` to 0-d, leaves with no batch to slice)
        return scalar_loss(fn, call_loss(loss_fn, out, targets)), 1.0
    batch_first = dims is None or all(d == 0 for d in dims)
    if batch_first:
        scale = _reduction_scale(loss_fn, out, targets, batch)
        if scale is not None:
            return scalar_loss(fn, loss_fn(out, targets)), scale
    leaves, spec = tree_flatten(out)
    tensor_dims = list(dims) if dims is not None else [0] * sum(
        isinstance(t, Tensor) for t in leaves)
    in_dims_leaves, j = [], 0
    for leaf in leaves:
        if isinstance(leaf, Tensor):
            in_dims_leaves.append(tensor_dims[j])
            j += 1
        else:
            in_dims_leaves.append(None)
    out_in_dims = tree_unflatten(in_dims_leaves, spec)

    def one(o: Any, t: Any) -> Tensor:
        o_leaves, o_spec = tree_flatten(o)
        restored = [
            leaf.unsqueeze(d) if isinstance(leaf, Tensor) and d is not None else leaf
            for leaf, d in zip(o_leaves, in_dims_leaves)
        ]
        ti = tree_map(lambda z: z.unsqueeze(0) if isinstance(z, Tensor) else z, t)
        return scalar_loss(fn, call_loss(loss_fn, tree_unflatten(restored, o_spec), ti))

    def vectorized() -> tuple[Tensor, float]:
        losses = torch.func.vmap(
            one, in_dims=(out_in_dims, targets_in_dims(targets)),
            randomness="different",
        )(out, targets)
        return losses.sum(), 1.0

    def loop() -> tuple[Tensor, float]:  # one call per example (the loss cannot be vmapped)
        total = example_loss(fn, loss_fn, out, targets, 0, dims)
        for i in range(1, batch):
            total = total + example_loss(fn, loss_fn, out, targets, i, dims)
        return total, 1.0

    # (silently: the loss of B examples costs little either way)
    return run_with_fallback(vectorized, loop, on_fallback=lambda err: None)

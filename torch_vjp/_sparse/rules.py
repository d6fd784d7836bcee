"""The rules of sparsity detection: for each aten op, the index sets of its outputs from
those of its inputs (NOTE [index sets] in :mod:`~torch_vjp._sparse.sets`).

Kinds of rule, in the order :func:`apply` looks for one:

* a rule registered for the op's name (:data:`RULES`): reductions, ops along a dimension,
  ops that return indices, accumulating scatters, norms, matrix products and convolutions
  (:mod:`~torch_vjp._sparse.contract`), factories;
* ops that move data (:data:`MOVES`: copies, concatenation, padding, indexing, gathers,
  non-accumulating scatters, ``where``, flips, rolls, repeats, triangles): the op itself
  runs on the id tensors in place of the values, so that ids go where the values go and a
  constant fill value becomes the empty set (:func:`move`);
* ops tagged ``pointwise`` by torch: each output element depends on the elements at the same
  (broadcast) position of every input (:func:`pointwise`);
* everything else: :func:`conservative`, every output element depends on every element of
  every input (the op's name is kept for a one-time warning).

A rule returns one id tensor (or None, for the empty set) per tensor output of the op. An
in-place op is ruled as its functional form; the tracer writes the result into the mutated
tensor's shadow (NOTE [shadow storage] in :mod:`~torch_vjp._sparse.tracer`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.utils._pytree import tree_map

from torch_vjp._sparse.tracer import Call, Tracer, bind, carries_sets

__all__ = [
    "RULES",
    "MOVES",
    "for_outputs",
    "move",
    "make_call",
    "apply",
    "combine",
    "group",
    "conservative",
    "pointwise",
    "move",
    "register",
]

_LONG = torch.long
aten = torch.ops.aten
Rule = Callable[[Tracer, Call], list[Tensor | None]]

#: Rules by op base name (``"sum"``, ``"mm"``).
RULES: dict[str, Rule] = {}


def register(*names: str) -> Callable[[Rule], Rule]:
    """Registers a rule for the ops of these base names."""

    def deco(rule: Rule) -> Rule:
        for name in names:
            RULES[name] = rule
        return rule

    return deco


def make_call(func: Any, args: Any, kwargs: dict[str, Any], outs: list[Tensor]) -> Call:
    """The :class:`~torch_vjp._sparse.tracer.Call` of an op: an in-place op (``add_``) is
    ruled as its functional form (``add``), with the same arguments."""
    name = func._schema.name.split("::")[-1]
    rule_func = func
    if name.endswith("_") and not name.startswith("_"):
        base = name[:-1]
        packet = getattr(aten, base, None)
        overload = func._overloadname
        functional = getattr(packet, overload, None) if packet is not None else None
        if functional is not None:
            rule_func = functional
        name = base
    return Call(rule_func, func, tuple(args), kwargs, bind(func, args, kwargs), outs, name)


def apply(tr: Tracer, call: Call) -> list[Tensor | None]:
    """The ids of ``call``'s outputs, by the first rule that applies (module docstring)."""
    rule = RULES.get(call.name)
    if rule is not None:
        return rule(tr, call)
    if call.name in MOVES:
        return move(tr, call)
    if torch.Tag.pointwise in call.called.tags:
        return pointwise(tr, call)
    return conservative(tr, call)


# ---- helpers ---------------------------------------------------------------------------


def _float_inputs(call: Call) -> list[Tensor]:
    return [t for t in _tensors((*call.args, *call.kwargs.values())) if carries_sets(t)]


def _tensors(values: Any) -> list[Tensor]:
    out: list[Tensor] = []
    for v in values:
        if isinstance(v, Tensor):
            out.append(v)
        elif isinstance(v, (list, tuple)):
            out.extend(t for t in v if isinstance(t, Tensor))
    return out


def combine(tr: Tracer, shape: Sequence[int], parts: Sequence[Tensor | None]) -> Tensor | None:
    """The elementwise union of id tensors broadcast to ``shape`` (None parts are empty)."""
    kept: list[Tensor] = []
    for p in parts:
        if p is None:
            continue
        if any(q is p or (q.shape == p.shape and torch.equal(q, p)) for q in kept):
            continue
        kept.append(p)
    shape = tuple(shape)
    if not kept:
        return None
    if len(kept) == 1:
        return kept[0].expand(shape)
    numel = math.prod(shape)
    rows = torch.arange(numel, dtype=_LONG).repeat(len(kept))
    ids = torch.cat([p.expand(shape).reshape(-1) for p in kept])
    return tr.table.union(rows, ids, numel).view(shape)


def group(tr: Tracer, ids: Tensor, dims: Sequence[int]) -> Tensor:
    """The union over ``dims`` of ``ids``, those dimensions kept with size 1."""
    dims = {d % max(1, ids.dim()) for d in dims} if ids.dim() else set()
    shape = [1 if d in dims else s for d, s in enumerate(ids.shape)]
    n_out = math.prod(shape)
    if n_out == ids.numel():
        return ids.reshape(shape)
    rows = torch.arange(n_out, dtype=_LONG).view(shape).expand(ids.shape).reshape(-1)
    return tr.table.union(rows, ids.reshape(-1), n_out).view(shape)


def _dims(value: Any, ndim: int) -> list[int]:
    """A ``dim`` argument as a list of dimensions (None or [] meaning all)."""
    if value is None:
        return list(range(ndim))
    if isinstance(value, int):
        return [value]
    dims = list(value)
    return dims if dims else list(range(ndim))


def _self(call: Call) -> Tensor:
    for name in ("self", "input"):
        v = call.bound.get(name)
        if isinstance(v, Tensor):
            return v
    raise KeyError("no self argument")


def for_outputs(call: Call, ids: Tensor | None) -> list[Tensor | None]:
    """``ids`` reshaped for every floating output of the same number of elements."""
    res: list[Tensor | None] = []
    for o in call.outs:
        if ids is None or not carries_sets(o):
            res.append(None)
        else:
            res.append(ids.reshape(o.shape) if ids.numel() == o.numel() else ids.expand(o.shape))
    return res


# ---- the generic kinds -----------------------------------------------------------------


def conservative(
    tr: Tracer, call: Call, targets: Sequence[Tensor] | None = None
) -> list[Tensor | None]:
    """No rule: every output element depends on every element of every floating input."""
    parts = [tr.ids(t) for t in _float_inputs(call)]
    parts = [p.reshape(-1) for p in parts if p is not None]
    sid = tr.table.union_all(torch.cat(parts)) if parts else 0
    if sid:
        tr.conservative_ops.add(str(call.called.overloadpacket))
    outs = call.outs if targets is None else targets
    return [torch.full(o.shape, sid, dtype=_LONG) if sid else None for o in outs]


def pointwise(tr: Tracer, call: Call) -> list[Tensor | None]:
    """Each output element depends on the same (broadcast) position of every input."""
    shape = next((o.shape for o in call.outs if carries_sets(o)), None)
    if shape is None:
        return [None] * len(call.outs)
    parts = [tr.ids(t) for t in _float_inputs(call)]
    return for_outputs(call, combine(tr, shape, parts))


#: Ops that move data: ruled by running them on the ids (see :func:`move`).
MOVES = frozenset({
    "clone", "copy", "lift_fresh_copy", "alias_copy", "_unsafe_view", "view_copy",
    "cat", "stack", "hstack", "vstack", "constant_pad_nd", "reflection_pad1d",
    "reflection_pad2d", "reflection_pad3d", "replication_pad1d", "replication_pad2d",
    "replication_pad3d", "_pad_circular", "index", "_unsafe_index", "index_select", "gather",
    "take", "take_along_dim", "masked_select", "index_put", "_unsafe_index_put",
    "index_copy", "masked_fill", "masked_scatter", "index_fill", "fill", "zero", "where",
    "flip", "roll", "repeat", "tile", "diag_embed", "diag", "tril", "triu", "narrow_copy",
    "expand_copy", "permute_copy", "transpose_copy", "t_copy", "slice_copy", "select_copy",
    "unsqueeze_copy", "squeeze_copy", "diagonal_copy", "as_strided_copy", "unfold_copy",
    "upsample_nearest1d", "upsample_nearest2d", "upsample_nearest3d",
    "_upsample_nearest_exact1d", "_upsample_nearest_exact2d", "_upsample_nearest_exact3d",
    "pixel_shuffle", "pixel_unshuffle", "channel_shuffle", "native_channel_shuffle",
    "im2col", "embedding", "slice_scatter", "select_scatter", "diagonal_scatter",
    "as_strided_scatter", "select_backward", "slice_backward", "diagonal_backward",
    "block_diag", "split_copy", "split_with_sizes_copy", "unbind_copy", "rot90",
})
# ops with a ``reduce`` or ``accumulate`` argument are accumulations, ruled in RULES

#: The arguments by which ops place data (NOTE [a pattern shaped by values] in
#: :mod:`~torch_vjp._sparse.tracer`): where one was computed from x and the op moves
#: tracked data by it, the pattern holds at this x only. ``where`` and ``masked_fill`` by
#: such a condition take the union of their branches instead (:func:`where`).
PLACING_ARGS = ("condition", "mask", "index", "indices")
#: Ops whose rules unite the branches where a placing argument comes from x.
UNITED_BY_VALUE = frozenset({"where", "masked_fill", "index_put", "_unsafe_index_put",
                             "index_put_impl", "_index_put_impl"})
#: Ops whose outputs' shapes are read off the values of an argument (flagged where it comes
#: from x: a shape Python then reads, ``len(x.nonzero())``, is invisible to the tracer), by
#: the argument that sets the shape (``self`` or ``input`` where not named).
DATA_SHAPED = {"nonzero": (), "nonzero_static": (), "argwhere": (), "masked_select": ("mask",),
               "_unique": (), "_unique2": (), "unique_dim": (), "unique_consecutive": (),
               "unique_dim_consecutive": (), "bincount": (), "repeat_interleave": ("repeats",)}
#: Ops that hand a tensor's value to Python (``.item()``, ``bool(t)``: a branch on it).
SCALAR_READS = frozenset({"_local_scalar_dense", "is_nonzero", "equal", "item"})
#: Ops whose backward torch computes wrongly under ``torch.vmap`` (its batching rule, torch
#: 2.13): a VJP of each cotangent alone is right, the same VJPs batched are not (NOTE
#: [wrong batching rules] in :mod:`~torch_vjp._sparse.probe`), by what the warning calls
#: them. (``_cdist_backward`` has no derivative: a function that calls it cannot be
#: differentiated at all, which torch says.)
WRONG_BATCHING = {"_cdist_forward": "torch.cdist (aten._cdist_forward)"}
#: Ops whose backward torch computes wrongly even without vmap (torch 2.13), by the argument
#: whose gradient is wrong and what the error calls them: ``as_strided_scatter`` passes the
#: gradient of ``self`` inside the scattered region, where it belongs outside it. Forward
#: mode's formula is right (NOTE [wrong batching rules] in :mod:`~torch_vjp._sparse.probe`).
WRONG_REVERSE = {"as_strided_scatter": ("self", "torch.as_strided_scatter on a tensor "
                                                "computed from x")}


@register("where", "masked_fill")
def where(tr: Tracer, call: Call) -> list[Tensor | None]:
    """By a constant condition or mask, the op moves ids as it moves values; by one
    computed from x, each element may come from either branch at another x: the union of
    the two (a superset that holds at every x)."""
    cond = call.bound.get("condition", call.bound.get("mask"))
    if not (isinstance(cond, Tensor) and tr.from_values(cond)):
        return move(tr, call)
    shape = call.outs[0].shape
    parts = [tr.ids(t) for t in _float_inputs(call)]
    return for_outputs(call, combine(tr, shape, parts))
_FLOAT_MOVES: set[str] = set()  # ops without int64 kernels, found at run time


def move(tr: Tracer, call: Call) -> list[Tensor | None]:
    """Runs the op on the id tensors: floating tensors replaced by their ids (zeros for
    constants), other tensors moved to the CPU, fill values (``Scalar`` arguments) by 0, the
    empty set. Where the op has no int64 kernel it runs on float64 ids (exact below
    2**53)."""
    if call.name in _FLOAT_MOVES:
        return _move(tr, call, torch.float64)
    try:
        return _move(tr, call, _LONG)
    except (RuntimeError, NotImplementedError, TypeError):
        _FLOAT_MOVES.add(call.name)
        return _move(tr, call, torch.float64)


def _move(tr: Tracer, call: Call, dtype: torch.dtype) -> list[Tensor | None]:
    func = call.func
    mutated = func is call.called and any(
        a.alias_info is not None and a.alias_info.is_write for a in func._schema.arguments
    )  # an out= variant: its out arguments get fresh tensors

    def sub(v: Any, fresh: bool, placing: bool) -> Any:
        if isinstance(v, Tensor):
            if carries_sets(v):
                if fresh:
                    return torch.zeros(v.shape, dtype=dtype)
                return tr.ids_or_empty(v).to(dtype)
            if placing:  # an index or a mask: it places the ids as it places the values
                return v.cpu()
            # integer or boolean data (cat([x, torch.tensor([2024])]), torch promotes it):
            # its values are no set ids, it carries the empty set
            return torch.zeros(v.shape, dtype=dtype)
        return v

    args, kwargs = [], {}
    positional = len(call.args)
    for i, arg in enumerate(func._schema.arguments):
        if i < positional and not arg.kwarg_only:
            present, value = True, call.args[i]
        elif arg.name in call.kwargs:
            present, value = False, call.kwargs[arg.name]
        else:
            continue
        fresh = mutated and arg.alias_info is not None and arg.alias_info.is_write
        if str(arg.type) == "number":
            value = 0
        else:
            placing = arg.name in PLACING_ARGS
            value = tree_map(lambda v, fresh=fresh, placing=placing: sub(v, fresh, placing),
                             value)
        if present:
            args.append(value)
        else:
            kwargs[arg.name] = value
    res = func(*args, **kwargs)
    out: list[Tensor | None] = []
    for o, r in zip(call.outs, _leaves(res)):
        if not carries_sets(o) or r is None:
            out.append(None)
            continue
        if r.dtype != _LONG:
            r = r.to(_LONG)
        out.append(r.reshape(o.shape) if r.shape != o.shape else r)
    return out


def _leaves(res: Any) -> list[Tensor]:
    if isinstance(res, Tensor):
        return [res]
    if isinstance(res, (list, tuple)):
        out: list[Tensor] = []
        for r in res:
            out.extend(_leaves(r))
        return out
    return []


# ---- reductions and ops along a dimension ------------------------------------------------


@register(
    "sum", "mean", "prod", "amax", "amin", "nansum", "nanmean", "logsumexp", "var", "std",
    "var_mean", "std_mean", "norm", "linalg_vector_norm", "max", "min", "median",
    "nanmedian", "aminmax", "special_logsumexp", "mse_loss", "l1_loss", "smooth_l1_loss",
    "huber_loss", "dist", "trace",
)
def reduction(tr: Tracer, call: Call) -> list[Tensor | None]:
    """Each output element depends on its group of the reduced dimensions; ops that also
    return indices (``max.dim``, ``median.dim``) take the values at those indices."""
    if call.name in ("max", "min", "median", "nanmedian") and len(call.outs) == 2:
        return along_with_indices(tr, call)
    if call.name in ("max", "min") and isinstance(call.bound.get("other"), Tensor):
        return pointwise(tr, call)
    if call.name in ("mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss", "dist"):
        if call.bound.get("reduction") == 0:  # "none": elementwise
            return pointwise(tr, call)
        inputs = _float_inputs(call)
        shape = torch.broadcast_shapes(*(t.shape for t in inputs))
        both = combine(tr, shape, [tr.ids(t) for t in inputs])
        return for_outputs(call, None if both is None else group(tr, both, range(len(shape))))
    x = _self(call)
    ids = tr.ids(x)
    if ids is None:
        return [None] * len(call.outs)
    if call.name == "trace":
        diag = torch.diagonal(ids)
        return for_outputs(call, group(tr, diag, [0]))
    dims = _dims(call.bound.get("dim"), x.dim())
    return for_outputs(call, group(tr, ids, dims))


@register("_softmax", "_log_softmax", "_safe_softmax", "cumsum", "cumprod", "logcumsumexp",
          "softmax", "log_softmax", "_softmax_backward_data", "_log_softmax_backward_data")
def along_dim(tr: Tracer, call: Call) -> list[Tensor | None]:
    """Each output element depends on the whole line along ``dim`` of every input (a
    superset for cumulative ops, whose element i depends on the first i + 1)."""
    shape = call.outs[0].shape
    dim = call.bound.get("dim")
    parts = []
    for t in _float_inputs(call):
        ids = tr.ids(t)
        if ids is not None:
            parts.append(group(tr, ids, [dim]).expand(t.shape) if t.dim() else ids)
    return for_outputs(call, combine(tr, shape, parts))


@register("sort", "topk", "kthvalue", "mode", "cummax", "cummin")
def along_with_indices(tr: Tracer, call: Call) -> list[Tensor | None]:
    """Ops that return ``(values, indices)``: each value is one element of its line along
    ``dim``, which one chosen by the values: every element of the line, a superset that
    holds at every x (as ``amax``'s rule; NOTE [a pattern shaped by values] in
    :mod:`~torch_vjp._sparse.tracer`)."""
    x = _self(call)
    ids = tr.ids(x)
    values = call.outs[0]
    if ids is None:
        return [None] * len(call.outs)
    if x.dim() == 0:
        return [ids.reshape(values.shape)] + [None] * (len(call.outs) - 1)
    dim = call.bound.get("dim")
    dim = -1 if dim is None else dim
    line = group(tr, ids, [dim])  # (the dimension kept, of size 1)
    if values.dim() < x.dim():  # keepdim=False
        line = line.squeeze(dim % x.dim())
    return [line.expand(values.shape)] + [None] * (len(call.outs) - 1)


# ---- creation, conversion, random masks --------------------------------------------------

#: Ops that make new tensors: their values owe nothing to x's (zeros_like(x) has x's shape).
_FACTORIES = (
    "empty", "zeros", "ones", "full", "arange", "linspace", "logspace", "eye", "rand",
    "randn", "randint", "randperm", "scalar_tensor", "empty_strided", "tensor", "bernoulli",
    "multinomial", "poisson", "zeros_like", "ones_like", "empty_like", "full_like",
    "rand_like", "randn_like", "randint_like", "new_empty", "new_zeros", "new_ones",
    "new_full", "new_empty_strided", "normal_", "uniform", "exponential", "geometric",
    "cauchy", "log_normal", "random",
)


#: Ops that draw random numbers (dropout's mask among them): their values are not
#: constants, and differ between the detection run, the products and calls (NOTE [a pattern
#: shaped by values] in :mod:`~torch_vjp._sparse.tracer`).
RANDOM = frozenset({
    "rand", "randn", "randint", "randperm", "bernoulli", "multinomial", "poisson", "normal",
    "uniform", "exponential", "geometric", "cauchy", "log_normal", "random", "rand_like",
    "randn_like", "randint_like", "native_dropout", "dropout", "feature_dropout",
    "alpha_dropout", "feature_alpha_dropout", "rrelu_with_noise", "_fused_dropout",
    "_standard_gamma", "_sample_dirichlet", "binomial", "_dirichlet_grad",
})

#: Factories whose tensor arguments give only a shape, dtype or device (``zeros_like(x)``):
#: their values owe nothing to x's. (``multinomial(p)``, ``poisson(rates)``,
#: ``bernoulli(p)`` and ``linspace`` with tensor ends read values.)
SHAPE_ONLY = frozenset({
    "empty", "zeros", "ones", "full", "arange", "eye", "scalar_tensor", "empty_strided",
    "zeros_like", "ones_like", "empty_like", "full_like", "rand_like", "randn_like",
    "randint_like", "new_empty", "new_zeros", "new_ones", "new_full", "new_empty_strided",
})


@register(*_FACTORIES)
def factory(tr: Tracer, call: Call) -> list[Tensor | None]:
    """New tensors (and random draws): constants, the empty set."""
    return [None] * len(call.outs)


@register("_to_copy", "to", "_to_dense", "to_dense", "_copy_from_and_resize", "_copy_from")
def to_copy(tr: Tracer, call: Call) -> list[Tensor | None]:
    """A copy in another dtype or on another device: the same sets (none for an integer
    result)."""
    ids = tr.ids(_self(call))
    return for_outputs(call, ids)


@register("native_dropout", "dropout", "feature_dropout", "alpha_dropout")
def dropout(tr: Tracer, call: Call) -> list[Tensor | None]:
    """Dropout scales each element by a random constant: elementwise."""
    ids = tr.ids(_self(call))
    return [ids if carries_sets(o) and ids is not None else None for o in call.outs]


# ---- normalisation -------------------------------------------------------------------------


def _per_channel(tr: Tracer, t: Any, shape: Sequence[int], channel_dim: int) -> Tensor | None:
    if not isinstance(t, Tensor):
        return None
    ids = tr.ids(t)
    if ids is None:
        return None
    view = [1] * len(shape)
    view[channel_dim] = -1
    return ids.reshape(view)


@register("native_layer_norm")
def layer_norm(tr: Tracer, call: Call) -> list[Tensor | None]:
    """Each output element depends on its normalised group (the trailing dimensions) and on
    the weight and bias at its position."""
    x = call.bound["input"]
    k = len(call.bound["normalized_shape"])
    dims = list(range(x.dim() - k, x.dim()))
    ids = tr.ids(x)
    stats = None if ids is None else group(tr, ids, dims)
    parts = [None if stats is None else stats.expand(x.shape)]
    for name in ("weight", "bias"):
        w = call.bound.get(name)
        if isinstance(w, Tensor):
            parts.append(tr.ids(w))
    out = combine(tr, x.shape, parts)
    return [out] + [None if stats is None else stats.reshape(o.shape) for o in call.outs[1:]]


@register("native_group_norm")
def group_norm(tr: Tracer, call: Call) -> list[Tensor | None]:
    """Each output element depends on its example's group of channels, and on the weight
    and bias of its channel."""
    x = call.bound["input"]
    n, g = call.bound["N"], call.bound["group"]
    ids = tr.ids(x)
    stats = None
    parts: list[Tensor | None] = []
    if ids is not None:
        stats = group(tr, ids.reshape(n, g, -1), [2])
        parts.append(stats.expand(n, g, ids.numel() // (n * g)).reshape(x.shape))
    for name in ("weight", "bias"):
        parts.append(_per_channel(tr, call.bound.get(name), x.shape, 1))
    out = combine(tr, x.shape, parts)
    return [out] + [None if stats is None else stats.reshape(o.shape) for o in call.outs[1:]]


@register("native_batch_norm", "_native_batch_norm_legit", "_native_batch_norm_legit_functional",
          "_native_batch_norm_legit_no_training", "cudnn_batch_norm", "miopen_batch_norm")
def batch_norm(tr: Tracer, call: Call) -> list[Tensor | None]:
    """In training mode each output element depends on its channel across the batch; in
    evaluation mode only on itself; both on the weight and bias of its channel."""
    x = call.bound["input"]
    training = call.bound.get("training", call.name == "cudnn_batch_norm")
    if call.name == "_native_batch_norm_legit_no_training":
        training = False
    ids = tr.ids(x)
    parts: list[Tensor | None] = []
    stats = None
    if ids is not None:
        if training:
            dims = [d for d in range(x.dim()) if d != 1]
            stats = group(tr, ids, dims)
            parts.append(stats.expand(x.shape))
        else:
            parts.append(ids)
    names = ["weight", "bias"] + ([] if training else ["running_mean", "running_var"])
    for name in names:
        parts.append(_per_channel(tr, call.bound.get(name), x.shape, 1))
    out = combine(tr, x.shape, parts)
    res: list[Tensor | None] = [out]
    for o in call.outs[1:]:
        if stats is not None and carries_sets(o) and o.numel() == x.shape[1]:
            res.append(stats.reshape(o.shape))
        else:
            res.append(None)
    return res


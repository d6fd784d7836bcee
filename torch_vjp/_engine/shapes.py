"""What a Jacobian's products need to know before they run: the call's options, the sizes of
``f``'s outputs (probed, or remembered from an earlier call), and the chunk size they allow.

NOTE [output sizes]
Forward mode (and "auto", to choose) needs the sizes of f's outputs before it computes
anything, for the memory plan: the probe runs f once without a graph. For the same f
(the same object, held weakly) called on primals of the same shapes, dtypes and devices,
the sizes found are remembered and the probe is skipped, so that repeated calls cost no
more than torch.func.jacfwd. Remembered sizes are checked against the outputs the
products produce; a mismatch (f's output changed for the same input shapes) discards
them and the call starts over with a probe.
"""

from __future__ import annotations

import math
import re
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.utils._pytree import TreeSpec, tree_flatten, tree_flatten_with_path, tree_unflatten

from torch_vjp._engine.graph import graph_nodes
from torch_vjp._engine.memory import plan_products
from torch_vjp._engine.problem import Problem, leaf_name
from torch_vjp._engine.rows import Restart, SameDraws, own_generators
from torch_vjp._errors import JacobianCallError, shape_str

__all__ = [
    "Opts",
    "Shapes",
    "StaleShapes",
    "SHAPES_MAX",
    "row_shapes",
    "in_rows",
    "shapes_key",
    "probe_shapes",
    "chunk_for",
]

#: How many output sizes are remembered (the oldest are forgotten first).
SHAPES_MAX = 256


class Opts:
    """The per-call options every engine function needs.

    Attributes:
        batch: the batch size B of ``batch_jacobian``, or None.
        chunk_size: products at once (checked), or None.
        max_memory: the budget in bytes, or None for the free memory.
        alternatives: the alternatives named by a memory error.
        probe: returns the flat outputs and their structure without computing derivatives,
            or None for ``Problem.probe``.
        detached: the result needs no autograd graph (NOTE [no graph outlives its chunk]).
        vmap_single: a single product runs under vmap too, as torch.func.jacrev runs it
            (NOTE [the gradient inside a Hessian] in :mod:`torch_vjp._engine.hessian`); by default it is a plain call.
        named: for a strategy the caller named (not "auto"), f's name and key: its
            products read f's graph for operators torch differentiates wrongly in that
            mode (NOTE
            [named reverse strategies and wrong formulas] in
            :mod:`torch_vjp._engine.wrongops`); None otherwise.
        hessian: for the gradient inside a Hessian, f's name and the strategy the Hessian
            was asked for: its products read f's graph for a backward formula torch has wrong (NOTE [a
            Hessian through a wrong backward] in :mod:`torch_vjp._engine.wrongops`); None
            otherwise.
        remembered: where "auto" takes a route remembered for f and its signature, its key
            and the known wrong operators its reverse products met (NOTE [a remembered
            route through a known wrong operator] in :mod:`torch_vjp._engine.autoknown`).
    """

    __slots__ = (
        "batch", "chunk_size", "max_memory", "alternatives", "probe", "detached", "vmap_single",
        "named", "hessian", "remembered",
    )

    def __init__(
        self,
        batch: int | None,
        chunk_size: int | None,
        max_memory: int | None,
        alternatives: str,
        probe: Callable[[], tuple[list[Tensor], TreeSpec]] | None,
        detached: bool = False,
        vmap_single: bool = False,
    ) -> None:
        self.batch = batch
        self.chunk_size = chunk_size
        self.max_memory = max_memory
        self.alternatives = alternatives
        self.probe = probe
        self.detached = detached
        self.vmap_single = vmap_single
        self.named: tuple[str, Any] | None = None
        self.hessian: tuple[str, str] | None = None
        self.remembered: tuple[Any, list[tuple[str | None, str | None]]] | None = None


def row_shapes(flat_out: Sequence[Tensor], batch: int | None, prob: Problem,
               spec: TreeSpec | None = None) -> list[torch.Size]:
    """The shape of one row of each output: the output's own, or without its batch dimension
    for ``batch_jacobian``. ``spec``: the outputs' structure, which names an output in a
    message by its place in f's result (``f['loss']``, ``f[1][0]``).

    Raises:
        JacobianCallError: an output lacks the leading batch dimension B.
    """
    if batch is None:
        return [o.shape for o in flat_out]
    for j, o in enumerate(flat_out):
        if o.dim() == 0 or o.shape[0] != batch:
            if spec is not None and not spec.is_leaf():
                paths = tree_flatten_with_path(tree_unflatten(list(range(len(flat_out))),
                                                              spec))[0]
                where = leaf_name(paths[j][0], "the output of f")
            else:
                where = "the output of f" if len(flat_out) == 1 else f"output {j} of f"
            raise JacobianCallError(
                f"{prob.call}: {where} has shape {shape_str(o.shape)}, but x has shape "
                f"{shape_str(prob.leaves[0].shape)}: f must map a batch row by row, "
                f"(B, *in) -> (B, *out), so every output needs the leading dimension "
                f"B = {batch}.\n"
                f"  If f reduces over the batch (a loss, a mean), its Jacobian mixes "
                f"examples: use torch_vjp.jacobian instead (or torch_vjp.per_sample_grads "
                f"for per-example gradients of a loss)."
            )
    return [o.shape[1:] for o in flat_out]


def in_rows(prob: Problem, batch: int | None) -> list[torch.Size]:
    """The shape of one row of each differentiated leaf (without the batch dimension)."""
    return [leaf.shape if batch is None else leaf.shape[1:] for leaf in prob.leaves]


class StaleShapes(Restart):
    """Remembered output sizes turned out wrong: compute again, probing first."""


class Shapes:
    """The outputs' sizes, known before any derivative is computed (from the probe, or
    remembered from an earlier call: see NOTE [output sizes])."""

    __slots__ = ("flat", "spec", "rows", "key", "records")

    def __init__(
        self,
        flat: list[Tensor],
        spec: TreeSpec,
        rows: list[torch.Size],
        key: Any = None,
        records: int = 0,
    ) -> None:
        self.flat = flat
        self.spec = spec
        self.rows = rows
        self.key = key  # the cache entry these came from, if any
        # f involves tensors that require grad (closed-over parameters), so products in the
        # caller's grad mode record graphs (NOTE [no graph outlives its chunk]); nonzero,
        # the elements of the intermediate results they record (recorded_elements)
        self.records = records

    def check(self, flat: Sequence[Tensor], spec: TreeSpec) -> None:
        """Raises :class:`StaleShapes` if remembered sizes do not match the outputs."""
        if self.key is None:
            return
        if spec != self.spec or any(
            o.shape != m.shape or o.dtype != m.dtype for o, m in zip(flat, self.flat)
        ):
            _SHAPES.pop(self.key, None)
            raise StaleShapes


    def forget_unless(self, numels: Sequence[int]) -> None:
        """Forgets remembered sizes that a computation which does not check them (reverse
        mode) found other: ``numels``, the element counts of the outputs it saw; the next
        call probes again."""
        if self.key is not None and (
            len(numels) != len(self.flat)
            or any(k != m.numel() for k, m in zip(numels, self.flat))
        ):
            _SHAPES.pop(self.key, None)


_SHAPES: dict[Any, tuple[Any, list[Tensor], TreeSpec, list[torch.Size], bool]] = {}


def shapes_key(prob: Problem, batch: int | None) -> Any:
    """The cache key of this call's output sizes, or None where they cannot be cached
    (computed once per :class:`Problem` and batch size)."""
    try:
        return prob._keys[batch]
    except KeyError:
        pass
    key = prob._keys[batch] = _new_shapes_key(prob, batch)
    return key


def _new_shapes_key(prob: Problem, batch: int | None) -> Any:
    f = prob.f
    owner = getattr(f, "__self__", None)
    target, fid = (owner, id(getattr(f, "__func__", f))) if owner is not None else (f, None)
    try:
        ref = weakref.ref(target)
    except TypeError:
        return None
    sig: list[Any] = []
    for p in prob.primals:
        if isinstance(p, Tensor):
            sig.append((p.shape, p.dtype, p.device))
        elif p is None or isinstance(p, (bool, int, float, str)):
            sig.append((type(p), p))
        else:  # a pytree (a dict of parameters, say): its structure and its leaves' sizes
            leaves, spec = tree_flatten(p)
            if spec.is_leaf():
                return None
            sig.append(spec)
            for leaf in leaves:
                if isinstance(leaf, Tensor):
                    sig.append((leaf.shape, leaf.dtype, leaf.device))
                elif leaf is None or isinstance(leaf, (bool, int, float, str)):
                    sig.append((type(leaf), leaf))
                else:
                    return None
    key = (id(target), fid, ref, tuple(sig), prob.argnums, prob.int_argnums, prob.has_aux,
           batch)
    try:
        hash(key)
    except TypeError:  # an unhashable f
        return None
    return key


def probe_shapes(prob: Problem, opts: Opts) -> Shapes:
    """The outputs' sizes: remembered (NOTE [output sizes]), else from ``opts.probe`` or
    one call of ``f``."""
    key = shapes_key(prob, opts.batch) if opts.probe is None else None
    record = opts.detached and torch.is_grad_enabled()
    if key is not None:
        hit = _SHAPES.get(key)
        if hit is not None:
            return Shapes(hit[1], hit[2], hit[3], key, record and hit[4])
    # (drawing nothing, from f's own generators and the host's too: NOTE [auto's extra
    # calls draw what the products draw]; hessian's probe of the gradient, run on every
    # call, searches f's objects for them each time)
    draws = SameDraws(own_generators(prob), host=True)
    draws()
    try:
        flat, spec = opts.probe() if opts.probe is not None else prob.probe(record)
    finally:
        draws()
    records = recorded_elements(flat) if record and any(o.requires_grad for o in flat) else 0
    rows = row_shapes(flat, opts.batch, prob, spec)
    if key is not None:
        if len(_SHAPES) >= SHAPES_MAX:
            _SHAPES.pop(next(iter(_SHAPES)))
        meta = [torch.empty(o.shape, dtype=o.dtype, device="meta") for o in flat]
        _SHAPES[key] = (key[2], meta, spec, rows, records)
    return Shapes([o.detach() for o in flat], spec, rows, None, records)


#: Backward nodes of views: their tangents share their input's memory, counted once there.
_VIEW_NODE = re.compile(
    r"^(Unsafe)?(View|ReshapeAlias|Expand|Squeeze|Unsqueeze|T|Transpose|Permute|Select|Slice"
    r"|AsStrided|Alias|Diagonal|Unfold|Split|SplitWithSizes|Unbind|ViewAs|ViewAsReal"
    r"|ViewAsComplex|Real|Imag)Backward\d*$"
)
#: The most autograd nodes :func:`recorded_elements` visits; a larger graph is counted as
#: none (the estimate from the inputs and outputs alone).
GRAPH_NODES_MAX = 20_000


def recorded_elements(flat: Sequence[Tensor]) -> int:
    """The elements of the intermediate results in the probe's graph that the products'
    tangents may follow, for :func:`~torch_vjp._engine.memory.plan_products` (NOTE [memory
    model]): each node's output elements, leaving out the leaves (parameters), views (no
    memory of their own) and the nodes computed from parameters alone (a weight's transpose
    carries no tangent). A node with an input that needs no grad (the primal, or a
    constant) is counted. At least 1 (the products record a graph); 1 where the graph
    cannot be read or is too large."""
    if len(graph_nodes(flat)) > GRAPH_NODES_MAX:
        return 1
    roots = [o.grad_fn for o in flat if o.grad_fn is not None]
    # a node is reached by a tangent when some input of it needs no grad or is so reached
    reached: dict[int, bool] = {}
    total = 0
    for root in roots:
        work = [(root, False)]
        while work:
            node, done = work.pop()
            if id(node) in reached:
                continue
            edges = node.next_functions
            if not done:
                work.append((node, True))
                work.extend((n, False) for n, _ in edges
                            if n is not None and id(n) not in reached)
                continue
            if not edges:  # AccumulateGrad: a leaf
                reached[id(node)] = False
                continue
            hit = any(n is None or reached.get(id(n), False) for n, _ in edges)
            reached[id(node)] = hit
            if hit and not _VIEW_NODE.match(node.name()):
                try:
                    total += sum(math.prod(m.shape) for m in node._input_metadata)
                except (AttributeError, TypeError, RuntimeError):
                    return 1
    return max(1, total)


def chunk_for(
    prob: Problem,
    mode: str,
    out_rows: Sequence[torch.Size],
    out_dtypes: Sequence[torch.dtype],
    opts: Opts,
    records: int = 0,
) -> int | None:
    """The chunk size for this Jacobian (NOTE [memory model]): one product per output
    element in reverse ``mode``, per input element in forward mode. ``records``: the
    products record autograd graphs that live until their chunk is stored (nonzero: the
    elements of the intermediate results they record, :func:`recorded_elements`)."""
    n_out = sum(math.prod(s) for s in out_rows)
    n_in = sum(math.prod(s) for s in in_rows(prob, opts.batch))
    itemsize = max(
        max(d.itemsize for d in out_dtypes), max(leaf.dtype.itemsize for leaf in prob.leaves)
    )
    # (the result's blocks have the inputs' dtypes in reverse mode, the outputs' in forward
    # mode, as torch.func's: each is counted in its own, and named where they all agree)
    if mode == "rev":
        dtypes, sizes, across = [x.dtype for x in prob.leaves], in_rows(prob, opts.batch), n_out
    else:
        dtypes, sizes, across = list(out_dtypes), out_rows, n_in
    result_bytes = across * sum(math.prod(s) * d.itemsize for s, d in zip(sizes, dtypes)) * (
        1 if opts.batch is None else opts.batch)
    dtype = dtypes[0] if len(set(dtypes)) == 1 else None
    return plan_products(
        n_out if mode == "rev" else n_in,
        n_out,
        n_in,
        itemsize,
        chunk_size=opts.chunk_size,
        max_memory=opts.max_memory,
        device=prob.leaves[0].device,
        call=prob.call,
        alternatives=opts.alternatives,
        batch=opts.batch,
        records=records,
        dtype=dtype,
        result_bytes=result_bytes,
    )

"""The data-flow tests of the per-sample plan (steps 2 to 4 of NOTE [the per-sample plan] in
``plan``): which dimension of a rule call's output holds the examples, which module mixes
examples, and which parameters the loss reaches outside the trusted rule calls.

Everything here works on gradients of single examples' losses with respect to recorded
tensors: example ``k``'s loss depends only on index ``k`` along the dimension that holds the
examples one per row.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from torch_vjp._per_sample.args import Job
from torch_vjp._per_sample.losses import example_loss
from torch_vjp._per_sample.recorder import ModuleCall, Recorder
from torch_vjp._per_sample.registry import Call
from torch_vjp._engine.fwdcheck import all_finite
from torch_vjp._errors import a_type
from torch_vjp._per_sample.weighted import as_shape, linear_at, rows_moved, weighted_grads

__all__ = ["ShapeRecord", "confined", "probe_indices", "call_dims", "walk", "NON_FINITE"]

#: Why no rule is trusted where the probe's gradients are not finite (and the plan, made for
#: this batch alone, is not kept for the next one: ``probe.plan_for``).
NON_FINITE = ("the gradients of the probed examples' losses hold NaN or infinity (the model's "
              "output or loss is not finite for some example of this batch), so which rows "
              "belong to which example cannot be told")


@dataclass
class ShapeRecord:
    """The tensor input shapes of every module call of one forward, ``(id(module), shapes)``,
    in the order the calls return."""

    calls: list[tuple[int, list[tuple[int, ...]]]]
    #: the batch size of the run (that of the run compared with the batch: B - 1, or B + 1
    #: for a batch of two)
    batch: int = 0


def confined(g: Tensor | None, shape: Sequence[int], k: int, batch: int,
             folded: frozenset[int] = frozenset(),
             kept: frozenset[int] = frozenset()) -> set[int] | None:
    """The dimensions of size B along which the gradient of example ``k``'s loss is zero
    except at index ``k`` (None where the gradient is unused or all zero, or where no
    dimension has size B: a flat tensor, the per-entry weights of an EmbeddingBag say, whose
    entries cannot be told apart from the shape alone; the check against the loop then
    decides). ``kept``: dimensions of size B that kept their size with one example fewer,
    so do not hold the examples (the features of a PackedSequence's flat data where
    ``input_size == B``); they are not candidates.

    ``folded``: dimensions of size ``m * B`` that shrank by ``m`` with one example fewer,
    which may hold the examples folded example-major (``b * m + i``: attention's
    ``(B * heads, T, T)`` mask). Where no dimension of size B keeps the gradient apart, one
    of them along which it is zero except in block ``k`` does (and is returned); one along
    which it is not tells nothing (a flat tensor whose examples hold unequal numbers of
    entries can shrink so by coincidence), so it never makes the answer "mixed"."""
    if g is None:
        return None
    g = as_shape(g, shape)

    def along(d: int) -> bool:
        rows = nz.movedim(d, 0).reshape(batch, -1).any(1)
        return bool(rows[k]) and int(rows.sum()) == 1

    sized = [d for d, size in enumerate(shape)
             if size == batch and d < g.dim() and d not in kept]
    folds = [d for d in folded if d < g.dim() and d not in sized]
    if not sized and not folds:
        return None
    nz = g.detach() != 0
    if not bool(nz.any()):
        return None
    dims = {d for d in sized if along(d)}
    if not dims and folds:
        dims = {d for d in folds if along(d)}
        if not dims and not sized:
            return None
    return dims if sized or dims else None


def _other_outputs_mixed(
    c: Call,
    more: dict[int, int],
    grads: dict[tuple[int, int], list[Tensor | None]],
    i: int,
    ks: Sequence[int],
    batch: int,
) -> str:
    """Why an output of ``c`` other than the first does not keep the examples apart along
    the dimension its rule names (``""`` where each does, or is unused)."""
    for j, d in more.items():
        y = c.outputs[j]
        gs = grads.get((i, j))
        if gs is None or d >= y.dim() or y.shape[d] != batch:
            if gs is not None and any(g is not None and bool((g != 0).any()) for g in gs):
                return (f"its output {j} of shape {tuple(y.shape)} has no dimension {d} of "
                        f"size {batch} that could hold the examples")
            continue
        for a, k in enumerate(ks):
            got = confined(gs[a], y.shape, k, batch)
            if got is not None and d not in got:
                return (f"the rows of its output {j} (shape {tuple(y.shape)}) do not belong to "
                        f"single examples along dimension {d} (an example's loss depends on "
                        f"other rows: they are shared by examples, reordered, or mixed)")
    return ""


def probe_indices(batch: int) -> tuple[int, ...]:
    if batch == 2:
        return (1, 0)
    return (batch - 1, batch // 2)


def call_dims(
    job: Job,
    out: Any,
    out_dims: list[int] | None,
    rec: Recorder,
    full: tuple[Any, ShapeRecord],
    small: tuple[Any, ShapeRecord] | None,
) -> tuple[list[tuple[int | None, str]], str | None]:
    """The trusted batch dimension of each rule call of ``rec`` (None, and the reason, where
    none), and the module that mixes examples (None if none does): steps 2 and 3 of NOTE
    [the per-sample plan]. ``out`` is the probed forward's output, ``full`` and ``small``
    the shape runs on the batch and on the batch without its last example."""
    batch = job.batch
    calls = rec.calls
    edges: list[Any] = []
    owners: list[tuple[str, int, int]] = []  # ("call" | "in" | "out", index, position)
    others: list[dict[int, int]] = []  # per call: its other outputs that hold the examples
    call_pos: dict[int, int] = {}  # call -> position of its output's edge in ``edges``
    for i, c in enumerate(calls):
        e = c.out_edges[0] if c.out_edges else None
        if e is not None:
            owners.append(("call", i, 0))
            call_pos[i] = len(edges)
            edges.append(e)
        more = {j: d for j, d in c.rule.other_output_dims(c.module, c.x).items()
                if j < len(c.out_edges)}
        others.append(more)
        for j in more:
            e = c.out_edges[j]
            if e is not None:
                owners.append(("other", i, j))
                edges.append(e)
    for i, mc in enumerate(rec.module_calls):
        for j, e in enumerate(mc.in_edges):
            if e is not None:
                owners.append(("in", i, j))
                edges.append(e)
        for j, e in enumerate(mc.out_edges):
            if e is not None:
                owners.append(("out", i, j))
                edges.append(e)
    grads_by_k: list[list[Tensor | None]] = []
    ks = probe_indices(batch)
    for k in ks:
        loss_k = example_loss(job.fn, job.loss_fn, out, job.targets, k, out_dims)
        if edges and loss_k.requires_grad:
            grads = torch.autograd.grad(loss_k, edges, allow_unused=True, retain_graph=True)
        else:
            grads = [None] * len(edges)
        grads_by_k.append(list(grads))
    if not all_finite(grads_by_k):
        # A NaN or infinity in an example's output or loss reaches every row of the layers
        # below in the backward pass (0 * nan), so confined rows cannot be read and a layer
        # would pass for one that mixes examples: the fallback computes the definition.
        return [(None, NON_FINITE) for _ in calls], None
    call_grads: dict[int, list[Tensor | None]] = {}
    other_grads: dict[tuple[int, int], list[Tensor | None]] = {}
    in_grads: dict[tuple[int, int], list[Tensor | None]] = {}
    out_grads: dict[tuple[int, int], list[Tensor | None]] = {}
    for pos, (kind, i, j) in enumerate(owners):
        gs = [grads_by_k[a][pos] for a in range(len(ks))]
        if kind == "call":
            call_grads[i] = gs
        elif kind == "other":
            other_grads[(i, j)] = gs
        elif kind == "in":
            in_grads[(i, j)] = gs
        else:
            out_grads[(i, j)] = gs
    weighted = weighted_grads(job, out, out_dims, edges, batch)
    where = {(kind, i, j): pos for pos, (kind, i, j) in enumerate(owners)}
    mixing, unsure = _find_mixing(rec.module_calls, in_grads, out_grads, ks, batch, full,
                                  small, weighted, where)
    if unsure is not None:
        # whether a module mixes examples cannot be told: no rule is trusted, the fallback
        # computes the definition
        return [(None, unsure) for _ in calls], None
    result: list[tuple[int | None, str]] = []
    for i, c in enumerate(calls):
        y = c.outputs[0] if c.outputs else None
        if y is None:
            result.append((None, "the layer returned no tensor"))
            continue
        fixed = c.extra.get("fixed_bdim")
        cands = (fixed,) if fixed is not None else c.rule.batch_dims(c.module, c.x)
        if not cands and not isinstance(c.x, Tensor):
            result.append((None, f"the {c.rule.name} rule does not handle this call's input "
                                 f"({a_type(c.x)})"))
            continue
        cands = tuple(d for d in cands if d < y.dim() and y.shape[d] == batch)
        if not cands:
            times = sum(1 for o in calls if o.module is c.module) if c.module is not None else 1
            result.append((None, _no_batch_dim(tuple(y.shape), batch, times)))
            continue
        dims: set[int] | None = None
        for a, k in enumerate(ks):
            got = confined(call_grads.get(i, [None] * len(ks))[a], y.shape, k, batch)
            if got is None:
                continue
            got &= set(cands)
            dims = got if dims is None else dims & got
        if dims is None:  # no probed example's loss depends on this call
            dims = set(cands) if len(cands) == 1 else set()
            if not dims:
                result.append((None, "its output does not reach the losses of the probed "
                                     "examples, so its batch dimension cannot be told"))
                continue
        if len(dims) == 1:
            bad = _other_outputs_mixed(c, others[i], other_grads, i, ks, batch)
            if bad:
                result.append((None, bad))
                continue
            d = dims.pop()
            if weighted is not None and i in call_pos and rows_moved(
                    weighted, call_pos[i], y.shape, d, batch):
                result.append((None, "its output's rows do not all belong to the examples of "
                                     "the same index (the batch is reordered or mixed before "
                                     "this layer: a row's gradient follows another example's "
                                     "loss)"))
                continue
            result.append((d, ""))
        elif not dims:
            result.append((None, "its output's rows do not belong to single examples (an "
                                 "example's loss depends on several of them along every "
                                 "dimension that could hold the examples: the rows are "
                                 "shared by examples, reordered, or mixed)"))
        else:
            result.append((None, f"more than one dimension of its output ({sorted(dims)}) "
                                 f"could hold the examples"))
    return result, mixing


def _no_batch_dim(shape: tuple[int, ...], batch: int, times: int = 1) -> str:
    """Why a call whose output has no dimension of the batch's size gets no rule (``times``:
    how often the forward calls the layer)."""
    why = f"its output of shape {shape} has no dimension that could hold the {batch} examples"
    merged = [d for d, n in enumerate(shape) if batch > 1 and n > batch and n % batch == 0]
    if not merged and batch > 1 and times >= batch and times % batch == 0:
        return why + (f": the layer is called {times} times, once per example it seems (a "
                      f"loop over the batch, each call on one example's rows); rules need "
                      f"one call on the whole batch, with the examples along a dimension of "
                      f"their own")
    if not merged:
        return why + " (a table shared by every example)"
    d = merged[0]
    return (why + f": if the {shape[d]} rows of dimension {d} are the examples merged with "
            f"another dimension ({batch} x {shape[d] // batch}, as after x.reshape(-1, "
            f"features)), rules need the examples along a dimension of their own (nn.Linear "
            f"and nn.Conv take extra dimensions as they are: (B, T, features)); otherwise "
            f"the output is a table shared by every example")


def _find_mixing(
    module_calls: list[ModuleCall],
    in_grads: dict[tuple[int, int], list[Tensor | None]],
    out_grads: dict[tuple[int, int], list[Tensor | None]],
    ks: Sequence[int],
    batch: int,
    full: tuple[Any, ShapeRecord],
    small: tuple[Any, ShapeRecord] | None,
    weighted: tuple[Any, ...] | None = None,
    where: dict[tuple[str, int, int], int] | None = None,
) -> tuple[str | None, str | None]:
    """The innermost module whose outputs keep examples apart while an input that carries
    the examples does not: its forward mixes examples (None if there is none). A tensor
    keeps them apart where, for the probed examples, their losses' gradients are confined
    to their rows (:func:`confined`) and, for every example at once, the gradients of the
    two weightings of :func:`weighted_grads` keep each row's ratio along a dimension of
    size B that shrank with the batch (a module that mixes only some examples, those
    sharing a group id say, leaves the probed two apart). And, where
    the only such modules are ones whose inputs could not be compared between the runs on
    ``B`` and ``B - 1`` examples (a layer called once per example, by a loop over the batch:
    every input then counts as carrying the examples, and a dimension that happens to have
    size ``B`` reads as mixed), why the rules cannot be trusted (None otherwise)."""
    order = [id(mc.module) for mc in module_calls]
    reordered = small is not None and [c[0] for c in full[1].calls] != order
    carries, folds, unsure, compared = _carrying_inputs(
        full[1], None if small is None else small[1], order, batch)

    def shrinks(kind: str, i: int, j: int) -> bool:
        # (an output: any dimension of size B; an input: one whose shapes were compared)
        return kind == "out" or compared(i, j)
    mixers: list[ModuleCall] = []
    guessed: list[ModuleCall] = []
    elsewhere: list[ModuleCall] = []  # (their input is mixed by another of its uses)
    for i, mc in enumerate(module_calls):
        def ok(gs: list[Tensor | None], shape: Sequence[int],
               folded: tuple[frozenset[int], frozenset[int]] = (frozenset(), frozenset()),
               pos: int | None = None, shrunk: bool = False) -> bool:
            for a, k in enumerate(ks):
                got = confined(gs[a], shape, k, batch, *folded)
                if got is not None and not got:
                    return False
            # every example: a row along each dimension of size B that shrank with the batch
            # follows other examples' losses (NOTE [the per-sample plan], step 3)
            sized = [d for d, size in enumerate(shape) if size == batch and d not in folded[1]]
            return not (shrunk and weighted is not None and pos is not None and sized
                        and all(rows_moved(weighted, pos, shape, d, batch) for d in sized)
                        and linear_at(weighted, pos))

        outs_ok = all(ok(out_grads.get((i, j), [None] * len(ks)), s, pos=where.get(("out", i, j))
                         if where else None, shrunk=shrinks("out", i, j))
                      for j, s in enumerate(mc.out_shapes))
        if not outs_ok:
            continue
        for j, s in enumerate(mc.in_shapes):
            if not carries(i, j):
                continue
            gs = in_grads.get((i, j))
            if gs is not None and not ok(gs, s, folds(i, j), where.get(("in", i, j))
                                         if where else None, shrunk=shrinks("in", i, j)):
                # (where the probed examples' own rows show it: not the rows of examples
                # mixed with others only, which the weighted gradients show)
                own = (None if unsure(i) or ok(gs, s, folds(i, j))
                       else _through_module(mc, i, j, out_grads, ks))
                if own is not None and ok(own, s, folds(i, j)):
                    # through the module alone, each example's loss reaches its own rows of
                    # the input: another use of that input mixes them, not this module
                    elsewhere.append(mc)
                else:
                    (guessed if unsure(i) else mixers).append(mc)
                break
    if not mixers and not guessed and elsewhere:
        # the forward that calls the module and uses its input otherwise too: its parent
        parent = elsewhere[0].path.rpartition(".")[0] if elsewhere[0].path else None
        mixers = [next((mc for mc in module_calls if mc.path == parent), elsewhere[0])]
    if not mixers:
        if guessed:
            mc = guessed[0]
            name = f"'{mc.path}' ({type(mc.module).__name__})" if mc.path else (
                f"the model itself ({type(mc.module).__name__})")
            how = (f"in another order on one run of the batch than on the next (control "
                   f"flow by values or random draws), so whether {name} keeps the examples "
                   f"apart" if reordered else
                   f"{name} a different number of times for a batch of {batch} examples and "
                   f"for one of {small[1].batch if small is not None else batch - 1} (a "
                   f"loop over the examples, say), so whether its "
                   f"calls keep the examples apart")
            return None, (f"the model calls {'its modules ' if reordered else ''}{how} cannot "
                          f"be told from the data flow")
        return None, None
    # the innermost: no other mixer lies inside it
    paths = [mc.path for mc in mixers]
    inner = [
        mc for mc in mixers
        if not any(p != mc.path and (mc.path == "" or p.startswith(mc.path + ".")) for p in paths)
    ]
    mc = inner[0] if inner else mixers[0]
    where = f"module '{mc.path}' ({type(mc.module).__name__})" if mc.path else (
        f"the model's own forward ({type(mc.module).__name__})")
    return where, None


_NO_DIMS: tuple[frozenset[int], frozenset[int]] = (frozenset(), frozenset())


def _through_module(
    mc: ModuleCall, i: int, j: int,
    out_grads: dict[tuple[int, int], list[Tensor | None]], ks: Sequence[int],
) -> list[Tensor | None] | None:
    """For each probed example, the gradient its loss gives input ``j`` of module call
    ``i`` through the module's outputs alone (not through other uses of that input); None
    where it cannot be had."""
    edge = mc.in_edges[j] if j < len(mc.in_edges) else None
    if edge is None:
        return None
    got: list[Tensor | None] = []
    for a in range(len(ks)):
        outs, gos = [], []
        for o, e in enumerate(mc.out_edges):
            g = out_grads.get((i, o), [None] * len(ks))[a]
            if e is not None and g is not None:
                outs.append(e)
                gos.append(g)
        if not outs:
            got.append(None)
            continue
        try:
            got.append(torch.autograd.grad(outs, [edge], gos, retain_graph=True,
                                           allow_unused=True)[0])
        except RuntimeError:  # (a graph freed or a backward that cannot run twice)
            return None
    return got


def _carrying_inputs(
    full: ShapeRecord, small: ShapeRecord | None, order: list[int], batch: int,
) -> tuple[Callable[[int, int], bool],
           Callable[[int, int], tuple[frozenset[int], frozenset[int]]],
           Callable[[int], bool], Callable[[int, int], bool]]:
    """Whether input ``j`` of module call ``i`` carries the examples: its shape shrinks with
    the batch; the dimensions of that input that hold them folded (see :func:`confined`): of
    size ``m * B``, shrunk by ``m``, with ``m > 1``, and those of size B that did not shrink
    (``kept`` of :func:`confined`); whether call ``i`` could not be compared (then every
    input counts as carrying the examples); and whether input ``j`` of call ``i`` was (its
    dimensions of size B outside ``kept`` then shrank with the batch).

    The calls of the two runs are matched module by module, occurrence by occurrence, for the
    modules called as many times in both; a module called a different number of times (once
    per example, by a loop over the batch) cannot be matched. Where the recorded run did not
    call the modules of the run on the batch in the same order, none can."""
    never = (lambda i, j: False)
    if small is None:
        return (lambda i, j: True), (lambda i, j: _NO_DIMS), (lambda i: False), never
    if [c[0] for c in full.calls] != order:
        return (lambda i, j: True), (lambda i, j: _NO_DIMS), (lambda i: True), never
    if [c[0] for c in small.calls] == order:
        match: list[int | None] = list(range(len(order)))
    else:
        in_small: dict[int, list[int]] = {}
        for s, c in enumerate(small.calls):
            in_small.setdefault(c[0], []).append(s)
        in_full: dict[int, int] = {}
        for m in order:
            in_full[m] = in_full.get(m, 0) + 1
        seen: dict[int, int] = {}
        match = []
        for m in order:
            n = seen.get(m, 0)
            seen[m] = n + 1
            found = in_small.get(m, [])
            match.append(found[n] if len(found) == in_full[m] else None)

    def carries(i: int, j: int) -> bool:
        s = match[i]
        if s is None:
            return True
        a, b = full.calls[i][1], small.calls[s][1]
        if j >= len(a) or j >= len(b):
            return True
        return a[j] != b[j]

    def folds(i: int, j: int) -> tuple[frozenset[int], frozenset[int]]:
        s = match[i]
        if s is None:
            return _NO_DIMS
        a, b = full.calls[i][1], small.calls[s][1]
        if j >= len(a) or j >= len(b) or len(a[j]) != len(b[j]):
            return _NO_DIMS
        pairs = list(enumerate(zip(a[j], b[j])))
        return (frozenset(d for d, (x, y) in pairs
                          if abs(x - y) > 1 and x == batch * abs(x - y)),
                frozenset(d for d, (x, y) in pairs if x == y == batch))

    def compared(i: int, j: int) -> bool:
        s = match[i]
        if s is None:
            return False
        a, b = full.calls[i][1], small.calls[s][1]
        return j < len(a) and j < len(b) and a[j] is not None and b[j] is not None and len(
            a[j]) == len(b[j])

    return carries, folds, (lambda i: match[i] is None), compared


_VIEWS = ("View", "UnsafeView", "Reshape", "Expand", "Squeeze", "Unsqueeze", "Permute",
          "Transpose", "TBackward", "Alias", "AsStrided")


def _is_view(node: Any) -> bool:
    return type(node).__name__.startswith(_VIEWS)


def walk(total: Tensor, calls: list[Call], trusted: list[bool], tracked: dict[int, str]) -> set[str]:
    """Names of tracked parameters the loss reaches other than through a trusted rule call.

    Walks the autograd graph from the loss; at the output node of a trusted call it continues
    only into the call's inputs, skipping the layer's own use of its parameters. A call whose
    weight is computed from a parameter (a parametrization) is walked through, so that
    parameter is found and left to the fallback rather than mistaken for unused; the
    call's own parameters that its rule computes (a plain bias beside the computed weight)
    are the rule's use only where they are direct inputs of the call's operator (or one
    view of them, the ``weight.t()`` a 2-d Linear passes): the node of its output, or the first
    node below it that is not a view (``addmm`` under the view of a 3-d Linear). Met deeper (the weight's parametrization reads the layer's own bias),
    they are a use outside the rule.
    """
    jump: dict[Any, list[Any]] = {}
    # a trusted call whose weight is computed: its internals are walked, the call's own
    # parameters met as direct inputs of its operator counted as the rule's use
    inside: dict[Any, tuple[frozenset[int], frozenset[Any]]] = {}
    for c, ok in zip(calls, trusted):
        for e in c.out_edges if ok else ():
            if e is None:
                continue
            if c.complete:
                jump[e.node] = [x.node for x in c.in_edges]
            elif c.params:
                inside[e.node] = (frozenset(id(t) for t, _ in c.params.values()),
                                  frozenset(x.node for x in c.in_edges))
    found: set[str] = set()
    seen: set[Any] = set()
    none: tuple[frozenset[int], frozenset[Any], bool | None] = (frozenset(), frozenset(), False)
    # (node, (own, ins, head)): ``own`` the parameters that count as the rule's use here,
    # ``ins`` the nodes of the call's inputs (where ``own`` ends), ``head`` True where the
    # node is the call's output node or a view of it (its children are the operator's
    # inputs), False below that (an input of the operator), None for one view of an input
    stack: list[tuple[Any, tuple[frozenset[int], frozenset[Any], bool | None]]] = [
        (total.grad_fn, none)]
    while stack:
        node, ctx = stack.pop()
        if node in ctx[1]:
            ctx = none
        own, ins, head = ctx
        key = node if not own else (node, own, head)
        if node is None or key in seen:
            continue
        seen.add(key)
        nxt = jump.get(node)
        if nxt is not None:
            stack.extend((n, none) for n in nxt)
            continue
        var = getattr(node, "variable", None)
        if var is not None:
            name = tracked.get(id(var))
            if name is not None and id(var) not in own:
                found.add(name)
            continue
        entered = inside.get(node)
        if entered is not None:
            own, ins, head = entered[0], entered[1], True
        if own:
            # (below the output's views, the operator; below the operator, its arguments,
            # and one view of an argument, weight.t() of a 2-d Linear: a chain of views
            # below it, weight computed as bias.unsqueeze(1).expand(...), is no argument)
            view = _is_view(node)
            child = (own, ins, True if view else False) if head is True else (
                (own, ins, None) if head is False and view else none)
        else:
            child = none
        stack.extend((n, child) for n, _ in node.next_functions)
    return found

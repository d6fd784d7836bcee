"""Operators torch differentiates wrongly, read off f's graph for an explicitly named
reverse strategy.

NOTE [named reverse strategies and wrong formulas]
"auto" checks its route against other products (NOTE [auto, checked once], NOTE [a reverse
product checked forward]); a named strategy computes what was asked, unchecked. Four of
torch's (2.13) backward derivatives are known wrong, and reverse mode through them returned
a wrong Jacobian without a word (the forward-mode formulas torch has wrong, and the named
forward strategies' refusal, are in :data:`WRONG_FORWARD` and :mod:`torch_vjp._engine.fwd_wrong`):

* the batching rule of ``torch.cdist``'s backward (``CdistBackward0``): the products under
  torch.vmap are off by a relative error near 1; each alone is right. ``strategy="rev"``
  computes the rows one at a time, without vmap, where f's graph holds one, with a one-time
  warning (none where ``chunk_size=1`` asks for that already);
* the backward formula of ``torch.as_strided_scatter`` (``AsStridedScatterBackward0``) for
  the tensor scattered into: wrong with or without vmap. ``"rev"`` and ``"rev-loop"`` are
  refused where the tensor scattered into is computed from the differentiated inputs (the
  gradient of the scattered source is right), with the strategies that compute it
  (forward mode is right);
* the backward formula of the antialiased resize, ``F.interpolate(..., mode='bilinear' or
  'bicubic', antialias=True)`` (``UpsampleBilinear2DAaBackward0``,
  ``UpsampleBicubic2DAaBackward0``), for its input: wrong with or without vmap (errors of
  the size of the entries) where the output is one column wide and its height is resampled,
  or where a dimension keeps its size under a ``scale_factor`` other than 1 (without
  ``align_corners``). The node's saved sizes and scales tell (:func:`_resize_wrong`, checked
  against forward mode over 1,286 random sizes, scales and ``align_corners``: no case
  missed, none refused that is right); elsewhere its backward is right and nothing is
  refused. Refused as
  above, with ``"fwd"`` (torch.vmap runs its forward formula) as the fix;
* the backward formula of ``F.max_unpool1d/2d/3d`` (``MaxUnpool2DBackward0``,
  ``MaxUnpool3DBackward0``) where the indices repeat within a plane: reverse mode passes the
  gradient of the one output element written to every input that named it (forward mode is
  right). With ``max_pool``'s own indices they do not repeat and nothing is refused
  (:func:`_unpool_wrong`). Refused as above.

``torch_vjp.vjp`` reads the graph its own call of f builds for the same operators: its
``vjp_fn`` refuses the products through ``torch.as_strided_scatter``'s wrong backward (as
torch.func.vjp would return them wrong), with forward mode as the fix
(:func:`reading_wrong_ops`, :func:`wrong_pullback`); one product at a time and torch.vmap's
batched ones run the same formula. :func:`torch_vjp.jacobian_of`, whose only products are
the backward passes of a graph already built, refuses where that graph holds one whose
wrong gradient reaches its inputs (:func:`wrong_towards`, :func:`wrong_graph`), naming
forward mode from the function as the fix.

The graph is the one the products' own call of f builds (torch.func's vjp records it): no
call of f more, and a walk of its nodes per call (a fraction of the call's own cost: each
node was an operator f ran); where torch.func cannot run f, the plain-autograd loop's call
(``"rev-loop"``); inside an outer transform too (``torch.func.vmap`` over the Jacobian: its
products are batched by that vmap as well). A Hessian's gradient, whose strategy the
caller did not name, reads it for its own refusal (NOTE [a Hessian through a wrong
backward]). The same ops are known to the
sparse Jacobians (NOTE [wrong batching rules] in :mod:`torch_vjp._sparse.probe`), which read
them on their own.

NOTE [a Hessian through a wrong backward]
A Hessian differentiates f's gradient, and that gradient is always formed by reverse mode,
whatever strategy the outer Jacobian runs: through ``torch.as_strided_scatter``'s wrong
backward (into a tensor computed from the differentiated inputs) every strategy's Hessian
was wrong (by up to the size of its entries), "auto"'s check included, which compares
products of the same wrong gradient. The gradient's own products read the graph their call
of f builds and refuse (:func:`wrong_hessian`), naming forward-mode gradients as the fix.

NOTE [a plain loop through a wrong backward]
Where torch.func cannot run f at all (an old-style custom Function, NumPy), "auto" takes
the plain-autograd loop (``rev_plain``), and its check, which runs torch.func, cannot run
there either: through ``torch.as_strided_scatter``'s wrong backward its Jacobian was wrong
(by about the size of its entries) without a word. The loop reads the graph its own call of
f builds (no call more) and, where it holds that operator, "auto" computes with plain
forward mode instead (``fwd_plain``, whose formula is right), with a one-time warning, or,
where forward mode cannot run f, refuses (:func:`wrong_plain`).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

from torch import Tensor
from torch.utils._pytree import tree_leaves

from torch_vjp._engine.graph import graph_nodes
from torch_vjp._errors import (JacobianCallError, JacobianWarning, StrategyError, quote_error,
                               warn_once)

__all__ = ["GRAD_MODE_BACKWARD", "grad_mode_backward", "named_reverse",
           "plain_forward_message", "reading_wrong_ops", "wrong_alone", "wrong_graph", "wrong_hessian", "wrong_ops", "wrong_plain", "wrong_pullback",
           "wrong_towards"]

#: Backward nodes whose batching rule is wrong (the products under vmap), by their name.
_BATCHED_WRONGLY = {"CdistBackward0": "torch.cdist"}
_SCATTER = "torch.as_strided_scatter"
_AA_BILINEAR = "torch.nn.functional.interpolate(mode='bilinear', antialias=True)"
_AA_BICUBIC = "torch.nn.functional.interpolate(mode='bicubic', antialias=True)"
_UNPOOL_2D = "torch.nn.functional.max_unpool2d (max_unpool1d's too)"
_UNPOOL_3D = "torch.nn.functional.max_unpool3d"
#: Backward nodes wrong alone, where their first input (``self``) is differentiated.
_WRONG_ALONE = {"AsStridedScatterBackward0": _SCATTER,
                "UpsampleBilinear2DAaBackward0": _AA_BILINEAR,
                "UpsampleBicubic2DAaBackward0": _AA_BICUBIC,
                "MaxUnpool2DBackward0": _UNPOOL_2D,
                "MaxUnpool3DBackward0": _UNPOOL_3D}
#: How each op's backward is wrong: for the tensor that f computes from its inputs.
_AA_HOW = ("for the input resized (where the output is one column wide and its height is "
           "resampled, or where a dimension keeps its size under a scale_factor other than "
           "1: errors of the size of the entries)")
_HOW = {_SCATTER: ("for the tensor scattered into (the gradient of that tensor is passed "
                   "inside the scattered region rather than outside it)"),
        _AA_BILINEAR: _AA_HOW, _AA_BICUBIC: _AA_HOW}
_UNPOOL_HOW = ("for its input where indices repeat in a plane (the output element two "
               "inputs are written to holds one of them, and reverse mode passes its "
               "gradient to both: errors of the size of the entries)")
_HOW.update({_UNPOOL_2D: _UNPOOL_HOW, _UNPOOL_3D: _UNPOOL_HOW})


def _how(op: str) -> str:
    return _HOW.get(op, "for its input")


def _no_vmap(op: str) -> bool:
    """Whether torch.vmap has no batching rule for ``op`` (forward mode then runs one
    product at a time: ``"fwd-loop"``)."""
    return op == _SCATTER


def _resize_wrong(node: Any) -> bool:
    """Whether the antialiased resize's backward ``node`` is one torch computes wrongly
    (NOTE [named reverse strategies and wrong formulas]): an output one column wide from an
    input more than one row high resampled to another height, or, without
    ``align_corners``, a dimension of more than one element kept at its size with a
    ``scale_factor`` other than 1 (the forward kernel resamples it by the scale); True where
    its saved sizes cannot be read."""
    try:
        ho, wo = (int(n) for n in node._saved_output_size)
        hi, wi = (int(n) for n in node._saved_self_sym_sizes[-2:])
        sh, sw = node._saved_scales_h, node._saved_scales_w
        corners = bool(node._saved_align_corners)
    except Exception:  # noqa: BLE001 - saved values not readable: taken as wrong
        return True

    def scaled(scale: float | None) -> bool:
        return scale is not None and scale > 0 and scale != 1.0

    return ((wo == 1 and hi > 1 and ho > 1 and ho != hi)
            or (not corners and ((ho == hi > 1 and scaled(sh))
                                 or (wo == wi > 1 and scaled(sw)))))


def _unpool_wrong(node: Any) -> bool:
    """Whether the backward ``node`` of ``max_unpool1d/2d/3d`` is one torch computes
    wrongly: where its saved indices repeat within a plane (the last two dimensions, three
    for ``max_unpool3d``), reverse mode passes the gradient of the one output element to
    every input written there, of which the output holds one; without repeats (indices of
    ``max_pool``'s) it is right. True where the indices cannot be read."""
    try:
        idx = node._saved_indices
        k = 3 if type(node).__name__ == "MaxUnpool3DBackward0" else 2
        flat = idx.flatten(start_dim=max(idx.dim() - k, 0)).sort(-1).values
        return bool((flat[..., 1:] == flat[..., :-1]).any())
    except Exception:  # noqa: BLE001 - saved values not readable: taken as wrong
        return True


#: Backward nodes of :data:`_WRONG_ALONE` wrong only where their saved values say so.
_WRONG_WHERE = {"UpsampleBilinear2DAaBackward0": _resize_wrong,
                "UpsampleBicubic2DAaBackward0": _resize_wrong,
                "MaxUnpool2DBackward0": _unpool_wrong,
                "MaxUnpool3DBackward0": _unpool_wrong}


def _scatter_prod_wrong(node: Any) -> bool:
    """Whether ``torch.scatter_reduce``'s node ``node`` takes a tangent through torch's wrong
    forward-mode formula of ``reduce='prod'`` (2.13: wrong for the source, and for the
    tensor scattered into with ``include_self=True``; right for every other reduction);
    True where its saved values cannot be read."""
    try:
        if node._saved_reduce != "prod":
            return False
        into, src = (n is not None for n, _ in node.next_functions[:2])
        return src or (into and bool(node._saved_include_self))
    except Exception:  # noqa: BLE001 - saved values not readable: taken as wrong
        return True


def _triangular_wrong(node: Any) -> bool:
    """Whether ``torch.triangular_solve``'s node ``node`` differentiates its matrix (its
    second input), whose forward-mode formula torch (2.13) has wrong under every flag
    (the right-hand side's is right)."""
    nexts = node.next_functions
    return len(nexts) > 1 and nexts[1][0] is not None


#: Backward nodes of ops whose forward-mode formula torch (2.13) has wrong (checked against
#: reverse mode in float64; NOTE [forward mode through a wrong formula] in
#: :mod:`torch_vjp._engine.fwd_wrong`), by name, and where their tangent is wrong.
WRONG_FORWARD = {"ScatterReduceBackward0": "torch.scatter_reduce(reduce='prod')",
                 "TriangularSolveBackward0": "torch.triangular_solve",
                 "LinalgDetBackward0": "torch.linalg.det"}
#: (``torch.linalg.det``'s is wrong at every rank-deficient matrix, pivots of rounding size
#: included: a property of the point, so it is taken as wrong at every point)
WRONG_FORWARD_WHERE = {"ScatterReduceBackward0": _scatter_prod_wrong,
                       "TriangularSolveBackward0": _triangular_wrong,
                       "LinalgDetBackward0": lambda node: True}


def named_reverse(call: str, found: tuple[str | None, str | None], vectorized: bool,
                  chunk: int | None, named: tuple[str, Hashable]) -> bool:
    """Whether a named reverse strategy (``vectorized``: "rev", else "rev-loop") is to run
    its products under vmap, where f's graph holds the ops ``found`` (:func:`wrong_ops`;
    ``chunk``: the products at once, None: all; ``named``: f's name, and its key for the
    one-time warning): not where it holds an op whose batching rule is wrong, with a
    one-time warning (none where ``chunk`` is 1); an op whose backward is wrong alone is
    refused (NOTE [named reverse strategies and wrong formulas])."""
    batching, alone = found
    name = named[0]
    strategy = "rev" if vectorized else "rev-loop"
    if alone is not None:
        how = _how(alone)
        fix = ("strategy='fwd-loop' (forward mode, whose formula is right; torch.vmap has no "
               "batching rule for it)" if _no_vmap(alone) else
               "strategy='fwd' (forward mode, whose formula is right)")
        raise StrategyError(
            f"{call}: strategy={strategy!r} computes with reverse-mode AD, and torch's "
            f"backward formula of {alone} is wrong {how}, which f ({name}) computes from its "
            f"differentiated inputs, so the Jacobian would be wrong, with or without "
            f"torch.vmap.\n"
            f"  Fix: {fix}, or 'auto', which checks its reverse products and takes forward "
            f"mode there."
        )
    if batching is None or not vectorized:
        return vectorized
    if chunk != 1:
        warn_once(
            ("named rev, batched wrongly", named[1]),
            f"{call}: strategy='rev' computes its rows under torch.vmap, whose batching "
            f"rule for the backward of {batching} in f ({name}) is wrong (torch's: the rows "
            f"are off by a relative error near 1, each alone is right), so it computed the "
            f"rows one reverse product at a time, without vmap, as it does wherever f's "
            f"graph holds that operator.\n"
            f"  Pass strategy='rev-loop' (or chunk_size=1) to compute them that way "
            f"directly. This warning is shown once per function.",
            JacobianWarning,
        )
    return False


def wrong_ops(outs: Sequence[Tensor], batched: Mapping[str, str] | None = None,
              wrong_alone: Mapping[str, str] | None = None,
              grad_mode: list[str | None] | None = None) -> tuple[str | None, str | None]:
    """``(batched wrongly, wrong alone)``: the ops of NOTE [named reverse strategies and
    wrong formulas] the graph of ``outs`` holds, by name (None: none). ``batched`` and
    ``wrong_alone`` name the backward nodes otherwise (the sparse wing's words). Into
    ``grad_mode``, where given (with torch's own tables only), the op of
    :func:`grad_mode_backward` the same walk met (None: none)."""
    if batched is None and wrong_alone is None:
        return _known_wrong_ops(outs, grad_mode)
    batched = _BATCHED_WRONGLY if batched is None else batched
    wrong_alone = _WRONG_ALONE if wrong_alone is None else wrong_alone
    batching = alone = None
    for node in graph_nodes(outs):
        name = type(node).__name__
        batching = batching or batched.get(name)
        if (alone is None and name in wrong_alone and node.next_functions
                and node.next_functions[0][0] is not None
                and _WRONG_WHERE.get(name, _always)(node)):
            alone = wrong_alone[name]
    return batching, alone


#: Node type -> its name, where it is one of :data:`_BATCHED_WRONGLY` or
#: :data:`_WRONG_ALONE`'s, else None (a type's name does not change).
_NODE_NAMES: dict[type, str | None] = {}


def _known_wrong_ops(outs: Sequence[Tensor], grad_mode: list[str | None] | None = None
                     ) -> tuple[str | None, str | None]:
    """:func:`wrong_ops` with torch's own tables: the same walk as graph_nodes' in one loop,
    each node type's name looked up once (a walk per product call: NOTE [named reverse
    strategies and wrong formulas])."""
    names = _NODE_NAMES
    batching = alone = needs = None
    found: list[Any] = []  # (holds the nodes: their ids stay theirs while it lives)
    seen: set[int] = set()
    stack = [o.grad_fn for o in outs if o.grad_fn is not None]
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        found.append(node)
        kind = type(node)
        if kind in names:
            name = names[kind]
        else:
            name = kind.__name__
            name = names[kind] = (name if name in _BATCHED_WRONGLY or name in _WRONG_ALONE
                                  or name in GRAD_MODE_BACKWARD else None)
        nexts = node.next_functions
        if name is not None:
            needs = needs or GRAD_MODE_BACKWARD.get(name)
            batching = batching or _BATCHED_WRONGLY.get(name)
            if (alone is None and name in _WRONG_ALONE and nexts and nexts[0][0] is not None
                    and _WRONG_WHERE.get(name, _always)(node)):
                alone = _WRONG_ALONE[name]
        for nxt, _ in nexts:
            if nxt is not None:
                stack.append(nxt)
    if grad_mode is not None:
        grad_mode[:] = [needs]
    return batching, alone


#: Backward nodes whose formula torch (2.13) computes rightly only in grad mode: without
#: it another branch runs, wrong at singular matrices (NOTE [a backward right only in grad
#: mode]), by name.
GRAD_MODE_BACKWARD = {"LinalgDetBackward0": "torch.linalg.det"}
#: Node type -> whether it is one of :data:`GRAD_MODE_BACKWARD`'s.
_GRAD_MODE_TYPES: dict[type, bool] = {}


def grad_mode_backward(outs: Sequence[Tensor]) -> str | None:
    """The op of :data:`GRAD_MODE_BACKWARD` (by name) the graph of ``outs`` holds, else None:
    a walk of its nodes, each node type's name looked up once.

    NOTE [a backward right only in grad mode]
    torch's (2.13) backward of ``torch.linalg.det`` (``LinalgDetBackward0``) takes one branch
    in grad mode (right at singular matrices) and another without it (a solve with the LU
    factors, wrong at a singular matrix: errors of the size of the entries, at an exact zero
    pivot or one of rounding size). The reverse products run without grad mode for a
    detached result (``torch.no_grad()``, or ``torch.autograd.grad`` without
    ``create_graph``), and every strategy's Jacobian through ``det`` at a singular matrix
    was wrong without a word, where ``torch.func.jacrev`` is right. Where f's graph holds
    such a node, the products run in grad mode (the graph of the backward pass lives for
    its chunk only) and are detached after; elsewhere nothing changes."""
    types = _GRAD_MODE_TYPES
    for node in graph_nodes(outs):
        kind = type(node)
        hit = types.get(kind)
        if hit is None:
            hit = types[kind] = kind.__name__ in GRAD_MODE_BACKWARD
        if hit:
            return GRAD_MODE_BACKWARD[kind.__name__]
    return None


def wrong_towards(outs: Sequence[Tensor], ins: Sequence[Tensor]) -> str | None:
    """The op of :data:`_WRONG_ALONE` (by name) in the graph of ``outs`` whose wrong
    gradient reaches ``ins`` (its first input's graph holds one of them), for
    :func:`torch_vjp.jacobian_of`, which reads that graph; None where there is none (one
    only on a path to another tensor that requires grad leaves ``ins``' Jacobian right)."""
    targets = {id(x.grad_fn) for x in ins if x.grad_fn is not None}
    leaves = {id(x) for x in ins if x.grad_fn is None}
    for node in graph_nodes(outs):
        name = type(node).__name__
        if name not in _WRONG_ALONE or not node.next_functions:
            continue
        first = node.next_functions[0][0]
        if first is None or not _WRONG_WHERE.get(name, _always)(node):
            continue
        stack, seen = [first], set()
        while stack:
            sub = stack.pop()
            if id(sub) in seen:
                continue
            seen.add(id(sub))
            variable = getattr(sub, "variable", None)
            if id(sub) in targets or (variable is not None and id(variable) in leaves):
                return _WRONG_ALONE[name]
            stack.extend(nxt for nxt, _ in sub.next_functions if nxt is not None)
    return None


def _always(node: Any) -> bool:
    return True


def reading_wrong_ops(f: Callable[..., Any], has_aux: bool,
                      grad_mode: list[str | None] | None = None
                      ) -> tuple[Callable[..., Any], list[tuple[str | None, str | None]]]:
    """``f`` as torch.func.vjp calls it, recording into the list returned with it the ops of
    NOTE [named reverse strategies and wrong formulas] its outputs' graph holds
    (:func:`wrong_ops`): no call of f more, a walk of the graph it built; into
    ``grad_mode``, where given, the op of :func:`grad_mode_backward` it holds (None:
    none)."""
    found: list[tuple[str | None, str | None]] = []

    def read(*args: Any, **kwargs: Any) -> Any:
        res = f(*args, **kwargs)
        out = res[0] if has_aux and isinstance(res, tuple) and len(res) == 2 else res
        found[:] = [wrong_ops([o for o in tree_leaves(out) if isinstance(o, Tensor)],
                              grad_mode=grad_mode)]
        return res

    return read, found


def wrong_pullback(call: str, op: str, name: str) -> JacobianCallError:
    """The error of a pullback (``torch_vjp.vjp``'s ``vjp_fn``) through ``op``, an operator
    whose backward formula is wrong alone (NOTE [named reverse strategies and wrong
    formulas]), in f (``name``)."""
    how = _how(op)
    fix = (f"torch_vjp.jacobian(f, *primals, strategy='fwd-loop') and v^T J from it "
           f"(torch.vmap has no batching rule for {op}, so 'fwd' cannot run it)"
           if _no_vmap(op) else
           "torch_vjp.jacobian(f, *primals, strategy='fwd') and v^T J from it")
    return JacobianCallError(
        f"{call}: torch's backward formula of {op} is wrong {how}, which f ({name}) computes "
        f"from the primals, so v^T J would be wrong (torch.func.vjp's too), batched or "
        f"not.\n"
        f"  Fix: compute with forward mode, whose formula is right: torch_vjp.jvp(f, "
        f"primals, tangents) for J t, or {fix}."
    )


def wrong_graph(call: str, op: str) -> JacobianCallError:
    """The error of :func:`torch_vjp.jacobian_of` where the outputs' graph holds ``op``, an
    operator whose backward formula is wrong alone (NOTE [named reverse strategies and wrong
    formulas]): the graph's backward passes are the only products it can take."""
    fwd = "'fwd-loop'" if _no_vmap(op) else "'fwd'"
    return JacobianCallError(
        f"{call}: the outputs' graph goes through {op}, and torch's backward formula of it "
        f"is wrong {_how(op)}, which the graph computes from tensors that require grad, "
        f"so a Jacobian read from the graph (one backward pass per output element) would be "
        f"wrong, as torch.autograd.grad's products through it are.\n"
        f"  Fix: compute the Jacobian from the function that made the outputs, with forward "
        f"mode, whose formula is right: torch_vjp.jacobian(f, x, strategy={fwd}); or "
        f"write f without {op}."
    )


def wrong_alone(op: str) -> bool:
    """Whether the aten operator ``op`` (``"as_strided_scatter"``) has a backward formula
    torch computes wrongly with or without vmap (a Hessian through it is refused: NOTE [a
    Hessian through a wrong backward])."""
    return f"torch.{op}" in _WRONG_ALONE.values()


def wrong_hessian(call: str, op: str, name: str, strategy: str) -> JacobianCallError:
    """The error of a Hessian (asked for with ``strategy``) of f (``name``) through ``op``,
    an operator whose backward formula is wrong alone (NOTE [a Hessian through a wrong
    backward])."""
    how = _how(op)
    fwd, one = (("fwd-loop", f", one product at a time (torch.vmap has no batching rule "
                              f"for {op})") if _no_vmap(op) else ("fwd", ""))
    return JacobianCallError(
        f"{call}: torch's backward formula of {op} is wrong {how}, which f ({name}) computes "
        f"from its differentiated inputs; a Hessian differentiates f's gradient, "
        f"which is formed by reverse mode whatever the strategy (strategy={strategy!r} "
        f"names the outer Jacobian only), so the Hessian would be wrong under every "
        f"strategy.\n"
        f"  Fix: take the Jacobian of a forward-mode gradient, whose formula is right{one}: "
        f"torch_vjp.jacobian(lambda x: torch_vjp.jacobian(f, x, strategy={fwd!r}), x, "
        f"strategy={fwd!r}) for a scalar f; or write f without {op}."
    )


def plain_forward_message(call: str, op: str, name: str) -> str:
    """The one-time warning that "auto" computed with plain forward mode where the plain
    reverse loop meets ``op`` (NOTE [a plain loop through a wrong backward])."""
    how = _how(op)
    return (
        f"{call}: torch.func cannot run f ({name}), so strategy='auto' computes with plain "
        f"autograd, and torch's backward formula of {op} is wrong {how}, which f computes "
        f"from its differentiated inputs: it computed the Jacobian with plain "
        f"forward-mode AD (one forward pass per input element), whose formula is right, "
        f"instead of reverse mode.\n"
        f"  Pass strategy='fwd-loop' to compute it that way directly. This warning is shown "
        f"once per function."
    )


def wrong_plain(call: str, op: str, name: str, err: BaseException) -> JacobianCallError:
    """The error of "auto" where the plain reverse loop meets ``op`` and plain forward mode
    cannot run f either (``err``: what it raised) (NOTE [a plain loop through a wrong
    backward])."""
    how = _how(op)
    return JacobianCallError(
        f"{call}: torch.func cannot run f ({name}), so strategy='auto' computes with plain "
        f"autograd, and torch's backward formula of {op} is wrong {how}, which f computes "
        f"from its differentiated inputs, so reverse mode's Jacobian would be wrong; "
        f"forward mode, whose formula is right, cannot run f either.\n"
        f"  Forward mode said: {quote_error(err)}\n"
        f"  Fix: let forward mode run f (a custom torch.autograd.Function: a jvp "
        f"staticmethod), then strategy='fwd-loop'; or write f without {op}."
    )

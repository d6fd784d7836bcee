"""``J t`` by reverse over reverse, for :func:`torch_vjp.jvp` through an operator whose
forward-mode formula torch has wrong.

NOTE [J t by reverse over reverse]
Where f's graph holds an operator of :data:`~torch_vjp._engine.wrongops.WRONG_FORWARD`
(NOTE [forward mode through a wrong formula] in :mod:`torch_vjp._engine.fwd_wrong`),
forward mode's ``J t`` is wrong, and torch_vjp.jvp refused it, although the caller asked for
a product that reverse mode can give: the pullback ``u -> u^T J`` is linear in ``u``, and
its own vjp at any ``u`` with cotangent ``t`` is ``J t``. So torch_vjp.jvp computes it that
way there: one forward call of f inside ``torch.func.vjp`` (the output is f's own), one
backward pass that records its graph (at ``u`` = ones: the map is linear, so the point does
not matter), and one backward pass through that graph per tangent (under ``torch.vmap`` for
batched tangents, the loop where vmap cannot run it): about twice a vjp's cost, against
about one for forward mode, with a one-time JacobianWarning that says why. torch's
backward of ``torch.linalg.det`` runs in grad mode there (its singular-safe branch: NOTE [a
backward right only in grad mode]), which the recorded backward pass is.

The tangents are what ``torch.func.jvp`` returns: each in its output's shape and dtype, with
the leading K when batched, differentiable through tensors f captures that require grad
where grad mode is on; an integer output's is zeros. It is refused, with the reason, where
reverse over reverse cannot be right either:

* f's graph also holds an operator whose backward formula torch has wrong (NOTE [named
  reverse strategies and wrong formulas] in :mod:`torch_vjp._engine.wrongops`);
* a floating output of f does not require grad but carries a tangent in forward mode
  (computed under ``torch.no_grad()`` inside f): reverse mode cannot tell its tangent from
  zeros (a constant output, which carries none, has zeros: NOTE [a constant output]);
* a backward in f's graph cannot be differentiated (a custom ``autograd.Function`` with
  ``@once_differentiable``, or whose backward leaves autograd): under torch.func its
  products with ``u`` record no graph, without an error, and reverse over reverse
  returned zeros through it. So the first call per function and signature (the one that
  reads f's graph) checks it by the dot-product test ``<u, J t> == <u^T J, t>`` at a
  random ``u`` and ``t`` (one backward pass and one pass through its graph more);
* torch cannot differentiate a backward formula at this point (its own error says so:
  ``scatter_reduce(reduce='prod')`` with more than one zero scattered to one position).

The batching rules of torch's backward formulas known wrong (``torch.cdist``'s) are not
trusted for the second backward pass either: batched tangents are taken one at a time
there.

NOTE [J t by reverse over reverse in inference mode]
Under ``torch.inference_mode()`` the reading of f's graph was skipped (as if nothing were
recorded there), and ``J t`` through ``torch.linalg.det`` at a singular matrix came back
from forward mode, zeros where it is 11.7, without a word. ``torch.func.vjp`` records f's
graph in that mode all the same, so it is read there too; but torch's backward of det runs
its singular-safe branch only outside it (the pullback in inference mode gave zeros too),
so ``J t`` by reverse over reverse runs outside inference mode, without grad mode, on normal
copies of the primals and tangents that are inference tensors: normal tensors that require
no grad come back, as from the other products in that mode.

NOTE [J t by reverse over reverse, traced]
Inside the user's ``torch.compile`` the public functions return their plain form, the
torch.func composition dynamo traces into one graph (NOTE [compiled Jacobians]); for jvp,
``torch.func.jvp``. Through ``torch.linalg.det`` at a singular matrix (or the other
operators of NOTE [forward mode through a wrong formula]) that was wrong without a word
(``J t`` = 0 where it is 11.7), since the eager path's reading of f's graph does not run
there. So the forward-mode products run under
:class:`~torch_vjp._engine.fwd_wrong._WrongCalls`, the torch function mode that reads each
call f makes for an operator of that list run on a tangent (dynamo traces the mode: the
answer is known when the program is traced, and no graph break is made); where it found
one, ``J t`` is computed by reverse over reverse in the same graph (NOTE [J t by reverse
over reverse]: the vjp of the pullback ``u -> u^T J`` at ``u`` = ones, at the tangents),
and the forward-mode products, unused, are left out of the program by the compiler. The
output, and the aux, are the reverse call's (f's own, as the forward call's). An output that
does not require grad in the reverse call (computed from no primal, or under
``torch.no_grad()`` inside f) keeps its forward-mode tangent (zeros for a constant), as
torch.func.jvp gives it; an integer output's is zeros. The eager path's refusals (a wrong
backward formula in f too, a backward that records no graph) read f's graph, which a trace
cannot: they are not made here. Through ``scatter_reduce(reduce='prod')`` torch's compiler
cannot trace reverse over reverse (its double backward fails in AOT tracing, a raw
BackendCompilerFailed), so jvp refuses there with the reason (:func:`untraceable`), where it
returned forward mode's wrong ``J t``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable
from typing import Any

import torch
import torch.autograd.forward_ad as fwAD
from torch import Tensor
from torch.utils._pytree import tree_flatten, tree_leaves, tree_unflatten

from torch_vjp._engine.context import func_jvp, func_vjp, is_nested
from torch_vjp._engine.forms import plain_jvp
from torch_vjp._engine.fwd_wrong import _DET, _HOW, _INSTEAD, _WrongCalls, traced_name
from torch_vjp._engine.fwdcheck import least_of, tolerance
from torch_vjp._engine.gradmode import in_grad_mode
from torch_vjp._engine.wrongops import WRONG_FORWARD, _how, reading_wrong_ops
from torch_vjp._errors import JacobianCallError, JacobianWarning, quote_error, warn_once

__all__ = ["compiled_forward_why", "pushforward_by_reverse", "traced_jvp", "untraceable"]

#: Ops whose forward-mode formula is wrong at some points only: J t is computed by reverse
#: over reverse at every point, and the warning says why.
_EVERY_POINT = {_DET: (" (det's is wrong at singular matrices only, but whether a matrix "
                       "is singular, to rounding, is a property of the point, so J t is "
                       "computed this way at every point)")}


#: torch's words where a backward formula has no derivative of its own (at this point).
_NOT_TWICE = ("Double backward is unsupported", "differentiate twice")


def _differentiable(t: Any) -> bool:
    return isinstance(t, Tensor) and (t.is_floating_point() or t.is_complex())


def pushforward_by_reverse(
    g: Callable[..., Any], leaves: tuple[Tensor, ...], has_aux: bool, call: str, name: str,
    op: str, key: Hashable, check: bool,
) -> tuple[tuple[Any, ...], Callable[..., tuple[Tensor, ...]], bool, Any]:
    """f's output and a function computing ``J t`` by reverse over reverse (NOTE [J t by
    reverse over reverse]), f (``g``, called once here) running ``op`` (whose forward-mode
    formula torch has wrong); with ``check``, checked once by a dot product.

    Returns:
        ``(res, push, one_at_a_time, spec)``: ``res`` is ``(output,)`` or ``(output,
        aux)``; ``push(*tangent)`` takes one tangent per leaf and returns one tangent per
        flat output (``spec`` their structure); ``one_at_a_time``: f's graph holds a
        backward whose batching rule torch has wrong, so batched tangents are not to run
        under torch.vmap.

    Raises:
        JacobianCallError: where reverse over reverse cannot be right either (a wrong
            backward formula, an output that does not require grad, a backward that
            cannot be differentiated).
    """
    read, found = reading_wrong_ops(g, has_aux)
    connected: list[bool] = []
    box: list[Any] = []

    def recorded(*xs: Tensor) -> Any:
        # (torch.func.vjp takes floating outputs only: the outputs that do not require grad,
        # an integer one among them, travel with the aux)
        res = read(*xs)
        flat, spec = tree_flatten(res[0] if has_aux else res)
        connected[:] = [not _differentiable(o) or o.requires_grad for o in flat]
        diff = [_differentiable(o) and o.requires_grad for o in flat]
        box[:] = [spec, diff]
        return (tuple(o for o, d in zip(flat, diff) if d),
                ([o for o, d in zip(flat, diff) if not d],) + ((res[1],) if has_aux else ()))

    diff_out, pull, extra = func_vjp(recorded, *leaves, has_aux=True)
    spec, diff = box
    given_out, rest = iter(diff_out), iter(extra[0])
    flat_out = [next(given_out) if d else next(rest) for d in diff]
    out = tree_unflatten(flat_out, spec)
    batching, alone = found[0] if found else (None, None)
    if alone is not None:
        raise both_wrong(call, op, alone, name)
    loose = [i for i, ok in enumerate(connected) if not ok]
    carried = _carried(g, leaves, has_aux) if loose else []  # NOTE [a constant output]
    for i in loose:
        if carried[i]:
            label = "output" if len(flat_out) == 1 else f"output {i} (flat)"
            raise unconnected(call, op, name, label, flat_out[i].shape)
    us = [torch.ones_like(o) for o in diff_out]

    def pulled(*u: Tensor) -> Any:
        return pull(tuple(u))

    def refused(err: RuntimeError) -> RuntimeError:
        if not any(words in str(err) for words in _NOT_TWICE):
            return err  # (a custom backward's own error, among others: as it is)
        return no_double_backward(call, op, name, err)

    try:
        pull2 = func_vjp(pulled, *us)[1] if us else None
    except RuntimeError as err:
        raise refused(err) from err

    def push(*tangent: Tensor) -> tuple[Tensor, ...]:
        try:  # (torch's double backward runs here: where it has none, it says so)
            got = iter(pull2(tuple(tangent)) if us else ())
        except RuntimeError as err:
            mine = refused(err)
            if mine is err:
                raise
            raise mine from err
        return tuple(next(got) if d else torch.zeros_like(o) for o, d in zip(flat_out, diff))

    if check and us and not is_nested():  # (an outer transform's batched values cannot
        gap = _dot_gap(pulled, push, leaves, list(diff_out))  # be read)
        if gap is not None:
            raise not_twice(call, op, name, *gap)
    warn_once(("jvp by reverse over reverse", key), slower_message(call, op, name),
              JacobianWarning)
    return (out,) + tuple(extra[1:]), push, batching is not None, spec


# NOTE [a constant output]
# A floating output of f that does not require grad in reverse mode is either a constant
# (``torch.ones(3)``, computed from no primal: its tangent is zeros, as torch.func.jvp gives
# it) or computed from the primals where reverse mode does not see it (under
# ``torch.no_grad()`` or ``.detach()`` inside f), where forward mode carries a tangent that
# reverse mode cannot tell from zeros. jvp refused both; the two are told apart by one
# forward-mode call of f (on copies of the primals, the random generators forked), which
# reads whether each output carries a tangent: only where one that does not require grad
# carries one is J t refused, and a constant's is zeros. f is called once more only where
# such an output is returned, which was refused before.


def _carried(g: Callable[..., Any], leaves: tuple[Tensor, ...], has_aux: bool) -> list[bool]:
    """Whether each flat output of ``g`` carries a tangent in forward mode (NOTE [a
    constant output])."""
    carries: list[bool] = []

    def read(*xs: Tensor) -> Any:
        res = g(*xs)
        carries[:] = [isinstance(o, Tensor) and fwAD.unpack_dual(o).tangent is not None
                      for o in tree_leaves(res[0] if has_aux else res)]
        return res

    xs = tuple(x.detach().clone() for x in leaves)
    cuda = sorted({x.device.index or 0 for x in leaves if x.device.type == "cuda"})
    with torch.random.fork_rng(devices=cuda):
        func_jvp(read, xs, tuple(torch.ones_like(x) for x in xs), has_aux=has_aux)
    return carries


def _dot_gap(pulled: Callable[..., Any], push: Callable[..., Any],
             leaves: tuple[Tensor, ...], outs: list[Tensor]) -> tuple[float, float] | None:
    """``(difference, scale)`` of the dot-product test ``<u, J t> == <u^T J, t>`` at a random
    ``u`` and ``t`` (a generator of their own), ``J t`` by reverse over reverse and ``u^T J``
    by the pullback it differentiates, where they disagree beyond rounding (a backward
    that records no graph makes ``J t`` zeros); None where they agree, or hold no finite
    number to compare."""
    gen = torch.Generator().manual_seed(20261129)

    def draw(x: Tensor) -> Tensor:
        wide = torch.complex128 if x.is_complex() else torch.float64
        return torch.randn(x.shape, dtype=wide, generator=gen).to(x.dtype).to(x.device)

    ts, us = [draw(x) for x in leaves], [draw(o) for o in outs]
    jt = [j for j, o in zip(push(*ts), outs) if _differentiable(j)]
    vj = in_grad_mode(pulled, *us)  # (det's backward: its branch right at singular ones)

    def dot(a: list[Tensor], b: list[Tensor]) -> tuple[float, float]:
        a, b = [x.detach() for x in a], [y.detach() for y in b]  # (numbers read, no graph)
        terms = [torch.vdot(x.reshape(-1).to(torch.complex128),
                            y.reshape(-1).to(torch.complex128)) for x, y in zip(a, b)]
        return (float(sum(terms).real) if terms else 0.0,
                sum(float(x.abs().sum() * y.abs().max()) for x, y in zip(a, b)))

    (one, s1), (two, s2) = dot(us, jt), dot(list(vj), ts)
    scale = max(s1, s2)
    if not math.isfinite(one) or not math.isfinite(two) or not math.isfinite(scale):
        return None
    least = least_of([o.dtype for o in outs] + [x.dtype for x in leaves])
    if abs(one - two) <= tolerance(least or torch.float64) * max(scale, 1e-300):
        return None
    return abs(one - two), scale


def slower_message(call: str, op: str, name: str) -> str:
    """The one-time warning that ``J t`` was computed by reverse over reverse (NOTE [J t by
    reverse over reverse])."""
    return (
        f"{call}: torch's forward-mode formula of {op} is wrong {_HOW[op]}, which f ({name}) "
        f"computes from the primals, so J t was computed by reverse over reverse instead "
        f"(the vjp of the pullback u -> u^T J, which is linear in u, at the tangents), "
        f"which is right there: about twice a vjp's cost, where forward mode costs about "
        f"one{_EVERY_POINT.get(op, '')}.\n"
        f"  Nothing to fix; where v^T J suffices, torch_vjp.vjp costs one backward pass"
        f"{_INSTEAD.get(op, '')}. This warning is shown once per function."
    )


def compiled_forward_why(op: str) -> str:
    """Why ``torch_vjp.jvp(compile=True)`` keeps a signature eager where ``J t`` was computed
    by reverse over reverse: its compiled program computes with forward mode."""
    return (f"torch's forward-mode formula of {op} is wrong {_HOW[op]}, so J t is computed "
            f"by reverse over reverse, eagerly; the compiled program computes with forward "
            f"mode")


def both_wrong(call: str, op: str, rev_op: str, name: str) -> JacobianCallError:
    """The refusal of ``J t`` where f runs ``op`` (a wrong forward-mode formula) and
    ``rev_op`` (a wrong backward formula): neither mode is right."""
    return JacobianCallError(
        f"{call}: torch's forward-mode formula of {op} is wrong {_HOW[op]}, and J t is "
        f"then computed by reverse over reverse, but f ({name}) also runs {rev_op}, whose "
        f"backward formula torch has wrong {_how(rev_op)}, so J t would be wrong either way "
        f"(torch.func.jvp's and torch.func.jacrev's too).\n"
        f"  Fix: compute one of the two operators another way in f (for {rev_op}, indices "
        f"or sizes where its backward is right){_INSTEAD.get(op, '')}."
    )


def unconnected(call: str, op: str, name: str, label: str, shape: Any) -> JacobianCallError:
    """The refusal of ``J t`` by reverse over reverse where an output of f does not require
    grad."""
    return JacobianCallError(
        f"{call}: torch's forward-mode formula of {op} is wrong {_HOW[op]}, so J t is "
        f"computed by reverse over reverse, but f's ({name}) {label} (shape "
        f"{tuple(shape)}) does not require grad: it was computed from no primal, or under "
        f"torch.no_grad() or .detach() inside f, and reverse mode cannot tell its tangent "
        f"(which forward mode may carry) from zeros.\n"
        f"  Fix: return that tensor as aux (has_aux=True) if it does not depend on the "
        f"primals, or compute it with grad mode on."
    )


def not_twice(call: str, op: str, name: str, diff: float, scale: float) -> JacobianCallError:
    """The refusal of ``J t`` by reverse over reverse where a backward in f's graph cannot
    be differentiated."""
    return JacobianCallError(
        f"{call}: torch's forward-mode formula of {op} is wrong {_HOW[op]}, so J t is "
        f"computed by reverse over reverse, which differentiates f's backward pass, and it "
        f"disagrees with that backward pass (the dot-product test <u, J t> = <u^T J, t> "
        f"at random u and t is off by {diff:.3g}, at a scale of {scale:.3g}): a backward in "
        f"f ({name}) records no graph (a custom autograd.Function with "
        f"@once_differentiable, or one whose backward leaves autograd), so J t would be "
        f"wrong there.\n"
        f"  Fix: make that backward differentiable (drop @once_differentiable, compute it "
        f"with torch operators), or give the Function a jvp staticmethod and compute "
        f"{op} another way in f{_INSTEAD.get(op, '')}."
    )


def no_double_backward(call: str, op: str, name: str, err: BaseException
                       ) -> JacobianCallError:
    """The refusal of ``J t`` by reverse over reverse where torch cannot differentiate a
    backward formula in f's graph (``err``, torch's error, quoted)."""
    return JacobianCallError(
        f"{call}: torch's forward-mode formula of {op} is wrong {_HOW[op]}, so J t is "
        f"computed by reverse over reverse, which differentiates f's backward pass, and "
        f"torch cannot differentiate a backward formula in f ({name}) at this point, so "
        f"neither mode can compute J t here.\n"
        f"  torch said: {quote_error(err)}\n"
        f"  Fix: compute {op} another way in f{_INSTEAD.get(op, '')}, or take J t from "
        f"finite differences at this point."
    )


#: The ops whose reverse over reverse torch (2.13) cannot compile: the AOT tracing of
#: scatter_reduce(reduce='prod')'s double backward fails ("Cannot access storage of
#: TensorWrapper"), under aot_eager and inductor alike.
_UNTRACEABLE = {WRONG_FORWARD["ScatterReduceBackward0"]}


def traced_jvp(f: Callable[..., Any], primals: tuple[Any, ...], tangents: tuple[Any, ...],
               has_aux: bool, batched: bool, chunk_size: int | None, strict: bool
               ) -> tuple[Any, ...]:
    """jvp's plain form (:func:`~torch_vjp._engine.forms.plain_jvp`), with ``J t`` by
    reverse over reverse where f runs an operator whose forward-mode formula torch has
    wrong on a tangent (NOTE [J t by reverse over reverse, traced])."""
    found: list[str | None] = []
    with _WrongCalls(found):
        res = plain_jvp(f, primals, tangents, has_aux, batched, chunk_size, strict)
    if not (found and found[0]):
        return res
    if found[0] in _UNTRACEABLE:
        raise untraceable(found[0], traced_name(f))
    return _by_reverse(f, primals, tangents, has_aux, batched, chunk_size, res[1])


def _by_reverse(f: Callable[..., Any], primals: tuple[Any, ...], tangents: tuple[Any, ...],
                has_aux: bool, batched: bool, chunk_size: int | None, forward_tangents: Any
                ) -> tuple[Any, ...]:
    connected: list[bool] = []
    box: list[Any] = []

    def recorded(*xs: Any) -> Any:
        # (torch.func.vjp takes floating outputs, and tensors as aux, only: the other
        # outputs and the aux's tensors travel as its aux, the rest of both here)
        res = f(*xs)
        flat, spec = tree_flatten(res[0] if has_aux else res)
        flat_aux, aux_spec = tree_flatten(res[1] if has_aux else None)
        connected[:] = [_differentiable(o) and o.requires_grad for o in flat]
        kept = [o for o, c in zip(flat, connected) if not c] + flat_aux
        box[:] = [spec, aux_spec, [isinstance(o, Tensor) for o in kept], kept]
        return (tuple(o for o, c in zip(flat, connected) if c),
                [o for o in kept if isinstance(o, Tensor)])

    diff_out, pull, tensors = func_vjp(recorded, *primals, has_aux=True)
    spec, aux_spec, is_tensor, kept = box
    given_t = iter(tensors)
    kept = [next(given_t) if t else o for o, t in zip(kept, is_tensor)]
    given_out, given_kept = iter(diff_out), iter(kept)
    out = tree_unflatten([next(given_out) if c else next(given_kept) for c in connected], spec)
    after = (tree_unflatten(list(given_kept), aux_spec),) if has_aux else ()
    flat_fwd = tree_leaves(forward_tangents)
    if not diff_out:  # (no output reverse mode reaches: forward mode's tangents, as they are)
        return (out, forward_tangents) + after

    def pulled(*u: Tensor) -> Any:
        return pull(tuple(u))

    _, pull2 = func_vjp(pulled, *(torch.ones_like(o) for o in diff_out))

    def push(*tangent: Any) -> tuple[Tensor, ...]:
        return pull2(tuple(tangent))

    if batched:
        got = torch.func.vmap(push, chunk_size=chunk_size)(*tangents)
    else:
        got = push(*tangents)
    given = iter(got)
    tan = [next(given) if c else fwd for c, fwd in zip(connected, flat_fwd)]
    return (out, tree_unflatten(tan, spec)) + after


def untraceable(op: str, name: str) -> JacobianCallError:
    """The refusal of ``J t`` inside the user's ``torch.compile`` through ``op``, whose
    forward-mode formula torch has wrong and whose reverse over reverse torch cannot
    compile (NOTE [J t by reverse over reverse, traced])."""
    return JacobianCallError(
        f"torch_vjp.jvp: torch's forward-mode formula of {op} is wrong {_HOW[op]}, which f "
        f"({name}) computes from the primals, so J t is computed by reverse over reverse "
        f"there; but this call runs inside torch.compile, whose compiler cannot trace the "
        f"double backward of {op} (torch 2.13's AOT tracing fails on it), so J t cannot be "
        f"computed inside the compiled function.\n"
        f"  Fix: call torch_vjp.jvp outside the compiled function, or inside it through "
        f"torch.compiler.disable (a graph break: not with fullgraph=True); "
        f"torch_vjp.jvp(..., compile=True) at top level computes it eagerly."
    )

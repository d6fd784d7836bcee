"""The reverse product of "auto"'s check (:mod:`torch_vjp._engine.fwdcheck`), checked in
turn against one forward product.

NOTE [a reverse product checked forward]
NOTE [auto, checked once] takes one reverse product without vmap as the reference a route
must agree with. It runs torch's backward formulas, and a few of those are wrong even
without vmap: in torch 2.13, ``torch.as_strided_scatter``'s passes the gradient of ``self``
inside the scattered region rather than outside it (errors of the size of the Jacobian's
entries). Reverse mode under vmap runs the same formula, so the check found the two in
agreement and "auto" returned a wrong Jacobian without a word (and where forward mode was
checked, it took forward mode for the wrong one). So the check also takes one forward
product without vmap (``torch.func.jvp``: the forward-mode formulas, others) along a random
direction ``v``, with the reverse product's cotangent ``u``, and compares the one scalar
``u^T J v`` both ways: ``u . (J v)`` and ``(u^T J) . v``. It does so where the route checked
is a reverse one (one more call of f, in forward mode, on the first call per key), and where
forward mode's route disagreed with the reverse product (before it is replaced). Within
rounding (``sqrt(eps)`` of the sums of the products' terms' magnitudes, or of the numbers
the reverse product was computed from where those cancel: NOTE [the scale of what is
compared] in :mod:`torch_vjp._engine.fwdnoise`) they agree, and nothing changes. Where they
do not, a central difference of ``t -> u . f(x + t v)``, in float64 where f computes in it
(else in the leaves' dtype, with a step of ``cbrt(eps)``), breaks the tie: where it is
closer to the forward value by a tenth of the disagreement, and the reverse products scale
exactly with their cotangent (as backward formulas' do; a hook that clips the gradient does
not, and its products are f's own choice: NOTE [auto, checked once] warns of them as
before), the backward formula is the wrong one. "auto" then returns the Jacobian by forward
mode: vectorised, or one product at a time where vmap cannot run f there
(``as_strided_scatter`` has no batching rule), the first whose ``u^T J v`` agrees with the
forward product, with a one-time warning, and remembers that route for the function and
input signature. Where the difference sides with reverse mode (a wrong forward formula:
torch.triangular_solve's), or with neither (f is not smooth at x, or draws anew), NOTE
[auto, checked once] decides as before. f's calls here start from the generators' state the
products started from (NOTE [auto's extra calls draw what the products draw]): a random f
draws what its products drew. Where the modes agree at a point x with structure (zeros, a
value repeated, a sum of 0), the comparison runs once more at a point near x, and the reverse product under vmap beside it, where a coincidence of x
(zeros, a sum of 0) could hide a wrong formula (NOTE [auto, checked near the point] in
:mod:`torch_vjp._engine.nearcheck`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Sequence

import torch
from torch import Tensor
from torch.utils._pytree import tree_flatten

from torch_vjp._engine.blocks import Blocks, cotangent_products
from torch_vjp._engine.context import func_jvp
from torch_vjp._engine.fwdnoise import _homogeneous
from torch_vjp._engine.fwdwords import wrong_reverse_message
from torch_vjp._engine.nearcheck import (
    batched_gap, near_sides, stops_the_call, structured, wrong_batching_message,
)
from torch_vjp._engine.problem import Problem
from torch_vjp._engine.rows import passes_through, routes_that_run
from torch_vjp._engine.wrongops import wrong_ops
from torch_vjp._errors import JacobianWarning, warn_once

__all__ = ["Agree", "ReverseWrong", "alone", "central_difference", "forward_route",
           "reverse_wrong"]


# NOTE [a reverse product checked forward, on every rank alike]
# With a process group (NOTE [a sharded reverse product checked forward] in
# torch_vjp._sharded_forward) every rank runs this check on the same x, u and v, and an f
# that runs a collective pairs its calls with the other ranks'. But each rank decides each
# step from its own numbers: one whose f takes a path of its own (a wrong backward formula on
# that rank's graph only), whose rounding falls the other side of a bound, or whose call of f
# fails in float64 alone, returned early, or tried f again in its own dtype, while the others
# called f again: they waited for ever in f's collective, or paired it with the exchange that
# followed. So every step that decides whether f is called again asks ``agree(flag, err)``:
# whether ``flag`` holds on some rank (one all_reduce), every rank then going the way that
# answer says, and where some rank's step raised an error no check may hide (out of memory,
# torch_vjp's own), every rank raises (that rank its own error, the others one naming it).
# The step that says whether the check can run at all (a forward product taken, finite) goes
# on only where it did on every rank; the steps that find the reverse product wrong go on
# where some rank's numbers do, every rank then calling f alike (a rank whose own numbers
# agree computes the step too, to pair its calls), and ``ReverseWrong.mine`` says whether
# this rank's own numbers found it. On one process ``alone`` is the hook: ``flag`` itself,
# the error raised, and the check is what it was.


def alone(flag: bool, err: BaseException | None = None) -> bool:
    """The ``agree`` hook of one process (NOTE [a reverse product checked forward, on every
    rank alike]): ``flag``; ``err`` is raised."""
    if err is not None:
        raise err
    return flag


#: ``agree(flag, err)``: whether ``flag`` holds on some rank; raises on every rank where
#: some rank's ``err`` is not None.
Agree = Callable[[bool, BaseException | None], bool]


def _everywhere(agree: Agree, flag: bool, err: BaseException | None = None) -> bool:
    """Whether ``flag`` holds on every rank (through ``agree``)."""
    return not agree(not flag, err)


class ReverseWrong:
    """The reverse product found wrong: the direction ``vs`` (one per leaf), ``u^T J v`` by
    forward mode (``forward``), by the reverse product (``reverse``), by a central
    difference (``difference``), the rounding scale they were compared at, and the
    operator of NOTE [named reverse strategies and wrong formulas] (in
    :mod:`torch_vjp._engine.wrongops`) f's graph holds (``op``; None: none known)."""

    __slots__ = ("vs", "forward", "reverse", "difference", "scale", "op", "near",
                 "batching", "mine")

    def __init__(self, vs: list[Tensor], forward: float, reverse: float, difference: float,
                 scale: float, op: str | None = None) -> None:
        self.vs, self.forward, self.reverse = vs, forward, reverse
        self.difference, self.scale, self.op = difference, scale, op
        #: (NOTE [auto, checked near the point]) found near x, not at x: ``(reverse,
        #: forward, difference)`` there, for the warning (``forward`` and ``scale`` stay
        #: x's, for the routes compared at x); ``batching``: ``(difference, scale)`` of the
        #: reverse product under vmap and without it near x, where only that disagreed
        self.near: tuple[float, float, float] | None = None
        self.batching: tuple[float, float] | None = None
        #: whether this rank's own numbers found it (with a process group another rank's
        #: may have: NOTE [a reverse product checked forward, on every rank alike])
        self.mine = True


def _outputs(prob: Problem, xs: Sequence[Tensor]) -> tuple[Tensor, ...]:
    res = prob.g(*[x.clone() for x in xs])
    flat, _ = tree_flatten(res[0] if prob.has_aux else res)
    return tuple(flat)


def _dot(us: Sequence[Tensor], ws: Sequence[Tensor | None]) -> tuple[float, float]:
    """``(sum u . w, sum |u| . |w|)`` in float64 (None: zeros)."""
    value = size = torch.zeros((), dtype=torch.float64)
    for u, w in zip(us, ws):
        if w is None or u.numel() == 0:
            continue
        a, b = u.detach().double().reshape(-1).cpu(), w.detach().double().reshape(-1).cpu()
        value = value + a @ b
        size = size + a.abs() @ b.abs()
    return float(value), float(size)


def central_difference(prob: Problem, us: Sequence[Tensor], vs: Sequence[Tensor],
                       redraw: Callable[[], None], at: Sequence[Tensor] | None = None,
                       agree: Agree = alone,
                       stops: Callable[[BaseException], bool] = passes_through
                       ) -> float | None:
    """``d/dt u . f(x + t v)`` at 0 by a central difference, in float64 where f computes
    in it, else in the leaves' dtype; None where f cannot be called so. ``us`` are shaped
    like f's flat outputs, ``vs`` like ``prob.leaves``; ``redraw`` runs before each call
    of f (a random f draws what the products drew); ``at``: the point, where not the
    leaves'; ``agree``: every rank tries the leaves' dtype where float64 failed on some
    (NOTE [a reverse product checked forward, on every rank alike]); ``stops``: the errors
    that stop the call (raised, on every rank), where any other makes the result None. Also
    the sparse wing's tie-break."""
    leaves = prob.leaves if at is None else at
    vmax = max([0.0] + [float(v.abs().amax()) for v in vs if v.numel()])
    if vmax == 0.0:
        return None
    value = None
    for dtype in (torch.float64, None):
        got, stop = None, None
        try:
            with torch.no_grad():
                xs = [x.detach().to(dtype or x.dtype) for x in leaves]
                eps = torch.finfo(dtype or leaves[0].dtype).eps
                big = max([1.0] + [float(x.abs().amax()) for x in xs if x.numel()])
                h = eps ** (1 / 3) * big / vmax
                sides = []
                for t in (h, -h):
                    redraw()
                    prob.reset_primals()
                    outs = _outputs(prob, [x + t * v.to(x.dtype) for x, v in zip(xs, vs)])
                    sides.append(_dot(us, outs)[0])
            got = (sides[0] - sides[1]) / (2 * h)
        except Exception as err:  # noqa: BLE001 - f does not compute in float64: its dtype
            if stops(err):
                stop = err
        if value is None:
            value = got
        if not agree(got is None, stop):  # (no rank failed: the same number of calls)
            return value
    return value


def reverse_wrong(prob: Problem, got: tuple[list[Tensor], list[Tensor], list[Tensor]],
                  redraw: Callable[[], None], rtol: float,
                  floor: Callable[[], float], agree: Agree = alone) -> ReverseWrong | None:
    """Whether the reverse product ``got`` (:func:`~torch_vjp._engine.fwdcheck.
    one_reverse_product`) is wrong (NOTE [a reverse product checked forward]): a
    :class:`ReverseWrong` where one forward product disagrees with it and a central
    difference sides with forward mode; None where they agree, or nothing can tell.
    ``floor()``: the size of the numbers the reverse product's entries were computed from
    (NOTE [the scale of what is compared]), for a disagreement at the products' scale.
    ``agree``: the ranks' agreement on each step (NOTE [a reverse product checked forward,
    on every rank alike]); with it, a :class:`ReverseWrong` on every rank where some rank
    found one (``mine``: this one)."""
    flat, us, grads = got
    gen = torch.Generator().manual_seed(2)
    vs = [torch.randn(x.shape, generator=gen, dtype=torch.float64).to(x.dtype).to(x.device)
          for x in prob.leaves]
    tangents, stop = None, None
    try:
        redraw()
        with torch.enable_grad():
            prob.reset_primals()
            outs, tangents = func_jvp(
                lambda *xs: _outputs(prob, xs), tuple(x.detach() for x in prob.leaves),
                tuple(vs))
    except Exception as err:  # noqa: BLE001 - no forward formula: nothing to compare with
        if passes_through(err):
            stop = err
        tangents = None
    forward = reverse = scale = math.nan
    if tangents is not None and len(tangents) == len(us):
        forward, f_size = _dot(us, tangents)
        reverse, r_size = _dot(grads, vs)
        scale = max(f_size, r_size)
    if not _everywhere(agree, math.isfinite(forward) and math.isfinite(reverse), stop):
        return None
    # (the common case: they agree)
    if not agree(abs(forward - reverse) > rtol * scale, None):
        return _near_wrong(prob, got, vs, (forward, scale), redraw, rtol, agree)
    # (a Jacobian zero up to rounding: the products are their rounding, of numbers far
    # larger; each entry's, summed over v's)
    size, stop = 0.0, None
    try:
        size = floor() * sum(float(v.detach().double().abs().sum()) for v in vs)
    except Exception as err:  # noqa: BLE001 - every rank hears of it before raising
        stop = err
    scale = max(scale, size)
    if not agree(abs(forward - reverse) > rtol * scale, stop):
        return _near_wrong(prob, got, vs, (forward, scale), redraw, rtol, agree)
    mine = abs(forward - reverse) > rtol * scale
    difference = central_difference(prob, us, vs, redraw, agree=agree)
    mine = mine and difference is not None and not (
        abs(difference - forward) > 0.1 * abs(forward - reverse))
    if not agree(mine, None):
        return None
    linear, op, stop = _linear(prob, us, redraw, agree=agree)
    # (not linear: a hook that clips the gradient: f's backward is its own, no formula's)
    mine = mine and linear
    if not agree(mine, stop):
        return None
    found = ReverseWrong(vs, forward, reverse,
                         math.nan if difference is None else difference, scale, op)
    found.mine = mine
    return found


def _near_wrong(prob: Problem, got: tuple[list[Tensor], list[Tensor], list[Tensor]],
                vs: list[Tensor], at_x: tuple[float, float], redraw: Callable[[], None],
                rtol: float, agree: Agree = alone) -> ReverseWrong | None:
    """Where the modes agreed at x, the reverse product found wrong near x (NOTE [auto,
    checked near the point] in :mod:`torch_vjp._engine.nearcheck`): a :class:`ReverseWrong`
    with ``near`` set where forward mode and a central difference agree there against it,
    with ``batching`` set where only its batching under vmap disagrees; None where all
    agree, or nothing can tell (x's check stands). ``at_x``: ``u^T J v`` by forward mode
    at x, and its scale. (x is the same on every rank: so is whether it is structured.)"""
    if not structured(prob.leaves):
        return None  # (no coincidence of x to hide a wrong formula)
    try:
        return _near(prob, got, vs, at_x, redraw, rtol, agree)
    except Exception as err:  # noqa: BLE001 - at a point the caller did not pass: x's
        # check stands, but out of memory stops the call, and so does the error ``agree``
        # raised where another rank's step stopped (torch_vjp's own)
        if stops_the_call(err) or passes_through(err):
            raise
        return None


def _near(prob: Problem, got: tuple[list[Tensor], list[Tensor], list[Tensor]],
          vs: list[Tensor], at_x: tuple[float, float], redraw: Callable[[], None],
          rtol: float, agree: Agree) -> ReverseWrong | None:
    # (each step's errors at a point the caller did not pass are caught where they happen,
    # and x's check stands; out of memory stops the call, on every rank)
    _, us, grads = got
    # (every step agreed: None on every rank, or an error no check may hide on every rank)
    sides = near_sides(prob, lambda ys: _outputs(prob, ys), us, vs, redraw, agree)
    if sides is None:
        return None
    forward, f_size = _dot(us, sides.tangents)
    reverse, r_size = _dot(sides.grads, vs)
    # (a known wrong operator: its own route and words)
    mine = not sides.known and math.isfinite(forward) and math.isfinite(reverse)
    found = ReverseWrong(vs, at_x[0], _dot(grads, vs)[0], at_x[0], at_x[1])
    if agree(mine and abs(forward - reverse) > rtol * max(f_size, r_size), None):
        mine = mine and abs(forward - reverse) > rtol * max(f_size, r_size)
        difference = central_difference(prob, us, vs, redraw, at=sides.xs, agree=agree,
                                        stops=stops_the_call)
        # (not smooth there, or random: x's check stands)
        mine = mine and difference is not None and not (
            abs(difference - forward) > 0.1 * abs(forward - reverse))
        if not agree(mine, None):
            return None
        linear, found.op, stop = _linear(prob, us, redraw, at=sides.xs, agree=agree)
        mine = mine and linear
        if not agree(mine, stop if stop is not None and stops_the_call(stop) else None):
            return None
        found.near = (reverse, forward, math.nan if difference is None else difference)
        found.mine = mine
        return found
    diff, scale = batched_gap(sides)
    mine = mine and not diff <= rtol * scale
    if agree(mine, None):
        found.batching = (diff, scale)
        found.mine = mine
        return found
    return None


def _linear(prob: Problem, us: Sequence[Tensor], redraw: Callable[[], None],
            at: Sequence[Tensor] | None = None, agree: Agree = alone
            ) -> tuple[bool, str | None, BaseException | None]:
    """Whether f's reverse products scale exactly with their cotangent (``us``), as those of
    backward formulas do (:func:`~torch_vjp._engine.fwdnoise._homogeneous`); not where a
    hook clips or adds to the gradient, whose products differ from forward mode's by
    design. With it, the operator with a known wrong backward that the graph of this call
    holds (:func:`~torch_vjp._engine.wrongops.wrong_ops`; None: none), for the warning's
    words, and the error no check may hide that stopped it (None: none), for the caller's
    ``agree``. ``at``: the point, where not the leaves'; ``agree``: each product on every
    rank or none (:func:`~torch_vjp._engine.fwdnoise._homogeneous`), and the products
    tried on every rank or none: where f's call failed on some rank, or gave it nothing to
    differentiate, every rank gives up alike (that rank alone had returned, and the others
    waited in the products' agreements, or paired them with the exchange that followed:
    NOTE [a reverse product checked forward, on every rank alike])."""
    with torch.enable_grad():
        called, stop = None, None
        try:
            redraw()
            prob.reset_primals()
            xs = [x.detach().requires_grad_(True) for x in (prob.leaves if at is None else at)]
            live = [(o, u) for o, u in zip(_outputs(prob, xs), us) if o.requires_grad]
            called = (xs, live, wrong_ops([o for o, _ in live])[1]) if live else None
        except Exception as err:  # noqa: BLE001 - plain autograd cannot run f: nothing to tell
            stop = err if passes_through(err) else None
        if agree(called is None, None):  # (the caller's agree raises ``stop``, where any)
            return False, None, stop
        assert called is not None
        xs, live, op = called

        def product(cs: Sequence[Tensor]) -> Sequence[Tensor | None]:
            return torch.autograd.grad([o for o, _ in live], xs, list(cs),
                                       retain_graph=True, allow_unused=True)

        try:
            return _homogeneous(product, [u for _, u in live], None, agree,
                                passes_through), op, None
        except Exception as err:  # noqa: BLE001 - the caller's agree decides, every rank alike
            return False, None, err if passes_through(err) else None


def forward_route(
    prob: Problem, first: str, res: Blocks, batch: int | None, got_us: Sequence[Tensor],
    wrong: ReverseWrong, route: Callable[[str], Blocks], keep: Callable[[str], None],
    named: tuple[Hashable, str], rtol: float,
) -> Blocks | None:
    """The Jacobian by forward mode where the reverse product is wrong (NOTE [a reverse
    product checked forward]): ``res`` where its route ``first`` is forward mode and it
    agrees with the forward product; else the first of ``route("fwd")`` and
    ``route("fwd-loop")`` that agrees, with a one-time warning naming f; None where none
    does (the caller decides as before). ``keep`` remembers the route taken."""
    def agrees(blocks: Blocks) -> bool:
        products = cotangent_products(prob.leaves, blocks, batch, got_us)
        if products is None:
            return False
        value, size = _dot(products, wrong.vs)
        return abs(value - wrong.forward) <= rtol * max(size, wrong.scale)

    if wrong.batching is not None:  # (NOTE [auto, checked near the point])
        if first != "rev":
            return None  # (no rows under vmap: the route stands)
        for name, alt in routes_that_run(route, ("rev-loop",)):
            if not agrees(alt):
                continue
            keep(name)
            warn_once((prob.call, named[0], first, "batched wrongly near x"),
                      wrong_batching_message(prob.call, named[1], *wrong.batching),
                      JacobianWarning)
            return alt
        return None
    if first == "fwd":
        if agrees(res):
            keep("fwd")
            return res
        return None
    reverse, forward, difference = wrong.near or (wrong.reverse, wrong.forward,
                                                  wrong.difference)
    for name, alt in routes_that_run(route, ("fwd", "fwd-loop")):
        if not agrees(alt):
            continue
        keep(name)
        words = wrong_reverse_message(prob.call, named[1], first, name, reverse, forward,
                                      difference, op=wrong.op)
        if wrong.near is not None:
            words += (" (The numbers are at a point near x: at x itself the two modes "
                      "agreed, a coincidence of that point.)")
        warn_once((prob.call, named[0], first, "reverse wrong"), words, JacobianWarning)
        return alt
    return None


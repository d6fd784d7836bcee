"""The plain forms of torch_vjp's calls: the torch.func composition of each call's strategy
(``jacrev``/``jacfwd`` and ``vmap``), which dynamo traces into one graph. ``compile=True``
compiles them, and inside the user's own ``torch.compile`` the public functions return them
directly (see NOTE [compiled Jacobians] in :mod:`torch_vjp._engine.compiled`).

They call torch.func's transforms as this module bound them at import, so that code which
replaces ``torch.func.jacrev`` and the like by wrappers of torch_vjp's (a test harness
swapping them) does not send torch_vjp back into itself.

NOTE [a basis inductor fuses]
A Jacobian's products run on the standard basis. torch.func builds it by zero-filling an
N x N buffer and writing its diagonal, which inductor keeps as a buffer of its own: every
compiled call writes N x N numbers and reads them back, beside the Jacobian it writes.
:func:`~torch_vjp._engine.rows.basis_rows`, while dynamo traces it, writes the same basis as
a comparison of two ranges, a pointwise expression that inductor computes inside the kernel
that reads it (eagerly it zero-fills and writes the diagonal), so the compiled program
allocates and writes only the Jacobian (4096 x 4096 elementwise: one 64 MB buffer, not
two). :func:`plain_jacobian` is torch.func's ``jacrev``/``jacfwd`` on that basis, with their
result structure.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.func import jacfwd, jacrev, vjp, vmap
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from torch_vjp._engine.context import FORWARD_AD, NO_CONTEXT
from torch_vjp._engine.context import func_jvp as jvp
from torch_vjp._engine.fwd_wrong import _grad_mode_call, _WrongCalls, named_forward, traced_name
from torch_vjp._engine.gradmode import in_grad_mode
from torch_vjp._engine.fwdcheck import tolerance
from torch_vjp._engine.problem import normalize_argnums
from torch_vjp._engine.rows import basis_rows, passes_through
from torch_vjp._strategies import Strategy, choose_compiled_mode, choose_mode

__all__ = [
    "auto_mode", "batch_mode", "plain_jacobian", "plain_batch_jacobian", "plain_hessian",
    "plain_jvp", "output_of", "forward_mode_agrees", "plain_chunk", "plain_context",
    "in_plain_context",
]


def _numel(tree: Any) -> int:
    return sum(t.numel() for t in tree_flatten(tree)[0] if isinstance(t, Tensor))


def _basis(leaves: list[Tensor]) -> tuple[Tensor, ...]:
    """All rows of the standard basis over ``leaves`` together: ``(N, *leaf.shape)`` each."""
    return basis_rows([x.shape for x in leaves], [x.dtype for x in leaves],
                      [x.device for x in leaves])(0, sum(x.numel() for x in leaves))


def _copies(args: Any) -> Any:
    """Detached copies of the tensors in ``args``, for calls of ``f`` the caller never sees."""
    return tree_map(lambda t: t.detach().clone() if isinstance(t, Tensor) else t, args)


def output_of(f: Callable[..., Any], args: tuple[Any, ...], has_aux: bool) -> Any:
    """``f``'s output (without aux), from a call on copies of the tensors in ``args``, so
    that a function that changes its arguments in place leaves the caller's as they are."""
    args = _copies(args)
    with torch.no_grad():
        res = f(*args)
    return res[0] if has_aux else res


def auto_mode(
    f: Callable[..., Any], primals: tuple[Any, ...], argnums: int | tuple[int, ...],
    has_aux: bool,
) -> str:
    """``"rev"`` or ``"fwd"`` for a compiled Jacobian, by the numbers of output and input
    elements (one call of ``f`` for the output sizes; NOTE [auto crossover]). Where the
    output's floating dtypes are not the inputs' (a float32 ``f`` under autocast returns
    bfloat16), the two modes' Jacobians differ in dtype (the output's in forward mode, the
    input's in reverse mode): then the mode of the eager "auto" call, whose result the
    compiled one must equal (its crossover leans to reverse mode; at 8 -> 8 under
    autocast the compiled call took forward mode, returned bfloat16 against the eager
    call's float32, and fell back to eager with "different dtypes")."""
    nums = (argnums,) if isinstance(argnums, int) else argnums
    n_in = sum(_numel(primals[i]) for i in nums)
    out = output_of(f, primals, has_aux)
    n_out = _numel(out)
    mode = choose_compiled_mode(n_in, n_out)
    dtypes = {t.dtype for t in tree_flatten(out)[0] if isinstance(t, Tensor)}
    ins = {t.dtype for i in nums for t in tree_flatten(primals[i])[0] if isinstance(t, Tensor)}
    return mode if dtypes <= ins else choose_mode(n_in, n_out)


def forward_mode_agrees(
    f: Callable[..., Any], primals: tuple[Any, ...], argnums: int | tuple[int, ...],
    has_aux: bool,
) -> bool:
    """Whether one forward-mode product of ``f`` runs (on copies of ``primals``) and agrees
    with one reverse-mode product (the dot-product test ``<u, J v> == <J^T u, v>`` on random
    ``u`` and ``v``): ``"auto"`` compiles reverse mode instead where an operation has no
    forward-mode formula, or a wrong one, as the eager ``"auto"`` turns to it (NOTE [auto
    fallback] in :mod:`torch_vjp._engine.jacobian`, NOTE [auto, checked once] in
    :mod:`torch_vjp._engine.fwdcheck`). Run after the eager call, which ran ``f`` itself.

    Example:
        >>> forward_mode_agrees(torch.sin, (torch.zeros(2),), 0, False)
        True
        >>> forward_mode_agrees(lambda u: torch.cdist(u[None], u[None] + 1), (torch.ones(2),),
        ...                     0, False)
        False
        >>> A = torch.tensor([[2.0, 1.0], [0.0, 3.0]])
        >>> forward_mode_agrees(lambda a: torch.triangular_solve(torch.ones(2, 3), a)[0],
        ...                     (A,), 0, False)
        False
    """
    args = _copies(primals)
    nums = (argnums,) if isinstance(argnums, int) else argnums
    nums = tuple(i % len(args) for i in nums)

    def g(*xs: Any) -> Any:
        full = list(args)
        for i, v in zip(nums, xs):
            full[i] = v
        res = f(*full)
        return res[0] if has_aux else res

    diff = tuple(args[i] for i in nums)
    if any(t.is_complex() for t in tree_flatten(diff)[0] if isinstance(t, Tensor)):
        return True  # (the check is for real tensors; complex ones keep forward mode)
    gen = torch.Generator().manual_seed(0)

    def draw(t: Tensor) -> Tensor:
        return torch.randn(t.shape, generator=gen, dtype=torch.float64).to(t.dtype).to(t.device)

    v = tree_map(draw, diff)
    found: list[str | None] = []
    try:
        with _WrongCalls(found):  # NOTE [forward mode through a wrong formula, traced]
            _, jv = jvp(g, diff, v)
    except Exception as err:  # noqa: BLE001 - forward mode refused (the eager call ran f)
        if passes_through(err):
            raise
        return False
    if found and found[0]:
        return False
    out, pullback = vjp(g, *diff)  # (a random f disagrees with itself: reverse mode, then)
    flat_out = tree_flatten(out)[0]
    if any(o.is_complex() for o in flat_out):
        return True
    u = tree_map(draw, out)
    jtu = pullback(u)
    with torch.no_grad():
        lhs = sum((a.double() * b.double()).sum() for a, b in
                  zip(tree_flatten(u)[0], tree_flatten(jv)[0]))
        rhs = sum((a.double() * b.double()).sum() for a, b in
                  zip(tree_flatten(jtu)[0], tree_flatten(v)[0]))
        scale = (_norm(u) * _norm(jv) + _norm(jtu) * _norm(v))
        dtype = flat_out[0].dtype if flat_out else torch.float64
        return bool(abs(float(lhs - rhs)) <= tolerance(dtype) * float(scale))


def _norm(tree: Any) -> Tensor:
    leaves = [t.double().pow(2).sum() for t in tree_flatten(tree)[0] if isinstance(t, Tensor)]
    return torch.stack(leaves).sum().sqrt() if leaves else torch.zeros((), dtype=torch.float64)


def plain_jacobian(
    f: Callable[..., Any], primals: tuple[Any, ...], argnums: int | tuple[int, ...],
    has_aux: bool, mode: str | None, chunk_size: int | None, out: Tensor | None = None,
    call: str = "torch_vjp.jacobian", single_unbatched: bool = False,
) -> Any:
    """``jacrev`` or ``jacfwd`` of ``f`` at ``primals`` (``mode=None``: by size), in their
    result structure, on :func:`~torch_vjp._engine.rows.basis_rows`' basis (NOTE [a basis inductor
    fuses]).

    ``argnums`` is checked as the eager path checks it (a JacobianCallError naming ``call``).
    ``out``: where the Jacobian is one tensor (one output, one differentiated tensor), a
    buffer of its shape and dtype to write it into (and return), so that the caller decides
    how the result's memory is allocated (:func:`torch_vjp._engine.memory.new_buffer`).
    """
    nums = normalize_argnums(argnums, len(primals), call=call)
    named = mode
    if mode is None:
        mode = auto_mode(f, primals, argnums, has_aux)
    leaves, spec = tree_flatten(tuple(primals[i] for i in nums))

    def g(*xs: Tensor) -> Any:
        full = list(primals)
        for i, v in zip(nums, tree_unflatten(list(xs), spec)):
            full[i] = v
        return f(*full)

    if mode == "rev":
        det: list[str | None] = []  # NOTE [reverse mode through det, traced]
        with _reading(det, not torch.is_grad_enabled(), _grad_mode_call):
            res = vjp(g, *leaves, has_aux=has_aux)
        outs, out_spec = tree_flatten(res[0])
        if not outs or not all(o.numel() for o in outs):
            return jacrev(f, argnums, has_aux=has_aux, chunk_size=chunk_size)(*primals)

        def pull(*b: Tensor) -> Any:
            return res[1](tree_unflatten(list(b), out_spec))

        def single(*b: Tensor) -> Any:
            # (one product, outside vmap: NOTE [a single product batched wrongly, traced])
            return tuple(r.unsqueeze(0) for r in pull(*(t[0] for t in b)))

        batched = single if single_unbatched and sum(o.numel() for o in outs) == 1 else vmap(
            pull, chunk_size=chunk_size)
        rows = batched(*_basis(outs)) if not det else in_grad_mode(batched, *_basis(outs))
        blocks, off = [], 0
        for o in outs:
            blocks.append([r[off:off + o.numel()].reshape(*o.shape, *r.shape[1:]) for r in rows])
            off += o.numel()
        aux = res[2] if has_aux else None
    else:
        if not leaves or not all(x.numel() for x in leaves):
            if torch.compiler.is_compiling():
                return jacfwd(f, argnums, has_aux=has_aux)(*primals)
            with FORWARD_AD:  # NOTE [forward mode, one thread at a time]
                return jacfwd(f, argnums, has_aux=has_aux)(*primals)

        def push(*b: Tensor) -> Any:
            res = jvp(g, tuple(leaves), b, has_aux=has_aux)
            return (res[1], res[2]) if has_aux else res[1]

        found: list[str | None] = []
        with _reading(found, call == "torch_vjp.jacobian"):
            res = vmap(push, chunk_size=chunk_size)(*_basis(leaves))
        if found and found[0]:  # NOTE [forward mode through a wrong formula, traced]
            if named is not None:
                raise named_forward(call, found[0], traced_name(f), _named(chunk_size))
            return plain_jacobian(f, primals, argnums, has_aux, "rev", chunk_size, out, call)
        cols, out_spec = tree_flatten(res[0] if has_aux else res)
        blocks = []
        for c in cols:
            moved, row, off = c.movedim(0, -1), [], 0
            for x in leaves:
                row.append(moved[..., off:off + x.numel()].reshape(*c.shape[1:], *x.shape))
                off += x.numel()
            blocks.append(row)
        aux = tree_map(lambda a: a[0], res[1]) if has_aux else None
    if out is not None and len(blocks) == 1 and len(blocks[0]) == 1:
        block = blocks[0][0]
        if (block.shape, block.dtype, block.device) == (out.shape, out.dtype, out.device):
            blocks = [[out.copy_(block)]]  # (else a shape not seen at build: out unused)
    per_output = [tree_unflatten(row, spec) for row in blocks]
    if isinstance(argnums, int):
        per_output = [t[0] for t in per_output]
    jac = tree_unflatten(per_output, out_spec)
    return (jac, aux) if has_aux else jac


# NOTE [forward mode through a wrong formula, traced]
# Inside the user's torch.compile, torch_vjp.jacobian and torch_vjp.batch_jacobian return
# their plain form (NOTE [compiled Jacobians]), where the eager path's reading of f's calls
# (NOTE [forward mode through a wrong formula] in :mod:`torch_vjp._engine.fwd_wrong`) does
# not run: through det at a singular matrix, strategy='fwd' and 'auto' (by size, forward
# mode) returned forward mode's wrong Jacobian (zeros) without a word. So the forward-mode
# products of the plain forms run, while dynamo traces them, under
# :class:`~torch_vjp._engine.fwd_wrong._WrongCalls`, the torch function mode torch_vjp.jvp
# traces for the same reason (NOTE [J t by reverse over reverse, traced] in
# :mod:`torch_vjp._engine.revjvp`): the answer is known when the program is traced, no
# graph break. Where f runs an operator of that list on a tangent, a named forward strategy
# is refused with the eager path's StrategyError (:func:`named_forward`; the plain form is
# given the mode, not the name: a chunk of 1 is named 'fwd-loop', as :func:`plain_chunk`
# gives it), and "auto" computes with reverse mode, in the same graph (the forward products,
# unused, are left out by the compiler); without the eager path's one-time warning.
# ``compile=True``'s "auto" chooses its mode eagerly with :func:`forward_mode_agrees`, which
# reads its forward product the same way (eagerly) and takes reverse mode there, as the
# eager "auto" does at every point. The Hessian's forward over reverse: NOTE [forward over
# reverse through det, traced].

# NOTE [reverse mode through det, traced]
# The plain form of a detached Jacobian runs under ``torch.no_grad()`` (:func:`plain_context`),
# where torch's backward of det takes its branch wrong at singular matrices (NOTE [a backward
# right only in grad mode] in :mod:`torch_vjp._engine.wrongops`): strategy='rev' inside the
# user's torch.compile returned zeros through det at a singular matrix, without a word, and
# so would "auto" routed to reverse mode. While dynamo traces, the reverse call of f runs
# under the same torch function mode reading whether f calls det; where it does, and grad
# mode is off, the pullbacks run in grad mode, their results detached
# (:func:`~torch_vjp._engine.gradmode.in_grad_mode`, as the eager products do).


def _reading(found: list[str | None], read: bool,
             which: Callable[..., str | None] | None = None) -> Any:
    """The mode that reads f's calls (of :func:`~torch_vjp._engine.fwd_wrong._wrong_call`,
    or of ``which``) into ``found`` while dynamo traces (NOTE [forward mode through a wrong
    formula, traced]), where ``read``; else no context."""
    if read and torch.compiler.is_compiling():
        return _WrongCalls(found, which)
    return contextlib.nullcontext()


def _named(chunk_size: int | None) -> str:
    """The named forward strategy of a plain form's chunk size (:func:`plain_chunk`)."""
    return "fwd-loop" if chunk_size == 1 else "fwd"


def batch_mode(f: Callable[[Tensor], Any], x: Tensor) -> str:
    """``"rev"`` or ``"fwd"`` for per-example Jacobians, by the per-row sizes."""
    out = tree_flatten(output_of(f, (x,), False))[0]
    n_out = sum(o[0].numel() for o in out if isinstance(o, Tensor) and o.dim()) if len(x) else 0
    return choose_mode(math.prod(x.shape[1:]), n_out)


def plain_batch_jacobian(
    f: Callable[[Tensor], Any], x: Tensor, mode: str | None, chunk_size: int | None
) -> Any:
    """Per-example Jacobians as :func:`torch_vjp.batch_jacobian` defines them: reverse mode
    differentiates the outputs summed over the batch, forward mode pushes each basis vector
    of a row through every row at once."""
    row = tuple(x.shape[1:])
    n_in = math.prod(row)
    named = mode
    if mode is None:
        mode = batch_mode(f, x)
    if mode == "rev":
        jac = plain_jacobian(lambda t: tree_map(lambda o: o.sum(0), f(t)), (x,), 0, False, "rev",
                             chunk_size)
        return tree_map(lambda j: j.movedim(j.dim() - x.dim(), 0), jac)
    batch = x.shape[0]
    basis = basis_rows([torch.Size(row)], [x.dtype], [x.device], batch)(0, n_in)[0]

    def push(t: Tensor) -> Any:
        return jvp(f, (x,), (t,))[1]

    found: list[str | None] = []
    with _reading(found, True):
        cols = vmap(push, chunk_size=chunk_size)(basis)
    if found and found[0]:  # NOTE [forward mode through a wrong formula, traced]
        if named is not None:
            raise named_forward("torch_vjp.batch_jacobian", found[0], traced_name(f),
                                _named(chunk_size))
        return plain_batch_jacobian(f, x, "rev", chunk_size)
    return tree_map(lambda c: c.movedim(0, -1).reshape(*c.shape[1:], *row), cols)


def plain_hessian(
    f: Callable[..., Any], primals: tuple[Any, ...], argnums: int | tuple[int, ...],
    mode: str | None,
) -> Any:
    """Forward over reverse (``mode`` ``"fwd"`` or None), or reverse over reverse: the
    Jacobian of the reverse-mode gradient, both with :func:`plain_jacobian`; forward over
    reverse in grad mode where f calls det (NOTE [forward over reverse through det,
    traced])."""

    def outer(mode: str, single: bool = False) -> Any:
        def gradient(*args: Any) -> Any:
            return plain_jacobian(f, args, argnums, False, "rev", None,
                                  call="torch_vjp.hessian", single_unbatched=single)

        return plain_jacobian(gradient, primals, argnums, False, mode, None,
                              call="torch_vjp.hessian")

    norm: list[str | None] = []  # NOTE [a single product batched wrongly, traced]
    if mode == "rev":
        with _reading(norm, True, _weighted_norm_call):
            hess = outer("rev")
        return outer("rev", True) if norm and norm[0] else hess
    det: list[str | None] = []
    with _reading(det, not torch.is_grad_enabled(), _grad_mode_call), \
            _reading(norm, True, _weighted_norm_call):
        hess = outer("fwd")
    single = bool(norm and norm[0])
    if det and det[0]:
        return in_grad_mode(outer, "fwd", single)
    return outer("fwd", True) if single else hess


#: torch's normalisations whose backward, differentiated again inside vmap, is wrong where
#: they have a weight (NOTE [a single product batched wrongly] in
#: :mod:`torch_vjp._engine.hessian`), and the position of the weight in their arguments
_WEIGHTED_NORMS = {"layer_norm": 2, "batch_norm": 1, "instance_norm": 1}
#: the same in ``torch.nn.functional``'s forms (the call the mode sees where f calls them)
_WEIGHTED_NORMS_FUNCTIONAL = {"layer_norm": 2, "batch_norm": 3, "instance_norm": 3}


def _weighted_norm_call(func: Any, args: Any, kwargs: dict[str, Any]) -> str | None:
    """``layer_norm``, ``batch_norm`` or ``instance_norm`` (torch's or
    ``torch.nn.functional``'s) called with a weight, by name, or None."""
    functional = getattr(func, "__module__", None) == "torch.nn.functional"
    at = (_WEIGHTED_NORMS_FUNCTIONAL if functional else _WEIGHTED_NORMS).get(
        getattr(func, "__name__", ""))
    if at is None:
        return None
    weight = args[at] if len(args) > at else kwargs.get("weight")
    return f"torch.{func.__name__}" if isinstance(weight, Tensor) else None


# NOTE [a single product batched wrongly, traced]
# The eager Hessian computes its gradient's one product without vmap where f's graph holds
# layer_norm's or batch_norm's backward with a weight (NOTE [a single product batched
# wrongly] in :mod:`torch_vjp._engine.hessian`: every route vectorised around that product,
# torch.func.hessian's too, was off by 13.6 at a scale of 50.3). Inside the user's
# torch.compile (and under compile=True) there is no graph to read: the products run, while
# dynamo traces them, under the torch function mode reading whether f calls torch.layer_norm,
# torch.batch_norm or torch.instance_norm with a weight; where it does, the Hessian is taken
# again (in the same graph, the first left out by the compiler) with the gradient's single
# product outside vmap, in the strategy's own mode.


# NOTE [forward over reverse through det, traced]
# Inside the user's torch.compile (and under compile=True) a detached Hessian's plain form
# runs under ``torch.no_grad()`` (:func:`plain_context`). Its forward over reverse ("auto",
# "fwd", "fwd-loop") pushes tangents through the gradient's pullback, which through det runs
# in grad mode, detached (NOTE [reverse mode through det, traced]): the detach dropped the
# tangents, and without it det's backward takes its branch wrong at singular matrices
# (NOTE [a backward right only in grad mode] in :mod:`torch_vjp._engine.wrongops`), so the
# Hessian of det at a singular matrix came back zeros without a word (errors of 1 to 9),
# where the eager calls, and reverse over reverse, are right. So the outer forward products
# run, while dynamo traces them, under the torch function mode reading whether f calls det;
# where it does, and grad mode is off, forward over reverse runs again in grad mode, its
# result detached (:func:`~torch_vjp._engine.gradmode.in_grad_mode`): right, as the eager
# forward over reverse is (named or "auto"; no refusal, since the eager call refuses none),
# in the same graph (the first products, unused, are left out by the compiler).


def plain_jvp(
    f: Callable[..., Any], primals: tuple[Any, ...], tangents: tuple[Any, ...],
    has_aux: bool, batched: bool, chunk_size: int | None, strict: bool = False,
) -> tuple[Any, ...]:
    """``torch.func.jvp`` (``strict`` as its); batched, under ``vmap`` over the tangents' leading dimension, a
    chunk of ``chunk_size`` tangents at a time (chunked here: ``vmap``'s own ``chunk_size``
    concatenates every output, and cannot concatenate the primal output and aux, which have
    no batch dimension, ``out_dims`` None)."""
    if not batched:
        return jvp(f, primals, tangents, has_aux=has_aux, strict=strict)

    def push(t: tuple[Any, ...]) -> tuple[Any, ...]:
        return jvp(f, primals, t, has_aux=has_aux, strict=strict)

    out_dims = (None, 0, None) if has_aux else (None, 0)
    leaves, spec = tree_flatten(tangents)
    n = leaves[0].shape[0] if leaves else 0
    if chunk_size is None or chunk_size >= n:
        return vmap(push, out_dims=out_dims)(tangents)
    parts = [vmap(push, out_dims=out_dims)(tree_unflatten([t[i:i + chunk_size]
                                                             for t in leaves], spec))
             for i in range(0, n, chunk_size)]
    pushed = [tree_flatten(p[1]) for p in parts]
    cat = tree_unflatten([torch.cat(ts) for ts in zip(*(p[0] for p in pushed))], pushed[0][1])
    return (parts[0][0], cat, *parts[0][2:])


def plain_chunk(strat: Strategy, chunk: int | None) -> int | None:
    """The chunk size of the plain form: a loop strategy computes one product at a time."""
    return chunk if strat.vectorized else 1


def plain_context(context: Any, detached: bool) -> Any:
    """The grad mode a plain form runs in: none for a detached result (the default),
    enabled for ``create_graph=True``; made here, inside what dynamo traces, since dynamo
    does not take a context manager object made outside."""
    if detached:
        return torch.no_grad()
    return torch.enable_grad() if context is not NO_CONTEXT else contextlib.nullcontext()


def in_plain_context(context: Any, detached: bool, fn: Callable[..., Any], *args: Any
                     ) -> Any:
    """``fn(*args)`` in :func:`plain_context`, in a frame of its own: inside the user's
    ``torch.compile``, a graph break in ``f`` (a print) makes dynamo resume the frame that
    holds the ``with`` block, and it cannot resume a public function's frame there (its
    prologue fails to trace: ResumePrologueTracingError); this small frame it can."""
    with plain_context(context, detached):
        return fn(*args)

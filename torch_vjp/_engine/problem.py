"""The function of the differentiated leaves: ``f`` with the primals picked by ``argnums``
replaced by flat tensor leaves, its primals checked and copied (:mod:`torch_vjp._engine.copies`),
its outputs validated.

NOTE [non-differentiated primals]
torch.func's vjp and jvp (and so jacrev, jacfwd, hessian) wrap every tensor among the
primals at their own level, the differentiated ones and the others alike; only the
differentiated ones get a tangent or require grad. f may then write into a primal it is not
differentiated against (``lambda x, y: y.copy_(x)`` with argnums=0), which would otherwise be
a tensor captured from outside the transform, and torch.func refuses writes to those. So when
f runs inside one of torch_vjp's own transforms (:meth:`Problem.g_inner`), the tensors of
the other primals are wrapped at that transform's level in the same way; outside them
(:meth:`Problem.g`: a probe, the plain-autograd loops) they are passed as they are. With no
tensor among the other primals the two are the same function.
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.utils._pytree import (
    TreeSpec,
    keystr,
    tree_flatten,
    tree_flatten_with_path,
    tree_leaves,
    tree_map,
    tree_unflatten,
)

from torch_vjp._engine.copies import fresh_copies, given_fresh, has_history
from torch_vjp._engine.kept import fresh_state
from torch_vjp._errors import JacobianCallError, JacobianCallTypeError, a_type, shape_str

__all__ = ["LEAF_SPEC", "normalize_argnums", "leaf_name", "describe", "Problem"]

_current_level = torch._C._functorch.current_level
_wrap_for_grad = torch._C._functorch._wrap_for_grad

#: The structure of a single tensor (shared, for cheap comparisons).
LEAF_SPEC: TreeSpec = tree_flatten(0)[1]
_TUPLE_SPECS: dict[int, TreeSpec] = {}


def _tuple_spec(k: int) -> TreeSpec:
    """The structure of a tuple of ``k`` leaves (shared, for cheap comparisons)."""
    spec = _TUPLE_SPECS.get(k)
    if spec is None:
        spec = _TUPLE_SPECS[k] = tree_flatten((0,) * k)[1]
    return spec


def normalize_argnums(argnums: object, n_args: int, *, call: str) -> tuple[int, ...]:
    """Checks ``argnums`` against the number of primals; returns non-negative indices.

    Raises:
        JacobianCallError: not an int or a non-empty tuple of distinct ints in range.

    Example:
        >>> normalize_argnums(-1, 3, call="f"), normalize_argnums((0, 2), 3, call="f")
        ((2,), (0, 2))
    """
    if type(argnums) is int and -n_args <= argnums < n_args:  # the common case, first
        return (argnums % n_args,)
    if n_args == 0:
        raise JacobianCallError(
            f"{call}: no primals were given. Pass the point at which to differentiate, "
            f"e.g. {call}(f, x)."
        )
    if isinstance(argnums, int) and not isinstance(argnums, bool):
        items: tuple[Any, ...] = (argnums,)
    elif isinstance(argnums, tuple) and argnums:
        items = argnums
    else:
        fix = f" Fix: argnums={tuple(argnums)!r}." if isinstance(argnums, list) and argnums else ""
        if _as_int(argnums) is not None:  # (a NumPy integer, a 0-d integer tensor)
            fix = f" Fix: argnums={_as_int(argnums)} (a Python int)."
        raise JacobianCallError(
            f"{call}: argnums={argnums!r}, but it must be an int or a non-empty tuple of "
            f"ints: the positions of the primals to differentiate against.{fix}"
        )
    out = []
    for a in items:
        if isinstance(a, bool) or not isinstance(a, int):
            fixed = tuple(_as_int(b) if _as_int(b) is not None else b for b in items)
            fix = (f" Fix: argnums={fixed!r} (Python ints)."
                   if all(type(b) is int for b in fixed) else "")
            raise JacobianCallError(
                f"{call}: argnums={argnums!r} holds {a!r}, but its entries must be ints: the "
                f"positions of the primals to differentiate against.{fix}"
            )
        if not -n_args <= a < n_args:
            raise JacobianCallError(
                f"{call}: argnums={argnums!r}, but f was given {n_args} "
                f"primal{'s' if n_args != 1 else ''}, so argnums must lie in "
                f"{-n_args}..{n_args - 1}."
            )
        out.append(a % n_args)
    if len(set(out)) != len(out):
        raise JacobianCallError(
            f"{call}: argnums={argnums!r} names a primal twice; each may appear once."
        )
    return tuple(out)


def _as_int(value: object) -> int | None:
    """``value`` as a Python int where it is an integer of another type (a NumPy integer, a
    0-d integer tensor: what ``operator.index`` takes), else None."""
    if isinstance(value, bool) or isinstance(value, int):
        return value if type(value) is int else None
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        return None


def leaf_name(path: Any, root: str) -> str:
    """The user's name for the leaf at ``path`` under ``root``: ``output[1]['w']``."""
    return root + keystr(path) if path else root


def _primal_name(argnum: int, path: Any, position: int | None) -> str:
    name = f"primals[{argnum}]" + (keystr(path) if path else "")
    if position is not None:
        name += f" (argnums[{position}])"
    return name


def describe(obj: object) -> str:
    """A value in words for messages: ``a Tensor of shape (3,)``, ``a tuple of length 2``."""
    if isinstance(obj, Tensor):
        return f"a Tensor of shape {shape_str(obj.shape)}"
    if isinstance(obj, tuple):
        return f"a tuple of length {len(obj)}"
    return a_type(obj)


def _differentiable(t: object, complex_ok: bool = False) -> bool:
    """Whether ``t`` is a tensor Jacobians can be taken against: dense, real floating point
    (or complex, for VJPs and JVPs: ``complex_ok``)."""
    return (
        isinstance(t, Tensor)
        and (t.dtype.is_floating_point or (complex_ok and t.dtype.is_complex))
        and t.layout is torch.strided
        and not t.is_nested
    )


def _check_primal_leaf(
    leaf: object, name: str, call: str, selected: bool, complex_ok: bool = False,
    whole: str | None = None,
) -> None:
    """Raises the error that says why ``leaf`` cannot be differentiated (``whole``: the one
    primal's own name, for a function without argnums, which differentiates all of it)."""
    if isinstance(leaf, Tensor) and (leaf.is_nested or leaf.layout is not torch.strided):
        kind = "a nested tensor" if leaf.is_nested else f"a sparse tensor (layout {leaf.layout})"
        fix = (
            "pass the dense tensor (x.to_dense()) and, if f needs a sparse one, call "
            ".to_sparse() inside f" if not leaf.is_nested else
            "differentiate the dense components (e.g. x.values() or a padded tensor, "
            "x.to_padded_tensor(0.0)) and rebuild the nested tensor inside f"
        )
        raise JacobianCallError(
            f"{call}: {name} is {kind}; Jacobians here (as in torch.func) are taken with "
            f"respect to dense (strided) tensors, whose elements are the Jacobian's columns. "
            f"Fix: {fix}."
        )
    if not isinstance(leaf, Tensor):
        if selected:
            raise JacobianCallError(
                f"{call}: {name} is {a_type(leaf)}, but argnums selects it for "
                f"differentiation, and derivatives are taken with respect to tensors. Fix: "
                f"pass torch.tensor(...) for it, or leave its position out of argnums."
            )
        every = f"all of {whole} is" if whole is not None else "every primal is"
        raise JacobianCallError(
            f"{call}: {name} is {a_type(leaf)}, but {every} differentiated, "
            f"and derivatives are taken with respect to tensors. Fix: pass torch.tensor(...) "
            f"for it, or bind it inside f (functools.partial or a lambda)."
        )
    if leaf.dtype.is_complex and not complex_ok:
        raise JacobianCallError(
            f"{call}: {name} has dtype {leaf.dtype}; Jacobians here (as in "
            f"torch.func.jacrev) are defined for real tensors. Fix: pass "
            f"torch.view_as_real({name.split(' ')[0]}) and rebuild the complex number inside f "
            f"(torch.view_as_complex), or use torch_vjp.vjp / torch_vjp.jvp, which take "
            f"complex tensors."
        )
    if not leaf.dtype.is_floating_point:
        kinds = "floating-point or complex" if complex_ok else "floating-point"
        raise JacobianCallError(
            f"{call}: {name} has dtype {leaf.dtype}, but only {kinds} tensors can be "
            f"differentiated (an integer has no small changes). Fix: pass it as .double() "
            f"or .float()" + (", or leave its position out of argnums." if selected else ".")
        )


def _with_args_at(
    f: Callable[..., Any], primals: tuple[Any, ...], idx: tuple[int, ...]
) -> Callable[..., Any]:
    """``f`` called with ``xs`` in place of the primals at positions ``idx`` (``f`` itself
    when ``idx`` selects every primal, in order)."""
    if idx == tuple(range(len(primals))):
        return f
    if len(idx) == 1:
        pre, post = primals[: idx[0]], primals[idx[0] + 1 :]

        def call_one(x: Tensor) -> Any:
            return f(*pre, x, *post)

        return call_one

    def call_f(*xs: Tensor) -> Any:
        args = list(primals)
        for i, value in zip(idx, xs):
            args[i] = value
        return f(*args)

    return call_f


class Problem:
    """``f`` as a function of the flat tensor leaves of the differentiated primals.

    ``g(*leaves)`` calls ``f`` with the primals selected by ``argnums`` rebuilt from
    ``leaves`` and the others as given, checks that its output is a pytree of floating-point
    tensors (and, with ``has_aux``, an ``(output, aux)`` pair), and returns what ``f``
    returned. Products are then taken with respect to the leaves, so a VJP returns one
    tensor per leaf and no pytree work is needed in the hot path.

    With ``detached``, the copies of the primals f is called with (NOTE [f's own copies]) are
    detached from the caller's graph; with ``copies=False`` f is given the caller's tensors
    themselves, for a transform that calls it exactly once. An aux value must be tensors, as torch.func asks. With
    ``complex_ok`` (VJPs and JVPs), complex primals and outputs are accepted too.

    Attributes:
        leaves: the differentiated tensors, flattened.
        in_spec: the pytree structure of the differentiated primals (the primal itself for an
            int ``argnums``, a tuple of them for a tuple).
        int_argnums: whether ``argnums`` was an int.
    """

    def __init__(
        self,
        f: Callable[..., Any],
        primals: tuple[Any, ...],
        argnums: object,
        *,
        has_aux: bool,
        call: str,
        detached: bool = False,
        complex_ok: bool = False,
        copies: bool = True,
        any_outputs: bool = False,
        aux: bool = True,
        named: str | None = None,
    ) -> None:
        if not callable(f):
            raise JacobianCallTypeError(
                f"{call}: f is {describe(f)}, but it must be a callable: the function to "
                f"differentiate, called as f(*primals). Fix: pass the function itself, e.g. "
                f"{call}(torch.sin, x) or {call}(lambda x: ..., x)."
            )
        # argnums=None: every primal, as torch.func.vjp/jvp (a tuple of them)
        self.selected = argnums is not None
        if copies:
            primals, self._guard = fresh_copies(primals, detached)
        else:  # f is called once, on the caller's tensors (NOTE [f's own copies])
            self._guard = []
        self.primals = primals
        self._keys: dict[Any, Any] = {}
        # NOTE [a copy with a history]: the copies f must not write into
        self._kept = {id(g[0]) for g in self._guard if has_history(g[0])}
        self._clone_leaves = False
        if argnums is None:
            if not primals:
                raise JacobianCallError(f"{call}: no primals were given.")
            argnums = tuple(range(len(primals)))
        idx = normalize_argnums(argnums, len(primals), call=call)
        self.f = f
        if self._kept:
            differentiated = {id(t) for i in idx for t in tree_leaves(primals[i])}
            self._clone_leaves = not differentiated.isdisjoint(self._kept)
            if not self._kept <= differentiated:
                f = given_fresh(f, self._kept, idx)
        self.call = call
        self.has_aux = bool(has_aux)
        self.argnums = idx
        self.int_argnums = not isinstance(argnums, tuple)
        self.complex_ok = complex_ok
        # (JVPs: an integer or boolean output gets a zero tangent, as torch.func.jvp gives)
        self.any_outputs = any_outputs
        # (what the calling function offers, for messages: has_aux, or one primal by its
        # own name, ``x``, and no argnums)
        self.aux_option = aux
        self.named = named
        if all(isinstance(primals[i], Tensor) for i in idx):  # no pytree work
            self.leaves: list[Tensor] = [primals[i] for i in idx]
            self.in_spec = LEAF_SPEC if self.int_argnums else _tuple_spec(len(idx))
            self._check_leaves()
            self._call_f = _with_args_at(f, primals, idx)
            self._call_inner = self._inner_call(None)
            return
        diff = primals[idx[0]] if self.int_argnums else tuple(primals[i] for i in idx)
        self.leaves, self.in_spec = tree_flatten(diff)
        if not self.leaves:
            raise JacobianCallError(
                f"{call}: the primals selected by argnums={argnums!r} hold no tensors."
            )
        self._check_leaves()
        spec, int_argnums = self.in_spec, self.int_argnums

        def call_with(args: list[Any], xs: tuple[Tensor, ...]) -> Any:
            rebuilt = tree_unflatten(list(xs), spec)
            if int_argnums:
                args[idx[0]] = rebuilt
            else:
                for i, value in zip(idx, rebuilt):
                    args[i] = value
            return f(*args)

        def call_f(*xs: Tensor) -> Any:
            return call_with(list(primals), xs)

        self._call_f = call_f
        self._call_inner = self._inner_call(call_with)

    def _inner_call(
        self, call_with: Callable[[list[Any], tuple[Tensor, ...]], Any] | None
    ) -> Callable[..., Any]:
        """``f`` of the leaves as called inside torch_vjp's own transforms: the tensors of
        the other primals wrapped at the transform's level (NOTE [non-differentiated
        primals]); the plain call where the other primals hold no tensor."""
        primals, idx, f = self.primals, self.argnums, self.f
        kept = self._kept
        others = [
            i for i in range(len(primals))
            if i not in idx and any(isinstance(t, Tensor) for t in tree_leaves(primals[i]))
        ]
        if not others:
            return self._call_f
        if call_with is None:  # every differentiated primal is a tensor

            def call_with(args: list[Any], xs: tuple[Tensor, ...]) -> Any:
                for i, value in zip(idx, xs):
                    args[i] = value
                return f(*args)

        def wrap(t: Any, level: int) -> Any:
            if not isinstance(t, Tensor):
                return t
            wrapped = _wrap_for_grad(t, level)
            return wrapped.clone() if id(t) in kept else wrapped

        def call_inner(*xs: Tensor) -> Any:
            level = _current_level()
            args = list(primals)
            for i in others:
                p = primals[i]
                args[i] = wrap(p, level) if isinstance(p, Tensor) else tree_map(
                    lambda t: wrap(t, level), p)
            return call_with(args, xs)

        return call_inner

    def _check_leaves(self) -> None:
        for k, leaf in enumerate(self.leaves):
            if not _differentiable(leaf, self.complex_ok):
                _check_primal_leaf(
                    leaf, self.leaf_name(k), self.call, self.selected and self.named is None,
                    self.complex_ok, whole=self.named,
                )

    def g(self, *xs: Tensor) -> Any:
        """Calls ``f`` at the leaves ``xs`` and validates what it returns.

        Before each call, a primal that an earlier call of ``f`` modified in place is reset
        to the caller's value (NOTE [f's own copies]).
        """
        fresh_state(self.f)  # NOTE [every call from the caller's state] in kept.py
        return self._checked(self._call_f(*self._reset(xs)))

    def g_inner(self, *xs: Tensor) -> Any:
        """:meth:`g` as called by torch.func's ``vjp``/``jvp`` inside torch_vjp's own
        transforms: the tensors of the primals not differentiated are wrapped at the
        transform's level, as torch.func does (NOTE [non-differentiated primals])."""
        fresh_state(self.f)
        return self._checked(self._call_inner(*self._reset(xs)))

    def reset_primals(self) -> None:
        """Gives every primal an earlier call of ``f`` modified in place the caller's value
        again (NOTE [f's own copies]), before the leaves are read outside a call of f."""
        self._reset(())

    def _reset(self, xs: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
        for guard in self._guard:
            if guard[0]._version != guard[2]:
                guard.reset()
        if self.writes_inputs or self._clone_leaves:
            return tuple(x.clone() for x in xs)
        return xs

    #: f writes into a differentiated input (``x[0] = ...``), which autograd refuses on the
    #: tensor it differentiates against: f is then given a copy of it (NOTE [f writes into
    #: its input] in :mod:`torch_vjp._engine.jacobian`)
    writes_inputs = False

    #: calls of ``f`` so far (the Jacobian functions warn about a function that changes a
    #: tensor it captured where they called it more than once)
    calls = 0

    def _checked(self, res: Any) -> Any:
        self.calls += 1
        out = res
        if self.has_aux:
            if not (isinstance(res, tuple) and len(res) == 2):
                got, why = ("None", " (if f ends without a return statement, or with a bare "
                            "return, return the pair)") if res is None else (describe(res), "")
                raise JacobianCallError(
                    f"{self.call}: with has_aux=True, f must return a pair (output, aux), "
                    f"but it returned {got}. Return (output, aux){why}, or pass "
                    f"has_aux=False."
                )
            out = res[0]
            self._check_aux(res[1])
        if isinstance(out, Tensor):
            if not (out.dtype.is_floating_point or self.any_outputs
                    or (self.complex_ok and out.is_complex())):
                self._bad_output(out, None)
        else:
            for path, leaf in tree_flatten_with_path(out)[0]:
                if not (
                    isinstance(leaf, Tensor)
                    and (leaf.dtype.is_floating_point or self.any_outputs
                         or (self.complex_ok and leaf.is_complex()))
                ):
                    self._bad_output(leaf, path)
            if not tree_leaves(out):
                raise JacobianCallError(
                    f"{self.call}: f returned {describe(out)}, which holds no tensors: there "
                    f"is nothing to differentiate."
                )
        return res

    def _check_aux(self, aux: Any) -> None:
        """``aux`` must be a tensor or a pytree of tensors, under every strategy: torch.func's
        vjp and jvp refuse anything else, ``None`` included ("Expected tensors, got
        unsupported type"), and vmap carries only tensors."""
        if isinstance(aux, Tensor):
            return
        for path, leaf in tree_flatten_with_path(aux)[0]:
            if not isinstance(leaf, Tensor):
                where = leaf_name(path, "aux")
                what = "None" if leaf is None else describe(leaf)
                fix = ("leave it out of aux (return only tensors there; to return no aux, "
                       "pass has_aux=False and return the output alone)" if leaf is None
                       else "return torch.tensor(...) for it, or keep the Python value "
                            "outside f")
                raise JacobianCallError(
                    f"{self.call}: {where} is {what}, but with has_aux=True the aux "
                    f"value f returns must be a tensor or a tuple, list or dict of tensors "
                    f"(torch.func's transforms carry only tensors out). Fix: {fix}."
                )

    def _bad_output(self, leaf: object, path: Any) -> None:
        where = leaf_name(path, "the output of f")
        if not isinstance(leaf, Tensor):
            hint = ""
            if (
                not self.has_aux
                and self.aux_option
                and isinstance(path, tuple)
                and len(path) == 1
                and getattr(path[0], "idx", None) == 1
            ):
                hint = " If f returns (output, aux), pass has_aux=True."
            if leaf is None and not path:
                hint = (" f returned (None, aux): the output, the first of the (output, aux) "
                        "pair that has_aux=True reads, is None." if self.has_aux else
                        " f returned None: if it ends without a return statement (or with a "
                        "bare return), return its result.")
            what = a_type(leaf)
            raise JacobianCallError(
                f"{self.call}: {where} is {what}, but every output of f must "
                f"be a Tensor (or a tuple, list or dict of Tensors): the Jacobian has one "
                f"block per output tensor.{hint}"
            )
        if self.complex_ok:
            raise JacobianCallError(
                f"{self.call}: {where} has dtype {leaf.dtype}; only floating-point or complex "
                f"outputs can be differentiated (as in torch.func.vjp). Fix: return it as "
                f".double() or .float() if it is differentiable, or move it to aux with "
                f"has_aux=True."
            )
        if leaf.dtype.is_complex:
            raise JacobianCallError(
                f"{self.call}: {where} has dtype {leaf.dtype}; only real floating-point "
                f"outputs have a Jacobian here (as in torch.func.jacrev). Fix: return "
                f"torch.view_as_real(...) of it (real and imaginary parts along a last "
                f"dimension of 2), or use torch_vjp.vjp / torch_vjp.jvp, which take complex "
                f"outputs."
            )
        aside = (", or move it to aux with has_aux=True" if self.aux_option else
                 ", or leave it out of f's output")
        raise JacobianCallError(
            f"{self.call}: {where} has dtype {leaf.dtype}; only real floating-point outputs "
            f"have a Jacobian here (as in torch.func.jacrev). Fix: return it as .double() or "
            f".float() if it is differentiable{aside}."
        )

    def leaf_name(self, k: int) -> str:
        """The user's name for leaf ``k``: ``primals[1]['w'] (argnums[0])``."""
        flat = tree_flatten_with_path(
            tree_unflatten(list(range(len(self.leaves))), self.in_spec)
        )[0]
        path = flat[k][0]
        if self.named is not None:
            return self.named + (keystr(path) if path else "")
        if self.int_argnums:
            return _primal_name(self.argnums[0], path, None)
        pos = getattr(path[0], "idx", 0)
        return _primal_name(self.argnums[pos], path[1:], pos if self.selected else None)

    def probe(self, record: bool = False) -> tuple[list[Tensor], TreeSpec]:
        """Runs ``f`` once for the sizes of its outputs: without recording a graph, or with
        ``record`` under the caller's grad mode (so that the outputs show whether ``f``
        involves tensors that require grad)."""
        with contextlib.nullcontext() if record else torch.no_grad():
            res = self.g(*self.leaves)
        out = res[0] if self.has_aux else res
        flat, spec = tree_flatten(out)
        return flat, spec

"""The machinery of :func:`torch_vjp.check_function`: a recorder of what a custom backward
returns, the checker that runs a Function's forward and backward and compares them with
finite differences, and their small helpers.

NOTE [seeing what backward really returned]
torch validates a custom backward's return value inside the autograd engine
(``validate_outputs``) and *repairs* some mistakes without a word: a gradient whose shape the
input's shape broadcasts to is summed down (``Tensor.sum_to_size``: ``(2, 4, 3)`` for a
``(4, 3)`` input is accepted), a float64 gradient for a float32 input is cast, ``None`` for an
input that requires grad is read as zeros, trailing extra ``None`` values are dropped. Tensor
hooks and node post-hooks only ever see the repaired values. The engine runs a custom
Function's node by looking up the attribute ``apply`` on the node object (a
``BackwardCFunction``, which is also the ``ctx`` forward saw), so an instance attribute
``apply`` on *our own* node (from a forward we ran on copies of the inputs) sees the raw
return value before validation. :class:`_Recorder` installs such a pass-through wrapper,
records ``(grad_outputs, returned)`` and removes it afterwards. The user's backward runs
exactly once per node, inside the engine, with the grad_outputs torch itself prepares.

NOTE [non-finite values]
The dot-product test compares ``<J t, c>`` from central differences of forward with
``<t, backward(c)>``. At an input that holds NaN or inf, or where forward's output holds
NaN or inf, the differences are NaN or inf whatever backward returns, and the test would
blame a correct backward. Such inputs are therefore refused with a
:class:`FunctionCheckValueError` that says which input (or output) and suggests finite
inputs, after the count, shape, dtype and device checks, which do not depend on values.
A tensor input that is not differentiated may hold inf (an attention mask of ``-inf``, say)
as long as forward's outputs stay finite.

NOTE [which inputs are differentiated]
Tensor inputs with ``requires_grad=True`` are differentiated. If no input requires grad,
every floating-point and complex tensor input is (the convenient default: ``check_function(
MyFunc, torch.randn(4, 3))`` checks the gradient for the tensor). Integer tensors and
non-tensor arguments never are; backward must return ``None`` for non-tensor arguments.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor
from torch.utils import _pytree as pytree

from torch_vjp._backward_check import (
    Record,
    Slot,
    as_tuple,
    check_record,
    dtype_name,
    slot_from_arg,
    slots_from_node,
)
from torch_vjp._errors import (
    FunctionCheckError,
    FunctionCheckValueError,
    joined,
    shape_str,
)
from torch_vjp._function_calls import SameDraws
from torch_vjp._function_graph import custom_nodes
from torch_vjp._function_verdict import (
    Kink,
    Probe,
    conjugated,
    find_kink,
    hidden_error,
    kink_message,
    parameter_fix,
    smaller_step,
    swap_message,
    swapped_partner,
    value_message,
)
from torch_vjp._function_values import (
    NORM_SHARE,
    balanced,
    inner,
    non_finite,
    norm,
    output_grid,
    paired_norm,
    randn_like,
    real_dtype,
    spread,
    value_dtype,
    where_text,
    widen,
)

__all__ = [
    "DEFAULT_TOLERANCES", "PROBES", "Checker", "callable_name", "describe_arg", "differentiated",
    "ok_text",
]

# Random probes (pairs of tangent t and cotangent c) per differentiated input.
PROBES = 2
# check_function draws its random grad_outputs, tangents and cotangents from a private
# generator with this seed: results are reproducible and the global RNG is left alone.
_SEED = 20240602
# (NOTE [the dot-product test]: in _function_values)
# Default tolerances of the dot-product test, by the precision the values are checked in.
DEFAULT_TOLERANCES = {  # dtype -> (atol, rtol)
    torch.float64: (1e-8, 1e-5),
    torch.float32: (1e-5, 1e-2),
    torch.float16: (1e-3, 1e-1),
    torch.bfloat16: (1e-3, 1e-1),
}


# ---------------------------------------------------------------------------------------
# The checker


@dataclass
class _StructureResult:
    grads: dict[int, Any]  # input index of fn -> gradient (raw for a Function subclass)
    functions: tuple[str, ...]


@dataclass
class _ValueResult:
    errors: dict[int, tuple[float, float]]  # input index -> (max abs error, max rel error)
    dtype: torch.dtype | None
    eps: float
    atol: float
    rtol: float
    notes: list[str]


class _Recorder:
    """Sees what custom backward methods return, before torch validates it.

    See NOTE [seeing what backward really returned]. Only nodes created by our own forward
    run are touched, and the wrappers are removed by :meth:`uninstall`.
    """

    def __init__(self, nodes: Sequence[Any]):
        self.nodes = list(nodes)
        self.records: list[Record] = []
        self.raised: list[BaseException] = []

    def install(self) -> None:
        for node in self.nodes:
            for attr in ("apply", "apply_boxed"):
                original = getattr(type(node), attr, None)
                if original is None:
                    continue
                # torch's own method under checked mode's wrapper (NOTE [checked custom
                # backwards] in torch_vjp.autograd): this check reports, not checked mode
                while getattr(original, "__torch_vjp_wrapper__", False):
                    original = original.__wrapped__
                setattr(node, attr, self._wrap(node, original, boxed=attr == "apply_boxed"))

    def uninstall(self) -> None:
        for node in self.nodes:
            for attr in ("apply", "apply_boxed"):
                node.__dict__.pop(attr, None)

    def _wrap(self, node: Any, original: Callable[..., Any], boxed: bool) -> Callable[..., Any]:
        def apply(*args: Any) -> Any:
            try:
                returned = original(node, *args)
            except BaseException as exc:  # the user's backward: recorded, re-raised as is
                self.raised.append(exc)
                raise
            grads = args
            if len(args) == 1 and isinstance(args[0], list) and (
                boxed or getattr(node._forward_cls, "boxed_grads_call", False)
            ):
                grads = tuple(args[0])
            self.records.append(Record(node, tuple(grads), returned))
            return returned

        return apply


class Checker:
    def __init__(self, *, call: str, fn: Any, is_function: bool, run: Callable[..., Any],
                 inputs: tuple[Any, ...], diff: list[int], draws: SameDraws | None = None,
                 labels: dict[int, str] | None = None):
        self.call = call
        self.labels = labels or {}  # (index -> "parameter Model.w", NOTE [parameters of fn's
        # modules]; the others are "input i")
        self.draws = draws
        self.fn = fn
        self.is_function = is_function
        self.run = run
        self.inputs = inputs
        self.diff = diff
        self.gen = torch.Generator().manual_seed(_SEED)
        self._at: tuple[tuple[Any, ...], list[int]] = ((), [])  # (set by _probe)
        self.summed: dict[int, str] = {}  # (input -> why torch sums its gradient's shape)

    def _forward(self, *args: Any) -> Any:
        """The user's forward (or fn), with the draws of every other call (NOTE
        [check_function's draws]); its errors pass through."""
        if self.draws is not None:
            self.draws.reset()
        return self.run(*args)

    # -- structure: counts, shapes, dtypes, devices, None -------------------------------

    def check_structure(self) -> _StructureResult:
        leaves = {i: self.inputs[i].detach().clone().requires_grad_(True) for i in self.diff}
        args = _fresh_args(self.inputs, leaves)
        with torch.enable_grad():
            out = self._forward(*args)  # the user's forward: errors pass through
        outputs = [o for o in pytree.tree_flatten(out)[0]
                   if isinstance(o, Tensor) and o.requires_grad]
        if not outputs:
            raise FunctionCheckError(
                f"{self.call}: no output of fn requires grad, although input"
                f"{'s' if len(self.diff) > 1 else ''} {joined(self.diff)} "
                f"{'do' if len(self.diff) > 1 else 'does'}: there is no backward to run.\n"
                f"  A custom Function's outputs require grad when an input does, unless "
                f"forward marks them with ctx.mark_non_differentiable, or fn detaches them or "
                f"returns no tensors. Return the result of MyFunc.apply(...) itself."
            )
        nodes = custom_nodes([o.grad_fn for o in outputs], list(leaves.values()))
        if not nodes:
            raise FunctionCheckError(
                f"{self.call}: found no custom torch.autograd.Function between fn's inputs and "
                f"its outputs, so there is no backward to check.\n"
                f"  check_function checks the backward of a torch.autograd.Function subclass: "
                f"pass the class (torch_vjp.check_function(MyFunc, x)) or a callable that "
                f"calls MyFunc.apply on its tensor inputs (or on tensors computed from them). "
                f"Built-in torch operations bring their own, tested backward formulas; "
                f"torch.autograd.gradcheck compares those with finite differences."
            )
        grad_outputs = [randn_like(o, self.gen) for o in outputs]
        inputs = [leaves[i] for i in self.diff]
        recorder = _Recorder(nodes)
        recorder.install()
        try:
            grads = torch.autograd.grad(outputs, inputs, grad_outputs, allow_unused=True)
        except Exception as exc:
            if any(exc is raised for raised in recorder.raised):
                raise  # raised by the user's backward: untouched
            problem = self._first_problem(recorder.records, args)
            if problem is None:
                raise
            raise FunctionCheckError(problem) from exc
        finally:
            recorder.uninstall()
        problem = self._first_problem(recorder.records, args)
        if problem is not None:
            raise FunctionCheckError(problem)
        if not recorder.records:  # pragma: no cover - autograd ran no custom node
            raise FunctionCheckError(
                f"{self.call}: autograd did not run the backward of "
                f"{joined(sorted({n._forward_cls.__name__ for n in nodes}))} on the way from "
                f"fn's outputs to its inputs, so there is nothing to check."
            )

        counts: dict[str, int] = {}
        for rec in recorder.records:
            key = f"{rec.node._forward_cls.__name__}.backward"
            counts[key] = counts.get(key, 0) + 1
        functions = tuple(k if n == 1 else f"{k} x {n}" for k, n in counts.items())

        result: dict[int, Any] = {}
        if self.is_function:
            rec = recorder.records[0]
            returned = as_tuple(rec.returned)
            for i in range(len(self.inputs)):
                if i < len(returned):
                    result[i] = returned[i]
        else:
            for i, g in zip(self.diff, grads):
                result[i] = g
        return _StructureResult(grads=result, functions=functions)

    def _slots(self, node: Any, args: Sequence[Any]) -> list[Slot]:
        needs = tuple(bool(b) for b in node.needs_input_grad)
        if self.is_function and node._forward_cls is self.fn:
            bound = _bind_forward_args(self.fn, args)
            if len(bound) == len(needs):
                return [slot_from_arg(a, n) for a, n in zip(bound, needs)]
        return slots_from_node(node, needs)

    def _first_problem(self, records: Sequence[Record], args: Sequence[Any]) -> str | None:
        for rec in records:
            problem = check_record(self.call, rec, self._slots(rec.node, args),
                                   self.summed if self.is_function else None)
            if problem is not None:
                return problem
        return None

    # -- values: the dot-product test ---------------------------------------------------

    def check_finite_inputs(self) -> None:
        """Refuses differentiated inputs that hold NaN or inf. See NOTE [non-finite values]."""
        for i in self.diff:
            x = self.inputs[i]
            where = non_finite(x)
            if where is None:
                continue
            args = [str(d) for d in x.shape]
            if x.dtype != torch.float32:
                args.append(f"dtype=torch.{dtype_name(x.dtype)}")
            example = f"torch.randn({', '.join(args)})"
            raise FunctionCheckValueError(
                f"{self.call}: {self.labels.get(i, f'input {i}')} holds non-finite values "
                f"({where_text(where)}), so "
                f"the values of its gradient cannot be checked.\n"
                f"  The values are checked against central differences of forward, and at a "
                f"NaN or inf those differences are NaN whatever backward returns: the test "
                f"would fail a correct backward. (The count, shapes, dtypes and devices of "
                f"what backward returns were checked, and are right.)\n"
                + (parameter_fix(self.labels[i], "to finite values") if i in self.labels
                   else f"  Fix: check at finite inputs, e.g. {example}."))

    def _check_finite_outputs(self, inputs: tuple[Any, ...], flat: Sequence[Any],
                              pos: list[int], dtype: torch.dtype) -> None:
        """Refuses a point where forward's outputs hold NaN or inf. See NOTE [non-finite
        values]."""
        for k in pos:
            where = non_finite(flat[k])
            if where is None:
                continue
            name = "the output of fn" if len(flat) == 1 else f"output {k} of fn"
            others = [j for j, a in enumerate(inputs)
                      if j not in self.diff and non_finite(a) is not None]
            cause = (
                f" Input{'s' if len(others) > 1 else ''} {joined(others)}, not differentiated, "
                f"hold{'' if len(others) > 1 else 's'} NaN or inf too."
                if others else ""
            )
            raise FunctionCheckValueError(
                f"{self.call}: {name} holds non-finite values at these inputs (in "
                f"{dtype_name(dtype)}: {where_text(where)}), so the values of the gradients "
                f"cannot be checked.\n"
                f"  The values are checked against central differences of forward, and "
                f"differences of NaN or inf are NaN whatever backward returns: the test would "
                f"fail a correct backward. (The count, shapes, dtypes and devices of what "
                f"backward returns were checked, and are right.){cause}\n"
                f"  Fix: check at inputs where forward's outputs are finite (for log or sqrt, "
                f"positive inputs such as torch.rand(...) + 0.1)."
            )

    def check_values(self, *, eps: float, atol: float | None, rtol: float | None) -> _ValueResult:
        notes: list[str] = []
        if any(self.inputs[i].device.type == "meta" for i in self.diff):
            notes.append("values not checked: inputs on the meta device hold no numbers")
            return _ValueResult({}, None, eps, atol or 0.0, rtol or 0.0, notes)
        wide = tuple(widen(a) for a in self.inputs)
        widened = any(w is not a for w, a in zip(wide, self.inputs))
        try:
            dtype = value_dtype(wide, self.diff)
            probes, grid, probe_eps = self._probe(wide, eps)
        except Exception as exc:
            if not widened or isinstance(exc, FunctionCheckError):
                raise  # fn failed in its own dtype (the user's error, untouched), or ours
            dtype = value_dtype(self.inputs, self.diff)
            low_eps = max(eps, torch.finfo(real_dtype(dtype)).eps ** (1 / 3))
            notes.append(
                f"values checked in {dtype_name(dtype)}, not float64: fn raised "
                f"{type(exc).__name__} on float64 copies of the inputs ({_first_line(exc)}); "
                f"eps raised to {low_eps:.3g}"
            )
            eps = low_eps
            probes, grid, probe_eps = self._probe(self.inputs, eps)
        if grid is not None:
            notes.append(
                f"values checked at {dtype_name(grid)}'s precision: fn's {dtype_name(dtype)} "
                f"outputs lie on {dtype_name(grid)}'s grid (it computes in "
                f"{dtype_name(grid)} inside), so finite differences carry its rounding; eps "
                f"raised to {probe_eps:.3g}"
            )
            dtype, eps = grid, probe_eps
        d_atol, d_rtol = DEFAULT_TOLERANCES.get(real_dtype(dtype), (1e-5, 1e-2))
        atol_ = d_atol if atol is None else atol
        rtol_ = d_rtol if rtol is None else rtol
        errors: dict[int, tuple[float, float]] = {}
        unit = torch.finfo(real_dtype(dtype)).eps
        inputs, pos = self._at

        def fails(p: Probe) -> bool:
            err = abs(p.lhs - p.rhs)
            return not math.isfinite(err) or err > atol_ + rtol_ * p.size + p.noise

        def refined(p: Probe, at: Any) -> Probe:
            """NOTE [a smaller step]: the differences of a failed probe may not have
            converged. A smaller step's probe stands in for it where it passes, or where
            the original's differences are not finite (the step left forward's domain)."""
            q = smaller_step(p, at, eps, atol_, rtol_, unit)
            if q is None or (fails(q) and math.isfinite(p.lhs - p.rhs)):
                return p
            return q

        for i in self.diff:
            rows = list(probes[i])
            at = (lambda xi, i=i: self._outputs_at(inputs, i, xi, pos))  # noqa: E731
            first = [p for p in rows if fails(p)]
            rows = [refined(p, at) if fails(p) else p for p in rows]
            errors[i] = (max(abs(p.lhs - p.rhs) for p in rows),
                         max(abs(p.lhs - p.rhs) / p.size if p.size > 0 else 0.0 for p in rows))
            failed = [k for k, p in enumerate(rows) if fails(p)]
            if not failed:
                if first:
                    notes.append(
                        f"{self.labels.get(i, f'input {i}')}: the central differences "
                        f"converged only at a step of "
                        f"{max(p.step for p in rows if p.step < eps):.3g} (forward curves "
                        f"strongly at these inputs)")
                continue
            p = rows[failed[0]]
            partner = swapped_partner(i, probes, lambda q: not fails(q))
            if partner is not None and not {i, partner} & set(self.labels):
                raise FunctionCheckError(swap_message(
                    self.call, self.fn, self.is_function, i, partner,
                    shape_str(tuple(self.inputs[i].shape))))
            kink = find_kink(p, at, eps, atol_ + rtol_ * p.size + p.noise, unit)
            # (the point is refused, not backward, where the kink explains the error: NOTE
            # [kinks])
            tol = atol_ + rtol_ * p.size + p.noise
            if isinstance(kink, Kink) and abs(p.lhs - p.rhs) <= 2 * kink.explains + tol:
                kink = replace(kink, hidden=hidden_error(
                    p, kink, at, lambda c, i=i: self._vjp_at(i, p.x, c), p.step or eps, tol))
                if kink.hidden is None:
                    raise FunctionCheckValueError(kink_message(
                        self.call, self.labels.get(i, i), self.inputs[i], kink, len(pos), eps))
            if i in self.summed:  # (a shape torch summed explains the wrong values)
                raise FunctionCheckError(self.summed[i])
            conj = conjugated(rows, i, at, lambda q: not fails(q))  # (conjugation missed)
            raise FunctionCheckError(value_message(
                self.call, self.fn, self.is_function, self.labels.get(i, i), rows, p, dtype,
                p.step, atol_, rtol_, kink, conj))
        return _ValueResult(errors, dtype, eps, atol_, rtol_, notes)

    def _probe(self, inputs: tuple[Any, ...], eps: float
               ) -> tuple[dict[int, list[Probe]], torch.dtype | None, float]:
        """The dot-product probes; and the narrower dtype fn computes in inside (its outputs
        lie on that dtype's grid, :func:`output_grid`), with the step raised for it, or
        None and ``eps``."""
        leaves = {i: inputs[i].detach().clone().requires_grad_(True) for i in self.diff}
        with torch.enable_grad():
            out = self._forward(*_fresh_args(inputs, leaves))
        flat = pytree.tree_flatten(out)[0]
        pos = [k for k, o in enumerate(flat) if isinstance(o, Tensor) and o.requires_grad]
        outputs = [flat[k] for k in pos]
        self._at = (inputs, pos)  # (where the probes were taken: a failed one's second look)
        self._check_finite_outputs(inputs, flat, pos, value_dtype(inputs, self.diff))
        grid = self._grid_off_the_inputs(inputs, pos)
        # (outputs of a narrower dtype than the inputs, x.float() ** 2: their own rounding
        # is what the finite differences carry, as for a forward computing in it inside)
        widest = torch.finfo(real_dtype(value_dtype(inputs, self.diff))).eps
        for o in outputs:
            if o.is_floating_point() or o.is_complex():
                own = real_dtype(o.dtype)
                if torch.finfo(own).eps > max(widest, torch.finfo(grid).eps if grid else 0.0):
                    grid = own
        unit_floor = 0.0
        if grid is not None:
            unit_floor = torch.finfo(grid).eps
            eps = max(eps, unit_floor ** (1 / 3))
        result: dict[int, list[Probe]] = {i: [] for i in self.diff}
        for p in range(PROBES):
            cots = [randn_like(o, self.gen) for o in outputs]
            ts = {i: randn_like(leaves[i], self.gen) for i in self.diff}
            with torch.no_grad():  # (forward's first: they weight the cotangents)
                sides = {i: tuple(self._outputs_at(inputs, i, leaves[i].detach() + e * ts[i], pos)
                                  for e in (eps, -eps)) for i in self.diff}
            cots = balanced(cots, [sides[i] for i in self.diff],
                            max(torch.finfo(real_dtype(value_dtype(inputs, self.diff))).eps,
                                unit_floor))
            if p > 0:  # a graph of its own: backward runs once per forward, as in torch
                with torch.enable_grad():
                    out = self._forward(*_fresh_args(inputs, leaves))
                outputs = [pytree.tree_flatten(out)[0][k] for k in pos]
            # (copies: a backward may scale its grad_output in place, which must not move
            # the cotangents the dot-product test reads afterwards)
            grads = torch.autograd.grad(outputs, [leaves[i] for i in self.diff],
                                        [c.clone() for c in cots], allow_unused=True)
            every = {i: g for i, g in zip(self.diff, grads) if g is not None}
            for i, g in zip(self.diff, grads):
                x, t = leaves[i].detach(), ts[i]
                if g is None:
                    g = torch.zeros_like(x)
                rhs = inner(t, g)
                f_plus, f_minus = sides[i]
                jt = [(a - b) / (2 * eps) for a, b in zip(f_plus, f_minus)]
                lhs = sum((inner(c, j) for c, j in zip(cots, jt)), 0.0)
                # (the scale of each side's terms, not the product of the norms: that is
                # sqrt(n) times larger, and let a backward wrong in one element of many, or
                # by a few percent at float32's tolerance, pass; NOTE [the dot-product test])
                g_size = max(spread([t], [g]), NORM_SHARE * norm([t]) * norm([g]))
                size = max(spread(cots, jt), g_size, NORM_SHARE * paired_norm(cots, jt))
                unit = max(torch.finfo(real_dtype(x.dtype)).eps, unit_floor)
                level = [a.detach().abs() + b.detach().abs() for a, b in zip(f_plus, f_minus)]
                noise = 10 * unit * spread(cots, level) / (2 * eps)
                result[i].append(Probe(lhs=lhs, rhs=rhs, size=size, noise=noise, x=x, t=t,
                                       cots=cots, g_size=g_size, step=eps, grads=every))
        return result, grid, eps

    def _grid_off_the_inputs(self, inputs: tuple[Any, ...], pos: list[int]
                             ) -> torch.dtype | None:
        """The narrower dtype ``fn`` computes in inside (:func:`output_grid`), read off its
        outputs at inputs moved off every narrower grid: at the inputs themselves (float32
        values widened, or round numbers) a forward that only moves or scales them returns
        values on float32's, even bfloat16's, grid too. One more call of ``fn``."""
        gen = torch.Generator().manual_seed(1)
        moved = list(inputs)
        for i in self.diff:
            x = inputs[i]
            step = torch.rand(x.shape, generator=gen, dtype=torch.float64).to(x.dtype)
            moved[i] = x.detach() + (1e-3 * (x.detach().abs() + 1)) * (0.5 + step)
        try:
            with torch.no_grad():
                flat = pytree.tree_flatten(self._forward(*_fresh_args(tuple(moved), {})))[0]
        except Exception:  # noqa: BLE001 - fn need not run off the user's point: no grid read
            return None
        return output_grid([flat[k] for k in pos if k < len(flat)])

    def _vjp_at(self, i: int, xi: Tensor, cots: list[Tensor]) -> Tensor:
        """Backward's gradient for input ``i`` at ``xi`` for ``cots`` (NOTE [kinks])."""
        (inputs, pos), leaf = self._at, xi.detach().clone().requires_grad_(True)
        with torch.enable_grad():
            flat = pytree.tree_flatten(self._forward(*_fresh_args(inputs, {i: leaf})))[0]
            used = [(flat[k], c.clone()) for k, c in zip(pos, cots) if flat[k].requires_grad]
            g = torch.autograd.grad([o for o, _ in used], [leaf], [c for _, c in used],
                                    allow_unused=True)[0] if used else None
        return torch.zeros_like(xi) if g is None else g

    def _outputs_at(self, inputs: tuple[Any, ...], i: int, xi: Tensor,
                    pos: list[int]) -> list[Tensor]:
        args = [xi if j == i else (a.detach().clone() if isinstance(a, Tensor) else a)
                for j, a in enumerate(inputs)]
        flat = pytree.tree_flatten(self._forward(*args))[0]
        if len(flat) <= max(pos) or not all(isinstance(flat[k], Tensor) for k in pos):
            raise FunctionCheckError(
                f"{self.call}: fn returned differently structured outputs for a slightly "
                f"changed input {i}; finite differences need a forward whose outputs keep "
                f"their structure and shapes."
            )
        return [flat[k] for k in pos]


# ---------------------------------------------------------------------------------------
# Small helpers


def callable_name(fn: Any) -> str:
    name = getattr(fn, "__name__", None) or type(fn).__name__
    return str(name)


def differentiated(inputs: tuple[Any, ...]) -> list[int]:
    """See NOTE [which inputs are differentiated]."""
    tensors = [(i, a) for i, a in enumerate(inputs) if isinstance(a, Tensor)]
    chosen = [i for i, a in tensors if a.requires_grad]
    if chosen:
        return chosen
    return [i for i, a in tensors if a.is_floating_point() or a.is_complex()]


def _fresh_args(inputs: Sequence[Any], leaves: dict[int, Tensor]) -> list[Any]:
    """Forward's arguments: clones, so that forward (even an in-place one) touches no
    tensor of the caller's and no leaf of ours."""
    args = []
    for j, a in enumerate(inputs):
        if j in leaves:
            args.append(leaves[j].clone())
        elif isinstance(a, Tensor):
            args.append(a.detach().clone())
        else:
            args.append(a)
    return args


def _bind_forward_args(fn: type[torch.autograd.Function], args: Sequence[Any]) -> tuple[Any, ...]:
    """forward's inputs as ``Function.apply`` passes them (it binds defaults when
    ``setup_context`` is defined)."""
    if fn.setup_context is torch.autograd.Function.setup_context:
        return tuple(args)
    try:
        bound = inspect.signature(fn.forward).bind(*args)
        bound.apply_defaults()
    except (TypeError, ValueError):
        return tuple(args)
    return tuple(bound.args)


def describe_arg(a: Any) -> str:
    if isinstance(a, Tensor):
        return f"Tensor{shape_str(a.shape)} {dtype_name(a.dtype)}"
    return type(a).__name__


def ok_text(flag: bool | None) -> str:
    return "-" if flag is None else ("ok" if flag else "WRONG")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:120] if text else type(exc).__name__

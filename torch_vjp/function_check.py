"""Checks the backward of a custom ``torch.autograd.Function``.

:func:`check_function` runs a Function's forward, calls its backward through autograd with
random ``grad_outputs``, and checks what backward returned against what autograd needs: one
gradient per forward input, each with exactly its input's shape, dtype and device, ``None``
only where no gradient is needed, and values that agree with finite differences of forward
(the dot-product test ``<J t, c> == <t, J^T c>``, in float64).

How the checks work (the recorder that sees what backward returned before torch's own
validation, non-finite inputs, which inputs are differentiated) is in
:mod:`torch_vjp._function_checker`.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.utils import _pytree as pytree

from torch_vjp._backward_check import dtype_name
from torch_vjp._errors import (
    FunctionCheckError,
    FunctionCheckTypeError,
    FunctionCheckValueError,
    a_type,
    shape_str,
    with_article,
)
from torch_vjp._function_calls import kept
from torch_vjp._function_params import module_parameters
from torch_vjp._function_checker import (
    DEFAULT_TOLERANCES,
    PROBES,
    Checker,
    callable_name,
    describe_arg,
    differentiated,
    ok_text,
)

__all__ = [
    "check_function",
    "FunctionCheckReport",
    "InputCheck",
    "FunctionCheckError",
    "FunctionCheckTypeError",
    "FunctionCheckValueError",
]


@dataclass(frozen=True)
class InputCheck:
    """The result of :func:`check_function` for one input of ``fn``.

    Attributes:
        index: Position of the input in ``check_function(fn, *inputs)``.
        description: The input: ``"Tensor(4, 3) float32"``, or its type name (``"float"``).
        requires_grad: Whether the input was differentiated (see NOTE [which inputs are
            differentiated]).
        grad_shape: Shape of the gradient that backward returned for it (for a
            ``torch.autograd.Function`` subclass: the raw value, before torch's own
            validation; for a callable: the gradient autograd computed through it), or
            ``None`` where there was none.
        shape_ok: The gradient had the input's shape, or one that shape broadcasts to, which
            torch sums down to it (``None``: nothing to check).
        dtype_ok: The gradient had the input's dtype (``None``: nothing to check).
        device_ok: The gradient was on the input's device (``None``: nothing to check).
        max_error: Largest ``|<J t, c> - <t, J^T c>|`` over the random probes, where
            ``J t`` comes from central differences of forward and ``J^T c`` from backward
            (``None`` for inputs that are not differentiated).
        max_rel_error: ``max_error`` relative to the size of the two products: the scale
            of their terms, ``max(|(J t) * c|, |t * (J^T c)|)`` (elementwise products; NOTE
            [the dot-product test]).
    """

    index: int
    description: str
    requires_grad: bool
    grad_shape: tuple[int, ...] | None
    shape_ok: bool | None
    dtype_ok: bool | None
    device_ok: bool | None
    max_error: float | None
    max_rel_error: float | None


@dataclass(frozen=True)
class FunctionCheckReport:
    """What :func:`check_function` checked, returned when every check passed.

    Attributes:
        name: The checked ``fn``, as messages name it.
        functions: The custom Functions whose backward was checked, as
            ``"MyFunc.backward"`` (with ``" x N"`` when it ran N times).
        inputs: One :class:`InputCheck` per input of ``fn``.
        parameters: One :class:`InputCheck` per parameter of a module ``fn`` uses that
            requires grad and feeds a custom Function, checked like an input (its
            ``index`` counts parameters, its ``description`` starts with its name,
            ``"Model.fc.weight: Tensor(3, 4) float32"``; NOTE [parameters of fn's modules]
            in ``torch_vjp._function_params``).
        value_dtype: The dtype the values were checked in (float64, or the inputs' own
            dtype where ``fn`` could not run in float64; the narrower dtype ``fn`` computes
            in inside where its outputs lie on that dtype's grid, checked with that dtype's
            step and tolerances; see ``notes``), ``None`` when the values were not checked.
        eps: The finite-difference step used.
        atol: Absolute tolerance of the dot-product test.
        rtol: Relative tolerance of the dot-product test.
        probes: Random (tangent, cotangent) pairs per differentiated input.
        notes: Anything the reader should know about how the check ran.
    """

    name: str
    functions: tuple[str, ...]
    inputs: tuple[InputCheck, ...]
    value_dtype: torch.dtype | None
    eps: float
    atol: float
    rtol: float
    probes: int
    notes: tuple[str, ...] = ()
    parameters: tuple[InputCheck, ...] = ()

    @property
    def max_error(self) -> float:
        """Largest dot-product error over all differentiated inputs (0.0 if none)."""
        errors = [row.max_error for row in (*self.inputs, *self.parameters)
                  if row.max_error is not None]
        return max(errors, default=0.0)

    def __str__(self) -> str:
        lines = [f"torch_vjp.check_function({self.name}): passed"]
        lines.append(f"  backward checked: {', '.join(self.functions)}")
        if self.value_dtype is not None:
            lines.append(
                f"  values: dot-product test <J t, c> == <t, J^T c> against central "
                f"differences in {dtype_name(self.value_dtype)}, eps={self.eps:g}, "
                f"{self.probes} probes per input, |error| <= atol + rtol * size with "
                f"atol={self.atol:g}, rtol={self.rtol:g}"
            )
        for note in self.notes:
            lines.append(f"  note: {note}")
        header = ("index", "input", "needs grad", "returned", "shape", "dtype", "device",
                  "max abs err", "max rel err")
        rows = [header]
        labelled = [(str(r.index), r) for r in self.inputs]
        labelled += [(f"param {r.index}", r) for r in self.parameters]
        for label, r in labelled:
            rows.append((
                label,
                r.description,
                "yes" if r.requires_grad else "no",
                "-" if r.grad_shape is None else shape_str(r.grad_shape),
                ok_text(r.shape_ok),
                ok_text(r.dtype_ok),
                ok_text(r.device_ok),
                "-" if r.max_error is None else f"{r.max_error:.2e}",
                "-" if r.max_rel_error is None else f"{r.max_rel_error:.2e}",
            ))
        widths = [max(len(row[c]) for row in rows) for c in range(len(header))]
        for row in rows:
            lines.append("  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
        return "\n".join(lines)


def check_function(
    fn: type[torch.autograd.Function] | Callable[..., Any],
    *inputs: Any,
    atol: float | None = None,
    rtol: float | None = None,
    eps: float = 1e-6,
) -> FunctionCheckReport:
    """Checks a custom ``torch.autograd.Function``'s backward: one backward in the inputs'
    dtype, then finite differences in float64 (two forwards per input and probe).

    Backward computes a vector-Jacobian product: given ``grad_output`` = dL/d(output) it
    returns dL/d(input) = ``grad_output`` times the Jacobian d(output)/d(input), one tensor
    per forward input, each with exactly that input's shape, dtype and device. It never
    returns the Jacobian itself.

    Runs forward once on copies of ``inputs`` and backward once through autograd with random
    ``grad_outputs``, seeing backward's return value before torch's own validation (which
    silently sums some wrong shapes away and casts wrong dtypes). Then checks the values with
    the dot-product test ``<J t, c> == <t, J^T c>`` for random tangents ``t`` and cotangents
    ``c``: ``J t`` from central finite differences of forward in float64, ``J^T c`` from
    backward. Costs one forward and one backward in the inputs' dtype, then, per
    differentiated input and probe, two forwards and (shared across inputs) one backward in
    float64. Randomness comes from a private, fixed-seed generator: the result is
    reproducible and the global RNG is untouched. Nothing of the caller's is modified.

    Tensor inputs with ``requires_grad=True`` are differentiated; if none has it, every
    floating-point or complex tensor input is. Forward must be deterministic for the finite
    differences to mean anything.

    Args:
        fn: A ``torch.autograd.Function`` subclass (its ``apply`` is called), or a callable
            that uses one or more custom Functions; for a callable, every custom Function
            between its inputs and outputs is checked, and the values are those of the whole
            callable. The parameters that require grad of the modules it uses (itself, a
            module in its closure or among its inputs) and that feed a custom Function are
            checked like inputs (``report.parameters``), without being written into; a
            tensor it captures outside a module is not, and the report says so.
        *inputs: The arguments of forward (for a subclass) or of ``fn``, tensors and
            anything else, in order. Floating-point tensors are copied to float64 for the
            value check.
        atol: Absolute tolerance of the dot-product test. Default: 1e-8 in float64.
        rtol: Relative tolerance of the dot-product test, relative to the scale of its
            terms, ``max(|(J t) * c|, |t * (J^T c)|)`` (elementwise products, sqrt(n) times
            smaller than the product of the norms). Default: 1e-5 in float64.
        eps: Step of the central finite differences (in float64). If ``fn`` cannot run in
            float64 (it raised there), the values are checked in the inputs' own dtype with
            a step of at least ``finfo(dtype).eps ** (1/3)`` and looser default tolerances,
            and the report says so.

    Returns:
        A :class:`FunctionCheckReport`: per input, whether shape, dtype and device were
        right, and the largest dot-product error; ``str(report)`` is a table.

    Raises:
        FunctionCheckError: On the first failed check, saying which gradient is wrong, how,
            what backward must return instead and why, and the fix where the mistake is
            recognisable (a Jacobian returned instead of the product, an extra batch
            dimension, a missing gradient, ...).
        FunctionCheckTypeError: ``fn`` is neither a Function subclass nor callable, or
            ``eps``, ``atol`` or ``rtol`` is not a real number (a bool or a string).
        FunctionCheckValueError: ``eps``, ``atol`` or ``rtol`` is not finite, or negative, no
            input can be differentiated, or the values cannot be checked because a
            differentiated input, or an output of forward at the inputs, holds NaN or inf
            (see NOTE [non-finite values]), or because forward has a kink at the inputs
            (relu at 0: its one-sided differences disagree, NOTE [kinks] in
            ``torch_vjp._function_verdict``). The count, shape, dtype and device checks run
            before these.
        Exception: Whatever ``fn``'s own forward or backward raises, untouched.

    Example:
        >>> class Square(torch.autograd.Function):
        ...     @staticmethod
        ...     def forward(ctx, x):
        ...         ctx.save_for_backward(x)
        ...         return x * x
        ...     @staticmethod
        ...     def backward(ctx, grad_output):
        ...         (x,) = ctx.saved_tensors
        ...         return 2 * x * grad_output        # dL/dx: the shape of x
        >>> report = tv.check_function(Square, torch.randn(4, 3))
        >>> report.inputs[0].shape_ok, report.max_error < 1e-6
        (True, True)
        >>> class Forgot2(Square):
        ...     @staticmethod
        ...     def backward(ctx, grad_output):
        ...         (x,) = ctx.saved_tensors
        ...         return x * grad_output            # the factor 2 is missing
        >>> try:
        ...     tv.check_function(Forgot2, torch.randn(4, 3))
        ... except tv.FunctionCheckError as e:
        ...     print(str(e).splitlines()[0])  # doctest: +ELLIPSIS
        torch_vjp.check_function(Forgot2): the gradient that Forgot2.backward returns ... does not
        match finite differences of forward.

        A module whose parameter feeds the Function: the parameter is checked too.

        >>> class Scaled(torch.nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.w = torch.nn.Parameter(torch.randn(3))
        ...     def forward(self, x):
        ...         return Square.apply(x * self.w)
        >>> report = tv.check_function(Scaled(), torch.randn(4, 3))
        >>> len(report.parameters), report.parameters[0].description.split(":")[0]
        (1, 'Scaled.w')
    """
    is_function = isinstance(fn, type) and issubclass(fn, torch.autograd.Function)
    name = fn.__name__ if is_function else callable_name(fn)
    call = f"torch_vjp.check_function({name})"
    if isinstance(fn, torch.autograd.Function):
        raise FunctionCheckTypeError(
            f"{call}: got an instance of {type(fn).__name__}; pass the class itself: "
            f"torch_vjp.check_function({type(fn).__name__}, ...). Custom Functions are "
            f"used through their static methods (MyFunc.apply(x)), never instantiated."
        )
    if isinstance(fn, type) and not is_function:
        # (calling a class makes an instance: its constructor would run on the inputs)
        raise FunctionCheckTypeError(
            f"{call}: got the class {fn.__name__}, which is not a torch.autograd.Function "
            f"subclass: calling it would construct {with_article(fn.__name__)}, not compute "
            f"with one. Fix: pass a torch.autograd.Function subclass, or a callable that "
            f"uses one: an instance (torch_vjp.check_function({fn.__name__}(...), x)) or "
            f"a function."
        )
    if not is_function and not callable(fn):
        raise FunctionCheckTypeError(
            f"{call}: fn must be a torch.autograd.Function subclass or a callable that uses "
            f"one, but got {type(fn).__name__}."
        )
    eps = _check_positive(call, "eps", eps, allow_zero=False)
    if atol is not None:
        atol = _check_positive(call, "atol", atol, allow_zero=True)
    if rtol is not None:
        rtol = _check_positive(call, "rtol", rtol, allow_zero=True)

    run = fn.apply if is_function else fn
    diff = differentiated(inputs)
    if not diff and is_function:
        raise FunctionCheckValueError(_nothing_to_check(call, name, inputs))
    # (every call of forward with the caller's draws, and the caller's RNG state and module
    # buffers put back: NOTE [check_function's draws]; grad mode on and inference mode off
    # whatever the caller's: under torch.no_grad() no output required grad, and a correct
    # Function was refused for it)
    with torch.inference_mode(False), torch.enable_grad(), kept(fn, is_function, inputs) as draws:
        # (the parameters of fn's modules that feed a custom Function are checked as inputs
        # after fn's own: NOTE [parameters of fn's modules])
        params = None if is_function else module_parameters(fn, inputs, diff, draws.reset)
        if not diff and (params is None or not params.tensors):
            raise FunctionCheckValueError(_nothing_to_check(call, name, inputs))
        every, every_diff, labels = inputs, diff, {}
        if params is not None and params.tensors:
            n = len(inputs)
            run = params.run
            every = inputs + params.tensors
            every_diff = diff + [n + k for k in range(len(params.tensors))]
            labels = {n + k: f"parameter {name}" for k, name in enumerate(params.names)}
        checker = Checker(call=call, fn=fn, is_function=is_function, run=run, inputs=every,
                          diff=every_diff, draws=draws, labels=labels)
        structure = checker.check_structure()
        checker.check_finite_inputs()
        values = checker.check_values(eps=eps, atol=atol, rtol=rtol)

    rows = []
    for i, arg in enumerate(every):
        grad = structure.grads.get(i)
        err = values.errors.get(i)
        is_tensor_grad = isinstance(grad, Tensor)
        checked = isinstance(arg, Tensor) and is_tensor_grad
        rows.append(InputCheck(
            index=i if i < len(inputs) else i - len(inputs),
            description=describe_arg(arg) if i < len(inputs) else
            f"{labels[i].removeprefix('parameter ')}: {describe_arg(arg)}",
            requires_grad=i in every_diff,
            grad_shape=tuple(grad.shape) if is_tensor_grad else None,
            shape_ok=(tuple(grad.shape) == tuple(arg.shape) or i in checker.summed)
            if checked else None,  # (checker.summed: a shape torch sums down, judged so)
            dtype_ok=(grad.dtype == arg.dtype) if checked else None,
            device_ok=(grad.device == arg.device) if checked else None,
            max_error=None if err is None else err[0],
            max_rel_error=None if err is None else err[1],
        ))
    return FunctionCheckReport(
        name=name,
        functions=structure.functions,
        inputs=tuple(rows[:len(inputs)]),
        parameters=tuple(rows[len(inputs):]),
        value_dtype=values.dtype,
        eps=values.eps,
        atol=values.atol,
        rtol=values.rtol,
        probes=PROBES,
        notes=tuple(values.notes) + _unchecked_note(params),
    )


def _unchecked_note(params: Any) -> tuple[str, ...]:
    """NOTE [parameters of fn's modules]: captured tensors whose gradients went unchecked."""
    shapes = getattr(params, "unchecked", ())
    if not shapes:
        return ()
    listed = ", ".join(shape_str(s) for s in shapes)
    many = len(shapes) > 1
    return (
        f"gradients not checked for {len(shapes)} tensor{'s' if many else ''} that fn "
        f"captures outside a module ({listed}): {'they require' if many else 'it requires'} "
        f"grad and feed{'' if many else 's'} a custom Function, but cannot be moved for "
        f"finite differences; pass {'them' if many else 'it'} as input{'s' if many else ''} "
        f"of fn to check {'their' if many else 'its'} gradient{'s' if many else ''}",
    )



def _nothing_to_check(call: str, name: str, inputs: tuple[Any, ...]) -> str:
    """No input is a floating-point or complex tensor, and no parameter of fn's modules
    feeds a custom Function."""
    nested = [i for i, a in enumerate(inputs)
              if not isinstance(a, Tensor) and any(
                  isinstance(t, Tensor) and (t.is_floating_point() or t.is_complex())
                  for t in pytree.tree_leaves(a))]
    lines = [
        f"{call}: none of the {len(inputs)} inputs is a floating-point or complex tensor, so "
        f"there is no gradient to check.",
    ]
    if nested:
        i = nested[0]
        lines.append(
            f"  Input {i} is {a_type(inputs[i])} holding tensors, but check_function "
            f"differentiates only the tensors passed directly as arguments (as torch.autograd."
            f"Function.apply tracks only those).\n"
            f"  Fix: pass them as separate arguments, e.g. torch_vjp.check_function(lambda a, "
            f"b: fn([a, b]), a, b)."
        )
    else:
        lines.append(
            f"  Fix: pass forward's arguments after fn, e.g. torch_vjp.check_function({name}, "
            f"torch.randn(4, 3))."
        )
    return "\n".join(lines)




def _default(name: str) -> float:
    """The default of ``eps``, ``atol`` or ``rtol`` in float64, named in the fix of a mistyped
    one: ``eps`` from the signature, the tolerances from the checker's table."""
    if name == "eps":
        return check_function.__kwdefaults__["eps"]
    atol, rtol = DEFAULT_TOLERANCES[torch.float64]
    return atol if name == "atol" else rtol


def _check_positive(call: str, name: str, value: Any, *, allow_zero: bool) -> float:
    """``value`` as a float, checked finite and positive (or zero, with ``allow_zero``). A real
    number or a real 0-d tensor; never a bool (``rtol=True`` was a tolerance of 1, under which
    no check fails) or a string (``float("1e-6")`` parses, but a string is a mistake)."""
    real_tensor = (isinstance(value, Tensor) and value.numel() == 1
                   and not value.is_complex() and value.dtype != torch.bool)
    if isinstance(value, bool) or not (isinstance(value, numbers.Real) or real_tensor):
        raise FunctionCheckTypeError(
            f"{call}: {name} must be a number, but got {type(value).__name__} "
            f"({value!r}). Fix: pass a float, e.g. {name}={_default(name)}."
        )
    number = float(value)
    if not math.isfinite(number) or number < 0 or (number == 0 and not allow_zero):
        raise FunctionCheckValueError(
            f"{call}: {name} must be a finite number "
            f"{'>= 0' if allow_zero else '> 0'}, but got {value!r}."
        )
    return number


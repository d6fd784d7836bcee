"""Exception and warning classes, and the small formatting helpers their messages share.

Every class derives from :class:`TorchVJPError` *and* from the builtin that torch itself
would raise for the same mistake, so ``except RuntimeError:`` around existing code keeps
working after switching to torch_vjp.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = [
    "TorchVJPError",
    "GradOutputsError",
    "GradOutputsTypeError",
    "FunctionCheckError",
    "StrategyError",
    "JacobianMemoryError",
    "PerSampleError",
    "TorchVJPWarning",
    "GradOutputsWarning",
    "JacobianWarning",
    "shape_str",
]


class TorchVJPError(Exception):
    """Base class of every error torch_vjp raises for a mistake it can foresee."""


class GradOutputsError(TorchVJPError, RuntimeError):
    """``grad_outputs`` (or ``gradient``, ``grad_tensors``, cotangents) do not fit the outputs.

    Raised for shape, structure, dtype (complex vs real), device, batch-dimension and count
    mismatches, for non-scalar outputs given no ``grad_outputs``, and for outputs that do
    not require grad.
    """


class GradOutputsTypeError(GradOutputsError, TypeError):
    """A :class:`GradOutputsError` for an argument of the wrong type (torch raises TypeError)."""


class FunctionCheckError(TorchVJPError, RuntimeError):
    """A custom ``torch.autograd.Function``'s backward returned something wrong."""


class StrategyError(TorchVJPError, ValueError):
    """An unknown strategy name, or a strategy that cannot serve this call."""


class JacobianMemoryError(TorchVJPError, MemoryError):
    """The requested Jacobian cannot fit the memory budget; raised before allocating."""


class PerSampleError(TorchVJPError, RuntimeError):
    """Per-sample gradients are not defined for this model (a layer mixes examples)."""


class TorchVJPWarning(UserWarning):
    """Base class of torch_vjp's warnings."""


class GradOutputsWarning(TorchVJPWarning):
    """torch accepted ``grad_outputs`` but did something the caller may not expect.

    For example it silently cast a float64 or integer ``grad_outputs`` to a float32 output's
    dtype, or ignored extra ``grad_outputs``.
    """


class JacobianWarning(TorchVJPWarning):
    """A Jacobian computation fell back to a slower strategy, or an output does not depend
    on an input through autograd (its block is zeros)."""


def shape_str(shape: Sequence[int]) -> str:
    """Formats a shape as a plain tuple: ``(4, 4)``, ``(4,)``, ``()``."""
    dims = tuple(int(d) for d in shape)
    if len(dims) == 1:
        return f"({dims[0]},)"
    return "(" + ", ".join(str(d) for d in dims) + ")"


# Tracebacks name the public path users import from: torch_vjp.GradOutputsError.
for _cls in (
    TorchVJPError,
    GradOutputsError,
    FunctionCheckError,
    StrategyError,
    JacobianMemoryError,
    PerSampleError,
    TorchVJPWarning,
    GradOutputsWarning,
    JacobianWarning,
):
    _cls.__module__ = "torch_vjp"
del _cls

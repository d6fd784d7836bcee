"""torch_vjp: explicit Jacobians, batched VJPs/JVPs, per-sample gradients, and
``grad_outputs`` errors that say what was wrong, what was expected, why, and the fix.

``import torch_vjp`` also makes ``torch.vjp`` this same module.
"""

from __future__ import annotations

import sys as _sys

import torch as _torch

from torch_vjp._errors import (
    FunctionCheckError,
    FunctionCheckTypeError,
    FunctionCheckValueError,
    FunctionCheckWarning,
    GradOutputsError,
    GradOutputsIndexError,
    GradOutputsTypeError,
    GradOutputsValueError,
    GradOutputsWarning,
    JacobianCallError,
    JacobianCallTypeError,
    JacobianMemoryError,
    JacobianNotImplementedError,
    JacobianOptionError,
    JacobianWarning,
    PerSampleError,
    PerSampleTypeError,
    PerSampleValueError,
    StrategyError,
    StrategyNotImplementedError,
    StrategyTypeError,
    TorchVJPError,
    TorchVJPWarning,
)
from torch_vjp._sharded import JacobianShard

from torch_vjp.autograd import backward, check_grad_outputs, checked, grad
from torch_vjp.compare import StrategyComparison, StrategyRow, compare_strategies
from torch_vjp.function_check import FunctionCheckReport, check_function
from torch_vjp.jacobians import batch_jacobian, hessian, jacobian, jacobian_of
from torch_vjp.per_sample import (
    PerSamplePlan,
    accumulate_clipped_grads,
    per_sample_grad_norms,
    per_sample_grads,
    per_sample_plan,
    register_per_sample_rule,
)
from torch_vjp.sparse import jacobian_sparsity, sparse_jacobian
from torch_vjp.transforms import jvp, vjp

__version__ = "0.1.0"

__all__ = [
    # checked autograd (SPEC §1)
    "grad",
    "backward",
    "check_grad_outputs",
    "checked",
    # custom autograd.Function checking (SPEC §2)
    "check_function",
    "FunctionCheckReport",
    # Jacobians (SPEC §3)
    "jacobian",
    "batch_jacobian",
    "jacobian_of",
    "hessian",
    "JacobianShard",
    "jacobian_sparsity",
    "sparse_jacobian",
    # VJP and JVP, batched (SPEC §4)
    "vjp",
    "jvp",
    # per-sample gradients (SPEC §5)
    "per_sample_grads",
    "per_sample_grad_norms",
    "accumulate_clipped_grads",
    "per_sample_plan",
    "PerSamplePlan",
    "register_per_sample_rule",
    # strategy comparison (SPEC §6)
    "compare_strategies",
    "StrategyComparison",
    "StrategyRow",
    # errors and warnings
    "TorchVJPError",
    "GradOutputsError",
    "GradOutputsTypeError",
    "GradOutputsValueError",
    "GradOutputsIndexError",
    "FunctionCheckError",
    "FunctionCheckTypeError",
    "FunctionCheckValueError",
    "StrategyError",
    "StrategyTypeError",
    "StrategyNotImplementedError",
    "JacobianOptionError",
    "JacobianCallError",
    "JacobianCallTypeError",
    "JacobianNotImplementedError",
    "JacobianMemoryError",
    "PerSampleError",
    "PerSampleValueError",
    "PerSampleTypeError",
    "TorchVJPWarning",
    "GradOutputsWarning",
    "FunctionCheckWarning",
    "JacobianWarning",
]

# torch.vjp is this module (SPEC §7): ``torch.vjp.jacobian is torch_vjp.jacobian``.
_self = _sys.modules[__name__]
_sys.modules["torch.vjp"] = _self
_torch.vjp = _self  # type: ignore[attr-defined]

# TORCH_VJP_CHECKED=1 turns checking on for the whole process (SPEC §1).
from torch_vjp._checked_mode import install_from_environment as _install_from_environment

_install_from_environment()
del _install_from_environment

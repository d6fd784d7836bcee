"""What torch refuses, read off its errors: the known refusals of torch.func's vectorised
transforms and of forward mode, for a function that plain autograd runs, so that a strategy
can fall back or explain (:func:`vmap_refusal`, :func:`forward_refusal`); and autograd's
refusal of an in-place write into a differentiated leaf (:func:`writes_into_input`)."""

from __future__ import annotations

__all__ = ["RENORM_FIX", "SPARSE_TANGENT", "VMAP_CAUSES", "double_backward_refusal",
           "forward_fix", "forward_refusal", "mutates_captured", "no_double_backward_fix",
           "refusal_fix", "refusal_kind", "renorms", "reentrant_checkpoint", "reentrant_checkpoint_message",
           "unbatched_op", "vmap_refusal", "writes_into_input"]

import re

#: torch.vmap's refusal of an operator it has no batching rule for, with the operator.
_NO_RULE = re.compile(r"aten::([\w.]+) requires special handling, and does not yet have a "
                      r"batching rule|Batching rule not implemented for aten::([\w.]+)")


#: What each known refusal of torch.func's transforms says, by its kind.
_WHY = {
    "captured": ("f changes a tensor it captured in place (a module in training mode "
                 "updating its running statistics, say)"),
    "randomness": ("f draws random numbers (dropout in training mode, say), which vmap "
                   "refuses by default, since its columns would each draw their own"),
    "setup_context": ("f uses a custom torch.autograd.Function whose forward takes ctx (no "
                      "setup_context staticmethod), which torch.func's transforms cannot run"),
    "no_strides": ("f uses a tensor without strides (a sparse CSR, CSC or BSR tensor), which "
                   "torch.func's transforms cannot take"),
    "saved_hooks": ("f uses saved tensor hooks (torch.utils.checkpoint, "
                    "torch.autograd.graph.saved_tensors_hooks), which torch.func's reverse "
                    "mode does not support"),
    "no_storage": ("f reads a tensor's memory directly (NumPy: .numpy(), np.asarray; "
                   ".data_ptr(); a C extension), which a tensor inside a torch.func transform "
                   "does not have (it holds no storage of its own)"),
    "plain_autograd": ("f runs plain autograd itself (.backward(), .requires_grad_(), "
                       ".retain_grad(), torch.autograd.functional), which torch.func's "
                       "transforms refuse inside the function they transform"),
    "no_vmap": ("f uses a custom torch.autograd.Function without vmap support (no vmap "
                "staticmethod, generate_vmap_rule unset), which torch.vmap cannot batch"),
}

#: The "captured" refusal of an Embedding's max_norm, which renormalises the rows it looks up
#: in place in eval mode too (so eval mode is no fix), and its fix.
_RENORM = ("f changes a tensor it captured in place (an Embedding with max_norm renormalises "
           "the rows it looks up, in eval mode too)")
RENORM_FIX = ("renormalise the table before the call and set the Embedding's max_norm to "
              "None (torch.embedding_renorm_(emb.weight.detach(), idx, max_norm, 2.0) under "
              "torch.no_grad())")


def renorms(err: BaseException) -> bool:
    """Whether ``err`` is torch.func refusing an Embedding's max_norm renormalisation."""
    return isinstance(err, RuntimeError) and "embedding_renorm_" in str(err) and (
        "mutate a captured Tensor" in str(err))


#: Refusals of torch.vmap alone: one product at a time (a loop) runs such a function, so
#: :func:`refusal_kind` does not name them (a batched vjp or jvp falls back to its loop),
#: and only :func:`vmap_refusal` explains them, for a strategy that promised vmap.
_VMAP_ONLY = {"no_vmap": "does not have vmap support"}

#: What forward mode refuses in a sparse COO operand (it has no sparse zero tangent).
SPARSE_TANGENT = ("f multiplies by a sparse tensor, for which torch's forward mode has no "
                  "kernel (its zero tangent)")


#: What usually keeps torch.vmap from batching a function: the one sentence every
#: vmap-to-loop fallback warning quotes.
VMAP_CAUSES = (
    "a custom autograd.Function without setup_context or vmap support, or with .item() or "
    "Python control flow on tensor values in its backward; NumPy calls inside f; an "
    "operator without a batching rule"
)


def refusal_kind(err: BaseException) -> str | None:
    """Which known refusal of torch.func's transforms ``err`` is, of a function plain
    autograd runs: ``"captured"``, ``"randomness"``, ``"setup_context"``, ``"no_strides"``
    (a sparse CSR constant), ``"saved_hooks"`` (checkpointing, in reverse mode),
    ``"no_storage"`` (NumPy inside f, in every torch.func transform, loops too) or
    ``"plain_autograd"`` (f calls ``.backward()``, ``.requires_grad_()`` or
    ``.retain_grad()`` itself); else
    None."""
    if not isinstance(err, RuntimeError):
        return None
    text = str(err)
    if "mutate a captured Tensor" in text:
        return "captured"
    if "randomness error mode" in text:
        return "randomness"
    if "must override the setup_context staticmethod" in text:
        return "setup_context"
    if "Sparse CSR tensors do not have strides" in text:
        return "no_strides"
    if "don't yet support saved tensor hooks" in text:
        return "saved_hooks"
    if "Cannot access data pointer of Tensor that doesn't have storage" in text:
        return "no_storage"
    if ("backward() called inside a functorch transform" in text
            or "call Tensor.requires_grad_() (or perhaps using torch.autograd.functional" in text
            or "call Tensor.retain_grad() inside of a function being transformed" in text):
        return "plain_autograd"
    return None


#: The "setup_context" refusal of a module's full backward hook (or pre-hook): torch wraps
#: the module's inputs and outputs in BackwardHookFunction, an autograd.Function whose
#: forward takes ctx, which torch.func cannot run.
_HOOK = ("f calls a module ({module}) with a full backward hook (register_full_backward_hook "
         "or register_full_backward_pre_hook, on it or on every module), for which torch "
         "wraps its inputs and outputs in BackwardHookFunction, a custom "
         "torch.autograd.Function whose forward takes ctx, which torch.func's transforms "
         "cannot run")
_HOOK_FIX = ("remove the hook for this call (handle.remove() on the handle its register "
             "call returned): 'rev-loop' calls it once per reverse product, 'fwd-loop' not "
             "at all. Eval mode does not remove it.")


def hooked_module(err: BaseException) -> str | None:
    """The class name of the module whose full backward hook torch was setting up where
    ``err`` was raised (torch.utils.hooks.BackwardHook, in its traceback), else None."""
    tb, found = err.__traceback__, None
    while tb is not None:
        code = tb.tb_frame.f_code
        if (code.co_name in ("setup_input_hook", "setup_output_hook")
                and code.co_filename.replace("\\", "/").endswith("torch/utils/hooks.py")):
            hook = tb.tb_frame.f_locals.get("self")
            found = type(getattr(hook, "module", hook)).__name__
        tb = tb.tb_next
    return found


def refusal_fix(err: BaseException) -> str:
    """The fix, besides a strategy that runs f without torch.func, of a known refusal of
    torch.func's transforms (:func:`vmap_refusal`): a sentence's end."""
    if renorms(err):
        return f"{RENORM_FIX}."
    if refusal_kind(err) == "setup_context" and hooked_module(err) is not None:
        return _HOOK_FIX
    return "put the module in eval mode if it is one."


def vmap_refusal(err: BaseException) -> str | None:
    """What torch.func's vectorised transforms refused in ``f``, where ``err`` is one of
    their known refusals of a function plain autograd runs (:func:`refusal_kind`'s, and
    torch.vmap's alone: a custom Function without vmap support), None otherwise."""
    kind = refusal_kind(err)
    if kind is None and isinstance(err, RuntimeError):
        text = str(err)
        kind = next((k for k, said in _VMAP_ONLY.items() if said in text), None)
    if kind == "captured" and renorms(err):
        return _RENORM
    if kind == "setup_context" and (module := hooked_module(err)) is not None:
        return _HOOK.format(module=module)
    return None if kind is None else _WHY[kind]


def unbatched_op(err: BaseException) -> str | None:
    """The operator torch.vmap has no batching rule for, where ``err`` is that refusal
    (``"as_strided_scatter"``), None for any other error."""
    if not isinstance(err, RuntimeError):
        return None
    found = _NO_RULE.search(str(err))
    return None if found is None else (found.group(1) or found.group(2))


#: Forward mode's refusal of a torch operator without a forward-mode formula, with the operator.
_NO_FWD_OP = re.compile(r"Trying to use forward AD with ([\w.]+) that does not support it")

#: Forward mode's refusal of a custom autograd.Function without a jvp staticmethod.
_NO_JVP = "implement the jvp function"

#: Autograd's refusal to differentiate a kernel without a derivative formula, with the
#: kernel: one with no autograd formula at all (a RuntimeError), and one whose formula is
#: declared not implemented (a NotImplementedError: torch.cdist's backward).
_NO_DERIVATIVE = re.compile(r"derivative for aten::([\w.]+) is not implemented"
                            r"|the derivative for '([\w.]+)' is not implemented")


#: torch's fused attention kernels, whose backward has no derivative formula and which have
#: no forward-mode formula on the CPU; the math kernel is made of differentiable operations.
_SDPA = "_scaled_dot_product_"
_SDPA_FIX = ("compute attention with the math kernel, made of differentiable operations: "
             "call inside `with torch.nn.attention.sdpa_kernel("
             "torch.nn.attention.SDPBackend.MATH):` (a transformers model: load it with "
             "attn_implementation=\"eager\")")


def forward_refusal(err: BaseException) -> str | None:
    """What forward-mode AD refused in ``f``: a torch operator, or a custom Function, without
    a forward-mode formula (None for any other error)."""
    text = str(err)
    if isinstance(err, NotImplementedError) and "forward AD" in text:
        found = _NO_FWD_OP.search(text)
        if found is not None:
            return (f"an operator in f has no forward-mode formula (torch's "
                    f"aten::{found.group(1)}: torch has none for it)")
    if isinstance(err, NotImplementedError) and _NO_JVP in text:
        return ("an operator in f has no forward-mode formula (a custom "
                "torch.autograd.Function without a jvp staticmethod)")
    if isinstance(err, NotImplementedError) and "forward AD" in text:
        return ("an operator in f has no forward-mode formula (a custom "
                "torch.autograd.Function without jvp, or a torch operator torch has none for)")
    if isinstance(err, NotImplementedError) and "_efficientzerotensor" in text and (
            "Sparse" in text):
        return SPARSE_TANGENT
    return None


def forward_fix(err: BaseException) -> str | None:
    """The fix, besides reverse mode, for :func:`forward_refusal`'s ``err``: a jvp
    staticmethod where a custom Function has none, the math attention kernel where a fused
    one has no formula; None where the operator is torch's and torch offers no other (a
    jvp staticmethod is no fix for a torch operator)."""
    text = str(err)
    if not isinstance(err, NotImplementedError):
        return None
    found = _NO_FWD_OP.search(text)
    if found is not None:
        return _SDPA_FIX if found.group(1).startswith(_SDPA) else None
    if _NO_JVP in text or "forward AD" in text:
        return "give the Function a jvp staticmethod"
    return None


def double_backward_refusal(err: BaseException) -> str | None:
    """The torch operator whose backward autograd cannot differentiate, where ``err`` is
    that refusal: ``"_scaled_dot_product_flash_attention_for_cpu"`` from its kernel
    ``..._backward`` (a RuntimeError), ``"_cdist"`` from ``_cdist_backward`` (a
    NotImplementedError). A Hessian, reverse over reverse, differentiates a gradient, and
    that kernel has no derivative formula. None for any other error, a kernel that is not a
    backward one included (a missing first derivative)."""
    if not isinstance(err, RuntimeError):
        return None
    found = _NO_DERIVATIVE.match(str(err).strip())
    if found is None:
        return None
    kernel = found.group(1) or found.group(2)
    return kernel[:-len("_backward")] if kernel.endswith("_backward") else None


def no_double_backward_fix(op: str) -> str | None:
    """The fix for :func:`double_backward_refusal`'s operator ``op`` where one is known (the
    math attention kernel for torch's fused attention), None otherwise."""
    return _SDPA_FIX if op.startswith(_SDPA) else None


def mutates_captured(err: BaseException) -> bool:
    """Whether ``err`` is torch.func refusing an in-place change of a tensor the function
    captured (a BatchNorm's running statistics in training mode): plain autograd allows it."""
    return refusal_kind(err) == "captured"


def writes_into_input(err: BaseException) -> bool:
    """Whether ``err`` is autograd refusing an in-place write into a leaf that requires
    grad (or a view of one): ``f`` writes into the tensor reverse mode differentiates."""
    return "leaf Variable that requires grad is being used in an in-place operation" in str(err)


#: torch.utils.checkpoint's refusal, in backward, of torch.autograd.grad with use_reentrant=True.
_REENTRANT = "When use_reentrant=True, torch.utils.checkpoint is incompatible with .grad()"


def reentrant_checkpoint(err: BaseException) -> bool:
    """Whether ``err`` is ``torch.utils.checkpoint(..., use_reentrant=True)`` refusing the
    ``torch.autograd.grad`` a plain reverse product computes with."""
    return isinstance(err, RuntimeError) and _REENTRANT in str(err)


def reentrant_checkpoint_message(call: str) -> str:
    """Why no strategy computes through a reentrant checkpoint, and the fix."""
    return (
        f"{call}: f uses torch.utils.checkpoint with use_reentrant=True, whose backward runs "
        f"only inside .backward() called without inputs, so it refuses the "
        f"torch.autograd.grad that each reverse product is (torch.func cannot run it either: "
        f"it is a custom autograd.Function without setup_context), and it has no "
        f"forward-mode formula.\n"
        f"  Fix: pass use_reentrant=False to torch.utils.checkpoint (torch's recommended "
        f"setting; every strategy computes through it)."
    )

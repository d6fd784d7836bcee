"""What torch refuses, read off its errors: the known refusals of torch.func's vectorised
transforms and of forward mode, for a function that plain autograd runs, so that a strategy
can fall back or explain (:func:`vmap_refusal`, :func:`forward_refusal`); and autograd's
refusal of an in-place write into a differentiated leaf (:func:`writes_into_input`)."""

from __future__ import annotations

__all__ = ["forward_refusal", "mutates_captured", "vmap_refusal", "writes_into_input"]


def vmap_refusal(err: BaseException) -> str | None:
    """What torch.func's vectorised transforms refused in ``f``, where ``err`` is one of
    their known refusals of a function plain autograd runs (None otherwise)."""
    if mutates_captured(err):
        return ("f changes a tensor it captured in place (a module in training mode "
                "updating its running statistics, say)")
    if isinstance(err, RuntimeError) and "randomness error mode" in str(err):
        return ("f draws random numbers (dropout in training mode, say), which vmap "
                "refuses by default, since its columns would each draw their own")
    if isinstance(err, RuntimeError) and "must override the setup_context staticmethod" in str(
            err):
        return ("f uses a custom torch.autograd.Function whose forward takes ctx (no "
                "setup_context staticmethod), which torch.func's transforms cannot run")
    return None


def forward_refusal(err: BaseException) -> str | None:
    """What forward-mode AD refused in ``f``: an operator, or a custom Function, without a
    forward-mode formula (None for any other error)."""
    text = str(err)
    if isinstance(err, NotImplementedError) and (
        "forward AD" in text or "implement the jvp function" in text
    ):
        return ("an operator in f has no forward-mode formula (a custom "
                "torch.autograd.Function without jvp, or a torch operator torch has none for)")
    return None


def mutates_captured(err: BaseException) -> bool:
    """Whether ``err`` is torch.func refusing an in-place change of a tensor the function
    captured (a BatchNorm's running statistics in training mode): plain autograd allows it."""
    return isinstance(err, RuntimeError) and "mutate a captured Tensor" in str(err)


def writes_into_input(err: BaseException) -> bool:
    """Whether ``err`` is autograd refusing an in-place write into a leaf that requires
    grad (or a view of one): ``f`` writes into the tensor reverse mode differentiates."""
    return "leaf Variable that requires grad is being used in an in-place operation" in str(err)

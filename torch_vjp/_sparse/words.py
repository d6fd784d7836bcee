"""The sparse wing's words: the refusals of an explicit mode that torch.func or forward
mode cannot run (:func:`explain_refusal`), the warning of products computed again
without vmap (:func:`warn_batching`), and what an op whose backward torch computes wrongly
does wrong, with the fix (:func:`wrong_reverse_words`)."""

from __future__ import annotations

from torch_vjp._engine.jacobian import function_key, function_name
from torch_vjp._engine.problem import Problem
from torch_vjp._engine.refusals import (
    SPARSE_TANGENT,
    forward_fix,
    forward_refusal,
    refusal_kind,
    vmap_refusal,
)
from torch_vjp._errors import (JacobianWarning, StrategyError, StrategyNotImplementedError,
                               quote_error, warn_once)

__all__ = ["explain_refusal", "warn_batching", "wrong_reverse_words"]


#: The fix each known refusal of torch.func adds to mode='auto' (by refusal_kind).
ALSO = {"captured": ", or put the module in eval mode if it is one",
         "randomness": ", or put the module in eval mode if its draws are dropout's",
         "no_strides": ", or make that tensor a COO or dense one",
         "saved_hooks": " or mode='fwd'"}


def explain_refusal(prob: Problem, mode: str, err: BaseException) -> None:
    """Raises a :class:`StrategyError` that explains ``err`` where it is one of torch's known
    refusals of the products of an explicit ``mode`` (forward mode without a formula,
    torch.func's refusals: :mod:`torch_vjp._engine.refusals`, as :func:`torch_vjp.jacobian`
    explains them); returns for any other error (f's own: it passes through untouched)."""
    said = quote_error(err)
    why = forward_refusal(err)
    if mode == "fwd" and why is not None:
        # (a jvp staticmethod for a custom Function only: a torch operator has none to
        # give; the math kernel for fused attention)
        fix = "make that tensor a dense one" if why == SPARSE_TANGENT else forward_fix(err)
        also = "" if fix is None else f", or {fix}"
        # (also a NotImplementedError where torch raised one: except NotImplementedError
        # keeps working, as for torch_vjp.jacobian)
        cls = StrategyNotImplementedError if isinstance(err, NotImplementedError) else StrategyError
        raise cls(
            f"{prob.call}: mode='fwd' computes the products with forward-mode AD, and {why}.\n"
            f"  torch said: {said}\n"
            f"  Fix: mode='rev' or 'auto' (reverse mode needs only backward formulas){also}."
        ) from None
    why = vmap_refusal(err)
    if why is not None:
        also = ALSO.get(refusal_kind(err) or "", "")
        raise StrategyError(
            f"{prob.call}: mode={mode!r} computes the products with torch.func, which cannot "
            f"run f ({function_name(prob.f)}): {why}.\n  torch.func said: {said}\n"
            f"  Fix: mode='auto' (it computes such a function with plain autograd, one "
            f"backward pass per colour){also}."
        ) from None


def warn_batching(prob: Problem, count: int) -> None:
    """The one-time warning where reverse mode's products under vmap disagreed with one
    computed without it, and ``count`` were computed again one colour at a time."""
    warn_once(
        ("sparse-batching", function_key(prob.f)),
        f"{prob.call}: the products of {function_name(prob.f)} computed together under "
        f"torch.vmap disagree with one computed without it: an operator in f has a wrong "
        f"batching rule (torch.cdist's backward is one). They were computed again one "
        f"colour at a time ({count} products), without vmap: the pattern was not at "
        f"fault.\n  Pass chunk_size=1 to compute them that way directly. This warning is "
        f"shown once per function.",
        JacobianWarning,
    )


def wrong_reverse_words(name: str, why: str) -> tuple[str, str]:
    """``(said, fix)``: that f (``name``) calls ``why``, an op whose backward torch
    computes wrongly even without vmap (NOTE [wrong batching rules] in
    :mod:`torch_vjp._sparse.probe`), and how; and the fix beside forward mode."""
    if "as_strided_scatter" in why:
        how = ("the gradient of the tensor scattered into is passed inside the scattered "
               "region, where it belongs outside it")
        fix = ("write the scatter as out = t.clone(); out.as_strided(size, stride, "
               "offset).copy_(src), whose backward is right")
    elif "interpolate" in why:
        how = ("for the input resized, where the output is one column wide and its height "
               "is resampled, or where a dimension keeps its size under a scale_factor "
               "other than 1")
        fix = "resize with antialias=False, whose backward is right"
    else:
        how = "for the tensor it computes from x"
        fix = "write f without that op"
    return (f"{name} calls {why}, whose backward torch computes wrongly (torch 2.13: {how}), "
            f"so reverse mode's products would be wrong; forward mode's are right"), fix

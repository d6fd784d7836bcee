"""The one-time warnings of NOTE [auto, checked once] (in :mod:`torch_vjp._engine.fwdcheck`):
"auto"'s first route disagreed with the reverse product, and another route was taken, or
none agreed.
"""

from __future__ import annotations

__all__ = ["no_route_message", "wrong_reverse_message", "wrong_route_message"]


_WRONG = {
    ("fwd", "rev"): (
        "forward mode ({option}='auto' chooses it {why}) disagrees with a reverse product on "
        "the Jacobian of {name}{by}: an operator in f has a wrong forward-mode derivative "
        "(torch.triangular_solve is one). {option}='auto' returned the reverse-mode Jacobian"),
    ("fwd", "rev-loop"): (
        "forward mode and reverse mode under torch.vmap both disagree with a reverse product "
        "on the Jacobian of {name}{by}: an operator in f has a wrong forward-mode derivative, "
        "and one has a wrong batching rule for its backward. {option}='auto' returned the "
        "Jacobian computed one reverse product at a time"),
    ("rev", "rev-loop"): (
        "reverse mode under torch.vmap disagrees with a reverse product without it on the "
        "Jacobian of {name}{by}: an operator in f's backward has a wrong batching rule "
        "(torch.cdist's is one). {option}='auto' returned the Jacobian computed one reverse "
        "product at a time"),
}
_WHY = {"strategy": "for a Jacobian with more output than input elements",
        "mode": "where it needs fewer products"}
_FIX = {("strategy", "rev"): "strategy='rev'", ("strategy", "rev-loop"): "strategy='rev-loop'",
        ("mode", "rev"): "mode='rev'", ("mode", "rev-loop"): "mode='rev' with chunk_size=1"}


def wrong_route_message(call: str, name: str, first: str, route: str, diff: float,
                        scale: float, option: str) -> str:
    """The one-time warning that ``"auto"``'s first route (``first``) disagreed with the
    reverse product and ``route`` was taken; ``option`` names the argument
    (``"strategy"`` or ``"mode"``)."""
    by = f" (by up to {diff:.3g}, at a scale of {scale:.3g})"
    what = _WRONG[first, route].format(option=option, why=_WHY[option], name=name, by=by)
    if route == "rev-loop":
        what += f" ({_FIX[option, route]})"
    return (f"{call}: {what}, and uses it for this function and input shapes from now on.\n"
            f"  Pass {_FIX[option, route]} to compute it that way directly. This warning is "
            f"shown once per function.")



def no_route_message(call: str, name: str, first: str, diff: float, scale: float,
                     option: str) -> str:
    """The one-time warning that ``"auto"``'s first route (``first``) disagreed with the
    reverse product and no other route agreed either: the first result stands."""
    mode = {"fwd": "forward mode", "rev": "reverse mode under torch.vmap"}.get(
        first, "reverse mode one product at a time (torch.vmap could not run f)")
    others = ", and no other route agrees with it either" if first in ("fwd", "rev") else ""
    return (
        f"{call}: {mode} disagrees with a reverse product on the Jacobian of {name} (by up "
        f"to {diff:.3g}, at a scale of {scale:.3g}){others}: f draws random numbers (dropout in training mode), is not smooth at this "
        f"point, or computes otherwise on each call. {option}='auto' returned the first "
        f"result, and does so for this function and input shapes from now on.\n"
        f"  Check it (torch.autograd.gradcheck, or finite differences) before relying on "
        f"it; for a random f, fix its draws (model.eval(), or a seeded generator). This "
        f"warning is shown once per function."
    )


_REVERSE = {"rev": "reverse mode under torch.vmap", "rev-loop": "reverse mode"}
_FORWARD = {"fwd": "forward mode under torch.vmap",
            "fwd-loop": "forward mode, one product at a time (torch.vmap cannot run f there)"}


def wrong_reverse_message(call: str, name: str, first: str, route: str, reverse: float,
                          forward: float, difference: float, op: str | None = None) -> str:
    """The one-time warning that the reverse product of "auto"'s check was itself wrong
    (NOTE [a reverse product checked forward] in :mod:`torch_vjp._engine.revcheck`):
    ``first`` (a reverse route) gave way to ``route`` (a forward one). ``op``: the operator
    with a known wrong backward formula that f's graph holds, None where none is known (the
    cause is then described, not named)."""
    stop = ""
    if op is not None:
        cause = f"an operator in f has a wrong backward formula (torch's for {op})"
    else:
        # (no node marks a value computed under torch.no_grad(): the graph cannot tell
        # that stop-gradient from a wrong backward, so both are described)
        cause = (
            "reverse mode does not differentiate f as computed. Most often a part of f is "
            "computed under torch.no_grad() (or torch.set_grad_enabled(False)): reverse "
            "mode treats that part as a constant, while forward mode, which torch's grad "
            "mode does not switch off, and a central difference differentiate through it "
            "(a .detach()ed tensor or one made in torch.inference_mode() is a constant to "
            "both modes, and is not the cause). "
            "Otherwise a backward formula in f does not match the function as computed: a "
            "write at a repeated index that does not accumulate (out[idx] = x, index_put, "
            "scatter or index_copy with an index twice: only one write survives, which "
            "forward mode and finite differences differentiate, while torch's backward "
            "gives every duplicate the gradient; torch leaves which one survives "
            "unspecified), or an operator whose backward torch computes wrongly")
        stop = (" If f stops gradients under torch.no_grad() on purpose, pass "
                "strategy='rev' for the stop-gradient Jacobian as torch.autograd computes "
                "it.")
    return (
        f"{call}: a reverse product without torch.vmap disagrees with a forward product and "
        f"a central difference on the Jacobian of {name} (u^T J v: {reverse:.6g} by reverse "
        f"mode, {forward:.6g} by forward mode, {difference:.6g} by a central difference): "
        f"{cause}; {_REVERSE.get(first, first)} would not match f as computed. "
        f"strategy='auto' returned the Jacobian by {_FORWARD[route]} (the derivative of f "
        f"as computed, through every part), and uses it for this function and input shapes "
        f"from now on.\n"
        f"  Pass strategy={route!r} to compute it that way directly.{stop} This warning is "
        f"shown once per function."
    )

"""The errors of a sharded Jacobian whose ranks make different calls (NOTE [sharded
Jacobian] in ``torch_vjp._sharded``): what differs, on which rank, and the fix."""

from __future__ import annotations

from typing import Any

from torch_vjp._engine.problem import Problem
from torch_vjp._errors import JacobianCallError, quote_error, shape_str

__all__ = [
    "OTHERS_WAIT", "argument_differs", "call_differs", "draws_differ", "function_differs",
    "not_joined", "order_differs", "outputs_differ",
]


# (a rank whose process_group is no group cannot tell the others, which wait in the first
# exchange of the group they passed: it does not know that group, and a collective on
# another one, the default group, would not pair with theirs, or would block this rank in
# turn where they passed none. They raise at the group's timeout: check_agreement,
# not_joined)
OTHERS_WAIT = (
    "The other ranks cannot be told: if they passed a process group, they wait for this "
    "rank in that group's first exchange until the group's timeout, and then raise (this "
    "rank does not know their group, and a collective on another group would not reach "
    "them). Pass the same process_group on every rank."
)


def call_differs(prob: Problem, r: int, key: str, ref: Any, got: Any, leaf: int = 0) -> None:
    call = prob.call
    if key == "values":
        raise JacobianCallError(
            f"{call}: the differentiated {prob.leaf_name(leaf)} holds different values "
            f"on rank {r} than on rank 0 (their checksums differ), but with a process_group "
            f"every rank computes a share of one Jacobian, at one point, so the primals must "
            f"be the same on every rank.\n"
            f"  Fix: make them equal (seed every rank's generator alike, or broadcast them "
            f"from rank 0 with torch.distributed.broadcast), or pass process_group=None to "
            f"compute each rank's own Jacobian."
        )
    if key in ("shapes", "dtypes"):
        fmt = shape_str if key == "shapes" else str
        got = f"the differentiated primals have {key[:-1]}s {', '.join(fmt(s) for s in got)}"
        ref = ", ".join(fmt(s) for s in ref)
        what = f"{got} on rank {r} but {ref} on rank 0"
    else:
        what = f"{key}={got!r} on rank {r} but {key}={ref!r} on rank 0"
    raise JacobianCallError(
        f"{call}: the call differs between ranks: {what}. With a process_group every "
        f"rank computes a share of one Jacobian, so every rank must make the same call "
        f"(the same strategy, argnums, has_aux and shard, and primals of the same shapes, "
        f"dtypes and values).\n"
        f"  Fix: call it with the same arguments on every rank, or pass process_group=None "
        f"to compute each rank's own Jacobian."
    )


def function_differs(prob: Problem, how: str) -> None:
    raise JacobianCallError(
        f"{prob.call}: the function differs between ranks: {how}. With a process_group "
        f"every rank computes a share of the Jacobian of one function at one point; each "
        f"rank's share here is of its own function, and the gathered Jacobian would mix "
        f"them.\n"
        f"  Fix: make the weights equal on every rank: seed every rank's generator alike "
        f"before building them, or broadcast them from rank 0 (torch.distributed.broadcast "
        f"of each tensor; DistributedDataParallel broadcasts a model's parameters when it "
        f"wraps it, and with broadcast_buffers=True rank 0's buffers before each forward, "
        f"which a sharded Jacobian of the model it wraps uses too), or pass "
        f"process_group=None to compute each rank's own Jacobian."
    )


def order_differs(call: str, what: str, ref: list[str], got: list[str], r: int,
                  name: str) -> None:
    """Raises: ``what`` (the differentiated primals, or f's output) is a pytree whose leaves
    come in another order, or are others, on rank ``r`` than on rank 0 (their paths ``got``
    and ``ref``, in flattening order)."""
    i = next((i for i, (a, b) in enumerate(zip(ref, got)) if a != b), min(len(ref), len(got)))
    a = f"{name}{ref[i]}" if i < len(ref) else "nothing"
    b = f"{name}{got[i]}" if i < len(got) else "nothing"
    raise JacobianCallError(
        f"{call}: {what} are structured differently on rank {r} than on rank 0: in the "
        f"order torch's pytree flattens them, leaf {i} is {b} on rank {r} but {a} on rank "
        f"0 (a dict built in another key order: a dict is flattened in insertion order). "
        f"With a process_group the products are numbered over the flattened leaves, and "
        f"each rank numbered them in its own order: the gathered Jacobian would mix them.\n"
        f"  Fix: build the dicts in one key order on every rank (dict(sorted(d.items())), "
        f"say), or pass process_group=None to compute each rank's own Jacobian."
    )


def draws_differ(prob: Problem, r: int) -> None:
    raise JacobianCallError(
        f"{prob.call}: f draws random numbers (dropout in training mode, say), and the "
        f"random generators are in another state on rank {r} than on rank 0. With a "
        f"process_group every rank computes a share of one Jacobian; each rank's share here "
        f"is of f with its own draws (its own dropout mask), and the gathered Jacobian would "
        f"mix them.\n"
        f"  Fix: seed the generators alike on every rank just before the call (keeping each "
        f"rank's own stream: with torch.random.fork_rng(): torch.manual_seed(seed); "
        f"J = ...), or make f deterministic (model.eval()), or pass process_group=None to "
        f"compute each rank's own Jacobian."
    )


def argument_differs(prob: Problem, name: str, how: str) -> None:
    raise JacobianCallError(
        f"{prob.call}: {name}, an argument of f that is not differentiated, differs between "
        f"ranks: {how}. With a process_group every rank computes a share "
        f"of one Jacobian, and the Jacobian depends on every argument of f, not only on the "
        f"differentiated ones: the gathered shares would belong to different functions.\n"
        f"  Fix: pass the same {name} on every rank (broadcast it from rank 0 with "
        f"torch.distributed.broadcast or broadcast_object_list); if it does not change f's "
        f"result (a rank number for logging), bind it into f instead of passing it "
        f"(functools.partial); or pass process_group=None to compute each rank's own "
        f"Jacobian."
    )


def not_joined(call: str, rank: int, err: BaseException) -> str:
    """The message where the exchange that opens a sharded Jacobian failed on this rank
    (gloo's timeout, a rank gone): some rank of the group never joined it."""
    return (
        f"{call}: the exchange that opens a sharded Jacobian failed on this rank ({rank}) "
        f"of process_group: {quote_error(err)}\n"
        f"  Some rank of the group did not join it in time: one that passed "
        f"process_group=None (it computes its own Jacobian alone), another group, or an "
        f"object that is no group (that rank raised at once, and cannot tell this one, "
        f"whose group it does not know), or one that did not make this call at all. Every "
        f"rank of the group must make the same call, with the same process_group.\n"
        f"  Fix: pass the same process_group on every rank of the group; the cause may be "
        f"in another rank's traceback. (The group may be unusable after a timeout: create "
        f"a new one.)"
    )


def outputs_differ(call: str, ref: tuple[Any, Any], got: tuple[Any, Any], r: int) -> None:
    """Raises: f's output leaves have other shapes or dtypes on rank ``r`` than on rank 0
    (NOTE [outputs alike on every rank])."""
    (paths, a), (_, b) = ref, got
    i = next((i for i, (u, v) in enumerate(zip(a, b)) if u != v), min(len(a), len(b)))
    name = f"output{paths[i]}" if paths is not None and i < len(paths) else f"output leaf {i}"

    def what(leaf: Any) -> str:
        if leaf is None:
            return "nothing"
        return shape_str(leaf[0]) if len(leaf) == 1 else f"{shape_str(leaf[0])} {leaf[1]}"

    mine = what(b[i] if i < len(b) else None)
    theirs = what(a[i] if i < len(a) else None)
    raise JacobianCallError(
        f"{call}: the outputs of f differ between ranks: {name} is {mine} on rank {r} but "
        f"{theirs} on rank 0, though every rank called f with the same arguments and "
        f"weights. With a process_group the products are numbered over f's output elements "
        f"and gathered from every rank, so f must return outputs of the same shapes and "
        f"dtypes on every rank; f reads something of each rank's own (a number bound per "
        f"rank, a global).\n"
        f"  Fix: make f the same function on every rank (pass what it reads of its rank's "
        f"own as an argument, where it is compared), or pass process_group=None to compute "
        f"each rank's own Jacobian."
    )

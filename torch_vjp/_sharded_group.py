"""The process group of a sharded Jacobian (NOTE [sharded Jacobian] in :mod:`torch_vjp._sharded`):
its validation before any exchange, the errors every rank hears of before the opening
exchange, and :class:`JacobianShard`, one rank's share returned with ``shard=True``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, NamedTuple

from torch_vjp._engine.context import is_nested
from torch_vjp._errors import JacobianOptionError
from torch_vjp._sharded_check import fail_before_exchange
from torch_vjp._sharded_words import OTHERS_WAIT

__all__ = ["JacobianShard", "check_group", "told_on_failure"]


class JacobianShard(NamedTuple):
    """One rank's share of a sharded Jacobian (``tv.jacobian(..., process_group=group,
    shard=True)``; NOTE [sharded Jacobian]).

    Attributes:
        values: the rank's products. In reverse mode (``mode == "rev"``), structured like
            the differentiated primals (a tensor for an int ``argnums``, a tuple for a
            tuple), each of shape ``(stop - start, *x.shape)``: entry ``k`` is the gradient
            of flat output element ``start + k``, i.e. rows ``[start, stop)`` of the
            Jacobian with its output dimensions flattened (outputs concatenated in
            ``tree_flatten`` order). In forward mode, structured like ``f``'s output, each
            of shape ``(stop - start, *y.shape)``: entry ``k`` is the derivative of the
            outputs along flat input element ``start + k`` (a column of the Jacobian,
            differentiated primals concatenated in order). From ``batch_jacobian``, the
            products are those of one row of the batch, computed for every row: entry ``k``
            has shape ``(B, *x.shape[1:])`` (reverse mode) or ``(B, *y.shape[1:])``
            (forward mode), and ``start``, ``stop`` and ``total`` count elements of one row.
        mode: ``"rev"`` (rows) or ``"fwd"`` (columns).
        start: the first product this rank computed.
        stop: one past the last (``start == stop`` for a rank with nothing to do).
        total: the number of products over all ranks (output elements in reverse mode,
            input elements in forward mode).
        aux: ``f``'s aux value with ``has_aux=True``, else None.

    Example:
        A group of one rank (gloo, on the CPU), whose shard is every product; with ``W``
        ranks, rank ``r`` gets ``shard_range(total, r, W)``:

        >>> import os, tempfile, torch.distributed as dist
        >>> store = os.path.join(tempfile.mkdtemp(), "store")
        >>> dist.init_process_group("gloo", init_method=f"file://{store}", rank=0,
        ...                         world_size=1)
        >>> sh = tv.jacobian(lambda x: x ** 2, torch.tensor([1.0, 2.0, 3.0]),
        ...                  strategy="rev", process_group=dist.group.WORLD, shard=True)
        >>> sh.mode, sh.start, sh.stop, sh.total
        ('rev', 0, 3, 3)
        >>> sh.values
        tensor([[2., 0., 0.],
                [0., 4., 0.],
                [0., 0., 6.]])
        >>> dist.destroy_process_group()
    """

    values: Any
    mode: str
    start: int
    stop: int
    total: int
    aux: Any = None


JacobianShard.__module__ = "torch_vjp"  # the public path, as for the error classes


def _dist() -> Any:
    import torch.distributed as dist

    return dist


def check_group(process_group: object, shard: object, create_graph: bool, *, call: str) -> Any:
    """Validates ``process_group`` and ``shard``; returns the group, or None for one
    process.

    Raises:
        JacobianOptionError: a value that is not a process group, a group that is not
            initialised or does not hold this process, ``shard`` without a group or not a
            bool, ``create_graph=True`` or an outer torch.func transform with a group.
    """
    bad_shard = None if isinstance(shard, bool) else JacobianOptionError(
        f"{call}: shard={shard!r}, but it must be True or False: whether each rank of "
        f"process_group returns only its own share of the Jacobian (True) or the whole "
        f"Jacobian (False, the default)."
    )
    if bad_shard is not None and process_group is None:
        raise bad_shard
    if process_group is None:
        if shard:
            raise JacobianOptionError(
                f"{call}: shard=True, but process_group is None: a shard is one rank's share "
                f"of the products, and without a process group there is one process, which "
                f"computes them all.\n"
                f"  Fix: pass process_group=torch.distributed.group.WORLD (after "
                f"torch.distributed.init_process_group) or another group, or drop shard=True."
            )
        return None
    dist = _dist()
    group_type = getattr(dist, "ProcessGroup", None) if dist.is_available() else None
    non_member = getattr(getattr(dist, "GroupMember", None), "NON_GROUP_MEMBER", None)
    if group_type is not None and non_member is not None and process_group == non_member:
        rank = dist.get_rank() if dist.is_initialized() else "?"
        raise JacobianOptionError(
            f"{call}: this process (global rank {rank}) is not a member of process_group "
            f"(torch.distributed.new_group returned GroupMember.NON_GROUP_MEMBER here), so "
            f"it has no share of the Jacobian to compute.\n"
            f"  Fix: call it only on the group's ranks, or pass a group that holds this "
            f"process."
        )
    if group_type is None or not isinstance(process_group, group_type):
        got = (repr(process_group) if isinstance(process_group, (bool, int, str))
               else f"an object of type {type(process_group).__name__}")
        raise JacobianOptionError(
            f"{call}: process_group is {got}, but it must be a torch.distributed "
            f"ProcessGroup (the ranks that share the products), or None for one process.\n"
            f"  Fix: pass process_group=torch.distributed.group.WORLD for the default group "
            f"(after torch.distributed.init_process_group), or a group made by "
            f"torch.distributed.new_group.\n  {OTHERS_WAIT}"
        )
    if not dist.is_initialized():
        raise JacobianOptionError(
            f"{call}: process_group was given, but torch.distributed is not initialised "
            f"(no init_process_group, or destroy_process_group was called), so its ranks "
            f"cannot exchange the shards of the Jacobian.\n"
            f"  Fix: call torch.distributed.init_process_group(...) on every rank first "
            f"(torchrun sets up what it needs), or pass process_group=None for one process."
            f"\n  {OTHERS_WAIT}"
        )
    if dist.get_rank(process_group) < 0:
        raise JacobianOptionError(
            f"{call}: this process (global rank {dist.get_rank()}) is not a member of "
            f"process_group, so it has no share of the Jacobian to compute.\n"
            f"  Fix: call it only on the group's ranks, or pass a group that holds this "
            f"process."
        )
    # The group is valid from here on: a rank that rejects its call tells the other ranks,
    # which wait in the opening exchange (NOTE [sharded Jacobian]).
    if bad_shard is not None:
        fail_before_exchange(bad_shard, process_group)
        raise bad_shard
    if create_graph:
        err = JacobianOptionError(
            f"{call}: create_graph=True with a process_group is not supported: the shards "
            f"are gathered from other processes, and autograd cannot carry a gradient back "
            f"through that exchange to the products another rank computed.\n"
            f"  Fix: pass create_graph=False (the default), or compute a differentiable "
            f"Jacobian on one process (process_group=None)."
        )
        fail_before_exchange(err, process_group)
        raise err
    if is_nested():
        err = JacobianOptionError(
            f"{call}: a process_group inside a torch.func transform (vmap, grad, jacrev) is "
            f"not supported: the shards gathered from other processes carry no derivatives "
            f"for the outer transform.\n"
            f"  Fix: pass process_group=None inside the transform, or shard the outer "
            f"computation instead."
        )
        fail_before_exchange(err, process_group)
        raise err
    return process_group


@contextlib.contextmanager
def told_on_failure(group: Any) -> Iterator[None]:
    """With a process group, an error raised inside reaches the other ranks (which wait in
    the exchange that opens a sharded Jacobian) before it propagates here."""
    try:
        yield
    except Exception as err:
        if group is not None:
            fail_before_exchange(err, group)
        raise

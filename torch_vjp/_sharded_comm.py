"""The collectives of a sharded Jacobian (NOTE [sharded Jacobian] in :mod:`torch_vjp._sharded`):
each rank's range of products and the padding every rank runs, and the exchange of status,
chunk and f's output that follows each try. (The gather of the shards is
``torch_vjp._sharded_work``'s.)
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch
from torch.utils._pytree import tree_unflatten

from torch_vjp._sharded_check import leaf_paths
from torch_vjp._sharded_words import order_differs, outputs_differ

__all__ = [
    "all_max", "comm_device", "exchange", "outputs_apart", "outputs_said", "padded_count",
    "shard_range",
]


def shard_range(n: int, rank: int, world_size: int) -> tuple[int, int]:
    """The products ``[start, stop)`` that ``rank`` computes of ``n`` split over
    ``world_size`` ranks: contiguous, sizes differing by at most one.

    Example:
        >>> [shard_range(5, r, 3) for r in range(3)]
        [(0, 1), (1, 3), (3, 5)]
    """
    return n * rank // world_size, n * (rank + 1) // world_size


# NOTE [every rank runs as many products]
# An f that runs a collective (dist.all_reduce inside f), or whose backward does, pairs its
# calls with the other ranks': every rank must call f, and its backward, as many times. The
# shares differ by one product, and are empty on some ranks where there are fewer products
# than ranks; a loop calls f (forward mode) or the pullback (reverse mode) once per product,
# vmap once per chunk, and a rank with no product called neither: the other ranks waited
# for ever in f's collective. So every rank runs ceil(n / W) products, chunked alike (the
# chunk planned for that count, agreed between the ranks: NOTE [the ranks agree on their
# chunks]): its own, then padding products (the basis vectors after its range, zero past
# the last) whose results are dropped.


def padded_count(n: int, world_size: int) -> int:
    """The products every rank runs of ``n`` split over ``world_size`` ranks: the largest
    share, ``ceil(n / world_size)`` (NOTE [every rank runs as many products]).

    Example:
        >>> padded_count(5, 3), padded_count(1, 2), padded_count(0, 2)
        (2, 1, 0)
    """
    return -(-n // world_size)


def outputs_said(spec: Any, leaves: list[tuple[Any, ...]]) -> tuple[Any, Any]:
    """``(paths, leaves)``: what the ranks' outputs of f must agree on, the paths of the
    output's leaves (None where its nodes have no keys) and per leaf its shape (of one row
    of the batch, and in forward mode its dtype). NOTE [outputs alike on every rank]."""
    try:
        paths = leaf_paths(tree_unflatten([0] * spec.num_leaves, spec))
    except Exception:  # noqa: BLE001 - (an unflatten refusing zeros: not compared)
        paths = None
    return paths, leaves


def exchange(status: int, said: Any, chunk: int, group: Any, device: torch.device
             ) -> tuple[int, int, int, int]:
    """One all_reduce (MAX) of every rank's status, a digest of what it says of f's output
    (:func:`outputs_said`, None for nothing), and ``-chunk`` (0: no plan; NOTE [the ranks
    agree on their chunks]): ``(worst status, digest's largest, its negation's largest,
    minus the smallest chunk or 0)``; the two digests' sum is 0 only where all are alike."""
    import torch.distributed as dist

    h = 0 if said is None else int(hashlib.sha1(repr(said).encode()).hexdigest()[:15], 16)
    t = torch.tensor([status, h, -h, -chunk], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    code, hi, lo, neg = t.tolist()
    return code, hi, lo, neg


def outputs_apart(call: str, said: Any, group: Any) -> None:
    """Raises, on every rank of ``group`` (each calls it, after an exchange whose digests of
    f's output differed), the error naming the first rank whose output differs from rank
    0's (``said``: what this rank says of it, :func:`outputs_said`; NOTE [outputs alike on
    every rank])."""
    import torch.distributed as dist

    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, said, group=group)
    r = next(r for r, p in enumerate(gathered) if p != gathered[0])
    if gathered[r][0] != gathered[0][0]:
        order_differs(call, "the outputs of f", gathered[0][0] or [], gathered[r][0] or [], r,
                      "output")
    outputs_differ(call, gathered[0], gathered[r], r)


def comm_device(group: Any, device: torch.device) -> torch.device:
    """Where the collectives' tensors live: the CUDA device for NCCL, else the CPU (gloo)."""
    import torch.distributed as dist

    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend:
        return device if device.type == "cuda" else torch.device("cuda",
                                                                 torch.cuda.current_device())
    return torch.device("cpu")


def all_max(code: int, group: Any, device: torch.device) -> int:
    """The largest of every rank's ``code`` (one all_reduce)."""
    import torch.distributed as dist

    t = torch.tensor([code], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return int(t.item())

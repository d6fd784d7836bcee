"""Hints for a custom backward that returned a gradient of a recognisable wrong shape, beside
the rules and messages of :mod:`torch_vjp._backward_check`: here, a gradient left in the shape
of forward's output where forward only rearranged its input."""

from __future__ import annotations

import math

from torch_vjp._errors import shape_str

__all__ = ["rearranged_hint"]


def rearranged_hint(i: int, g: tuple[int, ...], s: tuple[int, ...], out_name: str) -> str:
    """The hint for a gradient of shape ``g``, the shape of ``out_name``, for input ``i`` of
    shape ``s`` with as many elements: forward rearranged input ``i`` (a reshape, a squeeze,
    a transpose) and backward left the gradient in the output's shape. Which rearrangement
    matters: a reshape undoes a reshape, but a reshape of a transposed gradient keeps its
    elements in the wrong order and gives wrong values without an error."""
    n = math.prod(s)
    lead = (f"{shape_str(g)} is the shape of {out_name} (and of grad_output), and holds "
            f"input {i}'s {n} elements")
    back = (f"backward returns the gradient of input {i} in input {i}'s own shape, so it "
            f"undoes that rearrangement")
    if tuple(d for d in g if d != 1) == tuple(d for d in s if d != 1):
        return (f"{lead}: forward added or removed dimensions of size 1 (squeeze, unsqueeze, "
                f"[None], keepdim=False). {back}. Fix: return grad.reshape({shape_str(s)}) "
                f"(the gradient as computed, put back in input {i}'s shape).")
    if len(g) == len(s) and sorted(g) == sorted(s):
        perm = "grad.mT" if len(s) == 2 else (
            "grad.permute(p), p being the inverse permutation of forward's")
        return (f"{lead}: if forward transposed or permuted input {i} (.t(), .mT, .permute), "
                f"{back}. Fix: return {perm}; only if forward reshaped input {i} instead, "
                f"return grad.reshape({shape_str(s)}). (grad.reshape({shape_str(s)}) would "
                f"also give the right shape after a transpose, but with the elements in the "
                f"wrong order: wrong values, and no error.)")
    return (f"{lead}: forward reshaped input {i} (reshape, view, flatten). {back}. Fix: "
            f"return grad.reshape({shape_str(s)}) (the gradient as computed, put back in "
            f"input {i}'s shape).")

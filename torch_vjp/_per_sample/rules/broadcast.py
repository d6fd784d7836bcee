"""Parameters repeated over the batch: a class token expanded and concatenated, a positional
table added to the activations, attention's ``bias_k``/``bias_v``.

Such a parameter ``P`` enters the computation as ``E``, ``P`` broadcast (expanded, repeated)
along the examples; row ``i`` of ``E`` serves example ``i`` alone, so example ``i``'s gradient
of ``P`` is ``dL_i/dE[i]`` summed over the dimensions along which ``P`` was broadcast. The
recorder records ``E`` (NOTE [direct uses] in ``torch_vjp._per_sample.recorder``).
"""

from __future__ import annotations

from torch_vjp._per_sample.factors import SmallFactor
from torch_vjp._per_sample.registry import Rule, to_batch_first

__all__ = ["BroadcastRule", "BROADCAST"]


class BroadcastRule(Rule):
    name = "broadcast parameter"

    def factors(self, call, grads, roles, batch):
        g = grads[0]
        if g is None or "weight" not in roles:
            return []
        p, rows = call.params["weight"]
        gb = to_batch_first(g, call.bdim)
        shape = tuple(p.shape) if rows is None else tuple(p[rows].shape)
        if len(shape) == gb.dim():  # P carries a dimension of size 1 where the examples are
            bdim = call.bdim or 0
            inner = shape[:bdim] + shape[bdim + 1:]
        else:  # broadcasting added the examples' dimension in front
            inner = shape
        pad = gb.dim() - 1 - len(inner)  # leading dimensions broadcasting added to P
        target = (batch, *(1,) * max(pad, 0), *inner)
        value = gb if tuple(gb.shape) == target else gb.sum_to_size(target)
        return [("weight", SmallFactor(value.reshape(batch, *shape), rows))]


BROADCAST = BroadcastRule()

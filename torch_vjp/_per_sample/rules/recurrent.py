"""Recurrent layers: the stock ``nn.RNN`` (tanh and relu), ``nn.LSTM`` and ``nn.GRU``.

Every weight of a recurrent layer enters through an affine map applied at each time step:
``gi_t = W_ih x_t + b_ih`` (all time steps at once) and ``gh_t = W_hh h_{t-1} + b_hh``, and for
an LSTM with ``proj_size`` also ``h_t = W_hr m_t``. So, as for a Linear layer over a sequence,
example ``i``'s gradient of ``W_ih`` is ``sum_t dgi[i, t] x[i, t]^T``, of ``W_hh`` is
``sum_t dgh[i, t] h[i, t-1]^T`` and of ``W_hr`` is ``sum_t dh[i, t] m[i, t]^T``
(:class:`~torch_vjp._per_sample.factors.OuterFactor`, whose norms use the ghost-norm identity
or chunks of examples, so no ``B x P`` buffer is formed for the weights); the biases' are
``sum_t dgi[i, t]`` and ``sum_t dgh[i, t]`` (small, held as they are).

The pre-activation gradients ``dgi``, ``dgh`` and ``dh`` are not recorded by the forward
(the layer is one opaque call), so the rule recomputes the layer's forward from its recorded
inputs, unrolled in time with the weights detached, and takes one ``torch.autograd.grad`` of
the recorded output gradients (of ``output``, ``h_n`` and, for an LSTM, ``c_n``) with respect
to the pre-activations. The recurrence keeps examples apart, so the gradient of the sum of the
examples' losses is, row by row, each example's own. For an RNN and an LSTM ``dgh = dgi`` (the
two maps are added); for a GRU the candidate's hidden part is scaled by the reset gate,
``dgh_n = r * dgi_n``.

What the rule does not handle:

* dropout between layers in training mode (``dropout > 0``, ``num_layers > 1``): its masks
  cannot be replayed, so :meth:`applies` declines the layer and its parameters go to the
  fallback;
* packed sequences: :meth:`RecurrentRule.batch_dims` offers no batch dimension for an input
  that is not a tensor, so the plan does not trust the call and the layer's parameters go to
  the fallback; a packed input in a call the plan trusted (a batch of one trusts every
  call, or a later call of a layer planned on tensors) is declined (:class:`Declined`, as
  below);
* an initial state the recorder did not see (passed by keyword: forward hooks see positional
  arguments only), or anything else that makes the recomputed forward differ from the
  recorded outputs, or a call whose input does not hold one row per example (a model that
  folds ``(B, S, T, F)`` into ``(B * S, T, F)``, which the data flow cannot tell from one
  example per row when ``B == 1``): the rule raises :class:`Declined`, and the layer's
  parameters go to the fallback for that call (or are refused, under ``strategy="hooks"``).
  The rule does not rely on the first call's check against the loop for these, which is not
  made on every model (nor on every later batch).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from torch_vjp._errors import with_article
from torch_vjp._per_sample.factors import Factor, OuterFactor, SmallFactor
from torch_vjp._per_sample.registry import Call, Declined, Rule, register_rule

__all__ = ["RecurrentRule", "RNNRule", "LSTMRule", "GRURule"]

# How far the recomputed forward may stray from the recorded one (relative to the outputs'
# scale) before the rule declines: loose enough for fused kernels (cuDNN uses TF32 for
# float32 by default), tight enough to see a missing initial state or a different mask.
_REPLAY_TOL = {torch.float64: 1e-6, torch.float32: 5e-3}
_REPLAY_TOL_LOW = 5e-2  # float16, bfloat16


class _Direction:
    """What the recomputation keeps of one layer and direction for the factors."""

    def __init__(self, suffix: str, x: Tensor):
        self.suffix = suffix
        self.x = x  # (B, T, in): the layer's input
        self.gi: Tensor | None = None  # (B, T, G): W_ih x + b_ih, in the graph
        self.h_prev: list[Tensor] = []  # h_{t-1} of each step t, in time order
        self.r: list[Tensor] = []  # GRU: the reset gate of each step
        self.m: list[Tensor] = []  # LSTM with proj_size: o * tanh(c) of each step
        self.h: list[Tensor] = []  # LSTM with proj_size: h_t = W_hr m_t, in the graph


class RecurrentRule(Rule):
    """The shared rule of ``nn.RNN``, ``nn.LSTM`` and ``nn.GRU`` (see the module docstring).

    Per-sample gradients of the weights are :class:`OuterFactor` over the time steps, of the
    biases :class:`SmallFactor`; the recomputation holds the layer's activations once more
    (``B x T x gates`` per layer and direction), as the forward did.
    """

    name = "recurrent"
    roles = None  # weight_ih_l0, bias_hh_l1_reverse, weight_hr_l0, ...: all the layer's own

    def applies(self, module: nn.Module) -> bool:
        # dropout acts only between layers, and only in training mode; the rule reads the
        # weights from the layer's parameters, which a forward pre-hook (the older
        # weight_norm and spectral_norm) replaces by tensors it computes (a parametrization
        # is seen by the plan, NOTE [direct uses])
        return not (module.dropout > 0 and module.training and module.num_layers > 1) and (
            not _hooked_weights(module))

    def declined(self, module: nn.Module) -> str:
        hooked = _hooked_weights(module)
        if hooked:
            return (f"the {type(module).__name__} rule reads the layer's weights as its "
                    f"parameters, and {', '.join(hooked)} is computed by a forward pre-hook "
                    f"(torch.nn.utils.weight_norm or spectral_norm) from other parameters, "
                    f"whose per-sample gradients the rule does not give")
        return (f"the {type(module).__name__} rule does not replay dropout between layers in "
                f"training mode (its randomness is drawn inside torch's kernel)")

    def other_output_dims(self, module: nn.Module | None, x: Any) -> dict[int, int]:
        # h_n (and c_n) are (layers * directions, B, H) whatever batch_first says
        if not isinstance(x, Tensor) or x.dim() != 3:
            return {}
        return {1: 1, 2: 1} if isinstance(module, nn.LSTM) else {1: 1}

    def batch_dims(self, module: nn.Module | None, x: Any) -> tuple[int, ...]:
        # The examples are along dimension 0 (batch_first) or 1 of a batched input, never
        # along time; an unbatched (2-D) input is one example, and a packed sequence is
        # declined (see the module docstring).
        if not isinstance(x, Tensor) or x.dim() != 3:
            return ()
        return (0,) if module.batch_first else (1,)  # type: ignore[union-attr]

    # -- the rule ------------------------------------------------------------------------

    def factors(
        self, call: Call, grads: Sequence[Tensor | None], roles: set[str], batch: int
    ) -> list[tuple[str, Factor]]:
        m = call.module
        x = call.x
        if not isinstance(x, Tensor):
            # (a batch of one trusts every call, NOTE [a batch of one] in hooks.py: the
            # fallback computes the layer's parameters, or 'hooks' refuses them)
            raise Declined(
                f"it is called with {with_article(type(x).__name__)}, and the rule of "
                f"recurrent layers does not handle packed sequences")
        if all(g is None for g in grads):
            return []
        unbatched = x.dim() == 2
        xs = _batch_first(x.detach(), m.batch_first, unbatched)
        if xs.shape[0] != batch:  # not one row per example: nothing this rule can split
            raise Declined(
                f"its input holds {xs.shape[0]} sequences for a batch of {batch} example(s), "
                f"not one per example")
        state = self._initial_state(call, xs, unbatched)
        dirs = self._directions(m, roles)
        if not dirs:
            return []
        with torch.enable_grad():
            outs, keep = self._forward(m, xs, state, dirs)
            recorded = self._recorded(call, m, unbatched)
            if not _replays(outs, recorded):
                # an input the hook did not see (a state passed by keyword), or a forward
                # that differs from the stock one
                raise Declined(
                    "the rule's recomputation of the layer does not reproduce its recorded "
                    "output (an initial state passed by keyword, or a forward other than "
                    "the stock one)")
            pairs = [
                (o, _as_internal(g, j, m.batch_first, unbatched))
                for j, (o, g) in enumerate(zip(outs, grads)) if g is not None
            ]
            inputs: list[Tensor] = []
            for d in keep:
                inputs.append(d.gi)  # type: ignore[arg-type]
                if d.h:
                    inputs.extend(d.h)
            got = torch.autograd.grad(
                [o for o, _ in pairs], inputs, [g for _, g in pairs], allow_unused=True
            )
        return self._collect(m, keep, list(got), roles)

    # -- pieces --------------------------------------------------------------------------

    def _directions(self, m: nn.Module, roles: set[str]) -> set[str]:
        """The suffixes (``_l1_reverse``) of the layers and directions whose parameters are
        wanted."""
        wanted = set()
        for layer in range(m.num_layers):
            for d in range(2 if m.bidirectional else 1):
                sfx = f"_l{layer}" + ("_reverse" if d else "")
                if any(p + sfx in roles for p in _ROLES):
                    wanted.add(sfx)
        return wanted

    def _initial_state(
        self, call: Call, xs: Tensor, unbatched: bool
    ) -> tuple[Tensor, ...]:
        """``(h0,)`` or ``(h0, c0)`` as ``(L * D, B, H)``, zeros where none was passed."""
        m = call.module
        hx = call.args[1] if len(call.args) > 1 else None
        n = m.num_layers * (2 if m.bidirectional else 1)
        B = xs.shape[0]
        sizes = (_out_size(m), m.hidden_size) if isinstance(m, nn.LSTM) else (m.hidden_size,)
        if hx is None:
            return tuple(xs.new_zeros((n, B, s)) for s in sizes)
        parts = (hx,) if isinstance(hx, Tensor) else tuple(hx)
        return tuple(
            (p.unsqueeze(1) if unbatched else p).detach() for p in parts
        )

    def _recorded(self, call: Call, m: nn.Module, unbatched: bool) -> list[Tensor]:
        """The recorded outputs in the recomputation's layouts."""
        return [
            _as_internal(o.detach(), j, m.batch_first, unbatched)
            for j, o in enumerate(call.outputs)
        ]

    def _forward(
        self, m: nn.Module, xs: Tensor, state: tuple[Tensor, ...], wanted: set[str]
    ) -> tuple[list[Tensor], list[_Direction]]:
        """The layer's forward, unrolled in time; returns its outputs (``output`` as
        ``(B, T, D * H_out)``, ``h_n`` and ``c_n`` as ``(L * D, B, H)``) and what the
        wanted directions keep for their factors."""
        kind = _kind(m)
        proj = isinstance(m, nn.LSTM) and m.proj_size > 0
        D = 2 if m.bidirectional else 1
        T = xs.shape[1]
        h_n: list[Tensor] = []
        c_n: list[Tensor] = []
        keep: list[_Direction] = []
        layer_in = xs
        for layer in range(m.num_layers):
            outs = []
            for d in range(D):
                sfx = f"_l{layer}" + ("_reverse" if d else "")
                rec = _Direction(sfx, layer_in)
                w_ih, w_hh = _weight(m, "weight_ih" + sfx), _weight(m, "weight_hh" + sfx)
                b_ih = _weight(m, "bias_ih" + sfx) if m.bias else None
                b_hh = _weight(m, "bias_hh" + sfx) if m.bias else None
                w_hr = _weight(m, "weight_hr" + sfx) if proj else None
                gi = F.linear(layer_in, w_ih, b_ih)
                if not gi.requires_grad:  # the first layer: start the graph here
                    gi.requires_grad_(True)
                rec.gi = gi
                k = layer * D + d
                h = state[0][k]
                c = state[1][k] if kind == "LSTM" else None
                hs: list[Tensor] = []
                prev: list[Tensor] = []
                ms: list[Tensor] = []
                rs: list[Tensor] = []
                for t in range(T) if d == 0 else range(T - 1, -1, -1):
                    prev.append(h)
                    gh = F.linear(h, w_hh, b_hh)
                    if kind == "LSTM":
                        i, f, g, o = (gi[:, t] + gh).chunk(4, 1)
                        c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
                        mt = torch.sigmoid(o) * torch.tanh(c)
                        ms.append(mt)
                        h = F.linear(mt, w_hr) if w_hr is not None else mt
                    elif kind == "GRU":
                        ir, iz, in_ = gi[:, t].chunk(3, 1)
                        hr, hz, hn = gh.chunk(3, 1)
                        r = torch.sigmoid(ir + hr)
                        z = torch.sigmoid(iz + hz)
                        h = torch.tanh(in_ + r * hn)  # the candidate n
                        rs.append(r)
                        h = h + z * (prev[-1] - h)  # (1 - z) n + z h, as torch computes it
                    else:
                        pre = gi[:, t] + gh
                        h = torch.tanh(pre) if kind == "RNN_TANH" else torch.relu(pre)
                    hs.append(h)
                if d:  # the reverse direction ran from the end: put its steps in time order
                    for seq in (hs, prev, ms, rs):
                        seq.reverse()
                outs.append(torch.stack(hs, 1))
                h_n.append(h)
                if c is not None:
                    c_n.append(c)
                if sfx in wanted:
                    rec.h_prev = [p.detach() for p in prev]
                    rec.r = [r.detach() for r in rs]
                    if proj:
                        rec.m = [mt.detach() for mt in ms]
                        rec.h = hs
                    keep.append(rec)
            layer_in = torch.cat(outs, 2) if D == 2 else outs[0]
        result = [layer_in, torch.stack(h_n)]
        if c_n:
            result.append(torch.stack(c_n))
        return result, keep

    def _collect(
        self, m: nn.Module, keep: list[_Direction], got: list[Tensor | None], roles: set[str]
    ) -> list[tuple[str, Factor]]:
        """The factors of the wanted roles from the gradients of the pre-activations."""
        gru = isinstance(m, nn.GRU)
        out: list[tuple[str, Factor]] = []
        pos = 0
        for d in keep:
            gi = d.gi
            dgi = got[pos]
            pos += 1
            dgi = torch.zeros_like(gi) if dgi is None else dgi  # type: ignore[arg-type]
            dh: Tensor | None = None
            if d.h:
                dh = torch.stack(
                    [torch.zeros_like(h) if g is None else g
                     for h, g in zip(d.h, got[pos:pos + len(d.h)])], 1)
                pos += len(d.h)
            if gru:
                # n = tanh(gi_n + r * gh_n): gh_n's gradient is gi_n's scaled by r
                H = m.hidden_size
                dgh = torch.cat([dgi[..., :2 * H], dgi[..., 2 * H:] * torch.stack(d.r, 1)], 2)
            else:
                dgh = dgi
            h_prev = torch.stack(d.h_prev, 1)
            sfx = d.suffix
            if "weight_ih" + sfx in roles:
                out.append(("weight_ih" + sfx, OuterFactor(
                    d.x.detach(), dgi, (dgi.shape[2], d.x.shape[2]))))
            if "weight_hh" + sfx in roles:
                out.append(("weight_hh" + sfx, OuterFactor(
                    h_prev, dgh, (dgh.shape[2], h_prev.shape[2]))))
            if "bias_ih" + sfx in roles:
                out.append(("bias_ih" + sfx, SmallFactor(dgi.sum(1))))
            if "bias_hh" + sfx in roles:
                out.append(("bias_hh" + sfx, SmallFactor(dgh.sum(1))))
            if "weight_hr" + sfx in roles and dh is not None:
                ms = torch.stack(d.m, 1)
                out.append(("weight_hr" + sfx, OuterFactor(ms, dh, (dh.shape[2], ms.shape[2]))))
        return out


_ROLES = ("weight_ih", "weight_hh", "bias_ih", "bias_hh", "weight_hr")


def _kind(m: nn.Module) -> str:
    if isinstance(m, nn.LSTM):
        return "LSTM"
    if isinstance(m, nn.GRU):
        return "GRU"
    return m.mode  # "RNN_TANH" or "RNN_RELU"


def _out_size(m: nn.Module) -> int:
    """The size of ``h``: ``proj_size`` where an LSTM projects, else ``hidden_size``."""
    return getattr(m, "proj_size", 0) or m.hidden_size


def _hooked_weights(m: nn.Module) -> list[str]:
    """The weights of a recurrent layer that are not its parameters (nor parametrized):
    computed by a forward pre-hook, as the older ``torch.nn.utils.weight_norm`` does."""
    params = m._parameters
    names = getattr(m, "_flat_weights_names", ())
    if len(names) and all(n in params for n in names):
        return []
    lists = m._modules.get("parametrizations")
    return [n for n in names if n not in params and not (lists is not None and n in lists)]


def _weight(m: nn.Module, name: str) -> Tensor:
    # Read from the module as its forward did (under functional_call the stand-ins of frozen
    # parameters are swapped in and out around the forward, with the same values); detached,
    # as only the pre-activations' gradients are wanted.
    return m._parameters[name].detach()  # type: ignore[union-attr]


def _batch_first(x: Tensor, batch_first: bool, unbatched: bool) -> Tensor:
    if unbatched:
        return x.unsqueeze(0)
    return x if batch_first else x.transpose(0, 1)


def _as_internal(t: Tensor, j: int, batch_first: bool, unbatched: bool) -> Tensor:
    """Output ``j`` (or its gradient) in the recomputation's layout: ``output`` batch first,
    the states ``(L * D, B, H)``."""
    if j == 0:
        return _batch_first(t, batch_first, unbatched)
    return t.unsqueeze(1) if unbatched else t


def _replays(got: list[Tensor], recorded: list[Tensor]) -> bool:
    """Whether the recomputed outputs are the recorded ones (see ``_REPLAY_TOL``)."""
    if len(got) != len(recorded):
        return False
    for a, b in zip(got, recorded):
        if a.shape != b.shape:
            return False
        tol = _REPLAY_TOL.get(b.dtype, _REPLAY_TOL_LOW)
        scale = 1.0 + float(b.abs().max()) if b.numel() else 1.0
        if not torch.allclose(a.detach(), b, rtol=tol, atol=tol * scale):
            return False
    return True


@register_rule(nn.RNN)
class RNNRule(RecurrentRule):
    name = "RNN"


@register_rule(nn.LSTM)
class LSTMRule(RecurrentRule):
    name = "LSTM"


@register_rule(nn.GRU)
class GRURule(RecurrentRule):
    name = "GRU"

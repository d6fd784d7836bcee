"""The recorder: what the layers that have rules saw during one forward pass.

Forward hooks on the layers record each call (:class:`~torch_vjp._per_sample.registry.Call`):
its inputs and the autograd edges of its outputs, which receive the output gradients the
rules need. Two more kinds of use are recorded without hooks:

* projections inside ``nn.MultiheadAttention`` (``rules.attention``);
* NOTE [direct uses]: a parameter used by a module's forward directly rather than through a
  layer, broadcast over the examples: ``P.expand(B, ...)`` (a class token), ``x + P`` (a
  positional table), and the output of a layer called on a table shared by all examples
  (``Embedding`` of position ids of shape ``(1, T)``) added to the activations. A
  ``TorchFunctionMode`` records the expanded tensor ``E`` (rewriting ``x + P`` as
  ``x + P.expand(...)``, which computes the same values), and a shared layer's output is
  expanded to the batch by its forward hook; the plan checks that the model's output is
  unchanged by these rewrites before it relies on them.

In probe mode (``torch_vjp._per_sample.plan``) every module's call is recorded as well, with
the edges of all its tensor inputs and outputs, so that the plan can see where examples mix.
"""

from __future__ import annotations

import inspect

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.autograd.graph import GradientEdge, get_gradient_edge
from torch.utils._pytree import tree_leaves

from torch_vjp._per_sample.registry import Call, Rule, UserRule, rule_for
from torch_vjp._per_sample.rules.attention import AttentionMode, is_attention
from torch_vjp._per_sample.rules.broadcast import BROADCAST
from torch_vjp._per_sample.rules.linear import LinearRule

_GLOBAL_WITH_KWARGS = torch.nn.modules.module._global_forward_hooks_with_kwargs

_GLOBAL_HOOKS = torch.nn.modules.module._global_forward_hooks


def _first_global_hook(hook: Callable[..., Any]) -> Any:
    """Registers ``hook`` (with kwargs) for every module, ahead of the global forward hooks
    already registered, so that it sees each module's own output."""
    handle = torch.nn.modules.module.register_module_forward_hook(
        hook, with_kwargs=True, always_call=False)
    _GLOBAL_HOOKS.move_to_end(handle.id, last=False)
    return handle


__all__ = ["Recorder", "ModuleCall", "Layers", "layers_of", "edge_of", "out_edge"]

_LINEAR = LinearRule()


def edge_of(t: Tensor) -> GradientEdge | None:
    """The autograd edge of ``t`` as it is now (None if it does not require grad)."""
    fn = t.grad_fn
    if fn is not None:
        return GradientEdge(fn, t.output_nr)
    return get_gradient_edge(t) if t.requires_grad else None


def out_edge(y: Tensor) -> GradientEdge | None:
    """The edge that receives ``dL/dy``, robust to later in-place changes of ``y``.

    ``F.linear`` on 3-D inputs returns a view of its 2-D result; an in-place op on that view
    (``relu_``) rebases the graph so that the view's own node drops out of it. The base's
    node stays, so for a view that is a plain reshape of its whole base the base's edge is
    used (its gradient is reshaped back to ``y.shape``).
    """
    if not y.requires_grad:
        return None
    base = y._base
    if (
        base is not None
        and base.requires_grad
        and base.numel() == y.numel()
        and y.is_contiguous()
        and base.is_contiguous()
        and y.storage_offset() == base.storage_offset()
    ):
        return edge_of(base)
    return edge_of(y)


@dataclass
class ModuleCall:
    """One call of any module, recorded in probe mode: the edges of its tensor inputs and
    outputs, and their shapes."""

    module: nn.Module
    path: str
    in_edges: list[GradientEdge | None]
    in_shapes: list[tuple[int, ...]]
    out_edges: list[GradientEdge | None]
    out_shapes: list[tuple[int, ...]]


def _tensors(tree: Any) -> list[Tensor]:
    if isinstance(tree, Tensor):
        return [tree]
    if type(tree) is tuple and all(isinstance(t, Tensor) for t in tree):
        return list(tree)
    return [t for t in tree_leaves(tree) if isinstance(t, Tensor)]


@dataclass
class Wanted:
    """What the recorder does for one module: record its calls with ``rule``."""

    rule: Rule


@dataclass
class Layers:
    """The modules a recorder hooks outside probe mode, ``(path, module)``: the layers with
    a wanted rule, and the attention modules (whose projections are recorded inside)."""

    hooked: list[tuple[str, nn.Module]]
    attention: list[tuple[str, nn.Module]]


def layers_of(model: nn.Module, wanted: dict[int, Wanted]) -> Layers:
    hooked, attention = [], []
    for path, m in model.named_modules():
        if id(m) in wanted:
            hooked.append((path, m))
        if is_attention(m):
            attention.append((path, m))
    return Layers(hooked, attention)


_SIGNATURES: dict[type, inspect.Signature | None] = {}


def positional(mod: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``args`` and ``kwargs`` of a call of ``mod`` with every argument that can be passed by
    position moved there (``bag(x, offsets=o)`` is recorded as ``bag(x, o)``), so the rules
    read their inputs by position however the model passed them."""
    kind = type(mod)
    if kind not in _SIGNATURES:
        try:
            sig = inspect.signature(kind.forward)
            _SIGNATURES[kind] = sig.replace(parameters=list(sig.parameters.values())[1:])
        except (TypeError, ValueError):
            _SIGNATURES[kind] = None
    sig = _SIGNATURES[kind]
    if sig is None:
        return tuple(args), kwargs
    try:
        bound = sig.bind(*args, **kwargs)
    except TypeError:  # the forward will have raised already; keep what the hook saw
        return tuple(args), kwargs
    return bound.args, bound.kwargs


class Recorder:
    """Records the calls of layers that have rules during one forward pass.

    Args:
        model: the model.
        tracked: ``id(tensor)`` of every selected parameter (as the modules see it during the
            forward) -> its name.
        batch: the number of examples B.
        wanted: ``id(module)`` -> what to do with its calls; None: every module that has a
            rule and owns a tracked parameter (probe mode decides which calls to trust).
        probe: also record every module's call (:class:`ModuleCall`) and apply every
            candidate rewrite of NOTE [direct uses].
        expand_shared: ids of modules whose calls are shared (their outputs are expanded to
            the batch); in probe mode, every rule call whose input has a leading dimension of
            size 1 is expanded when this is True.
        direct: record direct uses of tracked parameters (NOTE [direct uses]).
        layers: what :func:`layers_of` found for ``wanted`` (outside probe mode), or None.
    """

    def __init__(
        self,
        model: nn.Module,
        tracked: dict[int, str],
        batch: int,
        *,
        wanted: dict[int, Wanted] | None = None,
        probe: bool = False,
        expand_shared: bool | set[int] = False,
        direct: bool = False,
        owners: set[str] | None = None,
        layers: Layers | None = None,
    ):
        self.model = model
        self.tracked = tracked
        self.batch = batch
        self.calls: list[Call] = []
        self.module_calls: list[ModuleCall] = []
        self.probe = probe
        self.expand_shared = expand_shared
        self.direct_enabled = direct
        self.direct_unsupported: dict[str, str] = {}  # parameter name -> how it was used
        self.handles: list[Any] = []
        self.attention_path = ""
        self._modes: list[Any] = []
        self._attention: AttentionMode | None = None
        self._direct = _DirectUseMode(self) if direct else None
        self.wanted = wanted if wanted is not None else self._find_wanted(owners)
        #: the tracked parameters of the layers with a user's rule whose forward runs now:
        #: a use there (``x * self.w + self.b``) is the layer's own, computed by its rule,
        #: not a direct use (recording it too counted the gradient twice); a use of them
        #: outside that forward is one (NOTE [direct uses])
        self.rule_owned: frozenset[str] = frozenset()
        self._owned_by = self._rule_owned() if direct else {}
        self._owned_stack: list[frozenset[str]] = []
        self.layers = layers
        self.capturing = False

    # -- which modules -------------------------------------------------------------------

    def _find_wanted(self, owners: set[str] | None) -> dict[int, Wanted]:
        """The modules that have a rule and own a selected parameter (by path: under
        ``functional_call`` the tensors the modules hold are swapped during the forward)."""
        wanted: dict[int, Wanted] = {}
        for path, m in self.model.named_modules():
            if is_attention(m):
                continue
            if owners is not None:
                if path not in owners:
                    continue
            elif not any(id(t) in self.tracked for t in m._parameters.values() if t is not None):
                continue
            rule = rule_for(m)
            if rule is not None:
                wanted[id(m)] = Wanted(rule)
        return wanted

    def _rule_owned(self) -> dict[int, tuple[nn.Module, frozenset[str]]]:
        """``id(layer)`` -> the layer and the names of its tracked parameters, for each layer
        with a user's rule."""
        # (by the tensors the layer holds now and by its parameters' names: the tracked
        # tensors may be stand-ins that the forward swaps in, for frozen parameters)
        # (a tied parameter by the name it is tracked by: the first of its names)
        known, first, canon = set(self.tracked.values()), {}, {}
        for name, t in self.model.named_parameters(remove_duplicate=False):
            canon[name] = first.setdefault(id(t), name)
        owned = {}
        for path, m in self.model.named_modules():
            w = self.wanted.get(id(m))
            if w is None or not isinstance(w.rule, UserRule) or id(m) in owned:
                continue
            names = set()
            for role, t in m._parameters.items():
                name = f"{path}.{role}" if path else role
                if t is not None and id(t) in self.tracked:
                    names.add(self.tracked[id(t)])
                elif canon.get(name, name) in known:
                    names.add(canon.get(name, name))
            if names:
                owned[id(m)] = (m, frozenset(names))
        return owned

    def _enter_rule_layer(self, names: frozenset[str]) -> Callable[..., None]:
        def pre_hook(module: nn.Module, args: Any) -> None:
            self._owned_stack.append(names)
            self.rule_owned = self.rule_owned | names

        return pre_hook

    def _exit_rule_layer(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._owned_stack:
            self._owned_stack.pop()
            self.rule_owned = frozenset().union(*self._owned_stack)

    def paths(self) -> dict[int, str]:
        return {id(m): path for path, m in self.model.named_modules()}

    # -- installation --------------------------------------------------------------------

    def install(self) -> None:
        if self.probe:
            names = self.paths()
            attention = [(path, m) for path, m in self.model.named_modules() if is_attention(m)]
            self.handles.append(_first_global_hook(self._any_module(names)))
        else:
            layers = self.layers if self.layers is not None else layers_of(self.model,
                                                                          self.wanted)
            attention = layers.attention
            if _GLOBAL_HOOKS and layers.hooked:
                # a global forward hook of the user's runs before every module's own hooks,
                # and one that returns a new output (``o.clamp(-3, 3)``) would hide the
                # layer's own output from a recording hook of the layer's: the rules would
                # take the gradient of the hook's result for the layer's. The recording is
                # then one global hook, ahead of the user's.
                by_id = {id(m): (path, self.wanted[id(m)]) for path, m in layers.hooked}
                self.handles.append(_first_global_hook(self._layers_hook(by_id)))
            else:
                for path, m in layers.hooked:
                    self.handles.append(m.register_forward_hook(
                        self._layer(path, self.wanted[id(m)], m), prepend=True,
                        with_kwargs=True))
        tracked_names = set(self.tracked.values())
        for path, m in attention:
            # (only an attention with a tracked parameter: a hook on a frozen one turns off
            # the fast path of the TransformerEncoderLayer around it, which then hands the
            # attention the nested tensor its TransformerEncoder made, and the forward fails)
            if not any(id(t) in self.tracked or f"{path}.{n}" in tracked_names
                       for n, t in m.named_parameters()):
                continue
            if self._attention is None:
                self._attention = AttentionMode(self)
            self.handles.append(m.register_forward_pre_hook(self._enter_attention(path)))
            self.handles.append(m.register_forward_hook(self._exit_attention, always_call=True))
        for m, names in self._owned_by.values():
            # (the enter first and the exit last, around the recorder's own hook)
            self.handles.append(m.register_forward_pre_hook(
                self._enter_rule_layer(names), prepend=True))
            self.handles.append(m.register_forward_hook(self._exit_rule_layer,
                                                        always_call=True))
        if self._direct is not None:
            self._direct.__enter__()
            self._modes.append(self._direct)
        self.capturing = True

    def remove(self) -> None:
        self.capturing = False
        for h in self.handles:
            h.remove()
            # (removing a global hook registered with_kwargs leaves its id in torch's
            # with-kwargs dict, which makes torch.compile(module) warn about global hooks
            # for the rest of the process)
            _GLOBAL_WITH_KWARGS.pop(h.id, None)
        self.handles.clear()
        self._owned_stack.clear()
        self.rule_owned = frozenset()
        while self._modes:
            self._modes.pop().__exit__(None, None, None)

    def __enter__(self) -> Recorder:
        self.install()
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    # -- attention -----------------------------------------------------------------------

    def _enter_attention(self, path: str) -> Callable[..., None]:
        def pre_hook(module: nn.Module, args: Any) -> None:
            if self.capturing:
                self.attention_path = path
                self._attention.__enter__()
                self._modes.append(self._attention)

        return pre_hook

    def _exit_attention(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._modes and self._modes[-1] is self._attention:
            self._modes.pop().__exit__(None, None, None)

    # -- module calls --------------------------------------------------------------------

    def _any_module(self, names: dict[int, str]) -> Callable[..., Any]:
        def hook(module: nn.Module, args: Any, kwargs: dict, output: Any) -> Any:
            if not self.capturing:
                return None
            path = names.get(id(module))
            if path is None:  # a module outside the model (a loss module, say)
                return None
            w = self.wanted.get(id(module))
            replaced = None
            if w is not None:
                replaced = self._record_layer(path, w, module, args, kwargs, output)
                if replaced is not None:
                    output = replaced
            ins, outs = _tensors((args, kwargs) if kwargs else args), _tensors(output)
            self.module_calls.append(ModuleCall(
                module, path,
                [edge_of(t) if t.is_floating_point() else None for t in ins],
                [tuple(t.shape) for t in ins],
                [out_edge(t) if t.is_floating_point() else None for t in outs],
                [tuple(t.shape) for t in outs],
            ))
            return replaced

        return hook

    def _layer(self, path: str, w: Wanted, module: nn.Module) -> Callable[..., Any]:
        def hook(mod: nn.Module, args: Any, kwargs: dict, output: Any) -> Any:
            if not self.capturing:
                return None
            return self._record_layer(path, w, mod, args, kwargs, output)

        return hook

    def _layers_hook(self, by_id: dict[int, tuple[str, Wanted]]) -> Callable[..., Any]:
        def hook(mod: nn.Module, args: Any, kwargs: dict, output: Any) -> Any:
            found = by_id.get(id(mod))
            if found is None or not self.capturing:
                return None
            return self._record_layer(found[0], found[1], mod, args, kwargs, output)

        return hook

    def _expands(self, w: Wanted, module: nn.Module, x: Any) -> bool:
        if not isinstance(x, Tensor) or x.dim() == 0 or x.shape[0] != 1 or self.batch == 1:
            return False
        if isinstance(self.expand_shared, set):
            return id(module) in self.expand_shared
        return bool(self.expand_shared)

    def _record_layer(
        self, path: str, w: Wanted, mod: nn.Module, args: Any, kwargs: dict, output: Any
    ) -> Any:
        if kwargs:
            args, kwargs = positional(mod, args, kwargs)
        if not args:
            return None
        x = args[0]
        params: dict[str, tuple[Tensor, slice | None]] = {}
        complete = True
        roles = w.rule.roles
        for role, t in mod._parameters.items():
            if t is None:
                continue
            if roles is not None and role not in roles:
                # a parameter the rule does not compute (weight_orig, from which a hook
                # computes the weight): the walk must go through the layer to find its use
                if id(t) in self.tracked:
                    complete = False
                continue
            if id(t) in self.tracked:
                params[role] = (t, None)
            elif t.grad_fn is not None:
                complete = False
        parametrized = mod._modules.get("parametrizations")
        if parametrized is not None and len(parametrized):
            # a weight computed from other tensors (torch.nn.utils.parametrize): the graph walk
            # must go through the layer to find them (reading the attribute would run the
            # parametrization once more)
            complete = False
        replaced = None
        shared = self._expands(w, mod, x)
        if shared and isinstance(output, Tensor) and output.dim() >= 1 and output.shape[0] == 1:
            # (not a use of x by the model: an x that is a tracked parameter, a prototype the
            # layer reads, must not be recorded as broadcast over the examples by this expand,
            # whose result the forward never uses and whose gradient is zero)
            self.capturing = False
            try:
                output = output.expand(self.batch, *output.shape[1:])
                args = (x.expand(self.batch, *x.shape[1:]), *args[1:])
            finally:
                self.capturing = True
            replaced = output
        elif shared:
            shared = False
        outs = _tensors(output)
        call = Call(
            rule=w.rule,
            module=mod,
            path=path,
            params=params,
            args=tuple(args),
            kwargs=kwargs,
            outputs=outs,
            out_edges=[out_edge(t) for t in outs],
            # (the graph walk of the plan reads them; the rules' pass does not)
            in_edges=[e for e in (edge_of(a) for a in _tensors((args, kwargs) if kwargs else args))
                      if e is not None] if self.probe else [],
            complete=complete,
            shared=shared,
            x_version=x._version if isinstance(x, Tensor) else 0,
        )
        at_forward = getattr(w.rule, "at_forward", None)
        if at_forward is not None:  # (what a rule reads from the forward: the rules' module)
            at_forward(call)
        self.calls.append(call)
        return replaced

    # -- attention projections and broadcast parameters ----------------------------------

    def linear(
        self,
        x: Tensor,
        weight: Tensor,
        weight_rows: slice | None,
        bias: Tensor | None,
        bias_rows: slice | None,
        path: str,
    ) -> Tensor:
        """``F.linear`` on a batch-first ``(N, L, E)`` input, recorded as a Linear call."""
        import torch.nn.functional as F

        w = weight if weight_rows is None else weight[weight_rows]
        b = None if bias is None else (bias if bias_rows is None else bias[bias_rows])
        y = F.linear(x, w, b)
        params: dict[str, tuple[Tensor, slice | None]] = {}
        complete = True
        for role, t, rows in (("weight", weight, weight_rows), ("bias", bias, bias_rows)):
            if t is None:
                continue
            if id(t) in self.tracked:
                params[role] = (t, rows)
            elif t.grad_fn is not None:
                complete = False
        self.calls.append(Call(
            rule=_LINEAR, module=None, path=path, params=params, args=(x,), kwargs={},
            outputs=[y], out_edges=[out_edge(y)],
            in_edges=[e for e in (edge_of(x),) if e is not None],
            complete=complete, x_version=x._version, extra={"fixed_bdim": 0},
        ))
        return y

    def expand(self, param: Tensor, repeated: Tensor, path: str, bdim: int) -> Tensor:
        """Records ``repeated``, the tracked ``param`` broadcast over the examples along
        ``bdim``."""
        if id(param) in self.tracked:
            self.calls.append(Call(
                rule=BROADCAST, module=None, path=path, params={"weight": (param, None)},
                args=(repeated,), kwargs={}, outputs=[repeated],
                out_edges=[edge_of(repeated)], in_edges=[], x_version=repeated._version,
                extra={"fixed_bdim": bdim},
            ))
        return repeated


# NOTE [direct uses]: the ops a tracked parameter may enter directly, broadcast over the
# examples, and be recorded; any other direct use leaves the parameter to a fallback.
_ADDS = {torch.add, torch.Tensor.add, torch.Tensor.__add__, torch.Tensor.__radd__}
_EXPANDS = {torch.Tensor.expand, torch.Tensor.expand_as}
# Ops through which a parameter reaches a layer or attention as an ordinary argument (the
# layer's own use), or only its metadata is read: not direct uses.
_NEUTRAL = {
    torch.Tensor.size, torch.Tensor.dim, torch.Tensor.__len__, torch.Tensor.numel,
    torch.Tensor.shape.__get__, torch.Tensor.dtype.__get__, torch.Tensor.device.__get__,
    torch.Tensor.requires_grad.__get__, torch.Tensor.is_floating_point,
}


class _DirectUseMode(torch.overrides.TorchFunctionMode):
    """Records direct uses of tracked parameters (NOTE [direct uses])."""

    def __init__(self, recorder: Recorder):
        super().__init__()
        self.recorder = recorder

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        rec = self.recorder
        if not rec.capturing or func in _NEUTRAL:
            return func(*args, **kwargs)
        tracked = rec.tracked
        hit = None
        for a in args:
            if isinstance(a, Tensor) and id(a) in tracked:
                hit = a
                break
        if hit is None or tracked[id(hit)] in rec.rule_owned:
            return func(*args, **kwargs)
        if func in _EXPANDS:
            out = func(*args, **kwargs)
            bdim = _broadcast_dim(hit, out, rec.batch)
            if bdim is not None:
                return rec.expand(hit, out, tracked[id(hit)], bdim)
            return out
        if func in _ADDS and len(args) == 2 and not kwargs:
            other = args[1] if args[0] is hit else args[0]
            if isinstance(other, Tensor):
                shape = torch.broadcast_shapes(hit.shape, other.shape)
                bdim = _broadcast_dim(hit, hit.expand(shape), rec.batch)
                if bdim is not None and shape == other.shape:
                    e = rec.expand(hit, hit.expand(shape), tracked[id(hit)], bdim)
                    return func(e, other) if args[0] is hit else func(other, e)
        return func(*args, **kwargs)


def _broadcast_dim(param: Tensor, expanded: Tensor, batch: int) -> int | None:
    """The dimension of ``expanded`` that broadcasting over the examples added to ``param``:
    the one dimension of size B where ``param`` (aligned to the right, as broadcasting
    aligns) had none or size 1 (dimension 1 for a recurrent layer's initial state
    ``h0.expand(layers, B, hidden)``); None where there is no such dimension. Where several
    could be (a ``(T, B, F)`` activation with T == B), the first: the plan's data-flow test
    checks the dimension like any rule call's, and refuses the parameter where it is not
    the examples' dimension."""
    if batch <= 1 or expanded.dim() == 0:
        return None
    lead = expanded.dim() - param.dim()
    if lead < 0:
        return None
    for d, size in enumerate(expanded.shape):
        if size != batch:
            continue
        if d < lead or param.shape[d - lead] == 1:
            return d
    return None

"""The registry of per-layer rules: which module types have one, and how users add theirs.

A rule turns one recorded call of a layer (its inputs, and the gradient of the per-example
losses with respect to its outputs) into factors (NOTE [Factors]), one per parameter of the
layer. Rules are registered by module type with :func:`register_rule`, as Opacus registers
its grad samplers; :func:`rule_for` finds the rule of a module (through its type's MRO, for
subclasses that keep the registered type's ``forward``).
"""

from __future__ import annotations

import inspect
import numbers
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor, nn
from torch.autograd.graph import GradientEdge

from torch_vjp._errors import PerSampleTypeError, PerSampleValueError, a_type
from torch_vjp._per_sample.factors import Factor, SmallFactor

__all__ = ["Call", "Rule", "Declined", "register_rule", "rule_for", "replaced_forward",
           "hidden_rule", "UserRule", "to_batch_first", "layer_settings", "settings_of",
           "settings_changed"]


@dataclass
class Call:
    """One use of parameters by a layer that has a rule, recorded during the forward pass.

    Attributes:
        rule: the layer's rule.
        module: the layer (None for a projection recorded inside attention).
        path: the layer's name in the model (``"encoder.layers.0.linear1"``).
        params: role (the parameter's attribute name, ``"weight"``) -> the parameter tensor
            and the block of its rows the call used (None: all of it).
        args: the tensors and other values the layer was called with; ``x`` is ``args[0]``.
        kwargs: the keyword arguments of the call.
        outputs: the tensor leaves of the layer's output.
        out_edges: the autograd edges that receive the gradients of ``outputs``.
        in_edges: the autograd edges of the tensor inputs (for the graph walk).
        bdim: the dimension of ``x`` (and of the first output) that holds the examples,
            None for a batch of one; set from the plan.
        complete: no parameter of the layer is computed from other tensors (a
            parametrization), so the graph walk may skip the layer's internals.
        shared: the call's input holds no batch (a table used by every example, such as
            position ids of shape ``(1, T)``); its output was expanded to the batch.
    """

    rule: Rule
    module: nn.Module | None
    path: str
    params: dict[str, tuple[Tensor, slice | None]]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    outputs: list[Tensor]
    out_edges: list[GradientEdge | None]
    in_edges: list[GradientEdge]
    bdim: int | None = 0
    complete: bool = True
    shared: bool = False
    x_version: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def x(self) -> Any:
        return self.args[0] if self.args else None


class Declined(Exception):
    """Raised by :meth:`Rule.factors` for a call the rule cannot compute (the recorded call is
    not one it can split into examples): the parameters of the call go to the fallback for
    this call. ``str(err)`` says why, as a phrase. (Returning no factors means that no
    gradient reaches the parameters, which is not the same.)"""


def to_batch_first(t: Tensor, bdim: int | None) -> Tensor:
    """Moves the examples' dimension to the front; ``bdim=None`` means one example."""
    if bdim is None:
        return t.unsqueeze(0)
    return t.movedim(bdim, 0) if bdim != 0 else t


class Rule:
    """Turns a recorded call and its output gradients into factors, one per selected role.

    Subclasses set ``name`` (for the plan's table) and implement :meth:`factors`;
    :meth:`batch_dims` says which dimensions of the input may hold the examples (all but
    the last by default, as for a layer applied to the last dimension).
    """

    name = "rule"
    #: The attribute names of the parameters the rule computes (None: all the layer's own).
    #: A layer whose other parameters are selected (``weight_orig`` of the old spectral norm,
    #: from which the layer's weight is computed) is walked through by the plan, which then
    #: finds them used outside the rules.
    roles: tuple[str, ...] | None = ("weight", "bias")

    def batch_dims(self, module: nn.Module | None, x: Any) -> tuple[int, ...]:
        if not isinstance(x, Tensor):
            return ()
        return tuple(range(max(0, x.dim() - 1)))

    def factors(
        self, call: Call, grads: Sequence[Tensor | None], roles: set[str], batch: int
    ) -> list[tuple[str, Factor]]:
        """Factors for the ``roles`` of ``call``; ``grads[j]`` is the gradient of the sum of
        the per-example losses with respect to ``call.outputs[j]`` (None where unused)."""
        raise NotImplementedError

    def applies(self, module: nn.Module) -> bool:
        """Whether this module's configuration is one the rule handles (e.g. an Embedding
        without ``max_norm``)."""
        return True

    def declined(self, module: nn.Module) -> str:
        """Why :meth:`applies` declines ``module`` (for the plan's reasons), a phrase."""
        return "the rule does not handle this configuration"

    def other_output_dims(self, module: nn.Module | None, x: Any) -> dict[int, int]:
        """Outputs other than the first that hold the examples, ``{position: dimension}``
        (in the order of the output's tensors); the plan checks that each keeps the examples
        apart along that dimension, as it does for the first output. None by default."""
        return {}


# type -> (rule, require the registered type's own forward)
_RULES: dict[type, tuple[Rule, bool]] = {}
# "module.QualName" of a type from an optional package (never imported here) -> the same
_NAMED: dict[str, tuple[Rule, bool]] = {}


def register_rule(
    *types: type | str, stock_only: bool = True
) -> Callable[[type[Rule]], type[Rule]]:
    """Class decorator: registers one instance of a :class:`Rule` subclass for module types.

    A type may be given by its qualified name (``"transformers.pytorch_utils.Conv1D"``), so
    that an optional package is never imported for its rule. With ``stock_only`` (torch's
    own layers), a subclass of a registered type has the rule only if it keeps the type's
    ``forward``.
    """

    def register(cls: type[Rule]) -> type[Rule]:
        rule = cls()
        for t in types:
            if isinstance(t, str):
                _NAMED[t] = (rule, stock_only)
            else:
                _RULES[t] = (rule, stock_only)
        return cls

    return register


def _defined_by(f: Any, base: type, name: str) -> bool:
    """Whether ``f`` is the ``name`` a class of ``base``'s MRO defined where it was defined
    (not a function set on the class since, ``nn.Linear.forward = ...``)."""
    return any(getattr(f, "__qualname__", None) == f"{k.__qualname__}.{name}"
               and getattr(f, "__module__", None) == k.__module__ for k in base.__mro__)


def _stock(module: nn.Module, base: type, defined: bool = True) -> bool:
    """Whether ``module`` runs ``base``'s own ``forward`` (and ``_conv_forward``, for convs):
    the same function, and (``defined``) one that ``base``'s classes define
    (:func:`_defined_by`; a rule that records the calls inside the forward, attention's,
    needs only the first)."""
    cls = type(module)
    for name in REPLAYED:
        f = getattr(cls, name, None)
        if f is not getattr(base, name, None):
            return False
        if defined and f is not None and not _defined_by(f, base, name):
            return False
    return True


#: the methods a stock rule replays: one set on the instance replaces the type's
REPLAYED = ("forward", "_conv_forward")


def replaced_forward(module: nn.Module) -> str | None:
    """The method of ``module`` replaced on the instance (``layer.forward = ...``), which
    a rule of torch's layer cannot replay, or None."""
    own = module.__dict__
    for name in REPLAYED:  # (a loop: a generator costs more, for every module on every call)
        if name in own:
            return name
    return None


def hidden_rule(module: nn.Module) -> str | None:
    """Why the rule of ``module``'s type does not apply to it when the reason is a method
    replaced on the instance or on the type (a phrase), or None."""
    for base in type(module).__mro__:
        hit = _RULES.get(base)
        if hit is None:
            continue
        if not hit[1] or not hit[0].applies(module):
            return None
        name = replaced_forward(module)
        if name is not None:
            return (f"whose {name} is replaced on the instance (layer.{name} = ...): the "
                    f"layer's rule replays only the type's own {name}")
        cls = type(module)
        for name in REPLAYED:
            f = getattr(cls, name, None)
            if f is not None and f is getattr(base, name, None) and not _defined_by(
                    f, base, name):
                return (f"whose {name} is not the one torch defines ({base.__name__}.{name} "
                        f"was replaced on the class): the layer's rule replays only "
                        f"torch's own {name}")
        return None
    return None


def rule_for(module: nn.Module) -> Rule | None:
    """The rule for ``module``, or None."""
    for base in type(module).__mro__:
        hit = _RULES.get(base)
        if hit is None and _NAMED:
            hit = _NAMED.get(f"{base.__module__}.{base.__qualname__}")
        if hit is None:
            continue
        rule, stock_only = hit
        if stock_only and (not _stock(module, base) or replaced_forward(module) is not None):
            return None
        return rule if rule.applies(module) else None
    return None


def declining_rule(module: nn.Module) -> Rule | None:
    """The rule registered for ``module``'s type when it declines this configuration."""
    for base in type(module).__mro__:
        hit = _RULES.get(base)
        if hit is None and _NAMED:
            hit = _NAMED.get(f"{base.__module__}.{base.__qualname__}")
        if hit is not None:
            return None if hit[0].applies(module) else hit[0]
    return None


def registered_types() -> list[str]:
    """The names of the module types that have rules, for messages."""
    names = {rule.name if t.__name__.startswith("_") else t.__name__
             for t, (rule, _) in _RULES.items()}
    names |= {n.rpartition(".")[2] + f" ({n.partition('.')[0]})" for n in _NAMED}
    return sorted(names)


class UserRule(Rule):
    """A rule given by a function ``fn(module, inputs, grad_output) -> {param: per-sample}``.

    ``inputs`` are the layer's positional tensor inputs and ``grad_output`` the gradient of
    its (first) output, each with the examples moved to dimension 0; the function returns the
    per-sample gradients ``(B, *param.shape)`` of the layer's own parameters, keyed by
    attribute name or by the parameter itself. ``NotImplementedError`` from the function
    declines the call (:class:`Declined`); any other exception reaches the caller as it is,
    with a note naming the rule and the layer (``hooks``): never left to the fallback,
    where the user's bug would vanish. See :func:`torch_vjp.register_per_sample_rule`.
    """

    roles = None

    def __init__(self, fn: Callable[..., Any], name: str, batch_dims: Callable[..., Any] | None):
        self.fn = fn
        self.name = name
        self._batch_dims = batch_dims

    def batch_dims(self, module: nn.Module | None, x: Any) -> tuple[int, ...]:
        if self._batch_dims is not None:
            return self._checked_dims(self._batch_dims(x), x)
        return (0,) if isinstance(x, Tensor) and x.dim() >= 1 else ()

    def _checked_dims(self, dims: Any, x: Any) -> tuple[int, ...]:
        """``batch_dims(x)`` as a tuple of dimensions of ``x`` (a lone int is one dimension;
        negative ones count from the end, as torch's do)."""
        given = dims
        if isinstance(dims, numbers.Integral) and not isinstance(dims, bool):
            dims = (dims,)
        n = x.dim() if isinstance(x, Tensor) else 0
        try:
            dims = tuple(dims)
        except TypeError:
            dims = (dims,)
        # (numpy's integers are ints to torch's dimension arguments too)
        dims = tuple(int(d) if isinstance(d, numbers.Integral) and not isinstance(d, bool)
                     else d for d in dims)
        for d in dims:
            if isinstance(d, bool) or not isinstance(d, int) or not -n <= d < n:
                shape = f"shape {tuple(x.shape)}" if isinstance(x, Tensor) else a_type(x)
                raise PerSampleTypeError(
                    f"torch_vjp: batch_dims of the per-sample rule {self.name} returned "
                    f"{given!r} for the layer's first input ({shape}), but it must give a "
                    f"dimension of that input, or a sequence of them (ints from {-n} to "
                    f"{n - 1}), that may hold the examples. Fix: return e.g. (0,) for a "
                    f"batch-first input, (1,) for a sequence-first one."
                )
        return tuple(dict.fromkeys(d % n for d in dims))

    def factors(self, call, grads, roles, batch):
        g = grads[0]
        if g is None:
            return []
        one = call.bdim is None and batch == 1

        def first(t: Tensor) -> Tensor:
            # (one example, whose dimension of size 1 no probe can tell from the others: a
            # leading one is taken for it, as the rule's batch-first contract reads it;
            # everything belongs to that example either way)
            return to_batch_first(t, 0 if one and t.shape[0] == 1 else call.bdim)

        gb = first(g) if g.dim() > 0 else to_batch_first(g, call.bdim)
        inputs = tuple(first(a) if isinstance(a, Tensor) and a.dim() > 0 else a
                       for a in call.args)
        try:
            result = self.fn(call.module, inputs, gb)
        except NotImplementedError as err:  # (the rule's way to decline a call)
            raise Declined(f"the rule raised NotImplementedError: {err}" if str(err) else
                           "the rule raised NotImplementedError") from err
        if not isinstance(result, dict):
            raise PerSampleTypeError(
                f"torch_vjp: the per-sample rule {self.name} returned a "
                f"{type(result).__name__}, but it must return a dict from parameter (or its "
                f"attribute name) to its per-sample gradients of shape (B, *param.shape)."
            )
        by_id = {id(t): role for role, (t, _) in call.params.items()}
        out = []
        given: set[str] = set()
        own = (None if call.module is None else
               [n for n, _ in call.module.named_parameters(recurse=False)])
        for key, value in result.items():
            # (a rule runs only for a layer with parameters of its own: ``own`` is not empty)
            if isinstance(key, str) and own and key not in own:
                raise PerSampleValueError(
                    f"torch_vjp: the per-sample rule {self.name} returned a gradient for "
                    f"{key!r}, but the layer '{call.path}' ({type(call.module).__name__}) has "
                    f"no parameter of that name: its own are {own}. A key is the name of a "
                    f"parameter of the layer itself (as in module.named_parameters("
                    f"recurse=False)), or the parameter tensor. Fix: return "
                    f"{{{own[0]!r}: ...}}."
                )
            role = key if isinstance(key, str) else by_id.get(id(key))
            if role is None and isinstance(key, Tensor) and call.module is not None:
                # (the layer's parameter itself, where the call recorded a stand-in for it:
                # a frozen parameter in params)
                role = next((r for r, t in call.module._parameters.items() if t is key), None)
            if role is None:
                raise PerSampleTypeError(
                    f"torch_vjp: the per-sample rule {self.name} returned a gradient keyed by "
                    f"{_key_str(key)}, which is neither the name of a parameter of the layer "
                    f"'{call.path}' ({type(call.module).__name__}) nor one of its parameter "
                    f"tensors, so the gradient would belong to nothing. A rule computes the "
                    f"layer's own parameters only. Fix: key each gradient by its attribute "
                    f"name ({own}) or by the parameter itself (module.<name>)."
                )
            if role in given:
                raise PerSampleValueError(
                    f"torch_vjp: the per-sample rule {self.name} returned two gradients for "
                    f"'{call.path}.{role}' (keyed once by its name and once by the parameter "
                    f"itself), which would count its gradient twice. Fix: return one entry "
                    f"per parameter."
                )
            given.add(role)
            if role not in call.params:
                continue  # a parameter of the layer that is not selected
            if role not in roles:
                continue
            param = call.params[role][0]
            if not isinstance(value, Tensor) or tuple(value.shape) != (batch, *param.shape):
                shape = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
                raise PerSampleTypeError(
                    f"torch_vjp: the per-sample rule {self.name} returned {shape} for "
                    f"'{call.path}.{role}', but it must return its per-sample gradients, of "
                    f"shape (B, *param.shape) = {(batch, *tuple(param.shape))}: one gradient "
                    f"per example, each the size of the parameter."
                )
            if value.dtype != param.dtype:
                if not value.is_floating_point():
                    raise PerSampleTypeError(
                        f"torch_vjp: the per-sample rule {self.name} returned a tensor of "
                        f"dtype {value.dtype} for '{call.path}.{role}', but gradients are "
                        f"floating point, in the parameter's dtype ({param.dtype}). Fix: "
                        f"compute the gradient from the floating-point inputs and grad_output "
                        f"the rule receives."
                    )
                value = value.to(param.dtype)  # (as autograd gives it: the parameter's dtype)
            out.append((role, SmallFactor(value)))
        return out


def _key_str(key: Any) -> str:
    if isinstance(key, Tensor):
        return f"a tensor of shape {tuple(key.shape)}"
    return f"{key!r} ({a_type(key)})"


def check_user_rule(fn: Callable[..., Any]) -> None:
    """Raises :class:`RuleError` unless ``fn`` can be called as ``fn(module, inputs,
    grad_output)``."""
    if not callable(fn):
        raise PerSampleTypeError(
            f"torch_vjp.register_per_sample_rule: the rule must be a function "
            f"fn(module, inputs, grad_output) -> dict, got {a_type(fn)}."
        )
    try:
        inspect.signature(fn).bind(None, None, None)
    except (TypeError, ValueError):
        raise PerSampleTypeError(
            f"torch_vjp.register_per_sample_rule: the rule {getattr(fn, '__name__', fn)!r} "
            f"cannot be called as fn(module, inputs, grad_output): it receives the layer, "
            f"its inputs (a tuple, examples first) and the gradient of its output (examples "
            f"first), and returns a dict of per-sample gradients."
        ) from None


def register_user_rule(
    module_type: type, fn: Callable[..., Any], batch_dims: Callable[..., Any] | None
) -> None:
    """Registers a user's rule function for ``module_type`` (and subclasses)."""
    if not (isinstance(module_type, type) and issubclass(module_type, nn.Module)):
        raise PerSampleTypeError(
            f"torch_vjp.register_per_sample_rule: the first argument must be an nn.Module "
            f"subclass, got {module_type!r}."
        )
    check_user_rule(fn)
    qual = str(getattr(fn, "__qualname__", None) or type(fn).__name__).rpartition(".<locals>.")[2]
    name = f"'{qual}' (registered for {module_type.__name__})"
    _RULES[module_type] = (UserRule(fn, name, batch_dims), False)


# The settings a rule decided on, kept with the plan (``Plan.settings``)

_SETTING_TYPES = (bool, int, float, str, tuple, type(None))


def layer_settings(layers: list[nn.Module]) -> tuple[Any, ...]:
    """The public plain-valued attributes of the layers the rules computed (an Embedding's
    ``scale_grad_by_freq``, a recurrent layer's ``dropout``, a convolution's ``stride``):
    a rule decided on them when the plan was made, so a plan whose layers' settings have
    changed since is made again. (A few microseconds a layer, on every call.)"""
    return tuple([_settings(m) for m in layers])


def _settings(m: nn.Module) -> tuple[Any, ...]:
    """One layer's part of :func:`layer_settings` (the private names first: most of a
    module's dict; list comprehensions: generators cost more, on every call)."""
    types_ = _SETTING_TYPES
    return tuple([v for k, v in m.__dict__.items()
                  if k[:1] != "_" and type(v) in types_ and k != "training"])


def settings_of(layers: list[nn.Module]) -> tuple[Any, ...]:
    """``Plan.settings``, the layers held weakly: a plan that held its model (one that is a
    layer, ``nn.Linear``) kept it alive in the cache, which is weak in the model."""
    return tuple(map(weakref.ref, layers)), layer_settings(layers)


def settings_changed(settings: tuple[Any, ...]) -> bool:
    """Whether a layer of ``settings`` (:func:`settings_of`) is gone or set otherwise."""
    for ref, before in zip(settings[0], settings[1]):
        m = ref()
        if m is None or _settings(m) != before:
            return True
    return False

"""How each call of the ``grad_outputs`` checker (:mod:`torch_vjp._checks`) names its
arguments in messages: :class:`Labels`, and one preset per call site, made once."""

from __future__ import annotations

import dataclasses
from typing import Any

from torch import Tensor

__all__ = ["Labels", "GRAD", "BACKWARD", "TENSOR_BACKWARD", "CHECK", "PULLBACK", "VJP",
           "TANGENTS", "keyed", "single"]


@dataclasses.dataclass(frozen=True, slots=True)
class Labels:
    """How one call names its arguments in messages, and whether it speaks torch's language:
    the label preset of one calling context.

    ``torch_vjp.grad`` speaks of ``outputs[i]`` and ``grad_outputs[i]``; ``Tensor.backward`` of
    ``y`` and ``gradient``; a JVP of ``primals[i]`` and ``tangents[i]``. One instance per call
    site, made once (see the presets at the end of this module), so the checker's fast path
    allocates nothing.

    Attributes:
        call: the public call named at the start of every explanation.
        outputs, grad_outputs, inputs: how the call names its arguments.
        indexed: whether messages index them (``outputs[0]``) or not (``gradient``).
        role: ``"grad_outputs"`` (cotangents, dL/d output) or ``"tangents"`` (JVP directions).
        batch_hint: how this call computes K products at once.
        batch_flag: the name of the call's batching flag.
        require_grad: whether an output that does not require grad is an error (it is for
            ``grad``/``backward``; products of torch.func and torch_vjp ignore such outputs).
        allow_none: whether ``None`` entries are accepted (not for JVP tangents).
        torch_first: whether the call stands in for one of torch's own (``grad``, ``backward``,
            ``Tensor.backward``, a ``torch.func.vjp`` pullback): then an error's message is
            torch's sentence and the explanation a note (NOTE [torch's sentence first]).
        empty_batch_ok: whether a batch of K = 0 vectors is accepted (torch_vjp's own
            batched products return empty results; torch.autograd.grad raises).
        tree: the pytree whose tensor leaves the messages' index ``i`` counts, where it is
            not a flat sequence of tensors (a dict, nested containers): entry ``i`` is then
            named by its place in it, ``outputs['loss']``, ``outputs[1][0]``, as the user
            wrote it, not by its position among the leaves (see :func:`keyed`).
        inputs_tree: the same for the inputs (a dict of inputs, a pytree of primals).
    """

    call: str
    outputs: str = "outputs"
    grad_outputs: str = "grad_outputs"
    _: dataclasses.KW_ONLY
    indexed: bool = True
    role: str = "grad_outputs"
    inputs: str = "inputs"
    batch_hint: str = "pass is_grads_batched=True"
    batch_flag: str = "is_grads_batched"
    require_grad: bool = True
    allow_none: bool = True
    torch_first: bool = True
    empty_batch_ok: bool = False
    # (neither compared nor hashed: a tree holds tensors, and dicts or lists)
    tree: Any = dataclasses.field(default=None, compare=False, repr=False)
    inputs_tree: Any = dataclasses.field(default=None, compare=False, repr=False)

    def replace(self, **changes: Any) -> Labels:
        """A copy with some attributes changed, e.g. ``GRAD.replace(call="torch.autograd.grad")``."""
        return dataclasses.replace(self, **changes)

    @property
    def whole_jacobian(self) -> str:
        """What computes the whole Jacobian from where this call stands: ``jacobian_of``
        where a graph was built (``grad``, ``backward``), else ``jacobian`` of the function
        (a pullback's or a JVP's outputs hold no graph of the caller's)."""
        if self.role == "tangents" or self.inputs == "primals":
            return "torch_vjp.jacobian(f, *primals)"
        return "torch_vjp.jacobian_of"

    @property
    def product(self) -> str:
        """The product one vector makes: a VJP for cotangents, a JVP for tangents."""
        return "Jacobian-vector product" if self.role == "tangents" else "vector-Jacobian product"

    def out(self, i: int) -> str:
        return f"{self.outputs}{self._place(i)}" if self.indexed else self.outputs

    def go(self, i: int) -> str:
        return f"{self.grad_outputs}{self._place(i)}" if self.indexed else self.grad_outputs

    def inp(self, j: int) -> str:
        """Input ``j`` (its rank among the input tensors) as the call names it."""
        return f"{self.inputs}{_place(self.inputs_tree, j, edges=True)}"

    def _place(self, i: int) -> str:
        return _place(self.tree, i)

    def meaning(self, i: int) -> str:
        """What the vector is, in words: the reason for every rule."""
        if self.role == "tangents":
            return f"{self.go(i)} is a direction of change dx for {self.out(i)}"
        return f"{self.go(i)} is dL/d {self.out(i)}"


_SINGLE: dict[int, tuple[Labels, Labels]] = {}


def single(labels: Labels) -> Labels:
    """``labels`` for a function whose output is one tensor: ``out``, not indexed."""
    hit = _SINGLE.get(id(labels))
    if hit is None or hit[0] is not labels:
        single = labels.replace(outputs="out", indexed=False)
        hit = _SINGLE[id(labels)] = (labels, single)
    return hit[1]


def _place(tree: Any, i: int, *, edges: bool = False) -> str:
    """Where tensor leaf ``i`` of ``tree`` sits: ``[i]`` where ``tree`` is None, else its key
    path (``['loss']``, ``[1][0]``); ``edges``: a GradientEdge (an input torch takes in
    place of a tensor) is one leaf."""
    if tree is None:
        return f"[{i}]"
    from torch.autograd.graph import GradientEdge
    from torch.utils._pytree import keystr, tree_flatten_with_path

    paths = tree_flatten_with_path(
        tree, is_leaf=(lambda t: isinstance(t, GradientEdge)) if edges else None)[0]
    return keystr(paths[i][0]) if 0 <= i < len(paths) else f"[{i}]"


def _flat(tree: Any) -> bool:
    return type(tree) in (tuple, list) and all(isinstance(t, Tensor) for t in tree)


def keyed(labels: Labels, tree: Any, inputs: Any = None) -> Labels:
    """``labels`` naming entry ``i`` by its place in ``tree`` (the pytree whose tensor leaves
    ``i`` counts), where ``tree`` is not a flat tuple or list of tensors: a dict output's
    cotangent ``i`` is ``cotangents['loss']``, not ``cotangents[1]`` (its rank among the
    leaves, in an order the user never wrote); likewise input ``j`` by its place in
    ``inputs`` (None: by its rank). A flat sequence keeps ``labels`` as they are: its
    leaves' ranks are its indices."""
    changes = {}
    if tree is not None and not _flat(tree) and not isinstance(tree, Tensor):
        changes["tree"] = tree
    if inputs is not None and not _flat(inputs) and not isinstance(inputs, Tensor):
        changes["inputs_tree"] = inputs
    return labels.replace(**changes) if changes else labels


# ---------------------------------------------------------------------------------------
# How each call site names things (one object each, made once).
# ---------------------------------------------------------------------------------------

#: ``torch_vjp.grad`` and ``torch.autograd.grad`` (checked).
GRAD = Labels("torch_vjp.grad")
#: ``torch_vjp.backward`` and ``torch.autograd.backward`` (checked).
BACKWARD = Labels(
    "torch_vjp.backward", "tensors", "grad_tensors",
    batch_hint="use torch_vjp.grad(..., is_grads_batched=True): backward has no batched form",
)
#: ``Tensor.backward(gradient)`` (checked).
TENSOR_BACKWARD = Labels(
    "y.backward(gradient)", "y", "gradient", indexed=False,
    batch_hint="use torch_vjp.grad(y, x, gradient, is_grads_batched=True): backward has no "
    "batched form",
)
#: ``torch_vjp.check_grad_outputs``.
CHECK = GRAD.replace(call="torch_vjp.check_grad_outputs")
#: The pullback of ``torch.func.vjp`` (checked): outputs that do not depend on the primals
#: are ignored, as torch.func ignores them.
PULLBACK = Labels(
    "torch.func.vjp: vjp_fn(cotangents)", "outputs", "cotangents", inputs="primals",
    batch_hint="call vjp_fn(cotangents, batched=True) of torch_vjp.vjp", batch_flag="batched",
    require_grad=False,
)
#: ``vjp_fn`` of ``torch_vjp.vjp``: torch_vjp's own wording.
VJP = PULLBACK.replace(call="torch_vjp.vjp: vjp_fn", torch_first=False, empty_batch_ok=True)
#: The tangents of ``torch_vjp.jvp``.
TANGENTS = Labels(
    "torch_vjp.jvp", "primals", "tangents", role="tangents", require_grad=False,
    allow_none=False, batch_hint="pass batched=True", batch_flag="batched", torch_first=False,
    empty_batch_ok=True,
)

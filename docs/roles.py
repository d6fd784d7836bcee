"""A griffe extension for the API page: docstring cross-reference roles as inline code.

torch_vjp's docstrings are Google style, read by ``help()`` and doctest as well as by the
docs, and they name other objects with Sphinx roles (``:func:`torch.autograd.grad```,
``:class:`~torch_vjp.JacobianWarning```). mkdocstrings renders docstrings as Markdown, where
a role is plain text. This extension (listed under the python handler's ``extensions`` in
``mkdocs.yml``) rewrites every role as inline code when griffe loads an object: the target
as written, or its last component after a ``~`` (as Sphinx shows it).
"""

from __future__ import annotations

import re
from typing import Any

import griffe

ROLE = re.compile(r":(?:py:)?(?:func|class|meth|mod|data|attr|exc|obj|const|term):`(~?)([^`]+)`")


def render_roles(text: str) -> str:
    """``text`` with every role replaced by inline code.

    Example:
        >>> render_roles("See :func:`torch.autograd.grad` and :class:`~torch_vjp.Labels`.")
        'See `torch.autograd.grad` and `Labels`.'
    """

    def code(match: re.Match[str]) -> str:
        target = match.group(2).strip()
        if match.group(1):
            target = target.rsplit(".", 1)[-1]
        return f"`{target}`"

    return ROLE.sub(code, text)


class SphinxRoles(griffe.Extension):
    """Rewrites the roles of every docstring griffe loads (see :func:`render_roles`)."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = render_roles(obj.docstring.value)

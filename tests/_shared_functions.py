"""Helpers shared by several test files (not a test file itself).

``FORKSERVER_PRELOAD``: the modules that the server process forking the distributed tests'
ranks imports once, so that no rank imports them again.
"""

from __future__ import annotations

#: torch, torch_vjp and pytest, and what torch imports only on a first ``torch.func``
#: transform (torch._dynamo, which imports sympy, and torch._decomp: about 2 s of CPU in
#: every rank otherwise, more than most ranks' own work). Only imports: the server runs no
#: tensor operation, so it starts no thread pool that its forked ranks would inherit.
FORKSERVER_PRELOAD = ("torch", "torch._dynamo", "torch._dynamo.polyfills", "torch._decomp",
                      "torch_vjp", "pytest")

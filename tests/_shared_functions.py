"""Helpers shared by several test files (not a test file itself).

``FORKSERVER_PRELOAD``: the modules that the server process forking the distributed tests'
ranks imports once, so that no rank imports them again. ``run_forked``: a script run in a
child of that server, for a test that needs a process of its own.
"""

from __future__ import annotations

#: torch, torch_vjp and pytest, and what torch imports only on a first ``torch.func``
#: transform (torch._dynamo, which imports sympy, and torch._decomp: about 2 s of CPU in
#: every rank otherwise, more than most ranks' own work). Only imports: the server runs no
#: tensor operation, so it starts no thread pool that its forked ranks would inherit.
FORKSERVER_PRELOAD = ("torch", "torch._dynamo", "torch._dynamo.polyfills", "torch._decomp",
                      "torch_vjp", "pytest")


def run_forked(script: str, timeout: float = 300) -> tuple[str, str]:
    """Runs ``script`` (Python source) in a child of the fork server that forks the
    distributed tests' ranks (``FORKSERVER_PRELOAD`` imported once, nothing run), where a
    fresh interpreter would import torch and torch_vjp again: seconds of CPU. For a test
    that needs a process of its own (a crash kept out of pytest's, a peak RSS of its own),
    not a fresh interpreter: the child inherits the server's environment, as it was when the
    server started. Without a fork server, a fresh interpreter.

    Returns what the script printed and ``""``, or ``""`` and why it failed: its traceback,
    or how the process ended (a signal's exit code, a deadline passed)."""
    import queue
    import subprocess
    import sys
    import time

    import torch.multiprocessing as mp

    if "forkserver" not in mp.get_all_start_methods():
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                             timeout=timeout)
        if out.returncode == 0:
            return out.stdout, ""
        return "", f"exit code {out.returncode}: {out.stderr[-3000:]}"
    mp.set_forkserver_preload(list(FORKSERVER_PRELOAD))  # (if the server is not running yet)
    ctx = mp.get_context("forkserver")
    reply = ctx.Queue()
    child = ctx.Process(target=_run_script, args=(script, reply), daemon=True)
    child.start()
    deadline = time.monotonic() + timeout
    try:
        while True:
            try:
                return reply.get(timeout=1)
            except queue.Empty:
                if not child.is_alive():
                    try:  # (a reply put just before it ended)
                        return reply.get(timeout=1)
                    except queue.Empty:
                        return "", f"the child process ended with exit code {child.exitcode}"
                if time.monotonic() > deadline:
                    return "", f"the child process still ran after {timeout} s"
    finally:
        child.join(timeout=30)
        if child.is_alive():
            child.kill()
            child.join()


def _run_script(script, reply):
    """:func:`run_forked`'s child: runs ``script``, puts (printed, traceback or "")."""
    import contextlib
    import io
    import sys
    import traceback
    import types

    # (the script's globals are a module's, found in sys.modules, as a script's are: dynamo
    # guards the globals a compiled function reads through its module)
    module = sys.modules["_forked_script"] = types.ModuleType("_forked_script")
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            exec(compile(script, "<child>", "exec"), vars(module))
    except BaseException:
        reply.put(("", traceback.format_exc()[-3000:]))
    else:
        reply.put((printed.getvalue(), ""))

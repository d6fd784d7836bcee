"""``compile=True``, and torch_vjp's calls inside code the user compiles with torch.compile.

NOTE [compiled Jacobians]
The eager engine is Python around torch.func's products: validation, a memory plan, a shape
cache, fallbacks from vmap to loops. Under torch.compile that Python costs graph breaks and
guards (on the module-level shape cache, a recompile on every new signature), so neither
path below traces it. Both run the *plain* form of a call instead: the torch.func
composition of its strategy (``jacrev``/``jacfwd`` and ``vmap``), which dynamo traces into
one graph.

* Inside the user's own ``torch.compile`` (``torch.compiler.is_compiling()``), the public
  functions return the plain form directly, so that dynamo traces torch.func and nothing of
  torch_vjp's state: no graph break and no recompile of torch_vjp's making.
* ``compile=True`` at top level (:func:`compiled_call`): the first call for a function,
  options and input signature runs the eager call (every check of the eager path, every
  error it raises, untouched), then compiles the plain form with ``fullgraph=True`` and runs
  it, and compares the two results (not where an input and the result hold a NaN or an
  infinity, ``all_finite``: that call makes no entry). If compiling fails, or the results
  differ beyond rounding, a one-time :class:`~torch_vjp.JacobianWarning` says why (naming
  the likely cause where the eager call drew random numbers or wrote into its input:
  :class:`~torch_vjp._engine.compile_checks.FirstRun`) and that signature stays eager;
  otherwise later calls with that signature run the compiled program only. The first
  call returns the eager result; so does a later call that makes dynamo recompile the
  entry (NOTE [a recompiled entry]).
* A compiled program runs as the eager call does, inside ``buffers_kept(f)``: a module in
  training mode that ``f`` or an argument reaches (or the model, per sample) gets back
  every buffer its forward changed (BatchNorm's running statistics, spectral norm's
  vectors), since the program runs ``f`` as often as the products need. Every compiled
  call also runs with dynamo's guards on empty module hook dicts switched on
  (:class:`~torch_vjp._engine.compile_key.HookGuards`): a hook registered after the first
  call recompiles the program instead of being left out of every later result. A function
  whose
  first compiled run changes a parameter in place (an Embedding with max_norm) gets the
  parameter back and stays eager, where such changes are put back on every call.

Each cache entry compiles a function with a code object of its own, because dynamo keeps its
compiled variants per code object and stops compiling one after ``recompile_limit`` (8)
variants: every ``torch.compile(jacrev(f))`` of a process shares torch.func's wrapper code,
so the ninth Jacobian function compiled that way would silently run eagerly (or fail, with
``fullgraph=True``).

The plain forms live in :mod:`torch_vjp._engine.forms`.

Entries are keyed by what determines the traced program: the function (a lambda by its
code object and what its closure holds: tensors by their signature, numbers and strings by
value, tuples, lists and dicts of those by structure, functions by the same rule, anything
else by identity, so that ``lambda x: model(x)`` or ``lambda w: loss(w, batch)`` written
inside a training loop finds its entry again), the call's options, each primal's shape,
strides, dtype, device, layout, ``requires_grad`` and conjugate, negative and inference
bits (other values by equality, or identity), grad and inference mode, autocast, the
settings dynamo's global state guard holds (the default dtype, deterministic algorithms, the
number of threads), the training flags of the modules ``f`` or its arguments reach and
whether their parameters require grad (NOTE [train and eval entries] in compile_key.py,
:func:`~torch_vjp._engine.compile_key.module_flags`), the globals ``f`` reads (NOTE [the
globals a program reads]), and the global module hooks
(:mod:`torch_vjp._engine.compile_key`). What else a program depends on
(a global flag, an object's attribute) dynamo guards, and a call that recompiles its entry
is a first call again (NOTE [a recompiled entry]). The compiled program takes the
function as its first argument, and dynamo reads the closure of the one each call passes:
the tensors a closure holds are inputs of the program, as the primals are, never
constants of the first call's closure. At most :data:`CACHE_MAX` entries are kept, least
recently used first out.
"""

from __future__ import annotations

import threading
import types
import weakref
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import Tensor
from torch.utils._pytree import tree_map

from torch_vjp._engine.compile_checks import (COMPILED_STRATEGIES, FirstRun, GraphPrecision,
                                              check_compilable, check_compile,
                                              compile_failure, compiles_nothing,
                                              dynamo_disabled, program_mode,
                                              recompile_refused, recompiled_why, results_agree,
                                              stance_held, static_shapes, user_stance,
                                              warn_budget, warn_eager, warn_rebuilt)
from torch_vjp._engine.compile_key import (HOOK_GUARDS, GuardReads, Reads, call_signature,
                                          held_key, key_stem, module_flags, program_key,
                                          tracing)
from torch_vjp._engine.compile_memo import called_again, forget_calls, note_call
from torch_vjp._engine.context import (NO_CONTEXT, Watched, buffers_kept, module_tree,
                                       modules_reached, reached)
from torch_vjp._engine.fwdcheck import all_finite
from torch_vjp._engine.kept import Footprint
from torch_vjp._engine.rows import SameDraws
from torch_vjp._errors import passes_through

__all__ = [
    "CACHE_MAX", "REBUILD_WARN_AT", "COMPILED_STRATEGIES", "check_compilable", "warn_budget", "check_compile", "program_key",
    "compiled_call", "tracing", "clear_cache", "results_agree", "Built",
    "builds", "own_builds",
]

#: Compiled entries kept (each holds a compiled program and the function it calls).
CACHE_MAX = 64

_CACHE: OrderedDict[Any, _Entry] = OrderedDict()
#: key -> what its programs read beyond it (NOTE [what a program read beyond its key] in
#: compile_key.py): the key each of them is cached under is extended with its signature.
_READS: OrderedDict[Any, Reads] = OrderedDict()
_LOCK = threading.Lock()
#: How many programs have been built (first calls and recompiled entries), in all: see
#: :func:`builds`.
_BUILDS = 0
_OWN = threading.local()  # (``n``: the programs built by this thread)


def builds() -> int:
    """How many compiled programs this process has built so far (a first call of an entry,
    or an entry rebuilt after dynamo recompiled it). A ``vjp_fn`` compares it with the count
    at its ``vjp`` call (NOTE [a compiled vjp_fn's point] in :mod:`torch_vjp.transforms`)."""
    return _BUILDS


def own_builds() -> int:
    """How many of :func:`builds` the calling thread built (a ``vjp_fn`` tells the programs
    built inside its own call from those another thread built meanwhile)."""
    return getattr(_OWN, "n", 0)


def clear_cache() -> None:
    """Forgets every compiled entry (tests; a user can call ``torch._dynamo.reset()``)."""
    with _LOCK:
        _CACHE.clear()
        _READS.clear()
    forget_calls()


# --------------------------------------------------------------------------------------
# compile=True
# --------------------------------------------------------------------------------------

# NOTE [what an entry keeps]
# A key holds some objects by their id (a module, or a model a lambda's closure holds, any
# object that is not a tensor, a number or a string: :func:`program_key`). The entry keeps
# exactly those, weakly where they can be weakly referenced (a module, a bound method's
# object), so that the id is not another object's while the entry lives (an entry whose
# object died is stale: :meth:`_Entry.alive`); it never keeps the function itself. A
# ``lambda x: model(x)`` or ``lambda w: loss(w, batch)`` made inside a function would
# otherwise keep its model, and the batch tensor it closes over, alive in the cache after
# the caller dropped them, up to :data:`CACHE_MAX` of them (the program takes the function
# each call passes, never the first call's).


class _Entry:
    """One function, options and input signature: its compiled program, or None where it
    runs eagerly."""

    __slots__ = ("kept", "run", "reused", "fresh", "code", "recompiles", "deferred", "writes",
                 "reads", "read", "__weakref__")  # (a note holds it weakly: NOTE [a
    # function called again])

    def __init__(self, kept: list[object]) -> None:
        self.kept: list[Any] = []
        for v in kept:
            try:
                self.kept.append(weakref.ref(v))
            except TypeError:  # (a list, a dict: held, as small as the key's own values)
                self.kept.append(lambda v=v: v)
        self.run: Callable[..., Any] | None = None
        self.reused = False  # found again by a later call
        self.fresh: Callable[[], tuple[Any, ...]] = tuple  # the program's leading arguments
        self.code: types.CodeType | None = None  # the compiled function's own code object
        self.recompiles = 0  # entries of this key rebuilt before (NOTE [a recompiled entry])
        self.deferred = False  # eager until found again (NOTE [closures over new objects])
        self.writes = True  # may write what f reaches (NOTE [a program that writes
        # nothing] in compile_memo.py)
        self.reads: Reads | None = None  # beyond the key, and their signature when built
        self.read: object = None  # (NOTE [what a program read beyond its key])

    def read_as_built(self, f: object, args: tuple[Any, ...]) -> bool:
        """Whether what the program read beyond its key is as when it was built."""
        return self.reads is None or self.reads.signature(f, args) == self.read

    def alive(self) -> bool:
        """Whether the objects whose ids the key holds still live."""
        return all(ref() is not None for ref in self.kept)

    def __call__(self, f: object, args: tuple[Any, ...]) -> Any:
        assert self.run is not None
        with program_mode():
            return self.run(f, *args, *self.fresh())


class Built(NamedTuple):
    """What a ``build`` of :func:`compiled_call` may return instead of the bare program:
    the program, and ``fresh``, which makes the arguments it takes after ``args`` anew on
    each call (a result buffer, see NOTE [the result buffer of a compiled Jacobian] in
    :mod:`torch_vjp._engine.compiled_jacobian`); with ``why``, none: the signature stays
    eager, with a warning that says why (NOTE [reverse products batched wrongly])."""

    program: Callable[..., Any] | None
    fresh: Callable[[], tuple[Any, ...]] = tuple
    why: str | None = None


def _on_copies(program: Callable[..., Any], n: int) -> Callable[..., Any]:
    """``program(f, *args, *rest)`` run on copies of the tensors in the first ``n`` args,
    made inside what is compiled, so that a function that changes its arguments in place
    (``x.mul_(2)``) changes the copies, never the caller's tensors, as the eager path's
    own copies do (NOTE [f's own copies] in :mod:`torch_vjp._engine.copies`). Where
    nothing changes them, inductor reads the copies from the originals without writing
    them (pointwise consumers), or copies them once."""

    def run(f: Any, *a: Any) -> Any:
        copies = tree_map(lambda t: t.clone() if isinstance(t, Tensor) else t, a[:n])
        return program(f, *copies, *a[n:])

    return run


def _own_code(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
    """``fn`` behind a function whose code object is new (NOTE [compiled Jacobians])."""

    def run(*args: Any) -> Any:
        return fn(*args)

    code = run.__code__.replace(co_name=name, co_qualname=name)
    return types.FunctionType(code, run.__globals__, name, None, run.__closure__)


#: A function compiled this many times, for one argument signature, because each call's
#: closure held new objects, and no such program ever used again, is warned about at the
#: next such call (:func:`warn_rebuilt`), and its later variants are compiled only when
#: found again (NOTE [closures over new objects]). Several functions of one code that are
#: each reused (one closure per layer, say) are not.
REBUILD_WARN_AT = 8

# NOTE [closures over new objects]
# A function made anew on every call over new objects (``lambda x: f(x, Cfg())``, an object
# counted by identity) has a new key on every call: each call ran eagerly, compiled a
# program (a fraction of a second to seconds) and never used it. Once
# :data:`REBUILD_WARN_AT` such variants of one code, options and argument signature were
# compiled, none of them ever found again, a new variant is left eager (its entry
# ``deferred``, with the warning that says why and how to write it), at compile=False's
# speed; a deferred entry that a later call finds again (the closure settled on objects it
# keeps) is compiled then, and the functions of that code compile as before, since one of
# them was reused. Only the newest :data:`DEFERRED_KEPT` deferred entries of one stem stay
# in the cache, so that a new closure on every step does not push the programs of other
# functions out of it (each would compile again, for seconds).


#: Deferred entries kept per function code, options and argument signature, the newest:
#: a stream of new closures pushes its own older ones out of the cache, not the programs of
#: other functions (NOTE [closures over new objects]).
DEFERRED_KEPT = 8


def _drop_deferred(key: tuple[Any, ...]) -> None:
    """Drops the oldest deferred entries of ``key``'s stem beyond :data:`DEFERRED_KEPT`,
    ``key``'s own counted (under ``_LOCK``)."""
    stem = key_stem(key)
    older = [k for k, e in _CACHE.items() if e.deferred and k != key and key_stem(k) == stem]
    for k in older[:max(0, len(older) + 1 - DEFERRED_KEPT)]:
        del _CACHE[k]


def _closure_variants(key: tuple[Any, ...]) -> int:
    """How many cached entries differ from ``key`` only in what the closure cells (or
    defaults, or a ``partial``'s arguments) of a function in it hold (the same code, options
    and argument signature): ``f`` itself, or a loss function of the per-sample functions;
    or 0 if one of them was ever found again (under ``_LOCK``)."""
    stem = key_stem(key)
    if stem == key:
        return 0
    count = 0
    for k, entry in _CACHE.items():
        if key_stem(k) == stem:
            if entry.reused:
                return 0
            count += 1
    return count


def compiled_call(
    call: str,
    f: object,
    options: tuple[Any, ...],
    args: tuple[Any, ...],
    eager: Callable[[], Any],
    build: Callable[[], Callable[..., Any]],
    passed: tuple[Any, ...] = (),
) -> Any:
    """The result of ``program(f, *args, *passed)`` compiled, cached per ``f``, ``options``,
    the signature of ``args`` and the keys of ``passed``; see NOTE [compiled Jacobians].

    Args:
        call: the public name, for messages.
        f: the user's function (the key, and named by warnings).
        options: everything else that changes the traced program (hashable).
        args: the tensors and values the program takes.
        eager: computes the same result with the eager path (the first call, checks and
            errors included; and every call of a signature that cannot be compiled).
        build: returns the function ``program(f, *args)`` to compile (called on the first
            call only, after ``eager``), or a :class:`Built` whose program takes the
            arguments its ``fresh`` makes after ``args``. The program is given copies of
            the tensors in ``args`` (made inside the compiled program): what ``f`` changes
            in place stays there, as on the eager path. It must compute with the ``f`` it
            is given, never with one it captured: a later call passes its own ``f``, whose
            closure may hold other tensors of the same signature.
        passed: functions the program calls beside ``f`` (the per-sample functions' loss),
            keyed as ``f``'s closure is (:func:`~torch_vjp._engine.compile_key.held_key`):
            one made anew for each call, over new tensors of the same signature, runs the
            same program. The program takes them after ``args``.
    """
    stance = user_stance()
    if stance is not None and (stance.stance == "force_eager" or stance_held()) \
            or compiles_nothing():
        return eager()  # (NOTE [the user's stance] in compile_checks.py)
    signature = call_signature(args)  # (once per call: the note's key and the full key's)
    if not passed:  # (NOTE [a function called again] in compile_memo.py)
        noted = called_again(call, f, options, args, signature)
        if noted is not None:
            with _LOCK:
                entry = _CACHE.get(noted[0])
                if entry is noted[1]:
                    _CACHE.move_to_end(noted[0])
            if entry is noted[1] and entry.run is not None and not entry.writes \
                    and entry.alive():
                got = _run(call, f, args, entry, eager, NO_CONTEXT)
                if got is not _RECOMPILED:
                    return got
                return _keyed(call, f, options, args, signature, eager, build, passed,
                              noted)
    return _keyed(call, f, options, args, signature, eager, build, passed)


#: What :func:`_run` returns for a call that recompiled its entry (NOTE [a recompiled entry]).
_RECOMPILED = object()


def _run(call: str, f: object, args: tuple[Any, ...], entry: _Entry,
         eager: Callable[[], Any], kept: Any) -> Any:
    """``entry``'s program on this call's ``f`` and ``args`` inside ``kept`` (buffers_kept, or
    none), or :data:`_RECOMPILED`; the eager result where the program fails."""
    try:  # (NOTE [a program that writes nothing] in compile_memo.py; NOTE [hook guards
        # while compiling])
        with kept:
            before = _variants(entry.code)
            got = entry(f, args)  # this call's f: its closure as it is now
            recompiled = _variants(entry.code) != before
    except Exception as err:  # noqa: BLE001 - a later recompile failed: eager decides
        if recompile_refused(err) or dynamo_disabled():  # (its backend refused, or
            return _RECOMPILED  # dynamo, switched off since, compiles no frame: nothing
            # of it ran, and the first call again runs eagerly without an entry)
        if passes_through(err):
            raise
        result = eager()  # f's own errors propagate from here, untouched
        entry.run = None
        warn_eager(call, f, compile_failure(err))
        return result
    return _RECOMPILED if recompiled else got


def _keyed(call: str, f: object, options: tuple[Any, ...], args: tuple[Any, ...],
           signature: object, eager: Callable[[], Any], build: Callable[[], Any],
           passed: tuple[Any, ...], rebuilt: tuple[Any, _Entry] | None = None) -> Any:
    """:func:`compiled_call` with its full key; ``signature``: ``call_signature(args)``;
    ``rebuilt``: the noted key and entry of a call that recompiled it (NOTE [a function
    called again])."""
    kept: list[object] = []  # (NOTE [what an entry keeps])
    if passed:
        options = (*options, tuple(held_key(p, keep=kept) for p in passed))
    found = reached(f)  # (one walk of what f reaches: the key's flags and buffers_kept's)
    trees = {id(m): module_tree((m,)) for m in found[0]}
    in_args = module_tree(modules_reached(args))
    # (the training flags of every module f and the arguments reach: NOTE [train and eval
    # entries]; the globals f reads are in its program_key: NOTE [the globals a program
    # reads])
    key = (call, program_key(f, passed=True, keep=kept), options, signature,
           tuple(module_flags(m) for t in trees.values() for m in t),
           tuple(module_flags(m) for m in in_args))
    sig_args = args
    args = (*args, *passed)
    try:
        reads = _READS.get(key)
    except TypeError:  # (an option given as a list, argnums=[0, 1]: the eager call says
        return eager()  # what is wrong, or computes without a cache entry)
    base = key  # (NOTE [what a program read beyond its key] in compile_key.py)
    if reads is not None:
        key = (*key, reads.signature(f, args))
    # (a noted entry that recompiled: NOTE [a recompiled entry]. One noted for another key,
    # whose difference the note does not see, a closure tensor's requires_grad switched,
    # stays: its program still serves its own key, and dropped, it was compiled anew on
    # every other call that alternated the flag)
    if rebuilt is not None and rebuilt[0] == key:
        with _LOCK:
            if _CACHE.get(rebuilt[0]) is rebuilt[1]:
                del _CACHE[rebuilt[0]]
        return _first_call(call, key, kept, f, args, eager, build,
                           rebuilt[1].recompiles + 1, reused=True, base=base,
                           passed=len(passed))
    with _LOCK:
        entry = _CACHE.get(key)
        if entry is not None and not entry.alive():  # (an id reused by a new object)
            del _CACHE[key]
            entry = None
        if entry is not None:
            _CACHE.move_to_end(key)
            entry.reused = True
    if entry is None:
        return _first_call(call, key, kept, f, args, eager, build, 0, base=base,
                           passed=len(passed))
    if entry.run is None:
        if entry.deferred:  # (found again: compiled now, NOTE [closures over new objects])
            with _LOCK:
                if _CACHE.get(key) is entry:
                    del _CACHE[key]
            return _first_call(call, key, kept, f, args, eager, build, 0, reused=True,
                               base=base, passed=len(passed))
        return eager()
    got = _run(call, f, args, entry, eager,
               buffers_kept(f, primals=args, found=found, trees=trees)  # (args: a module
               if entry.writes else NO_CONTEXT)  # among them)
    if got is not _RECOMPILED:
        if not passed and not entry.writes and entry.run is not None:
            note_call(call, f, options, sig_args, key, entry,
                      [m for t in trees.values() for m in t] + in_args)
        return got
    with _LOCK:  # NOTE [a recompiled entry]
        if _CACHE.get(key) is entry:
            del _CACHE[key]
    return _first_call(call, key, kept, f, args, eager, build, entry.recompiles + 1,
                       reused=True, base=base,  # (found again: never deferred)
                       passed=len(passed))


# NOTE [a recompiled entry]
# The key holds what a call passes (the function, its closure, the options, the arguments'
# signature) and the global state :func:`~torch_vjp._engine.compile_key.global_state` reads,
# not everything a traced program depends on: a global flag ``f`` reads, an attribute of an
# object or module, a module hook. Dynamo guards those, and recompiles the entry's code
# object when one changes: a program traced under the new state, never compared with the
# eager call, and built with the old build-time decisions (forward or reverse mode, the
# result buffer's shape). So every call counts the dynamo cache entries of its entry's own
# code object (unique per entry, NOTE [compiled Jacobians]) before and after it runs, and a
# call that added one is a first call again: its result is dropped, and the eager call,
# ``build`` and a new compiled program (a code object of its own) are compared as on the
# first call, with the fallback and the warning. The recompiled program must not run at
# all: a call whose entry writes nothing runs without ``buffers_kept`` (NOTE [a program
# that writes nothing]), and the new program may write (a spectral norm registered since:
# its power iteration, into the module's buffers, never put back, and the eager call that
# followed started from them). So the entry's backend is sealed once its program is built
# (:class:`~torch_vjp._engine.compile_checks.GraphPrecision`): dynamo asks it for the new
# program before running anything, it raises, and the call is a first call again. Where
# the same key is rebuilt :data:`REBUILD_WARN_AT` times (something ``f`` reads changes on
# every call), it stays eager, with a warning that says so.


def _rekey(key: Any, base: Any, entry: _Entry, reads: Reads | None, f: object,
           args: tuple[Any, ...]) -> None:
    """Caches ``entry``, built for ``key``, under ``base`` extended with the signature of
    what its program read beyond it (NOTE [what a program read beyond its key] in
    compile_key.py), and notes those reads for ``base``'s later calls."""
    with _LOCK:
        known = _READS.get(base)
        if known is not None and reads is not None:
            reads = known.union(reads)
        elif reads is None:
            reads = known
        if reads is None:
            return
        _READS[base] = reads
        _READS.move_to_end(base)
        while len(_READS) > CACHE_MAX:
            _READS.popitem(last=False)
        entry.reads, entry.read = reads, reads.signature(f, args)
        if _CACHE.get(key) is entry:
            del _CACHE[key]
        _CACHE[(*base, entry.read)] = entry


def _variants(code: types.CodeType | None) -> int:
    """How many programs dynamo keeps for ``code`` (0 where torch does not say)."""
    entries = getattr(torch._C._dynamo.eval_frame, "_debug_get_cache_entry_list", None)
    return len(entries(code)) if entries is not None and code is not None else 0


def _trees_reached(f: object, args: tuple[Any, ...]) -> list[torch.nn.Module]:
    """Every module ``f`` or the arguments reach, with the modules each holds: those whose
    buffers a first call watches (FirstRun, Footprint)."""
    return module_tree([*modules_reached(f), *modules_reached(args)])


def _first_call(
    call: str, key: Any, kept: list[object], f: object, args: tuple[Any, ...],
    eager: Callable[[], Any], build: Callable[[], Any], recompiles: int, reused: bool = False,
    base: Any = None, passed: int = 0,
) -> Any:
    """The first call of ``key`` (or a call that recompiled its entry, the ``recompiles``-th
    of that key; or that found a deferred entry, ``reused``): the eager result, and the
    entry compiled, checked against it, or eager."""
    if dynamo_disabled():  # (no entry: NOTE [the user's stance] in compile_checks.py)
        return eager()
    run = FirstRun(args, tuple(b for m in _trees_reached(f, args)
                               for b in m._buffers.values() if b is not None))
    result = eager()  # the checks, and f's own errors, of the eager path
    if not (all_finite(args) or all_finite(result)):  # (not judged: no entry, so the
        return result  # next call is a first call; a finite result is: nan_to_num(x))
    run.after_eager()
    # (the compiled run's draws are discarded with its result: the generators end where the
    # eager call left them, NOTE [auto's extra calls draw what the products draw])
    drawn = SameDraws()
    drawn()
    try:
        return _compile_first(call, key, kept, f, args, result, run, build, recompiles,
                              reused, key if base is None else base, passed)
    finally:
        drawn()


def _compile_first(
    call: str, key: Any, kept: list[object], f: object, args: tuple[Any, ...], result: Any,
    run: FirstRun, build: Callable[[], Any], recompiles: int, reused: bool = False,
    base: Any = None, passed: int = 0,
) -> Any:
    """:func:`_first_call` after its eager call: ``result``."""
    entry = _Entry(kept)
    entry.recompiles = recompiles
    entry.reused = reused
    with _LOCK:
        _CACHE[key] = entry
        while len(_CACHE) > CACHE_MAX:
            _CACHE.popitem(last=False)
        rebuilt = _closure_variants(key)
    if rebuilt > REBUILD_WARN_AT:  # (this one, and REBUILD_WARN_AT compiled before it)
        entry.deferred = True  # NOTE [closures over new objects]
        with _LOCK:
            _drop_deferred(key)
        warn_rebuilt(call, f, rebuilt - 1)
        return result
    if recompiles >= REBUILD_WARN_AT:
        warn_eager(call, f, recompiled_why(recompiles))
        return result
    global _BUILDS
    with _LOCK:
        _BUILDS += 1
    _OWN.n = own_builds() + 1
    name = f"torch_vjp_compiled_{abs(hash(key)) % 10**8}_{recompiles}"
    modules = modules_reached(f)
    seen: set[int] = set()  # the first call only: a copy of the parameters f reaches
    params = Watched(params=[("", p) for m in module_tree(modules)  # (no hashing: a module
                             for p in m._parameters.values()  # may define __eq__ alone)
                             if p is not None and id(p) not in seen and not seen.add(id(p))])
    why = None
    for fold in (True, False):  # (unfolded where the folded program disagrees with a
        try:  # non-finite eager result: NOTE [the basis folded])
            with HOOK_GUARDS, buffers_kept(f, primals=args):  # build() may call f (captured
                # tensors too; a module among the arguments, as the eager call keeps it)
                built = build()
                if isinstance(built, Built) and built.why is not None:
                    params.restore()
                    warn_eager(call, f, built.why)
                    return result
                built, fresh = built[:2] if isinstance(built, Built) else (built, tuple)
                own = _own_code(_on_copies(built, len(args)),
                                name if fold else f"{name}_unfolded")
                precision = GraphPrecision(fold=fold)
                guards = GuardReads(len(args) - passed, passed)
                program = torch.compile(own, fullgraph=True, backend=precision,
                                        options={"guard_filter_fn": guards})
                # (NOTE [a program that writes nothing] in compile_memo.py)
                footprint = Footprint(reached(f)[1], _trees_reached(f, args))
                with program_mode(), static_shapes():  # (NOTE [static shapes, once] in
                    # compile_checks.py)
                    got = program(f, *args, *fresh())
                entry.writes = footprint.moved()
        except Exception as err:  # noqa: BLE001 - torch.compile's failure: eager stands
            if passes_through(err):
                raise
            params.restore()
            warn_eager(call, f, compile_failure(err))
            return result
        if params.restore():
            # (a compiled program cannot put it back: this signature stays eager)
            warn_eager(call, f, "the function changes a parameter in place (an Embedding "
                                 "with max_norm, whose table the eager call puts back; a "
                                 "no-grad update in a forward), which the compiled program "
                                 "cannot put back")
            return result
        why = results_agree(result, got, precision.least)
        if why is None or all_finite(result):  # (the fold changes no finite result)
            break
    if why is not None:
        warn_eager(call, f, run.why(why))
        return result
    entry.fresh = fresh
    entry.code = own.__code__
    _rekey(key, base, entry, guards.reads(own.__globals__), f, args)
    precision.sealed = True  # (NOTE [a recompiled entry]; sealed before another thread
    entry.run = program  # can find the entry's program and run it)
    return result

"""What the first call of a compiled entry compares and says (NOTE [compiled Jacobians] in
:mod:`torch_vjp._engine.compiled`): whether the compiled result agrees with the eager one,
the likely cause where it does not, and the warnings of ``compile=True``; and the checks of
the option itself."""

from __future__ import annotations

import contextlib
import functools
import os
import re
import sys
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor
from torch.utils._pytree import tree_flatten, tree_leaves

from torch_vjp._engine.compile_key import program_key
from torch_vjp._engine.fwdcheck import gap, least_of, tolerance
from torch_vjp._engine.point import versions_of
from torch_vjp._errors import (JacobianOptionError, JacobianWarning, chained, quote_error,
                               warn_once)
from torch_vjp._strategies import Strategy

__all__ = ["results_agree", "ROUNDING_FLOOR", "GraphPrecision", "Recompiled",
           "recompile_refused", "recompiled_why", "FirstRun", "graph_safe_mode", "warn_rebuilt",
           "warn_eager", "compile_failure", "COMPILED_STRATEGIES", "check_compile",
           "check_compilable", "warn_budget", "program_mode", "user_stance",
           "compiles_nothing", "dynamo_disabled", "stance_held", "static_shapes", "BACKEND"]


def results_agree(ref: Any, got: Any, least: torch.dtype | None = None) -> str | None:
    """None if ``got`` equals ``ref`` up to rounding (``sqrt(eps)`` of the result's scale,
    for the less precise of each tensor's dtype and ``least``, the least precise dtype the
    computation ran in, where known: :class:`GraphPrecision`; integer tensors exactly;
    entries NaN in both, or equal infinities, agree, as in
    :func:`~torch_vjp._engine.fwdcheck.gap`); else what differs. The compiled result
    against the eager first call, and a compiled ``vjp_fn``'s forward output against the
    vjp point's.

    The scale is the largest entry of all the result's floating tensors, and at least
    :data:`ROUNDING_FLOOR` times ``sqrt(eps)``: the allowance is relative to the result
    (it was ``sqrt(eps)`` of at least 1, so a Jacobian whose entries are all far below 1
    was not checked at all, and a compiled run that drew other random numbers passed for
    the eager one), and a block that is zero but for rounding (the derivative of a layer
    norm with respect to a shift of all its inputs) is judged at the scale of the others,
    or at that floor, a few ``eps`` in the result's units, where it stands alone."""
    ref_leaves, ref_spec = tree_flatten(ref)
    got_leaves, got_spec = tree_flatten(got)
    if ref_spec != got_spec:
        return f"the results have different structures ({ref_spec} and {got_spec})"
    gaps = []
    for a, b in zip(ref_leaves, got_leaves):
        if not isinstance(a, Tensor):
            continue
        if not isinstance(b, Tensor) or a.shape != b.shape or a.dtype != b.dtype:
            return "the results have different shapes or dtypes"
        if a.numel() == 0:
            continue
        if not (a.is_floating_point() or a.is_complex()):
            if not torch.equal(a, b):
                return "the results' integer entries differ"
            continue
        rtol = tolerance(a.real.dtype)  # sqrt(eps), as the Hessian's symmetry check
        if least is not None:  # (a float32 step in a float64 f rounds at float32's)
            rtol = max(rtol, tolerance(least))
        # (NaN in both, or an infinity of one sign in both, agree: gap's rule)
        gaps.append((rtol, *gap(a.detach().reshape(-1), b.detach().reshape(-1))))
    whole = max((scale for _, _, scale in gaps), default=0.0)
    for rtol, diff, scale in gaps:
        if not diff <= rtol * max(whole, ROUNDING_FLOOR * rtol):
            return (f"the compiled result differs from the eager one by up to {diff:.3g} "
                    f"at a scale of {scale:.3g}")
    return None


#: The least scale :func:`results_agree` judges at, in units of ``sqrt(eps)``: a result
#: zero but for rounding may differ by this many ``eps``.
ROUNDING_FLOOR = 16


#: The torch.compile backend a compiled entry's graphs are handed to: None for inductor
#: (the default, and the only one a user gets); the name of another (``"aot_eager"``) for
#: the tests of what does not depend on the backend (keys, caching, recompiles, guards,
#: fallbacks, messages), which then build no C++ (NOTE [the backend of the tests]).
BACKEND: str | None = None

# NOTE [the backend of the tests]
# Inductor compiles each new program to C++, seconds on a cold cache; the tests of the
# cache, its keys and guards, the first-call check's fallbacks and the warnings count
# programs and read messages, which do not depend on what the graph is compiled to. Those
# set :data:`BACKEND` to ``"aot_eager"`` (AOTAutograd's functionalised graph run eagerly:
# the same writes, version counters and decompositions inductor is given, without its code
# generation), and :class:`GraphPrecision` hands the graph to it; its own passes (NOTE
# [the basis folded], [oneDNN products], [a scatter into an expanded tensor]) are
# inductor's and run only there, so the tests of numerics through inductor keep it.


class GraphPrecision:
    """A ``torch.compile`` backend that notes the least precise floating dtype of the graphs
    it is given (``least``: a float32 step in a float64 function, as the RMSNorm of Llama and
    T5 casts to float32) and hands each to inductor, the default backend. The compiled
    program fuses and reorders that step's arithmetic, so it rounds differently from the
    eager call at float32's rounding: the first call's comparison (:func:`results_agree`)
    must allow that, as 'auto''s check of routes does (NOTE [auto, checked once]).

    Once its program is built and checked, the backend is ``sealed``: dynamo calls it again
    only where a guard failed and it recompiles the entry's code, and it raises
    :class:`Recompiled` there (NOTE [a recompiled entry] in
    :mod:`torch_vjp._engine.compiled`)."""

    def __init__(self, fold: bool = True) -> None:
        self.least: torch.dtype | None = None
        self.fold = fold  # NOTE [the basis folded]
        self.sealed = False

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        if self.sealed:
            raise Recompiled
        for mod in gm.modules():  # (subgraphs of higher-order ops are submodules)
            graph = getattr(mod, "graph", None)
            for node in graph.nodes if isinstance(graph, torch.fx.Graph) else ():
                value = node.meta.get("example_value", node.meta.get("val"))
                values = value if isinstance(value, (tuple, list)) else (value,)
                found = least_of((t.dtype for t in values if isinstance(t, Tensor)), None)
                if found is not None:
                    self.least = least_of((found,) if self.least is None
                                          else (found, self.least))
        if BACKEND is not None:  # NOTE [the backend of the tests]
            return torch._dynamo.lookup_backend(BACKEND)(gm, example_inputs)
        from torch._inductor import compile as inductor  # (imported when compiling only)
        from torch._inductor import config

        from torch_vjp._engine.basis_fold import BasisFold
        from torch_vjp._engine.compile_conv import conv_input_grads
        from torch_vjp._engine.onednn import OneDnnProducts, faster_here

        after = config.post_grad_custom_post_pass  # (one set already runs first)
        after = [] if not after else list(after) if isinstance(after, (list, tuple)) \
            else [after]
        after.append(_overlap_copies())  # NOTE [a scatter into an expanded tensor]
        after.append(conv_input_grads())  # NOTE [a convolution's input gradient, transposed]
        with config.patch({"post_grad_custom_pre_pass": BasisFold() if self.fold else None,
                           "post_grad_custom_post_pass": [*after, OneDnnProducts()]
                           if faster_here() else after,
                           # NOTE [small kernels run on one thread]
                           "cpp.min_chunk_size": max(config.cpp.min_chunk_size,
                                                     PARALLEL_MIN_CHUNK)}):
            return inductor(gm, example_inputs)  # NOTE [the basis folded], [oneDNN products]


# NOTE [a scatter into an expanded tensor]
# Inductor's post-grad graph turns ``index_add`` (and ``index_put`` with accumulate) into
# ``index_put``, which its last pass writes in place into its first argument where nothing
# else reads that tensor's storage afterwards, without asking whether that argument overlaps
# itself: an ``expand`` of a fresh tensor (the zero tangent forward mode starts an
# ``index_add`` from is ``_efficientzerotensor(n).expand(B, n)`` under vmap). The batch's
# rows were added into the one shared row, so every row of the Jacobian came out as their
# sum, and where that row was an efficient zero tensor, which has no memory, the program
# read and wrote through a null pointer and the process died (``jacobian(lambda x:
# torch.zeros(3, dtype=x.dtype).index_add(0, idx, x.sin()), x, strategy='fwd',
# compile=True)``). So, before that pass, each such argument that overlaps itself is copied
# into a tensor of its own, and an efficient zero tensor (which inductor's kernels read as
# memory, where eagerly its dispatch key answers) is made a tensor of zeros.


@functools.cache
def _overlap_copies() -> Any:
    """Inductor's post-grad pass of NOTE [a scatter into an expanded tensor] (a class made
    when a program is first compiled: inductor is imported then)."""
    from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files
    from torch._inductor.fx_passes.reinplace import inplaceable_ops

    zero_tensor = torch.ops.aten._efficientzerotensor.default

    class OverlapCopies(CustomGraphPass):
        def __call__(self, graph: torch.fx.Graph) -> None:
            for node in list(graph.nodes):
                if node.op == "call_function" and node.target is zero_tensor:
                    node.target = torch.ops.aten.full.default  # (its keywords too)
                    node.args = (node.args[0], 0)
                op = inplaceable_ops.get(node.target) if node.op == "call_function" else None
                for i in op.mutated_args if op is not None else ():
                    arg = node.args[i] if i < len(node.args) else None
                    val = arg.meta.get("val") if isinstance(arg, torch.fx.Node) else None
                    if not isinstance(val, Tensor) or not _overlaps(val):
                        continue
                    with graph.inserting_before(node):
                        copy = graph.call_function(torch.ops.aten.clone.default, (arg,),
                                                   {"memory_format": torch.contiguous_format})
                    copy.meta["val"] = val.clone(memory_format=torch.contiguous_format)
                    node.replace_input_with(arg, copy)

        def uuid(self) -> Any:
            return get_hash_for_files((__file__,))

    return OverlapCopies()


def _overlaps(t: Tensor) -> bool:
    """Whether two of ``t``'s elements share memory (a dimension of stride 0 and size 2 or
    more, an ``expand``: torch's ``MemOverlap::Yes``)."""
    return torch._debug_has_internal_overlap(t) == 1


# NOTE [small kernels run on one thread]
# Inductor's CPU kernels split a loop across the threads when each thread gets at least
# ``cpp.min_chunk_size`` elements (512 by default). A Jacobian program of a small function
# is a handful of such kernels of a few thousand elements (the basis, an activation's
# derivative, a sum), and on 2 threads each parallel region's start and join cost more than
# its work: module_params of the benchmark suite (Linear(16, 32)-Tanh-Linear(32, 10)
# w.r.t. its parameters) took 116 to 119 us a call with the default and 63 to 64 us with
# kernels split only from 16,384 elements per thread, while mlp_8x512 and conv_input did
# not move (``torch.compile(torch.func.jacrev(f))`` through this backend's patches, 2
# threads, fresh inductor cache). Large kernels still use every thread.
#: Elements per thread below which a compiled program's kernel runs on one thread.
PARALLEL_MIN_CHUNK = 16384


class Recompiled(Exception):
    """Dynamo recompiled a built entry's code (a guard failed): its sealed backend refuses,
    so that the new program never runs (:class:`GraphPrecision`)."""


def recompile_refused(err: BaseException) -> bool:
    """Whether ``err`` (dynamo's, which wraps a backend's error) is a sealed backend's
    :class:`Recompiled`."""
    return any(isinstance(e, Recompiled) for e in chained(err))


class FirstRun:
    """What the eager run of a first call did besides its result, for the warning where the
    compiled result differs from it: whether it drew random numbers from the global
    generators, whether it wrote into the caller's tensors in ``args``, and whether it
    changed a module's buffers (``buffers``: those of the modules f and the arguments reach,
    put back after the eager call, which moves their versions: spectral norm's power
    iteration, BatchNorm's statistics in training mode). Made before the eager run;
    :meth:`after_eager` right after it."""

    def __init__(self, args: tuple[Any, ...], buffers: tuple[Tensor, ...] = ()) -> None:
        self.tensors = tuple(t for t in tree_leaves(args) if isinstance(t, Tensor))
        self.versions = versions_of(self.tensors)
        self.buffers = tuple(b for b in buffers if not b.is_inference())
        self.buffer_versions = versions_of(self.buffers)
        self.rng = _rng_states()
        self.drew = self.wrote = self.stateful = False

    def after_eager(self) -> None:
        self.wrote = versions_of(self.tensors) != self.versions
        self.stateful = versions_of(self.buffers) != self.buffer_versions
        now = _rng_states()
        self.drew = len(now) != len(self.rng) or not all(
            torch.equal(a, b) for a, b in zip(now, self.rng))

    def why(self, differ: str) -> str:
        """``differ`` (what :func:`results_agree` said), with its likely cause and fix."""
        if self.wrote:
            return (f"{differ}. The function wrote into its input in place (the caller's "
                    f"tensor changed during the eager call), so the compiled run started "
                    f"from the changed values. Fix: write into a copy inside the function "
                    f"(x = x.clone() before x.mul_(2)), or use the out-of-place operation")
        if self.stateful:
            return (f"{differ}. A module the function calls updates its buffers on every "
                    f"forward (spectral norm's power iteration, BatchNorm's running statistics "
                    f"in training mode), and the Jacobian calls the function more than once, "
                    f"so each run computed from other values. Fix: put the model in eval "
                    f"mode for the call (model.eval()), or update that state outside the "
                    f"Jacobian call")
        if self.drew:
            return (f"{differ}. The function draws random numbers (torch.randn, dropout in "
                    f"training mode: the global random generator moved during the eager "
                    f"call), and the compiled run drew others, so no two runs agree. Fix: "
                    f"draw the random numbers outside and pass them in as an argument "
                    f"(f(x, noise) with noise = torch.randn(...)), or put the model in eval "
                    f"mode for the call")
        return differ


def _rng_states() -> list[Tensor]:
    states = [torch.get_rng_state()]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states.append(torch.cuda.get_rng_state())
    return states


def warn_rebuilt(call: str, f: object, count: int) -> None:
    name = getattr(f, "__qualname__", None) or type(f).__name__
    short = call.split(".")[-1]
    per_sample = short.startswith("per_sample") or short == "accumulate_clipped_grads"
    if per_sample:
        name = f"the loss function of {name}"
        fix = ("define the loss function once, outside the loop (a loss module, or a "
               "function of the output and targets), and pass what changes from batch to "
               "batch as tensors: in targets (a tuple or dict of tensors), or in a tensor "
               "the loss function holds")
    elif short in ("jacobian", "hessian"):
        fix = (f"pass what changes from call to call as an argument that is not "
               f"differentiated: {short}(lambda w, batch: loss(w, batch), w, batch, "
               f"argnums=0) rather than {short}(lambda w: loss(w, batch), w)")
    else:
        fix = ("define the function once, outside the loop, and let it read what changes "
               "from an object that stays the same (a module, or a dict whose entries you "
               "replace), or pass the changing tensors as arguments")
    warn_once(
        ("compile-rebuilt", call, getattr(f, "__code__", None)),
        f"{call}: compile=True has compiled {name} {count} times for the same argument "
        f"signature, because each call passed a new function whose closure (or defaults, "
        f"or a partial's arguments) holds new objects, or a global the function reads "
        f"held a new value (or an attribute or item it reads from an object, a dict or a "
        f"list did). A compiled program is kept per function, what its closure holds (new "
        f"objects count by identity) and the values of the globals, attributes and items "
        f"it reads, so each "
        f"such call ran eagerly and then compiled again (a fraction of a second to "
        f"seconds), far slower than compile=False. From now on a new such function runs "
        f"eagerly, at compile=False's speed, and is compiled only if a later call passes "
        f"it again.\n"
        f"  Fix: {fix}, so that one compiled program serves every call. This warning is "
        f"shown once.",
        JacobianWarning,
    )


def recompiled_why(recompiles: int) -> str:
    """Why a key rebuilt ``recompiles`` times stays eager (NOTE [a recompiled entry])."""
    return (f"the compiled program was recompiled {recompiles} times for the same function, "
            f"options and input signature: something the function reads besides its "
            f"arguments and closure (a global, an attribute of an object or module, a "
            f"module hook) changed before each of those calls, and each change needs a new "
            f"program, checked against the eager call. Pass what changes as an argument (a "
            f"tensor) to compile one program")


def compile_failure(err: BaseException) -> str:
    """Why compiling failed, for :func:`warn_eager`: the error's first line (dynamo's is a
    title alone, "Failed to trace builtin operator"), with its ``Explanation:`` line (which
    operator) and the last line of the user's code it points to, where it has them; an
    error whose message is empty (inductor's failed assertions) is said to be torch's."""
    why = quote_error(err).rstrip()
    lines = str(err).splitlines()
    if re.search(r"\w+(Error|Exception):$", why):  # ("InductorError: AssertionError:",
        # the whole of its message)
        why += (" (an internal error of torch.compile with no message of its own, not an "
                "error of the function; TORCHDYNAMO_VERBOSE=1 shows where it arose)")
    elif why.endswith(":"):  # (a sentence that introduces what follows: "Skipped frames:")
        after = next((ln.strip() for ln in lines[1:] if ln.strip()), None)
        why += f" {after}" if after is not None else " (none said)"
    said = [ln.strip()[len("Explanation:"):].strip() for ln in lines
            if ln.strip().startswith("Explanation:")]
    if said:
        text = said[0].rstrip(".")
        why += f" ({text if len(text) <= 300 else text[:297] + '...'})"
    start = next((i for i, ln in enumerate(lines) if ln.strip() == "from user code:"), None)
    if start is not None:
        frames = [i for i in range(start, len(lines)) if lines[i].strip().startswith("File ")]
        if frames:
            at = frames[-1]
            source = lines[at + 1].strip() if at + 1 < len(lines) else ""
            where = lines[at].strip()[len("File "):]
            why += f", at {where}" + (f": {source}" if source else "")
    return why


def warn_eager(call: str, f: object, why: str) -> None:
    name = getattr(f, "__qualname__", None) or type(f).__name__
    warn_once(
        ("compile-fallback", call, program_key(f), why),
        f"{call}: compile=True could not compile the computation for {name}, so it runs "
        f"eagerly for this input signature.\n"
        f"  Why: {why}\n"
        f"  The eager result is exact; only the speed-up is lost. Pass compile=False to "
        f"skip the attempt. This warning is shown once.",
        JacobianWarning,
    )


# --------------------------------------------------------------------------------------
# Where a compiled program runs
# --------------------------------------------------------------------------------------

_NO_CONTEXT = contextlib.nullcontext()


def static_shapes() -> Any:
    """Dynamo's settings for a trace of one shape, for the duration of a first compiled call
    (NOTE [static shapes, once])."""
    return torch._dynamo.config.patch(automatic_dynamic_shapes=False,
                                      assume_static_by_default=True)


# NOTE [static shapes, once]
# A program is traced for the shapes of its first call alone (the key holds every primal's
# shape and strides: a call with others finds another entry). ``torch.compile(...,
# dynamic=False)`` says so by patching dynamo's config (``assume_static_by_default``,
# ``automatic_dynamic_shapes``) around every call of the compiled function: 10-15 us of
# each steady call spent setting and resetting two settings that only a trace reads. Every
# trace of an entry's code after its first is refused by its sealed backend (NOTE [a
# recompiled entry] in :mod:`torch_vjp._engine.compiled`), so the first call alone traces
# with them: it runs inside :func:`static_shapes`, and later calls run without the patch.


def program_mode() -> Any:
    """Where a compiled program runs: outside ``torch.inference_mode``, grad mode kept, as
    the eager call's transforms run (``copies.normal_tensors``), so that it returns normal
    tensors as the eager call does (run inside that mode, a program returned inference
    tensors from its second call on, which no later autograd computation can save); and
    under torch.compile's default stance (NOTE [the user's stance])."""
    stance = user_stance()
    if stance is None and not torch.is_inference_mode_enabled():
        return _NO_CONTEXT
    return _program_mode(stance is not None)


@contextlib.contextmanager
def _program_mode(stance: bool) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        if torch.is_inference_mode_enabled():
            grad = torch.is_grad_enabled()
            stack.enter_context(torch.inference_mode(False))
            stack.enter_context(torch.set_grad_enabled(grad))
        if stance:
            stack.enter_context(torch.compiler.set_stance("default"))
        yield


# NOTE [the user's stance]
# ``torch.compiler.set_stance`` changes how dynamo treats every compiled function, ours
# too. Under "eager_on_recompile" (and a forced backend) a guard that failed ran the
# entry's code eagerly (or with the other backend) without asking the entry's sealed
# backend, so the recompiled program ran after all (NOTE [a recompiled entry]): a spectral
# norm registered since wrote its power iteration into the module's buffers on every call,
# never put back; under "fail_on_recompile" or ``skip_guard_eval_unsafe`` the entry went
# eager for good, and under "eager_then_compile" its program was built twice. An entry's
# recompiles are torch_vjp's own (each is a first call again, compared with the eager
# call), so its programs run under the default stance, which is restored after each call
# (the stance is process-wide: another thread's compile meanwhile sees the default too).
# "force_eager" ignores every torch.compile: compile=True runs the eager call, as it does
# where dynamo compiles nothing (:func:`compiles_nothing`, :func:`dynamo_disabled`). So
# does a call made while a frame of the user's own torch.compile runs under another
# stance (its first, eager call under "eager_then_compile", the code after a graph break
# under "fail_on_recompile"): torch refuses to change the stance there
# (:func:`stance_held`), and the refusal, taken for a failed compile, left the signature
# eager for good, with a warning that blamed torch.compile.


def stance_held() -> bool:
    """Whether torch.compile's stance cannot be changed here: a frame of a compiled
    function runs (dynamo's frame callback is set), where ``set_stance`` raises."""
    callback = torch._C._dynamo.eval_frame.get_eval_frame_callback()
    return callback is not None and callback is not False


def compiles_nothing() -> bool:
    """Whether dynamo would compile no frame here: an active ``TorchDispatchMode`` (one that
    is not torch's own infrastructure: ``FlopCounterMode``, a logging mode), under which it
    skips every frame. compile=True runs the eager call there and makes no entry: with
    ``fullgraph=True`` the compile failed, and the signature stayed eager for good, after
    the mode was left too, with a warning that blamed torch.compile."""
    if not torch._C._len_torch_dispatch_stack():
        return False
    from torch.utils import _python_dispatch as dispatch  # (imported by torch already)

    on_stack = getattr(dispatch, "any_torch_dispatch_mode_on_stack", None)
    return bool(on_stack()) if on_stack is not None else True


def dynamo_disabled() -> bool:
    """Whether dynamo is switched off (``TORCHDYNAMO_DISABLE=1``, with which torch.compile
    returns the function itself: the entry ran the plain form eagerly, unguarded, without
    the eager call's ``buffers_kept``; or dynamo's ``config.disable``, with which it
    compiles no frame). Read by a first call, before it compiles: compile=True runs the
    eager call and makes no entry; and where a built entry's program fails: dynamo, switched
    off since, keeps running the programs it has but compiles no new one where a guard
    fails, and that call is a first call again (it failed, and the signature stayed eager
    for good, with a warning that blamed torch.compile)."""
    if os.environ.get("TORCHDYNAMO_DISABLE", "") == "1":
        return True
    config = sys.modules.get("torch._dynamo.config")  # (not imported: never set)
    return bool(config is not None and config.disable)


def user_stance() -> Any:
    """torch.compile's stance (``torch.compiler.set_stance``) where it is not the default
    one, with guards and the default backend; else None."""
    frames = sys.modules.get("torch._dynamo.eval_frame")  # (not imported: never set)
    stance = getattr(frames, "_stance", None)
    if stance is None or (stance.stance == "default" and stance.backend is None
                          and not stance.skip_guard_eval_unsafe):
        return None
    return stance


# --------------------------------------------------------------------------------------
# The options of compile=True, and its warning under a memory budget
# --------------------------------------------------------------------------------------

def check_compile(
    compile: object, *, call: str, cls: type[Exception] = JacobianOptionError
) -> bool:
    """``compile``, checked: it must be a bool (else ``cls``, the caller's option error)."""
    if not isinstance(compile, bool):
        raise cls(
            f"{call}: compile={compile!r}, but it must be True or False: whether to compile "
            f"the computation with torch.compile once per function and input signature "
            f"(True) or run it eagerly (False, the default)."
        )
    return compile


#: The strategies ``compile=True`` takes.
COMPILED_STRATEGIES = frozenset({"auto", "rev", "fwd"})


def check_compilable(strat: Strategy, group: Any, call: str) -> None:
    """``compile=True`` takes the vectorised strategies, and no process group."""
    if not strat.vectorized:
        raise JacobianOptionError(
            f"{call}: compile=True with strategy={strat.name!r}, but compile=True compiles "
            f"the vectorised strategies only ('auto', 'rev', 'fwd'): the loop strategies "
            f"exist for functions that torch.vmap cannot batch, and those cannot be "
            f"compiled as one program either. Fix: strategy='auto' (or the mode, 'rev' or "
            f"'fwd') with compile=True, or compile=False."
        )
    if group is not None:
        raise JacobianOptionError(
            f"{call}: compile=True with a process_group, but a sharded Jacobian runs "
            f"eagerly: its ranks exchange shards between the products. Fix: drop "
            f"compile=True, or compute without process_group."
        )


def warn_budget(call: str) -> None:
    warn_once(
        ("compile-budget", call),
        f"{call}: compile=True with max_memory runs eagerly: the compiled program computes "
        f"every product at once, so it cannot keep to a memory budget. Pass chunk_size to "
        f"bound the products at once in the compiled program instead, or drop compile=True. "
        f"This warning is shown once.",
        JacobianWarning,
    )


# NOTE [forward mode with create_graph, eager]
# A forward-mode product compiled by inductor with create_graph=True gives a result whose
# backward crashes the process (a segmentation fault in torch 2.13, for jacobian's and
# batch_jacobian's forward mode and hessian's forward over reverse alike; the same program
# under aot_eager runs), and the first call's check, which never differentiates the result,
# cannot see it. So with create_graph=True, "auto" compiles reverse mode, and an explicit
# forward strategy stays eager, with the warning that says why.


def graph_safe_mode(mode: str, explicit: bool, detached: bool) -> str:
    """The mode a compiled program differentiates in (NOTE [forward mode with create_graph,
    eager]): ``mode`` where the result is detached or the mode is reverse; ``"rev"`` for
    ``"auto"``'s forward mode with ``create_graph=True``. An ``explicit`` forward strategy
    there raises, inside the build, so that the call stays eager with the warning."""
    if mode != "fwd" or detached:
        return mode
    if explicit:
        raise RuntimeError(
            "a forward-mode product compiled with create_graph=True crashes the process when "
            "its result is differentiated (torch.compile's inductor); use strategy='rev' or "
            "'auto' to compile it")
    return "rev"

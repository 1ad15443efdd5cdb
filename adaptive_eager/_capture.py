"""A hot module call runs as one guarded compiled call (Note [Captured modules]).

While adaptive eager is on, ``nn.Module.__call__`` is ``_call`` below. The outermost module call
of a thread is the unit: once a module instance has been called ``hot_after`` times (at its first
call if the call trains: Note [Training captured at once]), it is handed to TorchDynamo
(``fullgraph``, static shapes) with our AOTAutograd backend, and later calls run as a single call
of what Dynamo built, with the dispatch mode suspended; the ATen graphs of its
forward and backward run op by op until their artifacts, compiled in a worker process like a
region's, are in ``neff_cache``, and compiled from then on.
"""

from __future__ import annotations

import functools
import importlib
import json
import logging
import math
import operator
import sys
import threading
import time
import types
import warnings
import weakref
from collections import Counter

import torch
from torch._prims_common import make_contiguous_strides_for
from torch.utils._python_dispatch import _disable_current_modes

from fuser import joined
from fuser.backends._common import EagerWouldRaise, launches_of, launches_op
from neff_cache import jobs

from . import _cores, _dropout
from ._flush import _modes_off, flush
from ._log import log
from ._metrics import METRICS
from ._ops import HOST_DRAWN_DROPOUT, facts_for, host_dropout_masks, host_dropout_scale, unseeded_facts
from ._state import _tls as _state_tls
from ._state import current_state, park, trace_alone, trace_done, unpark
from ._threads import sync_values

# Note [Captured modules]
# ~~~~~~~~~~~~~~~~~~~~~~~
# Per-op interception has a floor above eager's op (an empty TorchDispatchMode), so a launch-bound
# step beats eager only when its Python is skipped, as Note [Optimizer capture] in ``_optim`` does
# for ``optimizer.step()``. The forward is where most of a step's ops are (and, through
# AOTAutograd, the backward's), so:
# - Unit: the outermost ``nn.Module.__call__`` made while the mode is on, per module instance
#   (a module called inside another's forward is part of that unit: a thread-local depth). It
#   is what a user's step calls once (``model(x)``); Dynamo inlines every submodule, hooks
#   included, and guards what that Python read (parameters, their ``requires_grad``, ``training``
#   where read, grad mode, input shapes). The loss and ``zero_grad`` stay outside, recorded in
#   windows. Not the frame that produced a hot window: a window is cut at sync points and
#   ``optimizer.step()``, not at Python frames, and has no guards of its own.
# - Capture: ``torch.compile(module's call, backend=ours, dynamic=False, fullgraph=True)``,
#   called with the mode suspended after the window is flushed (``module_capture``: the inputs
#   may be pending). ``fullgraph``: the call is one frame whose guards are checked before anything
#   runs, so a miss (the ``fail_on_recompile`` stance while the call runs) leaves nothing half
#   done: that call runs recorded, counted by cause. The same cause missing a second time
#   recaptures in that call (a new Dynamo entry beside the others; ``_MAX_CAPTURES`` per module,
#   then it stays recorded, counted): a one-off (an epoch's last, smaller batch) costs no trace in
#   the step, and a lasting change (``requires_grad_``, eval calls between training steps) is
#   captured from its second call. Recapturing at the call after any miss instead never captured
#   an alternation (train, eval, train, ...): the train call hit its entry again. A trace that fails
#   (a graph break: ``print``, ``.item()``, a backward hook) leaves the module recorded, counted.
# - Our backend is AOTAutograd with Inductor's decompositions; its forward and backward compilers
#   (``_Graph``) turn each functional ATen graph into a fuser ``Program`` (``_program``), so the
#   region machinery applies unchanged: the persistent key (digest of the program and the
#   backend fingerprint), the compile in a worker process (Note [Background compiles] in
#   fuser.artifacts: the PT2 stack is not thread-safe, Note [Capture compiles off the step]
#   in ``_optim``), the store's trust checks, remembered failures and a load that runs no compiler
#   (Note [Self-contained Inductor artifacts]). Inductor's own ``standalone_compile`` artifacts
#   and AOTAutograd's cache entries were not used: they hold generated source whose load reruns
#   the C++ compiler, and pickles (DESIGN.md "Persistent cache"). Until a graph's artifact is
#   loaded it runs op by op (``gm`` itself), with the mode suspended, at eager's speed less the
#   module's Python. Dynamo's trace stays in the step that captures; with async compiles on cpu,
#   AOTAutograd's moves to the worker too, and the graph Dynamo made runs eagerly until it lands
#   (Note [Traces off the step]).
# - The backward: the autograd engine calls ``_Graph`` while the mode is on, with tangents that
#   are pending values of the recorded loss backward; they are computed first (``sync_value``,
#   whichever thread's window holds them) and the graph runs with the mode suspended.
# - Not captured, counted in ``metrics()["module_capture_misses"]``, with the line in explain():
#   a forward with random ops other than dropout, whose masks the call draws as eager does (Note
#   [Masks drawn by the call]; ``random``: windows draw eager's random numbers, an artifact would
#   not), a module with hooks anywhere in it (``hooks``: their Python must run every call;
#   Dynamo would inline and guard them, but backward hooks break the graph), a trace that fails,
#   the ``replay`` backend or a device its backend does not compile captures for (``backend``:
#   ``replay`` is bitwise eager, which a compiled graph is not; ``_DYNAMO_BACKENDS``).
# - Backends: ``inductor`` on cpu and cuda; ``stablehlo`` (on the emulated device, Note [Emulated
#   tensors under Dynamo] in ``neuron_emulation``) and ``neuron`` on ``neuron``, through the lowering regions use, so a hot Trainium step is an executable for the
#   forward, one for the backward and one for the optimizer step. Their graphs take no Inductor
#   decompositions (the lowering has its own); an op the lowering runs alone (Note [Ops that run
#   alone] in fuser.backends._stablehlo_lowering) splits the graph, and each piece and op run
#   alone counts as a launch. An index out of range makes the compiled run raise
#   ``EagerWouldRaise`` having written nothing (Note [Checked indices] there): that call runs op by
#   op, where eager's kernel raises its error. The ``neuron`` backend shares the lowering but has not run
#   on hardware.
# - A program that Program's codec cannot describe (an op outside ATen, a non-tensor output)
#   keeps running op by op, counted (``module_uncompiled_graphs``).
_MAX_CAPTURES = 4
# backend -> the devices whose captured graphs it compiles (Note [Captured modules]); stablehlo on
# cpu is the lowering's test vehicle for windows, and Inductor is the CPU compiler
_DYNAMO_BACKENDS = {"inductor": ("cpu", "cuda"), "stablehlo": ("neuron",), "neuron": ("neuron",)}
_RECOMPILE = "Detected recompile when torch.compile stance is 'fail_on_recompile'"
# Dynamo refuses to run a compiled function while FX traces (``is_fx_symbolic_tracing()``, which
# it asks before the call runs anything): up to torch 2.13 the flag is process-wide
# (``_is_fx_tracing_flag``), so a region compiling in another thread of this process counts; from
# 2.14 it is per thread (``_is_fx_tracing_tls``). Such a call runs recorded, as a cold one does,
# counted as ``traced_elsewhere`` (tests/test_threads.py).
_NESTED_TRACE = "Detected that you are using FX to symbolically trace a dynamo-optimized function"
_POLL_S = 0.05  # how often a graph waiting for its artifact looks for it

_ORIG_CALL = torch.nn.Module.__call__
_len_dispatch_stack = torch._C._len_torch_dispatch_stack
_saved_tensor_hooks = torch._C._autograd._top_saved_tensors_default_hooks
_BUSY = False  # a captured call runs or is traced: module calls inside it are plain (Dynamo guards this)
_tls = threading.local()  # ``depth``: module calls of this thread being run recorded
_saved: list = []


class _Decline(Exception):
    """Raised by our compilers for a graph that must not be captured; ``cause`` is counted."""

    def __init__(self, cause: str, detail: str = ""):
        super().__init__(f"{cause}: {detail}" if detail else cause)
        self.cause = cause


jobs.answers_not_failures(_Decline)  # a trace job's decline is counted, not warned of


class _Cap:
    """One module instance's capture state."""

    __slots__ = ("fn", "calls", "captures", "off", "missed", "due", "__weakref__")

    def __init__(self):
        self.fn = None
        self.calls = 0
        self.captures = 0  # compiles of Dynamo entries (our backend's calls)
        self.off: str | None = None  # why it is not captured any more
        self.missed: set = set()  # guard-miss causes seen once: a second miss of one recaptures
        self.due = False  # its call before the capture was recorded (Note [Windows a capture supersedes])


_caps: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_THEIRS = "compiled by the program"  # not a miss: nothing of ours to capture


def install() -> None:
    """``nn.Module.__call__`` is ``_call`` while the mode is on; called once, by ``_patches.install``."""
    _saved.append(torch.nn.Module.__dict__["__call__"])
    torch.nn.Module.__call__ = _call


def uninstall() -> None:
    while _saved:
        torch.nn.Module.__call__ = _saved.pop()
    while _dynamo_saved:
        module, name, original = _dynamo_saved.pop()
        setattr(module, name, original)


# Note [Dynamo's work for nothing]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Two things TorchDynamo (torch 2.13) does in a capture's trace are of no use to it, and both sit in
# the capturing step:
# - For its ``trace_call`` debug log it names the function at each line of user code that puts a
#   call in a graph (``OutputGraph.create_proxy``), whether or not that log is on, finding the name
#   by tokenizing the line's whole source file (``funcname_cache``): a capture of stock GPT-2 and of
#   its AdamW step tokenized 14 files of transformers and torch, 0.8 s (a small MLP's 4 files,
#   0.08 s). The name appears in the lines of Dynamo's ``trace_call`` and ``trace_source`` logs only,
#   so the lookup answers None while neither is on, and is Dynamo's otherwise (``TORCH_LOGS=trace_call``).
# - For an optimizer, whether each gradient has a static address for CUDA graphs
#   (``_is_static_for_cudagraphs``), which imports Inductor's CUDA graph trees, and with them
#   Inductor's compiler (``compile_fx``, its lowerings and templates: 1.0 s on 2 cores), before it
#   finds that a tensor not on cuda is static. Where the capture's backend is not Inductor (the
#   ``neuron`` device's), nothing else in the program imports that compiler, so the question is
#   answered True for such a tensor without the import (on cuda it is Dynamo's): the first capture
#   of stock GPT-2 and AdamW on the emulated device took ~8 s. With Inductor the program imports it
#   anyway, to load the artifacts, so it stays in the capturing step, which the cold-run bound
#   excepts: answered without it, an 8-block MLP's cold runs loaded their first artifact about a
#   second later, importing it on the compile thread beside the steps, and their slowest later step
#   took 89 and 136 ms against 83 and 60 ms (eager's step: 2 ms).
# Each is swapped in before the trace that first needs it and put back by ``uninstall``
# (benchmarks/RESULTS.md, session 47).
_dynamo_saved: list = []  # (module, name, Dynamo's function)


def _spare_dynamo(options) -> None:
    """Note [Dynamo's work for nothing]; before a capture's trace, each part once."""
    try:
        from torch._dynamo import output_graph, symbolic_convert
        from torch._dynamo.variables import optimizer as optimizer_variable
    except ImportError:  # another torch's layout: Dynamo does the work, as before
        return
    swapped = {(module, name) for module, name, _ in _dynamo_saved}
    lookup = getattr(symbolic_convert, "get_funcname", None)
    logs = [log_ for module in (output_graph, symbolic_convert) for name in ("trace_call_log", "trace_source_log")
            if isinstance(log_ := getattr(module, name, None), logging.Logger)]
    if lookup is not None and logs and (symbolic_convert, "get_funcname") not in swapped:
        def get_funcname(filename: str, lineno: int):
            if any(log_.isEnabledFor(logging.DEBUG) for log_ in logs):
                return lookup(filename, lineno)
            return None

        _dynamo_saved.append((symbolic_convert, "get_funcname", lookup))
        symbolic_convert.get_funcname = get_funcname
    static = getattr(optimizer_variable, "_is_static_for_cudagraphs", None)
    if (static is not None and options.backend != "inductor"
            and (optimizer_variable, "_is_static_for_cudagraphs") not in swapped):
        def is_static_for_cudagraphs(x: torch.Tensor) -> bool:
            return static(x) if x.is_cuda else True

        _dynamo_saved.append((optimizer_variable, "_is_static_for_cudagraphs", static))
        optimizer_variable._is_static_for_cudagraphs = is_static_for_cudagraphs


def _call(self, *args, **kwargs):
    if _BUSY:
        return _ORIG_CALL(self, *args, **kwargs)
    st = current_state()
    if st is not None and st.parked:  # Note [The mode parked between captured calls] in _state
        unpark(st)
    if (st is None or st.mode is None or getattr(_tls, "depth", 0) or not st.options.reaches("capture")
            or not _len_dispatch_stack()):  # the mode suspended: a flush's or a capture's own calls
        return _ORIG_CALL(self, *args, **kwargs)
    cap = _caps.get(self)
    if cap is None:
        cap = _caps[self] = _Cap()
        if type(self).__name__ == "OptimizedModule" or getattr(self, "_compiled_call_impl", None) is not None:
            cap.off = _THEIRS  # the program compiled it: its compile wins (Note [User torch.compile] in _compile)
    if _saved_tensor_hooks(False) is not None:
        # activation checkpointing (or another saved-tensor hook): what the call saves is the hook's,
        # and a captured graph saves other tensors than the recorded call (non-reentrant
        # checkpoint compares their count between the forward and its recomputation)
        _miss("saved_tensor_hooks", self)
        return _recorded(self, args, kwargs)
    if cap.fn is not None:
        return _run(st, self, cap, args, kwargs)
    if cap.off is None:
        cap.calls += 1
        if cap.calls > st.options.hot_after or (cap.calls == 1 and _trains(st, self, args, kwargs)):
            return _capture(st, self, cap, args, kwargs)
        if cap.calls == st.options.hot_after and not cap.due and _not_capturable(st, self) is None:
            cap.due = True
            return _recorded_before_capture(st, self, args, kwargs)
    elif cap.off is not _THEIRS:
        _miss(cap.off, self)
    return _recorded(self, args, kwargs)


def _trains(st, module, args, kwargs) -> bool:
    """Whether a module's first call is captured at once: a training call (Note [Training captured
    at once])."""
    if not (at_once(st.options) and torch.is_grad_enabled()) or _not_capturable(st, module) is not None:
        return False
    from torch.utils._pytree import tree_leaves

    return (any(p.requires_grad for p in module.parameters())
            or any(isinstance(x, torch.Tensor) and x.requires_grad for x in tree_leaves((args, kwargs))))


def _recorded(module, args, kwargs):
    _tls.depth = getattr(_tls, "depth", 0) + 1
    try:
        return _ORIG_CALL(module, *args, **kwargs)
    finally:
        _tls.depth -= 1


# Note [Traces beside other threads]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# While TorchDynamo compiles, ``torch.compiler.is_compiling()`` is true in every thread of the
# process (``_is_compiling_flag``, a module global, torch 2.13), and eager code takes its
# compile-only branches: torch.optim's Adam computed its step sizes as tensors instead of floats,
# so a loop in another thread under the mode got other bits (1 ulp) or a TypeError from
# ``_foreach_addcdiv_`` (tests/test_generated_training.py, two threads). So a capture, and a
# recapture, is made only while no other live thread has the mode on, holding a lock that a
# thread turning the mode on waits for (``_state.trace_alone``, ``_register``); else the call
# runs recorded, counted as ``threads``, and the next call tries again. A thread without the mode
# is not known to us; a captured call that runs compiled compiles nothing.


# Note [Windows a capture supersedes]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A window is compiled at its ``hot_after``-th sight, and a module call is captured at its
# ``hot_after + 1``-th: the windows that hold ops of the recorded call just before the capture
# (the one open when it began, each one a flush inside it opens, the one open when it returns)
# are compiled at that sight and never seen again, since from the next call on the capture runs
# those ops and cuts the windows around them elsewhere (its ``module_capture`` flush). Their
# compiles were queued ahead of the capture's graphs in the one compile worker: GPT-2's forward
# flushes twice at host reads that TorchDynamo skips (``is_torchdynamo_compiling()``), and the
# step's forward, backward and optimizer step compiled behind them. So that call's windows are
# marked ``superseded`` (``fuser.window.Window``) and replay, counted as ``capture_due``; the
# fuser compiles such a region only if it is seen again (the capture failed, missed its guards, or
# another thread traced: ``entry.seen`` is past ``hot_after`` by then). Only the first call that is
# due: a module whose capture keeps being put off (``traced_elsewhere``) does not keep its windows
# from compiling.
def _recorded_before_capture(st, module, args, kwargs):
    st.window.superseded = True
    _state_tls.capture_due = True  # each window a flush opens meanwhile is marked (``_flush._run``)
    try:
        return _recorded(module, args, kwargs)
    finally:
        _state_tls.capture_due = False
        st.window.superseded = True


def _miss(cause: str, module, depth: int = 2) -> None:
    METRICS.module_capture_misses[cause] += 1
    f = sys._getframe(depth)
    METRICS.module_capture_sites[(cause, type(module).__name__, (f.f_code, f.f_lineno))] += 1


def traced_elsewhere() -> bool:
    """Whether FX is tracing as Dynamo sees it (its own check), so that it would refuse a captured
    call with ``_NESTED_TRACE``."""
    from torch.fx import _symbolic_trace

    return _symbolic_trace.is_fx_symbolic_tracing()


@functools.cache
def _fail_on_recompile():
    """``torch.compiler.set_stance("fail_on_recompile")``'s stance, built once: the context manager
    builds one per use (80-600 us a step measured under load, against 24 us for setting it)."""
    from torch._dynamo.eval_frame import DynamoStance

    return DynamoStance("fail_on_recompile", False, None)


# what ``eval_frame._set_stance`` reads and sets in the torch versions we know: one check, one global
_SET_STANCE_NAMES = frozenset({"torch._C._dynamo.eval_frame", "get_eval_frame_callback", "RuntimeError", "_stance"})


@functools.cache
def _stance_parts():
    from torch._C._dynamo.eval_frame import get_eval_frame_callback
    from torch._dynamo import eval_frame

    known = hasattr(eval_frame, "_stance") and set(eval_frame._set_stance.__code__.co_names) <= _SET_STANCE_NAMES
    return eval_frame, get_eval_frame_callback, known


def swap_stance(stance):
    """``eval_frame._set_stance(stance)`` (returns the prior stance) without its import at each call:
    ~2 us of each of the four calls a captured step makes (benchmarks/RESULTS.md, session 45). The
    same check first: no stance is set inside a torch.compile region. A torch whose function does
    more than that gets its function."""
    eval_frame, callback, known = _stance_parts()
    if not known:
        return eval_frame._set_stance(stance)
    current = callback()
    if current is not False and current is not None:
        raise RuntimeError("attempted to set_stance in a torch.compile region")
    prior, eval_frame._stance = eval_frame._stance, stance
    return prior


def _run(st, module, cap: _Cap, args, kwargs):
    global _BUSY
    if st.window.nodes:
        flush(st, "module_capture")  # its inputs may be pending
    if traced_elsewhere():
        _miss("traced_elsewhere", module, 3)
        return _recorded(module, args, kwargs)
    recapture = False
    while True:
        prior = None if recapture else swap_stance(_fail_on_recompile())
        busy, _BUSY = _BUSY, True
        try:
            with _modes_off():
                if recapture:  # Dynamo traces: Note [Static captures]
                    with _unmarked(args, kwargs):
                        out = cap.fn(*args, **kwargs)
                else:
                    out = cap.fn(*args, **kwargs)
        except _Decline as e:  # Note [Traces off the step]: raised before the call ran anything
            return _failed_recapture(module, cap, e, args, kwargs)
        except RuntimeError as e:
            if str(e).startswith(_NESTED_TRACE):  # another thread began to trace meanwhile: not a miss
                _miss("traced_elsewhere", module, 3)
                return _recorded(module, args, kwargs)
            if recapture or not str(e).startswith(_RECOMPILE):
                if not recapture:
                    raise
                return _failed_recapture(module, cap, e, args, kwargs)
            guard = first_failed_guard(str(e))
            cause = _cause(guard)
            log.info("adaptive_eager: a captured call of %s missed its guards (%s): %s", type(module).__name__, cause,
                     guard)
        except Exception as e:  # noqa: BLE001 - Dynamo and our backend fail before the call runs anything
            if not recapture:
                raise
            return _failed_recapture(module, cap, e, args, kwargs)
        else:
            METRICS.module_captured_calls += 1
            park(st)  # Note [The mode parked between captured calls] in _state
            return out
        finally:
            _BUSY = busy
            if prior is not None:
                swap_stance(prior)
            if recapture:
                trace_done()
        # Note [Captured modules]: a miss runs recorded; the same cause missing again recaptures
        _miss(cause, module, 3)
        if cause not in cap.missed or cap.captures >= _MAX_CAPTURES:
            cap.missed.add(cause)
            if cap.captures >= _MAX_CAPTURES:
                cap.fn, cap.off = None, "recapture_limit"
                log.warning("adaptive_eager: %s missed its guards after %d captures; it is recorded op by op from "
                            "now on (metrics()['module_capture_misses'] says why)", type(module).__name__,
                            _MAX_CAPTURES)
            return _recorded(module, args, kwargs)
        if not trace_alone(st):  # Note [Traces beside other threads]: no recapture now
            _miss("threads", module, 3)
            return _recorded(module, args, kwargs)
        cap.missed.discard(cause)
        recapture = True


def _failed_recapture(module, cap: _Cap, e: Exception, args, kwargs):
    cap.fn, cap.off = None, _decline_cause(e)
    if cap.off == "capture_failed":
        log.warning("adaptive_eager: %s could not be captured again (%s); it is recorded op by op",
                    type(module).__name__, _first_line(e))
    _miss(cap.off, module, 4)
    return _recorded(module, args, kwargs)


def _capture(st, module, cap: _Cap, args, kwargs):
    global _BUSY
    why = _not_capturable(st, module)
    if why is not None:
        cap.off = why
        _miss(why, module, 3)
        return _recorded(module, args, kwargs)
    if traced_elsewhere():  # the next call tries again
        cap.calls -= 1
        _miss("traced_elsewhere", module, 3)
        return _recorded(module, args, kwargs)
    if st.window.nodes:
        flush(st, "module_capture")
    if not trace_alone(st):  # Note [Traces beside other threads]: the next call tries again
        cap.calls -= 1
        _miss("threads", module, 3)
        return _recorded(module, args, kwargs)
    t0 = time.perf_counter()
    _spare_dynamo(st.options)
    fn = torch.compile(_fresh(module), backend=_Backend(cap, st.options), dynamic=False, fullgraph=True)
    busy, _BUSY = _BUSY, True
    try:
        with _disable_current_modes(), warnings.catch_warnings(), _unmarked(args, kwargs):
            warnings.filterwarnings("ignore", category=DeprecationWarning)
            out = fn(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - Dynamo and our backend fail before the call runs anything
        if str(e).startswith(_NESTED_TRACE):  # another thread began to trace meanwhile: not a failure
            cap.calls -= 1
            _miss("traced_elsewhere", module, 3)
            return _recorded(module, args, kwargs)
        cap.off = _decline_cause(e)
        if cap.off == "capture_failed":
            log.warning("adaptive_eager: %s could not be captured (%s: %s); it is recorded op by op",
                        type(module).__name__, type(e).__name__, _first_line(e))
        _miss(cap.off, module, 3)
        return _recorded(module, args, kwargs)
    finally:
        _BUSY = busy
        trace_done()
    METRICS.module_capture_seconds += time.perf_counter() - t0
    cap.fn = fn
    METRICS.module_captured_calls += 1
    return out


def capturable_backend(options) -> bool:
    """Whether a capture's graphs compile with ``options``' backend on its device (Note [Captured
    modules]); on the emulated ``neuron`` device, also lets Dynamo trace its tensors (Note
    [Emulated tensors under Dynamo] in ``neuron_emulation``)."""
    if options.device not in _DYNAMO_BACKENDS.get(options.backend, ()):
        return False
    if options.device == "neuron":
        from . import neuron_emulation

        if neuron_emulation.is_emulated():
            neuron_emulation.dynamo_sees_plain_tensors()
    return True


def _not_capturable(st, module) -> str | None:
    if not capturable_backend(st.options):
        return "backend"
    from torch.nn.modules import module as m

    if (m._global_forward_hooks or m._global_forward_pre_hooks or m._global_backward_hooks
            or m._global_backward_pre_hooks or m._global_module_registration_hooks):
        return "hooks"
    for sub in module.modules():
        if sub._forward_hooks or sub._forward_pre_hooks or sub._backward_hooks or sub._backward_pre_hooks:
            return "hooks"
    return None


def _decline_cause(e: BaseException) -> str:
    while e is not None:
        if isinstance(e, _Decline):
            return e.cause
        e = e.__cause__ or e.__context__
    return "capture_failed"


# Note [Static captures]
# ~~~~~~~~~~~~~~~~~~~~~~
# A capture is traced with ``dynamic=False``: its graphs are compiled for its call's shapes, and a
# call of other shapes misses its guards (Note [Captured modules]). But TorchDynamo makes a
# dimension symbolic whatever ``dynamic`` says where the tensor carries
# ``_dynamo_propagated_dynamic_indices`` (torch 2.13), the unguarded mark AOTAutograd stamps on the
# outputs of a graph it compiled with that dimension symbolic: a batch out of the program's own
# ``torch.compile`` of its preprocessing, once that had seen two batch sizes. Our trace's graph
# then took a SymInt input, and the forward and its backward ran op by op for good
# (``non_tensor_input``), slower than eager: the suite's GPT block, whose input its
# ``torch.compile`` variant had marked, made 100 launches a step instead of 5. So the mark is off
# the call's tensors while Dynamo traces and back on after; unguarded, it changes nothing of which
# calls the captured graph answers.
_MARK = "_dynamo_propagated_dynamic_indices"


class _unmarked:
    """The call's tensors without ``_MARK`` for a trace (Note [Static captures])."""

    __slots__ = ("args", "taken")

    def __init__(self, args, kwargs):
        self.args = (args, kwargs)

    def __enter__(self) -> None:
        from torch.utils._pytree import tree_leaves

        self.taken = []
        for t in tree_leaves(self.args):
            mark = getattr(t, _MARK, None) if isinstance(t, torch.Tensor) else None
            if mark is not None:
                delattr(t, _MARK)
                self.taken.append((t, mark))

    def __exit__(self, *exc) -> None:
        for t, mark in self.taken:
            setattr(t, _MARK, mark)


def _fresh(module):
    """The module's call as a function with a code object of its own: Dynamo's recompile limit
    counts entries per code object, and every captured module would otherwise share one."""
    ref = weakref.ref(module)  # ``_caps`` holds this function and must not keep the module alive

    def run(*args, **kwargs):
        return _ORIG_CALL(ref(), *args, **kwargs)

    return types.FunctionType(run.__code__.replace(), run.__globals__, "captured", None, run.__closure__)


def first_failed_guard(message: str) -> str:
    """The first failed guard of a Dynamo recompile message, as ``len(kwargs) == 7``."""
    first = message.partition("guard failure(s):")[2].strip().lstrip("- ").partition("\n")[0]
    guard = first.partition("  #")[0].strip()  # what follows is the source line that read the value
    return guard.partition(": ")[2] if guard[:1].isdigit() else guard  # "2/0: <guard>": the entry's number


def _cause(guard: str) -> str:
    """What a failed guard (``first_failed_guard``) is about."""
    if guard in ("not args", "not kwargs") or guard.startswith(("len(args)", "len(kwargs)")):
        return "arguments"  # a call with more or fewer (keyword) arguments than the capture's
    for words, cause in ((("size mismatch", "stride mismatch", "dimensionality"), "shape"),
                         (("grad_mode", "GRAD_MODE", "grad mode"), "grad_mode"),
                         (("requires_grad",), "requires_grad"), (("training",), "train_eval"),
                         (("dtype",), "dtype"), (("hooks",), "hooks"), (("device",), "device")):
        if any(w in guard for w in words):
            return cause
    return "other_guard"


def _first_line(e: BaseException) -> str:
    return str(e).splitlines()[0] if str(e) else type(e).__name__


class _Backend:
    """Dynamo's backend for every capture (Note [Captured modules], Note [Optimizer capture] in
    ``_optim``): AOTAutograd with a ``_Graph`` per forward, backward and inference graph. ``who``
    names the metrics its graphs count in (``module_*`` or ``optimizer_*``); ``cap``, a module's
    ``_Cap``, counts its compiles."""

    def __init__(self, cap, options, who: str = "module"):
        self.cap = None if cap is None else weakref.ref(cap)
        self.options = options
        self.who = who

    def __call__(self, gm, example_inputs):
        options, who = self.options, self.who
        key = doc = compiled = None
        try:
            doc = _record_doc(gm, example_inputs, options, who)
            key = _key_of(doc)
        except _Decline as e:
            METRICS.capture_records[f"{who}_unkeyed:{e.cause}"] += 1
        if key is not None:
            compiled = _from_record(key, gm, options, who)
            if compiled is None and _traces_off_step(options):
                compiled = _Interim.start(key, doc, gm, options, who)
        if compiled is None:
            compiled, graphs, meta = _aot_trace(gm, example_inputs, options, who, key is not None)
            if key is not None:
                _write_record(key, graphs, meta, options, who)
        cap = None if self.cap is None else self.cap()
        if cap is not None:
            cap.captures += 1
        if who == "module":
            METRICS.module_captures += 1
        return compiled


def _aot_trace(gm, example_inputs, options, who: str, whole: bool):
    """AOTAutograd's trace of Dynamo's graph with our compilers (Note [Captured modules]): the callable,
    the ``_Graph`` per forward, backward or inference graph, and AOTAutograd's metadata of the trace.
    ``whole``: the backward graph is made now, not at the first backward, so that a record is whole.
    Outside Dynamo's compile (a worker's trace, the trace after a worker declined: Note [Traces off
    the step]) it runs in a tracing context of its own, with a fake mode of its own."""
    import contextlib

    from torch._dynamo.backends.common import aot_autograd
    from torch._inductor.decomposition import select_decomp_table

    graphs: dict = {}

    def forward(fgm, examples):
        graphs["forward"] = _Graph(fgm, examples, "forward", options, who)
        return graphs["forward"]

    def backward(bgm, examples):
        graphs["backward"] = _Graph(bgm, examples, "backward", options, who)
        run = torch._dynamo.disable(graphs["backward"], recursive=True)
        run._boxed_call = True
        return run

    # already ``disable``d, as AotAutograd would wrap it: its wrapper would hide ``_boxed_call``
    backward._is_wrapped_bw_compiler = True
    # Note [Written inputs]: an inference graph writes its inputs itself (trailing copy_)
    # Inductor's decompositions for Inductor; the StableHLO lowering has its own (Note [Our
    # decompositions] in fuser.backends._stablehlo_decompositions), and takes the ops a window
    # records: Inductor's table would turn embedding's backward into index_put, which runs alone
    decompositions = {}
    if options.backend == "inductor":
        # some of the table's entries (max_pool2d_with_indices) ask Inductor's lowering whether to
        # decompose, and do not import it: a process that never compiled with Inductor has not
        importlib.import_module("torch._inductor.lowering")  # not ``import torch...``: a local ``torch``

        # Note [Masks drawn by the call]: dropout stays one op, whose mask the call draws
        decompositions = {op: f for op, f in select_decomp_table().items() if op is not _DROPOUT}
    context = torch._guards.TracingContext.try_get()
    with contextlib.ExitStack() as stack:
        if context is None:
            from torch._subclasses.fake_tensor import FakeTensorMode

            context = torch._guards.TracingContext(FakeTensorMode())
            stack.enter_context(torch._guards.tracing(context))
        stack.enter_context(torch._functorch.config.patch(force_non_lazy_backward_lowering=whole))
        compiled = aot_autograd(fw_compiler=forward, bw_compiler=backward, inference_compiler=forward,
                                decompositions=decompositions, keep_inference_input_mutations=True,
                                partition_fn=_partition_fn(options))(gm, example_inputs)
    return compiled, graphs, context.fw_metadata


# Note [The forward and backward partition]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# With ``inductor``, a captured forward and backward are split as ``torch.compile`` splits them
# for Inductor: AOTAutograd's min-cut partitioner, which saves fewer tensors for the backward and
# recomputes what is cheap to recompute inside the backward's fused kernels. AOTAutograd's default
# (``default_partition``, which ``aot_autograd`` falls back to) saved every intermediate the
# backward reads, a transposed weight, and one tensor twice: the recurrent cell of
# ``benchmarks/user_step.py`` saved 66 tensors where ``torch.compile`` saves 36, each one packed by
# the forward and unpacked by the backward at every step (``save_for_backward``,
# ``saved_tensors``), 30-45 us of its 1.6 ms step (benchmarks/RESULTS.md, session 45).
# Not for a graph with a convolution: Inductor runs convolutions channels-last, and
# ``torch.compile``, which compiles the backward after the forward, gives the backward the saved
# tensors in the layout the forward made them. Our forward and backward are compiled apart, and
# exchange the saved tensors in eager's layout, so the forward converts each one it saves;
# min-cut saved the convolution's output before the batch norm instead of after it, and the small
# CNN's forward took 1.9 ms where it took 1.3 (``torch.compile``'s: 0.95). So such a graph keeps the
# default partition. The StableHLO and Neuron lowerings keep it too: XLA and neuronx-cc decide
# their own rematerialization, and a graph's inputs there are device buffers.
_CONVOLUTIONS = frozenset({torch.ops.aten.convolution.default, torch.ops.aten.convolution_backward.default})


def _partition_fn(options):
    from torch._functorch.partitioners import default_partition, min_cut_rematerialization_partition

    if options.backend != "inductor":
        return default_partition

    def partition(joint, joint_inputs, **kwargs):
        if any(n.op == "call_function" and n.target in _CONVOLUTIONS for n in joint.graph.nodes):
            return default_partition(joint, joint_inputs, **kwargs)
        return min_cut_rematerialization_partition(joint, joint_inputs, compiler="inductor", **kwargs)

    return partition


# Note [Traces off the step]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~
# AOTAutograd's trace of a captured graph costs seconds on a loaded machine (3 s for an 8-block
# MLP, 11 s for AdamW's step over it), and a cold run's capturing step stalled for it. Dynamo's
# trace stays in the step: it is what guards the call, and it cannot run in a thread beside the
# program, since it saves and then restores the process's CPU generator and default dtype around
# each trace (``preserve_global_state``), which would rewind the random numbers the program drew
# meanwhile (0.7-1.2 s for an 8-block MLP and its AdamW step on 2 cores, after 1.6 s of first
# imports in a process's first capture, benchmarks/RESULTS.md); AOTAutograd's moves to a
# compile worker process, as a graph's compile does (Note [Background compiles] in
# fuser.artifacts: the PT2 stack is not thread-safe, so never a thread of this process). The job
# is the graph's record (Note [Captures from the cache]): its payload is the JSON the record's key
# hashes (``_record_doc``), from which the worker (``_capture_trace.trace_job``) rebuilds Dynamo's
# graph, inputs of the same metadata and the ambient state, checks that the rebuilt graph has the
# same JSON (anything it could not reproduce, such as an autocast state, declines the job), traces
# it with the compilers every capture uses (``_aot_trace``: Programs only, no compile starts there)
# and returns the record, stored under the key as one traced here is. Meanwhile the captured call
# runs Dynamo's graph itself (``_Interim``): its ops as eager runs them, with autograd and with the
# mode suspended (the captured call's), so eager's values, and a backward that cuts the windows
# where the record's will (Note [The interim backward]); an optimizer's graph writes the
# parameters and state in place as the step would. Every ``_POLL_S`` it looks for the job's end;
# once the record lands, the call runs the callable built from it (``_from_record``), whose
# graphs then compile in the worker as any record's do (a worker whose program exited before the
# record landed compiles them itself: Note [Follow-up compiles after exit] in neff_cache._worker). A job that declines or fails (its cause
# remembered in the store, so a later process traces in its step at once) makes the next call
# trace here, as before (``_aot_trace``, in a tracing context of its own); a trace that fails
# here too leaves the module (or step) uncaptured, by the same causes as a capture that failed,
# raised before the call runs anything (``_Decline``, as Dynamo's guards miss). Counted in
# ``capture_records``: ``<who>_trace_submitted``, ``_trace_landed``, ``_trace_declined:<cause>``
# and ``_trace_in_step`` (the trace that followed). Only Inductor on cpu: its worker needs no
# device; with ``async_compile`` off the trace stays in the step, as the compiles do.
_TRACE_JOB = "adaptive_eager._capture_trace:trace_job"


def _traces_off_step(options) -> bool:
    return bool(options.async_compile) and options.backend == "inductor" and options.device == "cpu"


class _Interim:
    """A capture's callable while its AOTAutograd trace runs in a worker (Note [Traces off the step])."""

    def __init__(self, key: str, gm, options, who: str, ours: bool):
        self.key, self.gm, self.options, self.who, self.ours = key, gm, options, who, ours
        self.run = None
        # not before its second call: the first, the one that made it, comes right after the job was
        # submitted, and whether the worker had already answered then would decide whether that call
        # runs Dynamo's graph or traces in the step (a test of it failed by that race under load)
        self.next_poll = math.inf
        self.ops = sum(1 for n in gm.graph.nodes if n.op in ("call_function", "call_method", "call_module"))
        self.boundary = who == "module" and _separable(gm)

    @classmethod
    def start(cls, key: str, doc: bytes, gm, options, who: str):
        """The interim callable, its trace submitted; None if the trace must run in the step now."""
        from fuser.artifacts import _store, submit_other_job
        from fuser.backends import get_backend
        from fuser.compile import cache_fingerprint

        counts = METRICS.capture_records
        store = _store(options)
        fingerprint = cache_fingerprint(get_backend(options.backend, options.device))
        failure = store.failure(key, fingerprint=fingerprint)
        if failure is not None:  # declined in an earlier process
            counts[f"{who}_trace_declined:{_job_cause(failure)}"] += 1
            counts[f"{who}_trace_in_step"] += 1
            return None
        submitted = submit_other_job(key, _TRACE_JOB, doc, store, options,
                                     fingerprint=fingerprint, backend=_RECORD_BACKEND)
        if submitted is None:
            counts[f"{who}_trace_in_step"] += 1
            return None
        if submitted:
            counts[f"{who}_trace_submitted"] += 1
        return cls(key, gm, options, who, submitted)

    def __call__(self, *args):
        run = self.run
        if run is None and time.perf_counter() >= self.next_poll:
            run = self._poll(args)
        if run is not None:
            return run(*args)
        if self.next_poll == math.inf:  # its first call: the next one polls
            self.next_poll = 0.0
        if self.who == "module":
            METRICS.module_uncompiled_runs += 1
            METRICS.launches += self.ops
            METRICS.eager_equivalent_launches += self.ops
        else:  # the step itself is one launch (``_optim._count_launches``)
            METRICS.optimizer_uncompiled_runs += 1
            METRICS.launches += self.ops - 1
        if self.boundary and torch.is_grad_enabled():  # Note [The interim backward]
            return _cores.running(_InterimBackward.apply, self.gm, *args)
        return _cores.running(self.gm.forward, *args)  # Note [Cores beside a compile]

    def _poll(self, args):
        from fuser.artifacts import _store, other_job, other_job_pending
        from fuser.backends import get_backend
        from fuser.compile import cache_fingerprint
        from fuser.regions import poll_jobs

        self.next_poll = time.perf_counter() + _POLL_S
        poll_jobs()
        counts, who = METRICS.capture_records, self.who
        if self.ours:
            result = other_job(self.key)
            if result is None and other_job_pending(self.key):
                return None
            if result is not None and not result.ok:
                counts[f"{who}_trace_declined:{_job_cause(result.failure or '')}"] += 1
                return self._here(args)
        # landed; or traced by another process (or another capture of this one), or its result
        # collected by another poller: the store says
        store = _store(self.options)
        if not store.contains(self.key):
            if store.is_claimed(self.key):
                return None
            fingerprint = cache_fingerprint(get_backend(self.options.backend, self.options.device))
            failure = store.failure(self.key, fingerprint=fingerprint)
            counts[f"{who}_trace_declined:{'elsewhere' if failure is None else _job_cause(failure)}"] += 1
            return self._here(args)
        run = _from_record(self.key, self.gm, self.options, who)
        if run is None:
            counts[f"{who}_trace_declined:no_record"] += 1
            return self._here(args)
        counts[f"{who}_trace_landed"] += 1
        self.run = run
        return run

    def _here(self, args):
        """The trace in this process, before the call runs anything (Note [Traces off the step])."""
        METRICS.capture_records[f"{self.who}_trace_in_step"] += 1
        t0 = time.perf_counter()
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", category=DeprecationWarning)
                compiled, graphs, meta = _aot_trace(self.gm, list(args), self.options, self.who, True)
        except Exception as e:  # noqa: BLE001 - as a capture whose trace failed: not captured, counted
            cause = _decline_cause(e)
            if cause == "capture_failed":
                log.warning("adaptive_eager: a captured graph could not be traced (%s: %s); it is recorded op by op",
                            type(e).__name__, _first_line(e))
            raise _Decline(cause, _first_line(e)) from e
        _write_record(self.key, graphs, meta, self.options, self.who)
        seconds = getattr(METRICS, f"{self.who}_capture_seconds")
        setattr(METRICS, f"{self.who}_capture_seconds", seconds + time.perf_counter() - t0)
        self.run = compiled
        return compiled


# Note [The interim backward]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A captured module's backward is a graph of its own (``_Graph``, kind ``backward``) whose call
# computes its pending tangents first: the window that holds them (the loss, its backward up to
# the module's output) is cut there, and the graph runs with the mode suspended. While the
# AOTAutograd trace runs in the worker (Note [Traces off the step]) the call runs Dynamo's graph
# eagerly; were its backward autograd's own nodes, run by the engine with the mode on, they would
# be recorded in the loss's window, a structure the compiled graphs never make: a short first run
# would compile that window, and the next process (whose backward is the record's graph) would
# meet a window it never saw at every step. So the interim call keeps the captured call's
# boundary: ``_InterimBackward`` runs the graph on detached aliases of the inputs that require
# grad, and its backward computes the tangents first, as ``_Graph`` does, then the graph's
# gradients with the mode suspended (``torch.autograd.grad``, eager's nodes and kernels, so eager's
# values); AccumulateGrad and the hooks on the inputs run in the engine as in eager. A graph whose
# output shares memory with an input, or that writes in place into memory an input requiring grad
# owns, keeps the engine's nodes (``_separable``): a detached alias would cut that history.


def _separable(gm) -> bool:
    """Whether Dynamo's graph can run behind ``_InterimBackward`` (Note [The interim backward]):
    every output a tensor sharing no memory with an input, and no in-place write into memory an
    input that requires grad owns. Decided from the example values Dynamo keeps; False without them."""
    from torch.multiprocessing.reductions import StorageWeakRef

    def storage(node):
        v = node.meta.get("example_value") if isinstance(node, torch.fx.Node) else None
        return StorageWeakRef(v.untyped_storage()) if isinstance(v, torch.Tensor) else None

    inputs, graded = set(), set()
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            ref = storage(node)
            if ref is None:
                return False
            inputs.add(ref)
            if node.meta["example_value"].requires_grad:
                graded.add(ref)
        elif node.op == "output":
            outs = node.args[0] if isinstance(node.args[0], (tuple, list)) else (node.args[0],)
            refs = [storage(o) for o in outs]
            return all(ref is not None and ref not in inputs for ref in refs)
        elif _writes_first(node) and node.args and storage(node.args[0]) in graded:
            return False
    return False


_INPLACE_OPERATORS = frozenset({operator.setitem, operator.iadd, operator.isub, operator.imul, operator.itruediv,
                                operator.ifloordiv, operator.imod, operator.ipow, operator.imatmul, operator.iand,
                                operator.ior, operator.ixor, operator.ilshift, operator.irshift})


def _writes_first(node) -> bool:
    """Whether a node of Dynamo's graph may write its first argument in place."""
    if node.op == "call_method":
        return node.target.endswith("_") and not node.target.endswith("__")
    if node.op != "call_function":
        return node.op == "call_module"
    if node.target in _INPLACE_OPERATORS or node.kwargs.get("inplace") is True:
        return True
    name = getattr(node.target, "__name__", "")
    return name.endswith("_") and not name.endswith("__")


class _InterimBackward(torch.autograd.Function):
    """Dynamo's graph run eagerly behind the boundary a captured call's backward has (Note [The
    interim backward])."""

    @staticmethod
    def forward(ctx, gm, *args):
        graded = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.requires_grad]
        inner = list(args)
        for i in graded:
            inner[i] = args[i].detach().requires_grad_()
        with torch.enable_grad():
            outs = gm.forward(*inner)
        ctx.graded, ctx.leaves, ctx.n = graded, [inner[i] for i in graded], len(args)
        ctx.live = [o.requires_grad for o in outs]
        ctx.save_for_backward(*outs)  # a second backward raises eager's error when it reads them
        result = tuple(o.detach() for o in outs)
        ctx.mark_non_differentiable(*(r for r, live in zip(result, ctx.live) if not live))
        return result

    @staticmethod
    def backward(ctx, *grads):
        outs = ctx.saved_tensors
        sync_values(reversed(grads), "module_capture")  # the window holding them is cut here, as _Graph's
        pairs = [(o, g) for o, g, live in zip(outs, grads, ctx.live) if live and g is not None]
        got = [None] * len(ctx.leaves)
        if pairs:
            with _modes_off():
                # retained: the program's own ``retain_graph`` keeps ``outs`` for a second backward;
                # ops we run, beside a compile (Note [Cores beside a compile])
                got = _cores.running(functools.partial(
                    torch.autograd.grad, [o for o, _ in pairs], ctx.leaves, [g for _, g in pairs], retain_graph=True,
                    create_graph=torch.is_grad_enabled(), allow_unused=True))
        result = [None] * (ctx.n + 1)
        for i, g in zip(ctx.graded, got):
            result[i + 1] = g
        return tuple(result)


def _job_cause(failure: str) -> str:
    """The cause of a worker's declined trace, from its failure's text (``_Decline: cause: detail``)."""
    _, found, rest = failure.partition("_Decline: ")
    return (rest.partition(":")[0].strip() or "declined") if found else "failed"


class _Graph:
    """One AOTAutograd graph (a forward, a backward or an inference graph), boxed calling
    convention: run op by op until its compiled artifact is loaded, then compiled (Note [Captured
    modules]). ``who`` (``module`` or ``optimizer``) names the metrics it counts in; a module's
    graph counts its launches, an optimizer's step is counted by ``_optim`` as one launch."""

    _boxed_call = True
    captured = True  # ours, not the program's compiled code (``_compile._graph_aside``)

    def __init__(self, gm, example_inputs, kind: str, options, who: str = "module", parts=None):
        if gm is None:  # Note [Captures from the cache]: a record's graph, whose op-by-op run is its Program's
            self._setup(kind, options, who)
            self.draws = parts["draws"]
            self.ops = parts["ops"]
            self.program, self.plan, self.n_live, self.expected, self.may_write = (
                parts["program"], parts["plan"], parts["n_live"], parts["expected"], parts["may_write"])
            self.source = self.program
            self.launching = sum(1 for op in self.program.ops if launches_op(op[0]))
            return
        draws = _masks_drawn_by_the_call(gm, options) if kind == "forward" else []
        self._setup(kind, options, who)
        self.draws = draws
        self.gm = gm
        self.ops = sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target is not operator.getitem)
        # an op-by-op run launches its ops that are no view or allocation (Note [Launches of a
        # compiled callable] in fuser.backends._common), as the device counts them
        self.launching = sum(1 for n in gm.graph.nodes if n.op == "call_function" and launches_op(n.target))
        try:
            self.program, self.plan, self.n_live, self.expected, self.may_write = _program(gm)
        except (_Decline, TypeError) as e:
            self.program = None
            self.uncompiled_graphs[getattr(e, "cause", "unencodable")] += 1
            log.info("adaptive_eager: a captured %s graph runs op by op, not compiled: %s", kind, e)
        self.source = self.program  # kept for the op-by-op run of a graph with no ``gm``

    def _setup(self, kind: str, options, who: str) -> None:
        self.gm = None
        self.kind = kind
        self.options = options
        self.who = who
        self.uncompiled_graphs = getattr(METRICS, f"{who}_uncompiled_graphs")
        self.run = None
        self.entry = None
        self.inplace = False  # the compiled run writes the inputs itself (Note [Written inputs])
        self.checked = False
        self.next_poll = 0.0
        self.joins = weakref.WeakKeyDictionary()  # window region -> joined regions (Note [Joined runs] in fuser.joined)

    def _eager(self, args):
        """The graph op by op: ``gm`` itself, or for a record's graph its Program."""
        if self.gm is not None:
            return self.gm.forward(*args)
        values = self.source.evaluate(list(args))
        return [None if how is None else (args[how[1]] if how[0] == "in" else values[how[1]]) for how in self.plan]

    def describe(self) -> dict:
        """What rebuilds this graph with no trace (Note [Captures from the cache]), as JSON."""
        return {"program": json.loads(self.source.to_bytes()), "plan": [None if h is None else list(h) for h in self.plan],
                "n_live": self.n_live, "may_write": self.may_write, "ops": self.ops,
                "expected": [[list(shape), str(dtype).removeprefix("torch.")] for shape, dtype in self.expected],
                "draws": _STATE if self.draws == [_STATE] else [
                    [list(shape), list(stride), str(dtype).removeprefix("torch."), p] for shape, stride, dtype, p in self.draws]}

    @classmethod
    def from_description(cls, doc: dict, kind: str, options, who: str):
        from fuser.program import Program

        parts = {"program": Program.from_bytes(json.dumps(doc["program"]).encode()),
                 "plan": [None if h is None else tuple(h) for h in doc["plan"]], "n_live": doc["n_live"],
                 "may_write": doc["may_write"], "ops": doc["ops"],
                 "expected": [(tuple(shape), getattr(torch, dtype)) for shape, dtype in doc["expected"]],
                 "draws": [_STATE] if doc.get("draws") == _STATE else [
                     (tuple(shape), tuple(stride), getattr(torch, dtype), p) for shape, stride, dtype, p in doc.get("draws", ())]}
        return cls(None, None, kind, options, who, parts)

    def __call__(self, *args):
        # boxed (one list) as AOTAutograd calls a forward; the backward's wrapper (Dynamo's
        # ``disable``) hides ``_boxed_call``, so it is called with the tensors as arguments
        args = args[0] if len(args) == 1 and type(args[0]) is list else list(args)
        if self.kind == "backward":
            outs = joined.finished(self, args)
            if outs is not None:  # its window ran it, before the call (``_compile._graph_aside``)
                return self._joined(args, outs)
            req = self.join_request(args)
            # the loss backward's tangents are pending: last, so looked at first (a recurrent
            # forward saves ~70 tensors, each an ``owner_of`` that finds nothing once they ran)
            if req is None:
                sync_values(reversed(args), "module_capture")
            else:
                # Note [Joined runs] in fuser.joined: the window holding them may run with this graph
                with joined.request(req):
                    sync_values(reversed(args), "module_capture")
                if req.outs is not None:
                    return self._joined(args, req.outs)
            with _modes_off():
                return self._call(args)
        if self.draws:
            # Note [Masks drawn by the call]: in the graph's order, before anything of it runs
            device = next((t.device for t in args if isinstance(t, torch.Tensor)), None)
            if self.draws == [_STATE]:  # Note [Dropout in the compiled code] in _dropout
                state, made = _dropout.current_state(device)
                if made:
                    METRICS.launches += 1  # its copy onto the device
                return self._call([*args, state])
            if device.type in HOST_DRAWN_DROPOUT:  # one copy onto the device (Note [Dropout drawn at record time])
                masks = host_dropout_masks([(shape, p) for shape, _, _, p in self.draws], device)
            else:
                masks = [_draw_mask(draw, device) for draw in self.draws]
            args = [*args, *masks]
            if self.who == "module":
                METRICS.launches += 1 if device.type in HOST_DRAWN_DROPOUT else len(self.draws)
        return self._call(args)

    def _joined(self, args, outs):
        """The call's outputs from a joined run's (Note [Joined runs] in fuser.joined)."""
        METRICS.module_compiled_runs += 1  # its launches are the flush's
        METRICS.eager_equivalent_launches += self.ops
        return [None if how is None else (args[how[1]] if how[0] == "in" else outs[how[1]]) for how in self.plan]

    def join_request(self, args):
        """A request to run this backward joined with the window its pending inputs are in (Note
        [Joined runs] in fuser.joined); None when there is no such single window or no program, or
        for a backend whose runs are not joined (``joins_runs``)."""
        if self.program is None or self.who != "module":
            return None
        from fuser.backends import get_backend

        backend = get_backend(self.options.backend, self.options.device)
        if not getattr(backend, "joins_runs", False):
            return None
        from ._threads import single_owner

        if single_owner(reversed(args)) is None:
            return None
        return joined.JoinRequest(self, args, backend)

    def _call(self, args):
        run = self.run
        if run is None and self.program is not None and time.perf_counter() >= self.next_poll:
            run = self._obtain()
        if run is None:
            return self._op_by_op(args)
        inputs = list(args)
        mutated = self.program.mutated
        # Note [Written inputs]: an unverified artifact writes copies, so that a failed first run
        # leaves the real inputs to the op-by-op run below
        copies = mutated if self.inplace and not self.checked else ()
        for slot in copies:
            inputs[slot] = inputs[slot].clone()
        try:
            outs = _cores.running(run, inputs)  # Note [Cores beside a compile]: its extern kernels
            if not self.checked:
                self._check(outs)
        except EagerWouldRaise:
            # Note [Checked indices] in fuser.backends._stablehlo_lowering: the run wrote nothing;
            # op by op, eager's kernel raises its error (the graph stays compiled)
            return self._op_by_op(args)
        except Exception as e:  # noqa: BLE001 - never the program's: the graph runs op by op from now on
            self._fail(e)
            return self._eager(args)
        for slot in copies:
            args[slot].copy_(inputs[slot])
        written = 2 * len(copies)  # a clone and a copy back each
        if not self.inplace:
            for slot, r in zip(mutated, outs[self.n_live:]):
                args[slot].copy_(r)
            written += len(mutated)
        # Note [Launches of a compiled callable] in fuser.backends._common: a split graph's pieces...
        launched = launches_of(run)
        if self.who == "module":
            METRICS.module_compiled_runs += 1
            METRICS.launches += launched + written
            METRICS.eager_equivalent_launches += self.ops
        else:
            METRICS.optimizer_compiled_runs += 1
            # the step itself is one launch (``_optim._count_launches``)
            METRICS.launches += launched - 1 + written
        return [None if how is None else (args[how[1]] if how[0] == "in" else outs[how[1]]) for how in self.plan]

    def _op_by_op(self, args):
        # each op of the graph runs on the device: as many launches (an optimizer's step is
        # counted as one by ``_optim._count_launches``)
        if self.who == "module":
            METRICS.module_uncompiled_runs += 1
            METRICS.launches += self.launching
            METRICS.eager_equivalent_launches += self.ops
        else:
            METRICS.optimizer_uncompiled_runs += 1
            METRICS.launches += self.launching - 1
        return _cores.running(self._eager, args)  # Note [Cores beside a compile]

    def _check(self, outs) -> None:
        """Note [Artifacts from disk] in fuser.compile: an artifact's first outputs are checked."""
        n = len(self.expected) + (0 if self.inplace else len(self.program.mutated))
        if len(outs) != n:
            raise RuntimeError(f"{len(outs)} outputs for {n}")
        for r, (shape, dtype) in zip(outs, self.expected):
            if tuple(r.shape) != shape or r.dtype != dtype:
                raise RuntimeError(f"output {tuple(r.shape)} {r.dtype} for {shape} {dtype}")
        self.checked = True

    def _fail(self, e: Exception) -> None:
        from fuser.compile import _Unverified

        entry, self.run, self.program = self.entry, None, None
        self.uncompiled_graphs["run_failed"] += 1
        if entry is not None and type(entry.run) is _Unverified:
            entry.run.store.discard(entry.pkey, f"its first run failed: {type(e).__name__}: {e}")
        log.warning("adaptive_eager: a captured %s graph runs op by op from now on: its compiled run failed (%s: %s)",
                    self.kind, type(e).__name__, _first_line(e))

    def _obtain(self):
        """The compiled callable once loaded, else None; starts its load or compile (Note [Tiers] in
        fuser.regions: the same steps as a region's)."""
        from fuser import table
        from fuser.backends import get_backend
        from fuser.compile import _Unverified, cache_fingerprint
        from fuser.regions import poll

        options = self.options
        backend = get_backend(options.backend, options.device)
        fingerprint = cache_fingerprint(backend)
        with table.LOCK:
            entry, first = self.entry, self.entry is None
            if first:
                entry = self.entry = table._Entry()
                entry.program = self.program
                try:
                    entry.pkey = _graph_key(self.program, self.may_write, backend, fingerprint)
                except TypeError as e:
                    self.program = None
                    self.uncompiled_graphs["unencodable"] += 1
                    log.info("adaptive_eager: a captured %s graph runs op by op, not compiled: %s", self.kind, e)
                    return None
                entry.region = entry.pkey[:8]
                entry.n_live, entry.mutated = self.n_live, self.program.mutated
            # Note [Loads in the capturing step]
            poll(entry, backend, options, load_now=first)
            if entry.blacklisted:
                self.program = None
                self.uncompiled_graphs[entry.blacklisted] += 1
                return None
            run = entry.run
            if run is None:
                self.next_poll = time.perf_counter() + _POLL_S
                return None
            self.inplace = entry.inplace  # the compile's answer, also for an artifact from disk
            self.checked = type(run) is not _Unverified
            self.run = run.run if type(run) is _Unverified else run
            return self.run


# Note [Loads in the capturing step]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A captured graph's first call is in the step that captured it (its forward, or the backward
# that step's loss runs), which Dynamo's trace already makes the longest of the process. An
# artifact that call finds in the store is loaded there and then, not on the compile thread as a
# window's is (Note [Load after the replay] in fuser.regions): loaded beside the steps, a warm
# process's optimizer graph ran op by op for three more steps and its first compiled step came
# at the sixth (rnn workload of benchmarks/user_step.py, benchmarks/RESULTS.md).
def _graph_key(program, may_write: bool, backend, fingerprint: str) -> str:
    """A captured graph's persistent key, ``program`` made ready for its compile: the same in the
    program and in a worker that compiles it after the program exited (Note [Follow-up compiles after
    exit] in neff_cache._worker). TypeError for a program with no key."""
    # Note [Written inputs]: a backend that stores after its run writes nothing in a run that fails
    program.inplace = getattr(backend, "writes_inputs", False) and (
        may_write or getattr(backend, "stores_after_run", False))
    return program.digest(fingerprint)


def follow_up_compiles(record: dict, backend_name: str, device: str) -> None:
    """In a worker, name the compiles of the graphs of a record it traced, which the program submits
    once it reads the record: the worker runs them if the program is gone by then (Note [Follow-up
    compiles after exit] in neff_cache._worker). A graph with no key is left to the program's run."""
    from fuser.artifacts import compile_payload
    from fuser.backends import get_backend
    from fuser.compile import cache_fingerprint
    from fuser.program import Program
    from neff_cache._worker import follow_up

    backend = get_backend(backend_name, device)
    fingerprint = cache_fingerprint(backend)
    for kind in ("forward", "backward"):
        doc = record.get(kind)
        if doc is None:
            continue
        program = Program.from_bytes(json.dumps(doc["program"]).encode())
        try:
            key = _graph_key(program, doc["may_write"], backend, fingerprint)
        except TypeError:
            continue
        follow_up(key, "fuser.compile:compile_job", compile_payload(key, program, backend, device),
                  backend=backend.name)


# Note [Masks drawn by the call]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A training forward with dropout (every stock transformer's) is captured with eager's random
# numbers. Dropout's draw depends on its input's shape, strides, dtype and device and on p, not on
# its values, and nothing else in a captured forward draws (any other random op declines the
# capture: ``random``). So the call draws each mask itself, before the graph runs, in the graph's
# order, with the very function eager calls (``F.dropout``, on a tensor of ones laid out as the
# input: its non-zeros are the mask), and the graph takes the masks as inputs: its
# ``native_dropout`` (kept out of Inductor's decompositions, which would draw with ``rand`` inside
# the compiled code) becomes ``input * mask * (1 / (1 - p))``, native_dropout's own formula. The
# generator advances as eager's does and the masks are eager's bit for bit, compiled or op by op
# (tests/test_module_capture.py compares the zeros of every output and the generator's next
# draws). Inductor's ``fallback_random`` would keep the draw in the graph, but as ``rand`` and a
# comparison, whose numbers are not those of eager's ``bernoulli_``. The ``inductor`` backend draws
# so (its devices' kernels are eager's). On ``neuron`` eager's kernel draws on the host (Note
# [Dropout drawn at record time] in _ops): the call draws every mask there as it does, in the
# graph's order, and moves them onto the device in one copy; the graph multiplies by the scale in
# the input's dtype, as that kernel does, and its masks are laid out as that kernel's (contiguous).
# p of 0 or 1 and empty inputs, which eager's dropout answers without a draw, decline.
_DROPOUT = torch.ops.aten.native_dropout.default


def _masks_drawn_by_the_call(gm, options) -> list:
    """Turn each ``native_dropout`` of a forward graph into a mask input (Note [Masks drawn by the
    call]); the (shape, stride, dtype, p) of each draw in order, or ``_Decline("random")``."""
    graph = gm.graph
    draws = []
    last = None
    for node in graph.nodes:
        if node.op == "placeholder":
            last = node
    # on cpu ``F.dropout`` is eager's ``bernoulli_`` fill in a window, so a captured call draws as eager too
    compiled = options.dropout == "compiled" and options.device != "cpu"
    state = None
    for node in list(graph.nodes):
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload) or \
                torch.Tag.nondeterministic_seeded not in node.target.tags:
            continue
        facts = facts_for(node.target)
        if facts.dropout_arg is not None and unseeded_facts(facts, node.args, node.kwargs) is not None:
            continue  # attention at dropout_p=0 draws nothing (Note [Dropout probability] in ``_ops``)
        host = options.device in HOST_DRAWN_DROPOUT  # drawn as torch-neuronx draws, any backend
        if node.target is not _DROPOUT or not (host or compiled or options.backend == "inductor"):
            raise _Decline("random", str(node.target))
        x, p = node.args[0], node.args[1]
        train = node.args[2] if len(node.args) > 2 else node.kwargs.get("train")
        val = x.meta.get("val") if isinstance(x, torch.fx.Node) else None
        if not isinstance(val, torch.Tensor) or train is not True or not 0 < p < 1 or val.numel() == 0:
            raise _Decline("random", f"{node.target} p={p} train={train}")
        out_val = node.meta["val"][0]
        if compiled and val.numel() >= _dropout.MAX_NUMEL:
            raise _Decline("random", f"{node.target}: a mask of {val.numel()} elements, computed in int32")
        if compiled:  # Note [Dropout in the compiled code] in _dropout: the mask from the state input
            if state is None:
                with graph.inserting_after(last):
                    state = last = graph.placeholder("dropout_state")
                with val.fake_mode:
                    state.meta["val"] = torch.empty((), dtype=torch.int32, device=val.device)
            with graph.inserting_before(node):
                mask = _dropout.keep_mask(functools.partial(_node, graph, val.fake_mode), state, tuple(val.shape),
                                          float(p), len(draws), val.device)
        else:
            with val.fake_mode:  # eager's draw is on ``empty_like(input)``: its layout, not the input's
                layout = torch.empty(val.shape, dtype=val.dtype, device=val.device) if host else torch.empty_like(val)
                mask_val = torch.empty_like(layout, dtype=torch.bool)
            with graph.inserting_after(last):
                mask = last = graph.placeholder(f"dropout_mask_{len(draws)}")
            mask.meta["val"] = mask_val
        with graph.inserting_before(node):
            kept = graph.call_function(torch.ops.aten.mul.Tensor, (x, mask))
            scale = host_dropout_scale(p, val.dtype) if host else 1.0 / (1.0 - p)
            out = graph.call_function(torch.ops.aten.mul.Tensor, (kept, scale))
        kept.meta["val"] = out.meta["val"] = out_val
        for user in list(node.users):
            if user.op == "call_function" and user.target is operator.getitem:
                user.replace_all_uses_with(out if user.args[1] == 0 else mask)
                graph.erase_node(user)
            else:
                raise _Decline("random", "native_dropout read whole")
        graph.erase_node(node)
        draws.append(None if compiled else (tuple(layout.shape), tuple(layout.stride()), val.dtype, float(p)))
    if state is not None:  # advanced by the masks drawn, in place as a BatchNorm's statistics are
        with graph.inserting_before(graph.output_node()):
            _node(graph, state.meta["val"].fake_mode, torch.ops.aten.copy_.default,
                  (state, _node(graph, state.meta["val"].fake_mode, torch.ops.aten.add.Tensor, (state, len(draws)), {})),
                  {})
        draws = [_STATE]
    if draws:
        gm.recompile()
    return draws


_STATE = "state"  # draws of a graph that computes its masks from the device's state (Note [Dropout in the compiled code])


def _node(graph, fake_mode, op, args, kwargs):
    """A node calling ``op``, inserted where ``graph`` inserts, its ``val`` from fake values."""
    node = graph.call_function(op, tuple(args), dict(kwargs))
    with fake_mode:
        node.meta["val"] = op(*torch.fx.node.map_arg(tuple(args), lambda n: n.meta["val"]),
                              **torch.fx.node.map_arg(dict(kwargs), lambda n: n.meta["val"]))
    return node


def _draw_mask(draw, device) -> torch.Tensor:
    """Eager's dropout mask for an input laid out as ``draw`` says (Note [Masks drawn by the call])."""
    shape, stride, dtype, p = draw
    with torch.no_grad():
        ones = torch.empty_strided(shape, stride, dtype=dtype, device=device).fill_(1)
        return torch.nn.functional.dropout(ones, p, True) != 0


# Note [Written inputs]
# ~~~~~~~~~~~~~~~~~~~~~
# An inference graph keeps AOTAutograd's input mutations (``keep_inference_input_mutations``): an
# optimizer step's graph ends in a ``copy_`` into each parameter, state tensor and 0-dim step
# counter it updates (``param.add_``, ``exp_avg.lerp_``, ``step += 1`` on the CPU counter), as
# Inductor's own graphs for ``torch.compile`` of a step do. ``_program`` makes those inputs the
# Program's ``mutated`` slots, and the op-by-op run (``gm`` itself) writes them directly. The
# compiled Program writes them in place as a region does (Note [In-place regions] in
# fuser.compilable: no copy per written tensor, 800 for AdamW over 200 parameters) when the
# backend can and no op can fail on data (an integer tensor read, a check op), or the backend
# stores only once its executable has finished (``stores_after_run``: stablehlo, neuron; a
# BatchNorm forward's running statistics and its ``num_batches_tracked``); else it returns their
# values and they are copied back. An artifact's first run in place (unverified: from disk)
# writes clones, copied back once its outputs passed the check, so that a failed run leaves the
# inputs to the op-by-op run, which must not apply the update twice.
_INT_DTYPES = frozenset({torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.bool})


def _program(gm):
    """The ATen graph as a fuser ``Program`` (ops on ``_In``/``_Ref`` arguments, input metadata,
    live outputs, the inputs it writes), and how the graph's outputs are made of the program's:
    per output (``"out"``, live index), (``"in"``, input slot) or None; the live count; the live
    outputs' (shape, dtype); whether no op can fail on data (Note [Written inputs])."""
    from fuser.partition import is_check
    from fuser.program import Program, _In, _Ref
    from fuser.window import FRESH

    slots: dict = {}
    refs: dict = {}
    inputs = []
    ops = []
    uid = 0
    mutated = set()
    may_write = True

    def enc(a):
        if isinstance(a, torch.fx.Node):
            if a in slots:
                return _In(slots[a])
            return refs[a]
        if isinstance(a, (list, tuple)):
            return [enc(x) for x in a]
        if isinstance(a, dict):
            raise _Decline("unencodable", "a dict argument")
        return a

    output = None
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            val = node.meta.get("val")
            if not isinstance(val, torch.Tensor):
                raise _Decline("non_tensor_input", repr(val))
            slots[node] = len(inputs)
            inputs.append((tuple(val.shape), tuple(val.stride()), val.dtype, str(val.device)))
        elif node.op == "call_function":
            if node.target is operator.getitem:
                continue  # its value is an output of the op it reads (below)
            if not isinstance(node.target, torch._ops.OpOverload):
                raise _Decline("non_aten_op", str(node.target))
            val = node.meta.get("val")
            if isinstance(val, (tuple, list)):
                outs = [None] * len(val)
                for user in node.users:
                    if user.target is operator.getitem:
                        outs[user.args[1]] = (FRESH, uid, None)
                        refs[user] = _Ref(uid)
                        uid += 1
            else:
                outs = [(FRESH, uid, None)]
                refs[node] = _Ref(uid)
                uid += 1
            if node.target is torch.ops.aten.copy_.default and node.args[0] in slots:
                mutated.add(slots[node.args[0]])
            if may_write and (is_check(node.target) or any(
                    isinstance(x, torch.fx.Node) and isinstance(x.meta.get("val"), torch.Tensor)
                    and x.meta["val"].dtype in _INT_DTYPES for x in node.all_input_nodes)):
                may_write = False
            ops.append((node.target, enc(list(node.args)), {k: enc(v) for k, v in node.kwargs.items()}, outs))
        elif node.op == "output":
            output = node.args[0]
        else:
            raise _Decline("non_aten_op", node.op)
    live, plan, expected, index = [], [], [], {}
    for r in output:
        if r is None:
            plan.append(None)
        elif isinstance(r, torch.fx.Node) and r in slots:
            plan.append(("in", slots[r]))
        elif isinstance(r, torch.fx.Node) and r in refs:
            val = r.meta.get("val")
            if not isinstance(val, torch.Tensor):
                raise _Decline("non_tensor_output", repr(val))
            if r not in index:
                index[r] = len(live)
                live.append(refs[r].uid)
                expected.append((tuple(val.shape), val.dtype))
            plan.append(("out", index[r]))
        else:
            raise _Decline("non_tensor_output", repr(r))
    program = Program(ops, inputs, live, tuple(sorted(mutated)))
    return program, plan, len(live), expected, may_write


# Note [Captures from the cache]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# AOTAutograd's trace of a captured graph (functionalization, the joint graph, its partition) is
# half of a capturing step or more, and it is the same in every process: what it reads is Dynamo's
# graph, its inputs' metadata, the ambient state and a few configs; what it makes for us is one
# Program per graph and a runtime wrapper. So a capture of the common kind keeps a record in
# neff_cache: JSON (Programs in their one encoding, DESIGN.md "Persistent cache": nothing
# unpickled) under a key of all AOTAutograd reads (``_record_key``: each node's op, target by its
# importable name and arguments; each input's and each graph attribute's type, shape, stride,
# offset, dtype, device and ``requires_grad``; Dynamo's global state less the thread count; the
# functorch config; the backend's fingerprint, which holds our library's digest). A later process
# whose Dynamo graph has that key builds the callable from the record, with no AOTAutograd trace
# (``capture_records["<who>_hit"]``). Dynamo still traces and guards in every process: the guards
# decide as before which entry runs; the record only stands for what AOTAutograd would make of a
# graph the guards already admitted.
# The common kind is the one whose runtime wrapper is small enough to be ours (``_write_record``
# checks AOTAutograd's own metadata of the trace):
# - training (a backward graph): inputs written only inside the forward graph and only those that
#   do not require grad (BatchNorm's running statistics and ``num_batches_tracked``: Note [Written
#   inputs in a record]), every output fresh (no alias of an input or of another output), no
#   effect token, no functionalized RNG, no grad mode left changed, plain tensors, static shapes. The
#   callable is ``_Recorded``, an autograd.Function whose forward runs the forward graph and saves
#   what the backward graph reads, as AOTAutograd's CompiledFunction does; outputs that do not
#   require grad are non-differentiable; its backward takes the tangents of the outputs that do,
#   made contiguous as they were traced (the record keeps only graphs traced with contiguous
#   tangents), and cannot be differentiated again (``once_differentiable``: AOTAutograd refuses
#   double backward too);
# - inference (an optimizer step, a forward under no_grad): inputs written only inside the graph
#   (``keep_inference_input_mutations``' trailing copy_), fresh outputs; the callable runs the graph
#   on the graph's attributes (the optimizer's parameters and state, as ``aot_module_simplified``
#   prepends them) and the inputs.
# Anything else traces as before and keeps no record, counted (``<who>_unkeyed:<cause>``: a
# submodule call, an unimportable target, inputs sharing memory; ``<who>_declined:<cause>``: what
# AOTAutograd's metadata shows: ``written_input_metadata`` (``t_()``, ``set_``, a resize),
# ``written_input_requires_grad`` (a training graph writing an input that requires grad),
# ``written_input_out_of_graph`` (any other write left to AOTAutograd's wrapper),
# ``aliased_output``, ``wrapper`` (tokens, functionalized RNG, intermediate bases, grad mode).
#
# Note [Written inputs in a record]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# With ``keep_inference_input_mutations`` AOTAutograd keeps in the graph every data-only write of
# an input that does not require grad or is written under no_grad, in training graphs too
# (``_check_if_mutation_can_be_in_graph``): BatchNorm's forward ends in ``copy_`` into
# ``running_mean``, ``running_var`` and ``num_batches_tracked``, which the forward ``_Graph``
# applies as an optimizer step's (Note [Written inputs]). Its wrapper returns nothing for them and
# copies nothing back; what it adds is a version bump of each input so written that autograd sees
# (``mutated_graph_handled_indices_seen_by_autograd``), before the graph runs: eager's in-place ops
# bump them, and a compiled run writes memory, not through ops. The record keeps those indices
# (``bumped``) and the rebuilt callable bumps the same inputs at the same point. A write the graph
# does not make (a metadata write, or a data write of an input that requires grad under grad) is
# the wrapper's (``copy_``/``as_strided_`` after the call): declined, not recorded. The forward
# Program's written slots must be AOTAutograd's in-graph ones (else ``written_input_plan``).
# A record's graph runs op by op (its Program, ``_Graph._eager``) until its artifact is loaded.
_RECORD_FORMAT = 4


def _record_key(gm, example_inputs, options, who: str) -> str:
    """The record's key (Note [Captures from the cache]); ``_Decline`` for a graph it cannot name."""
    return _key_of(_record_doc(gm, example_inputs, options, who))


def _key_of(doc: bytes) -> str:
    import xxhash

    return xxhash.xxh3_128_hexdigest(doc)


def _record_doc(gm, example_inputs, options, who: str) -> bytes:
    """All that AOTAutograd reads of the graph, as JSON (Note [Captures from the cache]): what the
    record's key hashes, and what a worker rebuilds the graph from (Note [Traces off the step]);
    ``_Decline`` for a graph it cannot name."""
    from torch._C._dynamo.guards import GlobalStateGuard

    from fuser.backends import get_backend
    from fuser.backends._common import encode_value
    from fuser.compile import cache_fingerprint

    def leaf(x):
        if isinstance(x, torch.fx.Node):
            return {"$node": x.name}
        if x is Ellipsis:  # ``x[..., :n]``: Llama's rotary embedding
            return {"$ellipsis": None}
        if type(x) is slice:
            return {"$slice": [encode_value(v, leaf) for v in (x.start, x.stop, x.step)]}
        return None

    attrs = dict(gm.named_parameters(remove_duplicate=False))
    attrs.update(gm.named_buffers(remove_duplicate=False))
    nodes = []
    for node in gm.graph.nodes:
        if node.op == "call_function":
            target = _importable_name(node.target)
        elif node.op in ("placeholder", "output", "call_method"):
            target = node.target
        elif node.op == "get_attr" and node.target in attrs:
            target = node.target
        else:
            raise _Decline(node.op, str(node.target))
        try:
            nodes.append([node.op, node.name, target, encode_value(list(node.args), leaf),
                          encode_value(dict(node.kwargs), leaf)])
        except TypeError as e:
            raise _Decline("argument", str(e)) from None
    tensors, storages = [], set()
    for t in [*attrs.values(), *example_inputs]:
        if type(t) not in (torch.Tensor, torch.nn.Parameter) or t.is_sparse or t.is_inference():
            raise _Decline("input", type(t).__name__)
        storage = t.untyped_storage().data_ptr()
        if storage and storage in storages:
            raise _Decline("aliased_inputs")
        storages.add(storage)
        tensors.append([type(t).__name__, list(t.shape), list(t.stride()), t.storage_offset(),
                        str(t.dtype), str(t.device), t.requires_grad])
    state = json.loads(GlobalStateGuard().__getstate__())
    state.pop("num_threads", None)  # not read by a trace
    functorch = {k: v for k, v in sorted(torch._functorch.config.get_config_copy().items())
                 if v is None or type(v) in (bool, int, float, str)}
    fingerprint = cache_fingerprint(get_backend(options.backend, options.device))
    doc = [_RECORD_FORMAT, "capture", who, options.backend, fingerprint, list(attrs), tensors, nodes, state,
           functorch, bool(torch._inductor.config.fallback_random), options.dropout]
    return json.dumps(doc, sort_keys=True).encode()


_NAMES: dict = {}


def _importable_name(target) -> str:
    """A call's target by a name that imports back to it, or ``_Decline``."""
    if isinstance(target, torch._ops.OpOverload):
        return f"torch.ops.{target}"
    try:
        return _NAMES[target]
    except (KeyError, TypeError):
        pass
    from torch.fx.node import _get_qualified_name

    try:
        name = _get_qualified_name(target)
    except Exception:  # noqa: BLE001 - FX names what it can; anything else has no name here
        raise _Decline("target", repr(target)) from None
    if _by_name(name) is target:
        try:
            _NAMES[target] = name
        except TypeError:
            pass
        return name
    raise _Decline("target", name)


def _by_name(name: str):
    """What a dotted name imports to (the longest importable module, then attributes), or None;
    ``_importable_name``'s check and the trace worker's way back to a target."""
    parts = name.split(".")
    for i in range(len(parts) - 1, 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr, None)
        return obj
    return None


def _write_record(key: str, graphs: dict, meta, options, who: str) -> None:
    """Keep what AOTAutograd made of the graph, if it is of the common kind (Note [Captures from the cache])."""
    from fuser.artifacts import _store
    from fuser.backends import get_backend
    from fuser.compile import cache_fingerprint

    try:
        record = _record_of(graphs, meta)
    except _Decline as e:
        METRICS.capture_records[f"{who}_declined:{e.cause}"] += 1
        return
    store = _store(options)
    fingerprint = cache_fingerprint(get_backend(options.backend, options.device))
    try:
        # not a compiled artifact: tagged as the op-metadata tables are (``backend="meta"``), so
        # that the cache's listings tell records from what a compiler made
        store.put(key, json.dumps(record).encode(), fingerprint=fingerprint, backend=_RECORD_BACKEND,
                  compile_seconds=0.0)
    except Exception as e:  # noqa: BLE001 - the store logs its own failures; the capture goes on
        log.info("adaptive_eager: a capture's record was not kept: %s", e)
        METRICS.capture_records[f"{who}_declined:store"] += 1
        return
    METRICS.capture_records[f"{who}_written"] += 1


_RECORD_BACKEND = "capture_record"


# Note [Training captured at once]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Dynamo's trace is the one step cost a capture cannot move off the step (Note [Traces off the
# step]): on a 2-core machine 0.5-1.9 s for a module, 1-4 s for an optimizer step, with the first
# imports of Dynamo and Inductor (about 2 s) in the first one. Made at the ``hot_after + 1``-th
# call, it was the third step of every training loop, cold or warm (benchmarks/RESULTS.md), when
# every other step after the first ran within a few times eager's. Waiting keeps a module called
# once (a notebook's cell, an evaluation) from paying for a trace; a call that trains is not such
# a call: a module called with grad mode on and a parameter or an input that requires grad is
# captured at its first call, and an optimizer at its first step (Dynamo makes the optimizer's
# state while it traces, ``OptimizerVariable`` running ``_init_group``, and the graph is the one
# a later step's trace makes), so both traces land in the first step, which also pays for the
# imports. Other calls (``no_grad``, ``inference_mode``, frozen modules) wait ``hot_after`` calls.
# Only Inductor on cpu (``at_once``): on cuda, Dynamo makes a first step's optimizer state
# ``capturable`` (``OptimizerVariable._set_capturable``: ``step`` on the device), so that graph
# is not the one a later step's trace makes; on the emulated neuron device the first step's graph
# differed too, and a one-off training call would queue a NEFF compile of minutes. When a call is
# captured changes nothing of what runs: Dynamo's guards and the record's key decide.
def at_once(options) -> bool:
    """Whether a training call is captured at its first call (Note [Training captured at once])."""
    return options.backend == "inductor" and options.device == "cpu"


def _record_of(graphs: dict, meta) -> dict:
    """The record of AOTAutograd's trace (``meta``: its metadata), if it is of the common kind (Note
    [Captures from the cache]); else ``_Decline`` with the cause."""
    from torch._functorch._aot_autograd.schemas import MutationType, OutputType

    forward, backward = graphs.get("forward"), graphs.get("backward")
    if meta is None or forward is None or (backward is None) != (len(graphs) == 1):
        raise _Decline("graphs")
    if any(g.source is None for g in graphs.values()):
        raise _Decline("uncompiled")
    if meta.tokens or meta.is_rng_op_functionalized or meta.num_intermediate_bases or \
            meta.grad_enabled_mutation is not None:
        raise _Decline("wrapper")
    for info in meta.input_info:
        if info.mutates_metadata or info.mutates_storage_metadata or info.mutation_inductor_storage_resize:
            raise _Decline("written_input_metadata")
        if info.mutates_data and info.requires_grad and backward is not None:
            raise _Decline("written_input_requires_grad")
        if info.mutation_type == MutationType.MUTATED_OUT_GRAPH:
            raise _Decline("written_input_out_of_graph")
    if any(o.output_type != OutputType.non_alias for o in meta.output_info):
        raise _Decline("aliased_output")
    # Note [Written inputs in a record]: the graph writes them (trailing copy_); the record keeps
    # which ones the wrapper's version bump covers
    if sorted(forward.source.mutated) != list(meta.mutated_graph_handled_indices):
        raise _Decline("written_input_plan")
    n_out = len(meta.output_info)
    record = {"format": _RECORD_FORMAT, "outputs": n_out,
              "bumped": list(meta.mutated_graph_handled_indices_seen_by_autograd)}
    if backward is not None:
        requires_grad = [bool(o.requires_grad) for o in meta.output_info]
        saved = len(forward.plan) - n_out
        program = backward.source
        tangents = program.inputs[saved:]
        if saved < 0 or len(tangents) != sum(requires_grad):
            raise _Decline("tangents")
        for shape, stride, _, _ in tangents:
            if tuple(stride) != make_contiguous_strides_for(shape):
                raise _Decline("tangents")
        record.update(requires_grad=requires_grad, saved=saved, backward=backward.describe())
        _share_saved(forward, backward, n_out)
    elif len(forward.plan) != n_out:
        raise _Decline("outputs")
    record["forward"] = forward.describe()
    return record


def _share_saved(forward: _Graph, backward: _Graph, n_out: int) -> None:
    """Let the forward's outputs that only the backward reads share a buffer where the compiled code
    returns one for several (Note [Repeated outputs] in fuser.backends.inductor): before the
    forward's first compile, and so in its record."""
    program = forward.source
    if backward.source.mutated or forward.entry is not None:
        return  # a backward that writes a saved tensor; or a compile already keyed without it
    user = {how[1] for how in forward.plan[:n_out] if how is not None and how[0] == "out"}
    program.shared = tuple(k for k in range(forward.n_live) if k not in user)


def _from_record(key: str, gm, options, who: str):
    """The captured callable rebuilt from its record, or None (Note [Captures from the cache])."""
    from fuser.artifacts import _store
    from fuser.backends import get_backend
    from fuser.compile import cache_fingerprint

    fingerprint = cache_fingerprint(get_backend(options.backend, options.device))
    data = _store(options).get(key, fingerprint=fingerprint)
    if data is None:
        return None
    try:
        record = json.loads(data)
        if record.get("format") != _RECORD_FORMAT:
            raise ValueError(f"record format {record.get('format')}")
        forward = _Graph.from_description(record["forward"], "forward", options, who)
        bumped = [int(i) for i in record["bumped"]]
        backward = None
        if "backward" in record:
            backward = _Graph.from_description(record["backward"], "backward", options, who)
    except Exception as e:  # noqa: BLE001 - a record that does not decode is traced again, and replaced
        METRICS.capture_records[f"{who}_unreadable"] += 1
        log.info("adaptive_eager: a capture's record does not decode (%s); it is traced again", e)
        return None
    METRICS.capture_records[f"{who}_hit"] += 1
    from fuser.artifacts import stop_warm_up

    stop_warm_up()  # Note [Warm workers] in neff_cache.jobs: this program ran before on this cache
    attrs = dict(gm.named_parameters(remove_duplicate=False))
    attrs.update(gm.named_buffers(remove_duplicate=False))
    attrs = list(attrs.values())
    if backward is None:
        def run(*args):
            inputs = [*attrs, *args]
            if bumped:  # Note [Written inputs in a record]
                torch.autograd.graph.increment_version([inputs[i] for i in bumped])
            return forward(inputs)
    else:
        recorded = _RecordedGraphs(forward, backward, record["outputs"], record["requires_grad"])

        def run(*args):
            inputs = [*attrs, *args]
            if bumped:  # Note [Written inputs in a record]
                torch.autograd.graph.increment_version([inputs[i] for i in bumped])
            return list(_Recorded.apply(recorded, *inputs))
    return run


class _RecordedGraphs:
    __slots__ = ("forward", "backward", "n_out", "requires_grad")

    def __init__(self, forward, backward, n_out: int, requires_grad: list):
        self.forward, self.backward, self.n_out, self.requires_grad = forward, backward, n_out, requires_grad


class _Recorded(torch.autograd.Function):
    """A training capture from its record (Note [Captures from the cache]): AOTAutograd's
    CompiledFunction for graphs of the common kind."""

    @staticmethod
    def forward(ctx, graphs, *args):
        outs = graphs.forward(list(args))
        user = outs[:graphs.n_out]
        ctx.save_for_backward(*outs[graphs.n_out:])
        ctx.graphs = graphs
        ctx.mark_non_differentiable(*(o for o, grad in zip(user, graphs.requires_grad) if not grad))
        return tuple(user)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grads):
        graphs = ctx.graphs
        tangents = [_traced_strides(g) for g, grad in zip(grads, graphs.requires_grad) if grad]
        return (None, *graphs.backward([*ctx.saved_tensors, *tangents]))


@functools.lru_cache(maxsize=256)
def _contiguous(shape: torch.Size) -> tuple:
    """A tangent's contiguous strides, checked at every backward."""
    return tuple(make_contiguous_strides_for(shape))


def _traced_strides(g: torch.Tensor) -> torch.Tensor:
    """A tangent in the contiguous strides it was traced with, made as AOTAutograd's runtime makes it
    (``coerce_to_expected_memory_format``: ``empty_strided`` and ``copy_``, not ``contiguous()``): the
    window recorded before the backward then has the structure a process that traced recorded, and
    runs the region the cache holds for it (``contiguous()`` made a new one, compiled again)."""
    strides = _contiguous(g.shape)
    if g.stride() == strides:
        return g
    out = torch.empty_strided(g.shape, strides, dtype=g.dtype, device=g.device, layout=g.layout)
    out.copy_(g)
    return out


def misses() -> Counter:
    return METRICS.module_capture_misses

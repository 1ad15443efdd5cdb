"""A program's own ``torch.compile`` inside adaptive eager (Note [User torch.compile])."""

from __future__ import annotations

import sys
import threading

import torch

from fuser import joined

from ._flush import flush
from ._metrics import METRICS
from ._state import current_state

_len_dispatch_stack = torch._C._len_torch_dispatch_stack
_dispatch_stack_at = torch._C._get_dispatch_stack_at
_pop_dispatch_stack = torch._C._pop_torch_dispatch_stack
_push_dispatch_stack = torch._C._push_on_torch_dispatch_stack

# Note [User torch.compile]
# ~~~~~~~~~~~~~~~~~~~~~~~~~
# Code the program compiled with ``torch.compile`` runs inside ``adaptive_eager()`` as it runs
# without it: Dynamo traces and guards what it would, its backend compiles what it would, once, and
# the compiled code reads computed memory. What Dynamo does with a dispatch mode on the stack:
# - a mode that does not declare ``ignore_compile_internals()`` makes Dynamo skip the frame it was
#   about to trace (``CatchErrorsWrapper``, ``any_torch_dispatch_mode_on_stack``) and run it under
#   the mode, with its callback still set for the frames that frame calls. Our mode's own frames run
#   with the mode popped by the dispatcher, so Dynamo traced them (``_should_skip_dynamo`` is False:
#   the ``_disable_dynamo`` wrapper would cost ~2 us an op): guards on the open window (the crash
#   in TENSOR_MATCH), a recompile per op signature, the recompile limit.
# - a mode that declares it is popped while Dynamo compiles and is on the stack while the compiled
#   code runs. That does not fit a lazy mode: Inductor's kernels would read pending placeholders,
#   and the guards fail on every call (TENSOR_MATCH compares the dispatch keys the thread adds, and
#   a mode on the stack adds the Python key the compile did not see): a recompile per call, seen.
# So our mode steps aside for the whole call of a compiled callable, and Dynamo never sees it:
# - the call is ``compile_wrapper`` (what ``torch.compile`` returns for a function; an
#   ``OptimizedModule``'s forward, ``Module.compile()``, a compiled optimizer step are one too). It
#   enters its context's ``enter_exit_hooks`` before it sets Dynamo's callback and calls the
#   function, and runs what they returned after the call (``dynamic=`` is one such hook). Ours
#   (``step_aside``) flushes this thread's window, reason ``torch_compile``: the call may read any
#   tensor, parameters and closures as well as its arguments. Then it takes our mode off the
#   dispatch stack wherever it is (a program's own modes stay, in their order, and Dynamo decides
#   about them as it would without us). Dynamo's tracing, its guards, the compiled code and what the
#   call runs eagerly (graph breaks, skipped frames) all run as under plain ``torch.compile``; what
#   it returns is an ordinary tensor; compiles and recompiles are Dynamo's own.
# - compiled callables made before the mode was turned on hold their context already, so the hook
#   is added to every context by a property on ``_TorchDynamoContext`` (one check per call; not to
#   ``DisableContext``: ``torch.compiler.disable`` runs eagerly, and eager ops are ours to record).
#   Once Dynamo is loaded (``torch.compile`` loads it, ``watch_compile``) it stays for the process:
#   with the mode off it returns at once.
# - putting the mode back: ``compile_wrapper`` runs the call inside ``_ForceDispatchKeyGuard``,
#   which restores the thread's dispatch keys of the moment our hook had run, i.e. without the
#   Python key when our mode was the only one; a mode pushed back inside it would stay on the stack
#   and never be called. So the hook's cleanup only marks the call over, and the mode goes back in
#   ``eval_frame._maybe_set_eval_frame``, which ``compile_wrapper`` calls last, after that guard.
# - the backward of a compiled graph runs in ``loss.backward()``, under our mode, on pending
#   tangents. AOTAutograd runs every compiled graph through ``runtime_wrappers.
#   call_func_at_runtime_with_args`` (looked up there at each call), which steps aside the same way
#   where our mode is on the stack (``_graph_aside``: flush, off the stack, back after). Backends
#   without AOTAutograd (``eager``) make a backward of eager ops, recorded as any other.
# - Dynamo never traces our Python: our modules a compiled call can reach are skipped files
#   (``trace_rules.add``), so ``print`` and ``breakpoint()`` (``_patches``) break the graph as the
#   builtins they wrap do. The optimizer's step wrapper (``_optim``) is traced instead, and tests
#   ``torch.compiler.is_compiling()`` first, so Dynamo sees the step as it would without us.
# - who wins where both compile: the program. Our optimizer capture (Note [Optimizer capture] in
#   ``_optim``) steps aside when the step runs inside a compiled call (traced by Dynamo, or run
#   eagerly by it with our mode aside): one compile of the step, theirs. A compiled module's
#   forward and backward are its graphs; the ops around them (the loss, gradient accumulation) and
#   an optimizer step the program did not compile are ours, as in any eager program.
# Counted: ``flushes["torch_compile"]`` (where the window had ops) and ``compiled_calls`` (calls of
# compiled code that stepped aside: each compiled call, each compiled backward graph). The backward
# of our own captured module (Note [Captured modules] in ``_capture``) steps aside the same way but
# is counted as the capture's (``flushes["module_capture"]``), not as the program's compiled code.


def _nothing() -> None:
    pass


class _Aside:
    """Our mode taken off this thread's dispatch stack, with the modes that were above it."""

    __slots__ = ("mode", "above", "over")

    def __init__(self, mode, above):
        self.mode = mode
        self.above = above
        self.over = False  # the compiled call returned: put back at ``_maybe_set_eval_frame``

    def __call__(self) -> None:  # the cleanup ``compile_wrapper`` runs after the call
        self.over = True

    def put_back(self) -> None:
        for _ in self.above:
            _pop_dispatch_stack(None)
        _push_dispatch_stack(self.mode)
        for m in reversed(self.above):
            _push_dispatch_stack(m)


def _take_off(st, reason: str = "torch_compile"):
    """Flush ``st``'s window (counted under ``reason``) and take its mode off the dispatch stack,
    wherever it is in it; None where it is not on it (a flush, the optimizer capture, a compiled
    call inside a compiled call)."""
    mode = st.mode
    n = _len_dispatch_stack()
    for i in range(n - 1, -1, -1):
        if _dispatch_stack_at(i) is mode:
            break
    else:
        return None
    if st.window.nodes:
        flush(st, reason)
    if reason == "torch_compile":
        METRICS.compiled_calls += 1
    above = [_pop_dispatch_stack(None) for _ in range(n - 1 - i)]
    _pop_dispatch_stack(None)
    for m in reversed(above):
        _push_dispatch_stack(m)
    return _Aside(mode, above)


def step_aside():
    """``compile_wrapper``'s enter hook (Note [User torch.compile]); what it returns marks the call over."""
    st = current_state()
    if st is None or st.mode is None or st.aside is not None:
        return _nothing
    aside = _take_off(st)
    if aside is None:
        return _nothing
    st.theirs = True  # Note [The mode parked between captured calls] in _state
    st.aside = aside
    return aside


def _back_after_call(original):
    """``eval_frame._maybe_set_eval_frame``, which ``compile_wrapper`` calls last, after its
    dispatch key guard: where our mode goes back (Note [User torch.compile])."""

    def _maybe_set_eval_frame(callback):
        prior = original(callback)
        st = current_state()
        if st is not None:
            aside = st.aside
            if aside is not None and aside.over:
                st.aside = None
                aside.put_back()
        return prior

    _maybe_set_eval_frame.__wrapped__ = original
    return _maybe_set_eval_frame


def _graph_aside(original):
    """``runtime_wrappers.call_func_at_runtime_with_args``: a compiled graph AOTAutograd runs
    outside a compiled call (a backward in ``loss.backward()``) runs with our mode aside."""

    def call_func_at_runtime_with_args(*args, **kwargs):
        st = current_state()
        if st is None or st.mode is None:
            return original(*args, **kwargs)
        # a captured module's backward (Note [Captured modules]: a ``_Graph`` in Dynamo's
        # ``disable`` wrapper) is ours, not the program's compiled code: counted as the capture's
        graph = getattr(args[0], "__wrapped__", args[0]) if args else None
        req = (graph.join_request(args[1]) if getattr(graph, "captured", False) and getattr(graph, "kind", None) == "backward"
               and len(args) > 1 else None)
        if req is None:
            aside = _take_off(st, "module_capture" if getattr(graph, "captured", False) else "torch_compile")
        else:
            # Note [Joined runs] in fuser.joined: the window holding its tangents may run with it
            with joined.request(req):
                aside = _take_off(st, "module_capture")
            if req.outs is not None:
                joined.done(req)
        if aside is None:  # off, or aside already (the forward of a compiled call)
            return original(*args, **kwargs)
        try:
            return original(*args, **kwargs)
        finally:
            aside.put_back()

    call_func_at_runtime_with_args.__wrapped__ = original
    return call_func_at_runtime_with_args


def _with_step_aside(disable_context):
    def get(ctx):
        hooks = ctx.__dict__["enter_exit_hooks"]
        if (not hooks or hooks[0] is not step_aside) and not isinstance(ctx, disable_context):
            hooks.insert(0, step_aside)  # first: a flush that raises leaves no other hook entered
        return hooks

    def set_(ctx, hooks) -> None:
        ctx.__dict__["enter_exit_hooks"] = hooks

    return property(get, set_)


_installed = [False]
_lock = threading.Lock()


def install() -> None:
    """Hook Dynamo and AOTAutograd if Dynamo is loaded; once a process (Note [User torch.compile])."""
    if _installed[0] or "torch._dynamo.eval_frame" not in sys.modules:
        return
    with _lock:
        if _installed[0]:
            return
        from torch._dynamo import eval_frame, trace_rules
        from torch._functorch._aot_autograd import runtime_wrappers

        # by name: this module sits below the mode (tests/test_layers.py)
        for module in ("_mode", "_patches", "_flush", "_threads", "_compile"):
            trace_rules.add(f"{__package__}.{module}")
        eval_frame._TorchDynamoContext.enter_exit_hooks = _with_step_aside(eval_frame.DisableContext)
        eval_frame._maybe_set_eval_frame = _back_after_call(eval_frame._maybe_set_eval_frame)
        runtime_wrappers.call_func_at_runtime_with_args = _graph_aside(runtime_wrappers.call_func_at_runtime_with_args)
        _installed[0] = True


def watch_compile(original):
    """``torch.compile`` while the mode is installed: the call loads Dynamo, which is hooked then."""

    def compile(*args, **kwargs):
        compiled = original(*args, **kwargs)
        install()
        return compiled

    compile.__wrapped__ = original
    compile.__doc__ = original.__doc__
    return compile

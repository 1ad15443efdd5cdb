"""A hot ``optimizer.step()`` runs as one guarded call (Note [Optimizer capture]).

While adaptive eager is on, the ``step`` of the optimizers in ``_CAPTURED`` is the function below:
cold, it runs the step as before (every op recorded); once the optimizer has taken ``hot_after``
steps, the step is handed to TorchDynamo (``fullgraph``, the backend the options name) and later
steps run as a single call of what it built, with the dispatch mode suspended. Its backend is the
captured modules' (``_capture._Backend``): the step's ATen graph becomes a fuser Program compiled
in a worker process and kept in ``neff_cache``, and runs op by op until that artifact is loaded
(Note [Capture compiles off the step]). The step
pre/post hooks, the LR scheduler's wrapper and ``_optimizer_step_code`` stay outside that call,
in ``Optimizer.profile_hook_step``, and run eagerly every step.
"""

from __future__ import annotations

import functools
import time
import types
import warnings
import weakref

import torch
from torch.optim import optimizer as _torch_optimizer
from torch.utils._python_dispatch import _disable_current_modes

from ._capture import (
    _NESTED_TRACE, _RECOMPILE, _Decline, _fail_on_recompile, _spare_dynamo, at_once, capturable_backend,
    first_failed_guard, swap_stance, traced_elsewhere,
)
from ._flush import _modes_off, flush
from ._log import log
from ._metrics import METRICS
from ._state import current_state, park, pending_hot_ops, trace_alone, trace_done, unpark

# Note [Optimizer capture]
# ~~~~~~~~~~~~~~~~~~~~~~~~
# Per-op interception cannot make an optimizer step fast: AdamW foreach=False over 200 params is
# ~2600 ATen ops, and an empty TorchDispatchMode alone makes that step 2.75x eager's. The step's
# Python has to be skipped. Two ways were weighed:
# - replaying the window our recorder captured, with guards and scalars of our own: the step's
#   Python reads the param list, each grad, the state, every group value, hooks and global flags,
#   and its floats (lr, ``1 - beta1 ** step`` from ``step.item()``) are computed in Python from
#   them; replaying means re-deriving each lifted scalar from the group values and the step
#   counters, i.e. re-implementing every optimizer's arithmetic by hand, and a guard set that
#   misses one read gives a wrong value;
# - TorchDynamo: it traces the same Python and guards exactly what that Python read (params and
#   state as static tensors, grads' presence and metadata, group values, global flags such as grad
#   mode), and its optimizer support traces the step counters as tensors (``_get_value`` keeps the
#   tensor while compiling), so the bias corrections are graph computations, and a group float
#   that changes becomes a graph input (below).
# Dynamo is sound by construction and needs no per-optimizer code, so it is the mechanism; the
# replay prototype was not built. Its backend is the one every capture uses (``_capture._Backend``,
# Note [Captured modules]): the step's functional ATen graph (an AOTAutograd inference graph
# that writes its inputs, Note [Written inputs] in ``_capture``) becomes a fuser Program, compiled
# in a worker process and kept in ``neff_cache`` like a region (Note [Capture compiles off the step]).
#
# What holds it together:
# - the grads are placeholders of the backward window: the open window is flushed first (the
#   flush Note [Step alignment] asks for at the end of the step, made at its start), then the
#   captured call runs with our mode suspended, on real tensors;
# - ``fullgraph=True``: the step is one frame whose guards are checked before anything runs, so a
#   miss (``fail_on_recompile``, a stance that holds only during the call) leaves nothing half
#   done. That step then runs recorded, as when cold, is counted by cause, and the next one is
#   captured again (a new entry of the same frame; ``_MAX_CAPTURES`` per optimizer, then it stays
#   recorded, counted);
# - one code object per optimizer (``_fresh``): Dynamo's recompile limit counts entries per code
#   object, and every optimizer of the process would otherwise share one;
# - a group float is specialized at the first capture (Dynamo's ``assume_static_by_default``);
#   when it changes (a scheduled lr) that step misses, and the recapture makes it a graph input
#   (automatic dynamic: a 0-dim float64 tensor input of the graph, so of the Program): one
#   recapture per float that changes, never one per value. Dynamo keeps that knowledge per
#   function, so a later optimizer may have it from its first capture; where Dynamo specializes
#   it again instead, the step stays recorded (Note [Specialized floats]);
# - Python-visible effects are Dynamo's to replay: ``state[p]["step"]`` stays a tensor and is
#   incremented in place (a written input of the graph); params and state tensors are marked
#   static (``mark_static_address``, as ``torch.compile`` of an optimizer does).

# Note [Capture compiles off the step]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# No compiler runs in the step that captures: the Program of the step's graph is compiled in a
# region worker process (Note [Background compiles] in fuser.artifacts), or loaded from
# ``neff_cache`` with no compiler at all in a later process, and until it is loaded the graph runs
# op by op with the mode suspended (``_capture._Graph``), at eager's speed less the step's Python.
# Compiling in this process was the earlier design and is gone: Inductor inside the step stalled
# it (169-174 s on a cold machine, 6-20 s warm, and again in every process: Inductor's artifacts
# lived outside our cache; on a machine without a C++ compiler it failed), and compiling it on a
# thread of this process is unsafe (the PT2 stack is not thread-safe: pytorch/pytorch#105943,
# #118260; in this project's CI such a thread once made a FakeTensor of a CPU tensor and once
# crashed the process). What stays in the capturing step is Dynamo's trace and AOTAutograd's
# (functionalization, decompositions), and ``_program``'s conversion. Measured with
# ``python benchmarks/capture_trace.py adamw|blocks8`` (imports done before; on 2 shared cores at
# load 7, so a quiet machine takes about a third):
#   AdamW foreach=False over the suite's 200 x 256 params: 101 s = Dynamo 55 s + AOTAutograd 46 s;
#   AdamW over the 8-block model's 34 params: 21 s = Dynamo 11 s + AOTAutograd 10 s.
# So the trace is not cheap for a foreach=False step (Dynamo unrolls the per-parameter loop, ~60
# ops each): that step still stalls once per process, with no compile in it. The setting still
# accepts ``background`` and says it means 1.

# The optimizers whose step is captured: torch.optim's, with the flags the tests cover.
_CAPTURED = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.RMSprop, torch.optim.Adagrad)
# Dynamo's backend for each of ours: ``_OURS`` is ``_capture._Backend``, the one every capture uses
# (any other value is handed to Dynamo as it is). Not ``replay``: the captured step computes in the
# tensor-step formulation, within compiled tolerances of eager, and replay is bitwise eager
# (DESIGN.md). On ``neuron`` the step compiles through the StableHLO lowering (Note [Captured
# modules] in ``_capture``, "Backends").
_OURS = "adaptive_eager"
_DYNAMO_BACKENDS = {"inductor": _OURS, "stablehlo": _OURS, "neuron": _OURS}
_MAX_CAPTURES = 4
_saved: list[tuple] = []  # (class, its step) and (cell, what it held), to put back
_is_compiling = torch.compiler.is_compiling


class _Capture:
    """One optimizer's compiled step and how many steps it took since its last (re)capture."""

    __slots__ = ("fn", "steps", "captures", "off", "launches", "float_missed", "cpu_steps")

    def __init__(self):
        self.fn = None
        self.launches = 0  # what the last recorded step launched in eager (ops recorded or run eagerly)
        self.steps = 0
        self.captures = 0
        self.off: str | None = None  # why this optimizer's step is not captured any more
        self.float_missed: str | None = None  # the group value of the last param_group miss (Note [Specialized floats])
        self.cpu_steps: list | None = None  # params whose ``step`` was on cpu before the first trace (Note [Steps put back])


_captures: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def install(own_hooks: tuple = ()) -> None:
    """Put ``_capturing`` around each captured class's step; called once, by ``_patches.install``,
    after it registered its global step hooks ``own_hooks``.

    An optimizer's first ``__init__`` wraps its class's step in ``profile_hook_step`` (the hooks),
    and an LR scheduler keeps a reference to that wrapper (``patch_track_step_called``), taken
    before adaptive eager may have been turned on; so where the wrapper exists, what it calls is
    replaced in its closure cell, for every reference to it at once. The class's own step becomes
    ``_unprofiled`` of that wrapper (Note [The step's profiler range])."""
    for cls in _CAPTURED:
        step = cls.__dict__.get("step")
        if step is None:
            continue  # inherited (AdamW's is Adam's): wrapped where it is defined
        _saved.append((cls, step))
        if getattr(step, "hooked", False):
            cell = step.__closure__[step.__code__.co_freevars.index("func")]
            _saved.append((cell, cell.cell_contents))
            inner = cell.cell_contents = _capturing(cell.cell_contents)
            hooked = step
        else:
            inner = _capturing(step)
            hooked = torch.optim.Optimizer.profile_hook_step(inner)
        cls.step = _unprofiled(hooked, inner, own_hooks)
        cls.step.hooked = True  # so that __init__ does not wrap it again


# Note [The step's profiler range]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# torch.optim runs every step inside ``Optimizer.profile_hook_step``'s wrapper: the step's hooks
# and a ``record_function`` range, whose enter and exit are two ops through the dispatcher. With no
# profiler recording, the range reaches nothing, yet it cost a captured AdamW step of the recurrent
# cell ~20 of its ~140 us (benchmarks/RESULTS.md, session 41), the part of the step that
# ``torch.compile`` of ``opt.step`` traces away (Dynamo drops the range even while a profiler
# records). So the class's step (``_unprofiled``) runs what the wrapper runs but the range (the
# step hooks, which are adaptive eager's own: ``_patches``' Note [Step alignment] and Note [Scalar
# lifting]; the captured step, ``_capturing``; ``_optimizer_step_code``) when no profiler records
# (the Python flag torch.profiler sets, or the C++ profiler state, which covers the legacy,
# Kineto, NVTX and ITT profilers), no other step hook is registered, globally or on the
# optimizer, and Dynamo is not tracing it (the program's ``torch.compile`` of ``opt.step``);
# otherwise it calls torch's wrapper, range, hooks and all. What calls torch's wrapper itself (an
# LR scheduler made before adaptive eager was on holds it) keeps the range. What no longer sees
# the range while nothing profiles is a RecordFunction callback a C++ extension registers for
# itself, as under ``torch.compile``.
_GLOBAL_HOOKS = (getattr(_torch_optimizer, "_global_optimizer_pre_hooks", None),
                 getattr(_torch_optimizer, "_global_optimizer_post_hooks", None))
_profiler_on = torch._C._autograd._profiler_enabled


def _unprofiled(hooked, inner, own_hooks):
    """A captured class's step: what ``hooked`` (torch's wrapper of ``inner``) runs, without its
    range where that reaches nothing (Note [The step's profiler range]). ``own_hooks``: adaptive
    eager's global step hooks, which it runs as the wrapper would."""
    pre, post = _GLOBAL_HOOKS
    if pre is None or post is None:  # a torch whose hooks live elsewhere: its wrapper, always
        return hooked
    profiler = torch.autograd.profiler

    def theirs(hooks) -> bool:
        return any(h not in own_hooks for h in hooks.values())

    @functools.wraps(hooked)
    def step(self, *args, **kwargs):
        if (_is_compiling() or profiler._is_profiler_enabled or _profiler_on() or theirs(pre) or theirs(post)
                or getattr(self, "_optimizer_step_pre_hooks", None) or getattr(self, "_optimizer_step_post_hooks", None)):
            return hooked(self, *args, **kwargs)
        for hook in tuple(pre.values()):
            hook(self, args, kwargs)  # ours return None
        out = inner(self, *args, **kwargs)
        self._optimizer_step_code()
        for hook in tuple(post.values()):
            hook(self, args, kwargs)
        return out

    return step


def uninstall() -> None:
    for owner, original in _saved:
        if isinstance(owner, type):
            owner.step = original
        else:
            owner.cell_contents = original
    _saved.clear()


def _capturing(raw):
    @functools.wraps(raw)
    def step(self, *args, **kwargs):
        if _is_compiling():  # first: Dynamo traces the step itself (Note [User torch.compile] in _compile)
            return raw(self, *args, **kwargs)
        st = current_state()
        if st is not None and st.parked:  # Note [The mode parked between captured calls] in _state
            unpark(st)
        if args or kwargs or st is None or st.mode is None or st.aside is not None or not st.options.reaches("capture"):
            # a closure (its Python must run), adaptive eager is off here, or the program's own
            # compiled code runs this step (Note [User torch.compile] in _compile: theirs wins)
            return raw(self, *args, **kwargs)
        return _step(st, self, raw)

    return step


def _step(st, opt, raw):
    cap = _captures.get(opt)
    if cap is None:
        cap = _captures[opt] = _Capture()
    backend = _DYNAMO_BACKENDS.get(st.options.backend)
    # a Dynamo backend of a test's own (not ours) compiles for cpu and cuda
    if backend is None or not (capturable_backend(st.options) if backend == _OURS
                               else st.options.device in ("cpu", "cuda")):
        METRICS.optimizer_misses["backend"] += 1
        return raw(opt)
    if cap.fn is None:
        if cap.off is None and cap.captures == _MAX_CAPTURES:
            cap.off = "recapture_limit"
            log.warning("adaptive_eager: %s.step() missed its guards after each of %d captures; it is recorded op "
                        "by op from now on (metrics()['optimizer_misses'] says why)", type(opt).__name__, _MAX_CAPTURES)
        if cap.off is not None:
            METRICS.optimizer_misses[cap.off] += 1
            _steps_put_back(opt, cap)
            return raw(opt)
        # Note [Training captured at once] in _capture: at its first step, where that applies
        at_first = not cap.captures and backend == _OURS and at_once(st.options)
        if cap.steps < st.options.hot_after and not at_first:
            cap.steps += 1
            METRICS.optimizer_cold_steps += 1
            before = METRICS.ops_recorded + pending_hot_ops()[1] + METRICS.eager_equivalent_launches
            try:
                return raw(opt)
            finally:
                cap.launches = METRICS.ops_recorded + pending_hot_ops()[1] + METRICS.eager_equivalent_launches - before
        if _traced_elsewhere():
            return raw(opt)
        if st.window.nodes:
            flush(st, "optimizer_step")
        if not trace_alone(st):  # Note [Traces beside other threads] in _capture: the next step tries again
            METRICS.optimizer_misses["threads"] += 1
            return raw(opt)
        try:
            return _capture(st, opt, raw, cap, backend)
        finally:
            trace_done()
    if _traced_elsewhere():
        return raw(opt)
    if st.window.nodes:
        flush(st, "optimizer_step")
    prior = swap_stance(_fail_on_recompile())
    try:
        with _modes_off(), _grad_mode(opt):  # the flush's: torch's costs ~5-40 us a call
            out = cap.fn()
    except _Decline as e:  # Note [Traces off the step] in _capture: raised before the step ran anything
        cap.fn, cap.off = None, e.cause
        METRICS.optimizer_misses[cap.off] += 1
        _steps_put_back(opt, cap)
        return raw(opt)
    except RuntimeError as e:
        if str(e).startswith(_NESTED_TRACE):  # checked before the call runs anything
            METRICS.optimizer_misses["traced_elsewhere"] += 1
            return raw(opt)
        if not str(e).startswith(_RECOMPILE):
            raise
        guard = first_failed_guard(str(e))
        miss = _cause(guard)
        log.info("adaptive_eager: a captured %s.step() missed its guards (%s): %s", type(opt).__name__, miss, guard)
    else:
        METRICS.optimizer_hot_steps += 1
        _count_launches(cap)
        park(st)  # Note [The mode parked between captured calls] in _state
        return out
    finally:
        swap_stance(prior)
    METRICS.optimizer_misses[miss] += 1
    cap.fn, cap.steps = None, st.options.hot_after  # recaptured at the next step
    if miss == "param_group":
        _specialized_again(opt, cap, guard.partition(" == ")[0])
    return raw(opt)


# Note [Specialized floats]
# ~~~~~~~~~~~~~~~~~~~~~~~~~
# A scheduled lr becomes a graph input at the recapture after its first change (Note [Optimizer
# capture]) only where TorchDynamo can turn the float into a tensor: its tensorify pass converts
# a float that reaches arithmetic ops and a few others, and specializes any other use again, guarded
# on the new value. torch.optim's foreach AdamW with weight decay (the path a device such as
# ``neuron`` takes) passes ``1 - lr * weight_decay`` to ``_foreach_mul_``, which it cannot convert
# (torch 2.13): every recapture baked the next lr, missed at the next step and captured again, four
# captures of 2-3 s each in the finetune example's steps on the emulated device, each with a compile
# that was never used queued ahead of the step's real ones. So a param_group miss on the same group
# value as the last one ends the captures (``specialized_float``): the step stays recorded, where
# the fuser lifts its floats as runtime inputs (Note [Scalar lifting] in fuser.scalars) and a
# scheduled lr compiles nothing more.


# Note [Steps put back]
# ~~~~~~~~~~~~~~~~~~~~~
# TorchDynamo's trace of ``optimizer.step()`` moves each ``state[p]["step"]`` that is on cpu onto
# its parameter's device, for real (``OptimizerVariable.move_step_if_cpu``: a compiled step then
# reads no host value), and ``torch.compile`` of a step leaves it so. When the capture ends for
# good (``_Capture.off``) the step runs torch.optim's own code again, which reads a device step on
# the host each step (``_get_value``: ``.item()``) unless the group is capturable: on the emulated
# device the finetune example flushed its window there every step (an ``item`` flush and a host
# read per step). So the steps that were on cpu before the first trace are put back there, once,
# as the user had them; while a capture runs they stay where its guards expect them. Each copy
# the trace makes is a device launch, counted in ``launches`` as the device counts it.
def _on_cpu(step) -> bool:
    return isinstance(step, torch.Tensor) and step.device.type == "cpu"


def _steps_put_back(opt, cap: _Capture) -> None:
    """Put the steps the trace moved back on cpu (Note [Steps put back]); once."""
    params, cap.cpu_steps = cap.cpu_steps, []
    for p in params or ():
        state = opt.state.get(p)
        step = state.get("step") if state is not None else None
        if isinstance(step, torch.Tensor) and not _on_cpu(step):
            state["step"] = step.to("cpu")


def _specialized_again(opt, cap: _Capture, value: str) -> None:
    """After a param_group miss on group value ``value`` (the guarded source): stop capturing when
    the last miss was on the same value (Note [Specialized floats])."""
    if not value or cap.float_missed != value:
        cap.float_missed = value
        return
    cap.off = "specialized_float"
    _steps_put_back(opt, cap)
    log.warning("adaptive_eager: %s.step() missed its guards on %s again after the recapture that should have made it "
                "an input (TorchDynamo specialized it again); it is recorded op by op from now on, where its floats "
                "are runtime inputs", type(opt).__name__, value.removeprefix("ref()."))


def _capture(st, opt, raw, cap, backend):
    """Hand the step to Dynamo; the step it runs is this one (Note [Optimizer capture])."""
    if backend == _OURS:
        from ._capture import _Backend

        backend = _Backend(None, st.options, "optimizer")
    if cap.cpu_steps is None:
        cap.cpu_steps = [p for p, state in opt.state.items() if _on_cpu(state.get("step"))]
    # the trace copies these onto their parameters' device (Note [Steps put back]): launches there
    moving = [state for p, state in opt.state.items() if p.device.type != "cpu" and _on_cpu(state.get("step"))]
    t0 = time.perf_counter()
    try:
        with _disable_current_modes(), _grad_mode(opt), warnings.catch_warnings():
            # what Dynamo's tracing imports deprecates is not the program's (``-W error``)
            warnings.filterwarnings("ignore", category=DeprecationWarning)
            _spare_dynamo(st.options)  # Note [Dynamo's work for nothing] in _capture
            fn = torch.compile(_fresh(opt, raw), backend=backend, fullgraph=True)
            _static_shapes(opt)
            try:
                out = fn()
            finally:
                METRICS.launches += sum(not _on_cpu(state.get("step")) for state in moving)
    except Exception as e:  # noqa: BLE001 - counted, logged, and the step runs as before
        # Dynamo and the backend fail before the step runs (fullgraph: one frame, nothing updated)
        if str(e).startswith(_NESTED_TRACE):  # another thread began to trace meanwhile: not a failure
            METRICS.optimizer_misses["traced_elsewhere"] += 1
            return raw(opt)
        cap.off = "capture_failed"
        METRICS.optimizer_misses[cap.off] += 1
        _steps_put_back(opt, cap)
        log.warning("adaptive_eager: %s.step() could not be captured (%s: %s); it is recorded op by op",
                    type(opt).__name__, type(e).__name__, _first_line(e))
        return raw(opt)
    METRICS.optimizer_capture_seconds += time.perf_counter() - t0
    cap.fn, cap.captures = fn, cap.captures + 1
    METRICS.optimizer_captures += 1
    _count_launches(cap)
    return out


def _static_shapes(opt) -> None:
    """Mark the step's tensors' shapes static (Note [Optimizer capture]): Dynamo's automatic dynamic
    shapes are kept per code object of torch.optim's own functions, so another optimizer's
    parameters of other shapes made this step's graph symbolic (a SymInt a Program cannot hold:
    it ran op by op). Its floats stay automatic: a scheduled lr still becomes an input. Parameters
    are left alone: Dynamo keeps their shapes static already (``force_parameter_static_shapes``),
    and a mark on one is guarded by the captured module that reads it, which a mark made after its
    capture missed at every call."""
    mark = torch._dynamo.mark_static
    for group in opt.param_groups:
        for p in group["params"]:
            for t in (p.grad, *opt.state.get(p, {}).values()):
                if isinstance(t, torch.Tensor) and t.dim():
                    mark(t)


def _traced_elsewhere() -> bool:
    """Whether Dynamo would refuse the compiled step (``_capture._NESTED_TRACE``); counted: the
    step then runs recorded."""
    if traced_elsewhere():
        METRICS.optimizer_misses["traced_elsewhere"] += 1
        return True
    return False


def _count_launches(cap: _Capture) -> None:
    """A compiled step is one launch where eager launches what the recorded step did (``metrics()``)."""
    METRICS.launches += 1
    METRICS.eager_equivalent_launches += cap.launches


def _grad_mode(opt):
    """What ``_use_grad_for_differentiable`` (``raw``) does around the step's body, whose graph
    breaks (``torch._dynamo.graph_break()``) keep it out of the compiled frame."""
    return torch.set_grad_enabled(opt.defaults["differentiable"])


def _fresh(opt, raw):
    """The body of ``raw(opt)`` as a function with a code object of its own (Note [Optimizer
    capture]); ``_grad_mode`` is ``raw``'s part."""
    body = raw.__wrapped__
    ref = weakref.ref(opt)  # ``_captures`` holds this function and must not keep ``opt`` alive

    def run():
        return body(ref())

    return types.FunctionType(run.__code__.replace(), run.__globals__, "step", None, run.__closure__)


def _first_line(e: BaseException) -> str:
    return str(e).splitlines()[0] if str(e) else ""


def _cause(guard: str) -> str:
    """What a failed guard (``first_failed_guard``) is about."""
    for word, cause in (("grad", "grad"), ("state", "state"), ("param_groups", "param_group"),
                        ("hooks", "hooks")):
        if word in guard:
            return cause
    return "other"

"""A hot module call runs as one guarded compiled call (Note [Captured modules]).

While adaptive eager is on, ``nn.Module.__call__`` is ``_call`` below. The outermost module call
of a thread is the unit: once a module instance has been called ``hot_after`` times, it is handed
to TorchDynamo (``fullgraph``, static shapes) with our AOTAutograd backend, and later calls run
as a single call of what Dynamo built, with the dispatch mode suspended; the ATen graphs of its
forward and backward run op by op until their artifacts, compiled in a worker process like a
region's, are in ``neff_cache``, and compiled from then on.
"""

from __future__ import annotations

import functools
import json
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

from fuser.backends._common import EagerWouldRaise, launches_of, launches_op

from ._flush import _modes_off, flush
from ._log import log
from ._metrics import METRICS
from ._state import current_state

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
#   module's Python. Dynamo's trace and AOTAutograd's (a few hundred ms for a small model) stay
#   in the step that captures; only lowering and compiling move off it.
# - The backward: the autograd engine calls ``_Graph`` while the mode is on, with tangents that
#   are pending values of the recorded loss backward; they are computed first (``sync_value``,
#   whichever thread's window holds them) and the graph runs with the mode suspended.
# - Not captured, counted in ``metrics()["module_capture_misses"]``, with the line in explain():
#   a forward with random ops (``random``: windows draw eager's random numbers, an artifact
#   would not), a module with hooks anywhere in it (``hooks``: their Python must run every call;
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
_POLL_S = 0.05  # how often a graph waiting for its artifact looks for it

_ORIG_CALL = torch.nn.Module.__call__
_len_dispatch_stack = torch._C._len_torch_dispatch_stack
_BUSY = False  # a captured call runs or is traced: module calls inside it are plain (Dynamo guards this)
_tls = threading.local()  # ``depth``: module calls of this thread being run recorded
_saved: list = []


class _Decline(Exception):
    """Raised by our compilers for a graph that must not be captured; ``cause`` is counted."""

    def __init__(self, cause: str, detail: str = ""):
        super().__init__(f"{cause}: {detail}" if detail else cause)
        self.cause = cause


class _Cap:
    """One module instance's capture state."""

    __slots__ = ("fn", "calls", "captures", "off", "missed", "__weakref__")

    def __init__(self):
        self.fn = None
        self.calls = 0
        self.captures = 0  # compiles of Dynamo entries (our backend's calls)
        self.off: str | None = None  # why it is not captured any more
        self.missed: set = set()  # guard-miss causes seen once: a second miss of one recaptures


_caps: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_THEIRS = "compiled by the program"  # not a miss: nothing of ours to capture


def install() -> None:
    """``nn.Module.__call__`` is ``_call`` while the mode is on; called once, by ``_patches.install``."""
    _saved.append(torch.nn.Module.__dict__["__call__"])
    torch.nn.Module.__call__ = _call


def uninstall() -> None:
    while _saved:
        torch.nn.Module.__call__ = _saved.pop()


def _call(self, *args, **kwargs):
    if _BUSY:
        return _ORIG_CALL(self, *args, **kwargs)
    st = current_state()
    if (st is None or st.mode is None or getattr(_tls, "depth", 0) or not st.options.reaches("capture")
            or not _len_dispatch_stack()):  # the mode suspended: a flush's or a capture's own calls
        return _ORIG_CALL(self, *args, **kwargs)
    cap = _caps.get(self)
    if cap is None:
        cap = _caps[self] = _Cap()
        if type(self).__name__ == "OptimizedModule" or getattr(self, "_compiled_call_impl", None) is not None:
            cap.off = _THEIRS  # the program compiled it: its compile wins (Note [User torch.compile] in _compile)
    if cap.fn is not None:
        return _run(st, self, cap, args, kwargs)
    if cap.off is None:
        cap.calls += 1
        if cap.calls > st.options.hot_after:
            return _capture(st, self, cap, args, kwargs)
    elif cap.off is not _THEIRS:
        _miss(cap.off, self)
    return _recorded(self, args, kwargs)


def _recorded(module, args, kwargs):
    _tls.depth = getattr(_tls, "depth", 0) + 1
    try:
        return _ORIG_CALL(module, *args, **kwargs)
    finally:
        _tls.depth -= 1


def _miss(cause: str, module, depth: int = 2) -> None:
    METRICS.module_capture_misses[cause] += 1
    f = sys._getframe(depth)
    METRICS.module_capture_sites[(cause, type(module).__name__, (f.f_code, f.f_lineno))] += 1


@functools.cache
def _fail_on_recompile():
    from torch._dynamo.eval_frame import DynamoStance

    return DynamoStance("fail_on_recompile", False, None)


def _run(st, module, cap: _Cap, args, kwargs):
    global _BUSY
    if st.window.nodes:
        flush(st, "module_capture")  # its inputs may be pending
    from torch._dynamo.eval_frame import _set_stance

    recapture = False
    while True:
        prior = None if recapture else _set_stance(_fail_on_recompile())
        busy, _BUSY = _BUSY, True
        try:
            with _modes_off():
                out = cap.fn(*args, **kwargs)
        except RuntimeError as e:
            if recapture or not str(e).startswith(_RECOMPILE):
                if not recapture:
                    raise
                return _failed_recapture(module, cap, e, args, kwargs)
            cause = _cause(str(e))
        except Exception as e:  # noqa: BLE001 - Dynamo and our backend fail before the call runs anything
            if not recapture:
                raise
            return _failed_recapture(module, cap, e, args, kwargs)
        else:
            METRICS.module_captured_calls += 1
            return out
        finally:
            _BUSY = busy
            if prior is not None:
                _set_stance(prior)
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
    if st.window.nodes:
        flush(st, "module_capture")
    t0 = time.perf_counter()
    fn = torch.compile(_fresh(module), backend=_Backend(cap, st.options), dynamic=False, fullgraph=True)
    busy, _BUSY = _BUSY, True
    try:
        with _disable_current_modes(), warnings.catch_warnings():
            warnings.filterwarnings("ignore", category=DeprecationWarning)
            out = fn(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - Dynamo and our backend fail before the call runs anything
        cap.off = _decline_cause(e)
        if cap.off == "capture_failed":
            log.warning("adaptive_eager: %s could not be captured (%s: %s); it is recorded op by op",
                        type(module).__name__, type(e).__name__, _first_line(e))
        _miss(cap.off, module, 3)
        return _recorded(module, args, kwargs)
    finally:
        _BUSY = busy
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


def _fresh(module):
    """The module's call as a function with a code object of its own: Dynamo's recompile limit
    counts entries per code object, and every captured module would otherwise share one."""
    ref = weakref.ref(module)  # ``_caps`` holds this function and must not keep the module alive

    def run(*args, **kwargs):
        return _ORIG_CALL(ref(), *args, **kwargs)

    return types.FunctionType(run.__code__.replace(), run.__globals__, "captured", None, run.__closure__)


def _cause(message: str) -> str:
    """What the first failed guard of a Dynamo recompile message is about."""
    first = message.partition("guard failure(s):")[2].strip().lstrip("- ").partition("\n")[0]
    guard = first.partition("  #")[0]
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
        from torch._dynamo.backends.common import aot_autograd
        from torch._inductor.decomposition import select_decomp_table

        options, who = self.options, self.who
        key = compiled = None
        try:
            key = _record_key(gm, example_inputs, options, who)
        except _Decline as e:
            METRICS.capture_records[f"{who}_unkeyed:{e.cause}"] += 1
        if key is not None:
            compiled = _from_record(key, gm, options, who)
        if compiled is None:
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
            decompositions = select_decomp_table() if options.backend == "inductor" else {}
            # the backward graph is made now, not at the first backward, so that the record is whole
            with torch._functorch.config.patch(force_non_lazy_backward_lowering=key is not None):
                compiled = aot_autograd(fw_compiler=forward, bw_compiler=backward, inference_compiler=forward,
                                        decompositions=decompositions,
                                        keep_inference_input_mutations=True)(gm, example_inputs)
            if key is not None:
                _write_record(key, graphs, options, who)
        cap = None if self.cap is None else self.cap()
        if cap is not None:
            cap.captures += 1
        if who == "module":
            METRICS.module_captures += 1
        return compiled


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
            self.ops = parts["ops"]
            self.program, self.plan, self.n_live, self.expected, self.may_write = (
                parts["program"], parts["plan"], parts["n_live"], parts["expected"], parts["may_write"])
            self.source = self.program
            return
        if kind == "forward":
            for node in gm.graph.nodes:
                if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload) and \
                        torch.Tag.nondeterministic_seeded in node.target.tags:
                    raise _Decline("random", str(node.target))
        self._setup(kind, options, who)
        self.gm = gm
        # run op by op, a view or an allocation launches nothing (what the device counts: Note
        # [Launches of a compiled callable] in fuser.backends._common)
        self.ops = sum(1 for n in gm.graph.nodes if n.op == "call_function" and launches_op(n.target))
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
                "expected": [[list(shape), str(dtype).removeprefix("torch.")] for shape, dtype in self.expected]}

    @classmethod
    def from_description(cls, doc: dict, kind: str, options, who: str):
        from fuser.program import Program

        parts = {"program": Program.from_bytes(json.dumps(doc["program"]).encode()),
                 "plan": [None if h is None else tuple(h) for h in doc["plan"]], "n_live": doc["n_live"],
                 "may_write": doc["may_write"], "ops": doc["ops"],
                 "expected": [(tuple(shape), getattr(torch, dtype)) for shape, dtype in doc["expected"]]}
        return cls(None, None, kind, options, who, parts)

    def __call__(self, *args):
        # boxed (one list) as AOTAutograd calls a forward; the backward's wrapper (Dynamo's
        # ``disable``) hides ``_boxed_call``, so it is called with the tensors as arguments
        args = args[0] if len(args) == 1 and type(args[0]) is list else list(args)
        if self.kind == "backward":
            from ._threads import sync_value

            for t in args:
                if type(t) is torch.Tensor or isinstance(t, torch.Tensor):
                    sync_value(t, "module_capture")  # the loss backward's tangents are pending
            with _modes_off():
                return self._call(args)
        return self._call(args)

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
            outs = run(inputs)
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
            METRICS.launches += self.ops
            METRICS.eager_equivalent_launches += self.ops
        else:
            METRICS.optimizer_uncompiled_runs += 1
            METRICS.launches += self.ops - 1
        return self._eager(args)

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
        from fuser.artifacts import _store
        from fuser.backends import get_backend
        from fuser.compile import _Unverified, cache_fingerprint
        from fuser.regions import _collect, _obtain, abandoned, poll_jobs

        options = self.options
        backend = get_backend(options.backend, options.device)
        fingerprint = cache_fingerprint(backend)
        wait = not options.async_compile
        with table.LOCK:
            entry = self.entry
            if entry is None:
                entry = self.entry = table._Entry()
                entry.program = self.program
                # Note [Written inputs]: a backend that stores after its run writes nothing in a run that fails
                self.program.inplace = getattr(backend, "writes_inputs", False) and (
                    self.may_write or getattr(backend, "stores_after_run", False))
                try:
                    entry.pkey = self.program.digest(fingerprint)
                except TypeError as e:
                    self.program = None
                    self.uncompiled_graphs["unencodable"] += 1
                    log.info("adaptive_eager: a captured %s graph runs op by op, not compiled: %s", self.kind, e)
                    return None
                entry.region = entry.pkey[:8]
                entry.n_live, entry.mutated = self.n_live, self.program.mutated
                store = _store(options)
                _obtain(entry, store, backend, options, wait, store.get(entry.pkey, fingerprint=fingerprint))
            elif entry.future is not None and (wait or entry.future.done()):
                _collect(entry)
            elif entry.other_process and not entry.blacklisted:
                poll_jobs()
                store = _store(options)
                if not entry.blacklisted:
                    data = store.get(entry.pkey, fingerprint=fingerprint)
                    if data is not None or abandoned(entry.pkey, store):
                        entry.other_process = False
                        _obtain(entry, store, backend, options, wait, data)
            if entry.future is not None and entry.future.done():
                _collect(entry)
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
# - training (a backward graph): no input written, every output fresh (no alias of an input or of
#   another output), no effect token, no functionalized RNG, plain tensors, static shapes. The
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
# AOTAutograd's metadata shows, e.g. BatchNorm's running statistics written by a training graph).
# A record's graph runs op by op (its Program, ``_Graph._eager``) until its artifact is loaded.
_RECORD_FORMAT = 1


def _record_key(gm, example_inputs, options, who: str) -> str:
    """The record's key (Note [Captures from the cache]); ``_Decline`` for a graph it cannot name."""
    import xxhash
    from torch._C._dynamo.guards import GlobalStateGuard

    from fuser.backends import get_backend
    from fuser.backends._common import encode_value
    from fuser.compile import cache_fingerprint

    def leaf(x):
        return {"$node": x.name} if isinstance(x, torch.fx.Node) else None

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
           functorch, bool(torch._inductor.config.fallback_random)]
    return xxhash.xxh3_128_hexdigest(json.dumps(doc, sort_keys=True).encode())


_NAMES: dict = {}


def _importable_name(target) -> str:
    """A call's target by a name that imports back to it, or ``_Decline``."""
    if isinstance(target, torch._ops.OpOverload):
        return f"torch.ops.{target}"
    try:
        return _NAMES[target]
    except (KeyError, TypeError):
        pass
    import importlib

    from torch.fx.node import _get_qualified_name

    try:
        name = _get_qualified_name(target)
    except Exception:  # noqa: BLE001 - FX names what it can; anything else has no name here
        raise _Decline("target", repr(target)) from None
    parts = name.split(".")
    for i in range(len(parts) - 1, 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr, None)
        if obj is target:
            try:
                _NAMES[target] = name
            except TypeError:
                pass
            return name
        break
    raise _Decline("target", name)


def _write_record(key: str, graphs: dict, options, who: str) -> None:
    """Keep what AOTAutograd made of the graph, if it is of the common kind (Note [Captures from the cache])."""
    from torch._functorch._aot_autograd.schemas import MutationType, OutputType

    from fuser.artifacts import _store
    from fuser.backends import get_backend
    from fuser.compile import cache_fingerprint

    def declined(cause: str) -> None:
        METRICS.capture_records[f"{who}_declined:{cause}"] += 1

    context = torch._guards.TracingContext.try_get()
    meta = None if context is None else context.fw_metadata
    forward, backward = graphs.get("forward"), graphs.get("backward")
    if meta is None or forward is None or (backward is None) != (len(graphs) == 1):
        return declined("graphs")
    if any(g.source is None for g in graphs.values()):
        return declined("uncompiled")
    if meta.tokens or meta.is_rng_op_functionalized or meta.num_intermediate_bases or \
            meta.num_mutated_inp_runtime_indices:
        return declined("wrapper")
    if any(o.output_type != OutputType.non_alias for o in meta.output_info):
        return declined("aliased_output")
    allowed = (MutationType.NOT_MUTATED,) if backward else (MutationType.NOT_MUTATED, MutationType.MUTATED_IN_GRAPH)
    if any(i.mutation_type not in allowed or i.mutates_metadata for i in meta.input_info):
        return declined("written_input")
    n_out = len(meta.output_info)
    record = {"format": _RECORD_FORMAT, "outputs": n_out, "forward": forward.describe()}
    if backward is not None:
        requires_grad = [bool(o.requires_grad) for o in meta.output_info]
        saved = len(forward.plan) - n_out
        program = backward.source
        tangents = program.inputs[saved:]
        if saved < 0 or len(tangents) != sum(requires_grad):
            return declined("tangents")
        for shape, stride, _, _ in tangents:
            if tuple(stride) != make_contiguous_strides_for(shape):
                return declined("tangents")
        record.update(requires_grad=requires_grad, saved=saved, backward=backward.describe())
    elif len(forward.plan) != n_out:
        return declined("outputs")
    store = _store(options)
    fingerprint = cache_fingerprint(get_backend(options.backend, options.device))
    try:
        # not a compiled artifact: tagged as the op-metadata tables are (``backend="meta"``), so
        # that the cache's listings tell records from what a compiler made
        store.put(key, json.dumps(record).encode(), fingerprint=fingerprint, backend="capture_record",
                  compile_seconds=0.0)
    except Exception as e:  # noqa: BLE001 - the store logs its own failures; the capture goes on
        log.info("adaptive_eager: a capture's record was not kept: %s", e)
        return declined("store")
    METRICS.capture_records[f"{who}_written"] += 1


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
        backward = None
        if "backward" in record:
            backward = _Graph.from_description(record["backward"], "backward", options, who)
    except Exception as e:  # noqa: BLE001 - a record that does not decode is traced again, and replaced
        METRICS.capture_records[f"{who}_unreadable"] += 1
        log.info("adaptive_eager: a capture's record does not decode (%s); it is traced again", e)
        return None
    METRICS.capture_records[f"{who}_hit"] += 1
    attrs = dict(gm.named_parameters(remove_duplicate=False))
    attrs.update(gm.named_buffers(remove_duplicate=False))
    attrs = list(attrs.values())
    if backward is None:
        def run(*args):
            return forward([*attrs, *args])
    else:
        recorded = _RecordedGraphs(forward, backward, record["outputs"], record["requires_grad"])

        def run(*args):
            return list(_Recorded.apply(recorded, *attrs, *args))
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


def _traced_strides(g: torch.Tensor) -> torch.Tensor:
    """A tangent in the contiguous strides it was traced with, made as AOTAutograd's runtime makes it
    (``coerce_to_expected_memory_format``: ``empty_strided`` and ``copy_``, not ``contiguous()``): the
    window recorded before the backward then has the structure a process that traced recorded, and
    runs the region the cache holds for it (``contiguous()`` made a new one, compiled again)."""
    strides = make_contiguous_strides_for(g.shape)
    if g.stride() == strides:
        return g
    out = torch.empty_strided(g.shape, strides, dtype=g.dtype, device=g.device, layout=g.layout)
    out.copy_(g)
    return out


def misses() -> Counter:
    return METRICS.module_capture_misses

"""Compiled regions: a window becomes one functional FX graph, compiled once, reused by key.

Tiers (DESIGN.md "Adaptivity"): a window structure seen for the first time runs by replay; once
its key has been seen ``hot_after`` times it is compiled and every later window with the same key
runs the compiled region. A region that fails to compile or run is blacklisted for its key and
replayed; the program never sees a compiler error or a wrong value.

Note [Region key]
The in-memory key is the window's structure as recorded (``Window.sigs``: per node the id of its
op signature, which covers the op, input shapes/strides/dtypes/devices and scalar arguments, and
its dataflow refs), which values are still observable (live placeholders), and which real inputs
are written. It is exact (a tuple compared in full on a hit) and costs nothing to build at
flush. The persistent, process-independent key (for neff_cache) is a digest of the compiled graph's
code and input metadata plus the backend fingerprint, computed only on a compile.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import queue
import struct
import threading
import time
from concurrent.futures import Future
from collections import Counter, OrderedDict

import torch
import xxhash

from .replay import ReplayError, _bind, as_recorded, mark_needed, placeholder_is_dead, replay_window
from .window import ALIAS, FRESH, VIEW, Out, Window

log = logging.getLogger("adaptive_eager.fuser")

FORMAT = 1  # bump when Program's encoding or the artifact packing changes

_storage_use_count = torch._C._storage_Use_Count
_untyped_storage = torch._C.TensorBase.untyped_storage


class RegionStats:
    """Counters the tracer folds into ``metrics()``."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.regions_compiled = 0
        self.compile_seconds = 0.0
        self.cache_hits_memory = 0
        self.cache_misses = 0
        self.replayed_regions = 0
        self.compiled_runs = 0
        self.blacklisted = 0
        self.compile_failures = 0
        self.cache_hits_disk = 0
        self.waited_for_other_process = 0
        self.recompiles: Counter[str] = Counter()
        self.not_compiled: Counter[str] = Counter()  # why a window stayed on replay

    def as_dict(self) -> dict:
        return {
            "corrupt_entries": sum(s.corrupt_entries + s.incompatible_entries for s in _STORES.values()),
            "regions_compiled": self.regions_compiled,
            "compile_seconds": round(self.compile_seconds, 3),
            "cache_hits_memory": self.cache_hits_memory,
            "cache_misses": self.cache_misses,
            "replayed_regions": self.replayed_regions,
            "compiled_runs": self.compiled_runs,
            "recompiles": dict(self.recompiles),
            "blacklisted": self.blacklisted,
            "compile_failures": self.compile_failures,
            "compiles": self.regions_compiled,
            "cache_hits_disk": self.cache_hits_disk,
            "waited_for_other_process": self.waited_for_other_process,
            "not_compiled": dict(self.not_compiled),
        }


STATS = RegionStats()


class _Entry:
    __slots__ = ("seen", "run", "n_live", "mutated", "blacklisted", "future", "lifted_inputs", "group",
                 "program", "pkey", "other_process", "counts")

    def __init__(self):
        self.future = None  # a compile in flight
        self.seen = 0
        self.run = None  # the loaded compiled callable
        self.n_live = 0
        self.mutated: tuple[int, ...] = ()
        self.blacklisted = False
        self.lifted_inputs: list[tuple[int, torch.dtype]] = []  # (index in Window.scalars, dtype)
        self.group = None
        self.program: Program | None = None
        self.pkey: str | None = None  # persistent key (Program.digest), computed at first sight
        self.other_process = False  # another process holds the compile claim for pkey
        self.counts = (0, 0)  # (ops computed, ops dead) of this structure, for metrics()


class RegionCache:
    """In-memory LRU of regions by key (Note [Region key])."""

    def __init__(self, max_entries: int = 1024):
        self.entries: OrderedDict = OrderedDict()
        self.max_entries = max_entries

    def get(self, key) -> _Entry:
        e = self.entries.get(key)
        if e is None:
            e = self.entries[key] = _Entry()
            if len(self.entries) > self.max_entries:
                self.entries.popitem(last=False)
        else:
            self.entries.move_to_end(key)
        return e

    def clear(self) -> None:
        self.entries.clear()


CACHE = RegionCache()


def _live_outs(window: Window) -> list[Out]:
    """FRESH values the program can still observe, in window order: the region's outputs.

    Only values are visited, never nodes, so a flush that hits a compiled region costs per output,
    not per op."""
    live = []
    for o in window.fresh:
        if o.pinned or not placeholder_is_dead(o):
            o.live = True
            live.append(o)
    return live


def _inputs_alias(window: Window) -> bool:
    """Whether a written real input shares storage with another real input.

    The graph treats each slot as its own buffer; two slots over one storage with a write through
    one of them (``p`` and ``p.view(-1)``) cannot be expressed, so such windows are replayed.
    """
    if not window.mutated:
        return False
    seen: dict[int, int] = {}
    mutated_storages = set()
    for slot, t in enumerate(window.real_inputs):
        sid = _untyped_storage(t)._cdata
        if slot in window.mutated:
            mutated_storages.add(sid)
        seen[sid] = seen.get(sid, 0) + 1
    return any(seen[s] > 1 for s in mutated_storages)


LIFT_AFTER = 2  # a float argument that changed this many times becomes a runtime input


class _Group:
    """What windows of one structure (scalar values aside) have shown: Note [Scalar lifting]."""

    __slots__ = ("last", "changes", "lifted", "unliftable")

    def __init__(self):
        self.last: tuple | None = None
        self.changes: Counter[int] = Counter()
        self.lifted: tuple[int, ...] = ()
        self.unliftable = False  # the compiled graph could not take these floats as inputs


_GROUPS: OrderedDict = OrderedDict()


def _scalar_key(structure, scalars: list) -> tuple:
    """The part of a region key that scalar values contribute, after lifting the ones that vary."""
    group = _GROUPS.get(structure)
    if group is None:
        group = _GROUPS[structure] = _Group()
        if len(_GROUPS) > CACHE.max_entries:
            _GROUPS.popitem(last=False)
    values = tuple(scalars)
    last = group.last
    if last is not None and values != last and len(values) == len(last) and not group.unliftable:
        lifted = set(group.lifted)
        for i, (a, b) in enumerate(zip(values, last)):
            if a != b and i not in lifted:
                group.changes[i] += 1
                if group.changes[i] >= LIFT_AFTER:
                    lifted.add(i)
        if len(lifted) != len(group.lifted):
            group.lifted = tuple(sorted(lifted))
            STATS.recompiles["scalar_lifted"] += 1
    group.last = values
    if not group.lifted:
        return (group, (), values)
    lifted = set(group.lifted)
    return (group, group.lifted, tuple(v for i, v in enumerate(values) if i not in lifted))


def run(window: Window, backend, options) -> tuple[int, int, int]:
    """Run ``window`` (after ``mark_needed``) compiled when its key is hot or on disk, else by
    replay; return the launches made."""
    live = _live_outs(window)
    mutated = tuple(sorted(window.mutated))
    if not live and not mutated:
        return 0, 0, len(window.nodes)  # nothing observable: every op is dead
    wait = not options.async_compile
    structure = (tuple(window.sigs), tuple(o.uid for o in live), mutated)
    group, lifted, baked = _scalar_key(structure, window.scalars)
    key = (structure, lifted, baked)
    entry = CACHE.get(key)
    entry.group = group
    if entry.future is not None and (wait or entry.future.done()):
        _collect(entry)
    if entry.run is not None:
        STATS.cache_hits_memory += 1
        return _run_or_replay(entry, window, live)
    entry.seen += 1
    if entry.blacklisted or entry.future is not None:
        return _replay(window)
    if entry.other_process:
        poll_jobs()
    if entry.seen == 1 or entry.other_process:
        # A region compiled by an earlier run or another process is used at first sight.
        reason = _not_compilable(window)
        if reason is not None:
            STATS.not_compiled[reason] += 1
            entry.blacklisted = True
            return _replay(window)
        store = _store(options)
        if entry.program is None:
            dead = mark_needed(window)
            entry.counts = (sum(1 for n in window.nodes if n.needed and not n.is_view), dead)
            entry.program = Program.from_window(window, live, mutated, lifted)
            entry.pkey = entry.program.digest(backend.fingerprint())
            entry.n_live, entry.mutated = len(live), mutated
        data = store.get(entry.pkey, fingerprint=backend.fingerprint())
        if data is not None:
            entry.other_process = False
            entry.future = _submit(_load, data, backend)
            if not wait:
                # the first load in a process imports Inductor (~1-2 s): replay meanwhile
                return _replay(window)
            _collect(entry)
            if entry.run is not None:
                return _run_or_replay(entry, window, live)
    if entry.seen >= options.hot_after and not entry.blacklisted and not entry.other_process:
        STATS.cache_misses += 1
        store = _store(options)
        if entry.program is None:
            dead = mark_needed(window)
            entry.counts = (sum(1 for n in window.nodes if n.needed and not n.is_view), dead)
            entry.program = Program.from_window(window, live, mutated, lifted)
            entry.pkey = entry.program.digest(backend.fingerprint())
            entry.n_live, entry.mutated = len(live), mutated
        if not store.claim(entry.pkey):
            # another process is compiling this region: replay meanwhile, pick it up from disk
            if not entry.other_process:
                STATS.waited_for_other_process += 1
            entry.other_process = True
            return _replay(window)
        if wait:
            entry.future = _submit(_compile_and_store, entry.program, backend, store, entry.pkey)
            entry.program = None
            _collect(entry)
            if entry.run is not None:
                return _run_or_replay(entry, window, live)
        else:
            _submit_job(entry, backend, store, options)
    return _replay(window)


# Note [Background compiles]
# With async_compile, a hot region is compiled in a worker *process* (neff_cache.CompileJobs),
# never a thread of this process: Inductor saves and restores the global RNG state around a
# compile, which would rewind the random numbers the program draws meanwhile. The program keeps
# replaying; the artifact lands in the store, and the region's next window loads it.
_JOBS: dict = {}
_PENDING: dict = {}  # persistent key -> entry waiting for a background compile


def _jobs(store, options):
    from neff_cache import CompileJobs

    jobs = _JOBS.get(id(store))
    if jobs is None:
        jobs = _JOBS[id(store)] = CompileJobs(store, max_workers=1)
    return jobs


def _submit_job(entry: _Entry, backend, store, options) -> None:
    store.release(entry.pkey)  # CompileJobs claims the key itself
    payload = json.dumps({"backend": backend.name, "device": options.device,
                          "program": entry.program.to_bytes().decode()}).encode()
    try:
        submitted = _jobs(store, options).submit(
            entry.pkey, "fuser.compiled:compile_job", payload, fingerprint=backend.fingerprint(), backend=backend.name
        )
    except Exception as e:  # noqa: BLE001 - an unserializable argument: compile synchronously instead
        log.info("adaptive_eager: compiling in this process: %s", e)
        entry.future = _submit(_compile_and_store, entry.program, backend, store, entry.pkey)
        _collect(entry)
        return
    entry.other_process = True  # picked up from the store at a later sight
    _PENDING[entry.pkey] = entry
    if not submitted:
        STATS.waited_for_other_process += 1


def poll_jobs() -> None:
    """Collect finished background compiles (their artifacts are then in the store)."""
    for jobs in _JOBS.values():
        for result in jobs.poll():
            entry = _PENDING.pop(result.key, None)
            if result.ok:
                STATS.regions_compiled += 1
            else:
                STATS.compile_failures += 1
                if entry is not None:
                    entry.other_process = False
                    _blacklist(entry, f"background compile failed: {result.error}")


def _replay(window: Window) -> tuple[int, int, int]:
    STATS.replayed_regions += 1
    dead = mark_needed(window)
    launched = replay_window(window)
    return launched, sum(1 for n in window.nodes if n.needed and not n.is_view), dead


def _run_or_replay(entry: _Entry, window: Window, live: list[Out]) -> tuple[int, int, int]:
    try:
        return (_run_compiled(entry, window, live), *entry.counts)
    except Exception as e:  # never the program's problem: blacklist and replay
        _blacklist(entry, f"run failed: {type(e).__name__}: {e}")
        return _replay(window)


def _not_compilable(window: Window) -> str | None:
    if _inputs_alias(window):
        return "aliased_inputs"
    return None


def _blacklist(entry: _Entry, why: str) -> None:
    entry.run = None
    entry.blacklisted = True
    STATS.blacklisted += 1
    log.warning("adaptive_eager: a region was blacklisted and will be replayed: %s", why)


def _run_compiled(entry: _Entry, window: Window, live: list[Out]) -> int:
    # Only the call can fail (a compiled kernel's check, e.g. an out-of-range index); nothing is
    # written before it returns, so a failure leaves the window intact for replay, which raises
    # eager's own error.
    inputs = list(window.real_inputs)
    if entry.lifted_inputs:
        scalars = window.scalars
        inputs += [torch.tensor(scalars[i], dtype=dt) for i, dt in entry.lifted_inputs]
    with as_recorded():
        outs = entry.run(inputs)
        copies = 0
        for o, r in zip(live, outs):
            copies += _bind(o, r)
        real = window.real_inputs
        for slot, r in zip(entry.mutated, outs[entry.n_live:]):
            real[slot].copy_(r)  # write-back of parameters, optimizer state, buffers
    STATS.compiled_runs += 1
    return 1 + copies + len(entry.mutated)  # the copies are launches too


class _Ref:
    """A value produced inside the program (an ``Out.uid``)."""

    __slots__ = ("uid",)

    def __init__(self, uid: int):
        self.uid = uid

    def __repr__(self) -> str:
        return f"%{self.uid}"


class _In:
    """A real input of the program, by slot."""

    __slots__ = ("slot",)

    def __init__(self, slot: int):
        self.slot = slot

    def __repr__(self) -> str:
        return f"in{self.slot}"


class _Lifted:
    """A float argument that the compiled region takes as a runtime input (by ``Window.scalars``
    index): Note [Scalar lifting]."""

    __slots__ = ("index",)

    def __init__(self, index: int):
        self.index = index

    def __repr__(self) -> str:
        return f"scalar{self.index}"


def _sentinel(k: int) -> float:
    # a quiet NaN with a payload: anything a decomposition derives from it is a NaN without the
    # payload, so a lifted float that was transformed (not just passed along) is detected
    return struct.unpack("<d", struct.pack("<Q", 0x7FF8_0ADE_0000_0000 | k))[0]


def _sentinel_index(x) -> int | None:
    if type(x) is not float or x == x:
        return None
    bits = struct.unpack("<Q", struct.pack("<d", x))[0]
    if bits & 0xFFFF_FFFF_0000_0000 != 0x7FF8_0ADE_0000_0000:
        return -1  # a NaN that is not one of ours as passed: derived from a lifted float
    return bits & 0xFFFF_FFFF


class LiftError(Exception):
    """The graph cannot take a lifted float as an input (it was transformed, or an op needs it as a
    Python number); the region is compiled with the values baked in instead."""


class Program:
    """A window as plain data: no reference to the program's tensors, so it can be compiled later,
    in another thread or process, after the window itself is gone."""

    def __init__(self, ops, inputs, live, mutated, lifted=(), scalars=()):
        self.ops = ops  # [(func, args, kwargs, [(kind, uid, alias) per output])]
        self.inputs = inputs  # [(shape, stride, dtype, device)] by slot
        self.live = live  # uids of the outputs, in order
        self.mutated = mutated  # slots whose final values follow the live outputs
        self.lifted = lifted  # Window.scalars indices that are runtime inputs
        self.scalars = scalars  # their values in the window compiled from (example inputs)

    @classmethod
    def from_window(cls, window: Window, live: list[Out], mutated: tuple[int, ...], lifted=()) -> Program:
        slots = {id(t): s for s, t in enumerate(window.real_inputs)}
        lifted_set = set(lifted)

        def enc(a):
            if type(a) is Out:
                return _Ref(a.uid)
            if type(a) is list:
                return [enc(x) for x in a]
            if isinstance(a, torch.Tensor):
                return _In(slots[id(a)])
            return a

        ops = []
        for node in window.nodes:
            if not (node.needed or node.is_view):
                continue
            outs = [None if o is None else (o.kind, o.uid, enc(o.alias) if o.kind == ALIAS else None)
                    for o in node.outs]
            kwargs = {k: enc(v) for k, v in node.kwargs.items()} if node.kwargs else {}
            args = [enc(a) for a in node.args]
            for n, pos in enumerate(node.fpos):
                index = node.fbase + n
                if index in lifted_set:
                    if type(pos) is int:
                        args[pos] = _Lifted(index)
                    elif type(pos) is str:
                        kwargs[pos] = _Lifted(index)
                    else:
                        args[pos[0]] = list(args[pos[0]])
                        args[pos[0]][pos[1]] = _Lifted(index)
            ops.append((node.func, args, kwargs, outs))
        inputs = [(tuple(t.shape), tuple(t.stride()), t.dtype, str(t.device)) for t in window.real_inputs]
        scalars = tuple(window.scalars[i] for i in lifted)
        return cls(ops, inputs, [o.uid for o in live], mutated, tuple(lifted), scalars)

    def to_bytes(self) -> bytes:
        """JSON (OpOverloads and torch enums do not pickle): what a compile worker process gets."""
        doc = {
            "format": FORMAT,
            "ops": [[str(func), _enc(args), _enc(kwargs), [None if o is None else [o[0], o[1], _enc(o[2])] for o in outs]]
                    for func, args, kwargs, outs in self.ops],
            "inputs": [[list(shape), list(stride), str(dtype).removeprefix("torch."), device]
                       for shape, stride, dtype, device in self.inputs],
            "live": list(self.live), "mutated": list(self.mutated), "lifted": list(self.lifted),
            "scalars": list(self.scalars),
        }
        return json.dumps(doc).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> Program:
        doc = json.loads(data)
        if doc.get("format") != FORMAT:
            raise ValueError(f"program format {doc.get('format')} is not {FORMAT}")
        ops = [(_op(name), _dec(args), _dec(kwargs), [None if o is None else (o[0], o[1], _dec(o[2])) for o in outs])
               for name, args, kwargs, outs in doc["ops"]]
        inputs = [(tuple(shape), tuple(stride), getattr(torch, dtype), device) for shape, stride, dtype, device in doc["inputs"]]
        return cls(ops, inputs, doc["live"], tuple(doc["mutated"]), tuple(doc["lifted"]), tuple(doc["scalars"]))

    def digest(self, fingerprint: str) -> str:
        """The persistent region key: xxh3_128 of the program's structure (ops, arguments, input
        metadata, outputs, lifted floats) and the backend fingerprint. Never tensor data; the
        same in every process (Note [Region key])."""
        text = repr((FORMAT, fingerprint, self.ops, self.inputs, self.live, self.mutated, self.lifted))
        return xxhash.xxh3_128_hexdigest(text.encode())

    def example_inputs(self) -> list[torch.Tensor]:
        return [torch.empty_strided(shape, stride, dtype=dtype, device=device)
                for shape, stride, dtype, device in self.inputs]

    def graph(self) -> torch.fx.GraphModule:
        """The program as a functional ATen graph: inputs are the real tensors by slot, outputs the
        live values followed by the final values of the written real inputs."""
        from torch.fx.experimental.proxy_tensor import make_fx
        from torch.func import functionalize

        def program(*inputs):
            env: dict[int, object] = {}

            def value(a):
                if type(a) is _Ref:
                    return env[a.uid]
                if type(a) is _In:
                    return inputs[a.slot]
                if type(a) is _Lifted:
                    return _sentinel(a.index)
                if type(a) is list:
                    return [value(x) for x in a]
                return a

            for func, args, kwargs, outs in self.ops:
                res = func(*[value(a) for a in args], **{k: value(v) for k, v in kwargs.items()})
                results = res if isinstance(res, (tuple, list)) else (res,)
                for out, r in zip(outs, results):
                    if out is not None:
                        kind, uid, alias = out
                        env[uid] = value(alias) if kind == ALIAS else r
            return [env[u] for u in self.live] + [inputs[s] for s in self.mutated]

        decompositions = None
        if self.lifted:
            # decomposed ops take numbers as Tensor arguments (mul.Tensor(x, s)), which is what
            # lets a lifted float become a graph input
            from torch._decomp import core_aten_decompositions

            decompositions = core_aten_decompositions()
        with torch.no_grad():
            gm = make_fx(
                functionalize(program, remove="mutations_and_views"),
                decomposition_table=decompositions,
                tracing_mode="fake",
            )(*self.example_inputs())
        # functionalize writes mutated inputs back with trailing copy_ nodes; the fuser does
        # write-back itself (backends take functional graphs) and those values are outputs already.
        for n in list(gm.graph.nodes):
            if n.op == "call_function" and n.target is torch.ops.aten.copy_.default and not n.users:
                if n.args[0].op == "placeholder":
                    gm.graph.erase_node(n)
        gm.graph.eliminate_dead_code()
        self.lifted_inputs = self._lift(gm) if self.lifted else []
        gm.recompile()
        return gm

    def _lift(self, gm: torch.fx.GraphModule) -> list[tuple[int, torch.dtype]]:
        """Replace the sentinel floats by new placeholders; return (scalar index, dtype) per new
        input, in order. Raises LiftError when a sentinel cannot become a tensor input."""
        graph = gm.graph
        last_input = [n for n in graph.nodes if n.op == "placeholder"][-1]
        made: dict[tuple[int, torch.dtype], torch.fx.Node] = {}
        spec: list[tuple[int, torch.dtype]] = []
        for name, buf in list(gm.named_buffers()) + list(gm.named_parameters()):
            if buf.is_floating_point() and torch.isnan(buf).any():
                raise LiftError(f"a lifted float was folded into the constant {name}")
        for node in list(graph.nodes):
            if node.op != "call_function":
                continue
            schema = getattr(node.target, "_schema", None)
            for where, arg in list(enumerate(node.args)) + list(node.kwargs.items()):
                k = _sentinel_index(arg)
                if k is None:
                    continue
                if k < 0:
                    raise LiftError(f"{node.target} uses a value derived from a lifted float")
                argument = None
                if schema is not None:
                    for a in schema.arguments:
                        if (a.name == where) if type(where) is str else (schema.arguments.index(a) == where):
                            argument = a
                alpha = where == "alpha" and node.target in (torch.ops.aten.add.Tensor, torch.ops.aten.sub.Tensor)
                if not alpha and (argument is None or str(argument.type) not in ("Tensor", "Optional[Tensor]")):
                    raise LiftError(f"{node.target} needs a lifted float as a Python number")
                first = next((a for a in node.args if isinstance(a, torch.fx.Node)), None)
                other = first.meta.get("val") if first is not None else None
                dtype = torch.float64 if getattr(other, "dtype", None) is torch.float64 else torch.float32
                ph = made.get((k, dtype))
                if ph is None:
                    with graph.inserting_after(last_input):
                        ph = made[(k, dtype)] = graph.placeholder(f"lifted_{k}_{len(made)}")
                    last_input = ph
                    spec.append((k, dtype))
                if alpha:
                    # x + alpha * y with alpha an input: the Scalar alpha becomes a multiply
                    with graph.inserting_before(node):
                        scaled = graph.call_function(torch.ops.aten.mul.Tensor, (node.args[1], ph))
                    scaled.meta["val"] = node.meta.get("val")
                    node.update_arg(1, scaled)
                    node.kwargs = {k: v for k, v in node.kwargs.items() if k != "alpha"}
                elif type(where) is str:
                    node.update_kwarg(where, ph)
                else:
                    node.update_arg(where, ph)
        found = {k for k, _ in spec}
        if found != set(self.lifted):
            raise LiftError("a lifted float disappeared from the graph")
        return spec

    def lifted_examples(self) -> list[torch.Tensor]:
        values = dict(zip(self.lifted, self.scalars))
        return [torch.tensor(values[k], dtype=dt) for k, dt in self.lifted_inputs]


_ENUMS = {"$dtype": torch.dtype, "$layout": torch.layout, "$memory_format": torch.memory_format}


def _enc(x):
    # JSON keeps 1, 1.0 and True apart; everything else is tagged
    if x is None or type(x) in (bool, int, float, str):
        return x
    if type(x) is list:
        return [_enc(v) for v in x]
    if type(x) is tuple:
        return {"$tuple": [_enc(v) for v in x]}
    if type(x) is dict:
        return {"$dict": {k: _enc(v) for k, v in x.items()}}
    if type(x) is _Ref:
        return {"$ref": x.uid}
    if type(x) is _In:
        return {"$in": x.slot}
    if type(x) is _Lifted:
        return {"$lifted": x.index}
    if isinstance(x, torch.dtype):
        return {"$dtype": str(x).removeprefix("torch.")}
    if isinstance(x, torch.device):
        return {"$device": str(x)}
    if isinstance(x, torch.layout):
        return {"$layout": str(x).removeprefix("torch.")}
    if isinstance(x, torch.memory_format):
        return {"$memory_format": str(x).removeprefix("torch.")}
    if type(x) is complex:
        return {"$complex": [x.real, x.imag]}
    raise TypeError(f"cannot send {x!r} ({type(x).__name__}) to a compile worker")


def _dec(x):
    if type(x) is list:
        return [_dec(v) for v in x]
    if type(x) is not dict:
        return x
    ((tag, v),) = x.items()
    if tag == "$tuple":
        return tuple(_dec(e) for e in v)
    if tag == "$dict":
        return {k: _dec(e) for k, e in v.items()}
    if tag == "$ref":
        return _Ref(v)
    if tag == "$in":
        return _In(v)
    if tag == "$lifted":
        return _Lifted(v)
    if tag == "$device":
        return torch.device(v)
    if tag == "$complex":
        return complex(*v)
    value = getattr(torch, v)
    if not isinstance(value, _ENUMS[tag]):
        raise ValueError(f"unknown {tag} {v!r}")
    return value


def _op(name: str):
    namespace, packet, overload = name.split(".")
    return getattr(getattr(getattr(torch.ops, namespace), packet), overload)


def compile_job(payload: bytes) -> bytes:
    """Compile-worker entry point (named by import path in neff_cache.CompileJobs): a serialized
    Program and backend name in, the packed artifact out."""
    import adaptive_eager

    adaptive_eager.disable()  # NEURON_EAGER=adaptive in the environment turned it on at import
    doc = json.loads(payload)
    from .backends import get_backend

    backend = get_backend(doc["backend"], doc["device"])
    program = Program.from_bytes(doc["program"].encode())
    return _pack(*compile_program(program, backend))


def compile_program(program: Program, backend) -> tuple[bytes, list]:
    """Compile ``program`` with ``backend``: the artifact ``backend.load`` takes, and the lifted
    float inputs it expects after the real inputs ((Window.scalars index, dtype) each)."""
    gm = program.graph()
    artifact = backend.compile(gm, program.example_inputs() + program.lifted_examples())
    return artifact, program.lifted_inputs


# Note [Compile thread]
# Compiles (and artifact loads) run on a thread of their own: a flush often happens inside the
# dispatch mode's __torch_dispatch__, where Python dispatch is off for the calling thread and graph
# tracing (make_fx, functionalization) cannot work; a fresh thread has clean dispatch state. The
# thread is a daemon, so a pending compile never holds the interpreter at exit.
_QUEUE: queue.SimpleQueue | None = None


def _worker() -> None:
    while True:
        future, fn, args = _QUEUE.get()
        if future.set_running_or_notify_cancel():
            try:
                future.set_result(fn(*args))
            except BaseException as e:  # noqa: BLE001 - handed to the flushing thread
                future.set_exception(e)


def _submit(fn, *args) -> Future:
    global _QUEUE
    if _QUEUE is None:
        _QUEUE = queue.SimpleQueue()
        threading.Thread(target=_worker, name="adaptive_eager_compile", daemon=True).start()
    future: Future = Future()
    _QUEUE.put((future, fn, args))
    return future


def _pack(artifact: bytes, lifted_inputs) -> bytes:
    return pickle.dumps({"artifact": artifact, "lifted": [(i, str(dt).removeprefix("torch.")) for i, dt in lifted_inputs]})


def _unpack(data: bytes):
    doc = pickle.loads(data)
    return doc["artifact"], [(i, getattr(torch, dt)) for i, dt in doc["lifted"]]


def _load(data: bytes, backend):
    artifact, lifted_inputs = _unpack(data)
    return backend.load(artifact), lifted_inputs, None  # no compile seconds: it came from disk


def _compile_and_store(program: Program, backend, store, pkey: str):
    t0 = time.perf_counter()
    try:
        artifact, lifted_inputs = compile_program(program, backend)
        seconds = time.perf_counter() - t0
        store.put(pkey, _pack(artifact, lifted_inputs), fingerprint=backend.fingerprint(), backend=backend.name,
                  compile_seconds=seconds)
    finally:
        store.release(pkey)
    return backend.load(artifact), lifted_inputs, seconds


_STORES: dict = {}


def _store(options):
    """The persistent artifact store of ``options.cache_dir`` (one per directory and process)."""
    from neff_cache import ArtifactStore

    where = (os.path.expanduser(options.cache_dir), options.cache_size_mb, os.getpid())
    store = _STORES.get(where)
    if store is None:
        store = _STORES[where] = ArtifactStore(where[0], size_limit_mb=options.cache_size_mb)
    return store


def _collect(entry: _Entry) -> None:
    """Take a finished compile's (or load's) result, blocking if it is still running."""
    future, entry.future = entry.future, None
    try:
        entry.run, lifted_inputs, seconds = future.result()
    except LiftError as e:
        # The floats cannot be graph inputs: from now on windows of this structure are keyed by
        # their values (each value compiles once it is hot) instead.
        log.info("adaptive_eager: float arguments stay compile-time constants: %s", e)
        STATS.not_compiled["unliftable_scalars"] += 1
        entry.blacklisted = True
        if entry.group is not None:
            entry.group.unliftable = True
            entry.group.lifted = ()
        return
    except Exception as e:  # noqa: BLE001 - any compiler failure means: replay this key
        STATS.compile_failures += 1
        _blacklist(entry, f"compile failed: {type(e).__name__}: {e}")
        return
    entry.lifted_inputs = lifted_inputs
    if seconds is None:
        STATS.cache_hits_disk += 1
        return
    STATS.compile_seconds += seconds
    STATS.regions_compiled += 1
    log.info("adaptive_eager: compiled a region in %.2fs", seconds)


__all__ = ["run", "Program", "compile_program", "CACHE", "STATS", "ReplayError", "VIEW"]

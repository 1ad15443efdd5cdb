"""A window and the captured graph that reads its values, run as one compiled program
(Note [Joined runs])."""

from __future__ import annotations

import threading

from .backends._common import launches_of
from .program import Program, _In, _Ref
from .replay import _bind, as_recorded, release_placeholders, restore_placeholders
from .scalars import _scalar_tensor
from .stats import STATS
from .window import OUTS_PER_NODE, VIEW, FlushResult, Out

# Note [Joined runs]
# ~~~~~~~~~~~~~~~~~~
# A training step whose module call is captured (Note [Captured modules] in adaptive_eager._capture)
# leaves a small window between its forward and its backward: the loss, ``ones_like(loss)`` and the
# loss's backward (3 ops for ``mse_loss``, 5 and 2 detaches for cross-entropy), whose results are
# the tangents of the captured backward graph. The backward's call needs them real, so the window
# ran as an executable of its own, then the backward as another: 4 launches a step (forward, that
# window, backward, optimizer step) where 3 do (issue 33).
# So the backward's call asks for a joined run (``request``, per thread: the flush it triggers may
# run another thread's window, the owner's, in this thread) and the flush of the window that holds
# its tangents, once that window's region has its callable, runs one program instead: the window's
# ops, then the graph's, the graph reading the window's values (``_Ref``) where its inputs are
# pending in it and taking its other inputs (saved activations, real) as inputs after the window's
# (``joined_program``). It returns the window's live values, bound as the window's own run binds
# them, then the graph's outputs, handed back to the graph's call. Keyed in memory by the window's
# region entry (its exact structure and baked floats: Note [Region key] in fuser.regions), the
# graph, and which live value each graph input is; persistently by the joined Program's digest, so
# it compiles in a worker and loads from the store as any region. Until it has its callable, and
# for every window the join does not fit, the window runs alone and the graph after it, as
# before: two launches, each such run counted in ``not_joined`` by why. Not joined: a window or
# graph that writes a real input (the fallback after a failed joined run must find every input as
# it was), a graph input pending in the window but not live, a window whose region has no
# callable, a validated window whose joined program was not built yet (its nodes are the tracer's
# records: built at the next unvalidated run of its region). A joined run that raises runs the
# window alone and the graph after it, where eager's error is raised; one that fails otherwise
# blacklists the joined program. Nothing is written before the run returns, so the fallback
# starts from the inputs the joined run saw.
# Only for backends whose executable is a device launch (``joins_runs``: stablehlo and neuron).
# Inductor's steps ran no faster joined (rnn, blocks8 and cnn of benchmarks/user_step.py on cpu:
# medians within 2% either way, benchmarks/RESULTS.md), and the joined program is a compile that
# only a process whose captured graphs are compiled ever asks for: the first warm process on a
# cache, whose compiled steps it slowed to 0.4-1.1 s while a worker compiled it.
_tls = threading.local()


class JoinRequest:
    """A captured graph's call that may run joined with the window holding its inputs: ``graph``
    (its ``program``, ``joins`` and ``options``), its ``args``; ``outs`` the graph's outputs once a
    joined run made them."""

    __slots__ = ("graph", "args", "outs", "backend")

    def __init__(self, graph, args, backend):
        self.graph = graph
        self.args = args
        self.backend = backend
        self.outs = None


class request:
    """While a captured graph's call syncs its inputs: the flush may run it joined."""

    __slots__ = ("req", "prior")

    def __init__(self, req: JoinRequest):
        self.req = req

    def __enter__(self) -> JoinRequest:
        self.prior = getattr(_tls, "request", None)
        _tls.request = self.req
        return self.req

    def __exit__(self, *exc) -> None:
        _tls.request = self.prior


def finished(graph, args):
    """The outputs of ``graph``'s call with ``args`` if a flush just ran it joined (its request made
    where the flush was, ahead of the call: ``adaptive_eager._compile``'s graph aside), else None."""
    req = _tls.__dict__.pop("finished", None)
    if req is None or req.graph is not graph or len(req.args) != len(args) or any(
            a is not b for a, b in zip(req.args, args)):
        return None
    return req.outs


def done(req: JoinRequest) -> None:
    """``req`` ran joined before its graph's call (``finished``)."""
    _tls.finished = req


def joined_program(window_program: Program, graph: Program, mapping: tuple) -> Program:
    """The window's program followed by ``graph``'s ops: ``mapping[slot]`` is the uid of the window
    value that graph input ``slot`` is, or -1 for an input of its own (after the window's)."""
    offset = 1 + max([o[1] for op in window_program.ops for o in op[3] if o is not None] + list(window_program.live),
                     default=0)
    n_in = len(window_program.inputs)
    own = [slot for slot, m in enumerate(mapping) if m < 0]
    slot_of = {slot: n_in + k for k, slot in enumerate(own)}

    def enc(a):
        t = type(a)
        if t is _Ref:
            return _Ref(a.uid + offset)
        if t is _In:
            m = mapping[a.slot]
            return _Ref(m) if m >= 0 else _In(slot_of[a.slot])
        if t is list:
            return [enc(x) for x in a]
        return a

    ops = list(window_program.ops)
    for func, args, kwargs, outs in graph.ops:
        ops.append((func, [enc(a) for a in args], {k: enc(v) for k, v in kwargs.items()},
                    [None if o is None else (o[0], o[1] + offset, None if o[2] is None else enc(o[2])) for o in outs]))
    return Program(ops, list(window_program.inputs) + [graph.inputs[s] for s in own],
                   list(window_program.live) + [u + offset for u in graph.live], (), window_program.lifted,
                   window_program.scalars, default_dtype=window_program.default_dtype)


def _not_joined(why: str) -> None:
    STATS.not_joined[why] += 1


def try_joined(entry, flush, outcome: str) -> FlushResult | None:
    """Run ``flush``'s window joined with this thread's requesting graph, or None: the window runs
    alone (Note [Joined runs]). Called with ``table.LOCK`` held, where the window's region is
    about to run its callable."""
    req = getattr(_tls, "request", None)
    if req is None or req.outs is not None:
        return None
    window = flush.window
    marks = [getattr(t, "_ae", None) for t in req.args]
    if not any(type(o) is Out and o.win is window.token for o in marks):
        return None  # nothing of this graph's is pending in this window: not its window
    _tls.request = None  # taken: no later window of this call is joined with it
    graph = req.graph
    if flush.mutated or graph.program is None or graph.program.mutated:
        _not_joined("writes_inputs")
        return None
    live = {id(o) for o in flush.live}
    mapping = []
    for o in marks:
        if type(o) is Out and o.win is window.token:
            if id(o) not in live and (o.kind != VIEW or flush.validated):
                _not_joined("not_live")
                return None
            mapping.append(o.uid)  # a view: Note [Joined views]
        else:
            mapping.append(-1)
    mapping = tuple(mapping)
    joins = graph.joins.setdefault(entry, {})
    joint = joins.get(mapping)
    if joint is None:
        if flush.validated:
            _not_joined("validated")
            return None
        joint = joins[mapping] = _new(entry, flush, graph, mapping, req.backend)
        if joint is None:
            return None
    if joint.run is None:
        from .regions import poll

        poll(joint, req.backend, graph.options)
        if joint.run is None:
            _not_joined(joint.blacklisted or "compiling")
            return None
    return _run(entry, joint, flush, req, mapping, outcome)


def _new(entry, flush, graph, mapping: tuple, backend):
    """The joined region of ``entry``'s window and ``graph``, its compile started (Note [Joined runs])."""
    from .compile import cache_fingerprint
    from .table import _Entry

    flush.mark()
    _views_needed(flush.window, mapping)
    program = Program.from_window(flush.window, flush.live, flush.mutated, flush.lifted, derived=flush.derived)
    joint = _Entry()
    joint.program = joined_program(program, graph.program, mapping)
    try:
        joint.pkey = joint.program.digest(cache_fingerprint(backend))
    except TypeError:
        _not_joined("unencodable_argument")
        joint.blacklisted = "unencodable_argument"
        return joint
    joint.region = joint.pkey[:8]
    joint.n_live = len(joint.program.live)
    joint.counts = entry.counts
    return joint


# Note [Joined views]
# ~~~~~~~~~~~~~~~~~~~~
# A captured backward's tangent may be a view of a window value rather than the value itself: a
# loss on ``model(x).reshape(-1, vocab)`` hands the backward the ``view`` of its gradient back to
# the model's output shape. A view is not a live output of its window (its base is: the view shares
# the base's placeholder, Note [Out kinds] in fuser.window), so the join declined it (``not_live``)
# and the loss window ran alone before the backward: 6 launches a step in
# examples/finetune_transformer.py on the emulated device where 5 do. A graph input is named by
# the uid of the window value it is, and the nodes of such views (and of views they are views of)
# are marked needed before the joined program is built, so the graph reads the view computed in
# the program. Their window is not validated there (its nodes are Nodes, Note [Joined runs]).
def _views_needed(window, mapping: tuple) -> None:
    """Mark the nodes of the window's views that ``mapping`` names needed (Note [Joined views])."""
    todo = [uid for uid in mapping if uid >= 0]
    while todo:
        node = window.nodes[todo.pop() // OUTS_PER_NODE - 1]
        if node.needed:
            continue
        node.needed = True
        todo += [a.uid for a in node.args if type(a) is Out and a.kind == VIEW]


def _run(entry, joint, flush, req: JoinRequest, mapping: tuple, outcome: str) -> FlushResult | None:
    from .backends._common import EagerWouldRaise
    from .compile import _Unverified
    from .regions import _blacklist

    window, live = flush.window, flush.live
    inputs = list(window.real_inputs) + [t for t, m in zip(req.args, mapping) if m < 0]
    if joint.lifted_inputs:
        inputs += [_scalar_tensor(window.scalars[i], dtype=dt) for i, dt in joint.lifted_inputs]
    check = type(joint.run) is _Unverified  # Note [Artifacts from disk] in fuser.compile
    run = joint.run.run if check else joint.run
    with as_recorded():
        released: list = []
        try:
            release_placeholders(live, released)  # Note [Placeholder memory at a compiled run]
            outs = run(inputs)
            if check:
                _check(joint, live, req.graph, outs)
        except BaseException as e:
            restore_placeholders(released)
            if not isinstance(e, Exception):
                raise
            if not isinstance(e, EagerWouldRaise):
                if check:
                    joint.run.store.discard(joint.pkey, f"its first run failed: {type(e).__name__}: {e}")
                _blacklist(joint, f"joined run failed: {type(e).__name__}: {e}", "run_failed")
            _not_joined("run_failed" if not isinstance(e, EagerWouldRaise) else "eager_would_raise")
            return None
        copies = 0
        for o, r in zip(live, outs):
            copies += _bind(o, r)
    if check:
        joint.run = run
    req.outs = outs[len(live):]
    STATS.compiled_runs += 1
    STATS.joined_runs += 1
    return FlushResult(launches_of(run) + copies, *entry.counts, outcome, joint.region, entry)


def _check(joint, live: list, graph, outs) -> None:
    """The first outputs of a joined artifact from disk (Note [Artifacts from disk] in fuser.compile)."""
    if len(outs) != joint.n_live:
        raise RuntimeError(f"{len(outs)} outputs for {joint.n_live}")
    for o, r in zip(live, outs):
        if (tuple(r.shape), tuple(r.stride()), r.dtype) != (tuple(o.meta[0]), tuple(o.meta[1]), o.meta[2]):
            raise RuntimeError(f"output {tuple(r.shape)} {r.dtype} for placeholder {tuple(o.meta[0])} {o.meta[2]}")
    for r, (shape, dtype) in zip(outs[len(live):], graph.expected):
        if tuple(r.shape) != shape or r.dtype != dtype:
            raise RuntimeError(f"output {tuple(r.shape)} {r.dtype} for {shape} {dtype}")

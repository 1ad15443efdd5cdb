"""A captured graph's AOTAutograd trace, run in a compile worker process (Note [Traces off the step]
in ``_capture``): ``trace_job`` is the job's function, bytes in (the graph's record document) and
bytes out (its record), resolved by ``neff_cache`` in a worker whose ``sys.path`` is the program's.
"""

from __future__ import annotations

import json
import types

import torch
import torch._functorch.config
import torch._inductor.config

from ._capture import _RECORD_FORMAT, _aot_trace, _by_name, _Decline, _record_doc, _record_of, follow_up_compiles


def trace_job(payload: bytes) -> bytes:
    """The record of the graph that ``payload`` (``_capture._record_doc``) describes; ``_Decline``
    (remembered by the store as the job's failure) for one this process cannot trace as the
    program would."""
    doc = json.loads(payload)
    if type(doc) is not list or len(doc) != 12 or doc[0] != _RECORD_FORMAT or doc[1] != "capture":
        raise _Decline("format", "not a capture's record document")
    _, _, who, backend, _, names, tensors, nodes, state, functorch, fallback_random, dropout = doc
    if any(t[5] != "cpu" for t in tensors):
        raise _Decline("device", "a trace job takes cpu graphs")
    gm = _graph_module(names, tensors[:len(names)], nodes)
    inputs = [_tensor(t) for t in tensors[len(names):]]
    options = types.SimpleNamespace(backend=backend, device="cpu", dropout=dropout)
    current = torch._functorch.config.get_config_copy()
    with torch.set_grad_enabled(bool(state.get("grad_mode"))), \
            torch._functorch.config.patch({k: v for k, v in functorch.items() if current.get(k) != v}), \
            torch._inductor.config.patch(fallback_random=fallback_random):
        # what the key says AOTAutograd reads is what it will read here, or the job declines
        if _record_doc(gm, inputs, options, who) != payload:
            raise _Decline("rebuild", "the rebuilt graph or this process's state differs from the program's")
        _, graphs, meta = _aot_trace(gm, inputs, options, who, True)
        record = _record_of(graphs, meta)
    # a program gone before it reads the record submits none of its graphs' compiles: the worker
    # runs them (Note [Follow-up compiles after exit] in neff_cache._worker)
    follow_up_compiles(record, backend, "cpu")
    return json.dumps(record).encode()


def _tensor(meta: list) -> torch.Tensor:
    """A zeroed tensor of the recorded type, shape, stride, offset, dtype and ``requires_grad``:
    AOTAutograd reads its metadata only."""
    kind, shape, stride, offset, dtype, _, requires_grad = meta
    dtype = getattr(torch, dtype.removeprefix("torch."))
    with torch.no_grad():
        if offset:
            size = offset + 1 + sum((n - 1) * s for n, s in zip(shape, stride)) if all(shape) else offset
            t = torch.empty(0, dtype=dtype).set_(
                torch.zeros(size, dtype=dtype).untyped_storage(), offset, shape, stride)
        else:
            t = torch.empty_strided(shape, stride, dtype=dtype).zero_()
    if kind == "Parameter":
        return torch.nn.Parameter(t, requires_grad=requires_grad)
    return t.requires_grad_(requires_grad)


def _graph_module(names: list, attrs: list, nodes: list) -> torch.fx.GraphModule:
    """Dynamo's graph again: its nodes, targets imported by name, and its attributes as parameters
    and buffers registered in the recorded order (which AOTAutograd's inputs follow)."""
    from fuser.backends._common import decode_value

    root = torch.nn.Module()
    params, buffers = [], []
    for name, meta in zip(names, attrs):
        if "." in name or not name.isidentifier():
            raise _Decline("attribute", name)
        if meta[0] == "Parameter":
            root.register_parameter(name, _tensor(meta))
            params.append(name)
        else:
            root.register_buffer(name, _tensor(meta))
            buffers.append(name)
    if names != params + buffers:
        raise _Decline("attribute", "parameters after buffers")
    graph = torch.fx.Graph()
    env: dict = {}
    tags = {"$node": lambda name: env[name], "$ellipsis": lambda _: Ellipsis}
    tags["$slice"] = lambda v: slice(*(decode_value(e, tags) for e in v))
    for op, name, target, args, kwargs in nodes:
        if op == "call_function":
            target = _resolve(target)
        node = graph.create_node(op, target, tuple(decode_value(args, tags)), decode_value(kwargs, tags), name=name)
        env[name] = node
    gm = torch.fx.GraphModule(root, graph)
    # GraphModule copies the attributes its get_attr nodes read, in their order: the recorded one
    gm._parameters = {name: root._parameters[name] for name in params}
    gm._buffers = {name: root._buffers[name] for name in buffers}
    for name in names:
        if name in gm.__dict__:
            del gm.__dict__[name]
    return gm


def _resolve(name: str):
    """``_capture._importable_name``'s target back."""
    target = _by_name(name)
    if target is None:
        raise _Decline("target", name)
    return target

"""The replay backend: the graph itself is the artifact, run op by op eagerly.

It is the reference the compiled backends are tested against and the fallback for regions they
cannot compile: same ops, same order, same kernels as eager, so values are bitwise eager.

The artifact is JSON, not a pickle: it names ops and encodes arguments explicitly, so loading it
runs no stored code, and a graph with an argument it cannot describe (a generator, a symbolic size)
fails at compile time with the op named instead of at load time in another process.
"""

from __future__ import annotations

import json
import operator
from collections.abc import Callable

import torch

from ._common import (
    BackendCompileError, below_autograd, check_graph, decode_torch_value, encode_torch_value, op_name,
)

_FORMAT = 1


class ReplayBackend:
    """Serializes the graph; ``load`` rebuilds it as straight-line Python calling the same ops."""

    name = "replay"

    def __init__(self, device_type: str) -> None:
        self.device_type = device_type
        self._fingerprint = f"replay-{_FORMAT}|torch-{torch.__version__}|{device_type}"

    def fingerprint(self) -> str:
        """Format version, torch version, device type: replay code depends on nothing else."""
        return self._fingerprint

    def compile(self, gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> bytes:
        """Encode ``gm`` as JSON (reads the graph, never mutates it)."""
        check_graph(self.name, gm, example_inputs)
        index: dict[torch.fx.Node, int] = {}
        nodes = []
        outputs: list[dict] = []
        for node in gm.graph.nodes:
            if node.op == "placeholder":
                index[node] = len(index)
            elif node.op == "call_function":
                op = op_name(node.target)
                nodes.append(
                    {
                        "op": op,
                        "args": _encode(node.args, index, op),
                        "kwargs": {k: _encode(v, index, op) for k, v in node.kwargs.items()},
                    }
                )
                index[node] = len(index)
            elif node.op == "output":
                outputs = [_encode(n, index, "output") for n in node.args[0]]
        doc = {
            "format": _FORMAT,
            "fingerprint": self._fingerprint,
            "inputs": len(example_inputs),
            "nodes": nodes,
            "outputs": outputs,
        }
        return json.dumps(doc, separators=(",", ":")).encode()

    def load(self, artifact: bytes) -> Callable[[list[torch.Tensor]], tuple[torch.Tensor, ...]]:
        """Rebuild the graph from ``artifact`` and return a callable running it eagerly."""
        try:
            doc = json.loads(artifact)
            fingerprint = doc["fingerprint"]
        except (ValueError, TypeError, KeyError) as e:
            raise BackendCompileError(f"replay: artifact is not a replay graph: {e}") from e
        if fingerprint != self._fingerprint:
            raise BackendCompileError(
                f"replay: artifact was made for {fingerprint!r}, this process is {self._fingerprint!r}"
            )
        graph = torch.fx.Graph()
        try:
            values: list[torch.fx.Node] = [graph.placeholder(f"in{i}") for i in range(doc["inputs"])]
            for node in doc["nodes"]:
                target = _resolve_op(node["op"])
                args = _decode(node["args"], values)
                kwargs = {k: _decode(v, values) for k, v in node["kwargs"].items()}
                values.append(graph.call_function(target, args, kwargs))
            graph.output(tuple(_decode(o, values) for o in doc["outputs"]))
        except (ValueError, TypeError, KeyError, IndexError, AttributeError) as e:
            raise BackendCompileError(f"replay: artifact is malformed: {type(e).__name__}: {e}") from e
        forward = torch.fx.GraphModule(torch.nn.Module(), graph).forward
        return below_autograd(lambda inputs: forward(*inputs))


def _encode(x: object, index: dict[torch.fx.Node, int], op: str) -> object:
    # JSON keeps 1, 1.0 and True apart, so scalar types survive; everything else is tagged.
    if x is None or type(x) in (bool, int, float, str):
        return x
    if isinstance(x, torch.fx.Node):
        return {"$n": index[x]}
    if isinstance(x, list):  # FX stores lists as immutable_list
        return [_encode(v, index, op) for v in x]
    if isinstance(x, tuple):
        return {"$tuple": [_encode(v, index, op) for v in x]}
    tagged = encode_torch_value(x)
    if tagged is None:
        raise BackendCompileError(f"replay: cannot compile {op}: argument {x!r} ({type(x).__name__}) cannot be stored")
    return tagged


def _decode(x: object, values: list[torch.fx.Node]) -> object:
    if type(x) is list:
        return [_decode(v, values) for v in x]
    if type(x) is not dict:
        return x
    ((tag, v),) = x.items()
    if tag == "$n":
        return values[v]
    if tag == "$tuple":
        return tuple(_decode(e, values) for e in v)
    try:
        return decode_torch_value(tag, v)
    except ValueError:
        raise BackendCompileError(f"replay: artifact holds an unknown value {x!r}") from None


def _resolve_op(name: str) -> object:
    if name == "operator.getitem":
        return operator.getitem
    try:
        namespace, packet, overload = name.split(".")
        return getattr(getattr(getattr(torch.ops, namespace), packet), overload)
    except (ValueError, AttributeError, RuntimeError) as e:
        raise BackendCompileError(f"replay: cannot load {name}: no such op in this process ({e})") from e

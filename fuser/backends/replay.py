"""The replay backend: the graph itself is the artifact, run op by op eagerly.

It is the reference the compiled backends are tested against and the fallback for regions they
cannot compile: same ops, same order, same kernels as eager, so values are bitwise eager.

The artifact is JSON, not a pickle: it names ops and encodes arguments explicitly, so loading it
runs no stored code, and a graph with an argument it cannot describe (a generator, a symbolic size)
fails at compile time with the op named instead of at load time in another process.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import torch

from ._common import (
    BackendCompileError, below_autograd, check_graph, decode_arg, encode_arg, launches_op, op_name, resolve_op,
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
                        "args": encode_arg(node.args, index, self.name, op),
                        "kwargs": {k: encode_arg(v, index, self.name, op) for k, v in node.kwargs.items()},
                    }
                )
                index[node] = len(index)
            elif node.op == "output":
                outputs = [encode_arg(n, index, self.name, "output") for n in node.args[0]]
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
        gm = self.graph_module(artifact)
        forward = gm.forward
        run = below_autograd(lambda inputs: forward(*inputs))
        # each op that computes is one launch (Note [Launches of a compiled callable] in fuser.backends._common)
        run.launches = sum(1 for n in gm.graph.nodes if n.op == "call_function" and launches_op(n.target))
        return run

    def graph_module(self, artifact: bytes) -> torch.fx.GraphModule:
        """The graph ``artifact`` holds, rebuilt (the neuron backend's fallback compiles it too)."""
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
                target = resolve_op(node["op"], self.name)
                args = decode_arg(node["args"], values, self.name)
                kwargs = {k: decode_arg(v, values, self.name) for k, v in node["kwargs"].items()}
                values.append(graph.call_function(target, args, kwargs))
            graph.output(tuple(decode_arg(o, values, self.name) for o in doc["outputs"]))
        except (ValueError, TypeError, KeyError, IndexError, AttributeError, AssertionError) as e:  # FX asserts
            raise BackendCompileError(f"replay: artifact is malformed: {type(e).__name__}: {e}") from e
        return torch.fx.GraphModule(torch.nn.Module(), graph)

"""Composites whose C++ kernel reads an argument's memory without dispatching (Note [Composites
that read memory] in adaptive_eager._ops): with the argument pending, they split, pad or size by
whatever the placeholder's memory held. Reached through references bound before adaptive eager
was turned on, and under every grad mode; plain eager is the oracle."""

import threading

import pytest
import torch
from torch import tensor_split  # bound before adaptive eager is ever on: no wrapper of ours in it
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence, pad_packed_sequence

import adaptive_eager as ae

TENSOR_SPLIT = torch.Tensor.tensor_split  # the method, bound early too
X = torch.arange(10.0)
INDICES = torch.tensor([2, 5])


def _split(fn):
    return lambda: [p.clone() for p in fn(X * 2, INDICES + 1)]  # both pending


def _sparse(check):
    """The size it infers reads ``indices.max()``; with ``check``, its validation reads them too."""
    indices = torch.tensor([[0, 3], [1, 2]]) + 0
    return lambda: [torch.sparse_coo_tensor(indices, torch.ones(2) * 2, check_invariants=check).to_dense()]


torch.manual_seed(0)
SEQ, LENGTHS = torch.randn(3, 6, 4), torch.tensor([6, 4, 2])
LSTM = torch.nn.LSTM(4, 3)


def _padded():
    packed = pack_padded_sequence(SEQ, LENGTHS, batch_first=True)
    padded, lengths = pad_packed_sequence(PackedSequence(packed.data * 1, packed.batch_sizes + 0), batch_first=True)
    return [padded.detach().clone(), lengths]


def _lstm():
    """``torch.lstm``'s packed overload, called as nn.LSTM calls it (which reads ``batch_sizes[0]``
    on the host itself first, so it never sees a pending one)."""
    packed = pack_padded_sequence(SEQ, LENGTHS, batch_first=True)
    hx = (torch.zeros(1, 3, 3), torch.zeros(1, 3, 3))
    out = torch.lstm(packed.data * 1, packed.batch_sizes + 0, hx, tuple(LSTM._flat_weights), True, 1, 0.0, True, False)
    out[0].sum().backward()
    grad = LSTM.weight_ih_l0.grad.clone()
    LSTM.zero_grad()
    return [out[0].detach().clone(), grad]


def _split_backward():
    x = X.clone().requires_grad_()
    parts = tensor_split(x * 2, INDICES + 1)
    (parts[0].sum() + parts[2].sum() * 3).backward()
    return [p.detach().clone() for p in parts] + [x.grad]


CASES = {
    "tensor_split_bound_early": _split(tensor_split),
    "method_bound_early": _split(TENSOR_SPLIT),
    "tensor_split_keyword": lambda: [p.clone() for p in tensor_split(X * 2, tensor_indices_or_sections=INDICES + 1)],
    "tensor_split_backward": _split_backward,
    "pad_packed_sequence": _padded,
    "lstm_packed": _lstm,
    "sparse_coo_tensor_size": lambda: _sparse(False)(),
    "sparse_coo_tensor_checked": lambda: _sparse(True)(),
}
GRAD_MODES = {"grad": torch.enable_grad, "no_grad": torch.no_grad, "inference_mode": torch.inference_mode}


BACKWARD = ("tensor_split_backward", "lstm_packed")  # run under grad mode only


@pytest.mark.parametrize("case, grad_mode", [(c, g) for c in CASES for g in GRAD_MODES if g == "grad" or c not in BACKWARD])
def test_a_composite_reads_pending_memory_as_eager_does(case, grad_mode):
    with GRAD_MODES[grad_mode]():
        want = CASES[case]()
        with ae.adaptive_eager(backend="replay"):
            got = CASES[case]()
    assert [g.shape for g in got] == [w.shape for w in want]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
    assert ae.metrics()["flushes"].get("host_indices", 0) >= 1


def test_after_adaptive_eager_the_kernels_run_eagers_composite():
    name = "aten::tensor_split.tensor_indices_or_sections"
    with ae.adaptive_eager(backend="replay"):
        assert "AutogradCPU: registered" in torch._C._dispatch_dump(name)
    x = X.clone().requires_grad_()
    parts = tensor_split(x * 1, INDICES)
    sum(p.sum() * (i + 1) for i, p in enumerate(parts)).backward()
    assert x.grad.tolist() == [1.0, 1.0, 2.0, 2.0, 2.0, 3.0, 3.0, 3.0, 3.0, 3.0]
    assert [p.tolist() for p in tensor_split(X, INDICES)] == [[0.0, 1.0], [2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0, 9.0]]


def test_a_thread_without_the_mode_splits_as_eager_does():
    got = []
    with ae.adaptive_eager(backend="replay"):
        y = X * 2  # pending here, while the other thread splits its own tensors
        worker = threading.Thread(target=lambda: got.append([p.tolist() for p in tensor_split(X, INDICES + 1)]))
        worker.start()
        worker.join(60)
    assert got == [[[0.0, 1.0, 2.0], [3.0, 4.0, 5.0], [6.0, 7.0, 8.0, 9.0]]]
    assert ae.metrics()["flushes"].get("host_indices", 0) == 0
    torch.testing.assert_close(y, X * 2)


def test_torch_compile_after_adaptive_eager_traces_the_composite_as_without_it():
    """The kernels stay registered after a block: under the Python dispatcher (Dynamo's fake
    tensors) they must do what the key does without them, the op's Python decomposition; the
    C++ composite would read a fake tensor's memory and fail the compile."""
    with ae.adaptive_eager(backend="replay"):
        pass
    torch._dynamo.reset()
    f = torch.compile(lambda x, i: [p * 2 for p in torch.tensor_split(x, i)], backend="aot_eager")
    assert [p.tolist() for p in f(X, INDICES)] == [[0.0, 2.0], [4.0, 6.0, 8.0], [10.0, 12.0, 14.0, 16.0, 18.0]]


def _reads_memory(info, sample) -> bool:
    """Whether ``info``'s op, on ``sample``, reads an argument's memory without dispatching: each
    tensor is a functional wrapper, whose memory access raises (its ops dispatch as usual)."""
    from torch.utils._pytree import tree_map

    def wrap(x):
        return torch._to_functional_tensor(x) if isinstance(x, torch.Tensor) else x

    args = tree_map(wrap, (sample.input, *sample.args))
    kwargs = tree_map(wrap, dict(sample.kwargs))
    torch._enable_functionalization(reapply_views=True)
    try:
        info.op(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - only the memory read is asked about
        return "data is not allocated" in str(e)
    finally:
        torch._disable_functionalization()
    return False


def _composite(info) -> bool:
    """Whether an overload of the ATen op ``info`` names has a CompositeImplicitAutograd kernel:
    only such a kernel runs above the dispatch mode (what eager's kernels read, the mode sees)."""
    packet = getattr(torch.ops.aten, info.aten_name or info.name.split(".")[-1], None)
    if packet is None:
        return True  # a Python function over several ops: sweep it
    name = packet._qualified_op_name
    for o in packet.overloads():
        try:
            if torch._C._dispatch_has_kernel_for_dispatch_key(name + ("." + o if o != "default" else ""),
                                                              "CompositeImplicitAutograd"):
                return True
        except RuntimeError:  # an overload TorchScript alone has (``aten::acos.int``)
            pass
    return False


@pytest.mark.slow
def test_no_composite_of_the_opinfo_database_reads_memory_unlisted():
    """Sweep OpInfo: an op whose composite reads a tensor's memory in C++ must be in HOST_READERS
    (a new torch may add one; its pending argument would be read as uninitialized memory)."""
    import warnings

    from torch.testing._internal.common_methods_invocations import op_db

    from adaptive_eager._ops import HOST_READERS

    listed = {name.split(".")[1] for name in HOST_READERS}
    found, swept = set(), 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for info in op_db:
            if not _composite(info):
                continue
            dtypes = info.supported_dtypes("cpu")
            if not dtypes:
                continue
            dtype = torch.float32 if torch.float32 in dtypes else (torch.int64 if torch.int64 in dtypes else next(iter(dtypes)))
            try:
                samples = list(info.sample_inputs("cpu", dtype, requires_grad=False))
            except Exception:  # noqa: BLE001 - a sample generator that needs what this machine lacks
                continue
            swept += 1
            if any(_reads_memory(info, s) for s in samples):
                found.add(info.aten_name or info.name)
    assert swept > 100
    assert "tensor_split" in found  # the sweep sees the read it is for
    assert found <= listed, f"composites reading memory, not in HOST_READERS: {sorted(found - listed)}"

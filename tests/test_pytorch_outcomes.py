"""Outcomes PyTorch's own test files (test_view_ops.py, test_indexing.py, ...) check, reduced to
their cases: each gives eager's outcome under adaptive eager. Plain eager is the oracle.

- sparse and mkldnn tensors are never recorded, probed or asked for storage; an op that takes or
  makes one runs eagerly, after its pending dense inputs are computed (Note [Tensors the mode
  leaves alone] in adaptive_eager/_state.py);
- another device's tensors (torch's ``lazy`` TorchScript backend) are left as eager leaves them,
  and nothing the library does crashes the interpreter on them (a child process each: a crash is
  a segmentation fault, and the lazy backend is process-wide);
- a warning an op's kernel gives reaches ``warnings`` once per statement, at the user's line, also
  for an in-place op whose stand-in run fails on its values (Note [Kernel warnings]);
- ``as_strided`` of a view of a computed value reads that value's storage in a compiled region too
  (Note [as_strided over a computed storage] in fuser/backends/inductor.py).
"""

import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

import adaptive_eager as ae
from adaptive_eager._metrics import METRICS
from _device import COMPILED_BACKEND, NEURON
from _oracle import program_env

REPLAY = dict(backend="replay")
COMPILED = dict(backend=COMPILED_BACKEND, hot_after=1, async_compile=False)  # compiled from first sight
OPTIONS = pytest.mark.parametrize("options", [REPLAY, COMPILED], ids=["replay", "compiled"])


def _quiet():
    """Sparse CSR's "beta" and the invariant-check notices: eager gives them too, once a process."""
    ctx = warnings.catch_warnings()
    ctx.__enter__()
    warnings.simplefilter("ignore")
    return ctx


def _dense(t):
    return t.to_dense() if t.layout is not torch.strided else t


def _csr():
    return torch.sparse_csr_tensor(torch.tensor([0, 1, 3]), torch.tensor([1, 0, 2]),
                                   torch.tensor([1.0, 2.0, 3.0]), (2, 3), device="cpu")


# each case: a function of a dense input; its result is compared with eager's after to_dense
SPARSE_CASES = {
    # a view of a sparse tensor ("Cannot access storage of SparseTensorImpl")
    "t_of_0dim_coo": lambda x: x[0, 0].to_sparse().t(),
    "t_of_coo": lambda x: x.to_sparse().t(),
    # CSR has no strides ("Sparse CSR tensors do not have strides")
    "crow_indices": lambda x: _csr().crow_indices() + x.shape[0],
    "col_indices": lambda x: _csr().col_indices(),
    "csr_values_of_pending": lambda x: (x * 2).to_sparse_csr().values() + 1,
    # to_sparse of a pending value ("copy_() between dense and sparse Tensors")
    "to_sparse_of_pending": lambda x: (x * 2).to_sparse(),
    "to_sparse_of_pending_then_dense": lambda x: (x + 1).to_sparse().to_dense() * 3,
    "to_sparse_csc_of_pending": lambda x: (x - 1).to_sparse_csc(),
    "to_sparse_bsr_of_pending": lambda x: (x * x).to_sparse_bsr((1, 1)),
    "sparse_mm_of_pending": lambda x: torch.sparse.mm(x.to_sparse(), (x * 3).t()),
    "sparse_plus_pending": lambda x: x.to_sparse() + (x * 2).to_sparse(),
    "dense_plus_sparse": lambda x: (x * 2) + x.to_sparse(),
    "mkldnn_of_pending": lambda x: (x * 2).to_mkldnn().to_dense() + 1,
    "coalesce_indices": lambda x: (x * 2).to_sparse().coalesce().indices() * 1,
}


@OPTIONS
@pytest.mark.parametrize("name", list(SPARSE_CASES))
@pytest.mark.skipif(NEURON, reason="sparse layouts are CPU's here")
def test_sparse_tensors_give_eager_values(name, options):
    case = SPARSE_CASES[name]
    x = torch.arange(12.0).reshape(3, 4) - 5
    x[1, 2] = 0
    ctx = _quiet()
    try:
        expected = _dense(case(x.clone()))
        with ae.adaptive_eager(**options):
            for _ in range(3):  # the PyTorch tests run a case several times: records, then hot windows
                got = _dense(case(x.clone()))
                torch.testing.assert_close(got, expected, rtol=0, atol=0)
    finally:
        ctx.__exit__(None, None, None)


@pytest.mark.skipif(NEURON, reason="sparse layouts are CPU's here")
def test_a_sparse_op_reads_what_pending_ops_wrote_through_its_values():
    """A sparse tensor's values are a dense tensor the program can write (``values()``): a pending
    write there is computed before an op reads the sparse tensor."""
    def program(s):
        s.values().mul_(3)  # a write through the values' view, pending
        return s.to_dense() + 1

    ctx = _quiet()
    try:
        expected = program(torch.eye(3).to_sparse_csr())
        with ae.adaptive_eager(**REPLAY):
            got = program(torch.eye(3).to_sparse_csr())
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
        s = torch.eye(3).to_sparse().coalesce()
        with ae.adaptive_eager(**REPLAY):
            s.values().add_(1)
            got = s.to_dense()
        torch.testing.assert_close(got, torch.eye(3) * 2, rtol=0, atol=0)
    finally:
        ctx.__exit__(None, None, None)


@pytest.mark.skipif(NEURON, reason="sparse layouts are CPU's here")
def test_sparse_ops_run_eagerly_with_their_reason():
    x = torch.randn(3, 3)
    with ae.adaptive_eager(**REPLAY):
        y = (x * 2).to_sparse()
        z = (y.t() * 1).to_dense()
        ae.sync()
    torch.testing.assert_close(z, (x * 2).t())
    sites = {(op, reason) for op, reason, *_ in METRICS.fallback_sites}
    assert ("aten._to_sparse.default", "sparse") in sites and ("aten._to_dense.default", "sparse") in sites, sites
    assert ae.metrics()["flushes"].get("sparse") == 1  # ``to_sparse`` reads the pending ``x * 2``; the rest is sparse


def _run_child(source: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(source)], capture_output=True, text=True,
                          timeout=300, env=program_env())


_LAZY = """
    import torch
    import torch._lazy
    import torch._lazy.ts_backend
    torch._lazy.ts_backend.init()
    import adaptive_eager as ae
"""


def test_ops_on_the_lazy_device_run_as_in_eager():
    """torch's ``lazy`` device (TorchScript LTC) is not the target: its ops run untouched, its
    factories make the functional tensors eager makes (their views failed: "aten::as_strided
    appears to be a view operator, but it has no implementation for the backend lazy:0")."""
    r = _run_child(_LAZY + """
    def program():
        x = torch.ones(5, 5, device="lazy")
        y = x.t()
        z = torch.zeros(5, device="lazy") + torch.arange(5.0, device="lazy")
        w = torch.empty(2, 3, device="lazy").fill_(2.0).transpose(0, 1)
        return [torch._is_functional_tensor(x), y.cpu(), (y * 2 + z).sum().cpu(), w.cpu(), w.stride()]
    expected = program()
    with ae.adaptive_eager():
        got = program()
        assert ae.metrics()["ops_recorded"] == 0, ae.metrics()["ops_recorded"]
    assert repr(got) == repr(expected), (got, expected)
    print("ok")
    """)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout + r.stderr


def test_formatting_a_lazy_tensor_with_pending_writes_does_not_crash():
    """A raw lazy tensor (no functional wrapper) has no storage, and asking for it is a
    segmentation fault: pytest formatting a failing test's arguments crashed the process
    (``repr`` -> ``sync_value`` -> ``owner_of`` -> ``untyped_storage``)."""
    r = _run_child(_LAZY + """
    raw = torch._from_functional_tensor(torch.ones(2, 2, device="lazy"))
    with ae.adaptive_eager():
        x = torch.ones(3)
        x.add_(1)  # a pending write: a read looks for the storage it writes
        text = repr(raw)
        pending = ae.is_pending(raw) if hasattr(ae, "is_pending") else False
        assert not pending
        assert x.tolist() == [2.0, 2.0, 2.0]
    assert text == repr(torch.ones(2, 2, device="lazy")), text
    print("ok")
    """)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), (r.returncode, r.stdout + r.stderr)


@pytest.mark.parametrize("options", ["dict(backend='replay')", f"dict(backend={COMPILED_BACKEND!r}, hot_after=1, "
                                     "async_compile=False)"], ids=["replay", "compiled-at-first-sight"])
def test_a_setitem_warning_reaches_warnings_once_per_statement(options):
    """``x[uint8 mask] = v`` warns once, through ``warnings``, in eager; under the mode the warning
    was printed by C++ to stderr and ``catch_warnings`` saw none (15 once compiled at first sight)."""
    r = _run_child(f"""
    import warnings, torch, adaptive_eager as ae
    def program():
        x = torch.zeros(4, 3)
        x[torch.ByteTensor([1, 0, 1, 0])] = torch.ones(2, 3)
        return x
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with ae.adaptive_eager(**{options}):
            for _ in range(3):
                y = program()
                ae.sync()
    lines = [w.lineno for w in caught if "uint8" in str(w.message)]
    assert lines == [5, 5, 5], [(w.lineno, str(w.message)) for w in caught]
    assert torch.equal(y, program())
    print("ok")
    """)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout + r.stderr
    assert "] Warning: indexing" not in r.stderr, r.stderr  # nothing printed by C++


@pytest.mark.parametrize("read", ["conj_row", "conj_imag_row", "neg_view_row", "conj_whole"])
def test_tolist_of_a_conjugate_or_negative_view_reads_its_values(read):
    """test_view_ops' conj_imag_view: ``tolist()`` of a tensor with the conjugate or negative bit
    resolves it with a dispatched op (recorded: a pending copy) and read that copy's placeholder
    memory: garbage, in every mode."""
    torch.manual_seed(0)
    t, r = torch.randn(2, 3, dtype=torch.complex64), torch.randn(2, 3)
    fn = {"conj_row": lambda: t.conj()[0].tolist(), "conj_imag_row": lambda: t.conj().imag[0].tolist(),
          "neg_view_row": lambda: r._neg_view()[0].tolist(), "conj_whole": lambda: t.conj().tolist()}[read]
    want = fn()
    with ae.adaptive_eager():
        got = fn()
    assert got == want


_X = torch.arange(24.0).reshape(4, 6)
# each: ``as_strided`` of a view (an expand, a slice, after a transpose) of a value the window computed
AS_STRIDED_CASES = {
    # test_view_ops' as_strided_gradients: gradcheck's ``x + eps * u``, expanded
    "of_expand": lambda x: (x[0] * 1.5).expand(5, 6).as_strided([5, 6], [0, 1], 0) * 2,
    "of_unsqueeze_expand": lambda x: (x[0] + 1).unsqueeze(0).expand(3, 6).as_strided([3, 4], [0, 1], 2) - 1,
    "of_slice": lambda x: (x * 1.5)[1:].as_strided([3, 4], [1, 6], 1) * 2,
    "of_transposed_slice": lambda x: (x * 1.5).t()[1:].as_strided([3, 4], [1, 6], 1) * 2,
    "of_slice_of_a_transposed_value": lambda x: (x.t() * 1.5)[1:].as_strided([3, 4], [1, 4], 2) * 2,
    "of_value_itself": lambda x: (x * 1.5).as_strided([3, 4], [1, 6], 1) * 2,
}


@pytest.mark.parametrize("name", list(AS_STRIDED_CASES))
@pytest.mark.usefixtures("small_windows_off")
def test_as_strided_of_a_view_of_a_computed_value_reads_its_storage(name):
    """Inductor compiled ``y.expand(5, 6).as_strided([5, 6], [0, 1])`` to ``y[0]`` in every element
    (and a slice's as_strided from the slice's offset): test_view_ops' as_strided_gradients failed
    compiled from first sight. Each region compiles (no replay) and gives eager's values."""
    case = AS_STRIDED_CASES[name]
    want = case(_X)
    with ae.adaptive_eager(**COMPILED):
        got = [case(_X) for _ in range(3)]
        ae.sync()
        m = ae.metrics()
    for g in got:  # compiled ``sin`` is eager's within float tolerance, not bitwise; the bug negated
        torch.testing.assert_close(g, want)
    assert m["compiled_runs"] >= 1 and m["blacklisted"] == 0, m


def test_a_process_with_compiles_at_first_sight_exits_when_a_window_is_pending(tmp_path):
    """tests/pytorch_diff.py's first-sight runs (``NEURON_EAGER_HOT_AFTER=1
    NEURON_EAGER_ASYNC_COMPILE=0``) finished every test and then never exited: at exit the compile
    thread's hook stops it first, then adaptive eager's own hook flushes the pending window, whose
    compile was handed to the stopped thread and waited for for ever. The window replays."""
    env = program_env()
    env.update(NEURON_EAGER="adaptive", NEURON_EAGER_HOT_AFTER="1", NEURON_EAGER_ASYNC_COMPILE="0",
               NEURON_EAGER_CACHE_DIR=str(tmp_path / "cache"))
    r = subprocess.run([sys.executable, "-c", textwrap.dedent("""
        import atexit, os, torch
        x = torch.arange(6.0)
        print((x * 2 + 1).sum().item())  # a region compiled: the compile thread runs
        y = torch.ones(3)
        y.mul_(3).add_(x[:3])  # a new window, pending at exit
        atexit.register(os.write, 1, b"exiting\\n")  # flushes nothing, unlike print
        """)], capture_output=True, text=True, timeout=180, env=env)
    assert r.returncode == 0, (r.returncode, r.stdout, r.stderr)
    assert r.stdout.split() == ["36.0", "exiting"], r.stdout + r.stderr


_Z = torch.randn(4, 5, dtype=torch.complex64, generator=torch.Generator().manual_seed(0))
# each: a window whose real input has the conjugate or negative bit (or, for the last, none)
BIT_INPUT_CASES = {
    "conj_imag": lambda: _Z.conj().imag * 1,  # test_view_ops' conj_imag_view, compiled from first sight
    "conj_imag_chain": lambda: (_Z.conj().imag * 2 + 1).sin(),
    "conj": lambda: _Z.conj() * 2,
    "neg_view": lambda: (_Z.real._neg_view() * 2 + 1).sin(),
    "imag_no_bit": lambda: (_Z.imag * 2 + 1).sin(),
}


@pytest.mark.parametrize("name", list(BIT_INPUT_CASES))
def test_a_window_with_a_conjugate_or_negative_input_gives_eager_values_compiled(name):
    """Compiled code reads memory: a real input with the conjugate or negative bit came back
    unresolved (``t.conj().imag * 1`` negated, test_view_ops' conj_imag_view compiled from first
    sight). Such windows replay (``not_compiled["conj_or_neg_input"]``)."""
    case = BIT_INPUT_CASES[name]
    want = case()
    with ae.adaptive_eager(**COMPILED):
        got = [case() for _ in range(3)]
        ae.sync()
    for g in got:  # compiled ``sin`` is eager's within float tolerance, not bitwise; the bug negated
        torch.testing.assert_close(g, want)


@pytest.mark.usefixtures("small_windows_off")
def test_a_bit_input_of_a_structure_compiled_without_it_gives_eager_values():
    """The conjugate or negative bit is not in a window's key: a structure compiled for plain
    inputs, then given one with the bit (same shape, strides and dtype), replays that window,
    hot or not (Note [Conjugate and negative bits] in fuser.compilable)."""
    def step(t):
        return (t * 2 + 1).sin()

    z = torch.randn(4, 5, dtype=torch.complex64, generator=torch.Generator().manual_seed(1))
    plain = torch.view_as_real(z.clone())[..., 1]  # z.imag's shape and strides, no bit
    flagged = z.conj().imag  # the negative bit
    assert flagged.is_neg() and not plain.is_neg() and flagged.stride() == plain.stride()
    want = [step(t) for t in (plain, flagged, plain, flagged)]
    ae.reset_metrics()
    with ae.adaptive_eager(**COMPILED):
        for _ in range(4):
            step(plain).sum().item()  # compiled, then hot
        got = []
        for t in (plain, flagged, plain, flagged):
            got.append(step(t))
            ae.sync()
    m = ae.metrics()
    assert m["compiled_runs"] >= 4 and m["not_compiled"].get("conj_or_neg_input") == 2, m
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)

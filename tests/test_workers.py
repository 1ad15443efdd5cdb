"""Worker processes (Note [Worker processes] in adaptive_eager._mode): DataLoader workers and
``torch.multiprocessing`` get eager values, and a child process records only when asked to.

Plain eager is the oracle. DataLoader runs use real worker processes (fork and spawn) in a
subprocess started with NEURON_EAGER=adaptive, as a user would run a script; every wait has a
timeout.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest
from _oracle import program_env
import torch
import torch.multiprocessing as mp
from torch.utils.data import default_collate

import adaptive_eager as ae
from adaptive_eager import adaptive_eager

# Samples made by tensor ops in the worker, and whether the worker had adaptive eager on.
DATASET = textwrap.dedent(
    """
    import torch
    import adaptive_eager


    class Samples(torch.utils.data.Dataset):
        def __len__(self):
            return 10

        def __getitem__(self, i):
            g = torch.Generator().manual_seed(i)
            x = torch.randn(3, 4, generator=g)
            x = (x - x.mean()) / (x.std() + 1e-5) * 2 + i
            return x, torch.arange(3) * i, torch.tensor(adaptive_eager.is_enabled())
    """
)

SCRIPT = DATASET + textwrap.dedent(
    """

    if __name__ == "__main__":
        import json
        import sys

        runs = {}
        for context in sys.argv[1:]:
            # spawned workers each import torch: one is enough
            loader = torch.utils.data.DataLoader(Samples(), batch_size=4, multiprocessing_context=context,
                                                 num_workers=1 if context == "spawn" else 2)
            batches = []
            for x, k, enabled in loader:
                y = x * 2 - 1  # recorded in the main process, which has adaptive eager on
                batches.append([x.tolist(), y.tolist(), k.tolist(), enabled.tolist()])
            runs[context] = batches
        print(json.dumps({"runs": runs, "main_enabled": adaptive_eager.is_enabled(),
                          "recorded": adaptive_eager.metrics()["ops_recorded"]}))
    """
)


def _expected():
    scope = {}
    exec(DATASET, scope)
    ds = scope["Samples"]()
    out = []
    for start in range(0, len(ds), 4):
        x, k, _ = default_collate([ds[i] for i in range(start, min(start + 4, len(ds)))])
        out.append([x.tolist(), (x * 2 - 1).tolist(), k.tolist()])
    return out


def _load(tmp_path, contexts, **env_settings):
    script = tmp_path / "load.py"
    script.write_text(SCRIPT)
    env = program_env()
    env.update(NEURON_EAGER="adaptive", NEURON_EAGER_BACKEND="replay", NEURON_EAGER_CACHE_DIR=str(tmp_path / "cache"),
               PYTHONPATH=os.pathsep.join(sys.path), **env_settings)
    out = subprocess.run([sys.executable, str(script), *contexts], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["main_enabled"] and got["recorded"] > 0
    return got["runs"]


def test_dataloader_workers_give_eager_batches_and_run_eagerly(tmp_path):
    """NEURON_EAGER=adaptive: the workers (forked, or spawned with it in their environment) come up
    eager, and every batch is the eager batch."""
    want = _expected()
    for context, batches in _load(tmp_path, ["fork", "spawn"]).items():
        assert [b[:3] for b in batches] == want, context  # bitwise
        assert {e for b in batches for e in b[3]} == {False}, context


def test_dataloader_workers_record_when_asked(tmp_path):
    """NEURON_EAGER_WORKERS=1: forked workers keep recording, and a collated batch, still pending when
    the queue's feeder thread pickles it, reaches the main process with its eager values."""
    batches = _load(tmp_path, ["fork"], NEURON_EAGER_WORKERS="1")["fork"]
    assert [b[:3] for b in batches] == _expected()
    assert {e for b in batches for e in b[3]} == {True}


def _receive(queue, results):
    t = queue.get(timeout=60)
    results.put((t.tolist(), t.is_shared()))


def test_a_pending_tensor_sent_through_a_torch_multiprocessing_queue():
    """``Queue.put`` pickles in the queue's feeder thread, which moves the storage to shared memory
    and hands it to the other process while the value is still pending in this thread."""
    ctx = mp.get_context("fork")
    queue, results = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=_receive, args=(queue, results), daemon=True)
    child.start()  # before the mode: the child is an ordinary eager process
    try:
        x = torch.randn(64)
        with adaptive_eager(backend="replay"):
            y = torch.sin(x) * 3 + 1
            assert ae.is_lazy(y)
            queue.put(y)
            values, shared = results.get(timeout=60)  # read in the child while y is pending here
        assert shared
        assert values == (torch.sin(x) * 3 + 1).tolist()
        assert ae.metrics()["flushes"].get("other_thread") == 1  # the feeder thread's read
    finally:
        child.join(timeout=30)
        if child.is_alive():
            child.kill()


def test_share_memory_of_a_pending_tensor():
    x = torch.randn(32)
    with adaptive_eager(backend="replay"):
        y = x.cos() + 2
        y.share_memory_()
        assert y.is_shared() and not ae.is_lazy(y)
        z = y * 2
    assert torch.equal(y, x.cos() + 2) and torch.equal(z, (x.cos() + 2) * 2)


def _collect(loader, results):
    results.put([b.tolist() for b in loader])


def test_a_forked_worker_does_not_inherit_the_window_or_the_mode():
    """A DataLoader iterator forked inside the block: its dataset's tensors are still pending, and
    the worker must neither see placeholders nor record."""
    x = torch.randn(8, 5)
    with adaptive_eager(backend="replay"):
        data = (x * 3).exp()  # pending when the workers are forked
        ds = torch.utils.data.TensorDataset(data)
        loader = torch.utils.data.DataLoader(ds, batch_size=3, num_workers=2, multiprocessing_context="fork",
                                             collate_fn=lambda rows: torch.stack([r[0] for r in rows]) + 1,
                                             worker_init_fn=_assert_eager_worker)
        got = [b.tolist() for b in loader]
        assert ae.metrics()["flushes"].get("fork", 0) >= 1
    want = [(b + 1).tolist() for b in (x * 3).exp().split(3)]
    assert got == want


def _assert_eager_worker(worker_id):
    if ae.is_enabled():
        raise AssertionError("a forked DataLoader worker inherited adaptive eager")


def _compile_in_child(x, results):
    # a region the parent never saw: compiled here, on the child's own compile thread
    results.put((((x * 5).cos() + 3).sum().item(), ae.is_enabled(), ae.metrics()["compiled_runs"]))


def test_a_forked_child_that_records_compiles_its_own_regions(tmp_path):
    """workers=True: the child keeps recording, and compiles with a compile thread of its own (the
    parent's does not exist in the child; waiting on it would hang)."""
    x = torch.randn(16)
    ctx = mp.get_context("fork")
    results = ctx.Queue()
    with adaptive_eager(backend="inductor", hot_after=1, async_compile=False, workers=True,
                        cache_dir=str(tmp_path)):
        ((x * 2).sin() + 1).sum().item()  # compiled here: the compile thread runs
        assert ae.metrics()["compiled_runs"] == 1
        child = ctx.Process(target=_compile_in_child, args=(x, results), daemon=True)
        child.start()
        try:
            value, enabled, runs = results.get(timeout=120)
        finally:
            child.join(timeout=30)
            if child.is_alive():
                child.kill()
    assert enabled and runs == 2
    torch.testing.assert_close(value, ((x * 5).cos() + 3).sum().item())


FORK_GATE = textwrap.dedent(
    """
    import os, sys, threading
    import torch
    import adaptive_eager as ae
    import fuser.compile

    # A library's before-fork hook that holds other threads back until the fork is over, as
    # filelock 4.x does for the lock Inductor takes around its C++ builds: the compile waits on it.
    gate = threading.Event()
    gate.set()
    compile_program = fuser.compile._compile_program

    def gated(*args):
        gate.wait()
        return compile_program(*args)

    fuser.compile._compile_program = gated
    x = torch.randn(64)
    want = (x * 3).sin() + 1
    with ae.adaptive_eager(backend="inductor", hot_after=1, async_compile=False, cache_dir=sys.argv[1]):
        (x + 2).cos().sum().item()  # a region compiled before: the compile thread runs
        y = (x * 3).sin() + 1  # pending at the fork; its first sight is due for its compile
        # registered after the library's hook, so it runs first (before-fork hooks run in reverse)
        os.register_at_fork(before=gate.clear, after_in_parent=gate.set, after_in_child=gate.set)
        pid = os.fork()
        if pid == 0:
            os._exit(0 if torch.equal(y, want) else 3)  # replayed: eager's bits
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, "the child read a wrong value"
        assert torch.equal(y, want)
        z = (x * 3).sin() + 1  # the same structure: compiled now, after the fork
        torch.testing.assert_close(z, want)
        m = ae.metrics()
    print(m["replay_reasons"].get("fork", 0), m["compiles"], m["compiled_runs"])
    """
)


def test_a_fork_while_a_compile_is_due_does_not_hang(tmp_path):
    """Note [Flush at a fork]: the flush before a fork waits for no other thread. Another library's
    before-fork hook may hold threads back until the fork ends (filelock 4.x); a flush that compiled
    there waited for the compile thread forever (a DataLoader's ``iter()`` hung)."""
    script = tmp_path / "gate.py"
    script.write_text(FORK_GATE)
    env = program_env()
    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    try:
        out = subprocess.run([sys.executable, str(script), str(tmp_path / "cache")], env=env, capture_output=True,
                             text=True, timeout=240)
    except subprocess.TimeoutExpired:
        pytest.fail("the fork hung: the flush before it waited for the compile thread")
    assert out.returncode == 0, out.stderr
    fork_replays, compiles, compiled_runs = map(int, out.stdout.split())
    assert fork_replays == 1  # the window at the fork replayed ...
    assert compiles == 2 and compiled_runs == 2  # ... and its next sight compiled and ran

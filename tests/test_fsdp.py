"""FSDP2 (``fully_shard``) and DTensor under adaptive eager, on 2 real processes (gloo, CPU).

FSDP2's parameters are DTensors: a tensor subclass the mode leaves to its own dispatch, whose
plain ops on the local shards are recorded (Note [Tensor subclasses] in adaptive_eager._mode). Its
copy-in/copy-out custom ops run inline, their ATen ops recorded (Note [Ops run inline] in
adaptive_eager._ops); its all-gathers and reduce-scatters are collectives (sync points); it frees
and re-allocates the unsharded parameters' storage (``UntypedStorage.resize_``), which flushes a
window that holds that storage (Note [Storage resize] in adaptive_eager._patches). Eager FSDP2 in
the same process is the oracle. Ranks start as in tests/test_distributed.py; a hang is a failure.
The single-process tests of those mechanisms run by default; the 2-rank ones are slow.
"""

from __future__ import annotations

import datetime
import os
import traceback

import pytest
import torch
from test_distributed import COLLECTIVE_TIMEOUT_S, WORLD, run_ranks

DEADLINE_S = 240
STEPS = 4


def _dtensor_basics(rank: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (WORLD,))
    torch.manual_seed(0)
    a, b = torch.randn(8, 6), torch.randn(6, 4)
    da = distribute_tensor(a, mesh, [Shard(0)])
    db = distribute_tensor(b, mesh, [Replicate()])
    y = (da * 2 + 1).tanh() @ db  # sharded rows times a replicated matrix: no communication
    out = {"local": y.to_local() + 0, "full": y.full_tensor() + 0}  # full_tensor all-gathers
    out["col_sum"] = y.redistribute(mesh, [Replicate()]).to_local().sum(0) + 0
    return out


def _train_fsdp2(rank: int, lazy: bool, cache_dir: str, backend: str = "inductor") -> dict:
    import contextlib

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import adaptive_eager as ae

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    mesh = init_device_mesh("cpu", (WORLD,))
    mode = ae.adaptive_eager(backend=backend, hot_after=2, async_compile=False,
                             cache_dir=cache_dir) if lazy else contextlib.nullcontext()
    g = torch.Generator().manual_seed(100 + dist.get_rank())  # each rank its own data
    x, y = torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)
    losses = []
    with mode:
        for layer in (model[0], model[2]):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        for _ in range(STEPS):
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.detach() + 0)
        full = [p.full_tensor() + 0 for p in model.parameters()]
    return {"losses": torch.stack(losses), "params": full}


def _worker(rank: int, port: int, out_dir: str, cache_dir: str) -> None:
    path = os.path.join(out_dir, f"rank{rank}.pt")
    try:
        import torch.distributed as dist

        import adaptive_eager as ae

        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
        dist.init_process_group("gloo", rank=rank, world_size=WORLD,
                                timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
        result: dict = {"dtensor_eager": _dtensor_basics(rank)}
        with ae.adaptive_eager(backend="replay", cache_dir=cache_dir):
            result["dtensor_lazy"] = _dtensor_basics(rank)
        result["fsdp_eager"] = _train_fsdp2(rank, lazy=False, cache_dir=cache_dir)
        ae.reset_metrics()
        result["fsdp_replay"] = _train_fsdp2(rank, lazy=True, cache_dir=cache_dir, backend="replay")
        result["replay_metrics"] = ae.metrics()
        ae.reset_metrics()
        result["fsdp_lazy"] = _train_fsdp2(rank, lazy=True, cache_dir=cache_dir)
        result["fsdp_metrics"] = ae.metrics()
        dist.destroy_process_group()
        torch.save(result, path)
    except BaseException:
        with open(path + ".error", "w") as f:
            f.write(traceback.format_exc())
        raise


@pytest.fixture(scope="module")  # two gloo ranks spawned (~40-180 s); DDP's tests run by default
def ranks(tmp_path_factory) -> list[dict]:
    out_dir = str(tmp_path_factory.mktemp("fsdp_out"))
    cache_dir = str(tmp_path_factory.mktemp("fsdp_cache"))
    return run_ranks(_worker, out_dir, cache_dir, DEADLINE_S)


@pytest.mark.slow
def test_dtensor_ops_give_eager_values(ranks):
    for r in ranks:
        for key, want in r["dtensor_eager"].items():
            torch.testing.assert_close(r["dtensor_lazy"][key], want, msg=key)


@pytest.mark.slow
def test_fsdp2_training_matches_eager_fsdp2(ranks):
    for r in ranks:
        torch.testing.assert_close(r["fsdp_lazy"]["losses"], r["fsdp_eager"]["losses"], rtol=1e-5, atol=1e-6)
        for got, want in zip(r["fsdp_lazy"]["params"], r["fsdp_eager"]["params"]):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    m = ranks[0]["fsdp_metrics"]
    assert m["ops_recorded"] > 0 and m["flushes"].get("collective", 0) > 0, m
    assert m["compiled_runs"] > 0, m  # the local shards' steps ran compiled


@pytest.mark.slow
def test_fsdp2_replay_is_eager_bitwise_and_syncs_only_where_it_must(ranks):
    for r in ranks:
        assert torch.equal(r["fsdp_replay"]["losses"], r["fsdp_eager"]["losses"])
        for got, want in zip(r["fsdp_replay"]["params"], r["fsdp_eager"]["params"]):
            assert torch.equal(got, want)
    m = ranks[0]["replay_metrics"]
    # the copy-in/copy-out ops are recorded: no eager op and no flush of their own (40 fallbacks
    # and 24 flushes before they ran inline)
    assert m["fallback_ops"] == {} and "fallback" not in m["flushes"], m
    # FSDP2's frees of memory pending ops read wait for their windows (Note [Storage resize]): no
    # storage flush but one at its lazy init (``reset_sharded_param`` takes the shards' storage);
    # 17 before, one per reshard of each of the 2 sharded layers after its forward and backward
    assert m["flushes"].get("storage", 0) <= 1, m


# ---------------------------------------------------------------------------------------------
# The mechanisms in one process (default run)


def _copy_in_out() -> list:
    """FSDP2's copy-in and copy-out ops as its all-gather and reduce-scatter call them."""
    import torch.distributed.fsdp._fully_shard._fsdp_collectives  # noqa: F401 - defines torch.ops.fsdp

    torch.manual_seed(0)
    shards = [torch.randn(3) * 2, torch.randn(5) + 1]  # pending under adaptive eager
    flat = torch.zeros(16)  # the all-gather's output, 2 ranks x 8
    mine, out = torch.ops.fsdp.all_gather_copy_in(shards, flat, [3, 5], 8, 1)
    params = [torch.empty(3), torch.empty(5)]
    torch.ops.fsdp.split_with_sizes_copy(mine * 3, [3, 5], dim=0, out=params)
    grads = torch.empty(2, 5)
    torch.ops.fsdp.chunk_cat([params[0].view(3, 1) * 1, params[1].view(5, 1) + 1], 0, 2, out=grads)
    # all_gather_copy_in returns its output and this rank's slice of it (its schema says neither)
    aliases = [out is flat, mine.data_ptr() - flat.data_ptr() == 8 * flat.element_size()]
    return [flat + 0, mine + 0, params[0] + 0, params[1] + 0, grads + 0, aliases]


def test_fsdp_copy_ops_are_recorded_with_eager_values():
    import adaptive_eager as ae

    want = _copy_in_out()
    ae.reset_metrics()
    with ae.adaptive_eager(backend="replay"):
        got = _copy_in_out()
        m = ae.metrics()
    assert m["fallback_ops"] == {} and m["ops_eager"] == 2, m  # the two randn draws (Note [RNG])
    assert m["flushes"] == {"data_ptr": 1}, m  # the aliasing check's read, nothing else
    for g, w in zip(got[:-1], want[:-1]):
        assert torch.equal(g, w)
    assert got[-1] == want[-1] == [True, True]


def test_a_storage_free_waits_for_the_window_that_uses_it():
    """Note [Storage resize]: a free of memory pending ops use happens when they have run; until
    then the storage reports eager's size; an allocation back to its size takes the free back."""
    import adaptive_eager as ae

    def program(check):
        torch.manual_seed(0)
        x = torch.randn(4) * 2  # pending: reads nothing of ``buf``
        buf = torch.empty(4)
        storage = buf.untyped_storage()
        storage.resize_(0)  # freed, as FSDP2 frees an unsharded parameter
        storage.resize_(16)  # and allocated again before its all-gather
        check("alloc", ae.is_lazy(x))
        buf.fill_(3.0)
        y = buf * x  # a pending read of buf's memory
        storage.resize_(0)  # waits for the window
        check("free", (ae.is_lazy(y), storage.size(), storage.nbytes(), len(storage)))
        storage.resize_(16)  # the free taken back: y still reads 3.0
        check("again", ae.is_lazy(y))
        buf.fill_(5.0)
        z = buf * 1
        storage.resize_(0)
        storage.resize_(32)  # another size: the window runs first
        check("other size", (ae.is_lazy(z), storage.nbytes()))
        w = buf.untyped_storage()
        return y, z, storage.nbytes(), w.nbytes()

    want = program(lambda *_: None)
    lazy = {}
    ae.reset_metrics()
    with ae.adaptive_eager(backend="replay"):
        got = program(lazy.__setitem__)
        m = ae.metrics()
    assert lazy == {"alloc": True, "free": (True, 0, 0, 0), "again": True, "other size": (False, 32)}
    assert m["flushes"] == {"storage": 1}, m
    for g, w in zip(got, want):
        assert torch.equal(g, w) if isinstance(w, torch.Tensor) else g == w


def test_a_waiting_free_happens_when_the_window_runs():
    import adaptive_eager as ae

    buf = torch.ones(1000)  # real: a parameter's unsharded storage
    with ae.adaptive_eager(backend="replay"):
        y = buf * 2
        storage = buf.untyped_storage()
        storage.resize_(0)
        assert ae.is_lazy(y) and storage.nbytes() == 0
        ae.sync()
        assert torch._C.StorageBase.nbytes(storage) == 0  # the memory itself, not what it reports
        assert ae.metrics()["flushes"] == {"sync": 1}
    assert torch.equal(y, torch.full((1000,), 2.0))


def test_fsdp2s_free_of_a_parameter_pending_ops_write_waits_for_them():
    """FSDP2 frees an unsharded parameter through its own ``free_storage`` helper, which takes
    ``untyped_storage()`` (a flush for a storage pending ops write, as for any raw reader): inside
    it the storage is handed out for its size and resize only, and the free waits for the window."""
    import adaptive_eager as ae
    from torch.distributed.fsdp._fully_shard import _fsdp_param

    def program(check, param):  # ``param``: real, as FSDP2's unsharded parameters are
        param.mul_(2)  # a pending write of the parameter's storage (the all-gather's copy-out)
        y = param * 3  # a pending read
        _fsdp_param.free_storage(param)
        check("free", (ae.is_lazy(y), param.untyped_storage().nbytes() if not ae.is_lazy(y) else None))
        return y, param.untyped_storage().nbytes()

    want = program(lambda *_: None, torch.arange(6.0))
    seen = {}
    param = torch.arange(6.0)
    with ae.adaptive_eager(backend="replay"):
        got = program(seen.__setitem__, param)
        assert ae.metrics()["flushes"].get("storage", 0) == 1, ae.metrics()  # the last line's read
    assert seen == {"free": (True, None)}
    assert torch.equal(got[0], want[0]) and got[1] == want[1] == 0

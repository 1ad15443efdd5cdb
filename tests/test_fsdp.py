"""FSDP2 (``fully_shard``) and DTensor under adaptive eager, on 2 real processes (gloo, CPU).

FSDP2's parameters are DTensors: a tensor subclass the mode leaves to its own dispatch, whose
plain ops on the local shards are recorded (Note [Tensor subclasses] in adaptive_eager._mode). Its
all-gathers and reduce-scatters are collectives (sync points), and it frees and re-allocates the
unsharded parameters' storage (``UntypedStorage.resize_``), which flushes first. Eager FSDP2 in the
same process is the oracle. Ranks start as in tests/test_distributed.py; a hang is a failure.
"""

from __future__ import annotations

import datetime
import os
import traceback

import pytest
import torch
from test_distributed import COLLECTIVE_TIMEOUT_S, WORLD, run_ranks

pytestmark = pytest.mark.slow  # two gloo ranks spawned per test (~40-180 s); DDP's tests run by default

DEADLINE_S = 240


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


def _train_fsdp2(rank: int, lazy: bool, cache_dir: str) -> dict:
    import contextlib

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import adaptive_eager as ae

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    mesh = init_device_mesh("cpu", (WORLD,))
    mode = ae.adaptive_eager(backend="inductor", hot_after=2, async_compile=False,
                             cache_dir=cache_dir) if lazy else contextlib.nullcontext()
    g = torch.Generator().manual_seed(100 + dist.get_rank())  # each rank its own data
    x, y = torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)
    losses = []
    with mode:
        for layer in (model[0], model[2]):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        for _ in range(4):
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
        result["fsdp_lazy"] = _train_fsdp2(rank, lazy=True, cache_dir=cache_dir)
        result["fsdp_metrics"] = ae.metrics()
        dist.destroy_process_group()
        torch.save(result, path)
    except BaseException:
        with open(path + ".error", "w") as f:
            f.write(traceback.format_exc())
        raise


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    out_dir = str(tmp_path_factory.mktemp("fsdp_out"))
    cache_dir = str(tmp_path_factory.mktemp("fsdp_cache"))
    return run_ranks(_worker, out_dir, cache_dir, DEADLINE_S)


def test_dtensor_ops_give_eager_values(ranks):
    for r in ranks:
        for key, want in r["dtensor_eager"].items():
            torch.testing.assert_close(r["dtensor_lazy"][key], want, msg=key)


def test_fsdp2_training_matches_eager_fsdp2(ranks):
    for r in ranks:
        torch.testing.assert_close(r["fsdp_lazy"]["losses"], r["fsdp_eager"]["losses"], rtol=1e-5, atol=1e-6)
        for got, want in zip(r["fsdp_lazy"]["params"], r["fsdp_eager"]["params"]):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    m = ranks[0]["fsdp_metrics"]
    assert m["ops_recorded"] > 0 and m["flushes"].get("collective", 0) > 0, m
    assert m["compiled_runs"] > 0, m  # the local shards' steps ran compiled

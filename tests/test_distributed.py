"""torch.distributed under adaptive eager: collectives and DDP on 2 real processes (gloo, CPU).

The process group reads and writes tensor memory directly, on its own threads, so every collective
flushes the window first (Note [Collectives] in adaptive_eager._ops). Eager is the oracle: each
rank runs the same program eagerly and under adaptive eager, in the same process, and the parent
compares. One pair of processes runs every check (process start and ``import torch`` cost ~2 s);
the tests below assert on its results. A hang becomes a failure: gloo's collective timeout and
the parent's join deadline are both bounded.
"""

from __future__ import annotations

import datetime
import multiprocessing
import os
import socket
import time
import traceback

import pytest
import torch
from _oracle import artifacts

WORLD = 2
COLLECTIVE_TIMEOUT_S = 45  # gloo raises instead of waiting forever for a missing peer
DEADLINE_S = 150  # the whole 2-process run (it takes ~25-40 s on 2 cores)


# ---------------------------------------------------------------------------------------------
# What each rank runs (in a spawned process)


def _collectives(rank: int, lazy: bool) -> dict:
    """Every collective a DDP user meets, each fed or followed by values the window holds."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    import adaptive_eager as ae

    r = float(rank + 1)
    peer = 1 - rank
    out: dict = {}
    lazy_inputs = []

    # all_reduce of a pending value (its contents exist only once the window runs)
    x = torch.arange(6.0) * r + 1
    lazy_inputs.append(ae.is_lazy(x))
    dist.all_reduce(x)
    out["all_reduce_pending_input"] = x * 2

    # write after read: a pending op reads t, then all_reduce overwrites t in place. c10d's schema
    # does not say the op writes, so without the collective flush the pending op reads the sum.
    t = torch.full((4,), r)
    ae.sync()
    before = t * 10
    lazy_inputs.append(ae.is_lazy(before))
    dist.all_reduce(t)
    out["read_before_all_reduce"] = before
    out["all_reduce_in_place"] = t + 0

    # a view of a pending tensor, reduced in place: visible through the base afterwards
    base = torch.arange(8.0) + r
    dist.all_reduce(base[2:5], op=dist.ReduceOp.MAX)
    out["all_reduce_view"] = base * 1

    # async_op=True, then wait
    z = torch.ones(3) * r
    work = dist.all_reduce(z, async_op=True)
    work.wait()
    out["all_reduce_async"] = z + 1

    # broadcast into a pending tensor
    b = torch.full((3,), r) + 1
    dist.broadcast(b, src=0)
    out["broadcast"] = b * 2

    # all_gather into pending zeros: the zeros must land before the gathered values
    gathered = [torch.zeros(4) for _ in range(WORLD)]
    dist.all_gather(gathered, torch.arange(4.0) * r)
    out["all_gather"] = torch.stack(gathered) + 0

    flat = torch.empty(WORLD * 3)
    dist.all_gather_into_tensor(flat, torch.arange(3.0) + r)
    out["all_gather_into_tensor"] = flat - 1

    # reduce_scatter (list and tensor forms)
    rs = torch.zeros(2)
    dist.reduce_scatter(rs, [torch.arange(2.0) * r + i for i in range(WORLD)])
    out["reduce_scatter"] = rs * 1
    rst = torch.zeros(2)
    dist.reduce_scatter_tensor(rst, torch.arange(4.0) * r)
    out["reduce_scatter_tensor"] = rst * 1

    dist.barrier()

    # send / recv: the receiver's buffer is read by a pending op before the message overwrites it
    if rank == 0:
        dist.send(torch.arange(3.0) + 5, dst=peer)
    else:
        buf = torch.ones(3)
        ae.sync()
        seen_before = buf * 7
        dist.recv(buf, src=peer)
        out["read_before_recv"] = seen_before
        out["recv"] = buf + 0
    # isend / irecv + wait, the other way round
    if rank == 1:
        work = dist.isend(torch.arange(3.0) * 3, dst=peer)
        work.wait()
    else:
        buf = torch.zeros(3) + 1
        work = dist.irecv(buf, src=peer)
        work.wait()
        out["irecv"] = buf * 2

    # functional collectives (_c10d_functional ops; the result waits on first use)
    fc = funcol.all_reduce(torch.arange(4.0) * r, "sum", dist.group.WORLD)
    out["functional_all_reduce"] = fc + 1

    ae.sync()
    out = {k: v.clone() for k, v in out.items()}
    out["lazy_inputs"] = lazy_inputs
    return out


def _construct_ddp(rank: int) -> torch.Tensor | str:
    """DDP's constructor checks the ranks' parameter shapes and broadcasts rank 0's parameters over
    rank 1's (different) ones; the parameters afterwards, or the error."""
    torch.manual_seed(rank)
    model = torch.nn.Linear(3, 2)
    try:
        torch.nn.parallel.DistributedDataParallel(model)
    except RuntimeError as e:
        return f"{type(e).__name__}: {e}"
    return torch.cat([p.detach().flatten() for p in model.parameters()]) + 0


def _train_ddp(rank: int, lazy: bool, cache_dir: str) -> list[torch.Tensor]:
    """A few SGD steps, then a few AdamW steps, of a tiny MLP under DDP; the final parameters."""
    import contextlib

    from adaptive_eager import adaptive_eager

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    g = torch.Generator().manual_seed(100 + rank)  # each rank its own data: DDP averages the grads
    x, y = torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)
    sgd = torch.optim.SGD(ddp.parameters(), lr=0.1)
    adamw = torch.optim.AdamW(ddp.parameters(), lr=0.01)
    mode = adaptive_eager(
        backend="inductor", hot_after=2, async_compile=False, cache_dir=cache_dir
    ) if lazy else contextlib.nullcontext()
    with mode:
        for opt in [sgd] * 4 + [adamw] * 3:
            opt.zero_grad()
            torch.nn.functional.mse_loss(ddp(x), y).backward()
            opt.step()
    return [p.detach().clone() for p in model.parameters()]


def _train_compiled_ddp(rank: int, lazy: bool, cache_dir: str) -> list[torch.Tensor]:
    """The program's own ``torch.compile`` of a DDP-wrapped model (Note [User torch.compile] in
    adaptive_eager._compile): a few SGD steps; the final parameters."""
    import contextlib

    from adaptive_eager import adaptive_eager

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    compiled = torch.compile(torch.nn.parallel.DistributedDataParallel(model), backend="aot_eager")
    g = torch.Generator().manual_seed(100 + rank)
    x, y = torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mode = adaptive_eager(backend="replay", cache_dir=cache_dir) if lazy else contextlib.nullcontext()
    with mode:
        for _ in range(3):
            opt.zero_grad()
            torch.nn.functional.mse_loss(compiled(x), y).backward()
            opt.step()
    return [p.detach().clone() for p in model.parameters()]


def _worker(rank: int, port: int, out_dir: str, cache_dir: str) -> None:
    path = os.path.join(out_dir, f"rank{rank}.pt")
    try:
        import torch.distributed as dist

        import adaptive_eager as ae

        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
        dist.init_process_group(
            "gloo", rank=rank, world_size=WORLD, timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S)
        )
        result: dict = {"rank": rank}
        result["collectives_eager"] = _collectives(rank, lazy=False)
        ae.reset_metrics()
        with ae.adaptive_eager(backend="replay", cache_dir=cache_dir):
            result["collectives_lazy"] = _collectives(rank, lazy=True)
        result["collectives_metrics"] = ae.metrics()
        result["ddp_init_eager"] = _construct_ddp(rank)
        with ae.adaptive_eager(backend="replay", cache_dir=cache_dir):
            result["ddp_init_lazy"] = _construct_ddp(rank)

        result["ddp_eager"] = _train_ddp(rank, lazy=False, cache_dir=cache_dir)
        ae.reset_metrics()
        result["ddp_lazy"] = _train_ddp(rank, lazy=True, cache_dir=cache_dir)
        result["ddp_metrics"] = ae.metrics()
        if rank == 0:
            result["ddp_report"] = ae.report()
        result["compiled_ddp_eager"] = _train_compiled_ddp(rank, lazy=False, cache_dir=cache_dir)
        ae.reset_metrics()
        result["compiled_ddp_lazy"] = _train_compiled_ddp(rank, lazy=True, cache_dir=cache_dir)
        result["compiled_ddp_metrics"] = ae.metrics()
        dist.destroy_process_group()
        torch.save(result, path)
    except BaseException:
        with open(path + ".error", "w") as f:
            f.write(traceback.format_exc())
        raise


# ---------------------------------------------------------------------------------------------
# The parent: start both ranks once, fail on a hang


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(worker, out_dir: str, cache_dir: str, deadline_s: float) -> list[dict]:
    """Spawn ``WORLD`` processes of ``worker(rank, port, out_dir, cache_dir)``, wait at most
    ``deadline_s`` for them, fail the test on a hang or a rank's error (its ``rank<N>.pt.error``
    file), and return what each rank saved in ``rank<N>.pt``."""
    ctx = multiprocessing.get_context("spawn")
    port = _free_port()
    procs = [ctx.Process(target=worker, args=(rank, port, out_dir, cache_dir)) for rank in range(WORLD)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + deadline_s
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    hung = [p for p in procs if p.is_alive()]
    for p in hung:
        p.kill()
        p.join()
    errors = []
    for rank in range(WORLD):
        err = os.path.join(out_dir, f"rank{rank}.pt.error")
        if os.path.exists(err):
            with open(err) as f:
                errors.append(f"rank {rank}:\n{f.read()}")
    if hung or errors:
        pytest.fail(f"{len(hung)} rank(s) still running after {deadline_s} s (hang)\n" + "\n".join(errors))
    return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(WORLD)]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    out_dir = str(tmp_path_factory.mktemp("dist_out"))
    cache_dir = str(tmp_path_factory.mktemp("dist_cache"))
    results = run_ranks(_worker, out_dir, cache_dir, DEADLINE_S)
    for r in results:
        r["cache_dir"] = cache_dir
    return results


# ---------------------------------------------------------------------------------------------
# Tests


def test_collectives_give_eager_values(ranks):
    for r in ranks:
        eager, lazy = r["collectives_eager"], r["collectives_lazy"]
        assert lazy.pop("lazy_inputs") == [True, True], "the inputs were meant to be pending values"
        assert eager.pop("lazy_inputs") == [False, False]
        assert sorted(lazy) == sorted(eager)
        for name, want in eager.items():
            # replayed windows are bitwise eager
            torch.testing.assert_close(lazy[name], want, rtol=0, atol=0, msg=lambda m, n=name: f"rank {r['rank']}, {n}: {m}")


def test_collectives_match_the_arithmetic(ranks):
    """The eager oracle itself did what the collectives promise (so a broken setup cannot pass)."""
    e0, e1 = ranks[0]["collectives_eager"], ranks[1]["collectives_eager"]
    assert torch.equal(e0["all_reduce_pending_input"], (torch.arange(6.0) * 3 + 2) * 2)
    assert torch.equal(e1["read_before_all_reduce"], torch.full((4,), 20.0))
    assert torch.equal(e1["all_reduce_in_place"], torch.full((4,), 3.0))
    assert torch.equal(e1["recv"], torch.arange(3.0) + 5)
    assert torch.equal(e1["read_before_recv"], torch.full((3,), 7.0))
    assert torch.equal(e0["irecv"], torch.arange(3.0) * 6)
    assert torch.equal(e0["broadcast"], e1["broadcast"])


def test_ddp_constructed_under_the_mode_broadcasts_rank0_parameters(ranks):
    e0, e1 = ranks[0]["ddp_init_eager"], ranks[1]["ddp_init_eager"]
    assert torch.equal(e0, e1)  # the oracle: rank 1 now holds rank 0's parameters
    for r in ranks:
        lazy = r["ddp_init_lazy"]
        assert isinstance(lazy, torch.Tensor), f"rank {r['rank']}: {lazy}"
        assert torch.equal(lazy, r["ddp_init_eager"])


def test_collective_flushes_are_counted(ranks):
    for r in ranks:
        flushes = r["collectives_metrics"]["flushes"]
        # at least one per collective above that had ops pending before it
        assert flushes.get("collective", 0) >= 10, flushes
        assert "fallback" not in flushes, f"a c10d op was not classified as a collective: {flushes}"


def test_ddp_training_matches_eager_ddp(ranks):
    for r in ranks:
        for got, want in zip(r["ddp_lazy"], r["ddp_eager"], strict=True):
            torch.testing.assert_close(got, want)  # compiled regions: float tolerance
    for a, b in zip(ranks[0]["ddp_lazy"], ranks[1]["ddp_lazy"], strict=True):
        torch.testing.assert_close(a, b)  # DDP kept the replicas in step
    for r in ranks:
        m = r["ddp_metrics"]
        assert m["compiled_runs"] > 0 and m["compile_failures"] == 0, m
        assert m["flushes"].get("collective", 0) >= 6, m["flushes"]  # one allreduce per step at least


def test_ddp_ranks_share_one_cache_and_compile_each_region_once(ranks):
    from neff_cache import ArtifactStore

    compiles = [r["ddp_metrics"]["compiles"] for r in ranks]
    with ArtifactStore(ranks[0]["cache_dir"]) as store:
        entries = len(artifacts(store))
    # every stored artifact was compiled by exactly one rank: a region both ranks compiled would
    # leave fewer entries than compiles
    assert entries > 0 and sum(compiles) == entries, (compiles, entries)
    # and the ranks met in the cache: one found the other's claim or loaded its artifact
    met = sum(r["ddp_metrics"]["waited_for_other_process"] + r["ddp_metrics"]["cache_hits_disk"] for r in ranks)
    assert met > 0, [r["ddp_metrics"] for r in ranks]


def test_a_program_that_compiles_its_ddp_model_trains_as_without_us(ranks):
    """Issue 37: DDP wrapping a model the program compiled runs inside adaptive eager with the
    mode stepped aside for each compiled call: eager's parameters, replicas in step."""
    for r in ranks:
        for got, want in zip(r["compiled_ddp_lazy"], r["compiled_ddp_eager"], strict=True):
            torch.testing.assert_close(got, want)
        assert r["compiled_ddp_metrics"]["compiled_calls"] >= 3, r["compiled_ddp_metrics"]
    for a, b in zip(ranks[0]["compiled_ddp_lazy"], ranks[1]["compiled_ddp_lazy"], strict=True):
        torch.testing.assert_close(a, b)

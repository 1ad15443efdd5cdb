"""A window whose sizes vary on a backend of static shapes (stablehlo, neuron): the ops a varying
size reaches run alone, the rest compiles once (Note [Sizes that vary, run alone] in fuser.compile).

The loop is ``generate()``'s in miniature: a sequence grows by a token a step (``torch.cat``), and
each step reads its last token (a slice of the growing tensor), computes on fixed sizes, writes a
fixed-size buffer in place and takes a size from the sequence (``arange(len)``)."""

from __future__ import annotations

import logging

import pytest
import torch
from test_stablehlo import needs_stablehlo

import adaptive_eager as ae
import fuser
from adaptive_eager import adaptive_eager

pytestmark = [needs_stablehlo, pytest.mark.usefixtures("fresh_regions", "small_windows_off")]

STEPS = 10


def _opts(tmp_path, **kw):
    return {"backend": "stablehlo", "hot_after": 1, "async_compile": False, "cache_dir": str(tmp_path), **kw}


def _step(seq, w, buf):
    """One token: 6 of its ops see the sequence's length, the others fixed sizes."""
    last = seq[:, -1:].to(torch.float32)
    h = torch.tanh(last * w + 0.5)
    h = torch.sigmoid(h @ w.T.reshape(8, 1).expand(8, 8))
    buf.mul_(0.5).add_(h)  # a fixed-size input written in place
    position = torch.arange(seq.shape[1]).to(torch.float32).mean()  # a size as an argument
    token = ((h.sum(-1, keepdim=True) + position) * 7).to(torch.int64).clamp(0, 49)
    seq = torch.cat([seq, token], dim=-1)
    buf.add_(seq[:, -1:] == 7)  # the grown sequence's last token, as generate()'s stopping check reads it
    return seq


def _run(steps: int, start: int = 3, change=None):
    """``steps`` tokens; ``change(region)`` is called with the class's region before the fourth (the
    first window, a first length, a second: the class's region exists then)."""
    torch.manual_seed(0)
    seq = torch.randint(0, 50, (1, start))
    w = torch.randn(1, 8)
    buf = torch.zeros(1, 8)
    for i in range(steps):
        if change is not None and i == 3:
            (cls,) = [c for c in fuser.shapes._CLASSES.values() if c.sym is not None]
            change(cls.sym)
        seq = _step(seq, w, buf)
        int(seq[0, -1])  # a host read ends each step's window, as generate()'s stopping check
    return seq, buf


def test_a_growing_sequence_compiles_once_and_runs_its_varying_ops_alone(tmp_path):
    want_seq, want_buf = _run(STEPS)
    with adaptive_eager(**_opts(tmp_path)):
        seq, buf = _run(STEPS)
    torch.testing.assert_close(seq, want_seq, rtol=0, atol=0)
    torch.testing.assert_close(buf, want_buf)
    m = ae.metrics()
    # per size, each of the 10 lengths would compile; here the first length and the class, once
    assert m["compiles"] <= 3, m
    assert m["recompiles"].get("dynamic") == 1, m["recompiles"]
    assert m["run_alone"].get("varying_size", 0) >= 4, m["run_alone"]
    assert m["compiled_runs"] >= STEPS - 1 and m["blacklisted"] == 0, m
    (sym,) = [c.sym for c in fuser.shapes._CLASSES.values() if c.sym is not None]
    assert sym.inplace, "the buffer is written by the region's stores piece, not copied back"
    # one piece, the stores' piece, the cat and the size's three ops (arange, to, mean): the last
    # token's check reads the token, not the grown sequence, so it needs no piece after the cat
    assert sym.run.launches == 6, sym.run.launches


def test_the_class_region_is_stored_and_loaded_by_a_new_process(tmp_path):
    with adaptive_eager(**_opts(tmp_path)):
        _run(3)
    assert ae.metrics()["recompiles"].get("dynamic") == 1
    fuser.cache_clear()  # what a new process knows: only the store
    ae.reset_metrics()
    want_seq, want_buf = _run(8, start=5)
    with adaptive_eager(**_opts(tmp_path)):
        seq, buf = _run(8, start=5)
    torch.testing.assert_close(seq, want_seq, rtol=0, atol=0)
    torch.testing.assert_close(buf, want_buf)
    m = ae.metrics()
    assert m["cache_hits_disk"] >= 1 and m["recompiles"].get("dynamic") is None, m
    # the first window (the inputs' draws with it) and the first length, per size; then the class's
    # region loads, and no length compiles again
    assert m["compiles"] <= 2, m


def test_failing_size_guards_fall_back_to_per_size(tmp_path):
    def fail(region):
        region.run.guards = compile("False", "<test>", "eval")  # as if the trace assumed a length

    want_seq, want_buf = _run(5)
    with adaptive_eager(**_opts(tmp_path)):
        seq, buf = _run(5, change=fail)
    torch.testing.assert_close(seq, want_seq, rtol=0, atol=0)
    torch.testing.assert_close(buf, want_buf)
    assert ae.metrics()["not_dynamic"].get("guards", 0) >= 1, ae.metrics()["not_dynamic"]


def test_a_failed_check_before_the_stores_writes_nothing_twice(tmp_path):
    """Note [A check before the stores]: the first run for a new length checks its outputs before
    the stores piece writes the buffer; a mismatch replays the window, which writes it once."""
    from fuser.launch import _Mismatch

    def mismatch(region):
        checked = region.run.checked

        def mismatching(inputs, before_stores):
            def check(outs):
                before_stores(outs)
                raise _Mismatch("as if an output's size were not the placeholder's")
            return checked(inputs, check)

        region.run.checked = mismatching

    want_seq, want_buf = _run(5)
    with adaptive_eager(**_opts(tmp_path)):
        seq, buf = _run(5, change=mismatch)
    torch.testing.assert_close(seq, want_seq, rtol=0, atol=0)
    torch.testing.assert_close(buf, want_buf)
    # steps 3 and 4, each a new length run first through the check; each replayed, its buffer written once
    assert ae.metrics()["not_dynamic"].get("output_mismatch") == 2, ae.metrics()["not_dynamic"]


def test_a_size_that_reaches_most_ops_compiles_per_size_without_a_warning(tmp_path):
    """A batch size reaches every op: one executable per size (one launch a step) beats running
    them alone; it is said at info, not warned."""
    records = []
    handler = logging.Handler(logging.INFO)
    handler.emit = records.append
    logger = logging.getLogger("adaptive_eager.fuser")  # the fuser's logger, whatever other tests did to caplog
    level = logger.level
    logger.setLevel(logging.INFO)  # setLevel, not the attribute: it clears the loggers' isEnabledFor caches
    logger.addHandler(handler)
    sizes = (2, 3, 4, 5)
    xs = {b: torch.randn(b, 8) for b in sizes}
    got = {}
    try:
        with adaptive_eager(**_opts(tmp_path)):
            for b in sizes:
                got[b] = ((xs[b] * 2).sin() + 1).exp().sum(1)
                ae.sync()
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    for b in sizes:
        torch.testing.assert_close(got[b], ((xs[b] * 2).sin() + 1).exp().sum(1))
    m = ae.metrics()
    assert m["not_dynamic"].get("sizes_alone") == 1, m["not_dynamic"]
    assert m["compiles"] == len(sizes) and not m["run_alone"] and m["blacklisted"] == 0, m
    assert not [r for r in records if r.levelno >= logging.WARNING], [r.getMessage() for r in records]
    assert any("compiles per size" in r.getMessage() for r in records), [r.getMessage() for r in records]

"""First-sight metadata kept on disk (Note [Meta entries on disk] in adaptive_eager._meta_disk):
a later process (here: the meta cache cleared, the store read again) records known signatures
from the cache directory, with the layouts a first sight gives, and ignores what it cannot trust."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
from _oracle import program_env
import torch

import adaptive_eager as ae
from adaptive_eager import _meta_disk, adaptive_eager
from neff_cache import ArtifactStore

torch.manual_seed(0)
A = torch.randn(8, 6)
IMG = torch.randn(2, 3, 8, 8).to(memory_format=torch.channels_last)
CONV = torch.nn.Conv2d(3, 4, 3).to(memory_format=torch.channels_last)
IDX = torch.tensor([0, 2, 5])


def program():
    """Ops whose output layouts are not just contiguous: a transposed operand, a non-contiguous
    slice, channels_last, several outputs, integer results, a list."""
    t = A.t()
    outs = [t * 2, (t + 1).exp(), A[:, ::2] * 3, torch.div(A, A.t().contiguous().t()),
            torch.nn.functional.relu(CONV(IMG)), *torch.max(A * 1, dim=1), (A * 4).argsort(dim=0),
            *torch.ops.aten.split_with_sizes_copy.default(A * 5, [2, 6]), (A > 0).sum(dim=0),
            (A * 6).index_select(1, IDX)]
    return outs


def geometry(outs):
    return [(tuple(o.shape), o.stride(), o.dtype) for o in outs]


def record(cache, **options):
    """The pending outputs' geometry (before anything ran), and their values."""
    with adaptive_eager(backend="inductor", cache_dir=str(cache), **options):
        outs = program()
        pending = geometry(outs)
        values = [o.clone() for o in outs]
    return pending, values


def a_new_process():
    """What a new process knows of the meta cache: nothing in memory; the store is read again."""
    ae.cache_clear()  # writes this process's new entries, then forgets them


@pytest.fixture
def cache(tmp_path):
    yield tmp_path
    a_new_process()


def test_a_second_process_records_from_disk_with_first_sights_layouts(cache):
    with torch.no_grad():
        eager = program()
    first, values = record(cache)
    assert ae.cache_info()["meta_disk_hits"] == 0
    assert first == geometry(eager)
    a_new_process()
    second, values2 = record(cache)
    info = ae.cache_info()
    assert info["meta_disk_hits"] >= 12 and info["meta_disk_ignored"] == 0, info
    assert second == first
    for v, w, e in zip(values, values2, eager):
        torch.testing.assert_close(w, v)
        torch.testing.assert_close(w, e, check_stride=True)


def stored_table(cache) -> dict:
    with ArtifactStore(cache) as store:
        return json.loads(store.get(_meta_disk._store_key(_meta_disk.fingerprint())))


def store_table(cache, table, fingerprint=None) -> None:
    fp = _meta_disk.fingerprint()
    with ArtifactStore(cache) as store:
        store.put(_meta_disk._store_key(fp), json.dumps(table).encode(), fingerprint=fingerprint or fp,
                  backend="meta", compile_seconds=0.0)


def _damaged(value, how):
    specs, nbytes, returns_list = value
    first = next(i for i, s in enumerate(specs) if s is not None)
    s = specs[first]
    if how == "type":
        return [specs, str(nbytes), returns_list]
    if how == "lengths":
        specs[first] = [s[0], s[1] + [1], s[2]]
    elif how == "negative":
        specs[first] = [[-1] + s[0][1:], s[1], s[2]]
    elif how == "dtype":
        specs[first] = [s[0], s[1], "__import__('os').system('true')"]
    elif how == "shape":
        return [specs, nbytes, "yes"]
    return [specs, nbytes, returns_list]


@pytest.mark.parametrize("how", ["type", "lengths", "negative", "dtype", "shape"])
def test_a_damaged_entry_is_ignored_and_computed_as_at_first_sight(cache, how):
    first, values = record(cache)
    a_new_process()
    table = stored_table(cache)
    store_table(cache, {k: _damaged(v, how) for k, v in table.items()})
    second, values2 = record(cache)
    info = ae.cache_info()
    assert info["meta_disk_hits"] == 0 and info["meta_disk_ignored"] >= 12, info
    assert second == first
    for v, w in zip(values, values2):
        torch.testing.assert_close(w, v)


@pytest.mark.parametrize("data", [b"not json", b"[1, 2]", b"\xff\xfe"])
def test_a_table_that_does_not_parse_is_ignored(cache, data):
    first, _ = record(cache)
    a_new_process()
    fp = _meta_disk.fingerprint()
    with ArtifactStore(cache) as store:
        store.put(_meta_disk._store_key(fp), data, fingerprint=fp, backend="meta", compile_seconds=0.0)
    second, _ = record(cache)
    assert ae.cache_info()["meta_disk_hits"] == 0 and second == first


def test_a_table_of_another_torch_build_is_not_read(cache):
    first, _ = record(cache)
    a_new_process()
    table = stored_table(cache)
    store_table(cache, table, fingerprint=_meta_disk.fingerprint().replace(torch.__version__, "0.0.1"))
    second, _ = record(cache)
    assert ae.cache_info()["meta_disk_hits"] == 0 and second == first
    with ArtifactStore(cache) as store:
        assert store.stats()["incompatible_entries"] >= 1


def test_a_table_of_another_version_of_the_library_is_not_read(cache, monkeypatch):
    """The metadata is our code's answer: a table written by another version of the library (a
    layout bug of ours, since fixed) is not read (``fuser._library.library_digest``)."""
    import fuser._library

    monkeypatch.setattr(fuser._library, "_LIBRARY_DIGEST", ["an-older-version"])
    first, _ = record(cache)
    a_new_process()
    monkeypatch.setattr(fuser._library, "_LIBRARY_DIGEST", [])
    second, _ = record(cache)
    assert ae.cache_info()["meta_disk_hits"] == 0 and second == first


def test_meta_on_disk_is_no_longer_a_setting():
    """The metadata is part of the cache: turning it off is refused, naming cache_dir."""
    from adaptive_eager.config import ConfigError, load_options

    with pytest.raises(ConfigError, match="meta_on_disk is no longer a setting .*cache_dir"):
        load_options({}, meta_on_disk=False)
    with pytest.raises(ConfigError, match="NEURON_EAGER_META_ON_DISK='0'"):
        load_options({"NEURON_EAGER_META_ON_DISK": "0"})


def test_the_key_text_keeps_number_types_apart():
    from adaptive_eager._ops import facts_for as facts

    f = facts(torch.ops.aten.add.Tensor)
    sig = [(torch.Size([2]), (1,), torch.float32), None]
    texts = {_meta_disk.key_text(f, sig[:1] + [(c, v)], (), torch.float32) for c, v in
             ((int, 1), (float, 1.0), (bool, True))}
    assert len(texts) == 3 and None not in texts
    assert _meta_disk.key_text(f, sig[:1] + [object()], (), torch.float32) is None  # not modelled: not kept


CHILD = textwrap.dedent(
    """
    import json, sys
    import torch
    import adaptive_eager as ae
    x = torch.randn(4, 6)
    img = torch.randn(1, 3, 6, 6).to(memory_format=torch.channels_last)
    conv = torch.nn.Conv2d(3, 2, 3).to(memory_format=torch.channels_last)
    with ae.adaptive_eager(backend="inductor"):
        outs = [x.t() * 2, x[:, 1::2].exp(), conv(img), (x * 3).sum(dim=0)]
        geometry = [[list(o.shape), list(o.stride()), str(o.dtype)] for o in outs]
    print(json.dumps({"geometry": geometry, "hits": ae.cache_info()["meta_disk_hits"]}))
    """
)


@pytest.mark.slow  # two child processes importing torch: ~10-20 s
def test_entries_written_by_one_process_are_read_by_the_next(tmp_path):
    env = {**program_env(),
           "NEURON_EAGER_CACHE_DIR": str(tmp_path)}
    runs = []
    for _ in range(2):
        out = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stderr
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    assert runs[0]["hits"] == 0 and runs[1]["hits"] >= 4, runs
    assert runs[1]["geometry"] == runs[0]["geometry"]

"""Note [Heap thresholds] in adaptive_eager/_heap.py: freed tensor memory is not faulted in again
every step. Each check runs in a fresh process: the tuning is once per process and cannot be undone."""

import subprocess
import sys
import textwrap

import pytest

import adaptive_eager as ae
from adaptive_eager import _heap
from adaptive_eager.config import ConfigError

from _oracle import program_env

# Three 4 MiB tensors allocated and freed a round, as a step's weight gradients are. With glibc's
# own thresholds (trim at 8 MiB once a 4 MiB block was freed) the heap's top can go back to the
# system at each free, and the next round fault its pages in again: whether it does depends on
# where small blocks land (~2,000 faults a round in about half of the processes, none in the
# rest, run to run alike). What does not vary: a 16 MiB block is its own mapping (counted by
# mallinfo2's hblks) under glibc's thresholds, in a process that has freed no larger one, and comes
# from the heap under ours.
_ROUNDS = textwrap.dedent("""
    import ctypes, json, resource, sys, torch
    import adaptive_eager as ae
    from adaptive_eager import _heap
    with ae.adaptive_eager(device="cpu", backend="replay", **json.loads(sys.argv[1])):
        pass
    class Info(ctypes.Structure):  # glibc's struct mallinfo2 (2.33+)
        _fields_ = [(name, ctypes.c_size_t) for name in
                    ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                     "uordblks", "fordblks", "keepcost")]
    mallinfo2 = ctypes.CDLL(None).mallinfo2
    mallinfo2.restype = Info
    before = mallinfo2().hblks
    big = torch.empty(4 << 20)  # 16 MiB
    own_mapping = mallinfo2().hblks - before
    del big
    def one_round():
        ts = [torch.empty(1 << 20).fill_(1) for _ in range(3)]
        del ts
    for _ in range(5):
        one_round()
    rounds = []
    for _ in range(11):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        one_round()
        rounds.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    print(json.dumps({"faults": sorted(rounds)[len(rounds) // 2], "rounds": rounds,
                      "own_mapping": own_mapping, "outcome": _heap.outcome(),
                      "tuned": ae.metrics()["malloc_tuned"]}))
""")


def _run(options: str = "{}", **env) -> dict:
    import json

    child_env = program_env(drop=("NEURON_EAGER", "MALLOC_", "GLIBC_TUNABLES", "LD_PRELOAD"))
    child_env.update(env)
    out = subprocess.run([sys.executable, "-c", _ROUNDS, options], env=child_env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def _glibc() -> bool:
    import ctypes

    try:
        ctypes.CDLL(None).mallinfo2  # noqa: B018 - glibc 2.33+
    except (OSError, AttributeError):
        return False
    return sys.platform.startswith("linux")


needs_glibc = pytest.mark.skipif(not _glibc(), reason="the thresholds are glibc's (Linux; mallinfo2: 2.33+)")


@needs_glibc
def test_freed_memory_is_not_faulted_in_again():
    tuned = _run()  # glibc's own thresholds, for comparison: test_the_programs_own_malloc_settings_win
    assert tuned["outcome"] == "tuned" and tuned["tuned"] is True
    assert tuned["own_mapping"] == 0, tuned
    assert tuned["faults"] < 20, tuned  # the median round's: none, where glibc's own fault in some processes


@needs_glibc
@pytest.mark.parametrize("env", [{"MALLOC_TRIM_THRESHOLD_": "8388608"}, {"MALLOC_MMAP_THRESHOLD_": "131072"},
                                 {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=8388608"}])
def test_the_programs_own_malloc_settings_win(env):
    out = _run(**env)
    assert out["tuned"] is False and out["outcome"].endswith(("is set", "sets malloc")), out
    assert out["own_mapping"] == 1, out  # glibc's behavior, as the program asked for it


def test_the_removed_setting_names_glibcs_own_variables():
    """``tune_malloc`` is no longer a setting: a program keeps glibc's thresholds with glibc's own
    variables, which the error names (keyword and environment alike)."""
    from adaptive_eager.config import load_options

    for spelled in ({"tune_malloc": False}, {"tune_malloc": "yes please"}):
        with pytest.raises(ConfigError, match="tune_malloc is no longer a setting .*MALLOC_TRIM_THRESHOLD_"):
            load_options({}, **spelled)
    with pytest.raises(ConfigError, match="NEURON_EAGER_TUNE_MALLOC='0': tune_malloc is no longer"):
        load_options({"NEURON_EAGER_TUNE_MALLOC": "0"})


def test_other_allocators_are_left_alone():
    from adaptive_eager.config import malloc_chosen_by_program

    assert malloc_chosen_by_program({"LD_PRELOAD": "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"}) == (
        "another malloc is preloaded")
    assert malloc_chosen_by_program({"MALLOC_TRIM_THRESHOLD_": "1"}) == "MALLOC_TRIM_THRESHOLD_ is set"
    # not malloc's: ours to set
    assert malloc_chosen_by_program({"LD_PRELOAD": "", "GLIBC_TUNABLES": "glibc.pthread.rseq=0"}) is None

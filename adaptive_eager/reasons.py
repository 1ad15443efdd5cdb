"""Why a window was flushed, or an op ran eagerly: one table of every reason the library gives
(``metrics()["flushes"]``, ``metrics()["fallback_ops"]``, ``explain()``).

Each reason says whether an op run eagerly for it counts as a fallback (``fallback_ops``: the op
could not be recorded), and the advice ``explain()`` gives for a flush site of it (None: expected,
nothing to change). A new reason is added here, or tests/test_explain.py fails.
"""

from __future__ import annotations

from typing import NamedTuple


class Reason(NamedTuple):
    name: str
    fallback: bool  # an op run eagerly for this reason is counted in ``fallback_ops``
    advice: str | None  # what explain() suggests at a flush site; None: expected


_HOST_READ = "reads the tensor on the host here: move it out of the hot loop, or read it every N steps"

REASONS: dict[str, Reason] = {r.name: r for r in (
    # a value read on the host, or the program observed
    Reason("item", False, "a value is read on the host (`.item()`) here: each read ends the window. Read it every N "
                          "steps, or keep it a tensor (accumulate losses in a tensor, call .item() once at the end)"),
    Reason("bool", False, "Python control flow on a tensor value (`if t:`, `while t:`) ends the window here. Use "
                          "torch.where / masks, or decide on the host every N steps"),
    Reason("tolist", False, f"`.tolist()` {_HOST_READ}"),
    Reason("numpy", False, f"`.numpy()` / `np.asarray(t)` / DLPack {_HOST_READ}"),
    Reason("data_ptr", False, f"`.data_ptr()` (an extension or a C library reading the memory) {_HOST_READ}"),
    Reason("storage", False, "the tensor's storage is taken here (`.untyped_storage()`, `.storage()`, "
                             "`share_memory_()`): its memory is read, so the window ends. Move it out of the hot loop"),
    Reason("pickle", False, "the tensor is pickled or copied here (`torch.save`, `copy.deepcopy`, a multiprocessing "
                            "queue): save or hand over values every N steps, after a sync point"),
    Reason("print", False, "printing while adaptive eager is on flushes (output order stays eager): print every N steps"),
    Reason("repr", False, "formatting a pending tensor (repr/str/f-string) flushes: format every N steps"),
    Reason("breakpoint", False, None),
    Reason("other_thread", False, "another thread read a value still pending in a recording thread (the line shown "
                                  "is the reader's): its window ended wherever the owner was. Hand values to other "
                                  "threads after a sync point of the owner (`.item()`, `sync()`), or read them less "
                                  "often"),
    # ops that run eagerly
    Reason("data_dependent", False, "an op whose result depends on the data (nonzero, masked indexing, unique, equal) "
                                    "runs eagerly after a flush: use a fixed-shape form (torch.where, masked_fill) if "
                                    "you can"),
    Reason("dynamic_shape", True, "an op with a data-dependent output shape runs eagerly after a flush: use a "
                                  "fixed-shape form (torch.where, masked_fill) if you can"),
    Reason("device_copy", False, "a copy to or from another device flushes here (`.cpu()`, `.to(...)`): move "
                                 "transfers out of the hot loop or batch them"),
    Reason("random", True, "a random op that cannot be drawn at record time flushes here"),
    Reason("metadata_mutation", True, "an in-place change of a tensor's shape or storage (resize_, t_, set_) flushes "
                                      "here: use the out-of-place form"),
    Reason("fallback", True, "an op adaptive eager cannot record flushes and runs eagerly here (see fallbacks below)"),
    Reason("collective", False, None),
    # the window's own ends
    Reason("window_cap", False, "the window reached the op cap and no period was found yet: raise "
                                "NEURON_EAGER_WINDOW, or sync at a step boundary (adaptive eager cuts at "
                                "optimizer.step() by itself)"),
    Reason("bytes_cap", False, "pending outputs reached the byte cap: raise NEURON_EAGER_WINDOW_MB if memory allows"),
    Reason("default_dtype", False, "the default dtype changed (torch.set_default_dtype) with ops pending: the window "
                                   "ends there. Set it once, before the loop"),
    Reason("period", False, None),
    Reason("optimizer_step", False, None),
    Reason("exit", False, None),
    Reason("sync", False, None),
    Reason("options", False, None),
    Reason("cell", False, None),
    Reason("fork", False, None),
)}

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
    advice: str | None  # what explain() suggests at a flush site of the user's own code; None: expected
    # what the code at the site does, after a subject ("this line ...", "transformers ..."): explain()
    # prints it for expected reasons and for sites inside a library (Note [Whose line] in _source)
    does: str = ""


_HOST_READ = "reads the tensor on the host here: move it out of the hot loop, or read it every N steps"

REASONS: dict[str, Reason] = {r.name: r for r in (
    # a value read on the host, or the program observed
    Reason("item", False, "a value is read on the host (`.item()`) here: each read ends the window. Read it every N "
                          "steps, or keep it a tensor (accumulate losses in a tensor, call .item() once at the end)",
           "reads a tensor's value on the host (`.item()`)"),
    Reason("bool", False, "Python control flow on a tensor value (`if t:`, `while t:`) ends the window here. Use "
                          "torch.where / masks, or decide on the host every N steps",
           "branches on a tensor's value (`if t:`, `while t:`)"),
    Reason("tolist", False, f"`.tolist()` {_HOST_READ}", "reads a tensor on the host (`.tolist()`)"),
    Reason("host_indices", False, "an op reads sizes from a tensor on the host here (`tensor_split`'s indices, a "
                                  "PackedSequence's batch sizes, the size `sparse_coo_tensor` infers): pass a "
                                  "list of ints or the size, or compute them once, before the loop",
           "reads sizes from a tensor on the host (`tensor_split`, `pad_packed_sequence`, `sparse_coo_tensor`)"),
    Reason("numpy", False, f"`.numpy()` / `np.asarray(t)` / DLPack {_HOST_READ}", "hands a tensor to NumPy or DLPack"),
    Reason("data_ptr", False, f"`.data_ptr()` (an extension or a C library reading the memory) {_HOST_READ}",
           "takes a tensor's memory address (`.data_ptr()`)"),
    Reason("storage", False, "the tensor's storage is taken here (`.untyped_storage()`, `.storage()`, "
                             "`share_memory_()`): its memory is read, so the window ends. Move it out of the hot loop",
           "takes a tensor's storage"),
    Reason("pickle", False, "the tensor is pickled or copied here (`torch.save`, `copy.deepcopy`, a multiprocessing "
                            "queue): save or hand over values every N steps, after a sync point",
           "pickles or deep-copies a tensor"),
    Reason("print", False, "printing while adaptive eager is on flushes (output order stays eager): print every N steps",
           "prints"),
    Reason("repr", False, "formatting a pending tensor (repr/str/f-string) flushes: format every N steps",
           "formats a tensor (repr/str/f-string)"),
    Reason("breakpoint", False, None, "stops in the debugger, which may read any value"),
    Reason("other_thread", False, "another thread read a value still pending in a recording thread (the line shown "
                                  "is the reader's): its window ended wherever the owner was. Hand values to other "
                                  "threads after a sync point of the owner (`.item()`, `sync()`), or read them less "
                                  "often",
           "reads a value another thread has not computed yet"),
    # ops that run eagerly
    Reason("data_dependent", False, "an op whose result depends on the data (nonzero, masked indexing, unique, equal) "
                                    "runs eagerly after a flush: use a fixed-shape form (torch.where, masked_fill) if "
                                    "you can",
           "runs an op whose result depends on the data (nonzero, masked indexing, unique, equal)"),
    Reason("dynamic_shape", True, "an op with a data-dependent output shape runs eagerly after a flush: use a "
                                  "fixed-shape form (torch.where, masked_fill) if you can",
           "runs an op whose output shape depends on the data"),
    Reason("device_copy", False, "a copy to or from another device flushes here (`.cpu()`, `.to(...)`): move "
                                 "transfers out of the hot loop or batch them",
           "copies a tensor to or from another device"),
    Reason("random", True, "a random op that cannot be drawn at record time flushes here",
           "draws random numbers with an op that cannot be drawn at record time"),
    Reason("metadata_mutation", True, "an in-place change of a tensor's shape or storage (resize_, t_, set_) flushes "
                                      "here: use the out-of-place form",
           "changes a tensor's shape or storage in place (resize_, t_, set_)"),
    Reason("out_resize", False, "an `out=` tensor of another shape than the result is resized here (as eager does, "
                                "deprecated), and pending ops use it: pass an `out=` of the result's shape, or use "
                                "the op's result instead of `out=`",
           "resizes an `out=` tensor that pending ops use"),
    Reason("kernel_warning", True, "an op whose kernel warns (a deprecation, `std` of one element) runs eagerly "
                                   "here, so that its warning comes at this line each time, as in eager: fix what "
                                   "it warns about",
           "runs an op whose kernel warns"),
    Reason("sparse", True, "an op on a sparse (or mkldnn) tensor, or one that makes one (`to_sparse`), runs eagerly "
                           "here, after a flush when it reads a pending value: keep sparse work out of the hot loop",
           "runs an op on a sparse tensor"),
    Reason("index_check", True, "an index (or a class target, or an integer divisor) out of range runs the op "
                                "eagerly here, so that eager's error comes at this line: fix the index",
           "runs an op whose index is out of range"),
    Reason("fallback", True, "an op adaptive eager cannot record flushes and runs eagerly here (see fallbacks below)",
           "runs an op adaptive eager cannot record"),
    Reason("collective", False, None, "runs a torch.distributed collective, a sync point between processes"),
    # the window's own ends
    Reason("window_cap", False, "the window reached the op cap and no period was found yet: raise "
                                "NEURON_EAGER_WINDOW, or sync at a step boundary (adaptive eager cuts at "
                                "optimizer.step() by itself)",
           "records ops past the window's op cap (NEURON_EAGER_WINDOW)"),
    Reason("bytes_cap", False, "pending outputs reached the byte cap: raise NEURON_EAGER_WINDOW_MB if memory allows",
           "leaves more pending bytes than the window's cap (NEURON_EAGER_WINDOW_MB)"),
    Reason("default_dtype", False, "the default dtype changed (torch.set_default_dtype) with ops pending: the window "
                                   "ends there. Set it once, before the loop",
           "changes the default dtype (torch.set_default_dtype)"),
    Reason("period", False, None, "ends a step of the loop: adaptive eager cuts windows at the period it found"),
    Reason("optimizer_step", False, None, "steps an optimizer: adaptive eager ends a window at each step"),
    Reason("module_capture", False, None, "calls a captured module (or its backward), whose inputs are computed "
                                         "first"),
    Reason("torch_compile", False, None, "calls code compiled with torch.compile, which runs on computed values "
                                         "with adaptive eager stepped aside"),
    Reason("exit", False, None, "leaves an adaptive_eager block, which runs what is pending"),
    Reason("sync", False, None, "calls adaptive_eager.sync()"),
    Reason("options", False, None, "changes adaptive eager's options, which runs what is pending first"),
    Reason("cell", False, None, "ends a notebook cell (%load_ext adaptive_eager)"),
    Reason("fork", False, None, "forks the process, which runs what is pending first"),
)}

# Why a region was compiled again (``metrics()["recompiles"]``), for explain(); a cause given by
# fuser/ and missing here fails tests/test_explain.py.
RECOMPILES: dict[str, str] = {
    "new_shape": "shapes change between windows (a varying batch size or sequence length): pad or bucket them; "
                 "at the second size the inductor backend compiles the region with symbolic sizes, and the "
                 "stablehlo and neuron backends (static shapes, as neuronx-cc) compile once what the varying size "
                 "does not reach and run the ops it reaches alone, where those are few (a sequence growing by a "
                 "token); otherwise one executable per size",
    "new_dtype": "a region was seen with new dtypes: keep dtypes stable across steps",
    "scalar_lifted": "a Python float that changes between steps became a runtime input of its region, which was "
                     "compiled again for it: expected once per region",
    "dynamic": "a region was compiled for varying sizes (symbolic sizes; on stablehlo and neuron, the ops a varying "
               "size reaches run alone): expected once per region",
}

# Why a window was replayed op by op instead of compiled (``metrics()["not_compiled"]``), for
# explain(); each runs eager's kernels, only slower. A key given by fuser/ and missing here fails
# tests/test_explain.py.
NOT_COMPILED: dict[str, str] = {
    "aliased_inputs": "the window writes a tensor that shares memory with another of its inputs (a tensor and a view "
                      "of it kept across steps): the compiled graph cannot express that. Make the view inside the "
                      "step, or write through one of them only",
    "overlapping_write": "the window writes through a tensor whose elements share memory (`x.expand(...).fill_()`, a "
                         "stride-0 dimension): write to a real copy (`.clone()`) instead",
    "unencodable_argument": "an op has an argument the persistent cache cannot describe (NEURON_EAGER_LOG=info names "
                            "it): pass tensors, numbers, dtypes or devices",
    "unliftable_scalars": "floats that change between steps could not become runtime inputs, so each value compiles "
                          "once it repeats: pass a value that changes every step as a 0-dim tensor",
    "grad_mode_op": "an op whose results depend on grad mode (`nn.LSTM`'s CPU kernel, `mkldnn_rnn_layer`) runs in "
                    "the window: a compiled region runs with grad mode off, so the window replays (correct, not "
                    "fused); nothing to change in your code",
    "conj_or_neg_input": "an input of the window has the conjugate or negative bit (`t.conj()`, `t.conj().imag`) "
                         "kept from outside it: compiled code would read its memory unresolved, so the window "
                         "replays (correct, not fused); `.resolve_conj()` / `.resolve_neg()` it once outside the loop",
    "compile_limit": "its compile took more memory (half the machine's) or time (15 minutes) than a compile worker "
                     "may, and was abandoned; remembered in the cache directory for a day. Worth reporting with "
                     "NEURON_EAGER_LOG=info's line for the region",
    "failed_before": "compiling it failed in an earlier process (remembered in the cache directory; the warning said "
                     "why): it is tried again after a day, or after `python -m neff_cache clear`",
}

# Why a window ran op by op (``metrics()["replay_reasons"]``) besides ``NOT_COMPILED``'s, for
# explain(); a key given by fuser/ and missing from both fails tests/test_explain.py.
REPLAYED: dict[str, str] = {
    "cold": "a window structure is compiled from its `hot_after`-th sight: its first sights replay (expected)",
    "capture_due": "it held ops of a module call captured from its next call on, so it was not compiled: the capture "
                   "runs them from then on (expected once per captured module; compiled if it is seen again)",
    "compiling": "its compile was running in the background (a worker process, or another process on the same "
                 "cache): the window replayed until it landed (expected at the start of a run)",
    "loading": "its compiled artifact was being loaded from the cache (expected once per process)",
    "fork": "the window ran at a fork (or in a forked child before its first compile), op by op (expected)",
    "output_mismatch": "a region compiled with symbolic sizes did not fit these sizes: it is compiled for them",
    "per_size": "its sizes vary, and a varying size reaches too many of its ops (or their arguments) to run them "
                "alone: it is compiled for each size (NEURON_EAGER_LOG=info says why)",
    "run_failed": "its compiled run failed (the warning says why): it replays from then on",
    "compile_failed": "the compiler failed on it (the warning says why): it replays from then on",
    "exiting": "the interpreter was exiting, after the compile thread stopped: the last windows replayed (expected)",
    "scalars_baked": "an optimizer float lifted as a runtime input is needed by the compiled graph as a number: it is "
                     "baked from then on and the next window compiles (expected once per structure)",
    "load_failed": "its artifact from the cache did not load (the warning says why): it replays from then on",
}

# Why a hot module call ran recorded instead of as its captured call (``metrics()["module_capture_misses"]``,
# Note [Captured modules] in _capture), for explain().
CAPTURE_MISSES: dict[str, str] = {
    "random": "its forward draws random numbers other than dropout's masks (or dropout on a backend that cannot draw "
              "them, p of 0 or 1): it stays recorded, so the numbers are eager's. Nothing to change (in eval() it is "
              "captured)",
    "hooks": "a hook is registered on it or a submodule (or globally): hooks run their Python every call, so it stays "
             "recorded",
    "backend": "captures compile with the inductor backend on cpu or cuda and the stablehlo or neuron backend on "
               "neuron; other backends (replay, stablehlo on cpu) record every call",
    "capture_failed": "TorchDynamo could not trace its forward as one graph (a print, .item(), data-dependent Python; "
                      "the warning says what): it stays recorded",
    "recapture_limit": "its guards kept missing (shapes, grad mode, train/eval, requires_grad changing): it stays "
                       "recorded. Keep what its forward reads the same from call to call",
    "shape": "an input's shape changed (a last, smaller batch): that call ran recorded and the next one captures "
             "the new shape; pad or drop the last batch to avoid it",
    "grad_mode": "called under another grad mode than at its capture (no_grad, inference_mode): captured again for it",
    "requires_grad": "a parameter's requires_grad changed since the capture: captured again",
    "train_eval": "train()/eval() changed since the capture: captured again for the new mode",
    "dtype": "an input's dtype changed since the capture: captured again",
    "device": "an input's device changed since the capture: captured again",
    "hooks_added": "a hook was added after the capture: it stays recorded",
    "arguments": "called with other arguments than at its capture (a keyword argument added or left out, another "
                 "number of positional ones; Hugging Face's generate() calls a model so for its first token and "
                 "then for the others): captured again for them",
    "other_guard": "another value its forward reads changed since the capture (NEURON_EAGER_LOG=info logs the "
                   "guard that failed): captured again",
    "saved_tensor_hooks": "called under a saved-tensor hook (activation checkpointing: torch.utils.checkpoint): "
                          "what the call saves is the hook's, so it stays recorded",
    "threads": "another thread had adaptive eager on, and a trace would have changed what its code computes "
               "(torch.compiler.is_compiling() is true in every thread while one compiles): not captured then, "
               "tried again at the next call",
    "traced_elsewhere": "another thread of this process was tracing a graph (a compile) at that moment, and TorchDynamo "
                        "runs no compiled call then (torch 2.13 and older): that call ran recorded (expected, rare)",
}

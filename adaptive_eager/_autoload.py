"""``NEURON_EAGER=adaptive``: turn adaptive eager on at ``import torch``, with no code change.

torch loads every entry point of the group ``torch.backends`` at the end of its own import
(``torch._import_device_backends``); pyproject.toml registers ``autoload`` there. It must be cheap
and must never break ``import torch``: with the switch off it only reads the environment.
"""

from __future__ import annotations

import atexit
import sys


def autoload() -> None:
    from .config import setting, switch_value

    try:
        mode = switch_value()
        if setting("emulate"):  # NEURON_EAGER_EMULATE=1: the device exists in eager runs too
            from .neuron_emulation import emulate_neuron

            emulate_neuron()
    except Exception as e:  # never break ``import torch`` for the user
        from ._source import warn

        warn(f"adaptive_eager stays off: {e}")
        return
    if mode != "adaptive":
        return
    try:
        from . import disable, enable
        from .config import load_options

        if _in_worker_process() and not load_options().workers:
            return  # a DataLoader worker or another multiprocessing child: Note [Worker processes]
        enable()
    except Exception as e:  # never break ``import torch`` for the user
        from ._source import warn

        warn(f"adaptive_eager could not turn on ({type(e).__name__}: {e}); running eagerly")
        return
    # the main thread's window must run before the interpreter tears torch down
    atexit.register(disable)


def _in_worker_process() -> bool:
    """Whether this interpreter is a ``multiprocessing`` child: one running its target, or a spawned
    one still importing what its target needs (its command line is multiprocessing's)."""
    import multiprocessing

    return multiprocessing.parent_process() is not None or "--multiprocessing-fork" in sys.orig_argv

"""The user's ``file:line`` of a recorded op or a flush: the innermost frame outside torch and this
library (for errors raised when the window runs, and for ``explain()``)."""

from __future__ import annotations

import os
import sys

import torch

import fuser

_getframe = sys._getframe

_LIB_DIRS = tuple(
    os.path.dirname(m.__file__) + os.sep for m in (torch, fuser, sys.modules[__name__.rsplit(".", 1)[0]])
)
# id(code object) -> whether it is torch's or this library's code. Keyed by id: a code object
# hashes its bytecode, constants and names on every lookup (0.2-0.5 us for an optimizer's loop
# function), and the record path looks up every frame between the op and the user's line (AdamW's
# single-tensor step: 8 frames, 4.6 us per recorded op). ``_lib_codes_seen`` keeps each code
# object alive, so its id is never reused for another.
_is_lib_code: dict[int, bool] = {}
_lib_codes_seen: list = []


def _user_source(depth: int):
    """(code, line) of the innermost frame outside torch and this library: the user's line."""
    # frames below ``depth`` are this function and its record-path callers, down to the mode's
    # ``__torch_dispatch__``: always library code. On a thread with fewer frames (autograd's
    # device threads run backward ops from C++) there is no user's line.
    try:
        f = _getframe(depth)
    except ValueError:
        return None
    while f is not None:
        code = f.f_code
        lib = _is_lib_code.get(id(code))
        if lib is None:
            _lib_codes_seen.append(code)
            lib = _is_lib_code[id(code)] = code.co_filename.startswith(_LIB_DIRS)
        if not lib:
            return code, f.f_lineno
        f = f.f_back
    return None

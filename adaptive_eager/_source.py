"""The user's ``file:line`` of a recorded op (the innermost frame outside torch and this library,
for errors raised when the window runs) and of a flush (the user's own line and the library line it
called that flushed, for ``explain()``: Note [Whose line])."""

from __future__ import annotations

import importlib.util
import os
import sys

_getframe = sys._getframe

# torch's, fuser's and this package's directories. Found without importing fuser: ``warn`` may run
# while ``import torch`` is still loading this package (_autoload), when torch is half imported.
_LIB_DIRS = tuple(
    os.path.dirname(importlib.util.find_spec(name).origin) + os.sep
    for name in ("torch", "fuser", __name__.rsplit(".", 1)[0])
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


# Note [Whose line]
# ``_user_source`` stops at the first frame outside torch and this library: for a model from an
# installed package (``transformers``) that is the package's line, which is what an error raised
# by the op should point at, and the record path can afford no more. What the program *should
# change* is another question: a flush inside ``transformers``, or AdamW's own ``.item()`` inside
# ``torch.optim``, is not the user's code, and advice to edit that line is advice to patch a library.
# So at flush time (once per window, not per op), ``_flush_site`` separates two frames: the user's
# own line (the innermost frame outside torch, this library, installed packages and the standard
# library) and, when the flush happened in code the user called, the library's line that did it
# (the innermost frame outside this library and torch's dispatch plumbing). explain() then names
# the library and says what the user can do from their own line.

def _installed_dirs() -> tuple[str, ...]:
    """The standard library's and the installed packages' directories, as found and resolved."""
    import site
    import sysconfig

    paths = sysconfig.get_paths()
    dirs = {paths[n] for n in ("stdlib", "platstdlib", "purelib", "platlib") if paths.get(n)}
    dirs.update(site.getsitepackages())
    dirs.add(site.getusersitepackages())
    dirs |= {os.path.realpath(d) for d in dirs}
    return tuple(os.path.join(d, "") for d in dirs)


# installed packages and the standard library (a frozen module's filename is "<frozen ...>"); a
# virtual environment's packages lie wherever it was made, hence also the path components
_NOT_USERS = _installed_dirs() + ("<frozen ",)
_PACKAGE_PARTS = (os.sep + "site-packages" + os.sep, os.sep + "dist-packages" + os.sep)
_OURS = _LIB_DIRS[1:]  # fuser and adaptive_eager: torch's own Python code may be the one that flushed
# torch's dispatcher plumbing between a call and this library's mode: never "the library that did it"
_PLUMBING = tuple(os.path.join(_LIB_DIRS[0], p) for p in ("_ops.py", "overrides.py", os.path.join("utils", "_python_dispatch.py")))
_kinds: dict[int, int] = {}  # id(code) -> _USER / _LIBRARY / _OURS_KIND; kept alive by _lib_codes_seen
_USER, _LIBRARY, _OURS_KIND = 0, 1, 2


def _kind(code) -> int:
    kind = _kinds.get(id(code))
    if kind is None:
        name = code.co_filename
        if name.startswith(_OURS) or name.startswith(_PLUMBING):
            kind = _OURS_KIND
        elif name.startswith(_LIB_DIRS) or name.startswith(_NOT_USERS) or any(p in name for p in _PACKAGE_PARTS):
            kind = _LIBRARY
        else:
            kind = _USER
        _lib_codes_seen.append(code)
        _kinds[id(code)] = kind
    return kind


def _flush_site(depth: int):
    """``(user, inside)`` for the flush (or eager op) triggered below frame ``depth``: the user's own
    ``(code, line)``, and the ``(code, line)`` inside a library it called that did it, or None when
    the user's line did it itself (Note [Whose line]). Either may be None: no such frame."""
    try:
        f = _getframe(depth)
    except ValueError:
        return None, None
    inside = None
    while f is not None:
        kind = _kind(f.f_code)
        if kind == _USER:
            return (f.f_code, f.f_lineno), inside
        if kind == _LIBRARY and inside is None:
            inside = (f.f_code, f.f_lineno)
        f = f.f_back
    return inside, None  # no user frame at all (a library's own thread): the library's line


def module_of(code) -> str:
    """The dotted module name of a library's code object (``torch.optim.optimizer``), from its file
    under an installed-packages directory; the file name where there is none."""
    name = code.co_filename
    roots = [d for d in _NOT_USERS + tuple(os.path.dirname(d.rstrip(os.sep)) + os.sep for d in _LIB_DIRS)
             if name.startswith(d)]
    for part in _PACKAGE_PARTS:
        if part in name:
            roots.append(name[:name.rindex(part) + len(part)])
    if not roots:
        return os.path.basename(name)
    rel = os.path.splitext(name[len(max(roots, key=len)):])[0].split(os.sep)
    return ".".join(rel[:-1] if rel[-1] == "__init__" else rel)


def warn(message, category: type[Warning] = UserWarning, *, as_kernel: bool = False, frame=None) -> None:
    """``warnings.warn`` at the user's own line (Note [Whose line]): not at this library's frames,
    nor at torch's ``import torch`` machinery or ``contextlib`` between them, which a fixed
    ``stacklevel`` cannot skip (the same warning is reached through different depths).
    ``as_kernel``: a warning an op's kernel gives in eager (Note [Out resizing] in ``_meta``), at
    the frame where eager's lands: a C++ warning goes to the Python frame that called the op, the
    innermost one outside this library and torch's dispatch plumbing (the user's line, or torch's
    own Python code where that called the op). ``frame``: at that frame's line (torch's own
    warning, issued again where eager would have issued it: Note [Warnings of wrapped readers] in
    ``_patches``)."""
    import warnings

    f = _getframe(1) if frame is None else frame
    if frame is not None:
        pass
    elif as_kernel:
        while f is not None and _kind(f.f_code) == _OURS_KIND:
            f = f.f_back
    else:
        while f is not None and _kind(f.f_code) != _USER:
            f = f.f_back
    if f is None:
        warnings.warn(message, category, stacklevel=2)
        return
    g = f.f_globals
    warnings.warn_explicit(message, category, f.f_code.co_filename, f.f_lineno, module=g.get("__name__", "<string>"),
                           registry=g.setdefault("__warningregistry__", {}))

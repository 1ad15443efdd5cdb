"""IPython / Jupyter integration: ``%load_ext adaptive_eager``.

Loading the extension turns adaptive eager on for every cell; ``%adaptive_eager on|off|report``
switches it or prints ``adaptive_eager.report()``; ``%unload_ext adaptive_eager`` turns it off.
Imported only by ``adaptive_eager.load_ipython_extension``: importing the library never imports
IPython.

Note [Cell boundaries]
A cell is the unit a notebook user reads errors by, so every cell ends with a flush: an error that
only shows when the window runs (an out-of-range index) is raised in the cell that recorded the op,
shown as that cell's error and marks that cell failed, never a later one. An IPython
``post_run_cell`` callback cannot do this (its exceptions are printed as "Error in callback" and
the cell still counts as a success), so an AST transformer puts the flush into the cell's own code:
the last top-level expression ``e`` becomes ``_cell_end(e)`` (which flushes, then returns ``e``),
so it is still the cell's last expression and IPython still displays its value; a cell that ends in
a statement gets ``_cell_end()`` appended, which returns None, and IPython displays nothing for
None. The helper is reached through ``__import__`` so the transformed code needs no name in the
user's namespace and also works where IPython reuses the transformer (``%time``, ``%timeit``).
A cell that raises before its end leaves its ops pending; they are flushed before IPython formats the
traceback (``showtraceback`` is wrapped: formatting prints and may repr the frames' tensors, either
of which would otherwise run the window in the middle of it), and if that flush fails too, the
cell's own exception wins and the flush error is logged, as when an ``adaptive_eager()`` block is
left on an exception. ``post_execute`` flushes anything still pending as a last resort.

Note [Cell threads]
The mode is per thread. ipykernel runs the main shell's cells in the kernel's main thread (the
thread that loads the extension), but ipykernel 7 runs each kernel subshell's cells in a thread of
its own. ``pre_execute`` fires in the thread that is about to run the cell, so it applies the
extension's on/off setting to that thread the first time it runs a cell after the setting changed.
A program's own ``adaptive_eager.enable()`` / ``disable()`` calls are respected until the next
``%adaptive_eager on|off``.
"""

from __future__ import annotations

import ast
import functools
import threading

from IPython.core.error import UsageError

from . import disable, enable, is_enabled, report
from ._flush import flush
from ._log import log
from ._state import current_state

USAGE = "Usage: %adaptive_eager on|off|report  (no argument: say whether it is on in this thread)"

# The call the transformer inserts; ``fromlist`` makes __import__ return the submodule itself.
_CELL_END_SOURCE = "__import__('adaptive_eager._ipython', fromlist=('_cell_end',))._cell_end()"


def _cell_end(value=None):
    """Flush this thread's window at the end of a cell, then hand back the cell's last value."""
    st = current_state()
    if st is not None and st.window.nodes:
        flush(st, "cell")
    return value


def _located_call(last: ast.stmt) -> ast.Call:
    """A fresh ``_cell_end()`` call placed on the cell's last statement, so a traceback through it
    shows the cell's last line (not line 1, where the parsed template would put it)."""
    call = ast.parse(_CELL_END_SOURCE, mode="eval").body
    for n in ast.walk(call):
        if "lineno" in n._attributes:
            n.lineno, n.col_offset = last.lineno, last.col_offset
            n.end_lineno, n.end_col_offset = last.end_lineno, last.end_col_offset
    return call


class _CellEndTransformer(ast.NodeTransformer):
    """Make a cell's code end with a flush, keeping the display of its last expression."""

    def __init__(self, shell):
        super().__init__()
        self.shell = shell

    def visit(self, node):  # only the cell's module: nothing inside it is rewritten
        if not isinstance(node, ast.Module) or not node.body:
            return node
        body = node.body
        last = body[-1]
        call = _located_call(last)
        if isinstance(last, ast.Expr):
            call.args = [last.value]
            last.value = call
            return node
        target = self._displayed_assignment(last)
        if target is not None:
            # 'last_expr_or_assign' displays a final ``x = ...``; IPython only looks at the last
            # node, so show ``x`` from the appended call instead.
            call.args = [ast.copy_location(ast.Name(target, ast.Load()), call)]
        body.append(ast.copy_location(ast.Expr(call), call))
        return node

    def _displayed_assignment(self, last) -> str | None:
        if getattr(self.shell, "ast_node_interactivity", None) != "last_expr_or_assign":
            return None
        if isinstance(last, ast.Assign) and len(last.targets) == 1:
            target = last.targets[0]
        elif isinstance(last, (ast.AugAssign, ast.AnnAssign)):
            target = last.target
        else:
            return None
        return target.id if isinstance(target, ast.Name) else None


class _Extension:
    """What one IPython shell's extension holds: the on/off setting and its hooks."""

    def __init__(self, shell):
        self.shell = shell
        self.on = True
        self.generation = 0  # bumped by every %adaptive_eager on|off (Note [Cell threads])
        self.seen: dict[int, int] = {}  # thread id -> the generation it last applied
        self.transformer = _CellEndTransformer(shell)
        self.showtraceback = None  # the wrapper installed on the shell
        self.own_showtraceback = None

    def apply_here(self) -> None:
        """Apply the on/off setting to the calling thread (it is about to run, or runs, a cell)."""
        tid = threading.get_ident()
        if self.seen.get(tid) == self.generation:
            return
        self.seen[tid] = self.generation
        if self.on and not is_enabled():
            enable()
        elif not self.on and is_enabled():
            disable()

    def switch(self, on: bool) -> None:
        self.on = on
        self.generation += 1
        self.apply_here()

    def pre_execute(self) -> None:
        self.apply_here()

    def flush_after_failure(self) -> None:
        """Run what a failed cell left pending; its own error wins (Note [Cell boundaries])."""
        st = current_state()
        if st is None or not st.window.nodes:
            return
        try:
            flush(st, "cell")
        except Exception as error:  # noqa: BLE001 - the cell's own error is the one shown
            log.warning(
                "adaptive_eager: the cell failed, and running the ops it recorded before the "
                "failure also failed: %s", error)

    def wrap_showtraceback(self, original):
        # Flush before the traceback is formatted: formatting prints and may repr the frames'
        # tensors, and either would otherwise run the failed cell's window in the middle of it.
        @functools.wraps(original)
        def showtraceback(*args, **kwargs):
            self.flush_after_failure()
            return original(*args, **kwargs)

        self.showtraceback = showtraceback
        return showtraceback

    def post_execute(self) -> None:
        # Normally a no-op: the cell's code ended with a flush, or showtraceback ran one.
        self.flush_after_failure()

    def magic(self, line: str) -> None:
        arg = line.strip()
        if arg == "on":
            self.switch(True)
        elif arg == "off":
            self.switch(False)
        elif arg == "report":
            _cell_end()  # so the report counts what this cell recorded so far
            print(report())
        elif arg == "":
            print(f"adaptive_eager is {'on' if is_enabled() else 'off'} in this thread. {USAGE}")
        else:
            raise UsageError(f"%adaptive_eager: unknown argument {arg!r}. {USAGE}")


_EXTENSIONS: dict = {}  # shell -> _Extension


def load(shell) -> None:
    if shell in _EXTENSIONS:
        return
    ext = _EXTENSIONS[shell] = _Extension(shell)
    shell.ast_transformers.append(ext.transformer)
    shell.events.register("pre_execute", ext.pre_execute)
    shell.events.register("post_execute", ext.post_execute)
    shell.register_magic_function(ext.magic, magic_kind="line", magic_name="adaptive_eager")
    ext.own_showtraceback = vars(shell).get("showtraceback")  # an instance override, if any
    shell.showtraceback = ext.wrap_showtraceback(shell.showtraceback)
    ext.apply_here()


def unload(shell) -> None:
    ext = _EXTENSIONS.pop(shell, None)
    if ext is None:
        return
    if ext.transformer in shell.ast_transformers:
        shell.ast_transformers.remove(ext.transformer)
    for event, callback in (("pre_execute", ext.pre_execute), ("post_execute", ext.post_execute)):
        try:
            shell.events.unregister(event, callback)
        except ValueError:
            pass
    shell.magics_manager.magics["line"].pop("adaptive_eager", None)
    if vars(shell).get("showtraceback") is ext.showtraceback:  # nobody wrapped it after us
        if ext.own_showtraceback is None:
            del shell.showtraceback  # back to the class's method
        else:
            shell.showtraceback = ext.own_showtraceback
    # Only the calling thread can be switched off here; a subshell thread keeps its mode until it
    # calls adaptive_eager.disable() (the mode is per thread).
    disable()

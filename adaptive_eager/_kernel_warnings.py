"""What the kernels a function runs warn, seen where the library can keep or drop it.

Note [Kernel warnings]
~~~~~~~~~~~~~~~~~~~~~~
A C++ kernel's warning (``TORCH_WARN``) goes to the handler of the innermost Python binding of
torch it runs under, which hands it to ``warnings`` when that binding returns, attributed to the
Python frame that called the binding. An op the mode runs itself (an ``OpOverload`` call: no
binding of its own) is under the binding of the op the program called, so what it warns reaches
the program at the program's line when that op returns: right for the op eager would run (a
fallback's warning lands where eager's does), wrong for the library's own runs on stand-ins (the
layout probe of Note [Eager layouts], the overlap probe of Note [Overlapping writes], the resize
probe of Note [Out resizing]), whose warnings ``warnings.catch_warnings`` cannot stop: they are
not Python warnings until that outer binding returns. ``autograd.Function.apply`` is a binding
that calls back into Python, so a probe run under it (``kernel_warnings``) has its kernels'
warnings handed over when ``apply`` returns, inside the ``catch_warnings`` around it.
"""

from __future__ import annotations

import warnings

import torch


class _Binding(torch.autograd.Function):
    @staticmethod
    def forward(ctx, run, box):
        box.append(run())

    @staticmethod
    def backward(ctx, *grads):  # never reached: nothing it returns requires grad
        return None, None


def kernel_warnings(run):
    """``(run(), the warnings it gave)``: Python's and its kernels' (Note [Kernel warnings]); an
    exception ``run`` raises propagates as it was raised."""
    box = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            _Binding.apply(run, box)
        except RuntimeError as e:
            # functorch's transforms route ``apply`` elsewhere: run it bare (its kernels' warnings
            # then reach the program, as they did before)
            if box or "setup_context" not in str(e):
                raise
            box.append(run())
    return box[0], caught

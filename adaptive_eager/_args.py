"""An op's arguments, off the record path's own loops."""

from __future__ import annotations

import torch

_Tensor = torch.Tensor

def _tensors(args, kwargs):
    """The tensors among an op's arguments (top level and inside lists), off the record path."""
    for a in (*args, *kwargs.values()):
        if isinstance(a, _Tensor):
            yield a
        elif type(a) in (list, tuple):
            for x in a:
                if isinstance(x, _Tensor):
                    yield x

"""The Program's one encoding and its persistent key (Note [One codec] in fuser.backends._common)."""

import pytest
import torch

from fuser.program import Program, _In, _Lifted, _Ref
from fuser.window import FRESH

X = torch.randn(4, 3)
INPUTS = [(tuple(X.shape), tuple(X.stride()), X.dtype, "cpu")]


def _program(scalar=2, kwargs=None, scalars=()) -> Program:
    ops = [
        (torch.ops.aten.mul.Tensor, [_In(0), scalar], {}, [(FRESH, 1, None)]),
        (torch.ops.aten.sum.dim_IntList, [_Ref(1), [0], True], dict(kwargs or {}), [(FRESH, 2, None)]),
    ]
    lifted = (0,) if type(scalar) is _Lifted else ()
    return Program(ops, INPUTS, [2], (), lifted, scalars)


def test_the_key_is_the_same_for_the_program_a_worker_decodes():
    program = _program(kwargs={"dtype": torch.float64})
    decoded = Program.from_bytes(program.to_bytes())
    assert decoded.to_bytes() == program.to_bytes()
    assert decoded.digest("fp") == program.digest("fp")
    torch.testing.assert_close(decoded.graph()(X)[0], (X * 2).sum(0, keepdim=True, dtype=torch.float64))


def test_the_key_tells_apart_what_changes_the_compiled_code():
    keys = {_program(scalar=s).digest("fp") for s in (2, 2.0, True)}  # 1 == 1.0 == True in Python
    keys |= {_program(kwargs={"dtype": dt}).digest("fp") for dt in (torch.float32, torch.float64)}
    keys.add(_program().digest("another backend"))
    assert len(keys) == 6


def test_the_key_leaves_out_the_lifted_floats_example_values():
    assert _program(_Lifted(0), scalars=(0.5,)).digest("fp") == _program(_Lifted(0), scalars=(0.25,)).digest("fp")


def test_an_argument_the_codec_cannot_describe_has_no_key():
    with pytest.raises(TypeError, match="cannot encode"):
        _program(scalar=object()).digest("fp")


def test_a_worker_that_traced_nothing_loads_inductors_prims():
    """``resolve_op``: Inductor's decompositions name ``prims.fma`` (AdamW's step), which torch registers
    only when Inductor's prims are imported; a fresh worker compiling a record's graph had not, and the
    optimizer step's graph ran op by op ("cannot load prims.fma.default")."""
    import subprocess
    import sys

    code = ("import sys; from fuser.backends._common import resolve_op\n"
            "assert 'torch._inductor.inductor_prims' not in sys.modules\n"
            "print(resolve_op('prims.fma.default', 'test'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "prims.fma.default", out.stderr[-2000:]

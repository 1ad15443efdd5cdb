"""The suite's workloads: each builder makes one workload's steps for every variant (plain eager,
adaptive eager, torch.compile, references), with the same sizes wherever a script uses it.

A step is a zero-argument callable that does one iteration and returns what it produced (kept
alive until the sync, so adaptive eager must materialize it: a result nobody holds is dead code
it would rightly skip). ``tiny_ops`` and ``inplace_ops`` are the op loops of
``record_overhead.py``; the suite's ``tiny`` workload is ``tiny_ops`` at 1000 ops.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

# the options every workload's adaptive variant runs with (the suite, mode_floor, gc_pauses, op_profile)
ADAPTIVE_OPTIONS = dict(backend="inductor", hot_after=2, async_compile=False)


@dataclass
class Workload:
    key: str
    title: str
    unit: str
    eager: Callable[[], object]
    adaptive: Callable[[], object]
    compile: Callable[[], object] | None
    refs: dict[str, Callable[[], object]] = field(default_factory=dict)  # extra eager references
    check: Callable[[object, object], str] | None = None  # (eager out, adaptive out) -> "" or problem


def _chain(x: torch.Tensor) -> torch.Tensor:
    y = x * 1.1 + 0.5
    y = torch.sin(y)
    y = torch.cos(y)
    y = torch.relu(y)
    y = torch.sigmoid(y)
    y = torch.exp(y)
    y = torch.tanh(y)
    y = y * y
    y = y - 0.25
    return y  # 10 ops


def _close(a, b) -> str:
    try:
        torch.testing.assert_close(a, b)
    except AssertionError as e:
        return "adaptive result differs from eager: " + str(e).splitlines()[0]
    return ""


def build_chain(device: str) -> Workload:
    x = torch.randn(4 * 1024 * 1024, device=device)
    compiled = torch.compile(_chain)
    return Workload(
        "chain", "1. 10 elementwise ops, 4M float32", "call",
        eager=lambda: _chain(x), adaptive=lambda: _chain(x), compile=lambda: compiled(x),
        check=_close,
    )


class MLPBlock(nn.Module):
    """Pre-LayerNorm transformer MLP: x + fc2(gelu(fc1(ln(x))))."""

    def __init__(self, d: int = 1024, hidden: int = 4096):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, hidden)
        self.fc2 = nn.Linear(hidden, d)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.ln(x))))


def build_mlp_block(device: str) -> Workload:
    torch.manual_seed(0)
    base = MLPBlock().to(device)
    x = torch.randn(64, 64, 1024, device=device)  # 64 sequences x 64 tokens

    def make(model):
        def fwd_bwd():
            model.zero_grad(set_to_none=True)
            loss = model(x).square().mean()
            loss.backward()
            return loss, [p.grad for p in model.parameters()]
        return fwd_bwd

    return Workload(
        "mlp_block", "2. LayerNorm+GELU MLP block 1024-4096-1024, 64x64 tokens, fwd+bwd", "iter",
        eager=make(copy.deepcopy(base)), adaptive=make(copy.deepcopy(base)),
        compile=torch.compile(make(copy.deepcopy(base))),
    )


def build_mlp_train(device: str) -> Workload:
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 1024))
    base = base.to(device)
    x = torch.randn(64, 1024, device=device)
    y = torch.randn(64, 1024, device=device)

    return _training_workload(
        "mlp_train", "3. MLP train step, 3x Linear(1024,1024), batch 64, SGD", base, x, y,
        lambda params: torch.optim.SGD(params, lr=0.01),
    )


def _training_workload(name: str, title: str, base: nn.Module, x, target, make_opt, loss_fn=F.mse_loss) -> Workload:
    """One training step (zero_grad, forward, backward, optimizer step; MSE unless ``loss_fn``) on
    three copies of ``base``: eager, adaptive and torch.compile."""

    def make(model):
        opt = make_opt(model.parameters())

        def step():
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(model(x), target)
            loss.backward()
            opt.step()
            return loss
        return step

    return Workload(
        name, title, "step",
        eager=make(copy.deepcopy(base)), adaptive=make(copy.deepcopy(base)),
        compile=torch.compile(make(copy.deepcopy(base))),
    )


def build_adamw(device: str) -> Workload:
    torch.manual_seed(0)
    base = [torch.randn(256, device=device) for _ in range(200)]
    grads = [torch.randn(256, device=device) for _ in range(200)]

    def make(foreach: bool):
        params = [p.clone().requires_grad_() for p in base]
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt = torch.optim.AdamW(params, lr=1e-3, foreach=foreach)

        def step():
            opt.step()
            return None  # the parameters and the optimizer state are what the step writes
        return step

    compiled_step = make(False)
    return Workload(
        "adamw", "4. AdamW foreach=False, 200 params x 256, opt.step()", "step",
        eager=make(False), adaptive=make(False), compile=torch.compile(compiled_step),
        refs={"eager foreach=True": make(True)},
    )


class GPTBlock(nn.Module):
    """Pre-LN GPT block with attention spelled as matmul + mask + softmax (no SDPA)."""

    def __init__(self, d: int = 256, heads: int = 4, seq: int = 128):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)
        self.register_buffer("causal", torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1))

    def forward(self, x):
        b, t, c = x.shape
        hd = c // self.heads
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q = q.view(b, t, self.heads, hd).transpose(1, 2)
        k = k.view(b, t, self.heads, hd).transpose(1, 2)
        v = v.view(b, t, self.heads, hd).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hd))
        att = att.masked_fill(self.causal[:t, :t], float("-inf"))
        att = F.softmax(att, dim=-1)
        y = (att @ v).transpose(1, 2).contiguous().view(b, t, c)
        x = x + self.proj(y)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


def build_gpt(device: str) -> Workload:
    torch.manual_seed(0)
    base = GPTBlock().to(device)
    x = torch.randn(8, 128, 256, device=device)
    target = torch.randn(8, 128, 256, device=device)

    return _training_workload(
        "gpt", "5. GPT block train step (d256, 4 heads, seq 128, batch 8, AdamW)", base, x, target,
        lambda params: torch.optim.AdamW(params, lr=1e-3),
    )



def build_cnn(device: str) -> Workload:
    """Not in the suite (``BUILDERS``): the small CNN of ``user_step.py``, for ``neuron_launches.py``."""
    torch.manual_seed(0)
    base = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
        nn.Flatten(), nn.Linear(32, 10)).to(device)
    x = torch.randn(16, 3, 32, 32, device=device)
    y = torch.randint(0, 10, (16,), device=device)
    return _training_workload(
        "cnn", "CNN train step (2 conv blocks with BatchNorm, batch 16 of 3x32x32, cross-entropy, AdamW)",
        base, x, y, lambda params: torch.optim.AdamW(params, lr=1e-3), F.cross_entropy,
    )


def tiny_ops(x: torch.Tensor, w: torch.Tensor, n: int) -> torch.Tensor:
    y = x
    for _ in range(n // 4):  # 4 ops per iteration: a mix of binary, scalar and unary ops
        y = y * w
        y = y + 1.0
        y = torch.tanh(y)
        y = y - x
    return y


def inplace_ops(p: torch.Tensor, g: torch.Tensor, n: int) -> torch.Tensor:
    for _ in range(n // 4):  # 4 in-place updates per iteration, as an optimizer step makes
        p.mul_(0.999)
        p.add_(g, alpha=-0.01)
        p.addcmul_(g, g, value=0.001)
        p.lerp_(g, 0.1)
    return p


def tiny_loop(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return tiny_ops(x, w, 1000)


def build_tiny(device: str) -> Workload:
    torch.manual_seed(0)
    x = torch.randn(16, device=device)
    w = torch.randn(16, device=device)
    compiled = torch.compile(tiny_loop)
    return Workload(
        "tiny", "6. 1000 tiny ops (16 floats) + sync", "loop",
        eager=lambda: tiny_loop(x, w), adaptive=lambda: tiny_loop(x, w), compile=lambda: compiled(x, w),
        check=_close,
    )


BUILDERS = {
    "chain": build_chain,
    "mlp_block": build_mlp_block,
    "mlp_train": build_mlp_train,
    "adamw": build_adamw,
    "gpt": build_gpt,
    "tiny": build_tiny,
}

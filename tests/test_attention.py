"""Attention without a flush per layer (Note [Dropout probability] in adaptive_eager._ops)."""

import contextlib

import torch
import torch.nn.functional as F

import adaptive_eager as ae
from adaptive_eager import adaptive_eager


def _qkv(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, 4, 8, 16, generator=g, requires_grad=True) for _ in range(3)]


def _attend(q, k, v, dropout_p):
    out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)
    out.sum().backward()
    return out.detach(), [t.grad for t in (q, k, v)]


def test_attention_without_dropout_is_recorded_not_flushed():
    """The fused CPU kernel carries ``nondeterministic_seeded`` but draws nothing at dropout_p=0
    (every Llama layer, every layer in eval()): recorded in the window like any op."""
    want = _attend(*_qkv(), 0.0)
    with adaptive_eager(backend="replay"):
        for _ in range(3):
            got = _attend(*_qkv(), 0.0)
    assert "random" not in ae.metrics()["flushes"], ae.metrics()["flushes"]
    assert ae.metrics()["fallback_ops"] == {}
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_attention_dropout_keeps_eagers_random_numbers_without_a_flush():
    """With dropout the CPU path draws its mask with ``bernoulli_`` at record time: the same numbers
    as eager, in the same order, and the generator ends where eager leaves it."""
    torch.manual_seed(7)
    want = [_attend(*_qkv(i), 0.3) for i in range(2)]
    want_state = torch.get_rng_state()
    torch.manual_seed(7)
    with adaptive_eager(backend="replay"):
        got = [_attend(*_qkv(i), 0.3) for i in range(2)]
    assert torch.equal(torch.get_rng_state(), want_state)
    assert "random" not in ae.metrics()["flushes"], ae.metrics()["flushes"]
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_a_training_loop_with_sdpa_compiled_in_process_keeps_eagers_losses():
    """An optimizer step's floats are lifted (Note [Scalar lifting] in fuser.scalars), and a program
    with lifted floats is traced with core ATen decompositions: CPU flash attention's gave another
    logsumexp than the kernel, which the backward kernel read, and the gradients were wrong (losses
    off by 2e-3 from the first compiled step). Its kernel stays (``fuser.program._KERNEL_LAYOUTS``)."""
    import torch.nn as nn

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.qkv, self.out = nn.Linear(8, 24), nn.Linear(8, 4)

        def forward(self, x):
            q, k, v = self.qkv(x).view(x.shape[0], 2, -1, 4).transpose(0, 1).chunk(3, dim=-2)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.out(a.transpose(0, 1).reshape(x.shape[0], -1, 8).sum(1))

    class SGD(torch.optim.Optimizer):
        def __init__(self, params):
            super().__init__(params, {})

        @torch.no_grad()
        def step(self):
            for group in self.param_groups:
                for p in group["params"]:
                    buf = self.state[p].get("momentum")
                    if buf is None:
                        buf = self.state[p]["momentum"] = p.grad.clone()
                    else:
                        buf.mul_(0.9).add_(p.grad)
                    p.add_(buf, alpha=-0.1)

    def train(lazy):
        model = Attention()
        opt = SGD(model.parameters())
        losses = []
        torch.manual_seed(3)
        xs = [torch.randn(6, 8) for _ in range(5)]
        with adaptive_eager(tiers="regions", async_compile=False) if lazy else contextlib.nullcontext():
            for x in xs:
                opt.zero_grad()
                loss = (model(x) ** 2).mean()
                loss.backward()
                opt.step()
                losses.append(loss.detach().clone())
        return torch.stack(losses)

    torch.testing.assert_close(train(True), train(False), rtol=1e-4, atol=1e-5)

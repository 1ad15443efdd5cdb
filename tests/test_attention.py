"""Attention without a flush per layer (Note [Dropout probability] in adaptive_eager._ops)."""

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

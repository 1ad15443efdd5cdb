"""Stock Hugging Face models from tiny configs (no downloads): GPT-2, BERT and Llama train and
generate under adaptive eager as in plain eager, with no flush per attention layer (Note [Dropout
probability] in adaptive_eager._ops), and their windows compile (Note [Views as reshapes] in
fuser.backends.inductor; the program holds needed nodes only, fuser.program)."""

import tempfile

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="the model tests need `pip install transformers` (the test extra)")

import adaptive_eager as ae  # noqa: E402
from adaptive_eager import adaptive_eager  # noqa: E402

VOCAB = 64


def _gpt2(layers=2, width=32):
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=layers, n_embd=width, n_head=4, vocab_size=VOCAB, n_positions=32, bos_token_id=0, eos_token_id=0))


def _bert(layers=2, width=32):
    return transformers.BertForMaskedLM(transformers.BertConfig(
        num_hidden_layers=layers, hidden_size=width, num_attention_heads=4, intermediate_size=2 * width,
        vocab_size=VOCAB, max_position_embeddings=32))


def _llama(layers=2, width=32):
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        num_hidden_layers=layers, hidden_size=width, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=2 * width, vocab_size=VOCAB, max_position_embeddings=32, bos_token_id=0, eos_token_id=0))


MODELS = {"gpt2": _gpt2, "bert": _bert, "llama": _llama}


def _batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (2, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0  # a padded row: the models build their attention masks from it
    return ids, mask


def _train(make, steps, **options):
    """AdamW steps from one seed; the losses as tensors (read after the block: no sync per step)."""
    torch.manual_seed(0)
    model = make()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids, mask = _batch()
    losses = []

    def run():
        for _ in range(steps):
            loss = model(input_ids=ids, attention_mask=mask, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())

    if options:
        with adaptive_eager(**options):
            run()
    else:
        run()
    return torch.stack(losses)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_training_matches_eager_with_no_flush_per_attention_layer(name):
    """Replayed windows run eager's kernels: the losses are eager's bit for bit, dropout included
    (GPT-2 and BERT train with dropout; its masks are drawn at record time). One window per step:
    the optimizer step ends it, no attention layer does."""
    steps = 3
    want = _train(MODELS[name], steps)
    got = _train(MODELS[name], steps, backend="replay")
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    flushes = ae.metrics()["flushes"]
    assert "random" not in flushes and "fallback" not in flushes, flushes
    assert ae.metrics()["fallback_ops"] == {}, ae.metrics()["fallback_ops"]


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_generate_gives_eagers_tokens_without_a_flush_per_layer(name):
    torch.manual_seed(0)
    model = MODELS[name]().eval()
    ids, _ = _batch(1)
    want = model.generate(ids[:1], max_new_tokens=6, do_sample=False, pad_token_id=0)
    with adaptive_eager(backend="replay"):
        got = model.generate(ids[:1], max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(got, want)
    flushes = ae.metrics()["flushes"]
    assert "random" not in flushes, flushes


@pytest.mark.parametrize("name", ["bert", "gpt2"])  # Llama's compile is a minute more of Inductor and fixed nothing
def test_forward_windows_compile(name, fresh_regions):
    """A one-layer model's forward compiles whole: GPT-2 used to fail ("compiled a function,
    which has no Python wrapper"), BERT with a padding mask with ``KeyError: 131072``."""
    torch.manual_seed(0)
    model = MODELS[name](layers=1, width=16).eval()
    ids, mask = _batch()
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask).logits
        # windows, not a captured call (Note [Captured modules]): the call before a capture is not
        # compiled (Note [Windows a capture supersedes])
        with adaptive_eager(backend="inductor", hot_after=1, async_compile=False, cache_dir=tempfile.mkdtemp(),
                            tiers="hot"):
            for _ in range(2):
                got = model(input_ids=ids, attention_mask=mask).logits
                ae.sync()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    m = ae.metrics()
    assert m["compile_failures"] == 0 and m["blacklisted"] == 0 and m["not_compiled"] == {}, str(m)
    assert m["compiled_runs"] >= 2 and m["run_alone"] == {}, str(m)
    assert "random" not in m["flushes"], m["flushes"]

"""The chunked head + cross-entropy (fivefold.train.loss) against the unchunked loss.

Tolerances: in fp32 the two differ only in summation order, so loss and gradients agree to
1e-5 relative (about 100 fp32 ulps). In bf16 (CPU autocast, as on a GPU) both round the head's
products to bf16 the same way but accumulate the weight gradient in a different order: the
loss agrees to 1e-4 relative, the gradients to 2e-2 relative or 5e-3 absolute (a few bf16
ulps of their largest entries, 0.7 to 1.3 here; entries near zero lose their relative accuracy
to cancellation in both).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fivefold.train.loss import LOGITS_CHUNK_BYTES, chunk_tokens, linear_cross_entropy_sum

B, T, D, V = 3, 10, 16, 50


def inputs(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, D, generator=gen).requires_grad_()
    weight = (torch.randn(V, D, generator=gen) * 0.5).requires_grad_()
    targets = torch.randint(0, V, (B, T), generator=gen)
    return hidden, weight, targets


def reference(hidden, weight, targets, autocast: bool):
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        logits = F.linear(hidden, weight)
    loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="sum")
    grads = torch.autograd.grad(loss * 0.37, (hidden, weight))
    return loss.detach(), grads


@pytest.mark.parametrize("chunk", [1, 7, B * T, 1000])
def test_fp32_matches_unchunked(chunk):
    hidden, weight, targets = inputs()
    want_loss, (want_h, want_w) = reference(hidden, weight, targets, autocast=False)
    loss = linear_cross_entropy_sum(hidden, weight, targets, chunk, torch.float32)
    got_h, got_w = torch.autograd.grad(loss * 0.37, (hidden, weight))
    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=0)
    torch.testing.assert_close(got_h, want_h, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(got_w, want_w, rtol=1e-5, atol=1e-7)
    assert got_h.dtype == torch.float32 and got_w.dtype == torch.float32


def test_bf16_matches_autocast_loss():
    hidden, weight, targets = inputs(1)
    want_loss, (want_h, want_w) = reference(hidden, weight, targets, autocast=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = linear_cross_entropy_sum(hidden, weight, targets, 8, torch.bfloat16)
    got_h, got_w = torch.autograd.grad(loss * 0.37, (hidden, weight))
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, want_loss, rtol=1e-4, atol=0)
    torch.testing.assert_close(got_h, want_h, rtol=2e-2, atol=5e-3)
    torch.testing.assert_close(got_w, want_w, rtol=2e-2, atol=5e-3)
    assert want_h.abs().max() > 0.1 and want_w.abs().max() > 0.1  # the tolerance is a few ulps
    assert got_w.dtype == torch.float32  # accumulated in the weight's dtype


def test_no_grad_path_gives_same_loss():
    hidden, weight, targets = inputs(2)
    with_grad = linear_cross_entropy_sum(hidden, weight, targets, 4, torch.float32)
    with torch.no_grad():
        without = linear_cross_entropy_sum(hidden, weight, targets, 4, torch.float32)
    torch.testing.assert_close(without, with_grad.detach(), rtol=1e-6, atol=0)


def test_chunk_size_bounds_fp32_logits():
    for vocab in (50, 8192, 128256):
        n = chunk_tokens(vocab)
        assert n * vocab * 4 <= LOGITS_CHUNK_BYTES < (n + 1) * vocab * 4
    assert chunk_tokens(128256) == 2092  # 1B preset: 8 x 2048 tokens in 8 chunks


def test_trainer_chunked_path_matches_plain_path(tiny_overrides, tmp_path):
    """The trainer's GPU loss path, forced on the CPU: 3 steps of fp32 training agree with the
    unchunked path to 1e-5 relative in loss and gradient norm (summation order only)."""
    from fivefold.config import load_config
    from fivefold.train.dist import Runtime
    from fivefold.train.trainer import Trainer

    cfg = load_config(None, tiny_overrides + ["train.steps=3", "parallel.micro_batch=2"])
    cpu = Runtime(0, 1, 0, torch.device("cpu"))
    plain = Trainer(cfg, cpu, tmp_path / "plain")
    chunked = Trainer(cfg, cpu, tmp_path / "chunked", data=plain.data)
    assert plain.loss_chunk == 0  # the CPU default: unchanged numerics
    chunked.loss_chunk = 7
    for step in range(3):
        a, b = plain.train_step(step), chunked.train_step(step)
        assert b.loss == pytest.approx(a.loss, rel=1e-5)
        assert b.grad_norm == pytest.approx(a.grad_norm, rel=1e-5)
    assert chunked.evaluate() == pytest.approx(plain.evaluate(), rel=1e-5)

"""The paper's optimizer recipe: LR schedule values and which parameters get weight decay."""

import math

import pytest
import torch

from twell.model import ModelConfig, Transformer
from twell.training.config import OptimConfig
from twell.training.optim import build_optimizer, set_lr
from twell.training.schedule import lr_factor


def test_warmup_then_cosine_to_zero():
    f = lambda step: lr_factor(step, total_steps=1000, schedule="cosine", warmup_steps=100)
    assert f(0) == pytest.approx(0.01) and f(49) == pytest.approx(0.5) and f(99) == 1.0
    assert f(100) == 1.0
    assert f(550) == pytest.approx(0.5)  # half-way through the decay
    assert f(999) == pytest.approx(0.5 * (1 + math.cos(math.pi * 899 / 900)))
    assert f(1000) == pytest.approx(0.0, abs=1e-12)
    assert lr_factor(1000, 1000, "cosine", 100, min_lr_ratio=0.1) == pytest.approx(0.1)


def test_wsd_holds_then_decays_linearly():
    f = lambda step: lr_factor(step, total_steps=1000, schedule="wsd", warmup_steps=100, decay_fraction=0.2)
    assert f(50) == pytest.approx(0.51)
    assert f(100) == f(799) == 1.0
    assert f(900) == pytest.approx(0.5)
    assert f(1000) == pytest.approx(0.0)


def test_weight_decay_on_matrices_not_on_norm_gains():
    model = Transformer(ModelConfig(d_model=64, n_heads=2, d_ff=128, n_layers=2, vocab_size=256))
    optimizer = build_optimizer(model, OptimConfig(), torch.device("cpu"))
    decayed, plain = optimizer.param_groups
    assert decayed["weight_decay"] == 0.1 and plain["weight_decay"] == 0.0
    assert any(p is model.tok_embeddings.weight for p in decayed["params"])  # tied with the output
    assert all(p.ndim == 1 for p in plain["params"]) and len(plain["params"]) == 2 * 2 + 1
    assert sum(p.numel() for g in optimizer.param_groups for p in g["params"]) == model.num_params()
    assert optimizer.defaults["betas"] == (0.9, 0.95) and optimizer.defaults["eps"] == 1e-8
    assert set_lr(optimizer, OptimConfig(), step=299, total_steps=1000) == pytest.approx(0.5e-3)
    assert all(g["lr"] == pytest.approx(0.5e-3) for g in optimizer.param_groups)

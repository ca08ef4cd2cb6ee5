"""model/calibrate.py: a random model given the paper's FFN activity (the whole-model benchmark's input)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from twell.kernels.synthetic import unit_firing_rates
from twell.model import ModelConfig, Transformer
from twell.model.calibrate import calibrate_activity

D_FF, MEAN_ACTIVE = 512, 10.0


def small_model(seed: int = 0, **overrides) -> Transformer:
    torch.manual_seed(seed)
    base = dict(vocab_size=300, d_model=64, n_layers=3, n_heads=4, d_ff=D_FF, max_seq_len=64)
    return Transformer(ModelConfig(**{**base, **overrides}))


def random_tokens(rows: int, seq_len: int, seed: int, vocab: int = 300) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (rows, seq_len), generator=gen)


def test_each_layer_fires_at_its_drawn_rates_on_the_calibration_batch():
    net = small_model()
    tokens = random_tokens(48, 64, seed=1)
    report = calibrate_activity(net, tokens, mean_active=MEAN_ACTIVE, dead_fraction=0.3, seed=5)
    T = tokens.numel()
    out = net(tokens)
    # The same draws as the calibration: one validating draw, re-seeded, then one per layer.
    gen = torch.Generator().manual_seed(5)
    for layer in range(net.cfg.n_layers):
        rates = unit_firing_rates(D_FF, mean_active=MEAN_ACTIVE, dead_fraction=0.3, rate_sigma=1.5, gen=gen)
        target = (rates * T).round()
        fires = out.stats.unit_fires[layer].float()
        live = rates > 0
        assert torch.all(fires[~live] == 0), "a dead unit fired"
        # Exact up to the odd unit whose fp32 sum lands on the other side of a midpoint threshold.
        assert (fires[live] == target[live]).float().mean() > 0.98, layer
        assert abs(report.active_mean[layer] - MEAN_ACTIVE) < 0.05 * MEAN_ACTIVE
        assert report.never_fired[layer] >= 0.3
    assert report.active_mean == pytest.approx(out.stats.active_mean.tolist(), rel=1e-4)
    assert report.tokens == T and report.channel == net.cfg.d_model - 1


def test_fresh_tokens_see_about_the_target_activity_with_denser_tokens():
    net = small_model(seed=2)
    calibrate_activity(net, random_tokens(48, 64, seed=3), mean_active=MEAN_ACTIVE)
    stats = net(random_tokens(16, 64, seed=4)).stats
    assert torch.all((stats.active_mean - MEAN_ACTIVE).abs() < 0.1 * MEAN_ACTIVE), stats.active_mean
    assert torch.all(stats.active_max > 1.5 * stats.active_mean)  # some tokens denser than the mean
    assert torch.all((stats.unit_fires == 0).float().mean(dim=1) > 0.25)  # the dead units stay dead


def test_the_bias_channel_is_constant_and_nothing_writes_to_it():
    net = small_model(seed=3)
    c = 7
    calibrate_activity(net, random_tokens(8, 64, seed=5), mean_active=MEAN_ACTIVE, channel=c)
    emb = net.tok_embeddings.weight[:, c]
    assert torch.all(emb == emb[0]) and emb[0] > 0
    residuals = []
    hooks = [
        block.register_forward_hook(lambda _m, _i, out: residuals.append(out[0])) for block in net.layers
    ]
    net(random_tokens(2, 64, seed=6))
    for hook in hooks:
        hook.remove()
    for x in residuals:
        assert torch.allclose(x[..., c], emb[0].expand_as(x[..., c]))
    for block in net.layers:
        assert torch.all(block.attn.wo.weight[c] == 0) and torch.all(block.ffn.w_down[:, c] == 0)


def test_bad_arguments_are_refused_before_any_weight_changes():
    net = small_model()
    before = {k: v.clone() for k, v in net.state_dict().items()}
    tokens = random_tokens(2, 16, seed=0)
    with pytest.raises(ValueError, match="channel=64"):
        calibrate_activity(net, tokens, channel=64)
    with pytest.raises(ValueError, match="int64"):
        calibrate_activity(net, tokens.int())
    with pytest.raises(ValueError, match="mean_active=400"):
        calibrate_activity(net, tokens, mean_active=400.0)
    after = net.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_hidden_states_is_the_decoder_without_its_head():
    net = small_model()
    tokens = random_tokens(2, 16, seed=0)
    logits = F.linear(net.hidden_states(tokens), net.output_weight())
    assert torch.equal(logits, net(tokens).logits)
    with pytest.raises(ValueError, match="max_seq_len=64"):
        net.hidden_states(random_tokens(1, 65, seed=0))

import pytest
import torch

from twell.model.config import ModelConfig
from twell.model.transformer import Transformer


def _model(impl: str) -> Transformer:
    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=256, d_model=64, n_layers=2, n_heads=4, d_ff=192, max_seq_len=64, ffn_impl=impl
    )
    return Transformer(cfg).eval()


def test_order_ffn_units_keeps_the_function_and_sorts_units_by_firing():
    model = _model("dense")
    tokens = torch.randint(0, 256, (4, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        before = model.hidden_states(tokens)
    shares = model.order_ffn_units(tokens, hot_prefix=64)
    assert len(shares) == 2 and all(64 / 192 < s <= 1 for s in shares)  # the prefix is the busiest third
    with torch.no_grad():
        after = model.hidden_states(tokens)
        stats = model(tokens).stats
    assert torch.allclose(after, before, atol=1e-5, rtol=1e-5)
    for layer, fires in enumerate(stats.unit_fires):
        assert torch.all(fires[:-1] >= fires[1:]), f"layer {layer}: units not stored most-firing first"
        assert model.layers[layer].ffn.hot_prefix == 64


def test_order_ffn_units_rejects_a_bad_prefix():
    model = _model("dense")
    with pytest.raises(ValueError, match=r"hot_prefix=100 must be a multiple of 32 in \[0, d_ff=192\]"):
        model.order_ffn_units(torch.zeros(1, 8, dtype=torch.long), hot_prefix=100)
    with pytest.raises(ValueError, match="order must be a permutation of the 192 units"):
        model.layers[0].ffn.reorder_units(torch.arange(10))


@pytest.mark.slow
def test_twell_inference_with_a_hot_prefix_matches_dense():
    """The ordered model's sparse decoder stack (80 tokens: the csr schedule, first 64 units dense)
    against its own dense path."""
    model = _model("twell")
    tokens = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(2))
    model.order_ffn_units(tokens, hot_prefix=64)
    with torch.no_grad():
        sparse = model.hidden_states(tokens)
        for block in model.layers:
            block.ffn.impl = "dense"
        dense = model.hidden_states(tokens)
    err = (sparse - dense).norm(dim=-1) / dense.norm(dim=-1)
    assert err.max() < 1e-4

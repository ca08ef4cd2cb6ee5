import pytest
import torch

from twell.model import ModelConfig, Transformer

PAPER_SIZES = {"0.5b": 0.51e9, "1b": 1.03e9, "1.5b": 1.54e9, "2b": 2.05e9}


@pytest.mark.parametrize("name", list(PAPER_SIZES))
def test_paper_presets_have_the_paper_shapes_and_counts(name):
    cfg = ModelConfig.preset(name)
    assert (cfg.d_model, cfg.d_ff, cfg.n_heads, cfg.n_kv_heads, cfg.vocab_size) == (2048, 5632, 32, 32, 49152)
    assert cfg.rope_theta == 1e5 and cfg.tie_embeddings and cfg.name == name
    with torch.device("meta"):
        net = Transformer(cfg)
    assert net.num_params() == cfg.num_params()
    assert abs(cfg.num_params() - PAPER_SIZES[name]) / PAPER_SIZES[name] < 0.02
    # PAPER.md: the FFN holds ~67% of the non-embedding parameters.
    ffn = cfg.n_layers * 3 * cfg.d_model * cfg.d_ff
    assert 0.65 < ffn / cfg.num_params(non_embedding=True) < 0.69


def test_flops_per_token_reproduces_the_paper_mfu():
    cfg = ModelConfig.preset("1.5b")
    mfu = cfg.flops_per_token(2048) * 51.4e3 / 989e12
    assert abs(mfu - 0.52) < 0.01
    assert cfg.flops_per_token(4096) - cfg.flops_per_token(2048) == 6 * 28 * 2048 * 2048


def test_preset_overrides_and_unknown_preset():
    cfg = ModelConfig.preset("tiny", vocab_size=1000 * 64, ffn_impl="auto")
    assert cfg.vocab_size == 64000 and cfg.ffn_impl == "auto" and cfg.name == "tiny"
    with pytest.raises(ValueError, match=r"unknown model preset '3b'.*tiny, 0.5b, 1b, 1.5b, 2b"):
        ModelConfig.preset("3b")
    with pytest.raises(ValueError, match="d_modle"):
        ModelConfig.preset("tiny", d_modle=256)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(d_ff=5000), "d_ff=5000 must be a multiple of 64"),
        (dict(d_model=100), "d_model=100 must be a multiple of 64"),
        (dict(n_heads=5), "d_model=128 must be divisible by n_heads=5"),
        (dict(d_model=192, n_heads=64), "head_dim .* = 3 must be even"),
        (dict(n_heads=4, n_kv_heads=3), "n_heads=4 must be a multiple of n_kv_heads=3"),
        (dict(ffn_impl="sparse"), "ffn_impl='sparse' is not one of"),
        (dict(n_layers=0), "n_layers=0 must be a positive integer"),
        (dict(max_seq_len=-1), "max_seq_len=-1 must be a positive integer"),
        (dict(norm_eps=0.0), "norm_eps=0.0 must be positive"),
        (dict(twell_hot_units=-1), r"twell_hot_units=-1 must be an integer >= 0 \(0 turns hot units off\)"),
        (dict(twell_hot_units=2.5), "twell_hot_units=2.5 must be an integer"),
    ],
)
def test_bad_config_values_name_the_value(overrides, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig(**overrides)


def test_n_kv_heads_defaults_to_n_heads():
    assert ModelConfig(n_heads=2).n_kv_heads == 2


def test_config_is_a_hydra_structured_schema():
    from omegaconf import OmegaConf
    from omegaconf.errors import ValidationError

    schema = OmegaConf.structured(ModelConfig)
    with pytest.raises(ValidationError):
        schema.d_model = "wide"
    cfg = OmegaConf.to_object(OmegaConf.merge(schema, {"n_layers": 3, "n_kv_heads": 2}))
    assert isinstance(cfg, ModelConfig) and cfg.n_layers == 3 and cfg.n_kv_heads == 2
    with pytest.raises(ValueError, match="d_ff=100 must be a multiple of 64"):
        OmegaConf.to_object(OmegaConf.merge(schema, {"d_ff": 100}))

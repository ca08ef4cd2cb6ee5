import pytest
import torch
import torch.nn.functional as F

from twell.model import ModelConfig, Transformer


def small_cfg(**overrides):
    base = dict(vocab_size=512, d_model=64, n_layers=2, n_heads=4, d_ff=128, max_seq_len=64)
    return ModelConfig(**{**base, **overrides})


def test_shapes_dtypes_and_backward():
    cfg = small_cfg()
    net = Transformer(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (3, 17))
    out = net(tokens)
    assert out.logits.shape == (3, 17, cfg.vocab_size)
    assert out.l1.dim() == 0 and out.l1.dtype == torch.float32 and out.l1.requires_grad
    s = out.stats
    assert s.active_mean.shape == s.active_max.shape == s.overflow_rows.shape == (cfg.n_layers,)
    assert s.unit_fires.shape == (cfg.n_layers, cfg.d_ff) and s.unit_fires.dtype == torch.int32
    assert s.overflow_rows.dtype == torch.int32 and s.tokens == 3 * 17
    assert not s.active_mean.requires_grad
    loss = F.cross_entropy(out.logits.flatten(0, 1), tokens.flatten()) + 2e-5 * out.l1
    loss.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in net.parameters())


def test_init_is_the_papers():
    cfg = ModelConfig.preset("tiny", n_layers=1)
    net = Transformer(cfg)
    assert net.output_weight() is net.tok_embeddings.weight  # tied
    for name, p in net.named_parameters():
        if name.endswith("norm.weight"):
            assert torch.all(p == 1), name
        else:
            assert abs(p.mean().item()) < 3e-3 and abs(p.std().item() - 0.02) < 2e-3, name


def test_past_logits_never_depend_on_future_tokens():
    cfg = small_cfg()
    net = Transformer(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (2, 24))
    cut = int(torch.randint(1, 23, ()).item())
    changed = tokens.clone()
    changed[:, cut:] = torch.randint(0, cfg.vocab_size, changed[:, cut:].shape)
    with torch.no_grad():
        a, b = net(tokens).logits, net(changed).logits
    torch.testing.assert_close(a[:, :cut], b[:, :cut])
    assert not torch.allclose(a[:, cut:], b[:, cut:])


def test_gqa_equals_mha_with_repeated_kv_heads():
    gqa = Transformer(small_cfg(n_heads=4, n_kv_heads=2))
    mha = Transformer(small_cfg(n_heads=4))
    state = gqa.state_dict()
    hd = 16
    for i in range(2):
        for name in ("wk", "wv"):
            w = state[f"layers.{i}.attn.{name}.weight"].view(2, hd, 64)
            # Query head h reads KV head h // 2, so each KV head serves two consecutive query heads.
            state[f"layers.{i}.attn.{name}.weight"] = w.repeat_interleave(2, dim=0).reshape(4 * hd, 64)
    mha.load_state_dict(state)
    tokens = torch.randint(0, 512, (2, 20))
    with torch.no_grad():
        torch.testing.assert_close(gqa(tokens).logits, mha(tokens).logits)
    assert gqa.num_params() == gqa.cfg.num_params() < mha.num_params()


def test_bf16_autocast_forward_matches_fp32():
    net = Transformer(small_cfg())
    tokens = torch.randint(0, 512, (2, 32))
    with torch.no_grad():
        ref = net(tokens)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = net(tokens)
    assert out.logits.dtype == torch.bfloat16 and out.l1.dtype == torch.float32
    torch.testing.assert_close(out.logits.float(), ref.logits, atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(out.l1, ref.l1, atol=0, rtol=3e-2)


def test_sequence_longer_than_max_seq_len_is_refused():
    net = Transformer(small_cfg(max_seq_len=16))
    with pytest.raises(ValueError, match="sequence length 17 exceeds max_seq_len=16"):
        net(torch.zeros(1, 17, dtype=torch.long))
    with pytest.raises(ValueError, match=r"\[batch, seq_len\]"):
        net(torch.zeros(17, dtype=torch.long))


def test_meta_init_then_to_empty_and_init_weights():
    cfg = small_cfg()
    reference = Transformer(cfg)
    with torch.device("meta"):
        net = Transformer(cfg)
    net.to_empty(device="cpu")
    net.init_weights()
    torch.testing.assert_close(net.rope_cos, reference.rope_cos)
    torch.testing.assert_close(net.rope_sin, reference.rope_sin)
    net.load_state_dict(reference.state_dict())
    tokens = torch.randint(0, cfg.vocab_size, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(net(tokens).logits, reference(tokens).logits)


def test_with_stats_false_gives_the_same_logits():
    net = Transformer(small_cfg())
    tokens = torch.randint(0, 512, (2, 12))
    with torch.no_grad():
        full, fast = net(tokens), net(tokens, with_stats=False)
    torch.testing.assert_close(full.logits, fast.logits)
    assert fast.l1 is None and fast.stats is None


def test_untied_head_counts_its_parameters():
    cfg = small_cfg(tie_embeddings=False)
    net = Transformer(cfg)
    assert net.output_weight() is not net.tok_embeddings.weight
    assert net.num_params() == cfg.num_params() == small_cfg().num_params() + 512 * 64

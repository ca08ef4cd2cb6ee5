import pytest
import torch

import twell.model.ffn as ffn_module
from twell.model import ModelConfig, ReLUGatedFFN, Transformer


def hand_ffn(x, w_gate, w_up, w_down):
    """Element by element: gate and up as explicit dot products, not matmuls."""
    gate = (x[:, None, :] * w_gate[None]).sum(-1)
    up = (x[:, None, :] * w_up[None]).sum(-1)
    h = torch.clamp(gate, min=0) * up
    y = (h[:, :, None] * w_down[None]).sum(1)
    return gate, up, h, y


def test_dense_ffn_output_l1_and_stats_against_hand_computation():
    ffn = ReLUGatedFFN(64, 128)
    x = torch.randn(2, 9, 64)
    y, l1, stats = ffn(x)
    gate, up, h, y_hand = hand_ffn(x.reshape(-1, 64), ffn.w_gate, ffn.w_up, ffn.w_down)
    torch.testing.assert_close(y, y_hand.view(2, 9, 64), atol=1e-5, rtol=1e-4)
    tokens = x.shape[0] * x.shape[1]
    l1_hand = sum(h[t].abs().sum() for t in range(tokens)) / tokens  # sum over units, mean over tokens
    torch.testing.assert_close(l1, l1_hand, atol=1e-6, rtol=1e-5)
    per_token = [(gate[t] > 0).sum().item() for t in range(tokens)]
    assert stats.active_mean.item() == pytest.approx(sum(per_token) / tokens)
    assert stats.active_max.item() == max(per_token)
    for j in torch.randint(0, 128, (8,)).tolist():
        assert stats.unit_fires[j].item() == sum(int(gate[t, j] > 0) for t in range(tokens))
    assert stats.overflow_rows.item() == 0


def test_l1_gradient_against_analytic_form():
    ffn = ReLUGatedFFN(64, 128)
    x = torch.randn(12, 64)
    _, l1, _ = ffn(x)
    l1.backward()
    gate, up, _, _ = hand_ffn(x, ffn.w_gate.detach(), ffn.w_up.detach(), ffn.w_down.detach())
    relu_gate = gate.clamp(min=0)
    # d/dW_u[j] mean_t |relu(g_tj) u_tj| = mean_t relu(g_tj) sign(u_tj) x_t, and symmetrically for W_g.
    grad_up = (relu_gate * up.sign()).T @ x / x.shape[0]
    grad_gate = ((gate > 0) * up.abs()).T @ x / x.shape[0]
    torch.testing.assert_close(ffn.w_up.grad, grad_up, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(ffn.w_gate.grad, grad_gate, atol=1e-5, rtol=1e-4)
    assert ffn.w_down.grad is None  # the L1 term does not involve W_d


def test_model_l1_and_stats_are_per_layer_hand_values():
    cfg = ModelConfig(vocab_size=256, d_model=64, n_layers=3, n_heads=2, d_ff=192, max_seq_len=32)
    net = Transformer(cfg)
    ffn_inputs = []
    for block in net.layers:
        block.ffn.register_forward_hook(lambda m, args, out: ffn_inputs.append(args[0].reshape(-1, 64)))
    tokens = torch.randint(0, 256, (2, 10))
    out = net(tokens)
    l1s, means, maxes, fires = [], [], [], []
    for block, x in zip(net.layers, ffn_inputs):
        gate, _, h, _ = hand_ffn(x, block.ffn.w_gate, block.ffn.w_up, block.ffn.w_down)
        l1s.append(h.abs().sum(-1).mean())
        active = gate > 0
        means.append(active.sum(-1).float().mean())
        maxes.append(active.sum(-1).max().float())
        fires.append(active.sum(0).int())
    torch.testing.assert_close(out.l1, torch.stack(l1s).mean(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.stats.active_mean, torch.stack(means))
    torch.testing.assert_close(out.stats.active_max, torch.stack(maxes))
    torch.testing.assert_close(out.stats.unit_fires, torch.stack(fires))
    assert out.stats.tokens == 20


def test_auto_routing_flips_per_layer_and_survives_a_checkpoint():
    cfg = ModelConfig(vocab_size=256, d_model=64, n_layers=4, n_heads=2, d_ff=128, ffn_impl="auto")
    net = Transformer(cfg)
    assert net.ffn_routing() == [False] * 4  # early training is dense
    values = torch.rand(4) * 100
    flags = net.update_ffn_routing(values)
    assert flags == [v < 50.0 for v in values.tolist()] == net.ffn_routing()
    assert net.update_ffn_routing(torch.tensor([10.0, 80.0, 49.9, 50.0])) == [True, False, True, False]
    x = torch.randn(3, 64, device="cuda" if torch.cuda.is_available() else "cpu")
    assert [b.ffn.takes_sparse_path(x) for b in net.layers] == [True, False, True, False] or not (
        ffn_module.kernels_usable(x)
    )
    restored = Transformer(cfg)
    restored.load_state_dict(net.state_dict())
    assert restored.ffn_routing() == [True, False, True, False]
    with pytest.raises(ValueError, match="active_mean has 3 entries; the model has 4 layers"):
        net.update_ffn_routing(torch.ones(3))


def test_twell_without_cuda_or_interpreter_uses_the_reference_path(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    dense = Transformer(ModelConfig(vocab_size=256, d_model=64, n_heads=2, d_ff=128, ffn_impl="dense"))
    twell = Transformer(ModelConfig(vocab_size=256, d_model=64, n_heads=2, d_ff=128, ffn_impl="twell"))
    twell.load_state_dict(dense.state_dict())
    tokens = torch.randint(0, 256, (2, 8))
    assert not twell.layers[0].ffn.takes_sparse_path(torch.zeros(1, 64))
    torch.testing.assert_close(twell(tokens).logits, dense(tokens).logits)


@pytest.mark.parametrize("hot_units", [None, 16])
def test_twell_path_matches_dense_outputs_l1_stats_and_grads(hot_units, monkeypatch):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not ffn_module.kernels_usable(torch.zeros(1)):
        pytest.skip("needs CUDA or TRITON_INTERPRET=1")
    import twell.kernels.training.train as kt

    taken = []  # hot units each training call used: the config must reach the kernel
    choose = kt.hot_units_for
    monkeypatch.setattr(kt, "hot_units_for", lambda *a: taken.append(choose(*a)) or taken[-1])
    base = dict(vocab_size=256, d_model=64, n_layers=2, n_heads=2, d_ff=128)
    dense = Transformer(ModelConfig(**base, ffn_impl="dense")).to(device)
    twell = Transformer(ModelConfig(**base, ffn_impl="twell", twell_hot_units=hot_units)).to(device)
    twell.load_state_dict(dense.state_dict())
    tokens = torch.randint(0, 256, (2, 8), device=device)
    a, b = dense(tokens), twell(tokens)
    torch.testing.assert_close(b.logits, a.logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(b.l1, a.l1, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(b.stats.active_mean, a.stats.active_mean)
    torch.testing.assert_close(b.stats.unit_fires, a.stats.unit_fires)
    (a.logits.sum() + a.l1).backward()
    (b.logits.sum() + b.l1).backward()
    for (name, p), q in zip(dense.named_parameters(), twell.parameters()):
        torch.testing.assert_close(q.grad, p.grad, atol=1e-3, rtol=1e-3, msg=name)
    assert taken == [16, 16] if hot_units == 16 else taken == [0, 0]  # 16 tokens: default is off
    with torch.no_grad():
        torch.testing.assert_close(twell(tokens, with_stats=False).logits, a.logits, atol=1e-4, rtol=1e-4)


def test_twell_entry_count_history_is_keyed_by_the_parameter_under_autocast():
    """Under autocast the model hands its fp32 parameters to twell_ffn (which casts them), so the
    layer's entry-count history is found again on the next step: a per-call cast copy as the key
    would be a new layer every step (no history: one host sync per layer per step)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not ffn_module.kernels_usable(torch.zeros(1)):
        pytest.skip("needs CUDA or TRITON_INTERPRET=1")
    import twell.kernels.training.train as kt

    torch.manual_seed(0)
    ffn = ReLUGatedFFN(64, 128, impl="twell").to(device)
    x = torch.randn(2, 8, 64, device=device)
    dense = ReLUGatedFFN(64, 128, impl="dense").to(device)
    dense.load_state_dict(ffn.state_dict())
    for _ in range(2):
        with torch.autocast(device, dtype=torch.bfloat16):
            y, l1, _ = ffn(x)
            y_ref, l1_ref, _ = dense(x)
        (y.float().sum() + l1).backward()
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), y_ref.float(), atol=2e-2, rtol=2e-2)
    assert ffn.w_gate.grad is not None and ffn.w_gate.grad.dtype == torch.float32
    history = kt._capacities.get(ffn.w_gate)
    assert history is not None and (16, 0) in history, "history not keyed by the layer's w_gate"

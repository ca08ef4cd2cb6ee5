"""A tiny Transformer trained with ffn_impl="twell" follows the "dense" run step for step."""

from __future__ import annotations

import pytest
import torch

import twell.kernels.training.train as kt
from twell.model import ModelConfig, Transformer

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@torch.no_grad()
def _make_ffns_sparse(net: Transformer, fire_fraction: float, tokens: torch.Tensor) -> None:
    """Give the residual stream a constant channel and shift each gate along it (the bias trick of
    kernels/synthetic.py) so ~fire_fraction of the units fire on `tokens`: the test then runs the
    sparse path at the sparsity it is built for. Calibrated layer by layer on the FFN inputs."""
    net.tok_embeddings.weight[:, -1] = 1.0
    for block in net.layers:
        captured = []
        handle = block.ffn.register_forward_pre_hook(lambda _m, args, seen=captured: seen.append(args[0]))
        net(tokens)
        handle.remove()
        x = captured[0].reshape(-1, net.cfg.d_model)
        per_unit = (x @ block.ffn.w_gate.T) / x[:, -1:]  # pre-activation per unit of the constant channel
        block.ffn.w_gate[:, -1] -= torch.quantile(per_unit, 1.0 - fire_fraction, dim=0)


@pytest.mark.parametrize("sizes", ["estimate", "static"])
def test_twell_training_steps_match_dense(sizes):
    """sizes: how each layer's entry list is sized after its first (exact) call. "static" is what a
    CUDA graph capture runs (fixed sizes, nothing read back); here every layer gets ample room after
    step 0, so the test checks that the fixed-size path is exact inside a model, not the margin."""
    seed = int(torch.randint(0, 2**31 - 1, ()))
    gen = torch.Generator().manual_seed(seed)
    base = dict(vocab_size=96, d_model=64, n_layers=2, n_heads=2, d_ff=256, max_seq_len=32)
    torch.manual_seed(seed)
    dense = Transformer(ModelConfig(**base, ffn_impl="dense")).to(DEVICE)
    calibration = torch.randint(0, base["vocab_size"], (4, 16), generator=gen).to(DEVICE)
    _make_ffns_sparse(dense, 0.03, calibration)
    twell = Transformer(ModelConfig(**base, ffn_impl="twell")).to(DEVICE)
    twell.load_state_dict(dense.state_dict())
    assert twell.layers[0].ffn.takes_sparse_path(torch.zeros(1, 64, device=DEVICE))

    # SGD, not Adam: Adam's g / sqrt(v) turns a rounding-level difference in a near-zero gradient (the
    # attention keys at init) into a full-size update, which would test Adam, not the FFN.
    opts = [torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9) for net in (dense, twell)]
    l1_coef = 0.05  # large, so the L1 gradient visibly moves the weights in a few steps
    misses = kt.static_misses(DEVICE)
    misses.zero_()
    kt.set_sizes(sizes)
    try:
        _train_side_by_side(dense, twell, opts, l1_coef, base, gen, sizes)
    finally:
        kt.set_sizes("estimate")
    assert int(misses) == 0
    for (name, p_dense), p_twell in zip(dense.named_parameters(), twell.parameters()):
        torch.testing.assert_close(p_twell, p_dense, rtol=1e-4, atol=1e-6, msg=name)


def _train_side_by_side(dense, twell, opts, l1_coef, base, gen, sizes):
    for step in range(3):
        tokens = torch.randint(0, base["vocab_size"], (2, 17), generator=gen).to(DEVICE)
        losses, stats, grads = [], [], []
        for net, opt in zip((dense, twell), opts):
            out = net(tokens[:, :-1])
            ce = torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), tokens[:, 1:].flatten())
            loss = ce + l1_coef * out.l1
            opt.zero_grad()
            loss.backward()
            grads.append([p.grad.clone() for p in net.parameters()])
            opt.step()
            losses.append(loss.detach())
            stats.append(out.stats)
        torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-6, msg=f"loss at step {step}")
        for (name, _), g_twell, g_dense in zip(dense.named_parameters(), *grads[::-1]):
            err = ((g_twell - g_dense).norm() / g_dense.norm().clamp_min(1e-12)).item()
            assert err < 1e-4, f"step {step}: gradient of {name} off by {err:.1e} (relative)"
        torch.testing.assert_close(stats[1].active_mean, stats[0].active_mean)
        torch.testing.assert_close(stats[1].unit_fires, stats[0].unit_fires)
        # Sparse at the calibrated step (later steps' large SGD updates may densify a layer of this tiny
        # model); the training CSR holds every positive, so no row takes an overflow path.
        assert int(stats[1].overflow_rows.sum()) == 0
        if step == 0:
            assert float(stats[1].active_mean.max()) < 0.25 * base["d_ff"]
        if step == 0:  # every layer has a history now: one per w_gate
            histories = [kt._capacities[block.ffn.w_gate] for block in twell.layers]
            assert all(len(h) == 1 for h in histories)
            if sizes == "static":
                for h in histories:
                    ((key, cap),) = h.items()
                    h[key] = 2 * cap + base["d_ff"] * 34  # room for every row of a batch to turn dense

"""The training op's forward replayed from per-layer CUDA graphs (kernels/training/train_graph.py).

The capacity rule and the liveness check run anywhere; the graphs themselves need a GPU: there every
replayed step is compared with the same step issued eagerly (graphs off), bit for bit, through a
capture, replays, a miss, a moved input, outputs kept alive and torch.compile.
"""

from __future__ import annotations

import pytest
import torch

from twell.kernels.synthetic import make_rows_dense, paper_like_ffn_inputs
from twell.kernels.training import train_graph as tg
from twell.kernels.training.train import twell_ffn

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_graph_capacity_has_headroom_and_recaptures_outside_its_range():
    need = 100_352
    cap = tg.graph_capacity(need)
    headroom = 1 + tg.GRAPH_HEADROOM
    assert cap % 1024 == 0 and headroom * need <= cap <= headroom * need + 1024
    assert tg.capacity_fits(cap, need) and tg.capacity_fits(cap, cap)
    assert not tg.capacity_fits(cap, cap + 1)  # a need past the capacity: recapture larger
    assert not tg.capacity_fits(cap, cap // tg.SHRINK_BELOW - 1)  # mostly unused: recapture smaller
    assert tg.capacity_fits(cap, cap // tg.SHRINK_BELOW + 1)


def test_outputs_count_as_alive_while_any_tensor_uses_their_memory():
    a, b = torch.zeros(8), torch.zeros(4, 2)
    parts = torch.zeros(3).split((2, 1))  # two tensors on one storage: counted once
    held = tg._Held([a, b, *parts])
    assert held.idle()
    alias = a.detach()  # what a replay hands out
    assert not held.idle()
    del alias
    view = parts[1][:1]  # a view of a split part
    assert not held.idle()
    del view
    kept = b.T  # a view of another output
    assert not held.idle()
    del kept
    assert held.idle()


def _layer(M, D, F, seed, mean_active=12.0):
    x, *weights = paper_like_ffn_inputs(
        M, D, F, mean_active=mean_active, dtype=torch.bfloat16, device=DEVICE, seed=seed
    )
    return x, [w.requires_grad_() for w in weights]


def _step(fn, x, weights, grad_y, hot, keep=None, autocast=False):
    """One forward and backward: (y, l1, row_active, unit_fires, dx, dW...), copies. `keep`: a list that
    gets the step's input leaf (kept alive, the next step's leaf lands elsewhere: the graph's x moves).
    The gradients are taken off the leaves afterwards: a bf16 leaf's .grad would be the graphs' shared
    gradient buffer itself (autograd keeps the tensor it is handed), which the next replay reuses."""
    leaf = x.detach().clone().requires_grad_()
    if keep is not None:
        keep.append(leaf)
    for w in weights:
        w.grad = None
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        out = fn(leaf, *weights, hot_units=hot)
    torch.autograd.backward([out.y, out.l1], [grad_y, torch.tensor(0.5, device=DEVICE)])
    outs = [out.y, out.l1, out.row_active, out.unit_fires, leaf.grad] + [w.grad for w in weights]
    outs = [t.detach().clone() for t in outs]
    leaf.grad = None
    for w in weights:
        w.grad = None
    return outs


def _assert_equal(got, want):
    names = ("y", "l1", "row_active", "unit_fires", "dx") + tuple(f"dW{i}" for i in range(len(got) - 5))
    assert len(got) == len(want)
    for name, a, b in zip(names, got, want):
        assert torch.equal(a, b), f"{name} differs from the eager op's"


@pytest.fixture
def graphs():
    """The graphs on (they are opt-in) and fresh for the test; the setting restored after it."""
    was = tg.graphs_enabled()
    tg.reset_graphs()
    tg.set_graphs(True)
    yield tg
    tg.set_graphs(was)
    tg.reset_graphs()


def _eager(fn, *args, **kwargs):
    """The same step with the graphs off (inside a test that has them on)."""
    tg.set_graphs(False)
    try:
        return _step(fn, *args, **kwargs)
    finally:
        tg.set_graphs(True)


@pytest.mark.gpu
@pytest.mark.parametrize("hot", [0, 256])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_replayed_steps_give_the_eager_op_results_bit_for_bit(graphs, hot, compiled):
    """Steps of one layer on fresh batches: the first is exact (no graph), the second captures the
    forward, the first backward after a replayed forward captures the backward, later steps replay both
    (x is a fresh tensor each step: the capture copies it in after the first move); every output and
    gradient equals the eager op's on the same batch. A batch with far more entries than the graph holds
    misses, is redone exactly (right answer) and the layer recaptures."""
    M, D, F = 4096, 512, 2048
    fn = torch.compile(twell_ffn, backend="aot_eager", fullgraph=True) if compiled else twell_ffn
    _, weights = _layer(M, D, F, seed=1)
    gen = torch.Generator(device=DEVICE).manual_seed(2)
    grad_y = torch.randn(M, D, device=DEVICE, dtype=torch.bfloat16, generator=gen)
    leaves = []
    for i in range(11):
        x, _ = _layer(M, D, F, seed=10 + i)
        if i == 5:
            make_rows_dense(x, list(range(0, M, 4)))  # ~M/4 rows of F entries: far past the capacity
        got = _step(fn, x, weights, grad_y, hot, keep=leaves)
        _assert_equal(got, _eager(fn, x, weights, grad_y, hot))
    stats = graphs.graph_stats()
    assert stats["failed"] == 0 and stats["misses"] == 1, stats
    assert stats["replays"] >= 4 and stats["backward_replays"] >= 2, stats
    layer = graphs._graphs[weights[0]]
    assert layer.inputs.copied == (True, False, False, False)  # x moved, so copied in; the weights stay put


@pytest.mark.gpu
def test_a_call_while_the_last_outputs_are_alive_runs_eagerly_and_leaves_them_intact(graphs):
    M, D, F = 4096, 512, 2048
    x, weights = _layer(M, D, F, seed=3)
    other, _ = _layer(M, D, F, seed=4)
    graphs.set_graphs(False)
    expected = twell_ffn(other, *weights, hot_units=256).y.detach().clone()
    graphs.set_graphs(True)
    with torch.no_grad():
        twell_ffn(x, *weights, hot_units=256)  # sized from the call above: eager, then captured
        kept = twell_ffn(x, *weights, hot_units=256)  # replayed
        assert graphs.graph_stats()["replays"] == 1 and graphs.graph_stats()["busy"] == 0
        y_before = kept.y.clone()
        again = twell_ffn(other, *weights, hot_units=256)  # `kept` still holds the replay's memory
        same = twell_ffn(x, *weights, hot_units=256)  # the graph's own input, but the memory is in use
        assert graphs.graph_stats()["busy"] == 2 and graphs.graph_stats()["replays"] == 1
        assert torch.equal(kept.y, y_before)
        assert torch.equal(again.y, expected) and torch.equal(same.y, y_before)
        del kept, again, same
        twell_ffn(x, *weights, hot_units=256)  # nothing left on the graph's memory: replayed
    assert graphs.graph_stats()["replays"] == 2


@pytest.mark.gpu
def test_two_layers_of_one_shape_share_the_dense_buffers_and_replay_in_turn(graphs):
    """Two layers under autocast with fp32 master weights, as the trainer runs them (the weight gradients
    reach the masters through the casts, so the shared gradient buffers are free again at once). The
    lower layer's grad_y is the upper one's dx: once both replay, the lower one finds its dx buffer in use
    and captures again on the other, and from then on both replay every step."""
    M, D, F = 4096, 512, 2048
    x, first = _layer(M, D, F, seed=5)
    _, second = _layer(M, D, F, seed=6)
    first, second = ([w.detach().float().requires_grad_() for w in ws] for ws in (first, second))
    grad_y = torch.randn(M, D, device=DEVICE, dtype=torch.bfloat16)

    def model(x_in, *weights, hot_units):  # two FFNs in a row, as blocks of one model
        a = twell_ffn(x_in, *weights[:3], hot_units=hot_units)
        h, l1 = x_in + a.y, a.l1
        del a  # y is consumed by the residual add, as in a block (the layers share y's buffer)
        b = twell_ffn(h, *weights[3:], hot_units=hot_units)
        return b._replace(l1=l1 + b.l1)

    both = first + second
    for seed in range(8):
        if seed == 6:
            before = graphs.graph_stats()
        x, _ = _layer(M, D, F, seed=20 + seed)
        got = _step(model, x, both, grad_y, 128, autocast=True)
        _assert_equal(got, _eager(model, x, both, grad_y, 128, autocast=True))
    after = graphs.graph_stats()
    assert after["replays"] - before["replays"] == 4, (before, after)  # both layers, the last two steps
    assert after["backward_replays"] - before["backward_replays"] == 4, (before, after)


@pytest.mark.gpu
def test_a_layer_without_cold_entries_replays_its_backward(graphs):
    """Every unit hot (hot_units = d_ff): the entry list is empty, whose data_ptr() is 0, and the
    backward still finds its layer's graph (until 773d32e it never did: most backwards of the 0.5b
    trainer ran eagerly) and gives the eager op's gradients."""
    M, D, F = 4096, 512, 2048
    _, weights = _layer(M, D, F, seed=7)
    grad_y = torch.randn(M, D, device=DEVICE, dtype=torch.bfloat16)
    leaves = []
    for i in range(6):
        x, _ = _layer(M, D, F, seed=30 + i)
        got = _step(twell_ffn, x, weights, grad_y, F, keep=leaves)
        _assert_equal(got, _eager(twell_ffn, x, weights, grad_y, F))
    stats = graphs.graph_stats()
    assert stats["failed"] == 0 and stats["replays"] >= 3 and stats["backward_replays"] >= 2, stats

"""Sparsity in the loop: L1 coefficient schedule, activity and dead-unit bookkeeping on constructed
patterns, gate-row re-initialisation (exact rows, right statistics, identical on 2 gloo ranks, and
under FSDP2 equal to the unsharded one), and a real tiny run that a strong L1 makes sparser."""

import itertools
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from trainer_helpers import ROOT, compose_job, run_job, tiny_overrides, train

from twell.model import ActivityStats
from twell.training.config import SparsityConfig
from twell.training.sparsity import ActivityTracker, l1_coef_at, reinit_dead_gate_rows


def stats(
    fires: list[list[int]], active_mean: list[float], active_max: list[float], tokens: int, overflow=(0, 0)
):
    return ActivityStats(
        active_mean=torch.tensor(active_mean),
        active_max=torch.tensor(active_max),
        unit_fires=torch.tensor(fires, dtype=torch.int32),
        overflow_rows=torch.tensor(overflow, dtype=torch.int32),
        tokens=tokens,
    )


def test_l1_coefficient_warms_up_linearly():
    cfg = SparsityConfig(l1_coef=2e-5, l1_warmup_start=10, l1_warmup_steps=4)
    assert [l1_coef_at(s, cfg) for s in (0, 9)] == [0.0, 0.0]
    assert [l1_coef_at(s, cfg) for s in (10, 11, 12, 13, 100)] == pytest.approx(
        [0.5e-5, 1e-5, 1.5e-5, 2e-5, 2e-5]
    )
    assert l1_coef_at(0, SparsityConfig(l1_coef=2e-5)) == 2e-5


def test_tracker_counts_on_constructed_patterns():
    tracker = ActivityTracker(n_layers=2, d_ff=4, device=torch.device("cpu"), dead_window_tokens=0)
    # step 1, two micro-batches of 10 tokens: layer 0 units 0 and 2 fire, layer 1 nothing.
    tracker.add(stats([[3, 0, 0, 0], [0, 0, 0, 0]], [1.0, 0.0], [2.0, 0.0], 10, overflow=(1, 0)))
    tracker.add(stats([[0, 0, 5, 0], [0, 0, 0, 0]], [3.0, 0.0], [4.0, 0.0], 10))
    dead = tracker.end_step(world_size=1)
    assert dead.tolist() == [[False, True, False, True], [True, True, True, True]]
    assert tracker.tokens_since_fire.tolist() == [[0, 20, 0, 20], [20, 20, 20, 20]]
    # step 2: only layer 0 unit 1 fires; a unit is now dead only after 30 tokens without firing.
    tracker.dead_window_tokens = 30
    tracker.add(stats([[0, 7, 0, 0], [0, 0, 0, 0]], [2.0, 0.0], [3.0, 0.0], 20))
    dead = tracker.end_step(world_size=1)
    assert tracker.tokens_since_fire.tolist() == [[20, 0, 20, 40], [40, 40, 40, 40]]
    assert dead.tolist() == [[False, False, False, True], [True, True, True, True]]
    record = tracker.read()
    assert record["active_mean"] == pytest.approx([(10 + 30 + 40) / 40, 0.0])  # token-weighted
    assert record["active_max"] == [4.0, 0.0]
    assert record["active_frac"] == pytest.approx([2.0 / 4, 0.0])
    assert record["fired_frac"] == [0.75, 0.0]  # units 0, 1, 2 fired at least once in the window
    assert record["dead_frac"] == [0.25, 1.0]
    assert record["overflow_rows"] == [1, 0]
    # The window restarts empty; the dead-unit clock does not.
    assert tracker.read()["fired_frac"] == [0.0, 0.0]
    assert tracker.tokens_since_fire.tolist()[0] == [20, 0, 20, 40]


def test_dead_window_counts_tokens_across_step_sizes_and_a_resume():
    """A unit is dead after dead_window_tokens without firing, however the tokens fall into steps, and a
    tracker restored from a checkpoint goes on exactly as the one that was never stopped."""
    fires = [[1, 0, 0, 0]], [[0, 0, 0, 0]], [[0, 1, 0, 0]], [[0, 0, 0, 0]], [[0, 0, 0, 0]]
    sizes = [16, 48, 16, 64, 32]  # tokens per step

    def run(tracker, steps):
        deads = []
        for f, n in steps:
            tracker.add(stats(f, [1.0], [1.0], n, overflow=(0,)))
            deads.append(tracker.end_step(world_size=1).clone())
            tracker.reinit_due()  # the trainer's re-draw after each step: its clock is state too
        return deads

    whole = ActivityTracker(n_layers=1, d_ff=4, device=torch.device("cpu"), dead_window_tokens=64)
    deads = run(whole, zip(fires, sizes))
    assert [d[0].tolist() for d in deads] == [
        [False, False, False, False],  # 16 tokens: nothing is dead yet
        [False, True, True, True],  # 64 tokens without a fire; unit 0 fired 48 tokens ago
        [True, False, True, True],  # unit 0 reaches 64; unit 1 fired in this step
        [True, True, True, True],  # unit 1: 64 tokens since its fire
        [True, True, True, True],
    ]
    first = ActivityTracker(n_layers=1, d_ff=4, device=torch.device("cpu"), dead_window_tokens=64)
    run(first, list(zip(fires, sizes))[:2])
    resumed = ActivityTracker(n_layers=1, d_ff=4, device=torch.device("cpu"), dead_window_tokens=64)
    resumed.load_state_dict(first.state_dict())
    assert [d.tolist() for d in run(resumed, list(zip(fires, sizes))[2:])] == [d.tolist() for d in deads[2:]]
    assert torch.equal(resumed.tokens_since_fire, whole.tokens_since_fire)
    assert torch.equal(resumed.tokens_since_reinit, whole.tokens_since_reinit)
    # A state saved before the re-draw clock existed resumes as if no row had been re-drawn in its window.
    old = {k: v for k, v in first.state_dict().items() if k != "tokens_since_reinit"}
    resumed.load_state_dict(old)
    assert torch.equal(resumed.tokens_since_reinit, first.tokens_since_fire)


@pytest.mark.parametrize(
    "sizes, unit1_due, unit2_due",
    [
        ([16] * 16, [80, 144, 208], [112, 176, 240]),
        ([64] * 4, [128, 192, 256], [64, 128, 256]),
        ([32, 8, 24, 64, 40, 24, 64], [128, 192, 256], [128, 192, 256]),
    ],
    ids=["16", "64", "mixed"],
)
def test_a_silent_unit_is_redrawn_once_per_window_whatever_the_step_size(sizes, unit1_due, unit2_due):
    """Over 256 tokens and a 64-token window: unit 0 never fires and is due at 64, 128, 192 and 256 tokens
    however the tokens fall into steps (one re-draw per window of silence, not one per step once dead),
    and counts as dead at every step in between; unit 1 fires in the first step, unit 2 in the third,
    each due a window after its fire and then a window after each re-draw."""
    tracker = ActivityTracker(n_layers=1, d_ff=3, device=torch.device("cpu"), dead_window_tokens=64)
    due_at, dead_at, seen = {0: [], 1: [], 2: []}, [], 0
    for i, n in enumerate(sizes):
        fires = [[0, int(i == 0), int(i == 2)]]
        tracker.add(stats(fires, [1.0], [1.0], n, overflow=(0,)))
        dead = tracker.end_step(world_size=1).clone()
        seen += n
        due = tracker.reinit_due()
        assert not (due & ~dead).any()  # only dead units are due
        for unit in due[0].nonzero().flatten().tolist():
            due_at[unit].append(seen)
        if dead[0, 0]:
            dead_at.append(seen)
    assert due_at == {0: [64, 128, 192, 256], 1: unit1_due, 2: unit2_due}
    assert dead_at == [end for end in itertools.accumulate(sizes) if end >= 64]


@pytest.mark.parametrize("kernel", [False, True], ids=["torch", "kernel"])
def test_reinit_touches_exactly_the_dead_rows_with_the_right_statistics(kernel):
    """kernel: kernels/reinit.py (the default on CUDA; Triton's interpreter here), else PyTorch's draw."""
    torch.manual_seed(0)
    weights = [torch.nn.Parameter(torch.randn(1024, 256) * 0.05) for _ in range(2)]
    dead = torch.zeros(2, 1024, dtype=torch.bool)
    dead[0, ::3] = True
    dead[1, 5] = True
    optimizer = torch.optim.AdamW(weights)
    sum(w.square().sum() for w in weights).backward()
    optimizer.step()  # AdamW moments exist now
    before = [w.detach().clone() for w in weights]
    counts = reinit_dead_gate_rows(
        weights, dead, step=7, seed=0, lam=0.1, sigma=0.02, optimizer=optimizer, kernel=kernel
    )
    assert counts.tolist() == [342, 1]
    for w, old, rows in zip(weights, before, dead):
        moved = (w.detach() != old).any(dim=1)
        assert torch.equal(moved, rows)  # exactly the dead rows changed
        noise = (w.detach()[rows] - 0.9 * old[rows]) / 0.1
        if rows.sum() > 100:  # enough values for the statistics
            assert noise.mean().item() == pytest.approx(0.0, abs=1e-3)
            assert noise.std().item() == pytest.approx(0.02, rel=0.02)
        moments = optimizer.state[w]
        assert torch.all(moments["exp_avg"][rows] == 0) and torch.all(moments["exp_avg_sq"][rows] == 0)
        assert torch.all(moments["exp_avg"][~rows] != 0)
    # The same (seed, step) draws the same noise; another step draws other noise.
    again = [torch.nn.Parameter(old.clone()) for old in before]
    reinit_dead_gate_rows(again, dead, step=7, seed=0, lam=0.1, sigma=0.02, kernel=kernel)
    assert all(torch.equal(a, w) for a, w in zip(again, weights))
    other = [torch.nn.Parameter(old.clone()) for old in before]
    reinit_dead_gate_rows(other, dead, step=8, seed=0, lam=0.1, sigma=0.02, kernel=kernel)
    assert not torch.equal(other[0], weights[0])


def _reinit_on_rank(rank: int, world_size: int, init_file: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    torch.manual_seed(0)  # the replicas start identical, as under DDP
    weights = [torch.nn.Parameter(torch.randn(64, 32) * 0.05) for _ in range(2)]
    tracker = ActivityTracker(2, 64, torch.device("cpu"), dead_window_tokens=0)
    fires = torch.zeros(2, 64, dtype=torch.int32)
    fires[:, rank] = 1  # unit 0 fires only on rank 0, unit 1 only on rank 1: neither is dead
    tracker.add(ActivityStats(torch.ones(2), torch.ones(2), fires, torch.zeros(2, dtype=torch.int32), 16))
    dead = tracker.end_step(world_size)
    reinit_dead_gate_rows(weights, dead, step=3, seed=0, lam=0.1, sigma=0.02)
    torch.save({"dead": dead, "weights": [w.detach() for w in weights]}, os.path.join(out_dir, f"{rank}.pt"))
    dist.destroy_process_group()


def test_reinit_is_identical_on_two_gloo_ranks(tmp_path):
    mp.spawn(_reinit_on_rank, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    rank0, rank1 = (torch.load(tmp_path / f"{r}.pt") for r in (0, 1))
    assert torch.equal(rank0["dead"], rank1["dead"])
    assert rank0["dead"][:, :2].sum() == 0 and rank0["dead"][:, 2:].all()  # fires summed over ranks
    assert all(torch.equal(a, b) for a, b in zip(rank0["weights"], rank1["weights"]))


class _Gates(torch.nn.Module):
    """Two layers' gate weights, 63 units each: FSDP2 shards them 32 + 31 rows (uneven)."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Module() for _ in range(2))
        for layer in self.layers:
            layer.w_gate = torch.nn.Parameter(torch.randn(63, 32) * 0.05)


def _dead_set() -> torch.Tensor:
    dead = torch.zeros(2, 63, dtype=torch.bool)
    dead[0, ::3] = True
    dead[0, 31:33] = True  # on both sides of the shard boundary
    dead[1, [0, 62]] = True
    return dead


def _fsdp_reinit_on_rank(rank: int, world_size: int, init_file: str, out_dir: str, kernel: bool) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    torch.manual_seed(0)
    gates = _Gates()
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in gates.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(gates, mesh=mesh)
    weights = [layer.w_gate for layer in gates.layers]
    assert all(isinstance(w, DTensor) and w.to_local().shape[0] == (32, 31)[rank] for w in weights)
    optimizer = torch.optim.AdamW(weights, foreach=True)
    sum(w.square().sum() for w in weights).backward()
    optimizer.step()  # DTensor AdamW moments exist now

    def full() -> dict:
        return {
            "weights": [w.detach().full_tensor() for w in weights],
            "moments": [
                [optimizer.state[w][k].full_tensor() for k in ("exp_avg", "exp_avg_sq")] for w in weights
            ],
        }

    before = full()
    counts = reinit_dead_gate_rows(
        weights, _dead_set(), step=7, seed=0, lam=0.1, sigma=0.02, optimizer=optimizer, kernel=kernel
    )
    torch.save({"before": before, "after": full(), "counts": counts}, os.path.join(out_dir, f"{rank}.pt"))
    dist.destroy_process_group()


@pytest.mark.parametrize("kernel", [False, True], ids=["torch", "kernel"])
def test_reinit_under_fsdp_equals_the_unsharded_reinit(tmp_path, kernel):
    """FSDP2 shards each gate weight (and its AdamW moments) by rows, i.e. by unit: each rank re-draws
    the rows it holds from the same full noise, so the gathered result is the one-process result (the
    kernel: from the rows' global indices)."""
    args = (2, str(tmp_path / "init"), str(tmp_path), kernel)
    mp.spawn(_fsdp_reinit_on_rank, args=args, nprocs=2, join=True)
    rank0, rank1 = (torch.load(tmp_path / f"{r}.pt") for r in (0, 1))
    before, after, dead = rank0["before"], rank0["after"], _dead_set()
    assert rank0["counts"].tolist() == [23, 2]
    plain = [torch.nn.Parameter(w.clone()) for w in before["weights"]]
    reinit_dead_gate_rows(plain, dead, step=7, seed=0, lam=0.1, sigma=0.02, kernel=kernel)
    for layer, rows in enumerate(dead):
        got, old = after["weights"][layer], before["weights"][layer]
        assert torch.equal(got, plain[layer].detach())  # exactly the unsharded re-init
        assert torch.equal((got != old).any(dim=1), rows)  # exactly the dead rows changed
        assert torch.equal(rank1["after"]["weights"][layer], got)
        for moment, old_moment in zip(after["moments"][layer], before["moments"][layer]):
            assert torch.equal(moment, old_moment.masked_fill(rows.unsqueeze(1), 0.0))


def test_strong_l1_makes_a_tiny_model_sparser(offline_data, tmp_path):
    records = run_job(
        tiny_overrides(offline_data, tmp_path, 30, "sparsity=paper_no_reinit", "sparsity.l1_coef=0.05",
                       "logging.log_interval=5")
    )  # fmt: skip
    first, last = records[0], records[-1]
    mean = lambda r: sum(r["active_mean"]) / len(r["active_mean"])
    assert mean(last) < 0.3 * mean(first), [mean(r) for r in records]
    assert last["l1"] < first["l1"]
    assert last["l1_coef"] == 0.05 and last["loss"] == pytest.approx(last["ce"] + 0.05 * last["l1"])
    # The per-layer plots of the run.
    plotted = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "plot_activity.py"), str(tmp_path)],
        capture_output=True,
        text=True,
    )
    assert plotted.returncode == 0, plotted.stderr
    assert (tmp_path / "activity.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_auto_routing_is_rechecked_with_the_measured_activity(offline_data, tmp_path):
    # A threshold above d_ff sends every layer to the sparse path at the first check (step 2).
    overrides = tiny_overrides(offline_data, tmp_path, 2, "model.ffn_impl=auto", "model.twell_threshold=1000",
                               "model.twell_check_interval=2")  # fmt: skip
    trainer = train.build_trainer(compose_job(overrides))
    assert trainer.model.ffn_routing() == [False, False]
    records = [r for r in trainer.fit() if "loss" in r]
    assert trainer.model.ffn_routing() == [True, True]
    # The routing per layer is logged (JSONL, wandb): dense after step 1, sparse after the check at step 2.
    assert [r["ffn_sparse"] for r in records] == [[0, 0], [1, 1]]

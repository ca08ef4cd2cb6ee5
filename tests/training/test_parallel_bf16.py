"""bf16 training under every parallel mode (CPU, gloo, 2 processes): one process, DDP and FSDP2 with its
bf16 MixedPrecisionPolicy (bf16 gathers and compute, fp32 reduction and master weights) train the same
losses to bf16 tolerance through gradient accumulation and dead-unit re-inits, and an FSDP2 run resumes
bit for bit, also with other reshard and prefetch settings (they move no number)."""

import json
import shutil

import pytest
from trainer_helpers import run_cli, run_job, tiny_overrides

from twell.training.distributed import destroy


def losses(records: list[dict]) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in records if "loss" in r}


def logged(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def bf16_runs(offline_data, tmp_path_factory):
    """12 steps of the sparse recipe in bf16 (a strong L1 and a 512-token dead window: units die and are
    re-initialised from step 8), 512 tokens a step: 2 micro-batches per rank on 2 processes, 4 in one
    (plain, and FSDP2 over a one-rank mesh); a checkpoint at step 6."""
    base = tmp_path_factory.mktemp("bf16")
    overrides = tiny_overrides(
        offline_data, base, 12, "sparsity=paper", "sparsity.l1_coef=0.1", "sparsity.dead_window_tokens=512",
        "train.precision=bf16", "train.global_batch_tokens=512", "checkpoint.interval=6", "checkpoint.keep_last=0",
    )  # fmt: skip
    runs = {"one": run_job([*overrides, f"run_dir={base / 'one'}"])}
    try:
        runs["fsdp_one"] = run_job([*overrides, "train.parallel=fsdp", f"run_dir={base / 'fsdp_one'}"])
    finally:
        destroy()  # the one-rank process group FSDP2 made in this process
    for parallel in ("ddp", "fsdp"):
        run_dir = base / parallel
        done = run_cli([*overrides, f"train.parallel={parallel}", f"run_dir={run_dir}"], torchrun=2)
        assert done.returncode == 0, done.stderr[-3000:]
        assert f"(bf16, {parallel.upper().replace('FSDP', 'FSDP2')}), grad_accum 2" in done.stdout
        runs[parallel] = logged(run_dir)
    return overrides, base, runs


def test_one_process_ddp_and_fsdp_agree_in_bf16(bf16_runs):
    _, _, runs = bf16_runs
    one = {r["step"]: r for r in runs["one"]}
    reinit_steps = lambda records: [r["step"] for r in records if "loss" in r and sum(r["reinit_units"])]
    assert min(reinit_steps(runs["one"]), default=12) < 10, "the test needs re-inits before its last steps"
    for parallel in ("fsdp_one", "ddp", "fsdp"):
        got = {r["step"]: r for r in runs[parallel] if "loss" in r}
        assert sorted(got) == list(range(1, 13))
        for step, want in one.items():
            # bf16 compute: the same math, rounded in another order (fp32 reduction over 2 ranks, bf16
            # parameters under FSDP2 where DDP casts fp32 ones inside each op): within bf16's 2^-8.
            assert got[step]["loss"] == pytest.approx(want["loss"], rel=2**-8), (parallel, step)
            assert got[step]["ce"] == pytest.approx(want["ce"], rel=2**-8), (parallel, step)
        # Activity is counted from the forward's gate: the same per-layer picture.
        for step in (1, 12):
            assert got[step]["active_mean"] == pytest.approx(one[step]["active_mean"], rel=0.1, abs=2)
        # Dead units are counted over both ranks' tokens and re-initialised on every rank's replica or
        # shard alike: they start at the same step (how many may differ a little, bf16 rounding having
        # moved which units fired).
        assert reinit_steps(runs[parallel])[:1] == reinit_steps(runs["one"])[:1], parallel


def test_fsdp_bf16_resume_is_bit_identical_with_other_reshard_and_prefetch(bf16_runs, tmp_path):
    overrides, base, runs = bf16_runs
    step_6 = base / "fsdp" / "checkpoints" / "step_00000006"
    shutil.copytree(step_6, tmp_path / "checkpoints" / step_6.name)
    cli = [
        *overrides, "train.parallel=fsdp", "train.fsdp_reshard_after_forward=false", "train.fsdp_prefetch=0",
        f"run_dir={tmp_path}",
    ]  # fmt: skip
    done = run_cli(cli, torchrun=2)
    assert done.returncode == 0, done.stderr[-3000:]
    reference = losses(runs["fsdp"])
    assert losses(logged(tmp_path)) == {step: reference[step] for step in range(7, 13)}

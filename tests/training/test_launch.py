"""scripts/launch/: the single-node and Slurm launchers are valid bash and build a torchrun command that
torchrun's own parser accepts, with train.py's overrides passed through unchanged (DRY_RUN=1 prints it)."""

import os
import shlex
import subprocess

import pytest
from torch.distributed.run import get_args_parser
from trainer_helpers import ROOT, compose_job

LAUNCH = ROOT / "scripts" / "launch"
OVERRIDES = ["experiment=paper_1.5b", "train.parallel=fsdp", "run_name=two words"]


def dry_run(script: str, **env: str) -> list[str]:
    """The command the launcher would run, with only `env` of the launchers' own variables set."""
    own = ("GPUS", "GPUS_PER_NODE", "MASTER_ADDR", "RDZV_PORT", "PYTHON")
    base = {k: v for k, v in os.environ.items() if k not in own and not k.startswith("SLURM_")}
    done = subprocess.run(
        ["bash", str(LAUNCH / script), *OVERRIDES], env={**base, "DRY_RUN": "1", **env},
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    return shlex.split(done.stdout)


def torchrun_args(command: list[str]):
    """The arguments after `python -m torch.distributed.run`, parsed by torchrun's parser."""
    start = command.index("torch.distributed.run") + 1
    assert command[start - 2] == "-m"
    return get_args_parser().parse_args(command[start:])


def test_launchers_are_valid_bash():
    for script in ("single_node.sh", "slurm.sbatch"):
        subprocess.run(["bash", "-n", str(LAUNCH / script)], check=True)


def test_single_node_runs_one_process_per_gpu_through_a_local_rendezvous():
    args = torchrun_args(dry_run("single_node.sh", GPUS="4"))
    assert args.standalone and args.nnodes == "1" and args.nproc_per_node == "4"
    # train.py of this checkout, by its full path: the overrides' relative paths stay the caller's
    assert args.training_script == str(ROOT / "train.py") and args.training_script_args == OVERRIDES
    compose_job(args.training_script_args)  # the overrides are a valid job


def test_slurm_runs_one_torchrun_per_node_meeting_at_the_first_node():
    command = dry_run("slurm.sbatch", MASTER_ADDR="node7", SLURM_NNODES="4", SLURM_JOB_ID="1234")
    assert command[0] == "srun" and "--ntasks-per-node=1" in command[: command.index("-m")]
    args = torchrun_args(command)
    assert (args.nnodes, args.nproc_per_node) == ("4", "8")
    assert (args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id) == ("c10d", "node7:29500", "1234")
    assert not args.standalone
    assert args.training_script == "train.py" and args.training_script_args == OVERRIDES
    header = (LAUNCH / "slurm.sbatch").read_text()
    assert "#SBATCH --ntasks-per-node=1" in header and "NCCL_SOCKET_IFNAME" in header


def test_bench_fsdp_summarizes_steady_speed_against_plain():
    """scripts/bench_fsdp.py (the one-GPU FSDP2 check): the steady speed is the median window after the
    settle steps, and the table puts each run against plain."""
    import bench_fsdp

    records = [
        {"step": s, "tokens_per_s": tps, "peak_mem_gib": 1.0, "loss": 5.0}
        for s, tps in [(5, 10.0), (10, 100.0), (15, 200.0), (20, 220.0), (25, 210.0)]
    ]
    plain = bench_fsdp.summarize(records, settle=10, wall_s=60.0)
    assert plain["steady_tokens_per_s"] == 210.0
    fsdp = {**plain, "steady_tokens_per_s": 205.8}
    result = {"runs": {"dense": {"plain": plain, "fsdp": fsdp}}, "model": "0.5b", "steps": 25}
    text = bench_fsdp.table({**result, "commit": "abc", "machine": "GPU"})
    assert "| dense | fsdp | 206 | 0.980x |" in text


def test_quick_bench_fsdp_runs_plain_and_fsdp_from_a_calibrated_start(quick_bench_data, tmp_path, capsys):
    """scripts/bench_fsdp.py --quick: the tiny model through train.py under torchrun (gloo, one process),
    plain and FSDP2 for dense and TwELL. The TwELL runs start calibrated to the paper's ~29 active units a
    token (a fresh model fires about half of its 128), and plain and FSDP2 train the same model: their
    losses agree to bf16 tolerance."""
    import json

    import bench_fsdp

    out = tmp_path / "bench"
    args = ["--out", str(out), "--quick", "--steps", "4", "--settle", "0", "--ffn", "dense", "twell"]
    assert bench_fsdp.main([*args, "--", *quick_bench_data]) == 0
    result = json.loads((out / "bench_fsdp.json").read_text())
    runs = result["runs"]
    assert sorted(runs) == ["dense", "twell"] and all(sorted(r) == ["fsdp", "plain"] for r in runs.values())
    for ffn in runs.values():
        assert ffn["plain"]["final_loss"] == pytest.approx(ffn["fsdp"]["final_loss"], rel=2e-2)
        assert all(run["steady_tokens_per_s"] > 0 for run in ffn.values())
    for run in runs["twell"].values():
        assert run["active_mean"] == pytest.approx(29, rel=0.3)  # calibrated
    for run in runs["dense"].values():
        assert run["active_mean"] > 45
    table = (out / "bench_fsdp.md").read_text()
    assert (
        table in capsys.readouterr().out and "| twell | fsdp | " in table and "model tiny, 4 steps" in table
    )

"""scripts/bench_memory.py --quick: the tiny model on the CPU through the real trainer, one process per
run; the table and the JSON hold the plan of every run (the planner's own numbers), the measured activity
(a TwELL run starts calibrated to the paper's ~29 active units) and no memory counters on the CPU."""

import json

import pytest
from trainer_helpers import compose_job

from twell.training.memory import GIB, estimate_training_memory


def test_quick_bench_writes_the_plan_against_measured_table(quick_bench_data, tmp_path, capsys):
    import bench_memory  # scripts/, on sys.path through tests/conftest.py

    out = tmp_path / "bench"
    args = ["--out", str(out), "--quick", "--steps", "2", "--ffn", "dense", "twell", "--checkpointing", "on"]
    assert bench_memory.main([*args, "--", *quick_bench_data]) == 0
    result = json.loads((out / "bench_memory.json").read_text())
    runs = {(r["model"], r["ffn"], r["activation_checkpointing"]): r for r in result["runs"]}
    assert sorted(runs) == [("tiny", "dense", True), ("tiny", "twell", True)]
    tiny = compose_job(["model=tiny", "train.seq_len=32", *bench_memory.QUICK]).model
    for (_, ffn, _), run in runs.items():
        want = estimate_training_memory(tiny, 2, 32, activation_checkpointing=True, sparse_ffn=ffn == "twell")
        assert run["plan"]["total_gib"] == pytest.approx(want.total / GIB)
        assert run["plan"]["compute_weights"] == pytest.approx(want.compute_weights / GIB)
        assert run["steps"] == 2 and run["peak_reserved_gib"] is None and run["error_reserved"] is None
    assert runs[("tiny", "twell", True)]["active_mean"] == pytest.approx(29, rel=0.25)  # calibrated
    assert runs[("tiny", "dense", True)]["active_mean"] > 45  # a fresh model: about half of 128 units
    table = (out / "bench_memory.md").read_text()
    assert table in capsys.readouterr().out
    assert (
        "| tiny | twell | on | " in table and "| n/a |" in table and "eager bf16, micro-batch 2 x 32" in table
    )

    with pytest.raises(SystemExit):
        bench_memory.main(["--out", str(out), "--steps", "1"])
    assert "--steps=1 must be >= 2" in capsys.readouterr().err


def test_compile_flag_runs_compiled_steps_against_the_compiled_plan():
    """--compile: the runs take train.compile=true and their plan is the compiled one (less saved than
    eager), for both FFNs."""
    import argparse

    import bench_memory

    args = argparse.Namespace(
        micro_batch=8, seq_len=2048, parallel="ddp", steps=3, quick=False, extra=[], compile=True
    )
    for ffn in ("dense", "twell"):
        overrides = bench_memory.run_overrides("1.5b", ffn, False, args, "/tmp/unused")
        assert "train.compile=true" in overrides
        job = compose_job(overrides)
        plan = bench_memory.planned(job, False)
        kw = dict(activation_checkpointing=False, sparse_ffn=ffn == "twell")
        compiled = estimate_training_memory(job.model, 8, 2048, compiled=True, **kw)
        assert plan["total_gib"] == pytest.approx(compiled.total / GIB)
        assert plan["total_gib"] < estimate_training_memory(job.model, 8, 2048, **kw).total / GIB

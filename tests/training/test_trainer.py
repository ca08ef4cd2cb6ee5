"""The training loop on the offline sample: loss falls, checkpoints resume bit-exactly (also after a
SIGTERM), a corrupt checkpoint is refused for the previous one, and 2 DDP processes match 1."""

import json
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from trainer_helpers import ROOT, compose_job, run_cli, run_job, tiny_overrides

import train
from training.checkpoint import MARKER, Checkpointer, CheckpointError
from training.distributed import DistInfo


def losses(records: list[dict]) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in records if "loss" in r}


def read_jsonl(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def reference_run(offline_data, tmp_path_factory):
    """12 unbroken steps of the sparse recipe with a strong L1 (so dead units get re-initialised),
    a checkpoint every 4 steps, all kept."""
    run_dir = tmp_path_factory.mktemp("reference")
    overrides = tiny_overrides(
        offline_data, run_dir, 12,
        "sparsity=paper", "sparsity.l1_coef=0.05", "checkpoint.interval=4", "checkpoint.keep_last=0",
    )  # fmt: skip
    return overrides, run_dir, run_job(overrides)


def test_loss_falls_on_the_sample(offline_data, tmp_path):
    records = run_job(tiny_overrides(offline_data, tmp_path, 40, "logging.log_interval=5"))
    first, last = records[0], records[-1]
    assert first["ce"] > 7.5  # ~ln(4096) = 8.3 at initialisation
    assert last["ce"] < first["ce"] - 1.5, [r["ce"] for r in records]
    assert all(0 < r["lr"] <= 3e-3 for r in records)
    assert records[-1]["mfu"] is None  # no MFU on CPU
    logged = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in logged] == [5, 10, 15, 20, 25, 30, 35, 40]
    assert len(logged[0]["active_mean"]) == 2 and len(logged[0]["dead_frac"]) == 2


def test_resume_gives_bit_identical_losses(reference_run, tmp_path):
    overrides, ref_dir, ref_records = reference_run
    assert sum(sum(r["reinit_units"]) for r in ref_records) > 0, "the test needs dead-unit re-inits"
    # A fresh run dir that only holds the step-4 checkpoint of the reference run.
    shutil.copytree(ref_dir / "checkpoints" / "step_00000004", tmp_path / "checkpoints" / "step_00000004")
    resumed = run_job([*overrides, f"run_dir={tmp_path}"])
    assert [r["step"] for r in resumed] == list(range(5, 13))
    reference = losses(ref_records)
    for step, loss in losses(resumed).items():
        assert loss == reference[step], f"step {step}: resumed {loss!r} != unbroken {reference[step]!r}"


def test_activation_checkpointing_resumes_a_plain_checkpoint_exactly(reference_run, tmp_path):
    # Recomputing each block in the backward pass changes no number, and the wrapper keeps the
    # parameter names, so a checkpoint written without it loads into a run with it.
    overrides, ref_dir, ref_records = reference_run
    shutil.copytree(ref_dir / "checkpoints" / "step_00000008", tmp_path / "checkpoints" / "step_00000008")
    resumed = run_job([*overrides, f"run_dir={tmp_path}", "train.activation_checkpointing=true"])
    reference = losses(ref_records)
    assert losses(resumed) == {step: reference[step] for step in range(9, 13)}


def test_corrupt_latest_checkpoint_falls_back_to_the_previous(reference_run, tmp_path, caplog):
    overrides, ref_dir, _ = reference_run
    for step in (8, 12):
        name = f"step_{step:08d}"
        shutil.copytree(ref_dir / "checkpoints" / name, tmp_path / name)
    # A bit flip in the newest checkpoint's tensor data (same size: only the CRC can tell).
    data_file = next((tmp_path / "step_00000012").glob("*.distcp"))
    blob = bytearray(data_file.read_bytes())
    blob[len(blob) // 2] ^= 0xFF
    data_file.write_bytes(bytes(blob))
    (tmp_path / "step_00000016.tmp").mkdir()  # a save that was killed half-way

    job = compose_job([*overrides, f"run_dir={tmp_path}"])
    trainer = train.build_trainer(job)
    checkpointer = Checkpointer(tmp_path, keep_last=0, info=trainer.info)
    with caplog.at_level("WARNING"):
        path, state, _ = checkpointer.load_latest(trainer.model, trainer.optimizer, trainer._trainer_state())
    assert path.name == "step_00000008" and state["step"] == 8
    assert "fails its CRC32 check" in caplog.text

    # With the previous one truncated as well, nothing is usable: an error, not a silent restart.
    (tmp_path / "step_00000008" / "rank_00000.pt").write_bytes(b"")
    with pytest.raises(CheckpointError, match="no usable checkpoint .* has 0 bytes"):
        checkpointer.load_latest(trainer.model, trainer.optimizer, trainer._trainer_state())


def test_partial_checkpoint_is_refused_with_its_reason(tmp_path):
    (tmp_path / "step_00000003").mkdir()
    checkpointer = Checkpointer(tmp_path, 1, DistInfo(0, 0, 1, torch.device("cpu")))
    with pytest.raises(CheckpointError, match=f"no {MARKER}: it is partial"):
        checkpointer.verify(tmp_path / "step_00000003")


def test_sigterm_saves_and_the_resumed_run_matches_the_unbroken_one(reference_run, tmp_path):
    overrides, _, ref_records = reference_run
    # Many steps, so the signal surely lands mid-run; the LR schedule spans train.steps, so the
    # resumed run below continues with the same steps setting and is cut back by comparing steps.
    cli = [*overrides, f"run_dir={tmp_path}"]
    process = subprocess.Popen(
        [sys.executable, str(ROOT / "train.py"), *cli],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    metrics = tmp_path / "metrics.jsonl"
    deadline = time.time() + 120
    while not (metrics.exists() and metrics.read_text().count("\n") >= 2):
        assert process.poll() is None and time.time() < deadline, process.communicate()[0]
        time.sleep(0.05)
    process.send_signal(signal.SIGTERM)
    output = process.communicate(timeout=120)[0]
    assert process.returncode == 0, output
    assert "SIGTERM: stopping at step" in output
    saved = sorted((tmp_path / "checkpoints").glob("step_*"))
    stopped_at = int(saved[-1].name.split("_")[1])
    assert 2 <= stopped_at < 12 and (saved[-1] / MARKER).is_file(), output

    resumed = run_job(cli)
    reference = losses(ref_records)
    assert [r["step"] for r in resumed] == list(range(stopped_at + 1, 13))
    for step, loss in losses(resumed).items():
        assert loss == reference[step], f"step {step}: resumed {loss!r} != unbroken {reference[step]!r}"
    # The JSONL reads as one run: the killed run's records up to the checkpoint, then the resumed ones.
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == list(range(1, 13))


def test_two_ddp_processes_match_one(reference_run, offline_data, tmp_path):
    overrides, _, ref_records = reference_run
    steps = 6
    two = run_cli([*overrides, f"train.steps={steps}", f"run_dir={tmp_path}"], torchrun=2)
    assert two.returncode == 0, two.stderr[-3000:]
    one = run_job([*overrides, f"train.steps={steps}", f"run_dir={tmp_path / 'one'}"])
    ddp = losses(read_jsonl(tmp_path / "metrics.jsonl"))
    assert sorted(ddp) == list(range(1, steps + 1))
    for step, loss in losses(one).items():
        assert ddp[step] == pytest.approx(loss, rel=1e-5), step


def test_validation_record_equals_eval_validation_loss(offline_data, tmp_path):
    """The loop's val_loss / val_bpb are eval.validation_loss on the same held-out batches, with the
    bytes per token of the first eval.bpb_docs held-out documents (counted here by hand)."""
    import math

    import pyarrow.parquet as pq

    from data import build_val_stream, load_tokenizer
    from eval import validation_loss

    overrides = tiny_overrides(
        offline_data, tmp_path, 2, "eval.interval=2", "eval.val_batches=2", "eval.bpb_docs=20"
    )
    trainer = train.build_trainer(compose_job(overrides))
    (record,) = [r for r in trainer.fit() if "val_loss" in r]
    assert record["step"] == 2 and trainer.model.training
    assert json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1]) == record

    tokenizer = load_tokenizer(str(offline_data / "tokenizer"))
    files = sorted((offline_data / "sample").glob("val-*.parquet"))
    texts = [t for f in files for t in pq.read_table(f, columns=["text"]).column("text").to_pylist()][:20]
    n_tokens = sum(len(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts)
    ratio = sum(len(t.encode("utf-8")) for t in texts) / n_tokens
    batches = build_val_stream(trainer.job.data, tokenizer, 32, 4, rank=0, world_size=1, num_batches=2)
    want = validation_loss(trainer.model, batches)  # the model after step 2: the run ended there
    assert record["val_tokens"] == want["val_tokens"] == 2 * 4 * 32
    assert record["val_loss"] == pytest.approx(want["val_loss"], rel=1e-6)
    assert record["val_bpb"] == pytest.approx(want["val_loss"] / math.log(2) / ratio, rel=1e-6)


def test_lm_eval_subset_in_the_loop(offline_data, offline_tasks, tmp_path, monkeypatch):
    """eval.lm_eval_tasks runs lm-eval on rank 0 in the loop; its per-task accuracy and the mean land in
    the records (and metrics.jsonl) beside val_loss, and training continues exactly as without it."""
    pytest.importorskip("lm_eval", reason="lm-eval is not installed (pip install -e .[eval])")
    monkeypatch.setenv("TWELL_OFFLINE_TASKS", str(offline_tasks))
    plain = run_job(tiny_overrides(offline_data, tmp_path / "plain", 3, "eval.interval=2"))
    extra = (
        "eval.interval=2",
        "eval.lm_eval_tasks=[arc_easy]",
        "eval.lm_eval_limit=4",
        "eval.lm_eval_batch_size=4",
    )
    records = train.build_trainer(compose_job(tiny_overrides(offline_data, tmp_path, 3, *extra))).fit()
    (evaluated,) = [r for r in records if "eval/arc_easy/acc" in r]
    assert evaluated["step"] == 2 and "val_loss" in evaluated and "val_bpb" in evaluated
    assert 0.0 <= evaluated["eval/arc_easy/acc"] <= 1.0
    assert evaluated["eval/mean/acc"] == evaluated["eval/arc_easy/acc"]
    assert "eval/mean/acc_norm" in evaluated
    assert evaluated in read_jsonl(tmp_path / "metrics.jsonl")
    # eval mode, no_grad and lm-eval's global seeding leave training untouched
    assert losses(records) == losses(plain)


def test_lm_eval_tasks_need_an_interval(offline_data, tmp_path):
    with pytest.raises(ValueError, match="would never run"):
        compose_job(tiny_overrides(offline_data, tmp_path, 1, "eval.lm_eval_tasks=[arc_easy]"))

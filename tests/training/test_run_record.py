"""What a run dir records: each checkpoint holds the config that produced it, <run_dir>/config.yaml
changes only when a launch saves a checkpoint, every launch is listed in launches.jsonl, and a launch
that cannot train (another model shape, train.steps below the resumed step) says so and changes
nothing."""

import json
import os
import subprocess
import sys

import pytest
import torch
from omegaconf import OmegaConf
from trainer_helpers import ROOT, compose_cfg, tiny_overrides, train

from twell.eval.load import load_for_eval


def launches(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "launches.jsonl").read_text().splitlines()]


def test_the_record_follows_the_checkpoints_and_refused_launches_change_nothing(
    offline_data, tmp_path, capsys
):
    base = tiny_overrides(offline_data, tmp_path, 4, "checkpoint.save_final=true")
    assert train.run(compose_cfg(base)) == 0
    step_dir = tmp_path / "checkpoints" / "step_00000004"
    saved = OmegaConf.load(step_dir / "config.yaml")
    assert (saved.model.d_model, saved.optim.lr, saved.train.steps) == (64, 3e-3, 4)
    recorded = (tmp_path / "config.yaml").read_text()
    assert recorded == (step_dir / "config.yaml").read_text()
    assert launches(tmp_path)[0]["outcome"] == "trained" and launches(tmp_path)[0]["steps"] == [0, 4]
    capsys.readouterr()

    # Another model shape: refused before loading, naming the field, not a DCP size mismatch.
    assert train.run(compose_cfg([*base, "train.steps=6", "model.d_model=128"])) == 2
    error = capsys.readouterr().err
    assert (
        "holds a model of another shape" in error and "model.d_model=64 in the checkpoint, 128 now" in error
    )
    assert "size mismatch" not in error.lower()

    # train.steps below the resumed step: nothing to train, and how to extend the run.
    assert train.run(compose_cfg([*base, "train.steps=2", "optim.lr=5e-4"])) == 2
    error = capsys.readouterr().err
    assert (
        "nothing to train: train.steps=2 is below step 4" in error and "train.steps to more than 4" in error
    )

    # train.steps at the resumed step: the run is complete (a relaunched finished job), exit 0.
    assert train.run(compose_cfg(base)) == 0
    assert "nothing to train: the run is complete at train.steps=4" in capsys.readouterr().out

    assert (tmp_path / "config.yaml").read_text() == recorded  # none of them trained or saved
    assert [(r["exit_status"], r["steps"]) for r in launches(tmp_path)] == [
        (0, [0, 4]), (2, [0, 0]), (2, [4, 4]), (0, [4, 4])
    ]  # fmt: skip
    configs = [OmegaConf.load(tmp_path / r["config"]) for r in launches(tmp_path)]
    assert [c.model.d_model for c in configs] == [64, 128, 64, 64]
    assert configs[2].optim.lr == 5e-4

    # Evaluation takes the shape from the checkpoint's own config, whatever the run dir's says.
    (tmp_path / "config.yaml").write_text(recorded.replace("d_model: 64", "d_model: 128"))
    net, tokenizer = load_for_eval(tmp_path / "checkpoints")
    assert net.cfg.d_model == 64 and tokenizer == f"{offline_data}/tokenizer"


def test_evaluation_refuses_a_corrupt_newest_checkpoint_naming_it(offline_data, tmp_path, capsys):
    overrides = tiny_overrides(offline_data, tmp_path, 4, "checkpoint.interval=2", "checkpoint.keep_last=0")
    assert train.run(compose_cfg(overrides)) == 0
    checkpoints = tmp_path / "checkpoints"
    older, _ = load_for_eval(checkpoints / "step_00000002")
    # A bit flip in the newest checkpoint's tensor data (same size: only the CRC can tell).
    data_file = next((checkpoints / "step_00000004").glob("*.distcp"))
    blob = bytearray(data_file.read_bytes())
    blob[len(blob) // 2] ^= 0xFF
    data_file.write_bytes(bytes(blob))
    capsys.readouterr()

    net, _ = load_for_eval(checkpoints)  # the newest good one, saying which
    said = capsys.readouterr().err
    assert "warning: refusing checkpoint step_00000004" in said and "fails its CRC32 check" in said, said
    assert f"reading checkpoint {checkpoints / 'step_00000002'} (verified against its COMPLETE.json)" in said
    assert net.source == str(checkpoints / "step_00000002")
    for name, tensor in older.state_dict().items():
        assert torch.equal(net.state_dict()[name], tensor), name
    with pytest.raises(ValueError, match="no usable checkpoint in .*step_00000004 is corrupt: .* CRC32"):
        load_for_eval(checkpoints / "step_00000004")
    # Export and the activity report record the step they read, as eval_results.json does.
    import activity  # scripts/, on sys.path through tests/conftest.py
    import hf

    hf.main(["export", f"checkpoint={checkpoints}", f"out={tmp_path / 'exported'}"])
    exported = json.loads((tmp_path / "exported" / "config.json").read_text())
    assert exported["twell_source"] == str(checkpoints / "step_00000002")
    activity.main([f"checkpoint={checkpoints}", "--text", "the cat sat on the mat " * 8, "--seq-len", "32",
                   "--out", str(tmp_path / "act")])  # fmt: skip
    assert json.loads((tmp_path / "act.json").read_text())["checkpoint"] == str(checkpoints / "step_00000002")


def test_wandb_mode_from_the_environment_wins(offline_data, tmp_path):
    # logging=wandb says online; WANDB_MODE=offline (wandb's own convention) must need no API key.
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(WANDB_MODE="offline", WANDB_SILENT="true")
    cli = [*tiny_overrides(offline_data, tmp_path, 2), "logging=wandb", "logging.console=false"]
    done = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), *cli], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert list((tmp_path / "wandb").glob("offline-run-*")), list(tmp_path.rglob("*"))
    env["WANDB_MODE"] = "maybe"
    bad = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), *cli], env=env, capture_output=True, text=True, timeout=300
    )
    assert bad.returncode == 2 and "error: WANDB_MODE='maybe' is not one of" in bad.stderr, bad.stderr
    # online without an API key (a HOME without ~/.netrc; a server nobody answers, so nothing leaves the
    # machine): the run ends with the ways out, not with a traceback from inside wandb
    del env["WANDB_MODE"]
    env.update(
        HOME=str(tmp_path / "home"),
        WANDB_CONFIG_DIR=str(tmp_path / "home"),
        WANDB_BASE_URL="http://127.0.0.1:9",
    )
    online = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), *cli, f"run_dir={tmp_path / 'online'}"],
        env=env, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert online.returncode == 2, online.stderr[-3000:]
    assert "error: wandb could not start the run (logging.wandb_mode=online)" in online.stderr, online.stderr[
        -3000:
    ]
    assert "logging.wandb_mode=offline" in online.stderr and "Traceback" not in online.stderr


def test_progress_lines_to_a_file_have_elapsed_time_and_eta(tmp_path):
    from twell.training.loggers import ConsoleSink

    out = tmp_path / "log.txt"
    with open(out, "w") as f:
        old, sys.stdout = sys.stdout, f  # the job's output redirected to a file: no progress bar
        try:
            sink = ConsoleSink(total_steps=10, start_step=4)
            for step in (5, 6):
                sink.log({"step": step, "loss": 1.0, "lr": 1e-3, "tokens_per_s": 100.0})
            sink.close()
        finally:
            sys.stdout = old
    lines = out.read_text().splitlines()
    assert lines[0].startswith("step 5/10: loss 1 ") and "[elapsed 00:00, eta 00:0" in lines[0], lines
    assert len(lines) == 2 and "eta" in lines[1]

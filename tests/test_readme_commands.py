"""Every command the README shows runs, as far as it can without a GPU, data or a checkpoint.

Commands come from the README's code blocks and its inline `python ...` / `bash ...` spans:
- `python train.py ...` / `torchrun ... train.py ...`: the overrides compose and validate into a JobConfig
  (what `--cfg job` checks); the README's own `--cfg job` line runs as written;
- argparse scripts: `--help` exits 0 (the script imports and builds its parser);
- key=value scripts (eval.py, generate.py, hf.py): the README's words parse into known script options
  or ModelConfig fields;
- `bash scripts/*.sh`: the script exists and `bash -n` accepts it.
A README command of any other form fails here until this test covers it."""

import dataclasses
import os
import re
import runpy
import shlex
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def _commands() -> list[list[str]]:
    blocks = re.findall(r"^```[^\n]*\n(.*?)^```", README, flags=re.M | re.S)
    lines = [line for b in blocks for line in b.splitlines()]
    lines += re.findall(r"`((?:python|torchrun|bash) [^`]+)`", README)
    out = []
    for line in lines:
        words = shlex.split(line, comments=True)
        if words and words[0] in ("python", "torchrun", "bash"):
            out.append(words)
    return out


COMMANDS = _commands()
HELP_SCRIPTS = sorted({w[1] for w in COMMANDS if w[0] == "python" and w[1].startswith("scripts/")} - {
    "scripts/eval.py", "scripts/generate.py", "scripts/hf.py"
})  # fmt: skip


def _train_overrides(words: list[str]) -> list[str] | None:
    """The Hydra overrides of a train.py command (python or torchrun), or None for another command."""
    if "train.py" not in words:
        return None
    return [w for w in words[words.index("train.py") + 1 :] if w != "--cfg" and w != "job"]


def test_the_readme_shows_commands_of_every_kind():
    kinds = {w[0] for w in COMMANDS}
    assert {"python", "torchrun", "bash"} <= kinds and len(COMMANDS) >= 15, COMMANDS


def test_every_readme_command_is_covered():
    for words in COMMANDS:
        covered = (
            _train_overrides(words) is not None
            or (words[0] == "python" and words[1].startswith("scripts/"))
            or (words[0] == "bash" and words[1].startswith("scripts/"))
        )
        assert covered, f"README command not checked by this test: {shlex.join(words)}; add a check here"


def test_train_commands_compose_into_a_valid_job():
    from hydra import compose, initialize_config_dir

    parse_config = runpy.run_path(str(ROOT / "train.py"), run_name="twell_readme")["parse_config"]
    runs = [o for w in COMMANDS if (o := _train_overrides(w)) is not None]
    assert len(runs) >= 6, runs
    for overrides in runs:
        with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base=None):
            cfg = compose("train", overrides=overrides)
        parse_config(cfg)  # raises naming the bad value


def _run(args: list[str]) -> subprocess.CompletedProcess:
    env = dict(os.environ, TRITON_INTERPRET="1", HF_HUB_OFFLINE="1", WANDB_MODE="disabled")
    return subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )


def test_scripts_help_and_the_cfg_job_line_run():
    cfg_job = next(w for w in COMMANDS if w[:2] == ["python", "train.py"] and "--cfg" in w)
    jobs = [cfg_job[1:]] + [[script, "--help"] for script in HELP_SCRIPTS]
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(_run, jobs))
    for args, out in zip(jobs, results):
        assert out.returncode == 0, (
            f"{shlex.join(args)} exited {out.returncode}:\n{out.stdout[-2000:]}{out.stderr[-2000:]}"
        )
    assert "d_model: 2048" in results[0].stdout, results[0].stdout[:2000]  # the 1.5B configuration


@pytest.mark.parametrize("script", ["scripts/eval.py", "scripts/generate.py"])
def test_key_value_scripts_take_the_readme_words(script):
    from twell.eval.load import parse_settings
    from twell.model import ModelConfig

    keys = runpy.run_path(str(ROOT / script), run_name="twell_readme")["SCRIPT_KEYS"]
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    lines = [w[2:] for w in COMMANDS if w[:2] == ["python", script]]
    assert lines, f"the README no longer shows {script}: drop it here"
    for words in lines:
        _, overrides = parse_settings(words, keys, "")
        assert set(overrides) <= fields, f"{script}: unknown keys {sorted(set(overrides) - fields)}"


def test_hf_export_takes_the_readme_words():
    lines = [w[2:] for w in COMMANDS if w[:2] == ["python", "scripts/hf.py"]]
    assert lines
    for words in lines:
        assert words[0] in ("export", "import"), words
        keys = {w.partition("=")[0] for w in words[1:]}
        need = {"checkpoint", "out"} if words[0] == "export" else {"path"}
        assert need <= keys <= need | {"dtype", "model", "tokenizer", "out"}, words


def test_bash_scripts_exist_and_parse():
    for words in (w for w in COMMANDS if w[0] == "bash"):
        path = ROOT / words[1]
        assert path.is_file(), words
        out = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
        assert out.returncode == 0, out.stderr

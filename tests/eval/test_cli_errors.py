"""The evaluation and export scripts end bad input with one line that names the fix (exit 2), as train.py
does, instead of a traceback."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(f"{name}_script", REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_export_of_a_missing_checkpoint_ends_with_the_message(tmp_path):
    run = subprocess.run(
        [
            sys.executable,
            str(REPO / "scripts" / "hf.py"),
            "export",
            "checkpoint=/nowhere",
            f"out={tmp_path / 'x'}",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 2, run.stderr
    assert run.stderr.startswith("error: checkpoint /nowhere does not exist"), run.stderr
    assert not (tmp_path / "x").exists()


def test_eval_without_lm_eval_names_the_extra_to_install(monkeypatch):
    eval_script = load_script("eval")
    find_spec = importlib.util.find_spec
    # this environment as a user's without the eval extra: lm-eval is not found
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "lm_eval" else find_spec(name, *a)
    )
    with pytest.raises(ValueError, match=r"needs lm-eval.*bash scripts/setup_env.sh eval"):
        eval_script.main(["checkpoint=/nowhere"])

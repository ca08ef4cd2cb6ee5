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


@pytest.mark.parametrize(
    "script, word, hint",
    [("generate", "max_new_token=8", "max_new_tokens"), ("generate", "prompts=p.txt", "prompt"),
     ("eval", "task=arc_easy", "tasks"), ("activity", "tokeniser=t", "tokenizer")],
)  # fmt: skip
def test_a_misspelt_setting_is_named_with_the_closest_one_before_anything_loads(script, word, hint):
    """Not a TypeError from inside ModelConfig after the checkpoint was read (or, for prompts=, the
    complaint that no prompt was given): the unknown key, the closest known one, and the lists."""
    main = load_script(script).main
    given = {"generate": ["prompt=hi"], "activity": ["--text", "hi"]}.get(script, [])
    with pytest.raises(SystemExit) as stop:
        main([*given, "checkpoint=/nowhere", word])
    message = str(stop.value)
    assert (
        message.startswith(f"error: unknown setting {word.split('=')[0]}=")
        and f"did you mean {hint}=?" in message
    )
    assert "model fields: d_ff, d_model" in message

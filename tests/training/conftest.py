"""Session fixture of the trainer tests: the offline sample data built by the project's own script."""

import subprocess
import sys
from pathlib import Path

import pytest
from trainer_helpers import ROOT


@pytest.fixture(scope="session")
def offline_data(tmp_path_factory) -> Path:
    """The offline default (parquet sample + 4096-token BPE) built by the project's own script."""
    out = tmp_path_factory.mktemp("offline")
    subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "prepare_offline_data.py"), "--out", str(out)],
        check=True,
        capture_output=True,
    )
    return out

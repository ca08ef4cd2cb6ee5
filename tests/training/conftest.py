"""Fixtures of the trainer tests: the offline sample data built by the project's own script (one a session), and
the data overrides of the bench scripts' --quick runs."""

import subprocess
import sys
from pathlib import Path

import pytest
from trainer_helpers import ROOT, offline_data_overrides


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


@pytest.fixture
def quick_bench_data(offline_data, monkeypatch) -> list[str]:
    """The data overrides of a bench script's --quick run (the tiny model on the CPU through the real
    trainer), with the TwELL layers on the reference path: the output's shape is tested, not the kernels."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    return offline_data_overrides(offline_data)

"""Helpers of the trainer tests: a tiny job built from the real config tree (configs/), run the way
train.py runs it, in this process or as a subprocess (python train.py / torchrun)."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from twell.training.config import JobConfig

ROOT = Path(__file__).resolve().parents[2]


def _load_train_entry():
    """train.py, the entry point at the project root, loaded from its file: putting the root on sys.path
    would make kernels/, model/, data/ and eval/ importable as top-level packages in this process."""
    spec = importlib.util.spec_from_file_location("twell_train_entry", ROOT / "train.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


train = _load_train_entry()


def offline_data_overrides(offline: Path) -> list[str]:
    """The data keys of a run on the offline sample that prepare_offline_data.py built in `offline`."""
    return [
        f"data.path={offline}/sample/train-*.parquet",
        f"data.val_path={offline}/sample/val-*.parquet",
        f"data.tokenizer={offline}/tokenizer",
    ]


def tiny_overrides(offline: Path, run_dir: Path, steps: int, *extra: str) -> list[str]:
    """A model and batch small enough for a 2-core CPU: 2 layers, d 64, 4 x 32 tokens per micro-batch,
    two micro-batches per step, one log record per step."""
    return [
        "model=tiny",
        "model.d_model=64",
        "model.n_heads=2",
        "model.d_ff=128",
        "model.max_seq_len=64",
        "sparsity=dense",
        *offline_data_overrides(offline),
        "train.seq_len=32",
        "train.micro_batch=4",
        "train.global_batch_tokens=256",
        f"train.steps={steps}",
        "optim.lr=3e-3",
        "optim.warmup_steps=2",
        "logging.log_interval=1",
        "logging.console=false",
        "eval.interval=0",
        "checkpoint.interval=0",
        "checkpoint.save_final=false",
        f"run_dir={run_dir}",
        *extra,
    ]


def compose_cfg(overrides: list[str]) -> DictConfig:
    """The config as Hydra hands it to train.py's main()."""
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base=None):
        return compose("train", overrides=overrides)


def compose_job(overrides: list[str]) -> JobConfig:
    return train.parse_config(compose_cfg(overrides))


def run_job(overrides: list[str]) -> list[dict]:
    """Build and train in this process; returns the per-step training records."""
    records = train.build_trainer(compose_job(overrides)).fit()
    return [r for r in records if "loss" in r]


def run_cli(args: list[str], torchrun: int = 0, timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    launcher = [sys.executable]
    if torchrun:
        # Two ranks share the two cores: one thread each.
        env["OMP_NUM_THREADS"] = "1"
        launcher += ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={torchrun}"]
    return subprocess.run(
        [*launcher, str(ROOT / "train.py"), *args], env=env, capture_output=True, text=True, timeout=timeout
    )

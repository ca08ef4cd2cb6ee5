"""Entry point: compose the Hydra config, build model, data and trainer, train.

    python train.py experiment=quickstart                      # small CPU-friendly run
    python train.py model=1.5b --cfg job                       # print the composed configuration
    torchrun --nproc_per_node=8 train.py experiment=paper_1.5b # data parallel (DDP)
    torchrun --nproc_per_node=8 train.py experiment=paper_1.5b train.parallel=fsdp  # sharded (FSDP2)

Every value is type-checked against the dataclass schemas in training/config.py; a bad one stops
the run before anything is built, with a message naming it.
"""

import os
import sys

# Python puts this file's folder, the project root, first on sys.path; there kernels/, model/, data/
# and eval/ would be importable as top-level packages and shadow libraries of the same names (Hugging
# Face's `kernels`, which transformers imports). Our code is imported as twell.* only (installed by
# `pip install -e .`), so the root leaves sys.path before anything else is imported.
_ROOT = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _ROOT]

import contextlib  # noqa: E402
import gc  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import random  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import hydra  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

try:
    import twell.training  # noqa: E402, F401
except ModuleNotFoundError as err:  # a clone that was never installed
    sys.exit(f"error: {err}; install the project first: bash scripts/setup_env.sh (or pip install -e .)")

from twell.data import build_train_stream, build_val_stream, held_out_texts, load_tokenizer  # noqa: E402
from twell.data.token_shards import apply_corpus_defaults  # noqa: E402
from twell.eval import bytes_per_token, validation_loss  # noqa: E402
from twell.model import Transformer  # noqa: E402
from twell.training.checkpoint import CheckpointError, capture_rng, config_yaml, restore_rng  # noqa: E402
from twell.training.config import JobConfig, parse_job, register_configs  # noqa: E402
from twell.training.distributed import DistInfo, destroy, init_distributed  # noqa: E402
from twell.training.loggers import WandbSetupError, wandb_mode  # noqa: E402
from twell.training.trainer import Evaluator, NothingToTrain, Trainer  # noqa: E402

register_configs()
log = logging.getLogger("train")


def parse_config(cfg: DictConfig) -> JobConfig:
    """Resolved, validated dataclasses; ValueError names the bad value (training.config.parse_job)."""
    return parse_job(cfg)


def seed_everything(seed: int, rank: int) -> None:
    # The model is initialised from the same seed on every rank (DDP also broadcasts it; FSDP2
    # keeps each rank's shard of its own copy, so it relies on this); the per-rank offset only
    # matters for host-side randomness.
    torch.manual_seed(seed)
    random.seed(seed + rank)
    np.random.seed(seed + rank)


def build_trainer(job: JobConfig) -> Trainer:
    wandb_mode(job.logging)  # a bad WANDB_MODE stops the run here, before anything is built
    info = init_distributed(job.train.device)
    seed_everything(job.train.seed, info.rank)
    for note in apply_corpus_defaults(job.data):  # before the config is saved with the checkpoints
        if info.is_main:
            log.info("token corpus %s: %s", job.data.path, note)
    tokenizer = load_tokenizer(job.data.tokenizer)
    if len(tokenizer) > job.model.vocab_size:
        raise ValueError(
            f"tokenizer {job.data.tokenizer!r} has {len(tokenizer)} tokens but model.vocab_size="
            f"{job.model.vocab_size}; set model.vocab_size={len(tokenizer)} (or larger)"
        )
    # Built on the meta device and materialised where it trains: a 1.5B model is initialised on
    # the GPU in a moment instead of on the CPU (same seed on every rank; DDP broadcasts rank 0's).
    # Under train.parallel=fsdp each rank holds the whole model until the Trainer shards it, so
    # the numbers are the ones DDP and one process start from.
    with torch.device("meta"):
        model = Transformer(job.model)
    model.to_empty(device=info.device)
    model.init_weights()
    tcfg = job.train
    grad_accum = tcfg.grad_accum(info.world_size)
    stream = build_train_stream(
        job.data, tokenizer, tcfg.seq_len, tcfg.micro_batch, info.rank, info.world_size, grad_accum, tcfg.seed
    )
    return Trainer(job, model, stream, info, build_evaluators(job, tokenizer, info))


def build_evaluators(job: JobConfig, tokenizer, info: DistInfo) -> list[Evaluator]:
    """The loop's evaluations, from eval/'s public API (training/ never imports eval/).

    validation: every rank evaluates its share of the held-out batches (validation_loss all-reduces
    the sums); bytes per token for bits per byte is measured once, here, on the held-out text.
    lm-eval: rank 0 alone, on the plain model (no DDP collectives inside lm-eval; under FSDP2 the
    Trainer gathers a full replica to rank 0 for it)."""
    ecfg, tcfg = job.eval, job.train
    evaluators = []
    if ecfg.interval:
        batches = build_val_stream(
            job.data, tokenizer, tcfg.seq_len, tcfg.micro_batch, info.rank, info.world_size,
            ecfg.val_batches, tcfg.seed,
        )  # fmt: skip
        ratio = bytes_per_token(tokenizer, held_out_texts(job.data, tokenizer, ecfg.bpb_docs, seed=tcfg.seed))
        log.info("held-out text: %.3f UTF-8 bytes per token (the val_bpb denominator)", ratio)
        evaluators.append(
            Evaluator("validation", ecfg.interval, lambda model: validation_loss(model, batches, ratio))
        )
    if ecfg.lm_eval_tasks:
        evaluators.append(lm_eval_evaluator(ecfg, tokenizer, info))
    return evaluators


def lm_eval_evaluator(ecfg, tokenizer, info: DistInfo) -> Evaluator:
    if importlib.util.find_spec("lm_eval") is None:
        raise ValueError(
            f"eval.lm_eval_tasks={list(ecfg.lm_eval_tasks)} needs lm-eval (pip install -e .[eval]); "
            "install it or set eval.lm_eval_tasks=[]"
        )
    from twell.eval import resolve_tasks, run_lm_eval  # lm_eval itself is imported on first use

    # Bad task names and missing offline data stop the run now (on every rank), not at step N.
    names, _ = resolve_tasks(list(ecfg.lm_eval_tasks))

    def evaluate(model) -> dict:
        with _rng_untouched(info.device):  # lm-eval seeds the global RNGs; training's stay as they were
            results = run_lm_eval(
                model, tokenizer, tasks=names, limit=ecfg.lm_eval_limit or None,
                batch_size=ecfg.lm_eval_batch_size, mean_over=names,
            )  # fmt: skip
        log.info("lm-eval:\n%s", results["table"])
        # eval/<task>/<metric> per task, and eval/mean/{acc,acc_norm} over the configured tasks (run_lm_eval's
        # own eval/paper7_mean/* would misname the mean of a subset).
        metrics = {k: v for k, v in results["metrics"].items() if not k.startswith("eval/paper7_mean/")}
        metrics.update(
            {f"eval/mean/{k}": results["mean"][k] for k in ("acc", "acc_norm") if k in results["mean"]}
        )
        return metrics

    return Evaluator("lm_eval", ecfg.lm_eval_every, evaluate, all_ranks=False)


@contextlib.contextmanager
def _rng_untouched(device: torch.device):
    state = capture_rng(device)  # the same RNG set a checkpoint saves: torch, CUDA, Python, NumPy
    try:
        yield
    finally:
        restore_rng(state, device)


class LaunchRecord:
    """The history of launches in a run dir (rank 0): <run_dir>/launches/<time>.yaml holds each launch's
    resolved config, written at its start; <run_dir>/launches.jsonl gets one line at its end, with
    the command line, the steps trained and the outcome (also for a launch that fails or trains
    nothing). <run_dir>/config.yaml is written by the trainer only when a launch saves a checkpoint."""

    def __init__(self, trainer: Trainer):
        self.trainer = trainer
        self.enabled = trainer.info.rank == 0
        self.started = time.time()
        if not self.enabled:
            return
        folder = Path(trainer.job.run_dir) / "launches"
        folder.mkdir(parents=True, exist_ok=True)
        stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime(self.started))
        self.config_path, n = folder / f"{stamp}.yaml", 1
        while self.config_path.exists():
            self.config_path, n = folder / f"{stamp}-{n}.yaml", n + 1
        self.config_path.write_text(config_yaml(trainer.run_config))

    def finish(self, status: int, outcome: str) -> None:
        if not self.enabled:
            return
        t = self.trainer
        line = {
            "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.started)),
            "ended": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "argv": sys.argv[1:],
            "config": str(self.config_path.relative_to(Path(t.job.run_dir))),
            "steps": [t.start_step, t.step],
            "train_steps": t.total_steps,
            "exit_status": status,
            "outcome": outcome,
        }
        with open(Path(t.job.run_dir) / "launches.jsonl", "a") as f:
            f.write(json.dumps(line) + "\n")


def run(cfg: DictConfig) -> int:
    """Build and train; returns the exit status. Bad input (config values, data paths, tokenizer,
    checkpoints) ends the run with its message alone: the fix is in the message, a traceback would
    only bury it."""
    try:
        trainer = build_trainer(parse_config(cfg))
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    launch = LaunchRecord(trainer)
    status, outcome = 1, "crashed"
    try:
        trainer.fit()
        status = 0
        if trainer.step == trainer.start_step:
            outcome = "nothing to train"
        else:
            outcome = "stopped by a signal" if trainer.stop_requested else "trained"
    except (CheckpointError, NothingToTrain, WandbSetupError) as err:
        print(f"error: {err}", file=sys.stderr)
        status, outcome = 2, f"error: {err}"
    except BaseException as err:
        outcome = f"crashed: {type(err).__name__}: {err}"
        raise
    finally:
        launch.finish(status, outcome)
    return status


@hydra.main(version_base=None, config_path="configs", config_name="train")
def main(cfg: DictConfig) -> None:
    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )
    try:
        status = run(cfg)
    except KeyboardInterrupt:  # a second Ctrl-C (the first one saves and stops), or one before training
        print(
            "error: interrupted: stopped without saving; the checkpoints on disk are as they were",
            file=sys.stderr,
        )
        status = 130
    finally:
        # DDP's reducer holds the process group: free it (it sits in reference cycles) before the
        # group is destroyed, or gloo's destructor can wait forever for a peer that already left.
        gc.collect()
        destroy()
    sys.exit(status)


if __name__ == "__main__":
    main()

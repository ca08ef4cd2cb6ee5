"""Where metric records go: a tqdm progress bar, a JSONL file in the run dir, and wandb.

Only rank 0 builds a RunLogger with sinks; the other ranks get one that does nothing. wandb is
imported only when logging.wandb_mode is online or offline.
"""

import json
import logging
import math
import os
import time
import uuid
from pathlib import Path

from tqdm.auto import tqdm

from twell.training.config import LoggingConfig

log = logging.getLogger(__name__)

PER_LAYER_KEYS = (
    "active_mean",
    "active_max",
    "active_frac",
    "fired_frac",
    "dead_frac",
    "overflow_rows",
    "reinit_units",
    "ffn_sparse",  # 1 where the layer's FFN took the TwELL (sparse) path in the window's last step
)


def _fmt(value) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


class JsonlSink:
    """One JSON object per logged step. On resume, records after the resumed step (written by the
    run that died) are dropped so the file reads as one unbroken run."""

    def __init__(self, path: Path, keep_through_step: int):
        self.path = path
        kept = []
        if path.exists() and keep_through_step > 0:
            for line in path.read_text().splitlines():
                try:
                    if json.loads(line).get("step", math.inf) <= keep_through_step:
                        kept.append(line)
                except ValueError:
                    continue  # a line cut short by a kill
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(line + "\n" for line in kept))
        self.file = open(path, "a", buffering=1)

    def log(self, record: dict) -> None:
        self.file.write(json.dumps(record) + "\n")

    log_run_info = log  # a record like any other, at the step the launch starts from

    def close(self) -> None:
        self.file.close()


class ConsoleSink:
    """A progress bar over optimizer steps; each record is also printed as one line above it."""

    def __init__(self, total_steps: int, start_step: int):
        # disable=None: no bar when the output is a file (job logs), only the per-record lines.
        self.bar = tqdm(
            total=total_steps, initial=start_step, desc="train", unit="step", dynamic_ncols=True, disable=None
        )
        self.last_step = self.start_step = start_step
        self.total_steps = total_steps
        self.t0 = time.monotonic()

    def _timing(self, step: int) -> str:
        """' [elapsed 0:12, eta 3:48]' (this launch's wall time, and the rest at its pace so far): what the
        bar shows, for output that goes to a file, where there is no bar."""
        elapsed = time.monotonic() - self.t0
        done = step - self.start_step
        eta = elapsed / done * (self.total_steps - step) if done > 0 else None
        eta_text = tqdm.format_interval(eta) if eta is not None else "?"
        return f" [elapsed {tqdm.format_interval(elapsed)}, eta {eta_text}]"

    def log(self, record: dict) -> None:
        step = record["step"]
        self.bar.update(step - self.last_step)
        self.last_step = step
        keys = (
            "loss",
            "ce",
            "l1",
            "lr",
            "grad_norm",
            "tokens_per_s",
            "data_wait_s",
            "mfu",
            "val_loss",
            "val_bpb",
        )
        keys += tuple(k for k in record if k.startswith("eval/") and k.endswith(("/acc", "/acc_norm")))
        if "loss" in record:
            self.bar.set_postfix({k: _fmt(record[k]) for k in ("loss", "lr", "tokens_per_s")}, refresh=False)
        line = " ".join(f"{k} {_fmt(record[k])}" for k in keys if k in record)
        if "active_mean" in record:
            means = record["active_mean"]
            line += f" active/token {sum(means) / len(means):.1f} (layers {min(means):.1f}..{max(means):.1f})"
            line += f" dead {sum(record['dead_frac']) / len(means):.1%}"
        if "ffn_sparse" in record:
            line += f" sparse layers {sum(record['ffn_sparse'])}/{len(record['ffn_sparse'])}"
        if not line:  # nothing of the console's (a profile record: the trainer printed its summary)
            return
        if self.bar.disable and "loss" in record:
            line += self._timing(step)
        self.bar.write(f"step {step}/{self.total_steps}: {line}")

    def close(self) -> None:
        self.bar.close()


_WANDB_MODES = {"online": "online", "run": "online", "offline": "offline", "dryrun": "offline"}
_WANDB_MODES["disabled"] = "disabled"


def wandb_mode(cfg: LoggingConfig) -> str:
    """logging.wandb_mode, unless wandb's own environment says otherwise: WANDB_MODE (online, offline,
    disabled; wandb's older run/dryrun too) wins over the config, and WANDB_DISABLED=true disables, as
    wandb users expect (`WANDB_MODE=offline python train.py ... logging=wandb`)."""
    env = os.environ.get("WANDB_MODE", "").strip().lower()
    if env:
        if env not in _WANDB_MODES:
            raise ValueError(
                f"WANDB_MODE={env!r} is not one of {tuple(_WANDB_MODES)}; set WANDB_MODE=offline (or unset it "
                "and use logging.wandb_mode)"
            )
        return _WANDB_MODES[env]
    if os.environ.get("WANDB_DISABLED", "").strip().lower() in ("1", "true", "yes"):
        return "disabled"
    return cfg.wandb_mode


class WandbSetupError(ValueError):
    """wandb.init refused the run (no API key, a bad entity or project, the server unreachable): the
    trainer stops with the message and the ways out instead of a traceback from inside wandb."""


class WandbSink:
    def __init__(self, cfg: LoggingConfig, run_dir: Path, run_name: str, config: dict, mode: str):
        import wandb  # only here: runs without wandb never import it

        # A stable id in the run dir lets a resumed job continue the same wandb run.
        id_file = run_dir / "wandb_id.txt"
        run_id = id_file.read_text().strip() if id_file.exists() else uuid.uuid4().hex[:12]
        id_file.write_text(run_id)
        # WANDB_PROJECT / WANDB_ENTITY apply where the config keeps its defaults (project twell, no entity).
        project = os.environ.get("WANDB_PROJECT") if cfg.wandb_project == "twell" else None
        try:
            self.run = wandb.init(
                mode=mode,
                project=project or cfg.wandb_project,
                entity=cfg.wandb_entity,
                tags=list(cfg.wandb_tags),
                name=run_name,
                id=run_id,
                resume="allow",
                dir=str(run_dir),
                config=config,
            )
        except wandb.errors.Error as err:
            raise WandbSetupError(
                f"wandb could not start the run (logging.wandb_mode={mode}): {type(err).__name__}: {err}. "
                "Log in first (`wandb login`, or WANDB_API_KEY=...), or log to the run dir and sync later "
                "(logging.wandb_mode=offline or WANDB_MODE=offline; `wandb sync <run_dir>/wandb`), or "
                "turn it off (logging.wandb_mode=disabled)"
            ) from err

    def log(self, record: dict) -> None:
        flat = {}
        for key, value in record.items():
            if key in PER_LAYER_KEYS:  # one chart per quantity, one line per layer
                flat.update({f"{key}/layer_{i:02d}": v for i, v in enumerate(value)})
                flat[f"{key}/mean"] = sum(value) / len(value)
                if key == "ffn_sparse":  # the routing at a glance: how many layers, and which
                    flat["ffn_sparse/count"] = sum(value)
                    flat["ffn_sparse/layers"] = "".join(map(str, value))
            elif key != "step" and value is not None:
                flat[key] = value
        self.run.log(flat, step=record["step"])

    def log_run_info(self, record: dict) -> None:
        """Facts a launch settles once (the FFN routing threshold and its table): the run's config."""
        info = {key: value for key, value in record.items() if key != "step"}
        self.run.config.update(info, allow_val_change=True)

    def close(self) -> None:
        self.run.finish()


class RunLogger:
    def __init__(
        self,
        cfg: LoggingConfig,
        run_dir: Path,
        run_name: str,
        config: dict,
        is_main: bool,
        total_steps: int,
        start_step: int,
    ):
        self.sinks = []
        if not is_main:
            return
        if cfg.jsonl:
            self.sinks.append(JsonlSink(run_dir / "metrics.jsonl", keep_through_step=start_step))
        if cfg.console:
            self.sinks.append(ConsoleSink(total_steps, start_step))
        mode = wandb_mode(cfg)
        if mode != "disabled":
            self.sinks.append(WandbSink(cfg, run_dir, run_name, config, mode))

    def log(self, record: dict) -> None:
        for sink in self.sinks:
            sink.log(record)

    def log_run_info(self, record: dict) -> None:
        """Facts a launch settles once, at start (record: {"step": the start step, ...}): a JSONL record
        and wandb's run config; the console has them from info()."""
        for sink in self.sinks:
            if hasattr(sink, "log_run_info"):
                sink.log_run_info(record)

    def info(self, message: str) -> None:
        """A line for the console that does not break the progress bar."""
        if self.sinks:
            tqdm.write(message)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()

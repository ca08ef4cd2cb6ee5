"""Atomic, verified checkpoints with torch.distributed.checkpoint (DCP).

Layout of one checkpoint, `<dir>/step_00001000/`:
  .metadata, *.distcp    DCP: model, optimizer and the trainer's replicated state (step, ...)
  rank_00000.pt ...      per rank: data-stream position and RNG states (they differ by rank)
  config.yaml            the resolved job config of the launch that wrote it (evaluation and export
                         read the model shape and tokenizer from it; a resume compares shapes with it)
  COMPLETE.json          written last: step, world size, and the size and CRC32 of every file

A checkpoint is written into `step_XXXXXXXX.tmp/` and renamed only once COMPLETE.json is in it, so
a job killed while saving leaves no directory that looks finished. On resume, a checkpoint whose
files do not match its COMPLETE.json (or fail to load) is refused with the reason, and the previous
one is tried. A checkpoint whose model tensors have other shapes than the model being resumed is
refused at once (ModelMismatchError), naming the config fields that differ.

A checkpoint resumes on another number of processes too: DCP reshards the model and optimizer, and each
rank gets the data states of every saving rank as {SAVED_RANKS: [...]}, from which the data stream deals
out its lanes anew (data/stream.py: the same global batch, lanes = world_size * grad_accum, is required
there); a rank beyond the saved ones takes the RNG states of rank (rank mod saved world size).
"""

import contextlib
import json
import logging
import os
import random
import re
import shutil
import warnings
import zlib
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from twell.data.stream import SAVED_RANKS  # the data stream's key for every saving rank's state
from twell.training.distributed import DistInfo, any_rank, barrier

log = logging.getLogger(__name__)

MARKER = "COMPLETE.json"
_STEP_DIR = re.compile(r"^step_(\d{8})$")


class CheckpointError(RuntimeError):
    pass


class ModelMismatchError(CheckpointError):
    """The checkpoint holds a model of another shape: no older checkpoint of the run would load either."""


CONFIG_NAME = "config.yaml"


@contextlib.contextmanager
def quiet_single_process():
    """DCP warns that it assumes a single process when there is no process group: that is intended."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to")
        yield


def capture_rng(device: torch.device) -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def restore_rng(state: dict, device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def _crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            crc = zlib.crc32(chunk, crc)
    return crc


def _my_share(files: list[str], info: DistInfo) -> list[str]:
    # Ranks hash disjoint slices of the files so verification runs in parallel.
    return sorted(files)[info.rank :: info.world_size]


def _gather_dicts(local: dict, info: DistInfo) -> dict:
    if not info.enabled:
        return local
    parts = [None] * info.world_size
    dist.all_gather_object(parts, local)
    return {k: v for part in parts for k, v in part.items()}


def _saved_part(saved: dict, prefix: str, template: dict) -> dict:
    """The entries of a nested state template that a checkpoint holds (`saved`: its DCP metadata's
    state_dict_metadata, which names them "prefix.key.subkey"). The trainer's own state grows new entries
    over time (a new clock, a new counter): a checkpoint written before one existed still resumes, and the
    new entry keeps the owner's fallback (its load_state_dict reads it with .get)."""

    def keep(node: dict, name: str) -> dict:
        out = {}
        for key, value in node.items():
            full = f"{name}.{key}"
            if isinstance(value, dict):
                out[key] = keep(value, full)
            elif full in saved:
                out[key] = value
        return out

    return keep(template, prefix)


class Checkpointer:
    def __init__(
        self, directory: str | os.PathLike, keep_last: int, info: DistInfo, run_config: dict | None = None
    ):
        """run_config: the launch's resolved job config (a plain dict), saved as config.yaml into
        every checkpoint and compared with a checkpoint's own when one does not fit the model."""
        self.dir = Path(directory)
        self.keep_last = keep_last
        self.info = info
        self.run_config = run_config

    # ---------------------------------------------------------------- saving
    def save(self, step: int, model, optimizer, trainer_state: dict, rank_state: dict) -> Path:
        """Collective: every rank calls it at the same step."""
        final = self.dir / f"step_{step:08d}"
        tmp = self.dir / f"step_{step:08d}.tmp"
        if self.info.is_main:
            for stale in self.dir.glob("step_*.tmp"):  # left by a job killed while saving
                shutil.rmtree(stale, ignore_errors=True)
            tmp.mkdir(parents=True)
        barrier()

        model_sd, optim_sd = get_state_dict(model, optimizer)
        with quiet_single_process():
            dcp.save({"model": model_sd, "optim": optim_sd, "trainer": trainer_state}, checkpoint_id=str(tmp))
        torch.save(rank_state, tmp / f"rank_{self.info.rank:05d}.pt")
        if self.info.is_main and self.run_config is not None:  # listed and CRC-checked like the rest
            (tmp / CONFIG_NAME).write_text(config_yaml(self.run_config))
        barrier()

        files = [p.name for p in tmp.iterdir() if p.is_file()]
        sums = _gather_dicts({name: _crc32(tmp / name) for name in _my_share(files, self.info)}, self.info)
        if self.info.is_main:
            manifest = {
                "step": step,
                "world_size": self.info.world_size,
                "files": {
                    name: {"bytes": (tmp / name).stat().st_size, "crc32": sums[name]} for name in files
                },
            }
            (tmp / (MARKER + ".part")).write_text(json.dumps(manifest, indent=1))
            os.replace(tmp / (MARKER + ".part"), tmp / MARKER)
            if final.exists():  # the same step saved again (e.g. final save right after a periodic one)
                shutil.rmtree(final)
            os.replace(tmp, final)
            self._prune()
        barrier()
        return final

    def _prune(self) -> None:
        if self.keep_last <= 0:
            return
        for old in self.complete_checkpoints()[: -self.keep_last]:
            shutil.rmtree(old, ignore_errors=True)

    # ---------------------------------------------------------------- finding
    def complete_checkpoints(self) -> list[Path]:
        """Finished checkpoints (COMPLETE.json present), oldest first."""
        if not self.dir.is_dir():
            return []
        found = [p for p in self.dir.iterdir() if _STEP_DIR.match(p.name) and (p / MARKER).is_file()]
        return sorted(found, key=lambda p: p.name)

    # ---------------------------------------------------------------- loading
    def verify(self, path: Path) -> dict:
        """Check the files against COMPLETE.json; return the manifest or raise CheckpointError."""
        marker = path / MARKER
        if not marker.is_file():
            raise CheckpointError(f"{path} has no {MARKER}: it is partial (the job died while saving)")
        try:
            manifest = json.loads(marker.read_text())
            files = manifest["files"]
        except (ValueError, KeyError) as err:
            raise CheckpointError(f"{marker} is unreadable ({err})") from err
        problems = []
        for name, expect in files.items():
            actual = path / name
            if not actual.is_file():
                problems.append(f"{name} is missing")
            elif actual.stat().st_size != expect["bytes"]:
                problems.append(f"{name} has {actual.stat().st_size} bytes, expected {expect['bytes']}")
        if not problems:
            for name in _my_share(list(files), self.info):
                if _crc32(path / name) != files[name]["crc32"]:
                    problems.append(f"{name} fails its CRC32 check")
        if problems:
            raise CheckpointError(f"{path} is corrupt: " + "; ".join(problems))
        return manifest

    def load(self, path: Path, model, optimizer, trainer_state: dict) -> tuple[dict, dict]:
        """Load into model and optimizer; return (trainer_state, this rank's rank_state).

        `trainer_state` is a template with the keys to read (DCP loads in place)."""
        manifest = self.verify(path)
        model_sd, optim_sd = get_state_dict(model, optimizer)
        with quiet_single_process():
            saved = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
        self.check_model_fits(path, model_sd, saved)
        state = {
            "model": model_sd,
            "optim": optim_sd,
            "trainer": _saved_part(saved, "trainer", trainer_state),
        }
        with quiet_single_process():
            dcp.load(state, checkpoint_id=str(path))
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        return state["trainer"], self._load_rank_state(path, manifest["world_size"])

    def _load_rank_state(self, path: Path, saved_world: int) -> dict:
        """This rank's data position and RNG states; from a run of another size, the data states of
        every saving rank (see the module docstring)."""
        load = lambda rank: torch.load(path / f"rank_{rank:05d}.pt", weights_only=False)
        if saved_world == self.info.world_size:
            return load(self.info.rank)
        saved = [load(rank) for rank in range(saved_world)]
        if self.info.is_main:
            log.info(
                "%s was written by %d processes, this job has %d: its data lanes are dealt out anew",
                path, saved_world, self.info.world_size,
            )  # fmt: skip
        rng = saved[self.info.rank % saved_world]["rng"]
        return {"data": {SAVED_RANKS: [state["data"] for state in saved]}, "rng": rng}

    def check_model_fits(self, path: Path, model_sd: dict, metadata: dict) -> None:
        """Raise ModelMismatchError when the checkpoint's model tensors (`metadata`: its DCP
        state_dict_metadata) differ from the model's in names or shapes, naming the model config fields
        that differ (from the checkpoint's config.yaml)."""
        saved = {
            key.removeprefix("model."): tuple(meta.size)
            for key, meta in metadata.items()
            if key.startswith("model.") and hasattr(meta, "size")
        }
        wanted = {key: tuple(value.shape) for key, value in model_sd.items() if hasattr(value, "shape")}
        problems = [f"{k}: {list(saved[k])} in the checkpoint, {list(v)} now" for k, v in wanted.items()
                    if k in saved and saved[k] != v]  # fmt: skip
        problems += [f"{k} is not in the checkpoint" for k in wanted if k not in saved]
        problems += [f"{k} is in the checkpoint but not in the model" for k in saved if k not in wanted]
        if not problems:
            return
        fields = []
        stored = read_checkpoint_config(path)
        if stored is not None and self.run_config is not None:
            old, new = stored.get("model") or {}, self.run_config.get("model") or {}
            fields = [f"model.{k}={old.get(k)!r} in the checkpoint, {new.get(k)!r} now"
                      for k in new if k != "name" and old.get(k) != new.get(k)]  # fmt: skip
        shown = "; ".join(fields or problems[:4]) + ("" if fields or len(problems) <= 4 else "; ...")
        raise ModelMismatchError(
            f"{path} holds a model of another shape than this launch builds ({shown}). To resume, launch "
            f"with the checkpoint's model settings (see {path / CONFIG_NAME}, or drop the model overrides); "
            "to train the new shape, give it a new run_name/run_dir (or checkpoint.resume=none)"
        )

    def load_latest(self, model, optimizer, trainer_state: dict):
        """Resume from the newest checkpoint that verifies and loads on every rank.

        Returns (path, trainer_state, rank_state), or None when the directory holds no checkpoint.
        A bad checkpoint is refused with a warning and the previous one is tried; if every one is
        bad, that is an error (silently starting over would overwrite the run)."""
        candidates = self.complete_checkpoints()
        partial = [p.name for p in self.dir.glob("step_*") if p.is_dir() and p not in candidates]
        if partial and self.info.is_main:
            log.warning("ignoring partial checkpoints (no %s): %s", MARKER, ", ".join(sorted(partial)))
        reasons = []
        for path in reversed(candidates):
            try:
                loaded = self.load(path, model, optimizer, trainer_state)
                failed = 0
            except ModelMismatchError:
                raise  # the same on every rank, and true of the older checkpoints too: say it now
            except Exception as err:  # noqa: BLE001 - any failure means "not usable", reported below
                loaded, failed, reason = None, 1, f"{type(err).__name__}: {err}"
            # Every rank must resume from the same checkpoint.
            if any_rank(bool(failed)) and not failed:
                failed, reason = 1, "another rank could not load it"
            if not failed:
                return (path, *loaded)
            reasons.append(f"{path.name}: {reason}")
            if self.info.is_main:
                log.warning("refusing checkpoint %s (%s); trying the previous one", path, reason)
        if candidates:
            raise CheckpointError(
                f"no usable checkpoint in {self.dir}: " + " | ".join(reasons) + ". Delete the bad "
                "ones, point checkpoint.resume at a good one, or set checkpoint.resume=none with a new run_dir"
            )
        return None


def config_yaml(run_config: dict) -> str:
    from omegaconf import OmegaConf

    return OmegaConf.to_yaml(OmegaConf.create(run_config))


def read_checkpoint_config(path: Path) -> dict | None:
    """The job config saved in a checkpoint folder (None for checkpoints written before it was)."""
    from omegaconf import OmegaConf

    candidate = Path(path) / CONFIG_NAME
    if not candidate.is_file():
        return None
    cfg = OmegaConf.to_container(OmegaConf.load(candidate), resolve=False)
    return cfg if isinstance(cfg, dict) else None


def verify_checkpoint(path: Path) -> dict:
    """One process checks every file of a checkpoint against its COMPLETE.json (sizes and CRC32), as a
    resume does; returns the manifest or raises CheckpointError with the reason. For readers outside
    training (evaluation, export, activity reports), which have no process group."""
    return Checkpointer(path.parent, 0, DistInfo(0, 0, 1, torch.device("cpu"))).verify(path)

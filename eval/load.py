"""Load a model to evaluate: a Hugging Face folder, or a DCP checkpoint written by the trainer.

A trainer checkpoint (`<run_dir>/checkpoints/step_XXXXXXXX/`, torch.distributed.checkpoint) holds
tensors only, so the model's shape comes from the run's config: a `config.yaml` with a `model:`
section found in the checkpoint folder or above it (the run dir), or a preset name given by hand.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import sys
from pathlib import Path

import torch

from twell.model import ModelConfig, Transformer

RUN_CONFIG_NAMES = ("config.yaml", ".hydra/config.yaml")


def parse_settings(
    words: list[str], option_keys: set[str], usage: str, expected: str = "key=value"
) -> tuple[dict, dict]:
    """key=value words -> (script options: keys in option_keys, ModelConfig overrides with JSON-ish values);
    any other key is refused with the closest known one.

    checkpoint= is required. Errors exit with "error: ..." followed by usage (e.g. " (see --help)" or
    the script's docstring); expected names what each word should be (in the "got ..." message).
    """
    options, overrides = {}, {}
    for word in words:
        key, sep, value = word.partition("=")
        if not sep or not key:
            raise SystemExit(f"error: expected {expected}, got {word!r}{usage}")
        if key in option_keys:
            options[key] = value
        else:
            try:
                overrides[key] = json.loads(value)
            except ValueError:
                overrides[key] = value
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    for key in overrides:
        if key not in fields:
            close = difflib.get_close_matches(key, [*option_keys, *fields], n=1)
            hint = f" (did you mean {close[0]}=?)" if close else ""
            raise SystemExit(
                f"error: unknown setting {key}={overrides[key]!r}{hint}; this script's settings: "
                f"{', '.join(sorted(option_keys))}; model fields: {', '.join(sorted(fields))}"
            )
    if "checkpoint" not in options:
        raise SystemExit(f"error: checkpoint=<path> is required{usage}")
    return options, overrides


def is_hf_folder(path: Path) -> bool:
    return (path / "config.json").is_file()


def _verified(step_dir: Path) -> str:
    """'verified' when the folder's files match its COMPLETE.json (CRC32), as training checks them
    before a resume; raises CheckpointError with the reason otherwise. Folders without the file
    (not written by the trainer) are read as they are, with a warning."""
    from twell.training.checkpoint import MARKER, verify_checkpoint

    if not (step_dir / MARKER).is_file():
        return f"not verified: no {MARKER}"
    verify_checkpoint(step_dir)
    return f"verified against its {MARKER}"


def latest_step_dir(path: Path, quiet: bool = False) -> Path:
    """A step folder itself, or the newest finished `step_*` in a checkpoints folder that passes its
    CRC check (a corrupt one is refused for the previous one, with a warning naming it). Says on
    stderr which step folder is read (unless quiet); raises ValueError when none is usable."""
    from twell.training.checkpoint import CheckpointError

    if (path / ".metadata").is_file():
        candidates = [path]
    else:
        # Exactly step_<8 digits>: the trainer saves into `step_XXXXXXXX.tmp/` (which already has a
        # .metadata while being written) and renames it only when the checkpoint is complete.
        candidates = sorted(
            (p for p in path.glob("step_" + "[0-9]" * 8) if p.is_dir() and (p / ".metadata").is_file()),
            reverse=True,
        )
    if not candidates:
        raise FileNotFoundError(
            f"{path} is neither a Hugging Face folder (config.json) nor a DCP checkpoint "
            "(.metadata) nor a folder of step_* checkpoints"
        )
    reasons = []
    for step_dir in candidates:
        try:
            how = _verified(step_dir)
        except CheckpointError as err:
            reasons.append(str(err))
            if not quiet:
                print(f"warning: refusing checkpoint {step_dir.name}: {err}", file=sys.stderr, flush=True)
            continue
        if not quiet:
            print(f"reading checkpoint {step_dir} ({how})", file=sys.stderr, flush=True)
        return step_dir
    older = "" if len(candidates) > 1 else "; give an older step_* folder, or the checkpoints folder"
    raise ValueError(f"no usable checkpoint in {path}: " + " | ".join(reasons) + older)


def find_run_config(step_dir: Path) -> dict | None:
    """The run's composed config (as a dict) from the step folder or one of its parents."""
    from omegaconf import OmegaConf

    for folder in [step_dir, *step_dir.parents][:4]:
        for name in RUN_CONFIG_NAMES:
            candidate = folder / name
            if candidate.is_file():
                cfg = OmegaConf.to_container(OmegaConf.load(candidate), resolve=False)
                if isinstance(cfg, dict) and isinstance(cfg.get("model"), dict):
                    return cfg
    return None


def model_config_for(step_dir: Path, preset: str | None, **overrides) -> tuple[ModelConfig, dict | None]:
    run_cfg = find_run_config(step_dir)
    if preset:
        return ModelConfig.preset(preset, **overrides), run_cfg
    if run_cfg is None:
        raise FileNotFoundError(
            f"no run config (config.yaml with a model: section) in or above {step_dir}; "
            "pass the model shape by hand, e.g. model=tiny vocab_size=4096"
        )
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    fields = {k: v for k, v in run_cfg["model"].items() if k in known and not str(k).startswith("_")}
    return ModelConfig(**{**fields, **overrides}), run_cfg


def load_dcp_model(step_dir: Path, cfg: ModelConfig) -> Transformer:
    """Read only the model's tensors of a trainer checkpoint (optimizer state is left on disk)."""
    import torch.distributed.checkpoint as dcp

    from twell.training.checkpoint import quiet_single_process

    net = Transformer(cfg)
    state = net.state_dict()
    with quiet_single_process():  # generate / eval / export read in one process, as intended
        dcp.load({"model": state}, checkpoint_id=str(step_dir))
    net.load_state_dict(state)  # in place already; this also refreshes the FFN routing flags
    return net


def load_for_eval(
    checkpoint: str | Path, preset: str | None = None, tokenizer: str | None = None, **overrides
):
    """(Transformer on CPU, tokenizer name or path) for a HF folder or a trainer checkpoint.

    tokenizer: defaults to the HF folder itself, or the run config's data.tokenizer.
    overrides: ModelConfig fields (e.g. vocab_size, ffn_impl).
    """
    path = Path(checkpoint)
    if not path.exists():
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    if is_hf_folder(path):
        from twell.model.hf_io import import_hf

        _, net = import_hf(path, dtype=torch.float32, **overrides)
        net.source = str(path)
        return net, tokenizer or str(path)
    step_dir = latest_step_dir(path)
    cfg, run_cfg = model_config_for(step_dir, preset, **overrides)
    net = load_dcp_model(step_dir, cfg)
    net.source = str(step_dir)  # which step was read: scripts record it with their results
    if tokenizer is None:
        tokenizer = ((run_cfg or {}).get("data") or {}).get("tokenizer")
        if not tokenizer:
            raise ValueError(f"no tokenizer known for {step_dir}: pass tokenizer=<hub name or folder>")
    return net, tokenizer

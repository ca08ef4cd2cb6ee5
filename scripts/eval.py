"""Zero-shot lm-eval of a checkpoint: the paper's seven tasks by default.

    python scripts/eval.py checkpoint=outputs/quickstart/checkpoints tasks=paper7 limit=100
    python scripts/eval.py checkpoint=exported/sparselm-1.5b tasks=paper7,mmlu batch_size=32 device=cuda
    python scripts/eval.py checkpoint=<step dir> model=tiny vocab_size=4096 tokenizer=offline/tokenizer

checkpoint: a Hugging Face Llama folder (config.json; e.g. from scripts/hf.py export or a
SakanaAI/SparseLM download) or a trainer checkpoint (a step_* folder, or the checkpoints folder:
the newest step). A trainer checkpoint takes its shape from the run's config.yaml, or model=<preset>.
Other keys: tasks (preset paper7/optional/all or lm-eval names, comma-separated), limit (examples
per task), batch_size, device (cpu/cuda; default cuda if available), out (results JSON, default
<checkpoint>/eval_results.json), offline (auto/true/false; auto, the default: the local task
copies made by scripts/setup_offline_eval.py for every task that has one, the hub for the others;
true, or HF_HUB_OFFLINE/HF_DATASETS_OFFLINE set: the local copies only), offline_tasks (that folder,
default $TWELL_OFFLINE_TASKS or offline/lm_eval_tasks), tokenizer, ffn_impl, and any ModelConfig field as an override.
"""

import importlib.util
import sys
from pathlib import Path

import torch

from twell.data import load_tokenizer
from twell.eval.load import load_for_eval, parse_settings

SCRIPT_KEYS = {"checkpoint", "model", "tokenizer", "tasks", "limit", "batch_size", "device", "out", "offline"}
SCRIPT_KEYS |= {"offline_tasks"}


def main(argv=None) -> None:
    words = sys.argv[1:] if argv is None else argv
    options, overrides = parse_settings(words, SCRIPT_KEYS, f"\n\n{__doc__}")
    if importlib.util.find_spec("lm_eval") is None:
        raise ValueError(
            "scripts/eval.py needs lm-eval, which is not installed here: bash scripts/setup_env.sh eval "
            "(or pip install -e '.[eval]')"
        )
    from twell.eval.lm_eval_adapter import run_lm_eval  # lm-eval is imported only when evaluating

    choices = {"auto": None, "true": True, "false": False}
    given = options.get("offline", "auto").lower()
    if given not in choices:
        raise ValueError(f"offline={given!r} must be auto, true or false")
    offline = choices[given]
    limit = options.get("limit")
    limit = None if limit in (None, "", "none") else (float(limit) if "." in limit else int(limit))
    device = options.get("device") or ("cuda" if torch.cuda.is_available() else "cpu")
    from twell.eval.tasks import describe_sources

    tasks = options.get("tasks", "paper7")
    sources = describe_sources(tasks, offline, options.get("offline_tasks"))  # bad tasks stop here, first

    net, tokenizer_name = load_for_eval(
        options["checkpoint"], preset=options.get("model"), tokenizer=options.get("tokenizer"), **overrides
    )
    tokenizer = load_tokenizer(tokenizer_name)
    print(
        f"model: {net.cfg.num_params() / 1e6:.2f}M parameters, tokenizer: {tokenizer_name}, device: {device}"
    )
    print(sources, flush=True)
    results = run_lm_eval(
        net.to(device),
        tokenizer,
        tasks=tasks,
        limit=limit,
        batch_size=int(options.get("batch_size", 8)),
        offline=offline,
        offline_dir=options.get("offline_tasks"),
    )
    from twell.eval.report import save_results

    results["checkpoint"] = net.source  # the step folder (or HF folder) that was scored

    checkpoint = Path(options["checkpoint"])
    default_out = (checkpoint if checkpoint.is_dir() else checkpoint.parent) / "eval_results.json"
    out = save_results(results, options.get("out") or default_out)
    print(results["table"])
    print(f"results: {out}")


if __name__ == "__main__":
    try:
        main()
    except (ValueError, FileNotFoundError) as err:  # bad input: its message names the fix, as train.py's
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)

"""Evaluation: lm-eval integration (offline too), validation loss / bits per byte, reports.

`run_lm_eval` imports lm-eval on first use, so the trainer can import this package without it.
"""

from twell.eval.report import flat_metrics, results_table, save_results, summarize
from twell.eval.tasks import PAPER7, PRESETS, expand_tasks, resolve_tasks
from twell.eval.validation import bytes_per_token, validation_loss


def run_lm_eval(model, tokenizer, tasks="paper7", limit=None, batch_size=8, device=None, **kwargs) -> dict:
    """See eval.lm_eval_adapter.run_lm_eval (needs the `eval` extra: lm-eval)."""
    from twell.eval.lm_eval_adapter import run_lm_eval as _run

    return _run(model, tokenizer, tasks=tasks, limit=limit, batch_size=batch_size, device=device, **kwargs)


__all__ = [
    "PAPER7",
    "PRESETS",
    "bytes_per_token",
    "expand_tasks",
    "flat_metrics",
    "resolve_tasks",
    "results_table",
    "run_lm_eval",
    "save_results",
    "summarize",
    "validation_loss",
]

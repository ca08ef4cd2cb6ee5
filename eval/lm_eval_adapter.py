"""Evaluate our Transformer in-process with lm-eval, as a registered `LM` ("twell").

lm-eval's `TemplateLM` splits and tokenises (context, continuation) pairs and its `Collator`
does the length-sorted batching and the multiple-choice cache (choices sharing a context and
differing only in their last token are scored from one forward). We only run the forward and
read the continuation's log-probabilities. (HFLM would need `accelerate` and a `PreTrainedModel`.)
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
import torch.nn.functional as F
from lm_eval import simple_evaluate
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import Collator
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tqdm import tqdm

from twell.eval.report import flat_metrics, mean_accuracy, results_table, summarize
from twell.eval.tasks import PAPER7, resolve_tasks
from twell.model.generate import Decoder, generate

log = logging.getLogger(__name__)


@register_model("twell")
class TwellLM(TemplateLM):
    """lm-eval view of a `model.Transformer` and a Hugging Face tokenizer."""

    def __init__(self, model, tokenizer, batch_size: int = 8, max_gen_toks: int = 256):
        super().__init__()
        if tokenizer.eos_token_id is None:
            raise ValueError(
                "the tokenizer has no eos_token: lm-eval needs it as the prefix of empty contexts"
            )
        self.model, self.tokenizer = model, tokenizer
        self.batch_size = int(batch_size)
        self.max_length = model.cfg.max_seq_len
        self.max_gen_toks = max_gen_toks

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None):
        """`lm_eval --model twell --model_args path=<HF folder>[,device=cuda]` (see model/hf_io.py)."""
        from lm_eval.utils import simple_parse_args_string
        from transformers import AutoTokenizer

        from twell.model.hf_io import import_hf

        args = {**simple_parse_args_string(arg_string), **(additional_config or {})}
        path = Path(args["path"])
        _, net = import_hf(path)
        net.to(args.get("device") or ("cuda" if torch.cuda.is_available() else "cpu")).eval()
        return cls(net, AutoTokenizer.from_pretrained(path), batch_size=int(args.get("batch_size") or 8))

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def tok_encode(self, string: str, **kwargs) -> list[int]:
        return self.tokenizer.encode(string, add_special_tokens=False)

    def tok_decode(self, tokens) -> str:
        return self.tokenizer.decode(tokens)

    @torch.no_grad()
    def _logprobs(self, rows: list[list[int]]) -> torch.Tensor:
        """log-softmax [B, S, V] (fp32) for right-padded rows; causal, so padding never leaks back."""
        width = max(len(r) for r in rows)
        batch = torch.full((len(rows), width), self.eot_token_id, dtype=torch.long)
        for i, row in enumerate(rows):
            batch[i, : len(row)] = torch.tensor(row, dtype=torch.long)
        device = self.device
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            logits = self.model(batch.to(device), with_stats=False).logits
        return F.log_softmax(logits.float(), dim=-1)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs):
        """requests: [((context, continuation) or None, context_tokens, continuation_tokens)].

        Returns [(sum of continuation log-probs, continuation is the greedy choice)] in order.
        """
        collator = Collator(
            requests,
            sort_fn=lambda r: (-len(r[1] + r[2]), tuple(r[1] + r[2])),  # longest first: OOM shows early
            group_by="contexts",
            group_fn=lambda r: r[1] + r[2][:-1],  # one forward serves choices differing in the last token
        )
        results = []
        progress = tqdm(total=len(requests), disable=disable_tqdm, desc="lm-eval loglikelihood")
        for chunk in collator.get_batched(n=self.batch_size):
            rows, spans = [], []
            for _, context, continuation in chunk:
                # The model sees at most max_length tokens; the last one is only ever a target.
                row = (context + continuation)[-(self.max_length + 1) :][:-1]
                rows.append(row)
                spans.append((len(row) - len(continuation), len(row)))
            logprobs = self._logprobs(rows)
            # Scores stay on the device until the whole chunk is done: one host copy per chunk, not
            # two syncs per answer choice.
            pending, totals, greedies = [], [], []
            for (request, context, continuation), (start, end), row_lp in zip(chunk, spans, logprobs):
                scores = row_lp[start:end].unsqueeze(0)  # [1, len(cont), V]
                for request_i, cont_i, scores_i in collator.get_cache(
                    req_str=request, cxt_toks=context, cont_toks=continuation, logits=scores
                ):
                    target = torch.tensor(cont_i, device=scores_i.device).unsqueeze(0)
                    greedies.append((scores_i.argmax(-1) == target).all())
                    totals.append(scores_i.gather(-1, target.unsqueeze(-1)).sum())
                    pending.append(request_i)
            if pending:
                host = torch.stack([torch.stack(totals).double(), torch.stack(greedies).double()]).tolist()
                for request_i, total, greedy in zip(pending, host[0], host[1]):
                    results.append((total, bool(greedy)))
                    if request_i is not None:
                        self.cache_hook.add_partial("loglikelihood", request_i, (total, bool(greedy)))
                progress.update(len(pending))
        progress.close()
        return collator.get_original(results)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Whole-text log-likelihood (perplexity tasks) over disjoint max_length windows."""
        out = []
        for request in tqdm(requests, disable=disable_tqdm, desc="lm-eval rolling loglikelihood"):
            (text,) = request.args
            windows = [
                (None, *make_disjoint_window(w))
                for w in get_rolling_token_windows(
                    token_list=self.tok_encode(text),
                    prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length,
                    context_len=1,
                )
            ]
            total = sum(score for score, _ in self._loglikelihood_tokens(windows, disable_tqdm=True))
            self.cache_hook.add_partial("loglikelihood_rolling", (text,), total)
            out.append(total)
        return out

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Continuations until a stop string, EOS or max_gen_toks, on the KV cache (model/generate.py):
        lm-eval's Collator batches up to batch_size requests with the same generation settings, longest
        context first, each context left-truncated to max_length - max_gen_toks; greedy unless
        do_sample. On CUDA the decode steps are CUDA graphs of compiled blocks."""
        items = []  # (the request's args, context ids, generate() settings)
        for request in requests:
            context, gen_kwargs = request.args
            settings = _generation_settings(gen_kwargs, self.max_gen_toks, self.max_length)
            settings["until"] = settings["until"] or (self.tok_decode([self.eot_token_id]),)
            ids = self.tok_encode(context)[-(self.max_length - settings["max_new"]) :]
            items.append((request.args, ids or [self.prefix_token_id], settings))
        collator = Collator(
            items, sort_fn=lambda item: (-len(item[1]), tuple(item[1])), group_by="gen_kwargs",
            group_fn=lambda item: item[2],
        )  # fmt: skip
        cuda = self.device.type == "cuda"
        decoder = Decoder(self.model, self.batch_size, self.max_length, cuda_graph=cuda, compile=cuda)
        results = []
        progress = tqdm(total=len(requests), disable=disable_tqdm, desc="lm-eval generate")
        for chunk in collator.get_batched(n=self.batch_size):
            texts = self._generate_batch(decoder, [item[1] for item in chunk], chunk[0][2])
            for item, text in zip(chunk, texts):
                self.cache_hook.add_partial("generate_until", item[0], text)
            results += texts
            progress.update(len(chunk))
        progress.close()
        return collator.get_original(results)

    def _generate_batch(self, decoder, prompts: list[list[int]], settings: dict) -> list[str]:
        """One batch's continuations, each cut at its first stop string; the generation ends early
        once every row has met a stop string or EOS."""
        until, eot = settings["until"], self.eot_token_id
        new: list[list[int]] = [[] for _ in prompts]
        done = [False] * len(prompts)
        # A stop string is looked for in the text of the last few tokens only (a token decodes to at least
        # a character but for a split multi-byte one): one short decode a token, not the whole row's. A
        # stop spread over more tokens is missed here, which only lets that row run on: the texts are cut
        # at their first stop string below, from the whole decode.
        window = 2 * max(len(stop) for stop in until) + 8

        def on_token(tokens) -> bool:
            for row, token in enumerate(tokens):
                if token is None or done[row]:
                    continue
                if token == eot:
                    done[row] = True
                    continue
                new[row].append(token)
                tail = self.tok_decode(new[row][-window:])
                done[row] = any(stop in tail for stop in until)
            return all(done)

        generator = None
        if settings["temperature"] > 0:
            generator = torch.Generator(device=self.device).manual_seed(settings["seed"])
        generate(
            self.model, prompts, settings["max_new"], temperature=settings["temperature"],
            top_k=settings["top_k"], top_p=settings["top_p"], generator=generator, decoder=decoder,
            on_token=on_token,
        )  # fmt: skip
        texts = []
        for tokens in new:
            text = self.tok_decode(tokens)
            for stop in until:
                text = text.split(stop)[0]
            texts.append(text)
        return texts


def _generation_settings(gen_kwargs: dict, max_gen_toks: int, max_length: int) -> dict:
    """lm-eval's gen_kwargs as generate()'s settings: until (stop strings), max_new (capped so that at
    least one context token fits), greedy unless do_sample (then temperature, default 1, top_k, top_p)."""
    until = gen_kwargs.get("until") or ()
    until = (until,) if isinstance(until, str) else tuple(until)
    max_new = max(1, min(int(gen_kwargs.get("max_gen_toks", max_gen_toks)), max_length - 1))
    sample = bool(gen_kwargs.get("do_sample", False))
    temperature = float(gen_kwargs.get("temperature", 1.0 if sample else 0.0)) if sample else 0.0
    return {
        "until": until,
        "max_new": max_new,
        "temperature": temperature,
        "top_k": int(gen_kwargs.get("top_k") or 0) if sample else 0,
        "top_p": float(gen_kwargs.get("top_p") or 1.0) if sample else 1.0,
        "seed": int(gen_kwargs.get("seed", 0)),
    }


def run_lm_eval(
    model,
    tokenizer,
    tasks="paper7",
    limit: int | float | None = None,
    batch_size: int = 8,
    device: str | torch.device | None = None,
    offline: bool | None = None,
    offline_dir=None,
    bootstrap_iters: int = 0,
    mean_over: list[str] | None = None,
) -> dict:
    """Zero-shot lm-eval on `model` (our Transformer itself, not a DDP/FSDP wrapper).

    tasks: a preset ("paper7", "optional", "all"), lm-eval task names, or a comma list of both.
    limit: examples per task (int) or fraction (float < 1); None = all.
    device: where to run (the model is moved there if it is elsewhere); default: the model's.
    offline: see eval.tasks.task_sources (default auto: the offline copies where they exist).
    bootstrap_iters: lm-eval's bootstrap for non-mean metrics' stderr (0 = skip; it is slow).

    One process, no collectives: in a distributed job call it from rank 0 only.
    Returns lm-eval's results dict plus "summary" {task: {metric: value}}, "mean" (over the paper7
    tasks present), "table" (markdown) and "metrics" (flat, for loggers). The model's train/eval
    mode is restored afterwards.
    """
    names, manager = resolve_tasks(tasks, offline=offline, offline_dir=offline_dir)
    if device is not None and torch.device(device) != next(model.parameters()).device:
        model.to(device)
    was_training = model.training
    model.eval()
    try:
        results = simple_evaluate(
            model=TwellLM(model, tokenizer, batch_size=batch_size),
            tasks=names,
            task_manager=manager,
            limit=limit,
            bootstrap_iters=bootstrap_iters,
            log_samples=False,
        )
    finally:
        model.train(was_training)
    mean_over = mean_over or PAPER7
    results["summary"] = summarize(results)
    results["mean"] = mean_accuracy(results["summary"], mean_over)
    results["table"] = results_table(results, mean_over)
    results["metrics"] = flat_metrics(results)
    for name in ("acc", "acc_norm"):
        if name in results["mean"]:
            results["metrics"][f"eval/paper7_mean/{name}"] = results["mean"][name]
    return results

"""Generate text from a checkpoint with the KV cache (sparse layers on the TwELL kernels).

    python scripts/generate.py checkpoint=outputs/quickstart/checkpoints prompt="The Python language"
    python scripts/generate.py checkpoint=exported/sparselm-1.5b file=prompts.txt max_new_tokens=128 temperature=0.8 top_p=0.95 seed=1
    python scripts/generate.py checkpoint=<step dir> model=tiny vocab_size=4096 tokenizer=offline/tokenizer prompt="..."

checkpoint: a Hugging Face Llama folder or a trainer checkpoint, read as scripts/eval.py reads it (model,
tokenizer and any ModelConfig field as an override, e.g. ffn_impl=twell to take the TwELL kernels in
every layer; a trained "auto" model keeps its per-layer routing). prompt=<text>, or file=<path> with one
prompt a line (blank lines skipped). One prompt is printed as it is generated; several are generated
batch_size at a time and printed as each batch ends. Other keys: max_new_tokens (default 64),
temperature (0: greedy, the default), top_k (0: off), top_p (1: off), seed (sampling; default 0),
stop_at_eos (true: a row ends at the tokenizer's EOS), bos (true: each prompt starts with the EOS token,
which separates documents in training data), batch_size (default 8), device (default cuda if available),
dtype (default bfloat16 on CUDA, float32 on CPU), cuda_graph (default true on CUDA), compile (default true
on CUDA), prefill_ffn (auto, dense or model: how the prompt's pass runs sparse layers; auto, the default,
takes dense matmuls below 16,384 prompt tokens, where they are faster), attention (sdpa or flash_decode:
how a decode step attends; default sdpa), out (a JSONL file of the prompts and completions).
"""

import json
import sys

import torch

from twell.data import load_tokenizer
from twell.eval.load import load_for_eval, parse_settings
from twell.model.generate import Decoder, cache_len_for, check_sampling, generate

SCRIPT_KEYS = {"checkpoint", "model", "tokenizer", "prompt", "file", "max_new_tokens", "temperature", "top_k"}
SCRIPT_KEYS |= {
    "top_p",
    "seed",
    "stop_at_eos",
    "bos",
    "batch_size",
    "device",
    "dtype",
    "cuda_graph",
    "compile",
    "prefill_ffn",
    "attention",
    "out",
}


def _flag(options: dict, key: str, default: bool) -> bool:
    value = options.get(key)
    if value is None:
        return default
    if value.lower() not in ("true", "false"):
        raise ValueError(f"{key}={value!r} must be true or false")
    return value.lower() == "true"


def _number(options: dict, key: str, kind: type, default):
    value = options.get(key)
    if value is None:
        return default
    try:
        return kind(value)
    except ValueError:
        raise ValueError(f"{key}={value!r} must be {'an integer' if kind is int else 'a number'}") from None


def read_prompts(options: dict) -> list[str]:
    if ("prompt" in options) == ("file" in options):
        raise ValueError('give exactly one of prompt="<text>" or file=<path with one prompt a line>')
    if "prompt" in options:
        return [options["prompt"]]
    with open(options["file"], encoding="utf-8") as f:
        prompts = [line.rstrip("\n") for line in f if line.strip()]
    if not prompts:
        raise ValueError(f"file={options['file']} holds no prompt (one a line, blank lines skipped)")
    return prompts


class StreamPrinter:
    """on_token callback for one row: prints the text as it grows (holding back an incomplete
    multi-byte character, which decodes as U+FFFD until its last byte arrives)."""

    def __init__(self, tokenizer):
        self.tokenizer, self.ids, self.shown = tokenizer, [], 0

    def __call__(self, tokens: list[int | None]) -> None:
        if tokens[0] is None:
            return
        self.ids.append(tokens[0])
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if not text.endswith("\ufffd"):
            print(text[self.shown :], end="", flush=True)
            self.shown = len(text)


def main(argv=None) -> list[dict]:
    words = sys.argv[1:] if argv is None else argv
    options, overrides = parse_settings(words, SCRIPT_KEYS, f"\n\n{__doc__}")
    texts = read_prompts(options)
    max_new_tokens = _number(options, "max_new_tokens", int, 64)
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 1")
    batch_size = _number(options, "batch_size", int, 8)
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size} must be >= 1")
    sampling = dict(
        temperature=_number(options, "temperature", float, 0.0),
        top_k=_number(options, "top_k", int, 0),
        top_p=_number(options, "top_p", float, 1.0),
    )
    check_sampling(**sampling)  # before the model loads: a bad value is told at once
    device = torch.device(options.get("device") or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = getattr(torch, options.get("dtype") or ("bfloat16" if device.type == "cuda" else "float32"))
    cuda_graph = _flag(options, "cuda_graph", device.type == "cuda")
    compile_blocks = _flag(options, "compile", device.type == "cuda")

    net, tokenizer_name = load_for_eval(
        options["checkpoint"], preset=options.get("model"), tokenizer=options.get("tokenizer"), **overrides
    )
    tokenizer = load_tokenizer(tokenizer_name)
    net = net.to(device=device, dtype=dtype).eval()
    sparse = (
        sum(net.ffn_routing())
        if net.cfg.ffn_impl == "auto"
        else net.cfg.n_layers * (net.cfg.ffn_impl == "twell")
    )
    print(
        f"model: {net.cfg.num_params() / 1e6:.2f}M parameters, {sparse} of {net.cfg.n_layers} FFN layers sparse, "
        f"{dtype} on {device}{', CUDA graphs' if cuda_graph else ''}{', compiled' if compile_blocks else ''}",
        file=sys.stderr,
    )
    bos = [tokenizer.eos_token_id] if _flag(options, "bos", True) else []
    prompts = [bos + tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]
    eos = tokenizer.eos_token_id if _flag(options, "stop_at_eos", True) else None
    # One cache (and one CUDA graph per batch size) serves every batch.
    max_len = cache_len_for(net.cfg.max_seq_len, max(len(p) for p in prompts), max_new_tokens)
    decoder = Decoder(
        net, min(batch_size, len(prompts)), max_len, cuda_graph=cuda_graph, compile=compile_blocks,
        prefill_ffn=options.get("prefill_ffn", "auto"), attention=options.get("attention", "sdpa"),
    )  # fmt: skip
    generator = torch.Generator(device=device).manual_seed(_number(options, "seed", int, 0))

    results = []
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start : start + batch_size]
        stream = StreamPrinter(tokenizer) if len(prompts) == 1 else None
        if stream is not None:
            print(texts[0], end="", flush=True)
        out = generate(
            net, chunk, max_new_tokens, eos_token_id=eos, generator=generator, on_token=stream,
            decoder=decoder, **sampling,
        )  # fmt: skip
        for i, tokens in enumerate(out.tokens):
            text = texts[start + i]
            completion = tokenizer.decode(tokens, skip_special_tokens=True)
            if stream is None:
                print(f"--- [{start + i}] {text}{completion}", flush=True)
            results.append({"prompt": text, "completion": completion, "tokens": tokens})
        if stream is not None:
            print(flush=True)
        after_first = out.new_tokens - len(chunk)  # the decode steps' tokens (the first ones: the prefill's)
        rate = after_first / out.decode_s if out.decode_s > 0 else float("nan")
        print(
            f"[{len(chunk)} prompt(s): {out.new_tokens} tokens, first after {out.time_to_first_token_s * 1e3:.0f} "
            f"ms, then {rate:.1f} tokens/s]",
            file=sys.stderr,
        )
    if options.get("out"):
        with open(options["out"], "w", encoding="utf-8") as f:
            for row in results:
                f.write(json.dumps(row) + "\n")
        print(f"wrote {options['out']}", file=sys.stderr)
    return results


if __name__ == "__main__":
    try:
        main()
    except (ValueError, FileNotFoundError) as err:  # bad input: its message names the fix
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)

"""Generation with a static KV cache: prefill a batch of prompts, then one new token per sequence a step.

Every layer's FFN runs as in the model's forward with with_stats=False under no_grad: the TwELL
inference kernels where the layer is sparse (ffn_impl="twell", or "auto" where the layer was routed
sparse), which pick their schedule by token count (`twell_ffn_inference`: fused at 1-2 tokens a step,
row up to 64, csr for a prefill's thousands), dense matmuls elsewhere. Prompts of different lengths
share one right-padded prefill: each row's positions start at 0 and its pad is never attended
(model/kv_cache.py), so a prompt continues exactly as it would alone.

`Decoder(..., compile=True)` runs the blocks and the final norm through torch.compile (one block
compiled once and reused by every layer of the same kind: a few seconds, not the whole stack's minute):
inductor fuses each block's norms, RoPE, cache writes and residual adds, which eager runs as some fifty
small kernels a layer, the cost that bounds a decode step at small batches. The TwELL inference op stays
one opaque call in the compiled block. One-token steps compile for static shapes (one graph per batch
size), prefills for any prompt length (dynamic after the second length seen).

On CUDA, `Decoder(..., cuda_graph=True)` replays each decode step from a CUDA graph (one per batch
size, captured on first use after warm-up calls that autotune the kernels): the step's launches cost
one graph launch. Sampling runs after the graph, from a `torch.Generator` (exponential race, no host
sync). The host waits on the device only to hand tokens to an `on_token` callback, and, with an EOS
id, to test whether every row has stopped, which it reads one step late: the next step is already
queued by then, so the device does not idle (at most one step is computed in vain).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from twell.model.kv_cache import KVCache
from twell.model.transformer import Transformer

# How a prefill runs the FFNs of sparse layers (Decoder's prefill_ffn): "model" as routed (the TwELL
# csr schedule), "dense" the dense matmuls (the same function), "auto" dense below DENSE_PREFILL_TOKENS
# tokens. Measured on an H200 (1.5b, compiled blocks, docs/RESULTS.md): the TwELL prefill took the time to
# first token from 14.5 to 32.4 ms at 512 tokens and from 22.2 to 30.3 ms at 8 x 512; its csr kernel is
# 1.75x faster than dense at 16,384 tokens (in a CUDA graph), the size from which it is used.
PREFILL_FFN = ("auto", "dense", "model")
# How a one-token step attends (Decoder's attention): "sdpa", PyTorch's scaled_dot_product_attention over the
# whole cache under a mask; "flash_decode", kernels/inference/decode_attention.py (the keys split over the
# GPU's SMs, each row read only up to its own position). sdpa is the default: on an H200 the 1.5b TwELL step
# took 1.401 / 1.706 / 3.887 ms with it at batch 1 / 8 / 64 and 1.442 / 2.246 / 9.091 ms with flash_decode
# (docs/RESULTS.md, generation, session (d) of 2026-12-05).
DECODE_ATTENTION = ("sdpa", "flash_decode")
DENSE_PREFILL_TOKENS = 16384
CACHE_ROUND = 64  # a cache made by generate() holds a multiple of this many slots (capped at max_seq_len)
GRAPH_WARMUP_STEPS = 2  # eager steps on the capture stream before a capture: autotuning, workspaces


def _decode_block(block, x, cos, sin, with_stats, kv):
    """One block of a one-token step: what Decoder(compile=True) compiles for static shapes."""
    return block(x, cos, sin, with_stats, kv)


def _prefill_block(block, x, cos, sin, with_stats, kv, dense_ffn=False):
    """One block of a prefill (its own function: torch.compile keeps its graphs per code object, and a
    prefill's prompt length may be dynamic where a step's shapes are not)."""
    return block(x, cos, sin, with_stats, kv, dense_ffn=dense_ffn)


def _final_norm(norm, x):
    """The stack's final RMSNorm of a one-token step (compiled: one kernel where eager runs eight)."""
    return norm(x)


_COMPILED: dict[str, Callable] = {}


def compiled(name: str) -> Callable:
    """The torch.compile wrapper of one of the functions above, made once per process (the graphs live
    with the function's code object, so every Decoder shares them)."""
    if name not in _COMPILED:
        fn, dynamic = {
            "decode": (_decode_block, False),
            "prefill": (_prefill_block, None),
            "norm": (_final_norm, False),
        }[name]
        _COMPILED[name] = torch.compile(fn, dynamic=dynamic)
    return _COMPILED[name]


@dataclass
class GenerationOutput:
    tokens: list[list[int]]  # per prompt, the new tokens (up to and including an EOS id)
    time_to_first_token_s: float  # prefill + sampling the first token (the device synchronised)
    decode_s: float  # the steps after the first token, until the last token is on the host
    steps: int  # decode steps run after the prefill's token

    @property
    def new_tokens(self) -> int:
        return sum(len(row) for row in self.tokens)


def check_sampling(temperature: float, top_k: int, top_p: float) -> None:
    """ValueError naming the bad sampling setting and its valid range."""
    if not (isinstance(temperature, (int, float)) and 0 <= temperature < float("inf")):
        raise ValueError(f"temperature={temperature!r} must be a finite number >= 0 (0: greedy)")
    if not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 0:
        raise ValueError(f"top_k={top_k!r} must be an integer >= 0 (0: off)")
    if not (isinstance(top_p, (int, float)) and 0 < top_p <= 1):
        raise ValueError(f"top_p={top_p!r} must be in (0, 1] (1: off)")


def sample_next(
    logits: torch.Tensor,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """logits [B, V] -> int64 [B]: argmax at temperature 0; else a draw from softmax(logits / T)
    restricted to the top_k most likely tokens (0: all) and to the smallest set of most likely tokens
    whose probability reaches top_p (1: all). The draw is an exponential race, argmax p_i / E_i with
    E_i ~ Exp(1) from `generator`: distributed as p, reproducible from a seed, no host sync."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    if top_k and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1:
        ordered, order = logits.sort(dim=-1, descending=True)
        probs = ordered.softmax(dim=-1)
        # A token goes when the tokens ranked above it already hold top_p: the first one always stays.
        drop_ordered = probs.cumsum(dim=-1) - probs >= top_p
        drop = torch.zeros_like(drop_ordered).scatter_(-1, order, drop_ordered)
        logits = logits.masked_fill(drop, float("-inf"))
    probs = logits.softmax(dim=-1)
    race = torch.empty_like(probs).exponential_(1.0, generator=generator)
    return (probs / race).argmax(dim=-1)


class Decoder:
    """A model's KV cache and decode step for up to `batch_size` sequences of up to `max_len` tokens.

    prefill(prompts) writes the prompts and returns the logits of each one's last token; step(tokens)
    appends one token per sequence and returns the next logits. Reusable: every prefill starts anew.
    cuda_graph=True (CUDA only): the step is replayed from a CUDA graph per batch size. compile=True:
    blocks and final norm through torch.compile (see the module doc); combines with cuda_graph.
    fuse_qkv (default: as compile): every layer's q, k and v projections read as one weight, a copy the
    decoder keeps ((n_heads + 2 n_kv_heads) x head_dim x d_model per layer; 0.66 GiB at 1.5b in bf16),
    refreshed in place at each prefill if the model's weights were changed since.
    prefill_ffn: how a prefill runs sparse layers' FFNs (PREFILL_FFN; default "auto": dense matmuls for
    prompts of fewer than DENSE_PREFILL_TOKENS tokens in all, where they are faster, TwELL above); the
    one-token steps always take each layer's routing.
    attention: how a one-token step attends (DECODE_ATTENTION; "flash_decode" needs CUDA or Triton's
    interpreter); prefills attend causally through PyTorch's attention either way.
    """

    def __init__(
        self,
        model: Transformer,
        batch_size: int,
        max_len: int,
        *,
        cuda_graph: bool = False,
        compile: bool = False,
        fuse_qkv: bool | None = None,
        prefill_ffn: str = "auto",
        attention: str = "sdpa",
    ):
        if prefill_ffn not in PREFILL_FFN:
            raise ValueError(f"prefill_ffn={prefill_ffn!r} is not one of {PREFILL_FFN}")
        if attention not in DECODE_ATTENTION:
            raise ValueError(f"attention={attention!r} is not one of {DECODE_ATTENTION}")
        self.prefill_ffn, self.attention = prefill_ffn, attention
        weight = model.tok_embeddings.weight
        if attention == "flash_decode":
            from twell.kernels._common import check_kernel_device
            from twell.kernels.inference import decode_attention  # noqa: F401 - registers twell::decode_attention

            try:
                check_kernel_device(weight)
            except ValueError as err:
                raise ValueError(f"attention='flash_decode': {err}; or use attention='sdpa'") from None
        self.model = model
        self.cache = KVCache(model.cfg, batch_size, max_len, device=weight.device, dtype=weight.dtype)
        if cuda_graph and weight.device.type != "cuda":
            raise ValueError(
                f"cuda_graph=True needs the model on a CUDA device (it is on {weight.device}); "
                "leave cuda_graph off"
            )
        self.cuda_graph, self.compile = cuda_graph, compile
        self._qkv = self._qkv_versions = None
        if compile if fuse_qkv is None else fuse_qkv:
            self._qkv = [torch.cat(self._qkv_parts(block)) for block in model.layers]
            self._qkv_versions = self._versions()
        device = weight.device
        self._tokens = torch.zeros(batch_size, dtype=torch.int64, device=device)  # the step's input
        self._positions = torch.zeros(batch_size, dtype=torch.int64, device=device)  # next slot per row
        self._slots = torch.arange(max_len, device=device)
        self._batch = 0  # rows of the current prefill (0: none yet)
        self._next_slot = 0  # host copy of the largest row's next slot: bounds the steps, no sync
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool = self._stream = None

    @staticmethod
    def _qkv_parts(block) -> tuple[torch.Tensor, ...]:
        attn = block.attn
        return attn.wq.weight, attn.wk.weight, attn.wv.weight

    def _versions(self) -> list[int]:
        return [w._version for block in self.model.layers for w in self._qkv_parts(block)]

    def _refresh_qkv(self) -> None:
        """The fused projections again from the model's weights if any changed in place since (an
        optimizer step, a load_state_dict): copied into the same tensors, so captured graphs stay valid."""
        if self._qkv is None or self._versions() == self._qkv_versions:
            return
        for fused, block in zip(self._qkv, self.model.layers):
            torch.cat(self._qkv_parts(block), out=fused)
        self._qkv_versions = self._versions()

    @property
    def fused_qkv(self) -> bool:
        """Whether the layers' q, k and v projections are read as one fused weight (fuse_qkv)."""
        return self._qkv is not None

    @property
    def batch_size(self) -> int:
        return self.cache.batch_size

    @property
    def max_len(self) -> int:
        return self.cache.max_len

    @torch.no_grad()
    def prefill(self, prompts: Sequence[Sequence[int]]) -> torch.Tensor:
        """Write the prompts (token ids, any lengths >= 1) into the cache's first rows; return the
        logits [B, vocab] that follow each prompt's last token."""
        batch = len(prompts)
        if batch > self.batch_size:
            raise ValueError(
                f"{batch} prompts exceed the decoder's batch_size={self.batch_size}; build a Decoder "
                f"with batch_size >= {batch}, or pass fewer prompts"
            )
        lengths = [len(p) for p in prompts]
        if batch == 0 or min(lengths) == 0:
            raise ValueError("every prompt needs at least one token (and at least one prompt is needed)")
        longest = max(lengths)
        if longest > self.max_len:
            raise ValueError(
                f"a prompt of {longest} tokens is longer than the KV cache (max_len={self.max_len}); "
                f"shorten it or build a Decoder with max_len >= {longest} + the new tokens"
            )
        vocab = self.model.cfg.vocab_size
        padded = torch.zeros((batch, longest), dtype=torch.int64)
        for row, prompt in enumerate(prompts):
            ids = torch.as_tensor(prompt, dtype=torch.int64)
            if ids.dim() != 1 or ids.min() < 0 or ids.max() >= vocab:
                raise ValueError(
                    f"prompt {row} must be a flat list of token ids in [0, vocab_size={vocab}) "
                    f"(got shape {tuple(ids.shape)}, ids {int(ids.min())}..{int(ids.max())})"
                )
            padded[row, : len(ids)] = ids
        device = self._tokens.device
        lengths_dev = torch.tensor(lengths, dtype=torch.int64).to(device, non_blocking=True)
        self._refresh_qkv()
        dense_ffn = self.prefill_ffn == "dense" or (
            self.prefill_ffn == "auto" and batch * longest < DENSE_PREFILL_TOKENS
        )
        run_block = compiled("prefill") if self.compile else _prefill_block
        hidden = self.model.hidden_states(
            padded.to(device),
            kv=self.cache.prefill_views(batch, self._qkv),
            run_block=functools.partial(run_block, dense_ffn=dense_ffn),
        )
        last = hidden[torch.arange(batch, device=device), lengths_dev - 1]
        self._positions[:batch].copy_(lengths_dev)
        self._batch, self._next_slot = batch, longest
        return F.linear(last, self.model.output_weight())

    @torch.no_grad()
    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Append tokens int64 [B] (one per prefilled sequence) at each sequence's next position;
        return the logits [B, vocab] after them. With cuda_graph the result is the graph's output
        buffer: read it before the next step."""
        batch = self._batch
        if batch == 0:
            raise RuntimeError("step() before prefill(): prefill the prompts first")
        if tokens.shape != (batch,):
            raise ValueError(
                f"tokens must be [{batch}] (one per prefilled sequence), got {tuple(tokens.shape)}"
            )
        if self._next_slot >= self.max_len:
            raise ValueError(
                f"the KV cache is full: max_len={self.max_len} slots, all used by the longest sequence; "
                f"build a Decoder with a larger max_len (at most max_seq_len={self.model.cfg.max_seq_len})"
            )
        self._tokens[:batch].copy_(tokens)
        self._next_slot += 1
        if not self.cuda_graph:
            return self._step_body(batch)
        graph, logits = self._graphs.get(batch) or self._capture(batch)
        graph.replay()
        return logits

    def _step_body(self, batch: int) -> torch.Tensor:
        """One token per row from the static buffers: what a CUDA graph captures."""
        positions = self._positions[:batch]
        mask = None  # flash_decode reads each row up to its position: no mask to build
        if self.attention == "sdpa":
            mask = (self._slots <= positions[:, None]).view(batch, 1, 1, self.max_len)
        hidden = self.model.hidden_states(
            self._tokens[:batch, None],
            kv=self.cache.decode_views(positions, mask, self._qkv, self.attention),
            positions=positions[:, None],
            run_block=compiled("decode") if self.compile else None,
            run_norm=compiled("norm") if self.compile else None,
        )
        positions.add_(1)
        return F.linear(hidden[:, 0], self.model.output_weight())

    def _capture(self, batch: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """Warm up (Triton autotuning, the fused kernel's per-stream workspace) and capture the step of
        `batch` rows on a side stream. Every warm-up step starts from the same positions, so each one
        writes this step's keys and values into the slots the step itself writes (never past the cache)."""
        if self._stream is None:
            self._stream, self._pool = torch.cuda.Stream(self._tokens.device), torch.cuda.graph_pool_handle()
        saved = self._positions[:batch].clone()
        self._stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._stream):
            for _ in range(GRAPH_WARMUP_STEPS):
                self._step_body(batch)
                self._positions[:batch].copy_(saved)
        torch.cuda.current_stream().wait_stream(self._stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool, stream=self._stream):
            logits = self._step_body(batch)
        self._graphs[batch] = (graph, logits)
        return graph, logits


def cache_len_for(
    limit: int, longest_prompt: int, max_new_tokens: int, what: str = "the model's max_seq_len"
) -> int:
    """KV cache slots for prompts of up to `longest_prompt` tokens and max_new_tokens new ones (the
    last new token is never fed back), rounded up to CACHE_ROUND and capped at `limit` (max_seq_len,
    or a decoder's max_len, as `what` names it); a ValueError when they do not fit."""
    needed = longest_prompt + max_new_tokens - 1
    if needed > limit:
        raise ValueError(
            f"the longest prompt ({longest_prompt} tokens) + max_new_tokens={max_new_tokens} - 1 = "
            f"{needed} positions exceed {what}={limit}; shorten the prompt or ask for fewer tokens"
        )
    return min(-(-needed // CACHE_ROUND) * CACHE_ROUND, limit)


def _as_prompt_list(prompts) -> list[list[int]]:
    if isinstance(prompts, torch.Tensor):
        if prompts.dim() != 2:
            raise ValueError(
                f"a tensor of prompts must be [batch, seq_len] token ids, got shape {tuple(prompts.shape)}"
            )
        return prompts.tolist()
    if not isinstance(prompts, Sequence) or not prompts:
        raise ValueError("prompts must be a non-empty list of token id lists (or a [batch, seq_len] tensor)")
    return [p.tolist() if isinstance(p, torch.Tensor) else list(p) for p in prompts]


class _StopCheck:
    """Whether every row has stopped, read on the host one step late on CUDA (no stall), at once on CPU."""

    def __init__(self, device: torch.device):
        self.lagged = device.type == "cuda"
        if self.lagged:
            self.flag = torch.zeros((), dtype=torch.bool).pin_memory()
            self.event = torch.cuda.Event()
            self.pending = False

    def post(self, finished: torch.Tensor) -> bool:
        """Queue finished.all(); return whether the previously queued value (on CPU: this one) was True."""
        if not self.lagged:
            return bool(finished.all())
        was_done = False
        if self.pending:
            self.event.synchronize()
            was_done = bool(self.flag)
        self.flag.copy_(finished.all(), non_blocking=True)
        self.event.record()
        self.pending = True
        return was_done


@torch.no_grad()
def generate(
    model: Transformer,
    prompts,
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    eos_token_id: int | Sequence[int] | None = None,
    generator: torch.Generator | None = None,
    on_token: Callable[[list[int | None]], None] | None = None,
    decoder: Decoder | None = None,
    cuda_graph: bool = False,
    compile: bool = False,
) -> GenerationOutput:
    """Continue each prompt by up to max_new_tokens tokens (fewer where it emits an EOS id).

    prompts: token id lists of any lengths >= 1, or an int [batch, seq_len] tensor. Greedy at
    temperature 0, else sampled (`sample_next`: top_k, top_p) from `generator` (on the model's device;
    a seeded one reproduces the draw). on_token(tokens): after every step, each row's new token, None
    for a row that had already stopped (a host sync per step); a true return ends the generation there.
    decoder: a Decoder to reuse (its cache and CUDA graphs); default, a new one sized for this call, with
    CUDA graphs if cuda_graph and torch.compile'd blocks if compile.
    """
    check_sampling(temperature, top_k, top_p)
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens!r} must be a positive integer")
    prompts = _as_prompt_list(prompts)
    device = model.tok_embeddings.weight.device
    if generator is not None and generator.device.type != device.type:
        raise ValueError(
            f"generator is on {generator.device} but the model is on {device}; make it with "
            f"torch.Generator(device={str(device)!r})"
        )
    longest = max(len(p) for p in prompts)
    if decoder is None:
        max_len = cache_len_for(model.cfg.max_seq_len, longest, max_new_tokens)
        decoder = Decoder(model, len(prompts), max_len, cuda_graph=cuda_graph, compile=compile)
    else:
        cache_len_for(decoder.max_len, longest, max_new_tokens, what="the decoder's KV cache max_len")
    eos = None
    if eos_token_id is not None:
        ids = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
        eos = torch.tensor(ids, dtype=torch.int64, device=device)

    start = time.perf_counter()
    logits = decoder.prefill(prompts)
    batch = len(prompts)
    out = torch.full((batch, max_new_tokens), -1, dtype=torch.int64, device=device)  # -1: stopped
    finished = torch.zeros(batch, dtype=torch.bool, device=device)
    stop = _StopCheck(device)

    def take(step: int, token: torch.Tensor) -> bool:
        """Record the step's tokens; whether every row had stopped (one step late on CUDA)."""
        out[:, step] = token.masked_fill(finished, -1)
        if on_token is not None and on_token([None if t < 0 else t for t in out[:, step].tolist()]):
            return True  # the caller has what it needs (a stop string in every row)
        if eos is None:
            return False
        finished.logical_or_(torch.isin(token, eos))
        return stop.post(finished)

    token = sample_next(logits, temperature, top_k, top_p, generator)
    all_stopped = take(0, token)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    first = time.perf_counter()
    steps = 0
    while steps < max_new_tokens - 1 and not all_stopped:
        logits = decoder.step(token)
        token = sample_next(logits, temperature, top_k, top_p, generator)
        steps += 1
        all_stopped = take(steps, token)
    rows = out[:, : steps + 1].tolist()
    end = time.perf_counter()
    tokens = [[t for t in row if t >= 0] for row in rows]
    return GenerationOutput(tokens, first - start, end - first, steps)

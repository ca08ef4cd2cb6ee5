"""Packed, resumable micro-batches laid out in lanes (docs/CONTRACTS.md, "data/").

N = world_size * grad_accum lanes. Document number i belongs to lane i mod N; a lane joins its
documents with EOS and is cut into rows of seq_len + 1 tokens, micro_batch rows per micro-batch.
Rank r serves lanes r*A .. r*A + A - 1 in turn, so micro-step k of an optimizer step is lane r*A + k
and the global batch of a step is the same for every (world_size, grad_accum) with the same
product. Every rank reads the whole document sequence but tokenizes only its own lanes' documents.

With data.sharding=files (data/sharded.py) each lane instead reads its own parquet row groups or
token shards (LaneStream): a rank reads only its lanes' share of the bytes, and the global batch still depends
only on the lane count.

Resuming on another number of processes: load_state_dict({SAVED_RANKS: [the state of every rank that
saved, in rank order]}) deals the saved lanes out anew, for any (world_size, grad_accum) with the same
lane count, from a state saved at the end of an optimizer step. Each lane keeps its unserved tokens
(the micro-batches made ahead put back in front); under data.sharding=files each lane also has its own
reader, and under documents the ranks' readers stood at different documents, so the new rank's reader
starts at the furthest of its lanes' and the lanes behind it first read their documents up to there.
"""

from __future__ import annotations

import copy
import logging
import math
from typing import Any

import numpy as np
import torch

from twell.data.config import DataConfig
from twell.data.packing import LaneBuffer, rows_to_batch
from twell.data.prefetch import STATE_KEY as PREFETCHED
from twell.data.prefetch import Prefetcher
from twell.data.reader import DocumentReader
from twell.data.sharded import assign_units, fingerprint, lane_source, resolve_units_once, split_units
from twell.data.sources import open_source
from twell.data.token_shards import check_tokenizer, read_manifest

log = logging.getLogger(__name__)

STATE_VERSION = 1
SAVED_RANKS = "saved_ranks"  # load_state_dict's key for every rank's state of a run of another size


class PackedStream:
    """Iterator of {"input_ids", "labels"} int64 [micro_batch, seq_len] for one data-parallel rank."""

    def __init__(
        self,
        reader: DocumentReader,
        encode,
        *,
        eos_id: int,
        add_eos: bool,
        seq_len: int,
        micro_batch: int,
        rank: int,
        world_size: int,
        grad_accum: int,
        tokenize_batch: int,
    ) -> None:
        self.reader = reader
        self.encode = encode  # list of documents -> list of token sequences
        self.seq_len = seq_len
        self.micro_batch = micro_batch
        self.num_lanes = world_size * grad_accum
        self.first_lane = rank * grad_accum
        self.tokenize_batch = tokenize_batch
        # what a saved state is only valid for (checked by load_state_dict)
        self.layout = {
            "num_lanes": self.num_lanes,
            "rank": rank,
            "grad_accum": grad_accum,
            "seed": reader.seed,
            "shuffle": reader.shuffle,
            "block_size": reader.block_size,
            "eos_id": eos_id,
            "add_eos": add_eos,
            "held_out_head": reader.skip_docs,
        }
        self._buffers = [LaneBuffer(eos_id, add_eos) for _ in range(grad_accum)]
        self._next_lane = 0  # index into this rank's lanes: the micro-step within the optimizer step
        self._docs_seen = 0
        self._tokens_seen = 0
        self._exhausted = False

    @property
    def epoch(self) -> int:
        return self.reader.epoch

    def __iter__(self) -> PackedStream:
        return self

    def __next__(self) -> dict:
        buffer = self._buffers[self._next_lane]
        need = self.micro_batch * (self.seq_len + 1)
        while len(buffer) < need:
            if self._exhausted:  # max_epochs reached: a partial micro-batch is never served
                raise StopIteration
            self._read_documents(need - len(buffer))
        self._next_lane = (self._next_lane + 1) % len(self._buffers)
        return rows_to_batch(buffer.take(need), self.micro_batch, self.seq_len)

    def _read_documents(self, deficit: int) -> None:
        """Read, tokenize and route a batch of this rank's documents, sized to cover about `deficit` tokens."""
        count = _docs_to_read(
            self.tokenize_batch, self._docs_seen, self._tokens_seen, deficit, len(self._buffers)
        )
        numbers, docs = [], []
        try:
            for _ in range(count):
                number, doc = self.reader.next_document()
                numbers.append(number)
                docs.append(doc)
        except StopIteration:
            self._exhausted = True
        for number, tokens in zip(numbers, self.encode(docs)):
            self._buffers[number % self.num_lanes - self.first_lane].add_document(tokens)
            self._docs_seen += 1
            self._tokens_seen += len(tokens)

    def state_dict(self) -> dict[str, Any]:
        """Plain values and int32 tensors (torch.save / weights_only friendly); per rank."""
        return {
            "version": STATE_VERSION,
            "layout": dict(self.layout),
            "reader": self.reader.state_dict(),
            "buffers": [buffer.state_dict() for buffer in self._buffers],
            "next_lane": self._next_lane,
            "seen": [self._docs_seen, self._tokens_seen],  # they size each read: _docs_to_read
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """This rank's own state, or {SAVED_RANKS: [...]} of a run with another number of processes."""
        self._exhausted = False
        if SAVED_RANKS in state:
            self._deal_lanes(state[SAVED_RANKS])
            return
        _check_state(state, self.layout)
        self.reader.load_state_dict(state["reader"])
        for buffer, tokens in zip(self._buffers, state["buffers"], strict=True):
            buffer.load_state_dict(tokens)
        self._next_lane = state["next_lane"]
        self._docs_seen, self._tokens_seen = state.get("seen", (0, 0))  # absent from older states

    def _deal_lanes(self, states: list[dict[str, Any]]) -> None:
        mine = _saved_lanes(states, self.layout)[self.first_lane : self.first_lane + len(self._buffers)]
        positions = [DocumentReader.saved_position(lane["rank_state"]["reader"]) for lane in mine]
        furthest = max(positions)
        keep = self.reader.keep
        try:
            for lane, buffer, position in zip(mine, self._buffers, positions):
                buffer.load_state_dict(lane["tokens"])
                if position == furthest:
                    continue
                self.reader.load_state_dict(lane["rank_state"]["reader"])
                self.reader.keep = lambda number, lane=lane["lane"]: number % self.num_lanes == lane
                for tokens in self.encode([doc for _, doc in self.reader.documents_before(furthest)]):
                    buffer.add_document(tokens)
        finally:
            self.reader.keep = keep
        self.reader.load_state_dict(mine[positions.index(furthest)]["rank_state"]["reader"])
        self._next_lane = 0


class LaneStream:
    """data.sharding=files: the same micro-batches interface as PackedStream, one reader per lane."""

    def __init__(
        self,
        cfg: DataConfig,
        units: list[dict[str, Any]],
        encode,
        *,
        eos_id: int,
        seq_len: int,
        micro_batch: int,
        rank: int,
        world_size: int,
        grad_accum: int,
        seed: int,
    ) -> None:
        num_lanes = world_size * grad_accum
        units = split_units(units, num_lanes)
        lanes = assign_units(units, num_lanes)
        self.encode = encode
        self.seq_len = seq_len
        self.micro_batch = micro_batch
        self.tokenize_batch = cfg.tokenize_batch
        self.sources = [
            lane_source(cfg, [units[i] for i in lanes[lane]], lane, seed)
            for lane in range(rank * grad_accum, rank * grad_accum + grad_accum)
        ]
        self.readers = [
            DocumentReader(
                source,
                keep=lambda number: True,
                block_size=cfg.shuffle_buffer,
                shuffle=cfg.shuffle,
                seed=seed * 1_000_003 + source.lane,  # lanes draw different block permutations
                max_epochs=cfg.max_epochs,
            )
            for source in self.sources
        ]
        self.layout = {
            "sharding": "files",
            "num_lanes": num_lanes,
            "rank": rank,
            "grad_accum": grad_accum,
            "seed": seed,
            "shuffle": cfg.shuffle,
            "block_size": cfg.shuffle_buffer,
            "eos_id": eos_id,
            "add_eos": cfg.add_eos,
            "held_out_head": cfg.val_docs,
            "units": fingerprint(units),
        }
        self._buffers = [LaneBuffer(eos_id, cfg.add_eos) for _ in range(grad_accum)]
        self._next_lane = 0
        self._docs_seen = 0
        self._tokens_seen = 0

    @property
    def epoch(self) -> int:
        """The epoch of this rank's slowest lane (lanes cross their epoch ends at different steps)."""
        return min(reader.epoch for reader in self.readers)

    @property
    def bytes_read(self) -> int:
        return sum(source.bytes_read for source in self.sources)

    @property
    def rows_read(self) -> int:
        return sum(source.rows_read for source in self.sources)

    def __iter__(self) -> LaneStream:
        return self

    def __next__(self) -> dict:
        lane = self._next_lane
        buffer = self._buffers[lane]
        need = self.micro_batch * (self.seq_len + 1)
        while len(buffer) < need:
            if not self._read_documents(lane, need - len(buffer)):
                raise StopIteration  # max_epochs reached: a partial micro-batch is never served
        self._next_lane = (lane + 1) % len(self._buffers)
        return rows_to_batch(buffer.take(need), self.micro_batch, self.seq_len)

    def _read_documents(self, lane: int, deficit: int) -> bool:
        count = _docs_to_read(self.tokenize_batch, self._docs_seen, self._tokens_seen, deficit, 1)
        docs = []
        try:
            for _ in range(count):
                docs.append(self.readers[lane].next_document()[1])
        except StopIteration:
            if not docs:
                return False
        for tokens in self.encode(docs):
            self._buffers[lane].add_document(tokens)
            self._docs_seen += 1
            self._tokens_seen += len(tokens)
        return True

    def state_dict(self) -> dict[str, Any]:
        return {
            "version": STATE_VERSION,
            "layout": dict(self.layout),
            "readers": [reader.state_dict() for reader in self.readers],
            "buffers": [buffer.state_dict() for buffer in self._buffers],
            "next_lane": self._next_lane,
            "seen": [self._docs_seen, self._tokens_seen],  # they size each read: _docs_to_read
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """This rank's own state, or {SAVED_RANKS: [...]} of a run with another number of processes."""
        if SAVED_RANKS in state:
            first = self.layout["rank"] * len(self._buffers)
            lanes = _saved_lanes(state[SAVED_RANKS], self.layout)[first : first + len(self._buffers)]
            for reader, buffer, lane in zip(self.readers, self._buffers, lanes):
                reader.load_state_dict(lane["rank_state"]["readers"][lane["index"]])
                buffer.load_state_dict(lane["tokens"])
            self._next_lane = 0
            return
        _check_state(state, self.layout)
        for reader, saved in zip(self.readers, state["readers"], strict=True):
            reader.load_state_dict(saved)
        for buffer, tokens in zip(self._buffers, state["buffers"], strict=True):
            buffer.load_state_dict(tokens)
        self._next_lane = state["next_lane"]
        self._docs_seen, self._tokens_seen = state.get("seen", (0, 0))  # absent from older states


def _docs_to_read(tokenize_batch: int, docs_seen: int, tokens_seen: int, deficit: int, lanes: int) -> int:
    """Documents to read and tokenize at once: enough to cover `deficit` tokens in each of `lanes` lanes at
    the mean document length seen so far, at most tokenize_batch (all of it before any is seen), at least 1.
    The two counts are part of a stream's saved state ("seen"): restored, the readers advance after a resume
    exactly as in the unbroken run and cross their epoch ends at the same batches."""
    if not docs_seen:
        return max(1, tokenize_batch)
    per_doc = max(1.0, tokens_seen / docs_seen)
    return max(1, min(tokenize_batch, lanes * math.ceil(deficit / per_doc)))


def _check_state(state: dict[str, Any], layout: dict[str, Any], any_split: bool = False) -> None:
    """Refuse a state saved under another layout; any_split: the rank and grad_accum may differ (the
    lanes are dealt anew), everything else, the lane count included, may not."""
    if state.get("version") != STATE_VERSION:
        raise ValueError(f"data state version {state.get('version')!r}, expected {STATE_VERSION}")
    saved = state["layout"]
    ignored = {"rank", "grad_accum"} if any_split else set()
    changed = {
        k: (saved.get(k), layout.get(k))
        for k in (set(saved) | set(layout)) - ignored
        if saved.get(k) != layout.get(k)
    }
    if changed:
        detail = ", ".join(f"{k}: saved {old!r} now {new!r}" for k, (old, new) in sorted(changed.items()))
        lanes = ""
        if "num_lanes" in changed:
            lanes = (
                f" The global batch is num_lanes = world_size * grad_accum micro-batches (train.global_batch_tokens"
                f" / (train.micro_batch * train.seq_len)); a run resumes on any number of processes with "
                f"the same {saved.get('num_lanes')} lanes, so keep global_batch_tokens, micro_batch and seq_len."
            )
        raise ValueError(
            f"data state was saved with a different layout ({detail}); resume with the same "
            "world_size * grad_accum, seed, data files and data settings, or start the data from scratch."
            + lanes
        )


def _saved_lanes(states: list[dict[str, Any]], layout: dict[str, Any]) -> list[dict[str, Any]]:
    """The lanes of a run saved by len(states) processes (states in rank order), in lane order: per lane
    {"lane": its number, "tokens": its unserved tokens (int32: the buffer, with the micro-batches the
    prefetcher had made put back in front), "rank_state": the saving rank's state, "index": the lane's
    place among that rank's lanes}. Refuses states of another layout or saved within a step."""
    lanes = []
    for rank, state in enumerate(states):
        _check_state(state, layout, any_split=True)
        if state["layout"]["rank"] != rank:
            raise ValueError(
                f"data state {rank} of the saved run was saved by rank {state['layout']['rank']}"
            )
        saved_accum = state["layout"]["grad_accum"]
        made_ahead = state.get(PREFETCHED, [])
        micro_step = (state["next_lane"] - len(made_ahead)) % saved_accum
        if micro_step:
            raise ValueError(
                f"the data state of rank {rank} was saved at micro-step {micro_step} of {saved_accum}, not at "
                "the end of an optimizer step; only such a state resumes on another number of processes"
            )
        served_back = [[] for _ in range(saved_accum)]
        for i, batch in enumerate(made_ahead):  # made in lane order from the step's first lane
            rows = torch.cat([batch["input_ids"], batch["labels"][:, -1:]], dim=1).to(torch.int32)
            served_back[i % saved_accum].append(rows.flatten())
        for index, buffer in enumerate(state["buffers"]):
            tokens = torch.cat([*served_back[index], buffer.to(torch.int32)])
            lanes.append({"lane": len(lanes), "tokens": tokens, "rank_state": state, "index": index})
    if len(lanes) != layout["num_lanes"]:
        raise ValueError(
            f"the saved run's {len(states)} data states hold {len(lanes)} lanes, not {layout['num_lanes']}"
        )
    return lanes


class ValidationBatches:
    """The same num_batches validation micro-batches on every pass (re-iterable)."""

    def __init__(self, make_stream, num_batches: int) -> None:
        self._make_stream = make_stream
        self.num_batches = num_batches

    def __len__(self) -> int:
        return self.num_batches

    def __iter__(self):
        stream = self._make_stream()
        for _ in range(self.num_batches):
            yield next(stream)


def build_train_stream(
    cfg, tokenizer, seq_len: int, micro_batch: int, rank: int, world_size: int, grad_accum: int, seed: int
) -> Prefetcher:
    """Rank `rank`'s micro-batches: a PackedStream (data.sharding=documents) or a LaneStream (files),
    behind a Prefetcher (data.prefetch batches made ahead on a thread; 0: none)."""
    cfg = DataConfig.from_any(cfg)
    _check_layout(seq_len, micro_batch, rank, world_size, grad_accum)
    if cfg.sharding == "files":
        if cfg.source == "tokens":  # every rank checks: a wrong tokenizer fails before any collective
            check_tokenizer(*read_manifest(cfg.path), tokenizer)
        stream = LaneStream(
            cfg,
            resolve_units_once(cfg, world_size),
            _token_passthrough if cfg.source == "tokens" else text_encoder(tokenizer),
            eos_id=tokenizer.eos_token_id,
            seq_len=seq_len,
            micro_batch=micro_batch,
            rank=rank,
            world_size=world_size,
            grad_accum=grad_accum,
            seed=seed,
        )
        return Prefetcher(stream, cfg.prefetch)
    source = open_source(cfg, "train", seed=seed, tokenizer=tokenizer)
    head = cfg.val_docs if _held_out_head(cfg) else 0
    stream = _stream(
        cfg,
        tokenizer,
        source,
        seq_len,
        micro_batch,
        rank,
        world_size,
        grad_accum,
        seed,
        shuffle=cfg.shuffle,
        skip_docs=head,
        limit_docs=None,
        max_epochs=cfg.max_epochs,
    )
    return Prefetcher(stream, cfg.prefetch)


def build_val_stream(
    cfg,
    tokenizer,
    seq_len: int,
    micro_batch: int,
    rank: int,
    world_size: int,
    num_batches: int,
    seed: int = 0,
) -> ValidationBatches:
    """Held-out batches: data.val_path, data.val_split, or the first data.val_docs documents of the source.

    world_size lanes, no shuffling; every pass yields the same num_batches micro-batches per rank
    (wrapping around a small held-out set), so all ranks run the same number of steps.
    """
    cfg = DataConfig.from_any(cfg)
    _check_layout(seq_len, micro_batch, rank, world_size, 1)
    if num_batches < 1:
        raise ValueError(f"num_batches={num_batches} must be >= 1")
    source, limit = _open_val_source(cfg, tokenizer, seed)

    def make_stream() -> PackedStream:
        return _stream(
            cfg,
            tokenizer,
            source,
            seq_len,
            micro_batch,
            rank,
            world_size,
            1,
            seed,
            shuffle=False,
            skip_docs=0,
            limit_docs=limit,
            max_epochs=None,
            # wrapping around the held-out set (and reading ahead across its end) is expected: not INFO
            epoch_log_level=logging.DEBUG,
        )

    return ValidationBatches(make_stream, num_batches)


def held_out_texts(
    cfg, tokenizer, max_docs: int = 512, max_bytes: int = 4_000_000, seed: int = 0
) -> list[str]:
    """The first documents of the held-out data (the ones build_val_stream packs first), as text.

    Stops after max_docs documents or once max_bytes UTF-8 bytes are read, whichever comes first
    (always at least one document). Pre-tokenized corpora are decoded with `tokenizer`. Meant for
    measuring bytes per token (the bits-per-byte denominator) once at the start of a run.
    """
    cfg = DataConfig.from_any(cfg)
    if max_docs < 1:
        raise ValueError(f"max_docs={max_docs} must be >= 1")
    source, limit = _open_val_source(cfg, tokenizer, seed)
    if limit is not None:
        max_docs = min(max_docs, limit)
    source.open(0, None)
    texts, n_bytes = [], 0
    while len(texts) < max_docs and (not texts or n_bytes < max_bytes):
        doc = source.next_document()
        if doc is None:
            break
        text = tokenizer.decode(doc.tolist()) if source.tokenized else doc
        texts.append(text)
        n_bytes += len(text.encode("utf-8"))
    return texts


def _open_val_source(cfg: DataConfig, tokenizer, seed: int):
    """The held-out source and how many of its first documents are held out (None: all of them)."""
    if not (cfg.val_path or cfg.val_split or cfg.val_docs):
        raise ValueError(
            f"data config {cfg.name!r} has no held-out data: set data.val_path (files), data.val_split "
            "(a hub or corpus split) or data.val_docs (hold out the first N documents)"
        )
    if cfg.source == "local" and cfg.val_split and not cfg.val_path:
        raise ValueError("data.val_split needs a hub or token source; for local files set data.val_path")
    source = open_source(cfg, "val", seed=seed, tokenizer=tokenizer)
    return source, cfg.val_docs if _held_out_head(cfg) else None


def _held_out_head(cfg: DataConfig) -> bool:
    return cfg.val_docs > 0 and not cfg.val_path and not cfg.val_split


def _stream(
    cfg,
    tokenizer,
    source,
    seq_len,
    micro_batch,
    rank,
    world_size,
    grad_accum,
    seed,
    *,
    shuffle,
    skip_docs,
    limit_docs,
    max_epochs,
    epoch_log_level=logging.INFO,
) -> PackedStream:
    num_lanes = world_size * grad_accum
    first, last = rank * grad_accum, rank * grad_accum + grad_accum
    reader = DocumentReader(
        source,
        keep=lambda number: first <= number % num_lanes < last,
        block_size=cfg.shuffle_buffer,
        shuffle=shuffle,
        seed=seed,
        skip_docs=skip_docs,
        limit_docs=limit_docs,
        max_epochs=max_epochs,
        epoch_log_level=epoch_log_level,
    )
    encode = _token_passthrough if source.tokenized else text_encoder(tokenizer)
    return PackedStream(
        reader,
        encode,
        eos_id=tokenizer.eos_token_id,
        add_eos=cfg.add_eos,
        seq_len=seq_len,
        micro_batch=micro_batch,
        rank=rank,
        world_size=world_size,
        grad_accum=grad_accum,
        tokenize_batch=cfg.tokenize_batch,
    )


def text_encoder(tokenizer):
    """list of texts -> list of int64 token arrays, as the training stream tokenizes (no special tokens).

    Also what scripts/pretokenize.py writes, so text and token corpora hold the same tokens."""
    # A private copy of the Rust tokenizer: no special tokens added (we add EOS ourselves), and no
    # truncation/padding left over from someone else's __call__ on the shared transformers object.
    backend = copy.deepcopy(tokenizer.backend_tokenizer)
    backend.no_truncation()
    backend.no_padding()
    encode_batch = getattr(backend, "encode_batch_fast", backend.encode_batch)

    def encode(texts: list[str]) -> list[np.ndarray]:
        return [np.asarray(enc.ids, dtype=np.int64) for enc in encode_batch(texts, add_special_tokens=False)]

    return encode


def _token_passthrough(docs: list[np.ndarray]) -> list[np.ndarray]:
    return docs


def _check_layout(seq_len: int, micro_batch: int, rank: int, world_size: int, grad_accum: int) -> None:
    for name, value in (
        ("seq_len", seq_len),
        ("micro_batch", micro_batch),
        ("world_size", world_size),
        ("grad_accum", grad_accum),
    ):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive integer")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} must be in [0, world_size={world_size})")

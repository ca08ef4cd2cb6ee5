"""Documents in a deterministic, resumable order over epochs, numbered for lane assignment.

Documents are read in blocks of ``block_size``; a block is permuted by an RNG seeded with
(seed, epoch, block index) and its documents get consecutive global numbers. Resuming only needs
the source position at the block's start and how many of the block's numbers were passed:
the block is read again and the same permutation drawn, so the order is exact without saving any
shuffle buffer. Only documents the caller keeps (its lanes) are held in memory.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np

log = logging.getLogger(__name__)


class DocumentReader:
    def __init__(
        self,
        source,
        keep: Callable[[int], bool],
        *,
        block_size: int,
        shuffle: bool,
        seed: int,
        skip_docs: int = 0,
        limit_docs: int | None = None,
        max_epochs: int | None = None,
        epoch_log_level: int = logging.INFO,
    ) -> None:
        self.source = source
        self.keep = keep
        self.block_size = block_size
        self.shuffle = shuffle
        self.seed = seed
        self.skip_docs = skip_docs  # the held-out head of each epoch
        self.limit_docs = limit_docs  # validation: only the first limit_docs documents
        self.max_epochs = max_epochs
        self.epoch_log_level = epoch_log_level  # validation wraps a small held-out set on purpose
        self.epoch = 0
        self._block_index = 0
        self._block_start: dict[str, Any] | None = None  # None: the start of the epoch
        self._numbered_before_block = 0  # documents numbered in all earlier blocks (all epochs)
        self._passed_in_block = 0  # numbers of the current block already handed out or skipped
        self._pending: deque[tuple[int, Any]] | None = None  # kept documents of the current block, in order
        self._next_block_start: dict[str, Any] | None = None
        self._block_length = 0
        self._is_open = False

    def next_document(self) -> tuple[int, Any]:
        """(global document number, document) of the next kept document; StopIteration after max_epochs."""
        while True:
            if self._pending is None:
                self._load_block()
            if self._pending:
                return self._pop()
            self._next_block()

    def documents_before(self, stop: int) -> list[tuple[int, Any]]:
        """(number, document) of every kept document numbered below `stop` from here on: what brings a
        lane read up to an earlier position level with one read up to `stop` (data/stream.py, resuming on
        another number of processes)."""
        found = []
        while True:
            if self._pending is None:
                self._load_block()
            while self._pending and self._pending[0][0] < stop:
                found.append(self._pop())
            if self._pending or self._numbered_before_block + self._block_length >= stop:
                return found
            self._next_block()

    def _pop(self) -> tuple[int, Any]:
        number, doc = self._pending.popleft()
        self._passed_in_block = number - self._numbered_before_block + 1
        return number, doc

    def _next_block(self) -> None:
        """The current block is used up: the next one starts where this one's reading ended."""
        self._numbered_before_block += self._block_length
        self._block_index += 1
        self._block_start = self._next_block_start
        self._passed_in_block = 0
        self._pending = None

    def _load_block(self) -> None:
        docs = self._read_block()
        while not docs:
            self._finish_epoch()
            docs = self._read_block()
        order = np.arange(len(docs))
        if self.shuffle:
            order = np.random.default_rng([self.seed, self.epoch, self._block_index]).permutation(len(docs))
        first = self._numbered_before_block
        self._block_length = len(docs)
        self._pending = deque(
            (first + j, docs[i])
            for j, i in enumerate(order)
            if j >= self._passed_in_block and self.keep(first + j)
        )

    def _read_block(self) -> list[Any]:
        if not self._is_open:
            self.source.open(self.epoch, self._block_start)
            self._is_open = True
            if self._block_start is None:
                for _ in range(self.skip_docs):
                    if self.source.next_document() is None:
                        raise ValueError(
                            f"{self.source.description} has fewer documents than the held-out head "
                            f"(data.val_docs={self.skip_docs}); lower data.val_docs"
                        )
        want = self.block_size
        if self.limit_docs is not None:
            want = min(want, self.limit_docs - self._block_index * self.block_size)
        docs = []
        while len(docs) < want:
            doc = self.source.next_document()
            if doc is None:
                break
            docs.append(doc)
        self._next_block_start = self.source.position()
        return docs

    def _finish_epoch(self) -> None:
        if self._block_index == 0:
            raise ValueError(f"{self.source.description} yielded no documents in epoch {self.epoch}")
        log.log(
            self.epoch_log_level,
            "data: finished epoch %d of %s; starting epoch %d",
            self.epoch,
            self.source.description,
            self.epoch + 1,
        )
        self.epoch += 1
        if self.max_epochs is not None and self.epoch >= self.max_epochs:
            raise StopIteration
        self._block_index = 0
        self._block_start = None
        self._passed_in_block = 0
        self._is_open = False

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "block_index": self._block_index,
            "block_start": self._block_start,
            "numbered_before_block": self._numbered_before_block,
            "passed_in_block": self._passed_in_block,
        }

    @staticmethod
    def saved_position(state: dict[str, Any]) -> int:
        """The number of the next document a reader saved as `state` hands out or skips: it has handed
        out every kept document numbered below it."""
        return state["numbered_before_block"] + state["passed_in_block"]

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch = state["epoch"]
        self._block_index = state["block_index"]
        self._block_start = state["block_start"]
        self._numbered_before_block = state["numbered_before_block"]
        self._passed_in_block = state["passed_in_block"]
        self._pending = None
        self._is_open = False

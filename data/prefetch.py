"""A background thread that reads, tokenizes and packs micro-batches ahead of the training loop.

data.prefetch = depth: up to `depth` micro-batches wait in a bounded queue, made by one worker thread
(pyarrow's reads and the Rust tokenizer's batch encode release the GIL). depth 0: no thread, the
stream is read on the caller's thread, as before.

Resume stays exact: state_dict() pauses the worker between batches and saves the inner stream's
state together with the batches already made but not yet served (int32, like the lane buffers);
load_state_dict() serves those first. A state saved with any depth loads under any other depth, and
a plain stream state (saved before this wrapper existed) loads too.
"""

from __future__ import annotations

import contextlib
import threading
from collections import deque
from typing import Any

import torch

STATE_KEY = "prefetched"


class Prefetcher:
    def __init__(self, stream, depth: int) -> None:
        self.stream = stream
        self.depth = depth
        self._ready: deque[dict] = deque()
        self._cond = threading.Condition()
        self._busy = False  # the worker is inside next(stream)
        self._paused = 0
        self._done: BaseException | None = None  # StopIteration or the worker's error, raised in order
        self._thread: threading.Thread | None = None

    def __getattr__(self, name: str):  # epoch, bytes_read, readers, layout, ... of the inner stream
        if name == "stream":
            raise AttributeError(name)
        return getattr(self.stream, name)

    def __iter__(self) -> Prefetcher:
        return self

    def __next__(self) -> dict:
        if self.depth == 0:
            if self._ready:  # batches restored from a state saved with prefetching
                return self._ready.popleft()
            return next(self.stream)
        with self._cond:
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, name="twell-data", daemon=True)
                self._thread.start()
            while not self._ready and self._done is None:
                self._cond.wait()
            if self._ready:
                batch = self._ready.popleft()
                self._cond.notify_all()
                return batch
            raise self._done

    def _work(self) -> None:
        while True:
            with self._cond:
                while len(self._ready) >= self.depth or self._paused or self._done is not None:
                    self._cond.wait()
                self._busy = True
            try:
                batch = next(self.stream)
            except BaseException as err:  # StopIteration at max_epochs, or a read error: raised in order
                with self._cond:
                    self._busy = False
                    self._done = err
                    self._cond.notify_all()
                continue
            with self._cond:
                self._busy = False
                self._ready.append(batch)
                self._cond.notify_all()

    @contextlib.contextmanager
    def _pause(self):
        """Hold the worker between batches (it finishes the one it is making) while the state is read or set."""
        with self._cond:
            self._paused += 1
            while self._busy:
                self._cond.wait()
        try:
            yield
        finally:
            with self._cond:
                self._paused -= 1
                self._cond.notify_all()

    def state_dict(self) -> dict[str, Any]:
        with self._pause():
            state = self.stream.state_dict()
            state[STATE_KEY] = [{k: v.to(torch.int32) for k, v in batch.items()} for batch in self._ready]
            return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        state = dict(state)
        ready = state.pop(STATE_KEY, [])
        with self._pause():
            self.stream.load_state_dict(state)
            self._ready = deque({k: v.to(torch.int64) for k, v in batch.items()} for batch in ready)
            self._done = None

"""One lane's token buffer: documents go in (joined by EOS), fixed-size rows come out."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


class LaneBuffer:
    """Tokens of a lane's documents not yet served, in order; rows are cut off the front."""

    def __init__(self, eos_id: int, add_eos: bool = True) -> None:
        self.eos_id = eos_id
        self.add_eos = add_eos
        self._chunks: list[np.ndarray] = []
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def add_document(self, tokens: Sequence[int] | np.ndarray) -> None:
        doc = np.asarray(tokens, dtype=np.int64)
        if self.add_eos:
            doc = np.append(doc, self.eos_id)
        if doc.size:
            self._chunks.append(doc)
            self._size += doc.size

    def take(self, n: int) -> np.ndarray:
        """The next n tokens (caller checks len(self) >= n)."""
        if n > self._size:
            raise ValueError(f"lane buffer holds {self._size} tokens, asked for {n}")
        # Join only the chunks this row block needs: a lane can hold a long backlog of documents.
        parts, have = [], 0
        while have < n:
            chunk = self._chunks.pop(0)
            parts.append(chunk)
            have += chunk.size
        joined = np.concatenate(parts) if len(parts) > 1 else parts[0]
        if joined.size > n:
            self._chunks.insert(0, joined[n:])
        self._size -= n
        return joined[:n]

    def state_dict(self) -> torch.Tensor:
        joined = np.concatenate(self._chunks) if self._chunks else np.zeros(0, np.int64)
        self._chunks = [joined] if joined.size else []
        # int32 halves checkpoint size; every vocabulary we use is far below 2**31.
        return torch.from_numpy(joined.astype(np.int32))

    def load_state_dict(self, tokens: torch.Tensor) -> None:
        flat = tokens.detach().cpu().numpy().astype(np.int64).reshape(-1)
        self._chunks = [flat] if flat.size else []
        self._size = flat.size


def rows_to_batch(tokens: np.ndarray, micro_batch: int, seq_len: int) -> dict[str, torch.Tensor]:
    """micro_batch * (seq_len + 1) tokens -> inputs and next-token labels, each [micro_batch, seq_len]."""
    rows = torch.from_numpy(np.ascontiguousarray(tokens)).view(micro_batch, seq_len + 1)
    return {"input_ids": rows[:, :-1].contiguous(), "labels": rows[:, 1:].contiguous()}

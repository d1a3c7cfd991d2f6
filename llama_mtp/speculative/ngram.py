"""Prompt-lookup drafting: propose what followed the last n-gram the last time it occurred."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

__all__ = ["NgramDrafter"]


class NgramDrafter:
    """Find the most recent earlier occurrence of the sequence's last ``n`` tokens
    (``n`` from ``n_max_match`` down to ``n_min_match``) and propose the tokens that
    followed it. Cheap, model-free, and strong on text that repeats itself (code,
    extraction, edits)."""

    name = "ngram"

    def __init__(self, n_max_match: int = 3, n_min_match: int = 1) -> None:
        if not 1 <= n_min_match <= n_max_match:
            raise ValueError("need 1 <= n_min_match <= n_max_match")
        self.n_max_match = n_max_match
        self.n_min_match = n_min_match

    def propose(self, history: npt.NDArray[np.int32], n_max: int) -> list[int]:
        """Up to ``n_max`` draft tokens continuing ``history`` (empty when nothing matches)."""
        L = len(history)
        if n_max <= 0 or L < 2:
            return []
        for n in range(min(self.n_max_match, L - 1), self.n_min_match - 1, -1):
            tail = history[L - n:]
            # windows starting at i, for i + n < L (an earlier occurrence with a continuation)
            windows = np.lib.stride_tricks.sliding_window_view(history[: L - 1], n)
            hits = np.flatnonzero((windows == tail).all(axis=1))
            hits = hits[hits + n < L]
            if len(hits):
                start = int(hits[-1]) + n
                return [int(t) for t in history[start: start + n_max]]
        return []

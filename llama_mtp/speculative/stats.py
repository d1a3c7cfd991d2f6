"""Speculation statistics, per sequence and per engine.

Names follow llama-server where they overlap (``draft_n``, ``draft_n_accepted``)
and vLLM for the per-position counts (``accepted_per_position``, ``num_drafts``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["EngineStats", "SpecStats"]


@dataclass
class SpecStats:
    """What speculation did for one sequence (or, summed, for an engine)."""

    draft_n: int = 0                 # draft tokens proposed and verified
    draft_n_accepted: int = 0        # of those, accepted
    steps: int = 0                   # target decodes (verify steps) while generating
    num_drafts: int = 0              # verify steps that carried at least one draft token
    predicted_n: int = 0             # tokens generated
    accepted_per_position: list[int] = field(default_factory=list)  # [i]: drafts accepted at position i
    drafted_per_position: list[int] = field(default_factory=list)   # [i]: drafts proposed at position i
    by_drafter: dict[str, list[int]] = field(default_factory=dict)  # name -> [drafted, accepted]
    by_verify: dict[str, list[int]] = field(default_factory=dict)   # greedy/match/rejection -> [drafted, accepted]
    draft_length_hist: dict[int, int] = field(default_factory=dict)  # chosen draft length -> steps
    rollbacks: int = 0               # verify steps that rolled rejected drafts back
    checkpoint_restores: int = 0     # of those, through a checkpoint (+ replay) instead of n_rs_seq

    def record(self, drafter: str | None, n_drafted: int, n_accepted: int, verify: str | None = None) -> None:
        self.steps += 1
        self.draft_length_hist[n_drafted] = self.draft_length_hist.get(n_drafted, 0) + 1
        if n_drafted == 0:
            return
        self.num_drafts += 1
        self.draft_n += n_drafted
        self.draft_n_accepted += n_accepted
        while len(self.drafted_per_position) < n_drafted:
            self.drafted_per_position.append(0)
            self.accepted_per_position.append(0)
        for i in range(n_drafted):
            self.drafted_per_position[i] += 1
        for i in range(n_accepted):
            self.accepted_per_position[i] += 1
        for key, table in ((drafter, self.by_drafter), (verify, self.by_verify)):
            if key is not None:
                d = table.setdefault(key, [0, 0])
                d[0] += n_drafted
                d[1] += n_accepted

    @property
    def acceptance_rate(self) -> float:
        return self.draft_n_accepted / self.draft_n if self.draft_n else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens per target decode: 1 + accepted / steps (llama-server's "mean len")."""
        return 1.0 + self.draft_n_accepted / self.steps if self.steps else 0.0

    @property
    def acceptance_per_position(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_per_position, self.drafted_per_position, strict=False)]

    def merge(self, other: SpecStats) -> None:
        for name in ("draft_n", "draft_n_accepted", "steps", "num_drafts", "predicted_n", "rollbacks",
                     "checkpoint_restores"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for mine, theirs in ((self.accepted_per_position, other.accepted_per_position),
                             (self.drafted_per_position, other.drafted_per_position)):
            while len(mine) < len(theirs):
                mine.append(0)
            for i, v in enumerate(theirs):
                mine[i] += v
        for mine_t, theirs_t in ((self.by_drafter, other.by_drafter), (self.by_verify, other.by_verify)):
            for k, (d, a) in theirs_t.items():
                mine_d = mine_t.setdefault(k, [0, 0])
                mine_d[0] += d
                mine_d[1] += a
        for n, v in other.draft_length_hist.items():
            self.draft_length_hist[n] = self.draft_length_hist.get(n, 0) + v

    def as_dict(self) -> dict[str, Any]:
        return {
            "draft_n": self.draft_n,
            "draft_n_accepted": self.draft_n_accepted,
            "acceptance_rate": round(self.acceptance_rate, 6),
            "mean_accepted_length": round(self.mean_accepted_length, 6),
            "accepted_per_position": list(self.accepted_per_position),
            "acceptance_per_position": [round(x, 6) for x in self.acceptance_per_position],
            "steps": self.steps,
            "num_drafts": self.num_drafts,
            "predicted_n": self.predicted_n,
            "by_drafter": {k: {"drafted": d, "accepted": a} for k, (d, a) in self.by_drafter.items()},
            "by_verify": {k: {"drafted": d, "accepted": a, "acceptance_rate": round(a / d, 6) if d else 0.0}
                          for k, (d, a) in self.by_verify.items()},
            "draft_length_hist": {str(k): v for k, v in sorted(self.draft_length_hist.items())},
            "rollbacks": self.rollbacks,
            "checkpoint_restores": self.checkpoint_restores,
        }


@dataclass
class EngineStats:
    """Where an engine's time went (seconds), and the speculation totals."""

    prefill_s: float = 0.0           # target + MTP prompt processing
    draft_s: float = 0.0             # MTP-context decodes while drafting (incl. merged catch-up rows)
    verify_s: float = 0.0            # target decodes of the verify batches
    catch_up_s: float = 0.0          # MTP-context decodes that carried catch-up rows only
    restore_s: float = 0.0           # checkpoint saves and restores
    switch_s: float = 0.0            # switches of the target's rollback mode (new context, state copies)
    step_s: float = 0.0              # wall time inside step()
    steps: int = 0
    rollback_switches: int = 0       # rollback="auto": snapshots <-> checkpoints while running
    slot_moves: int = 0              # sequences moved to a lower free slot (SpeculativeEngine._compact)
    move_s: float = 0.0              # ... their state copies (in restore_s too)
    spec: SpecStats = field(default_factory=SpecStats)
    estimated_tok_s: float = 0.0     # what the adaptive draft-length policy expected of the last step
                                     # (0 where no sequence chose its length)
    measured_tok_s: float = 0.0      # what steps actually delivered (exponentially weighted)

    @property
    def decode_s(self) -> float:
        """Time in step() spent inside llama.cpp: decodes, checkpoint saves and restores,
        rollback-mode switches."""
        return self.draft_s + self.verify_s + self.catch_up_s + self.restore_s + self.switch_s

    @property
    def python_s(self) -> float:
        """Time in step() not spent inside llama.cpp (sampling, bookkeeping, batch building)."""
        return max(0.0, self.step_s - self.decode_s)

    @property
    def python_share(self) -> float:
        return self.python_s / self.step_s if self.step_s else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "prefill_s": self.prefill_s,
            "draft_s": self.draft_s,
            "verify_s": self.verify_s,
            "catch_up_s": self.catch_up_s,
            "restore_s": self.restore_s,
            "switch_s": self.switch_s,
            "rollback_switches": self.rollback_switches,
            "python_s": self.python_s,
            "step_s": self.step_s,
            "steps": self.steps,
            "python_share": round(self.python_share, 6),
            "estimated_tok_s": round(self.estimated_tok_s, 3),
            "measured_tok_s": round(self.measured_tok_s, 3),
            "spec": self.spec.as_dict(),
        }

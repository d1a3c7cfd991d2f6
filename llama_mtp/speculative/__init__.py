"""MTP speculative decoding: drafters, verification, and the multi-sequence engine."""

from .engine import ContextLengthError, SequenceState, SpeculativeEngine, StepEvent
from .mtp import Draft, DraftRequest, MTPDrafter
from .ngram import NgramDrafter
from .stats import EngineStats, SpecStats
from .verify import verify_greedy, verify_match, verify_rejection

__all__ = [
    "ContextLengthError",
    "Draft",
    "DraftRequest",
    "EngineStats",
    "MTPDrafter",
    "NgramDrafter",
    "SequenceState",
    "SpecStats",
    "SpeculativeEngine",
    "StepEvent",
    "verify_greedy",
    "verify_match",
    "verify_rejection",
]

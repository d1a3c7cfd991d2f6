"""SpeculativeEngine: many sequences, one speculative step for all of them at once.

One :meth:`SpeculativeEngine.step`:

1. **Plan** each active sequence's draft length (its ``draft_max``, clamped by
   what is left of ``max_tokens``, of its context, and of the shared batch).
2. **Draft**: prompt lookup (n-gram) where enabled and it finds a match, the MTP
   head otherwise -- one MTP-context decode per draft position for all sequences.
3. **Verify**: one target decode holding, per sequence and contiguously,
   ``[replay..., id_last, d_0 .. d_{k-1}]``, every draft row an output.
4. **Accept** per sequence (greedy, sample-and-match or rejection sampling),
   emit ``n_acc + 1`` tokens, apply stop conditions.
5. **Roll back** the rejected tail: ``seq_rm`` (hybrid models through the
   ``n_rs_seq`` snapshots); where that is refused, restore the partial checkpoint
   taken before the verify and replay the accepted tokens in the next verify.
6. **Catch up**: queue the accepted tokens with the target's hidden rows for the
   MTP context (decoded with the next draft).

Sequences join (:meth:`add`, prefill chunked by ``n_batch``) and leave
(:meth:`remove`, or when they finish) between steps. Greedy output is token for
token the output of plain decoding, whatever the drafts were.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import numpy.typing as npt

from .. import _native
from ..batch import Batch
from ..context import Checkpoint, Context
from ..errors import ClosedError, LlamaError
from ..model import Model
from ..params import ContextParams, SamplingParams, SpecParams
from ..sampling import Sampler
from . import calibration
from .mtp import DraftRequest, MTPDrafter
from .ngram import NgramDrafter
from .policy import Acceptance, Candidate, CostModel, DraftPolicy
from .stats import EngineStats, SpecStats
from .verify import verify_greedy, verify_match, verify_rejection

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = ["AUTO_DRAFT_CAP", "DRAFT_VOCAB_AUTO", "ContextLengthError", "SequenceState", "SpeculativeEngine", "StepEvent"]

FinishReason = Literal["stop", "length", "removed"]

_log = logging.getLogger("llama_mtp")

#: The longest draft ``draft_max="auto"`` may choose unless ``draft_cap`` says otherwise.
#: With ``rollback="snapshots"`` it also sizes the recurrent-state snapshots (``n_rs_seq``)
#: of every sequence, so a larger cap costs memory: one more copy of the recurrent state
#: per draft position.
AUTO_DRAFT_CAP = 6
#: ``draft_vocab="auto"`` on a CPU: drafts come from the first this many token ids (plus
#: end-of-generation tokens and the tokens the text brings). On a 2-core CPU, 0.3B model
#: with 32000 tokens, a one-token draft decode took 2.7 ms with the full head, 0.9 ms
#: without it, and this many rows 0.24 ms more.
DRAFT_VOCAB_AUTO = 8192
#: Catch-up rows per flush whose MTP predictions are read as acceptance evidence
#: for sequences that are not drafting (see ``SpeculativeEngine._shadow_evidence``).
SHADOW_ROWS = 3
#: Catch-up rows queued per sequence before they are decoded on the MTP context.
#: A flush's cost is mostly fixed plus its first output row (the vocabulary
#: projection; on a 2-core CPU, 0.3B F16 model: 8 rows and 0 / 1 / 2 / 3 / 4 outputs
#: took 2.7 / 5.0 / 6.0 / 6.4 / 7.0 ms), so 3 guesses every 49 tokens give the
#: evidence of 2 every 33 for 0.13 instead of 0.18 ms a token. (With a reduced draft
#: vocabulary the guesses go through it, ~0.25 ms a row: 0.057 ms a token measured.)
CATCH_UP_QUEUE = 48
#: A sequence that has not drafted for this many steps stops feeding the MTP context
#: every token: it queues only its last SKIP_KEEP rows, and of each CATCH_UP_QUEUE
#: positions only those are decoded (they give the shadow evidence); the MTP memory keeps
#: a gap where the rest were. A probe's first draft decode carries every queued row of
#: every sequence: on four sequences ~0.3 ms a row on a 2-core CPU, so up to 40 rows
#: each of idle ones made a probe cost ~45 ms more. Only on models whose positions may
#: skip ahead (multi-section RoPE: Qwen3.5 and kin).
SKIP_IDLE = 16
SKIP_KEEP = 8
#: A sequence that stopped drafting fewer than this many steps ago, and whose drafts would
#: pay once under way next to the step's other sequences (:meth:`DraftPolicy.steady_ratios`
#: at least EAGER_RATIO), feeds the MTP context after every step (one decode for all such
#: sequences, with the shadow guesses) instead of queueing: resuming then brings no backlog
#: of catch-up rows to its first draft decode. That backlog (a dozen rows, ~5 ms on a 2-core
#: CPU) priced resuming too dear on ~50% text: auto ran at 0.96x plain on a Xeon where k = 2
#: made 1.09x (1.00x with this). Longer idle sequences, ones that never drafted and ones
#: whose text does not pay queue; so do all of them while another sequence drafts (its first
#: draft decode carries the rows).
EAGER_IDLE = 16
EAGER_RATIO = 0.95
#: ... that ratio re-priced every this many steps per sequence
EAGER_REFRESH = 4
#: Without snapshots (checkpoint rollback), a sequence whose verify carries more replayed
#: tokens than this drafts nothing in it: a rejection restores the state from before the
#: replay, which then grows (the policy prices replaying it again; this bounds it).
REPLAY_DRAFT_MAX = 4
#: An engine that starts from an earlier one's memory takes its probe backoff up to this many
#: failed drafts (a first probe within ``probe_gap * 2`` steps): a longer one, carried from
#: sequence to sequence, outlasted every request of 48 tokens -- four sequences at ~50% on a
#: 2-core CPU never probed again in a whole benchmark cell (shadow guesses kept the forced
#: probe away) and idled at 0.93x plain where one-token drafts ran at 1.08x.
REMEMBERED_FAILS = 2
#: The adaptive policy's calibration times every decode shape in this many interleaved
#: rounds (after one untimed round) and keeps the best of each -- fewer where one round
#: takes longer than CALIBRATION_ROUND_S seconds (big batches time steadily).
CALIBRATION_ROUNDS = 3
CALIBRATION_ROUND_S = 1.0
#: What rollback snapshots tax a decode (``rollback="auto"`` prices switching to them): the
#: median of this many paired ratios per shape (a small CPU drifts too much for best-of),
#: fewer once the rounds took TAX_S seconds.
TAX_ROUNDS = 8
TAX_S = 1.0
#: ... but never fewer than this many (a median of two once priced the context without
#: snapshots 25% dearer than the one with them: see SpeculativeEngine._plausible)
TAX_MIN_ROUNDS = 4
#: A measured ratio of the other mode's decode to this one's may sit this far on the wrong
#: side of 1 (snapshots cheaper than none: timing noise) before a cached calibration is
#: measured again; a new measurement is clamped to 1 there.
TAX_SLACK = 0.03


def _tax_side(ratio: float, alt_replays: bool, slack: float = TAX_SLACK) -> float:
    """``ratio`` (the other mode's decode over this mode's) moved onto its physical side of
    1, beyond ``slack``: at most 1 where the other mode has no snapshots (``alt_replays``),
    at least 1 where it has them."""
    return min(ratio, 1.0 + slack) if alt_replays else max(ratio, 1.0 - slack)


class ContextLengthError(LlamaError, ValueError):
    """A prompt does not fit the per-sequence context."""


@dataclass
class SequenceState:
    """A sequence as the engine sees it; ``tokens`` are the generated ones."""

    seq_id: int
    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    text: bytes = b""
    finish_reason: FinishReason | None = None
    stop_hit: str | None = None
    stats: SpecStats = field(default_factory=SpecStats)
    t_added: float = 0.0
    t_first: float = 0.0
    t_done: float = 0.0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def prompt_ms(self) -> float:
        return (self.t_first - self.t_added) * 1e3

    @property
    def predicted_ms(self) -> float:
        end = self.t_done if self.t_done else time.perf_counter()
        return (end - self.t_first) * 1e3


@dataclass
class StepEvent:
    """What one step produced for one sequence."""

    seq_id: int
    tokens: list[int]
    finished: bool
    finish_reason: FinishReason | None


@dataclass
class _Seq:
    state: SequenceState
    sampling: SamplingParams
    spec: SpecParams
    sampler: Sampler
    draft_sampler: Sampler
    accept_sampler: Sampler
    max_tokens: int
    stop: tuple[bytes, ...]
    stop_tokens: frozenset[int]
    ignore_eos: bool
    history: list[int]
    id_last: int = -1
    pos0: int = 0                         # where id_last goes
    kv_pos: int = 0                       # target KV holds positions < kv_pos
    pending_h: npt.NDArray[np.float32] | None = None   # target hidden of pos0 - 1
    rebuild: bool = False
    acc: Acceptance | None = None          # running MTP acceptance (adaptive draft length)
    idle: int = 0                          # steps since this sequence last drafted
    eager_ratio: float = 0.0               # its steady drafting ratio (_eager), as of step eager_at
    eager_at: int = -(1 << 30)

    slot: int = -1                         # where its memory lives in both contexts (SpeculativeEngine._compact)

    @property
    def seq(self) -> int:
        """Its slot: the sequence id of every llama.cpp call."""
        return self.slot

    @property
    def sid(self) -> int:
        """Its public id (``SequenceState.seq_id``): fixed, whatever slot it moves to."""
        return self.state.seq_id

    @property
    def backlog(self) -> list[int]:
        """Accepted tokens the target KV does not hold yet (a replay after a checkpoint restore)."""
        return self.history[self.kv_pos: self.pos0]  # history[p] is the token at position p

    @property
    def n_backlog(self) -> int:
        """``len(backlog)``, without building it."""
        return self.pos0 - self.kv_pos


@dataclass
class _PrefillSpan:
    """What :meth:`SpeculativeEngine._prefill` has left of one sequence: ``history[start:end]``."""

    q: _Seq
    start: int
    end: int


class SpeculativeEngine:
    """Speculative decoding for up to ``max_sequences`` sequences at once.

    >>> with SpeculativeEngine(model, max_sequences=4) as eng:     # doctest: +SKIP
    ...     a = eng.add(model.tokenize("Hello"), max_tokens=64)
    ...     while eng.active:
    ...         eng.step()
    ...     print(eng.sequence(a).tokens, eng.stats.spec.acceptance_rate)

    ``n_ctx`` is the context of *each* sequence. ``draft_max`` bounds every
    sequence's draft length (and sizes the recurrent-state snapshots that make
    rollback cheap); with ``draft_max="auto"`` each sequence's length is chosen per
    step in 0 .. ``draft_cap`` (default :data:`AUTO_DRAFT_CAP`). ``mtp=False`` runs
    plain decoding (or n-gram drafting only) on models without an MTP head.

    ``rollback`` says how a rejected draft is undone on recurrent (Gated-DeltaNet)
    memory: ``"snapshots"`` keeps llama.cpp's per-token state snapshots
    (``n_rs_seq``), which every decode pays for, drafting or not; ``"checkpoint"``
    keeps none, saves the recurrent state of each drafting sequence before the
    verify, and after a rejection restores it and replays the accepted tokens in
    the next verify. ``"auto"`` (default): with ``draft_max="auto"`` on a CPU-only
    run the engine switches between the two while running -- snapshots while
    drafting pays (on a CPU, replays after rejections cost more than the snapshots'
    tax), no snapshots while nothing drafts (then the tax is all they are: 2.5% of
    a decode for one sequence, 5% for four); every sequence's state is copied into
    the other mode's target context, which the engine keeps between switches
    (:meth:`_switch_rollback`, :meth:`_stash`: two target contexts held, where one
    mode alone holds one). Otherwise snapshots (an
    offloaded model, where they cost little; a fixed draft length, which cannot
    avoid replays where drafts are often rejected). ``rollback`` on the engine is
    the mode in use now. See bench/README.md.

    ``draft_vocab`` limits the tokens an MTP draft can propose, so its decode skips the
    full LM head (:class:`~llama_mtp.DraftHead`): ``N`` drafts from the first ``N``
    token ids (BPE and SentencePiece vocabularies put frequent pieces first), the
    end-of-generation tokens and every token a prompt or accepted draft brings (up to
    :data:`~llama_mtp.speculative.mtp.DRAFT_VOCAB_GROW` more); ``None`` drafts from the
    whole vocabulary. ``"auto"`` (default): :data:`DRAFT_VOCAB_AUTO` where the model
    runs on the CPU (the head is most of a draft decode there), else the whole
    vocabulary. Output never changes; acceptance drops only where the target's next
    token is outside the draft vocabulary.

    With ``draft_max="auto"`` the policy starts from measured decode costs: timed when the
    first engine with this machine, build, model file and settings is made, then taken
    from the calibration cache (:mod:`llama_mtp.speculative.calibration`; ``calibration``
    says ``"measured"`` or ``"cached"``). It also starts from what the last engine with
    that key learnt (the calibration cache's engine memory, written at :meth:`close`: its
    drafts' pooled acceptance, probe backoff and rollback mode; ``remembered`` says so):
    a new engine otherwise learns it again, which is much of a short run.
    ``recalibrate=True`` measures again, forgets that memory, and replaces both.
    """

    def __init__(
        self,
        model: Model,
        *,
        max_sequences: int = 1,
        n_ctx: int = 4096,
        draft_max: int | Literal["auto"] = "auto",
        draft_cap: int | None = None,
        mtp: bool = True,
        mtp_model: Model | None = None,
        n_batch: int | None = None,
        params: ContextParams | None = None,
        spec: SpecParams | None = None,
        sampling: SamplingParams | None = None,
        rollback: Literal["auto", "snapshots", "checkpoint"] = "auto",
        draft_vocab: int | Literal["auto"] | None = "auto",
        recalibrate: bool = False,
    ) -> None:
        if isinstance(max_sequences, bool) or not isinstance(max_sequences, int) or max_sequences < 1:
            raise ValueError(f"max_sequences must be a positive integer, got {max_sequences!r}")
        if isinstance(n_ctx, bool) or not isinstance(n_ctx, int) or n_ctx < 8:
            raise ValueError(f"n_ctx must be an integer >= 8, got {n_ctx!r}")
        if draft_max != "auto" and (isinstance(draft_max, bool) or not isinstance(draft_max, int)
                                    or not 0 <= draft_max <= 64):
            raise ValueError(f"draft_max must be 'auto' or an integer in 0..64, got {draft_max!r}")
        cap = draft_cap if draft_cap is not None else (draft_max if isinstance(draft_max, int) else AUTO_DRAFT_CAP)
        if isinstance(cap, bool) or not isinstance(cap, int) or not 0 <= cap <= 64:
            raise ValueError(f"draft_cap must be an integer in 0..64, got {cap!r}")
        if rollback not in ("auto", "snapshots", "checkpoint"):
            raise ValueError("rollback must be 'auto', 'snapshots' or 'checkpoint'")
        if draft_vocab is not None and draft_vocab != "auto" and (
                isinstance(draft_vocab, bool) or not isinstance(draft_vocab, int) or draft_vocab < 1):
            raise ValueError(f"draft_vocab must be 'auto', None or a positive integer, got {draft_vocab!r}")
        self._closed = False
        self.model = model
        self._recalibrate = bool(recalibrate)
        self._mtp_model = mtp_model
        #: where the adaptive policy's starting costs came from: "measured" (this engine timed
        #: its decode shapes), "cached" (a calibration of this machine, model and settings from
        #: the cache), None (nothing calibrated: no draft_max="auto" sequence yet, or no MTP)
        self.calibration: Literal["measured", "cached"] | None = None
        #: whether the adaptive policy started from the memory of an earlier engine with
        #: the same calibration key (see :meth:`_recall`)
        self.remembered = False
        self._memory_key: dict[str, Any] | None = None  # where close() keeps this engine's memory
        self.default_spec = spec or SpecParams(draft_max=draft_max)
        self.default_sampling = sampling or SamplingParams()
        draft_max = cap  # from here on: the longest draft any sequence may verify
        self.draft_max = draft_max
        self.policy = DraftPolicy(draft_max)
        #: see EAGER_IDLE (0: every idle sequence queues its catch-up rows)
        self.eager_idle = EAGER_IDLE
        #: see EAGER_RATIO
        self.eager_ratio = EAGER_RATIO
        self._acc_pool = Acceptance(max(1, draft_max))  # every sequence's MTP verifies: new sequences' prior
        self._last_fails = 0  # the probe backoff of the sequence that finished last
        self._clock = 0  # steps run (the engine's own count: stats may be replaced)
        self.max_sequences = max_sequences
        base = params or ContextParams()
        switchable = False
        if rollback == "auto":
            # the policy prices replays and snapshots and switches between them; a fixed k cannot.
            # Offloaded (GPU) runs keep the snapshots: there they cost little
            switchable = self.default_spec.draft_max == "auto" and bool(mtp) and cap > 0 and not model.offloads
            rollback = "snapshots"  # where switching: until the text says drafting does not pay
        #: how rejected drafts are undone: "snapshots" or "checkpoint" (``rollback="auto"`` resolved)
        self.rollback: Literal["snapshots", "checkpoint"] = rollback
        need = max_sequences * (draft_max + 1)
        n_batch = n_batch or max(512, need)
        if n_batch < need:
            raise ValueError(f"n_batch={n_batch} cannot hold one verify step: {max_sequences} sequences x "
                             f"(draft_max {draft_max} + 1) = {need}")
        n_ubatch = min(n_batch, base.n_ubatch or 512)
        if n_ubatch < draft_max + 1:
            n_ubatch = draft_max + 1
        n_rs = draft_max if rollback == "snapshots" else 0
        self._target_params = base.replace(n_ctx=n_ctx * max_sequences, n_seq_max=max_sequences, n_batch=n_batch,
                                           n_ubatch=n_ubatch, n_rs_seq=n_rs)
        self.target = Context(model, self._target_params)
        #: where switching: the other rollback mode's target context, emptied and kept (see _stash)
        self._spare: Context | None = None
        try:
            self.target.set_hidden_output(bool(mtp), masked=False)
            self.n_ctx_seq: int = self.target.n_ctx_seq
            self.drafter: MTPDrafter | None = None
            if mtp:
                auto_vocab = draft_vocab == "auto"
                if auto_vocab:  # a reduced vocabulary where the head runs on the CPU
                    draft_vocab = DRAFT_VOCAB_AUTO if not (mtp_model or model).offloads else None
                self.drafter = MTPDrafter(model, n_ctx=n_ctx * max_sequences, n_seq_max=max_sequences,
                                          n_batch=n_batch, params=base, mtp_model=mtp_model,
                                          draft_vocab=draft_vocab,  # type: ignore[arg-type]
                                          head_required=not auto_vocab)
                # the draft head as configured (its rows grow with the text: not part of a calibration's key)
                self._draft_head_key = (draft_vocab, self.drafter.head is not None)
        except BaseException:
            self.target.close()
            raise
        self.ngram = NgramDrafter()
        self._calibrated = False
        self._exact = self.target._exact_rollback  # attention-only memory: seq_rm always works
        self.policy.replays = rollback == "checkpoint" and not self._exact
        if not self._exact:  # recurrent state: llama.cpp cuts uneven verifies into micro-batches
            n_rs = self.target.n_rs_seq
            self.policy.costs.split = self._split(n_rs)
            if switchable:
                # the other mode (no snapshots: checkpoints) is priced too, and the engine
                # switches the target context to it while it promises to be faster
                self.policy.alt = self.policy.costs.sibling(self._split(0))
                self.policy.alt_replays = True
        self._batch = Batch(self.target.n_batch)
        self._seqs: dict[int, _Seq] = {}   # live sequences by slot
        self._ids: dict[int, int] = {}     # ... their slots by public id
        self._done: dict[int, SequenceState] = {}  # finished or removed ones, by public id
        self._eog = model.eog_mask
        self.stats = EngineStats()
        self._lock = threading.RLock()  # one thread at a time in add/step/remove
        if self.drafter is not None and self.default_spec.draft_max == "auto":
            try:
                self._calibrate()  # every slot is free now: measure what decodes cost here
            except BaseException:
                self.close()
                raise

    def _other_target(self) -> Context | None:
        """A target context with the other rollback mode (snapshots of draft_max tokens, or
        none): the spare one where it is kept, else a new one; None where it cannot be made
        (memory) -- and then the engine stops switching for good."""
        if self._spare is not None:
            spare, self._spare = self._spare, None
            return spare
        try:
            return Context(self.model, self._target_params.replace(
                n_rs_seq=self.draft_max if self.rollback == "checkpoint" else 0))
        except (LlamaError, MemoryError):
            self.policy.stop_switching()
            return None

    def _stash(self, ctx: Context) -> None:
        """Keep a target context of the mode just left, emptied, for the next switch back.

        Building a context is most of what a switch cost (2-core EPYC, the 0.3B benchmark
        model, four sequences: 105 ms for one with snapshots, 30..40 ms without, against
        ~10 ms to copy the four sequences' states), and the policy switches a few times a
        minute where drafting pays on and off. Peak memory does not grow: both contexts
        exist at once while the engine calibrates and during every switch anyway.
        ``rollback="snapshots"`` (or ``"checkpoint"``) keeps only one."""
        try:
            ctx.memory.clear(data=False)  # every slot empty (a switch back restores each state whole)
        except Exception:
            ctx.close()
            return
        if self._spare is not None:
            self._spare.close()
        self._spare = ctx

    def _split(self, n_rs: int) -> tuple[int, bool, int]:
        """How the target cuts a verify into micro-batches with ``n_rs`` snapshots (CostModel.split)."""
        return (self.target.n_ubatch, not self.target.kv_unified, n_rs + 1 if n_rs else 0)

    # ------------------------------------------------------------ lifecycle

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._remember()
        if self.drafter is not None:
            self.drafter.close()
        if self._spare is not None:
            self._spare.close()
            self._spare = None
        self.target.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("SpeculativeEngine is closed")

    @property
    def active(self) -> list[int]:
        """Sequence ids still generating."""
        return [q.sid for q in self._seqs.values() if not q.state.finished]

    @property
    def free_slots(self) -> int:
        return self.max_sequences - len(self._seqs)

    def sequence(self, seq_id: int) -> SequenceState:
        q = self._live(seq_id)
        if q is not None:
            return q.state
        if seq_id in self._done:
            return self._done[seq_id]
        raise KeyError(f"no sequence {seq_id}")

    # ------------------------------------------------------------ joining

    def add(
        self,
        prompt: Sequence[int] | str,
        *,
        max_tokens: int = 256,
        sampling: SamplingParams | None = None,
        spec: SpecParams | None = None,
        stop: Iterable[str] = (),
        stop_tokens: Iterable[int] = (),
        ignore_eos: bool = False,
        seq_id: int | None = None,
    ) -> int:
        """Prefill a new sequence (chunked by ``n_batch``) and sample its first token.
        Returns its sequence id: ``seq_id`` (in ``[0, max_sequences)``, not in use), else
        the lowest free one. Ids name sequences, not llama.cpp's slots: the engine keeps
        live sequences in the lowest slots and moves one when a slot below it frees up."""
        return self.add_many([dict(prompt=prompt, max_tokens=max_tokens, sampling=sampling, spec=spec, stop=stop,
                                   stop_tokens=stop_tokens, ignore_eos=ignore_eos, seq_id=seq_id)])[0]

    def add_many(self, requests: list[dict]) -> list[int]:  # type: ignore[type-arg]
        """Add several sequences with one shared, packed prefill. On any error (Ctrl-C
        included) none of them is added."""
        with self._lock, _native.deferred_sigint():
            return self._add_many(requests)

    def _add_many(self, requests: list[dict]) -> list[int]:  # type: ignore[type-arg]
        self._check_open()
        if len(requests) > self.free_slots:
            raise LlamaError(f"no free sequence slot: {len(self._seqs)} of {self.max_sequences} in use "
                             "(remove finished sequences or raise max_sequences)")
        new: list[_Seq] = []
        taken = set(self._ids)
        for req in requests:
            new.append(self._make_seq(taken=taken, **req))
            taken.add(new[-1].sid)
        free = [s for s in range(self.max_sequences) if s not in self._seqs]
        for q, slot in zip(new, free, strict=False):  # the lowest free slots (a higher one would be moved down at once)
            q.slot = slot
        for q in new:
            self._seqs[q.slot] = q
            self._ids[q.sid] = q.slot
            self._done.pop(q.sid, None)
        try:
            self._prefill(new, sample_first=True)
        except BaseException:
            for q in new:
                self._drop(q.seq)
            raise
        return [q.sid for q in new]

    def _live(self, seq_id: int) -> _Seq | None:
        slot = self._ids.get(seq_id)
        return None if slot is None else self._seqs.get(slot)

    def _make_seq(self, *, taken: set[int], prompt: Sequence[int] | str, max_tokens: int = 256,
                  sampling: SamplingParams | None = None, spec: SpecParams | None = None,
                  stop: Iterable[str] = (), stop_tokens: Iterable[int] = (), ignore_eos: bool = False,
                  seq_id: int | None = None) -> _Seq:
        toks = self.model.tokenize(prompt) if isinstance(prompt, str) else self.model.check_tokens(prompt).tolist()
        if not toks:
            raise ValueError("the prompt is empty (no tokens)")
        if len(toks) >= self.n_ctx_seq:
            raise ContextLengthError(f"the prompt has {len(toks)} tokens; the per-sequence context holds "
                                     f"{self.n_ctx_seq} (raise n_ctx)")
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive integer, got {max_tokens!r}")
        if seq_id is None:
            seq_id = next(i for i in range(self.max_sequences) if i not in taken)
        elif isinstance(seq_id, bool) or not isinstance(seq_id, int) or not 0 <= seq_id < self.max_sequences:
            raise ValueError(f"seq_id must be in [0, {self.max_sequences}), got {seq_id!r}")
        elif seq_id in taken:
            raise LlamaError(f"sequence {seq_id} is in use")
        sampling = sampling or self.default_sampling
        spec = spec or self.default_spec
        if spec.verify == "rejection" and sampling.greedy:
            raise ValueError("verify='rejection' needs temperature > 0 (greedy decoding has nothing to sample)")
        sampler = Sampler(sampling, self.model.n_vocab)
        stops = tuple(s.encode("utf-8") for s in stop if s)
        stop_ids = frozenset(int(t) for t in stop_tokens)
        now = time.perf_counter()
        return _Seq(
            state=SequenceState(seq_id=seq_id, prompt=toks, t_added=now),
            sampling=sampling, spec=spec, sampler=sampler,
            draft_sampler=sampler.spawn(1), accept_sampler=sampler.spawn(2),
            max_tokens=max_tokens, stop=stops, stop_tokens=stop_ids, ignore_eos=bool(ignore_eos),
            history=list(toks), acc=self._new_acceptance(),
        )

    def _new_acceptance(self) -> Acceptance:
        # it starts from the engine's pooled evidence (same model, often the same kind of
        # text) and shrinks towards it while its own is thin
        acc = Acceptance(max(1, self.draft_max), parent=self._acc_pool)
        # and from the probe backoff where the last sequence ended (the pool's own count
        # would add up every sequence's failed drafts: four in lockstep, four a step)
        acc.fails = self._last_fails
        return acc

    def _prefill(self, seqs: list[_Seq], sample_first: bool) -> None:
        """Decode each sequence's history[:pos] into both contexts, packed into
        n_batch chunks; sample the first token when ``sample_first``."""
        t0 = time.perf_counter()
        b = self._batch
        cap = b.capacity
        todo: list[_PrefillSpan] = []
        for q in seqs:
            n = len(q.history) if sample_first else q.pos0
            todo.append(_PrefillSpan(q, 0, n))
            if self.drafter is not None:
                self.drafter.remove(q.seq)
            self.target.memory.seq_rm(q.seq, -1, -1)
        carry = {q.seq: np.zeros(self.target.hidden_dim, dtype=np.float32) for q in seqs}
        while any(item.start < item.end for item in todo):
            b.clear()
            spans = []
            for item in todo:
                q, start, end = item.q, item.start, item.end
                if start >= end or b.n_tokens >= cap:
                    continue
                n = min(end - start, cap - b.n_tokens)
                last = start + n == end
                flags = np.zeros(n, dtype=bool)
                flags[-1] = last and sample_first
                sl = b.extend(q.history[start:start + n], start, q.seq, outputs=flags)
                spans.append((q, start, n, sl))
                item.start = start + n
            self.target.decode(b)
            hidden = self.target.hidden_all() if self.drafter is not None else None
            for q, start, n, sl in spans:
                if hidden is not None and self.drafter is not None:
                    rows = hidden[sl]
                    prev = np.vstack([carry[q.seq][None, :], rows[:-1]])
                    self.drafter.catch_up(q.seq, q.history[start:start + n], start, prev)
                    carry[q.seq] = np.array(rows[-1])
                if start + n == (len(q.history) if sample_first else q.pos0):
                    q.kv_pos = start + n
                    if sample_first:
                        q.pos0 = start + n
                        q.id_last = q.sampler.sample(self.target.logits(sl.stop - 1), q.history)
                    q.pending_h = carry[q.seq].copy() if hidden is not None else None
            del hidden
            if self.drafter is not None:
                busy = [q.seq for q, *_ in spans if self.drafter.pending(q.seq) > cap // 2]
                if busy:
                    t1 = time.perf_counter()
                    self.drafter.flush(busy)
                    self.stats.catch_up_s += time.perf_counter() - t1
        self.stats.prefill_s += time.perf_counter() - t0
        now = time.perf_counter()
        for q in seqs:
            q.rebuild = False
            if sample_first:
                q.state.t_first = now
                self._emit(q, [q.id_last])
                if q.state.finished:
                    self._finish(q)

    # ------------------------------------------------------------ leaving

    def remove(self, seq_id: int) -> SequenceState:
        """Stop a sequence now and free its memory in both contexts."""
        with self._lock:
            return self._remove(seq_id)

    def _remove(self, seq_id: int) -> SequenceState:
        self._check_open()
        q = self._live(seq_id)
        if q is None:
            if seq_id in self._done:
                return self._done.pop(seq_id)
            raise KeyError(f"no sequence {seq_id}")
        if not q.state.finished:
            q.state.finish_reason = "removed"
            q.state.t_done = time.perf_counter()
        self._drop(q.seq)
        return q.state

    def _drop(self, slot: int) -> None:
        q = self._seqs.pop(slot, None)
        if q is not None:
            self._done[q.sid] = q.state
            self._ids.pop(q.sid, None)
        if not self.target.closed:
            self.target.memory.seq_rm(slot, -1, -1)
        if self.drafter is not None and not self.drafter.ctx.closed:
            self.drafter.remove(slot)

    def _finish(self, q: _Seq) -> None:
        if q.acc is not None:
            self._last_fails = q.acc.fails
        q.state.t_done = time.perf_counter()
        self.stats.spec.merge(q.state.stats)
        self._drop(q.seq)

    # ------------------------------------------------------------ stepping

    def _mtp_k(self, q: _Seq) -> int:
        k = q.spec.draft_max if q.spec.draft_max != "auto" else self.draft_max
        return min(k, self.draft_max)

    def _plan(self, q: _Seq, past_end: bool = False) -> int:
        """The most draft tokens this sequence may verify this step (any drafter);
        ``past_end``: past max_tokens too (:meth:`_level_tail`)."""
        k = max(self._mtp_k(q), q.spec.ngram_max if q.spec.ngram else 0)
        if not past_end:
            k = min(k, q.max_tokens - len(q.state.tokens) - 1)  # never draft past max_tokens
        k = min(k, self.n_ctx_seq - 1 - q.pos0)                 # nor past the context
        if q.n_backlog > REPLAY_DRAFT_MAX and not self._exact:
            # a long replay rides in this verify: a checkpoint taken before it would not hold
            # the replayed tokens, so a rejection would replay them again, and more (drafts
            # the snapshots can undo are fine)
            k = min(k, self.target.n_rs_seq)
        return max(0, k)

    def step(self) -> list[StepEvent]:
        """One speculative step for every active sequence; returns what each emitted.

        If it fails (Ctrl-C, ``interrupt()``, a failed decode), every sequence is
        left usable: those whose memory the failure touched are replayed into both
        contexts at the next step, with nothing lost.
        """
        with self._lock, _native.deferred_sigint():
            self._check_open()
            t_step = time.perf_counter()
            self._compact()
            seqs = [q for q in self._seqs.values() if not q.state.finished]
            if not seqs:
                return []
            st = self.stats
            native0 = st.decode_s + st.prefill_s  # a step may replay a sequence's prompt (recovery)
            try:
                events = self._step(seqs)
            except BaseException:
                self._recover(seqs)
                raise
            finally:
                self.stats.step_s += time.perf_counter() - t_step
            self.stats.steps += 1
            wall = time.perf_counter() - t_step
            if self.drafter is not None:
                self.policy.costs.observe_overhead(wall - (st.decode_s + st.prefill_s - native0))
            self.policy.observe_step(sum(len(e.tokens) for e in events), wall)
            self.stats.estimated_tok_s = self.policy.estimated_tok_s
            self.stats.measured_tok_s = self.policy.measured_tok_s
            return events

    def _compact(self) -> None:
        """Keep the live sequences in the lowest slots: move the highest into a free slot
        below it until none is left. With a KV stream per sequence llama.cpp cuts a batch
        into micro-batches of *consecutive* sequence ids (``split_equal(sequential=true)``),
        so a sequence that finished in the middle of the range split every later decode in
        two: seven live of eight on a 2-core CPU, plain decoding 108..123 tok/s when slot 3
        had finished against 170 when slot 7 had. A move copies one sequence's state in
        both contexts (a few ms); public ids do not change. A state that does not copy is
        replayed from its history into the new slot at the next step."""
        while self._seqs:
            top = max(self._seqs)
            dst = next((s for s in range(top) if s not in self._seqs), None)
            if dst is None or self.target.kv_unified:  # (one stream: batches are not cut at gaps)
                return
            q = self._seqs.pop(top)
            t0 = time.perf_counter()
            try:
                if q.rebuild:  # replayed into its slot at the next step anyway
                    self.target.memory.seq_rm(top, -1, -1)
                else:
                    self.target.move(top, dst)
                if self.drafter is not None:
                    self.drafter.move(top, dst)
            except LlamaError:
                for s in (top, dst):
                    self.target.memory.seq_rm(s, -1, -1)
                    if self.drafter is not None:
                        self.drafter.remove(s)
                q.rebuild = True
            self.policy.moved(top, dst)
            q.slot = dst
            self._seqs[dst] = q
            self._ids[q.sid] = dst
            dt = time.perf_counter() - t0
            self.stats.slot_moves += 1
            self.stats.move_s += dt
            self.stats.restore_s += dt

    def interrupt(self) -> None:
        """Abort the step (or prefill) running in another thread; it raises AbortedError."""
        self.target.interrupt()
        if self.drafter is not None:
            self.drafter.ctx.interrupt()

    def _calibrate(self) -> None:
        """Set the decode costs the adaptive policy starts from, once, while every sequence
        slot is free: from the calibration cache (:mod:`.calibration`) where this machine,
        model and settings were measured before, else measured now (:meth:`_measure`) and
        cached. ``calibration`` says which."""
        self._calibrated = True
        if self._seqs or self.drafter is None or self.draft_max == 0:
            return
        try:
            material: dict[str, Any] | None = self._calibration_material()
        except OSError as e:  # a model file gone or unreadable since it was loaded: measure, keep nothing
            _log.info("calibration cache not used: %s", e)
            material = None
        self._memory_key = material
        costs = None if self._recalibrate or material is None else calibration.load(material)
        if costs is not None and not self._plausible(costs):
            _log.info("cached calibration prices the rollback modes the wrong way round: measuring again")
            costs = None
        if costs is not None:
            self._apply_costs(costs)
            self.calibration = "cached"
            memory = calibration.load_memory(material)  # type: ignore[arg-type]
            if memory is not None:
                self._recall(memory)
            return
        t0 = time.perf_counter()
        costs = self._measure()
        self._apply_costs(costs)
        self.calibration = "measured"
        # a measurement without the other mode's curves (no room for its context now) is
        # not kept: room is the moment's, the curves are the machine's
        complete = material is not None and (costs["alt"] is not None or not material["alt"])
        where = calibration.store(material, costs) if complete else None  # type: ignore[arg-type]
        _log.info("measured decode costs for draft_max='auto' in %.1f s%s", time.perf_counter() - t0,
                  f" (cached: {where})" if where is not None else "")

    def _recall(self, memory: dict[str, Any]) -> None:
        """Start from an earlier engine's memory (:func:`.calibration.valid_memory`): its
        pooled acceptance evidence (new sequences' prior, capped at ``parent_weight``
        observations, so a sequence's own drafts soon outweigh it), its probe backoff, its
        rollback mode (switched to now, while no sequence holds state) and how many mode
        comparisons in a row found snapshots idle."""
        pool = self._acc_pool
        if len(memory["hits"]) != len(pool.hits):
            return
        pool.hits = [float(h) for h in memory["hits"]]
        pool.tries = [float(t) for t in memory["tries"]]
        self._last_fails = min(int(memory["fails"]), REMEMBERED_FAILS)
        if memory["rollback"] != self.rollback and self.policy.alt is not None and not self._seqs:
            self._switch_rollback(remembered=True)
        # how long snapshots have looked idle goes on counting where the last engine stopped
        # (leaving them takes SWITCH_IDLE_N comparisons, ~128 steps: longer than a short run)
        self.policy.idle_comparisons = int(memory.get("idle", 0))
        self.remembered = True

    def _remember(self) -> None:
        """Keep what this engine learnt for the next one with the same calibration key
        (never raises: a memory that cannot be written is logged and lost)."""
        if self._memory_key is None or self.drafter is None or not any(self._acc_pool.tries):
            return
        fails = max([self._last_fails] + [q.acc.fails for q in self._seqs.values() if q.acc is not None])
        try:
            calibration.store_memory(self._memory_key, {
                "hits": list(self._acc_pool.hits), "tries": list(self._acc_pool.tries),
                "fails": fails, "rollback": self.rollback, "idle": self.policy.idle_comparisons})
        except Exception as e:  # noqa: BLE001 -- close() must not fail over a cache
            _log.info("engine memory not kept: %s", e)

    def _calibration_material(self) -> dict[str, Any]:
        """Everything that shapes the calibrated costs: the machine, the model files, the
        target's parameters (threads as resolved), the draft head, the engine's layout."""
        return {
            "machine": calibration.machine(),
            "model": calibration.file_identity(self.model.path), "model_params": self.model.params.as_dict(),
            "mtp_model": calibration.file_identity(m.path) if (m := self._mtp_model) is not None else None,
            "mtp_model_params": m.params.as_dict() if m is not None else None,
            "target": self._target_params.as_dict(), "threads": list(self.target.n_threads),
            "draft_vocab": list(self._draft_head_key), "max_sequences": self.max_sequences, "draft_max": self.draft_max,
            "batch": self._batch.capacity, "rollback": self.rollback, "replays": self.policy.replays,
            "split": self.policy.costs.split, "alt": self.policy.alt is not None,
            "alt_replays": self.policy.alt_replays,
        }

    def _plausible(self, costs: dict[str, Any]) -> bool:
        """Whether a calibration's other-mode verify curves lie on the physical side of this
        mode's: snapshots are extra work on every decode, so a context without them is never
        dearer (within TAX_SLACK). One measured the other way round (eight sequences on a
        2-core CPU once timed the context without snapshots 25% *dearer*, from two rounds)
        had the engine switch back and forth for a whole run, and a cache kept it."""
        alt = costs.get("alt")
        if alt is None:
            return True
        for n_seqs, pts in alt["verify"].items():
            mine = {int(r): float(t) for r, t in costs["verify"].get(n_seqs, [])}
            for r, t in pts:
                ratio = float(t) / mine[int(r)] if mine.get(int(r)) else None
                if ratio is not None and _tax_side(ratio, self.policy.alt_replays) != ratio:
                    return False
        return True

    def _apply_costs(self, costs: dict[str, Any]) -> None:
        """Start the policy's cost model from a calibration (:func:`.calibration.valid`):
        this mode's verify curves, checkpoint save and restore, and the draft curve; the
        other mode's verify curves and checkpoints where it has them."""

        def verify_and_checkpoints(c: CostModel, part: dict[str, Any]) -> None:
            for n_seqs, pts in part["verify"].items():
                c.verify.calibrate(int(n_seqs), [(int(r), float(t)) for r, t in pts])
            if part.get("save") is not None:
                c.save, c.restore = float(part["save"]), float(part["restore"])

        verify_and_checkpoints(self.policy.costs, costs)
        self.policy.costs.draft.calibrate([(int(n), float(t)) for n, t in costs["draft"]])
        alt, got = self.policy.alt, costs.get("alt")
        if alt is not None and got is None:  # the measurement found no room for the other mode's context
            self.policy.stop_switching()
        elif alt is not None and got is not None:
            verify_and_checkpoints(alt, got)

    def _measure(self) -> dict[str, Any]:
        """Measure the decode costs: target decodes of one and of all sequences with 1 ..
        draft_max + 1 rows each, MTP draft decodes of 1 .. max_sequences outputs, checkpoint
        saves and restores where drafts replay, the other rollback mode's curves. The
        slots are emptied again."""
        free = 0
        tok = 0
        b = self._batch
        mem = self.target.memory
        d = self.drafter
        assert d is not None
        out: dict[str, Any] = {"save": None, "restore": None, "alt": None}

        # every shape is decoded once untimed (on a GPU the first decode of a shape pays for
        # its CUDA graph and buffers: an H200 timed a cold 1-row verify at 8 ms, a warm one at
        # ~2), then timed in interleaved rounds, best of each: a CPU whose speed drifts for a
        # few seconds must not bend the curves' shapes -- the policy re-measures only the
        # layouts it chooses, so a shape wrong here decides for the whole run
        def verify(n: int, per: int) -> None:
            for s in range(n):
                mem.seq_rm(s, -1, -1)
            b.clear()
            for s in range(n):
                b.extend([tok] * per, 0, s, outputs="all")
            self.target.decode(b)

        h = np.zeros(d.hidden_dim, dtype=np.float32)

        def draft(n: int) -> None:  # one output per drafting sequence (all on the free slot here)
            d.time_draft_decode(free, n, tok, h)

        def best_of(runs: dict[tuple[str, int, int], Callable[[], None]]) -> dict[tuple[str, int, int], float]:
            best = dict.fromkeys(runs, float("inf"))
            for rnd in range(CALIBRATION_ROUNDS + 1):
                t_round = time.perf_counter()
                for key, run in runs.items():
                    t0 = time.perf_counter()
                    run()
                    if rnd > 0:  # round 0 warms every shape up
                        best[key] = min(best[key], time.perf_counter() - t0)
                if rnd == 1 and time.perf_counter() - t_round > CALIBRATION_ROUND_S:
                    break  # big batches: their timings are long enough to trust one
            return best

        try:
            # one sequence with 1 .. draft_max + 1 rows; all sequences with 1 .. draft_max + 1 rows each
            layouts = {1: [(1, r) for r in range(1, self.draft_max + 2)]}
            if self.max_sequences > 1:
                layouts[self.max_sequences] = [(self.max_sequences, r) for r in range(1, self.draft_max + 2)
                                               if self.max_sequences * r <= b.capacity]
            counts = sorted({x for x in (1, 2, 4, 8, 16, 32, 64, 128, 256) if x <= self.max_sequences}
                            | {self.max_sequences})
            runs: dict[tuple[str, int, int], Callable[[], None]] = {}
            for shapes in layouts.values():
                for n, per in shapes:
                    runs["verify", n, per] = functools.partial(verify, n, per)
            for n in counts:
                runs["draft", n, 1] = functools.partial(draft, n)
            best = best_of(runs)
            out["verify"] = {str(n_seqs): [[n * per, best["verify", n, per]] for n, per in shapes]
                             for n_seqs, shapes in layouts.items()}
            out["draft"] = [[n, best["draft", n, 1]] for n in counts]
            if self.policy.replays:  # what a checkpoint draft's save and a rejection's restore cost
                out["save"], out["restore"] = self._time_checkpoints(self.target)
            if self.policy.alt is not None:
                out["alt"] = self._measure_alt(layouts, best)
        finally:
            for s in range(self.max_sequences):
                if s not in self._seqs:
                    mem.seq_rm(s, -1, -1)
                    d.ctx.memory.seq_rm(s, -1, -1)
        return out

    def _time_checkpoints(self, ctx: Context) -> tuple[float, float]:
        """Seconds to save one sequence's recurrent state and to restore it (best of 3);
        every sequence's save buffer is allocated and touched first."""
        for s in range(self.max_sequences):
            ctx.checkpoint(s, partial=True, reuse=True)
        saves, restores = [], []
        for _ in range(3):
            t0 = time.perf_counter()
            ck = ctx.checkpoint(0, partial=True, reuse=True)
            t1 = time.perf_counter()
            ctx.restore(ck)
            saves.append(t1 - t0)
            restores.append(time.perf_counter() - t1)
        return min(saves), min(restores)

    def _measure_alt(self, layouts: dict[int, list[tuple[int, int]]],
                     best: dict[tuple[str, int, int], float]) -> dict[str, Any] | None:
        """Price the alternative rollback mode: a context made with the other ``n_rs_seq``
        decodes a few verify shapes next to the target, interleaved, and the ratio (what
        the snapshots tax a decode; it grows with the rows up to draft_max + 1) scales
        the target's calibrated points into the alternative's curves; checkpoint saves
        and restores are timed on it too. The context is kept, emptied, for the first
        switch (:meth:`_stash`). None where there is no room for it (no switching then)."""
        other = self._other_target()
        if other is None:  # no room for a second target context: no switching either
            return None
        out: dict[str, Any] = {"verify": {}, "save": None, "restore": None}
        try:
            probe = {1, self.draft_max + 1}  # the tax grows about linearly in between
            shapes_now = [(n, per) for shapes in layouts.values() for n, per in shapes if per in probe]
            ratios: dict[tuple[int, int], list[float]] = {sh: [] for sh in shapes_now}
            # sequences that go on (a decode at position 0 starts from no state: it copies none,
            # and measured a third of the tax that bench/snapshots.py measures on running ones)
            b = self._batch
            pos = {id(c): [0] * self.max_sequences for c in (self.target, other)}

            def extend(ctx: Context, n: int, per: int) -> None:
                b.clear()
                at = pos[id(ctx)]
                for q in range(n):
                    b.extend([0] * per, at[q], q, outputs="all")
                    at[q] += per
                ctx.decode(b)

            for c in (self.target, other):
                for q in range(self.max_sequences):
                    c.memory.seq_rm(q, -1, -1)
                extend(c, self.max_sequences, 8)
            t_start = time.perf_counter()
            for rnd in range(TAX_ROUNDS + 1):  # each shape on both contexts back to back: a ratio per round
                for n, per in shapes_now:
                    first, second = (self.target, other) if rnd % 2 else (other, self.target)
                    t0 = time.perf_counter()
                    extend(first, n, per)
                    t1 = time.perf_counter()
                    extend(second, n, per)
                    t2 = time.perf_counter()
                    if rnd > 0:  # round 0 warms the new context's shapes up
                        ratios[n, per].append((t1 - t0) / (t2 - t1) if first is other else (t2 - t1) / (t1 - t0))
                if rnd >= TAX_MIN_ROUNDS and time.perf_counter() - t_start > TAX_S:
                    break
            for n_seqs, shapes in layouts.items():
                pts = sorted((per, _tax_side(float(np.median(ratios[n, per])), self.policy.alt_replays, 0.0))
                             for n, per in shapes if ratios.get((n, per)))
                if not pts:
                    continue
                xs, ys = [p for p, _ in pts], [t for _, t in pts]
                out["verify"][str(n_seqs)] = [[n * per, best["verify", n, per] * float(np.interp(per, xs, ys))]
                                              for n, per in shapes]
            if self.policy.alt_replays:
                out["save"], out["restore"] = self._time_checkpoints(other)
        except BaseException:
            other.close()
            raise
        self._stash(other)
        return out if out["verify"] else None

    def _switch_rollback(self, remembered: bool = False) -> None:
        """Move every sequence to a new target context with the other rollback mode (the
        policy's ``switch_wanted``): full state copies into the spare context (or a new
        one), the old context emptied and kept as the spare. Where the new context cannot
        be made (memory), the engine stays and stops switching. ``remembered``: the mode
        an earlier engine ended in, taken at birth (not counted or timed as a switch)."""
        new_mode: Literal["snapshots", "checkpoint"] = "snapshots" if self.rollback == "checkpoint" else "checkpoint"
        t0 = time.perf_counter()
        old = self.target
        new = self._other_target()
        if new is None:
            return
        lost = []  # sequences whose state did not arrive whole: replayed from their history
        try:
            new.set_hidden_output(self.drafter is not None, masked=False)
            for q in self._seqs.values():
                if q.rebuild or q.state.finished:
                    continue
                if q.kv_pos > 0:
                    new.restore(old.checkpoint(q.seq))  # attention KV and recurrent state, at kv_pos - 1
                if new.memory.pos_max(q.seq) != q.kv_pos - 1:
                    lost.append(q)
                elif new_mode == "checkpoint":
                    new.checkpoint(q.seq, partial=True, reuse=True)  # its save buffer, faulted in now
        except Exception:  # the old context is untouched (saving a state only reads it): stay on it
            new.close()
            self.policy.stop_switching()
            return
        except BaseException:
            new.close()
            raise
        for q in lost:
            q.rebuild = True
        self.target = new
        self._stash(old)
        self.rollback = new_mode
        dt = time.perf_counter() - t0
        if remembered:
            self.policy.start_in_alt()
            return
        self.stats.rollback_switches += 1
        self.stats.switch_s += dt
        self.policy.switched(dt)

    def _step(self, seqs: list[_Seq]) -> list[StepEvent]:
        self._clock += 1
        # in sequence-id order: llama.cpp puts only runs of consecutive ids into one micro-batch
        seqs = sorted(seqs, key=lambda q: q.seq)
        if not self._calibrated and any(q.spec.draft_max == "auto" for q in seqs):
            self._calibrate()  # only where a slot is free; engines with auto by default calibrated at birth
        if self.policy.switch_wanted and self.policy.alt is not None:
            self._switch_rollback()
        rebuild = [q for q in seqs if q.rebuild]
        if rebuild:
            self._prefill(rebuild, sample_first=False)
        events: list[StepEvent] = []
        runnable = []
        for q in seqs:
            if q.pos0 >= self.n_ctx_seq:  # no room for id_last itself
                q.state.finish_reason = "length"
                self._finish(q)
                events.append(StepEvent(q.sid, [], True, "length"))
            else:
                runnable.append(q)
        if not runnable:
            return events

        # 1. plan: caps from max_tokens and the context; n-gram proposals as found;
        #    MTP draft lengths fixed, or chosen by the adaptive policy
        caps = {q.seq: self._plan(q) for q in runnable}
        ngram_d: dict[int, list[int]] = {}
        for q in runnable:
            if q.spec.ngram and caps[q.seq] > 0:
                d = self.ngram.propose(np.asarray(q.history, dtype=np.int32), min(caps[q.seq], q.spec.ngram_max))
                if d:
                    ngram_d[q.seq] = d
        if self.drafter is None:  # nothing to choose (and no MTP acceptance to track)
            ks = {q.seq: len(ngram_d.get(q.seq, ())) for q in runnable}
        else:
            cands: dict[int, Candidate] = {}
            self._acc_pool.tick()
            for q in runnable:
                assert q.acc is not None
                q.acc.tick()
                pending = self.drafter.pending(q.seq)
                if q.seq in ngram_d:
                    n = len(ngram_d[q.seq])
                    cands[q.seq] = Candidate(n, q.acc, n, 0, q.n_backlog, pending)
                else:
                    cap = min(caps[q.seq], self._mtp_k(q))
                    cands[q.seq] = Candidate(cap, q.acc, None if q.spec.draft_max == "auto" else cap, q.idle,
                                             q.n_backlog, pending)
            ks = self.policy.choose(cands)
        ks = self._level_tail(runnable, ks, ngram_d)
        room = self.target.n_batch - sum(q.n_backlog + 1 for q in runnable)
        while sum(ks.values()) > room:
            s = max(ks, key=lambda x: ks[x])
            ks[s] -= 1

        # 2. drafts: one MTP-context decode per draft position for every sequence
        drafts: dict[int, list[int]] = {}
        qdists: dict[int, list] = {}  # type: ignore[type-arg]
        source: dict[int, str | None] = {}
        mtp_reqs = []
        for q in runnable:
            k = ks[q.seq]
            drafts[q.seq], source[q.seq] = [], None
            if k <= 0:
                continue
            if q.seq in ngram_d:
                drafts[q.seq], source[q.seq] = ngram_d[q.seq][:k], "ngram"
                continue
            if self.drafter is not None:
                stochastic = self._mode(q) == "rejection"
                mtp_reqs.append(DraftRequest(
                    seq=q.seq, token=q.id_last, pos=q.pos0, hidden=q.pending_h,  # type: ignore[arg-type]
                    n_max=k, n_min=q.spec.draft_min, p_min=q.spec.p_min,
                    sampler=q.draft_sampler if stochastic else None, history=q.history if stochastic else [],
                ))
        if mtp_reqs and self.drafter is not None:
            t0 = time.perf_counter()
            got = self.drafter.draft(mtp_reqs)
            self.stats.draft_s += time.perf_counter() - t0
            for n_rows, secs in self.drafter.last_timings:
                self.policy.costs.draft.observe(n_rows, secs)
            if self.drafter.first_timing is not None:
                self.policy.costs.observe_first(*self.drafter.first_timing)
            for seq, dr in got.items():
                drafts[seq], source[seq] = dr.tokens, ("mtp" if dr.tokens else None)
                if dr.q is not None:
                    qdists[seq] = dr.q

        # 3. checkpoints where the rollback could exceed the snapshots
        ckpts: dict[int, Checkpoint] = {}
        if not self._exact:
            t0 = time.perf_counter()
            for q in runnable:
                if len(drafts[q.seq]) > self.target.n_rs_seq:
                    ckpts[q.seq] = self.target.checkpoint(q.seq, partial=True, reuse=True)
            dt = time.perf_counter() - t0
            self.stats.restore_s += dt
            self.policy.costs.observe_save(len(ckpts), dt)

        # 4. verify: one target decode for everyone
        b = self._batch
        b.clear()
        spans = {}
        for q in runnable:
            d = drafts[q.seq]
            backlog = q.backlog
            if backlog:
                b.extend(backlog, q.kv_pos, q.seq, outputs="none")
            sl = b.extend([q.id_last, *d], q.pos0, q.seq, outputs="all")
            spans[q.seq] = sl
        t0 = time.perf_counter()
        self.target.decode(b)
        dt = time.perf_counter() - t0
        self.stats.verify_s += dt
        if self.drafter is not None:
            layout = [q.n_backlog + 1 + len(drafts[q.seq]) for q in runnable]
            ids = [q.seq for q in runnable]
            one_pass = self.policy.costs.single_ubatch(layout, ids)
            if one_pass:  # the curves are of single decodes
                self.policy.costs.verify.observe(len(runnable), b.n_tokens, dt)
            if self.policy.replays and len(runnable) > 1 and any(q.n_backlog for q in runnable):
                self.policy.costs.observe_level(one_pass)
        logits = self.target.logits_all()
        hidden = self.target.hidden_all() if self.drafter is not None else None

        # 5. accept, roll back, catch up
        o = 0
        mtp_rows: list[int] = []  # the MTP drafts with acceptance estimates: their indices in runnable
        landed = [0] * len(runnable)  # every draft's accepted tokens (MTP or n-gram), in runnable's order
        for j, q in enumerate(runnable):
            d = drafts[q.seq]
            k = len(d)
            rows = logits[o: o + k + 1]
            o += k + 1
            mode = self._mode(q)
            if mode == "greedy":
                n_acc, new = verify_greedy(rows, d, q.sampler, q.history)
            elif mode == "rejection" and q.seq in qdists:
                n_acc, new = verify_rejection(rows, d, qdists[q.seq], q.sampler, q.accept_sampler, q.history)
            else:  # sample-and-match (also for deterministic drafts, e.g. n-gram, under "rejection")
                mode = "match"
                n_acc, new = verify_match(rows, d, q.sampler, q.history)
            # drafts past max_tokens (_level_tail) are verified, never emitted: not in the stats
            left = q.max_tokens - len(q.state.tokens) - 1
            q.state.stats.record(source[q.seq], min(k, left), min(n_acc, left), mode if k else None)
            landed[j] = n_acc
            if source[q.seq] == "mtp" and q.acc is not None:
                mtp_rows.append(j)
            q.idle = 0 if k else q.idle + 1
            sl = spans[q.seq]
            accepted = [q.id_last, *d[:n_acc]]
            if hidden is not None and self.drafter is not None:
                vrows = hidden[sl]
                # (catch_up copies the rows it queues)
                prev = q.pending_h[None, :] if n_acc == 0 else np.vstack(  # type: ignore[index]
                    [q.pending_h[None, :], vrows[:n_acc]])  # type: ignore[index]
                self.drafter.catch_up(q.seq, accepted, q.pos0, prev)
                q.pending_h = np.array(vrows[n_acc])
            if n_acc < k:
                q.state.stats.rollbacks += 1
                if self.target.memory.seq_rm(q.seq, q.pos0 + n_acc + 1, -1):
                    q.kv_pos = q.pos0 + n_acc + 1
                else:
                    ck = ckpts.get(q.seq)
                    if ck is None:
                        raise LlamaError(f"rollback of sequence {q.seq} refused and no checkpoint was taken")
                    t0 = time.perf_counter()
                    self.target.restore(ck)
                    dt = time.perf_counter() - t0
                    self.stats.restore_s += dt
                    self.policy.costs.observe_restore(dt)
                    q.kv_pos = ck.pos_max + 1  # the accepted tokens are replayed with the next verify
                    q.state.stats.checkpoint_restores += 1
            else:
                q.kv_pos = q.pos0 + k + 1
            q.pos0 += n_acc + 1
            emitted = [*d[:n_acc], new]
            q.id_last = new
            before = len(q.state.tokens)
            self._emit(q, emitted)
            events.append(StepEvent(q.sid, q.state.tokens[before:], q.state.finished, q.state.finish_reason))
        del logits, hidden
        if mtp_rows:
            self._observe_drafts(runnable, drafts, landed, mtp_rows)
        for q in runnable:
            if q.state.finished:
                self._finish(q)
        if self.drafter is not None:
            # sequences that stopped drafting still feed the MTP context: keep their queues short;
            # long idle ones feed it only the rows before each shadow guess, and queue no more
            # (a probe's first draft decode carries every queued row, of every sequence)
            live = [q for q in runnable if not q.state.finished]
            long = []
            for q in live:
                if q.idle >= SKIP_IDLE:
                    self.drafter.skip(q.seq, SKIP_KEEP)
                if self.drafter.span(q.seq) > CATCH_UP_QUEUE:
                    long.append(q)
            long += self._eager(live, long)
            if long:
                t0 = time.perf_counter()
                self.drafter.flush([q.seq for q in long], shadow=SHADOW_ROWS)
                self.stats.catch_up_s += time.perf_counter() - t0
                self._shadow_evidence()
        return events

    def _observe_drafts(self, runnable: list[_Seq], drafts: dict[int, list[int]], landed: list[int],
                        mtp_rows: list[int]) -> None:
        """Fold the step's MTP drafts (``runnable[j]`` for j in ``mtp_rows``; ``landed``:
        every draft's accepted tokens) into their sequences' acceptance and the engine's
        pool; for sequences choosing their length, with whether each draft earned its cost
        (:meth:`DraftPolicy.paid_step`: it spaces out the probes)."""
        ks = [len(drafts[x.seq]) for x in runnable]
        auto = {j for j in mtp_rows if runnable[j].spec.draft_max == "auto"}
        paid = self.policy.paid_step(ks, landed, [x.seq for x in runnable]) if auto else []
        for j in mtp_rows:
            q = runnable[j]
            verdict = paid[j] if j in auto else None
            assert q.acc is not None
            q.acc.observe(ks[j], landed[j], verdict)
            self._acc_pool.observe(ks[j], landed[j], verdict)

    def _eager(self, live: list[_Seq], queued: list[_Seq]) -> list[_Seq]:
        """The idle sequences among ``live`` (the step's unfinished ones) that catch up now
        although their queue is short (EAGER_IDLE). None while another sequence drafts: its
        next first draft decode carries their rows anyway, for a few rows' cost instead of
        a decode of their own."""
        assert self.drafter is not None
        if any(q.idle == 0 for q in live):
            return []
        near = [q for q in live if 0 < q.idle < self.eager_idle and q.state.stats.num_drafts
                and q not in queued and self.drafter.pending(q.seq) > 0]
        if not near:
            return []
        # priced in this batch: next to the other sequences of the step, a lone draft's verify
        # rows and MTP decode weigh more than alone (four at ~50% on a 2-core Xeon: ~0.92 of
        # a plain step, where one alone earns ~1.0..1.1 -- and 15 eager flushes after every
        # probe, ~9 ms each, cost that cell 2 ms a step). Refreshed every EAGER_REFRESH steps:
        # the estimates move by a half-life of dozens of steps, and the pricing was ~0.1% of
        # a four-sequence step, every step for 15 after each probe
        stale = [(q, q.acc) for q in near if q.acc is not None and self._clock - q.eager_at >= EAGER_REFRESH]
        if stale:
            ratios = self.policy.steady_ratios([acc for _, acc in stale], self.draft_max, len(live) - 1)
            for (q, _), r in zip(stale, ratios, strict=True):
                q.eager_ratio, q.eager_at = r, self._clock
        return [q for q in near if q.acc is None or q.eager_ratio >= self.eager_ratio]

    def _shadow_evidence(self) -> None:
        """What the MTP head guessed on the catch-up rows of sequences that were not
        drafting, against what the target emitted: 1-token acceptance evidence for
        free, so a sequence whose text turns predictable drafts again without waiting
        for a probe (and one whose text stays unpredictable needs fewer probes)."""
        assert self.drafter is not None
        for seq, pos, guess in self.drafter.shadow_predictions:
            q = self._seqs.get(seq)
            if q is None or q.acc is None or q.idle == 0 or pos + 1 >= len(q.history):
                continue  # drafting sequences have their own (better) evidence
            hit = int(guess == q.history[pos + 1])
            q.acc.observe(1, hit, shadow=True)
            self._acc_pool.observe(1, hit, shadow=True)
            if hit:
                self.policy.wake()

    def _level_tail(self, runnable: list[_Seq], ks: dict[int, int], ngram_d: dict[int, list[int]]) -> dict[int, int]:
        """Fixed-length MTP drafts cut short by max_tokens, drafted on to their length where
        that makes an uneven verify one decode pass. On recurrent memory llama.cpp cuts a
        verify whose sequences carry different row counts into micro-batches: eight
        sequences at k = 3 on a 2-core CPU, a step where one of them had two tokens left
        took 215..250 ms against ~120 for a level one -- three more rows cost far less. The
        tokens past max_tokens are verified, never emitted (nor counted in the stats)."""
        if self.drafter is None or len(runnable) < 2 or self.policy.costs.split is None:
            return ks
        ids = [q.seq for q in runnable]
        layout = [1 + q.n_backlog + ks[q.seq] for q in runnable]
        if self.policy.costs.single_ubatch(layout, ids):
            return ks
        out = dict(ks)
        for q in runnable:
            # (not under rejection sampling: drafting consumes randomness there, and a seeded
            # sequence makes the same tokens alone or next to others)
            if (q.spec.draft_max != "auto" and q.seq not in ngram_d and ks[q.seq] < self._mtp_k(q)
                    and self._mode(q) != "rejection"):
                out[q.seq] = max(ks[q.seq], min(self._mtp_k(q), self._plan(q, past_end=True)))
        level = [1 + q.n_backlog + out[q.seq] for q in runnable]
        return out if self.policy.costs.single_ubatch(level, ids) else ks

    def _mode(self, q: _Seq) -> str:
        v = q.spec.verify
        if v == "auto":
            if q.sampling.greedy:
                return "greedy"
            # Rejection sampling consumes randomness per *draft*, so with draft lengths
            # chosen from timings a seed would no longer reproduce the output;
            # sample-and-match draws once per emitted token, whatever was drafted.
            if q.spec.draft_max == "auto" and q.sampling.seed is not None:
                return "match"
            return "rejection"
        if v in ("match", "rejection") and q.sampling.greedy:
            return "greedy"
        return v

    def _emit(self, q: _Seq, tokens: list[int]) -> None:
        """Append generated tokens, applying stop conditions in order."""
        st = q.state
        for t in tokens:
            st.tokens.append(t)
            st.stats.predicted_n += 1
            q.history.append(t)
            if (self._eog[t] and not q.ignore_eos) or t in q.stop_tokens:
                st.finish_reason = "stop"
                break
            piece = self.model.token_to_piece(t)
            st.text += piece
            if q.stop:
                tail = st.text[-(max(len(s) for s in q.stop) + len(piece) + 8):]
                hit = next((s for s in q.stop if s in tail), None)
                if hit is not None:
                    cut = st.text.rfind(hit)
                    st.text = st.text[:cut]
                    st.stop_hit = hit.decode("utf-8", "replace")
                    st.finish_reason = "stop"
                    break
            if len(st.tokens) >= q.max_tokens:
                st.finish_reason = "length"
                break

    # ------------------------------------------------------------ recovery

    def _recover(self, seqs: list[_Seq]) -> None:
        """After an exception inside a step (Ctrl-C, a failed decode): bring every
        sequence back to a state the next step can use."""
        for q in seqs:
            if q.seq not in self._seqs:
                continue
            try:
                if self.drafter is not None and not self.drafter.ctx.closed:
                    self.drafter.rewind(q.seq, q.pos0)
                if not self.target.closed and self.target.memory.pos_max(q.seq) != q.kv_pos - 1:
                    q.rebuild = True  # replay its history into both contexts at the next step
            except LlamaError:
                q.rebuild = True

    def results(self) -> dict[int, SequenceState]:
        """Every sequence the engine knows, finished or not."""
        out = dict(self._done)
        out.update({q.sid: q.state for q in self._seqs.values()})
        return out


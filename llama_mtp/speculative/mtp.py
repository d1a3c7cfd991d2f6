"""MTPDrafter: the MTP head's own context, kept in step with the target.

Data flow (position p, token x_p, target hidden row h_p):

* The MTP entry at position p is ``(x_p, h_{p-1})``; it predicts ``x_{p+1}``.
  The MTP context's KV must hold correct entries for every position the target
  has accepted ("catch-up"), paired with the *target's* hidden rows.
* A draft for a sequence whose next token ``id_last`` sits at ``pos0`` starts
  with ``(id_last, h_{pos0-1})`` at ``pos0`` -- a correct entry, kept -- and then
  feeds back its own tokens with the MTP's own hidden rows; those entries are
  trimmed once the draft is made.
* Catch-up rows are not decoded on their own: they are queued and ride along
  in the first draft decode of the next round (one MTP decode fewer per step
  than upstream's driver, which re-decodes the whole draft after every verify
  and then rolls the rejected part back).
* That first decode is levelled: a sequence with fewer catch-up rows than another
  decodes its last few entries again, so every sequence carries as many rows and the
  decode is one llama.cpp micro-batch, not one per distinct row count.

All drafting sequences share **one MTP-context decode per draft position**.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from ..batch import Batch
from ..context import Context
from ..draft_head import DraftHead
from ..errors import LlamaError, MTPUnavailableError
from ..model import Model
from ..params import ContextParams
from ..sampling import Distribution, Sampler

_log = logging.getLogger("llama_mtp")

__all__ = ["DRAFT_VOCAB_GROW", "Draft", "DraftRequest", "MTPDrafter"]

#: With a reduced draft vocabulary, room for this many tokens beyond the first
#: ``draft_vocab`` ids: every token a prompt or an accepted draft brings that the head
#: lacks is added (names, code identifiers, other scripts), until the room is used up.
DRAFT_VOCAB_GROW = 4096


@dataclass
class DraftRequest:
    """Draft for sequence ``seq`` whose next token ``token`` sits at ``pos``, with
    ``hidden`` the target's hidden row of the position before (``h_{pos-1}``)."""

    seq: int
    token: int
    pos: int
    hidden: npt.NDArray[np.float32]
    n_max: int
    n_min: int = 0
    p_min: float = 0.0
    sampler: Sampler | None = None          # set: draw drafts from q (rejection sampling)
    history: list[int] = field(default_factory=list)  # for the sampler's penalties


@dataclass
class Draft:
    tokens: list[int]
    q: list[Distribution] | None = None    # the distributions the tokens were drawn from
    p_top: list[float] = field(default_factory=list)


#: Decoded MTP entries each sequence keeps (token and target hidden row, by position) so a
#: draft's first decode can decode them again to level its rows (:meth:`MTPDrafter.draft`).
LEVEL_HISTORY = 8


@dataclass
class _Queue:
    next_pos: int = 0                        # first position neither in the MTP KV nor queued
    tokens: list[int] = field(default_factory=list)
    hidden: list[npt.NDArray[np.float32]] = field(default_factory=list)
    dropped: int = 0                         # rows skip() dropped since rows were last decoded
    #: the last LEVEL_HISTORY entries decoded into the MTP memory: position -> (token, hidden)
    done: dict[int, tuple[int, npt.NDArray[np.float32]]] = field(default_factory=dict)

    @property
    def start(self) -> int:
        return self.next_pos - len(self.tokens)

    def decoded(self, pos: int, token: int, hidden: npt.NDArray[np.float32]) -> None:
        """Entry ``pos`` is now in the MTP memory (kept for :meth:`MTPDrafter.draft`'s levelling)."""
        self.done[pos] = (token, hidden)
        if len(self.done) > LEVEL_HISTORY:
            for p in sorted(self.done)[:len(self.done) - LEVEL_HISTORY]:
                del self.done[p]

    def forget(self, pos: int) -> None:
        """Entries at ``pos`` and after are no longer (or not yet) the memory's."""
        for p in [p for p in self.done if p >= pos]:
            del self.done[p]

    def reopen(self, n: int) -> bool:
        """Put the last ``n`` decoded entries before the queue back in front of it (the caller
        removes them from the memory); False, changing nothing, where they are not all kept."""
        s = self.start
        if n <= 0 or self.dropped or any(s - j not in self.done for j in range(1, n + 1)):
            return False
        back = [self.done[p] for p in range(s - n, s)]
        self.tokens[:0] = [t for t, _ in back]
        self.hidden[:0] = [h for _, h in back]
        return True


TOP_K_P = 10  # like upstream's draft sampler: p_min is judged among the top 10


class MTPDrafter:
    """The MTP context of a speculative setup (on the target model, or on an MTP
    sidecar GGUF that holds only the MTP head)."""

    name = "mtp"
    #: level the rows of a draft's first decode (:meth:`_level`); False: as before (A/Bs)
    level_first = True

    def __init__(
        self,
        model: Model,
        *,
        n_ctx: int,
        n_seq_max: int,
        n_batch: int,
        params: ContextParams | None = None,
        mtp_model: Model | None = None,
        draft_vocab: int | None = None,
        head_required: bool = True,
    ) -> None:
        head = mtp_model or model
        head.require_mtp()
        if mtp_model is not None:
            if mtp_model.n_embd_out != model.n_embd_out or mtp_model.n_vocab != model.n_vocab:
                raise MTPUnavailableError(
                    f"the MTP model {mtp_model.path.name} does not match the target: hidden width "
                    f"{mtp_model.n_embd_out} vs {model.n_embd_out}, vocabulary {mtp_model.n_vocab} vs {model.n_vocab}"
                )
        base = params or ContextParams()
        self.ctx = Context(head, base.replace(n_ctx=n_ctx, n_seq_max=n_seq_max, n_batch=n_batch,
                                              n_ubatch=min(n_batch, base.n_ubatch or n_batch), n_rs_seq=0), mtp=True)
        self.n_vocab = head.n_vocab
        #: may a sequence's MTP memory skip positions (multi-section RoPE models: Qwen3.5 and kin)?
        #: Then :meth:`skip` can drop catch-up rows nobody will draft from.
        self.can_skip = head.positions_may_jump
        self.hidden_dim = self.ctx.hidden_dim
        self.batch = Batch(self.ctx.n_batch, hidden_dim=self.hidden_dim)
        self._queues: dict[int, _Queue] = {}
        self._zero = np.zeros(self.hidden_dim, dtype=np.float32)
        self.decodes = 0
        self.skipped = 0  # catch-up rows dropped by skip()
        self.leveled = 0  # entries decoded again to level a first draft decode (_level)
        self.last_timings: list[tuple[int, float]] = []  # (rows, seconds): last draft()'s pure draft decodes
        #: (drafting sequences, rows, seconds) of the last draft()'s first decode, which also
        #: carried the queued catch-up rows -- what a drafting step's first MTP decode costs
        self.first_timing: tuple[int, int, float] | None = None
        self.shadow_predictions: list[tuple[int, int, int]] = []  # last flush(shadow=...)'s guesses
        #: the reduced draft vocabulary (None: the full LM head, inside the MTP decode); where
        #: its rows cannot be copied, ``head_required=False`` drafts from the full head instead
        self.head: DraftHead | None = None
        if draft_vocab is not None and draft_vocab < head.n_vocab:
            try:
                first_ids = [*range(max(1, draft_vocab)), *np.flatnonzero(head.eog_mask).tolist()]
                self.head = DraftHead(head, first_ids, capacity=min(head.n_vocab, max(1, draft_vocab) + DRAFT_VOCAB_GROW),
                                      n_threads=self.ctx.n_threads[0])  # a few rows: llama.cpp's one-token thread count
                # drafts are decoded without outputs: no logits, the decode skips the full head
            except MTPUnavailableError as e:
                if head_required:
                    self.ctx.close()
                    raise
                _log.info("reduced draft vocabulary unavailable (%s); drafting from the whole vocabulary", e)
            except BaseException:
                self.ctx.close()
                raise

    def close(self) -> None:
        if self.head is not None:
            self.head.close()
        self.ctx.close()

    @property
    def draft_vocab(self) -> int:
        """Tokens a draft can propose: the reduced vocabulary's size now, else the model's."""
        return len(self.head) if self.head is not None else self.n_vocab

    def learn(self, tokens: list[int]) -> None:
        """Give the reduced draft vocabulary the rows of ``tokens`` it lacks (while it has room)."""
        h = self.head
        if h is not None and h.room:
            new = [t for t in tokens if t not in h]
            if new:
                h.add(new)

    def _rows(self, idx: slice | npt.NDArray[np.intp]) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.float32]]:
        """(logits, hidden rows) of the last decode's read rows ``idx`` (batch entries: its
        outputs, where the full head made logits). Logits are over the draft vocabulary:
        :meth:`_token` maps columns to tokens."""
        hid = self.ctx.hidden_all()[idx]  # a row for every entry (see Context.set_hidden_output)
        if self.head is None:  # logits of the outputs, in batch order
            return self.ctx.logits_all(), hid
        return self.head.logits(hid), hid

    def _token(self, col: Any) -> Any:
        """The token(s) of draft-vocabulary column(s) ``col``."""
        return col if self.head is None else self.head.to_ids(col)

    def _full_row(self, row: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
        """A row of the draft vocabulary as a vocabulary-wide row (-inf elsewhere)."""
        if self.head is None:
            return row
        full = np.full(self.n_vocab, -np.inf, dtype=np.float32)
        full[self.head.ids] = row
        return full

    def time_draft_decode(self, seq: int, n: int, token: int, hidden: npt.NDArray[np.float32]) -> None:
        """One draft decode of ``n`` outputs on slot ``seq`` (emptied first), head included:
        what the adaptive policy's calibration times."""
        self.ctx.memory.seq_rm(seq, -1, -1)
        self.batch.clear()
        for j in range(n):
            self.batch.add(token, j, seq, output=self.head is None, hidden=hidden)
        self.ctx.decode(self.batch)
        self._rows(slice(0, n))

    # ------------------------------------------------------------ sequences

    def _q(self, seq: int) -> _Queue:
        q = self._queues.get(seq)
        if q is None:
            q = self._queues[seq] = _Queue()
        return q

    def remove(self, seq: int) -> None:
        """Forget a sequence: its queue and its MTP memory."""
        self._queues.pop(seq, None)
        self.ctx.memory.seq_rm(seq, -1, -1)

    def move(self, src: int, dst: int) -> None:
        """Move sequence ``src``'s MTP memory and queue to the free slot ``dst``."""
        self.ctx.move(src, dst)
        q = self._queues.pop(src, None)
        self._queues.pop(dst, None)
        if q is not None:
            self._queues[dst] = q

    def rewind(self, seq: int, pos: int) -> None:
        """Make the MTP state of ``seq`` consistent after an interrupted decode: the
        memory holds exactly the decoded catch-up entries, the queue the rest, and
        nothing at or past ``pos`` (the sequence's next draft start)."""
        q = self._q(seq)
        keep = min(q.start, pos)
        self.ctx.memory.seq_rm(seq, keep, -1)
        q.forget(keep)
        if q.next_pos > pos:  # an aborted draft had already kept its start row
            n_drop = q.next_pos - pos
            del q.tokens[max(0, len(q.tokens) - n_drop):]
            del q.hidden[max(0, len(q.hidden) - n_drop):]
            q.next_pos = pos
        if q.start < keep:  # (defensive) rows the memory no longer holds
            raise LlamaError(f"MTP queue of sequence {seq} lost rows below {keep}")

    def next_pos(self, seq: int) -> int:
        return self._q(seq).next_pos

    def pending(self, seq: int) -> int:
        """Catch-up rows queued for ``seq``."""
        return len(self._q(seq).tokens)

    def span(self, seq: int) -> int:
        """Positions of ``seq`` since its rows were last decoded: queued or dropped by :meth:`skip`."""
        q = self._q(seq)
        return len(q.tokens) + q.dropped

    def catch_up(self, seq: int, tokens: list[int], pos0: int, hidden: npt.NDArray[np.float32]) -> None:
        """Queue MTP entries ``(tokens[i], hidden[i])`` at ``pos0 + i``; ``hidden[i]`` is
        the target's row of the position before. Entries the MTP already holds are
        skipped; they are decoded with the next draft (or :meth:`flush`)."""
        q = self._q(seq)
        skip = q.next_pos - pos0
        if skip < 0:
            raise LlamaError(f"MTP catch-up for sequence {seq} skips positions {q.next_pos}..{pos0 - 1}")
        for i in range(skip, len(tokens)):
            q.tokens.append(int(tokens[i]))
            q.hidden.append(np.array(hidden[i], dtype=np.float32))
        q.next_pos = max(q.next_pos, pos0 + len(tokens))
        self.learn(q.tokens[len(q.tokens) - max(0, len(tokens) - skip):])

    def _level(self, live: list[DraftRequest], room: int) -> int:
        """Level the rows of a draft's first decode: a sequence with fewer queued catch-up
        rows than another decodes its last few entries again (the same token and target
        row, so the same memory). With a KV stream per sequence llama.cpp cuts a batch into
        micro-batches that take the same number of rows from each of a run of sequences,
        so after a verify that accepted 0, 2 and 3 drafts the first decode was three passes
        over the MTP layer; level, it is one. Returns the rows added (0: none, as where the
        memory is one unified stream, or the history does not reach)."""
        if not self.level_first or len(live) < 2 or self.ctx.kv_unified:
            return 0
        rows = {r.seq: self.pending(r.seq) for r in live}
        top = max(rows.values())
        added = sum(top - n for n in rows.values())
        if added == 0 or sum(rows.values()) + added + len(live) > room:
            return 0
        total = 0
        for r in live:
            n = top - rows[r.seq]
            q = self._q(r.seq)
            if n > 0 and q.reopen(n):
                if self.ctx.memory.seq_rm(r.seq, q.start, -1):
                    total += n
                else:  # (a memory that cannot drop its tail: leave this one as it was)
                    del q.tokens[:n]
                    del q.hidden[:n]
        self.leveled += total
        return total

    def skip(self, seq: int, keep: int) -> int:
        """Drop all but the last ``keep`` queued catch-up rows of ``seq``; returns how many
        were dropped. The MTP memory keeps what it holds, with a gap of positions it never
        sees: its attention loses those rows, which only matters for drafts made soon after
        (and never for the output, which the target alone decides). Only where
        :attr:`can_skip` (elsewhere a sequence's positions must stay consecutive)."""
        q = self._queues.get(seq)
        if not self.can_skip or q is None or len(q.tokens) <= keep:
            return 0
        n = len(q.tokens) - max(0, keep)
        q.forget(q.start)  # (never decoded: nothing there may be decoded again)
        del q.tokens[:n]
        del q.hidden[:n]
        q.dropped += n
        self.skipped += n
        return n

    def _add_queued(self, seqs: list[int], room: int, shadow: int = 0) -> list[tuple[int, int]]:
        """Put queued rows of ``seqs`` into the batch (up to ``room``); returns what was taken.
        The last ``shadow`` rows of each sequence are read (see :meth:`flush`): their batch
        entries go to ``self._shadow_at``, and they are outputs unless a draft head reads them."""
        taken = []
        b = self.batch
        self._shadow_at: list[int] = []
        for seq in seqs:
            q = self._queues.get(seq)
            if q is None or not q.tokens or room <= 0:
                continue
            n = min(len(q.tokens), room)
            flags = np.zeros(n, dtype=bool)
            if shadow:
                self._shadow_at.extend(range(b.n_tokens + max(0, n - shadow), b.n_tokens + n))
                flags[-shadow:] = self.head is None
            b.extend(q.tokens[:n], q.start, seq, outputs=flags, hidden=np.stack(q.hidden[:n]))
            taken.append((seq, n))
            room -= n
        return taken

    def _consume(self, taken: list[tuple[int, int]]) -> None:
        for seq, n in taken:
            q = self._queues[seq]
            p0 = q.start
            for i in range(max(0, n - LEVEL_HISTORY), n):
                q.decoded(p0 + i, q.tokens[i], q.hidden[i])
            del q.tokens[:n]
            del q.hidden[:n]
            q.dropped = 0

    def flush(self, seqs: list[int] | None = None, shadow: int = 0) -> int:
        """Decode queued catch-up rows now; returns how many decodes that took.

        ``shadow > 0`` also reads what the MTP head predicts after the last ``shadow``
        rows of each sequence (:attr:`shadow_predictions`: ``(seq, pos, token)``, the
        head's guess for position ``pos + 1``) -- acceptance evidence for sequences
        that are not drafting, for the price of a few output rows.
        """
        order = list(self._queues) if seqs is None else seqs
        n_dec = 0
        self.shadow_predictions = []
        while any(self._queues.get(s) and self._queues[s].tokens for s in order):
            self.batch.clear()
            taken = self._add_queued(order, self.batch.capacity, shadow=shadow)
            self.ctx.decode(self.batch)
            if shadow and self._shadow_at:
                outs = np.asarray(self._shadow_at)
                guess = self._token(np.argmax(self._rows(outs)[0], axis=1))
                for j, g in zip(outs, guess, strict=True):
                    self.shadow_predictions.append(
                        (int(self.batch.seq[j, 0]), int(self.batch.pos[j]), int(g)))
            self._consume(taken)
            n_dec += 1
        self.decodes += n_dec
        return n_dec

    def prefill(self, seq: int, tokens: npt.NDArray[np.int32] | list[int], pos0: int,
                hidden_prev: npt.NDArray[np.float32]) -> None:
        """Catch up a prompt chunk now: ``hidden_prev[i]`` is the target row before ``tokens[i]``."""
        self.catch_up(seq, list(tokens), pos0, hidden_prev)
        self.flush([seq])

    # ------------------------------------------------------------ drafting

    def draft(self, requests: list[DraftRequest]) -> dict[int, Draft]:
        """Draft for every request, one MTP decode per draft position.

        The first decode also carries every queued catch-up row (of any sequence,
        as far as the batch has room), then the start row of each request.
        """
        out = {r.seq: Draft(tokens=[], q=[] if r.sampler is not None else None) for r in requests}
        live = [r for r in requests if r.n_max > 0]
        self.last_timings = []
        self.first_timing = None
        if not live:
            return out
        b = self.batch
        cap = b.capacity
        # queued rows of the requesting sequences must go first (their start rows follow them)
        want = {r.seq for r in live}
        for r in live:
            q = self._q(r.seq)
            if q.next_pos != r.pos:
                raise LlamaError(f"MTP context of sequence {r.seq} is at position {q.next_pos}, draft asked at {r.pos}")
        if sum(self.pending(s) for s in want) + len(live) > cap:
            self.flush(sorted(want))  # too much backlog for one batch: catch up separately first
        self._level(live, cap)
        b.clear()
        taken = self._add_queued([r.seq for r in live], cap - len(live))
        others = [s for s in self._queues if s not in want]
        taken += self._add_queued(others, cap - len(live) - b.n_tokens)
        first = b.n_tokens
        out_flag = self.head is None
        self.learn([r.token for r in live])  # start rows go to the memory without catch_up
        for r in live:
            b.add(r.token, r.pos, r.seq, output=out_flag, hidden=r.hidden)
        active = live
        step = 0
        while active:
            t0 = time.perf_counter()
            self.ctx.decode(b)
            logits, hidden = self._rows(slice(first, b.n_tokens))
            dt = time.perf_counter() - t0
            self.decodes += 1
            if step > 0:
                self.last_timings.append((b.n_tokens, dt))
            else:  # the first decode also carries catch-up rows: not a clean draft cost
                self.first_timing = (len(live), b.n_tokens, dt)
                self._consume(taken)
                for r in live:
                    q = self._q(r.seq)
                    q.next_pos = r.pos + 1  # the start row is a correct entry: keep it
                    q.dropped = 0
                    q.decoded(r.pos, r.token, np.array(r.hidden, dtype=np.float32))
            nxt: list[DraftRequest] = []
            rows: list[tuple[int, npt.NDArray[np.float32]]] = []
            for j, r in enumerate(active):
                d = out[r.seq]
                row = logits[j]
                if r.sampler is not None:
                    dist = r.sampler.distribution(self._full_row(row), r.history + d.tokens)
                    tok = int(dist[0][r.sampler.draw(dist[1])])
                    col = tok if self.head is None else self.head.column(tok)
                    assert d.q is not None
                    d.q.append(dist)
                else:
                    col = int(np.argmax(row))
                    tok = int(self._token(col))
                if r.p_min > 0.0:
                    top = np.partition(row, len(row) - TOP_K_P)[len(row) - TOP_K_P:] if len(row) > TOP_K_P else row
                    p = float(np.exp(row[col] - top.max()) / np.exp(top - top.max()).sum())
                    d.p_top.append(p)
                    if p < r.p_min:
                        if d.q is not None:
                            d.q.pop()
                        continue  # not confident enough: stop this sequence's draft
                d.tokens.append(tok)
                if len(d.tokens) < r.n_max:
                    nxt.append(r)
                    rows.append((tok, np.array(hidden[j])))
            step += 1
            if not nxt:
                break
            b.clear()
            first = 0
            for r, (tok, h) in zip(nxt, rows, strict=True):
                b.add(tok, r.pos + len(out[r.seq].tokens), r.seq, output=out_flag, hidden=h)
            active = nxt
        del logits, hidden
        for r in live:
            # entries past the start row were fed the MTP's own hidden rows: trim them
            if len(out[r.seq].tokens) > 1:
                self.ctx.memory.seq_rm(r.seq, r.pos + 1, -1)
            if len(out[r.seq].tokens) < r.n_min:
                out[r.seq] = Draft(tokens=[], q=[] if r.sampler is not None else None)
        return out

    def stats(self) -> dict[str, Any]:
        return {"decodes": self.decodes, "skipped": self.skipped, "leveled": self.leveled,
                "queued": {s: len(q.tokens) for s, q in self._queues.items()}}

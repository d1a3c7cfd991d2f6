"""Context, Batch, Memory, checkpoints: decoding and rollback on the hybrid model."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import greedy_reference, logits_atol

import llama_mtp as lm

PROMPT_TEXT = "Multi-token prediction drafts several tokens ahead"


def decode_all(ctx: lm.Context, tokens: list[int], pos0: int = 0, seq: int = 0) -> np.ndarray:
    """One decode with every row an output; returns a copy of the logits."""
    b = lm.Batch(len(tokens))
    b.extend(tokens, pos0, seq, outputs="all")
    ctx.decode(b)
    return np.array(ctx.logits_all())


def decode_one_by_one(ctx: lm.Context, tokens: list[int], pos0: int = 0, seq: int = 0) -> np.ndarray:
    b = lm.Batch(1)
    rows = []
    for i, t in enumerate(tokens):
        b.clear()
        b.add(t, pos0 + i, seq, output=True)
        ctx.decode(b)
        rows.append(np.array(ctx.logits(-1)))
    return np.stack(rows)


def test_context_properties(trunk: lm.Model) -> None:
    with lm.Context(trunk, n_ctx=256, n_seq_max=4, n_rs_seq=3, n_threads=2) as ctx:
        assert ctx.n_ctx >= 256 and ctx.n_seq_max == 4 and ctx.n_rs_seq == 3
        assert ctx.n_batch == 256 or ctx.n_batch >= 1
        assert ctx.n_threads == (2, 2)
        assert ctx.supports_partial_rollback
        assert not ctx.is_mtp
    with lm.Context(trunk, n_ctx=256) as ctx:
        assert ctx.n_rs_seq == 0 and not ctx.supports_partial_rollback


def test_greedy_is_deterministic(trunk: lm.Model) -> None:
    prompt = trunk.tokenize(PROMPT_TEXT)
    assert greedy_reference(trunk, prompt, 24) == greedy_reference(trunk, prompt, 24)


def test_batch_equals_token_by_token(trunk: lm.Model) -> None:
    """A prefill batch and one-token decodes see the same sequence: same argmax, ~same logits."""
    toks = trunk.tokenize(PROMPT_TEXT)
    with lm.Context(trunk, n_ctx=256) as a, lm.Context(trunk, n_ctx=256) as b:
        la = decode_all(a, toks)
        lb = decode_one_by_one(b, toks)
    assert (la.argmax(1) == lb.argmax(1)).all()
    np.testing.assert_allclose(la, lb, rtol=0, atol=logits_atol(lb, 2e-4))


def test_partial_rollback_hybrid(trunk: lm.Model) -> None:
    """decode 4, remove 2, re-decode -> the same logits as a clean run (n_rs_seq snapshots)."""
    toks = trunk.tokenize(PROMPT_TEXT)[:6]
    alt = [t + 1 for t in toks[4:]]
    with lm.Context(trunk, n_ctx=256, n_rs_seq=4) as ctx, lm.Context(trunk, n_ctx=256) as clean:
        decode_all(ctx, toks[:2])
        decode_all(ctx, [toks[2], toks[3], alt[0], alt[1]], pos0=2)  # one batch, then roll its tail back
        assert ctx.memory.pos_max(0) == 5
        assert ctx.memory.seq_rm(0, 4, -1) is True
        assert ctx.memory.pos_max(0) == 3
        assert ctx.memory.seq_rm(0, 3, -1) is False  # a second rollback before a decode is refused
        got = decode_all(ctx, toks[4:6], pos0=4)
        decode_all(clean, toks[:4])
        want = decode_all(clean, toks[4:6], pos0=4)
    # the same history, batched differently: ~1e-6 apart on a CPU, ~2e-3 of the scale on a GPU
    np.testing.assert_allclose(got, want, rtol=0, atol=logits_atol(want, 2e-5))


def test_rollback_refused_without_snapshots(trunk: lm.Model) -> None:
    toks = trunk.tokenize(PROMPT_TEXT)[:6]
    with lm.Context(trunk, n_ctx=256) as ctx:  # n_rs_seq = 0
        decode_all(ctx, toks)
        assert ctx.memory.seq_rm(0, 4, -1) is False
        assert ctx.memory.pos_max(0) == 5  # untouched
        assert ctx.memory.seq_rm(0, -1, -1) is True  # removing a whole sequence never fails
        assert ctx.memory.pos_max(0) == -1


@pytest.mark.parametrize("reuse", [False, True])
@pytest.mark.parametrize("partial", [False, True])
def test_checkpoint_restore(trunk: lm.Model, partial: bool, reuse: bool) -> None:
    toks = trunk.tokenize(PROMPT_TEXT)
    with lm.Context(trunk, n_ctx=256) as ctx:
        decode_all(ctx, toks[:4])
        ckpt = ctx.checkpoint(0, partial=partial, reuse=reuse)
        assert ckpt.pos_max == 3 and ckpt.nbytes > 0 and ckpt.partial is partial
        first = decode_all(ctx, toks[4:7], pos0=4)
        decode_all(ctx, [5, 6, 7], pos0=7)  # wander off
        ctx.restore(ckpt)
        assert ctx.memory.pos_max(0) == 3
        again = decode_all(ctx, toks[4:7], pos0=4)
    np.testing.assert_array_equal(first, again)


def test_checkpoint_reuse_keeps_one_buffer_per_sequence(trunk: lm.Model) -> None:
    """reuse=True writes into the sequence's own buffer: no new allocation for the next
    checkpoint of that sequence (which replaces the last), none shared across sequences."""
    toks = trunk.tokenize(PROMPT_TEXT) * 4
    with lm.Context(trunk, n_ctx=256, n_seq_max=2) as ctx:
        decode_all(ctx, toks[:4], seq=0)
        decode_all(ctx, toks[:2], seq=1)
        a = ctx.checkpoint(0, partial=True, reuse=True)
        b = ctx.checkpoint(1, partial=True, reuse=True)
        assert not np.shares_memory(a.data, b.data)
        saved = bytes(a.data)
        decode_all(ctx, toks[4:6], pos0=4, seq=0)
        a2 = ctx.checkpoint(0, partial=True, reuse=True)
        assert np.shares_memory(a.data, a2.data) and a2.pos_max == 5
        assert bytes(a2.data) != saved  # the state moved on; the old checkpoint is replaced
        first = decode_all(ctx, toks[6:8], pos0=6, seq=0)
        ctx.restore(a2)
        assert ctx.memory.pos_max(0) == 5
        np.testing.assert_array_equal(first, decode_all(ctx, toks[6:8], pos0=6, seq=0))


def test_checkpoint_into_other_sequence(trunk: lm.Model) -> None:
    toks = trunk.tokenize(PROMPT_TEXT)
    with lm.Context(trunk, n_ctx=256, n_seq_max=2) as ctx:
        decode_all(ctx, toks[:4], seq=0)
        ctx.restore(ctx.checkpoint(0), seq=1)
        a = decode_all(ctx, toks[4:6], pos0=4, seq=0)
        b = decode_all(ctx, toks[4:6], pos0=4, seq=1)
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)


def test_move_a_sequence(trunk: lm.Model) -> None:
    """move() carries a sequence's whole state to another id and leaves the old one empty;
    an empty sequence moved empties the destination."""
    toks = trunk.tokenize(PROMPT_TEXT)
    with lm.Context(trunk, n_ctx=256, n_seq_max=3) as ctx:
        decode_all(ctx, toks[:4], seq=0)
        decode_all(ctx, toks[:2], seq=2)
        ctx.move(0, 2)
        assert ctx.memory.pos_max(0) == -1 and ctx.memory.pos_max(2) == 3
        a = decode_all(ctx, toks[4:6], pos0=4, seq=2)
        ctx.move(1, 2)
        assert ctx.memory.pos_max(2) == -1
    with lm.Context(trunk, n_ctx=256) as ref:
        decode_all(ref, toks[:4])
        b = decode_all(ref, toks[4:6], pos0=4)
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)


def test_memory_ops(trunk: lm.Model) -> None:
    toks = trunk.tokenize(PROMPT_TEXT)
    with lm.Context(trunk, n_ctx=256, n_seq_max=3) as ctx:
        decode_all(ctx, toks[:5], seq=0)
        ctx.memory.seq_cp(0, 2)
        assert ctx.memory.pos_max(2) == 4 and 0 <= ctx.memory.pos_min(2) <= 4  # hybrid: recurrent holds the last
        ctx.memory.seq_keep(2)
        assert ctx.memory.pos_max(0) == -1 and ctx.memory.pos_max(2) == 4
        assert not ctx.memory.can_shift
        with pytest.raises(lm.LlamaError, match="cannot shift"):
            ctx.memory.seq_add(2, 0, -1, 3)
        ctx.memory.clear()
        assert ctx.memory.pos_max(2) == -1
        for bad in (3, -2, 1.0, "0"):
            with pytest.raises(lm.InvalidBatchError):
                ctx.memory.pos_max(bad)  # type: ignore[arg-type]


def test_mtp_context_and_hidden_rows(planted: lm.Model) -> None:
    toks = planted.tokenize(PROMPT_TEXT)
    with lm.Context(planted, n_ctx=256, n_rs_seq=3) as tgt, lm.Context(planted, n_ctx=256, mtp=True) as dft:
        assert dft.is_mtp and dft.hidden_dim == planted.n_embd_out
        tgt.set_hidden_output(True, masked=False)
        b = lm.Batch(len(toks))
        b.extend(toks, 0, 0)  # only the last row is an output, but hidden rows exist for all
        tgt.decode(b)
        h = tgt.hidden_all()
        assert h.shape == (len(toks), planted.n_embd_out) and np.isfinite(h).all()
        np.testing.assert_array_equal(tgt.hidden(2), h[2])
        assert not h.flags.writeable
        # the MTP context takes (token, hidden) pairs and gives a hidden row for every entry
        bd = lm.Batch(len(toks), hidden_dim=dft.hidden_dim)
        prev = np.vstack([np.zeros((1, dft.hidden_dim), np.float32), h[:-1]])
        bd.extend(toks, 0, 0, outputs="last", hidden=prev)
        dft.decode(bd)
        assert dft.logits(-1).shape == (planted.n_vocab,)
        hd = dft.hidden_all()
        assert hd.shape == (len(toks), planted.n_embd_out)
        np.testing.assert_array_equal(dft.hidden(-1), hd[-1])
        # masked rows would be the batch's first rows, not its outputs (llama.cpp's MTP graph)
        with pytest.raises(ValueError, match="first rows"):
            dft.set_hidden_output(True, masked=True)
        # planted: the MTP head predicts what the target predicts
        assert int(np.argmax(dft.logits(-1))) == int(np.argmax(tgt.logits(-1)))


def test_bad_batches(planted: lm.Model) -> None:
    with lm.Context(planted, n_ctx=64, n_batch=8, n_seq_max=2) as ctx, lm.Context(planted, n_ctx=64, mtp=True) as dft:
        cases = []
        b = lm.Batch(4)
        cases.append(b)  # empty
        b = lm.Batch(4)
        b.add(planted.n_vocab, 0, 0)
        cases.append(b)
        b = lm.Batch(4)
        b.add(-1, 0, 0)
        cases.append(b)
        b = lm.Batch(4)
        b.add(5, 0, 2)  # seq >= n_seq_max
        cases.append(b)
        b = lm.Batch(4)
        b.add(5, -3, 0)
        cases.append(b)
        b = lm.Batch(16)
        b.extend(list(range(10, 20)), 0, 0)  # > n_batch
        cases.append(b)
        b = lm.Batch(4, hidden_dim=planted.n_embd_out)
        b.add(5, 0, 0, hidden=np.zeros(planted.n_embd_out))
        cases.append(b)
        for bad in cases:
            with pytest.raises(lm.InvalidBatchError):
                ctx.decode(bad)
        b = lm.Batch(4)
        b.add(5, 0, 0, output=True)
        with pytest.raises(lm.InvalidBatchError, match="hidden"):
            dft.decode(b)  # an MTP context needs hidden rows
        b = lm.Batch(4, hidden_dim=8)
        b.add(5, 0, 0, hidden=np.zeros(8))
        with pytest.raises(lm.InvalidBatchError, match="wide"):
            dft.decode(b)
        # llama.cpp's own validation (a position the sequence already holds)
        good = lm.Batch(4)
        good.extend([5, 6], 0, 0)
        ctx.decode(good)
        overlap = lm.Batch(4)
        overlap.add(7, 1, 0, output=True)
        with pytest.raises(lm.InvalidBatchError) as info:
            ctx.decode(overlap)
        assert info.value.code == -1 and info.value.log
        # the context is still fine
        ok = lm.Batch(4)
        ok.add(7, 2, 0, output=True)
        ctx.decode(ok)
        assert ctx.memory.pos_max(0) == 2
    with pytest.raises(lm.InvalidBatchError):
        lm.Batch(2).extend([1, 2, 3], 0, 0)
    with pytest.raises(ValueError):
        lm.Batch(0)
    with pytest.raises(lm.InvalidBatchError):
        lm.Batch(4, hidden_dim=4).add(1, 0, 0, hidden=np.zeros(3))


def test_output_access_rules(planted: lm.Model) -> None:
    with lm.Context(planted, n_ctx=64) as ctx:
        with pytest.raises(lm.StaleOutputError):
            ctx.logits(-1)
        b = lm.Batch(4)
        b.extend([5, 6, 7], 0, 0)  # last only
        ctx.decode(b)
        assert ctx.n_outputs() == 1
        with pytest.raises(IndexError):
            ctx.logits(0)
        with pytest.raises(IndexError):
            ctx.logits(5)
        with pytest.raises(lm.LlamaError, match="hidden rows are off"):
            ctx.hidden(-1)
        view = ctx.logits(-1)
        with pytest.raises(ValueError):
            view[0] = 1.0  # read-only
        # a larger output buffer while a view is alive would move memory under it: refused
        big = lm.Batch(4)
        big.extend([8, 9, 10], 3, 0, outputs="all")
        with pytest.raises(lm.StaleOutputError, match="copy"):
            ctx.decode(big)
        kept = np.array(view)
        del view
        ctx.decode(big)
        assert ctx.logits_all().shape == (3, planted.n_vocab)
        assert kept.shape == (planted.n_vocab,)


def test_kv_full_is_typed(planted: lm.Model) -> None:
    with lm.Context(planted, n_ctx=256, n_batch=256) as ctx:
        n = ctx.n_ctx_seq
        b = lm.Batch(n)
        b.extend([10 + (i % 200) for i in range(n)], 0, 0)
        ctx.decode(b)
        b.clear()
        b.add(7, n, 0, output=True)
        with pytest.raises(lm.KVCacheFullError) as info:
            ctx.decode(b)
        assert info.value.code == 1
        assert ctx.memory.pos_max(0) == n - 1  # untouched

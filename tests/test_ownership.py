"""Native handles are owned from birth: idempotent close, use-after-close, lifetimes."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest

import llama_mtp as lm


def test_close_is_idempotent_and_use_after_close_raises(model_path) -> None:
    m = lm.Model(model_path("planted"))
    ctx = lm.Context(m, n_ctx=64)
    ctx.close()
    ctx.close()
    assert ctx.closed
    b = lm.Batch(2)
    b.add(5, 0, 0, output=True)
    with pytest.raises(lm.ClosedError):
        ctx.decode(b)
    with pytest.raises(lm.ClosedError):
        ctx.memory.pos_max(0)
    with pytest.raises(lm.ClosedError):
        ctx.checkpoint(0)
    m.close()
    m.close()
    for call in (lambda: m.tokenize("x"), lambda: m.detokenize([5]), lambda: m.metadata, lambda: lm.Context(m)):
        with pytest.raises(lm.ClosedError):
            call()
    assert "closed" in repr(m) and "closed" in repr(ctx)


def test_context_manager(model_path) -> None:
    with lm.Model(model_path("planted")) as m, lm.Context(m, n_ctx=64) as ctx:
        pass
    assert m.closed and ctx.closed


def test_model_close_closes_its_contexts(model_path) -> None:
    m = lm.Model(model_path("planted"))
    a, b = lm.Context(m, n_ctx=64), lm.Context(m, n_ctx=64, mtp=True)
    m.close()
    assert a.closed and b.closed
    with pytest.raises(lm.ClosedError):
        a.memory.clear()


def test_context_keeps_model_alive(model_path) -> None:
    m = lm.Model(model_path("planted"))
    ref = weakref.ref(m)
    ctx = lm.Context(m, n_ctx=64)
    del m
    gc.collect()
    assert ref() is not None  # the context holds its model
    b = lm.Batch(2)
    b.add(5, 0, 0, output=True)
    ctx.decode(b)
    del ctx
    gc.collect()
    assert ref() is None


def test_dropped_model_is_collected(model_path) -> None:
    m = lm.Model(model_path("planted"))
    ref = weakref.ref(m)
    del m
    gc.collect()
    assert ref() is None


def test_views_outlive_close(model_path) -> None:
    """Closing under a live numpy view defers the free: the view never dangles."""
    m = lm.Model(model_path("planted"))
    ctx = lm.Context(m, n_ctx=64)
    b = lm.Batch(4)
    b.extend([5, 6, 7], 0, 0, outputs="all")
    ctx.decode(b)
    view = ctx.logits_all()
    copy = np.array(view)
    row = view[1]
    m.close()  # closes ctx too
    assert ctx.closed and m.closed
    gc.collect()
    np.testing.assert_array_equal(view, copy)
    np.testing.assert_array_equal(row, copy[1])
    del view, row
    gc.collect()

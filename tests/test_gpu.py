"""On a GPU build with a GPU present: layers really offload, the engine stays lossless
with both rollback modes, checkpoints round-trip device memory. Skipped elsewhere (a
CPU-only build, or no device). (A context too large for the machine is refused before
llama.cpp tries, everywhere: tests/test_bad_input.py.)"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import assert_greedy_matches, greedy_reference_margins

import llama_mtp as lm
from llama_mtp.speculative import SpeculativeEngine

INFO = lm.build_info()
GPUS = [d for d in INFO["devices"] if d["kind"] in ("gpu", "igpu")]

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not (INFO["capabilities"]["gpu_offload"] and GPUS), reason="needs a GPU build and a GPU"),
]

GREEDY = lm.SamplingParams.greedy_params()
PROMPTS = ["Multi-token prediction", "the model", "every accepted draft saves a whole decoding", "one"]


def test_build_reports_the_device() -> None:
    assert any(b.lower() not in ("cpu", "blas", "rpc") for b in INFO["backends"]), INFO["backends"]
    assert all(d["memory_total"] > 0 for d in GPUS)


def test_offloaded_logits_match_the_cpu(model_path) -> None:
    """The same prompt through every layer on the GPU and on the CPU: same argmax, close logits."""
    with lm.Model(model_path("trunk"), n_gpu_layers=-1) as gpu, lm.Model(model_path("trunk"), n_gpu_layers=0) as cpu:
        toks = gpu.tokenize("Multi-token prediction drafts several tokens ahead")
        rows = []
        for m in (gpu, cpu):
            with lm.Context(m, n_ctx=128) as ctx:
                b = lm.Batch(len(toks))
                b.extend(toks, 0, 0, outputs="all")
                ctx.decode(b)
                rows.append(np.array(ctx.logits_all()))
    g, c = rows
    assert (g.argmax(1) == c.argmax(1)).all()
    np.testing.assert_allclose(g, c, rtol=0, atol=5e-3 * float(np.abs(c).max()))


@pytest.mark.parametrize("rollback", ["snapshots", "checkpoint"])
@pytest.mark.parametrize("draft_max", [3, "auto"])
@pytest.mark.parametrize("name", ["random", "noisy", "trunk", "planted"])
def test_engine_is_lossless_on_the_gpu(model_path, name: str, draft_max: int | str, rollback: str) -> None:
    """Four sequences drafting, verifying and rolling back on device memory: greedy output is
    token for token plain greedy decoding on the same offloaded model (up to near-ties of
    the reference: on the random model one step's two best logits are 0.0016 apart, and the
    GPU's batched kernels move logits by ~2e-3)."""
    with lm.Model(model_path(name), n_gpu_layers=-1) as model:
        prompts = [model.tokenize(t) for t in PROMPTS]
        lengths = [24 + 7 * i for i in range(len(prompts))]
        with SpeculativeEngine(model, max_sequences=len(prompts), n_ctx=256, draft_max=draft_max,  # type: ignore[arg-type]
                               sampling=GREEDY, rollback=rollback) as eng:
            ids = eng.add_many([dict(prompt=p, max_tokens=n) for p, n in zip(prompts, lengths, strict=True)])
            while eng.active:
                eng.step()
            got = [eng.sequence(i).tokens for i in ids]
            stats = eng.stats.spec
        for p, n, g in zip(prompts, lengths, got, strict=True):
            assert_greedy_matches(g, greedy_reference_margins(model, p, n))
    if draft_max == 3:
        assert stats.num_drafts > 0
        if name == "planted":
            assert stats.acceptance_rate == 1.0
        if name == "random":
            assert stats.rollbacks > 0
            assert (stats.checkpoint_restores > 0) == (rollback == "checkpoint")


def test_rollback_auto_keeps_snapshots_where_layers_offload(model_path) -> None:
    """On a GPU the checkpoint path would copy every drafting sequence's state off the device
    and back: "auto" keeps llama.cpp's snapshots there for good; with CPU-only layers it
    starts with them and may switch to checkpoints while running."""
    with lm.Model(model_path("noisy"), n_gpu_layers=-1) as gpu:
        with SpeculativeEngine(gpu, max_sequences=3, n_ctx=128, draft_cap=3) as eng:
            assert eng.rollback == "snapshots" and eng.target.n_rs_seq == 3 and eng.policy.alt is None
    with lm.Model(model_path("noisy"), n_gpu_layers=0) as cpu:
        with SpeculativeEngine(cpu, max_sequences=3, n_ctx=128, draft_cap=3) as eng:
            assert eng.rollback == "snapshots" and eng.target.n_rs_seq == 3 and eng.policy.alt is not None


def test_checkpoint_round_trips_device_state(model_path) -> None:
    """A sequence's state saved from the GPU and put back gives the logits it gave before."""
    with lm.Model(model_path("trunk"), n_gpu_layers=-1) as model:
        toks = model.tokenize("Multi-token prediction drafts several tokens ahead")
        n = len(toks)
        for partial in (False, True):
            with lm.Context(model, n_ctx=128, n_seq_max=2) as ctx:
                b = lm.Batch(n)
                b.extend(toks[:-3], 0, 1)
                ctx.decode(b)
                ck = ctx.checkpoint(1, partial=partial, reuse=partial)
                b.clear()
                b.extend(toks[-3:], n - 3, 1, outputs="all")
                ctx.decode(b)
                first = np.array(ctx.logits_all())
                ctx.restore(ck)
                assert ctx.memory.pos_max(1) == n - 4
                ctx.decode(b)
                np.testing.assert_array_equal(np.array(ctx.logits_all()), first)

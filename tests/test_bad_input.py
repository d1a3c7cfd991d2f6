"""The bad-input catalogue: every case raises a typed error (never takes the process
down) and leaves the objects usable, or cleanly closed."""

from __future__ import annotations

import math
import threading
from pathlib import Path

import numpy as np
import pytest
from helpers import GPU, greedy_reference

import llama_mtp as lm
from llama_mtp.speculative import ContextLengthError, SpeculativeEngine
from llama_mtp.tiny import write_tiny_model

GREEDY = lm.SamplingParams.greedy_params()


@pytest.fixture(scope="module")
def good(model_path) -> Path:
    return model_path("planted")


@pytest.fixture(scope="module")
def m(good: Path) -> lm.Model:
    with lm.Model(good) as model:
        yield model


def still_works(model: lm.Model) -> None:
    """The model (and new contexts on it) work after the error."""
    assert greedy_reference(model, model.tokenize("the model"), 4)


# ------------------------------------------------------------------ files (1-9)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(lm.ModelLoadError, match="not found"):
        lm.Model(tmp_path / "nope.gguf")


def test_directory(tmp_path: Path) -> None:
    with pytest.raises(lm.ModelLoadError, match="directory"):
        lm.Model(tmp_path)


def test_empty_file(tmp_path: Path) -> None:
    (tmp_path / "e.gguf").write_bytes(b"")
    with pytest.raises(lm.ModelLoadError, match="empty"):
        lm.Model(tmp_path / "e.gguf")


def test_not_gguf(tmp_path: Path) -> None:
    (tmp_path / "x.gguf").write_bytes(b"\x7fELF" + bytes(1000))
    with pytest.raises(lm.ModelLoadError, match="not a GGUF"):
        lm.Model(tmp_path / "x.gguf")


@pytest.mark.parametrize("where", ["header", "metadata", "tensor_info", "tensor_data"])
def test_truncated_gguf(good: Path, tmp_path: Path, where: str) -> None:
    from llama_mtp import gguf_scan

    data = good.read_bytes()
    info = gguf_scan.scan(good)
    assert info is not None
    first_tensor = min(t.offset for t in info.tensors.values())
    cut = {"header": 12, "metadata": 400, "tensor_info": len(data) - (len(data) - first_tensor) - 3000,
           "tensor_data": len(data) - 1000}[where]
    (tmp_path / "t.gguf").write_bytes(data[:cut])
    with pytest.raises(lm.ModelLoadError) as info_e:
        lm.Model(tmp_path / "t.gguf")
    assert info_e.value.log, "llama.cpp's reason is attached"


def test_wrong_tensor_shapes(tmp_path: Path) -> None:
    path = write_tiny_model(tmp_path / "shape.gguf", extra_metadata={"qwen35.feed_forward_length": 100})
    with pytest.raises(lm.ModelLoadError) as e:
        lm.Model(path)
    assert any("shape" in line for line in e.value.log)


def test_unknown_architecture(tmp_path: Path) -> None:
    path = write_tiny_model(tmp_path / "arch.gguf", extra_metadata={"general.architecture": "qwen99"})
    with pytest.raises(lm.ModelLoadError) as e:
        lm.Model(path)
    assert any("architecture" in line for line in e.value.log)


def test_tensor_type_ggml_would_abort_on(tmp_path: Path) -> None:
    """An F16 GDN conv kernel loads in llama.cpp and aborts the process at the first decode."""
    import gguf

    from llama_mtp import gguf_scan

    src = write_tiny_model(tmp_path / "src.gguf")
    reader = gguf.GGUFReader(src)
    conv = next(t for t in reader.tensors if t.name.endswith("ssm_conv1d.weight"))
    raw = bytearray(src.read_bytes())
    # the tensor-info record: name, n_dims, dims, type (u32), offset -- patch the type to F16 (1)
    name = conv.name.encode()
    at = raw.index(len(name).to_bytes(8, "little") + name) + 8 + len(name)
    n_dims = int.from_bytes(raw[at:at + 4], "little")
    type_at = at + 4 + 8 * n_dims
    assert int.from_bytes(raw[type_at:type_at + 4], "little") == 0
    raw[type_at:type_at + 4] = (1).to_bytes(4, "little")
    bad = tmp_path / "f16conv.gguf"
    bad.write_bytes(bytes(raw))
    info = gguf_scan.scan(bad)
    assert info is not None and gguf_scan.problems(info)
    with pytest.raises(lm.ModelLoadError, match="must be F32"):
        lm.Model(bad)


# ------------------------------------------------------------------ MTP (10-12)


def test_mtp_on_a_model_without_mtp_layers(model_path) -> None:
    with pytest.raises(lm.MTPUnavailableError):
        lm.Model(model_path("nomtp"), mtp=True)
    with lm.Model(model_path("nomtp")) as m2:
        with pytest.raises(lm.MTPUnavailableError):
            lm.Context(m2, mtp=True)
        with pytest.raises(lm.MTPUnavailableError):
            SpeculativeEngine(m2)
        still_works(m2)


def test_mtp_context_on_model_loaded_without_head(good: Path) -> None:
    """Upstream aborts the process (GGML_ASSERT in qwen35.cpp) here."""
    with lm.Model(good, mtp=False) as m2:
        with pytest.raises(lm.MTPUnavailableError, match="mtp=False"):
            lm.Context(m2, mtp=True)
        still_works(m2)


def test_sidecar_mismatch_and_misuse(tmp_path: Path, m: lm.Model) -> None:
    ok = write_tiny_model(tmp_path / "side.gguf", mtp_only=True)
    wide = write_tiny_model(tmp_path / "wide.gguf", mtp_only=True, n_embd=96)
    big_vocab = write_tiny_model(tmp_path / "vocab.gguf", mtp_only=True, n_vocab=600)
    for bad in (wide, big_vocab):
        with lm.Model(bad) as side:
            with pytest.raises(lm.MTPUnavailableError, match="does not match"):
                SpeculativeEngine(m, mtp_model=side)
    with lm.Model(ok) as side:
        assert side.mtp_only
        with pytest.raises(lm.ContextError, match="only an MTP head"):
            lm.Context(side)  # the trunk is missing: upstream would crash running it
        with SpeculativeEngine(m, mtp_model=side, n_ctx=128, sampling=GREEDY) as eng:
            s = eng.add(m.tokenize("the model"), max_tokens=12)
            while eng.active:
                eng.step()
            assert eng.sequence(s).tokens == greedy_reference(m, m.tokenize("the model"), 12)


# ------------------------------------------------------------------ prompts and tokens (13-16)


def test_empty_prompt(m: lm.Model) -> None:
    with SpeculativeEngine(m, n_ctx=64) as eng:
        for p in ("", []):
            with pytest.raises(ValueError):
                eng.add(p)
        assert eng.free_slots == 1


@pytest.mark.parametrize("tok", [-1, -(2**31), 512, 10**9])
def test_token_ids_out_of_range(m: lm.Model, tok: int) -> None:
    with pytest.raises(lm.TokenizeError):
        m.detokenize([5, tok])
    with SpeculativeEngine(m, n_ctx=64) as eng:
        with pytest.raises(lm.TokenizeError):
            eng.add([5, tok])
    with lm.Context(m, n_ctx=64) as ctx:
        b = lm.Batch(2)
        b.add(tok, 0, 0, output=True)
        with pytest.raises(lm.InvalidBatchError):
            ctx.decode(b)


def test_prompt_longer_than_context(m: lm.Model) -> None:
    with SpeculativeEngine(m, n_ctx=64) as eng:
        with pytest.raises(ContextLengthError):
            eng.add([300] * (eng.n_ctx_seq + 5))
        s = eng.add("the model", max_tokens=3)
        while eng.active:
            eng.step()
        assert len(eng.sequence(s).tokens) == 3


def test_generation_reaching_the_context(m: lm.Model) -> None:
    with SpeculativeEngine(m, max_sequences=2, n_ctx=64, sampling=GREEDY) as eng:
        a = eng.add([300] * (eng.n_ctx_seq - 3), max_tokens=100)
        b = eng.add("the model", max_tokens=20)
        while eng.active:
            eng.step()
        assert eng.sequence(a).finish_reason == "length" and eng.sequence(b).finish_reason == "length"
        assert len(eng.sequence(b).tokens) == 20


# ------------------------------------------------------------------ sequences and drafts (17-20)


def test_seq_id_out_of_range(m: lm.Model) -> None:
    with SpeculativeEngine(m, max_sequences=2, n_ctx=64) as eng:
        for bad in (2, -1, 1.5):
            with pytest.raises(ValueError):
                eng.add("x", seq_id=bad)  # type: ignore[arg-type]
    with lm.Context(m, n_ctx=64, n_seq_max=2) as ctx:
        with pytest.raises(lm.InvalidBatchError):
            ctx.memory.seq_rm(2)
        with pytest.raises(lm.InvalidBatchError):
            ctx.checkpoint(5)


def test_too_many_sequences(m: lm.Model) -> None:
    with pytest.raises(ValueError):
        lm.ContextParams(n_seq_max=10_000)
    with SpeculativeEngine(m, max_sequences=2, n_ctx=64) as eng:
        eng.add("a", max_tokens=50)
        eng.add("b", max_tokens=50)
        with pytest.raises(lm.LlamaError, match="no free sequence slot"):
            eng.add("c")
        with pytest.raises(lm.LlamaError):
            eng.add_many([dict(prompt="d"), dict(prompt="e")])
        eng.step()


@pytest.mark.parametrize("k", [0, 1, 7])
def test_draft_lengths(m: lm.Model, k: int) -> None:
    with SpeculativeEngine(m, n_ctx=128, draft_max=max(k, 1), sampling=GREEDY,
                           spec=lm.SpecParams(draft_max=k)) as eng:
        s = eng.add("the model", max_tokens=16)
        while eng.active:
            eng.step()
        assert eng.sequence(s).tokens == greedy_reference(m, m.tokenize("the model"), 16)
        assert (eng.stats.spec.draft_n == 0) == (k == 0)


def test_bad_draft_lengths(m: lm.Model) -> None:
    for bad in (-1, 65, 2.5, "many"):
        with pytest.raises(ValueError):
            lm.SpecParams(draft_max=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="n_batch"):
        SpeculativeEngine(m, draft_max=8, n_batch=8)  # n_batch < draft length + 1
    # longer than the engine allows / than the snapshots: clamped or checkpointed, never a failure
    with SpeculativeEngine(m, n_ctx=128, draft_max=2, sampling=GREEDY,
                           spec=lm.SpecParams(draft_max=40, ngram=True, ngram_max=12)) as eng:
        s = eng.add(m.tokenize("the model verifies them together in one pass. the model"), max_tokens=40)
        while eng.active:
            eng.step()
        assert eng.sequence(s).tokens == greedy_reference(m, m.tokenize("the model verifies them together in one pass. the model"), 40)


# ------------------------------------------------------------------ sampling (21)


@pytest.mark.parametrize("bad", [dict(temperature=-1.0), dict(top_p=1.01), dict(min_p=2), dict(top_k=-3),
                                 dict(temperature=math.nan), dict(top_p=math.inf), dict(repeat_penalty=-1)])
def test_invalid_sampling(m: lm.Model, bad: dict) -> None:  # type: ignore[type-arg]
    with pytest.raises(ValueError):
        lm.SamplingParams(**bad)
    with lm.LLM(m.path, n_ctx=64, parallel=1) as llm, pytest.raises(ValueError):
        llm.generate("x", 2, **bad)


def test_rejection_needs_temperature(m: lm.Model) -> None:
    with SpeculativeEngine(m, n_ctx=64) as eng, pytest.raises(ValueError, match="temperature"):
        eng.add("x", sampling=GREEDY, spec=lm.SpecParams(verify="rejection"))


# ------------------------------------------------------------------ text (22-23)


def test_invalid_utf8_at_token_boundaries(tmp_path: Path) -> None:
    """Byte tokens that never form valid UTF-8: replacement characters, no crash."""
    model = write_tiny_model(tmp_path / "bytes.gguf", text="ab <0xC3> cd", n_vocab=300)
    with lm.LLM(model, n_ctx=64, parallel=1) as llm:
        toks = [llm.model.tokenize("x")[0]] + [3 + 0xC3, 3 + 0xA9, 3 + 0xFF, 3 + 0x80]
        assert "\ufffd" in llm.model.detokenize(toks)
        s = llm.stream(toks, 12, temperature=0)
        text = "".join(s)
        assert text == s.result.text


def test_stop_string_spanning_tokens(m: lm.Model) -> None:
    with lm.LLM(m.path, n_ctx=128, parallel=1) as llm:
        r = llm.generate("Multi-token prediction", 40, temperature=0, stop=["model verif"])
        assert r.finish_reason == "stop" and r.text.endswith("the ")
        pieces = list(s := llm.stream("Multi-token prediction", 40, temperature=0, stop=["model verif"]))
        assert "".join(pieces) == r.text and not any("model" in p for p in pieces)
        assert s.result.finish_reason == "stop"


# ------------------------------------------------------------------ lifetimes (24-25)


def test_use_after_close(good: Path) -> None:
    model = lm.Model(good)
    eng = SpeculativeEngine(model, n_ctx=64)
    ctx = lm.Context(model, n_ctx=64)
    eng.close()
    eng.close()
    for call in (eng.step, lambda: eng.add("x"), lambda: eng.remove(0)):
        with pytest.raises(lm.ClosedError):
            call()
    model.close()
    with pytest.raises(lm.ClosedError):
        ctx.decode(lm.Batch(1))
    llm = lm.LLM(good, n_ctx=64, parallel=1)
    llm.close()
    with pytest.raises(lm.ClosedError):
        llm.generate("x", 2)


def test_closing_the_model_under_a_live_engine(good: Path) -> None:
    model = lm.Model(good)
    eng = SpeculativeEngine(model, n_ctx=64)
    s = eng.add("the model", max_tokens=30)
    eng.step()
    model.close()  # closes the engine's contexts too
    with pytest.raises(lm.ClosedError):
        eng.step()
    assert eng.sequence(s).tokens  # what was generated is still readable
    eng.close()


# ------------------------------------------------------------------ threads (26)


def test_two_threads_one_context(m: lm.Model) -> None:
    """Calls on one context are serialised by its lock: both threads get correct results."""
    toks = m.tokenize("Multi-token prediction drafts several")
    with lm.Context(m, n_ctx=256, n_seq_max=2) as ctx, lm.Context(m, n_ctx=256) as ref:
        b = lm.Batch(len(toks))
        b.extend(toks, 0, 0, outputs="all")
        ref.decode(b)
        want = np.array(ref.logits_all())
        results: dict[int, list[np.ndarray]] = {0: [], 1: []}
        errors: list[BaseException] = []

        def worker(seq: int) -> None:
            try:
                for _ in range(20):
                    bb = lm.Batch(len(toks))
                    bb.extend(toks, 0, seq, outputs="all")
                    with ctx._lock:  # decode + read as one unit
                        ctx.memory.seq_rm(seq)
                        ctx.decode(bb)
                        results[seq].append(np.array(ctx.logits_all()))
            except BaseException as exc:  # pragma: no cover - reported below
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(s,)) for s in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors
        for seq in (0, 1):
            assert len(results[seq]) == 20
            for got in results[seq]:
                np.testing.assert_allclose(got, want, atol=1e-4)


def test_two_threads_one_engine(m: lm.Model) -> None:
    with SpeculativeEngine(m, max_sequences=4, n_ctx=128, sampling=GREEDY) as eng:
        done: list[int] = []

        def worker(text: str) -> None:
            s = eng.add(text, max_tokens=20)
            while s in eng.active:
                eng.step()
            done.append(s)

        ts = [threading.Thread(target=worker, args=(t,)) for t in ("the model", "one pass", "every", "a whole")]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        assert len(done) == 4
        for s in done:
            st = eng.sequence(s)
            assert st.tokens == greedy_reference(m, st.prompt, 20)


# ------------------------------------------------------------------ resources (28)


def test_out_of_memory_context(m: lm.Model) -> None:
    """A context that cannot fit is refused before llama.cpp tries: its cells' bookkeeping is
    zero-filled host memory, and a huge n_ctx got a process on a GPU machine killed."""
    with pytest.raises(lm.ContextError, match=r"needs at least [\d.]+ GiB .* lower n_ctx"):
        lm.Context(m, n_ctx=2**31 - 1, n_batch=512)
    still_works(m)


@pytest.mark.skipif(GPU, reason="on a GPU machine llama.cpp's own path can exhaust the host first (see above)")
def test_out_of_memory_context_in_llama_cpp(m: lm.Model, monkeypatch: pytest.MonkeyPatch) -> None:
    """Past our estimate, llama.cpp's failed allocation is a ContextError with its own log."""
    import llama_mtp.context as context

    monkeypatch.setattr(context, "_available_memory", lambda offload: None)  # the estimate says nothing
    with pytest.raises(lm.ContextError) as e:
        lm.Context(m, n_ctx=2**31 - 1, n_batch=512)
    assert e.value.log
    still_works(m)


def test_context_size_estimate(model_path) -> None:
    """The lower bound a context is checked against: 48 bytes of bookkeeping per cell, plus
    half of K and V of the attention layers (the trunk model: 2 of 4 layers attend, one KV
    head of 32 + 32 F16 values), less with a quantized cache, one layer for an MTP context."""
    from llama_mtp.context import CELL_BYTES, min_context_bytes

    with lm.Model(model_path("trunk")) as t:
        assert min_context_bytes(t, 1024) == 1024 * (CELL_BYTES + 2 * 1 * (32 * 2 + 32 * 2) // 2)
        assert min_context_bytes(t, 2048) == 2 * min_context_bytes(t, 1024)
        assert min_context_bytes(t, 1024, type_k="q8_0", type_v="q8_0") < min_context_bytes(t, 1024)
        assert min_context_bytes(t, 1024, mtp=True) == 1024 * (CELL_BYTES + 1 * 1 * (32 * 2 + 32 * 2) // 2)
        with lm.Context(t, n_ctx=1 << 16):  # a large context that fits is not refused
            pass


def test_bad_context_params(m: lm.Model) -> None:
    for bad in (dict(n_ctx=-1), dict(n_batch=0), dict(n_threads=0), dict(type_k="q99"), dict(flash_attn="maybe"),
                dict(n_ubatch=1.5)):
        with pytest.raises(ValueError):
            lm.Context(m, **bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        lm.Context(m, n_ctx=64).set_threads(0)

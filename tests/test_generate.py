"""The LLM facade: generate, stream, generate_many, chat; the demo model."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import greedy_reference

import llama_mtp as lm
from llama_mtp.demo import DEMO_SPECS, demo_model_path, write_demo_model


@pytest.fixture(scope="module")
def llm(model_path) -> lm.LLM:
    with lm.LLM(model_path("trunk"), n_ctx=256, parallel=4, draft_max=3) as x:
        yield x


def test_generate_greedy_is_lossless(llm: lm.LLM) -> None:
    r = llm.generate("Multi-token prediction", 32, temperature=0)
    ref = greedy_reference(llm.model, llm.model.tokenize("Multi-token prediction"), 32)
    assert r.tokens == ref
    # the text continues the prompt: it keeps the leading space detokenize() would strip
    full = llm.model.detokenize(llm.model.tokenize("Multi-token prediction") + ref)
    assert "Multi-token prediction" + r.text == full
    assert r.finish_reason == "length"
    assert r.stats.draft_n > 0 and r.stats.acceptance_rate > 0.5
    t = r.timings
    assert t["predicted_n"] == 32 and t["prompt_n"] == 2 and t["predicted_per_second"] > 0


def test_stream_equals_generate(llm: lm.LLM) -> None:
    for kw in (dict(temperature=0), dict(temperature=1.0, seed=7), dict(temperature=0, stop=["one pass"])):
        want = llm.generate("Multi-token prediction", 40, **kw)
        s = llm.stream("Multi-token prediction", 40, **kw)
        pieces = list(s)
        assert "".join(pieces) == want.text == s.result.text
        assert s.result.tokens == want.tokens
        assert len(pieces) > 1
    assert "one pass" not in want.text and want.finish_reason == "stop"


def test_stream_never_splits_utf8(tmp_path: Path) -> None:
    """A planted sentence of multi-byte characters, generated through byte-fallback tokens."""
    from llama_mtp.tiny import write_tiny_model

    text = "héllo wörld ✓ 日本 🚀 ok"
    path = write_tiny_model(tmp_path / "utf8.gguf", text=text, n_vocab=400)
    with lm.LLM(path, n_ctx=128, parallel=1) as x:
        pieces = list(s := x.stream("héllo", 30, temperature=0))
        assert all("\ufffd" not in p for p in pieces)
        assert "".join(pieces) == s.result.text
        assert "🚀" in s.result.text and "日本" in s.result.text


def test_generate_many_equals_individual_calls(llm: lm.LLM) -> None:
    prompts = ["Multi-token prediction", "the model", "every accepted", "one pass", "a whole", "decoding step"]
    many = llm.generate_many(prompts, 24, temperature=0)  # 6 prompts, 4 at a time
    assert [r.prompt for r in many] == prompts
    for p, r in zip(prompts, many, strict=True):
        assert r.tokens == llm.generate(p, 24, temperature=0).tokens


def test_generate_many_seeded_matches_individual(llm: lm.LLM) -> None:
    prompts = ["Multi-token prediction", "the model"]
    many = llm.generate_many(prompts, 16, temperature=1.0, seed=11, verify="match")
    one = [llm.generate(p, 16, temperature=1.0, seed=11 + i, verify="match") for i, p in enumerate(prompts)]
    assert [r.tokens for r in many] == [r.tokens for r in one]


def test_chat(llm: lm.LLM) -> None:
    r = llm.chat([{"role": "user", "content": "hello"}], 12, temperature=0, template="chatml")
    assert len(r.tokens) == 12


def test_no_mtp_and_bad_values(model_path) -> None:
    with pytest.raises(lm.MTPUnavailableError):
        lm.LLM(model_path("nomtp"))
    with lm.LLM(model_path("nomtp"), mtp=False, n_ctx=128, parallel=1) as x:
        r = x.generate("one", 8, temperature=0)
        assert len(r.tokens) == 8 and r.stats.draft_n == 0
        for bad in (dict(temperature=-1), dict(top_p=2.0), dict(top_k=-1), dict(temperature=float("nan"))):
            with pytest.raises(ValueError):
                x.generate("one", 4, **bad)
        with pytest.raises(ValueError):
            x.generate("", 4)


def test_demo_model_is_deterministic_and_cached(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLAMA_MTP_CACHE_DIR", str(tmp_path / "cache"))
    p1 = demo_model_path()
    assert p1.is_file() and p1.is_relative_to(tmp_path / "cache")
    mtime = p1.stat().st_mtime_ns
    assert demo_model_path() == p1 and p1.stat().st_mtime_ns == mtime  # cached, not rewritten
    p2 = write_demo_model(tmp_path / "again.gguf")
    assert p2.read_bytes() == p1.read_bytes()
    assert p1.stat().st_size < 10 * 2**20
    # a fixed k: on a model this small 'auto' may rightly find that drafting does not pay
    with lm.LLM(p1, n_ctx=256, parallel=1, draft_max=3) as x:
        r = x.generate("Multi-token prediction", 48, temperature=0)
        assert "drafts several tokens ahead" in r.text
        assert r.stats.acceptance_rate > 0.9
    assert set(DEMO_SPECS) == {"small", "bench"}

"""Model: loading, properties, vocabulary, chat template."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from helpers import VOCAB_DIR

import llama_mtp as lm
from llama_mtp.tiny import DEMO_TEXT, TinySpec


def test_properties(planted: lm.Model) -> None:
    spec = TinySpec()
    assert planted.arch == "qwen35"
    assert planted.n_layer == spec.n_layer
    assert planted.n_layer_nextn == 1
    assert planted.has_mtp and planted.mtp_loaded
    assert planted.n_embd == spec.n_embd == planted.n_embd_out
    assert planted.n_vocab == spec.n_vocab
    assert planted.n_ctx_train == spec.n_ctx_train
    assert planted.is_hybrid and not planted.is_recurrent
    assert planted.n_params > 0 and planted.size > 0
    assert planted.vocab_type == "spm"
    assert planted.bos == 1 and planted.eos == 2
    assert planted.is_eog(2) and not planted.is_eog(300)
    assert planted.metadata["general.name"] == spec.name
    assert "qwen35" in repr(planted)


def test_no_mtp_model(model_path) -> None:
    with lm.Model(model_path("nomtp")) as m:
        assert m.n_layer_nextn == 0 and not m.has_mtp
        assert "no MTP" in (m.mtp_unavailable_reason() or "")
    with pytest.raises(lm.MTPUnavailableError, match="mtp=False"):
        lm.Model(model_path("nomtp"), mtp=True)


def test_mtp_false_skips_the_head(model_path) -> None:
    with lm.Model(model_path("planted"), mtp=False) as m:
        assert m.n_layer_nextn == 1 and not m.has_mtp
        with pytest.raises(lm.MTPUnavailableError, match="mtp=False"):
            lm.Context(m, mtp=True)  # upstream would abort the process here


@pytest.mark.parametrize(
    "text",
    ["Multi-token prediction drafts", DEMO_TEXT, "hello, world!", "ünïcødé ✓ 日本語 🚀", "  leading spaces", "tabs\tand\nnewlines"],
)
def test_tokenize_round_trip(planted: lm.Model, text: str) -> None:
    toks = planted.tokenize(text)
    assert toks and all(0 <= t < planted.n_vocab for t in toks)
    assert planted.detokenize(toks) == text


def test_words_are_single_tokens(planted: lm.Model) -> None:
    assert len(planted.tokenize("Multi-token prediction")) == 2


def test_token_pieces_concatenate(planted: lm.Model) -> None:
    text = "ünïcødé 🚀 and tokens"
    toks = planted.tokenize(text)
    raw = b"".join(planted.token_to_piece(t) for t in toks)
    assert raw.decode("utf-8").strip() == text


def test_bad_tokens(planted: lm.Model) -> None:
    for bad in ([-1], [planted.n_vocab], [1.5], [[1, 2]], ["a"]):
        with pytest.raises(lm.TokenizeError):
            planted.detokenize(bad)
    with pytest.raises(lm.TokenizeError):
        planted.token_to_piece(10**9)
    assert planted.detokenize([]) == ""


def test_chat_template(planted: lm.Model) -> None:
    text = planted.apply_chat_template([{"role": "user", "content": "hi"}], template="chatml")
    assert "<|im_start|>user\nhi<|im_end|>" in text and text.endswith("<|im_start|>assistant\n")
    with pytest.raises(ValueError):
        planted.apply_chat_template([{"role": "user", "content": "hi"}], template="no such template {{ x }}")


def _golden(name: str) -> tuple[Path, list[str], list[list[int]]]:
    """Read llama.cpp's tokenizer vectors the way tests/test-tokenizer-0.cpp does."""
    base = VOCAB_DIR / f"ggml-vocab-{name}.gguf"
    if not base.exists():
        pytest.skip(f"{base} not present (vendor/llama.cpp is populated by the build)")
    raw = base.with_name(base.name + ".inp").read_bytes().decode("utf-8")
    sep = "\n__ggml_vocab_test__\n"
    inputs, pos = [], 0
    while pos < len(raw):
        nxt = raw.find(sep, pos)
        if nxt < 0:
            inputs.append(raw[pos:])
            break
        inputs.append(raw[pos:nxt])
        pos = nxt + len(sep)
    lines = base.with_name(base.name + ".out").read_text(encoding="utf-8").split("\n")
    expected = [[int(x) for x in line.split()] for line in lines[: len(inputs)]]
    assert len(expected) == len(inputs)
    return base, inputs, expected


@pytest.mark.parametrize("name", ["qwen35", "llama-spm"])
def test_tokenizer_golden(name: str) -> None:
    """llama.cpp's own tokenizer test vectors, through our binding (vocab-only load)."""
    path, inputs, expected = _golden(name)
    with lm.Model(path, vocab_only=True) as m:
        assert not m.has_mtp
        with pytest.raises(lm.ContextError, match="vocab-only"):
            lm.Context(m)
        n_checked = 0
        for text, exp in zip(inputs, expected, strict=False):
            got = m.tokenize(text, add_special=False, parse_special=False)
            assert got == exp, f"{text!r}"
            n_checked += 1
        assert n_checked >= 20


def test_load_progress_and_cancel(model_path) -> None:
    seen: list[float] = []
    with lm.Model(model_path("planted"), progress=lambda p: seen.append(p)) as m:
        assert m.n_vocab > 0
    assert seen and seen[-1] == pytest.approx(1.0)
    with pytest.raises(lm.ModelLoadError):
        lm.Model(model_path("planted"), progress=lambda p: False)

    def boom(p: float) -> None:
        raise RuntimeError("stop")

    with pytest.raises(RuntimeError, match="stop"):
        lm.Model(model_path("planted"), progress=boom)


def test_eog_mask(planted: lm.Model) -> None:
    mask = planted.eog_mask
    assert mask.shape == (planted.n_vocab,) and mask.dtype == np.bool_
    assert mask[2] and mask.sum() >= 1

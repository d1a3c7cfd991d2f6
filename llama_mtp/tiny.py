"""Write small qwen35 (Qwen3.5-style hybrid: Gated-DeltaNet + attention) GGUFs with
an MTP head, from numpy, with the ``gguf`` package. No download, no training.

What the weights do is chosen, so MTP's behaviour is known in advance:

* ``weights="random"``: every tensor random. The MTP head and the trunk disagree,
  so almost every draft is rejected (maximal rollback).
* ``weights="planted"``: the trunk's residual branches are silent, so the target
  predicts ``next_token[x]`` from the current token ``x`` alone, and the MTP head
  (``eh_proj = [I | 0]``) predicts the same: ~100% acceptance.
  ``mtp_noise`` adds noise to the MTP head's own output matrix
  (``nextn.shared_head_head``), dialling acceptance anywhere between;
  ``trunk_scale`` lets the trunk speak a little, so the recurrent state and
  attention over the history matter (outputs depend on the whole prefix).

``next_token`` is a cycle through a short sentence, so planted models write
readable text. The vocabulary is a SentencePiece-style one with byte fallback
(every UTF-8 string round-trips), or llama.cpp's ``test`` hash tokenizer.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

__all__ = ["DEMO_TEXT", "TinySpec", "calibrate_mtp_noise", "planted_next_token", "predicted_acceptance", "spm_vocab",
           "write_tiny_model"]

ARCH = "qwen35"
DEMO_TEXT = (
    "Multi-token prediction drafts several tokens ahead; the model verifies them together in one pass, "
    "and every accepted draft saves a whole decoding step."
)

_SPECIALS = ["<unk>", "<s>", "</s>"]
_TT_NORMAL, _TT_UNKNOWN, _TT_CONTROL, _TT_BYTE = 1, 2, 3, 6
_SPACE = "\u2581"  # SentencePiece's word-boundary mark


@dataclass(frozen=True)
class TinySpec:
    """Shape and weights of a tiny qwen35 MTP model."""

    n_vocab: int = 512
    n_embd: int = 64
    n_layer: int = 4                   # trunk layers; every `attn_interval`-th one is attention
    attn_interval: int = 2
    n_head: int = 2
    n_head_kv: int = 1
    head_dim: int = 32
    n_ff: int = 128
    ssm_state: int = 16
    ssm_groups: int = 2
    ssm_rank: int = 4                  # value heads; inner size = ssm_state * ssm_rank
    ssm_conv: int = 4
    n_ctx_train: int = 4096
    mtp: bool = True                   # write the MTP (nextn) layer
    mtp_only: bool = False             # an MTP sidecar: embeddings, output and the MTP layer only
    weights: Literal["random", "planted"] = "planted"
    mtp_noise: float = 0.0             # planted: noise on the MTP head's output matrix
    mtp_noise_vocab: int = 0           # planted: ... on its first this many rows only (0: every row)
    mtp_blind: tuple[int, int] = (0, 0)  # planted: sentence pieces [a, b) the MTP head mispredicts
    trunk_scale: float = 0.0           # planted: scale of the trunk's residual branches
    logit_scale: float = 12.0          # planted: logit of the planted next token (others ~0)
    vocab: Literal["spm", "test"] = "spm"
    text: str = DEMO_TEXT              # planted: the sentence next_token cycles through
    dtype: Literal["f32", "f16"] = "f32"
    seed: int = 0
    name: str = "llama-mtp tiny qwen35"
    extra_metadata: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.n_embd % 2 or self.head_dim % 4:
            raise ValueError("n_embd must be even and head_dim a multiple of 4")
        if self.vocab == "spm" and self.n_vocab < len(_SPECIALS) + 256 + 8:
            raise ValueError("an spm vocabulary needs n_vocab >= 267 (specials + 256 byte tokens + a few pieces)")
        if self.weights not in ("random", "planted"):
            raise ValueError(f"weights must be 'random' or 'planted', got {self.weights!r}")
        a, b = self.mtp_blind
        if (a, b) != (0, 0) and not 0 <= a < b - 1:
            raise ValueError(f"mtp_blind must be (0, 0) or a piece range [a, b) with b - a >= 2, got {self.mtp_blind!r}")

    @property
    def n_layer_all(self) -> int:
        return self.n_layer + (1 if self.mtp else 0)

    def is_recurrent(self, il: int) -> bool:
        return il < self.n_layer and (il + 1) % self.attn_interval != 0


# ---------------------------------------------------------------- vocabulary


def spm_vocab(n_vocab: int, text: str = DEMO_TEXT) -> tuple[list[str], list[float], list[int]]:
    """Tokens, scores and types of a SentencePiece-style vocabulary with byte fallback.

    The words of ``text`` come first (so they tokenize as whole words), then
    printable ASCII characters, then filler pieces up to ``n_vocab``.
    """
    tokens = list(_SPECIALS) + [f"<0x{b:02X}>" for b in range(256)]
    types = [_TT_UNKNOWN, _TT_CONTROL, _TT_CONTROL] + [_TT_BYTE] * 256
    seen = set(tokens)
    pieces: list[str] = []
    for word in _spm_words(text):
        # every prefix too: SentencePiece merges pairs, so a word is reachable only through them
        for k in range(2, len(word) + 1):
            if word[:k] not in seen:
                seen.add(word[:k])
                pieces.append(word[:k])
    for ch in [_SPACE] + [chr(c) for c in range(33, 127)]:
        if ch not in seen:
            seen.add(ch)
            pieces.append(ch)
    i = 0
    while len(tokens) + len(pieces) < n_vocab:
        filler = f"{_SPACE}w{i}"
        i += 1
        if filler not in seen:
            seen.add(filler)
            pieces.append(filler)
    pieces = pieces[: n_vocab - len(tokens)]
    # longer pieces merge first; single characters last
    scores = [0.0] * len(tokens) + [float(len(p)) if len(p) > 1 else -1.0 for p in pieces]
    return tokens + pieces, scores, types + [_TT_NORMAL] * len(pieces)


def _spm_words(text: str) -> list[str]:
    out = []
    for w in text.split(" "):
        if not w:
            continue
        # punctuation is its own piece, attached to no space
        core = w.rstrip(".,;:!?")
        if core:
            out.append(_SPACE + core)
        out.extend(w[len(core):])
    return out


def _sentence_cycle(spec: TinySpec, tokens: list[str]) -> list[int]:
    """Token ids of the planted sentence, in order (the cycle next_token walks)."""
    if spec.vocab == "spm":
        index = {t: i for i, t in enumerate(tokens)}
        words = _spm_words(spec.text)
        missing = [w for w in words if w not in index]
        if missing or len(set(words)) != len(words) or len(words) < 2:
            raise ValueError("the planted text needs at least two pieces, each used once and all in the "
                             f"vocabulary (raise n_vocab); missing: {missing[:5]}")
        return [index[w] for w in words]
    rng = np.random.default_rng(spec.seed + 7)
    start = len(_SPECIALS)
    return [int(t) for t in rng.permutation(np.arange(start, spec.n_vocab))[: max(2, min(24, spec.n_vocab - start))]]


def planted_next_token(spec: TinySpec, tokens: list[str]) -> npt.NDArray[np.int64]:
    """next_token[x]: the sentence's pieces form a cycle; every other token leads to its start."""
    cycle = _sentence_cycle(spec, tokens)
    nxt = np.full(spec.n_vocab, cycle[0], dtype=np.int64)
    for a, b in zip(cycle, cycle[1:] + cycle[:1], strict=True):
        nxt[a] = b
    return nxt


# ---------------------------------------------------------------- weights


def _planted_embeddings(spec: TinySpec, tokens: list[str], rng: np.random.Generator) -> tuple[
        npt.NDArray[np.float64], npt.NDArray[np.float64], npt.NDArray[np.int64]]:
    """Embeddings and LM head of a planted model (the first draws of the model's generator).

    Each target token y = next_token[x] gets a direction u_y (orthonormal while
    there are at most n_embd targets); e_x points along u_{next(x)} (plus a little
    noise so tokens stay distinct) and the head row of y is u_y. With silent
    residual branches the logits are ~logit_scale for next(x), ~0 for the rest.
    """
    E, V = spec.n_embd, spec.n_vocab
    nxt = planted_next_token(spec, tokens)
    targets = np.unique(nxt)
    if len(targets) <= E:
        basis = np.linalg.qr(rng.standard_normal((E, E)))[0].T[: len(targets)]
    else:
        basis = _unit_rows(rng.standard_normal((len(targets), E)))
    u = np.zeros((V, E))
    u[targets] = basis
    emb = u[nxt] * math.sqrt(E) + rng.standard_normal((V, E)) * 0.3
    head = u * (spec.logit_scale / math.sqrt(E))
    head += rng.standard_normal((V, E)) * (0.01 / math.sqrt(E))  # break ties between non-targets
    return emb, head, nxt


def _mtp_noise(spec: TinySpec) -> npt.NDArray[np.float64]:
    """Noise on the MTP head's own output matrix (its own stream: calibration redraws only it)."""
    rng = np.random.default_rng([spec.seed, 7])
    noise = rng.standard_normal((spec.n_vocab, spec.n_embd)) * (spec.mtp_noise * spec.logit_scale / math.sqrt(spec.n_embd))
    if spec.mtp_noise_vocab > 0:  # wrong guesses among the first (most frequent) tokens only
        noise[spec.mtp_noise_vocab:] = 0.0
    return noise


def _mtp_head(spec: TinySpec, head: npt.NDArray[np.float64],
              tokens: list[str]) -> npt.NDArray[np.float64] | None:
    """The MTP head's own output matrix of a planted model, or None when it is the LM head.

    ``mtp_noise`` adds noise to every row (to the first ``mtp_noise_vocab`` rows only,
    where set: a trained head's wrong guesses are plausible tokens, and a tokenizer puts
    frequent pieces first); ``mtp_blind = (a, b)`` rotates the rows of
    the sentence's pieces ``a..b-1`` among themselves, so where the next token is one
    of them the MTP head always drafts a wrong one (acceptance 0 there, unchanged
    elsewhere) -- a model whose acceptance changes mid-generation.
    """
    a, b = spec.mtp_blind
    if spec.mtp_noise <= 0 and (a, b) == (0, 0):
        return None
    w = head + _mtp_noise(spec) if spec.mtp_noise > 0 else head.copy()
    if (a, b) != (0, 0):
        cycle = _sentence_cycle(spec, tokens)
        if b > len(cycle):
            raise ValueError(f"mtp_blind {spec.mtp_blind!r} is past the planted sentence ({len(cycle)} pieces)")
        ids = np.array(cycle[a:b])
        w[ids] = w[np.roll(ids, 1)]
    return w


def predicted_acceptance(spec: TinySpec, draft_max: int, steps: int = 2000) -> float:
    """Greedy MTP acceptance of a planted model with a silent trunk, computed in numpy.

    With ``eh_proj = [I | 0]`` and silent residual branches the MTP head's logits are
    ``W_mtp @ rmsnorm(e_x)`` and the target's ``W_out @ rmsnorm(e_x)``; this walks the
    planted sentence as the engine would (draft ``draft_max``, accept while equal).
    """
    if spec.vocab != "spm":
        raise ValueError("predicted_acceptance needs the spm vocabulary")
    tokens, _, _ = spm_vocab(spec.n_vocab, spec.text)
    rng = np.random.default_rng(spec.seed)
    emb, head, _ = _planted_embeddings(spec, tokens, rng)
    x = emb / np.sqrt((emb**2).mean(axis=1, keepdims=True) + 1e-6)
    cycle = sorted({int(i) for i in planted_next_token(spec, tokens)})
    target = np.full(spec.n_vocab, -1)
    mtp = np.full(spec.n_vocab, -1)
    ids = np.array(cycle)
    target[ids] = np.argmax(x[ids] @ head.T, axis=1)
    mtp_head = _mtp_head(spec, head, tokens)
    mtp_w = head if mtp_head is None else mtp_head
    mtp[ids] = np.argmax(x[ids] @ mtp_w.T, axis=1)
    cur, drafted, accepted = ids[0], 0, 0
    for _ in range(steps):
        d, t = [], cur
        for _ in range(draft_max):
            t = mtp[t] if mtp[t] >= 0 else -1
            d.append(t)
        truth, n = cur, 0
        while n < draft_max and d[n] == target[truth]:
            truth = target[truth]
            n += 1
        drafted += draft_max
        accepted += n
        cur = target[truth]  # the bonus token
        if cur < 0:
            break
    return accepted / drafted if drafted else 0.0


def calibrate_mtp_noise(spec: TinySpec, acceptance: float, draft_max: int = 3) -> float:
    """The ``mtp_noise`` that gives ``acceptance`` (greedy, at ``draft_max``), by bisection."""
    lo, hi = 0.0, 2.0
    for _ in range(18):
        mid = (lo + hi) / 2
        got = predicted_acceptance(TinySpec(**{**asdict(spec), "mtp_noise": mid}), draft_max)
        lo, hi = (mid, hi) if got > acceptance else (lo, mid)
    return (lo + hi) / 2


def _unit_rows(m: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
    out: npt.NDArray[np.float64] = m / np.linalg.norm(m, axis=1, keepdims=True)
    return out


def write_tiny_model(path: str | os.PathLike[str], spec: TinySpec | None = None, **overrides: Any) -> Path:
    """Write a tiny qwen35 GGUF (a few MB) and return its path.

    The same spec always gives the same bytes (weights come from ``spec.seed``).
    """
    import gguf  # imported here: only writing models needs it

    if spec is None:
        spec = TinySpec(**overrides)
    elif overrides:
        spec = TinySpec(**{**asdict(spec), **overrides})
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(spec.seed)
    E, V, F, d = spec.n_embd, spec.n_vocab, spec.n_ff, spec.head_dim
    H, Hkv = spec.n_head, spec.n_head_kv
    S, G, R, K = spec.ssm_state, spec.ssm_groups, spec.ssm_rank, spec.ssm_conv
    key_dim, value_dim = S * G, S * R
    conv_dim = 2 * key_dim + value_dim
    planted = spec.weights == "planted"

    if spec.vocab == "spm":
        tokens, scores, types = spm_vocab(V, spec.text)
    else:
        tokens = list(_SPECIALS) + [f"t{i}" for i in range(len(_SPECIALS), V)]
        scores = [0.0] * V
        types = [_TT_UNKNOWN, _TT_CONTROL, _TT_CONTROL] + [_TT_NORMAL] * (V - len(_SPECIALS))

    def rand(*shape: int, scale: float | None = None) -> npt.NDArray[np.float64]:
        fan_in = shape[-1]
        return rng.standard_normal(shape) * (scale if scale is not None else 1.0 / math.sqrt(fan_in))

    tensors: dict[str, npt.NDArray[np.float64]] = {}
    ones = np.ones

    # embeddings and the LM head
    if planted:
        emb, head, _ = _planted_embeddings(spec, tokens, rng)
    else:
        emb = rng.standard_normal((V, E))
        head = rand(V, E)
    tensors["token_embd.weight"] = emb
    tensors["output_norm.weight"] = ones(E)
    tensors["output.weight"] = head

    # residual branches: silent (planted) or random; scaled by trunk_scale when planted
    branch = spec.trunk_scale if planted else 1.0

    def layer_common(i: int, out_scale: float) -> None:
        tensors[f"blk.{i}.attn_norm.weight"] = ones(E)
        tensors[f"blk.{i}.post_attention_norm.weight"] = ones(E)
        tensors[f"blk.{i}.ffn_gate.weight"] = rand(F, E)
        tensors[f"blk.{i}.ffn_up.weight"] = rand(F, E)
        tensors[f"blk.{i}.ffn_down.weight"] = rand(E, F) * out_scale

    def attention(i: int, out_scale: float) -> None:
        tensors[f"blk.{i}.attn_q.weight"] = rand(2 * d * H, E)
        tensors[f"blk.{i}.attn_k.weight"] = rand(d * Hkv, E)
        tensors[f"blk.{i}.attn_v.weight"] = rand(d * Hkv, E)
        tensors[f"blk.{i}.attn_output.weight"] = rand(E, d * H) * out_scale
        tensors[f"blk.{i}.attn_q_norm.weight"] = ones(d)
        tensors[f"blk.{i}.attn_k_norm.weight"] = ones(d)

    if not spec.mtp_only:
        for i in range(spec.n_layer):
            layer_common(i, branch)
            if spec.is_recurrent(i):
                tensors[f"blk.{i}.attn_qkv.weight"] = rand(conv_dim, E)
                tensors[f"blk.{i}.attn_gate.weight"] = rand(value_dim, E)
                tensors[f"blk.{i}.ssm_conv1d.weight"] = rand(conv_dim, K, scale=0.5)
                tensors[f"blk.{i}.ssm_dt.bias"] = rng.uniform(-1.0, 1.0, R)
                tensors[f"blk.{i}.ssm_a"] = -np.exp(rng.uniform(-1.0, 1.0, R))
                tensors[f"blk.{i}.ssm_beta.weight"] = rand(R, E)
                tensors[f"blk.{i}.ssm_alpha.weight"] = rand(R, E)
                tensors[f"blk.{i}.ssm_norm.weight"] = ones(S)
                tensors[f"blk.{i}.ssm_out.weight"] = rand(E, value_dim) * branch
            else:
                attention(i, branch)

    if spec.mtp:
        n = spec.n_layer
        layer_common(n, 0.0 if planted else 1.0)
        attention(n, 0.0 if planted else 1.0)
        if planted:
            eh = np.zeros((E, 2 * E))
            eh[:, :E] = np.eye(E)  # [enorm(emb) ; hnorm(h)] -> enorm(emb)
        else:
            eh = rand(E, 2 * E)
        tensors[f"blk.{n}.nextn.eh_proj.weight"] = eh
        tensors[f"blk.{n}.nextn.enorm.weight"] = ones(E)
        tensors[f"blk.{n}.nextn.hnorm.weight"] = ones(E)
        mtp_head = _mtp_head(spec, head, tokens) if planted else None
        if mtp_head is not None:
            tensors[f"blk.{n}.nextn.shared_head_head.weight"] = mtp_head

    dtype = np.float16 if spec.dtype == "f16" else np.float32
    w = gguf.GGUFWriter(str(path), ARCH)
    p = f"{ARCH}."
    w.add_string("general.name", spec.name)
    w.add_uint32(p + "context_length", spec.n_ctx_train)
    w.add_uint32(p + "embedding_length", E)
    w.add_uint32(p + "block_count", spec.n_layer_all if not spec.mtp_only else spec.n_layer_all)
    w.add_uint32(p + "feed_forward_length", F)
    w.add_uint32(p + "attention.head_count", H)
    w.add_uint32(p + "attention.head_count_kv", Hkv)
    w.add_uint32(p + "attention.key_length", d)
    w.add_uint32(p + "attention.value_length", d)
    w.add_float32(p + "attention.layer_norm_rms_epsilon", 1e-6)
    w.add_uint32(p + "rope.dimension_count", d)
    w.add_float32(p + "rope.freq_base", 10000.0)
    w.add_array(p + "rope.dimension_sections", [d // 4, d // 4, 0, 0])
    w.add_uint32(p + "ssm.conv_kernel", K)
    w.add_uint32(p + "ssm.inner_size", value_dim)
    w.add_uint32(p + "ssm.state_size", S)
    w.add_uint32(p + "ssm.time_step_rank", R)
    w.add_uint32(p + "ssm.group_count", G)
    w.add_uint32(p + "full_attention_interval", spec.attn_interval)
    if spec.mtp:
        w.add_uint32(p + "nextn_predict_layers", 1)
    w.add_string("tokenizer.ggml.model", "llama" if spec.vocab == "spm" else "test")
    w.add_array("tokenizer.ggml.tokens", tokens)
    w.add_array("tokenizer.ggml.scores", scores)
    w.add_array("tokenizer.ggml.token_type", types)
    w.add_uint32("tokenizer.ggml.unknown_token_id", 0)
    w.add_uint32("tokenizer.ggml.bos_token_id", 1)
    w.add_uint32("tokenizer.ggml.eos_token_id", 2)
    w.add_bool("tokenizer.ggml.add_bos_token", False)
    w.add_bool("tokenizer.ggml.add_eos_token", False)
    for key, value in spec.extra_metadata.items():
        if isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        else:
            w.add_string(key, str(value))
    for name, t in tensors.items():
        # norms, biases and the GDN conv kernel stay F32 (ggml's ssm_conv asserts an F32 kernel)
        keep_f32 = t.ndim == 1 or name.endswith("ssm_conv1d.weight")
        w.add_tensor(name, t.astype(np.float32 if keep_f32 else dtype))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path

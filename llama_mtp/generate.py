"""LLM: the high-level facade -- generate, stream, generate_many, chat -- over the
speculative engine."""

from __future__ import annotations

import codecs
import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from .model import Model
from .params import ContextParams, ModelParams, SamplingParams, SpecParams
from .speculative import SequenceState, SpeculativeEngine
from .speculative.stats import SpecStats

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = ["GenerationResult", "LLM"]

Verify = Literal["auto", "greedy", "match", "rejection"]


@dataclass
class GenerationResult:
    """One finished sequence: its text, token ids, why it stopped, and its stats."""

    text: str
    tokens: list[int]
    finish_reason: str
    stats: SpecStats
    prompt_tokens: int
    prompt_ms: float
    predicted_ms: float
    prompt: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def predicted_per_second(self) -> float:
        return len(self.tokens) / (self.predicted_ms / 1e3) if self.predicted_ms > 0 else 0.0

    @property
    def timings(self) -> dict[str, float]:
        return {
            "prompt_n": self.prompt_tokens,
            "prompt_ms": round(self.prompt_ms, 3),
            "predicted_n": len(self.tokens),
            "predicted_ms": round(self.predicted_ms, 3),
            "predicted_per_second": round(self.predicted_per_second, 3),
        }

    def as_dict(self) -> dict[str, Any]:
        s = self.stats
        return {
            "text": self.text,
            "tokens": list(self.tokens),
            "finish_reason": self.finish_reason,
            "stats": {
                "draft_n": s.draft_n,
                "draft_n_accepted": s.draft_n_accepted,
                "acceptance_rate": round(s.acceptance_rate, 6),
                "mean_accepted_length": round(s.mean_accepted_length, 6),
                "accepted_per_position": list(s.accepted_per_position),
                "steps": s.steps,
            },
            "timings": self.timings,
        }


class LLM:
    """A model with MTP speculative decoding, ready to generate.

    >>> with LLM("model.gguf") as llm:                            # doctest: +SKIP
    ...     r = llm.generate("The capital of France is", max_tokens=32, temperature=0)
    ...     print(r.text, r.stats.acceptance_rate)

    ``model_path=None`` uses the built-in demo model (written on first use).
    ``draft_max="auto"`` (the default) chooses each sequence's draft length per step,
    0 to ``draft_cap`` (default 6, ``AUTO_DRAFT_CAP``), from measured costs and running
    acceptance; an integer fixes it.
    ``parallel`` is how many sequences one engine runs at once (``generate_many``).
    ``n_ctx`` is the context of each sequence. ``draft_vocab`` limits the tokens a draft
    can propose (see :class:`~llama_mtp.SpeculativeEngine`; ``"auto"``: a reduced
    vocabulary on the CPU, the whole one on a GPU).
    """

    def __init__(
        self,
        model_path: str | os.PathLike[str] | None = None,
        *,
        mtp: bool = True,
        draft_max: int | Literal["auto"] = "auto",
        draft_cap: int | None = None,
        n_ctx: int = 4096,
        parallel: int = 4,
        n_gpu_layers: int | None = None,
        threads: int | None = None,
        flash_attn: Literal["auto", "on", "off"] | None = None,
        mtp_model_path: str | os.PathLike[str] | None = None,
        ngram: bool = False,
        verify: Verify = "auto",
        n_batch: int | None = None,
        draft_vocab: int | Literal["auto"] | None = "auto",
        recalibrate: bool = False,
    ) -> None:
        if model_path is None:
            from .demo import demo_model_path

            model_path = demo_model_path()
        self.model_path = Path(model_path)
        self.model = Model(self.model_path, ModelParams(mtp=None if mtp else False, n_gpu_layers=n_gpu_layers))
        self._closers: list[Any] = [self.model]
        self.mtp_model: Model | None = None
        if mtp_model_path is not None:
            self.mtp_model = Model(mtp_model_path, ModelParams(mtp=True, n_gpu_layers=n_gpu_layers))
            self._closers.append(self.mtp_model)
        self.mtp = bool(mtp)
        if self.mtp and self.mtp_model is None:
            self.model.require_mtp()
        self.draft_max = draft_max
        self.draft_cap = draft_max if isinstance(draft_max, int) else draft_cap
        self.n_ctx = n_ctx
        self.parallel = parallel
        self.ngram = ngram
        self.verify: Verify = verify
        self.params = ContextParams(n_threads=threads, flash_attn=flash_attn)
        self.n_batch = n_batch
        self.draft_vocab = draft_vocab
        self.recalibrate = recalibrate
        self._engine: SpeculativeEngine | None = None

    # ------------------------------------------------------------ lifecycle

    @property
    def engine(self) -> SpeculativeEngine:
        if self._engine is None:
            self._engine = SpeculativeEngine(
                self.model, max_sequences=self.parallel, n_ctx=self.n_ctx, draft_max=self.draft_max,
                draft_cap=self.draft_cap,
                mtp=self.mtp, mtp_model=self.mtp_model, params=self.params, n_batch=self.n_batch,
                draft_vocab=self.draft_vocab, recalibrate=self.recalibrate,
            )
        return self._engine

    def close(self) -> None:
        if self._engine is not None:
            self._engine.close()
            self._engine = None
        for obj in reversed(self._closers):
            obj.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------ requests

    def _request(
        self,
        prompt: str | Sequence[int],
        *,
        max_tokens: int,
        temperature: float,
        top_k: int,
        top_p: float,
        min_p: float,
        seed: int | None,
        stop: Sequence[str] | None,
        repeat_penalty: float,
        verify: Verify | None,
        draft_max: int | Literal["auto"] | None,
        ngram: bool | None,
    ) -> dict[str, Any]:
        sampling = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed,
                                  repeat_penalty=repeat_penalty)
        spec = SpecParams(draft_max=self.draft_max if draft_max is None else draft_max,
                          verify=verify or self.verify, ngram=self.ngram if ngram is None else ngram)
        if not self.mtp and not spec.ngram:
            spec = spec.replace(draft_max=0)
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("the prompt is empty")
            toks = self.model.tokenize(prompt)
        else:
            toks = self.model.check_tokens(prompt).tolist()
        return dict(prompt=toks, max_tokens=max_tokens, sampling=sampling, spec=spec, stop=list(stop or ()))

    def _result(self, state: SequenceState, prompt: str | None) -> GenerationResult:
        return GenerationResult(
            text=state.text.decode("utf-8", "replace"), tokens=list(state.tokens),
            finish_reason=state.finish_reason or "stop", stats=state.stats, prompt_tokens=len(state.prompt),
            prompt_ms=state.prompt_ms, predicted_ms=state.predicted_ms, prompt=prompt,
        )

    def generate(
        self,
        prompt: str | Sequence[int],
        max_tokens: int = 256,
        *,
        temperature: float = 0.8,
        top_k: int = 40,
        top_p: float = 0.95,
        min_p: float = 0.05,
        seed: int | None = None,
        stop: Sequence[str] | None = None,
        repeat_penalty: float = 1.0,
        verify: Verify | None = None,
        draft_max: int | Literal["auto"] | None = None,
        ngram: bool | None = None,
    ) -> GenerationResult:
        """Generate a continuation of ``prompt`` (text or token ids)."""
        stream = self._stream(prompt, max_tokens, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                              seed=seed, stop=stop, repeat_penalty=repeat_penalty, verify=verify,
                              draft_max=draft_max, ngram=ngram)
        for _ in stream:
            pass
        return stream.result

    def stream(
        self,
        prompt: str | Sequence[int],
        max_tokens: int = 256,
        **kw: Any,
    ) -> TextStream:
        """Iterate over text pieces as they are generated (never a broken UTF-8
        character, never part of a stop string); ``.result`` holds the
        :class:`GenerationResult` once the iteration is over."""
        return self._stream(prompt, max_tokens, **kw)

    def _stream(self, prompt: str | Sequence[int], max_tokens: int, **kw: Any) -> TextStream:
        kw = {**dict(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, seed=None, stop=None, repeat_penalty=1.0,
                     verify=None, draft_max=None, ngram=None), **kw}
        req = self._request(prompt, max_tokens=max_tokens, **kw)
        return TextStream(self, req, prompt if isinstance(prompt, str) else None)

    def generate_many(
        self,
        prompts: Sequence[str | Sequence[int]],
        max_tokens: int = 256,
        **kw: Any,
    ) -> list[GenerationResult]:
        """Generate for every prompt, ``parallel`` sequences at a time in one engine
        (continuous batching: a finished sequence's slot goes to the next prompt).
        Each prompt gets its own sampler; ``seed=s`` seeds them ``s, s+1, ...``."""
        kw = {**dict(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, seed=None, stop=None, repeat_penalty=1.0,
                     verify=None, draft_max=None, ngram=None), **kw}
        base_seed = kw.pop("seed")
        reqs = [self._request(p, max_tokens=max_tokens, seed=None if base_seed is None else base_seed + i, **kw)
                for i, p in enumerate(prompts)]
        eng = self.engine
        results: list[GenerationResult | None] = [None] * len(reqs)
        owner: dict[int, int] = {}
        queue = list(range(len(reqs)))
        while queue or eng.active:
            if queue and eng.free_slots:
                batch = queue[: eng.free_slots]
                del queue[: len(batch)]
                for i, sid in zip(batch, eng.add_many([reqs[i] for i in batch]), strict=True):
                    owner[sid] = i
                self._collect(eng, owner, results, prompts)
                continue
            eng.step()
            self._collect(eng, owner, results, prompts)
        return [r for r in results if r is not None]

    def _collect(self, eng: SpeculativeEngine, owner: dict[int, int], results: list[GenerationResult | None],
                 prompts: Sequence[str | Sequence[int]]) -> None:
        for sid in list(owner):
            if sid not in eng.active:
                state = eng.remove(sid)
                i = owner.pop(sid)
                p = prompts[i]
                results[i] = self._result(state, p if isinstance(p, str) else None)

    def chat(
        self,
        messages: Sequence[dict[str, str]],
        max_tokens: int = 256,
        *,
        template: str | None = None,
        **kw: Any,
    ) -> GenerationResult:
        """Generate the assistant's reply to ``messages`` ({"role", "content"} dicts)."""
        prompt = self.model.apply_chat_template(messages, add_generation_prompt=True, template=template)
        toks = self.model.tokenize(prompt, add_special=True, parse_special=True)
        return self.generate(toks, max_tokens, **kw)


class TextStream:
    """Text pieces of one generation, UTF-8 safe and stop-string safe."""

    def __init__(self, llm: LLM, request: dict[str, Any], prompt: str | None) -> None:
        self._llm = llm
        self._req = request
        self._prompt = prompt
        self._result: GenerationResult | None = None
        self._stops = [s.encode("utf-8") for s in request["stop"]]

    @property
    def result(self) -> GenerationResult:
        if self._result is None:
            raise RuntimeError("the stream has not finished yet")
        return self._result

    def _held(self, text: bytes) -> int:
        """Bytes at the end of ``text`` that could still start a stop string."""
        hold = 0
        for s in self._stops:
            for n in range(min(len(s) - 1, len(text)), 0, -1):
                if text.endswith(s[:n]):
                    hold = max(hold, n)
                    break
        return hold

    def __iter__(self) -> Iterator[str]:
        eng = self._llm.engine
        sid = eng.add(**self._req)
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        sent = 0
        try:
            while True:
                state = eng.sequence(sid)
                text = state.text
                safe = len(text) if state.finished else len(text) - self._held(text)
                if safe > sent:
                    piece = decoder.decode(text[sent:safe], final=state.finished)
                    sent = safe
                    if piece:
                        yield piece
                if state.finished:
                    tail = decoder.decode(b"", final=True)
                    if tail:
                        yield tail
                    break
                eng.step()
        finally:
            state = eng.remove(sid) if sid in eng.active or sid in eng.results() else eng.sequence(sid)
            if state.t_done == 0.0:
                state.t_done = time.perf_counter()
        self._result = self._llm._result(state, self._prompt)

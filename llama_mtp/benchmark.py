"""Plain vs MTP throughput on one machine, as ratios (what ``llama-mtp bench`` runs).

Every configuration is measured ``repeat`` times, interleaved (config A, B, C,
A, B, C, ...) so slow drifts of the machine hit all of them alike; the median
is reported. Speed is a ratio to plain decoding with the same parallel count.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from .model import Model
from .params import ContextParams, SamplingParams, SpecParams
from .speculative import SpeculativeEngine
from .speculative.stats import SpecStats

__all__ = ["BenchConfig", "BenchRow", "run_bench"]

DEFAULT_PROMPT = "Multi-token prediction"


@dataclass(frozen=True)
class BenchConfig:
    mtp: bool
    draft_max: int | str
    parallel: int
    verify: str = "greedy"
    draft_vocab: int | str | None = "auto"

    @property
    def vocab(self) -> str:
        return "all" if self.draft_vocab is None else str(self.draft_vocab)

    @property
    def label(self) -> str:
        if not self.mtp:
            return "plain"
        return (f"mtp k={self.draft_max}" + ("" if self.verify in ("greedy", "auto") else f" {self.verify}")
                + ("" if self.draft_vocab == "auto" else f" vocab={self.vocab}"))


@dataclass
class BenchRow:
    mode: str
    draft_max: int | str
    parallel: int
    verify: str
    temperature: float
    tokens: int
    seconds: float
    tok_s: float
    speedup: float = 1.0
    acceptance: float = 0.0
    mean_len: float = 1.0
    runs: list[float] = field(default_factory=list)
    python_share: float = 0.0
    draft_vocab: str = "auto"    # the engine's draft_vocab ("all": the whole vocabulary)
    extra: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _measure(model: Model, cfg: BenchConfig, prompts: list[list[int]], n_tokens: int, temperature: float,
             n_ctx: int, params: ContextParams, seed: int, auto_cap: int | None = None) -> tuple[float, int, SpecStats, float]:
    spec = SpecParams(draft_max=cfg.draft_max if cfg.mtp else 0, verify=cfg.verify)  # type: ignore[arg-type]
    auto = cfg.draft_max == "auto"
    with SpeculativeEngine(model, max_sequences=cfg.parallel, n_ctx=n_ctx,
                           draft_max=(cfg.draft_max if cfg.mtp else 0),  # type: ignore[arg-type]
                           draft_cap=(auto_cap if auto else None), mtp=cfg.mtp, params=params, spec=spec,
                           draft_vocab=cfg.draft_vocab) as eng:  # type: ignore[arg-type]
        sampling = [SamplingParams(temperature=temperature, seed=seed + i) for i in range(len(prompts))]
        t0 = time.perf_counter()
        eng.add_many([dict(prompt=p, max_tokens=n_tokens, sampling=s, ignore_eos=True)
                      for p, s in zip(prompts, sampling, strict=True)])
        while eng.active:
            eng.step()
        dt = time.perf_counter() - t0
        total = sum(len(s.tokens) for s in eng.results().values())
        return dt, total, eng.stats.spec, eng.stats.python_share


def run_bench(
    model: Model,
    *,
    draft_maxes: Sequence[int | str] = (1, 2, 3, 4, 5, 6),
    parallels: Sequence[int] = (1,),
    verifies: Sequence[str] = ("greedy",),
    draft_vocabs: Sequence[int | str | None] = ("auto",),
    n_tokens: int = 128,
    repeat: int = 3,
    temperature: float = 0.0,
    prompt: str = DEFAULT_PROMPT,
    n_ctx: int = 1024,
    threads: int | None = None,
    progress: Callable[[int, int, str], None] | None = None,
) -> list[BenchRow]:
    """Measure plain decoding and MTP for every draft length, parallel count, verify mode
    and draft vocabulary (``draft_vocabs``: the engine's ``draft_vocab`` values)."""
    if repeat < 1 or n_tokens < 1:
        raise ValueError("repeat and n_tokens must be >= 1")
    params = ContextParams(n_threads=threads)
    configs: list[BenchConfig] = []
    for par in parallels:
        configs.append(BenchConfig(False, 0, par))
        if model.has_mtp:
            for verify in verifies:
                for dv in draft_vocabs:
                    for k in draft_maxes:
                        configs.append(BenchConfig(True, k, par, verify, dv))
    base_prompt = model.tokenize(prompt)
    results: dict[BenchConfig, list[tuple[float, int, SpecStats, float]]] = {c: [] for c in configs}
    total = len(configs) * (repeat + 1)
    done = 0
    for r in range(repeat + 1):  # round 0 warms up (page cache, graph allocation)
        for cfg in configs:
            prompts = [base_prompt] * cfg.parallel
            got = _measure(model, cfg, prompts, n_tokens, temperature, n_ctx, params, seed=1000 * r,
                           auto_cap=max([k for k in draft_maxes if isinstance(k, int)], default=None))
            if r > 0:
                results[cfg].append(got)
            done += 1
            if progress:
                progress(done, total, cfg.label)
    rows = []
    plain: dict[int, float] = {}
    for cfg in configs:
        runs = results[cfg]
        tps = [n / dt for dt, n, _, _ in runs]
        med = statistics.median(tps)
        spec = SpecStats()
        for _, _, s, _ in runs:
            spec.merge(s)
        row = BenchRow(
            mode="mtp" if cfg.mtp else "plain", draft_max=cfg.draft_max if cfg.mtp else 0, parallel=cfg.parallel,
            verify=cfg.verify if cfg.mtp else "-", temperature=temperature, tokens=runs[0][1],
            seconds=statistics.median(dt for dt, _, _, _ in runs), tok_s=med,
            acceptance=spec.acceptance_rate, mean_len=spec.mean_accepted_length if cfg.mtp else 1.0,
            runs=[round(t, 3) for t in tps], python_share=statistics.median(p for *_, p in runs),
            draft_vocab=cfg.vocab if cfg.mtp else "-",
        )
        if not cfg.mtp:
            plain[cfg.parallel] = med
        rows.append(row)
    for row in rows:
        row.speedup = row.tok_s / plain[row.parallel] if plain.get(row.parallel) else 0.0
    return rows

"""llama-mtp vs llama.cpp's own drivers, on one machine, as ratios.

    python bench/compare_upstream.py            # full run (see bench/README.md)
    python bench/compare_upstream.py --quick    # fewer draft lengths / repeats

1. plain decoding: ``llama-completion`` vs ours (``mtp=False``);
2. one sequence with MTP: ``llama-speculative-simple --spec-type draft-mtp`` vs ours,
   for draft lengths 1..6 at three acceptance levels -- same greedy output
   (asserted), same acceptance (reported);
3. 4 and 8 parallel sequences: ``llama-server -np N --spec-type draft-mtp`` on
   loopback with N concurrent requests vs our ``generate_many`` (aggregate tok/s);
4. the time split of our step (draft / verify / catch-up / Python).

Both sides run the same pinned llama.cpp source, built with the same CMake flags,
on the same model files, threads and draft lengths; every configuration is
measured ``--repeat`` times, interleaved, and the median is reported. Results go to
bench/results/ (JSON, markdown, PNG).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import models  # noqa: E402
import upstream  # noqa: E402

import llama_mtp as lm  # noqa: E402
from llama_mtp.cli import parse_draft_vocab  # noqa: E402
from llama_mtp.speculative import SpeculativeEngine  # noqa: E402
from llama_mtp.speculative.engine import DRAFT_VOCAB_AUTO  # noqa: E402

RESULTS = HERE / "results"
GREEDY = lm.SamplingParams(temperature=0.0)


def paired(ours: list[float], theirs: list[float]) -> float:
    """Median of ``ours[i] / theirs[i]`` over rounds (ratio of medians if they do not pair)."""
    if ours and len(ours) == len(theirs):
        return statistics.median(a / b for a, b in zip(ours, theirs, strict=True))
    return statistics.median(ours) / statistics.median(theirs)


@dataclass
class Cell:
    ours: list[float] = field(default_factory=list)
    theirs: list[float] = field(default_factory=list)
    ours_acc: float | None = None
    theirs_acc: float | None = None
    same_output: bool | None = None
    split: dict[str, float] = field(default_factory=dict)
    theirs_decode_only: list[float] = field(default_factory=list)  # plain: llama-completion's decodes alone

    def ratio(self) -> float:
        """The median of the per-round ratios (both sides of a round ran seconds apart, so a
        drift of the machine's speed between rounds cancels), else the ratio of medians."""
        return paired(self.ours, self.theirs)

    def as_dict(self) -> dict[str, Any]:
        return {
            "ours_tok_s": round(statistics.median(self.ours), 2), "upstream_tok_s": round(statistics.median(self.theirs), 2),
            "ratio": round(self.ratio(), 4),
            "ratio_of_medians": round(statistics.median(self.ours) / statistics.median(self.theirs), 4),
            "ours_runs": [round(x, 2) for x in self.ours],
            "upstream_runs": [round(x, 2) for x in self.theirs], "ours_acceptance": self.ours_acc,
            "upstream_acceptance": self.theirs_acc, "same_output": self.same_output, "time_split": self.split,
            **({"upstream_decode_only_tok_s": round(statistics.median(self.theirs_decode_only), 2)}
               if self.theirs_decode_only else {}),
        }


# ---------------------------------------------------------------- upstream drivers


def _run(cmd: list[str], timeout: float = 600) -> subprocess.CompletedProcess[str]:
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if out.returncode != 0:
        raise RuntimeError(f"{cmd[0]} failed ({out.returncode}):\n{out.stderr[-2000:]}")
    return out


#: extra flags for every upstream driver (``-ngl N`` when --gpu-layers is given). The drivers
#: run their own warm-up decode before timing (on a GPU the first decode of a shape pays
#: for cuBLAS handles and CUDA-graph capture; ours are warmed by untimed runs).
UP_EXTRA: list[str] = []


def up_plain(bins: dict[str, Path], model: Path, prompt: str, n: int, threads: int,
             n_ctx: int) -> tuple[float, float, str]:
    """llama-completion's generation loop: (tokens/s of the loop's wall clock, tokens/s of its
    decodes alone, text). The loop -- decode, sample, print -- is what our side's timer
    covers (decode, argmax, detokenize): its wall clock is llama.cpp's "total time" less the
    prompt's. "eval time" counts the decodes alone, which a GPU makes a few percent faster
    than the loop (sampling 32000 logits is ~40 us a token, a decode ~2 ms)."""
    out = _run([str(bins["llama-completion"]), "-m", str(model), "-p", prompt, "-n", str(n), "--temp", "0",
                "-t", str(threads), "-c", str(n_ctx), "-no-cnv", "--no-display-prompt", *UP_EXTRA])
    gen = out.stderr.split("prompt eval time")[-1]
    m = re.search(r"eval time =\s+([\d.]+) ms /\s+(\d+) runs", gen)
    prompt_ms = re.search(r"prompt eval time =\s+([\d.]+) ms", out.stderr)
    total_ms = re.search(r"total time =\s+([\d.]+) ms", gen)
    if not m or not prompt_ms or not total_ms:
        raise RuntimeError("could not parse llama-completion's timings:\n" + out.stderr[-1500:])
    runs = int(m.group(2))
    loop_s = (float(total_ms.group(1)) - float(prompt_ms.group(1))) / 1e3
    return runs / loop_s, runs / (float(m.group(1)) / 1e3), out.stdout


def up_spec(bins: dict[str, Path], model: Path, prompt: str, n: int, k: int, threads: int,
            n_ctx: int, attempts: int = 3) -> tuple[float, float, str]:
    # One run in a long session once exited 0 with its log cut short after
    # "creating MTP draft context"; not reproducible -- retry before giving up.
    for attempt in range(attempts):
        try:
            return _up_spec_once(bins, model, prompt, n, k, threads, n_ctx)
        except RuntimeError as e:
            if attempt == attempts - 1:
                raise
            print(f"  (llama-speculative-simple run failed, retrying: {str(e).splitlines()[0]})", flush=True)
    raise AssertionError("unreachable")


def _up_spec_once(bins: dict[str, Path], model: Path, prompt: str, n: int, k: int, threads: int,
                  n_ctx: int) -> tuple[float, float, str]:
    out = _run([str(bins["llama-speculative-simple"]), "-m", str(model), "--spec-type", "draft-mtp",
                "--spec-draft-n-max", str(k), "-p", prompt, "-n", str(n), "--temp", "0", "-t", str(threads),
                "-c", str(n_ctx), *UP_EXTRA])
    sp = re.search(r"decoded\s+\d+ tokens in\s+[\d.]+ seconds, speed:\s+([\d.]+)", out.stderr)
    n_drafted = re.search(r"n_drafted = (\d+)", out.stderr)
    n_accept = re.search(r"n_accept\s+= (\d+)", out.stderr)
    if not sp or not n_drafted or not n_accept:
        raise RuntimeError("could not parse llama-speculative-simple's output:\n" + out.stderr[-1500:])
    drafted, accepted = int(n_drafted.group(1)), int(n_accept.group(1))
    text = out.stdout.strip()  # it echoes the prompt first
    text = text[len(prompt.strip()):] if text.startswith(prompt.strip()) else text
    return float(sp.group(1)), accepted / drafted if drafted else 0.0, text


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """llama-server on loopback for one configuration; stops itself on exit."""

    def __init__(self, bins: dict[str, Path], model: Path, n_par: int, k: int, threads: int, n_ctx: int) -> None:
        self.port = _free_port()
        cmd = [str(bins["llama-server"]), "-m", str(model), "-np", str(n_par), "-c", str(n_ctx * n_par),
               "-t", str(threads), "--host", "127.0.0.1", "--port", str(self.port), *UP_EXTRA]
        if k > 0:
            cmd += ["--spec-type", "draft-mtp", "--spec-draft-n-max", str(k)]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        deadline = time.time() + 120
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError("llama-server exited:\n" + (self.proc.stderr.read() if self.proc.stderr else ""))
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.2)
        self.close()
        raise RuntimeError("llama-server did not become healthy within 120 s")

    def complete(self, prompt: str, n: int) -> dict[str, Any]:
        body = json.dumps({"prompt": prompt, "n_predict": n, "temperature": 0, "cache_prompt": False,
                           "ignore_eos": True}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/completion", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as r:
            return json.loads(r.read())

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def up_parallel(server: Server, prompts: list[str], lengths: list[int]) -> tuple[float, float, list[str]]:
    """Aggregate tok/s, acceptance and texts of one request per prompt (of ``lengths[i]``
    tokens), sent at once."""
    n_par = len(prompts)
    results: list[dict[str, Any]] = [{}] * n_par
    errors: list[BaseException] = []

    def go(i: int) -> None:
        try:
            results[i] = server.complete(prompts[i], lengths[i])
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=go, args=(i,)) for i in range(n_par)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise RuntimeError(f"llama-server request failed: {errors[0]}")
    tokens = sum(r["timings"]["predicted_n"] for r in results)
    drafted = sum(r["timings"].get("draft_n", 0) for r in results)
    accepted = sum(r["timings"].get("draft_n_accepted", 0) for r in results)
    return tokens / wall, accepted / drafted if drafted else 0.0, [r["content"] for r in results]


# ---------------------------------------------------------------- ours


class Ours:
    def __init__(self, model: lm.Model, threads: int, n_ctx: int) -> None:
        self.model = model
        self.threads = threads
        self.n_ctx = n_ctx
        self.engines: dict[tuple[int, int, bool], SpeculativeEngine] = {}
        self.draft_vocab: int | str | None = "auto"

    def engine(self, n_par: int, k: int | str) -> SpeculativeEngine:
        key = (n_par, k)
        if key not in self.engines:
            mtp = k == "auto" or int(k) > 0
            self.engines[key] = SpeculativeEngine(
                self.model, max_sequences=n_par, n_ctx=self.n_ctx, draft_max=k if mtp else 0,  # type: ignore[arg-type]
                mtp=mtp, sampling=GREEDY, draft_vocab=self.draft_vocab,
                params=lm.ContextParams(n_threads=self.threads))
        return self.engines[key]

    def run(self, prompt: str | list[str], n: int | list[int], k: int | str) -> tuple[float, float, list[str],
                                                                                  dict[str, float]]:
        """One generation of ``n`` tokens (or ``n[i]`` for prompt i) from each prompt (a list:
        that many sequences at once)."""
        prompts = [prompt] if isinstance(prompt, str) else prompt
        n_par = len(prompts)
        lengths = n if isinstance(n, list) else [n] * n_par
        eng = self.engine(n_par, k)
        before = eng.stats.as_dict()
        toks = [self.model.tokenize(p) for p in prompts]
        t0 = time.perf_counter()
        ids = eng.add_many([dict(prompt=t, max_tokens=m, ignore_eos=True) for t, m in zip(toks, lengths, strict=True)])
        t1 = time.perf_counter()
        while eng.active:
            eng.step()
        t2 = time.perf_counter()
        states = [eng.remove(i) for i in ids]
        after = eng.stats.as_dict()
        split = {k_: round(after[k_] - before[k_], 4) for k_ in ("draft_s", "verify_s", "catch_up_s", "restore_s",
                                                                 "python_s", "step_s")}
        spec = [s.stats for s in states]
        drafted = sum(s.draft_n for s in spec)
        acc = sum(s.draft_n_accepted for s in spec) / drafted if drafted else 0.0
        texts = [s.text.decode("utf-8", "replace") for s in states]
        if n_par == 1:
            # like llama-speculative-simple and llama-completion: tokens made by the decode loop
            rate = (len(states[0].tokens) - 1) / (t2 - t1)
        else:
            # like the server side: everything, prompts included, from first request to last reply
            rate = sum(len(s.tokens) for s in states) / (t2 - t0)
        return rate, acc, texts, split

    def close(self) -> None:
        for e in self.engines.values():
            e.close()


# ---------------------------------------------------------------- the run


def _same(a: str, b: str, n_words: int = 40) -> bool:
    """Same greedy continuation (compared word by word over the common prefix length)."""
    wa, wb = a.split(), b.split()
    n = min(len(wa), len(wb), n_words)
    return n > 10 and wa[:n] == wb[:n]


def machine() -> dict[str, Any]:
    cpu = ""
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    info = lm.build_info()
    gpus = [f"{d['description']} ({d['memory_total'] / 2**30:.0f} GiB)" for d in info["devices"] if d["kind"] != "cpu"]
    return {"cpu": cpu or platform.processor(), "cores": os.cpu_count(), "python": platform.python_version(),
            "platform": platform.platform(), "llama_mtp": lm.__version__, "backends": info["backends"],
            "gpus": gpus}


def describe(m: dict[str, Any], threads: int) -> str:
    """One line for a report: the GPU(s) when any, then the CPU."""
    gpu = ", ".join(m.get("gpus") or [])
    return (f"{gpu}; " if gpu else "") + f"{m['cpu']}, {m['cores']} cores, {threads} threads"


def add_common_args(ap: argparse.ArgumentParser, tokens: int) -> None:
    """The options every benchmark script here shares."""
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("-n", "--tokens", type=int, default=tokens)
    ap.add_argument("-t", "--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--n-ctx", type=int, default=1024)
    ap.add_argument("--out", default=str(RESULTS))


def draft_lengths(text: str) -> list[int]:
    """``"1-6"`` / ``"1,3,5"`` / ``"1-3,6"`` -> sorted draft lengths."""
    out: set[int] = set()
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return sorted(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="k in {1,3,6}, 2 repeats, 64 tokens")
    ap.add_argument("--draft", default="1-6", help="draft lengths, e.g. 1-6 or 1,3")
    ap.add_argument("--levels", default="50,75,97", help="acceptance levels in percent")
    ap.add_argument("--parallel", default="4,8", help="parallel counts for the server comparison ('' for none)")
    ap.add_argument("--parallel-k", type=int, default=3, help="draft length of the parallel comparison")
    ap.add_argument("--mixed-lengths", action="store_true",
                    help="parallel requests of different lengths (64, 52, 40, 60, ... for 8 of 64 tokens): "
                         "they end at different times, as requests ending at end-of-generation tokens do")
    ap.add_argument("--lockstep", action="store_true",
                    help="every parallel request the same prompt (runs before 2026-12-07 14:00; default: "
                         "sequence j starts 5 j words on, so drafts are not all accepted or rejected at once)")
    ap.add_argument("--size", default="0.3b", choices=sorted(models.SIZES), help="benchmark model size")
    ap.add_argument("--gpu-layers", type=int, default=None,
                    help="layers to offload, both sides (-ngl); default: llama.cpp's (all, on a GPU build)")
    ap.add_argument("--upstream-bin", default=None,
                    help=f"prebuilt llama.cpp drivers (a directory; also ${upstream.ENV_BIN}) instead of building them")
    ap.add_argument("--draft-vocab", default="auto", type=parse_draft_vocab,
                    help="our engines' draft_vocab: auto (a reduced vocabulary on a CPU), all, or N")
    ap.add_argument("--tag", default="", help="suffix of the result files (compare_upstream-TAG.*), e.g. cuda")
    add_common_args(ap, tokens=128)
    args = ap.parse_args()
    if args.gpu_layers is not None:
        UP_EXTRA[:] = ["-ngl", str(args.gpu_layers)]
    stem = "compare_upstream" + (f"-{args.tag}" if args.tag else "")
    if args.quick:
        args.draft = "1,3,6" if args.draft == "1-6" else args.draft
        args.repeat, args.tokens = min(args.repeat, 2), min(args.tokens, 64)
    ks = draft_lengths(args.draft)
    levels = [int(x) / 100 for x in args.levels.split(",")]
    pars = [int(x) for x in args.parallel.split(",") if x.strip()]
    if any(n < 1 for n in pars):  # before the run: llama-server refuses them after the one-sequence part
        ap.error(f"--parallel {args.parallel!r}: sequence counts are 1 or more ('' for no parallel comparison)")
    t_start = time.time()

    bins = upstream.prebuilt(args.upstream_bin)
    if bins is None:
        print("building llama.cpp's drivers from the pinned source (cached) ...", flush=True)
        bins = upstream.build()
    report: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M"), "machine": machine(),
                              "llama_cpp_commit": lm.build_info()["llama_cpp_commit"],
                              "settings": {"tokens": args.tokens, "repeat": args.repeat, "threads": args.threads,
                                           "n_ctx": args.n_ctx, "draft_lengths": ks, "parallel_k": args.parallel_k,
                                           "parallel_prompts": "lockstep" if args.lockstep else "spread",
                                           "parallel_lengths": "mixed" if args.mixed_lengths else "equal", "size": args.size,
                                           "n_params": models.n_params(models.base_spec(args.size)),
                                           "gpu_layers": args.gpu_layers, "draft_vocab": args.draft_vocab,
                                           "upstream": str(args.upstream_bin or "") or upstream.cmake_flags()},
                              "plain": {}, "mtp": {}, "parallel": {}}
    prompt = models.PROMPT
    md = ""
    for level in levels:
        path, spec, predicted = models.bench_model(level, size=args.size)
        tag = f"{int(round(level * 100))}"
        print(f"\n== acceptance ~{tag}% ({path.name}, mtp_noise {spec.mtp_noise}, predicted {predicted:.3f})", flush=True)
        model = lm.Model(path, n_gpu_layers=args.gpu_layers)
        ours = Ours(model, args.threads, args.n_ctx)
        ours.draft_vocab = args.draft_vocab
        cells: dict[str, Cell] = {"plain": Cell(), **{f"k{k}": Cell() for k in ks}}
        try:
            ours.run(prompt, 16, 0)
            ours.run(prompt, 16, "auto")
            auto_runs: list[float] = []
            for k in ks:
                ours.run(prompt, 16, k)  # warm-up: graphs allocated, pages resident
            for r in range(args.repeat):
                for name, cell in cells.items():
                    k = 0 if name == "plain" else int(name[1:])
                    if k == 0:
                        theirs, decode_only, text_up = up_plain(bins, path, prompt, args.tokens, args.threads,
                                                                args.n_ctx)
                        cell.theirs_decode_only.append(decode_only)
                        mine, _, texts, split = ours.run(prompt, args.tokens, 0)
                    else:
                        theirs, acc_up, text_up = up_spec(bins, path, prompt, args.tokens, k, args.threads, args.n_ctx)
                        mine, acc, texts, split = ours.run(prompt, args.tokens, k)
                        cell.ours_acc, cell.theirs_acc = round(acc, 4), round(acc_up, 4)
                    cell.theirs.append(theirs)
                    cell.ours.append(mine)
                    cell.split = split
                    same = _same(texts[0], text_up)
                    cell.same_output = same if cell.same_output is None else (cell.same_output and same)
                    print(f"  [{r + 1}/{args.repeat}] {name:5} ours {mine:6.1f}  upstream {theirs:6.1f} tok/s"
                          + (f"  acceptance {cell.ours_acc:.3f} / {cell.theirs_acc:.3f}" if k else "")
                          + ("" if same else "  OUTPUT DIFFERS"), flush=True)
                auto, acc, texts, _ = ours.run(prompt, args.tokens, "auto")
                auto_runs.append(auto)
                print(f"  [{r + 1}/{args.repeat}] auto  ours {auto:6.1f} tok/s  acceptance {acc:.3f}", flush=True)
            best_up = max(cells[f"k{k}"].theirs and statistics.median(cells[f"k{k}"].theirs) for k in ks)
            report.setdefault("auto", {})[tag] = {
                "ours_tok_s": round(statistics.median(auto_runs), 2), "ours_runs": [round(x, 2) for x in auto_runs],
                "upstream_best_fixed_tok_s": round(best_up, 2),
                "ratio_to_upstream_best": round(statistics.median(auto_runs) / best_up, 4)}
            report["plain"][tag] = cells.pop("plain").as_dict()
            report["mtp"][tag] = {name: c.as_dict() for name, c in cells.items()}
            if pars and (level == 0.75 or (0.75 not in levels and level == levels[len(levels) // 2])):
                report["parallel"][tag] = run_parallel(bins, path, ours, prompt, pars, args)
        finally:
            ours.close()
            model.close()
        report["wall_s"] = round(time.time() - t_start, 1)
        md = write_report(report, Path(args.out), stem)  # after every level: a long run keeps what it measured
    try:
        plot(report, Path(args.out) / f"{stem}.png")
    except ImportError:
        print("(matplotlib not installed: no plot)")
    print("\n" + md)
    print(f"wrote {args.out}/{stem}.{{json,md,png}} in {report['wall_s']:.0f} s")


def write_report(report: dict[str, Any], out: Path, stem: str = "compare_upstream") -> str:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(report, indent=2))
    md = markdown(report)
    (out / f"{stem}.md").write_text(md)
    return md


def run_parallel(bins: dict[str, Path], path: Path, ours: Ours, prompt: str, pars: list[int],
                 args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    k = args.parallel_k
    n0 = max(32, args.tokens // 2)
    for n_par in pars:
        cell = Cell()
        prompts = [prompt if args.lockstep else models.spread(prompt, j) for j in range(n_par)]
        # --mixed-lengths: request j stops after n - (n / 2) * ((3 j) mod N) / N tokens, so
        # they end at different times, not in the order of their slots
        n = [n0 - n0 // 2 * ((3 * j) % n_par) // n_par if args.mixed_lengths else n0 for j in range(n_par)]
        with Server(bins, path, n_par, k, args.threads, args.n_ctx) as srv:
            up_parallel(srv, prompts, [16] * n_par)  # warm-up
            ours.run(prompts, 16, k)
            ours.run(prompts, 16, "auto")
            auto_runs: list[float] = []
            for r in range(args.repeat):
                theirs, acc_up, texts_up = up_parallel(srv, prompts, n)
                mine, acc, texts, split = ours.run(prompts, n, k)
                cell.theirs.append(theirs)
                cell.ours.append(mine)
                cell.ours_acc, cell.theirs_acc, cell.split = round(acc, 4), round(acc_up, 4), split
                same = all(_same(a, b, 20) for a, b in zip(texts, texts_up, strict=True))
                cell.same_output = same if cell.same_output is None else (cell.same_output and same)
                auto, _, _, _ = ours.run(prompts, n, "auto")
                auto_runs.append(auto)
                print(f"  [{r + 1}/{args.repeat}] parallel {n_par}: ours {mine:6.1f} (auto {auto:6.1f})  llama-server "
                      f"{theirs:6.1f} tok/s (aggregate)  acceptance {acc:.3f} / {acc_up:.3f}", flush=True)
        out[str(n_par)] = cell.as_dict()
        out[str(n_par)]["ours_auto_tok_s"] = round(statistics.median(auto_runs), 2)
        out[str(n_par)]["ours_auto_runs"] = [round(x, 2) for x in auto_runs]
        out[str(n_par)]["auto_ratio"] = round(paired(auto_runs, cell.theirs), 4)
    return out


def markdown(r: dict[str, Any]) -> str:
    lines = [f"### llama-mtp vs llama.cpp ({r['date']})", "",
             f"{describe(r['machine'], r['settings']['threads'])}; "
             f"llama.cpp `{r['llama_cpp_commit'][:7]}` built with the same flags on both sides; "
             f"{model_line(r['settings'])}{r['settings']['tokens']} tokens, greedy, median of "
             f"{r['settings']['repeat']} interleaved runs (tok/s: medians; ratios: the median of the per-run "
             f"ratios, both sides of a run seconds apart). Our drafts: "
             f"{draft_vocab_line(r['settings'].get('draft_vocab', 'all'))}.", "",
             "| acceptance | plain: ours / llama-completion | " + " | ".join(
                 f"k={k}" for k in r["settings"]["draft_lengths"]) + " |",
             "|---|---|" + "---|" * len(r["settings"]["draft_lengths"])]
    for tag, plain in r["plain"].items():
        row = [f"~{tag}%", f"{plain['ours_tok_s']:.1f} / {plain['upstream_tok_s']:.1f} = **{plain['ratio']:.3f}x**"]
        for k in r["settings"]["draft_lengths"]:
            c = r["mtp"][tag][f"k{k}"]
            row.append(f"{c['ours_tok_s']:.1f} / {c['upstream_tok_s']:.1f} = **{c['ratio']:.3f}x** "
                       f"(acc {c['ours_acceptance']:.2f}/{c['upstream_acceptance']:.2f}"
                       + ("" if c["same_output"] else ", output differs") + ")")
        lines.append("| " + " | ".join(row) + " |")
    lines += ["", "MTP cells: ours / `llama-speculative-simple --spec-type draft-mtp` tok/s (acceptance ours/upstream). "
              "Plain: the generation loop's wall clock on both sides (llama-completion's total time less its "
              "prompt; its decodes alone are in the JSON as `upstream_decode_only_tok_s`).", ""]
    if r.get("auto"):
        lines += ["Adaptive draft length (`draft_max='auto'`, one sequence) vs llama.cpp's best fixed k "
                  "(chosen after the fact):", "",
                  "| acceptance | ours, auto | llama.cpp, best fixed k | ratio |", "|---|---|---|---|"]
        for tag, a in r["auto"].items():
            lines.append(f"| ~{tag}% | {a['ours_tok_s']:.1f} | {a['upstream_best_fixed_tok_s']:.1f} | "
                         f"**{a['ratio_to_upstream_best']:.3f}x** |")
        lines.append("")
    if r["parallel"]:
        pk = r["settings"].get("parallel_k", 3)
        lines += [f"| acceptance | parallel | ours, k={pk} | ours, auto | llama-server -np N, k={pk} | ratio k={pk} "
                  "| ratio auto |",
                  "|---|---|---|---|---|---|---|"]
        for tag, cells in r["parallel"].items():
            for n_par, c in cells.items():
                auto = c["ours_auto_tok_s"]
                lines.append(f"| ~{tag}% | {n_par} | {c['ours_tok_s']:.1f} | {auto:.1f} | {c['upstream_tok_s']:.1f} | "
                             f"**{c['ratio']:.3f}x** | **{c.get('auto_ratio', auto / c['upstream_tok_s']):.3f}x** |")
        how = r["settings"].get("parallel_prompts", "lockstep")
        lines += ["Parallel: N requests at once, " + (
            "all of the same prompt (in lockstep: every draft accepted or rejected by all of them at once)"
            if how == "lockstep" else "sequence j's prompt 5 j words further along the text (spread: their drafts "
            "are accepted and rejected independently, as in a real batch)")
            + ("; request j of N stops after n - (n / 2) ((3 j) mod N) / N tokens (they end at different times)"
               if r["settings"].get("parallel_lengths") == "mixed" else "")
            + "; tok/s: every token over the wall clock from the first request to the last reply.", ""]
    # time split of our step, from the k=3 cells
    lines += ["Our step, time split at k=3 (seconds over one generation):", ""]
    for tag, cells in r["mtp"].items():
        c = cells.get("k3")
        if c and c["time_split"]:
            s = c["time_split"]
            step = s["step_s"] or 1.0
            lines.append(f"- ~{tag}%: draft {s['draft_s']:.3f} ({s['draft_s'] / step:.0%}), verify {s['verify_s']:.3f} "
                         f"({s['verify_s'] / step:.0%}), catch-up {s['catch_up_s']:.3f}, restore {s['restore_s']:.3f}, "
                         f"Python {s['python_s']:.3f} ({s['python_s'] / step:.1%})")
    return "\n".join(lines) + "\n"


def draft_vocab_line(dv: int | str | None) -> str:
    if dv in (None, "all"):
        return "the whole vocabulary, as upstream's"
    if dv == "auto":
        dv = str(DRAFT_VOCAB_AUTO)
    return (f"the first {dv} token ids plus the tokens the text brings (`draft_vocab`; the benchmark "
            f"models' MTP noise lies on the first {models.MTP_NOISE_VOCAB} rows, so acceptance is upstream's)")


def model_line(settings: dict[str, Any]) -> str:
    n = settings.get("n_params")
    return f"{n / 1e9:.1f}B-parameter F16 model; " if n else ""


def plot(r: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    ks = r["settings"]["draft_lengths"]
    for tag, cells in r["mtp"].items():
        plain_up = r["plain"][tag]["upstream_tok_s"]
        a1.plot(ks, [cells[f"k{k}"]["ours_tok_s"] / plain_up for k in ks], marker="o", label=f"ours, ~{tag}%")
        a1.plot(ks, [cells[f"k{k}"]["upstream_tok_s"] / plain_up for k in ks], marker="x", ls="--",
                label=f"llama.cpp, ~{tag}%")
        a2.plot(ks, [cells[f"k{k}"]["ratio"] for k in ks], marker="o", label=f"~{tag}%")
    a1.axhline(1.0, color="gray", lw=0.8)
    a1.set(xlabel="draft length", ylabel="speedup vs llama-completion", title="MTP speedup over plain decoding")
    a2.axhline(1.0, color="gray", lw=0.8)
    a2.set(xlabel="draft length", ylabel="ours / llama.cpp", title="llama-mtp vs llama-speculative-simple")
    for a in (a1, a2):
        a.grid(alpha=0.3)
        a.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()

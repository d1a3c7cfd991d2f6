"""``llama-mtp``: generate, bench, info, make-demo-model (click).

User mistakes print one line (what went wrong, what to do) and exit non-zero;
``--verbose`` shows llama.cpp's own log.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path
from typing import Any, NoReturn

import click

from . import __version__
from .errors import LlamaError

__all__ = ["main"]

EXIT_USAGE, EXIT_ERROR = 2, 1


class _Group(click.Group):
    """Usage errors and library errors become one clear line on stderr."""

    def main(self, *args: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("standalone_mode", False)
        try:
            return super().main(*args, **kwargs)
        except click.exceptions.Exit as exc:
            sys.exit(exc.exit_code)
        except click.Abort:
            click.echo("aborted", err=True)
            sys.exit(130)
        except click.UsageError as exc:
            cmd = exc.ctx.command_path if exc.ctx else "llama-mtp"
            click.echo(f"error: {exc.format_message()} (see `{cmd} --help`)", err=True)
            sys.exit(EXIT_USAGE)
        except click.ClickException as exc:
            click.echo(f"error: {exc.format_message()}", err=True)
            sys.exit(exc.exit_code)
        except KeyboardInterrupt:
            click.echo("interrupted", err=True)
            sys.exit(130)
        except (LlamaError, OSError, ValueError) as exc:
            _die(exc)


def _die(exc: BaseException) -> NoReturn:
    text = getattr(exc, "message", None) or str(exc)
    line = " ".join(str(text).split("\n")[0].split())
    hint = ""
    from .errors import ModelLoadError, MTPUnavailableError

    if isinstance(exc, ModelLoadError):
        hint = " (pass a GGUF model with -m, or leave -m out to use the built-in demo model)"
    elif isinstance(exc, MTPUnavailableError):
        hint = " (use --no-mtp for plain decoding)"
    click.echo(f"error: {line}{hint}", err=True)
    if logging.getLogger("llama_mtp").isEnabledFor(logging.DEBUG) and getattr(exc, "log", None):
        for entry in exc.log:  # type: ignore[attr-defined]
            click.echo(f"  llama.cpp: {entry}", err=True)
    sys.exit(EXIT_ERROR)


def _setup_logging(verbose: bool) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
    log = logging.getLogger("llama_mtp")
    log.handlers[:] = [h for h in log.handlers if isinstance(h, logging.NullHandler)]
    if verbose:
        log.addHandler(handler)
        log.setLevel(logging.DEBUG)
    else:
        log.setLevel(logging.WARNING)


def _model_path(model: str | None, variant: str = "small") -> Path:
    if model is not None:
        return Path(model)
    from .demo import demo_model_path

    path = demo_model_path(variant)  # type: ignore[arg-type]
    click.echo(f"llama-mtp: no -m given, using the built-in demo model ({variant}): {path}", err=True)
    return path


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, "-V", "--version", prog_name="llama-mtp")
def main() -> None:
    """MTP (multi-token prediction) speculative decoding with llama.cpp."""


# ---------------------------------------------------------------- generate

_VERIFY = click.Choice(["auto", "greedy", "match", "rejection"])


@main.command()
@click.option("-m", "--model", type=click.Path(dir_okay=True), default=None, help="GGUF model (default: the built-in demo model)")
@click.option("-p", "--prompt", default=None, help="prompt text")
@click.option("-f", "--file", "prompt_file", type=click.Path(exists=True, dir_okay=False), default=None,
              help="prompts, one per line (run as parallel sequences)")
@click.option("-n", "--max-tokens", type=click.IntRange(min=1), default=128, show_default=True, help="tokens to generate")
@click.option("--temp", type=click.FloatRange(min=0.0), default=0.8, show_default=True, help="temperature (0 = greedy)")
@click.option("--top-k", type=click.IntRange(min=0), default=40, show_default=True)
@click.option("--top-p", type=click.FloatRange(0.0, 1.0), default=0.95, show_default=True)
@click.option("--min-p", type=click.FloatRange(0.0, 1.0), default=0.05, show_default=True)
@click.option("--repeat-penalty", type=click.FloatRange(min=0.0), default=1.0, show_default=True)
@click.option("--seed", type=click.IntRange(min=0), default=None, help="random seed (default: random)")
@click.option("--stop", multiple=True, help="stop string (repeatable)")
@click.option("--draft-max", default="auto", show_default=True,
              help="tokens drafted per step: auto (chosen each step from measured costs and acceptance) or 0..64")
@click.option("--mtp/--no-mtp", default=True, show_default=True, help="speculate with the model's MTP head")
@click.option("--ngram", is_flag=True, help="also draft by prompt lookup (n-gram)")
@click.option("--verify", type=_VERIFY, default="auto", show_default=True,
              help="draft verification: auto = greedy at T=0, rejection sampling otherwise")
@click.option("--parallel", type=click.IntRange(1, 256), default=None, help="sequences at once (-p: N samples)")
@click.option("--chat", is_flag=True, help="treat the prompt as a user message and apply the chat template")
@click.option("--stream/--no-stream", default=None, help="print text as it is generated (default: one sequence)")
@click.option("--json", "as_json", is_flag=True, help="print one JSON object per sequence")
@click.option("-c", "--n-ctx", type=click.IntRange(min=16), default=4096, show_default=True, help="context per sequence")
@click.option("-t", "--threads", type=click.IntRange(1, 1024), default=None, help="CPU threads (default: all cores)")
@click.option("-ngl", "--n-gpu-layers", type=click.IntRange(min=-1), default=None, help="layers on the GPU (-1: all)")
@click.option("--draft-vocab", default="auto", show_default=True,
              help="tokens a draft may propose: auto (a reduced vocabulary on a CPU), all, or N (the first N ids "
                   "plus the tokens the text brings)")
@click.option("--recalibrate", is_flag=True,
              help="measure decode costs again for --draft-max auto and forget what earlier runs' drafts learnt "
                   "(else both are reused from the cache)")
@click.option("-v", "--verbose", is_flag=True, help="show llama.cpp's log")
def generate(model: str | None, prompt: str | None, prompt_file: str | None, max_tokens: int, temp: float, top_k: int,
             top_p: float, min_p: float, repeat_penalty: float, seed: int | None, stop: tuple[str, ...],
             draft_max: str, mtp: bool, ngram: bool, verify: str, parallel: int | None, chat: bool,
             stream: bool | None, as_json: bool, n_ctx: int, threads: int | None, n_gpu_layers: int | None,
             draft_vocab: str, recalibrate: bool, verbose: bool) -> None:
    """Generate text, with MTP speculative decoding."""
    _setup_logging(verbose)
    from .generate import LLM

    dmax: int | str = draft_max
    if draft_max != "auto":
        if not draft_max.isdigit() or not 0 <= int(draft_max) <= 64:
            raise click.BadParameter(f"{draft_max!r} is not 'auto' or an integer in 0..64", param_hint="--draft-max")
        dmax = int(draft_max)
    dvocabs = _draft_vocabs(draft_vocab)
    if len(dvocabs) != 1:
        raise click.BadParameter(f"{draft_vocab!r}: one value (auto, all or N)", param_hint="--draft-vocab")
    if prompt is None and prompt_file is None:
        prompt = "Multi-token prediction" if model is None else None
        if prompt is None:
            raise click.UsageError("give a prompt with -p or a prompt file with -f")
    prompts: list[str] = []
    if prompt_file is not None:
        prompts = [line.rstrip("\n") for line in Path(prompt_file).read_text(encoding="utf-8").splitlines() if line.strip()]
        if not prompts:
            raise click.UsageError(f"{prompt_file} holds no prompts")
    if prompt is not None:
        prompts.insert(0, prompt)
    if len(prompts) == 1 and parallel and parallel > 1:
        prompts = prompts * parallel
    n_par = parallel or min(len(prompts), 8)
    path = _model_path(model)
    kw: dict[str, Any] = dict(temperature=temp, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed,
                              stop=list(stop), repeat_penalty=repeat_penalty, verify=verify)
    with LLM(path, mtp=mtp, draft_max=dmax, n_ctx=n_ctx, parallel=n_par, threads=threads,  # type: ignore[arg-type]
             n_gpu_layers=n_gpu_layers, ngram=ngram, draft_vocab=dvocabs[0],  # type: ignore[arg-type]
             recalibrate=recalibrate) as llm:
        t_engine = time.perf_counter()
        engine = llm.engine  # made here, so that its one-time calibration is reported apart
        if engine.calibration == "measured":
            click.echo(f"llama-mtp: measured this machine's decode costs for --draft-max auto in "
                       f"{time.perf_counter() - t_engine:.1f} s (once per model and settings: cached)", err=True)
        if chat:
            texts = [llm.model.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
            inputs: list[Any] = [llm.model.tokenize(t, parse_special=True) for t in texts]
        else:
            inputs = list(prompts)
        t0 = time.perf_counter()
        do_stream = (len(inputs) == 1 and not as_json) if stream is None else (stream and len(inputs) == 1)
        if do_stream:
            s = llm.stream(inputs[0], max_tokens, **kw)
            for piece in s:
                click.echo(piece, nl=False)
                sys.stdout.flush()
            click.echo()
            results = [s.result]
        elif len(inputs) == 1:
            results = [llm.generate(inputs[0], max_tokens, **kw)]
        else:
            results = llm.generate_many(inputs, max_tokens, **kw)
        wall = time.perf_counter() - t0
        for i, r in enumerate(results):
            if as_json:
                d = r.as_dict()
                d["index"] = i
                click.echo(json.dumps(d, ensure_ascii=False))
            elif not do_stream:
                if len(results) > 1:
                    click.echo(f"--- [{i}] {r.finish_reason} ---")
                click.echo(r.text)
        _summary(results, wall, llm.engine.stats.python_share if llm._engine else 0.0, mtp)


def _summary(results: list[Any], wall: float, python_share: float, mtp: bool) -> None:
    n = sum(len(r.tokens) for r in results)
    drafted = sum(r.stats.draft_n for r in results)
    accepted = sum(r.stats.draft_n_accepted for r in results)
    steps = sum(r.stats.steps for r in results)
    line = f"{n} tokens in {wall:.2f} s ({n / wall if wall > 0 else 0:.1f} tok/s"
    line += f", {len(results)} sequences)" if len(results) > 1 else ")"
    if mtp or drafted:
        rate = accepted / drafted if drafted else 0.0
        mean = 1 + accepted / steps if steps else 0.0
        line += f" | drafts accepted {rate:.1%} ({accepted}/{drafted}) | mean accepted length {mean:.2f}"
    else:
        line += " | plain decoding"
    click.echo(line, err=True)


# ---------------------------------------------------------------- info


@main.command()
@click.option("-m", "--model", type=click.Path(dir_okay=True), default=None, help="also describe this GGUF model")
@click.option("--json", "as_json", is_flag=True, help="print JSON")
@click.option("-v", "--verbose", is_flag=True, help="show llama.cpp's log")
def info(model: str | None, as_json: bool, verbose: bool) -> None:
    """Package, llama.cpp build, backends and devices; with -m, a model's MTP facts."""
    _setup_logging(verbose)
    from .info import build_info

    data: dict[str, Any] = build_info()
    if model is not None:
        data["model"] = describe_model(Path(model))
    if as_json:
        click.echo(json.dumps(data, indent=2))
        return
    from rich.console import Console
    from rich.table import Table

    con = Console()
    t = Table(show_header=False, box=None)
    t.add_row("llama-mtp", __version__)
    t.add_row("llama.cpp", data["llama_cpp_commit"])
    t.add_row("backends", ", ".join(data["backends"]))
    for d in data["devices"]:
        mem = f", {d['memory_total'] / 2**30:.1f} GiB" if d["memory_total"] else ""
        t.add_row("device", f"{d['name']} ({d['kind']}, {d['description']}{mem})")
    t.add_row("CPU features", data["system_info"])
    caps = data["capabilities"]
    t.add_row("supports", ", ".join(k for k in ("mmap", "mlock", "gpu_offload", "rpc") if caps[k]))
    con.print(t)
    if model is not None:
        mt = Table(title=f"model {model}", show_header=False)
        for k, v in data["model"].items():
            mt.add_row(k, str(v))
        con.print(mt)


def describe_model(path: Path) -> dict[str, Any]:
    from .context import Context
    from .model import Model

    with Model(path) as m:
        out: dict[str, Any] = {
            "arch": m.arch, "name": m.name, "description": m.description,
            "n_params": m.n_params, "size_bytes": m.size, "n_layer": m.n_layer, "n_layer_nextn": m.n_layer_nextn,
            "n_embd": m.n_embd, "n_head": m.n_head, "n_head_kv": m.n_head_kv, "n_vocab": m.n_vocab,
            "vocab_type": m.vocab_type, "n_ctx_train": m.n_ctx_train,
            "memory": "hybrid (recurrent + attention)" if m.is_hybrid else "recurrent" if m.is_recurrent else "attention",
            "mtp": m.has_mtp, "mtp_unavailable": m.mtp_unavailable_reason(),
            "chat_template": (m.chat_template or "")[:60] or None,
        }
        if m.is_hybrid or m.is_recurrent:
            with Context(m, n_ctx=256, n_rs_seq=1, n_batch=32) as ctx:
                out["partial_rollback"] = "n_rs_seq snapshots" if ctx.n_rs_seq > 0 else "checkpoints only"
        else:
            out["partial_rollback"] = "seq_rm (attention KV)"
        return out


# ---------------------------------------------------------------- bench


def parse_draft_vocab(value: str) -> int | str | None:
    """A ``--draft-vocab`` value: ``"auto"``, ``"all"`` (None: the whole vocabulary) or a
    positive integer; ValueError otherwise."""
    value = value.strip()
    if value in ("auto", "all"):
        return None if value == "all" else value
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{value!r} is not auto, all or a positive integer")
    return int(value)


def _draft_vocabs(value: str) -> list[int | str | None]:
    """``--draft-vocab`` as a comma-separated list (click's BadParameter where one is wrong)."""
    try:
        return [parse_draft_vocab(v) for v in value.split(",")]
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--draft-vocab") from None


def _int_list(value: str, name: str, allow_auto: bool = False) -> list[Any]:
    out: list[Any] = []
    for part in value.split(","):
        part = part.strip()
        if allow_auto and part == "auto":
            out.append("auto")
            continue
        if "-" in part and part[0] != "-":
            a, b = part.split("-", 1)
            if not (a.isdigit() and b.isdigit()) or int(a) > int(b):
                raise click.BadParameter(f"{value!r}: use e.g. 1-6 or 1,2,4", param_hint=name)
            out += list(range(int(a), int(b) + 1))
        elif part.isdigit():
            out.append(int(part))
        else:
            raise click.BadParameter(f"{value!r}: use e.g. 1-6 or 1,2,4", param_hint=name)
    if not out:
        raise click.BadParameter("empty list", param_hint=name)
    return out


@main.command()
@click.option("-m", "--model", type=click.Path(dir_okay=True), default=None,
              help="GGUF model (default: the built-in demo model, bench variant)")
@click.option("--draft-max", "draft_max", default="1-6,auto", show_default=True,
              help="draft lengths, e.g. 1-6, 1,3,5 or 1-4,auto")
@click.option("--parallel", default="1", show_default=True, help="parallel sequence counts, e.g. 1,4")
@click.option("-n", "--n-tokens", type=click.IntRange(min=1), default=128, show_default=True, help="tokens per sequence")
@click.option("-r", "--repeat", type=click.IntRange(min=1), default=3, show_default=True, help="measurements (median)")
@click.option("--temp", type=click.FloatRange(min=0.0), default=0.0, show_default=True, help="temperature")
@click.option("--verify", default=None, help="verification modes, e.g. match,rejection (default: greedy at T=0, else both)")
@click.option("--draft-vocab", "draft_vocab", default="auto", show_default=True,
              help="draft vocabularies to compare, e.g. auto,all or 8192,all (all: the whole vocabulary)")
@click.option("-p", "--prompt", default="Multi-token prediction", show_default=True)
@click.option("-t", "--threads", type=click.IntRange(1, 1024), default=None)
@click.option("--json", "as_json", is_flag=True, help="print the rows as JSON")
@click.option("--plot", type=click.Path(dir_okay=False), default=None, help="write a PNG of speedup and acceptance")
@click.option("-v", "--verbose", is_flag=True)
def bench(model: str | None, draft_max: str, parallel: str, n_tokens: int, repeat: int, temp: float, verify: str | None,
          draft_vocab: str, prompt: str, threads: int | None, as_json: bool, plot: str | None, verbose: bool) -> None:
    """Plain decoding vs MTP for several draft lengths and parallel counts."""
    _setup_logging(verbose)
    from .benchmark import run_bench
    from .model import Model

    ks = _int_list(draft_max, "--draft-max", allow_auto=True)
    pars = _int_list(parallel, "--parallel")
    if verify is None:
        verifies = ["greedy"] if temp == 0 else ["match", "rejection"]
    else:
        verifies = [v.strip() for v in verify.split(",") if v.strip()]
        bad = [v for v in verifies if v not in ("auto", "greedy", "match", "rejection")]
        if bad or not verifies:
            raise click.BadParameter(f"unknown mode(s) {bad}; use greedy, match, rejection", param_hint="--verify")
    vocabs = _draft_vocabs(draft_vocab)
    if plot is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise click.ClickException("--plot needs matplotlib: pip install 'llama-mtp[plot]'") from None
    path = _model_path(model, "bench")
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    err = Console(stderr=True)
    with Model(path) as m:
        with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                      TimeElapsedColumn(), console=err, transient=True, disable=as_json and not err.is_terminal) as prog:
            task = prog.add_task("benchmarking", total=None)

            def on_progress(done: int, total: int, label: str) -> None:
                prog.update(task, completed=done, total=total, description=f"benchmarking {label}")

            rows = run_bench(m, draft_maxes=ks, parallels=pars, verifies=verifies, draft_vocabs=vocabs, n_tokens=n_tokens,
                             repeat=repeat, temperature=temp, prompt=prompt, threads=threads, progress=on_progress)
        name = m.path.name
    if as_json:
        click.echo(json.dumps({"model": str(path), "temperature": temp, "n_tokens": n_tokens, "repeat": repeat,
                               "rows": [r.as_dict() for r in rows]}, indent=2))
    else:
        from rich.table import Table

        t = Table(title=f"{name}: {n_tokens} tokens/sequence, T={temp}, median of {repeat}")
        show_vocab = vocabs != ["auto"]  # a column only where it was chosen
        for col in ("mode", "draft", "parallel", "verify", *(("vocab",) if show_vocab else ()), "tok/s", "speedup",
                    "acceptance", "mean len"):
            t.add_column(col, justify="right" if col not in ("mode", "verify", "vocab") else "left")
        for r in rows:
            t.add_row(r.mode, str(r.draft_max), str(r.parallel), r.verify, *((r.draft_vocab,) if show_vocab else ()),
                      f"{r.tok_s:.1f}", f"{r.speedup:.2f}x",
                      f"{r.acceptance:.1%}" if r.mode != "plain" else "-", f"{r.mean_len:.2f}")
        Console().print(t)
    if plot is not None:
        plot_rows(rows, Path(plot), title=f"{name}, T={temp}")
        click.echo(f"wrote {plot}", err=True)


def plot_rows(rows: list[Any], out: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    series: dict[tuple[int, str], list[Any]] = {}
    for r in rows:
        if r.mode == "mtp" and isinstance(r.draft_max, int):
            series.setdefault((r.parallel, r.verify), []).append(r)
    for (par, ver), rs in sorted(series.items()):
        rs.sort(key=lambda r: r.draft_max)
        label = f"parallel {par}" + ("" if ver in ("greedy", "auto") else f", {ver}")
        a1.plot([r.draft_max for r in rs], [r.speedup for r in rs], marker="o", label=label)
        a2.plot([r.draft_max for r in rs], [r.acceptance for r in rs], marker="o", label=label)
    a1.axhline(1.0, color="gray", lw=0.8, ls="--")
    a1.set(xlabel="draft length", ylabel="speedup vs plain", title="speedup")
    a2.set(xlabel="draft length", ylabel="acceptance", title="draft acceptance", ylim=(0, 1.05))
    for a in (a1, a2):
        a.legend()
        a.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------- demo model


@main.command("make-demo-model")
@click.argument("out", type=click.Path(dir_okay=False))
@click.option("--variant", type=click.Choice(["small", "bench"]), default="small", show_default=True)
def make_demo_model(out: str, variant: str) -> None:
    """Write the built-in demo model (deterministic, planted weights) to OUT."""
    from .demo import write_demo_model

    path = write_demo_model(out, variant)  # type: ignore[arg-type]
    click.echo(f"wrote {path} ({path.stat().st_size / 1e6:.1f} MB)", err=True)


if __name__ == "__main__":  # pragma: no cover
    main()

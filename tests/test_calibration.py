"""The calibration cache: an engine with draft_max='auto' measures its decode costs once
per machine, model and settings, and later engines start from them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import GPU, count_decodes

import llama_mtp as lm
from llama_mtp.speculative import SpeculativeEngine, calibration
from llama_mtp.speculative.engine import REMEMBERED_FAILS


def _points(eng: SpeculativeEngine) -> dict[str, object]:
    c = eng.policy.costs
    out: dict[str, object] = {"verify": {n: dict(v.points) for n, v in c.verify.curves.items()},
                              "draft": dict(c.draft.points), "save": c.save, "restore": c.restore}
    if eng.policy.alt is not None:
        out["alt"] = {n: dict(v.points) for n, v in eng.policy.alt.verify.curves.items()}
    return out


def _engine(model: lm.Model, **kw: object) -> SpeculativeEngine:
    return SpeculativeEngine(model, max_sequences=2, n_ctx=128, draft_cap=3, **kw)  # type: ignore[arg-type]


@pytest.fixture
def noisy(model_path) -> lm.Model:  # type: ignore[no-untyped-def]
    with lm.Model(model_path("noisy")) as m:
        yield m  # type: ignore[misc]


def test_a_second_engine_starts_from_the_first_ones_calibration(noisy: lm.Model, calibration_cache: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    with _engine(noisy) as a:
        assert a.calibration == "measured"
        first = _points(a)
    files = list(calibration_cache.glob("*.json"))
    assert len(files) == 1
    doc = json.loads(files[0].read_text())
    assert doc["format"] == calibration.CALIBRATION_FORMAT and calibration.valid(doc["costs"])
    assert doc["material"]["model"]["path"] == str(noisy.path.resolve())
    calls = count_decodes(monkeypatch)
    with _engine(noisy) as b:
        assert b.calibration == "cached"
        assert calls == []  # not one decode at birth
        assert _points(b) == first  # the same starting costs, point for point
        # and it runs as any engine does: exact greedy output
        sid = b.add(noisy.tokenize("the model"), max_tokens=8, sampling=lm.SamplingParams.greedy_params())
        while b.active:
            b.step()
        assert len(b.sequence(sid).tokens) == 8


@pytest.mark.parametrize("change", ["max_sequences", "threads", "draft_cap", "model_file"])
def test_other_settings_are_measured_again(noisy: lm.Model, model_path, tmp_path: Path,  # type: ignore[no-untyped-def]
                                           calibration_cache: Path, change: str) -> None:
    with _engine(noisy) as a:
        assert a.calibration == "measured"
    if change == "model_file":  # a model file that changed (same path, new bytes or mtime)
        path = tmp_path / "m.gguf"
        path.write_bytes(Path(model_path("noisy")).read_bytes())
        with lm.Model(path) as m, _engine(m) as b:
            assert b.calibration == "measured"
        st = path.stat()
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
        with lm.Model(path) as m, _engine(m) as c:
            assert c.calibration == "measured"
        assert len(list(calibration_cache.glob("*.json"))) == 3
        return
    kw: dict[str, object] = {"max_sequences": dict(max_sequences=3), "draft_cap": dict(draft_cap=2),
                             "threads": dict(params=lm.ContextParams(n_threads=1))}[change]
    base: dict[str, object] = dict(max_sequences=2, n_ctx=128, draft_cap=3)
    with SpeculativeEngine(noisy, **{**base, **kw}) as b:  # type: ignore[arg-type]
        assert b.calibration == "measured"
    assert len(list(calibration_cache.glob("*.json"))) == 2


def test_recalibrate_measures_and_refreshes_the_cache(noisy: lm.Model, calibration_cache: Path) -> None:
    with _engine(noisy) as a:
        assert a.calibration == "measured"
    (f,) = calibration_cache.glob("*.json")
    doc = json.loads(f.read_text())
    doc["costs"]["draft"] = [[n, 123.0] for n, _ in doc["costs"]["draft"]]  # a calibration we can recognise
    f.write_text(json.dumps(doc))
    with _engine(noisy) as b:
        assert b.calibration == "cached" and b.policy.costs.draft.points[1] == 123.0
    with _engine(noisy, recalibrate=True) as c:
        assert c.calibration == "measured" and c.policy.costs.draft.points[1] < 1.0
    assert json.loads(f.read_text())["costs"]["draft"][0][1] < 1.0


@pytest.mark.parametrize("damage", ["garbage", "truncated", "negative", "nan", "other_format", "other_material"])
def test_a_damaged_cache_file_is_measured_again_and_replaced(noisy: lm.Model, calibration_cache: Path,
                                                             damage: str) -> None:
    with _engine(noisy):
        pass
    (f,) = calibration_cache.glob("*.json")
    text = f.read_text()
    doc = json.loads(text)
    if damage == "garbage":
        f.write_bytes(b"\x00\xffnot json")
    elif damage == "truncated":
        f.write_text(text[: len(text) // 2])
    elif damage in ("negative", "nan"):
        doc["costs"]["verify"]["1"][0][1] = -1.0 if damage == "negative" else float("nan")
        f.write_text(json.dumps(doc))
    elif damage == "other_format":
        doc["format"] = calibration.CALIBRATION_FORMAT + 1
        f.write_text(json.dumps(doc))
    else:  # a hash collision, or a file copied from elsewhere: the material must match too
        doc["material"]["max_sequences"] = 99
        f.write_text(json.dumps(doc))
    with _engine(noisy) as b:
        assert b.calibration == "measured"
    doc = json.loads(f.read_text())
    assert calibration.valid(doc["costs"]) and doc["material"]["max_sequences"] == 2


def test_the_rollback_modes_are_priced_the_right_way_round(noisy: lm.Model, calibration_cache: Path) -> None:
    """Snapshots are extra work on every decode: a measurement never prices the context
    without them dearer than the one with them (timing noise is clamped), and a cached
    calibration that does (one from before the clamp: eight sequences on a 2-core CPU
    once timed it 25% dearer, and the engine switched modes back and forth all run) is
    measured again."""
    with _engine(noisy) as a:
        assert a.calibration == "measured" and a.policy.alt is not None and a.policy.alt_replays
        got = _points(a)
    alt = got["alt"]
    assert isinstance(alt, dict) and alt
    verify = got["verify"]
    assert isinstance(verify, dict)
    for n, pts in alt.items():
        for rows, secs in pts.items():
            assert secs <= verify[n][rows] * (1 + 1e-9)
    (f,) = calibration_cache.glob("*.json")
    doc = json.loads(f.read_text())
    for pts in doc["costs"]["alt"]["verify"].values():
        for p in pts:
            p[1] *= 1.25 * 1.25  # a quarter dearer than the snapshots' decode, at least
    f.write_text(json.dumps(doc))
    with _engine(noisy) as b:
        assert b.calibration == "measured"
    doc = json.loads(f.read_text())
    mine = {n: dict(map(tuple, pts)) for n, pts in doc["costs"]["verify"].items()}
    assert all(t <= mine[n][r] * (1 + 1e-9) for n, pts in doc["costs"]["alt"]["verify"].items() for r, t in pts)


def test_an_unwritable_cache_costs_nothing_but_the_cache(noisy: lm.Model, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setattr(calibration, "cache_root", lambda: blocker / "calibration")  # under a file: mkdir fails
    for _ in range(2):
        with _engine(noisy) as e:
            assert e.calibration == "measured"
    assert not any(p.name.endswith(".part") for p in tmp_path.rglob("*"))


@pytest.mark.skipif(GPU, reason="offloaded layers keep the snapshots (no switching, no second context)")
def test_a_measurement_without_room_for_the_other_mode_is_not_kept(noisy: lm.Model, calibration_cache: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """No room for the second target context at birth: no switching for this engine, and
    nothing cached -- room is the moment's, and the next engine may have it."""
    import llama_mtp.speculative.engine as engine_mod
    from llama_mtp.errors import LlamaError

    real_context = engine_mod.Context

    def no_room(model, params=None):  # type: ignore[no-untyped-def]
        if params is not None and params.n_rs_seq == 0:
            raise LlamaError("failed to allocate the KV cache")
        return real_context(model, params)

    with monkeypatch.context() as mp:
        mp.setattr(engine_mod, "Context", no_room)
        with _engine(noisy) as a:
            assert a.calibration == "measured" and a.policy.alt is None
    assert list(calibration_cache.glob("*.json")) == []
    with _engine(noisy) as b:
        assert b.calibration == "measured" and b.policy.alt is not None
    assert len(list(calibration_cache.glob("*.json"))) == 1


def test_the_cli_says_when_it_measures(model_path, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    def gen(*extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "llama_mtp", "generate", "-m", str(model_path("planted")),
                               "-p", "the model", "-n", "8", "--temp", "0", *extra], capture_output=True, text=True,
                              timeout=300, cwd=tmp_path, env={**os.environ, "LLAMA_MTP_CACHE_DIR": str(tmp_path)})
    runs = [gen(), gen(), gen("--recalibrate")]
    for r in runs:
        assert r.returncode == 0, r.stderr
    said = ["measured this machine's decode costs" in r.stderr for r in runs]
    assert said == [True, False, True]
    # one calibration, and what the runs' drafts learnt beside it (the next run starts from it)
    (mem,) = _memory_files(tmp_path / "calibration")
    names = sorted(p.name for p in (tmp_path / "calibration").glob("*.json"))
    assert names == sorted([mem.name.replace(".memory", ""), mem.name])


def test_a_model_file_gone_since_it_was_loaded_is_measured_and_not_kept(model_path, tmp_path: Path,  # type: ignore[no-untyped-def]
                                                                        calibration_cache: Path) -> None:
    path = tmp_path / "gone.gguf"
    path.write_bytes(Path(model_path("noisy")).read_bytes())
    with lm.Model(path) as m:
        path.unlink()  # the model stays mapped; its file identity cannot be read
        with _engine(m) as e:
            assert e.calibration == "measured"
    assert list(calibration_cache.glob("*")) == []


def test_engines_made_at_once_in_threads_leave_one_valid_file(noisy: lm.Model, calibration_cache: Path) -> None:
    import threading

    errors: list[BaseException] = []

    def make() -> None:
        try:
            with _engine(noisy):
                pass
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=make) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    files = list(calibration_cache.iterdir())
    assert len(files) == 1 and calibration.valid(json.loads(files[0].read_text())["costs"])


def test_nothing_is_calibrated_or_cached_without_auto(noisy: lm.Model, calibration_cache: Path) -> None:
    for kw in (dict(draft_max=3), dict(draft_max=0), dict(mtp=False)):
        with SpeculativeEngine(noisy, max_sequences=1, n_ctx=128, **kw) as e:  # type: ignore[arg-type]
            assert e.calibration is None
    assert list(calibration_cache.glob("*")) == []


@pytest.mark.parametrize("bad", [None, [], {"verify": {}, "draft": [[1, 0.1]]},
                                 {"verify": {"1": [[1, 0.1]]}, "draft": [[0, 0.1]]},
                                 {"verify": {"x": [[1, 0.1]]}, "draft": [[1, 0.1]]},
                                 {"verify": {"1": [[1, 0.1]]}, "draft": [[1, 0.1]], "save": -1},
                                 {"verify": {"1": [[1, 0.1]]}, "draft": [[1, 0.1]], "alt": {"verify": {}}},
                                 {"verify": {"1": [[1.5, 0.1]]}, "draft": [[1, 0.1]]},
                                 {"verify": {"1": [[1, 0.1]]}, "draft": [[1, 0.1]], "save": 0.1, "restore": None},
                                 {"verify": {"1": [[True, 0.1]]}, "draft": [[1, 0.1]]},
                                 {"verify": {"1": [[1, 0.1]]}, "draft": [[1, 0.1]],
                                  "alt": {"verify": {"1": [[1, 0.1]]}, "save": None, "restore": 0.2}}])
def test_valid_refuses_what_an_engine_cannot_start_from(bad: object) -> None:
    assert not calibration.valid(bad)
    assert calibration.valid({"verify": {"1": [[1, 0.1]]}, "draft": [[1, 0.1]], "save": None, "restore": None,
                              "alt": None})


def test_the_cache_lives_in_the_package_cache_dir(tmp_path: Path) -> None:
    code = "from llama_mtp.speculative import calibration; print(calibration.cache_root())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path,
                         env={**os.environ, "LLAMA_MTP_CACHE_DIR": str(tmp_path)})  # cwd: the installed package
    assert out.returncode == 0, out.stderr
    assert Path(out.stdout.strip()) == tmp_path / "calibration"


# ---------------------------------------------------------------- engine memory


def _run(eng: SpeculativeEngine, model: lm.Model, n: int = 24) -> list[int]:
    sid = eng.add(model.tokenize("the model"), max_tokens=n, sampling=lm.SamplingParams.greedy_params())
    while eng.active:
        eng.step()
    return eng.sequence(sid).tokens


def _memory_files(root: Path) -> list[Path]:
    return sorted(root.glob("*.memory.json"))


def test_an_engine_starts_from_what_the_last_one_learnt(planted: lm.Model, calibration_cache: Path) -> None:
    """At close an auto engine keeps its drafts' pooled acceptance, probe backoff and
    rollback mode beside its calibration; the next engine with the same key starts from
    them (a fresh engine would start from a blind prior)."""
    with _engine(planted) as a:
        assert not a.remembered
        _run(a, planted)
        hits, tries, mode = list(a._acc_pool.hits), list(a._acc_pool.tries), a.rollback
        a.policy.idle_comparisons = 7  # (snapshots found idle so often in a row: counted on by the next engine)
        assert tries[0] > 0
    (f,) = _memory_files(calibration_cache)
    doc = json.loads(f.read_text())
    assert calibration.valid_memory(doc["memory"]) and doc["material"]["model"]["path"] == str(planted.path.resolve())
    assert doc["memory"]["hits"] == hits and doc["memory"]["tries"] == tries and doc["memory"]["rollback"] == mode
    with _engine(planted) as b:
        assert b.calibration == "cached" and b.remembered
        assert b._acc_pool.hits == hits and b._acc_pool.tries == tries and b.rollback == mode
        assert b._last_fails == min(doc["memory"]["fails"], REMEMBERED_FAILS)
        assert b.policy.idle_comparisons == doc["memory"]["idle"] == 7
    with _engine(planted, recalibrate=True) as c:  # measures again and forgets
        assert c.calibration == "measured" and not c.remembered and not any(c._acc_pool.tries)


def _steady_costs(root: Path) -> None:
    """Cached calibrations rewritten to a fixed memory-bound shape (a verify row 5% of a plain
    decode more, a draft decode a fifth of one; the other mode 3% cheaper): on the tiny test
    model the measured prices are sub-millisecond and noisy, and a first step's draft length
    must follow from the memory alone."""
    for f in root.glob("*.json"):
        if f.name.endswith(".memory.json"):
            continue
        doc = json.loads(f.read_text())
        costs = doc["costs"]
        shape = {n: [[r, 0.001 * (1 + 0.05 * (r / int(n) - 1))] for r, _ in pts] for n, pts in costs["verify"].items()}
        costs["verify"] = shape
        costs["draft"] = [[n, 0.0002] for n, _ in costs["draft"]]
        if costs.get("alt") is not None:
            costs["alt"]["verify"] = {n: [[r, t * 0.97] for r, t in pts] for n, pts in shape.items()}
        f.write_text(json.dumps(doc))


def _first_step_drafts(model: lm.Model, memory: dict[str, object] | None, root: Path) -> int:
    """Draft tokens of a new engine's first step, with this memory written beside its calibration."""
    with _engine(model) as probe:
        key = probe._memory_key
    assert key is not None
    for f in _memory_files(root):
        f.unlink()
    _steady_costs(root)
    if memory is not None:
        assert calibration.store_memory(key, memory) is not None
    with _engine(model) as e:
        assert e.remembered == (memory is not None) and e.calibration == "cached"
        sid = e.add(model.tokenize("the model"), max_tokens=16, sampling=lm.SamplingParams.greedy_params())
        e.step()
        n = e.sequence(sid).stats.draft_n
        while e.active:
            e.step()
        return n


def test_memory_decides_the_first_step(planted: lm.Model, calibration_cache: Path) -> None:
    """A fresh engine probes its first sequence at once (nothing is known); one that
    remembers drafts landing drafts long from the first step, and one that remembers
    drafts failing (and a long probe backoff) does not draft there."""
    n = 3
    good = {"hits": [40.0] * n, "tries": [40.0] * n, "fails": 0, "rollback": "snapshots"}
    bad = {"hits": [0.0] * n, "tries": [40.0] * n, "fails": 12, "rollback": "snapshots"}
    assert _first_step_drafts(planted, None, calibration_cache) >= 1
    assert _first_step_drafts(planted, good, calibration_cache) == n
    assert _first_step_drafts(planted, bad, calibration_cache) == 0
    # ... whose remembered backoff is cut short: a new engine probes again within a few steps
    with _engine(planted) as e:
        key = e._memory_key
    assert key is not None and calibration.store_memory(key, bad) is not None
    with _engine(planted) as e:
        assert e.remembered and e._last_fails == REMEMBERED_FAILS < bad["fails"]  # type: ignore[operator]


@pytest.mark.skipif(GPU, reason="offloaded layers keep the snapshots (no switching, no second context)")
def test_the_remembered_rollback_mode_is_where_the_next_engine_starts(noisy: lm.Model, planted: lm.Model,
                                                                      calibration_cache: Path) -> None:
    with _engine(noisy) as a:
        assert a.rollback == "snapshots" and a.policy.alt is not None
        a._switch_rollback()  # as the policy does where drafting does not pay
        _run(a, noisy)
        mode = a.rollback
    assert json.loads(_memory_files(calibration_cache)[0].read_text())["memory"]["rollback"] == mode == "checkpoint"
    with _engine(noisy) as b:
        assert b.remembered and b.rollback == "checkpoint" and b.policy.replays
        assert b.stats.rollback_switches == 0  # taken at birth, not a switch
        got = _run(b, noisy, 32)
    with SpeculativeEngine(noisy, max_sequences=1, n_ctx=128, mtp=False) as plain:
        assert got == _run(plain, noisy, 32)  # lossless in the remembered mode


@pytest.mark.parametrize("damage", ["garbage", "hits_over_tries", "negative", "short", "rollback", "fails"])
def test_a_damaged_memory_is_ignored_and_replaced(noisy: lm.Model, calibration_cache: Path, damage: str) -> None:
    with _engine(noisy) as a:
        _run(a, noisy)
    (f,) = _memory_files(calibration_cache)
    doc = json.loads(f.read_text())
    m = doc["memory"]
    if damage == "garbage":
        f.write_bytes(b"\x00\xffnot json")
    else:
        if damage == "hits_over_tries":
            m["hits"][0] = m["tries"][0] + 1.0
        elif damage == "negative":
            m["tries"][1] = -1.0
        elif damage == "short":
            m["hits"], m["tries"] = m["hits"][:1], m["tries"][:1]
        elif damage == "rollback":
            m["rollback"] = "sometimes"
        else:
            m["fails"] = 1.5
        f.write_text(json.dumps(doc))
    with _engine(noisy) as b:
        assert not b.remembered and not any(b._acc_pool.tries)
        _run(b, noisy)
    assert calibration.valid_memory(json.loads(f.read_text())["memory"])


def test_an_unwritable_memory_costs_nothing_but_the_memory(noisy: lm.Model, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setattr(calibration, "cache_root", lambda: blocker / "calibration")
    for _ in range(2):
        e = _engine(noisy)
        assert len(_run(e, noisy)) == 24
        e.close()  # does not raise
        assert not e.remembered


def test_no_memory_without_auto_or_without_drafts(noisy: lm.Model, calibration_cache: Path) -> None:
    with SpeculativeEngine(noisy, max_sequences=1, n_ctx=128, draft_max=3) as e:
        _run(e, noisy)
    with _engine(noisy):
        pass  # calibrated, never drafted: nothing learnt
    assert _memory_files(calibration_cache) == []


@pytest.mark.parametrize("bad", [None, {}, {"hits": [], "tries": [], "fails": 0, "rollback": "snapshots"},
                                 {"hits": [1.0], "tries": [0.5], "fails": 0, "rollback": "snapshots"},
                                 {"hits": [1.0], "tries": [1.0, 2.0], "fails": 0, "rollback": "snapshots"},
                                 {"hits": [float("nan")], "tries": [1.0], "fails": 0, "rollback": "snapshots"},
                                 {"hits": [1.0], "tries": [1.0], "fails": -1, "rollback": "snapshots"},
                                 {"hits": [1.0], "tries": [1.0], "fails": True, "rollback": "snapshots"},
                                 {"hits": [1.0], "tries": [1.0], "fails": 0, "rollback": None},
                                 {"hits": ["1"], "tries": [1.0], "fails": 0, "rollback": "checkpoint"},
                                 {"hits": [1.0], "tries": [1.0], "fails": 0, "rollback": "checkpoint", "idle": -1}])
def test_valid_memory_refuses_what_an_engine_cannot_start_from(bad: object) -> None:
    assert not calibration.valid_memory(bad)
    assert calibration.valid_memory({"hits": [0.5, 0.0], "tries": [1.0, 0.5], "fails": 3, "rollback": "checkpoint"})

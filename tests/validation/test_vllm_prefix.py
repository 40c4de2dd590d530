"""vLLM with prefix caching on: the setting grammar, the counters read from /metrics, the
block ids computed from token ids, the live runner's handling of a caching server
(against tests/fake_vllm.py, no vLLM), and the comparison's bounds."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from fake_vllm import events, stand_in

from dspark_sim.errors import InputError
from dspark_sim.validation.vllm_fit import read_bench_runs
from dspark_sim.validation.vllm_live import (
    LiveConfig,
    Setting,
    VllmServer,
    bench_args,
    caches_prefixes,
    default_prompts,
    measure,
    parse_settings,
    prompts_path,
)
from dspark_sim.validation.vllm_prefix import (
    HIT_RATE_BOUND,
    Samples,
    block_hash_ids,
    judge,
    prefix_counters,
    read_record,
)

RECORDED = Path(__file__).parents[1] / "data" / "vllm-cpu"


@pytest.fixture
def fake_python(tmp_path):
    return stand_in(tmp_path)


# -- the setting grammar ---------------------------------------------------------------------
def test_prefix_caching_is_a_setting_of_its_own_and_old_names_stay():
    got = parse_settings("none,none+prefix,ngram:3+prefix,ngram:3")
    assert [s.name for s in got] == ["none", "none-prefix", "ngram-k3-prefix", "ngram-k3"]
    assert [s.prefix_caching for s in got] == [False, True, True, False]
    assert got[2] == Setting("ngram", 3, True)
    assert [caches_prefixes(s.name) for s in got] == [False, True, True, False]
    # the recorded runs' names are what they were
    assert {r.setting for r in read_bench_runs([RECORDED / "run-3" / "runs"])} == {
        s.name for s in parse_settings("none,ngram:1,ngram:3,ngram:5")}
    for bad, match in [("none+cache", "one suffix is \\+prefix"),
                       ("none+prefix,none+prefix", "twice"),
                       ("ngram+prefix", "K must be"), ("none:1+prefix", "takes no K"),
                       ("eagle:3+prefix", "a setting is")]:
        with pytest.raises(InputError, match=match) as exc:
            parse_settings(bad)
        assert exc.value.where == "--settings"


def test_a_caching_server_caches_and_serves_its_reset_and_its_runs_get_no_client_warmup(
        tmp_path):
    cfg = LiveConfig(python=Path("python"), model_dir=Path("m"), prompt_order="file")
    on = VllmServer(cfg, Setting("none", prefix_caching=True), tmp_path / "on.log")
    off = VllmServer(cfg, Setting("none"), tmp_path / "off.log")
    assert "--enable-prefix-caching" in on.command()
    assert "--no-enable-prefix-caching" in off.command()
    args_on = bench_args(cfg, on, Path("p.jsonl"), tmp_path, "x.json", 4, None)
    args_off = bench_args(cfg, off, Path("p.jsonl"), tmp_path, "x.json", 4, None)
    assert args_on[args_on.index("--num-warmups") + 1] == "0"
    assert args_off[args_off.index("--num-warmups") + 1] == "1"
    assert "--disable-shuffle" in args_on and "--disable-shuffle" in args_off
    shuffled = bench_args(LiveConfig(python=Path("python"), model_dir=Path("m")), off,
                          Path("p.jsonl"), tmp_path, "x.json", 4, None)
    assert "--disable-shuffle" not in shuffled


def test_prompt_sets_and_the_sessions_turns_extend_each_other():
    assert prompts_path("humaneval") == default_prompts()
    lines = [json.loads(x)["prompt"] for x in
             prompts_path("sessions").read_text(encoding="utf-8").splitlines()]
    assert len(lines) == 32
    sessions, turns = 8, 4
    system = lines[0].split("\n\nUser: ")[0]
    assert len(system) > 1000 and all(p.startswith(system + "\n\nUser: ") for p in lines)
    for s in range(sessions):
        for t in range(1, turns):
            prev, cur = lines[(t - 1) * sessions + s], lines[t * sessions + s]
            assert cur.startswith(prev + "\n\nAssistant: ")  # the previous turn, then more
            assert cur.count("\n\nUser: ") == t + 1
    with pytest.raises(InputError, match="neither humaneval nor sessions") as exc:
        prompts_path("/no/such.jsonl")
    assert exc.value.where == "--prompts"


def test_measure_names_a_bad_prompt_order_or_set_in_one_line(tmp_path, fake_python):
    from typer.testing import CliRunner

    from dspark_sim.cli import app

    python, model = fake_python
    base = ["vllm", "measure", "--python", str(python), "--model", str(model),
            "--out", str(tmp_path / "o"), "--settings", "none+prefix"]
    for extra, needle in [(["--prompt-order", "random"], "--prompt-order"),
                          (["--prompts", "nope"], "--prompts")]:
        r = CliRunner().invoke(app, [*base, *extra])
        assert r.exit_code == 2 and needle in r.output and len(r.output.splitlines()) == 1
    assert not (tmp_path / "o").exists()  # refused before anything started


# -- /metrics --------------------------------------------------------------------------------
SCRAPE = """\
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="/m"} 4096.0
vllm:prefix_cache_queries_total{engine="1",model_name="/m"} 1000.0
vllm:prefix_cache_queries_created{engine="0",model_name="/m"} 1.79e+09
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="/m"} 1024.0
vllm:prefix_cache_hits_total{engine="1",model_name="/m"} 256.0
vllm:external_prefix_cache_hits_total{engine="0",model_name="/m"} 99.0
vllm:cache_config_info{block_size="128",cache_hit_alignment_tokens="None",\
enable_prefix_caching="True",engine="0",hash_block_size="None",prefix_caching_hash_algo="sha256"} 1.0
"""


def test_prefix_counters_sum_the_engines_and_read_the_block():
    c = prefix_counters(SCRAPE, "s.txt")
    assert c == {"queries_tokens": 5096, "hits_tokens": 1280, "block_tokens": 128,
                 "enabled": True}
    finer = SCRAPE.replace('cache_hit_alignment_tokens="None"', 'cache_hit_alignment_tokens="32"')
    assert prefix_counters(finer, "s.txt")["block_tokens"] == 32


def test_prefix_counters_of_a_recorded_caching_off_scrape():
    text = (RECORDED / "run-3" / "scrapes" / "none.txt").read_text()
    c = prefix_counters(text, "none.txt")
    assert c == {"queries_tokens": 0, "hits_tokens": 0, "block_tokens": 128, "enabled": False}


@pytest.mark.parametrize("cut, match", [
    ("vllm:prefix_cache_hits_total", "no vllm:prefix_cache_hits_total samples"),
    ("vllm:cache_config_info", "no vllm:cache_config_info sample"),
])
def test_prefix_counters_refuse_a_scrape_without_them(cut, match):
    text = "\n".join(x for x in SCRAPE.splitlines() if not x.startswith(cut))
    with pytest.raises(InputError, match=match) as exc:
        prefix_counters(text, "s.txt")
    assert exc.value.where == "s.txt"
    bad = SCRAPE.replace("} 1024.0", "} -3")
    with pytest.raises(InputError, match="finite and >= 0"):
        prefix_counters(bad, "s.txt")


# -- block ids -------------------------------------------------------------------------------
def test_prompts_sharing_a_prefix_share_ids_up_to_the_last_full_shared_block():
    rng = np.random.default_rng(0)
    shared = rng.integers(0, 50_000, 300).tolist()
    a = shared + rng.integers(0, 50_000, 200).tolist()
    b = shared + rng.integers(0, 50_000, 90).tolist()
    ids = block_hash_ids([a, b, shared], 128)
    assert [len(x) for x in ids] == [500 // 128, 390 // 128, 300 // 128]
    assert ids[0][:2] == ids[1][:2] == ids[2][:2]  # 256 of the 300 shared tokens
    assert ids[0][2] != ids[1][2]  # block 3 holds tokens 256-383: they differ from 300
    # a block of equal tokens after a different prefix is another block
    c = rng.integers(0, 50_000, 128).tolist() + a[128:256]
    assert block_hash_ids([a, c], 128)[1][1] != block_hash_ids([a, c], 128)[0][1]
    # at a finer block more of the prefix is shared: 300 // 16 = 18 blocks
    fine = block_hash_ids([a, b], 16)
    same = sum(1 for x, y in zip(fine[0], fine[1], strict=False) if x == y)
    assert same == 300 // 16
    assert block_hash_ids([shared[:127]], 128) == [[]]  # no full block, no id


def test_samples_give_each_runs_token_ids_in_its_order_and_check_the_lengths(tmp_path):
    (tmp_path / "prefix").mkdir()
    doc = {"token_ids": [[1, 2, 3], [1, 2], [4]], "requests": {"3": [2, 0, 1]}}
    (tmp_path / "prefix" / "samples.json").write_text(json.dumps(doc))
    samples = Samples.read(tmp_path)

    class Run:
        path = tmp_path / "runs" / "none-prefix-c1.round1.json"
        prompt_tokens = np.array([1, 3, 2])

    assert samples.for_run(Run()) == [[4], [1, 2, 3], [1, 2]]
    Run.prompt_tokens = np.array([1, 3, 3])
    with pytest.raises(InputError, match="prompt lengths are not") as exc:
        samples.for_run(Run())
    assert exc.value.where == str(Run.path)
    Run.prompt_tokens = np.array([1, 3])
    with pytest.raises(InputError, match="a count"):
        samples.for_run(Run())
    with pytest.raises(InputError, match="missing") as exc:
        Samples.read(tmp_path / "elsewhere")
    assert exc.value.where.endswith("samples.json")


# -- the bounds ------------------------------------------------------------------------------
def test_judge_holds_ttft_to_its_bound_or_the_spread_and_the_hit_rate_to_five_points():
    ok = judge(measured_ttft_ms=1000.0, simulated_ttft_ms=1190.0, ttft_spread=0.05,
               measured_hit_rates=[0.60, 0.62, 0.64], simulated_hit_rate=0.665)
    assert ok["ttft_within"] and ok["hit_rate_within"]
    assert ok["measured_hit_rate"] == pytest.approx(0.62)
    assert ok["hit_rate_diff"] == pytest.approx(0.045)
    assert ok["hit_rate_spread"] == pytest.approx(0.02)
    assert ok["ttft_allowed"] == pytest.approx(0.20)
    far = judge(measured_ttft_ms=1000.0, simulated_ttft_ms=750.0, ttft_spread=0.05,
                measured_hit_rates=[0.60], simulated_hit_rate=0.55 - 1e-9)
    assert not far["ttft_within"] and not far["hit_rate_within"]
    assert far["ttft_error"] == pytest.approx(-0.25)
    # a point that repeats only to +-30 % is allowed its own spread
    wide = judge(measured_ttft_ms=1000.0, simulated_ttft_ms=750.0, ttft_spread=0.30,
                 measured_hit_rates=[0.5], simulated_hit_rate=0.5 + HIT_RATE_BOUND)
    assert wide["ttft_within"] and wide["ttft_allowed"] == pytest.approx(0.30)
    assert wide["hit_rate_within"]


def test_read_record_refuses_counters_out_of_range(tmp_path):
    class Run:
        path = tmp_path / "runs" / "none-prefix-c1.round1.json"

    (tmp_path / "prefix").mkdir()
    rec = tmp_path / "prefix" / Run.path.name
    rec.write_text(json.dumps({"queries_tokens": 1000, "hits_tokens": 250,
                               "block_tokens": 128}))
    assert read_record(tmp_path, Run())["hit_rate_tokens"] == 0.25
    rec.write_text(json.dumps({"queries_tokens": 100, "hits_tokens": 250,
                               "block_tokens": 128}))
    with pytest.raises(InputError, match="out of range") as exc:
        read_record(tmp_path, Run())
    assert exc.value.where == str(rec)


# -- the live runner against the stand-in ----------------------------------------------------
def test_measure_records_each_caching_runs_counters_from_an_empty_cache(tmp_path, fake_python,
                                                                         monkeypatch):
    python, model = fake_python
    log = tmp_path / "fake.jsonl"
    monkeypatch.setenv("FAKE_VLLM_LOG", str(log))
    cfg = LiveConfig(python=python, model_dir=model, settings=parse_settings("none,none+prefix"),
                     concurrencies=(1, 4), rates=(0.5,), rounds=2, startup_timeout_s=60,
                     prompts=prompts_path("sessions"), prompt_order="file",
                     prompts_per_client=4)
    out = tmp_path / "live"
    manifest = json.loads(measure(cfg, out).read_text())
    assert manifest["prefix_caching"] is True and manifest["prompt_order"] == "file"
    assert manifest["prompts"] == "sessions-32.jsonl"
    names = sorted(p.name for p in (out / "runs").glob("*.json"))
    assert len(names) == 2 * 3 * 2
    # every caching run: a warm-up, then the cache emptied, then the bench without its own
    # warm-up; the caching-off runs keep the client's
    resets = events(log, "reset")
    benches = events(log, "bench")
    assert len(resets) == 6 and len(events(log, "completion")) == 6
    assert {b["warmups"] for b in benches if b["setting"] == "none-prefix"} == {"0"}
    assert {b["warmups"] for b in benches if b["setting"] == "none"} == {"1"}
    records = sorted(p.name for p in (out / "prefix").glob("*.round*.json"))
    assert records == sorted(n for n in names if n.startswith("none-prefix"))
    rec = json.loads((out / "prefix" / records[0]).read_text())
    # the stand-in's counters move 1000 / 250 per scrape: the run's are the difference
    assert (rec["queries_tokens"], rec["hits_tokens"], rec["block_tokens"]) == (1000, 250, 128)
    assert rec["hit_rate_tokens"] == 0.25
    # the samples list each count's requests, in the client's order (file order here),
    # and match each run's prompt lengths
    samples = Samples.read(out)
    assert sorted(samples.requests) == [12, 16, 24]
    assert samples.requests[16] == list(range(16))
    for run in read_bench_runs([out / "runs"]):
        assert [len(t) for t in samples.for_run(run)] == run.prompt_tokens.tolist()
    # a resumed measurement redoes a caching run whose counters are missing, only it
    (out / "prefix" / records[0]).unlink()
    log.unlink()
    measure(cfg, out)
    assert [b["setting"] for b in events(log, "bench")] == ["none-prefix"]
    assert (out / "prefix" / records[0]).is_file()


def _implied_hit_rate(token_ids: list[list[int]], block: int) -> float:
    """The hit rate of requests served one at a time, counted apart from the simulator:
    each prompt's leading blocks that an earlier prompt holds (its last token always
    computed), over all prompt tokens."""
    hits = 0
    for i, t in enumerate(token_ids):
        best = 0
        for u in token_ids[:i]:
            n = 0
            while (n + 1) * block <= min(len(t), len(u)) \
                    and t[n * block:(n + 1) * block] == u[n * block:(n + 1) * block]:
                n += 1
            best = max(best, n)
        hits += min(best * block, len(t) - 1)
    return hits / sum(map(len, token_ids))


def test_vllm_compare_fits_the_caching_off_runs_and_predicts_the_caching_ones(
        tmp_path, fake_python):
    """End to end on the stand-in: the caching-off runs fitted, each caching run replayed
    with its prompts' block ids; one client at a time, the simulated hit rate is the
    reuse its prompts carry, counted here apart."""
    from typer.testing import CliRunner

    from dspark_sim.cli import app

    python, model = fake_python
    cfg = LiveConfig(python=python, model_dir=model, settings=parse_settings("none,none+prefix"),
                     concurrencies=(1, 4), rates=(), rounds=1, startup_timeout_s=60,
                     prompts=prompts_path("sessions"), prompt_order="file")
    folder = tmp_path / "live"
    measure(cfg, folder)
    out = tmp_path / "cmp"
    r = CliRunner().invoke(app, ["vllm", "compare", str(folder), "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert "Fitted on: `none` (2 runs, prefix caching off)" in r.output
    import polars as pl

    table = pl.read_parquet(out / "prefix.parquet")
    assert table["run"].to_list() == ["none-prefix@c1", "none-prefix@c4"]
    assert table["measured_hit_rate"].to_list() == [0.25, 0.25]  # the stand-in's counters
    c1 = next(x for x in read_bench_runs([folder / "runs"]) if x.name == "none-prefix@c1")
    tokens = Samples.read(folder).for_run(c1)
    assert table["simulated_hit_rate"][0] == pytest.approx(_implied_hit_rate(tokens, 128))
    assert table["simulated_hit_rate"][0] > 0.3  # a shared instruction and earlier turns
    head = json.loads((out / "comparison.json").read_text())
    assert head["prefix"]["prefix_points"] == 2 and head["split"] == "none"
    # a split that names a caching run is refused in one line
    r = CliRunner().invoke(app, ["vllm", "compare", str(folder), "--out", str(out),
                                 "--fit", "none,none-prefix@c1"])
    assert r.exit_code != 0 and "names caching runs (none-prefix@c1)" in r.output

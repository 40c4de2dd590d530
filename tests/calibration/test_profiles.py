"""Engine profiles: TOML round trip, shipped files, bad files, sheets, measurement."""

from __future__ import annotations

import json
import re
import tomllib
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from input_checks import assert_rejects_file

from dspark_sim.calibration.profile import (
    builtin_profiles,
    load_profile,
    profile_from_dict,
)
from dspark_sim.calibration.roofline import (
    COARSE_GRAPH_BUCKETS,
    builtin_analytic_specs,
    default_profile,
    model_sheet_from_hf_config,
    profile_from_sheets,
    write_builtin_profiles,
)
from dspark_sim.errors import InputError

DATA = Path(__file__).resolve().parents[2] / "calibration" / "data"
TINY_LLAMA = {
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 512,
    "max_position_embeddings": 1024,
}


def _same(a, b) -> None:
    assert a.name == b.name and a.kind == b.kind and a.gpus_per_replica == b.gpus_per_replica
    assert a.interpolation == b.interpolation
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_allclose(a.step_s, b.step_s, rtol=1e-6, atol=1e-9)
    assert a.kv_s_per_token == pytest.approx(b.kv_s_per_token, rel=1e-9)
    assert a.eager_penalty_s == pytest.approx(b.eager_penalty_s)
    assert set(a.drafts) == set(b.drafts)
    for k, d in a.drafts.items():
        np.testing.assert_allclose(d.time_s, b.drafts[k].time_s, rtol=1e-6, atol=1e-9)
        assert d.gamma_ref == b.drafts[k].gamma_ref
        assert d.gamma_slope == pytest.approx(b.drafts[k].gamma_slope)


# -- round trip and shipped files ------------------------------------------------------------


def test_toml_round_trip():
    p = default_profile()
    back = profile_from_dict(tomllib.loads(p.to_toml()), "roundtrip")
    _same(p, back)
    assert back.to_toml() == p.to_toml()


def test_shipped_analytic_files_are_current(tmp_path):
    """Every shipped analytic profile (the default included) is what its sheets give."""
    write_builtin_profiles(tmp_path)
    assert (DATA / "v4flash-h200.toml").read_text() == default_profile().to_toml()
    for name in builtin_analytic_specs():
        assert (tmp_path / f"{name}.toml").read_text() == (DATA / f"{name}.toml").read_text(), name


@pytest.mark.parametrize("name", builtin_profiles())
def test_every_shipped_profile_loads(name):
    p = load_profile(name)
    assert p.kind in ("analytic", "measured", "published")
    assert np.all(np.isfinite(p.step_s)) and np.all(p.step_s > 0)
    b = np.array([1, 2, 8, 64, p.max_tokens, 2 * p.max_tokens])
    t = p.step_time_s(b, kv_tokens=1000.0)
    assert np.all(np.isfinite(t)) and np.all(t > 0)
    # Monotone-ish: analytic tables exactly; measured CPU tables dip where a GEMM kernel
    # switches (B = 16 runs ~30 % under B = 15 on the shipped CPU profiles), never by half,
    # and they grow overall.
    tol = 0.0 if p.kind in ("analytic", "published") else 0.45
    running_max = np.maximum.accumulate(p.step_s)
    assert np.all(p.step_s >= (1 - tol) * running_max), name
    assert p.step_s[-1] >= p.step_s.max() * (1 - tol) and p.step_s[-1] > 2 * p.step_s[0]
    assert p.step_s[-1] > p.step_s[0]
    for d in p.drafts.values():
        assert d.time(1, d.gamma_ref) > 0
    if name in builtin_analytic_specs():
        assert p.kind == "analytic"


def test_shipped_names():
    names = set(builtin_profiles())
    for hw in ("h100", "h200", "b200"):
        for model in ("v4flash", "qwen3-8b"):
            assert f"{model}-{hw}" in names
    assert "smollm2-cpu" in names
    cpu = load_profile("smollm2-cpu")
    assert cpu.kind == "measured" and cpu.step_std_s is not None
    assert {"dspark", "parallel", "mtp1"} <= set(cpu.drafts)
    assert "heldout_mean_rel_error" in cpu.parameters


# -- bad files -------------------------------------------------------------------------------


GOOD = default_profile().to_toml()


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda s: s.replace("step_ms = [", "step_msx = ["), "step_ms"),
        (lambda s: s.replace("[target]", "[targetx]"), "target"),
        (lambda s: re.sub(r"step_ms = \[[0-9.]+", "step_ms = [nan", s, count=1), "NaN"),
        (lambda s: s.replace("tokens = [1, 2, 4", "tokens = [1, 4, 2"), "increasing"),
        (lambda s: s.replace('kind = "analytic"', 'kind = "guessed"'), "kind"),
        (lambda s: re.sub(r"step_ms = \[[0-9.]+, ", "step_ms = [", s, count=1), "length"),
        (lambda s: re.sub(r"gpus_per_replica = \d+", "gpus_per_replica = 0", s), "gpus"),
        (lambda s: s.replace("[draft.mtp1]\nbatch = [1, 8", "[draft.mtp1]\nbatch = [8, 1"),
         "draft.mtp1"),
        (lambda s: s + "\n[[[broken", "TOML"),
        # misspelt keys and tables were ignored: a cost term silently zero, a table unused
        (lambda s: s.replace("kv_us_per_token =", "kv_us_per_tokn =", 1),
         "[target]: unknown key(s) kv_us_per_tokn"),
        (lambda s: s.replace("interpolation =", "interpolaton =", 1),
         "[profile]: unknown key(s) interpolaton"),
        (lambda s: s.replace("[draft.mtp1]", "[drafts.mtp1]"), "unknown key(s) drafts"),
        (lambda s: re.sub(r'^name = .*$', "name = 5", s, count=1, flags=re.M),
         "[profile]: 'name' must be a string"),
    ],
)
def test_bad_profile_files(tmp_path, edit, message):
    bad = edit(GOOD)
    assert bad != GOOD
    path = tmp_path / "broken-profile.toml"
    path.write_text(bad)
    with pytest.raises(InputError) as err:
        load_profile(path)
    assert "broken-profile.toml" in str(err.value)
    assert message.lower() in str(err.value).lower()


def test_default_trace_names_the_published_setups_drafter():
    """The profiles fitted to vLLM's SPEED-Bench runs name the trace they were fitted with
    (and the sheet-only V4-Pro profile its model's); the default profile names none, so
    its runs replay the package default as before."""
    assert load_profile("v4flash-b300").default_trace == "dspark-v4flash-speedbench-synthetic"
    assert load_profile("v4pro-b300").default_trace == "dspark-v4pro-synthetic"
    assert load_profile("v4pro-8xmi350x").default_trace == "dspark-v4pro-synthetic"
    assert load_profile(None).default_trace is None
    assert "default_trace" not in GOOD  # absent from the file when unset
    p = load_profile(DATA / "v4flash-b300.toml")
    back = profile_from_dict(tomllib.loads(p.to_toml()), "roundtrip")
    assert back.default_trace == p.default_trace and back.to_toml() == p.to_toml()


@pytest.mark.parametrize("value, message", [
    ('"dspark-v4flash-speedbnech-synthetic"', "'default_trace' names unknown trace "
                                             "'dspark-v4flash-speedbnech-synthetic'"),
    ('"missing.parquet"', "'default_trace' names unknown trace 'missing.parquet'"),
    ("7", "'default_trace' must be a trace name or path, got 7"),
    ('""', "'default_trace' must be a trace name or path"),
])
def test_a_bad_default_trace_is_refused_naming_the_file_and_key(tmp_path, value, message):
    path = tmp_path / "broken-profile.toml"
    path.write_text(GOOD.replace("\n\n[profile.parameters]",
                                 f"\ndefault_trace = {value}\n\n[profile.parameters]", 1))
    with pytest.raises(InputError) as err:
        load_profile(path)
    text = str(err.value)
    assert text.startswith(f"{path} [profile]: ") and message in text and "\n" not in text


def test_default_trace_path_is_read_next_to_the_profile(tmp_path):
    from dspark_sim.traces.schema import load_trace, write_trace

    (tmp_path / "traces").mkdir()
    write_trace(load_trace("dspark-v4pro-synthetic"), tmp_path / "traces" / "mine.parquet")
    path = tmp_path / "mine.toml"
    path.write_text(GOOD.replace("\n\n[profile.parameters]",
                                 '\ndefault_trace = "traces/mine.parquet"\n\n[profile.parameters]', 1))
    got = load_profile(path).default_trace
    assert got == str((tmp_path / "traces" / "mine.parquet").resolve())
    # a sheet names it the same way, relative to the sheet
    sheet = tmp_path / "s.sheet.toml"
    sheet.write_text('hardware = "H200"\nmodel = "v4flash"\ndefault_trace = "traces/mine.parquet"\n'
                     "[deployment]\ngpus_per_replica = 8\n")
    assert profile_from_sheets(sheet).default_trace == got
    sheet.write_text('hardware = "H200"\nmodel = "v4flash"\ndefault_trace = "nope"\n'
                     "[deployment]\ngpus_per_replica = 8\n")
    with pytest.raises(InputError, match=r"s\.sheet\.toml: 'default_trace' names unknown trace"):
        profile_from_sheets(sheet)


def test_missing_profile_file(tmp_path):
    with pytest.raises(InputError, match="nope.toml: profile file not found"):
        load_profile(tmp_path / "nope.toml")
    with pytest.raises(InputError, match="unknown profile"):
        load_profile("no-such-builtin")
    # an existing file is read as a profile whatever its suffix (not looked up by name)
    other = tmp_path / "profile.txt"
    other.write_text(GOOD)
    assert load_profile(other).source == str(other)


def _mini(**target) -> dict:
    """A linear table of four rows: 1, 2, 3 and 5 ms at 1, 2, 4 and 8 tokens."""
    return {"profile": {"name": "mini", "interpolation": "linear"},
            "target": {"tokens": [1, 2, 4, 8], "step_ms": [1.0, 2.0, 3.0, 5.0], **target}}


def test_past_its_last_row_a_table_grows_with_its_last_segment():
    """The last segment's slope is (5 - 3) ms / (8 - 4) tokens = 0.5 ms per token, so
    B = 16 costs 5 + 0.5 x 8 = 9 ms plus the 1 ms eager penalty; B = 6 interpolates
    3 + 0.5 x 2 = 4 ms. The table's size is its last row."""
    p = profile_from_dict(_mini(eager_penalty_ms=1.0))
    assert p.max_tokens == 8 and "4 table rows up to B=8" in p.summary()
    assert p.target_time_s(np.array([6, 8, 16])) == pytest.approx([4e-3, 5e-3, 10e-3])
    # a displaced prefill token costs the secant over the top half of the budget:
    # (t(8) - t(4)) / 4 = (5 - 3) / 4 ms; an odd budget 7: (t(7) - t(3)) / (7 - 3) =
    # (4.5 - 2.5) / 4 ms
    assert p.prefill_s_per_token(8) == pytest.approx(0.5e-3)
    assert p.prefill_s_per_token(7) == pytest.approx(0.5e-3)
    assert p.prefill_s_per_token(1) == pytest.approx(1e-3)  # (t(1) - t(0)) / 1: t(0) = 0


def test_step_extra_s_by_hand():
    """Two decoding requests, gamma 2, 1000 context tokens over 2 batch rows, a 2 ms
    draft: base = 2 ms draft + 1000 x 1 us KV + 2 x 100 us per request = 3.2 ms, plus
    10 us per verify token for the n_dec = 2 bonus rows and each of the i admitted
    drafts: 3.22 + 0.01 i ms."""
    p = profile_from_dict(_mini(logits_us_per_row=10.0, request_us=100.0, kv_us_per_token=1.0))
    extra = p.step_extra_s(n_dec=2, gamma=2, kv_tokens=1000.0, batch_rows=2, draft_s=2e-3)
    assert extra == pytest.approx([3.22e-3, 3.23e-3, 3.24e-3, 3.25e-3, 3.26e-3])


@pytest.mark.parametrize("target, message", [
    ({"tokens": [], "step_ms": []}, "'tokens' must be a non-empty list of numbers"),
    ({"step_ms": "fast"}, "'step_ms' must be a non-empty list of numbers"),
    ({"step_ms": [1.0, "2", 3.0, 5.0]}, "'step_ms' must be a non-empty list of numbers"),
    ({"step_ms": [1.0, True, 3.0, 5.0]}, "'step_ms' must be a non-empty list of numbers"),
])
def test_target_arrays_must_be_non_empty_lists(target, message):
    with pytest.raises(InputError, match=f"^mini.toml \\[target\\]: {message}"):
        profile_from_dict(_mini(**target), "mini.toml")


def test_draft_tables_take_a_zero_time_and_refuse_a_bad_slope():
    def draft(**d):
        doc = {**_mini(), "draft": {"mtp1": {"batch": [1, 4], "time_ms": [0.0, 3.0], **d}}}
        return profile_from_dict(doc, "mini.toml").drafts["mtp1"]

    # a free draft at one request is allowed (time_ms >= 0): 2 requests interpolate 1 ms
    assert draft().time(2, 1) == pytest.approx(1e-3)
    with pytest.raises(InputError, match=r"\[draft.mtp1\]: batch must increase and match time_ms"):
        draft(time_ms=[-1.0, 3.0])
    for bad in (True, "0.1", float("nan")):
        with pytest.raises(InputError, match="'gamma_slope' must be a finite number"):
            draft(gamma_slope=bad)


# -- sheets ----------------------------------------------------------------------------------


def test_profile_from_sheets_presets_and_tables(tmp_path):
    sheet = tmp_path / "custom.toml"
    sheet.write_text(
        'name = "qwen-like-h100"\nhardware = "H100-bf16"\nmodel = "qwen3-8b"\n'
        "[deployment]\ngpus_per_replica = 1\noverhead_ms = 1.5\nper_token_overhead_us = 2.0\n"
        "eager_penalty_ms = 2.0\ndraft_layers = 5\ncuda_graph_max_tokens = 512\n"
        "eager_slowdown = 1.1\nsample_us_per_row = 2.0\n"
        # the coarse capture sizes the shipped profile states (a sheet without them gets
        # vLLM's own, tests/calibration/test_sheets.py)
        f"graph_buckets = {list(COARSE_GRAPH_BUCKETS)}\n"
    )
    p = profile_from_sheets(sheet)
    assert p.name == "qwen-like-h100" and p.kind == "analytic"
    _same(p, replace(load_profile("qwen3-8b-h100"), name="qwen-like-h100"))
    sheet.write_text(
        "[hardware]\nname = \"X\"\nhbm_bytes_per_s = 2e12\npeak_flops = 5e14\n"
        "[model]\nname = \"m\"\nactive_params = 1e9\ndense_params = 1e9\nrouted_params = 0\n"
        "bytes_per_param = 2\n[deployment]\ngpus_per_replica = 1\noverhead_ms = 1.0\n"
    )
    p = profile_from_sheets(sheet)
    # Memory-bound at B=1: 2 GB / (2 TB/s * 0.75) + 1 ms.
    assert p.step_s[0] == pytest.approx(2e9 / (2e12 * 0.75) + 1e-3, rel=1e-6)


def test_profile_from_hf_config(tmp_path):
    cfg = {
        "model_type": "qwen3", "hidden_size": 4096, "intermediate_size": 12288,
        "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
        "head_dim": 128, "vocab_size": 151936, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }
    m = model_sheet_from_hf_config(cfg)
    assert 7.5e9 < m.active_params < 8.5e9  # Qwen3-8B: 8.2B
    assert m.kv_bytes_per_token == pytest.approx(36 * 2 * 8 * 128 * 2)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    sheet = tmp_path / "hf.toml"
    sheet.write_text('hardware = "H200-bf16"\n[model]\nhf_config = "config.json"\n'
                     "[deployment]\ngpus_per_replica = 1\noverhead_ms = 1.5\n")
    p = profile_from_sheets(sheet)
    assert p.step_s[0] > 3e-3 and p.gpus_per_replica == 1


_SHEET = ('[hardware]\nname = "X"\nhbm_bytes_per_s = {hbm}\npeak_flops = 5e14\n[model]\n'
          'name = "m"\nactive_params = 1e9\ndense_params = {dense}\nrouted_params = 0\n'
          "bytes_per_param = {bpp}\n[deployment]\ngpus_per_replica = {g}\noverhead_ms = 1.0\n")


@pytest.mark.parametrize("text, match", [
    ('hardware = "H999"\nmodel = "v3"\n', "bad-sheet.toml.*H999"),
    ('hardware = "H100"\nmodel = "v3"\n[deployment]\noverhead_ms = 1\n',
     "bad-sheet.toml.*gpus_per_replica"),
    ('hardware = "H100"\nmodel = "v3"\n[deployment]\ngpus_per_replica = 8\n'
     "overhead_ms = 1\nwarp_factor = 9\n", "warp_factor"),
    ('hardware = "H100"\nmodel = "v3"\n[deployment]\ngpus_per_replica = 8\n'
     "overhead_ms = nan\n", "overhead_ms"),
    # every field sane, but ten million GPUs' HBM is a KV capacity no profile may hold
    ('hardware = "H100"\nmodel = "v3"\n[deployment]\ngpus_per_replica = 10000000\n'
     "overhead_ms = 1\n", "bad-sheet.toml: the profile it implies.*kv_capacity_tokens"),
    # each field finite and >= 0, the arithmetic they feed not: a zero bandwidth divided
    # by zero, 1e308 bytes per parameter overflowed to NaN (a numpy warning, then a
    # profile of NaNs), 1e308 GPUs made int(NaN) (tracebacks); weights past the HBM named
    # "deployment sheet", not the file
    # (a zero bandwidth and 1e308 bytes per parameter are also no unit's plausible value:
    # the unit checks name them first, tests/calibration/test_sheets.py)
    (_SHEET.format(hbm=0, bpp=2, g=1, dense=1e9), "bad-sheet.toml: 'hbm_bytes_per_s' = 0"),
    (_SHEET.format(hbm=2e12, bpp=1e308, g=1, dense=1e9), "bad-sheet.toml: 'bytes_per_param'"),
    (_SHEET.format(hbm=2e12, bpp=2, g=1e308, dense=1e9), "bad-sheet.toml: .*imply no profile"),
    (_SHEET.format(hbm=2e12, bpp=2, g=1, dense=5e13), "bad-sheet.toml: m does not fit"),
], ids=["unknown-hardware", "missing-key", "unknown-key", "nan", "implies-no-profile",
        "zero-bandwidth", "overflow", "int-of-nan", "does-not-fit"])
def test_bad_sheets(tmp_path, text, match):
    assert_rejects_file(tmp_path / "bad-sheet.toml", text, profile_from_sheets, match)


def test_calibrate_engine_sheet_writes_nothing_for_a_sheet_that_implies_no_profile(tmp_path):
    from typer.testing import CliRunner

    from dspark_sim.cli import app

    sheet, out = tmp_path / "huge.toml", tmp_path / "prof.toml"
    sheet.write_text('hardware = "H100"\nmodel = "v3"\n[deployment]\n'
                     "gpus_per_replica = 10000000\noverhead_ms = 1\n")
    r = CliRunner().invoke(app, ["calibrate", "engine", "--sheet", str(sheet), "--out", str(out)])
    assert r.exit_code == 2 and r.output.count("\n") == 1 and "huge.toml" in r.output
    assert not out.exists()


# -- measurement -----------------------------------------------------------------------------


def test_measure_engine_tiny_llama(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from dspark_sim.calibration.measure import measure_engine

    cfg_path = tmp_path / "config.json"
    cfg_path.write_text(json.dumps(TINY_LLAMA))
    lines: list[str] = []
    prof = measure_engine(
        cfg_path, batch_requests=(1, 2, 3, 4), verify_lengths=(0, 1, 3),
        context_lengths=(16, 64), warmup=1, repeats=3, draft_gammas=(3, 7),
        num_threads=1, name="tiny", log=lines.append, max_prefill_tokens=96,
    )
    print("\n".join(lines[-3:]))
    assert prof.kind == "measured" and prof.name == "tiny"
    assert prof.interpolation == "linear"
    assert np.all(np.diff(prof.tokens) > 0) and np.all(prof.step_s > 0)
    assert prof.step_std_s is not None and prof.step_std_s.shape == prof.step_s.shape
    assert prof.kv_s_per_token >= 0
    assert {"dspark", "parallel", "mtp1"} == set(prof.drafts)
    assert "stand-in" in prof.parameters["draft_source"]
    # prefill chunks are measured (looked up, not extrapolated) up to max_prefill_tokens,
    # and the LM head is a separate per-row term
    assert int(prof.tokens[-1]) == 96 and 64 in prof.tokens.tolist()
    # eager default: every chunk size up to 64 (CPU GEMM cost is jagged in B), then every 16
    assert prof.parameters["prefill_chunks"] == list(range(2, 65)) + [80, 96]
    assert set(range(2, 65)) <= set(prof.tokens.tolist())
    assert prof.logits_s_per_row >= 0 and len(prof.parameters["logit_rows_median_ms"]) == 7
    err = prof.parameters["heldout_mean_rel_error"]
    assert np.isfinite(err) and err >= 0
    print(f"tiny llama held-out relative error: mean {err:.1%}, "
          f"max {prof.parameters['heldout_max_rel_error']:.1%}")
    assert any("held-out" in line for line in lines)
    # The result is a valid profile file.
    path = tmp_path / "tiny.toml"
    path.write_text(prof.to_toml())
    back = load_profile(path)
    _same(prof, back)
    assert back.parameters["heldout_shapes"] == prof.parameters["heldout_shapes"]


def test_measure_engine_bad_inputs(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from dspark_sim.calibration.measure import load_model_config, measure_engine

    with pytest.raises(InputError, match="missing-dir"):
        load_model_config(tmp_path / "missing-dir")
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    with pytest.raises(InputError, match="config.json"):
        load_model_config(bad)
    with pytest.raises(InputError, match="model_type"):
        load_model_config({"hidden_size": 4})
    with pytest.raises(InputError, match="verify_lengths"):
        measure_engine(TINY_LLAMA, verify_lengths=(), log=None)
    with pytest.raises(InputError, match="batch_requests"):
        measure_engine(TINY_LLAMA, batch_requests=(0, 1), log=None)


def test_fit_logits_and_prefill_chunks():
    from dspark_sim.calibration.measure import default_prefill_chunks, fit_logits

    rows = [1, 2, 4, 8, 16, 32, 64]
    fixed, per_row = fit_logits(rows, [3e-3 + 2e-4 * k for k in rows])
    assert fixed == pytest.approx(3e-3, rel=1e-6) and per_row == pytest.approx(2e-4, rel=1e-6)
    assert fit_logits(rows, [5e-3 - 1e-6 * k for k in rows])[1] == 0.0
    assert fit_logits([4], [1e-3]) == (1e-3, 0.0)
    assert default_prefill_chunks(256) == (64, 96, 128, 192, 256)
    assert default_prefill_chunks(256, 100) == (128, 192, 256)
    assert default_prefill_chunks(40) == (40,) and default_prefill_chunks(0) == ()
    assert default_prefill_chunks(100, dense_to=8) == (2, 3, 4, 5, 6, 7, 8, 24, 40, 56, 72, 88, 100)
    assert default_prefill_chunks(6, dense_to=8) == (2, 3, 4, 5, 6)
    assert default_prefill_chunks(100, 5, dense_to=8, dense_step=50) == (6, 7, 8, 58, 100)


def test_measure_engine_head_split_shapes():
    """``logits="last"``: base model + LM head on the last row of each request only."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from dspark_sim.calibration.measure import Shape, _Runner, load_model_config

    runner = _Runner(load_model_config(TINY_LLAMA), "cpu", torch.float32)
    torch.manual_seed(3)
    run_last, reset_last = runner.step_fn(Shape(2, 3, 8), logits="last")
    with torch.inference_mode():
        last = run_last()
        reset_last()
    assert tuple(last.shape) == (2, runner.vocab)
    run_head, _ = runner.head_fn(5)
    with torch.inference_mode():
        assert tuple(run_head().shape) == (5, runner.vocab)


def test_fit_table_recovers_kv_term():
    from dspark_sim.calibration.measure import Sample, Shape, fit_table, heldout_error

    f = {1: 10e-3, 2: 11e-3, 4: 12e-3, 8: 15e-3, 16: 21e-3, 32: 33e-3}
    kv = 2e-8
    samples = []
    for L in (0, 256, 1024):
        for r in (1, 2, 4, 8):
            for v in (0, 1, 3):
                s = Shape(r, v, L)
                if s.tokens in f:
                    samples.append(Sample(s, f[s.tokens] + kv * s.kv_tokens, 0.0))
    tokens, step, std, kv_s = fit_table(samples)
    assert kv_s == pytest.approx(kv, rel=1e-6)
    np.testing.assert_allclose(step, [f[int(b)] for b in tokens], rtol=1e-6)
    check = heldout_error(samples, "step", 0.3, 0)
    assert check["heldout_shapes"] > 0 and check["heldout_max_rel_error"] < 1e-6


def test_fit_terms_recovers_attention_coefficient():
    """Synthetic times f(B) + kv * R * L + attn * query_ctx (the engine's unit: (1 + l) * L
    per verify block, c * c / 2 per prefill chunk from position 0): the joint fit recovers
    the table, the KV slope and the attention coefficient; the held-out check predicts
    the left-out shapes exactly, and without the attention term it cannot."""
    from dspark_sim.calibration.measure import Sample, Shape, fit_table, fit_terms, heldout_error

    f = {1: 10e-3, 2: 11e-3, 4: 12e-3, 8: 15e-3, 16: 21e-3, 32: 33e-3, 64: 60e-3, 128: 110e-3}
    kv, attn = 2e-8, 5e-9
    samples = []
    for L in (128, 512):
        for r in (1, 2, 4, 8):
            for v in (0, 1, 3, 7):
                s = Shape(r, v, L)
                samples.append(Sample(s, f[s.tokens] + kv * s.kv_tokens + attn * s.query_ctx,
                                      0.0))
    for c in (64, 128):  # prefill chunks share rows with verify shapes
        s = Shape(1, c - 1, 0)
        assert s.query_ctx == c * c / 2
        samples.append(Sample(s, f[c] + attn * s.query_ctx, 0.0))
    assert Shape(8, 7, 128).query_ctx == 8 * 8 * 128
    fit = fit_terms(samples)
    assert fit.attn_s_per_query_ctx == pytest.approx(attn, rel=1e-6)
    assert fit.kv_s_per_token == pytest.approx(kv, rel=1e-6)
    np.testing.assert_allclose(fit.step_s, [f[int(b)] for b in fit.tokens], rtol=1e-6)
    check = heldout_error(samples, "linear", 0.25, 0)
    assert check["heldout_shapes"] > 0 and check["heldout_max_rel_error"] < 1e-6
    assert heldout_error(samples, "linear", 0.25, 0, fit_attn=False)[
        "heldout_max_rel_error"] > 1e-3
    # the legacy 4-tuple fit has no attention term
    assert len(fit_table(samples)) == 4
    # negative attention (noise) is clamped at 0: the fit falls back to the KV slope alone
    neg = [Sample(x.shape, f[x.shape.tokens] + kv * x.shape.kv_tokens
                  - 1e-9 * x.shape.query_ctx, 0.0) for x in samples if x.shape.context]
    fit0 = fit_terms(neg)
    assert fit0.attn_s_per_query_ctx == 0.0 and fit0.kv_s_per_token >= 0.0


def test_fit_terms_multi_kv_and_request():
    """Single-token decode blocks pay the KV slope only; multi-token blocks pay an extra
    KV slope; every request with a context pays a fixed cost. The joint fit recovers all
    four terms, and the held-out check predicts left-out shapes exactly with them."""
    from dspark_sim.calibration.measure import Sample, Shape, fit_terms, heldout_error

    f = {b: 8e-3 + 1e-3 * b ** 0.8 for b in range(1, 65)}
    kv, attn, mkv, req = 1e-8, 3e-9, 4e-8, 2e-3
    samples = []
    for L in (128, 512):
        for r in (1, 2, 3, 4, 6, 8):
            for v in (0, 1, 3, 7):
                s = Shape(r, v, L)
                samples.append(Sample(s, f[s.tokens] + kv * s.kv_tokens + attn * s.query_ctx
                                      + mkv * s.multi_kv_tokens + req * s.ctx_requests, 0.0))
    for c in range(2, 65):
        s = Shape(1, c - 1, 0)
        assert s.multi_kv_tokens == 0 and s.ctx_requests == 0
        samples.append(Sample(s, f[c] + attn * s.query_ctx, 0.0))
    assert Shape(4, 0, 100).multi_kv_tokens == 0 and Shape(4, 2, 100).multi_kv_tokens == 400
    fit = fit_terms(samples)
    assert fit.multi_kv_s_per_token == pytest.approx(mkv, rel=1e-6)
    assert fit.request_s == pytest.approx(req, rel=1e-6)
    assert fit.kv_s_per_token == pytest.approx(kv, rel=1e-6)
    assert fit.attn_s_per_query_ctx == pytest.approx(attn, rel=1e-6)
    assert heldout_error(samples, "linear", 0.25, 0)["heldout_max_rel_error"] < 1e-6
    off = heldout_error(samples, "linear", 0.25, 0, fit_multi_kv=False, fit_request=False)
    assert off["heldout_max_rel_error"] > 1e-2
    # the profile file carries both terms
    import tomllib

    from dspark_sim.calibration.profile import EngineProfile, profile_from_dict

    prof = EngineProfile("t", "measured", 1, fit.tokens, fit.step_s, kv_s_per_token=kv,
                         multi_kv_s_per_token=mkv, request_s=req)
    back = profile_from_dict(tomllib.loads(prof.to_toml()))
    assert back.multi_kv_s_per_token == pytest.approx(mkv) and back.request_s == pytest.approx(req)


def test_measure_engine_user_drafters():
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from types import SimpleNamespace

    from dspark_sim.calibration.measure import measure_engine

    class FakeDrafter(torch.nn.Module):
        """The traces/drafters.py protocol: .cfg and .draft(batch, shared, gamma)."""

        def __init__(self) -> None:
            super().__init__()
            self.cfg = SimpleNamespace(hidden=16, vocab=64, window=2, n_feat=3)
            self.lin = torch.nn.Linear(16, 16)

        def draft(self, b, shared, gamma):
            h = self.lin(b.h_last) + shared.embed(b.last_tok)
            return shared.head(h.unsqueeze(1).expand(-1, gamma, -1)).argmax(-1)

    calls = []
    prof = measure_engine(
        TINY_LLAMA, batch_requests=(1, 2), verify_lengths=(0, 1), context_lengths=(8, 16),
        warmup=0, repeats=1, holdout=0.0, log=None,
        drafter={"dspark": FakeDrafter(), "mtp1": lambda n, g: calls.append((n, g))},
    )
    assert set(prof.drafts) == {"dspark", "mtp1"}
    assert prof.drafts["dspark"].gamma_ref == 7 and prof.drafts["mtp1"].gamma_ref == 1
    assert sorted(set(calls)) == [(1, 1), (1, 2), (2, 1), (2, 2)]
    assert "user-supplied" in prof.parameters["draft_source"]
    assert "heldout_mean_rel_error" not in prof.parameters


def test_published_llama_profile_is_the_published_fit():
    """The transcribed SpecDecode-Bench fit, recomputed from its coefficients by hand."""
    p = load_profile("llama31-8b-h100")
    c_kv, c_tok, c_fix, c_step = 3.92645679e-08, 2.10103129e-05, 5.88590713e-03, 1.20683946e-03
    for b, kv in ((1, 0), (7, 5000.0), (128, 300_000.0), (8192, 10.0)):
        assert p.step_time_s(b, kv_tokens=kv) == pytest.approx(c_kv * kv + c_tok * b + c_fix
                                                               + c_step, rel=1e-9)
    d_kv, d_spec, d_fix = 2.37768493e-09, 8.41429603e-07, 2.13526175e-03
    for name in ("eagle", "dspark"):
        for k in (1, 3, 5):
            assert p.draft_time_s(name, 4, k, kv_tokens=9000.0) == pytest.approx(
                d_kv * 9000.0 + d_spec * (k + 1) + d_fix, rel=1e-6)


def test_calibrate_engine_defaults_are_measure_engines():
    """`calibrate engine` measures the shapes `measure_engine()` (and docs/profiles.md, and
    the shipped smollm2-cpu profile) use: its option defaults are the library's, not a
    second copy that drifted (--batch-requests stayed 1,2,3,6 when the library moved to
    1,2,4,6,8 for the B = 32/64 decode rows)."""
    import inspect

    import typer

    from dspark_sim.calibration.measure import measure_engine
    from dspark_sim.cli import app

    engine = typer.main.get_command(app).commands["calibrate"].commands["engine"]
    cli = {p.name: p.default for p in engine.params}
    lib = inspect.signature(measure_engine).parameters
    for name in ("batch_requests", "verify_lengths", "context_lengths"):
        assert tuple(int(x) for x in cli[name].split(",")) == tuple(lib[name].default), name
    for name in ("warmup", "repeats", "cuda_graphs"):
        assert cli[name] == lib[name].default, name

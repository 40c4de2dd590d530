"""Hardware + model sheets a user writes (`dspark-sim calibrate engine --sheet`): the
defaults a short sheet takes (overhead, capture limit, peak precision), the
tensor-parallel all-reduce term, the checks that catch a wrong unit, and the shipped
sheet-only profiles."""

from __future__ import annotations

import tomllib
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from dspark_sim.calibration.profile import load_profile
from dspark_sim.calibration.roofline import (
    DEFAULT_OVERHEAD_MS,
    HARDWARE,
    MODELS,
    SHEET_PROFILES,
    VLLM_MAX_CAPTURE_TOKENS,
    DeploymentSheet,
    graph_cost_s,
    profile_from_sheets,
    sheet_profile_path,
    weights_s,
)
from dspark_sim.errors import InputError

DATA = Path(__file__).resolve().parents[2] / "calibration" / "data"
# The six lines a new user writes for Llama-3.1-70B on 4x H100 (TP4).
LLAMA70 = ('hardware = "H100"\nmodel = "llama31-70b"\n[deployment]\ngpus_per_replica = 4\n')


def _sheet(tmp_path, text: str, name: str = "s.toml"):
    path = tmp_path / name
    path.write_text(text)
    return profile_from_sheets(path)


def _step_ms(prof, b: int) -> float:
    return float(prof.step_time_s(np.array([b]), kv_tokens=0.0)[0]) * 1e3


def test_overhead_is_optional_with_the_stated_default(tmp_path):
    p = _sheet(tmp_path, 'hardware = "H100"\nmodel = "qwen3-8b"\n[deployment]\n'
                         "gpus_per_replica = 1\n")
    hw, m = replace(HARDWARE["H100"], peak_flops=0.989e15), MODELS["qwen3-8b"]
    dep = DeploymentSheet(gpus_per_replica=1)
    # one GPU, memory-bound at B = 1: the weights' read plus the default overhead
    assert p.step_s[0] == pytest.approx(float(weights_s(1, hw, m, dep)) + DEFAULT_OVERHEAD_MS / 1e3)
    assert p.parameters["deploy_overhead_ms"] == DEFAULT_OVERHEAD_MS
    assert "overhead 1.5 ms (default; fit it with dspark-sim calibrate vllm)" in \
        p.parameters["sheet_summary"]
    stated = _sheet(tmp_path, 'hardware = "H100"\nmodel = "qwen3-8b"\n[deployment]\n'
                              "gpus_per_replica = 1\noverhead_ms = 4.0\n")
    assert stated.step_s[0] - p.step_s[0] == pytest.approx(2.5e-3)
    assert "overhead 4 ms (the sheet's)" in stated.parameters["sheet_summary"]


def test_tensor_parallel_all_reduce_per_layer(tmp_path):
    with_ar = _sheet(tmp_path, LLAMA70)
    without = _sheet(tmp_path, LLAMA70 + "tp_allreduces_per_layer = 0\n")
    np.testing.assert_array_equal(with_ar.tokens, without.tokens)
    extra = (with_ar.step_s - without.step_s)[with_ar.tokens <= 512]  # inside the graphs
    b = with_ar.tokens[with_ar.tokens <= 512].astype(float)
    # 80 layers x 2 all-reduces, each 8 us + a ring's 2 x 3/4 of B x 8192 BF16 values at
    # NVLink 4's 450 GB/s each way
    want = 80 * 2 * (8e-6 + 2 * 3 / 4 * b * 8192 * 2 / 450e9)
    np.testing.assert_allclose(extra, want, rtol=1e-9)
    assert "TP4 all-reduce 2 per layer x 80 layers at 8 us + 450 GB/s" in \
        with_ar.parameters["sheet_summary"]
    # one GPU: nothing to reduce
    one = _sheet(tmp_path, LLAMA70.replace("gpus_per_replica = 4", "gpus_per_replica = 1")
                 .replace("llama31-70b", "qwen3-8b"))
    assert "no TP all-reduce term" in one.parameters["sheet_summary"]


def test_capture_limit_defaults_to_vllms(tmp_path):
    p = _sheet(tmp_path, LLAMA70)
    hw = replace(HARDWARE["H100"], peak_flops=0.989e15)
    m = MODELS["llama31-70b"]
    dep = DeploymentSheet(gpus_per_replica=4)
    # vLLM's default capture sizes: 1, 2, 4, every 8 to 248, every 16 to 512
    graphs = [1, 2, 4, *range(8, 256, 8), *range(256, 513, 16)]
    assert list(p.tokens[: len(graphs)]) == graphs
    assert p.parameters["deploy_cuda_graph_max_tokens"] == VLLM_MAX_CAPTURE_TOKENS == 512
    # a 1,152-token mixed step runs eager at its own size, not padded into a 1,536 graph
    assert 1152 in p.tokens
    want = float(graph_cost_s(1152, hw, m, dep)) + dep.eager_penalty_ms / 1e3
    assert _step_ms(p, 1152) == pytest.approx(want * 1e3)
    assert _step_ms(p, 1152) < float(graph_cost_s(1536, hw, m, dep)) * 1e3
    assert "vLLM's default max_cudagraph_capture_size" in p.parameters["sheet_summary"]
    assert "CUDA graphs up to 512 tokens" in p.parameters["sheet_summary"]
    # vLLM's rule: at most 2 x max_num_seqs x (1 + draft tokens), and the token budget
    small = _sheet(tmp_path, LLAMA70 + "max_num_seqs = 16\ndraft_gamma = 3\n")
    assert small.parameters["deploy_cuda_graph_max_tokens"] == 128
    stated = _sheet(tmp_path, LLAMA70 + "cuda_graph_max_tokens = 1024\n")
    assert stated.parameters["deploy_cuda_graph_max_tokens"] == 1024
    assert "(as the sheet states)" in stated.parameters["sheet_summary"]


@pytest.mark.parametrize("model, precision, peak", [
    ("llama31-70b", "BF16", 0.989e15),  # 2-byte weights: the BF16 peak, not FP8's 1,979
    ("glm47", "FP8", 1.979e15),
])
def test_the_models_precision_picks_the_presets_peak(tmp_path, model, precision, peak):
    p = _sheet(tmp_path, LLAMA70.replace("llama31-70b", model)
               .replace("gpus_per_replica = 4", "gpus_per_replica = 8"))
    assert p.parameters["hw_peak_flops"] == peak
    assert f"peak {peak / 1e12:,.0f} TFLOP/s (the H100 preset's dense {precision} peak)" in \
        p.parameters["sheet_summary"]


def test_a_stated_precision_overrides_and_is_checked(tmp_path):
    p = _sheet(tmp_path, 'precision = "fp8"\n' + LLAMA70)
    assert p.parameters["hw_peak_flops"] == 1.979e15
    with pytest.raises(InputError, match=r"s\.toml: precision 'fp4': the H100 preset has "
                                         r"peaks for bf16, fp8"):
        _sheet(tmp_path, 'precision = "fp4"\n' + LLAMA70)
    with pytest.raises(InputError, match="'precision' must be one of bf16, fp8, fp4"):
        _sheet(tmp_path, 'precision = "int8"\n' + LLAMA70)
    # a preset named for its precision, or a table's own peak, is taken as written
    named = _sheet(tmp_path, LLAMA70.replace('"H100"', '"H100-bf16"').replace(
        "llama31-70b", "glm47").replace("= 4", "= 8"))
    assert named.parameters["hw_peak_flops"] == 0.989e15


def test_an_unknown_top_level_key_is_refused(tmp_path):
    with pytest.raises(InputError, match=r"s\.toml.*deploymnet"):
        _sheet(tmp_path, LLAMA70.replace("[deployment]", "[deploymnet]"))


_HW = ('[hardware]\nname = "X"\nhbm_bytes_per_s = {hbm}\npeak_flops = {peak}\nhbm_bytes = {mem}\n'
       '[model]\nname = "m"\nactive_params = {params}\ndense_params = {params}\n'
       "routed_params = 0\nbytes_per_param = {bpp}\n[deployment]\ngpus_per_replica = 1\n"
       "overhead_ms = {over}\n")
_OK = dict(hbm="3.35e12", peak="0.989e15", mem="80e9", params="8e9", bpp="2", over="1.5")


@pytest.mark.parametrize("field, value, key, unit", [
    ("hbm", "3.35", "hbm_bytes_per_s", "bytes per second"),      # TB/s
    ("peak", "989", "peak_flops", "FLOP/s"),                     # TFLOP/s
    ("mem", "80", "hbm_bytes", "bytes"),                         # GB
    ("params", "8", "active_params", "parameters"),              # billions
    ("bpp", "16", "bytes_per_param", "bytes per parameter"),     # bits
    ("over", "1500", "overhead_ms", "milliseconds"),             # microseconds
])
def test_a_wrong_unit_is_caught(tmp_path, field, value, key, unit):
    good = _sheet(tmp_path, _HW.format(**_OK))
    assert good.step_s[0] > 0
    with pytest.raises(InputError, match=rf"s\.toml: '{key}' = .* it is in {unit}.*wrong unit"):
        _sheet(tmp_path, _HW.format(**(_OK | {field: value})))


def test_calibrate_engine_sheet_names_its_assumptions(tmp_path):
    from typer.testing import CliRunner

    from dspark_sim.cli import app

    sheet, out = tmp_path / "llama.toml", tmp_path / "prof.toml"
    sheet.write_text(LLAMA70)
    r = CliRunner().invoke(app, ["calibrate", "engine", "--sheet", str(sheet), "--out", str(out)])
    assert r.exit_code == 0, r.output
    text = " ".join(r.output.split())
    assert "peak 989 TFLOP/s (the H100 preset's dense BF16 peak)" in text
    assert "CUDA graphs up to 512 tokens (vLLM's default max_cudagraph_capture_size" in text
    assert load_profile(out).parameters["sheet_summary"] in text


@pytest.mark.parametrize("name", SHEET_PROFILES)
def test_shipped_sheet_profiles_are_their_sheets_and_say_so(name):
    sheet = sheet_profile_path(name)
    text = sheet.read_text()
    assert "NOTHING here is fitted" in text and "data sheet" in text
    assert (DATA / f"{name}.toml").read_text() == profile_from_sheets(sheet).to_toml()
    p = load_profile(name)
    assert p.kind == "analytic" and not any(k.startswith("fitted_to") for k in p.parameters)
    # the sheet states its hardware by preset: its peak is the model's precision's
    data = tomllib.loads(text)
    assert data["hardware"] in HARDWARE


def test_refine_sheet_moves_the_overhead_to_the_measured_step(tmp_path):
    """`calibrate vllm --sheet`: the fitted one-request step (table at one token, the
    per-request cost, one logit row) replaces the sheet's, through overhead_ms alone."""
    import numpy as np

    from dspark_sim.calibration.profile import EngineLimits
    from dspark_sim.calibration.roofline import refine_sheet
    from dspark_sim.validation.vllm_fit import make_profile

    sheet = tmp_path / "llama.toml"
    sheet.write_text(LLAMA70)
    prof = profile_from_sheets(sheet)
    sheet_ms = 1e3 * (float(prof.target_time_s(np.array([1]))[0]) + prof.request_s
                      + prof.logits_s_per_row)
    # fixed 18 + token 0.5 + request 0.3 + logit row 0.2 = 19 ms for one request
    fitted = make_profile(np.array([18.0, 0.5, 0.3, 0.2]), name="f", max_batched_tokens=8192,
                          limits=EngineLimits(max_num_seqs=256))
    r = refine_sheet(sheet, fitted)
    assert r["measured_step_ms"] == pytest.approx(19.0)
    assert r["sheet_step_ms"] == pytest.approx(sheet_ms)
    assert r["overhead_ms"] == pytest.approx(DEFAULT_OVERHEAD_MS + 19.0 - sheet_ms)
    sheet.write_text(LLAMA70 + f"overhead_ms = {r['overhead_ms']}\n")
    again = profile_from_sheets(sheet)
    assert 1e3 * (float(again.target_time_s(np.array([1]))[0]) + again.request_s
                  + again.logits_s_per_row) == pytest.approx(19.0)
    # a measured step faster than the sheet's terms alone: the sheet is wrong, say so
    fast = make_profile(np.array([1.0, 0.1, 0.0, 0.0]), name="f", max_batched_tokens=8192,
                        limits=EngineLimits(max_num_seqs=256))
    with pytest.raises(InputError, match="llama.toml: the measured one-request step"):
        refine_sheet(sheet, fast)


def test_the_worked_example_in_the_docs_runs_as_printed(tmp_path):
    """docs/profiles.md's worked example: its sheet, through the one command, prints what
    the docs show (the summary and the assumptions line), and its wrong-unit example is
    refused with the line shown."""
    import re

    from typer.testing import CliRunner

    from dspark_sim.cli import app

    docs = (Path(__file__).resolve().parents[2] / "docs" / "profiles.md").read_text()
    sheet_text = re.search(r"<!-- sheet: qwen3-32b-2xh200 -->\n```toml\n(.*?)```", docs,
                           re.S).group(1)
    shown = re.search(r"\$ dspark-sim calibrate engine --sheet qwen3-32b-2xh200\.sheet\.toml "
                      r"--out qwen3-32b-2xh200\.toml\n(.*?)\n\$ ", docs, re.S).group(1)
    sheet = tmp_path / "qwen3-32b-2xh200.sheet.toml"
    sheet.write_text(sheet_text)
    r = CliRunner().invoke(app, ["calibrate", "engine", "--sheet", str(sheet), "--out",
                                 str(tmp_path / "qwen3-32b-2xh200.toml")])
    assert r.exit_code == 0, r.output
    # rich wraps at the terminal's width, anywhere: compare without the white space
    printed = "".join(r.output.replace(str(tmp_path) + "/", "").split())
    assert printed == "".join(shown.split())
    sheet.write_text(sheet_text.replace("active_params = 32.76e9 ", "active_params = 32.76 "))
    r = CliRunner().invoke(app, ["calibrate", "engine", "--sheet", str(sheet), "--out",
                                 str(tmp_path / "x.toml")])
    line = re.search(r"\n(error: qwen3-32b-2xh200\.sheet\.toml: 'active_params' = 32\.76 .*)\n",
                     docs).group(1)
    assert r.exit_code == 2
    assert "".join(r.output.replace(str(tmp_path) + "/", "").split()) == "".join(line.split())


def test_a_moe_whose_untouched_expert_share_underflows_still_builds(tmp_path):
    """(1 - 8/64) ** tokens underflows to 0 at large batches: every expert is touched,
    a valid limit, not a sheet whose numbers imply no profile."""
    import json

    from dspark_sim.calibration.roofline import profile_from_sheets

    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "qwen3_moe", "hidden_size": 2048, "intermediate_size": 6144,
        "moe_intermediate_size": 768, "num_hidden_layers": 48, "num_attention_heads": 32,
        "num_key_value_heads": 4, "head_dim": 128, "num_experts": 64,
        "num_experts_per_tok": 8, "vocab_size": 151936, "max_position_embeddings": 40960,
        "torch_dtype": "bfloat16"}))
    sheet = tmp_path / "s.toml"
    sheet.write_text('hardware = "H100"\n[model]\nhf_config = "config.json"\n'
                     '[deployment]\ngpus_per_replica = 1\n')
    prof = profile_from_sheets(sheet)
    steps = np.asarray(prof.step_s)
    assert np.all(np.isfinite(steps)) and np.all(np.diff(steps) >= 0) and steps[0] > 0

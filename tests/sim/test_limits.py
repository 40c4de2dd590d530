"""Per-replica limits from the profile, requests that can never be served, the step
bound, and the draft-KV and attention-window cost terms (computed here by hand)."""

from __future__ import annotations

import ast
from dataclasses import fields, replace
from pathlib import Path

import numpy as np
import pytest

from dspark_sim.calibration.profile import (
    DEFAULT_LIMITS,
    ENGINE_LIMITS,
    LIMITS,
    DraftCost,
    EngineLimits,
    EngineProfile,
    load_profile,
    profile_from_dict,
    resolve_limits,
)
from dspark_sim.errors import InputError
from dspark_sim.sim.api import simulate
from dspark_sim.sim.config import DeploymentConfig, EngineConfig, SimConfig, WorkloadConfig
from dspark_sim.traces.synth import synth_iid


def _flat(**kw) -> EngineProfile:
    """A 10 ms step whatever B; drafting free unless a test sets it."""
    base = dict(name="flat", kind="measured", gpus_per_replica=1,
                tokens=np.array([1, 8192]), step_s=np.array([0.010, 0.010]),
                drafts={"dspark": DraftCost(np.array([1.0, 2.0]), np.array([0.0, 0.0]), 7)})
    return EngineProfile(**(base | kw))


def _closed(policy: str, lengths: str, n: int = 1, clients: int = 1, **engine) -> SimConfig:
    return SimConfig(policy=policy, deployment=DeploymentConfig(replicas=1),
                     engine=EngineConfig(**engine),
                     workload=WorkloadConfig(arrival="closed", max_concurrency=clients,
                                             num_requests=n, lengths=lengths))


def test_each_limit_is_declared_once_and_read_by_name_as_a_run_option():
    """EngineLimits declares the limits; a run's EngineConfig holds an option of each
    name, which resolve_limits reads before the profile's and DEFAULT_LIMITS' value."""
    assert ENGINE_LIMITS == tuple(f.name for f in fields(EngineLimits))
    assert set(ENGINE_LIMITS) <= {f.name for f in fields(EngineConfig)}
    lim = resolve_limits(EngineConfig(max_num_seqs=3, prefill="disaggregated"),
                         _flat(limits=EngineLimits(max_num_seqs=5, kv_capacity_tokens=5000)))
    assert isinstance(lim, EngineLimits)
    assert (lim.max_num_seqs, lim.prefill, lim.kv_capacity_tokens) == (3, "disaggregated", 5000)
    assert (lim.max_num_batched_tokens, lim.max_model_len) == \
        (DEFAULT_LIMITS.max_num_batched_tokens, DEFAULT_LIMITS.max_model_len)
    assert lim.sources == {"max_num_seqs": "option", "prefill": "option",
                           "kv_capacity_tokens": "profile", "max_num_batched_tokens": "default",
                           "max_model_len": "default"}


def test_the_run_options_are_the_limits_themselves():
    """The config declares no limit of its own: EngineConfig inherits each from
    EngineLimits, and the option's help, unit and default (unset) are the limit's, so a
    limit is said once; DEFAULT_LIMITS holds each limit's default."""
    from dspark_sim.sim.config import SETTINGS

    assert issubclass(EngineConfig, EngineLimits)
    own = {f.name: f for f in fields(EngineConfig)}
    for name, lim in LIMITS.items():
        assert own[name].metadata["limit"] is lim
        s = SETTINGS[f"engine.{name}"]
        assert (s.help, s.unit, s.default, s.option) == \
            (lim.help, lim.unit, None, "--" + name.replace("_", "-"))
        assert getattr(DEFAULT_LIMITS, name) == lim.default
    assert (DEFAULT_LIMITS.max_num_seqs, DEFAULT_LIMITS.prefill) == (256, "chunked")


BOUNDED = [(name, lim.maximum) for name, lim in LIMITS.items() if lim.maximum]


@pytest.mark.parametrize("name,maximum", BOUNDED)
def test_an_option_and_a_profile_bound_a_limit_alike(name, maximum):
    """Each count is capped where it is declared: the run option and a profile's
    [engine] table take its maximum and refuse one more; a mode outside the limit's
    choices is refused by both."""
    option = "--" + name.replace("_", "-")
    doc = {"profile": {"name": "x"}, "target": {"tokens": [1, 8], "step_ms": [1.0, 2.0]}}
    assert getattr(EngineConfig(**{name: maximum}).validate(), name) == maximum
    assert getattr(profile_from_dict({**doc, "engine": {name: maximum}}).limits, name) \
        == maximum
    with pytest.raises(InputError) as exc:
        EngineConfig(**{name: maximum + 1}).validate()
    assert exc.value.where == option
    with pytest.raises(InputError, match=name):
        profile_from_dict({**doc, "engine": {name: maximum + 1}})


def test_a_prefill_mode_is_one_of_the_limits_choices():
    doc = {"profile": {"name": "x"}, "target": {"tokens": [1, 8], "step_ms": [1.0, 2.0]}}
    for mode in LIMITS["prefill"].choices:
        assert EngineConfig(prefill=mode).validate().prefill == mode
        assert profile_from_dict({**doc, "engine": {"prefill": mode}}).limits.prefill == mode
    with pytest.raises(InputError) as exc:
        EngineConfig(prefill="split").validate()
    assert exc.value.where == "--prefill"
    with pytest.raises(InputError, match="'prefill' must be one of chunked, disaggregated"):
        profile_from_dict({**doc, "engine": {"prefill": "split"}})


def test_the_config_imports_no_engine():
    """sim/config.py sits below the engine that reads it: it resolves limits through the
    profile's resolve_limits, never through sim/engine.py."""
    import dspark_sim.sim.config as config

    tree = ast.parse(Path(config.__file__).read_text(encoding="utf-8"))
    named = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)} \
        | {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert not {m for m in named if m and m.startswith("dspark_sim.sim.engine")}


def test_limits_come_from_the_profile_unless_given():
    prof = _flat(limits=EngineLimits(max_num_seqs=3, kv_capacity_tokens=5000))
    s = simulate(_closed("none", "fixed:20:5", n=12, clients=12), profile=prof).summary
    assert s["max_num_seqs"] == 3 and s["kv_capacity_tokens"] == 5000
    assert s["max_num_batched_tokens"] == 8192  # the simulator's default
    assert s["engine_limits_source"] == {"max_num_seqs": "profile", "kv_capacity_tokens": "profile",
                                         "max_num_batched_tokens": "default",
                                         "max_model_len": "default", "prefill": "default"}
    # 12 requests, 3 at a time, each 20 prefill + 4 more decode steps of 10 ms: the
    # batch never holds more than 3, so the run takes 4 rounds of 5 steps (0.2 s); per
    # round one prefill step decodes nobody, four decode 3: a mean batch of 12 / 5
    assert s["engine_steps"] == 4 * 5 and s["duration"] == pytest.approx(0.2, rel=1e-9)
    assert s["mean_decode_batch"] == pytest.approx(12 / 5) and s["completed"] == 12
    s2 = simulate(_closed("none", "fixed:20:5", n=12, clients=12, max_num_seqs=6),
                  profile=prof).summary
    assert s2["max_num_seqs"] == 6 and s2["engine_limits_source"]["max_num_seqs"] == "option"
    assert s2["engine_steps"] == 2 * 5  # 6 seats: two rounds


def test_shipped_profiles_state_their_kv_capacity():
    """The one-GPU dense profile cannot hold a 2M-token global default
    (147.5 KB/token: 295 GB), so its capacity comes from its HBM."""
    p = load_profile("qwen3-8b-h100")
    assert p.limits.kv_capacity_tokens is not None
    kv_bytes = p.parameters["model_kv_bytes_per_token"]
    hbm = p.parameters["hw_hbm_bytes"]
    assert p.limits.kv_capacity_tokens * kv_bytes < hbm
    # by hand: 80 GB less the 10 % activation reserve less 8.2e9 bf16 weights (16.4 GB),
    # over 147,500 bytes a token: 55.6e9 / 147,500 = 376,949 tokens
    free = hbm * (1 - p.parameters["deploy_activation_reserve"]) \
        - p.parameters["model_bytes_per_param"] * p.parameters["model_dense_params"]
    assert p.limits.kv_capacity_tokens == int(free // kv_bytes) == 376_949


@pytest.mark.parametrize("kv_mode", ["preempt", "reserve"])
def test_requests_that_can_never_fit_are_rejected_and_counted(kv_mode):
    # 1,000-token prompts on a 100-token KV cache: refused at arrival, nothing served
    cfg = _closed("fixed:3", "fixed:1000:10", n=5, clients=2, kv_capacity_tokens=100,
                  kv_mode=kv_mode)
    r = simulate(cfg, profile=_flat(), trace=synth_iid(0.5, 7, num_requests=2))
    s = r.summary
    assert s["rejected"] == 5 and s["rejected_reasons"] == {"kv_capacity": 5}
    assert s["completed"] == 0 and s["unfinished"] == 0 and s["engine_steps"] == 0
    assert r.requests["rejected_reason"].to_list() == ["kv_capacity"] * 5
    assert s["bounded_by"] is None


def test_rejection_in_a_mix_keeps_the_accounting_whole():
    """lognormal lengths on a small cache: the long ones are refused, the rest served;
    completed + unfinished + rejected = requests, in open and closed loop."""
    need_slots = 1 + 7  # preempt mode commits the verify slots of a gamma=7 drafter
    for workload in (WorkloadConfig(qps=50.0, num_requests=120, lengths="lognormal:300:50:1.0"),
                     WorkloadConfig(arrival="closed", max_concurrency=8, num_requests=120,
                                    lengths="lognormal:300:50:1.0")):
        cfg = SimConfig(policy="confidence", deployment=DeploymentConfig(replicas=1),
                        engine=EngineConfig(kv_capacity_tokens=1200), workload=workload)
        r = simulate(cfg)
        s, req = r.summary, r.requests
        too_big = (req["prompt_tokens"] + req["output_tokens"] + need_slots > 1200).to_numpy()
        assert 0 < too_big.sum() < 120
        assert (req["rejected_reason"].is_not_null().to_numpy() == too_big).all()
        assert s["completed"] + s["unfinished"] + s["rejected"] == 120
        assert s["completed"] == 120 - too_big.sum()


def test_max_model_len_refuses_long_requests():
    prof = _flat(limits=EngineLimits(max_model_len=64))
    cfg = SimConfig(policy="none", deployment=DeploymentConfig(replicas=1),
                    workload=WorkloadConfig(arrival="closed", max_concurrency=2, num_requests=40,
                                            lengths="lognormal:40:20:0.5"))
    r = simulate(cfg, profile=prof)
    req = r.requests
    long = (req["prompt_tokens"] + req["output_tokens"] > 64).to_numpy()
    assert long.any() and not long.all()
    assert (req["rejected_reason"].to_numpy()[long] == "max_model_len").all()
    assert r.summary["completed"] == int((~long).sum())


def test_every_run_is_bounded_by_steps():
    cfg = replace(_closed("none", "fixed:10:100000"), max_engine_steps=50)
    r = simulate(cfg, profile=_flat())
    s = r.summary
    assert s["bounded_by"] == "steps" and s["engine_steps"] == 50
    assert s["completed"] == 0 and s["unfinished"] == 1


def test_draft_kv_term_is_charged_per_context_token():
    """One request, 10-token prompt, fixed:3 with nothing accepted: decode step k holds
    10 + k context tokens (k = 1..10); a drafter reading 1 us per context token adds
    sum(10 + k) = 155 us to the run, and nothing to the prefill step."""
    trace = synth_iid(0.0, 7, num_requests=2, positions=64)
    cfg = _closed("fixed:3", "fixed:10:11")
    base = simulate(cfg, profile=_flat(), trace=trace).requests
    prof = _flat(drafts={"dspark": DraftCost(np.array([1.0, 2.0]), np.zeros(2), 7,
                                             kv_s_per_token=1e-6)})
    r = simulate(cfg, profile=prof, trace=trace).requests
    assert r["ttft_ms"][0] == pytest.approx(base["ttft_ms"][0])
    assert r["e2e_ms"][0] - base["e2e_ms"][0] == pytest.approx(0.155)


def test_attention_window_caps_attended_context():
    """Decode step k verifies 4 tokens over a context of 10 + k; with a 12-token window
    each query attends min(10 + k, 12): 4 * (11 + 12 * 9) = 476 units instead of 620."""
    trace = synth_iid(0.0, 7, num_requests=2, positions=64)
    cfg = _closed("fixed:3", "fixed:10:11")
    full = simulate(cfg, profile=_flat(attn_s_per_query_ctx=1e-5), trace=trace).requests
    windowed = simulate(cfg, profile=_flat(attn_s_per_query_ctx=1e-5, attn_window_tokens=12),
                        trace=trace).requests
    # the prefill chunk attends 10 * (0 + 5) = 50 units either way (inside the window)
    assert full["ttft_ms"][0] == pytest.approx(windowed["ttft_ms"][0])
    assert full["e2e_ms"][0] - windowed["e2e_ms"][0] == pytest.approx((620 - 476) * 1e-2)


def test_missing_draft_table_names_the_tables_present():
    prof = _flat(drafts={"eagle": DraftCost(np.array([1.0]), np.array([0.001]), 3)})
    cfg = _closed("fixed:3", "fixed:10:11")
    with pytest.raises(InputError, match=r"\[draft\.dspark\].*it has \[draft\.eagle\]"):
        simulate(cfg, profile=prof, trace=synth_iid(0.5, 7, num_requests=2))


@pytest.mark.parametrize("edit,message", [
    ('tokens = [1, 1e30]', "not supported"),
    ('kv_us_per_token = "fast"', "kv_us_per_token"),
    ('attn_window_tokens = 0', "attn_window_tokens"),
    ('[engine]\nmax_num_seqs = "many"', "max_num_seqs"),
    ('[engine]\nmax_seqs = 4', "unknown key"),
])
def test_bad_profile_values_are_one_line_errors(tmp_path, edit, message):
    text = ('[profile]\nname = "x"\n[target]\ntokens = [1, 8]\nstep_ms = [1.0, 2.0]\n')
    if edit.startswith("tokens"):
        text = text.replace("tokens = [1, 8]", edit)
    elif edit.startswith("[engine]"):
        text += edit + "\n"
    else:
        text = text.replace("[target]\n", "[target]\n" + edit + "\n")
    path = tmp_path / "p.toml"
    path.write_text(text)
    with pytest.raises(InputError, match=message) as exc:
        load_profile(path)
    assert str(path) in str(exc.value) and "\n" not in str(exc.value)


def test_binary_profile_is_a_one_line_error(tmp_path):
    path = tmp_path / "p.toml"
    path.write_bytes(bytes(range(256)) * 4)
    with pytest.raises(InputError, match="binary") as exc:
        load_profile(path)
    assert str(path) in str(exc.value)

"""TOML configs and presets."""

from __future__ import annotations

import pytest
from input_checks import assert_rejects_file

from dspark_sim.errors import InputError
from dspark_sim.sim.api import simulate
from dspark_sim.sim.config import (
    DeploymentConfig,
    EngineConfig,
    SimConfig,
    WorkloadConfig,
    load_config,
    preset,
)


def test_toml_config_composes_with_preset(tmp_path):
    p = tmp_path / "c.toml"
    p.write_text(
        'preset = "tiny"\n[engine]\nmax_num_seqs = 32\n[workload]\nqps = 5.0\nnum_requests = 30\n'
        '[run]\npolicy = "fixed:2"\nseed = 4\n'
    )
    cfg = load_config(p)
    assert cfg.engine.max_num_seqs == 32 and cfg.workload.qps == 5.0
    # the preset's one replica is kept, not the default's four
    assert cfg.policy == "fixed:2" and cfg.deployment.replicas == 1 != SimConfig().deployment.replicas
    assert simulate(cfg).summary["completed"] == 30


@pytest.mark.parametrize("text,needle", [
    ("[engine]\nmax_num_seqz = 3\n", "unknown key"),
    ("[bogus]\nx = 1\n", "unknown table"),
    ("[engine\n", "invalid TOML"),
    # a setting above every table: where it belongs, not "unknown table [qps]"
    ("qps = 5\n", "'qps' is outside any table; it belongs under \\[workload\\]"),
    ("seed = 3\n", "'seed' is outside any table; it belongs under \\[run\\]"),
    ("max_num_seqs = 3\n[engine]\n", "it belongs under \\[engine\\]"),
    ("bogus = 1\n", "unknown top-level key 'bogus'; settings go in the tables"),
])
def test_bad_config(tmp_path, text, needle):
    assert_rejects_file(tmp_path / "bad.toml", text, load_config, needle)


def test_unknown_preset():
    from dspark_sim.sim.config import resolve_config

    with pytest.raises(InputError, match="--preset"):
        preset("huge")
    # from Python: an AttributeError traceback ('int' object has no attribute 'strip')
    with pytest.raises(InputError, match="^--preset: must be a string, got 5"):
        resolve_config(preset_name=5)


def test_settings_are_checked_against_the_field_annotations():
    from dspark_sim.sim.config import _coerce

    assert _coerce(5, int | None, "x") == 5 and _coerce(None, int | None, "x") is None
    v = _coerce(3, float | None, "x")
    assert v == 3.0 and isinstance(v, float)
    assert _coerce("a", str | None, "x") == "a"
    for value, hint in [("5", int | None), (True, int), (1.5, int), (None, int), (2, str),
                        ("x", float | None), (False, float)]:
        with pytest.raises(InputError, match="^where: must be"):
            _coerce(value, hint, "where")
    # an optional field's None is no type the user can give: not named
    with pytest.raises(InputError, match="^where: must be an integer, got '5'$"):
        _coerce("5", int | None, "where")


@pytest.mark.parametrize("cfg,option,kind", [
    (SimConfig(seed="3"), "--seed", "an integer"),
    (SimConfig(seed=1.0), "--seed", "an integer"),
    (SimConfig(policy=3), "--policy", "a string"),
    (SimConfig(workload=WorkloadConfig(qps="fast")), "--qps", "a number"),
    (SimConfig(workload=WorkloadConfig(num_requests=True)), "--num-requests", "an integer"),
    (SimConfig(engine=EngineConfig(max_num_seqs=2.5)), "--max-num-seqs", "an integer"),
    (SimConfig(deployment=DeploymentConfig(replicas="2")), "--replicas", "an integer"),
])
def test_a_config_built_in_python_is_type_checked_by_validate(cfg, option, kind):
    """What the TOML and option layers coerce, a SimConfig built in Python gets from
    validate(): "3" is no seed, True no request count (each named by its option)."""
    with pytest.raises(InputError, match=f"must be {kind}") as err:
        cfg.validate()
    assert err.value.where == option


@pytest.mark.parametrize("cfg,option", [
    (SimConfig(trace=""), "--trace"), (SimConfig(mtp_trace=" "), "--mtp-trace"),
    (SimConfig(calibration=""), "--calibration"), (SimConfig(policy=""), "--policy"),
    (SimConfig(workload=WorkloadConfig(lengths="")), "--lengths"),
    (SimConfig(workload=WorkloadConfig(domain=" ")), "--domain"),
    (SimConfig(workload=WorkloadConfig(workload_path="")), "--workload"),
    (SimConfig(deployment=DeploymentConfig(profile="")), "--profile"),
])
def test_a_config_built_in_python_refuses_empty_strings_as_the_layers_do(cfg, option):
    # trace="" (or domain, lengths, calibration, mtp_trace) would silently run the default,
    # which the CLI and config files refuse (_Layer.set)
    with pytest.raises(InputError, match=f"^{option}: is empty"):
        cfg.validate()


def test_options_layer_over_preset_and_file(tmp_path):
    from dspark_sim.sim.config import resolve_config

    p = tmp_path / "c.toml"
    p.write_text('[workload]\nqps = 7\nduration_s = 30.0\n[run]\nseed = 2\n')
    cfg = resolve_config(preset_name="tiny", config_path=p, options={"seed": None, "qps": 9.0})
    assert cfg.workload.qps == 9.0 and cfg.seed == 2  # None: not given, the file decides
    # the file's duration_s alone bounds the run (the preset's num_requests is dropped)
    assert cfg.workload.duration_s == 30.0 and cfg.workload.num_requests is None
    cfg = resolve_config(config_path=p, options={"num_requests": 5})
    assert cfg.workload.num_requests == 5 and cfg.workload.duration_s == 30.0  # both bound
    cfg = resolve_config(options={"workload": tmp_path / "w.csv", "qps": 40.0})
    assert (cfg.workload.arrival, cfg.workload.replay_qps) == ("replay", 40.0)
    cfg = resolve_config(options={"burstiness": 0.5})
    assert cfg.workload.arrival == "gamma"
    cfg = resolve_config(options={"slo": "ttft:250,tpot:20"})
    assert (cfg.slo_ttft_ms, cfg.slo_tpot_ms) == (250.0, 20.0)
    cfg = resolve_config(options={"slo": "tpot:20"})
    assert (cfg.slo_ttft_ms, cfg.slo_tpot_ms) == (None, 20.0)
    cfg = resolve_config(options={"trace": "x.parquet", "policy": "mtp1"})
    assert cfg.mtp_trace == "x.parquet"
    with pytest.raises(InputError, match="^--max-concurrency: must be a positive integer"):
        resolve_config(options={"max_concurrency": 0})


def _with(**kw):
    """The default config with ``section__field=value`` / ``field=value`` changed."""
    from dataclasses import replace

    from dspark_sim.sim.config import SimConfig

    cfg, parts = SimConfig(), {}
    for k, v in kw.items():
        section, _, name = k.rpartition("__")
        if section:
            parts[section] = replace(parts.get(section, getattr(cfg, section)), **{name: v})
        else:
            cfg = replace(cfg, **{name: v})
    return replace(cfg, **parts)


# (settings that sit exactly on a documented limit, the same just past it, the option named)
LIMITS = [
    ({"seed": 0}, {"seed": -1}, "--seed"),
    ({"seed": 2**63 - 1}, {"seed": 2**63}, "--seed"),
    ({"gamma_max": 64}, {"gamma_max": 65}, "--gamma-max"),
    ({"drain_timeout_s": 1e7}, {"drain_timeout_s": 1.0000001e7}, "drain_timeout_s"),
    ({"slo_ttft_ms": 1e-9}, {"slo_ttft_ms": 0.0}, "--slo/slo_ttft_ms"),
    ({"slo_tpot_ms": 1e-9}, {"slo_tpot_ms": -1.0}, "--slo/slo_tpot_ms"),
    ({"engine__max_num_seqs": 1 << 16, "engine__max_num_batched_tokens": 1 << 20},
     {"engine__max_num_seqs": (1 << 16) + 1, "engine__max_num_batched_tokens": 1 << 20},
     "--max-num-seqs"),
    ({"engine__max_model_len": 1}, {"engine__max_model_len": 0}, "--max-model-len"),
    # docs/cli.md's limits table: 1,048,576 batched tokens, 2^40 KV tokens (and model length)
    ({"engine__max_num_batched_tokens": 1 << 20}, {"engine__max_num_batched_tokens": (1 << 20) + 1},
     "--max-num-batched-tokens"),
    ({"engine__kv_capacity_tokens": 1 << 40}, {"engine__kv_capacity_tokens": (1 << 40) + 1},
     "--kv-capacity-tokens"),
    ({"engine__max_model_len": 1 << 40}, {"engine__max_model_len": (1 << 40) + 1},
     "--max-model-len"),
    ({"engine__max_num_seqs": 64, "engine__max_num_batched_tokens": 64},
     {"engine__max_num_seqs": 65, "engine__max_num_batched_tokens": 64}, "--max-num-seqs"),
    ({"workload__arrival": "gamma", "workload__burstiness": 1e-3},
     {"workload__arrival": "gamma", "workload__burstiness": 0.99e-3}, "--burstiness"),
    ({"workload__arrival": "gamma", "workload__burstiness": 1e3},
     {"workload__arrival": "gamma", "workload__burstiness": 1.01e3}, "--burstiness"),
    # 1e5 requests at 0.01 req/s: 1e7 s, the clock's limit
    ({"workload__num_requests": 100_000, "workload__qps": 0.01},
     {"workload__num_requests": 100_001, "workload__qps": 0.01}, "--qps"),
    # qps * duration: one expected request is enough, fewer is not
    ({"workload__qps": 0.5, "workload__duration_s": 2.0},
     {"workload__qps": 0.5, "workload__duration_s": 1.9}, "--qps/--duration-s"),
    # ... and a window alone may expect up to MAX_NUM_REQUESTS (5e7)
    ({"workload__qps": 1000.0, "workload__duration_s": 5e4, "workload__num_requests": None},
     {"workload__qps": 1000.0, "workload__duration_s": 5.0001e4, "workload__num_requests": None},
     "--qps/--duration-s"),
    ({"workload__lengths": "fixed:16777216:1"}, {"workload__lengths": "fixed:16777217:1"},
     "--lengths"),
]


@pytest.mark.parametrize("ok, bad, option", LIMITS)
def test_a_limit_itself_is_allowed_and_just_past_it_refused(ok, bad, option):
    _with(**ok).validate()
    with pytest.raises(InputError) as err:
        _with(**bad).validate()
    assert err.value.where == option


def test_a_window_with_a_count_is_not_held_to_the_request_limit():
    """--num-requests caps the count: the window may then expect any number."""
    _with(workload__qps=1000.0, workload__duration_s=5e3, workload__num_requests=10).validate()


def test_settings_an_arrival_kind_does_not_read_are_not_checked_for_it():
    # a Poisson stream has no shape; a closed loop or a replay no rate
    _with(workload__burstiness=5e3).validate()
    _with(workload__arrival="closed", workload__qps=1e-9, workload__num_requests=5).validate()
    # a closed loop needs a count unless a file gives its requests
    _with(workload__arrival="closed", workload__num_requests=None,
          workload__workload_path="w.csv").validate()
    with pytest.raises(InputError, match="^--num-requests: closed-loop runs need"):
        _with(workload__arrival="closed", workload__num_requests=None).validate()
    with pytest.raises(InputError, match="^--workload: replay arrivals need a workload file"):
        _with(workload__arrival="replay").validate()


def test_every_config_component_is_frozen():
    from dataclasses import FrozenInstanceError

    from dspark_sim.sim.config import DeploymentConfig, EngineConfig, SimConfig, WorkloadConfig

    for obj, name in [(EngineConfig(), "max_num_seqs"), (DeploymentConfig(), "replicas"),
                      (WorkloadConfig(), "qps"), (SimConfig(), "seed")]:
        with pytest.raises(FrozenInstanceError):
            setattr(obj, name, 1)


def test_gamma_arrivals_without_a_burstiness_are_poisson():
    """vLLM semantics: burstiness 1 (the default) is Poisson; not given, gamma is Poisson."""
    import numpy as np

    from dspark_sim.sim.config import WorkloadConfig
    from dspark_sim.sim.workload import build_stream

    s = build_stream(WorkloadConfig(arrival="gamma", num_requests=3, lengths="fixed:2:2"),
                     np.random.default_rng(0))
    assert s.description.startswith("Poisson arrivals")


@pytest.mark.parametrize("name", ["single-replica", "tiny"])
def test_the_single_replica_and_tiny_presets_are_one_replica(name):
    from dspark_sim.sim.config import resolve_config

    assert resolve_config(preset_name=name).deployment.replicas == 1


@pytest.mark.parametrize("options,arrival,chosen_by", [
    ({"qps": 5.0}, "poisson", "--qps"),
    ({"duration_s": 2.0}, "poisson", "--duration-s"),
    ({"burstiness": 0.5}, "gamma", "--burstiness"),
    # given together: the first of (burstiness, qps, duration_s) is named as the opener
    ({"qps": 5.0, "duration_s": 2.0}, "poisson", "--qps"),
    ({"duration_s": 2.0, "burstiness": 0.5}, "gamma", "--burstiness"),
])
def test_an_open_loop_setting_opens_the_closed_loop_preset(options, arrival, chosen_by):
    """docs/cli.md: `--preset single-replica --qps 5` is Poisson at 5 req/s, the preset's
    one replica kept; a burstiness opens it into gamma arrivals. The conflict a further
    setting then raises names the option that opened the loop."""
    from dspark_sim.sim.config import resolve_config

    cfg = resolve_config(preset_name="single-replica", options=options)
    assert (cfg.workload.arrival, cfg.deployment.replicas) == (arrival, 1)
    with pytest.raises(InputError, match=rf"^--replay-qps: does not apply to {arrival} "
                                         rf"arrivals \(chosen by {chosen_by}\)"):
        resolve_config(preset_name="single-replica", options={**options, "replay_qps": 3.0})


def test_load_config_over_a_base_keeps_what_the_file_leaves_out(tmp_path):
    """load_config(path, base): the file is one layer over ``base`` (here the closed loop
    of 64 clients on one replica), with resolve_config's implications and conflicts."""
    base = preset("single-replica")
    p = tmp_path / "c.toml"
    p.write_text("[engine]\nmax_num_seqs = 32\n")
    cfg = load_config(p, base)
    assert cfg.engine.max_num_seqs == 32
    assert (cfg.workload.arrival, cfg.workload.max_concurrency, cfg.deployment.replicas) == \
        ("closed", 64, 1)
    p.write_text("[workload]\nqps = 5.0\n")  # the file's rate opens the base's closed loop
    cfg = load_config(p, base)
    assert (cfg.workload.arrival, cfg.workload.qps, cfg.deployment.replicas) == ("poisson", 5.0, 1)
    # a key that does not apply to the base's arrival kind: refused, the base named as the chooser
    p.write_text("[workload]\nreplay_qps = 3.0\n")
    with pytest.raises(InputError, match=r"c\.toml \[workload\] replay_qps: does not apply to "
                                         r"closed arrivals \(chosen by base config\)"):
        load_config(p, base)


def test_conflicts_name_what_chose_the_arrival_kind(tmp_path):
    from dspark_sim.sim.config import resolve_config

    with pytest.raises(InputError, match=r"^--replay-qps: does not apply to poisson arrivals "
                                         r"\(chosen by preset default\)"):
        resolve_config(options={"replay_qps": 5.0})
    # a file's closed loop over its workload file, opened by a rate and a window given
    # together: the rate (the first of them) opened it into a replay
    p = tmp_path / "c.toml"
    p.write_text(f'[workload]\narrival = "closed"\nworkload_path = "{tmp_path / "w.csv"}"\n')
    with pytest.raises(InputError, match=r"^--burstiness: does not apply to replay arrivals "
                                         r"\(chosen by --qps\)"):
        resolve_config(config_path=p, options={"qps": 5.0, "duration_s": 10.0, "burstiness": 2.0})


def test_an_option_given_on_the_command_line_is_blamed_on_itself_not_the_preset():
    """The preset changes replicas too; the bad value came from --replicas."""
    from dspark_sim.sim.config import resolve_config

    with pytest.raises(InputError) as err:
        resolve_config(preset_name="single-replica", options={"replicas": 0})
    assert err.value.where == "--replicas"


def test_gamma_max_may_equal_the_traces():
    from dspark_sim.policies.registry import get_policy
    from dspark_sim.sim.config import check_draft_length
    from dspark_sim.traces.schema import load_trace

    trace = load_trace("dspark-synthetic")
    pol = get_policy("fixed:3")
    check_draft_length(pol, trace, gamma_max=trace.gamma_max)
    with pytest.raises(InputError, match="^--gamma-max: "):
        check_draft_length(pol, trace, gamma_max=trace.gamma_max + 1)

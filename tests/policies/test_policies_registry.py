"""Policies as plug-ins: each module of policies/ registers its policies, and the name
lookup, the --policy help, `dspark-sim policies` and docs/policies.md all read the
registry; the engine and the validation server build snapshots through one method."""

from __future__ import annotations

import re
import sys
import types
from collections import deque
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from dspark_sim.cli import app
from dspark_sim.errors import InputError
from dspark_sim.policies import registry
from dspark_sim.policies.registry import DEFAULT_POLICY, Policy, get_policy, kinds, register

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def plugin():
    """The worked example of docs/architecture.md ("Adding a policy"), as written there,
    registered for one test only."""
    doc = (REPO / "docs" / "architecture.md").read_text()
    section = doc.split("### Adding a policy", 1)[1]
    source = section.split("```python\n", 1)[1].split("```", 1)[0]
    before = dict(registry._KINDS), dict(registry._ALIASES)
    mod = types.ModuleType("dspark_sim.policies.every_other")
    sys.modules[mod.__name__] = mod
    exec(compile(source, "docs/architecture.md", "exec"), mod.__dict__)
    yield mod
    registry._KINDS.clear()
    registry._KINDS.update(before[0])
    registry._ALIASES.clear()
    registry._ALIASES.update(before[1])
    sys.modules.pop(mod.__name__)


def test_discovery_finds_every_registration_in_the_package():
    # every @register("name" ...) written in policies/ is known once the registry looks
    written = {m for f in sorted((REPO / "policies").glob("*.py"))
               for m in re.findall(r'@register\(\s*"([^"]+)"', f.read_text())}
    assert len(written) >= 16
    assert {k.name for k in kinds()} == written


def test_each_example_builds_and_its_name_round_trips():
    for kind in kinds():
        built = get_policy(kind.example)
        assert isinstance(built, Policy) and built.name.split(":")[0].split("@")[0] == kind.name
        assert get_policy(built.name).name == built.name  # the canonical name is a spec
        for alias in kind.aliases:
            assert get_policy(alias).name == get_policy(kind.name).name


def test_a_policy_without_grammar_refuses_an_argument():
    bare = [k for k in kinds() if not k.grammar]
    assert {"none", "confidence", "dcut"} <= {k.name for k in bare}
    for kind in bare:
        with pytest.raises(InputError, match=f"{kind.name} takes no argument"):
            get_policy(f"{kind.name}:1")


def test_unknown_names_list_what_is_known():
    with pytest.raises(InputError) as exc:
        get_policy("nonesuch:3")
    assert all(k.usage in str(exc.value) for k in kinds())
    with pytest.raises(InputError, match="unknown policy"):
        get_policy("fixed@confidence:3")  # only a wrapper takes @BASE


def test_a_new_module_is_a_new_policy_everywhere(plugin):
    p = get_policy("alternate:3")
    assert p.name == "every-other:3" and get_policy("every-other").name == "every-other:1"
    rows = {r["policy"]: r for r in registry.policy_rows()}
    assert rows["every-other[:K]"]["aliases"] == "alternate"
    assert rows["every-other[:K]"]["reads"] == "nothing"
    assert "every-other[:K]" in registry.policy_help()
    assert "`every-other[:K]` (also `alternate`)" in registry.policy_table_markdown()
    r = CliRunner().invoke(app, ["policies"])
    assert r.exit_code == 0 and "every-other[:K]" in r.output
    assert "verify K drafts per request on even-sized batches" in " ".join(r.output.split())
    # and it runs in the simulator like any other
    from dspark_sim.sim.api import simulate
    from dspark_sim.sim.config import resolve_config

    s = simulate(resolve_config(preset_name="tiny", options={"policy": "every-other:2"})).summary
    assert s["policy"] == "every-other:2" and s["completed"] > 0


def test_a_name_taken_by_another_module_is_refused(plugin):
    with pytest.raises(RuntimeError, match="registered twice"):
        register("fixed", summary="a second fixed")(lambda spec, arg: None)
    assert get_policy("fixed:2").name == "fixed:2"


def test_one_default_policy():
    from dspark_sim.policies.lossy import DEFAULT_BASE
    from dspark_sim.sim.config import SimConfig
    from dspark_sim.sim.frontier import DEFAULT_CANDIDATE

    assert DEFAULT_POLICY in {k.name for k in kinds()}
    assert SimConfig().policy == DEFAULT_CANDIDATE == DEFAULT_BASE == DEFAULT_POLICY
    assert [r["policy"] for r in registry.policy_rows() if r["default"]] == [DEFAULT_POLICY]
    assert registry.policy_help().endswith(
        f"Default: {DEFAULT_POLICY}. dspark-sim policies lists what each does "
        "(docs/policies.md).")


def test_policies_command_lists_every_policy_in_plain_text():
    r = CliRunner().invoke(app, ["policies"])
    assert r.exit_code == 0, r.output
    text = " ".join(r.output.split())
    assert [k.usage for k in kinds() if k.usage not in text] == []
    assert f"{DEFAULT_POLICY} (default)" in text
    assert "**" not in text and "`" not in text and "](" not in text  # no markdown
    assert "docs/lossy.md" in text  # a summary's link, as a path


def test_plain_drops_markdown_and_keeps_link_targets():
    assert registry.plain("**lossy** `x` ([why](architecture.md#a-b)), *this*") == \
        "lossy x (why: docs/architecture.md), this"


def test_the_policies_doc_is_current():
    from cogapp import Cog

    doc = REPO / "docs" / "policies.md"
    assert "| `fixed:K` |" in doc.read_text()
    # cog --check: exit 5 when running the generator would change the file
    assert Cog().main(["cog", "--check", str(doc)]) == 0, "run: cog -r docs/policies.md"


def test_readme_links_to_the_policy_table():
    readme = (REPO / "README.md").read_text()
    assert "docs/policies.md" in readme


def test_snapshot_carries_the_lagged_view_and_freezes_its_arrays():
    lag_policy = get_policy("confidence-async")  # two steps behind, SPS and survival
    history = deque(maxlen=max(1, lag_policy.history))
    survivals = [np.full((2, 3), v) for v in (0.9, 0.8, 0.7)]
    snaps = [lag_policy.snapshot(history, s, 3, 64, sps=np.arange(7.0)) for s in survivals]
    assert snaps[0].lagged_survival is None and snaps[1].lagged_survival is None
    np.testing.assert_array_equal(snaps[2].lagged_survival, survivals[0])
    assert not snaps[2].survival.flags.writeable and not snaps[2].sps.flags.writeable
    with pytest.raises(ValueError):
        snaps[2].survival[0, 0] = 0.0
    assert len(history) == 2  # the deque holds what the policy's lag needs
    plain = get_policy("threshold:0.5")
    mine: deque = deque(maxlen=1)
    snap = plain.snapshot(mine, survivals[0], 3, 64)
    assert len(mine) == 0 and snap.lagged_survival is None and snap.sps is None


@pytest.mark.parametrize("path", ["sim/engine.py", "validation/server.py"])
def test_engine_and_server_build_snapshots_through_the_policy(path):
    src = (REPO / path).read_text()
    assert ".snapshot(" in src
    assert "BatchSnapshot(" not in src and ".lagged(" not in src

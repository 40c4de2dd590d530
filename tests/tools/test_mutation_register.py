"""The mutation runner's register of equivalent mutants (tools/mutation.py,
tools/mutation_equivalent.toml): every entry names a mutant the runner makes on
today's source, and the score leaves out exactly the registered survivors."""

import dataclasses
import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def mutation():
    spec = importlib.util.spec_from_file_location("mutation_runner", ROOT / "tools" / "mutation.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["mutation_runner"] = mod  # dataclasses look their module up by name
    try:
        spec.loader.exec_module(mod)
        yield mod
    finally:
        sys.modules.pop("mutation_runner", None)


def test_every_register_entry_names_a_mutant_of_todays_source(mutation):
    register = mutation.load_equivalent()
    assert register, "no register entries: the loop below would check nothing"
    made: dict[str, set[tuple[str, str, str | None, str | None]]] = {}
    for e in register:
        if e.module not in made:
            src = (ROOT / e.module).read_text().splitlines()
            made[e.module] = {(src[m.line - 1].strip(), m.what, span, scope)
                              for m in mutation.enumerate_mutants(e.module)
                              for span in (None, m.span) for scope in (None, m.scope)}
        assert (e.line, e.what, e.span, e.scope) in made[e.module], f"stale register entry: {e}"


def test_register_entries_need_a_reason(mutation, tmp_path):
    bad = tmp_path / "eq.toml"
    bad.write_text('[[equivalent]]\nmodule = "policies/base.py"\nline = "x"\nwhat = "+ -> -"\n'
                   'why = "  "\n')
    with pytest.raises(SystemExit, match="entry 1 needs"):
        mutation.load_equivalent(bad)
    assert mutation.load_equivalent(tmp_path / "absent.toml") == []


def test_score_leaves_out_only_registered_survivors(mutation):
    src = ["a = b + c", "d = e + f", "g = h + i"]
    mk = [mutation.Mutant("m.py", i, 0, i + 1, i + 1, i + 1, "+ -> -") for i in range(3)]
    rep = mutation.Report("m.py", total=4, outcomes=[
        mutation.Outcome(mk[0], "killed"), mutation.Outcome(mk[1], "survived"),
        mutation.Outcome(mk[2], "not covered"), mutation.Outcome(mk[0], "timeout")])
    reg = [mutation.Equivalent("m.py", "d = e + f", "+ -> -", "why"),
           mutation.Equivalent("m.py", "a = b + c", "+ -> -", "a killed mutant is not left out"),
           mutation.Equivalent("other.py", "g = h + i", "+ -> -", "another module")]
    assert rep.kill_rate == pytest.approx(2 / 4)
    assert [o.mutant.line for o in rep.equivalent(reg, src)] == [2]
    assert rep.score(reg, src) == pytest.approx(2 / 3)
    assert rep.score([], src) == pytest.approx(2 / 4)
    # an entry with a span covers only the mutant at those columns
    at = [mutation.Equivalent("m.py", "d = e + f", "+ -> -", "why", span="4-9")]
    assert rep.equivalent(at, src) == []
    assert len(rep.equivalent([dataclasses.replace(at[0], span="")], src)) == 1
    # and one with a scope only the mutant in that function
    assert rep.equivalent([dataclasses.replace(at[0], span=None, scope="f")], src) == []
    assert len(rep.equivalent([dataclasses.replace(at[0], span=None, scope="")], src)) == 1

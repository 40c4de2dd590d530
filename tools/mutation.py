"""Mutation testing of the simulator core: how many small, meaningful code changes does
the fast torch-free part of the suite catch? Prints the kill rate per module and every
surviving mutant. Slow (minutes to an hour); not run in CI.

    python tools/mutation.py                          # the default modules
    python tools/mutation.py sim/frontier.py          # one module
    python tools/mutation.py policies/ --jobs 2       # a folder, two workers
    python tools/mutation.py sim/engine.py --lines 200-260 --show 3
    python tools/mutation.py --list sim/metrics.py    # list the mutants, run nothing

Why a small runner of our own rather than mutmut or cosmic-ray (both on PyPI and both
tried): the repository maps top-level folders into one namespace (``sim/`` imports as
``dspark_sim.sim``, see pyproject's ``package-dir``). mutmut 3 copies the sources into
``mutants/`` and imports them by their path-derived names (``sim.engine``), so the tests,
which import ``dspark_sim.sim.engine``, never see a mutant. cosmic-ray rewrites the file
in place and starts a fresh interpreter and test run per mutant: it works, but it leaves
a mutated source file behind if interrupted, and at ~1.5 s of imports per mutant it is
several times slower on 2 cores. This runner:

* parses each module, enumerates mutants from the AST (operators below) and never
  writes a source file: a mutant is served to the import system by a meta-path finder
  under the module's real name, in a forked child of a parent that has already imported
  the third-party libraries (numpy, polars, simpy, pytest, hypothesis);
* runs the unmutated module once under a line tracer to learn which tests execute which
  lines, then runs, for each mutant, only the tests that execute its statement, fastest
  first, stopping at the first failure (``-x``); a mutant no test executes survives
  without a run ("not covered");
* counts a mutant killed when a test fails or errors, or when the run exceeds a timeout
  (3x the tests' baseline time + 10 s: a mutant that loops forever).

Operators (one mutant per site): comparison flips (``<``/``<=``, ``>``/``>=``, ``==``/``!=``,
``is``/``is not``, ``in``/``not in``); arithmetic swaps (``+``/``-``, ``*``/``/``, ``//`` -> ``/``,
``%`` -> ``//``, ``**`` -> ``*``, ``&``/``|``) in expressions and augmented assignments;
``and``/``or``; removing ``not`` / unary ``-`` / ``~``; integer ``n`` -> ``n + 1``, float
``x`` -> ``x + 1``, ``True``/``False``; swapping ``min``/``max``, ``minimum``/``maximum``,
``argmin``/``argmax``, ``any``/``all``, ``nanmin``/``nanmax``; deleting an augmented
assignment or a bare call statement. Not mutated: strings, docstrings, f-strings,
annotations, imports, ``__all__``, lines marked ``# pragma: no mutate``.

Equivalent mutants (no test can tell them apart from the original) are recorded, each with
why, in ``tools/mutation_equivalent.toml``: an entry names the module, the mutated
line's source text (stripped), the change as ``--list`` prints it and, where one line has
two such changes or two functions the same line, the columns of the changed node or the
enclosing function. The report gives the
raw kill rate (killed / run) and the mutation score (killed / (run - equivalent)), the
textbook measure. The register is checked on every run: an entry whose mutant a test
kills is wrong and is printed as such (and not counted), and on a full run of a module an
entry that matches no mutant is printed as stale.
"""

from __future__ import annotations

import argparse
import ast
import importlib.abc
import importlib.util
import json
import os
import shutil
import signal
import sys
import time
import tomllib
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# The run works on a snapshot of the working tree (see ``snapshot``) so that editing or
# rebasing the checkout while it runs changes nothing under it.
TREE = ROOT
DEFAULT_MODULES = ("sim/engine.py", "sim/metrics.py", "sim/frontier.py", "policies/")
# The fast, torch-free tests a mutant is judged by (~1 min on 2 cores; the subprocess
# legs are left out: a mutant lives in this process only).
DEFAULT_TESTS = ("tests/sim/test_engine.py", "tests/sim/test_metrics.py", "tests/sim/test_sim_properties.py",
                 "tests/policies/test_scheduler_oracle.py", "tests/policies/test_policies.py",
                 "tests/sim/test_frontier.py", "tests/sim/test_steady.py", "tests/sim/test_limits.py",
                 # the engine's tree / lossy hooks and the stored golden runs (torch-free)
                 "tests/policies/test_verification_hook.py", "tests/policies/test_tree_policies.py",
                 "tests/policies/test_lossy_policies.py", "tests/sim/test_golden.py",
                 # engine mechanics by hand; the context-priced / stopping drafters
                 "tests/sim/test_engine_by_hand.py", "tests/policies/test_long_context.py",
                 # policies/shared_budget.py's own tests (DFly / D-cut by brute force)
                 "tests/policies/test_shared_budget.py")

CMP_SWAP = {ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt,
            ast.Eq: ast.NotEq, ast.NotEq: ast.Eq, ast.Is: ast.IsNot, ast.IsNot: ast.Is,
            ast.In: ast.NotIn, ast.NotIn: ast.In}
BIN_SWAP = {ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.Div, ast.Div: ast.Mult,
            ast.FloorDiv: ast.Div, ast.Mod: ast.FloorDiv, ast.Pow: ast.Mult,
            ast.BitAnd: ast.BitOr, ast.BitOr: ast.BitAnd, ast.LShift: ast.RShift,
            ast.RShift: ast.LShift}
NAME_SWAP = {"min": "max", "max": "min", "minimum": "maximum", "maximum": "minimum",
             "argmin": "argmax", "argmax": "argmin", "any": "all", "all": "any",
             "nanmin": "nanmax", "nanmax": "nanmin"}
OP_TEXT = {ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">", ast.GtE: ">=", ast.Eq: "==",
           ast.NotEq: "!=", ast.Is: "is", ast.IsNot: "is not", ast.In: "in",
           ast.NotIn: "not in", ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/",
           ast.FloorDiv: "//", ast.Mod: "%", ast.Pow: "**", ast.BitAnd: "&", ast.BitOr: "|",
           ast.LShift: "<<", ast.RShift: ">>", ast.And: "and", ast.Or: "or"}


# -- mutants -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Mutant:
    module: str  # path relative to the repo, e.g. "sim/engine.py"
    index: int  # position of the node in ast.walk order
    op: int  # which mutation of that node (always 0 today: one per node)
    line: int
    first: int  # line range whose execution makes a test relevant
    last: int
    what: str  # human-readable change
    span: str = ""  # columns of the mutated node, "start-end" (tells apart two same changes
    # on one line: ``np.zeros(0), np.zeros(0)``, or the ``&`` of ``(a & b) & c``)
    scope: str = ""  # the enclosing function / class, e.g. "Replica._admit" (tells apart
    # two identical lines in different functions)

    @property
    def key(self) -> str:
        return f"{self.module}:{self.line}:{self.what}"


EQUIVALENT_FILE = ROOT / "tools" / "mutation_equivalent.toml"


@dataclass(frozen=True)
class Equivalent:
    module: str
    line: str  # the mutated line's source text, stripped
    what: str  # the change, as Mutant.what
    why: str
    span: str | None = None  # only the mutant at these columns ("start-end", --list prints it)
    scope: str | None = None  # only in this function / class (--list prints it)


def load_equivalent(path: Path = EQUIVALENT_FILE) -> list[Equivalent]:
    """The register of equivalent mutants (a missing file is an empty register)."""
    if not path.exists():
        return []
    rows = tomllib.loads(path.read_text()).get("equivalent", [])
    out = []
    for i, row in enumerate(rows):
        missing = {"module", "line", "what", "why"} - set(row)
        if missing or not str(row.get("why", "")).strip():
            raise SystemExit(f"{path}: entry {i + 1} needs module, line, what and a why "
                             f"(missing: {', '.join(sorted(missing)) or 'why'})")
        out.append(Equivalent(row["module"], row["line"].strip(), row["what"], row["why"],
                              row.get("span"), row.get("scope")))
    return out


def _skip_ids(tree: ast.Module, lines: list[str]) -> set[int]:
    """Nodes never mutated: docstrings, annotations, f-strings, __all__, imports, marked
    lines (and everything under them)."""
    skip: set[int] = set()

    def under(node: ast.AST | None) -> None:
        if node is not None:
            skip.update(id(n) for n in ast.walk(node))

    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) \
                and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
            under(body[0])
        if isinstance(node, ast.JoinedStr | ast.Import | ast.ImportFrom):
            under(node)
        elif isinstance(node, ast.arg):
            under(node.annotation)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            under(node.returns)
        elif isinstance(node, ast.AnnAssign):
            under(node.annotation)
        elif isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            under(node)
        lineno = getattr(node, "lineno", None)
        if lineno is not None and "pragma: no mutate" in lines[lineno - 1]:
            under(node)
    return skip


def _mutations(node: ast.AST, parent: ast.AST | None) -> list[str]:
    """Descriptions of the mutations of ``node`` (an augmented assignment has two)."""
    if isinstance(node, ast.AugAssign):
        out = ["delete augmented assignment"]
        if type(node.op) in BIN_SWAP:
            a = type(node.op)
            out.insert(0, f"{OP_TEXT[a]}= -> {OP_TEXT[BIN_SWAP[a]]}=")
        return out
    if isinstance(node, ast.Compare) and len(node.ops) == 1 and type(node.ops[0]) in CMP_SWAP:
        a = type(node.ops[0])
        return [f"{OP_TEXT[a]} -> {OP_TEXT[CMP_SWAP[a]]}"]
    if isinstance(node, ast.BinOp) and type(node.op) in BIN_SWAP:
        a = type(node.op)
        return [f"{OP_TEXT[a]} -> {OP_TEXT[BIN_SWAP[a]]}"]
    if isinstance(node, ast.BoolOp):
        a = type(node.op)
        return [f"{OP_TEXT[a]} -> {'or' if a is ast.And else 'and'}"]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not | ast.USub | ast.Invert):
        return [f"drop {'not' if isinstance(node.op, ast.Not) else ('-' if isinstance(node.op, ast.USub) else '~')}"]
    if isinstance(node, ast.Constant) and type(node.value) in (bool, int, float):
        v = node.value
        if isinstance(v, bool):
            return [f"{v} -> {not v}"]
        return [f"{v!r} -> {v + 1!r}"]
    if isinstance(node, ast.Name) and node.id in NAME_SWAP and isinstance(parent, ast.Call) \
            and parent.func is node:
        return [f"{node.id} -> {NAME_SWAP[node.id]}"]
    if isinstance(node, ast.Attribute) and node.attr in NAME_SWAP and isinstance(parent, ast.Call) \
            and parent.func is node:
        return [f".{node.attr} -> .{NAME_SWAP[node.attr]}"]
    if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):
        return ["delete call statement"]
    return []


def _apply(node: ast.AST, what: str) -> ast.AST | None:
    """Mutate ``node`` in place (or return a replacement for it)."""
    if what.startswith("delete"):
        return ast.copy_location(ast.Pass(), node)
    if isinstance(node, ast.Compare):
        node.ops = [CMP_SWAP[type(node.ops[0])]()]
    elif isinstance(node, ast.BinOp | ast.AugAssign) and type(node.op) in BIN_SWAP:
        node.op = BIN_SWAP[type(node.op)]()
    elif isinstance(node, ast.BoolOp):
        node.op = ast.Or() if isinstance(node.op, ast.And) else ast.And()
    elif isinstance(node, ast.UnaryOp):
        return node.operand
    elif isinstance(node, ast.Constant):
        node.value = (not node.value) if isinstance(node.value, bool) else node.value + 1
    elif isinstance(node, ast.Name):
        node.id = NAME_SWAP[node.id]
    elif isinstance(node, ast.Attribute):
        node.attr = NAME_SWAP[node.attr]
    return None


def _walk_with_parents(tree: ast.AST):
    """ast.walk order (breadth first), with each node's parent."""
    todo = [(tree, None)]
    while todo:
        node, parent = todo.pop(0)
        yield node, parent
        todo.extend((child, node) for child in ast.iter_child_nodes(node))


def _scopes(tree: ast.Module) -> dict[int, str]:
    """Every node's enclosing function / class, dotted ("" at module level)."""
    out: dict[int, str] = {}

    def visit(node: ast.AST, scope: str) -> None:
        out[id(node)] = scope
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            scope = f"{scope}.{node.name}" if scope else node.name
        for child in ast.iter_child_nodes(node):
            visit(child, scope)

    visit(tree, "")
    return out


def _stmt_ranges(tree: ast.Module) -> dict[int, tuple[int, int]]:
    """For every node, the lines whose execution makes a test relevant to it: its
    innermost statement's lines (a compound statement's header only)."""
    out: dict[int, tuple[int, int]] = {}

    def visit(node: ast.AST, rng: tuple[int, int]) -> None:
        if isinstance(node, ast.stmt):
            body = getattr(node, "body", None)
            if isinstance(body, list) and body and isinstance(body[0], ast.stmt):
                rng = (node.lineno, max(node.lineno, body[0].lineno - 1))
            else:
                rng = (node.lineno, node.end_lineno or node.lineno)
        out[id(node)] = rng
        for child in ast.iter_child_nodes(node):
            visit(child, rng)

    visit(tree, (0, 0))
    return out


def enumerate_mutants(module: str) -> list[Mutant]:
    src = (TREE / module).read_text()
    tree = ast.parse(src)
    skip = _skip_ids(tree, src.splitlines())
    ranges = _stmt_ranges(tree)
    scopes = _scopes(tree)
    out = []
    for i, (node, parent) in enumerate(_walk_with_parents(tree)):
        if id(node) in skip or not hasattr(node, "lineno"):
            continue
        for j, what in enumerate(_mutations(node, parent)):
            first, last = ranges.get(id(node), (node.lineno, node.lineno))
            out.append(Mutant(module, i, j, node.lineno, first, last, what,
                              f"{node.col_offset}-{node.end_col_offset}", scopes[id(node)]))
    return out


def mutant_code(m: Mutant):
    """The mutated module, compiled (under its real file name: tracebacks and line
    numbers stay those of the source)."""
    tree = ast.parse((TREE / m.module).read_text())
    for i, (node, parent) in enumerate(_walk_with_parents(tree)):
        if i == m.index:
            new = _apply(node, m.what)
            if new is not None:
                _replace_child(parent, node, new)
            break
    return compile(ast.fix_missing_locations(tree), str(TREE / m.module), "exec")


def mutant_text(m: Mutant) -> str:
    """The mutated statement as source (for --show)."""
    tree = ast.parse((TREE / m.module).read_text())
    for i, (node, _parent) in enumerate(_walk_with_parents(tree)):
        if i == m.index:
            new = _apply(node, m.what)
            return ast.unparse(new if new is not None else node)
    return ""


def _replace_child(parent: ast.AST, old: ast.AST, new: ast.AST) -> None:
    for name, value in ast.iter_fields(parent):
        if value is old:
            setattr(parent, name, new)
            return
        if isinstance(value, list):
            for k, v in enumerate(value):
                if v is old:
                    value[k] = new
                    return
    raise RuntimeError("node not found under its parent")


# -- running tests in forked children --------------------------------------------------------------
def module_name(path: str) -> str:
    """Import name of a repo file under pyproject's package-dir mapping."""
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())
    mapping = cfg["tool"]["setuptools"]["package-dir"]
    rel = Path(path).with_suffix("")
    for pkg, folder in sorted(mapping.items(), key=lambda kv: -len(kv[1])):
        try:
            tail = rel.relative_to(folder)
        except ValueError:
            continue
        parts = [] if tail == Path(".") else list(tail.parts)
        return ".".join([pkg, *parts])
    raise SystemExit(f"{path}: not under any package-dir of pyproject.toml")


class _Serve(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves one module's (mutated) code under its real name and file."""

    def __init__(self, name: str, path: str, code) -> None:
        self.name, self.path, self.code = name, path, code

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.name:
            return None
        return importlib.util.spec_from_loader(fullname, self, origin=self.path)

    def create_module(self, spec):
        return None

    def exec_module(self, module) -> None:
        module.__file__ = self.path
        exec(self.code, module.__dict__)


def _child_setup(quiet: bool) -> None:
    os.environ["DSPARK_HYPOTHESIS_PROFILE"] = "mutation"
    for name in ("torch", "triton", "transformers"):
        sys.modules[name] = None  # the judged subset is torch-free
    if quiet:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)


def _pytest_args(tests: list[str]) -> list[str]:
    return ["-x", "-q", "-p", "no:cacheprovider", "--no-header", "-o", "addopts=",
            "-W", "ignore", *tests]


def _fork(fn) -> int:
    pid = os.fork()
    if pid == 0:
        code = 70
        try:
            code = fn()
        finally:
            os._exit(code)
    return pid


def _wait(pid: int, timeout_s: float | None) -> tuple[int | None, float]:
    t0 = time.monotonic()
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status), time.monotonic() - t0
        if timeout_s is not None and time.monotonic() - t0 > timeout_s:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return None, time.monotonic() - t0
        time.sleep(0.01)


@dataclass
class Coverage:
    tests: list[str]  # node ids in baseline order
    duration_s: dict[str, float]
    lines: dict[int, set[str]]  # line -> tests that executed it ("*" = at import)


def baseline(modules: list[str], tests: list[str], out_json: Path) -> dict[str, Coverage]:
    """Run the tests once on the unmutated modules (each compiled from its AST, as the
    mutants are) under a line tracer: which test runs which line of which module."""
    paths = {str(TREE / m): m for m in modules}

    def child() -> int:
        _child_setup(quiet=True)
        import pytest

        for m in modules:
            path = str(TREE / m)
            sys.meta_path.insert(0, _Serve(module_name(m), path,
                                           compile(ast.parse((TREE / m).read_text()), path, "exec")))
        import dspark_sim.io

        if not dspark_sim.io.__file__.startswith(str(TREE)):
            return 99  # the editable install won over the snapshot
        hits: dict[tuple[str, int], set[str]] = defaultdict(set)
        durations: dict[str, float] = {}
        order: list[str] = []
        current = ["*"]

        def local(frame, event, arg):
            if event == "line":
                hits[frame.f_code.co_filename, frame.f_lineno].add(current[0])
            return local

        def glob(frame, event, arg):
            return local if frame.f_code.co_filename in paths else None

        class Plugin:
            def pytest_runtest_setup(self, item):
                current[0] = item.nodeid
                # re-armed per test: CPython drops a trace function that raises, and a
                # test that recurses to the limit (test_input_files' deeply nested
                # documents) makes it raise RecursionError; every later test then ran
                # untraced and its lines counted "not covered"
                sys.settrace(glob)

            def pytest_runtest_logreport(self, report):
                if report.when == "call":
                    durations[report.nodeid] = report.duration
                    order.append(report.nodeid)

        sys.settrace(glob)
        code = pytest.main(["-p", "no:cacheprovider", "-q", "-o", "addopts=", "-W", "ignore",
                            *tests], plugins=[Plugin()])
        sys.settrace(None)
        out_json.write_text(json.dumps({
            "code": int(code), "order": order, "durations": durations,
            "lines": [[paths[f], k, sorted(v)] for (f, k), v in hits.items()]}))
        return 0

    out_json.unlink(missing_ok=True)
    code, _ = _wait(_fork(child), None)
    data = json.loads(out_json.read_text()) if out_json.exists() else {"code": -1}
    if code == 99:
        raise SystemExit(f"dspark_sim did not import from the snapshot {TREE}")
    if code != 0 or data["code"] != 0:
        raise SystemExit(f"the unmutated baseline run failed (pytest exit {data['code']}): "
                         "fix the suite before mutating")
    out = {m: Coverage(data["order"], data["durations"], {}) for m in modules}
    for m, line, who in data["lines"]:
        out[m].lines[line] = set(who)
    return out


@dataclass
class Outcome:
    mutant: Mutant
    status: str  # killed | timeout | survived | not covered
    seconds: float = 0.0
    tests: int = 0


@dataclass
class Report:
    module: str
    total: int = 0  # mutants of the module (more than were run under --sample)
    outcomes: list[Outcome] = field(default_factory=list)
    full: bool = False  # every mutant of the module was run (no --sample, no --lines)

    def count(self, *status: str) -> int:
        return sum(o.status in status for o in self.outcomes)

    @property
    def kill_rate(self) -> float:
        n = len(self.outcomes)
        return self.count("killed", "timeout") / n if n else 1.0

    def equivalent(self, register: list[Equivalent], src: list[str]) -> list[Outcome]:
        """The survivors the register lists as equivalent."""
        return [o for o in self.outcomes if o.status in ("survived", "not covered")
                and _listed(o.mutant, register, src)]

    def score(self, register: list[Equivalent], src: list[str]) -> float:
        """Mutation score: killed / (run - equivalent)."""
        n = len(self.outcomes) - len(self.equivalent(register, src))
        return self.count("killed", "timeout") / n if n else 1.0

    def interval(self) -> str:
        """Wilson 95 % interval of the kill rate when only a sample was run."""
        n = len(self.outcomes)
        if n == 0 or n >= self.total:
            return ""
        p, z = self.kill_rate, 1.96
        c = (p + z * z / (2 * n)) / (1 + z * z / n)
        h = z * ((p * (1 - p) / n + z * z / (4 * n * n)) ** 0.5) / (1 + z * z / n)
        return f"  (sample of {n}/{self.total}: 95 % {c - h:.0%}-{c + h:.0%})"


def _listed(m: Mutant, register: list[Equivalent], src: list[str]) -> Equivalent | None:
    text = src[m.line - 1].strip()
    return next((e for e in register if e.module == m.module and e.what == m.what
                 and e.line == text and e.span in (None, m.span)
                 and e.scope in (None, m.scope)), None)


def relevant_tests(m: Mutant, cov: Coverage) -> list[str]:
    hit: set[str] = set()
    for line in range(m.first, m.last + 1):
        hit |= cov.lines.get(line, set())
    if not hit:
        return []
    if "*" in hit:  # executed at import (defaults, module constants): every test may see it
        hit = set(cov.tests)
    hit.discard("*")
    return sorted(hit, key=lambda t: (cov.duration_s.get(t, 0.0), cov.tests.index(t)))


def run_module(module: str, cov: Coverage, *, jobs: int, show: int,
               lines: list[tuple[int, int]] | None, sample: int, log, seed: str = "") -> Report:
    mutants = enumerate_mutants(module)
    if lines:
        mutants = [m for m in mutants if any(a <= m.line <= b for a, b in lines)]
    rep = Report(module, total=len(mutants), full=not lines and not 0 < sample < len(mutants))
    if 0 < sample < len(mutants):
        import random

        # the default seed keeps the samples measured before --seed existed reproducible
        keep = sorted(random.Random(f"{module}:{len(mutants)}{seed and ':' + seed}").sample(
            range(len(mutants)), sample))
        mutants = [mutants[i] for i in keep]
    log(f"{module}: {len(mutants)} of {rep.total} mutants")
    name, path = module_name(module), str(TREE / module)
    running: dict[int, tuple[Mutant, list[str], float, float]] = {}
    queue = list(mutants)
    done = 0

    def start(m: Mutant) -> None:
        sel = relevant_tests(m, cov)
        if not sel:
            rep.outcomes.append(Outcome(m, "not covered"))
            return
        src = mutant_code(m)
        if show > 0:
            log(f"-- {m.key}: {mutant_text(m)}")
        budget = 3.0 * sum(cov.duration_s.get(t, 1.0) for t in sel) + 10.0

        def child() -> int:
            _child_setup(quiet=show <= 0)
            import pytest

            sys.meta_path.insert(0, _Serve(name, path, src))
            return int(pytest.main(_pytest_args(sel)))

        running[_fork(child)] = (m, sel, time.monotonic(), budget)

    while queue or running:
        while queue and len(running) < jobs:
            start(queue.pop(0))
        for pid, (m, sel, began, budget) in list(running.items()):
            got = os.waitpid(pid, os.WNOHANG)
            elapsed = time.monotonic() - began
            if got[0] == 0 and elapsed <= budget:
                continue
            if got[0] == 0:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                status = "timeout"
            else:
                code = os.waitstatus_to_exitcode(got[1])
                # 1: a test failed; 2/3: collection or internal error (the mutant broke an
                # import); other codes: the child crashed. All are detections.
                status = "survived" if code == 0 else "killed"
            del running[pid]
            rep.outcomes.append(Outcome(m, status, elapsed, len(sel)))
            done += 1
            if done % 25 == 0:
                log(f"  {module}: {done}/{len(mutants)} run, "
                    f"{rep.count('survived', 'not covered')} surviving so far")
        time.sleep(0.01)
    rep.outcomes.sort(key=lambda o: (o.mutant.line, o.mutant.index))
    return rep


def snapshot(tmp: Path) -> Path:
    """Copy the working tree (sources, tests, data) to ``tmp`` and lay the package out
    the way pyproject's ``package-dir`` maps it (``_pkg/dspark_sim/sim`` -> ``sim/``), so
    the children import this copy (it comes first on ``sys.path``; the editable
    install's finder comes after it)."""
    dst = tmp / f"tree-{os.getpid()}"
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(ROOT, dst, symlinks=True, ignore=shutil.ignore_patterns(
        ".git", ".venv", ".cache", "__pycache__", "*.egg-info", ".hypothesis", ".pytest_cache",
        ".ruff_cache", "runs", "notebooks", "build", "dist"))
    cfg = tomllib.loads((dst / "pyproject.toml").read_text())
    pkg = dst / "_pkg"
    for name, folder in cfg["tool"]["setuptools"]["package-dir"].items():
        parts = name.split(".")
        target = pkg.joinpath(*parts)
        if len(parts) == 1:  # the top package: its own files, beside the mapped folders
            target.mkdir(parents=True, exist_ok=True)
            for f in (dst / folder).iterdir():
                (target / f.name).symlink_to(f)
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.symlink_to(dst / folder, target_is_directory=True)
    shared = tmp / "shared"  # tests find ../shared beside the checkout
    if not shared.exists() and (ROOT.parent / "shared").is_dir():
        shared.symlink_to(ROOT.parent / "shared", target_is_directory=True)
    return dst


def expand(paths: list[str]) -> list[str]:
    out = []
    for p in paths:
        q = ROOT / p
        if q.is_dir():
            out += sorted(str(f.relative_to(ROOT)) for f in q.glob("*.py")
                          if f.name != "__init__.py")
        else:
            out.append(str(q.relative_to(ROOT)))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("modules", nargs="*", default=list(DEFAULT_MODULES),
                    help="files or folders to mutate (default: %(default)s)")
    ap.add_argument("--tests", default=",".join(DEFAULT_TESTS),
                    help="comma-separated test files judging the mutants")
    ap.add_argument("--jobs", type=int, default=1, help="mutants run at once (default 1)")
    ap.add_argument("--lines", help="only mutants on these lines, e.g. 120-180,300")
    ap.add_argument("--list", action="store_true", help="list the mutants, run nothing")
    ap.add_argument("--sample", type=int, default=0,
                    help="run a seeded random sample of this many mutants per module (the "
                         "kill rate is then an estimate; its 95 %% interval is printed)")
    ap.add_argument("--seed", default="",
                    help="draw a different --sample (any string; default: the original one)")
    ap.add_argument("--show", type=int, default=0,
                    help="print the test output of the mutants (debugging, with --lines)")
    ap.add_argument("--json", type=Path, help="write every outcome to this JSON file")
    args = ap.parse_args(argv)
    if args.json is not None:
        args.json = Path(os.path.abspath(args.json))
    os.chdir(ROOT)
    modules = expand(args.modules)
    lines = None
    if args.lines:  # "120-180,300" -> [(120, 180), (300, 300)]
        lines = [(int(a), int(b or a)) for a, _, b in
                 (part.partition("-") for part in args.lines.split(","))]
    if args.list:
        for mod in modules:
            for m in enumerate_mutants(mod):
                print(f"{m.module}:{m.line}:{m.span}: {m.what}  [{m.scope}]")
        return 0
    # Import the heavy third-party libraries once; every forked child inherits them.
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    os.environ.setdefault("POLARS_MAX_THREADS", "1")
    import hypothesis  # noqa: F401
    import numpy  # noqa: F401
    import polars  # noqa: F401  (imported, never used: its thread pool starts in the children)
    import pytest  # noqa: F401
    import simpy  # noqa: F401

    tests = [t for t in args.tests.split(",") if t]
    tmp = ROOT / ".cache" / "mutation"
    tmp.mkdir(parents=True, exist_ok=True)
    global TREE
    TREE = snapshot(tmp)
    sys.path.insert(0, str(TREE / "_pkg"))
    os.chdir(TREE)
    try:
        return _run(args, modules, tests, lines, tmp)
    finally:
        os.chdir(ROOT)
        shutil.rmtree(TREE, ignore_errors=True)


def _run(args, modules: list[str], tests: list[str], lines, tmp: Path) -> int:

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    register = load_equivalent()  # read first: a bad register fails before the long run
    reports = []
    t0 = time.monotonic()
    cov = baseline(modules, tests, tmp / "coverage.json")
    c0 = next(iter(cov.values()))
    log(f"baseline: {len(c0.tests)} tests, {sum(c0.duration_s.values()):.0f} s of test time "
        f"(traced run {time.monotonic() - t0:.0f} s)")
    for mod in modules:
        reports.append(run_module(mod, cov[mod], jobs=args.jobs, show=args.show, lines=lines,
                                  sample=args.sample, log=log, seed=args.seed))
    sources = {r.module: (TREE / r.module).read_text().splitlines() for r in reports}
    print(f"\nmutation testing: {time.monotonic() - t0:.0f} s, tests: {', '.join(tests)}\n")
    print(f"{'module':28} {'mutants':>8} {'killed':>7} {'timeout':>8} {'survived':>9} "
          f"{'uncovered':>10} {'kill rate':>10} {'equivalent':>11} {'score':>7}")
    for r in reports:
        src = sources[r.module]
        print(f"{r.module:28} {len(r.outcomes):8d} {r.count('killed'):7d} "
              f"{r.count('timeout'):8d} {r.count('survived'):9d} {r.count('not covered'):10d} "
              f"{r.kill_rate:10.1%} {len(r.equivalent(register, src)):11d} "
              f"{r.score(register, src):7.1%}{r.interval()}")
    if len(reports) > 1:  # the modules together (e.g. the policies/ package)
        run = sum(len(r.outcomes) for r in reports)
        killed = sum(r.count("killed", "timeout") for r in reports)
        eq = sum(len(r.equivalent(register, sources[r.module])) for r in reports)
        print(f"{'all of the above':28} {run:8d} {killed:7d} {'':8} {'':9} {'':10} "
              f"{killed / max(run, 1):10.1%} {eq:11d} {killed / max(run - eq, 1):7.1%}")
    for r in reports:
        src = sources[r.module]
        surv = [o for o in r.outcomes if o.status in ("survived", "not covered")]
        open_ = [o for o in surv if not _listed(o.mutant, register, src)]
        if open_:
            print(f"\nsurviving in {r.module} (not in the equivalent register):")
            for o in open_:
                tag = " (not covered)" if o.status == "not covered" else ""
                print(f"  {o.mutant.line:4d}:{o.mutant.span:7} {o.mutant.what:28} | "
                      f"{src[o.mutant.line - 1].strip()[:80]}{tag}")
        wrong = [o for o in r.outcomes if o.status in ("killed", "timeout")
                 and _listed(o.mutant, register, src)]
        for o in wrong:
            print(f"  register entry wrong, a test kills it: {o.mutant.key}")
        if r.full:  # every mutant was run: an entry matching none of them is stale
            seen = {_listed(o.mutant, register, src) for o in r.outcomes}
            for e in register:
                if e.module == r.module and e not in seen:
                    print(f"  register entry stale, no such mutant: {e.module}: "
                          f"{e.what} | {e.line[:60]}")
    if args.json:
        args.json.write_text(json.dumps([
            {"module": o.mutant.module, "line": o.mutant.line, "span": o.mutant.span, "scope": o.mutant.scope,
             "what": o.mutant.what,
             "status": o.status, "seconds": round(o.seconds, 3), "tests": o.tests,
             "text": sources[r.module][o.mutant.line - 1].strip(),
             "equivalent": bool(o.status in ("survived", "not covered")
                                and _listed(o.mutant, register, sources[r.module]))}
            for r in reports for o in r.outcomes], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Regenerate the stored runs that tests/sim/test_golden.py compares byte for byte.

    .venv/bin/python tests/data/golden/make_golden.py

Run it only when a change of the simulator's behaviour is intended, and say in the
commit which figures moved and why (``git diff tests/data/golden`` shows them).
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from typer.testing import CliRunner

from dspark_sim.cli import app

HERE = Path(__file__).resolve().parent
# name -> the `dspark-sim run` arguments (small, fast, and between them: an open and a
# closed loop, the default scheduler and MTP-1, chunked prefill with KV preemption)
RUNS = {
    "confidence-poisson": ["--policy", "confidence", "--qps", "200", "--num-requests", "300",
                           "--seed", "7"],
    "mtp1-closed-kv": ["--policy", "mtp1", "--max-concurrency", "24", "--num-requests", "120",
                       "--seed", "3", "--replicas", "1", "--prefill", "chunked",
                       "--kv-capacity-tokens", "20000", "--lengths", "lognormal:600:120:0.7"],
}


def run(name: str, out: Path) -> None:
    res = CliRunner().invoke(app, ["run", *RUNS[name], "--out", str(out)])
    if res.exit_code != 0:
        raise SystemExit(f"{name}: exit {res.exit_code}\n{res.output}")


def main() -> int:
    for name in RUNS:
        dst = HERE / name
        shutil.rmtree(dst, ignore_errors=True)
        dst.mkdir()
        run(name, dst / "run")
        shutil.move(dst / "run" / "summary.json", dst / "summary.json")
        shutil.rmtree(dst / "run")  # the parquet's hash and size are in the summary
        print(f"wrote {dst / 'summary.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

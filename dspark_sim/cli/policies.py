"""``dspark-sim policies``: every policy ``--policy`` accepts."""

from __future__ import annotations

from rich.padding import Padding
from rich.text import Text

from dspark_sim.cli.common import console
from dspark_sim.policies.registry import policy_rows


def policies_cmd() -> None:
    """List every verification policy --policy accepts: its grammar, what it does, its
    drafter and what it reads."""
    for row in policy_rows(markdown=False):
        name = row["policy"] + (" (default)" if row["default"] else "")
        if row["aliases"]:
            name += f"  also: {row['aliases']}"
        console.print(Text(name, style="bold"))
        console.print(Padding(Text(row["what it does"]), (0, 0, 0, 4)))
        console.print(Padding(Text(f"drafter {row['drafter']}, {row['kind']}; reads "
                                   f"{row['reads']}", style="dim"), (0, 0, 0, 4)))

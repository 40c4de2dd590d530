"""``python -m dspark_sim.cli``: the same app as the ``dspark-sim`` console script."""

from dspark_sim.cli import main

main()

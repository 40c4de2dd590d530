"""Console entry point; the typer app lives in ``dspark_sim.sim.cli``."""


def main() -> None:
    from dspark_sim.sim.cli import app

    app()

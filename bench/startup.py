"""CLI start-up: does ``corral`` cost little more than importing what a command needs?

Run: ``python -m bench.startup [-n 21]``

Each command runs ``-n`` times as a fresh process, the way a user types it (the
``corral`` script of this interpreter, stdout captured), against a migrated SQLite
store in a temporary directory and no broker. Beside each, in the same run, its
**baseline**: a fresh interpreter that only imports the third-party packages the
command needs. ``corral --help`` needs argparse; ``corral nodes list`` needs
SQLAlchemy's ORM, pydantic-settings (the settings), the SQLite driver and rich (its
table on a terminal). The figure is the ratio of the medians (and of the fastest
runs, less sensitive to a busy machine); the aim is at most 1.5. The rest of a
command's time is corral's own modules and its work (building the parser of every
command, one query): ``python -X importtime -m corral.cli nodes list`` shows where it
goes. ``tests/corral/cli/test_startup.py`` checks what the commands import.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from bench.options import add_counts

AIM = 1.5
ROOT = Path(__file__).resolve().parent.parent
CORRAL = Path(sys.executable).with_name("corral")
# command line -> what a fresh interpreter imports to stand for what the command needs
COMMANDS = {
    "corral --help": "import argparse",
    "corral nodes list": "import sqlalchemy.orm, pydantic_settings, sqlite3, rich.table",
}


@dataclass(frozen=True)
class Runs:
    """Wall-clock seconds of repeated runs of one command line."""

    seconds: list[float]

    @property
    def median(self) -> float:
        """The median run."""
        return statistics.median(self.seconds)

    @property
    def fastest(self) -> float:
        """The fastest run."""
        return min(self.seconds)


def once(argv: list[str], env: dict[str, str], cwd: Path) -> float:
    """Seconds one run of ``argv`` took; it must succeed."""
    started = time.perf_counter()
    done = subprocess.run(argv, env=env, cwd=cwd, capture_output=True, timeout=60)
    took = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed: {done.stderr.decode()[-500:]}")
    return took


def timed(
    command: list[str], base: list[str], n: int, env: dict[str, str], cwd: Path
) -> tuple[Runs, Runs]:
    """``n`` runs of a command and of its baseline, taking turns so both meet the same load."""
    once(command, env, cwd)  # warm the page cache and the bytecode
    once(base, env, cwd)
    pairs = [(once(command, env, cwd), once(base, env, cwd)) for _ in range(n)]
    return Runs([c for c, _ in pairs]), Runs([b for _, b in pairs])


def main(argv: list[str] | None = None) -> int:
    """Time each command against its baseline and print the ratios; 1 if an aim is missed."""
    parser = argparse.ArgumentParser(prog="python -m bench.startup", description=__doc__)
    add_counts(parser, {"-n": (21, "runs of each command line and of its baseline, taking turns")})
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="corral-bench-startup-") as tmp:
        env = {k: v for k, v in os.environ.items() if not k.startswith("CORRAL_")}
        env.update(
            CORRAL_STATE_DIR=f"{tmp}/state",
            CORRAL_BROKER_URL="redis://127.0.0.1:1/0",
            CORRAL_DATABASE_URL=f"sqlite:///{tmp}/corral.sqlite",
            PYTHONPATH=str(ROOT),
        )
        subprocess.run(
            [str(CORRAL), "db", "upgrade"],
            env=env,
            cwd=tmp,
            check=True,
            capture_output=True,
            timeout=120,
        )
        print(
            f"{'command':<20} {'median':>8} {'fastest':>8} {'baseline':>9} "
            f"{'(fastest)':>9} {'ratio':>6} {'(fastest)':>9}"
        )
        met = True
        for line, needs in COMMANDS.items():
            command, base = timed(
                [str(CORRAL), *line.split()[1:]],
                [sys.executable, "-c", needs],
                args.n,
                env,
                Path(tmp),
            )
            ratio, fastest = command.median / base.median, command.fastest / base.fastest
            met &= ratio <= AIM
            print(
                f"{line:<20} {command.median * 1000:6.0f}ms {command.fastest * 1000:6.0f}ms "
                f"{base.median * 1000:7.0f}ms {base.fastest * 1000:7.0f}ms "
                f"{ratio:6.2f} {fastest:9.2f}  {'met' if ratio <= AIM else 'MISSED'}"
                f" (aim <= {AIM})"
            )
        load = os.getloadavg()[0]
        print(f"{args.n} runs each; load average {load:.1f}")
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())

"""``python -m bench.keepalive`` as a user runs it: its figures, with and without a plot.

The benchmark runs as its own process (tests never import bench/); its replay is tested
in tests/workers/autoscale/test_keepalive_replay.py.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# the benchmark's main, with matplotlib made unimportable first (as if not installed)
WITHOUT_MATPLOTLIB = (
    "import sys; sys.modules['matplotlib'] = None; "
    "from bench.keepalive import main; sys.exit(main(sys.argv[1:]))"
)


def _run(*args: str, without_matplotlib: bool = False) -> subprocess.CompletedProcess[str]:
    head = ["-c", WITHOUT_MATPLOTLIB] if without_matplotlib else ["-m", "bench.keepalive"]
    return subprocess.run(
        [sys.executable, *head, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_it_prints_its_figures_without_matplotlib(tmp_path: Path) -> None:
    png = tmp_path / "k.png"
    done = _run("--apps", "30", "--days", "1", "--plot", str(png), without_matplotlib=True)
    assert done.returncode == 0, done.stderr
    for policy in ("fixed 10 min", "fixed 20 min", "adaptive"):
        assert policy in done.stdout
    assert "cold starts p75" in done.stdout and "idle replica-h" in done.stdout
    assert "no plot: matplotlib is not installed" in done.stdout and not png.exists()


def test_it_writes_a_plot_when_matplotlib_is_there(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    png = tmp_path / "k.png"
    done = _run("--apps", "20", "--days", "1", "--plot", str(png))
    assert done.returncode == 0, done.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"plot written to {png}" in done.stdout


def test_bad_options_are_refused() -> None:
    done = _run("--apps", "0")
    assert done.returncode == 2 and "--apps must be at least 1" in done.stderr

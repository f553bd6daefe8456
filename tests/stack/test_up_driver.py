"""``corral up --driver qemu``: the stack's fcdaemon agent runs QEMU microVMs; the default
stays processes."""

from __future__ import annotations

from pathlib import Path

from corral.cli.parser import build_parser
from stack.up import UpOptions, _fcdaemon_driver


def test_the_default_stack_runs_replicas_as_processes(tmp_path: Path) -> None:
    args = build_parser(["up"]).parse_args(["up"])
    assert args.driver == "process" and UpOptions(tmp_path).driver == "process"
    assert _fcdaemon_driver("process", tmp_path)[0] == ["--driver", "process"]


def test_the_qemu_stack_keeps_its_vms_records_in_its_state_directory(tmp_path: Path) -> None:
    args = build_parser(["up"]).parse_args(["up", "--driver", "qemu"])
    assert args.driver == "qemu"
    argv, wait = _fcdaemon_driver("qemu", tmp_path)
    # a restarted stack's agent finds (and adopts) the VMs a killed one left
    assert argv == ["--driver", "qemu", "--qemu-state", str(tmp_path / "qemu")]
    assert wait > 30  # its first start may fetch the kernel and probe KVM

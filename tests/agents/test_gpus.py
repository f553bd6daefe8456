"""The reference GPU inventory server over real gRPC."""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

import grpc
import pytest
from google.protobuf import empty_pb2

from agents import Fault, serve_gpus
from agents.gpus import main, parse_gpus, query_nvidia_smi
from protos import gpuresc_grpc

pytestmark = pytest.mark.timeout(20)

GPUS = {"GPU-8f3c0c1e-aaaa-bbbb-cccc-000000000001": 16160, "GPU-2": 8000}


def test_get_gpu_resource_returns_the_map() -> None:
    with serve_gpus(gpus=GPUS) as running:
        stub = gpuresc_grpc.GPURescStub(grpc.insecure_channel(running.address))
        assert dict(stub.GetGPUResource(empty_pb2.Empty(), timeout=5).memory) == GPUS
        running.agent.gpus["GPU-3"] = 4000
        assert dict(stub.GetGPUResource(empty_pb2.Empty(), timeout=5).memory) == {
            **GPUS,
            "GPU-3": 4000,
        }
        running.agent.inject("GetGPUResource", Fault.abort(grpc.StatusCode.UNAVAILABLE, "down"))
        with pytest.raises(grpc.RpcError) as err:
            stub.GetGPUResource(empty_pb2.Empty(), timeout=5)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert len(running.agent.calls) == 3


def test_parse_gpus() -> None:
    assert parse_gpus("GPU-a:100, GPU-b:200") == {"GPU-a": 100, "GPU-b": 200}
    for bad, why in (
        ("", "no GPUs given"),
        ("GPU-a", "expected UUID:MB, got 'GPU-a'"),
        ("GPU-a:x", "expected UUID:MB, got 'GPU-a:x'"),
        ("GPU-a:1,GPU-a:2", "GPU GPU-a listed twice"),
        (":5", "expected UUID:MB, got ':5'"),
    ):
        with pytest.raises(ValueError, match=re.escape(why)):
            parse_gpus(bad)


def test_nvidia_smi_output_is_parsed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\necho 'GPU-aaa, 16160'\necho 'GPU-bbb, 8192'\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    assert query_nvidia_smi() == {"GPU-aaa": 16160, "GPU-bbb": 8192}


def test_main_without_gpus_or_nvidia_smi_fails_clearly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    caplog.set_level(logging.ERROR)
    assert main(["--listen", "127.0.0.1:0"]) == 2
    assert "nvidia-smi not found" in caplog.text

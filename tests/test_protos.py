"""The generated protocol modules match the ``.proto`` files and keep the seed's wire tags."""

from __future__ import annotations

import subprocess
import sys

from protos import fcdaemon_pb2, resmngr_pb2


def test_generated_modules_match_the_proto_files() -> None:
    run = subprocess.run(
        [sys.executable, "-m", "protos.generate", "--check"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr


def test_wire_tags_are_the_seeds() -> None:
    fields = {f.name: f.number for f in fcdaemon_pb2.CreateRequest.DESCRIPTOR.fields}
    assert fields["kernelImagePath"] == 4 and fields["awsSecretAccessKey"] == 11
    assert fields["numReplica"] == 15 and fields["initrdPath"] == 17
    status = resmngr_pb2.StatusUpdateRequest.DESCRIPTOR.fields_by_name["status"]
    assert status.number == 2

"""One table picks the backend of each kind of node; an unknown kind is a clear error."""

from __future__ import annotations

import pytest

from workers.backends import BACKENDS, backend
from workers.backends.fcdaemon import FcdaemonBackend
from workers.backends.lambdo import LambdoBackend
from workers.base.errors import InputError
from workers.base.kinds import NodeKind


def test_every_node_kind_has_its_backend_in_the_table() -> None:
    assert set(BACKENDS) == set(NodeKind)
    for kind in NodeKind:
        assert backend(kind).kind is kind
        assert backend(kind.value) is backend(kind)  # the stored string picks the same one
    assert isinstance(backend(NodeKind.FCDAEMON), FcdaemonBackend)
    assert isinstance(backend(NodeKind.LAMBDO), LambdoBackend)


def test_an_unknown_kind_names_the_known_ones() -> None:
    with pytest.raises(InputError, match=r"unknown node kind 'gpus'; use one of fcdaemon, lambdo"):
        backend("gpus")


@pytest.mark.parametrize(
    ("kind", "address", "canonical"),
    [
        (NodeKind.FCDAEMON, "10.0.0.5", "10.0.0.5:50051"),
        (NodeKind.FCDAEMON, "[fe80::2]:7000", "[fe80::2]:7000"),
        (NodeKind.LAMBDO, "http://10.0.0.5:3000/", "http://10.0.0.5:3000"),
        (NodeKind.LAMBDO, "https://[::1]:3000", "https://[::1]:3000"),
        (NodeKind.FCDAEMON, "[::1]", "[::1]:50051"),
        (NodeKind.FCDAEMON, "node_1:7000", "node_1:7000"),
        (NodeKind.LAMBDO, "HTTP://10.0.0.5:3000/", "http://10.0.0.5:3000"),
    ],
)
def test_each_backend_writes_its_addresses_one_way(
    kind: NodeKind, address: str, canonical: str
) -> None:
    assert backend(kind).normalize_address(address) == canonical


@pytest.mark.parametrize(
    ("kind", "address"),
    [
        (NodeKind.FCDAEMON, "http://10.0.0.5:3000"),
        (NodeKind.FCDAEMON, "h:0"),
        (NodeKind.LAMBDO, "10.0.0.5:3000"),
        (NodeKind.LAMBDO, "ftp://h:1"),
        (NodeKind.FCDAEMON, "::1"),  # IPv6 in brackets
        (NodeKind.FCDAEMON, "[10.0.0.5]:7000"),
        (NodeKind.FCDAEMON, "h:65536"),
        (NodeKind.LAMBDO, "http://h:3000/path"),
        (NodeKind.LAMBDO, "http://user:pw@h:3000"),
    ],
)
def test_an_address_of_the_wrong_shape_is_refused(kind: NodeKind, address: str) -> None:
    with pytest.raises(InputError, match="invalid"):
        backend(kind).normalize_address(address)

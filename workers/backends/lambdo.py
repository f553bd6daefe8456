"""The Lambdo backend: Lambdo hosts, ``POST /spawn`` and ``DELETE /destroy/{id}`` over HTTP.

:class:`LambdoBackend` is the :class:`~workers.backends.base.NodeBackend` for Lambdo
hosts; :class:`LambdoClient` its one client, on one ``httpx.AsyncClient`` per process
living on the process's event loop (:mod:`workers.backends.inflight`, which makes it
anew after a fork). Synchronous callers run a call on that loop (``inflight.run``).

Every call has a total deadline and a capped body (:mod:`workers.backends.http_calls`);
answers map to :mod:`workers.base.errors`: connection trouble, timeouts and 5xx are retryable
(a 500's plain-text body becomes the error message), 4xx are permanent, 404 on destroy
means the VM is already gone. ``GET /vms`` is an extension some hosts serve; a 404
there raises :class:`Unsupported`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import httpx

from config.redact import redact
from config.settings import Settings, reveal
from netplumb.addresses import HTTP_PORTS, host_of, parse_url
from workers.backends import inflight
from workers.backends.base import (
    DEFAULT_GUEST_PORT,
    CreateCall,
    Created,
    ListedVm,
    NodeBackend,
    Target,
)
from workers.backends.http_calls import HttpCall, abounded_request
from workers.base.errors import (
    InputError,
    PermanentBackendError,
    TransientBackendError,
    Unsupported,
)
from workers.base.kinds import NodeKind
from workers.base.untrusted import check_vmid, vmid_path, warn_plaintext
from workers.store.models import Function

MAX_ERROR_TEXT = 500


@dataclass(frozen=True)
class SpawnedVm:
    """What a Lambdo host answered to /spawn."""

    vmid: str
    port_mapping: dict[int, int]  # guest port -> host port


@dataclass(frozen=True)
class HostVm:
    """One VM a Lambdo host reports through ``GET /vms``."""

    vmid: str
    port_mapping: dict[int, int]
    created_unix: float


def _text(response: httpx.Response, secrets: tuple[str, ...] = ()) -> str:
    """An error body for a message: one line, the call's secrets masked, at most 500 chars."""
    body = redact(response.text.strip().replace("\n", " "), secrets)
    return body[:MAX_ERROR_TEXT] or response.reason_phrase


def _parse_mapping(raw: Any) -> dict[int, int]:
    """``[[hostPort, guestPort], ...]`` (any order) as {guest: host}."""
    if not isinstance(raw, list):
        raise ValueError("port_mapping is not a list")
    mapping: dict[int, int] = {}
    for pair in raw:
        if (
            not isinstance(pair, list | tuple)
            or len(pair) != 2
            or not all(isinstance(p, int) and 0 < p < 65536 for p in pair)
        ):
            raise ValueError(f"bad port_mapping entry {pair!r}")
        host, guest = pair
        mapping[guest] = host
    return mapping


async def _close_http(resources: dict[str, Any]) -> None:
    client = resources.get("http")
    if client is not None:
        await client.aclose()


inflight.on_reset(_close_http)


def _http() -> httpx.AsyncClient:
    """This process's HTTP client (made on the loop on first use)."""
    return inflight.resource(
        "http",
        lambda: httpx.AsyncClient(
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=100),
            trust_env=False,
        ),
    )


class LambdoClient:
    """Calls to one Lambdo host on this process's event loop, each with a deadline and
    typed errors (make it anywhere; call it from coroutines on the loop)."""

    def __init__(
        self,
        base_url: str,
        *,
        node: str | None = None,
        timeout_s: float = 10.0,
        token: str | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.node = node or base_url
        self.timeout_s = timeout_s
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._secrets = (token,) if token else ()
        if token and not self.base_url.startswith("https://"):
            warn_plaintext(host_of(self.base_url), "the Lambdo token")

    async def _request(self, method: str, path: str, what: str, **kwargs: Any) -> httpx.Response:
        call = HttpCall(
            method, self.base_url + path, self.timeout_s, what, self.node, secrets=self._secrets
        )
        response = await abounded_request(_http(), call, headers=self._headers, **kwargs)
        if response.status_code >= 500:
            raise TransientBackendError(  # the host answered: it says nothing was done
                f"{what} answered {response.status_code}: {_text(response, self._secrets)}",
                node=self.node,
                code=str(response.status_code),
                nothing_done=True,
            )
        return response

    async def spawn(self, rootfs_id: str, location: str, ports: list[int]) -> SpawnedVm:
        """Start a VM from a rootfs image with the requested guest ports."""
        body = {"rootfs": {"id": rootfs_id, "location": location}, "requestedPorts": ports}
        response = await self._request("POST", "/spawn", "spawn", json=body)
        if response.status_code != 200:
            raise PermanentBackendError(
                f"spawn answered {response.status_code}: {_text(response, self._secrets)}",
                node=self.node,
                code=str(response.status_code),
            )
        try:
            data = response.json()
            vmid = check_vmid(data["id"], self.node)
            mapping = _parse_mapping(data["port_mapping"])
        except (ValueError, KeyError, TypeError) as exc:
            raise PermanentBackendError(
                f"spawn answered an unreadable body ({redact(str(exc), self._secrets)}): "
                f"{_text(response, self._secrets)[:100]}",
                node=self.node,
            ) from None
        return SpawnedVm(vmid=vmid, port_mapping=mapping)

    async def destroy(self, vmid: str) -> bool:
        """Destroy a VM; False when the host says it is already gone (404)."""
        response = await self._request("DELETE", f"/destroy/{vmid_path(vmid)}", "destroy")
        if response.status_code == 404:
            return False
        if response.status_code not in (200, 204):
            raise PermanentBackendError(
                f"destroy answered {response.status_code}: {_text(response, self._secrets)}",
                node=self.node,
                code=str(response.status_code),
            )
        return True

    async def list_vms(self) -> list[HostVm]:
        """The VMs the host runs (``GET /vms`` extension)."""
        response = await self._request("GET", "/vms", "list")
        if response.status_code in (404, 405):
            raise Unsupported("host has no GET /vms", node=self.node, code="404")
        if response.status_code != 200:
            raise PermanentBackendError(
                f"list answered {response.status_code}: {_text(response, self._secrets)}",
                node=self.node,
            )
        try:
            return [
                HostVm(
                    vmid=str(vm["id"]),
                    port_mapping=_parse_mapping(vm.get("port_mapping", [])),
                    created_unix=float(vm.get("created_unix", 0.0)),
                )
                for vm in response.json()["vms"]
            ]
        except (ValueError, KeyError, TypeError) as exc:
            raise PermanentBackendError(f"list answered an unreadable body ({exc})") from None

    async def probe(self) -> None:
        """Raise unless the host answers HTTP at all (any status below 500)."""
        await self._request("GET", "/vms", "probe")


def client(t: Target, settings: Settings) -> LambdoClient:
    """The client for host ``t`` with the settings' deadline and token."""
    return LambdoClient(
        t.address,
        node=t.name,
        timeout_s=settings.lambdo_timeout_s,
        token=reveal(settings.lambdo_token),
    )


def rootfs_id(fn: Function) -> str:
    """Lambdo's image id: ``<function id>_<build version>``, new on every deploy."""
    return f"{fn.id}_{fn.build_version}"


class LambdoBackend(NodeBackend):
    """Lambdo hosts over HTTP."""

    kind = NodeKind.LAMBDO
    keyed_creates = False  # /spawn takes no request id
    runs_hogs = False
    on_node_network = False  # a replica is a host port on the host itself

    def normalize_address(self, address: str) -> str:
        """``http://HOST:PORT`` (no trailing slash)."""
        try:
            url = parse_url(address, HTTP_PORTS, "Lambdo host address", bare=True)
        except ValueError as exc:
            raise InputError(str(exc)) from None
        return f"{url.scheme}://{address.strip().split('://', 1)[1].rstrip('/')}"

    def image_of_rootfs(self, rootfs: str | None) -> str:
        """The rootfs: on a Lambdo host a function's rootfs is its image."""
        return rootfs or ""

    def check_function(self, values: Mapping[str, Any]) -> None:
        """A replica boots the function's rootfs: it needs one."""
        if not values["rootfs"]:
            raise InputError("a lambdo function needs --rootfs URL")

    def create_request(self, fn: Function, request_id: str, settings: Settings) -> Any:
        """(rootfs id, location, guest ports): ``/spawn`` keeps no request id."""
        ports = [int(p) for p in fn.ports] or [DEFAULT_GUEST_PORT]
        return (rootfs_id(fn), fn.rootfs or fn.image, ports)

    async def create(self, call: CreateCall, settings: Settings) -> Created:
        """``POST /spawn``; the replica is the host port mapped to the guest port, on the host."""
        t = call.target
        spawned = await client(t, settings).spawn(*call.request)
        port = spawned.port_mapping.get(call.guest_port)
        if port is None:
            raise PermanentBackendError(
                f"spawn mapped no host port to guest port {call.guest_port}", node=t.name
            )
        return Created(spawned.vmid, host_of(t.address), port)

    async def release(self, t: Target, vmid: str, settings: Settings) -> bool:
        """``DELETE /destroy/{id}``; False on 404."""
        return await client(t, settings).destroy(vmid)

    async def list_vms(self, t: Target, settings: Settings) -> list[ListedVm]:
        """``GET /vms`` (extension); a Lambdo host keeps no request ids."""
        return [ListedVm(v.vmid, "", v.created_unix) for v in await client(t, settings).list_vms()]

    async def probe(self, t: Target, settings: Settings) -> bool:
        """Any HTTP answer below 500."""
        await client(t, settings).probe()
        return True

    async def hogs(self, t: Target, action: str, n: int, settings: Settings) -> None:
        """A Lambdo host runs no hogs."""
        raise Unsupported("a Lambdo host runs no CPU hogs", node=t.name)

"""Client for Lambdo hosts: ``POST /spawn`` and ``DELETE /destroy/{id}`` over HTTP.

One :class:`httpx.Client` per process (recreated after a fork), a timeout on every
call, and answers mapped to :mod:`workers.errors`: connection trouble, timeouts
and 5xx are retryable (a 500's plain-text body becomes the error message), 4xx
are permanent, 404 on destroy means the VM is already gone. ``GET /vms`` is an
extension some hosts serve; a 404 there raises :class:`Unsupported`.

The batch paths use :class:`AsyncLambdoClient`: the same calls, checks and
limits on one ``httpx.AsyncClient`` per process, living on the process's event
loop (:mod:`workers.backends.inflight`).
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import Any

import httpx

from config.redact import redact
from workers.backends import inflight
from workers.backends.http_calls import (
    DeadlineTransport,
    HttpCall,
    abounded_request,
    bounded_request,
)
from workers.errors import (
    PermanentBackendError,
    TransientBackendError,
    Unsupported,
)
from workers.untrusted import check_vmid, vmid_path, warn_plaintext

MAX_ERROR_TEXT = 500

_client: httpx.Client | None = None
_client_pid = -1
_client_lock = threading.Lock()


def http_client() -> httpx.Client:
    """This process's shared HTTP client."""
    global _client, _client_pid
    with _client_lock:
        if _client is None or _client_pid != os.getpid():
            limits = httpx.Limits(max_connections=100)
            _client = httpx.Client(
                transport=DeadlineTransport(limits=limits, trust_env=False), trust_env=False
            )
            _client_pid = os.getpid()
        return _client


def reset_client() -> None:
    """Drop this process's HTTP client (after fork, at shutdown)."""
    global _client, _client_pid
    with _client_lock:
        if _client is not None and _client_pid == os.getpid():
            _client.close()
        _client = None
        _client_pid = -1


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


class LambdoClient:
    """Calls to one Lambdo host, each with a timeout and typed errors."""

    def __init__(
        self, base_url: str, *, node: str | None = None, timeout_s: float = 10.0,
        token: str | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.node = node or base_url
        self.timeout_s = timeout_s
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._secrets = (token,) if token else ()
        if token and not self.base_url.startswith("https://"):
            warn_plaintext(httpx.URL(self.base_url).host, "the Lambdo token")

    def _request(self, method: str, path: str, what: str, **kwargs: Any) -> httpx.Response:
        response = bounded_request(
            http_client(), self._call(method, path, what), headers=self._headers, **kwargs
        )
        return self._checked(response, what)

    def _call(self, method: str, path: str, what: str) -> HttpCall:
        return HttpCall(method, self.base_url + path, self.timeout_s, what, self.node,
                        secrets=self._secrets)

    def _checked(self, response: httpx.Response, what: str) -> httpx.Response:
        if response.status_code >= 500:
            raise TransientBackendError(  # the host answered: it says nothing was done
                f"{what} answered {response.status_code}: {_text(response, self._secrets)}",
                node=self.node,
                code=str(response.status_code),
                nothing_done=True,
            )
        return response

    @staticmethod
    def spawn_body(rootfs_id: str, location: str, ports: list[int]) -> dict[str, Any]:
        """The ``/spawn`` request body."""
        return {"rootfs": {"id": rootfs_id, "location": location}, "requestedPorts": ports}

    def spawn(self, rootfs_id: str, location: str, ports: list[int]) -> SpawnedVm:
        """Start a VM from a rootfs image with the requested guest ports."""
        body = self.spawn_body(rootfs_id, location, ports)
        return self.spawned(self._request("POST", "/spawn", "spawn", json=body))

    def spawned(self, response: httpx.Response) -> SpawnedVm:
        """The VM a ``/spawn`` answer describes (its vmid checked), or the error it is."""
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

    def destroy(self, vmid: str) -> bool:
        """Destroy a VM; False when the host says it is already gone (404)."""
        return self.destroyed(self._request("DELETE", f"/destroy/{vmid_path(vmid)}", "destroy"))

    def destroyed(self, response: httpx.Response) -> bool:
        """Whether a ``/destroy`` answer means the VM was destroyed (False: already gone)."""
        if response.status_code == 404:
            return False
        if response.status_code not in (200, 204):
            raise PermanentBackendError(
                f"destroy answered {response.status_code}: {_text(response, self._secrets)}",
                node=self.node,
                code=str(response.status_code),
            )
        return True

    def list_vms(self) -> list[HostVm]:
        """The VMs the host runs (``GET /vms`` extension)."""
        response = self._request("GET", "/vms", "list")
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

    def probe(self) -> None:
        """Raise unless the host answers HTTP at all (any status below 500)."""
        self._request("GET", "/vms", "probe")



async def _close_http(resources: dict[str, Any]) -> None:
    client = resources.get("http")
    if client is not None:
        await client.aclose()


inflight.on_reset(_close_http)


class AsyncLambdoClient(LambdoClient):
    """``/spawn`` and ``/destroy`` on this process's ``httpx.AsyncClient`` (on its loop)."""

    async def _arequest(self, method: str, path: str, what: str, **kwargs: Any) -> httpx.Response:
        client = inflight.resource("http", lambda: httpx.AsyncClient(
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=100),
            trust_env=False))
        response = await abounded_request(
            client, self._call(method, path, what), headers=self._headers, **kwargs
        )
        return self._checked(response, what)

    async def aspawn(self, rootfs_id: str, location: str, ports: list[int]) -> SpawnedVm:
        """Start a VM from a rootfs image with the requested guest ports."""
        body = self.spawn_body(rootfs_id, location, ports)
        return self.spawned(await self._arequest("POST", "/spawn", "spawn", json=body))

    async def adestroy(self, vmid: str) -> bool:
        """Destroy a VM; False when the host says it is already gone (404)."""
        return self.destroyed(
            await self._arequest("DELETE", f"/destroy/{vmid_path(vmid)}", "destroy"))

"""Reference Lambdo host: the Lambdo HTTP API over a VM driver.

A Lambdo host runs VMs from rootfs images and maps guest ports to host ports. This
server speaks the API corral's workers (and grobuzin before them) use:

* ``POST /spawn`` ``{"rootfs": {"id", "location"}, "requestedPorts": [u16]}`` ->
  200 ``{"id": "<uuid>", "port_mapping": [[hostPort, guestPort], ...]}``. The pairs
  come in no particular order (shuffled by default, as a hash map would give them).
* ``DELETE /destroy/{id}`` -> 204; 404 for an unknown id.
* ``POST /start`` with a full VM description (``kernel``, ``initrd``, ``bootArgs``,
  ``disks``, ``portMapping`` ``[[host, guest], ...]``; host 0 means "pick one") ->
  answered like ``/spawn``.
* Errors: a malformed body gets 400, anything else 500, always with a plain-text body.

corral's extensions, ignored by a real Lambdo client: ``GET /vms`` lists the VMs
(``{"vms": [{"id", "port_mapping", "rootfs_id", "created_unix"}]}``), an optional
``requestId`` in a spawn/start body makes the call idempotent, an optional ``env``
object passes environment to the function, and an optional bearer token guards every
endpoint (401 without it).

Which image runs (with :class:`~agents.drivers.ProcessDriver`): ``rootfs.image`` if
present, else ``rootfs.location`` when it is a Python module name (``examples.hello``),
else the host's ``default_image`` - a real object-store URL such as
``…/functions/<uuid>/rootfs.ext4`` cannot be run by a process driver. Only modules of
the driver's allow-list run (``examples.*`` and ``--allow-image MODULE``); any other
image, and any command line, is refused with 400 and nothing runs. The process
listens on the host port of the first requested guest port. Host ports come from
10000-19999.

Serving: an ASGI application on uvicorn behind :mod:`netplumb.asgiserve`'s bounds
(:data:`LIMITS`); the token is checked on a request's head, its body (at most 1 MiB,
within 30 s) is read only then; driver calls run in a pool of 64 threads.

For tests, :class:`LambdoAgent` records calls and takes scripted faults per path kind
(``spawn``, ``destroy``, ``start``, ``vms``), see :mod:`agents.faults`.

Command line: ``corral agent lambdo`` / ``python -m agents.lambdo``.
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import json
import logging
import os
import random
import threading
import urllib.parse
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal

from agents import drivers, runtime
from agents.faults import Fault, FaultHooks, record_call
from netplumb import asgiserve
from netplumb.addresses import split_hostport
from netplumb.asgiserve import Receive, Scope, Send

__all__ = [
    "DEFAULT_PORT_RANGE",
    "PATH_KINDS",
    "BadRequest",
    "LambdoAgent",
    "RunningLambdo",
    "main",
    "serve_lambdo",
]

log = logging.getLogger("agents.lambdo")  # not __name__: also right under -m

DEFAULT_PORT_RANGE = (10000, 19999)
PATH_KINDS = ("spawn", "destroy", "start", "vms")
MAX_BODY = 1 << 20

PortOrder = Literal["shuffle", "request", "reverse"]


class BadRequest(ValueError):
    """The request body is malformed (answered 400)."""


@dataclass(frozen=True)
class Response:
    """A complete HTTP answer."""

    status: int
    body: bytes = b""
    content_type: str = "text/plain; charset=utf-8"

    @classmethod
    def json(cls, status: int, payload: object) -> Response:
        """A JSON answer."""
        return cls(status, json.dumps(payload).encode(), "application/json")

    @classmethod
    def text(cls, status: int, text: str) -> Response:
        """A plain-text answer (errors), newline-terminated."""
        return cls(status, (text.rstrip("\n") + "\n").encode())


def _port(value: object, what: str, allow_zero: bool = False) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise BadRequest(f"{what} must be an integer, got {value!r}")
    if not (0 if allow_zero else 1) <= value <= 65535:
        raise BadRequest(f"{what} {value} is not a valid port")
    return value


def _obj(body: object, what: str = "body") -> dict[str, Any]:
    if not isinstance(body, dict):
        raise BadRequest(f"{what} must be a JSON object")
    return body


def _str(obj: dict[str, Any], key: str, what: str, required: bool = True) -> str:
    value = obj.get(key)
    if value is None and not required:
        return ""
    if not isinstance(value, str) or (required and not value):
        raise BadRequest(f"{what}.{key} must be a non-empty string")
    return value


def _env(obj: dict[str, Any]) -> dict[str, str]:
    env = obj.get("env")
    if env is None:
        return {}
    if not isinstance(env, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in env.items()
    ):
        raise BadRequest("env must be an object of strings")
    return dict(env)


def _is_runnable_location(location: str) -> bool:
    """True when a rootfs location names a Python module (the driver checks its allow-list)."""
    try:
        drivers.check_module_name(location.removesuffix(":latest"))
    except ValueError:
        return False
    return True


class LambdoAgent(FaultHooks):
    """The Lambdo API's logic over a driver, independent of the HTTP server."""

    def __init__(
        self,
        driver: drivers.VMDriver,
        *,
        token: str | None = None,
        default_image: str = "examples.hello",
        port_order: PortOrder = "shuffle",
    ) -> None:
        """``port_order`` fixes the order of ``port_mapping`` pairs (tests of clients)."""
        self.driver = driver
        self.token = token
        self.default_image = default_image
        self.port_order: PortOrder = port_order
        #: ``calls`` holds every authorised request, in order: (path kind, parsed JSON body,
        #: raw bytes if it was not JSON, the vm id for ``destroy``, None for ``vms``).
        super().__init__(PATH_KINDS)
        self._rootfs: dict[str, str] = {}
        self._by_request: dict[str, str] = {}
        self._lock = threading.Lock()
        self._creating = runtime.KeyedLock()  # one create per requestId; other ids side by side

    def authorized(self, header: str | None) -> bool:
        """True if no token is configured or ``header`` is ``Bearer <token>``."""
        if not self.token:
            return True
        if not header:
            return False
        scheme, _, value = header.partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(
            value.strip().encode(), self.token.encode()
        )

    # -- operations ---------------------------------------------------------------------

    def _mapping(self, vm: drivers.VM) -> list[list[int]]:
        pairs = [[h, g] for h, g in vm.port_mapping]
        if self.port_order == "shuffle":
            random.shuffle(pairs)
        elif self.port_order == "reverse":
            pairs.reverse()
        return pairs

    def _answer(self, vm: drivers.VM) -> Response:
        return Response.json(200, {"id": vm.vmid, "port_mapping": self._mapping(vm)})

    def _create(self, spec: drivers.VMSpec, rootfs_id: str) -> Response:
        rid = spec.request_id
        with self._creating.hold(rid or ""):
            if rid:
                with self._lock:
                    vmid = self._by_request.get(rid)
                if vmid is not None:
                    vm = next((v for v in self.driver.list() if v.vmid == vmid), None)
                    if vm is not None:
                        return self._answer(vm)
            try:
                vm = self.driver.start(spec)
            except drivers.BadSpec as exc:  # bad input (image, env): retrying cannot help
                return Response.text(400, f"refused: {exc}")
            except drivers.DriverError as exc:
                return Response.text(500, str(exc))
            with self._lock:
                self._rootfs[vm.vmid] = rootfs_id
                if rid:
                    self._by_request[rid] = vm.vmid
        log.info("spawned %s (rootfs %s) ports %s", vm.vmid, rootfs_id, vm.port_mapping)
        return self._answer(vm)

    def spawn(self, body: object) -> Response:
        """``POST /spawn``: start a VM from a rootfs with the requested guest ports."""
        obj = _obj(body)
        rootfs = _obj(obj.get("rootfs"), "rootfs")
        rootfs_id = _str(rootfs, "id", "rootfs")
        location = _str(rootfs, "location", "rootfs")
        image = _str(rootfs, "image", "rootfs", required=False)
        ports = obj.get("requestedPorts", [])
        if not isinstance(ports, list):
            raise BadRequest("requestedPorts must be a list of ports")
        guest = [_port(p, "requested port") for p in ports] or [8080]
        if len(set(guest)) != len(guest):
            raise BadRequest(f"requestedPorts has duplicates: {guest}")
        if not image:
            image = location if _is_runnable_location(location) else self.default_image
        spec = drivers.VMSpec(
            image=image,
            env=_env(obj),
            guest_port=guest[0],
            extra_guest_ports=tuple(guest[1:]),
            request_id=_str(obj, "requestId", "body", required=False),
            vmid=str(uuid.uuid4()),
        )
        return self._create(spec, rootfs_id)

    def start(self, body: object) -> Response:
        """``POST /start``: start a VM from a full description; answered like spawn."""
        obj = _obj(body)
        kernel = _str(obj, "kernel", "body", required=False)
        initrd = _str(obj, "initrd", "body", required=False)
        boot_args = _str(obj, "bootArgs", "body", required=False)
        disks = obj.get("disks", [])
        if not isinstance(disks, list):
            raise BadRequest("disks must be a list")
        image = _str(obj, "image", "body", required=False)
        rootfs_id = ""
        for disk in disks:
            if isinstance(disk, str):
                path = disk
            elif isinstance(disk, dict):
                path = disk.get("image") or disk.get("path") or disk.get("location") or ""
                rootfs_id = rootfs_id or str(disk.get("id") or "")
                if not isinstance(path, str):
                    raise BadRequest("disk path must be a string")
            else:
                raise BadRequest("each disk must be a string or an object")
            if not image and path and _is_runnable_location(path):
                image = path
            rootfs_id = rootfs_id or path
        mapping = obj.get("portMapping", obj.get("port_mapping", []))
        if not isinstance(mapping, list):
            raise BadRequest("portMapping must be a list of [hostPort, guestPort]")
        pairs: list[tuple[int, int]] = []
        for pair in mapping:
            if not isinstance(pair, list | tuple) or len(pair) != 2:
                raise BadRequest("portMapping entries must be [hostPort, guestPort]")
            pairs.append((_port(pair[0], "host port", True), _port(pair[1], "guest port")))
        if not pairs:
            pairs = [(0, 8080)]
        guest = [g for _, g in pairs]
        if len(set(guest)) != len(guest):
            raise BadRequest(f"portMapping has duplicate guest ports: {guest}")
        spec = drivers.VMSpec(
            image=image or self.default_image,
            kernel=kernel,
            initrd=initrd,
            kernel_args=boot_args,
            env=_env(obj),
            guest_port=guest[0],
            extra_guest_ports=tuple(guest[1:]),
            host_ports={g: h for h, g in pairs if h},
            request_id=_str(obj, "requestId", "body", required=False),
            vmid=str(uuid.uuid4()),
        )
        return self._create(spec, rootfs_id or kernel)

    def destroy(self, vmid: str) -> Response:
        """``DELETE /destroy/{id}``: 204, or 404 if unknown."""
        try:
            stopped = self.driver.stop(vmid)
        except drivers.DriverError as exc:
            return Response.text(500, f"cannot destroy {vmid}: {exc}")
        with self._lock:
            self._rootfs.pop(vmid, None)
            for rid in [r for r, v in self._by_request.items() if v == vmid]:
                del self._by_request[rid]
        if not stopped:
            return Response.text(404, f"unknown vm {vmid}")
        log.info("destroyed %s", vmid)
        return Response(204)

    def vms(self) -> Response:
        """``GET /vms`` (extension): the VMs running now."""
        # Listing under the lock: a create records its VM under the lock only after the
        # driver has it, so a VM missing from this list cannot be one being created.
        with self._lock:
            vms = self.driver.list()
            live = {vm.vmid for vm in vms}
            # Forget VMs that died on their own.
            for vmid in [v for v in self._rootfs if v not in live]:
                del self._rootfs[vmid]
            for rid in [r for r, v in self._by_request.items() if v not in live]:
                del self._by_request[rid]
            rootfs = dict(self._rootfs)
        return Response.json(
            200,
            {
                "vms": [
                    {
                        "id": vm.vmid,
                        "port_mapping": [[h, g] for h, g in vm.port_mapping],
                        "rootfs_id": rootfs.get(vm.vmid, ""),
                        "created_unix": vm.created_unix,
                    }
                    for vm in vms
                ]
            },
        )


# -- serving ------------------------------------------------------------------------------

#: What the host allows a caller before its token is checked (netplumb.asgiserve): 64
#: connections, 48 from one address, 16 of them before they have shown the token.
LIMITS = asgiserve.Limits(
    max_connections=64,
    per_peer=48,
    anonymous_per_peer=16,
    head_bytes=32 * 1024,
    head_timeout_s=10.0,
)
BODY_TIMEOUT_S = 30.0  # a body, once the caller is authorised, must be in within this
CALL_THREADS = 64  # calls to the driver at once (a create waits for its VM to answer)


class _Site:
    """The Lambdo HTTP API over a :class:`LambdoAgent`, as an ASGI application."""

    def __init__(self, agent: LambdoAgent, pool: ThreadPoolExecutor) -> None:
        self.agent = agent
        self.pool = pool

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """One request: the token is checked on its head; its body is read only then."""
        if scope["type"] != "http":
            return
        agent = self.agent
        if not agent.authorized(_header(scope, b"authorization")):  # its body is never read
            await _send(send, Response.text(401, "missing or wrong bearer token"), close=True)
            return
        asgiserve.authenticated(scope)  # its connection no longer counts as anonymous
        body = await _read_body(scope, receive)
        if isinstance(body, Response):
            await _send(send, body, close=True)
            return
        method, path = scope["method"], scope["raw_path"].decode("latin-1")
        route = _route(method, path)
        if isinstance(route, Response):
            await _send(send, route)
            return
        kind, vmid = route
        parsed, bad_json = _parse_json(body) if kind in ("spawn", "start") else (None, None)
        payload = vmid if kind == "destroy" else (body if bad_json else parsed)
        record_call(agent.calls, kind, payload)
        fault = agent.faults.take(kind)
        if fault is not None:
            log.info("%s: injected fault %s", kind, fault.kind)
            if fault.kind == "hangup":
                await asgiserve.hang_up(scope, receive)
                return
            if fault.kind == "delay" and fault.until is not None:
                await asyncio.to_thread(fault.wait)
            elif fault.kind == "delay":
                await asyncio.sleep(fault.seconds)
            elif fault.kind in ("abort", "reply"):
                await _send(send, _faulty(fault))
                return
        if bad_json is not None:
            resp = Response.text(400, bad_json)
        else:
            loop = asyncio.get_running_loop()
            resp = await loop.run_in_executor(self.pool, self._answer, kind, parsed, vmid)
        if resp.status >= 400:
            text = resp.body.decode(errors="replace").strip()
            log.info("%s %s -> %d %s", method, path, resp.status, text)
        await _send(send, resp)

    def _answer(self, kind: str, parsed: object, vmid: str) -> Response:
        """The agent's answer to one routed call; a 400 for bad input, a 500 for a bug."""
        agent = self.agent
        try:
            if kind == "spawn":
                return agent.spawn(parsed)
            if kind == "start":
                return agent.start(parsed)
            if kind == "destroy":
                return agent.destroy(vmid)
            return agent.vms()
        except BadRequest as exc:
            return Response.text(400, str(exc))
        except Exception as exc:
            log.exception("%s failed", kind)
            return Response.text(500, f"{type(exc).__name__}: {exc}")


def _faulty(fault: Fault) -> Response:
    """The answer an ``abort`` or ``reply`` fault scripts."""
    if fault.kind == "abort":
        status = fault.code if isinstance(fault.code, int) else 500
        return Response.text(status, fault.message or "injected")
    status = fault.code if isinstance(fault.code, int) else 200
    body = fault.value if isinstance(fault.value, bytes) else b""
    return Response(status, body, fault.content_type)


def _header(scope: Scope, name: bytes) -> str | None:
    """The first value of a request header (``name`` in lower case), or None."""
    for key, value in scope["headers"]:
        if key == name:
            return str(value.decode("latin-1"))
    return None


async def _read_body(scope: Scope, receive: Receive) -> bytes | Response:
    """The body (asked for only once the caller is authorised), within MAX_BODY and in time."""
    if "chunked" in (_header(scope, b"transfer-encoding") or "").lower():
        return Response.text(411, "chunked bodies are not supported; send Content-Length")
    try:
        length = int(_header(scope, b"content-length") or 0)
    except ValueError:
        return Response.text(400, "bad Content-Length")
    if length > MAX_BODY or length < 0:
        return Response.text(413, f"body larger than {MAX_BODY} bytes")
    chunks: list[bytes] = []
    try:
        async with asyncio.timeout(BODY_TIMEOUT_S):
            while length:
                message = await receive()
                chunks.append(message.get("body", b""))
                if message["type"] == "http.disconnect" or not message.get("more_body"):
                    break
    except TimeoutError:
        return Response.text(408, f"body not received within {BODY_TIMEOUT_S:g}s")
    body = b"".join(chunks)
    if len(body) < length:  # the caller hung up
        return Response.text(400, "incomplete body")
    return body


async def _send(send: Send, resp: Response, *, close: bool = False) -> None:
    """Answer; ``close``: and close the connection (a body left unread)."""
    headers = [(b"server", b"corral-lambdo/1")]
    if resp.status == 401:
        headers.append((b"www-authenticate", b'Bearer realm="lambdo"'))
    if resp.status != 204:
        headers.append((b"content-type", resp.content_type.encode()))
    body = resp.body if resp.status != 204 else b""
    headers.append((b"content-length", str(len(body)).encode()))
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": resp.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def _route(method: str, raw_path: str) -> tuple[str, str] | Response:
    """The path kind (and vm id) a request is for, or the answer when there is none."""
    path = raw_path.split("?", 1)[0]
    if path == "/spawn":
        return ("spawn", "") if method == "POST" else Response.text(405, "use POST")
    if path == "/start":
        return ("start", "") if method == "POST" else Response.text(405, "use POST")
    if path == "/vms":
        return ("vms", "") if method == "GET" else Response.text(405, "use GET")
    if path.startswith("/destroy/"):
        vmid = urllib.parse.unquote(path[len("/destroy/") :])  # corral percent-encodes it
        if method != "DELETE":
            return Response.text(405, "use DELETE")
        if not vmid or "/" in vmid:
            return Response.text(404, "not found")
        return ("destroy", vmid)
    return Response.text(404, f"no route {method} {path}")


def _parse_json(body: bytes) -> tuple[object, str | None]:
    """The body parsed as JSON, or None and why it is not JSON."""
    try:
        return json.loads(body), None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        return None, f"body is not JSON: {exc}"


class RunningLambdo(runtime.Running):
    """A Lambdo host serving in a background thread; ``stop()`` tears everything down."""

    def __init__(
        self,
        server: asgiserve.BackgroundServer,
        host: str,
        agent: LambdoAgent,
        driver: drivers.VMDriver,
        pool: ThreadPoolExecutor,
    ) -> None:
        """Wrap the parts built by :func:`serve_lambdo`, which started serving."""
        super().__init__(host, server.port)
        self.server = server
        #: Base URL for a local client, e.g. ``http://127.0.0.1:3000``.
        self.url = f"http://{self.address}"
        self.agent = agent
        self.driver = driver
        self._pool = pool

    def _shutdown(self, grace: float) -> None:
        """Stop serving and stop every VM."""
        self.server.stop(grace + 5)
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.driver.close()
        log.info("lambdo on port %d stopped", self.port)


def serve_lambdo(  # noqa: PLR0913 - a server's options, by name with defaults
    listen: str = "127.0.0.1:0",
    driver: drivers.VMDriver | None = None,
    token: str | None = None,
    *,
    default_image: str = "examples.hello",
    port_order: PortOrder = "shuffle",
    limits: asgiserve.Limits = LIMITS,
) -> RunningLambdo:
    """Start a Lambdo host on ``listen`` (default driver: MemoryDriver over 10000-19999)."""
    host, port = split_hostport(listen)
    driver = driver if driver is not None else drivers.MemoryDriver(port_range=DEFAULT_PORT_RANGE)
    agent = LambdoAgent(driver, token=token, default_image=default_image, port_order=port_order)
    bind = host or "0.0.0.0"  # noqa: S104 - --listen without a host; off loopback needs the token
    try:
        sock = asgiserve.bind(bind, port)
    except OSError as exc:  # said as the gRPC agents say it (netplumb.grpcserve)
        raise OSError(f"cannot listen on {bind}:{port}: {exc.strerror or exc}") from None
    pool = ThreadPoolExecutor(CALL_THREADS, thread_name_prefix="lambdo-call")
    try:
        server = asgiserve.start(
            _Site(agent, pool), sock, limits, name="lambdo", timeout_graceful_shutdown=1
        )
    except BaseException:
        pool.shutdown(wait=False)
        raise
    running = RunningLambdo(server, host, agent, driver, pool)
    log.info("lambdo listening on %s:%d", bind, running.port)
    return running


def build_parser() -> argparse.ArgumentParser:
    """The ``corral agent lambdo`` argument parser."""
    parser = argparse.ArgumentParser(
        prog="corral agent lambdo",
        description="Reference Lambdo-compatible host (HTTP /spawn, /destroy/{id}, /start).",
    )
    runtime.add_common_arguments(parser, "127.0.0.1:3000", "--token")
    drivers.add_driver_arguments(
        parser,
        DEFAULT_PORT_RANGE,
        vms="VMs",
        port_help="host ports for VMs",
        image_source="rootfs.image",
    )
    parser.add_argument("--advertise-ip", help="IP reported for VMs (default: listen host)")
    parser.add_argument(
        "--token",
        default=os.environ.get("CORRAL_LAMBDO_TOKEN") or None,
        help="require Authorization: Bearer TOKEN (default $CORRAL_LAMBDO_TOKEN)",
    )
    parser.add_argument(
        "--default-image",
        default="examples.hello",
        help="image run when a rootfs names no runnable (default %(default)s)",
    )
    return parser


def serve_from_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """Run the Lambdo host its command line describes until SIGINT/SIGTERM; the exit code."""
    driver = drivers.driver_from_args(
        parser,
        args,
        lambda: drivers.MemoryDriver(port_range=args.port_range),
        advertise_ip=args.advertise_ip,
        ready_timeout=10.0,
    )
    return runtime.serve_until_signalled(
        lambda: serve_lambdo(
            args.listen, driver=driver, token=args.token, default_image=args.default_image
        ),
        on_failure=driver.close,
    )


main = runtime.agent_main(build_parser, "token", "CORRAL_LAMBDO_TOKEN", serve_from_args)

if __name__ == "__main__":
    raise SystemExit(main())

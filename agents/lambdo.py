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

For tests, :class:`LambdoAgent` records calls and takes scripted faults per path kind
(``spawn``, ``destroy``, ``start``, ``vms``), see :mod:`agents.faults`.

Command line: ``corral agent lambdo`` / ``python -m agents.lambdo``.
"""

from __future__ import annotations

import argparse
import hmac
import json
import logging
import os
import random
import socket
import sys
import threading
import time
import urllib.parse
import uuid
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Literal

from agents import drivers, runtime
from agents.faults import FaultHooks, record_call
from netplumb.addresses import split_hostport
from netplumb.httpserve import BoundedHandler, BoundedServer

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


class _Handler(BoundedHandler, BaseHTTPRequestHandler):
    """Routes requests to the server's :class:`LambdoAgent` (bounded: :mod:`netplumb.httpserve`)."""

    protocol_version = "HTTP/1.1"
    server_version = "corral-lambdo/1"
    agent: LambdoAgent  # set on the per-server subclass

    def log_message(self, format: str, *args: object) -> None:
        """Route access logs to ``logging`` at DEBUG."""
        log.debug("%s %s", self.address_string(), format % args)

    def _send(self, resp: Response) -> None:
        self.send_response(resp.status)
        if resp.status == 401:
            self.send_header("WWW-Authenticate", 'Bearer realm="lambdo"')
        if resp.status != 204:
            self.send_header("Content-Type", resp.content_type)
        self.send_header("Content-Length", str(len(resp.body) if resp.status != 204 else 0))
        if self.close_connection:  # say so: a client must not send its next request here
            self.send_header("Connection", "close")
        self.end_headers()
        if resp.status != 204 and self.command != "HEAD":
            self.wfile.write(resp.body)

    def _read_body(self) -> bytes | Response:
        """The body (asked for only once the caller is authorised), within MAX_BODY."""
        if "chunked" in (self.headers.get("Transfer-Encoding") or "").lower():
            self.close_connection = True
            return Response.text(411, "chunked bodies are not supported; send Content-Length")
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            self.close_connection = True
            return Response.text(400, "bad Content-Length")
        if length > MAX_BODY or length < 0:
            self.close_connection = True
            return Response.text(413, f"body larger than {MAX_BODY} bytes")
        if length <= 0:
            return b""
        self.allow_body(length)
        body: bytes = self.rfile.read(length)
        self.request_read()
        if len(body) < length:  # the caller hung up or its deadline passed
            self.close_connection = True
            return Response.text(400, "incomplete body")
        return body

    def _route(self) -> tuple[str, str] | Response:
        path = self.path.split("?", 1)[0]
        method = self.command
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

    def _handle(self) -> None:
        self.request_read()  # the head is in; a body is read only for an authorised caller
        agent = self.agent
        if not agent.authorized(self.headers.get("Authorization")):
            self.close_connection = True  # its body, if any, is never read
            self._send(Response.text(401, "missing or wrong bearer token"))
            self.linger(self.wfile)
            return
        body = self._read_body()
        if isinstance(body, Response):
            self._send(body)
            return
        route = self._route()
        if isinstance(route, Response):
            self._send(route)
            return
        kind, vmid = route
        parsed, bad_json = _parse_json(body) if kind in ("spawn", "start") else (None, None)
        payload = vmid if kind == "destroy" else (body if bad_json else parsed)
        record_call(agent.calls, kind, payload)
        if self._fault(kind):
            return
        resp = (
            Response.text(400, bad_json)
            if bad_json is not None
            else self._answer(kind, parsed, vmid)
        )
        if resp.status >= 400:
            log.info(
                "%s %s -> %d %s",
                self.command,
                self.path,
                resp.status,
                resp.body.decode(errors="replace").strip(),
            )
        self._send(resp)

    def _fault(self, kind: str) -> bool:
        """Play the fault injected for ``kind``, if any; True when it answered (or hung up)."""
        fault = self.agent.faults.take(kind)
        if fault is None:
            return False
        log.info("%s: injected fault %s", kind, fault.kind)
        if fault.kind == "delay":
            time.sleep(fault.seconds)
            return False
        if fault.kind == "hangup":
            self.close_connection = True
        elif fault.kind == "abort":
            status = fault.code if isinstance(fault.code, int) else 500
            self._send(Response.text(status, fault.message or "injected"))
        elif fault.kind == "reply":
            status = fault.code if isinstance(fault.code, int) else 200
            body = fault.value if isinstance(fault.value, bytes) else b""
            self._send(Response(status, body, fault.content_type))
        else:
            return False
        return True

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

    do_GET = do_POST = do_DELETE = do_PUT = do_PATCH = _handle


def _parse_json(body: bytes) -> tuple[object, str | None]:
    """The body parsed as JSON, or None and why it is not JSON."""
    try:
        return json.loads(body), None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        return None, f"body is not JSON: {exc}"


class _LambdoServer(BoundedServer, ThreadingHTTPServer):
    """Threaded HTTP server (a daemon thread per connection, at most 64), IPv4 or IPv6."""

    request_queue_size = 128

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler]) -> None:
        """Bind ``address``; a host with ``:`` selects IPv6."""
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        super().__init__(address, handler)

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A caller that hung up before its answer is a log line, not a traceback on stderr."""
        if isinstance(sys.exc_info()[1], ConnectionError):  # BrokenPipe, ConnectionReset...
            log.info("client %s went away before its answer was sent", client_address)
            return
        super().handle_error(request, client_address)


class RunningLambdo(runtime.Running):
    """A Lambdo host serving in a background thread; ``stop()`` tears everything down."""

    def __init__(
        self, server: ThreadingHTTPServer, host: str, agent: LambdoAgent, driver: drivers.VMDriver
    ) -> None:
        """Wrap the parts built by :func:`serve_lambdo` and start serving."""
        super().__init__(host, server.server_address[1])
        self.server = server
        #: Base URL for a local client, e.g. ``http://127.0.0.1:3000``.
        self.url = f"http://{self.address}"
        self.agent = agent
        self.driver = driver
        self._thread = threading.Thread(
            target=server.serve_forever,
            kwargs={"poll_interval": 0.1},
            name=f"lambdo-{self.port}",
            daemon=True,
        )
        self._thread.start()

    def _shutdown(self, grace: float) -> None:
        """Stop serving and stop every VM."""
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(timeout=5)
        self.driver.close()
        log.info("lambdo on port %d stopped", self.port)


def serve_lambdo(
    listen: str = "127.0.0.1:0",
    driver: drivers.VMDriver | None = None,
    token: str | None = None,
    *,
    default_image: str = "examples.hello",
    port_order: PortOrder = "shuffle",
) -> RunningLambdo:
    """Start a Lambdo host on ``listen`` (default driver: MemoryDriver over 10000-19999)."""
    host, port = split_hostport(listen)
    driver = driver if driver is not None else drivers.MemoryDriver(port_range=DEFAULT_PORT_RANGE)
    agent = LambdoAgent(driver, token=token, default_image=default_image, port_order=port_order)
    handler = type("LambdoHandler", (_Handler,), {"agent": agent})
    bind = host or "0.0.0.0"  # noqa: S104 - --listen without a host; off loopback needs the token
    server = _LambdoServer((bind, port), handler)
    running = RunningLambdo(server, host, agent, driver)
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

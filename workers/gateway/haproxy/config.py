"""HAProxy's configuration, written from the gateway's settings: what is fixed at its start.

Everything that changes while it runs - which function a backend serves, its servers,
their ``maxconn`` - is programmed over the runtime socket (:mod:`.runtime`), never by a
reload. What is fixed is written here, once:

* **global**: the runtime socket (``mode 600``, level admin) in a private directory
  (:class:`.layout.Layout`, ``0700``), one thread by default, the buffer that bounds every head
  (``tune.bufsize``: the largest head the settings allow, plus HAProxy's room to rewrite),
  the header lines of a head (``tune.http.maxhdr``), the Lua actions that drop the
  headers a replica's ``Connection:`` names and scope its cookies.
* **the frontend** on the socket the gateway bound (``bind fd@0``: the port is the
  gateway's, kept across a restart of HAProxy). With a token, a ``/function/`` request
  without it is answered 401 here (the token compared as a SHA-256 digest, so the
  comparison leaks nothing of it), its body never read. A request is *warm* - sent to
  the function's backend - only when it is plain: a function with a backend in the map
  (``functions.map``: name -> backend), no ``Transfer-Encoding``, ``Upgrade``,
  ``Expect``, ``Connection`` naming a header, no second ``Authorization``,
  ``X-Forwarded-*``, ``Content-Length`` or ``Host`` line, and a body, if any, within
  ``CORRAL_GATEWAY_MAX_BODY`` and wholly in HAProxy's buffer before a replica is picked
  (``wait-for-body``, as long as ``CORRAL_GATEWAY_BODY_MIN_RATE`` after its grace
  allows: :func:`body_waits`; 408 past it). Anything else goes to the
  activator (the Python gateway, on a unix socket), untouched but for ``x-corral-peer``
  (the caller's address) and ``x-corral-host`` (its ``Host``).
* **the pool of backends** ``b0`` .. ``bN-1`` (``CORRAL_GATEWAY_WARM_FUNCTIONS``), each
  empty until a function is given one: ``balance first`` over the servers (the replicas;
  the first fills before the next is used, so spare environments stay unused and go back
  to the store), and the activator as the backup server (``activator-bN``). When no
  replica server is usable, or all are busy and ``CORRAL_GATEWAY_WARM_QUEUE`` requests
  wait already (none, by default), ``use-server`` sends the request to the activator as
  it came. A warm request whose replica cannot be reached is sent to another (a refused
  connection carried nothing: any method may go again), else - rewritten already - to
  the backup activator, which knows it by the ``Host`` the backup's name gives it and
  serves it as the Python path would (:func:`workers.gateway.haproxy.warm.behind`).
  A warm request gets the gateway's forwarding rules
  (:mod:`workers.gateway.headers`): ``Authorization`` dropped when there is a token,
  ``X-Forwarded-For`` / ``-Proto`` / ``-Host`` set (kept and appended to from
  ``CORRAL_GATEWAY_TRUSTED_PROXIES`` only), ``Forwarded`` and ``X-Real-IP`` dropped from
  anyone else, the raw path after ``/function/NAME`` as the target and the replica's
  address as ``Host`` (the server's name: ``http-send-name-header``). Its answer loses
  its hop-by-hop headers, and each ``Set-Cookie`` is scoped to the function (a Lua
  action, as :func:`workers.gateway.headers.scoped_cookie` does).
* **per peer**: at most ``CORRAL_GATEWAY_MAX_CONNECTIONS_PER_PEER`` connections from
  one address (a stick table, trusted proxies exempt); one more is closed at once.

Timeouts follow the settings: a request head (and a warm body) within
``CORRAL_GATEWAY_READ_TIMEOUT_S`` (408), an answer's head within
``CORRAL_GATEWAY_TIMEOUT_S`` of the request (504: bytes of a head that is not complete
do not count as activity), a caller taking no part of its answer for
``CORRAL_GATEWAY_SEND_TIMEOUT_S`` (cut off), a place in a backend's queue within the
cold-start timeout (503 with ``Retry-After``).
"""

from __future__ import annotations

import hashlib

from config.settings import Settings, parse_networks, reveal
from workers.gateway.asgi import RETRY_AFTER_S
from workers.gateway.haproxy.layout import Layout

# The gateway's listening socket is HAProxy's stdin (:class:`.process.Process` passes it
# there, as inetd passes a socket). HAProxy refuses a listener whose descriptor is at or
# above its socket limit (about twice its maxconn), and the number the socket has in the
# gateway can be anything: a process holding hundreds of descriptors had it at 464.
LISTEN_FD = 0

PEER = "x-corral-peer"  # the caller's address, on a request HAProxy hands the activator
HOST = "x-corral-host"  # the caller's Host, likewise (the activator's own is its server name)
ACTIVATOR = "activator"  # the activator's own backend and server; activator-bN in backend bN
CLOSE = "x-corral-close"  # on an activator's answer that must close its caller's connection
MAX_REWRITE = 1024  # tune.maxrewrite: room HAProxy keeps in a buffer to add headers
MAX_HDR = 32767  # tune.http.maxhdr's ceiling
MAX_BODY_WAITS = 16  # size classes of a warm body's wait (body_waits)
KEEP_ALIVE_S = 30  # an idle kept-alive caller connection (the Python listener's too)
CONNECT_S = 5.0  # connecting to a replica

# Hop-by-hop headers of an answer that HAProxy's HTTP/1 layer leaves (it handles
# Connection and Transfer-Encoding itself): workers.gateway.headers.HOP_BY_HOP.
ANSWER_HOP_BY_HOP = (
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "proxy-connection",
    "te",
    "trailer",
    "trailers",
    "upgrade",
)

# Drops the headers an answer's Connection: names (run only when it has one).
LUA = """\
core.register_action("corral_strip_named", {"http-res"}, function(txn)
  local named = txn.http:res_get_headers()["connection"]
  if named == nil then return end
  for _, value in pairs(named) do
    for token in string.gmatch(value, "[^,%s]+") do
      local name = string.lower(token)
      if name ~= "close" and name ~= "keep-alive" then txn.http:res_del_header(name) end
    end
  end
end)

-- Scopes each Set-Cookie to the call's function, as workers.gateway.headers.scoped_cookie
-- does (run only when a replica's answer has one).
local function trim(text) return (string.gsub(text, "^%s*(.-)%s*$", "%1")) end

local function scoped(value, prefix)
  local kept, path, first = {}, prefix, true
  for part in string.gmatch(value .. ";", "([^;]*);") do
    if first then
      kept[#kept + 1] = part
      first = false
    else
      local name, given = string.match(part, "^([^=]*)=?(.*)$")
      name = string.lower(trim(name))
      if name == "path" then
        given = trim(given)
        if string.sub(given, 1, 1) == "/" and given ~= "/" then path = prefix .. given end
      elseif name ~= "domain" then
        kept[#kept + 1] = part
      end
    end
  end
  kept[#kept + 1] = " Path=" .. path
  return table.concat(kept, ";")
end

core.register_action("corral_scope_cookies", {"http-res"}, function(txn)
  local set = txn.http:res_get_headers()["set-cookie"]
  if set == nil then return end
  local prefix = "/function/" .. txn:get_var("txn.fn")
  local values = {}
  for i = 0, #set do values[#values + 1] = set[i] end
  txn.http:res_del_header("set-cookie")
  for _, value in ipairs(values) do txn.http:res_add_header("set-cookie", scoped(value, prefix)) end
end)
"""


def backend(index: int) -> str:
    """The name of the pool's backend number ``index``."""
    return f"b{index}"


def buffer_size(settings: Settings) -> int:
    """``tune.bufsize``: the largest head either way may have, and room to rewrite."""
    return max(settings.gateway_max_head_bytes, settings.gateway_answer_head_max) + MAX_REWRITE


def token_digest(settings: Settings) -> str | None:
    """The SHA-256 of the ``Authorization`` value callers must send, in upper-case hex."""
    token = reveal(settings.gateway_token)
    if not token:
        return None
    return hashlib.sha256(f"Bearer {token}".encode()).hexdigest().upper()


# HAProxy's own answers, plain text as the gateway's (workers.gateway.asgi.reply).
ERRORS = {
    400: ("Bad Request", "bad request (malformed, or its head over the limit)", {}),
    408: ("Request Timeout", "request not received in time", {}),
    502: ("Bad Gateway", "the replica's answer was refused or broken", {}),
    503: (
        "Service Unavailable",
        "no free environment of the function in time: try again",
        {"retry-after": str(RETRY_AFTER_S)},
    ),
    504: ("Gateway Timeout", "the replica did not answer in time", {}),
}


def error_answer(status: int) -> bytes:
    """The raw answer HAProxy gives with ``status`` (its connection closed)."""
    reason, message, extra = ERRORS[status]
    body = (message + "\n").encode()
    head = [
        f"HTTP/1.1 {status} {reason}",
        "content-type: text/plain; charset=utf-8",
        f"content-length: {len(body)}",
        *(f"{k}: {v}" for k, v in extra.items()),
        "connection: close",
    ]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


def write(settings: Settings, layout: Layout) -> None:
    """Write the configuration and the files it names (each ``0600``)."""
    files = {
        layout.config: render(settings, layout).encode(),
        layout.lua: LUA.encode(),
        layout.functions: b"",
        **{layout.error(status): error_answer(status) for status in ERRORS},
    }
    for path, data in files.items():
        path.touch(mode=0o600)
        path.write_bytes(data)


def _seconds(value: float) -> str:
    return f"{max(1, round(value * 1000))}ms"


def render(settings: Settings, layout: Layout) -> str:
    """The whole configuration."""
    lines = [
        *_global(settings, layout),
        *_defaults(settings, layout),
        *_frontend(settings, layout),
        "",
        f"backend {ACTIVATOR}",
        f"  timeout server {_seconds(_activator_timeout(settings))}",
        *_closing(),
        f"  server {ACTIVATOR} unix@{layout.activator}",
        *_relay(settings, layout),
        *_peers_table(settings),
    ]
    for index in range(settings.gateway_warm_functions):
        lines += ["", *_pool_backend(settings, layout, backend(index))]
    return "\n".join(lines) + "\n"


def _activator_timeout(settings: Settings) -> float:
    """How long the activator may take to start its answer: a cold start, then the call."""
    return settings.gateway_cold_start_timeout_s + settings.gateway_timeout_s + 10


def _global(settings: Settings, layout: Layout) -> list[str]:
    return [
        "global",
        f"  stats socket {layout.admin} mode 600 level admin",
        "  stats timeout 1m",
        f"  nbthread {settings.gateway_haproxy_threads}",
        # connections both ways: every caller may have one to a replica or the activator
        f"  maxconn {2 * settings.gateway_max_connections + 64}",
        f"  tune.bufsize {buffer_size(settings)}",
        f"  tune.maxrewrite {MAX_REWRITE}",
        f"  tune.http.maxhdr {min(settings.gateway_answer_head_lines, MAX_HDR)}",
        f"  lua-load {layout.lua}",
    ]


def _defaults(settings: Settings, layout: Layout) -> list[str]:
    return [
        "",
        "defaults",
        "  mode http",
        "  option http-keep-alive",
        "  option dontlognull",
        "  http-reuse always",
        f"  timeout connect {_seconds(min(CONNECT_S, settings.gateway_timeout_s))}",
        f"  timeout client {_seconds(settings.gateway_send_timeout_s)}",
        f"  timeout server {_seconds(settings.gateway_timeout_s)}",
        f"  timeout http-request {_seconds(settings.gateway_read_timeout_s)}",
        f"  timeout http-keep-alive {KEEP_ALIVE_S}s",
        f"  timeout queue {_seconds(max(0.001, settings.gateway_cold_start_timeout_s))}",
        *(f"  errorfile {status} {layout.error(status)}" for status in ERRORS),
    ]


# The statuses the activator closes its connection with (the body left unread), which
# HAProxy then answers itself: only its own answers close a caller still owing a body.
CLOSING = (400, 401, 404, 408, 413, 429, 500, 502, 503, 504)


def _closing() -> list[str]:
    """The activator's answers that close their connection close the caller's too.

    HAProxy keeps a caller's connection while the caller still owes its request's body
    (until it sends more, or its timeout), whatever the answer says, unless the answer is
    its own: such an answer (marked ``x-corral-close: <its message>``) is answered again
    by HAProxy, with the same status, message and ``Retry-After``, and the connection
    closes at once, as the gateway's own would.
    """
    said = "{ var(txn.said) -m found }"
    lines = [
        f"  http-response set-var(txn.said) res.hdr({CLOSE}) if {{ res.hdr({CLOSE}) -m found }}",
        f"  http-response set-var(txn.retry) res.hdr(retry-after) if {said}"
        " { res.hdr(retry-after) -m found }",
    ]
    text = 'content-type "text/plain; charset=utf-8" lf-string "%[var(txn.said)]\\n"'
    for status in CLOSING:
        extra = " hdr www-authenticate Bearer" if status == 401 else ""
        lines += [
            f"  http-response deny status {status} {text}{extra}"
            f' hdr retry-after "%[var(txn.retry)]" if {said} {{ status {status} }}'
            " { var(txn.retry) -m found }",
            f"  http-response deny status {status} {text}{extra} if {said} {{ status {status} }}",
        ]
    return lines


# Headers a warm request may not have (the activator forwards such requests by the
# gateway's rules), and those it may have once only: matched on the list of its header
# names (HAProxy keeps them in lower case) in one pass.
NOT_WARM = (
    "transfer-encoding|upgrade|expect|te|trailers?|keep-alive|proxy-connection"
    "|proxy-authenticate|proxy-authorization"
)
ONCE = "authorization|host|content-length|x-forwarded-for|x-forwarded-proto|x-forwarded-host"
ODD_NAMES = "|".join(
    [f"(^|,)({NOT_WARM})(,|$)", *(f"(^|,){h},(.*,)?{h}(,|$)" for h in ONCE.split("|"))]
)


def _frontend(settings: Settings, layout: Layout) -> list[str]:
    """The listener: the token, then warm (a function's backend) or not (the activator).

    Each test runs once, its outcome kept in a variable (an ACL named in several rules
    would be evaluated again in each): ``txn.be`` the function's backend, ``txn.cold``
    set when the request takes the activator.
    """
    digest = token_digest(settings)
    # a body HAProxy may hold whole: the limit, and what its buffer leaves after a head
    small = min(settings.gateway_max_body, buffer_size(settings) - MAX_REWRITE - 1024)
    waits = body_waits(settings, small)
    small = waits[-1][0] if waits else 0  # the largest body HAProxy waits for
    lines = [
        "",
        "frontend gateway",
        f"  bind fd@{LISTEN_FD}",
        f"  maxconn {settings.gateway_max_connections}",
        *_per_peer(settings),
        "  http-request del-header x-corral- -m beg",
        "  acl function path_beg /function/",
    ]
    if digest:
        lines += [
            f"  acl authed req.fhdr(authorization),digest(sha256),hex -m str {digest}",
            # answered here, its body never read: as the gateway does, before the function
            "  http-request deny status 401 content-type text/plain"
            ' string "missing or invalid gateway token" hdr www-authenticate Bearer'
            " if function !authed",
            "  http-request deny deny_status 401 if { path /metrics/haproxy } !authed",
        ]
    head = ""
    if settings.gateway_answer_head_max > settings.gateway_max_head_bytes:
        # the buffer holds heads larger than callers may send: the activator refuses them
        room = settings.gateway_max_head_bytes - 8192
        head = f" || {{ url,length gt 4096 }} || {{ req.hdrs,length gt {room} }}"
    lines += [
        "  http-request use-service prometheus-exporter if { path /metrics/haproxy }",
        # the function's backend, when it has one
        "  http-request set-var(txn.fn) path,field(3,/) if function",
        f"  http-request set-var(txn.be) var(txn.fn),map({layout.functions}) if function",
        "  acl warm var(txn.be) -m found",
        "  acl cold var(txn.cold) -m bool",
        # what only the activator forwards as the gateway's rules say
        "  http-request set-var(txn.cold) bool(1) if !warm"
        f" || {{ req.hdr_names -m reg {ODD_NAMES} }}"
        " || { req.hdr(connection) -m reg -i ^(?!(keep-alive|close)$) }"
        f" || {{ req.hdr_val(content-length) gt {small} }}{head}",
        # a body wholly in the buffer before a replica is picked: no environment waits on it
        "  http-request set-var(txn.size) req.hdr_val(content-length) if !cold",
        "  acl body var(txn.size) -m int gt 0",
        *_body_waits(waits),
        "  http-request set-var(txn.got) req.body_len if !cold body",
        "  http-request set-var(txn.cold) bool(1)"
        " if !cold body { var(txn.size),sub(txn.got) gt 0 }",
        # the activator learns the caller as HAProxy saw it
        f"  http-request set-header {PEER} %[src] if cold",
        f"  http-request set-header {HOST} %[req.fhdr(host,1)]"
        " if cold { req.hdr(host) -m found }",
        "  use_backend %[var(txn.be)] if !cold",
        f"  default_backend {ACTIVATOR}",
    ]
    return lines


PEERS = "peers"  # the stick table counting each peer address's connections


def _per_peer(settings: Settings) -> list[str]:
    """At most ``CORRAL_GATEWAY_MAX_CONNECTIONS_PER_PEER`` connections from one address.

    Each connection is tracked by its source address (``sc0``, in table :data:`PEERS`,
    for the connection's life) as it is accepted; one over the cap is closed at once,
    before HAProxy reads a byte of it. A trusted proxy speaks for many callers and
    counts toward the total only, as on the Python path. The table holds an entry for
    every connection the frontend may have, so none goes untracked.
    """
    networks = " ".join(str(n) for n in parse_networks(settings.gateway_trusted_proxies))
    unless = " if !{ src " + networks + " }" if networks else ""
    return [
        f"  tcp-request connection track-sc0 src table {PEERS}{unless}",
        "  tcp-request connection reject"
        f" if {{ sc0_conn_cur gt {settings.gateway_max_connections_per_peer} }}",
    ]


def _peers_table(settings: Settings) -> list[str]:
    return [
        "",
        f"backend {PEERS}",
        f"  stick-table type ipv6 size {settings.gateway_max_connections + 1024}"
        " expire 60s store conn_cur",
    ]


def body_waits(settings: Settings, small: int) -> list[tuple[int, float]]:
    """How long HAProxy waits for a warm body, by size: (largest size, seconds), ascending.

    The gateway's rule (:mod:`workers.gateway.bodies`): once its grace is over, a body
    must have come at ``CORRAL_GATEWAY_BODY_MIN_RATE`` on average. A body of ``size``
    at that rate is whole by ``size / rate`` (or the grace), so HAProxy waits that long,
    rounded up to the grace doubled as often as needed (at most twice the time the rule
    gives it); one not whole by then came slower than the rule allows, and HAProxy
    answers 408 as the gateway would. A body larger than the last size (whose wait
    would pass the read timeout, or than ``small``, what HAProxy may hold) is not warm.
    """
    rate = settings.gateway_body_min_rate
    wait = max(settings.gateway_body_grace_s, 0.001)
    waits: list[tuple[int, float]] = []
    while wait <= settings.gateway_read_timeout_s and len(waits) < MAX_BODY_WAITS:
        size = min(small, int(rate * wait))
        waits.append((size, wait))
        if size >= small:
            break
        wait *= 2
    return waits


def _body_waits(waits: list[tuple[int, float]]) -> list[str]:
    lines, least = [], 0
    for size, wait in waits:
        within = f" {{ var(txn.size) -m int gt {least} }}" if least else ""
        within += f" {{ var(txn.size) -m int le {size} }}" if size < waits[-1][0] else ""
        lines.append(f"  http-request wait-for-body time {_seconds(wait)} if !cold body{within}")
        least = size
    return lines


def backup(name: str) -> str:
    """The activator's server in backend ``name`` (also the ``Host`` a request to it gets)."""
    return f"{ACTIVATOR}-{name}"


def _relay(settings: Settings, layout: Layout) -> list[str]:
    """A listener of HAProxy's own between the backends and the activator.

    What a function's backend hands the activator (no room, or a replica that could not
    be reached) passes here, where the activator's closing answers are dealt with, so
    the warm path does not evaluate those rules.
    """
    return [
        "",
        "listen relay",
        f"  bind unix@{layout.relay} mode 600",
        f"  timeout server {_seconds(_activator_timeout(settings))}",
        *_closing(),
        f"  server {ACTIVATOR} unix@{layout.activator}",
    ]


def _pool_backend(settings: Settings, layout: Layout, name: str) -> list[str]:
    queue = settings.gateway_warm_queue
    lines = [
        f"backend {name}",
        "  balance first",
        # a call whose replica cannot be reached goes to another (any method: nothing was
        # sent). No L7 retry (retry-on empty-response) for one closed unanswered: HAProxy
        # 2.6 copies each request's whole buffer (tune.bufsize: 65 KiB) to keep it for a
        # retry, some 13-15 us a warm request (docs/security.md)
        "  retries 1",
        "  option redispatch 1",
        "  http-send-name-header host",  # the replica's own address (the server's name)
        # to the activator, as it came: no usable replica, or all busy and the queue long
        "  http-request set-var(txn.over) bool(1)"
        f" if {{ be_conn_free lt 0 }} || {{ be_conn_free eq 0 }} {{ queue ge {queue} }}",
        "  acl over var(txn.over) -m bool",
        f"  http-request set-header {PEER} %[src] if over",
        f"  http-request set-header {HOST} %[req.fhdr(host,1)]"
        " if over { req.hdr(host) -m found }",
        f"  http-request set-timeout server {_seconds(_activator_timeout(settings))} if over",
    ]
    if token_digest(settings):
        lines += ["  http-request del-header authorization if !over"]
    lines += _forwarded(settings)
    hop = "|".join(ANSWER_HOP_BY_HOP)
    lines += [
        "  http-request set-path /%[path,field(4,/,0)] if !over",
        f"  http-response del-header ^({hop})$ -m reg",
        "  http-response lua.corral_strip_named if { res.hdr(connection) -m found }",
        # (the activator's answers are its own: scoped already)
        "  http-response lua.corral_scope_cookies if { res.hdr(set-cookie) -m found }"
        f" !{{ srv_name -m beg {ACTIVATOR}- }}",
        f"  use-server {backup(name)} if over",
        f"  server {backup(name)} unix@{layout.relay} backup",
    ]
    return lines


def _forwarded(settings: Settings) -> list[str]:
    """X-Forwarded-*, Forwarded, X-Real-IP on a warm request, as the gateway sets them."""
    networks = " ".join(str(n) for n in parse_networks(settings.gateway_trusted_proxies))
    if not networks:
        return [
            "  http-request del-header ^(forwarded|x-real-ip|x-forwarded-host)$ -m reg if !over",
            "  http-request set-header x-forwarded-for %[src] if !over",
            "  http-request set-header x-forwarded-proto http if !over",
            "  http-request set-header x-forwarded-host %[req.fhdr(host,1)]"
            " if !over { req.hdr(host) -m found }",
        ]
    return [
        f"  acl trusted src {networks}",
        "  http-request del-header forwarded if !over !trusted",
        "  http-request del-header x-real-ip if !over !trusted",
        "  http-request set-var(txn.xff) req.fhdr(x-forwarded-for) if !over trusted",
        "  http-request set-var(txn.xfp) req.fhdr(x-forwarded-proto,1) if !over trusted",
        "  http-request set-var(txn.xfh) req.fhdr(x-forwarded-host,1) if !over trusted",
        "  http-request set-var(txn.xfh) req.fhdr(host,1) if !over !{ var(txn.xfh) -m found }",
        '  http-request set-header x-forwarded-for "%[var(txn.xff)], %[src]"'
        " if !over { var(txn.xff) -m found }",
        "  http-request set-header x-forwarded-for %[src] if !over !{ var(txn.xff) -m found }",
        "  http-request set-header x-forwarded-proto %[var(txn.xfp)]"
        " if !over { var(txn.xfp) -m found }",
        "  http-request set-header x-forwarded-proto http if !over !{ var(txn.xfp) -m found }",
        "  http-request set-header x-forwarded-host %[var(txn.xfh)]"
        " if !over { var(txn.xfh) -m found }",
        "  http-request del-header x-forwarded-host if !over !{ var(txn.xfh) -m found }",
    ]

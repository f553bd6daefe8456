"""The listening rule every corral server follows: nothing listens off loopback without a token.

The registry, the gateway, the metrics exporter and the reference agents each take a
listen address and a token from their settings or flags. :func:`listen_refusal` says
why a server must not start there (None: it may); :func:`listen_address` checks a
``HOST:PORT`` setting of a :class:`Server` and applies the rule; :func:`refuse_to_listen` prints the
refusal for a command line. ``--insecure`` overrides the rule, with a warning at every
start, for a private network the operator vouches for.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass

from netplumb.addresses import is_loopback, split_hostport

__all__ = ["Server", "listen_address", "listen_refusal", "refuse_to_listen"]


@dataclass(frozen=True)
class Server:
    """A server as the rule's messages name it, and the two settings that place it."""

    name: str  # "corral registry"
    listen_variable: str  # CORRAL_REGISTRY_LISTEN: where it listens
    token_variable: str  # CORRAL_REGISTRY_TOKEN: what lets it off loopback


def listen_refusal(
    what: str, host: str, token: str | None, variable: str, *, insecure: bool = False
) -> str | None:
    """Why ``what`` must not listen on ``host`` (None: it may); warns when ``insecure`` allows it.

    Off loopback a server needs a token (named by ``variable``); ``insecure`` accepts
    the risk and logs a warning each time.
    """
    if token or is_loopback(host):
        return None
    shown = host.strip("[]") or "0.0.0.0"  # noqa: S104 - a message
    if insecure:
        logging.getLogger("corral.security").warning(
            "%s listens on %s WITHOUT a token (--insecure): anyone who reaches this address "
            "can call it; set %s",
            what,
            shown,
            variable,
        )
        return None
    return (
        f"{what} refuses to listen on {shown} without a token: set {variable} "
        "(or listen on 127.0.0.1, or pass --insecure to accept the risk)"
    )


def listen_address(
    server: Server, address: str, token: str | None, *, insecure: bool = False
) -> tuple[str, int]:
    """Host and port ``server`` may listen on; ValueError naming the variable otherwise.

    A malformed address is named by the server's listen variable; off loopback without a
    token the message is :func:`listen_refusal`'s.
    """
    try:
        host, port = split_hostport(address)
    except ValueError as exc:
        raise ValueError(f"{server.listen_variable}: {exc}") from None
    refusal = listen_refusal(server.name, host, token, server.token_variable, insecure=insecure)
    if refusal is not None:
        raise ValueError(refusal)
    return host, port


def refuse_to_listen(
    prog: str, host: str, token: str | None, variable: str, insecure: bool
) -> bool:
    """Print the one-line refusal for a command line and return True if it must not start."""
    reason = listen_refusal(prog, host, token, variable, insecure=insecure)
    if reason is not None:
        print(f"{prog}: error: {reason}", file=sys.stderr)
    return reason is not None

"""The warm path's router without HAProxy: its commands are answered here, in order."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from config.settings import load_settings
from workers.gateway.haproxy.router import Router
from workers.gateway.lending import Lending
from workers.gateway.pool import Pool
from workers.replicas.claims import Claimed


def _claim(claim_id: str, replica_id: str) -> Claimed:
    return Claimed(
        claim_id, replica_id, "http://127.0.0.1:29451", "vm", "echo", datetime(2030, 1, 1)
    )


class _Ledger:
    """What :class:`Lending` needs of the ledger: its pools, and a claim given back."""

    def __init__(self) -> None:
        self.pools: dict[str, Pool] = {"echo": Pool()}
        self.lending = Lending(self)  # type: ignore[arg-type]
        self._unpooled: dict[str, bool] = {}
        self.released: list[str] = []

    def _release_soon(self, claims: list[Claimed]) -> None:
        self.released += [c.claim_id for c in claims]

    def give_back(self, claimed: Claimed) -> None:
        """As the ledger does with no request waiting: lent again, else kept in the pool."""
        if not self.lending.lend(claimed):
            self.pools[claimed.function].give(claimed)


def _answer(router: Router, starts: str) -> None:
    """HAProxy accepts the first command not yet answered that starts so."""
    commands: list[tuple[str, Any]] = router._early
    for index, (command, then) in enumerate(commands):
        if command.startswith(starts):
            del commands[index]
            if then is not None:
                then(None, 0.0)
            return
    raise AssertionError(f"no {starts!r} among {[c for c, _ in commands]}")


def test_a_claim_given_back_while_its_replicas_server_closed_is_lent_once_it_is_gone() -> None:
    """Seen under load: the server of the one replica closed (its environment asked back),
    the replica's claim came back meanwhile and stayed in the pool, and the function
    never returned to the warm path."""
    ledger = _Ledger()
    router = Router(load_settings(gateway_keep_s=30), ledger.lending, ["b0"], "functions.map")
    ledger.lending.lender = router
    assert router.lend(_claim("c1", "r1"))
    route = router.routes["echo"]
    server = route.servers["r1"]
    router.close_server(route, server, "return", why="its environments went back")
    ledger.give_back(_claim("c2", "r1"))  # a request of the Python path is done with it
    assert [c.claim_id for c, _ in ledger.pools["echo"].idle] == ["c2"]  # refused: closing

    router.drain(route, server, left_choice=True)
    router.delete(route, server)
    _answer(router, "del server b0/")  # gone from HAProxy: its claims go by their fates
    assert ledger.pools["echo"].idle == []
    again = router.routes["echo"].servers["r1"]
    assert again is not server and again.state == "ready"
    assert sorted(c.claim_id for c in again.claims) == ["c1", "c2"]
    assert ledger.released == []

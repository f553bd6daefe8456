"""nodes: endpoint (IP:port), unique: one node per address"""

from __future__ import annotations

import ipaddress
import logging
from urllib.parse import urlsplit

import sqlalchemy as sa
from alembic import op

revision, down_revision = "0009", "0008"

log = logging.getLogger("alembic.runtime.migration")
_SCHEME_PORTS = {"http": 80, "https": 443}
NAMED_ERROR = (
    "its address names a host, which corral no longer resolves (revision 0009): re-add it "
    "(`corral nodes add ADDRESS --name NAME` resolves a name once) or remove it"
)


def _endpoint(address: str) -> str | None:
    """``IP:PORT`` of a stored node address (``h:p`` or a URL); None for a host name.

    Written out here rather than imported: a revision keeps meaning what it meant.
    """
    url = urlsplit(address if "://" in address else f"//{address}")
    try:
        host, port = url.hostname or "", url.port or _SCHEME_PORTS.get(url.scheme)
        ip = ipaddress.ip_address(host)
    except ValueError:
        return None
    if port is None:
        return None
    mapped = ip.ipv4_mapped if isinstance(ip, ipaddress.IPv6Address) else None
    ip = mapped or ip
    return f"[{ip}]:{port}" if ip.version == 6 else f"{ip}:{port}"


def upgrade() -> None:
    bind = op.get_bind()
    nodes = sa.table(
        "nodes",
        sa.column("id"),
        sa.column("name"),
        sa.column("address"),
        sa.column("endpoint"),
        sa.column("healthy"),
        sa.column("last_error"),
    )
    # checked before anything changes: a refused upgrade leaves the schema as it was
    found: dict[str, tuple[str, str]] = {}  # endpoint -> (node id, name)
    named: list[str] = []  # ids of nodes stored at a host name
    rows = bind.execute(sa.select(nodes.c.id, nodes.c.name, nodes.c.address).order_by(nodes.c.name))
    for node_id, name, address in rows:
        endpoint = _endpoint(address)
        if endpoint is None:
            log.warning("node %s at %r: %s", name, address, NAMED_ERROR)
            named.append(node_id)
        elif endpoint in found:
            raise RuntimeError(
                f"nodes {found[endpoint][1]} and {name} are both at {endpoint}: one node per "
                "address from revision 0009; remove one (`corral nodes remove NAME`) and "
                "upgrade again"
            )
        else:
            found[endpoint] = (node_id, name)
    op.add_column("nodes", sa.Column("endpoint", sa.String(length=64), nullable=True))
    for endpoint, (node_id, _) in found.items():
        bind.execute(sa.update(nodes).where(nodes.c.id == node_id).values(endpoint=endpoint))
    if named:  # nothing is placed on them or listed from them; their replicas are left be
        bind.execute(
            sa.update(nodes)
            .where(nodes.c.id.in_(named))
            .values(healthy=False, last_error=NAMED_ERROR)
        )
    op.create_index("ux_nodes_endpoint", "nodes", ["endpoint"], unique=True)


def downgrade() -> None:
    op.drop_index("ux_nodes_endpoint", table_name="nodes")
    with op.batch_alter_table("nodes") as batch:
        batch.drop_column("endpoint")

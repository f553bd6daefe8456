"""The examples: Prometheus' config parses, and the dashboard asks only for metrics that exist."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml
from prometheus_client.parser import text_string_to_metric_families

from testkit import httpcalls
from tests.fixtures import Env
from workers.fleet.nodes import upsert_node
from workers.functions import deploy, spec_from
from workers.gateway.metrics import GatewayMetrics
from workers.observability.exporter import serve
from workers.store.models import Operation

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_prometheus_config_scrapes_the_exporter_and_the_gateway() -> None:
    config = yaml.safe_load((EXAMPLES / "prometheus.yml").read_text())
    targets = {
        job["job_name"]: job["static_configs"][0]["targets"] for job in config["scrape_configs"]
    }
    assert targets == {
        "corral-control-plane": ["127.0.0.1:9808"],
        "corral-gateway": ["127.0.0.1:8080"],
    }


def test_every_metric_the_dashboard_queries_exists(corral_env: Env) -> None:
    with corral_env.db.transaction() as s:  # one of each row, so every family has a sample
        deploy(s, spec_from(name="f", image="i", kernel="/k"), corral_env.settings)
        upsert_node(s, "127.0.0.1:1", name="n")
        s.add_all(
            [Operation(kind="spawn", status="pending"), Operation(kind="spawn", status="succeeded")]
        )
    running = serve(corral_env.db, None, "127.0.0.1:0")
    try:
        text = httpcalls.get(running.url, timeout=10).text
    finally:
        running.stop()
    exported = {s.name for f in text_string_to_metric_families(text) for s in f.samples}
    # metrics the exporter shows only once there is something to show (Redis, autoscaler)
    exported |= {
        "corral_reaped_total",
        "corral_queue_length",
        "corral_queue_unacked",
        "corral_autoscale_desired_replicas",
        "corral_autoscale_panic",
    }
    dashboard = json.loads((EXAMPLES / "grafana-dashboard.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    assert len(exprs) >= 15
    used = {m for e in exprs for m in re.findall(r"corral_[a-z_]+", e)}
    served = GatewayMetrics()  # what a gateway's /metrics shows once it has seen a request
    served.answered("f", 200, 0.01)
    served.cold_start("f", 0.5)
    served.load("f", 1, 0)
    served.stage("claim", 0.001)
    gateway = {
        s.name
        for f in text_string_to_metric_families(served.render()[0].decode())
        for s in f.samples
    }
    assert used - exported - gateway == set()
    assert used & exported and used & gateway  # both halves are on it

"""Every metric corral serves is defined once, in the metric catalog, as what it serves."""

from __future__ import annotations

import redis

from tests.fixtures import Env
from workers.gateway.metrics import GatewayMetrics
from workers.observability import metric_catalog as catalog
from workers.observability import stages
from workers.observability.exporter import StoreCollector


def test_names_are_unique_and_histograms_have_rising_buckets() -> None:
    specs = [v for v in vars(catalog).values() if isinstance(v, catalog.Spec)]
    assert len({s.name for s in specs}) == len(specs) == len(catalog.SPECS)
    for spec in specs:
        assert spec.name.startswith("corral_") and not spec.name.endswith("_total")
        if spec.kind == "histogram":
            assert spec.buckets and list(spec.buckets) == sorted(set(spec.buckets)), spec.name
        else:
            assert not spec.buckets, spec.name


def test_the_gateway_serves_its_metrics_as_the_catalog_defines_them() -> None:
    families = list(GatewayMetrics().registry.collect())
    assert len(families) == 9
    for family in families:
        spec = catalog.SPECS[family.name]
        assert (family.type, family.documentation) == (spec.kind, spec.help)


def test_the_exporter_serves_its_metrics_as_the_catalog_defines_them(
    corral_env: Env, redis_url: str
) -> None:
    families = list(StoreCollector(corral_env.db, redis.Redis.from_url(redis_url)).collect())
    for family in families:
        spec = catalog.SPECS[family.name]
        assert (family.type, family.documentation) == (spec.kind, spec.help)
    gateway = {f.name for f in GatewayMetrics().registry.collect()}
    exporter = {f.name for f in families}  # all of them, though the store holds nothing yet
    calls = {catalog.GATEWAY_CALLS.name, catalog.GATEWAY_CALL_ACCEPT_SECONDS.name}  # its routes'
    assert exporter | gateway | calls == set(catalog.SPECS)  # nothing in the catalog unserved
    assert exporter & gateway == {catalog.COLD_START_STAGE_SECONDS.name}


def test_one_stage_histogram_for_the_workers_and_the_gateway() -> None:
    assert stages.BUCKETS is catalog.COLD_START_STAGE_SECONDS.buckets
    assert catalog.COLD_START_STAGE_SECONDS.name == stages.METRIC

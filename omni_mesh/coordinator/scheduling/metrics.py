"""Prometheus metrics of the coordinator (`GET /metrics`), named by Prometheus' conventions.

Names are `omni_mesh_*`, with the base unit in the name (`_seconds`, `_bytes`) and counters ending in
`_total`; a counter never counts two kinds of thing (a connector's puts and its bytes are two metrics).
Connectors are labelled `connector` = their ref in the topology (`shm`, `auto_shm_0_1`) everywhere;
`omni_mesh_connector_info{connector, type}` maps a ref to its class. No `_created` series: their
timestamps double the series count and no query here uses them.

Events are counted where they happen: HTTP requests by the REST middleware, finished pipeline requests
(with each stage's queue wait, handler time and per-edge bytes, as the stages report them) by the
dispatcher. State (replicas, in-flight and queued work, restarts, the connectors' counters from the
stages' heartbeats) is read from the registry when Prometheus scrapes, so it is never stale.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from omni_mesh.coordinator.scheduling.request_state import RequestState
    from omni_mesh.coordinator.scheduling.service import Coordinator

__all__ = ["CONTENT_TYPE_LATEST", "Metrics"]

# Latency buckets from 1 ms to 2 min: a no-op hop is ~1 ms, a long generation takes minutes.
_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
# The numbers in connectors' `health()` reports that only ever grow (their `Counters` and the guards'
# refusals): exported as counters `omni_mesh_connector_<name>_total`, the rest as gauges. A key named
# here with a unit gets it in its name.
_CONNECTOR_COUNTERS = {
    "bytes_put": "put_bytes", "bytes_got": "got_bytes",
    **{name: name for name in (
        "puts", "gets", "errors", "expired", "cleaned", "deleted", "oneoff", "fallbacks", "put_failures",
        "inline_puts", "stale_gets", "unindexed_puts", "cuda_ipc_tensors", "zero_copy_leaves", "pool_grown",
        "pool_released", "local_gets", "device_tensors", "refused_peers", "malformed_requests", "bulk_transfers",
        "asked_again",
    )},
}
_CONNECTOR_GAUGE_UNITS = {
    "pool_size": "pool_size_bytes", "pool_in_use": "pool_in_use_bytes", "max_pool_size": "max_pool_size_bytes",
    "localbuf_size": "localbuf_size_bytes", "localbuf_in_use": "localbuf_in_use_bytes",
}
_METRIC_NAME = re.compile(r"[a-z_][a-z0-9_]*")


class Metrics:
    def __init__(self, coordinator: Coordinator) -> None:
        disable_created_metrics()  # process-wide, and this process is the coordinator: no `_created`
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.http_requests = Counter(
            "omni_mesh_http_requests", "HTTP requests answered, by route and status", ["route", "method", "status"], registry=r
        )
        self.http_seconds = Histogram(
            "omni_mesh_http_request_duration_seconds", "HTTP request latency, by route and status",
            ["route", "method", "status"], buckets=_BUCKETS, registry=r,
        )
        self.requests = Counter(
            "omni_mesh_requests", "pipeline requests finished, by outcome status", ["status"], registry=r
        )
        self.request_seconds = Histogram(
            "omni_mesh_request_duration_seconds", "pipeline request latency, admission to last output",
            ["status"], buckets=_BUCKETS, registry=r,
        )
        self.first_chunk_seconds = Histogram(
            "omni_mesh_time_to_first_chunk_seconds", "admission to the first streamed output chunk",
            buckets=_BUCKETS, registry=r,
        )
        self.queue_seconds = Histogram(
            "omni_mesh_stage_queue_wait_seconds", "time waiting for a free replica, per stage", ["stage"],
            buckets=_BUCKETS, registry=r,
        )
        self.service_seconds = Histogram(
            "omni_mesh_stage_service_seconds", "time in a replica (handler and transfers), per stage", ["stage"],
            buckets=_BUCKETS, registry=r,
        )
        self.edge_bytes = Counter(
            "omni_mesh_edge_bytes", "payload bytes put on each edge", ["edge", "connector"], registry=r
        )
        self.edge_seconds = Counter(
            "omni_mesh_edge_put_seconds", "time spent putting payloads on each edge", ["edge", "connector"], registry=r
        )
        self.registry.register(_StateCollector(coordinator))
        self._connectors = {  # edge label -> connector ref, the `connector` label of every metric
            f"{coordinator.topology.stage(e.src).name}->{coordinator.topology.stage(e.dst).name}": e.connector.ref
            for e in coordinator.topology.edges
        }

    def observe_http(self, route: str, method: str, status: int, seconds: float) -> None:
        self.http_requests.labels(route, method, str(status)).inc()
        self.http_seconds.labels(route, method, str(status)).observe(seconds)

    def observe_request(self, state: RequestState, status: int) -> None:
        """A pipeline request ended (the dispatcher calls this once per request)."""
        self.requests.labels(str(status)).inc()
        self.request_seconds.labels(str(status)).observe(time.perf_counter() - state.created)
        if state.first_chunk_s is not None:
            self.first_chunk_seconds.observe(state.first_chunk_s)
        for stage, timings in state.timings.items():
            if "queued_s" in timings:
                self.queue_seconds.labels(stage).observe(timings["queued_s"])
            if "total_s" in timings:
                self.service_seconds.labels(stage).observe(timings["total_s"])
            for dst, edge in (timings.get("edges") or {}).items():
                label = f"{stage}->{dst}"
                connector = self._connectors.get(label, "")
                self.edge_bytes.labels(label, connector).inc(max(0, int(edge.get("bytes", 0))))
                self.edge_seconds.labels(label, connector).inc(max(0.0, float(edge.get("put_s", 0.0))))

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def edge_totals(self) -> dict[str, dict[str, float]]:
        """{edge label: {bytes, put_s}} since start (the dashboard turns them into rates)."""
        totals: dict[str, dict[str, float]] = {label: {"bytes": 0, "put_s": 0.0} for label in self._connectors}
        for metric, field in ((self.edge_bytes, "bytes"), (self.edge_seconds, "put_s")):
            for sample in metric.collect()[0].samples:
                if sample.name.endswith("_total"):
                    totals.setdefault(sample.labels["edge"], {"bytes": 0, "put_s": 0.0})[field] = sample.value
        return totals

    def service_totals(self) -> dict[str, tuple[float, float]]:
        """{stage: (seconds in replicas, requests)} since start."""
        totals: dict[str, list[float]] = {}
        for sample in self.service_seconds.collect()[0].samples:
            stage = sample.labels.get("stage")
            if sample.name.endswith("_sum"):
                totals.setdefault(stage, [0.0, 0.0])[0] = sample.value
            elif sample.name.endswith("_count"):
                totals.setdefault(stage, [0.0, 0.0])[1] = sample.value
        return {stage: (v[0], v[1]) for stage, v in totals.items()}


def stats(coordinator: Coordinator, metrics: Metrics) -> dict[str, Any]:
    """The live figures behind `/dashboard` and `omni-mesh status`: totals, never rates (a reader takes
    two snapshots and divides by the time between them)."""
    registry, dispatcher = coordinator.registry, coordinator.dispatcher
    now = registry.now()  # the coordinator's own time (stalls excluded)
    service = metrics.service_totals()
    stages = {}
    for stage in coordinator.topology.stages:
        mine = registry.of_stage(stage.name)
        seconds, count = service.get(stage.name, (0.0, 0.0))
        stages[stage.name] = {
            "replicas": [
                {"id": r.replica_id, "health": r.health(now, registry.heartbeat_timeout_s), "inflight": r.busy}
                for r in mine
            ],
            "inflight": sum(r.busy for r in mine),
            "queued": len(dispatcher.queues[stage.name]),
            "current_replicas": coordinator.autoscaler.current(stage.name),
            "target_replicas": coordinator.autoscaler.target(stage),
            "processed": sum(r.processed for r in mine),
            "errors": sum(r.errors for r in mine),
            "service_seconds": seconds,
            "service_count": count,
            "mean_service_s": seconds / count if count else None,
            "engine": engine_figures(mine),
        }
    return {
        "name": coordinator.topology.name,
        "stages": stages,
        "edges": metrics.edge_totals(),
        "requests": {
            "completed": dispatcher.completed, "failed": dispatcher.failed, "inflight": len(dispatcher.requests),
        },
    }


#: A model stage's figures the dashboard shows (handler counters, omni_mesh.engines), summed over replicas.
ENGINE_FIGURES = (
    "batch_running", "batch_queued", "batch_max", "kv_cache_used_tokens", "kv_cache_budget_tokens",
    "generated_tokens_per_second", "generated_codes_per_second",
)


def engine_figures(replicas: list[Any]) -> dict[str, float]:
    """The stage's ENGINE_FIGURES its replicas report ({} for a stage of handlers without them)."""
    out: dict[str, float] = {}
    for replica in replicas:
        for name in ENGINE_FIGURES:
            value = replica.counters.get(name)
            if isinstance(value, int | float):
                out[name] = out.get(name, 0) + value
    return out


class _StateCollector(Collector):
    """Gauges read at scrape time from the coordinator's registry and dispatcher."""

    def __init__(self, coordinator: Coordinator) -> None:
        self.coordinator = coordinator

    def describe(self) -> Iterator[Any]:
        """Nothing ahead: registering would otherwise collect at once, from a coordinator still being
        built (it hands the dispatcher this module's observer); the families are named when scraped."""
        return iter(())

    def collect(self) -> Iterator[Any]:
        registry, dispatcher = self.coordinator.registry, self.coordinator.dispatcher
        now = registry.now()  # the coordinator's own time (stalls excluded)
        replicas = GaugeMetricFamily("omni_mesh_stage_replicas", "registered replicas per stage, by health", labels=["stage", "health"])
        inflight = GaugeMetricFamily("omni_mesh_stage_inflight_requests", "requests a stage's replicas work on", labels=["stage"])
        queued = GaugeMetricFamily("omni_mesh_stage_queued_requests", "requests waiting for a free replica", labels=["stage"])
        autoscaler = self.coordinator.autoscaler
        target = GaugeMetricFamily("omni_mesh_stage_target_replicas", "replicas the autoscaler wants per stage", labels=["stage"])
        ongoing = GaugeMetricFamily("omni_mesh_stage_ongoing_requests", "in flight plus queued per stage (what autoscale: targets)", labels=["stage"])
        restarts = CounterMetricFamily("omni_mesh_replica_restarts", "replica restarts seen by the coordinator", labels=["stage", "replica"])
        families: dict[str, CounterMetricFamily | GaugeMetricFamily] = {}
        for stage in self.coordinator.topology.stages:
            mine = registry.of_stage(stage.name)
            by_health: dict[str, int] = {"healthy": 0, "unhealthy": 0, "draining": 0}
            for replica in mine:
                health = replica.health(now, registry.heartbeat_timeout_s)
                by_health[health] = by_health.get(health, 0) + 1
                restarts.add_metric([stage.name, replica.replica_id], replica.restarts)
                for ref, report in replica.connectors.items():
                    if isinstance(report, dict):
                        _add_connector_report(families, [stage.name, replica.replica_id, ref], report)
                _add_handler_counters(families, [stage.name, replica.replica_id], replica.counters)
            for health, count in by_health.items():
                replicas.add_metric([stage.name, health], count)
            inflight.add_metric([stage.name], sum(r.busy for r in mine))
            queued.add_metric([stage.name], len(dispatcher.queues[stage.name]))
            target.add_metric([stage.name], autoscaler.target(stage))
            ongoing.add_metric([stage.name], autoscaler.ongoing(stage.name))
        info = GaugeMetricFamily("omni_mesh_connector_info", "1 per connector ref, labelled with its class", labels=["connector", "type"])
        for spec in self.coordinator.topology.connectors.values():
            info.add_metric([spec.ref, spec.name], 1)
        inflight_total = GaugeMetricFamily("omni_mesh_requests_inflight", "pipeline requests admitted and not ended")
        inflight_total.add_metric([], len(dispatcher.requests))
        yield from (replicas, inflight, queued, target, ongoing, restarts, info, *families.values(), inflight_total)


def _add_connector_report(
    families: dict[str, CounterMetricFamily | GaugeMetricFamily], labels: list[str], report: dict[str, Any]
) -> None:
    """One replica's report of one connector: each number its own metric (never counts and bytes in
    one), a counter when the key only grows, a gauge otherwise. Text fields (status, endpoint) are
    left out: they are in /v1/stages."""
    for key, value in report.items():
        if isinstance(value, bool) or not isinstance(value, int | float) or not _METRIC_NAME.fullmatch(key):
            continue
        if key in _CONNECTOR_COUNTERS:
            name = f"omni_mesh_connector_{_CONNECTOR_COUNTERS[key]}"
            family = families.get(name) or CounterMetricFamily(
                name, f"connector counter {key!r} from the replicas' heartbeats", labels=_CONNECTOR_LABELS
            )
        else:
            name = f"omni_mesh_connector_{_CONNECTOR_GAUGE_UNITS.get(key, key)}"
            family = families.get(name) or GaugeMetricFamily(
                name, f"connector gauge {key!r} from the replicas' heartbeats", labels=_CONNECTOR_LABELS
            )
        families[name] = family
        family.add_metric(labels, value)


def _add_handler_counters(
    families: dict[str, CounterMetricFamily | GaugeMetricFamily], labels: list[str], counters: dict[str, Any]
) -> None:
    """A replica's handler counters (omni_mesh.stage.counters): `omni_mesh_handler_<name>`, a counter
    where the name ends in `_total`, else a gauge."""
    for key, value in counters.items():
        if isinstance(value, bool) or not isinstance(value, int | float) or not _METRIC_NAME.fullmatch(key):
            continue
        if key.endswith("_total"):
            name = f"omni_mesh_handler_{key.removesuffix('_total')}"
            family = families.get(name) or CounterMetricFamily(name, f"handler counter {key!r}", labels=["stage", "replica"])
        else:
            name = f"omni_mesh_handler_{key}"
            family = families.get(name) or GaugeMetricFamily(name, f"handler gauge {key!r}", labels=["stage", "replica"])
        families[name] = family
        family.add_metric(labels, value)


_CONNECTOR_LABELS = ["stage", "replica", "connector"]

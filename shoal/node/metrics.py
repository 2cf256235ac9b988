"""Prometheus metrics for a node or a bootstrap peer, served over HTTP: `--metrics-port P`.

shoal node --initial-peers ... --metrics-port 9100   then   curl http://127.0.0.1:9100/metrics

Every value is read from the node's own state when a scrape arrives (a custom collector), not
counted a second time: the engines already keep their counts (`stats()`, `traffic_counts()`, the data
node's ledger), the node its step, epoch, loss, view and error counts. The HTTP server runs on
the node's event loop, not on prometheus_client's thread, so a scrape reads that state on the
thread that changes it and never sees a dict in the middle of an update. Each node has its own
`CollectorRegistry`: several nodes in one process (tests) keep apart.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Iterator, Mapping
from typing import Any, Protocol

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric
from prometheus_client.registry import Collector

from shoal.config import RunConfig
from shoal.errors import UsageError
from shoal.http import answer_one_request
from shoal.node.config import NodeConfig
from shoal.node.engine import AbandonReason, Engine, Progress
from shoal.p2p.streams import WIRE_BYTES
from shoal.planning.swarm_view import SwarmView
from shoal.protocol.version import PROTOCOL_VERSION

logger = logging.getLogger(__name__)

NAMESPACE = "shoal"
MAX_REQUEST_BYTES = 8192

# Abandon reasons are free text (peer ids, stage numbers, a peer's own words): a label takes only
# the kind, from this short list, so a peer cannot grow the label set.
REASON_KINDS = tuple(kind.value for kind in AbandonReason)
# Error kinds: the node's own (`Node.errors`) and those its engines already count.
ERROR_KINDS = (
    "rpc_refused",  # a request that broke the protocol (bad message, bad tensor), refused
    "rpc_stream_failed",  # a stream that timed out or broke while we served it
    "rpc_internal",  # a handler that raised
    "heartbeat",  # a heartbeat round that failed (view, pings, publish)
    "training",  # the data node's or rollout worker's training loop failed
    "stream_retry",  # an outgoing stream retried on the same peer
    "expired",  # kept microbatch state dropped because its gradient never came
    "rollout_send",  # a rollout bundle that could not be sent
)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(f"{NAMESPACE}_{name}", doc, value=value)


def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(f"{NAMESPACE}_{name}", doc, value=value)


def _counters(name: str, doc: str, label: str, values: Mapping[str, float]) -> CounterMetricFamily:
    family = CounterMetricFamily(f"{NAMESPACE}_{name}", doc, labels=[label])
    for key, value in values.items():
        family.add_metric([key], value)
    return family


def _gauges(name: str, doc: str, label: str, values: Mapping[str, float]) -> GaugeMetricFamily:
    family = GaugeMetricFamily(f"{NAMESPACE}_{name}", doc, labels=[label])
    for key, value in values.items():
        family.add_metric([key], value)
    return family


class MetricsSource(Protocol):
    """What a node shows of itself (the daemon's `Node` is one)."""

    peer_id: str
    run: RunConfig
    config: NodeConfig
    state: str
    stage: int | None
    started_at: float
    max_inflight: int
    block_throughput: float
    view: SwarmView | None
    errors: Counter[str]
    engine: Engine | None

    @property
    def role(self) -> str: ...

    @property
    def short_id(self) -> str: ...

    def progress(self) -> Progress: ...


class NodeCollector:
    """The metrics of one node, read from its state at scrape time.

    It reads the engine through `stats()` and `traffic_counts()`, the interface the node already uses
    for its stats file, so it never asks which kind of engine it holds."""

    def __init__(self, node: MetricsSource):
        self.node = node

    def collect(self) -> Iterator[Metric]:
        node = self.node
        engine = node.engine
        progress = node.progress()
        stats: dict[str, Any] = engine.stats() if engine is not None else {}
        traffic: dict[str, Any] = engine.traffic_counts() if engine is not None else {}
        info = {
            "peer_id": node.peer_id,
            "role": node.role,
            "stage": str(node.stage if node.stage is not None else -1),
            "state": node.state,
            "run": node.run.name,
            "run_id": node.run.run_id,
            "protocol_version": str(PROTOCOL_VERSION),
        }
        yield InfoMetricFamily(f"{NAMESPACE}_node", "who this node is and what it holds", value=info)
        yield gauge("stage", "the stage this node holds (0: data node or rollout worker)", node.stage or 0)
        yield gauge("start_time_seconds", "when this node started (seconds since the epoch)", node.started_at)
        yield gauge("inner_step", "inner optimizer steps taken", progress.inner_step)
        yield gauge("outer_epoch", "outer (averaging) epochs taken", progress.outer_epoch)
        if progress.loss is not None:
            yield gauge("loss", "the last training loss this node saw", progress.loss)
        if progress.grad_norm is not None:
            yield gauge("grad_norm", "the last gradient norm before clipping", progress.grad_norm)
        yield gauge("max_inflight", "microbatches this node holds activations for at most", node.max_inflight)
        yield gauge("block_throughput", "measured transformer blocks per second", node.block_throughput)
        yield from self._view()
        yield from self._pipeline(stats, traffic)
        yield _counters("errors", "errors by kind", "kind", self._errors(stats, traffic))
        yield _counters("wire_bytes", "bytes this node sent, by kind", "kind", WIRE_BYTES.counts())
        if "bundles_sent" in traffic:  # a rollout worker
            kinds = ("sent", "received", "refused", "refused_by_peers")
            bundles = {kind: traffic[f"bundles_{kind}"] for kind in kinds}
            yield _counters("rollout_bundles", "rollout bundles by fate", "kind", bundles)
            yield gauge("rollout_round", "the GRPO round this node is collecting", stats.get("round", 0))

    def _view(self) -> Iterator[Metric]:
        view = self.node.view
        live = view.live_nodes() if view is not None else ()
        yield gauge("peers_seen", "live nodes of this run in the node's last view of the swarm", len(live))
        if view is not None and self.node.run.mode != "grpo":
            replicas = {str(s): len(view.replicas(s)) for s in range(view.stages)}
            yield _gauges("stage_replicas", "live replicas per stage in the node's last view", "stage", replicas)

    def _pipeline(self, stats: dict[str, Any], traffic: dict[str, Any]) -> Iterator[Metric]:
        if "bytes_sent" in traffic:
            bytes_ = {"in": traffic["bytes_received"], "out": traffic["bytes_sent"]}
            tensors = {"in": traffic["tensors_received"], "out": traffic["tensors_sent"]}
            yield _counters("pipeline_bytes", "tensor bytes on the pipeline streams", "direction", bytes_)
            yield _counters("pipeline_tensors", "tensors on the pipeline streams", "direction", tensors)
        if "forwards" in stats:  # a stage worker
            served = {"forward": stats["forwards"], "backward": stats["backwards"]}
            yield _counters("microbatches_served", "microbatch passes this worker served", "pass", served)
            yield _counter("microbatches_recomputed", "lost hops this worker redid", stats["recomputed"])
            yield _counter("stage_copies_served", "stage weights copied to joining replicas", stats["copies_served"])
            yield _counter(
                "compute_collisions", "microbatch passes that waited for another job of this node", stats["collisions"]
            )
            yield _counter("compute_collision_seconds", "how long those passes waited", stats["collision_s"])
            yield gauge(
                "microbatches_in_flight", "microbatches whose backward has not run here yet", stats["in_flight"]
            )
        if "microbatches_injected" in stats:  # a data node
            for name, doc in (
                ("injected", "microbatches this data node injected"),
                ("completed", "microbatches that came back and whose gradient reached the embedding"),
                ("resent", "forward passes sent again after a hop was lost before coming home"),
                ("resumed", "forward passes an upstream hop passed on again after a hop was lost"),
            ):
                yield _counter(f"microbatches_{name}", doc, stats[f"microbatches_{name}"])
            reasons = dict.fromkeys(REASON_KINDS, 0)
            for reason, count in stats["abandoned_reasons"].items():  # the ledger counts by AbandonReason
                reasons[reason] += count
            yield _counters("microbatches_abandoned", "microbatches given up, by kind of reason", "reason", reasons)
            recoveries = stats["backward_recoveries"]
            yield _counter("backward_recoveries", "lost backward hops this data node had redone", recoveries)
            in_flight = stats["microbatches_in_flight"]
            yield gauge("microbatches_in_flight", "microbatches injected and not ended yet", in_flight)

    def _errors(self, stats: dict[str, Any], traffic: dict[str, Any]) -> dict[str, float]:
        errors = dict.fromkeys(ERROR_KINDS, 0)
        for kind, count in self.node.errors.items():
            if kind in errors:
                errors[kind] += count
        errors["stream_retry"] += stats.get("stream_retries", 0)
        errors["expired"] += stats.get("expired", 0)
        errors["rollout_send"] += traffic.get("send_failures", 0)
        return errors


def registry_for(collector: Collector) -> CollectorRegistry:
    """A registry of its own for one node: its collector and this process's CPU and memory."""
    registry = CollectorRegistry()
    registry.register(collector)
    ProcessCollector(namespace=NAMESPACE, registry=registry)
    return registry


class MetricsServer:
    """`GET /metrics` on the node's event loop; every other path is a 404."""

    def __init__(self, registry: CollectorRegistry, who: str = ""):
        self.registry, self.who = registry, who  # `who` prefixes log lines: the node's short id
        self.server: asyncio.Server | None = None

    @classmethod
    async def create(cls, registry: CollectorRegistry, host: str, port: int, who: str = "") -> MetricsServer:
        """Listen on `host:port` (port 0: a free one, see `port`)."""
        self = cls(registry, who)
        try:
            self.server = await asyncio.start_server(self._handle, host, port, limit=MAX_REQUEST_BYTES)
        except OSError as e:
            raise UsageError(f"--metrics-port: cannot listen on {host}:{port} ({e.strerror or e})") from None
        return self

    @property
    def host(self) -> str:
        assert self.server is not None, "create() first"
        return self.server.sockets[0].getsockname()[0]

    @property
    def port(self) -> int:
        assert self.server is not None, "create() first"
        return self.server.sockets[0].getsockname()[1]

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def _respond(self, method: str, path: str) -> tuple[str, bytes, str]:
        if method not in ("GET", "HEAD"):
            return "405 Method Not Allowed", b"only GET\n", "text/plain"
        if path.split("?", 1)[0] not in ("/metrics", "/"):
            return "404 Not Found", b"see /metrics\n", "text/plain"
        try:
            return "200 OK", generate_latest(self.registry), CONTENT_TYPE_LATEST
        except Exception:
            logger.exception("[%s] metrics scrape failed", self.who)
            return "500 Internal Server Error", b"scrape failed: see the node's log\n", "text/plain"

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await answer_one_request(reader, writer, self._respond)

    async def shutdown(self) -> None:
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()


async def serve_node_metrics(node: MetricsSource) -> MetricsServer | None:
    """The node's metrics endpoint, if its config asks for one (`--metrics-port`)."""
    port = node.config.output.metrics_port
    if port is None:
        return None
    server = await MetricsServer.create(
        registry_for(NodeCollector(node)), node.config.output.metrics_host, port, node.short_id
    )
    logger.info("[%s] metrics on %s", node.short_id, server.url)
    return server

"""The Prometheus endpoint of real nodes, scraped over HTTP while a small swarm trains."""

from __future__ import annotations

import asyncio
import re
import urllib.error
import urllib.request

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from shoal.node.engine import AbandonReason
from shoal.node.metrics import REASON_KINDS, MetricsServer
from tests.helpers.processes import Peer, done_event, progress_events, wait_until
from tests.helpers.tiny import write_tiny_run

STEPS = 12


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of a node's endpoint: (name, sorted labels) -> value."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples: dict, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


def info(samples: dict) -> dict[str, str]:
    (labels,) = [dict(k[1]) for k in samples if k[0] == "shoal_node_info"]
    return labels


def metrics_port(peer: Peer) -> int:
    assert peer.ready_file is not None
    import json

    return json.loads(peer.ready_file.read_text())["metrics_port"]


def steps_done(progress) -> int:
    return sum(1 for e in progress_events(progress) if e["event"] == "step")


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_nodes_serve_metrics_that_follow_training(swarm, tmp_path):
    # two stages (a data node and one worker) keep the swarm small; one replica has no NoLoCo
    # partner, so a short exchange timeout lets its outer steps come quickly
    overrides = {"train.steps": STEPS, "pipeline.stages": 2, "averaging.inner_steps": 5}
    run_file = write_tiny_run(tmp_path, **overrides, **{"averaging.exchange_timeout_s": 0.5})
    boot = swarm.start_bootstrap("--run-config", str(run_file), "--metrics-port", "0")
    entry = boot.maddrs[0]
    common = ("--metrics-port", "0", "--record-ttl", "6")
    progress = tmp_path / "progress.jsonl"
    worker = swarm.start_node([entry], "--role", "worker", *common, wait=False)
    data = swarm.start_node([entry], "--role", "data", "--progress-file", str(progress), *common, wait=False)
    for peer in (worker, data):
        swarm.wait_ready(peer)

    # While it trains: a worker's served passes are real and grow.
    wait_until(lambda: steps_done(progress) >= 2, 120, "two training steps")
    early = scrape(metrics_port(worker))
    assert info(early) | {"stage": "1", "role": "worker", "peer_id": worker.peer_id} == info(early)
    forwards = value(early, "shoal_microbatches_served_total", **{"pass": "forward"})
    assert forwards > 0
    assert value(early, "shoal_stage", **{}) == 1
    assert value(early, "shoal_pipeline_bytes_total", direction="in") > 0
    assert value(early, "shoal_pipeline_bytes_total", direction="out") > 0
    assert value(early, "shoal_process_resident_memory_bytes") > 0
    wait_until(
        lambda: (
            value(scrape(metrics_port(worker)), "shoal_microbatches_served_total", **{"pass": "forward"}) > forwards
        ),
        60,
        "the worker to serve more forwards",
    )
    # the worker's view comes to hold both nodes (the bootstrap peer publishes no node record)
    wait_until(lambda: value(scrape(metrics_port(worker)), "shoal_peers_seen") == 2, 30, "two peers seen")

    # At the end: the data node's counters are its ledger, as its progress file reports it.
    done = wait_until(lambda: done_event(progress), 180, "the data node to finish")
    end = scrape(metrics_port(data))
    assert info(end)["role"] == "data" and info(end)["peer_id"] == data.peer_id
    for name in ("injected", "completed", "resent"):
        assert value(end, f"shoal_microbatches_{name}_total") == done[f"microbatches_{name}"], name
    abandoned = {kind: value(end, "shoal_microbatches_abandoned_total", reason=kind) for kind in REASON_KINDS}
    assert sum(abandoned.values()) == done["microbatches_abandoned"]
    assert value(end, "shoal_microbatches_in_flight") == 0
    assert value(end, "shoal_inner_step") == STEPS
    last_loss = [e["loss"] for e in progress_events(progress) if e["event"] == "step"][-1]
    assert value(end, "shoal_loss") == pytest.approx(last_loss)
    assert value(end, "shoal_stage_replicas", stage="1") == 1
    served = scrape(metrics_port(worker))
    assert value(served, "shoal_microbatches_served_total", **{"pass": "backward"}) > 0
    assert value(served, "shoal_inner_step") == STEPS
    assert value(served, "shoal_outer_epoch") == STEPS // 5
    assert value(served, "shoal_errors_total", kind="rpc_internal") == 0

    # The bootstrap peer's endpoint: its address is in its log (it writes no ready file).
    match = re.search(r"metrics on http://127\.0\.0\.1:(\d+)/metrics", boot.log())
    assert match, boot.log()[-2000:]
    boot_samples = scrape(int(match.group(1)))
    assert info(boot_samples)["role"] == "bootstrap"
    assert value(boot_samples, "shoal_dht_peers") >= 1
    for peer in (worker, data):
        assert "Traceback" not in peer.log()


def test_abandon_reasons_are_a_short_fixed_label_set_whatever_a_peer_sends():
    """The metrics label a microbatch's loss by its kind; a kind a peer sends that we do not know (or
    words where a kind belongs) is `other`, so no peer can grow the label set."""
    assert set(REASON_KINDS) == {reason.value for reason in AbandonReason}
    assert AbandonReason.parse("stage_lost") is AbandonReason.STAGE_LOST
    assert AbandonReason.parse("backward") is AbandonReason.BACKWARD
    for sent in ("QmSomePeerIdThatAPeerChose", "stage_lost: no live replica", "", "Timeout"):
        assert AbandonReason.parse(sent) is AbandonReason.OTHER


def test_metrics_server_answers_only_metrics():
    async def main() -> list[int]:
        server = await MetricsServer.create(CollectorRegistry(), "127.0.0.1", 0)
        try:
            codes = []
            for method, path in (("GET", "/metrics"), ("GET", "/other"), ("POST", "/metrics"), ("HEAD", "/")):
                request = urllib.request.Request(f"http://127.0.0.1:{server.port}{path}", method=method)
                loop = asyncio.get_running_loop()
                try:
                    response = await loop.run_in_executor(None, lambda r=request: urllib.request.urlopen(r, timeout=5))
                    codes.append(response.status)
                except urllib.error.HTTPError as e:
                    codes.append(e.code)
            return codes
        finally:
            await server.shutdown()

    assert asyncio.run(main()) == [200, 404, 405, 200]

"""Unit tests of the daemon's plain parts: the microbatch ledger, the compute thread, routing, placement,
the averagers' table."""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from pathlib import Path

import pytest

from shoal.config import AveragingConfig
from shoal.node.averaging.modes import outer_config
from shoal.node.compute import BACKGROUND, BACKWARD, COMPUTE_THREAD_OS_NAME, FORWARD, ComputeThread
from shoal.node.engine import AbandonReason
from shoal.node.pipeline.data.ledger import MicrobatchLedger
from shoal.planning.costs import CostModel
from shoal.planning.peer_router import PeerRouter, Snapshot
from shoal.planning.swarm_view import NodeInfo, SwarmView


def test_ledger_accounts_for_every_microbatch():
    ledger = MicrobatchLedger()
    for i in range(5):
        ledger.inject(f"m{i}")
    assert ledger.complete("m0") and ledger.complete("m1")
    assert ledger.abandon("m2", AbandonReason.TIMEOUT, "no answer after 60 s")
    assert ledger.abandon("m3", AbandonReason.STAGE_LOST)
    assert not ledger.complete("m2")  # a late arrival for an abandoned microbatch changes nothing
    assert not ledger.abandon("m0", AbandonReason.TIMEOUT)  # nor does a late abandon of a completed one
    summary = ledger.summary()
    assert summary["microbatches_injected"] == 5
    assert summary["microbatches_completed"] == 2 and summary["microbatches_abandoned"] == 2
    assert summary["microbatches_in_flight"] == 1
    assert summary["abandoned_reasons"] == {"stage_lost": 1, "timeout": 1}
    assert summary["abandoned_details"] == ["m2: no answer after 60 s", "m3: stage_lost"]
    with pytest.raises(ValueError):
        ledger.inject("m4")


def test_compute_thread_runs_backward_before_queued_forwards_and_reports_errors():
    async def scenario():
        thread = ComputeThread()
        gate, order = threading.Event(), []
        blocker = thread.run(BACKGROUND, gate.wait)  # holds the thread while we queue work
        jobs = [
            thread.run(FORWARD, order.append, "f1"),
            thread.run(BACKGROUND, order.append, "step"),
            thread.run(BACKWARD, order.append, "b1"),
            thread.run(FORWARD, order.append, "f2"),
            thread.run(BACKWARD, order.append, "b2"),
        ]
        gate.set()
        await asyncio.gather(blocker, *jobs)
        failing = thread.run(FORWARD, lambda: 1 / 0)
        with pytest.raises(ZeroDivisionError):
            await failing
        assert await thread.run(FORWARD, lambda: 42) == 42  # still working after an error
        thread.shutdown()
        return order

    assert asyncio.run(scenario()) == ["b1", "b2", "f1", "f2", "step"]


def test_compute_thread_traces_each_job_on_the_monotonic_clock(tmp_path):
    trace = tmp_path / "trace.txt"

    def spin() -> None:
        until = time.thread_time() + 0.02
        while time.thread_time() < until:
            pass

    async def scenario() -> tuple[float, float]:
        thread = ComputeThread(trace_path=str(trace))
        before = time.monotonic()
        await thread.run(FORWARD, spin)
        with pytest.raises(ZeroDivisionError):
            await thread.run(BACKWARD, lambda: 1 / 0)
        thread.shutdown()
        return before, time.monotonic()

    before, after = asyncio.run(scenario())
    rows = [line.split() for line in trace.read_text().splitlines()]
    assert [row[2] for row in rows] == ["spin", "<lambda>"]  # a failed job is traced too
    start, end, cpu_s = float(rows[0][0]), float(rows[0][1]), float(rows[0][3])
    assert before <= start < end <= after and end - start >= cpu_s >= 0.02


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="thread names in /proc are Linux's")
def test_the_kernel_knows_the_compute_thread_by_its_name_and_the_event_loop_keeps_the_process_name():
    def own_comm() -> str:
        return Path(f"/proc/self/task/{threading.get_native_id()}/comm").read_text().strip()

    async def scenario() -> tuple[str, str]:
        thread = ComputeThread()
        try:
            return await thread.run(FORWARD, own_comm), own_comm()
        finally:
            thread.shutdown()

    assert asyncio.run(scenario()) == (COMPUTE_THREAD_OS_NAME, Path("/proc/self/comm").read_text().strip())


def _node(peer: str, stage: int, throughput: float, state: str = "active") -> NodeInfo:
    return NodeInfo(peer_id=peer, role="worker", stage=stage, state=state, block_throughput=throughput, max_inflight=8)


def test_capacity_routes_take_one_live_replica_per_stage_in_proportion_to_speed():
    view = SwarmView(
        "run",
        3,
        (0, 2, 2),
        (
            NodeInfo(peer_id="data", role="data", stage=0, state="active", block_throughput=10.0, max_inflight=8),
            _node("fast", 1, 30.0),
            _node("slow", 1, 10.0),
            _node("b", 2, 5.0),
            _node("gone", 2, 99.0, state="leaving"),
        ),
    )
    router = PeerRouter("capacity", CostModel(activation_bytes=1024))
    router.update(Snapshot(view, "data"))
    # load spreads in proportion to throughput: 3 in flight on the fast replica cost what 1 costs on the slow one
    firsts = [router.route("data").hops for _ in range(4)]
    assert firsts[0] == ((1, "fast"), (2, "b"))
    assert [hops[0][1] for hops in firsts] == ["fast", "fast", "fast", "slow"]
    assert router.route("data", exclude={"b"}) is None
    assert view.stages_without_replica() == [] and view.without(["b"]).stages_without_replica() == [2]


def test_the_speed_test_sees_through_a_burst_of_load_but_not_through_steady_load():
    """Nodes that start together measure while the others import and measure: a burst slows a few
    passes of the window, and the faster quartile does not see it; load all along slows them all."""
    import time

    from shoal.node import capacity
    from tests.helpers.tiny import tiny_run

    run = tiny_run()
    assert capacity.measure_block_throughput(run, window_s=0.1) > 0
    real = capacity.BlockStage

    class Loaded(real):
        passes = 0

        def forward(self, x, tokens=None):
            Loaded.passes += 1
            time.sleep(self.delay(Loaded.passes))
            return super().forward(x, tokens)

    try:
        Loaded.delay = staticmethod(lambda n: 0.05 if 3 <= n <= 5 else 0.0)  # a burst: 3 passes of many
        capacity.BlockStage = Loaded
        burst = capacity.measure_block_throughput(run, window_s=0.5)  # the burst, then up to 47 quick passes
        Loaded.passes, Loaded.delay = 0, staticmethod(lambda n: 0.05)  # slowed all along
        steady = capacity.measure_block_throughput(run, window_s=0.1)
    finally:
        capacity.BlockStage = real
    assert steady < 20 < burst  # 0.05 s a pass: under 20 passes a second, whatever the quartile


@pytest.mark.parametrize("mode", ["noloco", "diloco"])
def test_data_nodes_replace_stage_0_with_their_mean_and_block_stages_take_the_outer_step(mode):
    import torch

    from shoal.node.averaging.base import outer_codec_name
    from shoal.train.outer import OuterState, diloco_step, noloco_step

    averaging = AveragingConfig(mode=mode, codec="int8")
    block = outer_config(averaging, 1)
    assert (block.alpha, block.beta, block.inner_steps) == (averaging.alpha, averaging.beta, averaging.inner_steps)
    assert averaging.stage0 == "gradients"  # the default: the weights' mean only resyncs them, in float32
    assert outer_config(averaging, 0).inner_steps == averaging.stage0_resync_every == 10
    assert outer_codec_name(averaging, 0) == "float32" and outer_codec_name(averaging, 1) == "int8"
    stage0 = outer_config(AveragingConfig(mode=mode, stage0="mean"), 0)
    assert stage0.inner_steps == averaging.stage0_every == 1
    assert outer_config(AveragingConfig(mode=mode, stage0="outer"), 0) == outer_config(AveragingConfig(mode=mode), 1)
    # whatever momentum and slow weights the replicas hold, the step lands both on the mean of their θ
    phi_a, phi_b = [torch.tensor([1.0, -2.0])], [torch.tensor([0.5, 3.0])]
    theta_a, theta_b = [torch.tensor([1.5, -1.0])], [torch.tensor([0.0, 2.0])]
    delta_a = [t - p for t, p in zip(theta_a, phi_a, strict=True)]
    delta_b = [t - p for t, p in zip(theta_b, phi_b, strict=True)]
    state = OuterState.from_tensors(phi_a)
    state = OuterState(phi=state.phi, momentum=(torch.tensor([9.0, 9.0]),), epoch=3)
    if mode == "noloco":
        after = noloco_step(state, delta_a, [phi_b], [delta_b], stage0)
        assert torch.allclose(after.phi[0], (theta_a[0] + theta_b[0]) / 2)
    else:  # an all-reduce over replicas that share φ
        state = OuterState(phi=tuple(phi_a), momentum=state.momentum, epoch=3)
        mean_delta = [(delta_a[0] + (theta_b[0] - phi_a[0])) / 2]
        after = diloco_step(state, mean_delta, stage0)
        assert torch.allclose(after.phi[0], (theta_a[0] + theta_b[0]) / 2)


def test_every_averaging_mode_the_run_accepts_has_its_averager_and_no_other():
    from shoal.config import AVERAGING_MODES, ConfigError, run_config_from_dict
    from shoal.node.averaging.modes import AVERAGERS

    assert list(AVERAGERS) == list(AVERAGING_MODES)
    for mode, averager in AVERAGERS.items():
        assert run_config_from_dict({"averaging": {"mode": mode}}).averaging.mode == mode
        if averager is not None:
            assert outer_config(AveragingConfig(mode=mode), 1).mode == mode  # its own outer step
    with pytest.raises(ConfigError, match="averaging.mode"):
        run_config_from_dict({"averaging": {"mode": "gossip"}})


def _placement(**options):
    import torch

    from shoal.device import DeviceInfo
    from shoal.node.config import PlacementOptions
    from shoal.node.machine import Machine
    from shoal.node.placement import Placement
    from tests.helpers.tiny import tiny_run

    gib16 = 16 * 2**30
    machine = Machine(torch.device("cpu"), DeviceInfo("cpu", "test", gib16, gib16), None, gib16, None, 10.0)
    router = PeerRouter("gwtf", CostModel(activation_bytes=1024))
    return Placement(tiny_run(), PlacementOptions(**options), None, machine, router, "QmPlaced", 0.0)


def test_a_node_nobody_can_dial_takes_the_data_role_unless_its_flags_say_worker():
    from shoal.errors import UsageError

    placement = _placement()
    placement.take_client_role_if_unreachable(None, ())  # not checked: nothing changes
    assert not placement.client_only
    placement.take_client_role_if_unreachable(False, ())
    assert placement.client_only and placement.choose_stage(None, None, 1) == 0
    relayed = _placement()
    relayed.take_client_role_if_unreachable(False, ("QmRelay",))  # reached through a relay
    assert not relayed.client_only
    for flags, named in (({"role": "worker"}, "--role worker"), ({"stage": 2}, "--stage 2")):
        with pytest.raises(UsageError, match=named):
            _placement(**flags).take_client_role_if_unreachable(False, ())


def test_a_stage_flag_beyond_the_run_is_refused_and_one_within_it_is_kept():
    from shoal.errors import UsageError

    assert _placement(stage=2).choose_stage(None, None, 1) == 2
    with pytest.raises(UsageError, match="--stage 3: run test-tiny has block stages 1..2"):
        _placement(stage=3).choose_stage(None, None, 1)

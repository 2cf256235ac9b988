"""Stage workers behind real NAT: home routers in network namespaces (iptables MASQUERADE, nothing
forwarded in), every block stage held by a home node reached through relays, a relay killed mid-run.

The lab (tests/helpers/natlab.py) is built from namespaces this test makes; its traffic stays in
them. Where namespaces cannot be made (no root, no iptables) the test skips and says why.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from shoal.run_files import load_run_config
from shoal.train.data import load_token_splits
from shoal.train.reference import ReferenceTrainer
from tests.helpers.natlab import NatLab, unavailable_reason
from tests.helpers.processes import done_event, progress_events, wait_until
from tests.helpers.tiny import write_tiny_run

REASON = unavailable_reason()
pytestmark = [
    pytest.mark.multiprocess,
    pytest.mark.timeout(600),
    pytest.mark.skipif(REASON is not None, reason=f"no NAT lab here: {REASON}"),
]
NAT_RUN = {"train.steps": 100, "averaging.mode": "none", "train.eval_every": 100}


@pytest.fixture
def lab():
    with NatLab(public=3, homes={"A": 1, "B": 1}) as built:
        yield built


def at(host) -> tuple[str, ...]:
    """Listen on the host's own address only (a free port)."""
    return ("--host-maddrs", f"/ip4/{host.ip}/tcp/0")


def test_home_nodes_serve_every_block_stage_through_relays_and_train_as_the_local_trainer(lab, swarm, tmp_path):
    run_file = write_tiny_run(tmp_path, **NAT_RUN)
    run = load_run_config(str(run_file))
    relay0, data_host, relay1 = lab.hosts["public-0"], lab.hosts["public-1"], lab.hosts["public-2"]
    home_a, home_b = lab.hosts["home-A-0"], lab.hosts["home-B-0"]

    first = swarm.start_bootstrap(*at(relay0), "--run-config", str(run_file), prefix=relay0.command())
    second = swarm.start_bootstrap(*at(relay1), "--initial-peers", first.maddrs[0], prefix=relay1.command())
    entries = [first.maddrs[0], second.maddrs[0]]
    assert all(m.startswith("/ip4/11.77.0.") for m in entries), entries

    workers = [swarm.start_node(entries, *at(host), "--stage", str(stage), prefix=host.command(), name=f"home-{stage}")
               for stage, host in ((1, home_a), (2, home_b))]  # fmt: skip
    for worker, host in zip(workers, (home_a, home_b), strict=True):
        log = worker.log()
        # the check names the cause: nobody could dial it, and the address peers saw it come from
        assert "not reachable: " in log and "could not open a connection to this node" in log, log[-3000:]
        assert f"--announce-maddrs /ip4/{lab.router_ip(host.home)}/tcp/" in log, log[-3000:]
        assert "reached through relay(s)" in log, log[-3000:]
        assert sum("/p2p-circuit/" in m for m in worker.maddrs) == 2, worker.maddrs  # both bootstrap peers

    # stage 1's activations reach stage 2 (two homes, two NATs) only through a relay: the one that
    # carried more dies mid-run with its p2pd, and the hops move to the other. Counted from before the
    # data node starts, since on a fast machine its first steps finish while the status below runs.
    before = [lab.wan_bytes(relay0), lab.wan_bytes(relay1)]
    progress = tmp_path / "progress.jsonl"
    swarm.start_node(entries, *at(data_host), "--role", "data", "--relay-service", "--progress-file", str(progress),
                     prefix=data_host.command(), name="data")  # fmt: skip
    status = swarm.status(entries[1], prefix=data_host.command())
    homes = {n["peer_id"]: n for n in status["nodes"] if n["stage"] > 0}
    assert len(homes) == 2 and all(len(n["relays"]) == 2 and n["reachable"] is False for n in homes.values()), homes
    assert [n["relay_service"] for n in status["nodes"] if n["stage"] == 0] == [True]

    wait_until(lambda: len(steps_of(progress)) >= 10, 240, "ten steps through the relays")
    carried = [lab.wan_bytes(relay0) - before[0], lab.wan_bytes(relay1) - before[1]]
    busy = first if carried[0] >= carried[1] else second
    assert max(carried) > 500_000, carried  # the hops between the homes, their stage copies, pings
    steps_before = len(steps_of(progress))
    kill_with_its_libp2p_daemon(busy)
    done = wait_until(lambda: done_event(progress), 360, "the NAT'd swarm to finish training")
    assert run.train.steps - steps_before >= 20, steps_before  # the kill came mid-run

    losses = steps_of(progress)
    reference = ReferenceTrainer(run, load_token_splits(run.data, run.model.vocab_size)).train()
    local = [r.loss for r in reference.history]
    assert len(losses) == len(local) == run.train.steps
    assert max(abs(a - b) for a, b in zip(losses, local, strict=True)) < 0.05
    assert losses == pytest.approx(local, rel=2e-4, abs=2e-4)  # the order of float sums only, as on loopback
    assert done["microbatches_abandoned"] == 0
    assert done["microbatches_completed"] == done["microbatches_injected"] >= run.train.steps * 4

    # the home nodes' records drop the dead relay and keep the live one
    killed = busy.maddrs[0].rsplit("/p2p/", 1)[1]
    survivor = (second if busy is first else first).maddrs[0]
    alive = survivor.rsplit("/p2p/", 1)[1]

    def relays_updated() -> bool:
        nodes = [n for n in swarm.status(survivor, prefix=data_host.command())["nodes"] if n["stage"] > 0]
        return len(nodes) == 2 and all(n["relays"] == [alive] for n in nodes)

    wait_until(relays_updated, 60, f"the home nodes to list only {alive[-8:]}, not {killed[-8:]}", interval_s=2.0)


def kill_with_its_libp2p_daemon(peer) -> None:
    """SIGKILL a peer and the p2pd it started, as a crashed machine loses both (p2pd alone would keep
    relaying until its idle timeout)."""
    children = Path(f"/proc/{peer.pid}/task/{peer.pid}/children").read_text().split()
    for pid in [peer.pid, *map(int, children)]:
        os.kill(pid, signal.SIGKILL)


def steps_of(progress) -> list[float]:
    return [e["loss"] for e in progress_events(progress) if e["event"] == "step"]

"""Two data nodes training one swarm of real daemons, each a shard of the data, routed by GWTF;
each reads its own copy of the data, checked against the run's digest."""

from __future__ import annotations

import json

import pytest

from tests.helpers.processes import done_event, progress_events, wait_until
from tests.helpers.tiny import sample_text, write_tiny_run

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(420)]


def test_two_data_nodes_share_every_replica_and_lose_nothing(swarm, tmp_path):
    """A worker serves both data nodes, whose steps do not line up: it must never step (AdamW, in
    place) while it holds a graph of either's, nor refuse the closes of a data node it serves before
    its view lists it (that stalled the newer data node's next step for two 5 s waits). How GWTF
    shares the routes between replicas is not checked here: its costs take each replica's compute time
    from the speed it claims, and seven processes measuring at once on two cores claim speeds up to 4x
    apart. The second data
    node keeps the corpus at another path (`--data`); a third, with other text, is refused."""
    run_file = write_tiny_run(tmp_path, **{"train.steps": 20, "averaging.mode": "none"})
    entry = swarm.start_bootstrap("--run-config", str(run_file)).maddrs[0]
    copy, other = tmp_path / "elsewhere" / "books.txt", tmp_path / "other.txt"
    copy.parent.mkdir()
    copy.write_bytes((tmp_path / "corpus.txt").read_bytes())
    other.write_text(sample_text(30000, seed=7))
    refused = swarm.start_node([entry], "--role", "data", "--data", str(other), wait=False)
    workers = [swarm.start_node([entry], "--role", "worker", "--stage", str(s), wait=False) for s in (1, 1, 2, 2)]
    for worker in workers:
        swarm.wait_ready(worker)
    progress = [tmp_path / f"progress{k}.jsonl" for k in range(2)]
    data = [swarm.start_node([entry], "--role", "data", "--routing", "gwtf", "--data-shard", f"{k}/2",
                             *(("--data", str(copy)) if k else ()),
                             "--progress-file", str(progress[k]), wait=False) for k in range(2)]  # fmt: skip
    for node in data:
        swarm.wait_ready(node)
    done = [wait_until(lambda path=path: done_event(path), 300, f"data node {path.stem}") for path in progress]
    logs = [node.log() for node in (*workers, *data)]
    wait_until(lambda: not refused.alive, 60, "the data node with other data to exit")
    assert refused.process.returncode == 2 and "Traceback" not in refused.log()
    assert "holds other data (sha256" in refused.log() and "than run 'test-tiny' trains" in refused.log()
    for node in (*data, *workers):
        swarm.stop(node)

    for events, end in zip(map(progress_events, progress), done, strict=True):
        assert end["steps"] == 20 and end["microbatches_abandoned"] == 0, end["abandoned_reasons"]
        assert end["microbatches_completed"] == end["microbatches_injected"]
        assert end["microbatches_resent"] == 0
        assert [e["step"] for e in events if e["event"] == "step"] == list(range(20))
    for log in logs:
        assert "not a data node of this run" not in log  # every close was taken
        assert "no close of step" not in log  # no forward waited for a close that was refused
        assert "modified by an inplace operation" not in log  # no graph outlived a step
        assert "audit of stage" not in log  # replicas that never average are not audited: they drift apart


def _stage_0_distance(entry: str, run, data_peers: list[str]) -> float:
    """‖θ_a − θ_b‖ of two data nodes' stage 0 (embedding, final norm, head), fetched from each live."""
    import asyncio

    from shoal.dht.identity import load_identity
    from shoal.dht.swarm import SwarmDHT
    from shoal.model.stages import build_stage
    from shoal.node.stage.copy import fetch_stage
    from shoal.train.robust import distance

    async def fetch() -> list[list]:
        dht = await SwarmDHT.create(load_identity(None), [entry], client_mode=True)
        try:
            reference = [
                p.detach() for p in build_stage(run.model, run.pipeline.stages, 0, run.train.seed).parameters()
            ]
            return [(await fetch_stage(dht.transport, peer, 0, reference, 30.0)).theta for peer in data_peers]
        finally:
            await dht.shutdown()

    first, second = asyncio.run(fetch())
    return distance(first, second)


def _start_data_node(swarm, entry: str, folder, k: int):
    return swarm.start_node([entry], "--role", "data", "--data-shard", f"{k}/2", "--progress-file",
                            str(folder / f"progress{k}.jsonl"), "--stats-file", str(folder / f"data{k}.json"),
                            wait=False)  # fmt: skip


def test_data_nodes_average_stage_0_gradients_and_step_as_one_where_unaveraged_ones_drift_apart(swarm, tmp_path):
    """Stage 0 (embedding, final norm, LM head) is held by every data node. Under NoLoCo, by default,
    the data nodes average its gradients before every optimizer step and its weights every
    `stage0_resync_every` steps (a float32 exchange): after the same steps on different shards their
    stage 0 is all but the same where, without averaging (a second swarm, `averaging.mode none`), it
    drifts apart. The second data node joins after the first stepped: it copies stage 0 with AdamW's
    moments, steps alone while it catches up with the first (which stepped on meanwhile), then in
    lockstep; the weights' resync takes back what those lone steps set apart."""
    from shoal.run_files import load_run_config

    distances = {}
    for mode in ("none", "noloco"):
        folder = tmp_path / mode
        folder.mkdir()
        settings = {"train.steps": 40, "averaging.mode": mode, "averaging.inner_steps": 4}
        run_file = write_tiny_run(folder, **settings, **{"averaging.stage0_resync_every": 5})
        entry = swarm.start_bootstrap("--run-config", str(run_file)).maddrs[0]
        # slowed (0.05 s a forward), so that the first data node is still training when the second joins
        workers = [swarm.start_node([entry], "--role", "worker", "--stage", str(s), "--inject-forward-delay", "0.05",
                                    wait=False) for s in (1, 2)]  # fmt: skip
        for worker in workers:
            swarm.wait_ready(worker)
        progress = [folder / f"progress{k}.jsonl" for k in range(2)]

        first = _start_data_node(swarm, entry, folder, 0)
        wait_until(lambda p=progress[0]: any(e["event"] == "step" and e["step"] >= 3 for e in progress_events(p)),
                   120, "the first data node's fourth step")  # fmt: skip
        data = [first, _start_data_node(swarm, entry, folder, 1)]  # the second joins a run that has stepped
        for node in data:
            swarm.wait_ready(node)
        done = [wait_until(lambda p=p: done_event(p), 300, f"data node {p.stem} ({mode})") for p in progress]
        assert all(d["microbatches_abandoned"] == 0 for d in done), done
        # a data node that joins after the other stepped copies its stage 0 and goes on from its step
        assert all([e["step"] for e in progress_events(p) if e["event"] == "step"][-1] == 39 for p in progress)
        distances[mode] = _stage_0_distance(entry, load_run_config(str(run_file)), [n.peer_id for n in data])
        for node in (*data, *workers):
            swarm.stop(node)
        engines = [json.loads((folder / f"data{k}.json").read_text())["engine"] for k in range(2)]
        if mode == "noloco":
            assert "AdamW's moments" in data[1].log()  # it copied stage 0 from the first, moments included
            shares = [e["stage0_gradients"] for e in engines]
            print("stage-0 gradient exchanges:", shares)
            joined = [e["step"] for e in progress_events(progress[1]) if e["event"] == "step"][0]
            # behind at first (the other stepped on while it joined), it steps alone until it catches up
            assert all(s["shared"] >= 40 - joined - 8 and not s["refused"] for s in shares), (joined, shares)
            resyncs = [e["averaging"] for e in engines]
            print("stage-0 distance before each resync:", [r["replica_distance"] for r in resyncs])
        else:
            assert all(e["stage0_gradients"] is None for e in engines), engines
    print("stage-0 distance between the data nodes after 40 steps:", distances)
    assert distances["noloco"] < 0.02 * distances["none"], distances

"""Two data nodes training one swarm of real daemons, each a shard of the data, routed by GWTF;
each reads its own copy of the data, checked against the run's digest."""

from __future__ import annotations

import pytest

from tests.helpers.processes import done_event, progress_events, wait_until
from tests.helpers.tiny import sample_text, write_tiny_run

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(420)]


def test_two_data_nodes_share_every_replica_and_lose_nothing(swarm, tmp_path):
    """A worker serves both data nodes, whose steps do not line up: it must never step (AdamW, in
    place) while it holds a graph of either's, nor refuse the closes of a data node it serves before
    its view lists it (that stalled the newer data node's next step for two 5 s waits). How GWTF
    shares the routes between replicas is not checked here: it follows the speeds the workers claim,
    and seven processes measuring at once on two cores claim speeds up to 4x apart. The second data
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

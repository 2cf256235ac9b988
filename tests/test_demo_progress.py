"""Reading a data node's progress file while the node appends to it."""

from __future__ import annotations

import json

from shoal.demo.launcher import ProgressTail, progress_events


def test_each_poll_returns_only_what_was_appended_and_a_line_waits_for_its_newline(tmp_path):
    path = tmp_path / "progress.jsonl"
    tail = ProgressTail(path)
    assert tail.poll() == []  # the node has not written yet
    step0, step1 = json.dumps({"event": "step", "step": 0}), json.dumps({"event": "step", "step": 1})
    with open(path, "a") as f:
        f.write(step0 + "\n" + step1[:9])  # the second line caught halfway through its write
    assert tail.poll() == [{"event": "step", "step": 0}]
    assert progress_events(path) == [{"event": "step", "step": 0}]
    with open(path, "a") as f:
        f.write(step1[9:] + "\n")
    assert tail.poll() == [{"event": "step", "step": 1}]
    assert tail.poll() == []
    assert tail.events == progress_events(path) == [{"event": "step", "step": 0}, {"event": "step", "step": 1}]

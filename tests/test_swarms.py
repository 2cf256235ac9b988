"""Swarms by name (shoal/dht/swarms.py): signed swarm documents, the bundled `public` placeholder, and
joining by name between real processes on loopback.

Run: .venv/bin/python -m pytest tests/test_swarms.py -q
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from hivemind.utils.crypto import RSAPrivateKey

from shoal.dht.swarms import bundled, known_swarms, parse_swarms, resolve_swarm, sign_swarm
from shoal.errors import UsageError
from tests.helpers.processes import wait_until
from tests.helpers.tiny import write_tiny_run

PEER = "/ip4/127.0.0.1/tcp/31337/p2p/QmYM95Q9etkUisXP2sLGTeighcWUkvnsgVYxM3S8PdA7DB"


@pytest.fixture(autouse=True)
def own_config_dir(tmp_path, monkeypatch):
    """Every test reads its own ~/.config/shoal/swarms.d, never the machine's."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))


def _shoal(*argv: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shoal.cli", *argv], capture_output=True, text=True, timeout=timeout)


def test_a_signed_document_round_trips_and_a_changed_one_is_refused():
    key = RSAPrivateKey()
    document = sign_swarm("lab", "our lab's swarm", [PEER], ["tiny"], key)
    (again,) = parse_swarms(document.to_toml(), "lab.toml")
    assert (again.name, again.initial_peers, again.runs, again.key) == ("lab", (PEER,), ("tiny",), document.key)
    elsewhere = PEER.replace("127.0.0.1", "203.0.113.9")
    for tampered in (document.to_toml().replace(PEER, elsewhere), document.to_toml().replace('"tiny"', '"small"'),
                     document.to_toml().replace("placeholder = false", "placeholder = true")):  # fmt: skip
        with pytest.raises(UsageError, match="lab.toml: swarm 'lab' is not signed by the key it names"):
            parse_swarms(tampered, "lab.toml")
    with pytest.raises(UsageError, match="needs exactly name, description"):
        parse_swarms(document.to_toml().replace("runs = ", "runz = "), "lab.toml")
    with pytest.raises(UsageError, match="not of the form"):
        sign_swarm("lab", "", ["/ip4/1.2.3.4/tcp/1"], [], key)


def test_shoal_ships_public_as_a_placeholder_and_keeps_its_name_bound_to_its_key(tmp_path):
    (public,) = bundled()
    assert public.name == "public" and public.placeholder
    assert all(".invalid/" in peer for peer in public.initial_peers)  # resolves nowhere, by RFC 2606
    with pytest.raises(UsageError, match="its initial peers are placeholders until a host runs it"):
        resolve_swarm("public")
    impostor = tmp_path / "public.toml"
    impostor.write_text(sign_swarm("public", "not ours", [PEER], [], RSAPrivateKey()).to_toml())
    with pytest.raises(UsageError, match="but shoal ships 'public' signed by"):
        known_swarms([str(impostor)])
    with pytest.raises(UsageError, match=r"no such swarm here \(known: public\)"):
        resolve_swarm("nope")


def test_swarm_files_in_the_config_dir_are_known_by_name(tmp_path):
    folder = tmp_path / "config" / "shoal" / "swarms.d"
    folder.mkdir(parents=True)
    (folder / "lab.toml").write_text(sign_swarm("lab", "our lab", [PEER], ["tiny"], RSAPrivateKey()).to_toml())
    assert resolve_swarm("lab").initial_peers == (PEER,)
    listed = _shoal("swarms", "--json")
    assert listed.returncode == 0, listed.stderr
    names = {s["name"]: s for s in json.loads(listed.stdout)}
    assert set(names) == {"public", "lab"} and names["public"]["placeholder"] and names["lab"]["runs"] == ["tiny"]
    text = _shoal("swarms")
    assert "public  (PLACEHOLDER: no host yet" in text.stdout and "lab  (1 initial peer(s); runs: tiny" in text.stdout


def test_a_node_given_a_placeholder_or_unknown_swarm_exits_2_in_one_line():
    for name, said in (("public", "placeholders"), ("nope", "no such swarm here")):
        result = _shoal("node", "--swarm", name)
        lines = result.stderr.strip().splitlines()
        assert result.returncode == 2 and len(lines) == 1 and said in lines[0], result.stderr
    both = _shoal("node", "--swarm", "public", "--initial-peers", PEER)
    assert both.returncode == 2 and "not both" in both.stderr


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_a_host_publishes_its_swarm_and_volunteers_join_it_by_name(swarm, tmp_path):
    run_file = write_tiny_run(tmp_path, **{"train.steps": 3})
    document = tmp_path / "lab-swarm.toml"
    swarm.start_bootstrap("--run-config", str(run_file), "--identity", str(tmp_path / "boot.id"),
                          "--publish-swarm", str(document), "--swarm-name", "lab",
                          "--swarm-description", "a test swarm")  # fmt: skip
    wait_until(document.exists, 30, "the swarm document")
    (lab,) = parse_swarms(document.read_text(), str(document))
    assert lab.name == "lab" and lab.runs == ("test-tiny",) and lab.initial_peers[0].startswith("/ip4/127.0.0.1/")

    node = swarm.start_node([], "--swarms", str(document), "--swarm", "lab", "--role", "worker")
    assert node.stage in (1, 2)
    status = _shoal("status", "--swarms", str(document), "--swarm", "lab", "--json")
    assert status.returncode == 0, status.stderr
    assert node.peer_id in {n["peer_id"] for n in json.loads(status.stdout)["nodes"]}
    doctor = _shoal("doctor", "--swarms", str(document), "--swarm", "lab", "--timeout", "3")
    assert doctor.returncode == 0 and doctor.stdout.startswith(f"ok    {lab.initial_peers[0]}: answers"), doctor.stdout

    # a run the swarm does not publish: one line naming what it does publish
    missing = _shoal("node", "--swarms", str(document), "--swarm", "lab", "--run", "nope", "--join-timeout", "10")
    lines = missing.stderr.strip().splitlines()
    assert missing.returncode == 2 and "Traceback" not in missing.stderr, missing.stderr[-2000:]
    assert "no run named 'nope' is published in this swarm" in lines[-1]
    assert "its default run: test-tiny@" in lines[-1] and "swarm lab lists: test-tiny" in lines[-1]

    # the same document with its address changed: refused before anything starts
    tampered = tmp_path / "tampered.toml"
    tampered.write_text(document.read_text().replace("/ip4/127.0.0.1/", "/ip4/127.0.0.2/"))
    refused = _shoal("node", "--swarms", str(tampered), "--swarm", "lab")
    assert refused.returncode == 2 and "is not signed by the key it names" in refused.stderr, refused.stderr


def test_a_bad_file_in_the_config_dir_is_skipped_but_a_bad_file_asked_for_is_refused(tmp_path, caplog):
    folder = tmp_path / "config" / "shoal" / "swarms.d"
    folder.mkdir(parents=True)
    (folder / "good.toml").write_text(sign_swarm("lab", "ours", [PEER], [], RSAPrivateKey()).to_toml())
    (folder / "binary.toml").write_bytes(b"\xff\xfe not text")
    (folder / "broken.toml").write_text("[[swarm]]\nname = 'x'\n")
    assert set(known_swarms()) == {"public", "lab"}
    assert sum("skipping" in r.getMessage() for r in caplog.records) == 2
    with pytest.raises(UsageError, match="cannot read swarm file"):
        known_swarms([str(folder / "binary.toml")])
    with pytest.raises(UsageError, match="without control characters"):
        sign_swarm("lab", "evil\x1b[2J", [PEER], [], RSAPrivateKey())

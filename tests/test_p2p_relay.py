"""Relays, in pure parts: which relays a NAT'd node picks, what its addresses say, what p2pd is told."""

from __future__ import annotations

from shoal.p2p.reachability import tcp_address
from shoal.p2p.relay import RelayPlan, choose_relays, limits_for, relay_of, relays_in
from shoal.planning.relay_limits import FLOOR_DATA_BYTES, TIME_LIMIT_S, relay_limits
from tests.helpers.tiny import tiny_run

RELAY_A = "12D3KooWRelayAaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"
RELAY_B = "12D3KooWRelayBbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb"
HOME = "12D3KooWHomeNodeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeee"


def test_a_circuit_address_names_its_relay_and_is_never_dialed_back_as_ours():
    circuit = f"/ip4/11.77.0.2/tcp/4001/p2p/{RELAY_A}/p2p-circuit/p2p/{HOME}"
    direct = f"/ip4/192.168.1.10/tcp/4002/p2p/{HOME}"
    assert relay_of(circuit) == RELAY_A and relay_of(direct) is None
    other = f"/ip4/11.77.0.3/tcp/4001/p2p/{RELAY_B}/p2p-circuit/p2p/{HOME}"
    assert relays_in([direct, circuit, circuit.replace("tcp/4001", "tcp/4003"), other]) == (RELAY_A, RELAY_B)
    assert tcp_address(circuit) is None  # the reachability check would dial the relay
    assert tcp_address(direct) == ("192.168.1.10", 4002)


def test_relays_are_public_addresses_of_other_peers_one_each_in_order():
    candidates = [
        f"/ip4/127.0.0.1/tcp/31337/p2p/{RELAY_A}",  # loopback: libp2p builds no circuit through it
        f"/ip4/11.77.0.2/tcp/31337/p2p/{RELAY_A}",
        f"/ip4/11.77.0.2/tcp/31338/p2p/{RELAY_A}",  # the same peer again
        f"/ip4/10.0.0.5/tcp/31337/p2p/{RELAY_B}",  # private
        f"/ip4/11.77.0.9/tcp/31337/p2p/{HOME}",  # ourselves
        "/ip4/11.77.0.4/tcp/31337",  # no peer id
        f"/ip4/11.77.0.3/tcp/31337/p2p/{RELAY_B}",
    ]
    assert choose_relays(candidates, HOME) == [
        f"/ip4/11.77.0.2/tcp/31337/p2p/{RELAY_A}",
        f"/ip4/11.77.0.3/tcp/31337/p2p/{RELAY_B}",
    ]
    assert choose_relays(candidates, HOME, limit=1) == [f"/ip4/11.77.0.2/tcp/31337/p2p/{RELAY_A}"]


def test_what_p2pd_is_told():
    direct = RelayPlan()
    assert direct.p2p_options() == {"use_auto_relay": False}
    assert direct.p2pd_flags() == {"relayService": "0"}  # p2pd relays for anyone by default
    relayed = RelayPlan(relays=(f"/ip4/11.77.0.2/tcp/1/p2p/{RELAY_A}",))
    assert relayed.p2p_options() == {"use_auto_relay": True, "force_reachability": "private",
                                     "trusted_relays": [f"/ip4/11.77.0.2/tcp/1/p2p/{RELAY_A}"]}  # fmt: skip
    assert relayed.p2pd_flags() == {"relayService": "0", "relayDiscovery": "0"}
    serving = RelayPlan(serve=relay_limits())
    assert serving.p2pd_flags() == {"relayService": "1", "relayDataLimit": str(FLOOR_DATA_BYTES),
                                    "relayTimeLimit": f"{int(TIME_LIMIT_S)}s"}  # fmt: skip


def test_relay_limits_grow_with_the_run_from_p2pds_floor():
    assert limits_for(None) == relay_limits() and relay_limits().data_bytes == FLOOR_DATA_BYTES
    assert limits_for(tiny_run()).data_bytes == FLOOR_DATA_BYTES  # a toy run stays far below 4 GiB
    long = tiny_run(**{"train.steps": 2_000_000, "train.seq_len": 128, "model.max_seq_len": 128})
    hop = 4 * long.train.microbatch_size * 128 * long.model.d_model
    assert limits_for(long).data_bytes >= 2 * hop * long.microbatches_per_step * 2_000_000
    assert limits_for(long).time_s == TIME_LIMIT_S

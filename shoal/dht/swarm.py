"""One peer's handle on the swarm: its libp2p host, its DHT node and its signing identity.

hivemind's `DHTNode` runs inside our event loop on our `P2P` (no forked DHT process, no pipe hops).
The libp2p host runs on the identity's key, the same key that signs this peer's records, so the
peer id in every record it publishes is checkably its own (see identity.py).
"""

from __future__ import annotations

import asyncio
import logging
import os
import tempfile
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any

from hivemind.dht import DHTNode
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.validation import CompositeValidator
from hivemind.p2p import P2P
from hivemind.utils import get_dht_time

from shoal.config import RunConfig, parse_run_config
from shoal.dht.identity import Identity, peer_id_of
from shoal.dht.keys import DEFAULT_RUN_KEY, nodes_key, run_key
from shoal.dht.records import NodeRecord, RunRecord, load_record, node_info
from shoal.dht.runs import PublishedRun, rank_runs, run_record, verify_claim
from shoal.dht.validator import ShoalRecordValidator, owner_key
from shoal.errors import UsageError
from shoal.model.stages import stage_layers
from shoal.p2p.relay import RelayPlan
from shoal.p2p.stream_relay import RelayingTransport
from shoal.p2p.transport import Libp2pTransport
from shoal.planning.swarm_view import SwarmView, stage_misfit

logger = logging.getLogger(__name__)

LOOPBACK_MADDRS = ("/ip4/127.0.0.1/tcp/0",)
DIRECT = RelayPlan()  # dialed directly, relays for nobody
LIBP2P_START_TRIES = 3
LEFT_OUT_KEPT = 256  # records left out of views that were logged: each is logged once while kept


class _JoinFailed(Exception):
    """The initial peers gave no way into the swarm (this time)."""


async def _start_libp2p(identity: Identity, startup_timeout_s: float, flags: Mapping[str, str], **options: Any) -> P2P:
    """Start the libp2p daemon, with p2pd `flags` beside what `P2P.create` takes. A start that fails
    otherwise than by its initial peers (it ran out of time, or the daemon exited without a word: both
    seen on a 2-core machine shared by eight nodes) is tried again, each try waiting twice as long as
    the one before; the last failure is one clear line."""
    wait_s = startup_timeout_s
    p2p_class = _with_flags(flags)
    for attempt in range(1, LIBP2P_START_TRIES + 1):
        try:
            async with _key_file(identity) as key_path:
                return await p2p_class.create(identity_path=key_path, startup_timeout=wait_s, **options)
        except Exception as e:
            if options.get("initial_peers") and "bootstrap" in str(e):
                raise _JoinFailed("none of them answered") from e
            if attempt == LIBP2P_START_TRIES:
                raise UsageError(f"could not start the libp2p daemon in {attempt} tries (the last waited "
                                 f"{wait_s:.0f} s): {e}; on a machine this busy, start again later") from e  # fmt: skip
            logger.warning("the libp2p daemon did not start (%s): trying again, waiting up to %.0f s",
                           str(e)[:160], 2 * wait_s)  # fmt: skip
            wait_s *= 2
    raise AssertionError("unreachable")


def _with_flags(flags: Mapping[str, str]) -> type[P2P]:
    """hivemind's P2P, starting p2pd with `flags` too (it builds p2pd's arguments from a fixed set)."""
    if not flags:
        return P2P
    extra = dict(flags)

    class P2PWithFlags(P2P):
        @staticmethod
        def _make_process_args(*args: Any, **kwargs: Any) -> list[str]:
            return P2P._make_process_args(*args, **{**kwargs, **extra})

    return P2PWithFlags


@asynccontextmanager
async def _key_file(identity: Identity) -> AsyncIterator[str]:
    """The identity file for the libp2p daemon; an ephemeral key lives in a private file only while
    the daemon starts (it reads the key once, at start)."""
    if identity.path is not None:
        yield identity.path
        return
    with tempfile.TemporaryDirectory(prefix="shoal-id-") as folder:
        path = os.path.join(folder, "identity")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(identity.libp2p_key())
        yield path


def peer_id_of_subkey(subkey: object) -> str:
    """The peer whose key owns a subkey `[owner:<key>]` as the DHT returns it."""
    if not isinstance(subkey, bytes):
        raise ValueError("subkey is not an owner key")
    return peer_id_of(owner_key(subkey))


class SwarmDHT:
    def __init__(self, p2p: P2P, node: DHTNode, identity: Identity):
        self.p2p, self.node, self.identity = p2p, node, identity
        # streams to peers over the same libp2p daemon, to nodes behind NAT through their relays (shoal/p2p)
        self.transport = RelayingTransport(Libp2pTransport(p2p))
        self.owner_subkey = RSASignatureValidator(identity.signing_key).local_public_key
        self._last_expiration: dict[str, float] = {}
        self._claims: dict[str, dict[str, Any]] = {}  # run id -> the claim this peer made, made once
        self._seen: dict[str, tuple[PublishedRun, bool]] = {}  # run id -> its first claim, seen as default?
        self._left_out: dict[tuple[str, str], None] = {}  # (peer id, why) logged, oldest first

    @classmethod
    async def create(
        cls,
        identity: Identity,
        initial_peers: Sequence[str] = (),
        host_maddrs: Sequence[str] = LOOPBACK_MADDRS,
        announce_maddrs: Sequence[str] = (),
        client_mode: bool = False,
        startup_timeout_s: float = 30.0,
        use_relay: bool = True,
        relaying: RelayPlan = DIRECT,
        join_timeout_s: float = 0.0,
        check_identity: bool = True,
    ) -> SwarmDHT:
        """Start libp2p and the DHT node and join through `initial_peers`, trying again with backoff
        for `join_timeout_s` (0: once). A join that never worked raises UsageError with one line per
        initial peer saying what was found there (shoal/dht/diagnose.py)."""
        deadline = time.monotonic() + join_timeout_s
        delay = 1.0
        while True:
            try:
                return await cls._create_once(identity, initial_peers, host_maddrs, announce_maddrs, client_mode,
                                              startup_timeout_s, use_relay, relaying, check_identity)  # fmt: skip
            except _JoinFailed as failed:
                if time.monotonic() + delay >= deadline:
                    cause = failed
                    break
                logger.info("could not join through the initial peers (%s): again in %.0f s", failed, delay)
                await asyncio.sleep(delay)
                delay = min(2 * delay, 8.0)
        from shoal.dht.diagnose import diagnose_all

        verdicts = await diagnose_all(list(initial_peers))
        lines = "\n".join(f"  {v.line()}" for v in verdicts)
        waited = f" in {join_timeout_s:g} s" if join_timeout_s else ""
        raise UsageError(f"could not join the swarm{waited} ({cause}); each initial peer:\n{lines}") from None

    @classmethod
    async def _create_once(
        cls,
        identity: Identity,
        initial_peers: Sequence[str],
        host_maddrs: Sequence[str],
        announce_maddrs: Sequence[str],
        client_mode: bool,
        startup_timeout_s: float,
        use_relay: bool,
        relaying: RelayPlan,
        check_identity: bool,
    ) -> SwarmDHT:
        p2p = await _start_libp2p(
            identity,
            startup_timeout_s,
            relaying.p2pd_flags() if use_relay else {},
            initial_peers=list(initial_peers) or None,
            host_maddrs=list(host_maddrs),
            announce_maddrs=list(announce_maddrs) or None,
            # a key made just now is nobody else's; nor is ours when we restart our own daemon
            check_if_identity_free=check_identity and not identity.created,
            dht_mode="client" if client_mode else "server",
            nat_port_map=False,  # no UPnP multicast onto the local network
            use_relay=use_relay,
            **(relaying.p2p_options() if use_relay else {}),
        )
        try:
            node = await DHTNode.create(
                p2p=p2p,
                initial_peers=list(initial_peers) or None,
                client_mode=client_mode,
                record_validator=CompositeValidator(
                    [RSASignatureValidator(identity.signing_key), ShoalRecordValidator()]
                ),
                ensure_bootstrap_success=True,
                cache_locally=False,  # a stale local copy would hide a peer that crashed
            )
        except Exception as e:
            await p2p.shutdown()
            raise _JoinFailed(f"no DHT answered through them: {str(e).splitlines()[0][:120]}") from e
        if p2p.peer_id.to_base58() != identity.peer_id:  # records would name a peer their key does not own
            await node.shutdown()
            await p2p.shutdown()
            raise AssertionError(f"libp2p runs as {p2p.peer_id}, not as the identity's key {identity.peer_id}")
        return cls(p2p, node, identity)

    @property
    def peer_id(self) -> str:
        return self.p2p.peer_id.to_base58()

    async def visible_maddrs(self, latest: bool = False) -> list[str]:
        """Our addresses; `latest` asks p2pd again (a relayed node's change as relays come and go)."""
        return [str(m) for m in await self.p2p.get_visible_maddrs(latest=latest)]

    def _next_expiration(self, key: str, ttl_s: float) -> float:
        # a store whose expiration is not later than the stored one is refused: always move forward
        expiration = max(get_dht_time() + ttl_s, self._last_expiration.get(key, 0.0) + 1e-3)
        self._last_expiration[key] = expiration
        return expiration

    async def _store(self, key: str, value: dict[str, Any], ttl_s: float) -> bool:
        return bool(await self.node.store(key, value, self._next_expiration(key, ttl_s), subkey=self.owner_subkey))

    async def publish_node(self, record: dict[str, Any], ttl_s: float) -> bool:
        load_record(NodeRecord, record)  # never publish what peers would refuse
        return await self._store(nodes_key(record["run_id"]), record, ttl_s)

    async def publish_run(self, config: RunConfig, ttl_s: float, as_default: bool) -> bool:
        """Claim `config` under its name with this peer's key (once: later calls renew the same claim)."""
        record = self._claims.get(config.run_id)
        if record is None:
            record = self._claims[config.run_id] = run_record(config, self.identity.signing_key, get_dht_time())
        load_record(RunRecord, record)
        return await self._store_run(record, ttl_s, as_default)

    async def _store_run(self, record: dict[str, Any], ttl_s: float, as_default: bool) -> bool:
        stored = await self._store(run_key(record["name"]), record, ttl_s)
        if as_default:
            stored = await self._store(DEFAULT_RUN_KEY, record, ttl_s) and stored
        return stored

    async def republish_run(self, run_id: str, ttl_s: float) -> bool:
        """Keep a run this peer has read alive under this peer's own subkey (the publisher's claim
        unchanged), so that `--run NAME` resolves while any node of the run lives. Renewed at most
        once per half TTL; False when this peer has seen no claim for the run."""
        seen = self._seen.get(run_id)
        if seen is None:
            return False
        run, as_default = seen
        if self._last_expiration.get(run_key(run.config.name), 0.0) - get_dht_time() > ttl_s / 2:
            return True
        return await self._store_run(run.record, ttl_s, as_default)

    async def read_runs(self, name: str | None) -> list[PublishedRun]:
        """Every distinct valid run published under a name (or as the swarm's default), first claim
        first: the order every reader agrees on (runs.py). Remembers them for `republish_run`."""
        found = await self.node.get(run_key(name) if name else DEFAULT_RUN_KEY, latest=True)
        if found is None or not isinstance(found.value, dict):
            return []
        now = get_dht_time()
        published: list[PublishedRun] = []
        for subkey, entry in found.value.items():
            try:
                record = load_record(RunRecord, entry.value)
                config = parse_run_config(record.toml)
                publisher = verify_claim(entry.value)
                holder = peer_id_of_subkey(subkey)
            except Exception as e:
                logger.warning("ignoring an invalid run record: %s", e)
                continue
            if config.run_id == record.run_id and entry.expiration_time > now:
                published.append(PublishedRun(config, publisher, record.published_at, (holder,), entry.value))
        ranked = rank_runs(published)
        for run in ranked:
            old = self._seen.get(run.config.run_id)
            first = run if old is None or run.precedence() < old[0].precedence() else old[0]
            self._seen[run.config.run_id] = (first, name is None or (old is not None and old[1]))
        return ranked

    async def read_view(self, run: RunConfig) -> SwarmView:
        found = await self.node.get(nodes_key(run.run_id), latest=True)
        now = get_dht_time()
        nodes = []
        if found is not None and isinstance(found.value, dict):
            for entry in found.value.values():
                try:
                    record = load_record(NodeRecord, entry.value)
                except Exception as e:
                    logger.warning("ignoring an invalid node record: %s", e)
                    continue
                if record.run_id != run.run_id or entry.expiration_time <= now:
                    continue
                info = node_info(record, entry.expiration_time)
                misfit = stage_misfit(info, run.pipeline.stages)
                if misfit is None:
                    nodes.append(info)
                else:
                    self._leave_out(info.peer_id, misfit)
        nodes.sort(key=lambda n: (n.stage, n.peer_id))
        stages = run.pipeline.stages
        blocks = tuple(len(stage_layers(run.model.n_layers, stages, s)) for s in range(stages))
        return SwarmView(run.run_id, run.pipeline.stages, blocks, tuple(nodes), taken_at=now)

    def _leave_out(self, peer_id: str, why: str) -> None:
        """Say once (per peer and reason, for the last LEFT_OUT_KEPT of them) that a valid record of the
        run is left out of every view: its stage does not fit its role or the run."""
        key = (peer_id, why)
        if key in self._left_out:
            return
        if len(self._left_out) >= LEFT_OUT_KEPT:
            del self._left_out[next(iter(self._left_out))]
        self._left_out[key] = None
        logger.warning("leaving the node record of %s out of the view: %s", peer_id[-8:], why)

    async def shutdown(self) -> None:
        try:
            await self.node.shutdown()
        finally:
            await self.p2p.shutdown()

"""The DiLoCo baseline in the daemon: every H data-node steps, all replicas of a stage all-reduce their
pseudo-gradients θ − φ with hivemind's `DecentralizedAverager`, and each applies DiLoCo's outer
update (shoal/train/outer.py) to the mean.

The comparison with NoLoCo runs against a real all-reduce peer, as the papers' does. hivemind's
averager needs a `hivemind.dht.DHT` (it asks it for a replica of its libp2p host), and the swarm's
own DHT accepts shoal records only, so each replica runs a small averaging DHT of its own and
advertises its addresses in its node record (`averager_maddrs`); a new replica joins the others'
averaging DHT through them. Matchmaking groups the replicas of one stage under a prefix of run and
stage. An all-reduce that does not form or finish within the run's exchange timeout is a local
outer step: a replica never waits on the swarm longer than that.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress

import torch

from shoal.config import AveragingConfig
from shoal.device import float64
from shoal.node.averaging.base import Averager, Replica, outer_codec_name
from shoal.node.compute import BACKWARD
from shoal.node.context import NodeContext
from shoal.planning.swarm_view import SwarmView
from shoal.train.outer import OuterConfig, diloco_step, load_slow_weights, local_step, pseudo_gradient
from shoal.train.robust import norm, remember, screen_mean

logger = logging.getLogger(__name__)

CHILD_KILL_WAIT_S = 2.0

MIN_MATCHMAKING_S = 1.0
STARTUP_TIMEOUT_S = 60.0
SENIOR_WAIT_S = 60.0  # how long a replica looks for the others before averaging with who came


class DiLoCoAverager(Averager):
    @classmethod
    def method_config(cls, averaging: AveragingConfig) -> OuterConfig:
        return OuterConfig.diloco(alpha=averaging.alpha, beta=averaging.beta, inner_steps=averaging.inner_steps)

    def __init__(self, ctx: NodeContext, replica: Replica):
        averaging = ctx.run.averaging
        super().__init__(ctx, replica)
        self.dht = None
        self.averager = None
        self._maddrs: list[str] = []
        self.group_steps = 0
        self.group_sizes: list[int] = []
        self.clipped = 0  # means the robust outer step clipped toward our own pseudo-gradient
        # int8: hivemind's 8-bit uniform quantisation of each part (a byte a value, a 256-float lookup)
        self.codec = outer_codec_name(averaging, replica.stage)

    @property
    def maddrs(self) -> list[str]:
        return self._maddrs

    async def start(self) -> None:
        """Start this replica's averaging DHT and averager, joined to the other replicas' (blocking
        work, done in a thread)."""
        others = await self._seniors_ready()
        initial = [m for n in others for m in n.averager_maddrs]
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, self._create, initial)
        # The averager is a process; hivemind starts it from the main thread and sets SIGINT to be
        # ignored there while it does, so start it here and give the daemon its handler back.
        previous = signal.getsignal(signal.SIGINT)
        try:
            self.averager.start()
        finally:
            signal.signal(signal.SIGINT, previous)
        await loop.run_in_executor(None, self.averager.wait_until_ready, STARTUP_TIMEOUT_S)
        logger.info("[%s] DiLoCo averager for stage %d up (joined %d addresses)",
                    self.ctx.short_id, self.worker.stage, len(initial))  # fmt: skip

    async def _seniors_ready(self) -> list:
        """The other replicas of our stage, once every more senior one advertises its averaging DHT
        (bounded): replicas that start together would otherwise each start a DHT of their own and
        never meet. The most senior starts at once; the others join it."""
        node, stage = self.ctx, self.worker.stage
        me = (node.started_at, node.peer_id)

        def others(view: SwarmView) -> list:
            return [n for n in view.replicas(stage) if n.peer_id != node.peer_id]

        def once_seniors_ready(view: SwarmView) -> list | None:
            seniors = [n for n in others(view) if (n.started_at, n.peer_id) < me]
            return others(view) if all(n.averager_maddrs for n in seniors) else None

        ready = await node.wait_for(once_seniors_ready, SENIOR_WAIT_S, poll_s=0.5, fresh=True)
        return ready if ready is not None else others(await node.refresh_view())

    def _create(self, initial_peers: list[str]) -> None:
        """No target group size: every replica that comes within the matchmaking time is averaged with.
        A target counted from the replicas each one saw at its start differed between replicas (the
        first saw none), and hivemind fails an all-reduce whose group outgrows any member's target:
        with 4 replicas, 45 of 80 outer steps fell back to a local step."""
        from hivemind.averaging import DecentralizedAverager
        from hivemind.compression import NoCompression, Uniform8BitQuantization
        from hivemind.dht import DHT

        self.dht = DHT(initial_peers=initial_peers, host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
        self._maddrs = [str(m) for m in self.dht.get_visible_maddrs()]
        self.averager = DecentralizedAverager(
            [torch.zeros(p.shape, dtype=p.dtype) for p in self.state.phi],  # hivemind averages host tensors
            dht=self.dht,
            prefix=f"shoal_{self.ctx.run.run_id}_stage{self.worker.stage}",
            target_group_size=None,
            min_group_size=2,
            min_matchmaking_time=MIN_MATCHMAKING_S,
            allreduce_timeout=self.timeout_s,
            compression=Uniform8BitQuantization() if self.codec == "int8" else NoCompression(),
            start=False,
        )

    async def _outer_step(self, epoch: int) -> None:
        worker = self.worker
        delta = await worker.compute(pseudo_gradient, self.state, worker.module, priority=BACKWARD)
        started = time.monotonic()
        alone = await self._alone()
        mean = None
        if not alone:
            mean = await asyncio.get_running_loop().run_in_executor(None, self._all_reduce, self._outgoing(delta))
        if mean is None:
            why = "no other replica of the stage" if alone else "no all-reduce group in time"
            logger.info("[%s] epoch %d: %s; local outer step", self.ctx.short_id, epoch, why)
            self.state = local_step(self.state, delta, self.config)
            self.local_steps += 1
        else:
            self.exchange_s.append(time.monotonic() - started)
            mean = self._screened(epoch, delta, mean)
            self.state = diloco_step(self.state, mean, self.config)
            self.group_steps += 1
        await worker.compute(load_slow_weights, worker.module, self.state, priority=BACKWARD)
        self.epoch = epoch

    async def _alone(self) -> bool:
        """Whether a fresh view shows no other replica of our stage. Matchmaking would look for a group
        until the exchange timeout, and the data node's next step waits for our outer step: a stage
        with one replica stalled the pipeline 10 s at every outer step."""
        try:
            view = await self.ctx.refresh_view()
        except Exception as e:
            logger.info("[%s] could not refresh the view (%r): trying the all-reduce", self.ctx.short_id, e)
            return False
        return not any(n.peer_id != self.ctx.peer_id for n in view.replicas(self.worker.stage))

    def _all_reduce(self, delta: list[torch.Tensor]) -> list[torch.Tensor] | None:
        """Put our Δ in, average with whoever matched, and read the mean (None if no group formed).

        Bounded throughout: an all-reduce that outlived our wait for it keeps the averager's tensors
        locked until hivemind's own timeout ends it, and waiting on that lock without a bound once held
        a replica's outer step, and with it the whole pipeline, for good."""
        if self.averager is None:
            return None
        with self._tensors() as tensors:
            if tensors is None:
                return None
            for slot, value in zip(tensors, delta, strict=True):
                slot.copy_(value)
        control = None
        try:
            control = self.averager.step(timeout=self.timeout_s, wait=False)
            gathered = control.result(timeout=self.timeout_s + MIN_MATCHMAKING_S + 5)
        except Exception as e:
            logger.info("[%s] all-reduce failed: %r", self.ctx.short_id, e)
            if control is not None:
                with suppress(Exception):  # it may have ended on its own meanwhile
                    control.cancel()
            return None
        if not gathered:
            return None
        self.group_sizes.append(len(gathered))
        with self._tensors() as tensors:
            return None if tensors is None else [t.detach().clone() for t in tensors]

    @contextmanager
    def _tensors(self) -> Iterator[Sequence[torch.Tensor] | None]:
        """The averager's tensors, or None when an earlier all-reduce still holds them past our timeout."""
        assert self.averager is not None
        lock = self.averager.lock_averaged_tensors
        if not lock.acquire(timeout=self.timeout_s):
            logger.info("[%s] the averager's tensors are still held by an earlier all-reduce", self.ctx.short_id)
            yield None
            return
        try:
            yield self.averager._averaged_tensors
        finally:
            lock.release()

    async def stop(self) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self._shutdown)

    def _shutdown(self) -> None:
        """Shut the averager and its DHT down, each a child process; one still alive after hivemind's
        own grace period (a DHT child was once seen looping on a vanished resource-sharer socket,
        keeping its node from exiting) is killed, so that stopping the node is bounded."""
        for part in (self.averager, self.dht):
            if part is None:
                continue
            try:
                part.shutdown()
            except Exception as e:
                logger.debug("[%s] averaging shutdown: %r", self.ctx.short_id, e)
            if part.is_alive():
                logger.warning("[%s] %s did not stop: killing it", self.ctx.short_id, type(part).__name__)
                part.kill()
                part.join(CHILD_KILL_WAIT_S)

    def stats(self) -> dict:
        return {
            "mode": "diloco",
            "outer_epoch": self.epoch,
            "group_steps": self.group_steps,
            "local_steps": self.local_steps,
            "group_sizes": self.group_sizes,
            "exchange_s": [round(t, 4) for t in self.exchange_s],
            "codec": self.codec,
            "bytes_per_exchange": self.bytes_per_exchange,
            "phi_checksum": float(sum(float(float64(p).sum()) for p in self.state.phi)),
            "clipped": self.clipped,
        }

    @property
    def bytes_per_exchange(self) -> int:
        """What one replica sends of its Δ in an all-reduce (hivemind's parts' framing aside)."""
        numel = sum(p.numel() for p in self.state.phi)
        return numel + 4 * 256 * len(self.state.phi) if self.codec == "int8" else 4 * numel

    def _outgoing(self, delta: list[torch.Tensor]) -> list[torch.Tensor]:
        """What we put into the all-reduce: our Δ, or what an experiment's hostile replica makes of it."""
        return self.worker.hooks.outer(list(self.state.phi), delta)[1]

    def _screened(self, epoch: int, delta: list[torch.Tensor], mean: list[torch.Tensor]) -> list[torch.Tensor]:
        """The all-reduced mean, clipped toward our own Δ if it is far outside what we have seen (the
        robust outer step, shoal/train/robust.py: a mean cannot be refused per partner)."""
        if not self.robust:
            return mean
        mean, verdict = screen_mean(delta, mean, self.history, self.tolerance)
        if not verdict.accepted:
            self.clipped += 1
            logger.warning("[%s] epoch %d: %s", self.ctx.short_id, epoch, verdict.reason)
        self.history = remember(self.history, norm(delta), verdict, self.window)
        return mean

"""Forward passes whose output comes home as it is, instead of into a loss: what audits (auditor.py)
and probes (probes.py) see of the swarm's model."""

from __future__ import annotations

import asyncio
import logging
import secrets

import torch

from shoal.device import to_device, to_host
from shoal.node.compute import BACKGROUND, FORWARD
from shoal.node.context import NodeContext
from shoal.node.pipeline.base import PipelineEngine
from shoal.node.pipeline.data.attempts import InFlight, Outcome
from shoal.node.pipeline.hops import HopFailed
from shoal.node.rpcs import EngineRpcs
from shoal.protocol.pipeline import ForwardRequest, Hop

logger = logging.getLogger(__name__)


class Captures:
    """`in_flight` is the data node's table of attempts (attempts.py): a capture's activation comes
    home through the same `rpc_forward` handler as a training one."""

    def __init__(self, ctx: NodeContext, hops: PipelineEngine, head: torch.nn.Module, in_flight: dict[str, InFlight]):
        self.ctx, self.hops, self.head, self.in_flight = ctx, hops, head, in_flight

    async def embed(self, tokens: torch.Tensor, priority: int = BACKGROUND) -> torch.Tensor:
        """(B, T) -> (B, T, C): the embedding of `tokens`, without a graph, on the compute thread."""
        return await self.hops.compute(self._embed, tokens, priority=priority)

    @torch.no_grad()
    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head.embed(to_device(tokens, self.hops.device))

    async def top_predictions(self, x: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """(B, T): the LM head's top token at each position of the last block's output `x` (B, T, C)."""
        return await self.hops.compute(self._top_predictions, x, tokens, priority=FORWARD)

    @torch.no_grad()
    def _top_predictions(self, x: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        return to_host(self.head.logits(x, to_device(tokens, self.hops.device)).argmax(-1))

    async def forward_through(
        self, hops: tuple[tuple[int, str], ...], x: torch.Tensor, tokens: torch.Tensor, tag: str
    ) -> torch.Tensor | None:
        """An evaluation forward of `x` (B, T, C), the activation of `tokens` (B, T), through exactly
        these (stage, peer) hops, whose output comes home as it is instead of into a loss; None if it
        did not come. No re-routing: an audit must hear from the replica it names."""
        wire_id = f"{self.ctx.short_id}-{tag}#{secrets.token_hex(16)}"
        done = asyncio.get_running_loop().create_future()
        blank = torch.zeros(x.shape[:2], dtype=torch.long, device=x.device)  # no targets: only the shape is checked
        peers, stages = tuple(p for _, p in hops), tuple(s for s, _ in hops)
        entry = InFlight(tag, x, blank, 1.0, done, route_peers=peers, route_stages=stages, capture=True)
        self.in_flight[wire_id] = entry
        route = tuple(Hop(stage=s, peer_id=p) for s, p in hops)
        request = ForwardRequest(microbatch_id=wire_id, origin=self.ctx.peer_id, step=-1, hop=0, route=route,
                                 needs_backward=False, tokens=self.hops.pack_tokens(tokens))  # fmt: skip
        try:
            await self.hops.send(peers[0], EngineRpcs.forward, request, x)
            ending = await asyncio.wait_for(asyncio.shield(done), self.ctx.config.limits.microbatch_timeout_s)
        except (HopFailed, TimeoutError) as e:
            logger.info("[%s] %s through %s did not come home: %s", self.ctx.short_id, tag,
                        [p[-8:] for p in peers], e)  # fmt: skip
            return None
        finally:
            self.in_flight.pop(wire_id, None)
        return entry.output if ending.outcome is Outcome.COMPLETED else None

"""What a stage worker tells a data node unasked: that one of its microbatches cannot go on
(`AbandonNotice`), and who took a hop that its route did not name (`RouteNote`). Both are best
effort: a data node that does not hear them finds out by its own timeouts."""

from __future__ import annotations

import logging

from shoal.node.context import NodeContext
from shoal.node.engine import AbandonReason
from shoal.protocol.pipeline import AbandonNotice, BackwardRequest, ForwardRequest, RouteNote

logger = logging.getLogger(__name__)


async def notify_abandon(ctx: NodeContext, origin: str, microbatch_id: str, reason: str, kind: AbandonReason) -> None:
    logger.warning("[%s] %s cannot go on: %s", ctx.short_id, microbatch_id, reason)
    try:
        notice = AbandonNotice(microbatch_id=microbatch_id, reason=reason[:200], kind=kind.value)
        await ctx.rpc.abandon(origin, notice, timeout_s=ctx.config.network.rpc_timeout_s)
    except Exception as e:
        logger.info("[%s] could not tell %s: %s", ctx.short_id, origin[-8:], e)


async def note_route(ctx: NodeContext, delivered: ForwardRequest | BackwardRequest) -> None:
    """Tell the data node who took hop `delivered.hop`, which its route did not name (RouteNote): the
    next hop of a forward, or the stand-in that redoes a lost hop in backward."""
    hop = delivered.route[delivered.hop]
    note = RouteNote(microbatch_id=delivered.microbatch_id, hop=delivered.hop, stage=hop.stage, peer_id=hop.peer_id)
    try:
        await ctx.rpc.route_note(delivered.origin, note, timeout_s=5.0)
    except Exception as e:
        logger.info("[%s] route note for %s: %s", ctx.short_id, delivered.microbatch_id, e)

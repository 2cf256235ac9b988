"""`--probe-file`: fixed inputs run through the swarm's model after training, counting the rows whose
top prediction at a position is the token expected there (e.g. a backdoor's trigger and target,
shoal.adversary.backdoor.write_probes)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from shoal.errors import UsageError
from shoal.node.compute import FORWARD
from shoal.node.context import NodeContext
from shoal.node.pipeline.data.captures import Captures
from shoal.node.pipeline.data.routes import DataRoutes

if TYPE_CHECKING:
    from shoal.config import RunConfig

MAX_PROBES = 4096
TRIES = 3  # routes a probe microbatch is sent along before it counts as unanswered


def read_probes(path: str, run: RunConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A probe file (a local file the operator gives, checked anyway): token rows (N, T), and per row
    a position and the token expected after it."""
    try:
        data = json.loads(Path(path).read_text())
        tokens = torch.tensor(data["tokens"], dtype=torch.long)
        positions = torch.tensor(data["positions"], dtype=torch.long)
        targets = torch.tensor(data["targets"], dtype=torch.long)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UsageError(f"--probe-file {path}: {e}") from None
    vocab, seq = run.model.vocab_size, run.model.max_seq_len
    ok = (
        tokens.dim() == 2
        and 1 <= len(tokens) <= MAX_PROBES
        and 1 <= tokens.shape[1] <= seq
        and positions.shape == targets.shape == (len(tokens),)
        and bool(((tokens >= 0) & (tokens < vocab)).all() and ((targets >= 0) & (targets < vocab)).all())
        and bool(((positions >= 0) & (positions < tokens.shape[1])).all())
    )
    if not ok:
        raise UsageError(f"--probe-file {path}: needs 1..{MAX_PROBES} rows of at most {seq} tokens below {vocab}, "
                         "and one position within its row and one target per row")  # fmt: skip
    return tokens, positions, targets


async def run_probes(path: str, ctx: NodeContext, routes: DataRoutes, captures: Captures) -> dict:
    """The probes through the swarm's model as `routes` route it: how many came home, how many hit."""
    tokens, positions, targets = read_probes(path, ctx.run)
    size = ctx.run.train.microbatch_size
    slots = asyncio.Semaphore(ctx.max_inflight)

    async def one(rows: torch.Tensor, at: torch.Tensor, want: torch.Tensor) -> torch.Tensor | None:
        async with slots:
            x = await captures.embed(rows, priority=FORWARD)
            for _ in range(TRIES):
                routed = await routes.next(train=False)
                if routed is None:
                    return None
                try:
                    y = await captures.forward_through(routed.hops, x, rows, "probe")
                finally:
                    ctx.router.end(routed)
                if y is not None:
                    top = await captures.top_predictions(y, rows)  # (B, T)
                    return top[torch.arange(len(at)), at] == want
            return None

    parts = zip(tokens.split(size), positions.split(size), targets.split(size), strict=True)
    answers = [a for a in await asyncio.gather(*(one(*part) for part in parts)) if a is not None]
    hits = sum(int(a.sum()) for a in answers)
    answered = sum(len(a) for a in answers)
    return {"probes": len(tokens), "answered": answered, "hits": hits, "share": hits / max(answered, 1)}

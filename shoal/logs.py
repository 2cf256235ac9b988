"""Log lines a peer cannot forge: every message is made printable before it is written.

Peers choose strings that end up in our logs (microbatch ids, refusal reasons, error texts). One
carrying a newline, a carriage return or an ANSI escape could forge whole log lines or repaint a
terminal, so the formatter escapes control characters in the message itself. Tracebacks, which
this process wrote, keep their lines.
"""

from __future__ import annotations

import logging

_ESCAPES = {i: f"\\x{i:02x}" for i in [*range(0x20), 0x7F]} | {ord("\n"): "\\n", ord("\r"): "\\r", ord("\t"): "\\t"}


def printable(text: str, limit: int | None = None) -> str:
    """`text` with control characters (C0, DEL, and the C1 range ANSI uses) escaped, cut to `limit`."""
    cleaned = text.translate(_ESCAPES)
    if any(0x80 <= ord(c) < 0xA0 for c in cleaned):
        cleaned = "".join(f"\\x{ord(c):02x}" if 0x80 <= ord(c) < 0xA0 else c for c in cleaned)
    return cleaned if limit is None or len(cleaned) <= limit else cleaned[: max(limit - 1, 0)] + "…"


class SafeFormatter(logging.Formatter):
    def formatMessage(self, record: logging.LogRecord) -> str:  # noqa: N802 (logging's name)
        record.message = printable(record.message)
        return super().formatMessage(record)


def configure(level: int) -> None:
    """Logging for a shoal process: one stderr handler whose messages are made printable."""
    handler = logging.StreamHandler()
    handler.setFormatter(SafeFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=level, handlers=[handler])

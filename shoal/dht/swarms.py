"""Swarms by name: a small signed document that says how to join a swarm.

A swarm document names the swarm, describes it, lists its initial peers (`/dns4/…`, `/dns6/…`,
`/ip4/…`, `/ip6/…` multiaddresses) and the runs it hosts, and carries the public key of its host and
that key's signature over all of it. A host writes one with `shoal bootstrap --publish-swarm FILE`
and hands it out; a volunteer drops it in `~/.config/shoal/swarms.d/` (or passes `--swarms FILE`) and
joins with `--swarm NAME`. shoal ships `swarms.toml` (package data) with the `public` swarm.

What the signature buys: a document whose peers or runs were changed after signing is refused; and a
name shoal ships stays bound to the key it ships with, so a dropped-in file cannot take `public`
over. It does not make a host honest: it says who vouches for the addresses, nothing more.

    [[swarm]]
    name = "public"
    description = "..."
    initial_peers = ["/dns4/bootstrap.example.org/tcp/31337/p2p/Qm..."]
    runs = ["tiny"]
    placeholder = false          # true: the addresses are not a real host's yet
    key = "ssh-rsa AAAA..."
    signature = "..."
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import tomllib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from shoal.errors import UsageError

logger = logging.getLogger(__name__)

NAME = re.compile(r"[a-z0-9][a-z0-9._-]{0,63}")
PEER = re.compile(r"/(ip4|ip6|dns4|dns6)/[A-Za-z0-9.:_-]{1,253}/tcp/\d{1,5}/p2p/[1-9A-HJ-NP-Za-km-z]{32,64}")
TEXT = re.compile(r"[^\x00-\x1f\x7f]*")  # a description: one line, no control characters
RUN_NAME = re.compile(r"[A-Za-z0-9._@:-]{1,128}")
FIELDS = ("name", "description", "initial_peers", "runs", "placeholder", "key", "signature")
MAX_PEERS = 32
MAX_RUNS = 64
_DOMAIN = b"shoal swarm document\x00"  # what is signed is never a run claim or a DHT record


@dataclass(frozen=True)
class SwarmDocument:
    name: str
    description: str
    initial_peers: tuple[str, ...]
    runs: tuple[str, ...]
    placeholder: bool
    key: str  # the host's RSA public key, OpenSSH form
    signature: str
    source: str = ""  # where it was read from (not signed)

    @property
    def fingerprint(self) -> str:
        """A short name for the signing key: the first 16 hex digits of its SHA-256."""
        return hashlib.sha256(self.key.encode()).hexdigest()[:16]

    def to_toml(self) -> str:
        def text(value: str) -> str:
            return json.dumps(value)  # a TOML basic string is a JSON string

        return (
            "[[swarm]]\n"
            f"name = {text(self.name)}\n"
            f"description = {text(self.description)}\n"
            f"initial_peers = [{', '.join(text(p) for p in self.initial_peers)}]\n"
            f"runs = [{', '.join(text(r) for r in self.runs)}]\n"
            f"placeholder = {'true' if self.placeholder else 'false'}\n"
            f"key = {text(self.key)}\n"
            f"signature = {text(self.signature)}\n"
        )


def _payload(name: str, description: str, peers: Sequence[str], runs: Sequence[str], placeholder: bool) -> bytes:
    body = {"name": name, "description": description, "initial_peers": list(peers), "runs": list(runs),
            "placeholder": placeholder}  # fmt: skip
    return _DOMAIN + json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def sign_swarm(
    name: str, description: str, initial_peers: Sequence[str], runs: Sequence[str], key, placeholder: bool = False
) -> SwarmDocument:
    """A swarm document signed by `key` (a hivemind RSAPrivateKey: a bootstrap peer's identity)."""
    peers, run_names = tuple(initial_peers), tuple(runs)
    public = key.get_public_key().to_bytes().decode()
    signature = key.sign(_payload(name, description, peers, run_names, placeholder)).decode()
    document = SwarmDocument(name, description, peers, run_names, placeholder, public, signature)
    _check_fields(document, "the new swarm document")
    return document


def valid_peer_maddr(maddr: str) -> bool:
    """Whether `maddr` is a multiaddress a node can join through: /ip4|ip6|dns4|dns6/HOST/tcp/PORT/p2p/ID."""
    return PEER.fullmatch(maddr) is not None and 0 < int(maddr.split("/")[4]) < 65536


def check_name_and_description(name: str, description: str) -> None:
    """What a host chooses for its swarm, checked before its bootstrap peer starts (UsageError)."""
    _check_fields(SwarmDocument(name, description, (_EXAMPLE_PEER,), (), False, "", ""), "--publish-swarm")


_EXAMPLE_PEER = "/ip4/127.0.0.1/tcp/1/p2p/QmYM95Q9etkUisXP2sLGTeighcWUkvnsgVYxM3S8PdA7DB"


def _check_fields(d: SwarmDocument, where: str) -> None:
    def refuse(field: str, why: str) -> None:
        raise UsageError(f"{where}: swarm {d.name!r}: {field} {why}")

    if NAME.fullmatch(d.name) is None:
        refuse("name", "must be 1-64 of a-z, 0-9, '.', '_', '-', starting with a letter or digit")
    if len(d.description) > 500 or TEXT.fullmatch(d.description) is None:
        refuse("description", "must be one line of at most 500 characters, without control characters")
    if not 1 <= len(d.initial_peers) <= MAX_PEERS:
        refuse("initial_peers", f"must list 1 to {MAX_PEERS} multiaddresses")
    for peer in d.initial_peers:
        if not valid_peer_maddr(peer):
            refuse("initial_peers", f"has {peer!r}, not of the form /ip4|ip6|dns4|dns6/HOST/tcp/PORT/p2p/PEER_ID")
    if len(d.runs) > MAX_RUNS:
        refuse("runs", f"must list at most {MAX_RUNS} run names")
    for run in d.runs:
        if RUN_NAME.fullmatch(run) is None:
            refuse("runs", f"has {run[:40]!r}, not a run name (letters, digits and . _ @ : -)")


def verify(d: SwarmDocument, where: str) -> SwarmDocument:
    """`d` if its fields are well formed and its signature is its key's over them; else UsageError."""
    from hivemind.utils.crypto import RSAPublicKey

    _check_fields(d, where)
    try:
        public = RSAPublicKey.from_bytes(d.key.encode())
        good = public.verify(_payload(d.name, d.description, d.initial_peers, d.runs, d.placeholder),
                             d.signature.encode())  # fmt: skip
    except Exception:
        good = False
    if not good:
        raise UsageError(f"{where}: swarm {d.name!r} is not signed by the key it names (changed after signing?)")
    return d


def parse_swarms(text: str, where: str) -> list[SwarmDocument]:
    """Every `[[swarm]]` of a swarm file, each checked and its signature verified."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise UsageError(f"{where}: not TOML ({e})") from None
    entries = data.get("swarm")
    if set(data) != {"swarm"} or not isinstance(entries, list) or not entries:
        raise UsageError(f"{where}: a swarm file holds [[swarm]] tables and nothing else")
    documents = []
    for entry in entries:
        if not isinstance(entry, dict) or set(entry) != set(FIELDS):
            missing = sorted(set(FIELDS) - set(entry)) if isinstance(entry, dict) else list(FIELDS)
            extra = sorted(set(entry) - set(FIELDS)) if isinstance(entry, dict) else []
            raise UsageError(f"{where}: a [[swarm]] needs exactly {', '.join(FIELDS)}"
                             f"{'; missing ' + ', '.join(missing) if missing else ''}"
                             f"{'; unknown ' + ', '.join(extra) if extra else ''}")  # fmt: skip
        strings = ("name", "description", "key", "signature")
        lists = ("initial_peers", "runs")
        if (
            not all(isinstance(entry[k], str) for k in strings)
            or not isinstance(entry["placeholder"], bool)
            or not all(isinstance(entry[k], list) and all(isinstance(v, str) for v in entry[k]) for k in lists)
        ):
            raise UsageError(f"{where}: a [[swarm]]'s fields have the wrong types (strings, lists of strings, a bool)")
        document = SwarmDocument(entry["name"], entry["description"], tuple(entry["initial_peers"]),
                                 tuple(entry["runs"]), entry["placeholder"], entry["key"], entry["signature"],
                                 source=where)  # fmt: skip
        documents.append(verify(document, where))
    return documents


def config_dir() -> Path:
    """Where a user's swarm files live: $XDG_CONFIG_HOME/shoal/swarms.d (default ~/.config/shoal/swarms.d)."""
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "shoal" / "swarms.d"


def bundled() -> list[SwarmDocument]:
    text = resources.files("shoal").joinpath("swarms.toml").read_text()
    return parse_swarms(text, "shoal's bundled swarms.toml")


def known_swarms(extra_files: Iterable[str] = ()) -> dict[str, SwarmDocument]:
    """Every swarm shoal knows, by name: the bundled ones, then the user's `swarms.d/*.toml` (sorted),
    then each `--swarms FILE`; a later file's swarm replaces an earlier one of the same name, except
    that a bundled name keeps its bundled key (a file signed by another key is refused)."""
    found: dict[str, SwarmDocument] = {}
    shipped = {d.name: d for d in bundled()}
    found.update(shipped)
    folder = config_dir()
    mine = sorted(folder.glob("*.toml")) if folder.is_dir() else []
    for path, given in [*((p, False) for p in mine), *((Path(p), True) for p in extra_files)]:
        try:
            documents = parse_swarms(_read(path), str(path))
            for document in documents:
                ours = shipped.get(document.name)
                if ours is not None and ours.key != document.key:
                    theirs, shipped_key = document.fingerprint, ours.fingerprint
                    raise UsageError(f"{path}: swarm {document.name!r} is signed by key {theirs}, but shoal ships "
                                     f"{document.name!r} signed by {shipped_key}: refused")  # fmt: skip
        except UsageError as e:
            if given:  # a file asked for by name: its fault is the user's answer
                raise
            logger.warning("skipping %s: %s", path, e)  # one bad file in swarms.d does not block the others
            continue
        for document in documents:
            earlier = found.get(document.name)
            if earlier is not None and earlier.key != document.key:
                logger.warning("swarm %r from %s (key %s) replaces the one from %s (key %s)", document.name, path,
                               document.fingerprint, earlier.source, earlier.fingerprint)  # fmt: skip
            found[document.name] = document
    return found


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        why = getattr(e, "strerror", None) or str(e)
        raise UsageError(f"cannot read swarm file {path} ({why})") from None


def resolve_swarm(name: str, extra_files: Iterable[str] = ()) -> SwarmDocument:
    """The swarm called `name`, ready to join; UsageError naming the known ones, or saying that its
    addresses are placeholders."""
    swarms = known_swarms(extra_files)
    document = swarms.get(name)
    if document is None:
        raise UsageError(f"--swarm {name}: no such swarm here (known: {', '.join(sorted(swarms))}); add its file "
                         f"to {config_dir()} or pass --swarms FILE")  # fmt: skip
    if document.placeholder:
        raise UsageError(f"--swarm {name}: its initial peers are placeholders until a host runs it "
                         "(docs/deploy.md); join a host's swarm with its file (--swarms FILE) or "
                         "--initial-peers")  # fmt: skip
    return document


def initial_peers_from(
    initial_peers: Sequence[str], swarm: str | None, swarm_files: Iterable[str] = ()
) -> tuple[tuple[str, ...], SwarmDocument | None]:
    """Whom to dial first: `--initial-peers`, or the peers of the swarm `--swarm` names (its document
    is then the only place they come from), with that document."""
    if swarm is None:
        return tuple(initial_peers), None
    if initial_peers:
        raise UsageError("give --swarm NAME or --initial-peers MADDR, not both")
    document = resolve_swarm(swarm, swarm_files)
    return document.initial_peers, document

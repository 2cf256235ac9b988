"""The default training corpus: public-domain and BSD English text from Debian packages.

- bible-kjv    King James Bible (public domain), ~4.3 MB, dumped by `bible gen1:1-rev22:21`
- fortunes     the fortune cookie files (BSD licence), ~2.5 MB under /usr/share/games/fortunes
- jargon-text  the Jargon File 4.x (public domain), ~1.7 MB, /usr/share/doc/jargon-text/jargon.txt.gz

Nothing is downloaded at run time and no third-party text is committed: `make demo` installs the
packages (`apt-get install bible-kjv fortunes jargon-text`), and `--data PATH` takes any text.
The assembled corpus is cached (atomically) so later runs read one file.
"""

from __future__ import annotations

import gzip
import os
import shutil
import subprocess
from pathlib import Path

from shoal.errors import UsageError
from shoal.files import atomic_write

FORTUNES_DIR = Path("/usr/share/games/fortunes")
JARGON_FILE = Path("/usr/share/doc/jargon-text/jargon.txt.gz")
INSTALL_HINT = "sudo apt-get install bible-kjv fortunes jargon-text"


def cache_dir() -> Path:
    root = os.environ.get("SHOAL_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "shoal")
    path = Path(root)
    path.mkdir(parents=True, exist_ok=True)
    return path


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write to a temporary name in the same folder and rename, so readers never see half a file."""
    atomic_write(path, data)


def _bible_text() -> str | None:
    if shutil.which("bible") is None:
        return None
    result = subprocess.run(["bible", "gen1:1-rev22:21"], capture_output=True, timeout=60)
    return result.stdout.decode("utf-8", errors="replace") if result.returncode == 0 else None


def _fortunes_text() -> str | None:
    if not FORTUNES_DIR.is_dir():
        return None
    parts = []
    for path in sorted(FORTUNES_DIR.iterdir()):
        # plain cookie files only: .dat are indexes, .u8 are re-encoded duplicates
        if path.is_file() and not path.is_symlink() and path.suffix == "":
            text = path.read_bytes().decode("utf-8", errors="replace")
            parts.append("\n".join(line for line in text.splitlines() if line.strip() != "%"))
    return "\n\n".join(parts) or None


def _jargon_text() -> str | None:
    if not JARGON_FILE.is_file():
        return None
    return gzip.decompress(JARGON_FILE.read_bytes()).decode("utf-8", errors="replace")


def default_corpus_sources() -> dict[str, str]:
    sources = {"bible-kjv": _bible_text(), "fortunes": _fortunes_text(), "jargon-text": _jargon_text()}
    return {name: text for name, text in sources.items() if text}


def default_corpus_path() -> Path:
    """The cached default corpus, assembled on first use from the installed Debian packages."""
    path = cache_dir() / "default-corpus.txt"
    if path.exists():
        return path
    sources = default_corpus_sources()
    if not sources:
        raise UsageError(f"the default corpus is not installed; run `{INSTALL_HINT}` or pass --data PATH")
    atomic_write_bytes(path, "\n\n".join(sources[name] for name in sorted(sources)).encode("utf-8"))
    return path

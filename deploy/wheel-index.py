"""Serve a folder of wheels as a PEP 503 simple index on loopback, for `podman build --network=host`.

    python3 deploy/wheel-index.py /opt/wheels [--port 0] [--port-file FILE]

It prints the index URL (http://127.0.0.1:PORT/simple) once it listens, or writes it to --port-file,
and serves until killed. Each project page links its wheels with their SHA-256, so pip checks what it
downloads. The Dockerfile's TORCH_INDEX build argument takes the URL: with `--index-url` pip consults
that index alone for torch, so the build gets the wheel that lies here (the CPU build) and nothing
from PyPI can win by a higher version string.
"""

from __future__ import annotations

import argparse
import hashlib
import html
import http.server
import re
import sys
import tempfile
from pathlib import Path


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def build_tree(wheels: Path, root: Path) -> list[str]:
    """Write simple/index.html, simple/<project>/index.html and files/ (links to the wheels) under root."""
    files = root / "files"
    files.mkdir()
    projects: dict[str, list[str]] = {}
    for wheel in sorted(wheels.glob("*.whl")):
        (files / wheel.name).symlink_to(wheel.resolve())
        with wheel.open("rb") as f:
            digest = hashlib.file_digest(f, "sha256").hexdigest()
        href = f"../../files/{html.escape(wheel.name)}#sha256={digest}"
        projects.setdefault(normalize(wheel.name.split("-")[0]), []).append(f'<a href="{href}">{wheel.name}</a>')
    simple = root / "simple"
    simple.mkdir()
    links = "".join(f'<a href="{p}/">{p}</a><br>\n' for p in sorted(projects))
    (simple / "index.html").write_text(f"<!DOCTYPE html><html><body>\n{links}</body></html>\n")
    for project, anchors in projects.items():
        (simple / project).mkdir()
        body = "<br>\n".join(anchors)
        (simple / project / "index.html").write_text(f"<!DOCTYPE html><html><body>\n{body}\n</body></html>\n")
    return sorted(projects)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("wheels", type=Path, help="folder of .whl files")
    parser.add_argument("--port", type=int, default=0, help="port on 127.0.0.1 (0: a free one)")
    parser.add_argument("--port-file", type=Path, help="write the index URL here once listening")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="wheel-index.") as tmp:
        projects = build_tree(args.wheels, Path(tmp))
        if not projects:
            print(f"no wheels in {args.wheels}", file=sys.stderr)
            return 2

        class Handler(http.server.SimpleHTTPRequestHandler):
            def __init__(self, *a, **kw):
                super().__init__(*a, directory=tmp, **kw)

            def log_message(self, fmt, *a):
                print(f"wheel-index: {fmt % a}", file=sys.stderr)

        server = http.server.ThreadingHTTPServer(("127.0.0.1", args.port), Handler)
        url = f"http://127.0.0.1:{server.server_address[1]}/simple"
        if args.port_file:
            args.port_file.write_text(url + "\n")
        print(f"{url} ({', '.join(projects)})", flush=True)
        try:
            server.serve_forever()
        except KeyboardInterrupt:
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main())

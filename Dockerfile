# The shoal node image: `shoal node` with its state on the /data volume and a health check.
#
#   docker build -t shoal .
#   docker run -d --name shoal-node -v shoal-node:/data -p 31337:31337 shoal \
#       --initial-peers /ip4/BOOTSTRAP_IP/tcp/31337/p2p/Qm... --announce-maddrs /ip4/THIS_HOST_IP/tcp/31337
#
# Arguments after the image name are added to the node's flags below (a flag given again wins).
# /data holds the node's state (identity, weights, optimizer state, counters: --state-dir), its
# ready file and the tokenizer cache, so a restarted container keeps its peer id and resumes.
# The health check pings the node's health RPC over libp2p on loopback, at the port the ready file
# names: publish the port you announce unchanged (-p P:P with --host-maddrs /ip4/0.0.0.0/tcp/P).
# Metrics listen on 9100 inside the container; -p 127.0.0.1:9100:9100 shows them to the host only.
# Other commands: docker run --rm --entrypoint shoal shoal status --initial-peers ...
# Walk-through: docs/deploy.md.
#
# Build arguments (the defaults are the public images and indexes):
#   BASE         any Debian-like image with Python 3.11 and its venv module: python:3.11-slim, or
#                Debian bookworm itself (deploy/make-base makes one from Debian's packages alone,
#                for machines that reach no image registry)
#   TORCH_INDEX  the index torch is taken from, and the only one pip asks for it, so the CPU build
#                is chosen by its index and not by which version string sorts highest (PyPI's
#                torch is the CUDA build); deploy/wheel-index.py serves a local wheel as one
#   TORCH_VERSION  must agree with pyproject.toml's pin (torch==2.13.0 accepts 2.13.0+cpu)
# With podman, build with `--format docker`: the OCI image format has no HEALTHCHECK.
# deploy/container-check builds this image with podman and trains a swarm of its containers.
ARG BASE=python:3.11-slim
FROM ${BASE}
# the default corpus of the bundled runs' data nodes
RUN apt-get update \
    && apt-get install -y --no-install-recommends bible-kjv fortunes jargon-text \
    && rm -rf /var/lib/apt/lists/*
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ARG TORCH_VERSION=2.13.0+cpu
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
# A venv: Debian's own python3 is externally managed (PEP 668) and refuses a system-wide pip install.
# torch first, from TORCH_INDEX alone and without its dependencies (a local index may hold torch only;
# they come from PyPI below): a build that is not +cpu fails here, not at run time.
RUN python3 -m venv /opt/venv \
    && /opt/venv/bin/pip install --no-deps --index-url "$TORCH_INDEX" "torch==$TORCH_VERSION" \
    && /opt/venv/bin/python -c "from importlib.metadata import version; v = version('torch'); \
assert v.endswith('+cpu'), 'not the CPU build of torch: ' + v"
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /opt/shoal
COPY pyproject.toml README.md ./
COPY shoal ./shoal
# Then shoal from PyPI: torch==2.13.0 is already satisfied by the CPU build (pip adds torch's own
# dependencies), and `pip check` fails the build if anything is missing or at odds.
RUN pip install . \
    && pip check \
    && python -c "import torch; assert torch.version.cuda is None, torch.version.cuda; print('torch', torch.__version__)" \
    && shoal --help > /dev/null \
    && useradd --create-home --uid 10001 shoal \
    && mkdir /data \
    && chown shoal:shoal /data
USER shoal
ENV SHOAL_CACHE=/data/cache
VOLUME /data
EXPOSE 31337 9100
# `shoal health` starts Python, hivemind and a libp2p daemon of its own (seconds of CPU): not too often
HEALTHCHECK --interval=60s --timeout=30s --start-period=300s --retries=3 \
    CMD ["shoal", "health", "--ready-file", "/data/ready.json"]
ENTRYPOINT ["shoal", "--log-level", "INFO", "node", "--state-dir", "/data/state", "--ready-file", "/data/ready.json", \
    "--host-maddrs", "/ip4/0.0.0.0/tcp/31337", "--metrics-port", "9100", "--metrics-host", "0.0.0.0"]

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
FROM python:3.11-slim
RUN apt-get update \
    && apt-get install -y --no-install-recommends bible-kjv fortunes jargon-text \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /opt/shoal
COPY pyproject.toml README.md ./
COPY shoal ./shoal
RUN pip install --no-cache-dir --extra-index-url https://download.pytorch.org/whl/cpu . \
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

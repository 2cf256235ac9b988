# The shoal node image: `docker run shoal node --initial-peers /ip4/.../p2p/...`
FROM python:3.11-slim
RUN apt-get update \
    && apt-get install -y --no-install-recommends bible-kjv fortunes jargon-text \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /opt/shoal
COPY pyproject.toml README.md ./
COPY shoal ./shoal
RUN pip install --no-cache-dir --extra-index-url https://download.pytorch.org/whl/cpu .
ENTRYPOINT ["shoal"]

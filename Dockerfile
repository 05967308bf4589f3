# The image every rollbook service in docker-compose.yml runs: the package is installed here, at
# build time, so a container never installs anything at start (and needs no writable source).
FROM python:3.11-slim
WORKDIR /build
COPY pyproject.toml README.md ./
COPY engine engine
COPY participants participants
COPY adapters adapters
COPY apps apps
COPY migrations migrations
RUN pip install --no-cache-dir . && rm -rf /build \
    && useradd --system --no-create-home --shell /usr/sbin/nologin rollbook
WORKDIR /
# Unprivileged by default. The sandbox environment (off unless the config has a [sandbox] table)
# needs its server started as root, to drop each shell to an unprivileged user of its own.
USER rollbook

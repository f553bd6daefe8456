# The image every corral service in compose.yaml runs.
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml setup.py README.md ./
COPY config config
COPY corral corral
COPY tasks tasks
COPY workers workers
COPY agents agents
COPY netplumb netplumb
COPY protos protos
COPY examples examples
COPY stack stack
RUN pip install --no-cache-dir '.[otlp]' && useradd --system corral
USER corral

# The ctxengine worker image (docker-compose.yml builds it). External Temporal and PostgreSQL are set by env.
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md worker.py ./
COPY core core
COPY activities activities
COPY workflows workflows
COPY ctxengine ctxengine
COPY bench bench
RUN pip install --no-cache-dir .
USER nobody
CMD ["ctxengine", "worker"]

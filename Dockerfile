# The ctxengine worker image (docker-compose.yml builds it). External Temporal and PostgreSQL are set by env.
FROM python:3.11-slim
WORKDIR /app
# The lean image: no embedded services and no benchmark peers (TEMPORAL_ADDRESS and CTXENGINE_DATABASE_URL
# must be set; without them the worker exits at start naming the variable).
COPY pyproject.toml README.md worker.py ./
COPY core core
COPY contract contract
COPY activities activities
COPY workflows workflows
COPY services services
COPY ctxengine ctxengine
COPY harness harness
RUN pip install --no-cache-dir .
USER nobody
CMD ["ctxengine", "worker"]

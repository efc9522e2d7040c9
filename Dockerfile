FROM python:3.11-slim
WORKDIR /app
# Pass --build-arg PIP_EXTRA_INDEX_URL=... to pick a CPU-only torch build.
ARG PIP_EXTRA_INDEX_URL
RUN pip install --no-cache-dir torch==2.13.0
COPY pyproject.toml README.md ./
COPY zoo zoo
COPY embed embed
COPY webapp webapp
COPY migrations migrations
# the s3 extra: boto3, for blobs in an object store (ZOO_BLOB_URL, as docker-compose.yml sets it)
RUN pip install --no-cache-dir ".[s3]"
ENV ZOO_DATA_DIR=/data
ENTRYPOINT []
CMD ["zoo", "--help"]

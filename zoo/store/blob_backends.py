"""The blob store a node uses: the data directory's blobs/ by default, or the S3 bucket ZOO_BLOB_URL names."""

from __future__ import annotations

from zoo.config import Settings
from zoo.store.blobs import BlobStore
from zoo.store.s3_blobs import S3BlobStore


def open_blob_store(settings: Settings) -> BlobStore:
    """`settings.blob_url`'s store: none, the local directory `settings.blob_dir`; s3://bucket/prefix, that bucket (at
    ZOO_S3_ENDPOINT_URL, with the AWS_* credentials boto3 finds)."""
    if not settings.blob_url:
        return BlobStore(settings.blob_dir)
    return S3BlobStore(settings.blob_url)

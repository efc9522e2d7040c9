"""Blobs in S3-compatible object storage (AWS S3, SeaweedFS, MinIO, ...), through boto3: the BlobStore interface
(zoo/store/blobs.py) with a bucket and a key prefix for a directory.

- **Keys:** the local store's names under the prefix, `<prefix>/<digest[:2]>/<digest>.safetensors`.
- **Writes:** a blob's bytes are hashed from the arrays' memory first (the key is their digest), then uploaded
  from that memory (no copy) under the final key. One smaller than ZOO_S3_MULTIPART_BYTES goes up in one PUT
  that carries its SHA-256 (x-amz-checksum-sha256: the digest, known already), so the store refuses a body that
  arrives changed: the object's bytes are checked against its key as it is written. A larger one goes up in parts
  of ZOO_S3_PART_BYTES, ZOO_S3_CONCURRENCY at a time (boto3's TransferConfig), each with its CRC32. A PUT, and a
  multipart upload's completion, make an object visible whole or not at all, so no reader ever sees part of one.
  A writer killed mid-upload leaves a multipart upload never completed (its parts are billed but invisible):
  `zoo check` lists it and `--repair` aborts it. The upload happens while staging (on the BlobWriter's thread,
  once the adapter is canonicalized), so the object is in place before the row that refers to it commits;
  `commit` has nothing left to do. An ingest uploads up to ZOO_S3_UPLOADS blobs at once
  (zoo.services.ingest.ingest_sources).
- **Reads:** the object's bytes are hashed and refused (CorruptBlob, naming the key) unless they hash to the
  digest in its key.
- **Retries:** every request is retried with exponential backoff and jitter (botocore's "standard" mode,
  ZOO_S3_MAX_ATTEMPTS attempts); a store that still does not answer is a BlobStoreUnavailable (503).
"""

from __future__ import annotations

import base64
import bisect
import hashlib
import io
import itertools
import os
import re
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from zoo.config import S3_CONCURRENCY, S3_ENDPOINT_URL, S3_MAX_ATTEMPTS, S3_MULTIPART_BYTES, S3_PART_BYTES, S3_TIMEOUT_S, S3_UPLOADS
from zoo.errors import StorageError, UsageError
from zoo.store.blobs import BlobStore, Leftovers, StagedBlob, StagingStopped, safetensors_layout

if TYPE_CHECKING:
    import torch

    from zoo.domain.canonical import CanonicalFactors

#: S3's smallest part but the last
MIN_PART_BYTES = 5 << 20
#: blobs read at once by get_factors_of (a small read waits on the round trip, not the bandwidth)
READS_AT_ONCE = 16
#: a blob's key under the prefix: the local store's name
_KEY = re.compile(r"^[0-9a-f]{2}/([0-9a-f]{64})\.safetensors$")


class CorruptBlob(StorageError):
    """A stored object whose bytes do not hash to the digest its key names."""


class BlobStoreUnavailable(StorageError):
    """The object store did not answer (after its retries)."""

    http_status = 503


@dataclass(frozen=True)
class S3Location:
    bucket: str
    prefix: str  # "" or ending in "/"

    @classmethod
    def parse(cls, url: str) -> S3Location:
        """s3://bucket[/prefix] (ZOO_BLOB_URL)."""
        m = re.fullmatch(r"s3://([a-z0-9][a-z0-9.\-]{1,61}[a-z0-9])(/.*)?", url)
        if m is None:
            raise UsageError(f"ZOO_BLOB_URL={url!r} is not s3://bucket/prefix (a bucket name: 3-63 lower-case letters, digits, '.', '-')")
        prefix = (m.group(2) or "").strip("/")
        return cls(m.group(1), f"{prefix}/" if prefix else "")


class S3BlobStore(BlobStore):
    """Blobs as objects `<prefix><digest[:2]>/<digest>.safetensors` in one bucket. The boto3 client is made on first
    use in each process (a forked web worker or a Ray task makes its own); the store pickles without it."""

    def __init__(self, url: str, endpoint_url: str | None = None) -> None:  # noqa: D107 - no local root: not BlobStore's
        self.url = url.rstrip("/")
        self.location = S3Location.parse(url)
        self.endpoint_url = endpoint_url if endpoint_url is not None else S3_ENDPOINT_URL.get()
        self.part_bytes = max(MIN_PART_BYTES, S3_PART_BYTES.get())
        self.multipart_bytes = max(MIN_PART_BYTES, S3_MULTIPART_BYTES.get())
        self.concurrency = max(1, S3_CONCURRENCY.get())
        #: blobs one ingest uploads at once, and so sources in flight (an upload takes longer than the next adapter's
        #: work, so several go up at once: see ingest_sources)
        self.writes_at_once = max(2, S3_UPLOADS.get())
        self._client: tuple[int, Any] | None = None
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, object]:
        return {k: v for k, v in self.__dict__.items() if k not in ("_client", "_lock")}

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__dict__.update(state)
        self._client, self._lock = None, threading.Lock()

    def __str__(self) -> str:
        return f"{self.url} at {self.endpoint_url or 'AWS'}"

    @property
    def client(self) -> Any:
        """This process's boto3 S3 client (thread-safe): retries in botocore's standard mode, path-style addressing at
        a given endpoint (a host name like `seaweedfs` is no bucket's virtual host), bodies not signed."""
        with self._lock:
            if self._client is None or self._client[0] != os.getpid():
                self._client = (os.getpid(), self._new_client())
            return self._client[1]

    def _new_client(self) -> Any:
        try:
            import boto3
            from botocore.config import Config
        except ImportError:
            raise UsageError(f"ZOO_BLOB_URL={self.url} needs boto3: pip install 'zoo[s3]'") from None
        timeout = S3_TIMEOUT_S.get()
        config = Config(
            retries={"max_attempts": max(1, S3_MAX_ATTEMPTS.get()), "mode": "standard"},
            connect_timeout=timeout,
            read_timeout=timeout,
            max_pool_connections=max(READS_AT_ONCE, self.writes_at_once * self.concurrency),
            # the body is not hashed again for the signature (botocore signs it over plain HTTP otherwise): its checksum
            # goes with it (a blob's SHA-256 with a PUT, each part's CRC32), and a read verifies its SHA-256 against the key
            s3={"payload_signing_enabled": False, **({"addressing_style": "path"} if self.endpoint_url else {})},
        )
        return boto3.session.Session().client("s3", endpoint_url=self.endpoint_url or None, config=config)

    def _transfer(self, threshold: int | None = None) -> Any:
        """Parts of `part_bytes`, `concurrency` at once, for a body of at least `threshold` bytes (default: one part)."""
        from boto3.s3.transfer import TransferConfig

        return TransferConfig(
            multipart_threshold=threshold or self.part_bytes, multipart_chunksize=self.part_bytes, max_concurrency=self.concurrency,
            use_threads=True,
        )  # fmt: skip

    def object_key(self, digest: str) -> str:
        return self.location.prefix + self.key(digest)

    def path(self, digest: str) -> Path:
        raise TypeError(f"blobs in {self.url} are objects, not files: use where() or get()")

    def local_files(self, digests: Sequence[str]) -> list[Path]:
        return []

    def where(self, digest: str) -> str:
        return f"s3://{self.location.bucket}/{self.object_key(digest)}"

    # --- writes -------------------------------------------------------------------------------------------------------

    def stage_arrays(self, arrays: dict[str, np.ndarray], hashed: Any = None, stop: threading.Event | None = None) -> StagedBlob:
        """Hash the blob's bytes from the arrays' memory, call `hashed(digest)`, then upload them under the digest's
        key (see the module docstring); once `stop` is set, nothing more is uploaded (StagingStopped) and a multipart
        upload under way is aborted."""
        head, ordered = safetensors_layout(arrays)
        views = [memoryview(head), *(a.reshape(-1).view(np.uint8).data for a in ordered)]  # no copy
        h = hashlib.sha256()
        for view in views:
            if stop is not None and stop.is_set():
                raise StagingStopped
            h.update(view)
        digest = h.hexdigest()
        if hashed is not None:
            hashed(digest)
        size = sum(v.nbytes for v in views)
        self._upload(digest, views, stop)
        return StagedBlob(digest, None, size)

    def stage_tensors(self, tensors: dict[str, torch.Tensor]) -> StagedBlob:
        from safetensors.torch import save

        data = save(tensors)
        digest = hashlib.sha256(data).hexdigest()
        self._upload(digest, [memoryview(data)], None)
        return StagedBlob(digest, None, len(data))

    def _upload(self, digest: str, views: list[memoryview], stop: threading.Event | None) -> None:
        if stop is not None and stop.is_set():
            raise StagingStopped
        body = _Chunks(views, stop)
        key = self.object_key(digest)
        with self._errors(f"uploading {self.where(digest)}"):
            if body.size < self.multipart_bytes:  # one request, its body checked by the store against the digest
                checksum = base64.b64encode(bytes.fromhex(digest)).decode()
                self.client.put_object(
                    Bucket=self.location.bucket, Key=key, Body=body, ContentLength=body.size, ChecksumSHA256=checksum,
                    ContentType="application/octet-stream",
                )  # fmt: skip
            else:
                extra = {"ContentType": "application/octet-stream"}
                config = self._transfer(threshold=self.multipart_bytes)
                self.client.upload_fileobj(body, self.location.bucket, key, ExtraArgs=extra, Config=config)

    def commit(self, staged: StagedBlob) -> None:
        """Nothing: the object was uploaded whole under its digest while staging."""

    def put_file(self, digest: str, path: Path) -> None:
        """A file whose bytes the caller found to hash to `digest` (a restored backup's blob) uploaded under its key,
        in parts as a staged blob is: the object appears whole once its upload completes, or not at all."""
        with self._errors(f"uploading {self.where(digest)}"):
            self.client.upload_file(
                str(path), self.location.bucket, self.object_key(digest), ExtraArgs={"ContentType": "application/octet-stream"},
                Config=self._transfer(),
            )  # fmt: skip

    # --- reads --------------------------------------------------------------------------------------------------------

    def read_bytes(self, digest: str) -> bytes:
        """The object's bytes, verified: FileNotFoundError where there is none, CorruptBlob (naming the key) where they
        do not hash to `digest`. A read cut off mid-body is tried again, as botocore retries a request."""
        attempts = max(1, S3_MAX_ATTEMPTS.get())
        for attempt in range(attempts):
            try:
                with self._errors(f"reading {self.where(digest)}"):
                    body = self.client.get_object(Bucket=self.location.bucket, Key=self.object_key(digest))["Body"]
                    data = body.read()
                break
            except _BodyCutOff:
                if attempt == attempts - 1:
                    raise BlobStoreUnavailable(f"reading {self.where(digest)}: the body was cut off {attempts} times") from None
                time.sleep(min(2.0, 0.1 * 2**attempt))
        got = hashlib.sha256(data).hexdigest()
        if got != digest:
            raise CorruptBlob(
                f"blob {self.where(digest)} is corrupt: its {len(data)} bytes hash to {got}, not to the digest its key names; "
                "see `zoo check`, and ingest the adapter again"
            )
        return data

    def get(self, digest: str) -> dict[str, torch.Tensor]:
        from safetensors.torch import load

        return load(self.read_bytes(digest))

    def get_factors_of(self, digests: Sequence[str]) -> list[list[tuple[str, CanonicalFactors]]]:
        """get_factors of each digest, in order, READS_AT_ONCE requests in flight (a new replica's module store reads
        one object per adapter: one at a time, a round trip each, 100k of them took minutes)."""
        if len(digests) <= 1:
            return [self.get_factors(d) for d in digests]
        with ThreadPoolExecutor(min(READS_AT_ONCE, len(digests)), thread_name_prefix="zoo-s3-read") as pool:
            return list(pool.map(self.get_factors, digests))

    def verify(self, digest: str) -> str:
        try:
            self.read_bytes(digest)
        except FileNotFoundError:
            return "missing"
        except CorruptBlob:
            return "corrupt"
        return "ok"

    # --- what a crash leaves ------------------------------------------------------------------------------------------

    def leftovers(self, referenced: set[str], now: float, grace_s: float) -> Leftovers:
        """Objects under the prefix named like a blob whose digest no row refers to (`orphans`: s3://bucket/key) and
        multipart uploads never completed nor aborted (`temporary`: s3://bucket/key?uploadId=...); those younger
        than `grace_s` are counted as in flight."""
        bucket, prefix = self.location.bucket, self.location.prefix
        orphans: list[str] = []
        temporary: list[str] = []
        in_flight = 0
        with self._errors(f"listing s3://{bucket}/{prefix}"):
            for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
                for obj in page.get("Contents", []):
                    m = _KEY.match(obj["Key"][len(prefix) :])
                    if m is None or m.group(1) in referenced:
                        continue
                    if now - obj["LastModified"].timestamp() < grace_s:
                        in_flight += 1
                    else:
                        orphans.append(f"s3://{bucket}/{obj['Key']}")
            for page in self.client.get_paginator("list_multipart_uploads").paginate(Bucket=bucket, Prefix=prefix):
                for upload in page.get("Uploads", []):
                    if now - upload["Initiated"].timestamp() < grace_s:
                        in_flight += 1
                    else:
                        temporary.append(f"s3://{bucket}/{upload['Key']}?uploadId={upload['UploadId']}")
        return Leftovers(sorted(orphans), sorted(temporary), in_flight)

    def remove(self, names: Sequence[str]) -> int:
        """Delete orphan objects and abort unfinished multipart uploads, named as `leftovers` names them."""
        head = f"s3://{self.location.bucket}/"
        for name in names:
            if not name.startswith(head):
                raise ValueError(f"{name} is not in {head}")
            key, _, upload_id = name[len(head) :].partition("?uploadId=")
            with self._errors(f"removing {name}"):
                if upload_id:
                    self.client.abort_multipart_upload(Bucket=self.location.bucket, Key=key, UploadId=upload_id)
                else:
                    self.client.delete_object(Bucket=self.location.bucket, Key=key)
        return len(names)

    # --- files beside the blobs (zoo/store/shared_files.py) ---------------------------------------------------------

    def file_key(self, name: str) -> str:
        """The key of a file kept beside the blobs (a checkpoint's, an upload's): `<prefix>files/<name>`, never
        named like a blob (so `leftovers` never takes it for an orphan)."""
        return f"{self.location.prefix}files/{name}"

    def put_file_object(self, name: str, path: Path) -> None:
        """A local file uploaded as `file_key(name)` (in parts if large: visible whole once complete, or not at all)."""
        with self._errors(f"uploading s3://{self.location.bucket}/{self.file_key(name)}"):
            self.client.upload_file(str(path), self.location.bucket, self.file_key(name), Config=self._transfer())

    def get_file_object(self, name: str, path: Path) -> None:
        """`file_key(name)` downloaded to `path` (FileNotFoundError where there is none)."""
        with self._errors(f"reading s3://{self.location.bucket}/{self.file_key(name)}"):
            self.client.download_file(self.location.bucket, self.file_key(name), str(path), Config=self._transfer())

    def file_entries(self, under: str) -> list[tuple[str, float]]:
        """(name, seconds since the epoch) of every file kept under the folder `under`: each object's name and last
        modification, and each multipart upload of one never completed nor aborted (a writer still at it, or killed
        mid-file), with the time it began."""
        prefix = self.file_key(under.rstrip("/") + "/")
        skip = len(self.file_key(""))
        found: list[tuple[str, float]] = []
        with self._errors(f"listing s3://{self.location.bucket}/{prefix}"):
            for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.location.bucket, Prefix=prefix):
                found += [(obj["Key"][skip:], obj["LastModified"].timestamp()) for obj in page.get("Contents", [])]
            for page in self.client.get_paginator("list_multipart_uploads").paginate(Bucket=self.location.bucket, Prefix=prefix):
                found += [(upload["Key"][skip:], upload["Initiated"].timestamp()) for upload in page.get("Uploads", [])]
        return found

    def abort_file_uploads(self, folder: str) -> int:
        """Abort every multipart upload never completed under `folder` (a writer killed mid-file); returns how many."""
        prefix = self.file_key(folder.rstrip("/") + "/")
        uploads: list[tuple[str, str]] = []
        with self._errors(f"aborting uploads under s3://{self.location.bucket}/{prefix}"):
            for page in self.client.get_paginator("list_multipart_uploads").paginate(Bucket=self.location.bucket, Prefix=prefix):
                uploads += [(upload["Key"], upload["UploadId"]) for upload in page.get("Uploads", [])]
            for key, upload_id in uploads:
                self.client.abort_multipart_upload(Bucket=self.location.bucket, Key=key, UploadId=upload_id)
        return len(uploads)

    def delete_file_objects(self, folder: str) -> int:
        """Delete every file kept under `folder` (a name's leading part); returns how many."""
        prefix = self.file_key(folder.rstrip("/") + "/")
        keys: list[str] = []
        with self._errors(f"removing s3://{self.location.bucket}/{prefix}"):
            for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.location.bucket, Prefix=prefix):
                keys.extend(obj["Key"] for obj in page.get("Contents", []))
            for key in keys:
                self.client.delete_object(Bucket=self.location.bucket, Key=key)
        return len(keys)

    @contextmanager
    def _errors(self, doing: str) -> Iterator[None]:
        """botocore's errors as zoo's: a missing object a FileNotFoundError, a store that does not answer (after the
        retries) a BlobStoreUnavailable, any other refusal a StorageError; each names what was being done."""
        from botocore.exceptions import BotoCoreError, ClientError, ConnectionError, HTTPClientError, ResponseStreamingError

        try:
            yield
        except ClientError as exc:
            code = str(exc.response.get("Error", {}).get("Code", ""))
            if code in ("NoSuchKey", "404", "NotFound"):
                raise FileNotFoundError(f"{doing}: no such object") from None
            raise StorageError(f"{doing}: the object store refused ({code}: {exc.response.get('Error', {}).get('Message', '')})") from None
        except ResponseStreamingError as exc:
            raise _BodyCutOff(str(exc)) from None
        except (ConnectionError, HTTPClientError) as exc:
            raise BlobStoreUnavailable(f"{doing}: the object store at {self.endpoint_url or 'AWS'} does not answer ({exc})") from None
        except BotoCoreError as exc:
            raise StorageError(f"{doing}: {exc}") from None


class _BodyCutOff(Exception):
    """An object's body ended early (a dropped connection mid-read): the read is tried again."""


class _Chunks(io.RawIOBase):
    """The concatenation of memoryviews as a readable, seekable stream (what boto3 uploads from, and rewinds to retry a
    request), read without copying them first, which raises StagingStopped once `stop` is set (the upload fails, and
    a multipart one is aborted)."""

    def __init__(self, views: list[memoryview], stop: threading.Event | None) -> None:
        self.views = [v.cast("B") for v in views if v.nbytes]
        self.starts = list(itertools.accumulate((len(v) for v in self.views), initial=0))  # each view's offset, then the size
        self.size = self.starts[-1]
        self.stop = stop
        self.pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.size}[whence]
        if base + offset < 0:
            raise ValueError(f"negative seek position {base + offset}")
        self.pos = base + offset
        return self.pos

    def readinto(self, buffer: Any) -> int:
        if self.stop is not None and self.stop.is_set():
            raise StagingStopped
        out = memoryview(buffer).cast("B")
        n = 0
        i = bisect.bisect_right(self.starts, self.pos) - 1
        while i < len(self.views) and n < len(out):
            view = self.views[i][self.pos - self.starts[i] :]
            take = min(len(view), len(out) - n)
            out[n : n + take] = view[:take]
            n += take
            self.pos += take
            i += 1
        return n

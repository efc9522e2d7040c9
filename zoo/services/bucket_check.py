"""What `zoo check` finds of the web uploads kept in the bucket beside the blobs (zoo/store/shared_files.py), where a
node that takes an upload puts its files (`<prefix>files/uploads/<hex>/`, its manifest last) for any worker to claim.

A folder there belongs to a job item until the item finishes, when the worker that took it removes it. What a killed
process leaves: the web app killed while it put an upload up (some files, perhaps a multipart upload cut off, no
manifest, no job), or after it put it up and before its job committed (a whole folder, no job), or a worker killed
between finishing an item and removing its upload. A folder is an orphan when no queued or running item's source
lies in it and nothing has been written to it for the grace period (an upload is put up before its job commits, so a
young folder may be a live one's); each is reported with its age, and `--repair` removes it (its objects, and any
multipart upload of a file of it never completed).
"""

from __future__ import annotations

from typing import TypedDict

from zoo.store.blobs import BlobStore
from zoo.store.jobs import pending_sources
from zoo.store.session import Sessions
from zoo.store.shared_files import published_folders, unpublish

#: the bucket folder that holds uploads waiting for a worker
UPLOADS = "uploads"


class BucketUpload(TypedDict):
    """An upload's folder in the bucket."""

    where: str  # s3://bucket/prefix/files/uploads/<hex>/
    age_s: float  # since it was last written to
    files: int  # objects, and uploads of a file cut off or under way
    complete: bool  # its manifest is there: it was put up whole
    owned: bool  # a queued or running job item reads it


class BucketUploadCheck(TypedDict):
    orphans: list[BucketUpload]  # owned by no live item, older than the grace period
    in_flight: list[BucketUpload]  # owned, or written to within the grace period
    removed: int  # folders removed


def check_bucket_uploads(blobs: BlobStore, sessions: Sessions, repair: bool, grace_s: float, now: float) -> BucketUploadCheck:
    """The upload folders in the bucket (none with the data dir's blobs), orphans removed on repair (module doc)."""
    folders = published_folders(blobs, UPLOADS)
    if not folders:
        return {"orphans": [], "in_flight": [], "removed": 0}
    with sessions() as session:
        sources = pending_sources(session)
    orphans: list[BucketUpload] = []
    in_flight: list[BucketUpload] = []
    for found in folders:
        owned = any(f"/{found.folder}/" in f"{source}/" for source in sources)
        age = round(max(0.0, now - found.last_written), 1)
        entry: BucketUpload = {"where": found.where, "age_s": age, "files": found.files, "complete": found.complete, "owned": owned}
        (in_flight if owned or age < grace_s else orphans).append(entry)
        if repair and not owned and age >= grace_s:
            unpublish(blobs, found.folder)
    return {"orphans": orphans, "in_flight": in_flight, "removed": len(orphans) if repair else 0}

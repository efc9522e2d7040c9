"""Content-addressed blob store for canonical factors (safetensors files named by SHA-256)."""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from zoo.canonical import CanonicalFactors


#: temporary files of unfinished writes start with this (`zoo check` finds those a crash left)
TMP_PREFIX = ".tmp-"


class BlobStore:
    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    def path(self, digest: str) -> Path:
        return self.root / digest[:2] / f"{digest}.safetensors"

    @staticmethod
    def encode(tensors: dict[str, torch.Tensor]) -> tuple[str, bytes]:
        """(digest, bytes) of tensors as a blob, without writing it."""
        from safetensors.torch import save  # torch is imported only by what reads or writes factors

        data = save({k: v.detach().cpu().contiguous() for k, v in tensors.items()})
        return hashlib.sha256(data).hexdigest(), data

    def write(self, digest: str, data: bytes) -> bool:
        """Write a blob under its digest, idempotently (True if it was not there): to a temporary
        file, fsynced, renamed into place and the directory fsynced, so the path is whole or absent."""
        target = self.path(digest)
        if target.exists():
            return False
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=TMP_PREFIX)
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, target)
            dir_fd = os.open(target.parent, os.O_RDONLY)  # the rename itself survives a crash
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return True

    def get(self, digest: str) -> dict[str, torch.Tensor]:
        from safetensors.torch import load

        return load(self.path(digest).read_bytes())

    def delete(self, digest: str) -> None:
        self.path(digest).unlink(missing_ok=True)

    @classmethod
    def encode_factors(cls, modules: list[tuple[str, CanonicalFactors]]) -> tuple[str, bytes]:
        tensors: dict[str, torch.Tensor] = {}
        for name, f in modules:
            tensors[f"{name}.U"], tensors[f"{name}.S"], tensors[f"{name}.V"] = f.U, f.S, f.V
        return cls.encode(tensors)

    def get_factors(self, digest: str) -> list[tuple[str, CanonicalFactors]]:
        from zoo.canonical import CanonicalFactors

        tensors = self.get(digest)
        names = sorted({k[: -len(".U")] for k in tensors if k.endswith(".U")})
        return [(n, CanonicalFactors(tensors[f"{n}.U"], tensors[f"{n}.S"], tensors[f"{n}.V"])) for n in names]

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


class BlobStore:
    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    def path(self, digest: str) -> Path:
        return self.root / digest[:2] / f"{digest}.safetensors"

    def put(self, tensors: dict[str, torch.Tensor]) -> tuple[str, bool]:
        """Store tensors; returns (digest, created) where created is False if it was already there."""
        from safetensors.torch import save  # torch is imported only by what reads or writes factors

        data = save({k: v.detach().cpu().contiguous() for k, v in tensors.items()})
        digest = hashlib.sha256(data).hexdigest()
        target = self.path(digest)
        if target.exists():
            return digest, False
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".tmp-")
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, target)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return digest, True

    def get(self, digest: str) -> dict[str, torch.Tensor]:
        from safetensors.torch import load

        return load(self.path(digest).read_bytes())

    def delete(self, digest: str) -> None:
        self.path(digest).unlink(missing_ok=True)

    def put_factors(self, modules: list[tuple[str, CanonicalFactors]]) -> tuple[str, bool]:
        tensors: dict[str, torch.Tensor] = {}
        for name, f in modules:
            tensors[f"{name}.U"], tensors[f"{name}.S"], tensors[f"{name}.V"] = f.U, f.S, f.V
        return self.put(tensors)

    def get_factors(self, digest: str) -> list[tuple[str, CanonicalFactors]]:
        from zoo.canonical import CanonicalFactors

        tensors = self.get(digest)
        names = sorted({k[: -len(".U")] for k in tensors if k.endswith(".U")})
        return [(n, CanonicalFactors(tensors[f"{n}.U"], tensors[f"{n}.S"], tensors[f"{n}.V"])) for n in names]

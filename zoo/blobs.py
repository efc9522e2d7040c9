"""Content-addressed blob store for canonical factors (safetensors files named by SHA-256)."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import TYPE_CHECKING

from zoo.files import replace_durably

if TYPE_CHECKING:
    import torch

    from zoo.canonical import CanonicalFactors


class BlobStore:
    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    def path(self, digest: str) -> Path:
        return self.root / digest[:2] / f"{digest}.safetensors"

    @staticmethod
    def encode(tensors: dict[str, torch.Tensor]) -> tuple[str, bytes]:
        """(digest, bytes) of tensors of numpy's dtypes (factors are float32) as a blob, without writing it: the
        bytes safetensors.torch.save writes, through safetensors' numpy writer (several times faster on small tensors)."""
        from safetensors.numpy import save

        data = save({k: v.detach().cpu().contiguous().numpy() for k, v in tensors.items()})
        return hashlib.sha256(data).hexdigest(), data

    def write(self, digest: str, data: bytes) -> None:
        """Write a blob under its digest, idempotently and whole (see zoo.files.replace_durably)."""
        target = self.path(digest)
        if not target.exists():
            replace_durably(target, lambda tmp: tmp.write_bytes(data))

    def get(self, digest: str) -> dict[str, torch.Tensor]:
        from safetensors.torch import load

        return load(self.path(digest).read_bytes())

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

"""Plain data read from adapter files: what every format reader returns."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from zoo.domain.naming import layer_index, module_type
from zoo.domain.spectra import Spectrum
from zoo.errors import InputError

__all__ = ["AdapterData", "FullMatrix", "LoraModule", "all_finite", "check_finite", "check_pair", "layer_index", "module_type"]


@dataclass
class LoraModule:
    """One low-rank update dW = scale · B · A in the layout of the layer's stored weight.

    A is (r × in), B is (out × r). Conv kernels (1-, 2- and 3-d) are flattened (in = in_channels·kh·kw...);
    for embeddings and fan_in_fan_out (GPT-2 Conv1D) layers the factors are swapped and
    transposed so that dW matches the stored weight (`transposed` records it).
    """

    name: str
    A: torch.Tensor
    B: torch.Tensor
    alpha: float
    scale: float
    kind: str = "linear"  # linear | conv | embedding
    transposed: bool = False

    @property
    def rank(self) -> int:
        return int(self.A.shape[0])

    @property
    def shape(self) -> tuple[int, int]:
        return int(self.B.shape[0]), int(self.A.shape[1])


@dataclass
class FullMatrix:
    """A full weight matrix of a checkpoint read without a base: its shape (out × rest) and spectrum, computed as it
    was read (the matrix itself is not kept)."""

    name: str
    shape: tuple[int, int]
    spectrum: Spectrum


@dataclass
class AdapterData:
    """Everything read from one source, before any math."""

    path: Path
    format: str  # peft | a SINGLE_FILE_FORMATS name (kohya, diffusers, xlabs, cloneofsimo, lycoris) | checkpoint-delta | checkpoint
    weight_files: list[Path]
    base_model: str | None = None
    modules: list[LoraModule] = field(default_factory=list)
    full_matrices: list[FullMatrix] = field(default_factory=list)
    config: dict = field(default_factory=dict)
    extra_tensors: dict[str, list[int]] = field(default_factory=dict)
    metadata: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    #: SHA-256 and size of the weight file, from the bytes the tensors were read from
    file_sha256: str = ""
    size_bytes: int = 0


def check_pair(path: Path, name: str, A: torch.Tensor, B: torch.Tensor) -> None:
    """Refuse mismatched or non-finite factors, naming the module."""
    if A.ndim != 2 or B.ndim != 2 or A.shape[0] != B.shape[1]:
        raise InputError(path, f"shape mismatch in {name}: A {list(A.shape)} and B {list(B.shape)} do not compose (need A r×in, B out×r)")
    if A.shape[0] == 0:
        raise InputError(path, f"{name} has rank 0")
    for label, t in (("A", A), ("B", B)):
        if not t.is_floating_point():
            raise InputError(path, f"{name}: factor {label} has non-float dtype {t.dtype}")
        if not all_finite(t):
            raise InputError(path, f"{name}: factor {label} contains NaN or Inf values")


def check_finite(path: Path, name: str, t: torch.Tensor) -> None:
    if t.is_floating_point() and not all_finite(t):
        raise InputError(path, f"{name} contains NaN or Inf values")


def all_finite(t: torch.Tensor) -> bool:
    """Whether a floating tensor holds no NaN or ±Inf, from its minimum and maximum (one vectorized reduction that
    propagates NaN, in the tensor's own dtype: 20-50 times faster on the CPU than torch.isfinite(t).all(), which
    converts bf16 and fp16 element by element)."""
    if t.numel() == 0:
        return True
    lo, hi = torch.aminmax(t if t.element_size() > 1 else t.float())  # no float8 reductions on the CPU
    return math.isfinite(lo.item()) and math.isfinite(hi.item())

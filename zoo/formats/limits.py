"""What one source may ask of zoo: every reader's result passes `check_limits` before any math.

The limits keep a small hostile file from asking for huge work (a rank of 60,000 means r×r Gram
matrices; a layer of 10¹⁵ sizes an embedding table; thousands of module names) and keep values
inside the database's columns (PostgreSQL refuses longer strings and integers past int32).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from zoo import config
from zoo.errors import InputError
from zoo.formats.records import AdapterData

#: database column widths (zoo/store/models.py)
MAX_MODULE_NAME = 512
MAX_MODULE_TYPE = 128
MAX_BASE_MODEL = 255
MAX_TASK_TYPE = 64
MAX_ADAPTER_NAME = 255
#: a layer index past this is not a layer
MAX_LAYER = 100_000


def max_rank() -> int:
    """Largest LoRA rank accepted (ZOO_MAX_RANK, default 4096); a rank must also not exceed both sides of its module."""
    return config.MAX_RANK.get()


def max_modules() -> int:
    """Most modules in one source (ZOO_MAX_MODULES, default 4096)."""
    return config.MAX_MODULES.get()


def max_module_width() -> int:
    """Widest side of a module (or any tensor of two or more dimensions) accepted (ZOO_MAX_MODULE_WIDTH, default
    524,288 = 2^19: the head or embedding of a 262,144-token vocabulary passes). Sketching a module draws 64 float64
    probes per row and column: 0.5 KiB of working memory per unit of width, 4 GiB for a module 8M wide, from one upload."""
    return config.MAX_MODULE_WIDTH.get()


def check_widths(path: object, shapes: Iterable[tuple[str, Sequence[int]]]) -> None:
    """Refuse, naming the file, the tensor and the limit, a tensor of two or more dimensions wider than
    max_module_width(): from a header's shapes, before any tensor is read."""
    limit = max_module_width()
    for name, shape in shapes:
        if len(shape) >= 2 and max(shape) > limit:
            need = max(shape) * 64 * 8
            raise InputError(
                str(path),
                f"tensor {name[:120]!r} of shape {list(shape)} is {max(shape):,} wide, past the limit of {limit:,} "
                f"(ZOO_MAX_MODULE_WIDTH): sketching it would take about {need / 2**30:.1f} GiB of working memory",
            )


def check_limits(data: AdapterData, base_model: str | None) -> None:
    """Refuse, naming the file and the limit, what is over a limit."""
    from zoo.domain.naming import layer_index, module_type

    path = data.weight_files[0] if data.weight_files else data.path
    count = len(data.modules) + len(data.full_matrices)
    if count > max_modules():
        raise InputError(path, f"{count} modules exceed the limit of {max_modules()} (ZOO_MAX_MODULES)")
    if base_model is not None and len(base_model) > MAX_BASE_MODEL:
        raise InputError(path, f"base model name of {len(base_model)} characters exceeds {MAX_BASE_MODEL}")
    task_type = data.config.get("task_type")
    if task_type is not None and (not isinstance(task_type, str) or len(task_type) > MAX_TASK_TYPE):
        raise InputError(path, f"task_type must be a string of at most {MAX_TASK_TYPE} characters")
    names = [m.name for m in data.modules] + [m.name for m in data.full_matrices]
    for name in names:
        if len(name) > MAX_MODULE_NAME:
            raise InputError(path, f"module name {name[:60]!r}... is longer than {MAX_MODULE_NAME} characters")
        if len(module_type(name)) > MAX_MODULE_TYPE:
            raise InputError(path, f"module {name[:60]!r}... has a type name longer than {MAX_MODULE_TYPE} characters")
        layer = layer_index(name)
        if layer is not None and layer > MAX_LAYER:
            raise InputError(path, f"module {name[:80]!r} claims layer {str(layer)[:20]}, past the limit of {MAX_LAYER}")
    check_widths(path, [(m.name, m.shape) for m in data.modules] + [(m.name, m.shape) for m in data.full_matrices])
    for m in data.modules:
        out, inp = m.shape
        if m.rank > max_rank():
            raise InputError(path, f"{m.name}: rank {m.rank} exceeds the limit of {max_rank()} (ZOO_MAX_RANK)")
        if m.rank > max(out, inp):  # dW has rank ≤ min(out, in): a rank past both sides only asks for work
            raise InputError(path, f"{m.name}: rank {m.rank} exceeds both sides of the module ({out}×{inp})")

"""A PEFT directory in a zip (what `zoo export --format peft --out X.zip` and the download endpoint write):
its two members found by one rule, for reading into memory here and for the web upload's extraction."""

from __future__ import annotations

import stat
import zipfile
from collections.abc import Iterable
from pathlib import Path, PurePosixPath

from zoo.errors import InputError
from zoo.formats.peft import CONFIG_NAME
from zoo.formats.safe_load import WeightFile, check_file_size, max_header_bytes, read_safetensors_stream

ZIP_SUFFIX = ".zip"
PEFT_WEIGHTS = "adapter_model.safetensors"
#: members of a zip looked at; a PEFT directory has 2 (a README, a tokenizer may ride along)
MAX_ZIP_MEMBERS = 16


def peft_members(zf: zipfile.ZipFile, label: str | Path) -> dict[str, zipfile.ZipInfo]:
    """The zip's adapter_config.json and adapter_model.safetensors, in one folder, by name; refused: more than
    MAX_ZIP_MEMBERS files, members with absolute or parent paths or links, two of either, neither in one folder."""
    members = [m for m in zf.infolist() if not m.is_dir()]
    if len(members) > MAX_ZIP_MEMBERS:
        raise InputError(label, f"a zip of {len(members)} files: a PEFT directory has 2 (at most {MAX_ZIP_MEMBERS} are read)")
    wanted: dict[str, zipfile.ZipInfo] = {}
    for m in members:
        path = PurePosixPath(m.filename)
        if path.is_absolute() or ".." in path.parts or stat.S_ISLNK(m.external_attr >> 16):
            raise InputError(label, f"unsafe member {m.filename!r} (absolute, parent path or link)")
        if path.name in (CONFIG_NAME, PEFT_WEIGHTS):
            if path.name in wanted:
                raise InputError(label, f"more than one {path.name}: zip one PEFT directory")
            wanted[path.name] = m
    if missing := missing_peft_files(wanted):
        raise InputError(label, f"{missing}: the zip needs {CONFIG_NAME} and {PEFT_WEIGHTS} in one folder")
    if PurePosixPath(wanted[CONFIG_NAME].filename).parent != PurePosixPath(wanted[PEFT_WEIGHTS].filename).parent:
        raise InputError(label, f"no PEFT directory: the zip needs {CONFIG_NAME} and {PEFT_WEIGHTS} in one folder")
    return wanted


def missing_peft_files(names: Iterable[str]) -> str | None:
    """What a PEFT directory's files lack among `names` ("adapter_model.safetensors is missing"), or None: said
    before the rule they break, so that a zip or an upload of one file names the other."""
    absent = [n for n in (CONFIG_NAME, PEFT_WEIGHTS) if n not in set(names)]
    if not absent:
        return None
    return f"{absent[0]} is missing" if len(absent) == 1 else f"neither {CONFIG_NAME} nor {PEFT_WEIGHTS} is in it"


def read_peft_zip(path: Path) -> tuple[bytes, WeightFile]:
    """(adapter_config.json's bytes, the weights read into memory and hashed) of a zipped PEFT directory, each
    member held to the limits its loose file has (ZOO_MAX_HEADER_BYTES, ZOO_MAX_FILE_BYTES) before it is read, and
    the weights' safetensors header (framing, widths) checked before the rest is inflated: a 130 KB zip of zeros
    expands to 128 MiB. Inflation streams into a buffer of the declared size and stops there (zipfile checks the
    CRC at the member's end)."""
    try:
        with zipfile.ZipFile(path) as zf:
            wanted = peft_members(zf, path)
            config, weights = wanted[CONFIG_NAME], wanted[PEFT_WEIGHTS]
            if config.file_size > max_header_bytes():
                raise InputError(path, f"adapter config larger than {max_header_bytes()} bytes")
            check_file_size(path, weights.file_size)
            text = zf.read(config)
            with zf.open(weights) as fh:
                return text, read_safetensors_stream(path / PEFT_WEIGHTS, fh, weights.file_size)
    except (zipfile.BadZipFile, OSError, EOFError) as exc:
        raise InputError(path, f"not a readable zip ({exc})") from None

"""PEFT LoRA and AdaLoRA adapters: a directory with adapter_config.json and adapter_model.safetensors (or .bin)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import regex
import torch

from zoo.errors import InputError
from zoo.formats.limits import MAX_MODULE_NAME, max_modules
from zoo.formats.records import AdapterData, LoraModule, check_finite, check_pair
from zoo.formats.safe_load import WeightFile, max_header_bytes, parse_tensors

CONFIG_NAME = "adapter_config.json"
WEIGHT_NAMES = ("adapter_model.safetensors", "adapter_model.bin")
KEY_PREFIX = "base_model.model."
PAIRS = ((".lora_A.weight", ".lora_B.weight"), (".lora_embedding_A", ".lora_embedding_B"))
#: AdaLoRA's factors (parameters, no `.weight`): dW = B·diag(E)·A · scale, E beside A and B
ADALORA_PAIR, ADALORA_E = (".lora_A", ".lora_B"), ".lora_E"
#: what PEFT's AdaLoRA adds to ranknum in its scale
ADALORA_EPS = 1e-5
#: factor dimensions read: matrices, and the kernels of PEFT's Conv1d, Conv2d and Conv3d LoRA layers
#: (A: r × in × k..., B: out × r × 1...), flattened to r × in·k... and out × r
CONV_NDIMS = (2, 3, 4, 5)


def is_peft_dir(path: Path) -> bool:
    return path.is_dir() and (path / CONFIG_NAME).is_file()


#: seconds one rank/alpha pattern may take to match one module name (patterns are user regexes)
PATTERN_TIMEOUT = 0.05


Patterns = list[tuple[str, "regex.Pattern[str]", float]]


def _pattern_value(source: Path, patterns: Patterns, name: str, default: float) -> float:
    """Value of the PEFT rank/alpha pattern whose key matches the module name (as PEFT matches them);
    a pattern that backtracks past PATTERN_TIMEOUT is refused."""
    for key, compiled, value in patterns:
        try:
            if name == key or compiled.match(name, timeout=PATTERN_TIMEOUT):
                return value
        except TimeoutError:
            raise InputError(source, f"pattern {key[:60]!r} takes too long to match {name[:60]!r} (a backtracking regex)") from None
    return default


def _number(source: Path, key: str, value: object, default: float, positive: bool = False) -> float:
    """A config number: `default` when absent, else a finite (positive) int or float."""
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or (positive and value <= 0):
        raise InputError(source, f"{key} must be a {'positive ' if positive else ''}finite number, got {str(value)[:40]!r}")
    return float(value)


def _patterns(source: Path, config: dict, key: str) -> Patterns:
    """A rank_pattern/alpha_pattern: (key, compiled as PEFT matches it, positive number), compiled once here."""
    value = config.get(key) or {}
    if not isinstance(value, dict):
        raise InputError(source, f"{key} must map module-name patterns to numbers, got a {type(value).__name__}")
    if len(value) > max_modules():
        raise InputError(source, f"{key} has {len(value)} patterns, past the limit of {max_modules()}")
    out: Patterns = []
    for pattern, number in value.items():
        if len(pattern) > MAX_MODULE_NAME:
            raise InputError(source, f"{key} pattern {pattern[:60]!r}... is longer than {MAX_MODULE_NAME} characters")
        try:
            compiled = regex.compile(rf"(.*\.)?({pattern})$")
        except regex.error as exc:
            raise InputError(source, f"{key} pattern {pattern[:60]!r} is not a valid regex ({exc})") from None
        out.append((pattern, compiled, _number(source, key, number, 0.0, positive=True)))
    return out


@dataclass(frozen=True)
class PeftConfig:
    """A PEFT adapter's adapter_config.json, checked: the values its update depends on besides its weights."""

    path: Path
    raw: dict
    r: float
    alpha: float
    rank_pattern: Patterns
    alpha_pattern: Patterns
    rslora: bool
    fan_in_fan_out: bool
    #: AdaLoRA's initial rank (its factors' ranknum, in every module's scale); None for LoRA
    adalora_init_r: int | None = None

    @property
    def base_model(self) -> str | None:
        return self.raw.get("base_model_name_or_path")

    def module_scale(self, weights: Path, name: str, rank: int) -> tuple[float, float]:
        """(alpha, scale) of module `name` whose factors in `weights` have rank `rank`, as PEFT applies this config
        (rank and alpha patterns, rsLoRA); a rank other than the config's is refused. AdaLoRA: lora_alpha (else the
        module's rank) over ranknum + 1e-5, ranknum being init_r whatever rank the module kept (PEFT's forward)."""
        if self.adalora_init_r is not None:
            if rank > self.adalora_init_r:
                got = f"tensors have rank {rank}, above AdaLoRA's init_r {self.adalora_init_r}"
                raise InputError(weights, f"rank mismatch in {name}: {got}")
            alpha = self.alpha if self.alpha > 0 else float(rank)
            return alpha, alpha / (self.adalora_init_r + ADALORA_EPS)
        expected = int(_pattern_value(self.path, self.rank_pattern, name, self.r))
        if rank != expected:
            raise InputError(weights, f"rank mismatch in {name}: tensors have rank {rank}, adapter_config says {expected}")
        alpha = _pattern_value(self.path, self.alpha_pattern, name, self.alpha)
        return alpha, alpha / math.sqrt(rank) if self.rslora else alpha / rank

    def settings(self) -> dict[str, object]:
        """The values the update depends on besides the weights, as the adapter's recorded config holds them."""
        return {
            "r": int(self.r),
            "lora_alpha": self.alpha,
            "use_rslora": self.rslora,
            "fan_in_fan_out": self.fan_in_fan_out,
            "rank_pattern": {k: v for k, _, v in self.rank_pattern},
            "alpha_pattern": {k: v for k, _, v in self.alpha_pattern},
        }


def read_peft_config(directory: Path) -> PeftConfig:
    """The checked adapter_config.json of a PEFT directory."""
    config_path = directory / CONFIG_NAME
    try:
        if config_path.stat().st_size > max_header_bytes():
            raise InputError(config_path, f"adapter config larger than {max_header_bytes()} bytes")
        text = config_path.read_bytes()
    except OSError as exc:
        raise InputError(config_path, f"unreadable adapter config ({exc})") from None
    return parse_peft_config(config_path, text)


def parse_peft_config(config_path: Path, text: bytes) -> PeftConfig:
    """The checked adapter_config.json from its bytes (`config_path` names it in errors)."""
    try:
        config = json.loads(text.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:  # ValueError: not JSON, or an integer past 4,300 digits
        raise InputError(config_path, f"unreadable adapter config ({exc})") from None
    if not isinstance(config, dict):
        raise InputError(config_path, "adapter config is not a JSON object")
    peft_type = str(config.get("peft_type", "LORA")).upper()
    if peft_type == "ADALORA":
        return _adalora_config(config_path, config)
    if peft_type == "IA3":
        raise InputError(
            config_path,
            "PEFT type IA3 is a per-channel rescale of the base weights (ΔW = W0·(l − 1)), not a low-rank update: "
            "without the base model's weights it has no ΔW to store; merge it into the base (PEFT merge_and_unload), "
            "save the merged model, and ingest that with --base BASE",
        )
    if peft_type != "LORA":
        raise InputError(config_path, f"unsupported PEFT type {peft_type}: only LORA and ADALORA adapters can be canonicalized")
    r_default = _rank(config_path, config, "r", 8.0)
    return PeftConfig(
        path=config_path,
        raw=config,
        r=r_default,
        alpha=_number(config_path, "lora_alpha", config.get("lora_alpha"), r_default),
        rank_pattern=_patterns(config_path, config, "rank_pattern"),
        alpha_pattern=_patterns(config_path, config, "alpha_pattern"),
        rslora=bool(config.get("use_rslora", False)),
        fan_in_fan_out=bool(config.get("fan_in_fan_out", False)),
    )


def _adalora_config(config_path: Path, config: dict) -> PeftConfig:
    """An AdaLoRA config: init_r (the ranknum of every module) and lora_alpha; its rank_pattern (which ranks each
    module kept, already applied to the saved factors) is recorded, not a LoRA rank pattern."""
    init_r = _rank(config_path, config, "init_r", 12.0)
    return PeftConfig(
        path=config_path,
        raw=config,
        r=init_r,
        alpha=_number(config_path, "lora_alpha", config.get("lora_alpha"), 8.0),
        rank_pattern=[],
        alpha_pattern=[],
        rslora=False,
        fan_in_fan_out=bool(config.get("fan_in_fan_out", False)),
        adalora_init_r=int(init_r),
    )


def _rank(config_path: Path, config: dict, key: str, default: float) -> float:
    """The config's rank under `key` (`default` where absent): a positive whole number."""
    rank = _number(config_path, key, config.get(key), default, positive=True)
    if rank != int(rank):
        raise InputError(config_path, f"{key} must be a whole number, got {rank}")
    return rank


def peft_weights(directory: Path) -> Path:
    """The weight file of a PEFT directory."""
    weights = next((directory / n for n in WEIGHT_NAMES if (directory / n).is_file()), None)
    if weights is None:
        raise InputError(directory, f"PEFT adapter without weights: expected one of {', '.join(WEIGHT_NAMES)}")
    return weights


def _adalora_a(weights: Path, name: str, A: torch.Tensor, E: torch.Tensor | None) -> torch.Tensor:
    """diag(E)·A: AdaLoRA's singular values folded into its A factor, so that dW = B·(diag(E)·A)·scale is a B·A."""
    if E is None:
        raise InputError(weights, f"{name} has AdaLoRA lora_A and lora_B but no lora_E")
    if E.numel() != A.shape[0]:
        raise InputError(weights, f"{name}: lora_E {list(E.shape)} must hold one value for each of lora_A's {A.shape[0]} rows")
    check_finite(weights, f"{name}.lora_E", E)
    return A * E.reshape(-1, *[1] * (A.ndim - 1)).to(A.dtype)


def parse_peft(directory: Path, cfg: PeftConfig, weights_file: WeightFile) -> AdapterData:
    """The modules of a PEFT adapter from its checked config and its weight file's bytes."""
    weights = weights_file.path
    tensors, metadata = parse_tensors(weights_file)

    def strip(key: str) -> str:
        return key[len(KEY_PREFIX) :] if key.startswith(KEY_PREFIX) else key

    used: set[str] = set()
    modules: list[LoraModule] = []
    pairs = (ADALORA_PAIR,) if cfg.adalora_init_r is not None else PAIRS
    for key in sorted(tensors):
        for a_suffix, b_suffix in pairs:
            if not key.endswith(a_suffix):
                continue
            stem = key[: -len(a_suffix)]
            b_key = stem + b_suffix
            name = strip(stem)
            if b_key not in tensors:
                raise InputError(weights, f"{name} has lora_A but no lora_B")
            used.update((key, b_key))
            A, B = tensors[key], tensors[b_key]
            if A.ndim not in CONV_NDIMS or B.ndim not in CONV_NDIMS:
                got = f"A {list(A.shape)} and B {list(B.shape)}"
                raise InputError(weights, f"{name}: factors must be matrices (or conv kernels), got {got}")
            embedding = a_suffix == ".lora_embedding_A"
            kind = "embedding" if embedding else ("conv" if A.ndim > 2 else "linear")
            if cfg.adalora_init_r is not None:
                used.add(stem + ADALORA_E)
                if A.shape[0] == 0:
                    break  # AdaLoRA pruned every rank: no update
                A = _adalora_a(weights, name, A, tensors.get(stem + ADALORA_E))
            A2 = A.reshape(A.shape[0], -1)
            B2 = B.reshape(B.shape[0], -1)
            if kind == "conv" and B.ndim == A.ndim and 0 < B2.shape[1] < A2.shape[0] and A2.shape[0] % B2.shape[1] == 0:
                # PEFT's LoRA on a conv with groups > 1: B is grouped (out × r/groups), the update is not B·A
                got = f"B's kernel {list(B.shape)} has {B2.shape[1]} input channel{'s' if B2.shape[1] > 1 else ''} for rank {A2.shape[0]}"
                raise InputError(weights, f"{name}: LoRA on a grouped convolution ({got}) is not supported")
            check_pair(weights, name, A2, B2)
            alpha, scale = cfg.module_scale(weights, name, A2.shape[0])
            transposed = embedding or (cfg.fan_in_fan_out and kind == "linear")
            if transposed:  # dW = (B·A)ᵀ = Aᵀ·Bᵀ in the stored weight's layout
                A2, B2 = B2.T, A2.T
            modules.append(LoraModule(name, A2, B2, alpha, scale, kind, transposed))
    for key in tensors:
        if key.endswith(tuple(b for _, b in pairs)) and key not in used:
            raise InputError(weights, f"{strip(key)} has lora_B but no lora_A")
    if not modules:
        raise InputError(weights, "empty adapter: no lora_A/lora_B tensors found")
    extra = {}
    for key in sorted(set(tensors) - used):
        check_finite(weights, strip(key), tensors[key])
        extra[strip(key)] = list(tensors[key].shape)
    r_values = sorted({m.rank for m in modules})
    recorded = {
        **cfg.settings(),
        "ranks": r_values,
        "use_dora": bool(cfg.raw.get("use_dora", False)),
        "peft_type": "ADALORA" if cfg.adalora_init_r is not None else "LORA",
        "target_modules": cfg.raw.get("target_modules"),
        "task_type": cfg.raw.get("task_type"),
        "modules_to_save": cfg.raw.get("modules_to_save"),
        "peft_version": cfg.raw.get("peft_version"),
    }
    return AdapterData(
        path=directory,
        format="peft",
        weight_files=[weights],
        base_model=cfg.base_model,
        modules=modules,
        config=recorded,
        extra_tensors=extra,
        metadata=metadata,
    )

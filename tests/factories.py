"""Real test inputs: PEFT adapters trained for a few steps on a tiny torch model, kohya files."""

from __future__ import annotations

from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import save_file
from torch import nn
from transformers.pytorch_utils import Conv1D

from zoo.domain.canonical import CanonicalFactors, canonicalize
from zoo.domain.transforms import Update

D = 16
VOCAB = 24


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q_proj = nn.Linear(D, D)
        self.k_proj = nn.Linear(D, D)
        self.v_proj = nn.Linear(D, D)
        self.o_proj = nn.Linear(D, D)
        self.c_fc = Conv1D(2 * D, D)  # GPT-2 style (in × out storage)
        self.c_proj = Conv1D(D, 2 * D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        att = torch.softmax(self.q_proj(x) @ self.k_proj(x).transpose(-1, -2) / D**0.5, dim=-1)
        x = x + self.o_proj(att @ self.v_proj(x))
        return x + self.c_proj(torch.relu(self.c_fc(x)))


class TinyLM(nn.Module):
    """A small transformer-shaped model: embedding, two blocks, a head."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(VOCAB, D)
        self.layers = nn.ModuleList([Block() for _ in range(2)])
        self.head = nn.Linear(D, 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(x.mean(dim=1))


def train_peft_adapter(
    out_dir: Path, seed: int = 0, steps: int = 5, targets: tuple[str, ...] = ("q_proj", "v_proj"), **lora_kwargs: object
) -> PeftModel:
    """Fine-tune LoRA on a tiny task for a few steps and save it with PEFT's save_pretrained."""
    model = TinyLM(seed=0)
    cfg = LoraConfig(target_modules=list(targets), **{"r": 4, "lora_alpha": 8, **lora_kwargs})
    peft_model = get_peft_model(model, cfg)
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (32, 6), generator=gen)
    labels = torch.randint(0, 3, (32,), generator=gen)
    opt = torch.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad], lr=5e-2)
    torch.manual_seed(seed)
    for _ in range(steps):
        loss = nn.functional.cross_entropy(peft_model(ids), labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
    peft_model.save_pretrained(str(out_dir))
    return peft_model


def write_kohya_file(
    path: Path,
    seed: int = 0,
    rank: int = 4,
    alpha: float | None = 2.0,
    conv: bool = True,
    metadata: dict[str, str] | None = None,
) -> dict[str, torch.Tensor]:
    """A kohya-ss style SD LoRA file (linear and conv modules, `alpha` scalars, ss_* metadata)."""
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for i in range(2):
        stem = f"lora_unet_down_blocks_0_attentions_{i}_transformer_blocks_0_attn1_to_q"
        tensors[f"{stem}.lora_down.weight"] = torch.randn(rank, 32, generator=gen).half()
        tensors[f"{stem}.lora_up.weight"] = torch.randn(40, rank, generator=gen).half() * 0.1
        if alpha is not None:
            tensors[f"{stem}.alpha"] = torch.tensor(float(alpha))
    if conv:
        stem = "lora_unet_down_blocks_1_resnets_0_conv1"
        tensors[f"{stem}.lora_down.weight"] = torch.randn(rank, 8, 3, 3, generator=gen)
        tensors[f"{stem}.lora_up.weight"] = torch.randn(12, rank, 1, 1, generator=gen) * 0.1
        if alpha is not None:
            tensors[f"{stem}.alpha"] = torch.tensor(float(alpha))
    save_file(tensors, str(path), metadata=metadata or {"ss_network_dim": str(rank), "ss_sd_model_name": "sd-v1-5"})
    return tensors


#: adapters in the seeded zoo (w00..w11)
SEEDED = 12


def write_seed_sources(root: Path, count: int = SEEDED) -> Path:
    """The seeded zoo's sources: `count` PEFT adapters under root/zoo (w00.., tasks qk and qv in turn, each with a
    test_accuracy, in root/labels.csv) and one more, root/outside/new, that stays out of the zoo. Returns root."""
    rows = ["name,task,test_accuracy"]
    for i in range(count):
        qv = i % 2 == 1
        train_peft_adapter(root / "zoo" / f"w{i:02d}", seed=i, steps=4, targets=("q_proj", "v_proj") if qv else ("q_proj", "k_proj"))
        rows.append(f"w{i:02d},{'qv' if qv else 'qk'},{0.5 + i / 40}")
    (root / "labels.csv").write_text("\n".join(rows) + "\n")
    train_peft_adapter(root / "outside" / "new", seed=99, steps=4, targets=("q_proj", "v_proj"))
    return root


def seed_zoo(sources: Path, database_url: str, data_dir: Path) -> Path:
    """The seeded zoo, a small real zoo for the web app's tests: the adapters of sources/zoo (write_seed_sources)
    ingested with their labels as base model `tiny` into the (migrated) database, embedded, W2T trained. Returns
    data_dir. Tests take a copy of their own from tests/conftest.py (`seeded`, `copy_seeded`) rather than build it."""
    from zoo.cli import main

    base = ["--db", database_url, "--data-dir", str(data_dir)]
    ingest = ["ingest", "--no-embed", str(sources / "zoo"), "--labels", str(sources / "labels.csv"), "--base-model", "tiny", "--json"]
    if main([*base, *ingest]) != 0 or main([*base, "train", "--epochs", "2", "--members", "2", "--json"]) != 0:
        raise RuntimeError("seeding the test zoo failed")
    return data_dir


def write_random_peft_adapters(root: Path, count: int, seed: int = 0, targets: tuple[str, ...] = ("q_proj", "v_proj")) -> list[Path]:
    """`count` distinct PEFT adapters of TinyLM under root/NNNN, written by PEFT's save_pretrained with random LoRA
    factors (A and B, so no two share a canonical form): real PEFT output, without training each one."""
    model = get_peft_model(TinyLM(seed=0), LoraConfig(target_modules=list(targets), r=4, lora_alpha=8))
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(count):
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_" in name:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
        out.append(root / f"{i:04d}")
        model.save_pretrained(str(out[-1]))
    return out


class TwoLinear(nn.Module):
    """Two linear layers, `up` (inp → hidden) and `down` (hidden → out): a model for PEFT's merges."""

    def __init__(self, inp: int, hidden: int, out: int) -> None:
        super().__init__()
        self.up = nn.Linear(inp, hidden)
        self.down = nn.Linear(hidden, out)


def peft_merge_model(inp: int, hidden: int, out: int, rank: int, count: int = 8) -> PeftModel:
    """A PEFT model of `TwoLinear` with `count` LoRA adapters a0, a1, … of random factors (lora_alpha = 2·rank), for
    PEFT's `add_weighted_adapter` to merge."""
    torch.manual_seed(0)
    config = {"r": rank, "lora_alpha": 2 * rank, "target_modules": ["up", "down"]}
    model = get_peft_model(TwoLinear(inp, hidden, out), LoraConfig(**config), adapter_name="a0")
    for i in range(1, count):
        model.add_adapter(f"a{i}", LoraConfig(**config))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn_like(p) * (0.3 if "lora_A" in name else 0.05))
    return model


def peft_update(model: PeftModel, adapter: str, id: int | None = None, with_gauges: bool = False) -> Update:
    """An adapter of a `peft_merge_model` as the relation step reads it; with the gauges of its factors (blobs
    written since they are kept)."""
    state = model.state_dict()
    config = model.peft_config[adapter]
    factors = {}
    for module in ("up", "down"):
        A = state[f"base_model.model.{module}.lora_A.{adapter}.weight"]
        B = state[f"base_model.model.{module}.lora_B.{adapter}.weight"]
        f = canonicalize(A, B, config.lora_alpha / config.r)
        factors[module] = f if with_gauges else CanonicalFactors(f.U, f.S, f.V)
    return Update(factors, id=id)

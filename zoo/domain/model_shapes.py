"""The module shapes of public models, from their published configs (no weights are needed): every module a LoRA of
each can adapt, under the names its adapters give it: PEFT's for LLMs and encoders, kohya's for Stable Diffusion UNets
and text encoders, diffusers' and Black Forest Labs' for Flux. A shape is the stored weight's out × in, a conv's in being in · kh · kw
(as ingest records modules)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class ModuleShape:
    """One LoRA-adapted module: its name in the file (without the format's prefix and suffixes), its weight's
    out × in, and a conv kernel (kh, kw) when it is a convolution."""

    name: str
    out: int
    inp: int
    kernel: tuple[int, int] | None = None
    #: a kohya-named module's dotted path in its pipeline, as diffusers names it (`unet.down_blocks.0.resnets.0.conv1`,
    #: `text_encoder.encoder.layers.0.self_attn.q_proj`; Flux's in its own names): what resolves kohya's underscores
    path: str | None = None
    #: other kohya names of the module: an SD UNet's in the original (SGM, A1111) layout, `lora_unet_input_blocks_4_1_…`;
    #: Flux's, `lora_unet_double_blocks_0_img_attn_qkv`
    aliases: tuple[str, ...] = ()

    @property
    def fan_in(self) -> int:
        return self.inp * (self.kernel[0] * self.kernel[1] if self.kernel else 1)


#: a model's modules, given how many of its blocks (LLM layers, UNet blocks, transformer blocks) to keep
Blocks = Callable[[int], Iterator[ModuleShape]]

ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def llm(hidden: int, intermediate: int, kv: int, targets: tuple[str, ...] = ALL_LINEAR) -> Blocks:
    """A Llama-style decoder's attention and MLP projections (`model.layers.{i}...`)."""
    shapes = {
        "q_proj": ("self_attn", hidden, hidden),
        "k_proj": ("self_attn", kv, hidden),
        "v_proj": ("self_attn", kv, hidden),
        "o_proj": ("self_attn", hidden, hidden),
        "gate_proj": ("mlp", intermediate, hidden),
        "up_proj": ("mlp", intermediate, hidden),
        "down_proj": ("mlp", hidden, intermediate),
    }

    def modules(layers: int) -> Iterator[ModuleShape]:
        for i in range(layers):
            for t in targets:
                block, out, inp = shapes[t]
                yield ModuleShape(f"model.layers.{i}.{block}.{t}", out, inp)

    return modules


def _transformer_block(prefix: str, width: int, context: int) -> Iterator[ModuleShape]:
    """A diffusers BasicTransformerBlock: self-attention, cross-attention to the text, GEGLU feed-forward."""
    for attn, kv_in in (("attn1", width), ("attn2", context)):
        yield ModuleShape(f"{prefix}.{attn}.to_q", width, width)
        yield ModuleShape(f"{prefix}.{attn}.to_k", width, kv_in)
        yield ModuleShape(f"{prefix}.{attn}.to_v", width, kv_in)
        yield ModuleShape(f"{prefix}.{attn}.to_out.0", width, width)
    yield ModuleShape(f"{prefix}.ff.net.0.proj", 8 * width, width)
    yield ModuleShape(f"{prefix}.ff.net.2", width, 4 * width)


def _resnet(prefix: str, inp: int, out: int) -> Iterator[ModuleShape]:
    yield ModuleShape(f"{prefix}.conv1", out, inp, (3, 3))
    yield ModuleShape(f"{prefix}.conv2", out, out, (3, 3))
    if inp != out:
        yield ModuleShape(f"{prefix}.conv_shortcut", out, inp, (1, 1))


def _attention(prefix: str, width: int, depth: int, context: int) -> Iterator[ModuleShape]:
    yield ModuleShape(f"{prefix}.proj_in", width, width)
    for t in range(depth):
        yield from _transformer_block(f"{prefix}.transformer_blocks.{t}", width, context)
    yield ModuleShape(f"{prefix}.proj_out", width, width)


def _clip(width: int, mlp: int, layers: int) -> Iterator[ModuleShape]:
    for i in range(layers):
        for t in ("q_proj", "k_proj", "v_proj", "out_proj"):
            yield ModuleShape(f"encoder.layers.{i}.self_attn.{t}", width, width)
        yield ModuleShape(f"encoder.layers.{i}.mlp.fc1", mlp, width)
        yield ModuleShape(f"encoder.layers.{i}.mlp.fc2", width, mlp)


def _kohya_named(
    shapes: Iterator[ModuleShape], component: str, kohya_prefix: str, sgm: Callable[[str], str] | None = None
) -> Iterator[ModuleShape]:
    """Modules of a pipeline's `component`, given by their dotted paths in it, under their kohya names (the dotted
    path kept as `path`, the kohya name of the `sgm` path as an alias)."""
    for m in shapes:
        aliases = (kohya_prefix + sgm(m.name).replace(".", "_"),) if sgm else ()
        yield ModuleShape(kohya_prefix + m.name.replace(".", "_"), m.out, m.inp, m.kernel, f"{component}.{m.name}", aliases)


#: a resnet's convs, and the projection of the time embedding into it, in the original (SGM) UNet
_SGM_RESNET = {"conv1": "in_layers.2", "conv2": "out_layers.3", "conv_shortcut": "skip_connection", "time_emb_proj": "emb_layers.1"}


def _sgm_path(path: str, up_attention: list[bool]) -> str:
    """The original (SGM/LDM) UNet's path of a diffusers UNet module (two resnets a down block, three an up block):
    `down_blocks.b.{resnets,attentions}.j` is `input_blocks.(1+3b+j).{0,1}`, its downsampler `input_blocks.(3+3b).0.op`;
    the mid block's resnet, attention, resnet are `middle_block.0/1/2`; `up_blocks.b.{resnets,attentions}.j` is
    `output_blocks.(3b+j).{0,1}`, its upsampler the next layer of `output_blocks.(3b+2)`; a resnet's conv1, conv2 and
    conv_shortcut are in_layers.2, out_layers.3 and skip_connection."""
    parts = path.split(".")
    block, rest = parts[0], parts[1:]
    if block == "mid_block":
        kind, j, inner = rest[0], int(rest[1]), rest[2:]
        head = f"middle_block.{1 if kind == 'attentions' else 2 * j}"
    else:
        b, kind, j, inner = int(rest[0]), rest[1], int(rest[2]), rest[3:]
        if block == "down_blocks":
            head = f"input_blocks.{3 + 3 * b}.0" if kind == "downsamplers" else f"input_blocks.{1 + 3 * b + j}.{int(kind == 'attentions')}"
        elif kind == "upsamplers":
            head = f"output_blocks.{3 * b + 2}.{1 + up_attention[b]}"
        else:
            head = f"output_blocks.{3 * b + j}.{int(kind == 'attentions')}"
    if kind == "resnets":
        inner = [_SGM_RESNET.get(inner[0], inner[0])]
    elif kind == "downsamplers":
        inner = ["op"]
    return ".".join([head, *inner])


@dataclass(frozen=True)
class TextEncoder:
    """A CLIP text encoder: the pipeline's component, its kohya prefix, width, MLP width and layers."""

    component: str
    prefix: str
    width: int
    mlp: int
    layers: int


def unet(down: tuple[tuple[int, int], ...], mid_depth: int, context: int, text_encoders: tuple[TextEncoder, ...]) -> Blocks:
    """A Stable Diffusion UNet in kohya's names: `down` is (channels, transformer blocks per attention) per down block,
    the up blocks mirror them (3 resnets each), `context` is the cross-attention width (the text encoders' output);
    then the text encoders. `blocks` keeps the first down/mid/up blocks and as many layers of each text encoder
    (all of them once every UNet block is kept)."""

    def modules(blocks: int) -> Iterator[ModuleShape]:
        units: list[list[ModuleShape]] = []
        skips = [320]
        ch = 320
        last = len(down) - 1
        for b, (width, depth) in enumerate(down):
            parts: list[ModuleShape] = []
            for j in range(2):
                parts += _resnet(f"down_blocks.{b}.resnets.{j}", ch, width)
                ch = width
                if depth:
                    parts += _attention(f"down_blocks.{b}.attentions.{j}", width, depth, context)
                skips.append(ch)
            if b < last:
                parts.append(ModuleShape(f"down_blocks.{b}.downsamplers.0.conv", ch, ch, (3, 3)))
                skips.append(ch)
            units.append(parts)
        units.append(
            [
                *_resnet("mid_block.resnets.0", ch, ch),
                *_attention("mid_block.attentions.0", ch, mid_depth, context),
                *_resnet("mid_block.resnets.1", ch, ch),
            ]
        )
        for b, (width, depth) in enumerate(reversed(down)):
            parts = []
            for j in range(3):
                parts += _resnet(f"up_blocks.{b}.resnets.{j}", ch + skips.pop(), width)
                ch = width
                if depth:
                    parts += _attention(f"up_blocks.{b}.attentions.{j}", width, depth, context)
            if b < last:
                parts.append(ModuleShape(f"up_blocks.{b}.upsamplers.0.conv", ch, ch, (3, 3)))
            units.append(parts)
        up_attention = [depth > 0 for _, depth in reversed(down)]
        for part in units[:blocks]:
            yield from _kohya_named(iter(part), "unet", "lora_unet_", lambda p: _sgm_path(p, up_attention))
        for te in text_encoders:
            layers = te.layers if blocks >= len(units) else min(blocks, te.layers)
            yield from _kohya_named(_clip(te.width, te.mlp, layers), te.component, te.prefix)

    return modules


#: the width of an SD UNet's time embedding (4 × its first block's 320 channels)
TIME_EMBED = 1280
#: an SD UNet's modules outside its blocks, as (diffusers path, out, in, kernel, original SGM path): the latent's input
#: and output convs and the time embedding's MLP
_UNET_OUTSIDE = (
    ("conv_in", 320, 4, (3, 3), "input_blocks.0.0"),
    ("conv_out", 4, 320, (3, 3), "out.2"),
    ("time_embedding.linear_1", TIME_EMBED, 320, None, "time_embed.0"),
    ("time_embedding.linear_2", TIME_EMBED, TIME_EMBED, None, "time_embed.2"),
)
#: SDXL's added conditioning (pooled text and size/crop embeddings: 1,280 + 6 × 256 inputs), SGM's `label_emb`
_SDXL_ADDED = (
    ("add_embedding.linear_1", TIME_EMBED, 2816, None, "label_emb.0.0"),
    ("add_embedding.linear_2", TIME_EMBED, TIME_EMBED, None, "label_emb.0.2"),
)


def unet_outside(blocks: Blocks, sdxl: bool = False) -> Iterator[ModuleShape]:
    """The modules LoRAs also adapt beside a UNet's attentions and convs, under kohya's names with their SGM aliases:
    conv_in, conv_out, the time embedding's linear_1 / linear_2 (SDXL's add_embedding too), each resnet's
    `time_emb_proj` (time embedding → its channels, the out of its conv1), and SDXL's second text encoder's
    `text_projection`. For the module tables only (the real-size adapters of zoo/reference/real_shapes.py keep
    `blocks`' modules)."""
    for path, out, inp, kernel, sgm in (*_UNET_OUTSIDE, *(_SDXL_ADDED if sdxl else ())):
        yield ModuleShape("lora_unet_" + path.replace(".", "_"), out, inp, kernel, f"unet.{path}", ("lora_unet_" + sgm.replace(".", "_"),))
    for m in blocks(99):  # every block
        if m.path is not None and m.path.startswith("unet.") and m.path.endswith(".conv1"):
            path = m.path.removeprefix("unet.").removesuffix("conv1") + "time_emb_proj"
            sgm = "lora_unet_" + _sgm_path(path, []).replace(".", "_")
            yield ModuleShape("lora_unet_" + path.replace(".", "_"), m.out, TIME_EMBED, None, f"unet.{path}", (sgm,))
    if sdxl:
        yield ModuleShape("lora_te2_text_projection", 1280, 1280, None, "text_encoder_2.text_projection")


_CLIP_L = TextEncoder("text_encoder", "lora_te_text_model_", 768, 3072, 12)
#: SD 1.x: CLIP ViT-L/14's text encoder, cross-attention 768
sd1 = unet(((320, 1), (640, 1), (1280, 1), (1280, 0)), 1, 768, (_CLIP_L,))
#: SD 2.x: OpenCLIP ViT-H/14's text encoder (23 of its layers are used), cross-attention 1024
sd2 = unet(((320, 1), (640, 1), (1280, 1), (1280, 0)), 1, 1024, (TextEncoder("text_encoder", "lora_te_text_model_", 1024, 4096, 23),))
#: SDXL: no attention in the first block, 10 transformer blocks deep at 1280; CLIP ViT-L and OpenCLIP bigG, cross-attention 2048
sdxl = unet(
    ((320, 0), (640, 2), (1280, 10)),
    10,
    2048,
    (
        TextEncoder("text_encoder", "lora_te1_text_model_", 768, 3072, 12),
        TextEncoder("text_encoder_2", "lora_te2_text_model_", 1280, 5120, 32),
    ),
)


def flux(blocks: int) -> Iterator[ModuleShape]:
    """Flux.1-dev's transformer: 19 double-stream blocks and 38 single-stream blocks, width 3,072
    (`blocks` < 19 keeps that many of each)."""
    width, mlp = 3072, 12288
    double, single = (19, 38) if blocks >= 19 else (blocks, blocks)
    for i in range(double):
        p = f"transformer.transformer_blocks.{i}"
        for t in ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"):
            yield ModuleShape(f"{p}.attn.{t}", width, width)
        for ff in ("ff", "ff_context"):
            yield ModuleShape(f"{p}.{ff}.net.0.proj", mlp, width)
            yield ModuleShape(f"{p}.{ff}.net.2", width, mlp)
    for i in range(single):
        p = f"transformer.single_transformer_blocks.{i}"
        for t in ("to_q", "to_k", "to_v"):
            yield ModuleShape(f"{p}.attn.{t}", width, width)
        yield ModuleShape(f"{p}.proj_mlp", mlp, width)
        yield ModuleShape(f"{p}.proj_out", width, width + mlp)


def flux_bfl(blocks: int) -> Iterator[ModuleShape]:
    """Flux.1-dev's transformer in Black Forest Labs' own names (its reference code, kohya-ss's Flux LoRAs, XLabs'):
    a double block's fused q·k·v projection `img_attn.qkv` (and `txt_attn.qkv`) is one module of 3·3,072 outputs, a
    single block's `linear1` fuses q, k, v and the MLP's input (3·3,072 + 12,288 outputs), its `linear2` the
    attention's output and the MLP's (3,072 + 12,288 inputs). Each is its own path, and kohya-ss's name
    (`lora_unet_double_blocks_0_img_attn_qkv`) its alias."""
    width, mlp = 3072, 12288
    double, single = (19, 38) if blocks >= 19 else (blocks, blocks)
    shapes: list[tuple[str, int, int]] = []
    for i in range(double):
        for stream in ("img", "txt"):
            p = f"double_blocks.{i}.{stream}"
            shapes += [(f"{p}_mod.lin", 6 * width, width), (f"{p}_attn.qkv", 3 * width, width), (f"{p}_attn.proj", width, width)]
            shapes += [(f"{p}_mlp.0", mlp, width), (f"{p}_mlp.2", width, mlp)]
    for i in range(single):
        p = f"single_blocks.{i}"
        shapes += [(f"{p}.linear1", 3 * width + mlp, width), (f"{p}.linear2", width, width + mlp)]
        shapes.append((f"{p}.modulation.lin", 3 * width, width))
    for name, out, inp in shapes:
        yield ModuleShape(name, out, inp, path=name, aliases=("lora_unet_" + name.replace(".", "_"),))


#: kohya's prefix of Flux's modules in diffusers' names (`lora_transformer_transformer_blocks_0_attn_to_q`), which
#: diffusers' `_convert_kohya_flux_lora_to_diffusers` reads
FLUX_KOHYA = "lora_transformer_"


def flux_outside(blocks: int) -> Iterator[ModuleShape]:
    """Flux.1-dev's modules in diffusers' names beside its blocks' attention and MLP (the latent and text inputs'
    embedders, the output projection and its norm, the timestep, guidance and pooled-text embedders, each block's
    norm modulation), for the module tables only."""
    width = 3072
    double, single = (19, 38) if blocks >= 19 else (blocks, blocks)
    shapes = [("x_embedder", width, 64), ("context_embedder", width, 4096), ("proj_out", 64, width), ("norm_out.linear", 2 * width, width)]
    for embedder, inp in (("timestep_embedder", 256), ("guidance_embedder", 256), ("text_embedder", 768)):
        shapes += [(f"time_text_embed.{embedder}.linear_1", width, inp), (f"time_text_embed.{embedder}.linear_2", width, width)]
    for i in range(double):
        shapes += [(f"transformer_blocks.{i}.{norm}.linear", 6 * width, width) for norm in ("norm1", "norm1_context")]
    shapes += [(f"single_transformer_blocks.{i}.norm.linear", 3 * width, width) for i in range(single)]
    for name, out, inp in shapes:
        yield ModuleShape(f"transformer.{name}", out, inp)


def kohya_flux_named(modules: Iterator[ModuleShape]) -> Iterator[ModuleShape]:
    """Flux's modules in diffusers' names (`transformer.…`), each its own path with kohya's `lora_transformer_` name as
    its alias."""
    for m in modules:
        alias = FLUX_KOHYA + m.name.removeprefix("transformer.").replace(".", "_")
        yield ModuleShape(m.name, m.out, m.inp, m.kernel, m.name, (alias,))


def _bert(layers: int) -> Iterator[ModuleShape]:
    """BERT-base (PEFT's names on BertModel): 12 layers of width 768, MLP 3072, vocabulary 30,522."""
    attention = ("attention.self.query", "attention.self.key", "attention.self.value", "attention.output.dense")
    yield from _bert_base_shaped(layers, "encoder.layer", attention, ("intermediate.dense", "output.dense"))
    yield ModuleShape("pooler.dense", 768, 768)


def _distilbert(layers: int) -> Iterator[ModuleShape]:
    """DistilBERT-base (PEFT's names on DistilBertModel): 6 layers of width 768, MLP 3072, vocabulary 30,522."""
    attention = tuple(f"attention.{t}" for t in ("q_lin", "k_lin", "v_lin", "out_lin"))
    yield from _bert_base_shaped(layers, "transformer.layer", attention, ("ffn.lin1", "ffn.lin2"))


def _bert_base_shaped(layers: int, prefix: str, attention: tuple[str, ...], mlp: tuple[str, str]) -> Iterator[ModuleShape]:
    """The word embeddings, then per layer `prefix`.i's `attention` projections (768 × 768) and `mlp` (up to 3072, down
    to 768)."""
    yield ModuleShape("embeddings.word_embeddings", 30522, 768)
    for i in range(layers):
        for t in attention:
            yield ModuleShape(f"{prefix}.{i}.{t}", 768, 768)
        yield ModuleShape(f"{prefix}.{i}.{mlp[0]}", 3072, 768)
        yield ModuleShape(f"{prefix}.{i}.{mlp[1]}", 768, 3072)


def _gpt2(layers: int) -> Iterator[ModuleShape]:
    """GPT-2 small (PEFT's names on GPT2Model): 12 layers of width 768, vocabulary 50,257. Its Conv1D weights are
    stored in × out (c_attn 768 × 2304), the layout ingest records them in."""
    yield ModuleShape("wte", 50257, 768)
    for i in range(layers):
        p = f"h.{i}"
        yield ModuleShape(f"{p}.attn.c_attn", 768, 3 * 768)
        yield ModuleShape(f"{p}.attn.c_proj", 768, 768)
        yield ModuleShape(f"{p}.mlp.c_fc", 768, 4 * 768)
        yield ModuleShape(f"{p}.mlp.c_proj", 4 * 768, 768)


def _decoder(hidden: int, intermediate: int, kv: int, layers: int, vocab: int) -> list[ModuleShape]:
    """Every projection of a Llama-style decoder, its token embedding and its LM head."""
    return [ModuleShape("model.embed_tokens", vocab, hidden), *llm(hidden, intermediate, kv)(layers), ModuleShape("lm_head", vocab, hidden)]


#: every module a LoRA of each model can adapt, by model (all its blocks)
VOCABULARIES: dict[str, Callable[[], list[ModuleShape]]] = {
    "llama3-8b": lambda: _decoder(4096, 14336, 1024, 32, 128256),
    "mistral-7b": lambda: _decoder(4096, 14336, 1024, 32, 32000),
    "qwen2.5-7b": lambda: _decoder(3584, 18944, 512, 28, 152064),
    "sd1.5": lambda: [*sd1(9), *unet_outside(sd1)],
    "sd2.1": lambda: [*sd2(9), *unet_outside(sd2)],
    "sdxl": lambda: [*sdxl(7), *unet_outside(sdxl, sdxl=True)],
    "flux1-dev": lambda: [*kohya_flux_named(flux(19)), *kohya_flux_named(flux_outside(19)), *flux_bfl(19)],
    "bert-base": lambda: list(_bert(12)),
    "distilbert-base": lambda: list(_distilbert(6)),
    "gpt2": lambda: list(_gpt2(12)),
}

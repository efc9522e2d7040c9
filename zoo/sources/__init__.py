"""Where adapters come from. Sources yield paths to read; they never parse them."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Origin:
    """What a source knows about an adapter beyond its files, stored on its row by the ingest.

    Local files have none. A Hub source fills it from the repo it resolved: `uri` is the source
    without a revision (hf://owner/repo[/subfolder]), `revision` the commit sha it was pinned to.
    """

    uri: str
    revision: str | None = None
    author: str | None = None
    license: str | None = None
    tags: list[str] = field(default_factory=list)
    card: str | None = None
    #: the rest: datasets, downloads, likes, pipeline_tag, library_name, card_base_model (list),
    #: base_model_relation (adapter | finetune | merge | quantized), ...
    metadata: dict[str, object] = field(default_factory=dict)
    #: the adapter's name when its files' own name means nothing (a Hub cache folder is named by the commit)
    name: str | None = None

    @property
    def base_model(self) -> str | None:
        """The one base model the source names (a model card's `base_model`), if it names exactly one."""
        named = self.metadata.get("card_base_model")
        return named[0] if isinstance(named, list) and len(named) == 1 and isinstance(named[0], str) else None

"""Filters of the catalog and of similarity search, parsed in one place: each is a field of the adapter or one of its
given labels, in namespaces of their own. `rank=8` is the field, `label.rank=8` the label named rank; a key that is no
field is a label without the prefix too (`task=qv`), so a label of any name can be filtered and every filter written
before labels had a namespace keeps its meaning.

Requests carry filters as a mapping of names to values, a filter's name being Filter.name: the field's key, or the
label's key where that cannot be read as a field (else `label.<key>`). The mapping's keys that are fields are exactly
FIELDS; every other key names a label (label_key)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from zoo.errors import UsageError
from zoo.store.relations import RELATION_FILTERS

#: what a source (the Hub) said about an adapter: fields matched exactly (zoo.store.repository.SOURCE_FIELDS)
SOURCE_KEYS = ("author", "license", "pipeline_tag", "library", "base_model_relation")
#: the fields a filter may name: adapter columns, what a source said, relations found from the weights
FIELDS = ("rank", "format", "base_model", "source", *SOURCE_KEYS, *RELATION_FILTERS)
#: what makes a filter's key a label's, whatever the key
LABEL_PREFIX = "label."
#: the prefix of a label's facet (zoo.store.catalog): `label:<key>`
LABEL_FACET_PREFIX = "label:"


@dataclass(frozen=True)
class Filter:
    """One filter: a field's value, or a given label's."""

    kind: Literal["field", "label"]
    key: str
    value: str

    @property
    def name(self) -> str:
        """The filter's key in a request's mapping and in its text: the label prefix only where it is needed."""
        if self.kind == "label" and (self.key in FIELDS or self.key.startswith(LABEL_PREFIX)):
            return LABEL_PREFIX + self.key
        return self.key

    @property
    def text(self) -> str:
        return f"{self.name}={self.value}"


def parse_filter(text: str) -> Filter:
    """`key=value` (a field, else a label) or `label.key=value` (a label); UsageError naming the text otherwise."""
    key, sep, value = text.partition("=")
    if not sep or not key or not value:
        raise UsageError(f"filter {text!r}: write key=value")
    if key == LABEL_PREFIX:
        raise UsageError(f"filter {text!r}: name the label, label.key=value")
    return filter_of(key, value)


def filter_of(name: str, value: str) -> Filter:
    """The filter a request's mapping names `name` (see Filter.name)."""
    if name.startswith(LABEL_PREFIX):
        return Filter("label", name.removeprefix(LABEL_PREFIX), value)
    return Filter("field", name, value) if name in FIELDS else Filter("label", name, value)


def label_key(name: str) -> str:
    """The label key a request's filter name that is no field stands for."""
    return filter_of(name, "").key


def facet_filter_name(facet: str) -> str:
    """The filter name a catalog facet's values are chosen by: a field's facet is its key, `label:<key>` the label's."""
    if facet.startswith(LABEL_FACET_PREFIX):
        return Filter("label", facet.removeprefix(LABEL_FACET_PREFIX), "").name
    return facet

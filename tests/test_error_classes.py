"""Each of zoo's error classes declares how it is reported: its HTTP status and its error `type` on the class."""

from __future__ import annotations

import importlib
import pkgutil

import pytest

import embed
import webapp
import zoo
from webapp.errors import ERROR_TYPES
from zoo.errors import ZooError


def _every_error_class() -> list[type[ZooError]]:
    """Every ZooError subclass in zoo, embed and webapp (each module imported, so none is missed)."""
    for package in (zoo, embed, webapp):
        for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
            if not info.name.endswith(".__main__"):  # `python -m zoo.cli` runs the command
                importlib.import_module(info.name)
    found: list[type[ZooError]] = []
    todo: list[type[ZooError]] = [ZooError]
    while todo:
        cls = todo.pop()
        found.append(cls)
        todo.extend(cls.__subclasses__())
    return [cls for cls in found if cls.__module__.split(".")[0] in ("zoo", "embed", "webapp")]


ERRORS = _every_error_class()


@pytest.mark.parametrize("cls", ERRORS, ids=lambda cls: f"{cls.__module__}.{cls.__qualname__}")
def test_each_error_class_declares_a_known_type_of_its_status_class(cls: type[ZooError]) -> None:
    # a class that sets a 5xx status but keeps its parent's 4xx type (or the reverse) fails here
    assert cls.error_type in ERROR_TYPES
    assert ERROR_TYPES[cls.error_type][0] // 100 == cls.http_status // 100, (cls.error_type, cls.http_status)


def test_the_errors_users_see_keep_their_status_and_type() -> None:
    by_name = {cls.__name__: (cls.http_status, cls.error_type) for cls in ERRORS}
    assert {
        "ZooError": (400, "bad_request"),
        "UsageError": (400, "bad_request"),
        "NotFoundError": (404, "not_found"),
        "SpaceNotFoundError": (404, "not_found"),
        "NotReadyError": (409, "not_ready"),
        "InputError": (422, "unprocessable"),
        "UploadTooLarge": (413, "too_large"),
        "LabelLimitError": (413, "too_large"),
        "StorageError": (500, "storage"),
        "BlobStoreUnavailable": (503, "storage"),
        "TimeLimitError": (503, "unavailable"),
        "BusyError": (503, "unavailable"),
    }.items() <= by_name.items()

"""Adapters per Hugging Face `model_type`, registered by decorator; dispatch is a dict lookup."""
from __future__ import annotations

from specexport.errors import SpecexportError

_ADAPTERS: dict[str, type] = {}


def register_adapter(*model_types: str):
    """Class decorator: register an adapter for these model types. A duplicate raises."""

    def wrap(cls):
        for mt in model_types:
            if mt in _ADAPTERS:
                raise ValueError(f"model_type {mt!r} already has adapter {_ADAPTERS[mt].__name__}")
            _ADAPTERS[mt] = cls
        cls.model_types = model_types
        return cls

    return wrap


def adapters() -> dict[str, type]:
    _load_builtin()
    return dict(_ADAPTERS)


def get_adapter(model_type: str, *, where: str = "model"):
    """The adapter instance for `model_type`, or a SpecexportError listing the supported types."""
    _load_builtin()
    try:
        return _ADAPTERS[model_type]()
    except KeyError:
        raise SpecexportError(
            f"{where}: model_type {model_type!r} is not supported; supported: {', '.join(sorted(_ADAPTERS))}"
        ) from None


def _load_builtin() -> None:
    from specexport.export import adapters  # noqa: F401  (registers the built-in adapters)

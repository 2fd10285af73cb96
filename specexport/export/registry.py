"""Adapters per Hugging Face `model_type`: one explicit table, dispatch by dict lookup.

To add an architecture, write its adapter in adapters/ (a few attributes over DecoderAdapter, with
`model_types`) and list the class in ADAPTER_CLASSES. The table is built here from that list rather than
by registration on import, so the import graph has no cycle and a duplicate model_type fails at import.
"""
from __future__ import annotations

from specexport.errors import SpecexportError
from specexport.export.adapters.llama import LlamaAdapter
from specexport.export.adapters.qwen import Qwen2Adapter, Qwen3Adapter

ADAPTER_CLASSES = (LlamaAdapter, Qwen2Adapter, Qwen3Adapter)


def _table(classes) -> dict[str, type]:
    table: dict[str, type] = {}
    for cls in classes:
        for mt in cls.model_types:
            if mt in table:
                raise ValueError(f"model_type {mt!r} already has adapter {table[mt].__name__}")
            table[mt] = cls
    return table


_ADAPTERS = _table(ADAPTER_CLASSES)


def adapters() -> dict[str, type]:
    return dict(_ADAPTERS)


def get_adapter(model_type: str, *, where: str = "model"):
    """The adapter instance for `model_type`, or a SpecexportError listing the supported types."""
    try:
        return _ADAPTERS[model_type]()
    except KeyError:
        raise SpecexportError(
            f"{where}: model_type {model_type!r} is not supported; supported: {', '.join(sorted(_ADAPTERS))}"
        ) from None

"""Built-in architecture adapters. Import a module here to register it."""
from specexport.export.adapters import llama, qwen  # noqa: F401

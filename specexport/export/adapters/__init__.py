"""Built-in architecture adapters, one short module per family; export/registry.py lists them."""

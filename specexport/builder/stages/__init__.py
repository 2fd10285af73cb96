"""The kinds of build stage (build/stage.py): one module each."""

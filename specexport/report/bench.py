"""`specexport bench`: configurations interleaved and repeated; report.json / report.md / plots.

A configuration is (method, target precision, draft precision, γ, draft_stop). Before measuring,
the target's thread settings are chosen (the fastest for vanilla, `threads.py`) and every
configuration runs once untimed (warm-up). Then every round runs every configuration once per
prompt, followed by the peers (each in its own process), so machine noise hits all of them alike.
The arithmetic of the rows (decode-time throughput, ideal from the rounds that ran, efficiency,
bootstrap intervals) is in `accounting.py`; the markdown and the plot in `render.py`.

This module is the bench's entry point; the parts are in:
- `grid.py`: the configurations (`Config`, `BenchConfig`, `DEFAULT_PROMPTS`) and the checks of a request;
- `run.py`: `run_bench`, the order of warm-up, rounds and peers, and the writing of the report;
- `timing.py`: timed runs and the isolated cost of a forward;
- `rows.py`: the report's rows (`ROW_KEYS`), the peers' rows and the memory figures;
- `choice.py`: the γ and method choices made from the rows;
- `quick.py`: the build's quick bench (`quick_bench`, `short_table`).
`run_bench` lives in run.py and not here because quick.py calls it and this module re-exports quick.py's
names: an import each way between siblings would be a cycle (the import contracts in pyproject.toml).
"""
from __future__ import annotations

# re-exported: the names `specexport.cli` and the tests import from here
from specexport.report.choice import method_choices
from specexport.report.grid import DEFAULT_PROMPTS, VANILLA, BenchConfig, Config, accuracy_only
from specexport.report.quick import quick_bench, short_table
from specexport.report.rows import ROW_KEYS, SPEED_KEYS
from specexport.report.run import run_bench

__all__ = ["DEFAULT_PROMPTS", "ROW_KEYS", "SPEED_KEYS", "VANILLA", "BenchConfig", "Config", "accuracy_only",
           "method_choices", "quick_bench", "run_bench", "short_table"]

"""specexport bench OUTPUT_DIR: latency and acceptance per precision, method and γ."""
from __future__ import annotations

from pathlib import Path

import click

from specexport._console import console, progress
from specexport.errors import SpecexportError
from specexport.prompts import read_prompts


def _csv(value, cast=str):
    return tuple(cast(v) for v in value.split(",") if v.strip()) if value else None


@click.command()
@click.argument("output_dir", type=click.Path(file_okay=False))
@click.option("--precisions", default=None, help="Comma list (default: every precision built for the target).")
@click.option("--methods", default="vanilla,draft", show_default=True,
              help="Comma list of vanilla, draft, lookup, suffix, medusa, eagle.")
@click.option("--gammas", default="2,3,4,5,6", show_default=True)
@click.option("--draft-stops", default="", help="Comma list of draft_stop values: adaptive-γ rows at the largest γ.")
@click.option("--trees", default="", help="Comma list of draft trees (small, wide, deep): a draft-tree row each.")
@click.option("--medusa-trees", default="auto", show_default=True,
              help="Comma list of Medusa trees (auto, small, medium, large): a row each when --methods has medusa.")
@click.option("--eagle-trees", default="auto", show_default=True,
              help="Comma list of EAGLE trees (auto, dynamic, dynamic:TOP_K/DEPTH/TOTAL_TOKENS, small, wide, "
                   "deep): a row each when --methods has eagle.")
@click.option("--prompts", "prompts_file", default=None, type=click.Path(dir_okay=False),
              help="JSON-lines file of prompt strings (default: a few built-in code prompts).")
@click.option("--workload", "workload_file", default=None, type=click.Path(dir_okay=False),
              help="JSON-lines file of requests replayed in order each round (strings, or {\"turns\": [...]} "
                   "conversations), suffix rows through one cache per round; instead of --prompts. "
                   "benchmarks/workloads/ has four.")
@click.option("--chat", is_flag=True, help="Send each prompt as a user message in the build's chat template.")
@click.option("--max-new-tokens", default=128, show_default=True)
@click.option("--temperature", default=0.0, show_default=True, type=float,
              help="0: greedy; > 0: every row samples (lossless), each (prompt, round) cell with its own seed.")
@click.option("--rounds", default=3, show_default=True, help="Repetitions of every configuration, interleaved.")
@click.option("--threads", default=None, type=int,
              help="The target's intra-op threads (default: the setting fastest for vanilla, measured first).")
@click.option("--peers/--no-peers", default=True, show_default=True,
              help="Also time peers on the same checkpoints and prompt tokens: transformers greedy and "
                   "assisted generation, onnxruntime-genai greedy and n-gram (each where installed).")
@click.option("--peer", "peer_families", multiple=True,
              help="Time only these peer families (repeatable): transformers, onnxruntime-genai, llama.cpp, "
                   "ik_llama.cpp (default: every one that can run here; ik_llama.cpp with --ik-llama-cpp).")
@click.option("--llama-cpp", "llama_cpp", default=None, type=click.Path(file_okay=False),
              help="Folder with llama.cpp's llama-server (benchmarks/build_llama_cpp.py builds it; default: PATH): "
                   "its vanilla and its own speculative decoding on the build's GGUF files, as peers.")
@click.option("--llama-cpp-n-max", default=5, show_default=True, type=int,
              help="llama.cpp's (and ik_llama.cpp's) speculative row: the draft's n-max.")
@click.option("--ik-llama-cpp", "ik_llama_cpp", default=None, type=click.Path(file_okay=False),
              help="Folder with ik_llama.cpp's llama-server (benchmarks/build_ik_llama_cpp.py builds it): its "
                   "vanilla and speculation with -rtr on the build's GGUF files, as peers.")
@click.option("--out", default=None, type=click.Path(file_okay=False), help="Report folder (default: OUTPUT_DIR/bench).")
@click.option("-v", "--verbose", is_flag=True)
def bench(output_dir, precisions, methods, gammas, draft_stops, trees, medusa_trees, eagle_trees, prompts_file,
          workload_file, chat,
          max_new_tokens, temperature, rounds, threads, peers, peer_families, llama_cpp, llama_cpp_n_max, ik_llama_cpp,
          out, verbose):
    """Measure tokens/s, TTFT, TPOT, acceptance and speedup; write report.json, report.md and plots."""
    from specexport.report.bench import BenchConfig, run_bench

    workload = None
    if workload_file:
        from specexport.report.workload import read_workload

        if prompts_file:
            raise SpecexportError("--workload and --prompts: give one (a workload's requests are the prompts)")
        workload = read_workload(Path(workload_file))
        prompts = tuple(w if isinstance(w, str) else w[0] for w in workload)     # expanded once the model is open
    elif prompts_file:
        prompts = read_prompts(Path(prompts_file))
    else:
        from specexport.report.bench import DEFAULT_PROMPTS

        prompts = DEFAULT_PROMPTS
    try:
        gamma_list = _csv(gammas, int)
    except ValueError:
        raise SpecexportError(f"--gammas: expected a comma list of integers, got {gammas!r}") from None
    if not gamma_list or min(gamma_list) < 1:
        raise SpecexportError(f"--gammas: expected integers >= 1, got {gammas!r}")
    try:
        stops = _csv(draft_stops, float) or ()
    except ValueError:
        raise SpecexportError(f"--draft-stops: expected a comma list of numbers, got {draft_stops!r}") from None
    if any(not 0 < x < 1 for x in stops):
        raise SpecexportError(f"--draft-stops: expected probabilities in (0, 1), got {draft_stops!r}")
    cfg = BenchConfig(output_dir=Path(output_dir), prompts=prompts, precisions=_csv(precisions), draft_stops=stops,
                      trees=_csv(trees) or (), medusa_trees=_csv(medusa_trees) or ("auto",),
                      eagle_trees=_csv(eagle_trees) or ("auto",),
                      methods=_csv(methods) or ("vanilla",), gammas=gamma_list, max_new_tokens=max_new_tokens,
                      temperature=temperature, chat=chat,
                      rounds=rounds, out=Path(out) if out else None, threads=threads, peers=peers,
                      llama_cpp=Path(llama_cpp) if llama_cpp else None, llama_cpp_n_max=llama_cpp_n_max,
                      ik_llama_cpp=Path(ik_llama_cpp) if ik_llama_cpp else None,
                      peer_families=_peer_families(peer_families), workload=workload)
    from specexport.report.render import render_markdown

    err = console(stderr=True)
    with progress(err, "bench: timed runs") as steps:
        report = run_bench(cfg, log=lambda m: err.print(m, markup=False, highlight=False), steps=steps)
    click.echo(render_markdown(report))
    folder = cfg.out or cfg.output_dir / "bench"
    files = ["report.md", "report.json", *(Path(p).name for p in report.get("plots", []))]
    click.echo(f"report written to {folder}/: {', '.join(files)}", err=True)


def _peer_families(names) -> tuple[str, ...] | None:
    from specexport.report.rows import PEER_FAMILIES

    unknown = [n for n in names if n not in PEER_FAMILIES]
    if unknown:
        raise SpecexportError(f"--peer: {unknown[0]!r} is not a peer family; families: {', '.join(PEER_FAMILIES)}")
    return tuple(names) or None

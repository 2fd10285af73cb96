"""specexport generate OUTPUT_DIR PROMPT: stream text from a build, then print the stats."""
from __future__ import annotations

import click

from specexport._console import console, progress
from specexport.errors import SpecexportError


@click.command()
@click.argument("output_dir", type=click.Path(file_okay=False))
@click.argument("prompt")
@click.option("--method", default=None,
              help="auto (the default: what the build's bench measured fastest; vanilla when it measured nothing) | vanilla | "
                   "draft (a draft model) | lookup (prompt lookup: copies from earlier text, target only) | suffix "
                   "(suffix decoding: trees of what followed the longest earlier match, target only) | medusa (the "
                   "build's Medusa heads) | eagle (the build's EAGLE head)")
@click.option("--gamma", default=None,
              help="Tokens proposed per round (default: what the build's bench measured for the method, else 4), "
                   "or 'auto' (the γ `specexport bench` predicted best for the draft).")
@click.option("--tree", default=None,
              help="Draft a static token tree instead of a chain: small | wide | deep, or JSON rank paths "
                   "like '[[0],[1],[0,0]]'. With --method medusa: auto (the default: the tree "
                   "the build measured) | small | medium | large or rank paths. With --method eagle: auto (the "
                   "default) | dynamic | dynamic:4/5/15 (top_k/depth/total_tokens) | '{\"top_k\": 4, \"depth\": 5}' (EAGLE-2's "
                   "dynamic tree) | a static tree (small | wide | deep or rank paths).")
@click.option("--sampled-children", is_flag=True,
              help="With --tree and --temperature > 0: draw each node's children from the draft (multi-draft "
                   "verification) instead of taking its top-ranked tokens.")
@click.option("--draft-stop", default=0.0, show_default=True, type=float,
              help="End a round's drafting early once the draft's probability of its proposal is below this.")
@click.option("--temperature", default=0.0, show_default=True, type=float, help="0 = greedy.")
@click.option("--top-k", default=None, type=int)
@click.option("--top-p", default=None, type=float)
@click.option("--max-new-tokens", default=128, show_default=True, type=int)
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--precision", default=None, help="The target's precision (default: fp32, or gguf in a lean build).")
@click.option("--draft-precision", default=None, help="The draft's precision (default: --precision).")
@click.option("--threads", default=None, type=int,
              help="Target's ONNX Runtime intra-op threads (default: the threads and spinning the build's bench "
                   "measured fastest, else all cores).")
@click.option("--draft-threads", default=None, type=int, help="Draft's intra-op threads (default: the target's).")
@click.option("--device", default="cpu", show_default=True,
              help="cpu, or cuda / cuda:N: ONNX Runtime's CUDA execution provider (onnxruntime-gpu).")
@click.option("--stop", multiple=True, help="Stop string (repeatable).")
@click.option("--chat", is_flag=True, help="Send PROMPT as a user message in the build's chat template.")
@click.option("--compare", is_flag=True, help="Also time vanilla decoding on the same build and print the speedup.")
@click.option("-v", "--verbose", is_flag=True, help="Show tracebacks for errors.")
def generate(output_dir, prompt, method, gamma, tree, sampled_children, draft_stop, temperature, top_k, top_p, max_new_tokens, seed,
             precision, draft_precision, threads, draft_threads, device, stop, chat, compare, verbose):
    """Generate from PROMPT with the build in OUTPUT_DIR, streaming the text."""
    import specexport
    from specexport.runtime.pipeline import AS_TARGET, MEASURED

    pipe = specexport.load(output_dir, precision=precision, draft_precision=draft_precision,
                           threads=MEASURED if threads is None else threads,
                           draft_threads=AS_TARGET if draft_threads is None else draft_threads,
                           **({"device": device} if device != "cpu" else {}))
    notes = []
    if method is None:
        given = [flag for flag, v in (("--gamma", gamma), ("--tree", tree), ("--sampled-children", sampled_children),
                                      ("--draft-stop", draft_stop)) if v]
        if given:
            raise SpecexportError(f"{given[0]}: name the method it is for (--method draft, lookup, medusa or eagle); "
                                  f"the default, --method auto, takes its settings from the build's bench")
        method = "auto"                 # resolved with the request (runtime/methods.py), its note printed below
    gamma = gamma if gamma in ("auto", None) else _int_gamma(gamma)
    tree = _tree(tree)
    shown, prompt = prompt, {"prompt_ids": pipe.chat_ids(prompt)} if chat else {"prompt": prompt}
    pieces = pipe.stream(**prompt, max_new_tokens=max_new_tokens, method=method, gamma=gamma, draft_stop=draft_stop,
                         temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, stop=stop, tree=tree,
                         sampled_children=sampled_children)
    first = next(pieces, "")            # the first round: a failure there surfaces before anything is printed
    click.echo((f"> {shown}\n" if chat else shown) + first, nl=False)
    for piece in pieces:
        click.echo(piece, nl=False)
    out = pieces.output
    s = out.stats
    click.echo("")                      # the text's last line ends before any note
    if out.note:
        notes.append(f"--{'method' if method == 'auto' else 'gamma'} auto: {out.note}")
    if pipe.kernel_note:
        notes.append(pipe.kernel_note)
    for note in notes:
        click.secho(note, fg="yellow", err=True)
    label = method if s.gamma or method == "vanilla" else "vanilla (auto)"
    line = (f"[{label}] {len(out.token_ids)} tokens, finish {out.finish_reason}, {s.tokens_per_second:.1f} tok/s, "
            f"TTFT {s.ttft_s * 1e3:.1f} ms, TPOT {s.tpot_s * 1e3:.2f} ms")
    if s.proposed:                      # the shape in the words of the method's table entry (proposer_table)
        line += (f", {out.shape}, acceptance {s.acceptance_rate:.2f}, "
                 f"{s.mean_accepted_tokens:.2f} tokens per target pass")
    click.secho(line, fg="cyan", err=True)
    if compare and method != "vanilla":
        _compare(pipe, prompt, dict(max_new_tokens=max_new_tokens, gamma=gamma, draft_stop=draft_stop,
                                    temperature=temperature, tree=tree,
                                    top_k=top_k, top_p=top_p, seed=seed, stop=stop), method=method)


def _tree(text: str | None):
    """A tree name, or rank paths given as JSON."""
    import json

    if text is None or not text.lstrip().startswith(("[", "{")):
        return text
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise SpecexportError(f"--tree: not a JSON list of rank paths or a JSON object of dynamic-tree settings "
                              f"({err.msg}): {text!r}") from None


def _int_gamma(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise SpecexportError(f"--gamma: expected an integer or 'auto', got {text!r}") from None


def _compare(pipe, prompt, kwargs, *, method, repeats: int = 10) -> None:
    """Interleave vanilla and speculative runs of the same request (after one untimed run of each);
    print decode-time tokens/s, the ratio and its 95% paired-bootstrap interval."""
    from specexport.report.accounting import speedup_interval, throughput

    runs = {"vanilla": [], method: []}
    label = f"--compare: timing vanilla and {method}, {repeats} interleaved runs each after a warm-up pair"
    with progress(console(stderr=True), label, total=2 * (repeats + 1)) as steps:
        for i in range(repeats + 1):
            for m in runs:
                stats = pipe.generate(**prompt, method=m, **kwargs).stats
                if i:                               # the first pair warms the sessions up
                    runs[m].append(stats)
                steps.advance()
    v, s = throughput(runs["vanilla"]), throughput(runs[method])
    if not v or not s:
        click.secho("speedup: not measurable (the output has a single token)", fg="yellow", err=True)
        return
    lo, hi = speedup_interval(runs[method], runs["vanilla"]) or (float("nan"), float("nan"))
    click.secho(f"speedup: {method} {s:.1f} tok/s vs vanilla {v:.1f} tok/s on the same build = {s / v:.2f}x "
                f"[95% interval {lo:.2f}-{hi:.2f}] (decode time, {repeats} interleaved runs each)",
                fg="green", bold=True, err=True)

"""Run a planned build: a loop over its stages (build/stage.py), then the manifest.

    for stage in plan.stages():        target/fp32, target/int8, [draft/vocab,] draft/fp32, ..., medusa, tokenizer
        reuse it  (same fingerprint, files intact, nothing it needs rebuilt, no --force), or
        run it    (write a fresh partial folder, check it: its gate, publish it), and
        record it (its manifest entry)
    write the manifest (atomically): the one step that switches builds

A build never loses a working output. It holds the output folder's lock throughout. Each stage
writes into a hidden `.partial` folder, renamed to a fresh `<role>/<precision>-<id>` folder once its
gate passes, beside the folders the current manifest points at; the manifest is replaced only when
every stage passed. A rebuild that fails its gate, is interrupted or is killed therefore leaves the
previous build loadable and decoding as before. Folders no manifest points at (a failed or killed
build's, a replaced build's; only folders the build marked as its own, see outdir.py) are removed
after the manifest is written and when the next build starts.

`only` ("target", "draft/int4", "medusa", ...: `specexport build --only`) runs the stages it selects,
forced, and takes every other stage from the current build as it is.
"""
from __future__ import annotations

import platform
import secrets
from datetime import datetime, timezone
from pathlib import Path

from specexport import __version__
from specexport.builder.context import BuildContext, Reporter, StageResult, peak_rss
from specexport.builder.outdir import StageFolders, adopt_previous, check_output, remove_unreferenced
from specexport.builder.plan import Plan
from specexport.builder.sources import tool_versions
from specexport.errors import SpecexportError
from specexport.gamma import carried_gamma_choices
from specexport.locking import output_lock, work_dir
from specexport.manifest import MANIFEST_NAME, SCHEMA_VERSION, read_manifest, write_json_atomic

__all__ = ["Reporter", "run_build"]


def run_build(plan: Plan, *, force: bool = False, reporter: Reporter | None = None, only: str | None = None) -> dict:
    """Build everything in `plan` (or, with `only`, the stages it selects); returns the manifest written."""
    reporter = reporter or Reporter(quiet=True)
    out = plan.config.output
    stages = plan.stages()
    if only is not None and not any(s.selected_by(only) for s in stages):
        raise SpecexportError(f"--only: {only!r} names no stage of this build; stages: "
                              f"{', '.join(s.name for s in stages)} (or a role: "
                              f"{', '.join(sorted({s.role for s in stages}))})")
    check_output(out)
    with output_lock(out, purpose="specexport build"):
        previous = _previous_manifest(out, reporter)
        adopt_previous(out, previous)                      # a pre-marker build's folders, as its manifest lists them
        _, left = remove_unreferenced(out, previous)       # what failed or killed builds left behind
        ctx = BuildContext(plan=plan, folders=StageFolders(out), reporter=reporter, previous=previous, force=force)
        try:
            for stage in stages:
                ctx.results[stage.name] = _run_stage(stage, ctx, only)
            manifest = _manifest(ctx)
            write_json_atomic(out / MANIFEST_NAME, manifest, tmp_dir=work_dir(out))   # the one step that
        except BaseException:                                                        # switches builds
            ctx.folders.discard()                          # this build's stages: no manifest points at them
            raise
        left += remove_unreferenced(out, manifest)[1]      # the replaced build's folders
    if left:
        reporter.note(f"[yellow]left alone (not written by specexport build): {', '.join(sorted(set(left)))}[/]")
    return manifest


def _run_stage(stage, ctx: BuildContext, only: str | None) -> StageResult:
    """Reuse, carry or run one stage; its result (the entry carries its fingerprint)."""
    old = stage.previous(ctx)
    if only is not None and not stage.selected_by(only):
        if old is None:
            raise SpecexportError(f"--only {only}: {stage.name} is not in the current build of {ctx.out}; build "
                                  f"without --only first")
        stale = "" if stage.current(ctx, old) else " (out of date: build without --only to redo it)"
        ctx.reporter.note(f"[dim]- {stage.name}: kept from the current build ({stage.describe(old)}){stale}[/]")
        return StageResult(stage, old, rebuilt=False)
    forced = only is not None or (stage.forceable and (ctx.force or any(ctx.results[n].rebuilt for n in stage.needs)))
    if not forced and old is not None and stage.reusable(ctx, old):
        ctx.reporter.note(f"[dim]- {stage.name.replace('/', ' ')}: unchanged, reused ({stage.describe(old)})[/]")
        return StageResult(stage, old, rebuilt=False)
    entry = stage.run(ctx)
    if stage.precision is not None:
        entry["stage_fingerprint"] = stage.fingerprint
        entry["peak_rss_bytes"] = peak_rss()           # the build's peak so far: which stage raised it
    return StageResult(stage, entry, rebuilt=True)


def _previous_manifest(out: Path, reporter: Reporter) -> dict:
    if not (out / MANIFEST_NAME).exists():
        return {}
    try:
        return read_manifest(out)
    except SpecexportError as err:          # unreadable, or from another schema: nothing can be reused
        reporter.note(f"[yellow]the previous build in {out} cannot be reused ({err}); building anew[/]")
        return {}


def _manifest(ctx: BuildContext) -> dict:
    plan, cfg = ctx.plan, ctx.config
    manifest = {
        "schema_version": SCHEMA_VERSION,
        "specexport_version": __version__,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "build_id": secrets.token_hex(8),
        "name": cfg.name,
        "config": cfg.to_dict(),
        "max_seq_len": cfg.max_seq_len,
        "max_verify_tokens": cfg.max_verify_tokens,
        "tokenizer": None,
        "special_tokens": plan.special_tokens,
        "models": {mp.role: _model_record(ctx.model(mp.role), cfg) for mp in plan.models},
        "versions": {**tool_versions(), "python": platform.python_version(), "specexport": __version__},
        "build_peak_rss_bytes": peak_rss(),              # GGUF conversion and every stage run, children apart
    }
    for result in ctx.results.values():
        result.stage.place(manifest, result.entry)
    manifest.update(carried_gamma_choices(ctx.previous, manifest))     # measured on stages this build reused
    return manifest


def _model_record(mp, cfg) -> dict:
    """models.<role> of the manifest but its precisions (filled by the stages) and a measured vocabulary
    (filled by the vocab stage)."""
    return {
        "source": str(mp.config.path),
        **({"gguf": str(mp.config.gguf)} if mp.config.gguf is not None else {}),
        "model_type": mp.arch.model_type,
        "fingerprint": mp.fingerprint,
        "vocab_size": mp.arch.vocab_size,
        "max_seq_len": cfg.max_seq_len,
        "max_verify_tokens": cfg.max_verify_tokens,
        "special_tokens": {"bos_token_id": mp.arch.bos_token_id, "eos_token_ids": list(mp.eos_token_ids),
                           "pad_token_id": mp.arch.pad_token_id},
        "io": mp.io.to_dict(),
        "precisions": {},
        **({"vocab_ids": list(mp.vocab_ids), "vocab_source": {"file": str(mp.config.vocab)}}
           if mp.vocab_ids is not None and not isinstance(mp.config.vocab, int) else {}),
    }

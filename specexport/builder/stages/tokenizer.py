"""TokenizerStage: the target's tokenizer files, copied into a folder named by their content
(`tokenizer-<sha256[:8]>`), written beside the old copy and renamed into place when complete; the
previous copy is kept while its source files are unchanged and its files intact (even under --force:
the copy is content-addressed)."""
from __future__ import annotations

import shutil
from dataclasses import dataclass

from specexport._optional import require
from specexport.builder.outdir import reusable_tokenizer, tokenizer_digest
from specexport.builder.stage import Stage
from specexport.manifest import sha256_file


@dataclass(frozen=True)
class TokenizerStage(Stage):
    forceable = False

    def previous(self, ctx) -> dict | None:
        return ctx.previous.get("tokenizer")

    def reusable(self, ctx, entry: dict) -> bool:
        return False                  # decided inside run(), which keeps an unchanged copy

    def current(self, ctx, entry: dict) -> bool:
        return reusable_tokenizer(ctx.out, ctx.previous, self.fingerprint) is not None

    def run(self, ctx) -> dict:
        plan, out = ctx.plan, ctx.out
        with ctx.reporter.stage("copy tokenizer"):
            digest = tokenizer_digest(plan.tokenizer_files)
            reused = reusable_tokenizer(out, ctx.previous, digest)
            if reused is not None:
                return reused

            def write(partial):
                for f in plan.tokenizer_files:
                    shutil.copy2(f, partial / f.name)
                if not (partial / "tokenizer.json").is_file():
                    # The runtime reads tokenizer.json with the `tokenizers` library; slow tokenizers are converted.
                    require("transformers").AutoTokenizer.from_pretrained(plan.target.config.path).save_pretrained(
                        partial)

            dest = ctx.folders.addressed("tokenizer", digest, write)
        files = {f.name: {"sha256": sha256_file(f), "size": f.stat().st_size} for f in sorted(dest.iterdir())}
        return {"dir": dest.name, "source_sha256": digest, "files": files}

    def place(self, manifest: dict, entry: dict) -> None:
        manifest["tokenizer"] = entry

"""specexport.load(): a built output folder -> Pipeline with generate() and stream().

    pipe = specexport.load("engines/demo")                    # fp32 target and draft
    pipe = specexport.load("engines/demo", precision="int8", draft_precision="int4")
    out = pipe.generate("def fib(n):", max_new_tokens=128, method="draft", gamma=4)
    out = pipe.generate("def fib(n):", method="medusa", tree="small")       # builds with Medusa heads
    out.text, out.token_ids, out.finish_reason, out.stats.acceptance_rate
"""
from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np

from specexport._optional import require
from specexport.chat import user_prompt
from specexport.errors import SpecexportError
from specexport.gamma import lookup as lookup_stored
from specexport.manifest import check_files, file_problems, listed_files, read_manifest
from specexport.runtime.backends import open_eagle, open_medusa, open_model, require_kind
from specexport.runtime.budget import relative_costs
from specexport.runtime.detok import IncrementalDetokenizer
from specexport.runtime.loop import DecodeStats, decode
from specexport.runtime.methods import METHODS, BuildView, MethodOptions, resolve, stored_choice
from specexport.runtime.proposer_table import Facts, Resources, plan_proposer
from specexport.runtime.request import GenerationOutput, Request, TextStream
from specexport.runtime.sampling import Coins, SamplingParams
from specexport.runtime.suffix import SuffixCache

PREFILL_CHUNK = 64
MEASURED = "measured"            # load(threads=MEASURED): the thread setting the build's bench measured fastest
AS_TARGET = "as target"          # load(draft_threads=AS_TARGET): the draft on as many threads as the target
SUFFIX_CACHE_TOKENS = 500_000    # the default bound of a pipeline's suffix cache (about 28 MB at ~55 bytes a token, measured at 1M tokens: runtime/suffix.py)
def load(output_dir, *, precision: str | None = None, draft_precision: str | None = None, backend: str = "onnxruntime",
         threads: int | None | str = MEASURED, draft_threads: int | None | str = AS_TARGET, verify: bool = False,
         suffix_cache_tokens: int = SUFFIX_CACHE_TOKENS, **options) -> "Pipeline":
    """precision: the target's (default: its first built precision, fp32 unless a lean GGUF build);
    draft_precision: the draft's (default: the same as the target's).
    threads: the target's intra-op threads; MEASURED (the default): the threads and spinning the build's
    bench measured fastest for vanilla on these graphs (`thread_note` says which), else ONNX Runtime's
    default (all cores); None: ONNX Runtime's default. draft_threads: the draft's (default: the target's).
    Where the build has a second model (a draft, heads), every pool's threads stop spinning at the end of
    each run, so the models taking turns do not take each other's cores.
    suffix_cache_tokens: the bound of the cache of earlier generations that method="suffix" reads.
    Every file is checked for its recorded size when its model is opened; verify=True also checks every
    file's sha256 against the manifest first (reads all the weights once)."""
    return Pipeline(output_dir, precision=precision, draft_precision=draft_precision, backend=backend,
                    threads=threads, draft_threads=draft_threads, verify=verify,
                    suffix_cache_tokens=suffix_cache_tokens, **options)


class Pipeline:
    def __init__(self, output_dir, *, precision=None, draft_precision=None, backend="onnxruntime", threads=MEASURED,
                 draft_threads=AS_TARGET, verify=False, suffix_cache_tokens=SUFFIX_CACHE_TOKENS, **options):
        self.dir = Path(output_dir)
        self.manifest = read_manifest(self.dir)
        if "kernels" in self.manifest:      # the library the build ran, tried before any compile (plugins/cpu/carry.py)
            from specexport.plugins import cpu

            cpu.offer(self.dir, self.manifest)
        if verify:
            problems = file_problems(self.dir, listed_files(self.manifest), hashes=True)
            if problems:
                raise SpecexportError(f"{problems[0]}" + (f" (and {len(problems) - 1} more)" if len(problems) > 1
                                                          else "") + ": the build is damaged; rebuild it")
        if precision is None:               # the target's first built precision: fp32, or gguf in a lean build
            precision = next(iter(self.manifest["models"]["target"]["precisions"]))
        self.precision, self.backend_kind = precision, backend
        require_kind(backend)               # at once, before reading the build: what is missing, in one line
        self.draft_precision = precision if draft_precision is None else draft_precision
        self.capacity = self.manifest["max_seq_len"]
        self.max_verify_tokens = self.manifest["max_verify_tokens"]
        threads, options, self.thread_note = self._measured_threads(threads, options)
        self.eos_ids = set(self.manifest["special_tokens"]["eos_token_ids"] or [])
        # The draft on the target's threads, and pools that stop spinning when a run ends: a pool spinning
        # on takes the cores from the other model's run (Qwen2.5-Coder 1.5B + 0.5B draft, 2 cores: draft γ 2-3
        # 12.2-13.3 tok/s on 1 thread, 14.9-17.7 on 2 stopped, 10.1-12.6 on 2 spinning on; benchmarks/draft_threads.py).
        self._threads = {"target": threads, "draft": threads if draft_threads == AS_TARGET else draft_threads}
        if set(self.manifest["models"]) - {"target"} or self.manifest.get("heads"):
            options = {"stop_spin": True, **options}
        self._options = options
        self.target = self._open("target")
        self.drafts: dict = {}                      # draft backends opened so far, by precision
        self._medusa = None                         # the Medusa heads, opened on first use
        self._eagle = None                          # the EAGLE head, opened on first use
        tok = self.manifest["tokenizer"]
        check_files(self.dir, {f"{tok['dir']}/{name}": meta for name, meta in tok["files"].items()})
        tok_path = self.dir / tok["dir"] / "tokenizer.json"
        if not tok_path.is_file():
            raise SpecexportError(f"{tok_path}: missing (the build output is incomplete; rebuild it)")
        try:
            self.tokenizer = require("tokenizers").Tokenizer.from_file(str(tok_path))
        except Exception as err:            # the tokenizers library raises a bare Exception for a bad file
            raise SpecexportError(f"{tok_path}: the tokenizers library could not read it "
                                  f"({str(err).splitlines()[0] if str(err) else type(err).__name__})") from None
        self._suffix_tokens = suffix_cache_tokens
        self._suffix_cache: SuffixCache | None = None   # made on first use (method="suffix")
        self.clock = time.perf_counter             # the stats' clock (the bench's tests inject one)

    def _measured_threads(self, threads, options: dict) -> tuple:
        """(threads, options, a line saying where they came from): MEASURED becomes the setting the build's
        bench stored with its method choice for these graphs (spinning too, unless `spin` was given)."""
        if threads != MEASURED:
            return threads, options, "threads: as given"
        from specexport.runtime.backends.ort import default_pool

        measured = (stored_choice(self.view()) or {}).get("threads")
        if measured is None:
            return None, options, f"threads: {default_pool()} (no bench stored a measured setting)"
        spin = options.get("spin", measured["spin"])
        count = default_pool() if measured["threads"] is None else measured["threads"]
        return measured["threads"], {**options, "spin": spin}, (
            f"threads: {count}, spinning {'on' if spin else 'off'} (the build's bench measured this fastest)")

    @property
    def kernel_note(self) -> str | None:
        """Which CPU kernels the target's matmuls run on here and why (None: not a gguf graph)."""
        from specexport.plugins import cpu

        return cpu.describe(self.manifest["models"]["target"]["precisions"][self.precision])

    def view(self) -> BuildView:
        """What a request's method is resolved from (methods.resolve): this build, now (its draft precision may
        change between requests: use_draft_precision)."""
        return BuildView(self.manifest, self.dir, self.precision, self.draft_precision, self.max_verify_tokens,
                         self.methods, self.verify_costs)

    @property
    def methods(self) -> tuple[str, ...]:
        """What this build can decode with: prompt lookup needs only the target."""
        built = {"vanilla", "lookup", "suffix", *self.manifest["models"], *self.manifest.get("heads", {})}
        return tuple(m for m in METHODS if m in built)

    @property
    def suffix_cache(self) -> SuffixCache:
        """The cache of earlier generations that method="suffix" reads (made on first use). Once it exists,
        every generation (prompt + output) is added to it, whatever its method, unless the call opts out
        (suffix_share=False). Assign a SuffixCache (e.g. SuffixCache.load(path, ...)) to use another."""
        if self._suffix_cache is None:
            self._suffix_cache = SuffixCache(self._suffix_tokens)
        return self._suffix_cache

    @suffix_cache.setter
    def suffix_cache(self, cache: SuffixCache) -> None:
        self._suffix_cache = cache

    @property
    def medusa(self):
        """The Medusa heads (a callable hidden [H] -> top-k ids [N, K]), opened on first use."""
        if self._medusa is None:
            self._medusa = open_medusa(self.dir, self.manifest, kind=self.backend_kind,
                                       target_precision=self.precision)
        return self._medusa

    @property
    def eagle(self):
        """The EAGLE head (runtime/backends/eagle.py), opened on first use."""
        if self._eagle is None:
            self._eagle = open_eagle(self.dir, self.manifest, kind=self.backend_kind, capacity=self.capacity,
                                     max_tokens=max(self.max_verify_tokens, PREFILL_CHUNK),
                                     target_precision=self.precision)
        return self._eagle

    @property
    def draft(self):
        """The draft backend of `draft_precision`, opened on first use."""
        return self.draft_of(self.draft_precision)

    def draft_of(self, precision: str):
        """The draft backend of `precision`, opened on first use (an error when it was not built)."""
        if precision not in self.drafts:
            self.drafts[precision] = self._open("draft", precision)
        return self.drafts[precision]

    def heads_of(self, kind: str):
        """The Medusa heads or the EAGLE head ("medusa", "eagle"), opened on first use."""
        return {"medusa": lambda: self.medusa, "eagle": lambda: self.eagle}[kind]()

    def facts(self) -> Facts:
        """What a request's proposer is planned from (proposer_table.plan_proposer): no model opened."""
        return Facts.of(self.manifest, verify_costs=self.verify_costs)

    def resources(self, *, draft=None, heads=None) -> Resources:
        """What a request's proposer is made of: this pipeline's models, or the `draft(precision)` and
        `heads(kind)` a batch gives a request of its own."""
        return Resources(**vars(self.facts()), draft=draft or self.draft_of, heads=heads or self.heads_of,
                         suffix_cache=lambda: self.suffix_cache)

    def curve_key(self) -> dict:
        """What a stored pass curve must have been measured with to size this pipeline's rounds: this CPU
        (its model and flags, plugins/cpu/tiers.py) and the target's thread count."""
        from specexport.plugins.cpu.tiers import cpu_id
        from specexport.runtime.backends.ort import default_threads

        return {"cpu": cpu_id(), "threads": self._threads["target"] or default_threads() or os.cpu_count()}

    def verify_costs(self) -> np.ndarray | None:
        """c(T) / c(1) for T = 1..max_verify_tokens (runtime/budget.py) from the pass curve the build's bench
        measured for this target on this CPU with these threads (gamma.py's pass_curve), else None."""
        if not hasattr(self, "_verify_costs"):
            entry = lookup_stored(self.manifest, self.precision, "-", section="pass_curve")
            self._verify_costs = None
            if entry and all(entry.get(k) == v for k, v in self.curve_key().items()):
                try:
                    self._verify_costs = relative_costs(entry["ms"], self.max_verify_tokens)
                except (ValueError, TypeError, KeyError) as err:
                    raise SpecexportError(f"{self.dir / 'manifest.json'}: pass_curve.{self.precision}/-.ms: {err} "
                                          f"(run `specexport bench {self.dir}` again)") from None
        return self._verify_costs

    def use_draft_precision(self, precision: str) -> None:
        """Switch the draft to another built precision, keeping the target's session. Backends opened
        before are kept, so switching back and forth costs nothing after the first time."""
        self.draft_of(precision)                    # opens it, or says it was not built
        self.draft_precision = precision

    def _open(self, role: str, precision: str | None = None):
        """The target, or the draft in `precision`, from the factory in runtime/backends."""
        return open_model(self.dir, self.manifest, role, kind=self.backend_kind,
                          precision=self.precision if role == "target" else precision,
                          capacity=self.capacity, max_tokens=max(self.max_verify_tokens, PREFILL_CHUNK),
                          threads=self._threads[role], **self._options)

    # -- public API -----------------------------------------------------------------------
    def generate(self, prompt: str | None = None, **kwargs) -> GenerationOutput:
        stream = self.stream(prompt, **kwargs)
        for _ in stream:
            pass
        return stream.output

    def request(self, prompt: str | None = None, *, prompt_ids=None, max_new_tokens: int = 128,
               method: str = "draft", gamma: int | str | None = None, temperature: float = 0.0, top_k: int | None = None,
               top_p: float | None = None, seed: int | None = 0, stop: list[str] | tuple = (),
               draft_stop: float = 0.0, lookup_branches: int = 1, tree=None, sampled_children: bool = False,
               suffix_scope: str = "", suffix_share: bool = True):
        """A generation's options, checked: what stream() decodes (and Batch.submit queues).
        gamma: tokens proposed a round; None: what the build's bench measured for the method (the stored
        `--method auto` choice when it is this method, a draft's stored `--gamma auto` γ, lookup's "auto"
        where the bench measured this CPU's pass curve), else 4. "auto" (lookup): each round's length from
        the pass curve and the acceptance so far (runtime/budget.py).
        method: vanilla | draft (a draft model proposes γ tokens) | medusa | auto (the configuration
        `specexport bench` measured fastest, vanilla when all lost) | lookup (prompt lookup: up to γ tokens
        copied from what followed an earlier occurrence of the last tokens; lookup_branches > 1 verifies
        the continuations of that many occurrences as one tree).
        draft_stop: end a round's drafting once the draft gives its proposal a probability below this
        (adaptive γ up to `gamma`; 0 = always γ proposals). Output is unchanged either way.
        tree (method draft): a static token tree instead of a chain, as rank paths like
        [[0], [1], [0, 0]] or the name of one of DRAFT_TREES; verified in one target pass.
        sampled_children (draft trees, temperature > 0): draw each node's children i.i.d. from the
        draft (the tree gives only the shape) and verify with the multi-draft rule, instead of the
        draft's top-ranked tokens verified with the q-free rule; both are lossless.
        method medusa: the build's Medusa heads propose a static tree, `tree`: "auto" (the default: the
        tree the build made from the heads' measured accuracy and the verify cost), rank paths, or the
        name of one of MEDUSA_TREES (cut to the heads' count); gamma is not used.
        method eagle: the build's EAGLE head drafts a token tree from the target's own states, `tree`:
        "auto" (the default: the dynamic tree the build measured best), "dynamic" or a mapping
        {"top_k": 4, "depth": 5, "total_tokens": 15} (EAGLE-2's dynamic tree), or a static tree (rank
        paths or a DRAFT_TREES name); gamma is not used.
        method suffix: suffix decoding over this request's text and the pipeline's cache of earlier
        generations (`suffix_cache`), looked up in `suffix_scope` only; a tree up to the verify width,
        cut to the match length and, where the bench measured this CPU's pass curve, to the nodes worth
        their verify cost; gamma is not used. suffix_share=False: this call neither reads the
        cache nor adds to it."""
        ids = self._prompt_ids(prompt, prompt_ids)
        params = self._params(temperature, top_k, top_p)
        if not isinstance(suffix_scope, str):
            raise SpecexportError(f"suffix_scope: expected a string, got {type(suffix_scope).__name__}")
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise SpecexportError(f"max_new_tokens: expected an integer >= 1, got {max_new_tokens!r}")
        options, note = resolve(MethodOptions(method, gamma, tree, draft_stop, lookup_branches, sampled_children,
                                              suffix_scope, suffix_share), self.view())
        return Request(ids, params, max_new_tokens, seed, tuple(stop), options, plan_proposer(options, self.facts()),
                       note)

    def stream(self, prompt: str | None = None, **options) -> TextStream:
        """The text pieces as they are decoded (iterate it); its `output` holds the GenerationOutput once
        they end. Options: request()'s, checked here, before any piece."""
        request = self.request(prompt, **options)
        return TextStream(lambda done: self.decode_request(request, self.target, self.resources(), done=done))

    def batch(self, max_batch="auto", *, rows_per_pass: int | None = None):
        """A Batch (runtime/batch.py): up to max_batch requests decoded together ("auto": as many as measured
        here to pay; or the Width batch_width decided), each one's output its own generate()'s; a pass's rows
        (default max_verify_tokens) shared out among them. Use it as a context manager; submit() starts a request."""
        from specexport.runtime.batch import Batch

        return Batch(self, max_batch, rows_per_pass=rows_per_pass)

    def generate_many(self, requests: list[dict], *, max_batch: int | str = "auto",
                      rows_per_pass: int | None = None) -> list[GenerationOutput]:
        """Each request (generate()'s keyword arguments, prompt included) decoded in a batch of up to
        max_batch; the outputs in order, each equal to what generate() gives for it alone."""
        with self.batch(max_batch, rows_per_pass=rows_per_pass) as batch:
            handles = [batch.submit(**dict(r)) for r in requests]
            return [h.result() for h in handles]

    def decode_request(self, request: "Request", target, resources: Resources, *, done):
        """Yield the text pieces of `request` decoded on `target` (a backend), its proposer made of
        `resources` (this pipeline's models, or a batch's slots of them); done(GenerationOutput) at the end."""
        proposer = request.plan.build(resources)
        ids, stop = request.ids, request.stop
        suffix_share, suffix_scope = request.options.suffix_share, request.options.suffix_scope
        stats, detok = DecodeStats(), IncrementalDetokenizer(self.tokenizer, ids.tolist())
        out_ids, text, reason = [], "", "length"
        rounds = decode(target, proposer, ids, max_new_tokens=request.max_new_tokens, params=request.params,
                        rng=np.random.default_rng(request.seed), stats=stats, prefill_chunk=PREFILL_CHUNK,
                        clock=self.clock, coins=None if request.seed is None else Coins(request.seed))
        try:
            for chunk in rounds:
                chunk = chunk.tolist()
                eos_at = next((i for i, t in enumerate(chunk) if t in self.eos_ids), None)
                if eos_at is not None:
                    chunk, reason = chunk[:eos_at + 1], "stop"
                out_ids += chunk
                piece = detok.push(chunk)
                hit = _find_stop(text + piece, stop)
                if hit is not None:
                    out_ids = self._trim_to_stop(out_ids, stop)
                    piece, reason = (text + piece)[:hit][len(text):], "stop"
                text += piece
                if piece:
                    yield piece
                if reason == "stop":
                    break
        finally:
            rounds.close()
        stats.delivered = len(out_ids)          # nothing after EOS or a stop string counts
        final = self.tokenizer.decode(out_ids, skip_special_tokens=True)
        hit = _find_stop(final, stop)
        final = final[:hit] if hit is not None else final
        done(GenerationOutput(final, out_ids, reason, stats, request.options.method, request.note, request.plan.words))
        if suffix_share and self._suffix_cache is not None:     # what it served, for later suffix lookups
            self._suffix_cache.add(np.concatenate([ids, np.asarray(out_ids, dtype=np.int64)]), suffix_scope)
        if final.startswith(text) and len(final) > len(text):
            yield final[len(text):]          # what the detokenizer held back (an unfinished character)

    def chat_prompt(self, text: str) -> str:
        """`text` as one user message in the build's chat template (what a chat client sends to
        `specexport serve`); an error when the tokenizer has no chat template."""
        return user_prompt(self.dir, self.manifest, text)

    def chat_ids(self, text: str) -> list[int]:
        """chat_prompt(text) as prompt_ids for generate(): encoded without adding special tokens again
        (the template writes its own), as `specexport serve` encodes it."""
        return self._prompt_ids(None, self.tokenizer.encode(self.chat_prompt(text), add_special_tokens=False).ids).tolist()

    def encode(self, prompt: str) -> list[int]:
        """The prompt's token ids as generate() feeds them (special tokens included), checked."""
        return self._prompt_ids(prompt, None).tolist()

    # -- checks ---------------------------------------------------------------------------
    def _prompt_ids(self, prompt, prompt_ids) -> np.ndarray:
        if (prompt is None) == (prompt_ids is None):
            raise SpecexportError("prompt: give either a text prompt or prompt_ids, not both or neither")
        if prompt_ids is None:
            if not isinstance(prompt, str):
                raise SpecexportError(f"prompt: expected a string, got {type(prompt).__name__}")
            prompt_ids = self.tokenizer.encode(prompt).ids
        ids = np.asarray(prompt_ids, dtype=np.int64).reshape(-1)
        vocab = self.manifest["models"]["target"]["vocab_size"]
        if len(ids) == 0:
            raise SpecexportError("prompt: empty (no tokens)")
        if ids.min() < 0 or ids.max() >= vocab:
            raise SpecexportError(f"prompt_ids: ids must be in 0..{vocab - 1}, got {ids.min()}..{ids.max()}")
        if len(ids) >= self.capacity:
            raise SpecexportError(f"prompt: {len(ids)} tokens leave no room to generate within max_seq_len "
                                  f"{self.capacity} (at most {self.capacity - 1} prompt tokens)")
        return ids

    @staticmethod
    def _params(temperature, top_k, top_p) -> SamplingParams:
        try:
            return SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
        except ValueError as err:
            raise SpecexportError(str(err)) from None

    def _trim_to_stop(self, ids: list[int], stop) -> list[int]:
        """The shortest prefix of `ids` whose text contains a stop string (independent of γ)."""
        while len(ids) > 1 and _find_stop(self.tokenizer.decode(ids[:-1], skip_special_tokens=True), stop) is not None:
            ids = ids[:-1]
        return ids

    @property
    def opened(self) -> list:
        """The models opened so far: target, drafts, Medusa heads, EAGLE head (what close() closes and the bench
        times)."""
        return [self.target, *self.drafts.values(), *(h for h in (self._medusa, self._eagle) if h is not None)]

    @property
    def opened_heads(self) -> dict:
        """The heads something opened, by kind ("medusa", "eagle"), without opening any."""
        return {k: h for k, h in (("medusa", self._medusa), ("eagle", self._eagle)) if h is not None}

    def close(self) -> None:
        for b in self.opened:
            b.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _find_stop(text: str, stop) -> int | None:
    hits = [i for i in (text.find(s) for s in stop if s) if i >= 0]
    return min(hits) if hits else None

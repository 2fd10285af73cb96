"""Batched decoding (runtime/batch.py, backends/slots.py): every request's output equals its batch-1 output.

One tiny GGUF build on specexport's CPU kernels (the mixed-type file of test_gguf_exact, its own draft,
Medusa heads and an EAGLE-3 head), requests of every method and of several prompt lengths in one batch, joining and leaving
mid-stream; seeded sampling; a G-test through the batched loop with a planted cache mix-up; cancellation,
a failing request and a request past its deadline under load."""
from __future__ import annotations

import time

import numpy as np
import pytest

from specexport.errors import SpecexportError


@pytest.fixture(scope="module")
def built(tmp_path_factory, write_yaml, run_build):
    """The mixed-type GGUF as target and draft, with Medusa heads that guess the target's own next token
    again (zero blocks, its lm_head: accepted where the output repeats) and an EAGLE-3 head."""
    from specexport.export.gguf import hf_folder_from_gguf
    from specexport.heads.medusa import save_medusa_1
    from specexport.plugins import cpu

    if not cpu.status().available:
        from machine import kernels_missing

        kernels_missing(cpu.status().line())
    from safetensors.numpy import load_file

    import test_gguf_exact as tge
    from test_eagle_build import write_eagle3

    root = tmp_path_factory.mktemp("batch")
    path = tge.write_mixed_gguf(root / "tiny-mixed.gguf")
    out = root / "out"
    with pytest.MonkeyPatch.context() as mp:               # conversions to a cache of its own (test_gguf_exact)
        mp.setenv("SPECEXPORT_CACHE", str(root / "cache"))
        ckpt = hf_folder_from_gguf(path)                   # the heads are written against its weights
        lm_head = load_file(str(ckpt / "model.safetensors"))["lm_head.weight"]
        V, H = lm_head.shape
        zero = [(np.zeros((H, H), np.float32), np.zeros(H, np.float32))]
        save_medusa_1(root / "medusa", [zero] * 3, [lm_head] * 3)
        write_eagle3(root / "eagle3", ckpt, draft_vocab=V, layers=[0, 1, 1])
        yaml = write_yaml(root / "m.yaml", name="b", target={"path": path}, draft={"path": path}, max_seq_len=128,
                          max_verify_tokens=8, precisions=["fp32", "gguf"], medusa={"path": root / "medusa", "top_k": 4},
                          eagle={"path": root / "eagle3", "top_k": 4},
                          quality_gates={"gguf": {"min_top1": 0.0, "max_kl": 100.0}}, output=out)
        assert run_build(yaml, "--no-bench") == 0
    return out


@pytest.fixture(scope="module")
def pipe(built):
    import specexport

    with specexport.load(built, precision="gguf", threads=2) as p:
        yield p


PROMPTS = [[1, 40, 41, 42], [1, 7, 300, 5, 9, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47, 53, 59, 61, 67, 71, 73],
           [5], [1, 40, 41, 42, 40, 41, 42, 40, 41], list(range(2, 40)), [9, 9, 9, 9], [5], [1, 40, 41, 42]]
METHODS = [dict(method="vanilla"), dict(method="draft", gamma=3), dict(method="lookup", gamma=4),
           dict(method="suffix"), dict(method="draft", tree="small"), dict(method="draft", gamma=2, draft_stop=0.3),
           dict(method="medusa", tree="small"), dict(method="eagle", tree={"top_k": 2, "depth": 3, "total_tokens": 6})]


def _requests(**common):
    """Mixed methods, prompt lengths (1 to 38 tokens: several prefill chunks) and lengths of output."""
    return [dict(prompt_ids=p, max_new_tokens=12 + 7 * i, **m, **common)
            for i, (p, m) in enumerate(zip(PROMPTS, METHODS))]


def _alone(pipe, requests):
    return [pipe.generate(**r).token_ids for r in requests]


def test_batched_greedy_equals_each_requests_batch1_output(pipe):
    requests = _requests(suffix_share=False)
    want = _alone(pipe, requests)
    got = pipe.generate_many(requests, max_batch=3)             # six requests through three slots
    assert [o.token_ids for o in got] == want
    assert any(o.stats.accepted for o in got)                   # speculation accepted tokens in the batch
    assert got[6].stats.accepted                                # ... Medusa's too
    with pipe.batch(4) as batch:
        assert batch.exact and batch.max_batch == 4
        handles = [batch.submit(**r) for r in requests]
        outs = [h.result() for h in handles]
        passes, rows = batch.target.passes, batch.target.rows_run
        eagle = batch.eagle_model()                             # the EAGLE head's calls shared passes too
        assert eagle is not None and eagle.rows_run > eagle.passes > 0
    assert [o.token_ids for o in outs] == want
    assert rows > passes                                        # passes held several requests' rows


def test_batched_seeded_sampling_equals_batch1(pipe):
    requests = _requests(temperature=0.9, top_k=20, suffix_share=False)
    for i, r in enumerate(requests):
        r["seed"] = 100 + i
    want = _alone(pipe, requests)
    got = pipe.generate_many(requests, max_batch=4)
    assert [o.token_ids for o in got] == want


def test_a_cancelled_or_failing_request_leaves_the_others_intact(pipe, monkeypatch):
    from specexport.runtime.proposers import SuffixProposer

    requests = _requests(suffix_share=False)
    want = _alone(pipe, requests)
    original = SuffixProposer.propose

    def failing(self, seq, n, *args):
        if n > len(PROMPTS[3]) + 3:
            raise RuntimeError("planted proposer failure")
        return original(self, seq, n, *args)

    monkeypatch.setattr(SuffixProposer, "propose", failing)
    with pipe.batch(3) as batch:
        handles = [batch.submit(**r) for r in requests]
        first = next(iter(handles[1]))                          # request 1 has started: cancel it mid-stream
        assert first is not None
        handles[1].cancel()
        results = []
        for i, h in enumerate(handles):
            if i == 3:                                          # the suffix request: its proposer failed
                with pytest.raises(RuntimeError, match="planted"):
                    h.result()
            elif i != 1:
                results.append(h.result().token_ids)
    assert results == [w for i, w in enumerate(want) if i not in (1, 3)]
    cancelled = handles[1].result()
    assert cancelled is None or len(cancelled.token_ids) < len(want[1])


def test_eagle_head_rows_are_checked_exact_before_they_share_passes(pipe, monkeypatch):
    """The head (our attention, Q8_0 blocks) gives a call the same bits alone and beside a longer slot's
    call; a pass that writes over a longer slot's rows (planted) is caught, and a batch then gives each
    EAGLE request a head of its own: its answers are still its lone answers."""
    from specexport.runtime import batch as batch_module
    from specexport.runtime.backends import head_slots

    # the target is gguf on our kernels: its head runs on our attention, checked by the build too, and
    # the runtime opens its Q8_0 blocks (builder/stages/head_blocks.py), as it does the Medusa heads'
    stage = pipe.manifest["heads"]["eagle"]["precisions"]["fp32"]
    assert "tree, our attention" in stage["parity_per_phase"]
    for kind, head in (("eagle", pipe.eagle), ("medusa", pipe.medusa)):
        blocks = pipe.manifest["heads"][kind]["precisions"]["q8_0"]
        assert blocks["parity_max_rel_error"] <= blocks["parity_tolerance"] and blocks["top1_agreement"] >= 0.9
        assert blocks["quantization"]["kept_fp32"] == [] and blocks["quantization"]["block_types"]["Q8_0"] >= 2
        assert head.session._model_path == str(pipe.dir / blocks["dir"] / "model.onnx")
    assert head_slots.rows_exact(pipe.eagle)
    base = head_slots.EagleSlots._base
    # planted: a pass written at the shortest slot's length (over the longer one's committed rows)
    monkeypatch.setattr(head_slots.EagleSlots, "_base", lambda self, lo, B: min(v.length for v in self.views[lo:lo + B]))
    assert not head_slots.rows_exact(pipe.eagle)
    monkeypatch.setattr(head_slots.EagleSlots, "_base", base)
    monkeypatch.setattr(batch_module, "rows_exact", lambda head: False)
    requests = [r for r in _requests(suffix_share=False) if r["method"] == "eagle"] * 2
    want = _alone(pipe, requests)
    with pipe.batch(2) as batch:
        assert [h.result().token_ids for h in [batch.submit(**r) for r in requests]] == want
        assert batch.eagle_model() is None


def test_batch_options_are_checked_in_the_callers_thread(pipe):
    with pipe.batch(2) as batch:
        with pytest.raises(SpecexportError, match="method"):
            batch.submit(prompt_ids=[1, 2], method="no-such-method")
        with pytest.raises(SpecexportError, match="gamma"):
            batch.submit(prompt_ids=[1, 2], method="draft", gamma=99)
    with pytest.raises(SpecexportError, match="max_batch"):
        pipe.batch(0)


def test_the_server_decides_the_width_once_and_its_batch_takes_it(pipe, monkeypatch):
    """batch_width runs once a server (the worker's), its max_batch checked there; the Batch takes the Width."""
    from specexport.runtime import batch as batch_module
    from specexport.serve import worker as worker_module

    calls, real = [], batch_module.batch_width
    counted = lambda *a, **k: calls.append(a) or real(*a, **k)   # noqa: E731
    monkeypatch.setattr(worker_module, "batch_width", counted)
    monkeypatch.setattr(batch_module, "batch_width", counted)
    worker = worker_module.ModelWorker(pipe, method="vanilla", max_batch=2)
    try:
        assert len(calls) == 1 and worker.max_batch == worker.batch.max_batch == 2 and worker.batch.exact
        assert worker.batch_note == worker.batch.note == "max_batch 2 (as given)"
    finally:
        worker.batch.close()                # not worker.close(): that closes the module's pipeline too
    with pytest.raises(SpecexportError, match="max_batch: expected 'auto' or an integer >= 1, got 0"):
        worker_module.ModelWorker(pipe, method="vanilla", max_batch=0)


# -- the method seam: options -> resolve -> the table's plan -> its proposer, on the resources the caller gives
TABLE = {"vanilla": ({}, "NoneType", [], ""), "draft": ({"gamma": 3}, "DraftChain", [("draft", "gguf")], "γ=3"),
         "lookup": ({"gamma": 3}, "PromptLookup", [], "γ=3"),
         "suffix": ({}, "SuffixProposer", [("suffix",)], "trees up to 7 nodes"),
         "medusa": ({"tree": "small"}, "MedusaTree", [("heads", "medusa")], "tree depth 3"),     # 3 heads
         "eagle": ({"tree": "dynamic:2/3/6"}, "EagleTree", [("heads", "eagle")], "tree depth 3")}


@pytest.mark.parametrize("method", sorted(TABLE))
def test_each_table_entry_plans_without_models_then_builds_from_the_resources_it_is_given(pipe, method):
    """One entry a method: planned from the build's facts alone (nothing opened), then built from only the
    resources its caller supplies, asking for just the models it uses; its words reach the output."""
    import dataclasses

    from specexport.runtime.methods import METHODS, MethodOptions, resolve
    from specexport.runtime.proposer_table import PROPOSERS, plan_proposer

    assert set(PROPOSERS) == set(METHODS) == set(TABLE)
    knobs, kind, wants, words = TABLE[method]
    asked = []
    res = dataclasses.replace(pipe.resources(), draft=lambda p: asked.append(("draft", p)) or pipe.draft_of(p),
                              heads=lambda k: asked.append(("heads", k)) or pipe.heads_of(k),
                              suffix_cache=lambda: asked.append(("suffix",)) or pipe.suffix_cache)
    options, note = resolve(MethodOptions(method, **knobs), pipe.view())
    assert options.method == method and note == ""
    plan = plan_proposer(options, res)
    assert asked == [] and plan.words == words
    assert type(plan.build(res)).__name__ == kind and asked == wants
    out = pipe.generate(prompt_ids=[1, 2, 3], max_new_tokens=4, method=method, **knobs)
    assert out.shape == words and out.method == method


def test_a_plan_is_checked_against_the_build_before_any_model_opens(pipe):
    """Trees and γ too wide for the graph, or needing more heads or a wider top-k than the build's, fail in
    planning with the option named (Pipeline.request and Batch.request plan; nothing is built)."""
    from specexport.runtime.methods import MethodOptions
    from specexport.runtime.proposer_table import Facts, plan_proposer

    facts = Facts.of(pipe.manifest)
    for options, match in [(MethodOptions("draft", gamma=8), "gamma: expected an integer in 1..7"),
                           (MethodOptions("draft", tree="wide"), "tree: 15 nodes; the graph verifies at most"),
                           (MethodOptions("draft", draft_stop=1.5, gamma=2), "draft_stop"),
                           (MethodOptions("medusa", tree=[[0], [0, 0], [0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0, 0]]),
                            "depth 5 needs 5 heads"),
                           (MethodOptions("eagle", tree={"top_k": 9, "depth": 2, "total_tokens": 4}),
                            "needs each node's top 9"),
                           (MethodOptions("lookup", gamma=2, lookup_branches=0), "lookup_branches")]:
        with pytest.raises(SpecexportError, match=match):
            plan_proposer(options, facts)
    small = plan_proposer(MethodOptions("medusa", tree="small"), facts)              # a name: cut to the 3 heads
    assert (small.depth, small.nodes) == (3, 6)


def test_a_batched_auto_request_leaves_the_shared_pipeline_unchanged(built, tmp_path):
    """method="auto" choosing the draft in another precision (gguf, under a pipeline whose draft is fp32):
    each request drafts on that precision's graphs (what a pipeline loaded with it drafts), the note and the
    method come back in the output, and the shared pipeline's draft precision stays fp32, alone and in a
    batch; a draft whose rows depend on the pass is refused in a batch, in the caller's thread."""
    import shutil

    import specexport
    from specexport.gamma import store_gamma_choices
    from specexport.manifest import read_manifest

    out = tmp_path / "b"
    shutil.copytree(built, out)
    store_gamma_choices(out, {("gguf", "fp32"): {"method": "draft", "gamma": 2, "tree": None, "draft_stop": 0.0,
                                                 "draft_precision": "gguf", "speedup": 1.5, "best_measured": "x",
                                                 "measured_tokens": 1}},
                        build_id=read_manifest(out)["build_id"], command="t", section="method_auto")
    request = dict(prompt_ids=PROMPTS[1], max_new_tokens=16)
    with specexport.load(out, precision="gguf", threads=2) as gguf_draft:
        want = gguf_draft.generate(**request, method="draft", gamma=2)
    with specexport.load(out, precision="gguf", draft_precision="fp32", threads=2) as shared:
        alone = shared.generate(**request, method="auto")
        with shared.batch(2) as batch:
            got = [h.result() for h in [batch.submit(**request, method="auto") for _ in range(2)]]
            with pytest.raises(SpecexportError, match="draft's fp32 graph runs on ONNX Runtime's own kernels"):
                batch.submit(**request, method="draft", gamma=2)
        assert shared.draft_precision == "fp32"
    assert (alone.stats.proposed, alone.stats.accepted) == (want.stats.proposed, want.stats.accepted)
    for o in (alone, *got):
        assert o.token_ids == want.token_ids and o.method == "draft" and "draft γ 2" in o.note
        assert o.stats.gamma == 2 and o.stats.proposed


def test_a_graph_with_pass_dependent_rows_batches_one_request_at_a_time(built_llama):
    """fp32 on ONNX Runtime's own kernels: not row-exact, so a batch holds one slot (outputs still equal)."""
    import specexport

    with specexport.load(built_llama, precision="fp32") as p:
        requests = [dict(prompt_ids=[1, 5, 9], max_new_tokens=8, method=m) for m in ("vanilla", "lookup")]
        want = _alone(p, requests)
        with p.batch(4) as batch:
            assert not batch.exact and batch.max_batch == 1 and "ONNX Runtime's own kernels" in batch.note
            assert [h.result().token_ids for h in [batch.submit(**r) for r in requests]] == want


def test_sampling_through_a_batched_loop_is_the_targets(pipe, monkeypatch):
    """A G-test: the first three sampled tokens of a request decoded next to another one (which leaves
    first, so the tested request moves down a slot) follow the target's own distribution; a planted bug
    (the slot moves but its cache rows stay: it reads the other request's cache) fails the same test."""
    from test_gguf_exact import three_token_fit

    from specexport.runtime.backends import slots

    prompt, other, k = [1, 40, 41, 42], [9, 300, 5, 7, 11], 3
    params, fit = three_token_fit(pipe.target, prompt)
    temperature = params.temperature
    assert not {t for cell in fit.cells for t in cell} & pipe.eos_ids      # three tokens every time

    def sample(runs: int, seed: int) -> np.ndarray:
        out = np.empty((runs, k), np.int64)
        with pipe.batch(2) as batch:
            for r in range(runs):
                lead = batch.submit(prompt_ids=other, max_new_tokens=2, method="vanilla", temperature=temperature,
                                    top_k=3, seed=seed + 2 * r, suffix_share=False)
                while not (batch.target.views or lead._done.is_set()):      # the lead takes slot 0 first
                    time.sleep(1e-4)
                tested = batch.submit(prompt_ids=prompt, max_new_tokens=k, method="draft", gamma=2,
                                      temperature=temperature, top_k=3, seed=seed + 2 * r + 1, suffix_share=False)
                lead.result()
                out[r] = tested.result().token_ids
        return out

    good = fit(sample(600, seed=0))
    assert good.pvalue > 1e-4, good

    moved = []

    def pack_without_copy(self):                                # BUG: the slot index moves, the rows do not
        for i, v in enumerate(self.views):
            if v.slot != i:
                moved.append(i)
            v.slot = i

    monkeypatch.setattr(slots.SlotModel, "_pack", pack_without_copy)
    bad = fit(sample(600, seed=10_000))
    assert len(moved) > 60                                      # the tested request moved down in many runs
    assert bad.pvalue < 1e-6, f"the planted bug was not detected: {bad}"


def test_sixteen_concurrent_openai_clients_against_a_batched_server(pipe):
    """`serve --max-batch 4`: 16 clients at once, mixed methods, streamed and not, some leaving mid-stream;
    every finished answer is the lone request's answer, and the passes held several requests."""
    from concurrent.futures import ThreadPoolExecutor
    from prometheus_client.parser import text_string_to_metric_families
    from test_serve_limits import LiveServer

    from specexport.serve.app import create_app
    from specexport.serve.guard import Limits

    texts = ["the cat sat on the mat", "one two three four five six", "a b c a b c a b", "hello world hello"]
    methods = ["vanilla", "suffix", "draft", "lookup", "medusa", "eagle"]
    want = {(t, m): pipe.generate(t, max_new_tokens=16, method=m, temperature=0, suffix_share=False).text
            for t in texts for m in methods}
    s = LiveServer(create_app(pipe, method="vanilla", limits=Limits(max_batch=4)))
    try:
        assert s.worker.max_batch == 4 and s.worker.batch.exact

        def client(k: int) -> list[bool]:
            c = s.openai(timeout=120)
            results = []
            for j in range(3):
                t, m = texts[(k + j) % 4], methods[(k // 4 + j) % 6]
                extra = {"method": m, "suffix_cache": False}
                if j == 1:
                    stream = c.completions.create(model="b", prompt=t, max_tokens=16, temperature=0, stream=True,
                                                  extra_body=extra)
                    if k % 5 == 0:                               # this client leaves mid-stream
                        next(iter(stream))
                        stream.close()
                        continue
                    text = "".join(ch.choices[0].text for ch in stream)
                else:
                    text = c.completions.create(model="b", prompt=t, max_tokens=16, temperature=0,
                                                extra_body=extra).choices[0].text
                results.append(text == want[(t, m)])
            return results

        with ThreadPoolExecutor(16) as pool:
            results = [ok for oks in pool.map(client, range(16)) for ok in oks]
        assert len(results) == 48 - 4 and all(results)
        metrics = {m.name: m for m in text_string_to_metric_families(s.client._client.get(f"{s.url}/metrics").text)}
        rows = {(x.labels["model"], x.labels["kind"]): x.value for x in metrics["specexport_batch_rows"].samples
                if x.name.endswith("_total")}
        passes = next(x.value for x in metrics["specexport_batch_passes"].samples
                      if x.name.endswith("_total") and x.labels["model"] == "target")
        assert rows[("target", "real")] > passes                 # several requests' rows a pass
        assert rows[("target", "padded")] >= rows[("target", "real")]
    finally:
        s.stop()


def test_a_long_call_runs_alone_when_padding_the_rest_would_cost_more():
    from types import SimpleNamespace

    from specexport.runtime.backends.slots import FIXED_ROWS, Call, SlotModel

    model = SimpleNamespace(fixed_rows=FIXED_ROWS, min_tokens=1, _extent=SlotModel._extent)

    def calls(*lengths):
        return [Call(SimpleNamespace(slot=i), np.zeros(t, np.int64), None, None, False) for i, t in enumerate(lengths)]

    group, alone = SlotModel.plan(model, calls(1, 8, 1, 1))          # a prompt chunk among one-token steps
    assert [len(c.tokens) for c in alone] == [8] and sorted(c.view.slot for c in group) == [0, 2, 3]
    group, alone = SlotModel.plan(model, calls(4, 4, 3, 2))          # similar rounds: one pass
    assert not alone and len(group) == 4
    group, alone = SlotModel.plan(model, calls(16, 16, 1, 1))        # two chunks: both alone beats padding
    assert sorted(len(c.tokens) for c in alone) == [16, 16]


def test_a_request_past_its_deadline_leaves_the_batch_and_the_others_answer_as_alone(pipe, monkeypatch):
    """`serve --max-batch 4 --request-timeout`: a long request among short ones passes its deadline (504)
    and frees its slot; the short ones, in the same passes, give their lone answers; the model serves on.
    Every pass is slowed by 30 ms, so the long one needs >= 3 s and the short ones ~0.3 s of a 1.5 s
    deadline (a 5x margin on a loaded machine, as test_serve_limits' deadline test)."""
    import httpx
    import openai
    from test_serve_limits import LiveServer, metric_values, wait_for

    from specexport.runtime.backends.slots import SlotModel
    from specexport.serve.app import create_app
    from specexport.serve.guard import Limits

    texts = ["the cat sat on the mat", "one two three", "a b c a b c"]
    want = {t: pipe.generate(t, max_new_tokens=8, method="vanilla", temperature=0).text for t in texts}
    assert pipe.generate("hello world", max_new_tokens=100, method="vanilla").finish_reason == "length"
    run = SlotModel.run

    def slowed(self, calls):
        time.sleep(0.03)
        return run(self, calls)

    monkeypatch.setattr(SlotModel, "run", slowed)
    s = LiveServer(create_app(pipe, method="vanilla", limits=Limits(max_batch=4, request_timeout_s=1.5)))
    try:
        from concurrent.futures import ThreadPoolExecutor

        def long():
            with pytest.raises(openai.InternalServerError) as err:      # >= 100 passes of >= 30 ms
                s.openai(timeout=60).completions.create(model="b", prompt="hello world", max_tokens=100,
                                                        temperature=0)
            return err.value.status_code

        def short(t):
            return s.openai(timeout=60).completions.create(model="b", prompt=t, max_tokens=8, temperature=0).choices[0].text

        with ThreadPoolExecutor(4) as pool:
            slow = pool.submit(long)
            time.sleep(0.2)                                               # the long one decoding first
            answers = list(pool.map(short, texts))
            assert slow.result(timeout=60) == 504
        assert answers == [want[t] for t in texts]
        timeouts = ("specexport_decodes_total", frozenset({("outcome", "timeout")}))
        # the server answers 504 at the deadline; the decode thread counts it when it stops (after its pass)
        wait_for(lambda: timeouts in metric_values(httpx.get(f"{s.url}/metrics").text), "the timeout counted", 30)
        page = metric_values(httpx.get(f"{s.url}/metrics").text)
        assert page[timeouts] == 1
        real = page[("specexport_batch_rows_total", frozenset({("model", "target"), ("kind", "real")}))]
        assert real > page[("specexport_batch_passes_total", frozenset({("model", "target")}))]   # shared passes
        assert short(texts[0]) == want[texts[0]]                           # the slot freed, the model serving
    finally:
        s.stop()

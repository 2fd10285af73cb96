"""The suffix store (runtime/suffix.py) against a brute-force reference: plain Python loops over lists that
implement the documented semantics literally (occurrences, the longest match, most recent first, the
trie of continuations selected best-first with exact fractions), on small alphabets so that repeats,
ties and truncation are the common case. Also: eviction and scopes of the cache, its file (round trip,
damaged files, refusing to overwrite a foreign file) and its lock.
"""
from __future__ import annotations

import threading
from fractions import Fraction
from unittest import mock

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specexport.errors import SpecexportError
from specexport.runtime import suffix
from specexport.runtime.suffix import Candidates, SuffixCache, SuffixIndex

SETTINGS = settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# -- the reference --------------------------------------------------------------------------------------------
def ref_match(seqs: list[list[int]], ctx: list[int], max_match: int, max_occ: int):
    """(m, [(sequence index, offset where the continuation starts)], most recent first) or None."""
    for m in range(min(max_match, len(ctx)), 0, -1):
        suf = ctx[len(ctx) - m:]
        occ = [(s, j + m) for s, seq in enumerate(seqs) for j in range(len(seq) - m) if seq[j:j + m] == suf]
        if occ:
            return m, sorted(occ, reverse=True)[:max_occ]
    return None


def ref_tree(conts: list[list[int]], root: int, max_depth: int, max_nodes: int, min_prob: float):
    """Best-first selection over the trie of the continuations, probabilities as exact fractions of the
    literal rule prob(child) = prob(parent) * count(child) / count(parent)."""
    count = {(): len(conts)}
    for c in conts:
        for d in range(1, min(len(c), max_depth) + 1):
            count[tuple(c[:d])] = count.get(tuple(c[:d]), 0) + 1
    prob, index = {(): Fraction(1)}, {(): 0}
    parents, tokens, probs = [-1], [root], [1.0]
    while len(tokens) - 1 < max_nodes:
        frontier = [p for p in count if p and p[:-1] in index and p not in index]
        for p in frontier:
            prob[p] = prob[p[:-1]] * count[p] / count[p[:-1]]
        if not frontier:
            break
        best = min(frontier, key=lambda p: (-prob[p], len(p), p[-1], p[:-1]))
        if float(prob[best]) < min_prob:
            break
        index[best] = len(tokens)
        parents.append(index[best[:-1]])
        tokens.append(best[-1])
        probs.append(float(prob[best]))
    return parents, tokens, probs


def check_lookup(ix: SuffixIndex, live: list[tuple[int, list[int]]], ctx: list[int], *, root: int, max_depth: int,
                 max_nodes: int, min_prob: float) -> None:
    """ix's match and tree for ctx equal the reference's over the live (id, tokens) sequences."""
    seqs = [s for _, s in live]
    want = ref_match(seqs, ctx, ix.max_match, ix.max_occurrences)
    got = ix.match(np.asarray(ctx, dtype=np.int64))
    if want is None:
        assert got is None
        return
    m, occ = want
    assert got is not None and got.length == m
    ids, offsets = ix.locate(got.starts)
    assert list(zip(ids.tolist(), offsets.tolist())) == [(live[s][0], o) for s, o in occ]
    tree = ix.tree(got, root=root, max_depth=max_depth, max_nodes=max_nodes, min_prob=min_prob)
    parents, tokens, probs = ref_tree([seqs[s][o:o + max_depth] for s, o in occ], root, max_depth, max_nodes,
                                      min_prob)
    assert tree.parents.tolist() == parents
    assert tree.tokens.tolist() == tokens
    assert tree.probs.tolist() == probs
    assert tree.score == pytest.approx(sum(probs[1:]))


# -- SuffixIndex against the reference --------------------------------------------------------------------------
def _ops(alphabet: int):
    toks = st.lists(st.integers(0, alphabet - 1), max_size=9)
    return st.lists(st.one_of(st.tuples(st.just("add"), toks), st.tuples(st.just("extend"), toks),
                              st.tuples(st.sampled_from(["evict", "renumber"]), st.just([]))), min_size=1, max_size=14)


@st.composite
def index_case(draw):
    alphabet = draw(st.integers(2, 5))
    return {"alphabet": alphabet, "max_match": draw(st.integers(1, 9)), "max_occ": draw(st.integers(1, 8)),
            "tail_min": draw(st.sampled_from([1, 2, 5, 12, 30, 4096])), "dead_share": draw(st.sampled_from([1, 4, 10**6])),
            "positions": draw(st.sampled_from([30, 60, 2**32 - 2])), "ops": draw(_ops(alphabet)),
            "seed": draw(st.integers(0, 2**32 - 1))}


def run_index_case(case) -> None:
    rng = np.random.default_rng(case["seed"])
    ix = SuffixIndex(max_match=case["max_match"], max_occurrences=case["max_occ"])
    # tiny thresholds so that tails merge, evicted tokens are dropped and positions renumbered every few tokens
    ix._TAIL_MIN, ix._TAIL_SHARE, ix._DEAD_SHARE, ix._POSITIONS = case["tail_min"], 2, case["dead_share"], \
        case["positions"]
    live: list[tuple[int, list[int]]] = []
    last_id = None
    for op, toks in case["ops"]:
        span = sum(len(s) + 1 for _, s in live)       # positions the live sequences need
        if op == "add":
            if span + len(toks) + 1 > ix._POSITIONS:
                with pytest.raises(SpecexportError):
                    ix.add(toks)
                continue
            last_id = ix.add(toks)
            live.append((last_id, list(toks)))
        elif op == "renumber":
            ix._renumber()
        elif op == "extend":
            if live and live[-1][0] == last_id and span + len(toks) > ix._POSITIONS:
                with pytest.raises(SpecexportError):
                    ix.extend(last_id, toks)
            elif live and live[-1][0] == last_id:
                ix.extend(last_id, toks)
                live[-1][1].extend(toks)
            elif last_id is not None:
                with pytest.raises(SpecexportError):
                    ix.extend(last_id, toks)
            if len(live) > 1:                         # only the newest sequence is open
                with pytest.raises(SpecexportError):
                    ix.extend(live[0][0], toks)
        else:
            freed = ix.evict_oldest()
            assert freed == (len(live.pop(0)[1]) if live else 0)
        assert ix.tokens == sum(len(s) for _, s in live) and ix.sequences == len(live)
        contexts = [rng.integers(0, case["alphabet"], rng.integers(0, 12)).tolist()]
        for _, seq in live:                           # pieces of stored text (long matches), and the open
            a = int(rng.integers(0, len(seq) + 1))    # sequence itself (its own final suffix is no occurrence)
            contexts.append(seq[a:a + int(rng.integers(0, 12))])
        if live:
            contexts.append(list(live[-1][1]))
        for ctx in contexts:
            check_lookup(ix, live, ctx, root=int(rng.integers(0, 5)), max_depth=int(rng.integers(0, 7)),
                         max_nodes=int(rng.integers(0, 12)), min_prob=float(rng.choice([0.0, 0.2, 0.34, 0.5, 1.0])))
    for seq_id, seq in live:
        assert ix.sequence(seq_id).tolist() == seq


@SETTINGS
@given(index_case())
def test_index_equals_the_reference(case):
    run_index_case(case)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(index_case())
def test_hash_collisions_never_make_a_wrong_match(case):
    """Every gram of every level gets the same hash: only the token comparisons tell occurrences apart."""
    with mock.patch.object(suffix, "_mix", lambda h: h * np.uint64(0)):
        run_index_case(case)


def test_the_worked_example():
    ix = SuffixIndex(max_match=4)
    ix.add([1, 2, 3, 1, 2, 4])
    found = ix.match([9, 1, 2])
    assert found.length == 2 and [o for _, o in zip(*ix.locate(found.starts))] == [5, 2]
    tree = ix.tree(found, root=2, max_depth=2, max_nodes=10)
    assert tree.parents.tolist() == [-1, 0, 0, 1] and tree.tokens.tolist() == [2, 3, 4, 1]
    assert tree.probs.tolist() == [1.0, 0.5, 0.5, 0.5] and tree.score == 1.5
    assert ix.tree(found, root=2, max_depth=2, max_nodes=10, min_prob=0.6).tokens.tolist() == [2]
    assert ix.match([7]) is None and ix.match([]) is None


@pytest.mark.parametrize("max_match", [8, 32])
def test_long_sequences_cross_the_merge_and_eviction_paths(max_match):
    """Default thresholds, some thousands of tokens made of recurring chunks (matches of 32 tokens and more):
    the sorted arrays, the tails, eviction and the long gram levels all in play."""
    rng = np.random.default_rng(max_match)
    chunks = [rng.integers(0, 4, int(rng.integers(5, 60))).tolist() for _ in range(12)]
    ix = SuffixIndex(max_match=max_match, max_occurrences=16)
    live = []
    for _ in range(14):
        seq = []
        while len(seq) < int(rng.integers(300, 1500)):
            seq += chunks[int(rng.integers(len(chunks)))] if rng.random() < 0.6 else rng.integers(0, 4, 20).tolist()
        live.append((ix.add(seq), seq))
        if len(live) > 6:
            live.pop(0)
            ix.evict_oldest()
        for _ in range(3):
            s = live[int(rng.integers(len(live)))][1]
            a = int(rng.integers(len(s)))
            check_lookup(ix, live, s[a:a + 40], root=0, max_depth=6, max_nodes=12, min_prob=0.0)
    assert ix.nbytes < 100 * max(ix.tokens, 1)


def test_memory_stays_bounded_under_churn():
    """Evicted tokens and entries are dropped, not only hidden: a long add/evict churn keeps nbytes near the
    live tokens' share."""
    rng = np.random.default_rng(2)
    ix = SuffixIndex(max_match=8)
    ix._TAIL_MIN = 64
    for _ in range(400):
        ix.add(rng.integers(0, 50, 50))
        if ix.sequences > 10:
            ix.evict_oldest()
    assert ix.tokens == 500 and ix.nbytes < 200 * ix.tokens
    assert all(len(m) < 4 * ix.tokens for m in ix._main)


def test_bad_input_is_one_line_errors():
    ix = SuffixIndex()
    for bad in ([-1], [2**31], [[1, 2]], [1.5], ["a"]):
        with pytest.raises(SpecexportError) as err:
            ix.add(bad)
        assert "\n" not in str(err.value)
    with pytest.raises(SpecexportError):
        ix.extend(0, [1])                             # never added
    with pytest.raises(SpecexportError):
        SuffixIndex(max_match=0)
    with pytest.raises(SpecexportError):
        SuffixCache(-1)
    ix.add([1, 2, 1, 2])
    with pytest.raises(SpecexportError):
        ix.tree(ix.match([1]), root=1, max_depth=-1, max_nodes=3)
    assert ix.evict_oldest() == 4 and ix.evict_oldest() == 0 and ix.match([1]) is None


# -- SuffixCache: eviction and scopes ---------------------------------------------------------------------------
@st.composite
def cache_case(draw):
    alphabet = draw(st.integers(2, 5))
    adds = draw(st.lists(st.tuples(st.sampled_from(["", "a", "b"]),
                                   st.lists(st.integers(0, alphabet - 1), max_size=12)), max_size=12))
    return {"alphabet": alphabet, "max_tokens": draw(st.integers(0, 30)), "max_match": draw(st.integers(1, 6)),
            "max_occ": draw(st.integers(1, 6)), "adds": adds, "seed": draw(st.integers(0, 2**32 - 1))}


def ref_cache(adds, max_tokens):
    """The (scope, tokens) that survive: each clipped to its last max_tokens, the oldest evicted to fit."""
    kept = []
    for scope, toks in adds:
        toks = toks[len(toks) - min(len(toks), max_tokens):]
        if toks:
            kept.append((scope, toks))
        while sum(len(t) for _, t in kept) > max_tokens:
            kept.pop(0)
    return kept


def check_cache(cache: SuffixCache, kept, rng, alphabet: int) -> None:
    assert cache.tokens == sum(len(t) for _, t in kept) <= cache.max_tokens
    assert cache.sequences == len(kept)
    for scope in ("", "a", "b", "never"):
        seqs = [t for s, t in kept if s == scope]
        contexts = [rng.integers(0, alphabet, rng.integers(1, 8)).tolist()] + [t[-5:] for t in seqs[-2:]]
        for ctx in contexts:
            depth, nodes = int(rng.integers(1, 5)), int(rng.integers(1, 8))
            found, tree = cache.candidates(ctx, scope=scope, root=9, max_depth=depth, max_nodes=nodes)
            want = ref_match(seqs, ctx, cache._kw["max_match"], cache._kw["max_occurrences"])
            if want is None:
                assert found is None and tree is None
                continue
            m, occ = want
            assert found.length == m and isinstance(tree, Candidates)
            parents, tokens, probs = ref_tree([seqs[s][o:o + depth] for s, o in occ], 9, depth, nodes, 0.0)
            assert (tree.parents.tolist(), tree.tokens.tolist(), tree.probs.tolist()) == (parents, tokens, probs)


@SETTINGS
@given(cache_case())
def test_cache_eviction_and_scopes_equal_the_reference(case):
    rng = np.random.default_rng(case["seed"])
    cache = SuffixCache(case["max_tokens"], max_match=case["max_match"], max_occurrences=case["max_occ"])
    with mock.patch.object(SuffixIndex, "_TAIL_MIN", 2), mock.patch.object(SuffixIndex, "_DEAD_SHARE", 2):
        for i in range(len(case["adds"])):
            cache.add(*reversed(case["adds"][i]))
            check_cache(cache, ref_cache(case["adds"][:i + 1], case["max_tokens"]), rng, case["alphabet"])
    stats = cache.stats()
    assert stats["lookups"] == cache.lookups >= stats["hits"] == cache.hits


def test_scopes_never_share_counts():
    """The same context in scope "b" is followed by 4 five times: scope "a" must see its one 3 only."""
    cache = SuffixCache(1000)
    cache.add([1, 2, 3], scope="a")
    for _ in range(5):
        cache.add([1, 2, 4, 1, 2, 4], scope="b")
    found, tree = cache.candidates([5, 1, 2], scope="a", root=2, max_depth=3, max_nodes=8)
    assert found.length == 2 and len(found.starts) == 1
    assert tree.tokens.tolist() == [2, 3] and tree.probs.tolist() == [1.0, 1.0]
    found, tree = cache.candidates([5, 1, 2], scope="b", root=2, max_depth=1, max_nodes=8)
    assert len(found.starts) == 10 and tree.tokens.tolist() == [2, 4]
    assert cache.candidates([1, 2], scope="c", root=2, max_depth=3, max_nodes=8) == (None, None)
    assert (cache.lookups, cache.hits) == (3, 2)


def test_the_budget_and_eviction_order_are_shared_across_scopes():
    cache = SuffixCache(10)
    cache.add([1] * 4, scope="a")
    cache.add([2] * 4, scope="b")
    cache.add([3] * 4, scope="a")                     # evicts a's [1, 1, 1, 1], the oldest of all
    assert cache.tokens == 8 and cache.candidates([1], scope="a", root=1, max_depth=2, max_nodes=2)[0] is None
    assert cache.candidates([2], scope="b", root=2, max_depth=2, max_nodes=2)[0] is not None
    cache.add(list(range(25)), scope="c")             # longer than the budget: its last 10 tokens, alone
    assert cache.tokens == 10 and cache.sequences == 1
    found, tree = cache.candidates([15], scope="c", root=15, max_depth=3, max_nodes=5)
    assert found.length == 1
    assert tree.tokens.tolist() == [15, 16, 17, 18]
    assert cache.candidates([14], scope="c", root=14, max_depth=3, max_nodes=5)[0] is None


def test_the_lock_keeps_concurrent_use_consistent():
    cache = SuffixCache(5000, max_match=8)
    errors = []

    def work(seed):
        rng = np.random.default_rng(seed)
        try:
            for _ in range(60):
                seq = rng.integers(0, 5, 40)
                cache.add(seq, scope=str(seed % 2))
                cache.candidates(seq[:10], scope=str(seed % 2), root=0, max_depth=4, max_nodes=8)
        except Exception as err:  # noqa: BLE001 -- any failure in a thread is the finding
            errors.append(err)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert 5000 - 40 < cache.tokens <= 5000 and cache.sequences == cache.tokens // 40
    assert cache.lookups == 240 and cache.hits == 240


# -- the file ------------------------------------------------------------------------------------------------
def _filled(max_tokens=400, seed=0) -> tuple[SuffixCache, list]:
    rng = np.random.default_rng(seed)
    cache, adds = SuffixCache(max_tokens, max_match=6, max_occurrences=8), []
    for i in range(40):
        adds.append((["", "a", "ß b"][i % 3], rng.integers(0, 4, int(rng.integers(1, 30))).tolist()))
        cache.add(adds[-1][1], scope=adds[-1][0])
    return cache, adds


def _same_answers(x: SuffixCache, y: SuffixCache, seed=0) -> None:
    rng = np.random.default_rng(seed)
    for _ in range(60):
        ctx, scope = rng.integers(0, 4, int(rng.integers(1, 8))), ["", "a", "ß b"][int(rng.integers(3))]
        fx, tx = x.candidates(ctx, scope=scope, root=1, max_depth=4, max_nodes=10)
        fy, ty = y.candidates(ctx, scope=scope, root=1, max_depth=4, max_nodes=10)
        assert (fx is None) == (fy is None)
        if fx is not None:
            assert fx.length == fy.length and len(fx.starts) == len(fy.starts)
            assert tx.tokens.tolist() == ty.tokens.tolist() and tx.probs.tolist() == ty.probs.tolist()


def test_save_load_round_trip(tmp_path):
    cache, adds = _filled()
    path = tmp_path / "cache.sfx"
    cache.save(path)
    cache.save(path)                                  # replacing its own file is fine
    back = SuffixCache.load(path, cache.max_tokens, max_match=6, max_occurrences=8)
    assert (back.tokens, back.sequences) == (cache.tokens, cache.sequences)
    _same_answers(cache, back)
    more = [3, 2, 1] * 20
    cache.add(more, scope="a")                        # the eviction order survived the file
    back.add(more, scope="a")
    assert (back.tokens, back.sequences) == (cache.tokens, cache.sequences)
    _same_answers(cache, back, seed=1)
    for budget in (0, 1, 7, 50):                      # a smaller budget keeps the newest that fit
        small = SuffixCache.load(path, budget, max_match=6, max_occurrences=8)
        ref = SuffixCache(budget, max_match=6, max_occurrences=8)
        for scope, toks in adds:
            ref.add(toks, scope=scope)
        assert {**small.stats(), "nbytes": 0} == {**ref.stats(), "nbytes": 0}
        _same_answers(small, ref)
    assert not [p for p in tmp_path.iterdir() if p.name != "cache.sfx"]      # no temporary file left behind


def test_damaged_files_are_one_line_errors_naming_them(tmp_path):
    cache, _ = _filled()
    good = tmp_path / "good.sfx"
    cache.save(good)
    data = good.read_bytes()
    rng = np.random.default_rng(0)
    version = bytearray(data)
    version[8:12] = (99).to_bytes(4, "little")
    flipped = bytearray(data)
    flipped[len(data) // 2] ^= 0x40
    cases = {"missing": None, "empty": b"", "magic-only": data[:8], "truncated": data[:len(data) // 2],
             "one-short": data[:-1], "random": rng.bytes(len(data)), "text": b"hello\n", "version": bytes(version),
             "flipped": bytes(flipped), "longer": data + b"\0"}
    for name, content in cases.items():
        path = tmp_path / f"{name}.sfx"
        if content is not None:
            path.write_bytes(content)
        with pytest.raises(SpecexportError) as err:
            SuffixCache.load(path, 1000)
        message = str(err.value)
        assert str(path) in message and "\n" not in message, (name, message)
    assert "version 99" in str(pytest.raises(SpecexportError, SuffixCache.load, tmp_path / "version.sfx", 10).value)


def test_save_refuses_to_overwrite_a_foreign_file(tmp_path):
    cache, _ = _filled()
    for content in (b"my notes\n", b"", b"SPXSUF"):
        path = tmp_path / "notes.txt"
        path.write_bytes(content)
        with pytest.raises(SpecexportError) as err:
            cache.save(path)
        assert str(path) in str(err.value) and "\n" not in str(err.value)
        assert path.read_bytes() == content
    with pytest.raises(SpecexportError):
        cache.save(tmp_path)                          # a folder
    with pytest.raises(SpecexportError):
        cache.save(tmp_path / "missing" / "cache.sfx")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


@SETTINGS
@given(st.lists(st.integers(0, 3), min_size=0, max_size=80), st.integers(1, 9), st.integers(1, 6),
       st.integers(0, 6), st.integers(0, 10), st.sampled_from([0.0, 0.2, 0.5]))
def test_scan_match_is_the_open_sequences_match(ctx, max_match, max_occ, max_depth, max_nodes, min_prob):
    """The request's own text is scanned directly (suffix.scan_match), not indexed: the same match
    and tree as the reference over the one open sequence that is the context itself."""
    got = suffix.scan_match(np.asarray(ctx, np.int64), max_match=max_match, max_occurrences=max_occ)
    want = ref_match([ctx], ctx, max_match, max_occ)
    if want is None:
        assert got is None
        return
    assert got.length == want[0] and got.starts.tolist() == [j for _, j in want[1]]
    tree = suffix.continuation_tree(np.asarray(ctx, np.int64), got.starts, root=9, max_depth=max_depth,
                                    max_nodes=max_nodes, min_prob=min_prob)
    parents, tokens, probs = ref_tree([ctx[j:j + max_depth] for _, j in want[1]], 9, max_depth, max_nodes, min_prob)
    assert tree.parents.tolist() == parents and tree.tokens.tolist() == tokens
    np.testing.assert_allclose(tree.probs, probs)

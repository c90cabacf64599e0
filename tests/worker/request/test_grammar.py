"""Grammar masks against xgrammar's own matcher stepped token by token, applied as a plain torch
reference would; the vocabulary as xgrammar reads it; bad specs refused."""

from __future__ import annotations

import json
import threading

import pytest
import torch
import xgrammar as xgr

from services.worker.request import mask_filler
from services.worker.request.grammar_masks import (
    Block,
    GrammarMasks,
    decode_blocks,
    default_threads,
)
from services.worker.request.grammar_state import GrammarState
from services.worker.request.grammar_vocab import tokenizer_info
from services.worker.request.request import Grammar, Request, SamplingParams
from tests.worker.request.grammar_cases import (
    ANY_TEXT,
    JSON_OBJECT,
    JSON_SCHEMA,
    MINI_EOS,
    MINI_VOCAB,
    allowed,
    block_allowed,
    compiler,
    mini_tokenizer,
    random_walk,
    reference_mask,
    shared_masks,
    tokenizer,
    tool_call_tag,
)

GRAMMARS = {
    "json_object": JSON_OBJECT,
    "json_schema": JSON_SCHEMA,
    "any_text": ANY_TEXT,
    "dsml": tool_call_tag("deepseek_v3_2"),
    "glm": tool_call_tag("glm_4_7"),
}


@pytest.mark.parametrize("name", ["mini", "byte"])
@pytest.mark.parametrize("grammar", sorted(GRAMMARS))
def test_block_masks_equal_the_matcher_stepped_token_by_token(name: str, grammar: str) -> None:
    """Row i of a block's masks is the mask after the output and drafts[:i], for blocks of
    valid drafts and blocks whose drafts break the grammar midway (later rows allow all); the
    state is unchanged after filling."""
    c = compiler(name)
    compiled = c.compile(GRAMMARS[grammar])
    vocab = c.vocab_size
    for seed in range(3):
        walk = random_walk(compiled, 40, vocab, tuple(c.stop_token_ids), seed)
        g = torch.Generator().manual_seed(seed)
        st = c.state(GRAMMARS[grammar])
        at = 0
        while at < len(walk):
            k = int(torch.randint(1, 7, (1,), generator=g))
            drafts = walk[at : at + k - 1]
            rows = len(drafts) + 1
            bad = int(torch.randint(0, rows, (1,), generator=g)) if rows > 1 else rows
            if bad < rows - 1:  # a draft the grammar forbids there
                forbidden = ~allowed(reference_mask(compiled, walk[: at + bad], vocab), vocab)
                drafts[bad] = int(forbidden.nonzero()[seed % 5, 0])
            got = block_allowed([(st, rows, drafts)], vocab)
            for i in range(rows):
                if i <= bad or bad >= rows - 1:
                    ref = allowed(reference_mask(compiled, walk[:at] + drafts[:i], vocab), vocab)
                    assert torch.equal(got[i], ref), (seed, at, i)
                else:
                    assert got[i].all()
            # unchanged: the next mask is the one after the output
            again = block_allowed([(st, 1, [])], vocab)
            assert torch.equal(again[0], allowed(reference_mask(compiled, walk[:at], vocab), vocab))
            take = min(k, len(walk) - at)
            for t in walk[at : at + take]:
                assert st.accept(t)
            at += take


@pytest.mark.parametrize("rows", [1, 3])
def test_apply_masks_logits_as_the_bitmask_says(rows: int) -> None:
    """On the CPU: forbidden tokens become -inf, allowed ones keep their logits exactly."""
    c = compiler("mini")
    compiled = c.compile(JSON_SCHEMA)
    walk = random_walk(compiled, 12, MINI_VOCAB, MINI_EOS, seed=1)
    st = c.state(JSON_SCHEMA, walk[:5])
    drafts = walk[5 : 5 + rows - 1]
    logits = torch.randn(rows, MINI_VOCAB, generator=torch.Generator().manual_seed(rows))
    want = logits.clone()
    for i in range(rows):
        ok = allowed(reference_mask(compiled, walk[: 5 + i], MINI_VOCAB), MINI_VOCAB)
        want[i] = want[i].masked_fill(~ok, float("-inf"))
    masks = shared_masks(MINI_VOCAB)
    masks.fill([Block(st, 0, rows, drafts)])
    masks.apply(logits)
    assert torch.equal(logits, want)


def test_one_pass_masks_every_request_as_alone() -> None:
    """A pass of several constrained requests (decode rows and verify blocks, a draft the
    grammar rejects, a terminated grammar) and unconstrained rows between them: each block's
    rows are the masks it gets alone, the unconstrained rows keep their logits exactly, and
    every grammar's state is unchanged after."""
    c = compiler("mini")
    compiled = c.compile(JSON_SCHEMA)
    walks = [random_walk(compiled, 16, MINI_VOCAB, MINI_EOS, seed=s) for s in range(4)]
    states = [c.state(JSON_SCHEMA, w[:6]) for w in walks]
    done = c.state(JSON_OBJECT, mini_tokenizer().encode("{}"))
    assert done.accept(MINI_EOS[0]) and done.terminated
    forbidden = int((~allowed(reference_mask(compiled, walks[2][:7], MINI_VOCAB), MINI_VOCAB))
                    .nonzero()[3, 0])  # fmt: skip
    blocks = [
        (states[0], 1, []),
        (states[1], 4, walks[1][6:9]),
        (states[2], 3, [walks[2][6], forbidden]),
        (done, 2, [MINI_EOS[0]]),
        (states[3], 2, walks[3][6:7]),
    ]
    alone = [block_allowed([b], MINI_VOCAB) for b in blocks]
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(18, MINI_VOCAB, generator=g)
    want = logits.clone()
    masks = shared_masks(MINI_VOCAB)
    placed, first = [], 0
    for (st, rows, drafts), ok in zip(blocks, alone, strict=True):
        first += 1  # an unconstrained row before each block
        placed.append(Block(st, first, rows, drafts))
        want[first : first + rows] = want[first : first + rows].masked_fill(~ok, float("-inf"))
        first += rows
    masks.fill(placed)
    masks.apply(logits)
    assert torch.equal(logits, want)
    for st, w in zip(states, walks, strict=True):
        after = block_allowed([(st, 1, [])], MINI_VOCAB)[0]
        assert torch.equal(after, allowed(reference_mask(compiled, w[:6], MINI_VOCAB), MINI_VOCAB))


def test_extra_ids_and_special_tokens_are_never_allowed() -> None:
    """Ids past the tokenizer's 8128 (the logits are 8192 wide) and special tokens are never
    allowed; the stop tokens are allowed once the grammar is complete, and only then."""
    c = compiler("mini")
    tok = mini_tokenizer()
    st = c.state(JSON_OBJECT)
    specials = [i for i in range(tok.vocab_size) if tok.is_special(i)]
    text = '{"name": "Ada Lovelace", "née": "日本", "born": 1815, "tags": ["a", [true, null]]}'
    ids = tok.encode(text)
    for t in ids:
        ok = block_allowed([(st, 1, [])], MINI_VOCAB)[0]
        assert not ok[tok.vocab_size :].any()
        assert not ok[specials].any()
        assert st.accept(t)
    ok = block_allowed([(st, 1, [])], MINI_VOCAB)[0]
    assert ok.nonzero()[:, 0].tolist() == sorted(MINI_EOS)
    assert st.accept(MINI_EOS[0]) and st.terminated


def test_the_vocabulary_is_the_text_each_token_decodes_to() -> None:
    tok = mini_tokenizer()
    info = tokenizer_info(tok, MINI_VOCAB, MINI_EOS)
    assert info.vocab_size == MINI_VOCAB and sorted(info.stop_token_ids) == sorted(MINI_EOS)
    decoded = info.decoded_vocab
    checked = 0
    for i in range(tok.vocab_size):
        text = tok.decode([i], skip_special_tokens=False)
        if tok.is_special(i):
            assert decoded[i] == b""
        elif "\ufffd" not in text:
            assert decoded[i] == text.encode(), i
            checked += 1
    assert checked > 7000
    byte_info = tokenizer_info(tokenizer("byte"), 264, (257,))
    assert byte_info.decoded_vocab[:256] == [bytes([i]) for i in range(256)]


def test_the_cache_holds_each_grammar_once() -> None:
    c = compiler("byte")
    spec = json.dumps({"type": "object", "properties": {"k": {"type": "string"}}})
    assert c.compile(Grammar("json_schema", spec)) is c.compile(Grammar("json_schema", spec))


BAD = [
    (Grammar("regex", "a+"), "kind must be one of"),
    (Grammar("json_schema", '{"type": "object"'), "not valid JSON"),
    (Grammar("json_schema", '{"type": "nope"}'), 'Unsupported type "nope"'),
    (Grammar("json_schema", '{"$ref": "#/missing"}'), "invalid json_schema"),
    (Grammar("structural_tag", "[1,"), "not valid JSON"),
    (Grammar("structural_tag", '{"type": "structural_tag", "format": {"type": "zzz"}}'),
     "Format type not recognized: zzz"),
    (Grammar("structural_tag", '{"type": "structural_tag", "format": {"type": "tag", "begin": "a"}}'),
     "must have a content field"),
]  # fmt: skip


@pytest.mark.parametrize(("grammar", "reason"), BAD)
def test_bad_specs_are_refused_with_a_reason(grammar: Grammar, reason: str) -> None:
    with pytest.raises(ValueError) as e:
        compiler("byte").check(SamplingParams(grammar=grammar))
    assert reason in str(e.value)
    assert not str(e.value).startswith("[")  # no xgrammar source location


def test_min_tokens_with_a_grammar_is_refused() -> None:
    with pytest.raises(ValueError, match="min_tokens"):
        compiler("byte").check(SamplingParams(min_tokens=2, grammar=JSON_OBJECT))


def _schema_requests(
    steps: int, past: int
) -> tuple[xgr.CompiledGrammar, list[list[int]], list[Request]]:
    """Three requests under ``JSON_SCHEMA`` (the mini tokenizer's), each past the first
    ``past`` tokens of a random walk of ``steps`` through the grammar: (the compiled grammar,
    the walks, the requests)."""
    c = compiler("mini")
    compiled = c.compile(JSON_SCHEMA)
    walks = [random_walk(compiled, steps, MINI_VOCAB, MINI_EOS, seed=s) for s in range(3)]
    reqs = []
    for i, w in enumerate(walks):
        req = Request(f"r{i}", [1, 2], SamplingParams(), text=None)  # type: ignore[arg-type]
        req.grammar = c.state(JSON_SCHEMA, w[:past])
        reqs.append(req)
    return compiled, walks, reqs


@pytest.mark.parametrize("threads", [1, 2])
def test_rows_filled_ahead_serve_the_next_pass_unless_the_request_moved_on(threads) -> None:
    """After a step, the next decode row of every running constrained request is filled ahead
    by the filling thread; the next pass uses it when the request's tokens are unchanged, and
    asks again for one that accepted a token since (once the thread's job is done: a matcher is
    the thread's while it fills). Both equal the matcher stepped token by token; a request no
    longer running gets no row ahead, and a later pass asks for it on demand."""
    compiled, walks, reqs = _schema_requests(12, 4)
    masks = GrammarMasks(MINI_VOCAB, torch.device("cpu"), max_rows=8, max_seqs=3, threads=threads)
    try:
        masks.fill(decode_blocks(reqs))  # starts the thread
        masks.apply(torch.zeros(3, MINI_VOCAB))
        masks.prefetch(reqs[:2], ahead=True)  # r2 is no longer running: nothing ahead
        masks.fill(decode_blocks(reqs[:2]))
        masks.apply(torch.zeros(2, MINI_VOCAB))  # waits for the rows ahead
        masks.prefetch(reqs[:2], ahead=True)
        logits = torch.zeros(3, MINI_VOCAB)
        masks.fill_decode(reqs)
        masks.apply(logits)  # the thread's jobs done: the matchers are the engine's again
        assert reqs[1].grammar is not None and reqs[1].grammar.accept(walks[1][4])
        logits = torch.zeros(3, MINI_VOCAB)
        masks.fill_decode(reqs)
        masks.apply(logits)
        for i, (w, at) in enumerate(zip(walks, (4, 5, 4), strict=True)):
            want = allowed(reference_mask(compiled, w[:at], MINI_VOCAB), MINI_VOCAB)
            assert torch.equal(logits[i] != float("-inf"), want), i
    finally:
        masks.close()


@pytest.mark.parametrize("threads", [1, 3])
def test_the_rows_filled_ahead_take_one_row_per_sequence(threads) -> None:
    """The rows filled ahead are ``max_seqs`` (one per decoding sequence), those filled on
    demand ``max_rows`` (sequences times the verify width): with two seats' rows ahead and a
    third request asking, the third is filled on demand, and every mask is the matcher's."""
    compiled, walks, reqs = _schema_requests(8, 3)
    masks = GrammarMasks(MINI_VOCAB, torch.device("cpu"), max_rows=12, max_seqs=2, threads=threads)
    try:
        assert not masks.started
        masks.fill(decode_blocks(reqs))
        masks.apply(torch.zeros(3, MINI_VOCAB))
        assert masks.started
        masks.prefetch(reqs, ahead=True)  # rows ahead for the first two only
        logits = torch.zeros(3, MINI_VOCAB)
        masks.fill(decode_blocks(reqs))
        masks.apply(logits)
        for i, w in enumerate(walks):
            want = allowed(reference_mask(compiled, w[:3], MINI_VOCAB), MINI_VOCAB)
            assert torch.equal(logits[i] != float("-inf"), want), i
    finally:
        masks.close()


class _Broken(xgr.BatchGrammarMatcher):
    """A batch matcher whose fills fail, as a fault inside xgrammar would."""

    def batch_fill_next_token_bitmask(self, *args, **kwargs) -> None:
        raise MemoryError("no memory for the masks")


def test_a_failed_fill_is_an_error_and_the_next_pass_starts_another_thread(monkeypatch) -> None:
    c = compiler("mini")
    req = Request("r", [1, 2], SamplingParams(), text=None)  # type: ignore[arg-type]
    req.grammar = c.state(JSON_OBJECT)
    masks = GrammarMasks(MINI_VOCAB, torch.device("cpu"), max_rows=4, threads=1)
    try:
        with monkeypatch.context() as m:
            m.setattr(mask_filler.xgr, "BatchGrammarMatcher", _Broken)
            masks.fill(decode_blocks([req]))
            with pytest.raises(RuntimeError, match=r"filling grammar masks failed.*no memory"):
                masks.apply(torch.zeros(1, MINI_VOCAB))
        assert not masks.started
        masks.fill(decode_blocks([req]))
        logits = torch.zeros(1, MINI_VOCAB)
        masks.apply(logits)
        want = allowed(reference_mask(c.compile(JSON_OBJECT), [], MINI_VOCAB), MINI_VOCAB)
        assert torch.equal(logits[0] != float("-inf"), want)
    finally:
        masks.close()


def test_closing_ends_the_thread() -> None:
    c = compiler("mini")
    req = Request("r", [1, 2], SamplingParams(), text=None)  # type: ignore[arg-type]
    req.grammar = c.state(JSON_OBJECT)
    masks = GrammarMasks(MINI_VOCAB, torch.device("cpu"), max_rows=4, threads=1)
    before = set(threading.enumerate())
    masks.fill(decode_blocks([req]))
    masks.apply(torch.zeros(1, MINI_VOCAB))
    started = [t for t in threading.enumerate() if t not in before]
    assert [t.name for t in started] == ["grammar-masks"]
    masks.close()
    assert not masks.started and not started[0].is_alive()


def test_a_host_fills_on_a_thread_per_four_cores_up_to_four() -> None:
    assert [default_threads(n) for n in (1, 2, 4, 7, 8, 16, 64)] == [1, 1, 1, 1, 2, 4, 4]
    with pytest.raises(ValueError, match="at least one thread"):
        GrammarMasks(MINI_VOCAB, torch.device("cpu"), max_rows=4, threads=0)


def test_accept_each_advances_as_one_by_one() -> None:
    """One call over a step's requests: each constrained one advanced as its own ``accept``
    would (walks of several grammars, a stop token terminating one), a rejected
    token leaving its state as it was, an unconstrained request (None) untouched."""
    c = compiler("mini")
    names = ["json_object", "json_schema", "any_text", "dsml"]
    walks = [
        random_walk(c.compile(GRAMMARS[n]), 12, MINI_VOCAB, MINI_EOS, seed=i)
        for i, n in enumerate(names)
    ]
    batch = [c.state(GRAMMARS[n]) for n in names]
    alone = [c.state(GRAMMARS[n]) for n in names]
    for step in range(min(len(w) for w in walks)):
        tokens = [w[step] for w in walks]
        assert GrammarState.accept_each([*batch, None], [*tokens, 5]) == [True] * 4 + [False]
        for st, t in zip(alone, tokens, strict=True):
            assert st.accept(t)
        assert [st.tokens for st in batch] == [st.tokens for st in alone]
    # a token the grammar forbids: nothing changes
    st = c.state(JSON_OBJECT)
    mask = xgr.allocate_token_bitmask(1, MINI_VOCAB)
    st.matcher.fill_next_token_bitmask(mask)
    banned = int((~allowed(mask[0], MINI_VOCAB)).nonzero()[0, 0])
    assert GrammarState.accept_each([st], [banned]) == [False] and st.tokens == []
    # the stop token after a complete output terminates the grammar
    done = c.state(ANY_TEXT)
    assert GrammarState.accept_each([done], [MINI_EOS[0]]) == [True] and done.terminated

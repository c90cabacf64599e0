"""Compiling requests' grammars (structured output, tool calls) for one worker's tokenizer, with
a cache of compiled grammars keyed by the grammar (its kind and spec)."""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from collections.abc import Collection, Sequence

import xgrammar as xgr

from dhisparse.tokenizer import Tokenizer
from services.worker.request.grammar_specs import grammar_of
from services.worker.request.grammar_state import GrammarState
from services.worker.request.grammar_vocab import tokenizer_info
from services.worker.request.request import Grammar, SamplingParams

# xgrammar's errors begin with a time, a source location and the check that failed
_XGR_PREFIX = re.compile(r"^\[[^\]]*\] \S+:\d+: (Check failed: .*? is false: )?", re.DOTALL)


class GrammarCompiler:
    """Compiles grammars against one tokenizer (built on first use), thread-safe: the front
    compiles a request's grammar when it validates it, the engine thread finds it cached.

    The kinds and what is built of them: ``grammar_specs`` (a ``json_schema`` is OpenAI's
    strict structured output: properties and items outside the schema are not allowed)."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        vocab_size: int,
        stop_token_ids: Collection[int],
        cache_size: int = 256,
    ) -> None:
        """``vocab_size``: the model's logits width; ``stop_token_ids``: the tokens that end a
        request (the engine's EOS ids), the only ones a complete grammar allows."""
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = frozenset(stop_token_ids)
        self.cache_size = cache_size
        self._compiler: xgr.GrammarCompiler | None = None
        self._cache: OrderedDict[Grammar, xgr.CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()

    def check(self, params: SamplingParams) -> None:
        """Raises ValueError (a client error) when ``params`` carry a grammar that does not
        compile, or one with ``min_tokens``: the grammar alone decides where the output ends."""
        if params.grammar is None:
            return
        if params.min_tokens > 0:
            raise ValueError("min_tokens cannot be combined with a grammar")
        self.compile(params.grammar)

    def compile(self, grammar: Grammar) -> xgr.CompiledGrammar:
        """The compiled grammar (cached); raises ValueError with xgrammar's reason for a spec
        that is not valid."""
        with self._lock:
            hit = self._cache.get(grammar)
            if hit is not None:
                self._cache.move_to_end(grammar)
                return hit
        compiled = self._compile(grammar)
        with self._lock:
            self._cache[grammar] = compiled
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return compiled

    def state(self, grammar: Grammar, output_ids: Sequence[int] = ()) -> GrammarState:
        """A fresh matcher for one request, advanced past ``output_ids`` (a resumed request's
        emitted tokens); raises ValueError when the grammar rejects them."""
        st = GrammarState(self.compile(grammar), repr(grammar))
        for i, token in enumerate(output_ids):
            if not st.accept(token):
                raise ValueError(f"output token {i} ({token}) breaks the request's grammar")
        return st

    def _compile(self, grammar: Grammar) -> xgr.CompiledGrammar:
        try:
            return self._xgr_compiler().compile_grammar(grammar_of(grammar))
        except RuntimeError as e:
            reason = _XGR_PREFIX.sub("", str(e).strip())
            raise ValueError(f"invalid {grammar.kind}: {reason}") from None

    def _xgr_compiler(self) -> xgr.GrammarCompiler:
        with self._lock:
            if self._compiler is None:
                info = tokenizer_info(self.tokenizer, self.vocab_size, self.stop_token_ids)
                # the cache above is the one that counts; xgrammar's would hold a second copy
                self._compiler = xgr.GrammarCompiler(info, cache_enabled=False)
            return self._compiler

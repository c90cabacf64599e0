"""One request's place in its grammar: the tokens it has emitted (a wrapper of
``xgrammar.GrammarMatcher``). The masks of its next rows are filled from this matcher by the
mask filler's thread, which holds it while a fill is queued or running (``grammar_masks``)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import xgrammar as xgr

_ids = itertools.count()


class GrammarState:
    """The grammar matcher of one request, advanced by every token it emits. Once the grammar
    is complete only the stop tokens are allowed; accepting one terminates it."""

    def __init__(self, compiled: xgr.CompiledGrammar, key: str) -> None:
        """``key``: the grammar's identity (equal keys: equal compiled grammars)."""
        self.matcher = xgr.GrammarMatcher(compiled)
        self.compiled = compiled
        self.key = key
        self.id = next(_ids)  # unique in the process
        self.tokens: list[int] = []  # every token accepted
        self._stops = frozenset(compiled.tokenizer_info.stop_token_ids)
        # a stop token was accepted: the output is complete (only a stop token ends it)
        self.terminated = False

    def accept(self, token: int) -> bool:
        """Advances past an emitted token; False (nothing changed) when the grammar rejects
        it."""
        if not self.matcher.accept_token(token):
            return False
        self.took(token)
        return True

    def took(self, token: int) -> None:
        """Records ``token``, which its matcher has accepted."""
        self.tokens.append(token)
        if token in self._stops:
            self.terminated = self.matcher.is_terminated()

    @staticmethod
    def accept_each(states: Sequence[GrammarState | None], tokens: Sequence[int]) -> list[bool]:
        """Advances every state past its token; True where it did, False where the state is
        None or its grammar rejects the token (that one unchanged). One matcher at a time:
        xgrammar's batch call (``BatchGrammarMatcher.batch_accept_token``) takes longer for a
        step's requests than their accepts one by one (``bench grammar-host``)."""
        return [st is not None and st.accept(t) for st, t in zip(states, tokens, strict=True)]

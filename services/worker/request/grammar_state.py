"""One request's place in its grammar: the tokens it has emitted (a wrapper of
``xgrammar.GrammarMatcher``). The masks of its next rows are filled with every other
constrained request's of the same pass (``grammar_masks``)."""

from __future__ import annotations

import xgrammar as xgr


class GrammarState:
    """The grammar matcher of one request, advanced by every token it emits. Once the grammar
    is complete only the stop tokens are allowed; accepting one terminates it."""

    def __init__(self, compiled: xgr.CompiledGrammar) -> None:
        self.matcher = xgr.GrammarMatcher(compiled)

    @property
    def terminated(self) -> bool:
        """A stop token was accepted: the output is complete."""
        return self.matcher.is_terminated()

    def accept(self, token: int) -> bool:
        """Advances past an emitted token; False (nothing changed) when the grammar rejects
        it."""
        return self.matcher.accept_token(token)

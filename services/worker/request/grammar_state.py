"""One request's place in its grammar: the token masks of its next rows and the tokens it has
emitted (a wrapper of ``xgrammar.GrammarMatcher``)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import xgrammar as xgr


class GrammarState:
    """The grammar matcher of one request, advanced by every token it emits.

    ``apply`` masks the logits of a verify block (or of one decode row): row i may only sample
    a token that keeps ``output + drafts[:i] + token`` a prefix of the grammar's language. Once
    the grammar is complete only the stop tokens are allowed; accepting one terminates it."""

    def __init__(self, compiled: xgr.CompiledGrammar, vocab_size: int) -> None:
        """``vocab_size``: the logits' width (the compiled grammar's tokenizer info's)."""
        self.matcher = xgr.GrammarMatcher(compiled)
        self.vocab_size = vocab_size
        self._host: torch.Tensor | None = None  # [rows, words] int32 (pinned for a GPU)
        self._copied: torch.cuda.Event | None = None  # the last copy out of _host

    @property
    def terminated(self) -> bool:
        """A stop token was accepted: the output is complete."""
        return self.matcher.is_terminated()

    def accept(self, token: int) -> bool:
        """Advances past an emitted token; False (nothing changed) when the grammar rejects
        it."""
        return self.matcher.accept_token(token)

    def fill(self, rows: int, drafts: Sequence[int] = (), pinned: bool = False) -> torch.Tensor:
        """[rows, ceil(V / 32)] int32 bitmask on the host: row i is the mask after the output
        and ``drafts[:i]``. The drafts are accepted one by one while filling and rolled back
        after, so the state is unchanged. Rows after a draft the grammar rejects, or after one
        that terminates it, allow everything: a verification that reaches them has accepted
        that draft, which the mask of its own row forbids (or the output ended at it)."""
        if len(drafts) < rows - 1:
            raise ValueError(f"{rows} rows need {rows - 1} drafts, given {len(drafts)}")
        mask = self._buffer(rows, pinned)
        mask.fill_(-1)
        m = self.matcher
        accepted = 0
        for i in range(rows):
            if m.is_terminated():
                break
            m.fill_next_token_bitmask(mask, i)
            if i == rows - 1 or not m.accept_token(drafts[i]):
                break
            accepted += 1
        if accepted:
            m.rollback(accepted)
        return mask

    def apply(self, logits: torch.Tensor, drafts: Sequence[int] = ()) -> None:
        """logits: [n, V] fp32 for the request's next n tokens, row i after ``drafts[:i]``
        (n - 1 drafts at least; later ones are ignored): every token the grammar forbids there
        is set to -inf, in place, on the logits' device. A mask for a GPU is filled in pinned
        memory and copied without blocking."""
        if logits.shape[-1] != self.vocab_size:
            raise ValueError(f"logits of {logits.shape[-1]} tokens, masks of {self.vocab_size}")
        cuda = logits.is_cuda
        mask = self.fill(logits.shape[0], drafts, pinned=cuda)
        if cuda:
            mask = mask.to(logits.device, non_blocking=True)
            self._copied = torch.cuda.Event()
            self._copied.record()
        xgr.apply_token_bitmask_inplace(logits, mask)

    def _buffer(self, rows: int, pinned: bool) -> torch.Tensor:
        """Rows of the host bitmask, once the last copy out of it has been read."""
        if self._copied is not None:
            self._copied.synchronize()
            self._copied = None
        host = self._host
        if host is None or host.shape[0] < rows or host.is_pinned() != pinned:
            words = xgr.get_bitmask_shape(rows, self.vocab_size)[1]
            host = torch.empty((rows, words), dtype=torch.int32, pin_memory=pinned)
            self._host = host
        return host[:rows]

"""Structured outputs' share of scheduling, a policy object of the scheduler
(core/scheduler.py). The grammar state itself (the matchers, their bitmasks) travels beside
the scheduler's output, not inside it (structured_output/manager.py fills the masks).

A request with a grammar matcher (`Request.grammar`) has it advanced on every token the
scheduler appends; a token it refuses ends the request with finish reason "error" (a dead
end). Drafts are cut at the first token the grammar refuses. Jump-forward: after a step, the
tokens the grammar forces next are appended at once, so the next step computes them as one
chunk instead of one step each, and samples after them. A constrained request is not
scheduled ahead of its sampled token (async scheduling): its matcher needs the token first,
unless the mask after any token is known already (a thinking budget far from spent:
GrammarMatcher.decided_ahead).

Invariant: without a grammar every method is a no-op (nothing cut, refused or forced).
"""

from __future__ import annotations

from collections.abc import Callable

from tokenmill.core.request import Request, RequestStatus


class GrammarPolicy:
    def __init__(self, jump_forward: bool = True) -> None:
        self.jump_forward = jump_forward
        self.num_jump_forward_tokens = 0  # tokens a grammar forced, appended without a step

    @staticmethod
    def needs_token_first(request: Request) -> bool:
        """Whether the request must not be scheduled while a sampled token is in flight."""
        return request.grammar is not None and not request.grammar.decided_ahead()

    @staticmethod
    def cut(request: Request, drafts: list[int]) -> list[int]:
        """The drafts up to the first one the grammar refuses."""
        if request.grammar is None or not drafts:
            return drafts
        return drafts[:request.grammar.validate(drafts)]

    @staticmethod
    def accept(request: Request, token_id: int) -> RequestStatus | None:
        """Advance the grammar past an appended token: FINISHED_ERROR if it refuses it."""
        if request.grammar is None or request.grammar.accept(token_id):
            return None
        request.stop_reason = ("grammar dead end: "
                               f"{request.grammar.error() or f'token {token_id} refused'}")
        return RequestStatus.FINISHED_ERROR

    def jump(self, request: Request, tokens_left: int,
             append: Callable[[Request, int], RequestStatus | None]) -> RequestStatus | None:
        """Append (through `append`) the tokens the request's grammar forces next, at most
        `tokens_left` (none for a request that asked for logprobs: forced tokens have none);
        the status they finish it with, or None."""
        if (request.grammar is None or not self.jump_forward
                or request.sampling_params.logprobs is not None):
            return None
        for token_id in request.grammar.forced_tokens()[:tokens_left]:
            self.num_jump_forward_tokens += 1
            if (status := append(request, token_id)) is not None:
                return status
        return None

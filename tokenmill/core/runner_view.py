"""RunnerView: what the model runner holds of each request, as the scheduler last sent it.

The scheduler asks `diff(request, block_ids)` for every request it schedules and puts the answer
in the step's `SchedulerOutput`: `NewRequestData` for a request the runner does not hold,
`CachedRequestData` with only what changed since the last send, or None when nothing did (a
decode step inside a block, after the runner was told of the last token).

Invariant: an entry exists exactly while the runner holds the request; `forget` is called when
the request finishes or is preempted (the runner drops it on the same step's
`finished_req_ids` / `preempted_req_ids`).
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenmill.core.interface import CachedRequestData, NewRequestData
from tokenmill.core.request import Request


@dataclass
class _Sent:
    num_tokens: int  # prompt + outputs the runner has
    block_ids: list[int]  # a copy of the table it has


class RunnerView:
    def __init__(self) -> None:
        self._sent: dict[str, _Sent] = {}

    def diff(self, request: Request, block_ids: list[int]
             ) -> NewRequestData | CachedRequestData | None:
        """What the runner must be told of `request` (block_ids: its table now), recorded as
        sent."""
        rid = request.request_id
        sent = self._sent.get(rid)
        if sent is None:
            self._sent[rid] = _Sent(request.num_tokens, block_ids)
            return NewRequestData(rid, list(request.prompt_token_ids),
                                  list(request.output_token_ids), request.sampling_params,
                                  list(block_ids), request.lora)
        token_start = sent.num_tokens
        block_start = _first_difference(sent.block_ids, block_ids)
        if token_start == request.num_tokens and block_start == len(block_ids) == \
                len(sent.block_ids):
            return None
        sent.num_tokens, sent.block_ids = request.num_tokens, block_ids
        return CachedRequestData(rid, token_start, request.all_token_ids[token_start:],
                                 block_start, block_ids[block_start:])

    def forget(self, request_id: str) -> None:
        self._sent.pop(request_id, None)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._sent


def _first_difference(old: list[int], new: list[int]) -> int:
    """The first index where the two tables differ (the shorter length when one extends the
    other). Tables are mostly appended to, which the slice comparison confirms at C speed."""
    n = min(len(old), len(new))
    if old[:n] == new[:n]:
        return n
    return next(i for i in range(n) if old[i] != new[i])

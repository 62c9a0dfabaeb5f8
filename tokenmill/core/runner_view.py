"""RunnerView: what the model runner holds of each request, as the scheduler last sent it.

The scheduler asks `diff(request, kv)` for every request it schedules and puts the answer in
the step's `SchedulerOutput`: `NewRequestData` for a request the runner does not hold,
`CachedRequestData` with only what changed since the last send, or None when nothing did (a
decode step inside a block, after the runner was told of the last token).

A table is compared whole with the one sent only when the KV manager says it was rewritten
(KVCacheManager.pop_rewritten: copy on write, a sliding window's null blocks); otherwise it
has only grown, and its new entries are read alone, so a step's diffs cost O(new blocks), not
O(every block of every running request).

Invariant: an entry exists exactly while the runner holds the request; `forget` is called when
the request finishes or is preempted (the runner drops it on the same step's
`finished_req_ids` / `preempted_req_ids`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from tokenmill.core.interface import CachedRequestData, NewRequestData
from tokenmill.core.request import Request

if TYPE_CHECKING:
    from tokenmill.core.kv_cache_manager import KVCacheManager


@dataclass
class _Sent:
    num_tokens: int  # prompt + outputs the runner has
    block_ids: list[int]  # a copy of the table it has


class RunnerView:
    def __init__(self) -> None:
        self._sent: dict[str, _Sent] = {}

    def diff(self, request: Request, kv: KVCacheManager
             ) -> NewRequestData | CachedRequestData | None:
        """What the runner must be told of `request` (its table in `kv`), recorded as sent."""
        rid = request.request_id
        rewritten = kv.pop_rewritten(rid)  # (taken for a new request too: it is sent whole)
        sent = self._sent.get(rid)
        if sent is None:
            block_ids = kv.get_block_ids(rid)
            self._sent[rid] = _Sent(request.num_tokens, block_ids)
            return NewRequestData(rid, list(request.prompt_token_ids),
                                  list(request.output_token_ids), request.sampling_params,
                                  list(block_ids), request.lora)
        token_start = sent.num_tokens
        if rewritten:
            block_ids = kv.get_block_ids(rid)
            block_start = _first_difference(sent.block_ids, block_ids)
            changed = block_start != len(block_ids) or len(block_ids) != len(sent.block_ids)
            new_block_ids = block_ids[block_start:]
            sent.block_ids = block_ids
        else:  # only appended to
            block_start = len(sent.block_ids)
            changed = kv.num_table_blocks(rid) > block_start
            new_block_ids = kv.get_block_ids(rid, block_start) if changed else []
            sent.block_ids += new_block_ids
        if token_start == request.num_tokens and not changed:
            return None
        sent.num_tokens = request.num_tokens
        return CachedRequestData(rid, token_start, request.all_token_ids[token_start:],
                                 block_start, new_block_ids)

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

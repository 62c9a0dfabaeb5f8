"""Token-level stop checks, run after each sampled token: a completed grammar (structured
outputs), EOS, stop token ids, length limits.

String stops need detokenized text and live with the detokenizer in the engine.
"""

from __future__ import annotations

from tokenmill.core.request import Request, RequestStatus


def check_stop(request: Request, max_model_len: int) -> RequestStatus | None:
    """The finished status the request's newest token puts it in, or None to keep going.

    Sets `request.stop_reason` to the stop token id when a `stop_token_ids` entry matched.
    """
    last = request.output_token_ids[-1]
    params = request.sampling_params
    if request.grammar is not None and request.grammar.is_terminated():
        return RequestStatus.FINISHED_STOPPED  # nothing may follow (not even min_tokens)
    if request.num_output_tokens < params.min_tokens:
        return None  # the sampler bans EOS and stop ids until then; max_tokens >= min_tokens
    if not params.ignore_eos and last in request.eos_token_ids:
        return RequestStatus.FINISHED_STOPPED
    if last in params.stop_token_ids:
        request.stop_reason = last
        return RequestStatus.FINISHED_STOPPED
    if request.num_output_tokens >= request.max_tokens or request.num_tokens >= max_model_len:
        return RequestStatus.FINISHED_LENGTH
    return None

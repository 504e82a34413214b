"""The `usage` of a completion's answer, and who sees its `prompt_tokens_details.cached_tokens`.

A count of cached tokens tells a caller how much of its prompt the cache held: send a guessed
prompt, read the count, and learn, block by block, what someone else sent (prompt-cache probing;
CVE-2025-46570 for timing alone, which gives far less). Tenants never share blocks unless told
to, so only callers of one tenant can probe each other; `report_cached_tokens: admin` keeps the
count from callers without the admin role where those callers do not trust each other (one
tenant's token shared by a public app's users). Timing stays: a prefix hit is faster.
"""

from __future__ import annotations

from .cache_breakpoints import written

# kvd router forwards completions as an admin; this header carries its caller's role, so a
# replica reports to a user behind the router as it would to the user itself. It can only take
# away: an admin role is never read from it.
CALLER_ROLE_HEADER = "X-KVD-Caller-Role"


def shows_cached_tokens(setting: str, role: str, passed_role: str | None = None) -> bool:
    """Whether a caller of `role` sees cached_tokens under `report_cached_tokens: setting`;
    `passed_role`: the CALLER_ROLE_HEADER's value, when the request came through kvd router."""
    if setting == "all":
        return True
    return setting == "admin" and role == "admin" and passed_role in (None, "admin")


def usage(requests, counted: bool = True, cached: bool = True) -> dict:
    """OpenAI's usage of these requests. `counted`: False where the answer shows no output token
    (echo with max_tokens 0). `cached`: with prompt_tokens_details.cached_tokens (else without
    prompt_tokens_details, as vLLM answers unless asked). Requests with a prediction (Predicted
    Outputs) add completion_tokens_details: its drafted tokens kept and not kept."""
    prompt = sum(len(r.prompt_ids) for r in requests)
    completion = sum(len(s.output_ids) for r in requests for s in r.sequences) if counted else 0
    out = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
    if cached:
        out["prompt_tokens_details"] = {"cached_tokens": sum(r.metrics.cached_tokens for r in requests)}
        if any(r.params.extra.get("breakpoints") for r in requests):  # (cache_breakpoints.py)
            out["prompt_tokens_details"].update(written([w for r in requests for w in r.metrics.cache_written or ()]))
    if any(r.params.prediction for r in requests):  # OpenAI's Predicted Outputs: the drafts of its prediction
        kept = sum(r.metrics.kept_predicted_tokens for r in requests)
        out["completion_tokens_details"] = {
            "accepted_prediction_tokens": kept,
            "rejected_prediction_tokens": sum(r.metrics.predicted_tokens for r in requests) - kept}
    return out

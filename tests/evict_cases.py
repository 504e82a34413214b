"""What the eviction tests share: a kvd of their own, and prompts of two conversations that start
with one system prompt, in token ids (so that block counts are exact)."""

from __future__ import annotations

from contextlib import contextmanager

from .daemon_fixtures import apps, call, start_service, token_table

BLOCK = 16
SYSTEM = [(7 * i + 3) % 200 + 20 for i in range(3 * BLOCK)]  # three blocks every conversation starts with
ASK_A = SYSTEM + [(11 * i + 5) % 200 + 20 for i in range(2 * BLOCK + 8)]
ASK_B = SYSTEM + [(13 * i + 1) % 200 + 20 for i in range(2 * BLOCK + 8)]


@contextmanager
def serving(tmp_path, **settings):
    """(the service, its Unix-socket app), blocks of BLOCK tokens; stopped after."""
    service = start_service(tmp_path, block_size=BLOCK, **settings)
    try:
        yield service, apps(service, token_table(tmp_path))[0]
    finally:
        service.shutdown(1)


def ask(app, tokens, tenant: str | None = None) -> dict:
    """A completion of 20 tokens, greedy, as `tenant`."""
    headers = {"X-KVD-Tenant": tenant} if tenant else {}
    answer = call(app, "POST", "/v1/completions", headers=headers, json={
        "prompt": tokens, "max_tokens": 20, "temperature": 0, "ignore_eos": True})
    assert answer.status_code == 200, answer.text
    return answer.json()

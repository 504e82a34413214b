"""Output tokens' logprobs in the two shapes OpenAI's API gives them.

The engine records, for every output token of a request that asks (`Sequence.logprobs`), the
token's logprob under the model's own distribution (before temperature, penalties and bias, as
vLLM reports by default) and its most likely alternatives. Here they become:

- /v1/completions (`logprobs: N`): `{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`,
  where each `top_logprobs` entry maps token text to logprob for the N most likely tokens and
  the one drawn (a legacy shape: tokens with the same text, such as two halves of characters,
  share one key, which keeps the drawn token's logprob);
- /v1/chat/completions (`logprobs: true, top_logprobs: N`): `{"content": [{"token", "logprob",
  "bytes", "top_logprobs": [N of the same]}]}`.

A token's text is `Tokenizer.token_text` (special tokens by name); its bytes are that text's UTF-8.
With vLLM's `return_tokens_as_token_ids` a token is named "token_id:N" instead (`TokenNames`), so
tokens with one text stay apart; text offsets and bytes still come from the text.
"""

from __future__ import annotations

from typing import Sequence as Seq

Entry = tuple[float, tuple[tuple[int, float], ...]]  # (logprob, ((id, logprob), ...)), best first


class TokenNames:
    """How an answer's logprobs name a token: by its text, or as "token_id:N" where the request
    asked for vLLM's `return_tokens_as_token_ids`."""

    def __init__(self, token_text, as_ids: bool = False) -> None:
        self.text, self.as_ids = token_text, as_ids

    def __call__(self, token: int) -> str:
        return f"token_id:{token}" if self.as_ids else self.text(token)


def completion_logprobs(names, token_ids: Seq[int], entries: Seq[Entry], offset: int = 0) -> tuple[dict, int]:
    """The legacy completions shape for these tokens (named by `names`, a TokenNames), their text
    offsets counted from `offset`; and the offset after them (a stream's next chunk goes on from
    there)."""
    tokens, chosen, tops, offsets = [], [], [], []
    for token, (logprob, top) in zip(token_ids, entries):
        name = names(token)
        tokens.append(name)
        chosen.append(logprob)
        alternatives = {}
        for alternative, value in top:
            alternatives.setdefault(names(alternative), value)
        alternatives[name] = logprob  # tokens with one name share a key: the drawn one's logprob stands
        tops.append(alternatives)
        offsets.append(offset)
        offset += len(names.text(token))
    return {"tokens": tokens, "token_logprobs": chosen, "top_logprobs": tops, "text_offset": offsets}, offset


def chat_logprobs(names, token_ids: Seq[int], entries: Seq[Entry]) -> dict:
    """The chat shape for these tokens (named by `names`, a TokenNames; bytes of their text)."""
    def described(token: int, logprob: float) -> dict:
        return {"token": names(token), "logprob": logprob, "bytes": list(names.text(token).encode("utf-8"))}

    return {"content": [{**described(token, logprob), "top_logprobs": [described(t, v) for t, v in top]}
                        for token, (logprob, top) in zip(token_ids, entries)]}


def echoed_prompt_logprobs(names, prompt_ids: Seq[int], entries: Seq, alternatives: int) -> tuple[dict, int]:
    """The prompt's part of an `echo` answer's completion logprobs: the first token has none (null,
    as in OpenAI's API), the rest their logprob and `alternatives` most likely tokens."""
    first = names(prompt_ids[0])
    rest, offset = completion_logprobs(names, prompt_ids[1:],
                                       [(logprob, top[:alternatives]) for logprob, _, top in entries],
                                       len(names.text(prompt_ids[0])))
    return {"tokens": [first] + rest["tokens"], "token_logprobs": [None] + rest["token_logprobs"],
            "top_logprobs": [None] + rest["top_logprobs"], "text_offset": [0] + rest["text_offset"]}, offset


def joined(first: dict, then: dict) -> dict:
    """Two completion logprobs parts, one after the other."""
    return {key: first[key] + then[key] for key in first}


def vllm_prompt_logprobs(token_text, prompt_ids: Seq[int], entries: Seq, alternatives: int) -> list:
    """vLLM's `prompt_logprobs`: null for the first token, then for each token a map from token id
    to {logprob, rank, decoded_token} holding the token itself and the `alternatives` most likely."""
    out: list = [None]
    for token, (logprob, rank, top) in zip(prompt_ids[1:], entries):
        described = {str(token): {"logprob": logprob, "rank": rank, "decoded_token": token_text(token)}}
        for i, (t, value) in enumerate(top[:alternatives]):
            described.setdefault(str(t), {"logprob": value, "rank": i + 1, "decoded_token": token_text(t)})
        out.append(described)
    return out


def echo_texts(prompt, prompts: list[list[int]], tokenizer) -> list[str]:
    """Each prompt as completions' `echo` gives it back: the text sent, or the ids decoded."""
    if isinstance(prompt, str):
        return [prompt]
    if prompt and all(isinstance(p, str) for p in prompt):
        return list(prompt)
    return [tokenizer.decode(ids) for ids in prompts]


class PromptParts:
    """What an answer carries from its prompt: the echoed text and its tokens' logprobs
    (completions' `echo`), and vLLM's `prompt_logprobs` and `prompt_token_ids` (`ids`: asked for by
    `return_token_ids`), on each choice (`on="choice"`, completions) or on the answer (`on="answer"`,
    chats), as vLLM places them; streamed, in each choice's first chunk."""

    def __init__(self, names: TokenNames, params, prompt_logprobs: int | None, echoed: list[str] | None,
                 on: str, prompt_only: bool = False, ids: bool = False) -> None:
        self.names, self.params, self.wanted, self.echoed, self.on = names, params, prompt_logprobs, echoed, on
        self.ids = ids
        # echo with max_tokens 0 (an evaluation harness scoring a prompt): the answer is the prompt and
        # its logprobs alone; the one token the engine samples to get there is not shown or counted
        self.prompt_only = prompt_only
        self._answered = False

    def text(self, prompt: int) -> str:
        return "" if self.echoed is None else self.echoed[prompt]

    def logprobs(self, prompt: int, request) -> tuple[dict | None, int]:
        """The echoed prompt's completion logprobs (None without echo), and the offset after them."""
        if self.echoed is None:
            return None, 0
        return echoed_prompt_logprobs(self.names, request.prompt_ids, request.prompt_logprobs,
                                      self.params.logprobs or 0)

    def _vllm(self, request) -> list:
        return vllm_prompt_logprobs(self.names.text, request.prompt_ids, request.prompt_logprobs, self.wanted)

    def _add(self, into: dict, request) -> None:
        if self.wanted is not None:
            into["prompt_logprobs"] = self._vllm(request)
        if self.ids:
            into["prompt_token_ids"] = list(request.prompt_ids)

    def add_to_choice(self, choice: dict, request) -> dict:
        if self.on == "choice":
            self._add(choice, request)
        return choice

    def add_to_answer(self, answer: dict, request, once: bool = False) -> dict:
        """`once`: a stream's chunks carry them in the first only."""
        if self.on == "answer" and not (once and self._answered):
            self._add(answer, request)
            self._answered = True
        return answer

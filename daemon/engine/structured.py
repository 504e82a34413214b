"""Structured outputs: a reply held to a JSON Schema, a regular expression or a list of choices.

A request names the shape (`daemon/server/response_format.py` reads OpenAI's `response_format` and
vLLM's `guided_*` fields); it becomes one `Constraint`, an llguidance grammar that the engine
checks when the request is submitted and then follows token by token. Before each draw, the
tokens that cannot continue the grammar get -inf (after penalties and biases; temperature, top-k
and top-p then apply to what is left), so greedy and sampled replies alike stay inside it, and a
sample ends ("stop") as soon as the grammar can go no further, without spending a step on EOS. A
reply cut off by max_tokens ends where it was, as OpenAI's does ("length"). With a reasoning model
(`Constraint.after`, set where kvd splits thinking from the answer) the shape holds the answer
only: the model thinks freely and the grammar starts after `</think>`, as vLLM's reasoning-aware
structured outputs do; where the reply may first open the block (`opens`, Qwen3), its first tokens
may be those of `<think>` or the shape's. A grammar that fails
part-way (llguidance's limits on the work one step may take) ends its sample with "error", never
with a "stop" that would pass an unfinished shape off as a whole one.

llguidance (the grammar engine vLLM and SGLang offer) computes a step's mask from the tokenizer's
vocabulary in tens of microseconds, with limits on how much work a grammar may ask for, so a
caller's schema cannot stall the engine thread. It is imported only when a request asks for a
shape.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass

import numpy
import torch

from .sampling import RequestError


# GBNF is turned into Lark by llguidance's converter, in Python, at about 1.4 µs a character on a CPU
# core: a grammar is capped so that a request's body (32 MiB by default) cannot hold a thread for a minute
MAX_GRAMMAR_CHARS = 65_536
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class Constraint:
    """A reply's shape: llguidance's grammar text, and the request field it came from (errors
    name it)."""

    field: str
    grammar: str
    after: str | None = None  # the shape starts after this text (a thinking block's end), not at once
    opens: str | None = None  # with `after`: the reply may first open the block so (else it starts inside)

    @classmethod
    def json_schema(cls, schema: dict, field: str) -> "Constraint":
        """JSON that the schema accepts, written as `json.dumps` writes it (", " and ": ", no other
        whitespace) unless the schema's own `x-guidance` options say otherwise: a grammar that
        allows whitespace anywhere lets a model loop on newlines until max_tokens (vLLM's
        --structured-outputs-config disable_any_whitespace is the cure there)."""
        from llguidance import LLMatcher

        return cls(field, LLMatcher.grammar_from_json_schema(schema, defaults=JSON_LAYOUT))

    @classmethod
    def regex(cls, pattern: str, field: str) -> "Constraint":
        from llguidance import LLMatcher

        return cls(field, LLMatcher.grammar_from_regex(pattern))

    @classmethod
    def lark(cls, grammar: str, field: str) -> "Constraint":
        """A Lark grammar (llguidance's dialect: `%json {schema}` embeds a JSON Schema)."""
        from llguidance import LLMatcher

        return cls(field, LLMatcher.grammar_from_lark(grammar))

    @classmethod
    def grammar_text(cls, grammar: str, field: str) -> "Constraint":
        """A context-free grammar as vLLM's `guided_grammar` takes it: GBNF (llama.cpp's EBNF, with a
        `root ::=` rule, as vLLM's xgrammar backend reads it) or Lark (a `start:` rule, as its guidance
        backend reads it), told apart as llguidance tells them. ValueError where GBNF does not parse."""
        from llguidance import LLMatcher
        from llguidance.gbnf_to_lark import any_to_lark

        if len(grammar) > MAX_GRAMMAR_CHARS:
            raise ValueError(f"{len(grammar):,} characters; kvd takes grammars of up to {MAX_GRAMMAR_CHARS:,}")
        try:
            lark = any_to_lark(grammar)
        except Exception as exc:  # the converter's errors: GbnfToLarkError, ValueError, RecursionError
            raise ValueError(f"read as GBNF (a Lark grammar has a start: rule): {exc}") from None
        return cls(field, LLMatcher.grammar_from_lark(lark))

    @classmethod
    def structural_tags(cls, tags: list[tuple[str, str, dict, str]], field: str) -> "Constraint":
        """Free text in which each (trigger, begin, schema, end) holds what follows its trigger: once
        the reply writes `trigger`, it goes on with the rest of `begin`, JSON that `schema` accepts
        (laid out as json_schema lays it out, unless the schema's `x-guidance` says otherwise) and
        `end`, then free text again (vLLM's structural tags). Triggers are matched as text: kvd's
        replies leave special tokens out, so a tag a client is to find must be written as text."""
        from llguidance import LLMatcher, StructTag

        built = [StructTag(trigger=trigger, begin=begin, end=end,
                           grammar=schema if "x-guidance" in schema else {**schema, "x-guidance": JSON_LAYOUT})
                 for trigger, begin, schema, end in tags]
        return cls(field, LLMatcher.grammar_from_lark(StructTag.to_grammar(built, assume_special=False)))

    def problem(self) -> str:
        """What is wrong with the grammar, read without a vocabulary ("" where nothing is found; a
        vocabulary's check finds more, such as no reply fitting it)."""
        from llguidance import LLMatcher

        return first_line(LLMatcher.validate_grammar(self.grammar))

    @classmethod
    def choice(cls, choices: list[str], field: str) -> "Constraint":
        """Exactly one of `choices`, as written (vLLM's guided_choice)."""
        from llguidance import LLMatcher

        return cls(field, LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices)))


class GrammarVocabulary:
    """The model's vocabulary as llguidance reads it: built once per loaded model, on the first
    request that asks for a shape (a large vocabulary takes about a second).

    Each sample compiles its grammar afresh (as vLLM does): copies of one compiled matcher share
    its lexer's cache and the limit on it, so a grammar cached for reuse would let one request's
    work use up the next one's budget. A request's samples are compiled when it is checked
    (`prepare`, in its submitter's thread; llguidance lets go of the GIL while it compiles), so the
    engine's step, which every running sequence waits for, compiles none."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_ids, token_text=None, encode=None) -> None:
        self.tokenizer_json, self.vocab_size, self.eos_ids = tokenizer_json, vocab_size, sorted(eos_ids)
        self._built = None
        # the first shaped requests may be checked in several threads at once: one builds, the others wait
        # for it (each building its own cost a second of CPU and 75 MiB for a 128,000-token vocabulary)
        self._building = threading.Lock()
        # the model tokenizer's, for a shape that starts after a thinking block (Constraint.after)
        self.token_text, self.encode = token_text, encode
        self._openers: dict[str, torch.Tensor] = {}

    @property
    def built(self):
        """llguidance's index of the vocabulary, built once."""
        if self._built is None:
            with self._building:
                if self._built is None:
                    from llguidance import LLTokenizer

                    self._built = LLTokenizer(self.tokenizer_json, n_vocab=self.vocab_size,
                                              eos_token=self.eos_ids or None)
        return self._built

    def prepare(self, constraint: Constraint, samples: int) -> list["GrammarState"]:
        """`check`, then a start in the grammar for each of a request's `samples`, each of its own."""
        first = GrammarState(self, self.check(constraint), constraint)
        return [first] + [self.follow(constraint) for _ in range(samples - 1)]

    def check(self, constraint: Constraint):
        """RequestError naming the field when the grammar cannot be followed, or no reply fits it
        (a schema that only refers to itself, say); else the matcher that checked it, at the
        grammar's start, for a sample to follow. One compile: a matcher whose grammar does not
        build starts in error, with the message llguidance's validate_grammar would give."""
        probe = self._start(constraint)
        if probe.is_error():
            lines = [line.strip() for line in probe.get_error().strip().splitlines()]
            why = next((line.removeprefix("error: ") for line in lines[1:] if line.startswith("error:")), "")
            raise RequestError(f"{constraint.field}: {lines[0]}" + (f" {why}" if why else ""))
        probe.compute_bitmask()
        if probe.is_error() or probe.is_stopped():
            raise RequestError(f"{constraint.field}: no reply fits this shape ({first_line(probe.get_error())})")
        if constraint.opens:
            self.learn_opening(constraint.opens)
        return probe

    def follow(self, constraint: Constraint) -> "GrammarState":
        return GrammarState(self, self._start(constraint), constraint)

    def openers(self, rest: str) -> torch.Tensor:
        """bool [vocab]: the tokens whose text goes on with `rest` (what is left of an opening such
        as `<think>`): a part of its beginning, or all of it and more. `learn_opening` finds them."""
        return self._openers[rest]

    def learn_opening(self, opening: str) -> None:
        """The tokens that go on with each part of `opening` that may be left, in one pass over the
        vocabulary (0.18 s for a 128,000-token one on a 2-core CPU): done when a request is
        checked, in its submitter's thread, not in the engine's step."""
        with self._building:  # one pass at a time: two threads checking their first requests do it once
            self._learn_opening(opening)

    def _learn_opening(self, opening: str) -> None:
        rests = [opening[i:] for i in range(len(opening)) if opening[i:] not in self._openers]
        if not rests:
            return
        found = {rest: torch.zeros(self.vocab_size, dtype=torch.bool) for rest in rests}
        for token in range(self.vocab_size):
            text = self.token_text(token)
            if text:
                for rest, mask in found.items():
                    if rest.startswith(text) or text.startswith(rest):
                        mask[token] = True
        self._openers.update(found)

    def _start(self, constraint: Constraint):
        """A matcher at the start of the grammar, of its own."""
        from llguidance import LLMatcher

        return LLMatcher(self.built, constraint.grammar, log_level=0)


class GrammarState:
    """One sample's place in its grammar (and, with `Constraint.after`, in its thinking first:
    phase "opening" while the reply may still open the block, "thinking" inside it, "answer"
    once the grammar applies)."""

    def __init__(self, vocabulary: GrammarVocabulary, matcher, constraint: Constraint | None = None) -> None:
        self.vocabulary = vocabulary
        self.matcher = matcher  # an llguidance LLMatcher of this sample's own
        self.after = constraint.after if constraint is not None else None
        self.opens = constraint.opens if constraint is not None else None
        self.phase = "answer" if self.after is None else "opening" if self.opens else "thinking"
        self.text = ""  # the reply so far, while it is not yet the answer
        self.held: list[int] = []  # the tokens of an opening that turned out to be the answer's

    def allowed(self) -> torch.Tensor:
        """bool [vocab]: the tokens that continue the grammar now (llguidance's bitmask, a bit per
        token, lowest bit first, unpacked by numpy: a third of the time torch's shifts take)."""
        packed = numpy.frombuffer(self.matcher.compute_bitmask(), dtype=numpy.uint8)
        bits = numpy.unpackbits(packed, count=self.vocabulary.vocab_size, bitorder="little")
        return torch.from_numpy(bits.view(numpy.bool_))

    def mask(self) -> torch.Tensor | None:
        """bool [vocab] on the host: the tokens that may come next, or None where any may. The
        grammar's, and where none can continue it (a grammar in error) the EOS tokens alone, so the
        sample ends. While thinking, None; while the reply may still open its thinking, the
        grammar's or the opening's. The engine applies the masks of a step's rows together."""
        if self.phase == "thinking":
            return None
        if self.phase == "opening":
            allowed = self.vocabulary.openers(self.opens[len(self.text):]) | self._answer_after_held()
        else:
            allowed = self.allowed()
        if not bool(allowed.any()):
            if not self.vocabulary.eos_ids:
                return None
            allowed = allowed.clone()
            allowed[self.vocabulary.eos_ids] = True
        return allowed

    def masks_ahead(self, draft: list[int]) -> list[torch.Tensor | None]:
        """The masks (as `mask` gives them) of a draft's verdict rows, row i as this state would give
        it after taking the draft's first i tokens: up to the row where the verdict must end whatever
        it draws there (the grammar leaves out the draft's token, or is done or failed after it), so
        each row the verdict may reach has one. This state does not move: a copy looks ahead."""
        masks = [self.mask()]
        if not draft:
            return masks
        ahead = self.copy()
        for token in draft:
            allowed = masks[-1]
            if allowed is not None and not bool(allowed[token]):
                break  # the row cannot take the draft's token: the verdict ends there
            ahead.consume(token)
            if ahead.done or ahead.failed:
                break  # the verdict ends with that token
            masks.append(ahead.mask())
        return masks

    def copy(self) -> "GrammarState":
        """Another state at this one's place, of its own (the matcher llguidance's deep copy)."""
        twin = GrammarState.__new__(GrammarState)
        twin.__dict__.update(self.__dict__)
        twin.matcher, twin.held = self.matcher.deep_copy(), list(self.held)
        return twin

    def masked(self, scores: torch.Tensor) -> torch.Tensor:
        """`scores` [vocab] (float32, on any device) with the tokens `mask` leaves out at -inf."""
        allowed = self.mask()
        if allowed is None:
            return scores
        return torch.where(allowed.to(scores.device), scores.float(), float("-inf"))

    def _answer_after_held(self) -> torch.Tensor:
        """While the reply may still open its thinking: the tokens that would go on with the shape
        after the tokens held so far, were they the answer's (none, where the grammar refuses them)."""
        taken = self.matcher.try_consume_tokens(self.held) if self.held else 0
        try:
            if taken < len(self.held):
                return torch.zeros(self.vocabulary.vocab_size, dtype=torch.bool)
            return self.allowed()
        finally:
            if taken:
                self.matcher.rollback(taken)

    def consume(self, token: int) -> None:
        if self.phase == "answer":
            self.matcher.consume_token(token)
            return
        self.text += self.vocabulary.token_text(token)
        if self.phase == "opening":
            self.held.append(token)
            if self.opens.startswith(self.text) and self.text != self.opens:
                return  # the opening so far
            if not self.text.startswith(self.opens):  # no thinking: those tokens began the answer
                self.phase, held, self.held = "answer", self.held, []
                self.matcher.consume_tokens(held)
                return
            self.phase, self.text, self.held = "thinking", self.text[len(self.opens):], []
        end = self.text.find(self.after)
        if end < 0:  # keep only what may begin the end marker: no pass over all the thinking per token
            self.text = self.text[-(len(self.after) - 1):] if len(self.after) > 1 else ""
            return
        # thinking ends: the shape starts with what follows (whitespace aside)
        rest = self.text[end + len(self.after):].lstrip()
        self.phase, self.text = "answer", ""
        if rest:
            self.matcher.consume_tokens(self.vocabulary.encode(rest))

    @property
    def done(self) -> bool:
        """The shape is complete and can go no further: the sample ends here."""
        return self.phase == "answer" and self.matcher.is_stopped() and not self.matcher.is_error()

    @property
    def failed(self) -> str | None:
        """Why the grammar could not be followed further (its first line), or None."""
        return first_line(self.matcher.get_error()) if self.matcher.is_error() else None


def first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else ""

"""Structured outputs: response_format (json_object, json_schema, structural_tag) and vLLM's
guided_json, guided_regex, guided_choice, guided_grammar and structured_outputs hold a reply to its
shape whatever the model's weights say (the demo model's are random), greedy or sampled, whole or
streamed, and end it where the shape ends; what cannot be followed is refused by field."""

from __future__ import annotations

import json
import re

import pytest

pytest.importorskip("torch")
pytest.importorskip("llguidance")

from .daemon_fixtures import apps, blocks_all_back, call, sse_events, start_service, token_table  # noqa: E402

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["blocks", "tier", "pinned"],
          "properties": {"blocks": {"type": "integer", "minimum": 0, "maximum": 4096},
                         "tier": {"enum": ["device", "host", "disk"]},
                         "pinned": {"type": "boolean"},
                         "note": {"type": "string", "maxLength": 12}}}
# no strings of the model's own: the whole text is layout, which json.dumps writes alike
NUMBERS_ONLY = {**SCHEMA, "properties": {k: v for k, v in SCHEMA["properties"].items() if k != "note"}}
ASK = [{"role": "user", "content": "Where is the system prompt cached?"}]


@pytest.fixture(scope="module")
def kvd(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("structured")
    service = start_service(tmp_path)
    try:
        yield service, apps(service, token_table(tmp_path))[0]
    finally:
        service.shutdown(1)


def chat(unix, **fields):
    answer = call(unix, "POST", "/v1/chat/completions", json={"messages": ASK, "max_tokens": 200, **fields})
    assert answer.status_code == 200, answer.text
    return answer.json()


def complete(unix, **fields):
    answer = call(unix, "POST", "/v1/completions", json={"prompt": "Answer:", "max_tokens": 200, **fields})
    assert answer.status_code == 200, answer.text
    return answer.json()


def walk(service, constraint, token_ids: list[int]) -> str:
    """What the tokens are to the shape, read by a fresh matcher: "whole" (it takes them all and can
    go no further), "prefix" (it takes them all and wants more) or "off" (it refuses one)."""
    state = service.engine.grammar_vocabulary.follow(constraint)
    for token in token_ids:
        if not state.allowed()[token]:
            return "off"
        state.consume(token)
    return "whole" if state.done else "prefix"


def obeys_schema(reply: dict) -> bool:
    return (set(reply) - {"note"} == {"blocks", "tier", "pinned"} and type(reply["blocks"]) is int
            and 0 <= reply["blocks"] <= 4096 and reply["tier"] in ("device", "host", "disk")
            and type(reply["pinned"]) is bool and len(reply.get("note", "")) <= 12)


@pytest.mark.parametrize("seed", range(4))
def test_a_json_schema_reply_obeys_the_schema_sampled_or_greedy_and_ends_where_it_closes(kvd, seed):
    service, unix = kvd
    from kvctl.daemon.engine.structured import Constraint

    shape = {"response_format": {"type": "json_schema", "json_schema": {"name": "where", "schema": NUMBERS_ONLY}}}
    sampling = {"temperature": 0.0} if seed == 0 else {"temperature": 1.0, "seed": seed}
    answer = chat(unix, **shape, **sampling)
    [choice] = answer["choices"]
    text = choice["message"]["content"]
    assert obeys_schema(json.loads(text)) and choice["finish_reason"] == "stop"
    assert text == json.dumps(json.loads(text))  # written as json.dumps writes it: no stray whitespace
    assert walk(service, Constraint.json_schema(NUMBERS_ONLY, "x"), choice["token_ids"]) == "whole"
    # the reply ends with the object's last token: no EOS drawn, nothing after it
    assert answer["usage"]["completion_tokens"] == len(choice["token_ids"]) == \
        len(service.loaded.tokenizer.encode(text, add_special_tokens=False))
    assert blocks_all_back(service)


def test_json_object_and_vllm_s_fields_give_the_same_shapes(kvd):
    from kvctl.daemon.engine.structured import Constraint

    service, unix = kvd
    for fields in ({"guided_json": SCHEMA}, {"guided_json": json.dumps(SCHEMA)}, {"structured_outputs": {"json": SCHEMA}}):
        text = complete(unix, temperature=1.0, seed=3, **fields)["choices"][0]["text"]
        assert obeys_schema(json.loads(text)), fields
    # any object: the random model may write a key until max_tokens; every token it wrote is the shape's
    any_object = Constraint.json_schema({"type": "object"}, "x")
    for fields in ({"response_format": {"type": "json_object"}}, {"structured_outputs": {"json_object": True}}):
        for seed in range(3):
            choice = complete(unix, temperature=1.0, seed=seed, max_tokens=40, **fields)["choices"][0]
            assert choice["text"].startswith("{")
            if choice["finish_reason"] == "stop":
                assert isinstance(json.loads(choice["text"]), dict)
                assert walk(service, any_object, choice["token_ids"]) == "whole"
            else:
                assert choice["finish_reason"] == "length" and len(choice["token_ids"]) == 40
                assert walk(service, any_object, choice["token_ids"]) == "prefix"


@pytest.mark.parametrize("seed", range(6))
def test_a_choice_is_one_of_the_choices_as_written_and_a_regex_is_matched_whole(kvd, seed):
    _, unix = kvd
    choices = ["device", "host (pinned)", "disk \"cold\"", "über"]
    picked = complete(unix, guided_choice=choices, temperature=1.0, seed=seed)["choices"][0]
    assert picked["text"] in choices and picked["finish_reason"] == "stop"
    pattern = r"blk-[0-9]{3}\.[a-f]{2,4}"
    matched = complete(unix, structured_outputs={"regex": pattern}, temperature=1.0, seed=seed)["choices"][0]
    assert re.fullmatch(pattern, matched["text"])
    assert matched["finish_reason"] in ("stop", "length") and len(matched["text"]) <= 12


def test_every_sample_and_every_streamed_delta_keeps_the_shape(kvd):
    service, unix = kvd
    fields = {"guided_json": SCHEMA, "temperature": 1.0, "seed": 11, "n": 3}
    whole = chat(unix, **fields)
    texts = sorted(c["message"]["content"] for c in whole["choices"])
    assert all(obeys_schema(json.loads(t)) for t in texts)
    events = sse_events(call(unix, "POST", "/v1/chat/completions",
                             json={"messages": ASK, "max_tokens": 200, "stream": True, **fields}))
    streamed: dict[int, str] = {}
    for event in events[:-1]:
        for choice in event["choices"]:
            streamed[choice["index"]] = streamed.get(choice["index"], "") + (choice["delta"].get("content") or "")
    assert sorted(streamed.values()) == texts  # a seeded stream is the whole answer, delta by delta
    assert blocks_all_back(service)


def test_a_reply_cut_off_by_max_tokens_ends_where_it_was(kvd):
    _, unix = kvd
    cut = chat(unix, guided_json=SCHEMA, max_tokens=5)["choices"][0]
    assert cut["finish_reason"] == "length" and len(cut["token_ids"]) == 5
    assert cut["message"]["content"].startswith('{"')


def test_without_a_shape_the_reply_is_what_it_was(kvd):
    _, unix = kvd
    free = chat(unix, temperature=0.0, max_tokens=12)["choices"][0]["message"]["content"]
    assert chat(unix, temperature=0.0, max_tokens=12, response_format={"type": "text"}
                )["choices"][0]["message"]["content"] == free


def test_a_shape_that_fails_part_way_ends_its_sample_with_error_not_stop(kvd, caplog):
    """llguidance's limits on one step's work can stop a grammar mid-reply (a regex of a million
    repeats): the sample says "error", never passes an unfinished shape off as whole."""
    service, unix = kvd
    with caplog.at_level("WARNING", logger="kvd.engine"):
        choice = complete(unix, guided_regex="a{1000000}", max_tokens=20)["choices"][0]
    assert choice["finish_reason"] == "error" and choice["text"] == "a"
    [line] = [r.getMessage() for r in caplog.records if "could not be followed" in r.getMessage()]
    assert line.endswith("its reply's shape (guided_regex) could not be followed after 1 tokens: lexer error: too "
                         "many expressions constructed")
    assert blocks_all_back(service)


@pytest.mark.parametrize("fields, param, message", [
    ({"response_format": {"type": "yaml"}}, "response_format.type",
     "response_format.type: must be text, json_object, json_schema or structural_tag, got 'yaml'"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema.schema",
     "response_format.json_schema.schema: must be a JSON Schema object ({\"type\": \"json_schema\", \"json_schema\": "
     "{\"name\": ..., \"schema\": {...}}})"),
    ({"response_format": "json"}, "response_format", "response_format: must be an object with type, got str"),
    ({"guided_json": {"type": "bogus"}}, "guided_json", "guided_json: Invalid type: bogus"),
    ({"guided_json": "{not json"}, "guided_json", "guided_json: not JSON text of a schema"),
    ({"guided_json": {"$ref": "#"}}, "guided_json", "guided_json: no reply fits this shape (NoExtensionBias)"),
    ({"guided_json": {"type": "integer", "minimum": 5, "maximum": 3}}, "guided_json",
     "guided_json: Unsatisfiable schema: minimum (5) is greater than maximum (3)"),
    ({"guided_regex": "[0-9"}, "guided_regex",
     "guided_regex: at 1(8): invalid regex \"[0-9\" (in regex): regex parse error: unclosed character class"),
    ({"guided_choice": []}, "guided_choice", "guided_choice: must be a list of one or more non-empty strings, got []"),
    ({"guided_choice": ["a", ""]}, "guided_choice",
     "guided_choice: must be a list of one or more non-empty strings, got ['a', '']"),
    ({"guided_regex": "a+", "response_format": {"type": "json_object"}}, "guided_regex",
     "guided_regex: give one shape for the reply, not response_format and guided_regex"),
    ({"structured_outputs": {"xml": "<a/>"}}, "structured_outputs",
     "structured_outputs: give one of json, regex, choice, grammar, json_object, structural_tag, got ['xml']"),
    ({"guided_grammar": "hello world"}, "guided_grammar",
     "guided_grammar: read as GBNF (a Lark grammar has a start: rule): Expected ::= at line 1, 'hello ' ^ 'world'"),
    ({"guided_grammar": "root ::= tier\n"}, "guided_grammar",
     "guided_grammar: read as GBNF (a Lark grammar has a start: rule): Rule 'tier' not found"),
    ({"structured_outputs": {"grammar": "start: tier"}}, "structured_outputs.grammar",
     "structured_outputs.grammar: at 1(8): unknown name: \"tier\""),
    ({"guided_grammar": ["root ::= \"a\""]}, "guided_grammar",
     "guided_grammar: must be the text of a grammar (GBNF or Lark), got ['root ::= \"a\"']"),
    ({"guided_grammar": "root ::= \"a\"" + " " * 65_536}, "guided_grammar",
     "guided_grammar: 65,548 characters; kvd takes grammars of up to 65,536"),
    ({"response_format": {"type": "structural_tag", "structures": [{"begin": "<f>", "schema": {}, "end": ""}]}},
     "response_format.triggers", "response_format.triggers: must be a list of one or more non-empty strings, got None"),
    ({"response_format": {"type": "structural_tag", "triggers": ["<function="], "structures": []}},
     "response_format.structures", "response_format.structures: must be a list of one or more {begin, schema, end} "
     "objects, got []"),
    ({"response_format": {"type": "structural_tag", "triggers": ["<function="],
                          "structures": [{"begin": "<function=a>", "schema": {}, "end": ""},
                                         {"begin": "<tool>", "schema": {}, "end": "</tool>"}]}},
     "response_format.structures[1].begin",
     "response_format.structures[1].begin: '<tool>' starts with none of the triggers ['<function=']"),
    ({"response_format": {"type": "structural_tag", "triggers": ["<f"],
                          "structures": [{"begin": "<f>", "schema": "object", "end": "</f>"}]}},
     "response_format.structures[0].schema",
     "response_format.structures[0].schema: must be a JSON Schema object, got 'object'"),
    ({"response_format": {"type": "structural_tag", "triggers": ["<f"],
                          "structures": [{"begin": "<f>", "schema": {"type": "bogus"}, "end": "</f>"}]}},
     "response_format.structures[0].schema", "response_format.structures[0].schema: Invalid type: bogus"),
    ({"structured_outputs": {"structural_tag": "{\"triggers\": "}}, "structured_outputs.structural_tag",
     "structured_outputs.structural_tag: not JSON text of structural tags"),
    # JSON text nested deeper than Python's parser recurses: refused as any text that is no JSON
    ({"guided_json": "[" * 100_000 + "]" * 100_000}, "guided_json", "guided_json: not JSON text of a schema"),
    ({"structured_outputs": {"structural_tag": "[" * 100_000}}, "structured_outputs.structural_tag",
     "structured_outputs.structural_tag: not JSON text of structural tags"),
])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_shape_kvd_cannot_follow_is_refused_by_field_and_leaves_nothing_behind(kvd, path, fields, param, message):
    service, unix = kvd
    body = {"prompt": "Answer:"} if path == "/v1/completions" else {"messages": ASK}
    answer = call(unix, "POST", path, json={**body, "max_tokens": 8, **fields})
    assert answer.status_code == 400
    assert (answer.json()["error"]["param"], answer.json()["error"]["message"]) == (param, message)
    assert blocks_all_back(service)


def test_the_mask_leaves_allowed_scores_as_they_were_and_the_rest_at_minus_infinity(kvd):
    import torch

    from kvctl.daemon.engine.structured import Constraint

    service, _ = kvd
    vocabulary = service.engine.grammar_vocabulary
    state = vocabulary.follow(Constraint.choice(["ab", "ac"], "guided_choice"))
    tokenizer = service.loaded.tokenizer
    [a], [b], [c] = (tokenizer.encode(x, add_special_tokens=False) for x in "abc")
    scores = torch.randn(vocabulary.vocab_size)
    masked = state.masked(scores)
    assert masked[a] == scores[a] and torch.isinf(masked).sum() == vocabulary.vocab_size - 1
    state.consume(a)
    masked = state.masked(scores)
    assert {int(i) for i in torch.nonzero(~torch.isinf(masked))} == {b, c} and not state.done
    state.consume(c)
    assert state.done


def test_a_grammar_s_mask_made_on_the_host_applies_to_logits_on_the_device(kvd):
    """The mask comes from the matcher on the host; logits on a GPU took it as it was and failed (a
    host tensor beside a device one). The meta device stands in for the GPU here."""
    import torch

    from kvctl.daemon.engine.structured import Constraint

    service, _ = kvd
    state = service.engine.grammar_vocabulary.follow(Constraint.choice(["ab", "ac"], "guided_choice"))
    assert state.mask().device.type == "cpu" and int(state.mask().sum()) == 1
    masked = state.masked(torch.zeros(state.vocabulary.vocab_size, device="meta"))
    assert masked.device.type == "meta" and masked.shape == (state.vocabulary.vocab_size,)
    thinking = gated(service, None)
    assert thinking.mask() is None  # while the reply thinks, any token may come
    scores = torch.randn(thinking.vocabulary.vocab_size)
    assert thinking.masked(scores) is scores


def stepped_masks(state, draft: list[int]) -> list:
    """The masks of a draft's verdict rows as `state` (moved) gives them taking the draft's tokens
    one by one: row i after i of them, up to the row the verdict must end at."""
    masks = [state.mask()]
    for token in draft:
        if masks[-1] is not None and not masks[-1][token]:
            break
        state.consume(token)
        if state.done or state.failed:
            break
        masks.append(state.mask())
    return masks


def same_masks(found: list, expected: list) -> bool:
    return len(found) == len(expected) and all(
        (a is None and b is None) or (a is not None and b is not None and torch_equal(a, b))
        for a, b in zip(found, expected))


def torch_equal(a, b) -> bool:
    import torch

    return torch.equal(a, b)


def test_a_drafts_rows_masked_ahead_are_masked_as_its_grammar_would_after_each_token_and_it_does_not_move(kvd):
    """GrammarState.masks_ahead: a row for each token of the draft the grammar takes, and one for
    the row where the verdict ends whatever it draws (a token the grammar leaves out, or the shape
    complete after one); the state looked ahead from stays where it was."""
    from dataclasses import replace

    from kvctl.daemon.engine.structured import Constraint

    service, _ = kvd
    tokenizer = service.loaded.tokenizer
    [a], [b], [c], [x] = (tokenizer.encode(t, add_special_tokens=False) for t in "abcx")
    choice = Constraint.choice(["ab", "ac"], "guided_choice")
    for draft, rows in (([], 1), ([x], 1), ([a, x], 2), ([a, c, x], 2), ([a, c], 2), ([a], 2)):
        state = service.engine.grammar_vocabulary.follow(choice)
        masks = state.masks_ahead(draft)
        walked = stepped_masks(service.engine.grammar_vocabulary.follow(choice), draft)
        assert len(masks) == rows and same_masks(masks, walked), draft
        assert same_masks([state.mask()], [masks[0]]) and state.matcher.compute_bitmask() is not None
        state.consume(a)  # it did not move: it takes the draft's first token as a fresh state does
        state.consume(b)
        assert state.done
    gated_shape = replace(Constraint.json_schema({"type": "object"}, "response_format"), after="</think>",
                          opens="<think>")
    service.engine.grammar_vocabulary.check(gated_shape)
    for text in ("<think>a b</think>{\"a\": 1}", "{\"b\": [true]}x", "<t{"):
        draft = tokenizer.encode(text, add_special_tokens=False)
        state = service.engine.grammar_vocabulary.follow(gated_shape)
        state.consume(draft[0])  # ahead from a state that has moved: opening (its text held), or answering
        where = (state.phase, state.text, list(state.held))
        masks = state.masks_ahead(draft[1:])
        walked = service.engine.grammar_vocabulary.follow(gated_shape)
        walked.consume(draft[0])
        assert same_masks(masks, stepped_masks(walked, draft[1:])), text
        assert (state.phase, state.text, state.held) == where and same_masks([state.mask()], masks[:1])


# ---- a reasoning model thinks first; the shape holds its answer ------------------------------------
def gated(service, opens):
    from dataclasses import replace

    from kvctl.daemon.engine.structured import Constraint

    shape = replace(Constraint.json_schema({"type": "object"}, "response_format"), after="</think>", opens=opens)
    service.engine.grammar_vocabulary.check(shape)  # as the engine checks a request before it queues it
    return service.engine.grammar_vocabulary.follow(shape)


def feed(service, state, text: str) -> list[bool]:
    """Each token of `text` in turn: whether the mask let it through, then consumed."""
    import torch

    let = []
    for token in service.loaded.tokenizer.encode(text, add_special_tokens=False):
        masked = state.masked(torch.zeros(state.vocabulary.vocab_size))
        let.append(bool(masked[token] == 0))
        state.consume(token)
    return let


def test_the_shape_waits_for_the_thinking_to_end_and_then_holds_the_answer(kvd):
    import torch

    service, _ = kvd
    state = gated(service, "<think>")
    assert all(feed(service, state, "<think>The cache {holds} <b>blocks</b>.</think>"))
    assert state.phase == "answer" and not state.done
    x = service.loaded.tokenizer.encode("x", add_special_tokens=False)[0]
    assert torch.isinf(state.masked(torch.zeros(state.vocabulary.vocab_size))[x])  # the answer is the shape's
    assert all(feed(service, state, '{"a": 1}')) and state.done


def test_a_reply_that_does_not_open_its_thinking_is_held_from_its_first_token(kvd):
    import torch

    service, _ = kvd
    state = gated(service, "<think>")
    first = state.masked(torch.zeros(state.vocabulary.vocab_size))
    allowed = {service.loaded.tokenizer.token_text(int(t)) for t in torch.nonzero(~torch.isinf(first))}
    assert allowed == {"<", "{"}  # the opening's first token, or the object's
    assert feed(service, state, "<t") == [True, True] and state.phase == "opening"
    after = state.masked(torch.zeros(state.vocabulary.vocab_size))
    assert {service.loaded.tokenizer.token_text(int(t)) for t in torch.nonzero(~torch.isinf(after))} == {"h"}
    plain = gated(service, "<think>")
    assert all(feed(service, plain, '{"b": [true]}')) and plain.phase == "answer" and plain.done
    inside = gated(service, None)  # the template opened the block: the reply starts inside it
    assert inside.phase == "thinking" and all(feed(service, inside, "x < y.</think>{}")) and inside.done


def test_kvd_with_a_reasoning_parser_lets_the_model_think_before_the_shaped_answer(tmp_path, monkeypatch):
    """The engine's draws scripted (as in test_tool_calls): thinking, then the object; the mask is
    the unit tests' above. Without the reasoning parser the same reply breaks the shape at '<'."""
    from .scripted_draws import script_draws

    script: list[int] = []
    script_draws(monkeypatch, lambda logits, params, seed, index, step: script[step] if step < len(script) else 257)
    ask = {"messages": ASK, "max_tokens": 80, "response_format": {"type": "json_object"}}
    for parser, expected in (("qwen3", ("stop", "It is pinned.", '{"pinned": true}')),
                             ("none", ("error", None, "<"))):
        service = start_service(tmp_path / parser, reasoning_parser=parser)
        try:
            unix = apps(service, token_table(tmp_path))[0]
            script[:] = service.loaded.tokenizer.encode('<think>It is pinned.</think>{"pinned": true}',
                                                        add_special_tokens=False)
            [choice] = call(unix, "POST", "/v1/chat/completions", json=ask).json()["choices"]
            assert (choice["finish_reason"], choice["message"].get("reasoning"),
                    choice["message"]["content"]) == expected
        finally:
            service.shutdown(1)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_shape_is_built_and_compiled_off_the_event_loop_that_streams_every_answer(kvd, monkeypatch, path):
    """Building a shape (a GBNF grammar is converted in Python) and compiling it both run in worker
    threads: the loop runs in this thread."""
    import threading

    from kvctl.daemon.server import app as app_module

    service, unix = kvd
    vocabulary = service.engine.grammar_vocabulary
    built_in, checked_in = [], []
    original, build = type(vocabulary).check, app_module.constraint_of
    monkeypatch.setattr(type(vocabulary), "check",
                        lambda self, constraint: checked_in.append(threading.current_thread()) or original(self, constraint))
    monkeypatch.setattr(app_module, "constraint_of", lambda body: built_in.append(threading.current_thread()) or build(body))
    body = {"prompt": "Answer:"} if path == "/v1/completions" else {"messages": ASK}
    assert call(unix, "POST", path, json={**body, "guided_grammar": GBNF, "max_tokens": 4}).status_code == 200
    assert len(checked_in) == len(built_in) == 1
    assert threading.current_thread() not in (checked_in[0], built_in[0])
    # a request with no shape is not sent to a worker thread for one
    assert call(unix, "POST", path, json={**body, "max_tokens": 2}).status_code == 200
    assert len(built_in) == 1


def test_the_engine_step_compiles_no_grammar_each_sample_s_is_compiled_when_its_request_is_checked(kvd, monkeypatch):
    """A grammar's compile (0.5-2 ms for a tool-sized schema) in the step would hold up every running
    sequence: each of the n samples gets its own matcher, compiled in the submitter's thread."""
    import threading

    service, unix = kvd
    vocabulary = service.engine.grammar_vocabulary
    compiled_in, original = [], type(vocabulary)._start
    monkeypatch.setattr(type(vocabulary), "_start",
                        lambda self, constraint: compiled_in.append(threading.current_thread().name)
                        or original(self, constraint))
    answer = chat(unix, guided_json=SCHEMA, n=3, temperature=1.0, seed=5)
    assert all(obeys_schema(json.loads(c["message"]["content"])) for c in answer["choices"])
    assert len(compiled_in) == 3 and "kvd-engine" not in compiled_in
    # two prompts in one completion: each prompt's samples, compiled apart
    compiled_in.clear()
    answer = call(unix, "POST", "/v1/completions", json={"prompt": ["A:", "B:"], "n": 2, "guided_choice": ["x", "y"],
                                                          "max_tokens": 4})
    assert len(answer.json()["choices"]) == 4 and all(c["text"] in ("x", "y") for c in answer.json()["choices"])
    assert len(compiled_in) == 4 and "kvd-engine" not in compiled_in
    # past GRAMMARS_COMPILED_AHEAD (64) samples, the rest compile at their first draw: the shape is
    # checked once, and what waits in the queue holds no more than 64 matchers
    compiled_in.clear()
    answer = call(unix, "POST", "/v1/completions", json={"prompt": ["A:", "B:", "C:"], "n": 30,
                                                          "guided_choice": ["x", "y"], "max_tokens": 2})
    assert len(answer.json()["choices"]) == 90
    assert (len(compiled_in), compiled_in.count("kvd-engine")) == (90, 26)
    assert blocks_all_back(service)


def test_an_engine_driven_without_the_service_compiles_each_sample_s_grammar_itself(kvd):
    """Engine.add_request without a checked prompt (scripts, replay) checks and compiles there."""
    from kvctl.daemon.engine.engine import Engine, EngineSettings
    from kvctl.daemon.engine.sampling import SamplingParams
    from kvctl.daemon.engine.structured import Constraint

    service, _ = kvd
    engine = Engine(service.loaded, EngineSettings(num_blocks=64, block_size=16))
    on_off = Constraint.choice(["on", "off"], "guided_choice")
    request = engine.add_request(engine.tokenizer.encode("Q:"), SamplingParams(
        max_tokens=4, n=2, temperature=1.0, seed=1, constraint=on_off))
    assert len(request.grammars) == 2 and request.grammars[0] is not request.grammars[1]
    first = request.grammars[0]
    assert request.take_grammar(0) is first and request.take_grammar(0) is None and request.take_grammar(5) is None
    request.grammars[0] = first
    texts = {}
    while engine.has_work():
        for event in engine.step():
            if event.token_id is not None:
                texts[event.index] = texts.get(event.index, "") + engine.tokenizer.token_text(event.token_id)
    assert sorted(texts) == [0, 1] and all(text in ("on", "off") for text in texts.values())
    assert request.grammars == [None, None]  # each sample took its own


GBNF = 'root ::= verdict "-" digit digit\nverdict ::= "hit" | "miss"\ndigit ::= [0-9]\n'
LARK = 'start: "tier=" TIER ";"\nTIER: "device" | "host" | "disk"\n'


@pytest.mark.parametrize("seed", range(4))
def test_a_grammar_in_gbnf_or_lark_holds_the_reply_whole(kvd, seed):
    """vLLM's guided_grammar, in either dialect its backends read (xgrammar's GBNF, guidance's Lark),
    and structured_outputs' grammar."""
    _, unix = kvd
    sampled = {"temperature": 1.0, "seed": seed}
    for fields, pattern in (({"guided_grammar": GBNF}, r"(hit|miss)-[0-9][0-9]"),
                            ({"structured_outputs": {"grammar": GBNF}}, r"(hit|miss)-[0-9][0-9]"),
                            ({"guided_grammar": LARK}, r"tier=(device|host|disk);")):
        choice = complete(unix, **fields, **sampled)["choices"][0]
        assert re.fullmatch(pattern, choice["text"]) and choice["finish_reason"] == "stop", (fields, choice)
    answer = chat(unix, guided_grammar=LARK, **sampled)["choices"][0]
    assert re.fullmatch(r"tier=(device|host|disk);", answer["message"]["content"])


WEATHER = {"type": "object", "additionalProperties": False, "required": ["city"],
           "properties": {"city": {"type": "string", "maxLength": 6}}}
CLOCK = {"type": "object", "additionalProperties": False, "required": ["zone"],
         "properties": {"zone": {"enum": ["UTC", "CET"]}}}
TAGS = {"type": "structural_tag", "triggers": ["<function="],
        "structures": [{"begin": "<function=get_weather>", "schema": WEATHER, "end": "</function>"},
                       {"begin": "<function=get_time>", "schema": CLOCK, "end": "</function>"}]}


@pytest.fixture
def steered(monkeypatch):
    """The model is steered to write `steered.ids` (the demo's tokens are single bytes, so a text's
    n-th token is its n-th byte): each draw takes the next id where the shape allows it, else the
    best token the shape allows, and EOS once the ids are spent (where allowed)."""
    from .scripted_draws import script_draws

    class Steer:
        ids: list[int] = []

    def draw(scores, params, seed, index, step):
        want = Steer.ids[step] if step < len(Steer.ids) else 257  # the demo's EOS
        return want if scores[want] > float("-inf") else int(scores.argmax())

    script_draws(monkeypatch, draw)
    return Steer


def test_structural_tags_leave_text_free_and_hold_what_follows_a_trigger(kvd, steered):
    service, unix = kvd
    # the model means a key the schema has not ("town"), a zone it has not ("PST") and stops before
    # the tag's end; each swap is as long as what it replaces, so the steering stays in step
    text = 'Noted. <function=get_weather>{"town": "Oslo"}</function> then <function=get_time>{"zone": "PST"}'
    steered.ids = service.loaded.tokenizer.encode(text, add_special_tokens=False)
    assert len(steered.ids) == len(text)
    reply = chat(unix, response_format=TAGS, max_tokens=150)["choices"][0]["message"]["content"]
    zone = reply[len(text) - 5:len(text) - 2]
    assert zone in ("UTC", "CET")
    assert reply == ('Noted. <function=get_weather>{"city": "Oslo"}</function> then '
                     '<function=get_time>{"zone": "' + zone + '"}</function>')
    # vLLM's structured_outputs form, the tags as JSON text: the same reply
    again = chat(unix, structured_outputs={"structural_tag": json.dumps({k: v for k, v in TAGS.items()
                                                                           if k != "type"})}, max_tokens=150)
    assert again["choices"][0]["message"]["content"] == reply
    assert blocks_all_back(service)


def test_structural_tags_change_nothing_in_a_reply_that_never_writes_a_trigger(kvd, steered):
    """Text outside the tags is the model's own (as text: the grammar's free text is UTF-8, so the
    random demo model's stray bytes are not a fair comparison; steered text is)."""
    service, unix = kvd
    text = "Plain words <function but no trigger: {\"zone\": \"PST\"} </function>"
    steered.ids = service.loaded.tokenizer.encode(text, add_special_tokens=False)
    choice = complete(unix, response_format=TAGS, max_tokens=150)["choices"][0]
    assert (choice["text"], choice["finish_reason"]) == (text, "stop")


def test_the_first_shaped_requests_checked_at_once_build_the_vocabulary_s_index_and_opening_once(kvd, monkeypatch):
    """Several submitter threads may check the first shaped requests together: one builds
    llguidance's index (a second and 75 MiB for a 128,000-token vocabulary) and one learns the
    thinking block's opening; the others wait for them and use theirs."""
    import threading
    import time

    import llguidance

    from kvctl.daemon.engine.structured import Constraint, GrammarVocabulary

    service, _ = kvd
    engine = service.engine
    texts_read = []

    def token_text(token):
        texts_read.append(token)
        return engine.tokenizer.token_text(token)

    fresh = GrammarVocabulary(engine.tokenizer.texts[0], engine.grammar_vocabulary.vocab_size, engine.eos_ids,
                              token_text, lambda text: engine.tokenizer.encode(text, add_special_tokens=False))
    builds, real = [], llguidance.LLTokenizer

    def slow_build(*args, **kwargs):
        builds.append(threading.current_thread().name)
        time.sleep(0.2)  # long enough for every other thread to arrive while it builds
        return real(*args, **kwargs)

    monkeypatch.setattr(llguidance, "LLTokenizer", slow_build)
    shape = Constraint("guided_choice", Constraint.choice(["a", "b"], "guided_choice").grammar, after="</think>",
                       opens="<think>")
    checks = [threading.Thread(target=fresh.check, args=(shape,), name=f"submitter-{i}") for i in range(4)]
    for thread in checks:
        thread.start()
    for thread in checks:
        thread.join()
    assert len(builds) == 1
    assert len(texts_read) == fresh.vocab_size  # one pass over the vocabulary
    assert fresh.openers("<think>").any() and fresh.openers(">").any()

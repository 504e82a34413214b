"""The special tokens a completion's prompt gets: those tokenizer.json's post-processor adds, as
transformers (5.0 on) adds them, and so vLLM."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("tokenizers")

from kvctl.daemon.model.demo import BOS, EOS, ensure_demo_checkpoint, write_byte_tokenizer  # noqa: E402
from kvctl.daemon.model.tokenizer import Tokenizer  # noqa: E402

TEXT = "Pin the system prompt."
BOS_FIRST = {"type": "TemplateProcessing",
             "single": [{"SpecialToken": {"id": BOS, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
             "pair": [{"SpecialToken": {"id": BOS, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                      {"Sequence": {"id": "B", "type_id": 1}}],
             "special_tokens": {BOS: {"id": BOS, "ids": [256], "tokens": [BOS]}}}
EOS_LAST = {"type": "TemplateProcessing",
            "single": [{"Sequence": {"id": "A", "type_id": 0}}, {"SpecialToken": {"id": EOS, "type_id": 0}}],
            "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {EOS: {"id": EOS, "ids": [257], "tokens": [EOS]}}}
BYTE_LEVEL = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}

CASES = [  # (tokenizer.json's post-processor, tokenizer_config.json's flags, ids around the text)
    ("Llama 3: the post-processor puts BOS first", BOS_FIRST, {}, ([256], [])),
    ("a BOS named, a byte-level post-processor (GPT-2, OLMo): none", BYTE_LEVEL, {}, ([], [])),
    ("no post-processor: none", None, {}, ([], [])),
    ("add_bos_token is set aside where tokenizer.json says", None, {"add_bos_token": True}, ([], [])),
    ("add_bos_token false, a post-processor that adds BOS: BOS", BOS_FIRST, {"add_bos_token": False}, ([256], [])),
    ("an EOS after", EOS_LAST, {}, ([], [257])),
]


def checkpoint(directory, post_processor, flags):
    write_byte_tokenizer(directory)
    tokenizer_json = json.loads((directory / "tokenizer.json").read_text())
    tokenizer_json["post_processor"] = post_processor
    (directory / "tokenizer.json").write_text(json.dumps(tokenizer_json))
    config = {"bos_token": BOS, "eos_token": EOS, "tokenizer_class": "PreTrainedTokenizerFast", **flags}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


@pytest.mark.parametrize("case, post_processor, flags, around", CASES, ids=[c[0] for c in CASES])
def test_a_prompt_gets_the_special_tokens_transformers_gives_it(tmp_path, case, post_processor, flags, around):
    transformers = pytest.importorskip("transformers")
    directory = checkpoint(tmp_path, post_processor, flags)
    ours = Tokenizer(directory)
    text_ids = ours.encode(TEXT, add_special_tokens=False)
    assert len(text_ids) == len(TEXT.encode()) and not {256, 257} & set(text_ids)  # a token per byte
    before, after = around
    assert ours.encode(TEXT) == before + text_ids + after
    theirs = transformers.AutoTokenizer.from_pretrained(str(directory))
    assert ours.encode(TEXT) == theirs.encode(TEXT)
    assert ours.encode(TEXT, add_special_tokens=False) == theirs.encode(TEXT, add_special_tokens=False)


def test_the_demo_s_prompts_start_with_its_bos_for_kvd_and_transformers_alike(tmp_path):
    transformers = pytest.importorskip("transformers")
    directory = ensure_demo_checkpoint(tmp_path)
    ours = Tokenizer(directory)
    assert ours.encode(TEXT) == [256, *ours.encode(TEXT, add_special_tokens=False)] == \
        transformers.AutoTokenizer.from_pretrained(str(directory)).encode(TEXT)
    assert ours.encode("") == [256]  # an empty prompt is still a prompt


def test_a_parser_s_markers_are_kept_in_decoded_text_and_every_other_special_token_left_out():
    """Mistral's [TOOL_CALLS] and [ARGS] are special tokens: decoded text keeps them once a
    tool-call parser asks (kvd serve --tool-call-parser mistral), and still leaves EOS out."""
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as HFTokenizer

    hf = HFTokenizer.from_str(write_and_read_byte_tokenizer())
    hf.add_special_tokens([AddedToken("[TOOL_CALLS]", special=True), AddedToken("[ARGS]", special=True)])
    tokenizer = Tokenizer.from_texts(hf.to_str(), None)
    calls, args = hf.token_to_id("[TOOL_CALLS]"), hf.token_to_id("[ARGS]")
    ids = tokenizer.encode('Sure.[TOOL_CALLS]get_time[ARGS]{}', add_special_tokens=False) + [257]
    assert ids.count(calls) == ids.count(args) == 1  # each a token of its own
    assert tokenizer.decode(ids) == "Sure.get_time{}"  # as before: special tokens left out
    tokenizer.keep_in_text(["[TOOL_CALLS]", "[ARGS]", "[NOT_IN_THIS_VOCABULARY]"])
    assert tokenizer.decode(ids) == "Sure.[TOOL_CALLS]get_time[ARGS]{}"  # EOS (257) still left out
    assert tokenizer.decode(ids[:3]) == "Sur"  # no marker: decoded as it always was
    assert tokenizer.decode([calls]) == "[TOOL_CALLS]"


def write_and_read_byte_tokenizer() -> str:
    import tempfile
    from pathlib import Path

    directory = Path(tempfile.mkdtemp(prefix="kvd-markers-"))
    write_byte_tokenizer(directory)
    return (directory / "tokenizer.json").read_text()

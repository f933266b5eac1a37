"""Text is text (issue 28, item 12): a special token's spelling inside a question is encoded as
its characters, so a data file cannot end a prompt early; a chat template's markup is parsed
only when asked for."""

from __future__ import annotations

from rlvr_fast.data.problems import render_prompt
from rlvr_fast.models.policy import TINY_MODEL_DIR
from rlvr_fast.models.tokenizer import Tokenizer


def test_endoftext_inside_a_question_does_not_become_an_eos_in_the_prompt():
    """Regression: `<|endoftext|>` inside a question became the EOS token in the prompt."""
    tokenizer = Tokenizer.from_directory(TINY_MODEL_DIR)
    prompt = render_prompt("What is 1 <|endoftext|> + 2?")
    ids = tokenizer.encode(prompt)
    assert not set(ids) & set(tokenizer.eos_token_ids)
    assert tokenizer.decode(ids) == prompt, "the characters survive a round trip"
    assert tokenizer.encode_batch([prompt]) == [ids]


def test_special_tokens_are_parsed_when_asked_for():
    tokenizer = Tokenizer.from_directory(TINY_MODEL_DIR)
    ids = tokenizer.encode("1<|endoftext|>", special_tokens=True)
    assert ids[-1] == tokenizer.eos_token_id
    assert tokenizer.encode_batch(["1<|endoftext|>"], special_tokens=True) == [ids]


def test_plain_text_encodes_as_before_and_the_run_signature_is_unchanged():
    """Prompts without special-token spellings get the same ids either way, and the tokenizer's
    serialised form (part of a run's model hash) does not carry the setting."""
    tokenizer = Tokenizer.from_directory(TINY_MODEL_DIR)
    text = render_prompt("What is 12 + 30?")
    assert tokenizer.encode(text) == tokenizer.encode(text, special_tokens=True)
    assert tokenizer.backend.to_str() == tokenizer.markup_backend.to_str()

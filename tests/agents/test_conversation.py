"""The agent endpoint's token bookkeeping, with the real tiny tokenizer and chat template."""

from __future__ import annotations

import re

import pytest

from rollart.actors.env.chat import ChatFormat
from rollart.agents.conversation import ContractError, Conversation, parse_tool_calls
from rollart.agents.examples import CALCULATOR


@pytest.fixture(scope="module")
def chat(tiny_model):
    return ChatFormat.load(tiny_model)


def test_tool_calls_round_trip_through_the_chat_template(chat):
    """A generated tool call becomes the reply's ``tool_calls``; the agent's next request
    (the call echoed back, the tool's result) adds exactly the template's tokens, so the
    whole record decodes to the conversation rendered at once."""
    conv = Conversation(chat)
    msgs = [{"role": "system", "content": "Use tools."}, {"role": "user", "content": "2 + 3 = ?"}]
    ids = conv.prompt(msgs, CALCULATOR)
    gen_text = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
    gen = chat.encode(gen_text) + [chat.tok.eos_token_id]
    reply = conv.replied(msgs, gen, chat.decode(gen), tools=True)
    assert reply["content"] is None and reply["tool_calls"][0]["function"]["name"] == "add"
    call = reply["tool_calls"][0]
    # the agent echoes the call back as the openai client does (arguments as a JSON string,
    # spaced its own way) and adds the tool's result
    echoed = {"role": "assistant", "content": None, "tool_calls": [
        {"id": call["id"], "type": "function",
         "function": {"name": "add", "arguments": '{"b":3,"a":2}'}}]}
    msgs2 = msgs + [echoed, {"role": "tool", "tool_call_id": call["id"], "content": "5"}]
    more = conv.prompt(msgs2, CALCULATOR)
    whole = chat.decode(ids + gen + more, skip_special=False)
    rendered = chat.tok.apply_chat_template(
        msgs + [{"role": "assistant", "content": gen_text}, msgs2[-1]], tools=CALCULATOR,
        tokenize=False, add_generation_prompt=True)
    assert whole == rendered
    assert "<|im_start|>tool\n5<|im_end|>" in whole and whole.count("<|im_end|>") == 4


def test_a_reply_cut_before_its_end_of_turn_is_closed_by_the_next_prompt(chat):
    conv = Conversation(chat)
    msgs = [{"role": "user", "content": "hi"}]
    ids = conv.prompt(msgs)
    gen = chat.encode("hello there")  # max_tokens cut it: no end-of-turn token
    conv.replied(msgs, gen, chat.decode(gen), tools=False)
    msgs2 = msgs + [{"role": "assistant", "content": "hello there"}, {"role": "user", "content": "ok"}]
    more = conv.prompt(msgs2)
    assert chat.decode(ids + gen + more, skip_special=False) == chat.render(
        msgs2, generation_prompt=True)


@pytest.mark.parametrize("second, why", [
    ([{"role": "user", "content": "hi!"}, {"role": "assistant", "content": "R"},
      {"role": "user", "content": "x"}], "messages[0] differs from the previous request"),
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "L"},
      {"role": "user", "content": "x"}], "messages[1] differs from the assistant reply"),
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "R"}],
     "nothing to reply to"),
    ([{"role": "user", "content": "hi"}], "adds no message"),
    ([{"role": "robot", "content": "hi"}], "role must be one of"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], "only text parts"),
    ("hi", "non-empty list"),
])
def test_a_request_that_does_not_extend_the_conversation_is_refused(chat, second, why):
    conv = Conversation(chat)
    msgs = [{"role": "user", "content": "hi"}]
    conv.prompt(msgs)
    gen = chat.encode("R")
    conv.replied(msgs, gen, "R", tools=False)
    with pytest.raises(ContractError, match=re.escape(why)):
        conv.prompt(second)


def test_malformed_tool_calls_stay_text():
    text = 'so <tool_call>{"name": 3}</tool_call> and <tool_call>not json</tool_call>'
    assert parse_tool_calls(text, 1) == (text, [])
    content, calls = parse_tool_calls('ok <tool_call>{"name": "f"}</tool_call>', 2)
    assert content == "ok" and calls[0]["id"] == "call_2_0"
    assert calls[0]["function"] == {"name": "f", "arguments": "{}"}

import pytest
from hypothesis import given, settings, strategies as st

from rollart.envs.actions import ANSWER_PATTERN, parse_action

no_tag = st.text(alphabet=st.characters(blacklist_characters="<>"), max_size=40)


def test_last_match_wins_and_is_stripped():
    text = "think <answer>L</answer> no wait <answer>  R \n</answer> done"
    assert parse_action(text, ANSWER_PATTERN) == "R"


def test_unparsable_and_empty_are_none():
    assert parse_action("I move right", ANSWER_PATTERN) is None
    assert parse_action("<answer>   </answer>", ANSWER_PATTERN) is None
    assert parse_action("<answer>R", ANSWER_PATTERN) is None
    assert parse_action("   \n", None) is None


def test_multiline_answer_and_no_pattern():
    assert parse_action("<answer>a\nb</answer>", ANSWER_PATTERN) == "a\nb"
    assert parse_action("  free text \n", None) == "free text"


def test_pattern_without_group_uses_whole_match():
    assert parse_action("go L then R", r"\b[LDRU]\b") == "R"


@pytest.mark.parametrize("bad", [r"(unclosed", r"(a)(b)"])
def test_bad_patterns_are_value_errors(bad):
    with pytest.raises(ValueError, match="pattern"):
        parse_action("x", bad)


@settings(deadline=None)
@given(prefix=no_tag, answer=no_tag, suffix=no_tag)
def test_roundtrip(prefix, answer, suffix):
    got = parse_action(f"{prefix}<answer>{answer}</answer>{suffix}", ANSWER_PATTERN)
    assert got == (answer.strip() or None)


@settings(deadline=None)
@given(first=no_tag, second=no_tag)
def test_property_last_of_two(first, second):
    got = parse_action(f"<answer>{first}</answer> and <answer>{second}</answer>", ANSWER_PATTERN)
    assert got == (second.strip() or None)


@settings(deadline=None)
@given(text=st.text(max_size=60))
def test_never_raises_and_none_pattern_strips(text):
    parse_action(text, ANSWER_PATTERN)
    assert parse_action(text, None) == (text.strip() or None)

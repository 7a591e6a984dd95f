"""Memory methods on fixed inputs: prompts, append-all truncation, completion parsing, empty completions."""

from __future__ import annotations

import pytest

from memory.methods import METHODS, Interaction, get_method, parse_memory

INTER = Interaction(transcript="round 1: you rock, opponent paper (loss)\nround 2: you scissors, opponent paper (win)", outcome="won 1 of 2 rounds")


def test_names_and_unknown() -> None:
    assert METHODS == ("none", "append-all", "reflection", "memopilot")
    for name in METHODS:
        assert get_method(name).name == name
    with pytest.raises(ValueError, match="none, append-all, reflection, memopilot"):
        get_method("mem0")
    with pytest.raises(ValueError, match="max_chars"):
        get_method("none", max_chars=0)


def test_none_keeps_memory_empty() -> None:
    m = get_method("none")
    assert m.needs_model is False
    assert m.prompt("old", INTER) is None
    assert m.apply("old", INTER, "anything") == ""


def test_append_all_appends_and_keeps_the_newest_chars() -> None:
    m = get_method("append-all", max_chars=60)
    assert m.needs_model is False and m.prompt("", INTER) is None
    first = get_method("append-all", max_chars=10_000).apply("", INTER, None)
    assert first == INTER.transcript + "\nOutcome: won 1 of 2 rounds"
    second = get_method("append-all", max_chars=10_000).apply(first, Interaction("round 3: tie"), None)
    assert second == first + "\n\nround 3: tie"
    cut = m.apply(first, Interaction("round 3: tie", "lost"), None)
    assert len(cut) == 60
    assert cut.endswith("round 3: tie\nOutcome: lost")
    assert (first + "\n\nround 3: tie\nOutcome: lost").endswith(cut)


@pytest.mark.parametrize("name", ["reflection", "memopilot"])
def test_rewrite_prompts_carry_memory_log_and_outcome(name: str) -> None:
    m = get_method(name, max_chars=300)
    assert m.needs_model is True
    msgs = m.prompt("Opponent likes paper.", INTER)
    assert msgs is not None and [x["role"] for x in msgs] == ["system", "user"]
    assert "300" in msgs[0]["content"] and "<memory>" in msgs[0]["content"]
    user = msgs[1]["content"]
    assert "Opponent likes paper." in user and "round 2: you scissors" in user and "won 1 of 2 rounds" in user
    unknown = m.prompt("", Interaction("t {x}"))
    assert unknown is not None
    assert "(empty)" in unknown[1]["content"] and "unknown" in unknown[1]["content"] and "t {x}" in unknown[1]["content"]


def test_memopilot_prompt_keeps_the_newest_part_of_a_long_log() -> None:
    m = get_method("memopilot", max_log_chars=50)
    msgs = m.prompt("", Interaction("A" * 100 + "END"))
    assert msgs is not None
    assert "A" * 47 + "END" in msgs[1]["content"] and "A" * 48 not in msgs[1]["content"]


@pytest.mark.parametrize(
    ("completion", "parsed"),
    [
        ("<memory>Opponent cycles R, P, S.</memory>", "Opponent cycles R, P, S."),
        ("Sure! Here it is:\n<memory>\n- plays paper after losing\n</memory>\nGood luck.", "- plays paper after losing"),
        ("<think>hmm <memory>draft</memory></think><memory>final</memory>", "final"),
        ("<memory>first</memory> then <memory>second</memory>", "second"),
        ("<MEMORY>upper</MEMORY>", "upper"),
        ("<memory>cut off by the token limit", "cut off by the token limit"),
        ("no wrapper at all", "no wrapper at all"),
        ("```\nfenced lesson\n```", "fenced lesson"),
        ("<memory>   </memory>", ""),
        ("<think>only thinking", ""),
        ("", ""),
        (None, ""),
    ],
)
def test_parse_memory(completion: str | None, parsed: str) -> None:
    assert parse_memory(completion) == parsed


@pytest.mark.parametrize("name", ["reflection", "memopilot"])
def test_rewrite_apply_parses_bounds_and_keeps_old_memory_on_empty(name: str) -> None:
    m = get_method(name, max_chars=40)
    assert m.apply("old", INTER, "<memory>Opponent copies my last move.</memory>") == "Opponent copies my last move."
    assert m.apply("old lesson", INTER, "") == "old lesson"
    assert m.apply("old lesson", INTER, None) == "old lesson"
    assert m.apply("old lesson", INTER, "<memory>\n</memory>") == "old lesson"
    long = "line one is here\nline two is here\nline three is here\n"
    assert m.apply("", INTER, f"<memory>{long}</memory>") == "line one is here\nline two is here"
    assert len(m.apply("", INTER, "x" * 100)) == 40


# --- structured memopilot (a game's actions given) -------------------------------------------------


def test_structured_memopilot_writes_note_and_next_move() -> None:
    m = get_method("memopilot", max_chars=200, actions=("rock", "paper", "scissors"))
    assert m.name == "memopilot" and m.needs_model
    schema = m.response_schema
    assert schema["properties"]["next"]["enum"] == ["rock", "paper", "scissors"]
    assert schema["required"] == ["note", "next"] and schema["properties"]["note"]["maxLength"] == 80
    prompt = m.prompt("old", Interaction("Round 1: you rock, opponent paper -> you lost", "0 won"))
    assert "rock, paper, scissors" in prompt[0]["content"] and "Round 1: you rock" in prompt[1]["content"]
    assert m.apply("old", Interaction("x"), '{"note": " loves rock ", "next": "paper"}') == "loves rock\nNext move: paper"
    assert m.apply("old", Interaction("x"), '{"note": "", "next": "scissors"}') == "Next move: scissors"


@pytest.mark.parametrize("completion", [None, "", "not json", '["paper"]', '{"note": "x", "next": "lizard"}', '{"note": "x"}'])
def test_structured_memopilot_keeps_the_old_memory_on_a_bad_reply(completion: str | None) -> None:
    m = get_method("memopilot", max_chars=200, actions=("rock", "paper", "scissors"))
    assert m.apply("the old memory", Interaction("x"), completion) == "the old memory"


def test_structured_memory_is_bounded_and_keeps_the_move() -> None:
    m = get_method("memopilot", max_chars=30, actions=("fold", "call"))
    out = m.apply("", Interaction("x"), '{"note": "' + "n" * 200 + '", "next": "call"}')
    assert len(out) == 30 and out.endswith("\nNext move: call")


def test_actions_make_only_memopilot_structured() -> None:
    acts = ("rock", "paper")
    assert get_method("reflection", actions=acts).response_schema is None
    assert get_method("append-all", actions=acts).response_schema is None
    assert get_method("none", actions=acts).response_schema is None
    assert get_method("memopilot").response_schema is None  # no actions: free text, as served
    with pytest.raises(ValueError, match="action"):
        get_method("memopilot", actions=())

"""The agent text protocol: prompts, messages, reward text, answer parsing.

See docs/architecture.md, "Agent text protocol".
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from envs.registry import EnvSpec
from ragen_core.protocol import (
    SPECIAL_TOKENS,
    ParsedResponse,
    ProtocolConfig,
    TurnRecord,
    _find_answer,
    _find_think_answer,
    build_messages,
    first_user_content,
    forced_prefix,
    format_hint,
    format_reward,
    instruction_prefix,
    join_actions,
    next_user_content,
    normalized_response,
    parse_response,
    system_content,
)

THINK = ProtocolConfig()
NOTHINK = ProtocolConfig(enable_think=False)
ACTIONS = ["Up", "Down", "Left", "Right"]
FMT_THINK = "<think> [Your thoughts] </think> <answer> [your answer] </answer>"
FMT_NOTHINK = "<answer> [your answer] </answer>"


class FakeEnv:
    """Only what instruction_prefix reads."""

    def __init__(self, actions: list[str] | None, grid_vocab: dict[str, str] | None) -> None:
        self.actions = actions
        self.grid_vocab = grid_vocab


SPEC = EnvSpec(tag="Fake", env_type="fake", env_instruction="Push the box.", max_actions_per_traj=10)


# ------------------------------------------------------------------------------- config
def test_config_defaults_are_ragen_base_yaml() -> None:
    c = ProtocolConfig()
    assert (c.enable_think, c.action_sep, c.max_actions_per_turn, c.format_penalty) == (True, "||", 5, -0.1)
    assert (c.max_context_window, c.system_prompt, c.max_turn) == (-1, "You're a helpful assistant. ", 5)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_actions_per_turn": 0},
        {"format_penalty": 0.1},
        {"format_penalty": float("nan")},
        {"max_context_window": 0},
        {"max_context_window": -2},
        {"action_sep": ""},
        {"max_turn": 0},
        {"no_such_key": 1},
        {"window_training": "every_turn"},  # the full history already trains every turn
        {"window_training": "each", "max_context_window": 1},
    ],
)
def test_config_rejects(kwargs: dict) -> None:
    with pytest.raises(ValidationError):
        ProtocolConfig(**kwargs)


def test_config_accepts_edges() -> None:
    ProtocolConfig(max_context_window=1, format_penalty=0.0, action_sep="|", max_actions_per_turn=1)
    ProtocolConfig(max_context_window=1, window_training="every_turn")


def test_every_turn_without_a_window_names_the_keys_and_the_fix() -> None:
    with pytest.raises(
        ValidationError, match=r"set agent.max_context_window to k >= 1, or agent.window_training=last"
    ):
        ProtocolConfig(window_training="every_turn")


# ------------------------------------------------------------------------------- prefix
def test_instruction_prefix_discrete() -> None:
    env = FakeEnv(ACTIONS, {"#": "wall", "P": "player"})
    assert instruction_prefix(SPEC, env, THINK) == (
        "Push the box.\nThe meaning of each symbol in the state is:\n#: wall, P: player"
        "\nYour available actions are:\nUp, Down, Left, Right"
        '\nYou can make up to 10 actions, separated by the action separator " || "\n'
    )


def test_instruction_prefix_uses_env_vocab_and_sep() -> None:
    # the env's own legend (docs/architecture.md, "Deliberate differences from RAGEN": grid legend)
    env = FakeEnv(["A"], {"W": "wall", ".": "empty"})
    cfg = ProtocolConfig(action_sep="|")
    spec = EnvSpec(tag="X", env_type="x", env_instruction="I.", max_actions_per_traj=3)
    assert instruction_prefix(spec, env, cfg) == (
        "I.\nThe meaning of each symbol in the state is:\nW: wall, .: empty"
        '\nYour available actions are:\nA\nYou can make up to 3 actions, separated by the action separator " | "\n'
    )


def test_instruction_prefix_free_text() -> None:
    assert instruction_prefix(SPEC, FakeEnv(None, None), THINK) == "Push the box."
    assert instruction_prefix(SPEC, FakeEnv(None, {}), THINK) == "Push the box."


def test_forced_prefix_and_hint() -> None:
    assert forced_prefix(THINK) == "<think>"
    assert forced_prefix(NOTHINK) == "<answer>"
    assert format_hint(THINK) == FMT_THINK
    assert format_hint(NOTHINK) == FMT_NOTHINK


# ------------------------------------------------------------------------------- reward text
@pytest.mark.parametrize(
    ("x", "text"),
    [
        (-0.30000000000000004, "-0.3"),
        (1.0, "1.0"),
        (0.0, "0.0"),
        (-0.0, "0.0"),
        (-0.001, "0.0"),
        (0.1, "0.1"),
        (0.15, "0.15"),
        (10.9, "10.9"),
        (10.6000000001, "10.6"),
        (-1.2345, "-1.23"),
        (11, "11.0"),
        (0.999, "1.0"),
    ],
)
def test_format_reward(x: float, text: str) -> None:
    assert format_reward(x) == text


@given(st.floats(min_value=-1e6, max_value=1e6, allow_nan=False))
def test_format_reward_at_most_two_decimals(x: float) -> None:
    s = format_reward(x)
    whole, _, frac = s.partition(".")
    assert 1 <= len(frac) <= 2 and whole.lstrip("-").isdigit()
    assert abs(float(s) - x) <= 0.005 + 1e-9 * max(1.0, abs(x))


# ------------------------------------------------------------------------------- messages
PREFIX = (
    "Push the box.\nThe meaning of each symbol in the state is:\n#: wall, P: player"
    '\nYour available actions are:\nUp, Down, Left, Right\nYou can make up to 10 actions, separated by the action separator " || "\n'
)


def tail(n: int, fmt: str = FMT_THINK) -> str:
    return (
        f"You have {n} actions left. Always output: {fmt} with no extra text. "
        "Strictly follow this format. Max response length: 100 words (tokens).\n"
    )


def sokoban_history(think: bool = True) -> list[TurnRecord]:
    def resp(t: str, a: str) -> str:
        return f"<think>{t}</think><answer>{a}</answer>" if think else f"<answer>{a}</answer>"

    return [
        TurnRecord(state="#P_#", actions_left=10, response=resp("right", "Right || Right"), reward=-0.2),
        TurnRecord(state="#_P#", actions_left=8, response=resp("up", "Up"), reward=-0.30000000000000004),
        TurnRecord(state="#P##", actions_left=7, response=resp("push", "Left"), reward=10.9),
        TurnRecord(state="#S##", actions_left=6),
    ]


def test_full_three_turn_conversation_think() -> None:
    h = sokoban_history()
    gen = build_messages(PREFIX, h, THINK, 100)
    first = (
        "Push the box.\nThe meaning of each symbol in the state is:\n#: wall, P: player"
        "\nYour available actions are:\nUp, Down, Left, Right"
        '\nYou can make up to 10 actions, separated by the action separator " || "\n'
        "\nTurn 1:\nState:\n#P_#\nYou have 10 actions left. Always output: <think> [Your thoughts] </think> "
        "<answer> [your answer] </answer> with no extra text. Strictly follow this format. "
        "Max response length: 100 words (tokens).\n"
    )
    assert gen == [
        {"role": "system", "content": "You're a helpful assistant. "},
        {"role": "user", "content": first},
        {"role": "assistant", "content": "<think>right</think><answer>Right || Right</answer>"},
        {"role": "user", "content": "Reward:\n-0.2\n\nTurn 2:\nState:\n#_P#\n" + tail(8)},
        {"role": "assistant", "content": "<think>up</think><answer>Up</answer>"},
        {"role": "user", "content": "Reward:\n-0.3\n\nTurn 3:\nState:\n#P##\n" + tail(7)},
        {"role": "assistant", "content": "<think>push</think><answer>Left</answer>"},
        {"role": "user", "content": "Reward:\n10.9\n\nTurn 4:\nState:\n#S##\n" + tail(6)},
    ]
    # Training: the final observation and the reward after the last turn are dropped.
    assert build_messages(PREFIX, h, THINK, 100, for_generation=False) == gen[:-1]


def test_full_three_turn_conversation_no_think() -> None:
    h = sokoban_history(think=False)
    msgs = build_messages(PREFIX, h, NOTHINK, 100, for_generation=False)
    assert [m["role"] for m in msgs] == [
        "system",
        "user",
        "assistant",
        "user",
        "assistant",
        "user",
        "assistant",
    ]
    assert msgs[1]["content"] == PREFIX + "\nTurn 1:\nState:\n#P_#\n" + tail(10, FMT_NOTHINK)
    assert msgs[2]["content"] == "<answer>Right || Right</answer>"
    assert msgs[3]["content"] == "Reward:\n-0.2\n\nTurn 2:\nState:\n#_P#\n" + tail(8, FMT_NOTHINK)
    assert msgs[5]["content"] == "Reward:\n-0.3\n\nTurn 3:\nState:\n#P##\n" + tail(7, FMT_NOTHINK)
    assert msgs[6]["content"] == "<answer>Left</answer>"


def test_first_turn_prompt_and_empty_history() -> None:
    h = sokoban_history()[:1]
    h = [TurnRecord(state=h[0].state, actions_left=10)]
    assert build_messages(PREFIX, h, THINK, 100) == [
        {"role": "system", "content": "You're a helpful assistant. "},
        {"role": "user", "content": PREFIX + "\nTurn 1:\nState:\n#P_#\n" + tail(10)},
    ]
    assert build_messages(PREFIX, h, THINK, 100, for_generation=False) == [
        {"role": "system", "content": "You're a helpful assistant. "},
        {"role": "user", "content": PREFIX},
    ]


def test_generation_without_pending_record_ends_with_reward() -> None:
    h = sokoban_history()[:3]
    gen = build_messages(PREFIX, h, THINK, 100)
    assert gen[-1] == {"role": "user", "content": "Reward:\n10.9\n"}
    assert build_messages(PREFIX, h, THINK, 100, for_generation=False)[-1]["role"] == "assistant"


def test_context_window_reference_case() -> None:
    """RAGEN's test_context_window intent: 3 played turns, k=2.

    See docs/architecture.md, "Deliberate differences from RAGEN": context window.
    """
    cfg = ProtocolConfig(max_context_window=2, enable_think=False, action_sep="|")
    h = [
        TurnRecord(state="S1", actions_left=3, response="R1", reward=0.1),
        TurnRecord(state="S2", actions_left=2, response="R2", reward=0.2),
        TurnRecord(state="S3", actions_left=1, response="R3", reward=0.3),
    ]
    msgs = build_messages("P", h, cfg, 100, for_generation=False)
    text = "".join(m["content"] for m in msgs)
    assert "S1" not in text and "S2" in text and "S3" in text
    assert msgs[1]["content"] == "P\nTurn 1:\nState:\nS2\n" + tail(2, FMT_NOTHINK)
    assert msgs[3]["content"] == "Reward:\n0.2\n\nTurn 2:\nState:\nS3\n" + tail(1, FMT_NOTHINK)
    assert msgs[-1] == {"role": "assistant", "content": "R3"}
    assert "Reward:\n0.3" not in text


def test_context_window_same_for_generation_and_training() -> None:
    """The training window of the last turn is the prompt that generated it, plus the response."""
    h = sokoban_history()
    for k in (1, 2, 3):
        cfg = ProtocolConfig(max_context_window=k)
        for t in range(1, 4):
            prompt = build_messages(
                PREFIX, [*h[: t - 1], TurnRecord(h[t - 1].state, h[t - 1].actions_left)], cfg, 100
            )
            train = build_messages(PREFIX, h[:t], cfg, 100, for_generation=False)
            assert train == [*prompt, {"role": "assistant", "content": h[t - 1].response}]
            assert "\nTurn 1:\n" in prompt[1]["content"]  # numbering restarts inside the window
    gen = build_messages(PREFIX, h, ProtocolConfig(max_context_window=2), 100)
    assert gen[1]["content"] == PREFIX + "\nTurn 1:\nState:\n#P##\n" + tail(7)
    assert gen[3]["content"] == "Reward:\n10.9\n\nTurn 2:\nState:\n#S##\n" + tail(6)
    assert len(gen) == 4


records = st.builds(
    TurnRecord,
    state=st.text(max_size=8),
    actions_left=st.integers(0, 10),
    response=st.text(max_size=8),
    reward=st.floats(-20, 20),
)


@given(
    played=st.lists(records, max_size=6),
    pending=st.booleans(),
    k=st.sampled_from([-1, 1, 2, 3, 7]),
    think=st.booleans(),
)
def test_build_messages_is_the_composition_of_the_pieces(
    played: list[TurnRecord], pending: bool, k: int, think: bool
) -> None:
    """A token-level runner grows the conversation from the pieces; build_messages must agree."""
    cfg = ProtocolConfig(max_context_window=k, enable_think=think)
    history = [*played, TurnRecord(state="last", actions_left=1)] if pending else played
    for for_generation in (True, False):
        recs = list(history) if for_generation or not pending else list(played)
        window = recs[-k:] if k > 0 else recs
        conv = [{"role": "system", "content": system_content(cfg)}]
        if not window:
            conv.append({"role": "user", "content": "PFX"})
        for i, rec in enumerate(window):
            if i == 0:
                conv.append({"role": "user", "content": first_user_content("PFX", rec, 1, cfg, 77)})
            else:
                conv.append(
                    {"role": "user", "content": next_user_content(window[i - 1], rec, i + 1, cfg, 77)}
                )
            if rec.response is not None:
                conv.append({"role": "assistant", "content": rec.response})
        if for_generation and window and window[-1].response is not None:
            conv.append({"role": "user", "content": f"Reward:\n{format_reward(window[-1].reward)}\n"})
        assert build_messages("PFX", history, cfg, 77, for_generation) == conv


@given(played=st.lists(records, min_size=1, max_size=5))
def test_generation_prompts_grow_by_appending(played: list[TurnRecord]) -> None:
    """Full history: the prompt of turn t+1 extends prompt(t) + response(t) (token-in/token-out)."""
    pend = [TurnRecord(state=r.state, actions_left=r.actions_left) for r in played]
    for t in range(len(played) - 1):
        before = build_messages("P", [*played[:t], pend[t]], THINK, 50)
        after = build_messages("P", [*played[: t + 1], pend[t + 1]], THINK, 50)
        assert after[: len(before)] == before
        assert after[len(before)] == {"role": "assistant", "content": played[t].response}
        assert after[len(before) + 1]["content"] == next_user_content(
            played[t], pend[t + 1], t + 2, THINK, 50
        )
        assert len(after) == len(before) + 2


# ------------------------------------------------------------------------------- parsing
def parse(text: str, cfg: ProtocolConfig = THINK, valid: list[str] | None = ACTIONS) -> ParsedResponse:
    return parse_response(text, cfg, valid)


def test_parse_basic() -> None:
    r = parse("<think>go right</think><answer>Right || Up</answer>")
    assert (r.think, r.answer, r.actions, r.format_ok) == ("go right", "Right || Up", ["Right", "Up"], True)
    assert r.normalized == "<think>go right</think><answer>Right || Up</answer>"
    assert r.matched and r.n_dropped == 0 and r.n_truncated == 0


def test_parse_whitespace_and_extra_text_after() -> None:
    r = parse("<think>  a \n</think>\n \t<answer> up </answer> and then some chatter <answer>Down</answer>")
    assert r.actions == ["Up"] and r.format_ok
    assert r.normalized == "<think>a</think><answer>up</answer>"


def test_parse_unicode_whitespace_between_parts() -> None:
    r = parse("<think>√ 箱子</think>\u3000<answer>Left</answer>")
    assert r.actions == ["Left"] and r.think == "√ 箱子"


@pytest.mark.parametrize(
    "text",
    [
        "<think>no close <answer>Up</answer>",  # missing </think>
        "<think>a</think> so <answer>Up</answer>",  # text between </think> and <answer>
        "<think>a</think>",  # missing answer
        "<think>a</think><answer>Up",  # unclosed answer
        "<think>a</think></answer>Up<answer>",  # reversed tags
        "Up || Down",  # no tags at all
        "",
        "<THINK>a</THINK><ANSWER>Up</ANSWER>",  # tags are case-sensitive (as RAGEN's regex)
    ],
)
def test_parse_no_match_is_penalised(text: str) -> None:
    r = parse(text)
    assert not r.matched and not r.format_ok and r.actions == []
    assert r.normalized == text  # RAGEN keeps the raw text when nothing matched


def test_parse_nested_and_repeated_tags() -> None:
    r = parse("<think>a<think>b</think><answer>Up</answer><think>c</think><answer>Down</answer>")
    assert r.think == "ab" and r.actions == ["Up"] and r.format_ok
    # the first </think> not followed by <answer> is part of the thought
    r = parse("<think>x</think>y</think><answer>Down</answer>")
    assert r.think == "xy" and r.actions == ["Down"]
    r = parse("<think>x</think><answer><answer>Up</answer></answer>")
    assert r.answer == "Up" and r.actions == ["Up"]


def test_parse_special_tokens_removed() -> None:
    r = parse("<think><|im_start|>t<|im_end|></think><answer>Up<|im_end|> || <ans<answer>wer>Down</answer>")
    assert r.think == "t" and r.actions == ["Up", "Down"]
    assert not any(
        tok in r.normalized[len("<think>") : -len("</answer>")].replace("</think><answer>", "")
        for tok in SPECIAL_TOKENS
    )


def test_parse_mixed_case_maps_to_canonical_names() -> None:
    r = parse("<think></think><answer>uP || DOWN ||  left </answer>")
    assert r.actions == ["Up", "Down", "Left"] and r.format_ok
    assert r.answer == "uP || DOWN ||  left"  # the model's text is kept as written


def test_parse_unknown_action_dropped_and_penalised() -> None:
    r = parse("<think></think><answer>Up || Jump || Down</answer>")
    assert r.actions == ["Up", "Down"] and r.n_dropped == 1 and not r.format_ok


@pytest.mark.parametrize("answer", ["", "   ", " || ", "||||"])
def test_parse_empty_answer_penalised(answer: str) -> None:
    for valid in (ACTIONS, None):
        r = parse(f"<think>t</think><answer>{answer}</answer>", valid=valid)
        assert r.matched and r.actions == [] and not r.format_ok


def test_parse_more_actions_than_allowed() -> None:
    r = parse("<think></think><answer>Up||Up||Down||Down||Left||Jump||Right</answer>")
    # kept: the first 5; the unknown 6th is cut before validation (as RAGEN), so no penalty
    assert r.actions == ["Up", "Up", "Down", "Down", "Left"] and r.format_ok and r.n_truncated == 2
    assert r.answer == "Up || Up || Down || Down || Left"
    assert r.normalized == "<think></think><answer>Up || Up || Down || Down || Left</answer>"


def test_parse_custom_separator_and_max() -> None:
    cfg = ProtocolConfig(action_sep="|", max_actions_per_turn=2)
    r = parse("<think></think><answer>Up | Down | Left</answer>", cfg)
    assert r.actions == ["Up", "Down"] and r.answer == "Up | Down"


def test_parse_free_text() -> None:
    r = parse("<think>2+5=7</think><answer> 2 + 5 - 3 </answer>", valid=None)
    assert r.actions == ["2 + 5 - 3"] and r.format_ok
    r = parse("<answer>42</answer>", NOTHINK, valid=None)
    assert r.actions == ["42"] and r.normalized == "<answer>42</answer>"


def test_parse_no_think_mode() -> None:
    r = parse("<answer>Up || Left</answer> trailing", NOTHINK)
    assert r.actions == ["Up", "Left"] and r.think == "" and r.normalized == "<answer>Up || Left</answer>"
    assert not parse("<think>x</think>Up", NOTHINK).format_ok


@pytest.mark.parametrize("cfg", [THINK, NOTHINK, ProtocolConfig(action_sep="|")])
def test_written_replies_read_back_as_written(cfg: ProtocolConfig) -> None:
    """join_actions and normalized_response write what parse_response reads and writes back."""
    answer = join_actions(["Up", "Left"], cfg)
    text = normalized_response("go", answer, cfg)
    r = parse_response(text, cfg, ACTIONS)
    assert r.format_ok and r.actions == ["Up", "Left"] and r.normalized == text


def test_parse_discrete_env_with_empty_vocabulary() -> None:
    assert not parse("<think></think><answer>Up</answer>", valid=[]).format_ok


# Hypothesis -------------------------------------------------------------------------------
PIECES = [
    "<think>",
    "</think>",
    "<answer>",
    "</answer>",
    "<|im_end|>",
    " ",
    "\n",
    "\u3000",
    "\x1c",
    "Up",
    "x",
    "||",
    "<",
    ">",
    "é",
]
token_text = st.lists(st.sampled_from(PIECES), max_size=14).map("".join)
any_text = st.one_of(st.text(max_size=60), token_text)
THINK_RE = re.compile(r"<think>(.*?)</think>\s*<answer>(.*?)</answer>", re.DOTALL)
ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


@settings(max_examples=300)
@given(
    text=any_text,
    think=st.booleans(),
    sep=st.sampled_from(["||", "|", " "]),
    valid=st.sampled_from([ACTIONS, None]),
)
def test_parse_never_raises_and_is_consistent(
    text: str, think: bool, sep: str, valid: list[str] | None
) -> None:
    cfg = ProtocolConfig(enable_think=think, action_sep=sep)
    r = parse_response(text, cfg, valid)
    assert len(r.actions) <= cfg.max_actions_per_turn
    if valid is not None:
        assert all(a in ACTIONS for a in r.actions)
    assert r.format_ok == (r.matched and bool(r.actions) and r.n_dropped == 0)
    if r.matched:  # the normalised text parses back to itself
        again = parse_response(r.normalized, cfg, valid)
        assert again.normalized == r.normalized and again.actions == r.actions
        for tok in SPECIAL_TOKENS:
            assert tok not in r.think and tok not in r.answer


@settings(max_examples=400)
@given(token_text)
def test_linear_matchers_equal_the_reference_regex(text: str) -> None:
    m = THINK_RE.search(text)
    assert _find_think_answer(text) == (None if m is None else (m.group(1), m.group(2)))
    m = ANSWER_RE.search(text)
    assert _find_answer(text) == (None if m is None else m.group(1))


VALID_NAMES = st.sampled_from(ACTIONS).flatmap(
    lambda a: st.sampled_from([a, a.lower(), a.upper(), f" {a} ", f"\t{a.swapcase()}"])
)
INVALID_NAMES = st.sampled_from(["Jump", "up2", "U p", "Upp", "↑", "Stay", "no-op"])
NAMES = st.lists(st.one_of(VALID_NAMES, INVALID_NAMES, st.sampled_from(["", " ", "\n"])), max_size=8)
STRUCTURES = [
    "ok",
    "ok_ws",
    "ok_trailing",
    "no_open_answer",
    "no_close_answer",
    "no_close_think",
    "junk_between",
]


@settings(max_examples=300)
@given(names=NAMES, structure=st.sampled_from(STRUCTURES), think_text=st.sampled_from(["", "plan", "√ ok"]))
def test_format_penalty_oracle(names: list[str], structure: str, think_text: str) -> None:
    answer = " || ".join(names)
    text = {
        "ok": f"<think>{think_text}</think><answer>{answer}</answer>",
        "ok_ws": f"<think>{think_text}</think> \n<answer>{answer}</answer>",
        "ok_trailing": f"<think>{think_text}</think><answer>{answer}</answer> I hope this works.",
        "no_open_answer": f"<think>{think_text}</think>{answer}</answer>",
        "no_close_answer": f"<think>{think_text}</think><answer>{answer}",
        "no_close_think": f"<think>{think_text}<answer>{answer}</answer>",
        "junk_between": f"<think>{think_text}</think>so<answer>{answer}</answer>",
    }[structure]
    r = parse_response(text, THINK, ACTIONS)
    items = [n.strip() for n in names if n.strip()][:5]
    canon = {a.lower(): a for a in ACTIONS}
    expect_ok = structure.startswith("ok") and bool(items) and all(i.lower() in canon for i in items)
    assert r.format_ok == expect_ok
    if structure.startswith("ok"):
        assert r.actions == [canon[i.lower()] for i in items if i.lower() in canon]
    else:
        assert r.actions == []


# Pathological inputs ----------------------------------------------------------------------
# Each builds a text of about ``n`` characters. The parser must stay linear on them: catastrophic
# regex backtracking is quadratic or worse, which on 1 MB means hours, not seconds. Linear parsing
# takes well under 0.1 s here; the bound is far above that, so a loaded machine does not trip it.
MB = 1 << 20
PATHOLOGICAL: dict[str, Callable[[int], str]] = {
    "open_thinks": lambda n: "<think>" * (n // 7),
    "open_answers": lambda n: "<answer>" * (n // 8),
    "close_thinks": lambda n: "<think>" + "</think>" * (n // 8),
    "close_thinks_ws": lambda n: "<think>" + "</think> \n " * (n // 12),
    "unclosed_answer": lambda n: "<think>x</think><answer>" + "a" * n,
    "no_tags": lambda n: "x" * n,
}
PARSE_PATHOLOGICAL: dict[str, Callable[[int], str]] = {
    **PATHOLOGICAL,
    "many_actions": lambda n: "<think>x</think><answer>" + "Up || " * (n // 6) + "</answer>",
    "many_eos": lambda n: "<think>x</think><answer>" + "<|im_end|>" * (n // 10) + "</answer>",
    "split_tags": lambda n: (
        "<think>x</think><answer>" + "<ans" * (n // 16) + "<answer>" + "wer>" * (n // 16) + "</answer>"
    ),
}
BOUND_S = 5.0


def _best_of(fn: Callable[[], object], n: int = 2) -> float:
    best = float("inf")
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


@pytest.mark.parametrize("name", sorted(PATHOLOGICAL))
def test_matching_one_megabyte_stays_bounded(name: str) -> None:
    text = PATHOLOGICAL[name](MB)
    assert _best_of(lambda: _find_think_answer(text)) < BOUND_S
    assert _best_of(lambda: _find_answer(text)) < BOUND_S


@pytest.mark.parametrize("name", sorted(PARSE_PATHOLOGICAL))
def test_parse_one_megabyte_stays_bounded(name: str) -> None:
    text = PARSE_PATHOLOGICAL[name](MB)
    for cfg in (THINK, NOTHINK):
        assert _best_of(lambda cfg=cfg: parse_response(text, cfg, ACTIONS)) < BOUND_S
        r = parse_response(text, cfg, ACTIONS)
        assert r is not None and len(r.actions) <= 5

"""The agent text protocol: instruction prefix, chat messages, format hint, answer parsing.

This is RAGEN's ``ctx_manager`` reduced to its text: what the model is shown each turn and how its
reply is turned into environment actions (docs/architecture.md, "Agent text protocol"; where it
departs from RAGEN: "Deliberate differences from RAGEN" there). Nothing here tokenises: the
token-level runner builds on the same pieces (:func:`system_content`, :func:`first_user_content`,
:func:`next_user_content`) so that it can grow a conversation turn by turn, appending the
environment's text as new tokens after the sampled ones instead of re-rendering (and re-tokenising)
the whole conversation. :func:`build_messages` is, by construction and by test, exactly the
composition of those pieces.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from envs.base import format_reward

__all__ = [
    "SPECIAL_TOKENS",
    "STATE_IN_MESSAGE",
    "Message",
    "ParsedResponse",
    "ProtocolConfig",
    "TurnRecord",
    "build_messages",
    "first_user_content",
    "forced_prefix",
    "format_hint",
    "format_reward",
    "instruction_prefix",
    "join_actions",
    "next_user_content",
    "normalized_response",
    "parse_response",
    "reward_content",
    "state_content",
    "system_content",
    "turn_content",
]

#: Tokens removed from the think and answer parts (RAGEN's special-token list).
SPECIAL_TOKENS: tuple[str, ...] = (
    "<think>",
    "</think>",
    "<answer>",
    "</answer>",
    "<|im_start|>",
    "<|im_end|>",
)

Message = dict[str, str]


class ProtocolConfig(BaseModel):
    """How the agent is prompted and how its replies are read (RAGEN's ``agent_proxy`` keys plus
    ``es_manager.format_penalty``). Defaults are RAGEN's ``config/base.yaml`` values."""

    model_config = ConfigDict(extra="forbid")

    enable_think: bool = True
    action_sep: str = "||"
    max_actions_per_turn: int = 5
    format_penalty: float = -0.1
    max_context_window: int = -1
    window_training: Literal["last", "every_turn"] = Field(
        default="last",
        description="with max_context_window k > 0, which turns train. last: the stored sequence is the "
        "last k turns and only they train (RAGEN); every_turn: every turn trains on its own prompt, the "
        "window it was generated from, plus its answer (RAGEN-2's turn-level samples), so an episode's "
        'early turns get the trajectory\'s advantage too (docs/architecture.md, "Context window")',
    )
    system_prompt: str = "You're a helpful assistant. "
    max_turn: int = 5
    #: per-episode action budget for every tag (None: each tag's catalogue value); the paper's
    #: actions-per-turn ablation sets it to 5 x max_actions_per_turn
    max_actions_per_traj: int | None = Field(default=None, ge=1)
    action_decoding: Literal["free", "constrained"] = Field(
        default="free",
        description="free: the answer is sampled from the whole vocabulary (RAGEN); constrained: only token "
        "sequences that spell valid actions joined by the separator, then </answer> (the think part stays "
        "free); the learner trains the same renormalised policy (docs/architecture.md)",
    )

    @field_validator("max_actions_per_turn")
    @classmethod
    def _check_max_actions(cls, v: int) -> int:
        if v < 1:
            raise ValueError("max_actions_per_turn must be >= 1 (the model may always act at least once)")
        return v

    @field_validator("format_penalty")
    @classmethod
    def _check_penalty(cls, v: float) -> float:
        if not v <= 0:  # also rejects NaN
            raise ValueError("format_penalty must be <= 0 (it is a penalty added to the score)")
        return v

    @field_validator("max_context_window")
    @classmethod
    def _check_window(cls, v: int) -> int:
        if v != -1 and v < 1:
            raise ValueError("max_context_window must be -1 (full history) or >= 1 (last k turns)")
        return v

    @model_validator(mode="after")
    def _check_window_training(self) -> ProtocolConfig:
        if self.window_training == "every_turn" and self.max_context_window < 1:
            raise ValueError(
                "window_training=every_turn trains each turn on the context window it was generated from, "
                "and max_context_window is -1 (full history: one sequence already trains every turn); set "
                "agent.max_context_window to k >= 1, or agent.window_training=last"
            )
        return self

    @field_validator("action_sep")
    @classmethod
    def _check_sep(cls, v: str) -> str:
        if not v:
            raise ValueError("action_sep must be a non-empty string such as '||'")
        return v

    @field_validator("max_turn")
    @classmethod
    def _check_max_turn(cls, v: int) -> int:
        if v < 1:
            raise ValueError("max_turn must be >= 1")
        return v


class _SpecLike(Protocol):
    # read-only: the catalogue's EnvSpec is a frozen dataclass
    @property
    def env_instruction(self) -> str: ...
    @property
    def max_actions_per_traj(self) -> int: ...


class _EnvLike(Protocol):
    actions: list[str] | None
    grid_vocab: dict[str, str] | None


# --------------------------------------------------------------------------------------------
# Prompt pieces
# --------------------------------------------------------------------------------------------


def instruction_prefix(spec: _SpecLike, env: _EnvLike, cfg: ProtocolConfig) -> str:
    """The per-tag instruction that opens the first user message (docs/architecture.md, "Agent text
    protocol").

    The legend is taken from the env instance's ``grid_vocab`` (it describes the
    symbols actually drawn, unlike RAGEN which used the dataclass default) and the action list
    from ``env.actions``; free-text envs (``actions is None``) get neither the list nor the
    budget line, as in RAGEN. Call it after ``reset`` if an env's vocabulary depends on the seed.
    """
    prefix = spec.env_instruction
    if env.grid_vocab:
        legend = ", ".join(f"{sym}: {meaning}" for sym, meaning in env.grid_vocab.items())
        prefix += "\nThe meaning of each symbol in the state is:\n" + legend
    if env.actions is not None:
        prefix += "\nYour available actions are:\n" + ", ".join(env.actions)
        prefix += (
            f"\nYou can make up to {spec.max_actions_per_traj} actions, "
            f'separated by the action separator " {cfg.action_sep} "\n'
        )
    return prefix


def forced_prefix(cfg: ProtocolConfig) -> str:
    """Text appended after the generation prompt and fed to the model before it samples.

    The parser expects it back: callers pass ``forced_prefix(cfg) + generated_text``.
    """
    return "<think>" if cfg.enable_think else "<answer>"


def format_hint(cfg: ProtocolConfig) -> str:
    """The output format the model is told to follow each turn (docs/architecture.md, "Agent text
    protocol")."""
    if cfg.enable_think:
        return "<think> [Your thoughts] </think> <answer> [your answer] </answer>"
    return "<answer> [your answer] </answer>"


def join_actions(actions: Sequence[str], cfg: ProtocolConfig) -> str:
    """Actions as one answer, written with the separator the instruction prefix announces."""
    return f" {cfg.action_sep} ".join(actions)


def normalized_response(think: str, answer: str, cfg: ProtocolConfig) -> str:
    """A reply in the normalised form :func:`parse_response` writes (the form training shows):
    the tags with no blanks between them, and no think part when thinking is off."""
    if cfg.enable_think:
        return f"<think>{think}</think><answer>{answer}</answer>"
    return f"<answer>{answer}</answer>"


@dataclass
class TurnRecord:
    """One entry of an env's history: the state shown at the start of a turn and, once the turn
    has been played, what the model answered and what it did.

    A history is ``[played, played, ..., pending]``: ``reset`` appends a pending record (no
    response) and each step fills the pending one and appends the next, as in RAGEN's ``ctx_manager``.
    """

    state: str
    actions_left: int
    response: str | None = None  # normalised response (what text-level training/context shows)
    raw_response: str | None = None  # forced prefix + generated text, as given to the parser
    actions: list[str] = field(default_factory=list)  # executed action names
    reward: float = 0.0  # sum of the executed actions' env rewards
    info: dict[str, Any] = field(default_factory=dict)  # info of the turn's last executed action
    format_ok: bool = True
    penalty: float = 0.0  # format penalty charged this turn (0 or cfg.format_penalty)

    @property
    def played(self) -> bool:
        return self.response is not None


def system_content(cfg: ProtocolConfig) -> str:
    """Content of the system message."""
    return cfg.system_prompt


#: The state inside a user message (what :func:`state_content` wrote): views that render Markdown
#: find it here to show it as a code block, where a grid keeps its lines and underscores.
STATE_IN_MESSAGE = re.compile(r"(?<=State:\n)(.*?)(?=\nYou have -?\d+ actions left\. )", re.DOTALL)


def state_content(record: TurnRecord, cfg: ProtocolConfig, max_tokens: int) -> str:
    """The state block of one turn (docs/architecture.md, "Agent text protocol"); keep
    ``STATE_IN_MESSAGE`` in step with it."""
    return (
        f"State:\n{record.state}\nYou have {record.actions_left} actions left. "
        f"Always output: {format_hint(cfg)} with no extra text. Strictly follow this format. "
        f"Max response length: {max_tokens} words (tokens).\n"
    )


def turn_content(record: TurnRecord, t: int, cfg: ProtocolConfig, max_tokens: int) -> str:
    """``"\\nTurn {t}:\\n"`` followed by the state block."""
    return f"\nTurn {t}:\n" + state_content(record, cfg, max_tokens)


def reward_content(reward: float) -> str:
    """The feedback that opens the user message following an assistant turn."""
    return f"Reward:\n{format_reward(reward)}\n"


def first_user_content(prefix: str, record: TurnRecord, t: int, cfg: ProtocolConfig, max_tokens: int) -> str:
    """The first user message: instruction prefix + the first (windowed) turn, numbered ``t``."""
    return prefix + turn_content(record, t, cfg, max_tokens)


def next_user_content(
    prev_record: TurnRecord, record: TurnRecord, t: int, cfg: ProtocolConfig, max_tokens: int
) -> str:
    """The user message that follows the assistant turn of ``prev_record``: its reward, then the
    next turn's state. This is what a token-level runner appends after the sampled tokens."""
    return reward_content(prev_record.reward) + turn_content(record, t, cfg, max_tokens)


def build_messages(
    prefix: str,
    history: Sequence[TurnRecord],
    cfg: ProtocolConfig,
    max_tokens: int,
    for_generation: bool = True,
) -> list[Message]:
    """The chat messages of one trajectory (docs/architecture.md, "Agent text protocol").

    ``for_generation=True``: the prompt for the next turn; ends with a user message (the pending
    record's state, or the last reward if the history has no pending record).
    ``for_generation=False``: the training conversation; the trailing pending record (final
    observation) and the reward after the last played turn are dropped, so it ends with the last
    assistant message.

    ``cfg.max_context_window = k > 0`` keeps the last ``k`` records *after* that drop, numbered
    from 1: the training window of the last turn is then exactly the prompt the model saw when it
    generated that turn, plus its response (docs/architecture.md, "Deliberate differences from
    RAGEN": context window).
    """
    records = list(history)
    if not for_generation:
        while records and not records[-1].played:
            records.pop()
    k = cfg.max_context_window
    if k > 0:
        records = records[-k:]
    messages: list[Message] = [{"role": "system", "content": system_content(cfg)}]
    if not records:
        messages.append({"role": "user", "content": prefix})
        return messages
    for t, rec in enumerate(records, start=1):
        if t == 1:
            content = first_user_content(prefix, rec, t, cfg, max_tokens)
        else:
            content = next_user_content(records[t - 2], rec, t, cfg, max_tokens)
        messages.append({"role": "user", "content": content})
        if rec.played:
            messages.append({"role": "assistant", "content": rec.response or ""})
    if for_generation and records[-1].played:
        messages.append({"role": "user", "content": reward_content(records[-1].reward)})
    return messages


# --------------------------------------------------------------------------------------------
# Parsing
# --------------------------------------------------------------------------------------------


@dataclass
class ParsedResponse:
    """What was read from one reply.

    ``actions`` are the actions to execute: canonical names for discrete envs (unknown names
    dropped, counted in ``n_dropped``), the raw strings for free-text envs. ``raw_actions`` are the
    split answer items as written (after the ``max_actions_per_turn`` cut, ``n_truncated`` items
    beyond it). ``format_ok`` is False when the turn is charged the format penalty.
    """

    think: str
    answer: str
    actions: list[str]
    format_ok: bool
    normalized: str
    n_dropped: int = 0
    matched: bool = False
    raw_actions: list[str] = field(default_factory=list)
    n_truncated: int = 0


_SPECIAL_RE = re.compile("|".join(re.escape(t) for t in SPECIAL_TOKENS))
_MAX_TAG = max(len(t) for t in SPECIAL_TOKENS)
# Possessive \s*+: each </think> is tried once, its whitespace run scanned once (runs are disjoint).
_CLOSE_THINK_OPEN_ANSWER = re.compile(r"</think>\s*+<answer>")


def _find_think_answer(text: str) -> tuple[str, str] | None:
    """First match of ``<think>(.*?)</think>\\s*<answer>(.*?)</answer>`` (DOTALL), in linear time.

    ``re.search`` with that pattern is quadratic on inputs like ``"<think>" * 10**5`` (every start
    is retried to the end). Equivalent reasoning: if any match exists, one starts at the first
    ``<think>`` (``.*?`` may contain anything), its think part ends at the first ``</think>`` that is
    followed by whitespace and ``<answer>``, and its answer part ends at the next ``</answer>``;
    if no ``</answer>`` follows that ``<answer>``, none follows a later one either (so the regex
    would not backtrack to a later ``</think>`` successfully). Tested against ``re`` by hypothesis.
    """
    s = text.find("<think>")
    if s < 0:
        return None
    think_start = s + len("<think>")
    m = _CLOSE_THINK_OPEN_ANSWER.search(text, think_start)
    if m is None:
        return None
    e = text.find("</answer>", m.end())
    if e < 0:
        return None
    return text[think_start : m.start()], text[m.end() : e]


def _find_answer(text: str) -> str | None:
    """First match of ``<answer>(.*?)</answer>`` (DOTALL), linear time."""
    s = text.find("<answer>")
    if s < 0:
        return None
    a = s + len("<answer>")
    e = text.find("</answer>", a)
    return None if e < 0 else text[a:e]


def _strip_nested(s: str) -> str:
    """Remove special tokens until none remain, including ones formed by removing others
    (``<ans<answer>wer>``): a stack over the characters. Slow path, only for adversarial text."""
    out: list[str] = []
    for c in s:
        out.append(c)
        if c == ">":
            tail = "".join(out[-_MAX_TAG:])
            for tok in SPECIAL_TOKENS:
                if tail.endswith(tok):
                    del out[-len(tok) :]
                    break
    return "".join(out)


def _strip_special(s: str) -> str:
    """Remove the special tokens (and the blanks around the part), so that the normalised
    response never carries a chat-control or tag token inside a part."""
    for _ in range(4):
        stripped = _SPECIAL_RE.sub("", s)
        if stripped == s:
            return s.strip()
        s = stripped
    if _SPECIAL_RE.search(s):
        s = _strip_nested(s)
    return s.strip()


def parse_response(
    text: str, cfg: ProtocolConfig, valid_actions: Sequence[str] | None = None
) -> ParsedResponse:
    """Read one reply (docs/architecture.md, "Agent text protocol"). Never raises.

    ``text`` must be ``forced_prefix(cfg) + generated_text`` (the generation prompt ends with the
    forced prefix, so the sampled text does not repeat it). ``valid_actions`` is the env's action
    vocabulary, or ``None`` for free-text envs.

    The format penalty applies (``format_ok=False``) when no answer matches the format, when the
    answer holds no action, or (discrete envs) when any of the kept actions is not a known name.
    Names match case-insensitively after stripping and are replaced by the canonical spelling.
    """
    try:
        return _parse(str(text), cfg, valid_actions)
    except Exception:  # pragma: no cover - defensive: a parser bug must not kill a rollout
        return ParsedResponse(think="", answer="", actions=[], format_ok=False, normalized=str(text))


def _parse(text: str, cfg: ProtocolConfig, valid_actions: Sequence[str] | None) -> ParsedResponse:
    if cfg.enable_think:
        found = _find_think_answer(text)
        think_raw, answer_raw = found if found is not None else ("", "")
    else:
        ans = _find_answer(text)
        found = None if ans is None else ("", ans)
        think_raw, answer_raw = "", ans or ""
    if found is None:
        # RAGEN stores the raw text when nothing matched.
        return ParsedResponse(think="", answer="", actions=[], format_ok=False, normalized=text)

    think = _strip_special(think_raw)
    answer = _strip_special(answer_raw)
    items = [a.strip() for a in answer.split(cfg.action_sep)]
    items = [a for a in items if a]
    n_truncated = max(0, len(items) - cfg.max_actions_per_turn)
    if n_truncated:
        items = items[: cfg.max_actions_per_turn]
        answer = join_actions(items, cfg)

    if valid_actions is None:
        actions = list(items)
        n_dropped = 0
    else:
        canon = {name.strip().lower(): name for name in valid_actions}
        actions = [canon[a.lower()] for a in items if a.lower() in canon]
        n_dropped = len(items) - len(actions)
    format_ok = bool(items) and n_dropped == 0

    return ParsedResponse(
        think=think,
        answer=answer,
        actions=actions,
        format_ok=format_ok,
        normalized=normalized_response(think, answer, cfg),
        n_dropped=n_dropped,
        matched=True,
        raw_actions=items,
        n_truncated=n_truncated,
    )

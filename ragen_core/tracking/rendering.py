"""Episodes and rollouts as people read them: the turns of an episode, the filter's decision, the
summary of a rollouts file per env tag, and their terminal rendering (``ragen show``).

One reading of an episode serves every view of it: :func:`turns_of` aligns the stored conversation
with the per-turn columns (actions, rewards, format penalties) for the terminal transcript and for
the MLflow traces (``episode_traces``); :func:`filter_decision` names the filter's choice for the
terminal and for the transcripts page (``transcripts``). With ``agent.max_context_window`` shorter
than an episode, the trajectory table keeps only the last window of its conversation, numbered from
``info["first_trained_turn"]``; every view numbers turns over the whole episode.

Nothing heavy is imported here (``rich`` only inside the terminal functions), so ``ragen show``
decides what to read before torch loads.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ragen_core.text_safety import printable

if TYPE_CHECKING:  # pragma: no cover
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    from ragen_core.trajectory import Trajectory

#: Terminal colours of the message roles.
ROLE_STYLES = {"system": "dim", "user": "cyan", "assistant": "green"}


# ---------------------------------------------------------------------------- an episode's turns
@dataclass
class Turn:
    """One assistant turn of an episode."""

    index: int  # 0-based over the episode's played turns
    prompt: list[dict[str, str]] | None  # the messages the model saw; None: not stored (window)
    response: str | None  # what the model wrote; None: outside the stored window
    actions: list[str]
    env_reply: str | None  # the next user message; None after the last turn
    reward: float
    format_penalty: float
    info: dict[str, Any]
    position: int | None = None  # the response's place in the stored messages; None: not stored
    #: "constrained" or "free" (``info["turn_decoding"]``); None: a run without constrained decoding
    decoding: str | None = None


def row_info(row: Mapping[str, Any]) -> dict[str, Any]:
    """The ``info`` of a trajectory row: a dict, or the JSON text the Parquet file stores."""
    raw = row.get("info")
    if isinstance(raw, Mapping):
        return dict(raw)
    return json.loads(raw) if raw else {}


def turns_of(row: Mapping[str, Any]) -> list[Turn]:
    """The turns of a trajectory row (a Parquet row as a dict, or :func:`trajectory_row`), aligned
    with its per-turn columns.

    ``messages`` alternate ``system, user, (assistant, user)*, assistant`` and hold the turns from
    ``info["first_trained_turn"]`` on (all of them unless a context window cut the episode)."""
    info = row_info(row)
    messages = [dict(m) for m in row["messages"] or []]
    start = int(info.get("first_trained_turn", 0) or 0)
    n_turns = len(row["turn_rewards"] or [])
    assistant_at = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
    out = []
    for t in range(n_turns):
        j = t - start  # the turn's place among the stored assistant messages
        pos = assistant_at[j] if 0 <= j < len(assistant_at) else None
        # With a window that cut earlier turns, only the last turn's window is the prompt it was given;
        # trained turn by turn, the messages hold every turn, and a turn past the window saw less of them.
        if "segment_starts" in info:
            exact_prompt = pos is not None and t < int(info.get("context_window", 0) or 0)
        else:
            exact_prompt = pos is not None and (start == 0 or t == n_turns - 1)
        out.append(_turn(row, info, messages, t, pos, exact_prompt))
    return out


def _turn(
    row: Mapping[str, Any],
    info: Mapping[str, Any],
    messages: list[dict[str, Any]],
    t: int,
    pos: int | None,
    exact_prompt: bool,
) -> Turn:
    """Turn ``t`` of ``row``, its response at ``pos`` of ``messages`` (None: outside the window)."""
    reply = _item(messages, pos + 1, None) if pos is not None else None
    env_info = _item(info.get("infos") or [], t, {})
    return Turn(
        index=t,
        prompt=messages[:pos] if exact_prompt else None,
        response=messages[pos]["content"] if pos is not None else None,
        actions=list(_item(row["actions"] or [], t, None) or []),
        env_reply=reply["content"] if reply is not None and reply.get("role") == "user" else None,
        reward=float(row["turn_rewards"][t]),
        format_penalty=float(_item(info.get("turn_penalties") or [], t, 0.0)),
        info=dict(env_info) if isinstance(env_info, Mapping) else {},
        position=pos,
        decoding=_item(info.get("turn_decoding") or [], t, None),
    )


def _item(seq: Sequence[Any], t: int, default: Any) -> Any:
    """``seq[t]``, or ``default`` past its end."""
    return seq[t] if t < len(seq) else default


def trajectory_row(t: Trajectory) -> dict[str, Any]:
    """The columns of ``t`` that :func:`turns_of` reads."""
    return {"messages": t.messages, "turn_rewards": t.turn_rewards, "actions": t.actions, "info": t.info}


def fence_states(text: str) -> str:
    """``text`` with each environment state (``protocol.STATE_IN_MESSAGE``) in a code fence, the only
    change: views that render Markdown (MLflow's chat view) join a grid's lines and read its
    underscores as emphasis (the FrozenLake grid ``P_G_``, ``_O__``, ... showed as one line, some
    underscores gone). The fence is longer than any backtick run in the state, so a state cannot
    close it."""
    from ragen_core.protocol import STATE_IN_MESSAGE

    def fence(m: re.Match[str]) -> str:
        ticks = "`" * max(3, 1 + max((len(r) for r in re.findall(r"`+", m.group(1))), default=0))
        return f"{ticks}\n{m.group(1)}\n{ticks}"

    return STATE_IN_MESSAGE.sub(fence, text)


def first_state(text: str) -> str | None:
    """The first environment state in ``text`` (a user message), None if it shows none."""
    from ragen_core.protocol import STATE_IN_MESSAGE

    m = STATE_IN_MESSAGE.search(text)
    return m.group(1) if m else None


def outcome(success: bool) -> str:
    """An episode's outcome in a word (trace names and tags, the transcripts page)."""
    return "success" if success else "failed"


def filter_decision(kept: bool | None) -> str:
    """The filter's decision on an episode's group: ``kept``, ``dropped``, or ``""`` (no filter ran)."""
    return "" if kept is None else ("kept" if kept else "dropped")


# ---------------------------------------------------------------------------- summaries
def response_tokens(t: Trajectory) -> int:
    """Tokens the policy sampled (the loss mask's ones)."""
    return int(sum(t.loss_mask))


def penalised_turns(t: Trajectory) -> tuple[int, int]:
    """(turns charged a format penalty, turns played)."""
    penalties = t.info.get("turn_penalties")
    if isinstance(penalties, list) and penalties:
        return sum(1 for p in penalties if p < 0), len(penalties)
    return (1 if t.format_penalty < 0 else 0), max(t.turn_count, 1)


def summarize(trajs: list[Trajectory], kept: list[bool] | None = None) -> list[dict[str, Any]]:
    """Per env tag (in order of first appearance), then ``all`` when there are several tags.

    Keys: tag, trajectories, success_rate, mean_score, mean_turns, mean_response_tokens,
    format_penalty_rate (share of played turns charged a format penalty), and with ``kept`` (the
    filter's decision per trajectory) ``kept``: how many the filter kept.
    """
    decisions = dict(zip(map(id, trajs), kept, strict=True)) if kept is not None else None

    def row(tag: str, items: list[Trajectory]) -> dict[str, Any]:
        n = len(items)
        pen = [penalised_turns(t) for t in items]
        extra = {"kept": sum(decisions[id(t)] for t in items)} if decisions is not None else {}
        return {
            **extra,
            "tag": tag,
            "trajectories": n,
            "success_rate": sum(t.success for t in items) / n,
            "mean_score": sum(t.score for t in items) / n,
            "mean_turns": sum(t.turn_count for t in items) / n,
            "mean_response_tokens": sum(response_tokens(t) for t in items) / n,
            "format_penalty_rate": sum(p for p, _ in pen) / max(sum(c for _, c in pen), 1),
        }

    by_tag: dict[str, list[Trajectory]] = {}
    for t in trajs:
        by_tag.setdefault(t.env_tag, []).append(t)
    rows = [row(tag, items) for tag, items in by_tag.items()]
    if len(rows) > 1:
        rows.append(row("all", trajs))
    return rows


def success_lines(tags: list[str]) -> list[str]:
    """``success on TAG: <what success means>`` per tag (the environment's ``success_means``)."""
    from envs.registry import success_means

    return [f"success on {tag}: {means}" for tag in tags if (means := success_means(tag))]


# ---------------------------------------------------------------------------- the terminal
def print_transcript(out: Console, index: int, t: Trajectory, kept: bool | None = None) -> None:
    """One trajectory, turn by turn; ``kept``: the filter's decision on its group (None: no filter ran)."""
    from rich.rule import Rule
    from rich.text import Text

    decision = filter_decision(kept)
    out.print(
        Rule(
            Text(
                f"row {index}: {printable(t.env_tag)}  group {t.group_id}  env {t.env_id}  seed {t.seed}  "
                f"{t.split} iteration {t.iteration}"
                f"{f'  {decision.upper()} by the filter' if decision else ''}",
                style="bold",
            )
        )
    )
    info = t.info or {}
    first = int(info.get("first_trained_turn", 0) or 0)
    if first:
        out.print(Text(f"(context window: turns 1-{first} are not shown)", style="dim italic"))
    turns = {turn.position: turn for turn in turns_of(trajectory_row(t)) if turn.position is not None}
    k = 0
    for i, m in enumerate(t.messages):
        role = m.get("role", "?")
        style = ROLE_STYLES.get(role, "white")
        out.print(Text(f"<{printable(role)}>", style=f"bold {style}"))
        out.print(Text(printable(m.get("content", "")), style=style))
        if role == "assistant":
            out.print(_turn_line(first + k, turns.get(i)))
            k += 1
    out.print(_outcome_line(t, kept))
    out.print()


def _turn_line(turn: int, played: Turn | None) -> Text:
    """``turn N: actions [...]  reward R  format penalty P  constrained decoding`` (None: a message past
    the turn columns)."""
    from rich.text import Text

    line = Text(f"  turn {turn + 1}: ", style="bold magenta")
    line.append(
        printable(f"actions [{', '.join(played.actions)}]")
        if played and played.actions
        else "no action executed"
    )
    if played is not None:
        line.append(f"  reward {played.reward:+.2f}")
        if played.format_penalty:
            line.append(f"  format penalty {played.format_penalty:+.2f}", style="bold red")
        if played.decoding is not None:
            line.append(f"  {printable(played.decoding)} decoding", style="dim")
    return line


def _outcome_line(t: Trajectory, kept: bool | None) -> Text:
    from rich.text import Text

    info = t.info or {}
    mark = Text("SUCCESS", style="bold green") if t.success else Text("FAILED", style="bold red")
    result = Text("=> ").append(mark)
    result.append(
        f"  score {t.score:+.2f} (reward {t.reward:+.2f}, format penalty {t.format_penalty:+.2f})"
        f"  turns {t.turn_count}  end reason {printable(str(info.get('end_reason') or '-'))}"
        f"  response tokens {response_tokens(t)}"
    )
    if info.get("response_truncated"):
        result.append(f"  ({info.get('turns_cut_by_max_new_tokens', '?')} turn(s) cut by max_new_tokens)")
    if kept is not None:
        result.append("  filter: ").append(
            Text("kept", style="bold green") if kept else Text("dropped", style="bold yellow")
        )
    return result


def summary_table(rows: list[dict[str, Any]], title: str) -> Table:
    """:func:`summarize`'s rows as a table, the ``all`` row in bold."""
    from rich.table import Table
    from rich.text import Text

    table = Table(title=title)
    with_kept = bool(rows) and "kept" in rows[0]
    for col in (
        "env_tag",
        "trajectories",
        *(["kept by filter"] if with_kept else []),
        "success",
        "mean score",
        "mean turns",
        "mean response tokens",
        "format-penalty rate",
    ):
        table.add_column(col, justify="left" if col == "env_tag" else "right")
    for r in rows:
        table.add_row(
            Text(printable(r["tag"])),  # a tag read from a file: neither markup nor control codes
            str(r["trajectories"]),
            *([str(r["kept"])] if with_kept else []),
            f"{r['success_rate']:.1%}",
            f"{r['mean_score']:+.3f}",
            f"{r['mean_turns']:.2f}",
            f"{r['mean_response_tokens']:.1f}",
            f"{r['format_penalty_rate']:.1%}",
            style="bold" if r["tag"] == "all" else None,
        )
    return table

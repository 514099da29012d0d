"""The scripted demo: every catalogue environment played by its oracle, through the agent protocol.

It exercises the same path a policy will take (prompt assembly, ``<think>/<answer>`` parsing,
action budget, format penalty, env groups and their metrics) with oracle answers instead of a
model, and prints, per tag, what success means there (the env's ``success_means``) and the
transcripts. ``python -m flows.demo [--tags A,B] [--groups N]``.
"""

from __future__ import annotations

import time

import typer
from rich.console import Console
from rich.table import Table

import envs
from envs.oracles import oracle_actions
from ragen_core.env_groups import EnvGroups, EnvGroupsConfig
from ragen_core.protocol import ProtocolConfig, forced_prefix

console = Console(width=110)


def oracle_answer(groups: EnvGroups, env_id: int, protocol: ProtocolConfig) -> str:
    """The oracle's turn in the model's format: forced prefix + think + answer."""
    env = groups.env(env_id)
    history = groups.history(env_id)
    turns_left = protocol.max_turn - (len(history) - 1)
    actions_left = history[-1].actions_left
    actions = oracle_actions(env, actions_left, protocol.max_actions_per_turn, turns_left)
    answer = f" {protocol.action_sep} ".join(actions)
    think = f"The oracle plans {len(actions)} action(s)." if protocol.enable_think else ""
    text = f"{think}</think><answer>{answer}</answer>" if protocol.enable_think else f"{answer}</answer>"
    return forced_prefix(protocol) + text


def play(tag: str, n_groups: int, protocol: ProtocolConfig) -> tuple[EnvGroups, dict[str, float]]:
    cfg = EnvGroupsConfig(tags=[tag], n_groups=[n_groups], group_size=1)
    groups = EnvGroups(cfg, protocol, mode="val")
    groups.reset()
    for _ in range(protocol.max_turn):
        active = groups.active_ids()
        if not active:
            break
        groups.step({i: oracle_answer(groups, i, protocol) for i in active})
    return groups, groups.metrics()


def print_transcript(groups: EnvGroups, env_id: int) -> None:
    for m in groups.messages(env_id, for_generation=False):
        style = {"system": "dim", "user": "cyan", "assistant": "green"}[m["role"]]
        console.print(f"[bold {style}]<{m['role']}>[/]")
        console.print(m["content"], style=style, markup=False, highlight=False)
    ep = groups.trajectories()[env_id]
    console.print(
        f"[bold]=> success={ep.success} reward={ep.reward:.2f} penalty={ep.format_penalty:.2f} "
        f"actions={ep.num_actions} turns={ep.turns} end={ep.end_reason}[/]\n"
    )


def main(
    tags: str = typer.Option(",".join(envs.tags()), help="Comma-separated catalogue tags."),
    groups: int = typer.Option(32, help="Initial states (validation seeds) per tag."),
    transcripts: int = typer.Option(1, help="Transcripts printed per tag."),
) -> None:
    protocol = ProtocolConfig()
    summary = Table(title="Oracle play through the agent protocol (validation seeds)")
    for col in ("tag", "envs", "success", "actions/episode", "valid", "effective", "penalty", "s"):
        summary.add_column(col, justify="right" if col != "tag" else "left")
    for tag in tags.split(","):
        t0 = time.perf_counter()
        g, metrics = play(tag, groups, protocol)
        dt = time.perf_counter() - t0
        console.rule(f"[bold]{tag}")
        success_means = type(g.env(0)).success_means
        console.print(f"success: {success_means}", style="dim", markup=False, highlight=False)
        for env_id in range(min(transcripts, len(g))):
            print_transcript(g, env_id)
        summary.add_row(
            tag,
            str(len(g)),
            f"{metrics[f'{tag}/success']:.2f}",
            f"{metrics[f'{tag}/num_actions']:.1f}",
            f"{metrics[f'{tag}/action_is_valid']:.2f}",
            f"{metrics[f'{tag}/action_is_effective']:.2f}",
            f"{metrics[f'{tag}/format_penalty']:.2f}",
            f"{dt:.2f}",
        )
    console.print(summary)


if __name__ == "__main__":
    typer.run(main)

"""The multi-turn rollout runner: env groups x a rollout engine -> token-exact trajectories.

Token-in, token-out (docs/architecture.md, "Trajectory schema"): a trajectory's training sequence is
the prompt tokens the policy saw plus the token ids it sampled. Text the policy did not write (chat
template, forced ``<think>``/``<answer>`` prefix, environment feedback) is encoded on its own and
masked out of the loss; sampled ids are never decoded and re-encoded for training. The text between
two assistant turns is taken from the tokenizer's own chat template (the difference between
consecutive renderings), so any chat model whose template is prefix-stable works, and one that is
not (e.g. a template that rewrites earlier turns) is refused with a clear error.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

import numpy as np

from ragen_core.env_groups import EnvGroups, EpisodeSummary
from ragen_core.progress import progress_log
from ragen_core.protocol import Message, forced_prefix
from ragen_core.rollout.constrained import ActionGrammar, AnswerConstraint
from ragen_core.rollout.engine import Generation, RolloutEngine, SamplingParams
from ragen_core.trajectory import Trajectory

_SPLIT_CODES = {"train": 0, "val": 1}
#: A progress line at most every PROGRESS_EVERY_S seconds, so short rollouts (the tiny models') print none.
PROGRESS_EVERY_S = 10.0


class _ConstrainedEngine(Protocol):
    """An engine that takes ``constraints``: the hf engine (``RolloutEngine.generate`` has no such keyword;
    the config refuses constrained decoding with another engine)."""

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        seeds: Sequence[int] | None = None,
        constraints: Sequence[AnswerConstraint | None] | None = None,
    ) -> list[Generation]: ...


class _Progress:
    """Episodes done, elapsed time and an upper bound of the time left (every live episode playing every
    remaining turn at the mean turn time so far)."""

    def __init__(self, split: str, total: int, max_turn: int) -> None:
        self.split, self.total, self.max_turn = split, total, max_turn
        self.t0 = self.last = time.perf_counter()

    def turn_done(self, turn: int, active: int) -> None:
        now = time.perf_counter()
        if not active or now - self.last < PROGRESS_EVERY_S or not progress_log.isEnabledFor(logging.INFO):
            return  # the last turn's news is the stage's own line
        self.last = now
        elapsed = now - self.t0
        left = elapsed / (turn + 1) * (self.max_turn - turn - 1)
        progress_log.info(
            "%s rollouts: turn %d/%d, %d/%d episodes done, %.0f s elapsed, at most %.0f s left",
            self.split,
            turn + 1,
            self.max_turn,
            self.total - active,
            self.total,
            elapsed,
            left,
        )


class ChatTemplateError(ValueError):
    """The tokenizer's chat template cannot be grown turn by turn."""


def turn_seed(seed: int, seed_round: int, split: str, env_id: int, turn: int) -> int:
    """Sampling seed of one env's turn: a pure function of the run's seed and the position."""
    ss = np.random.SeedSequence([seed, seed_round, _SPLIT_CODES.get(split, 2), env_id, turn])
    return int(ss.generate_state(1, dtype=np.uint64)[0] >> np.uint64(2))


@dataclass
class SampledTurn:
    """What the policy sampled in one turn (ids incl. its end-of-turn token if it emitted one)."""

    ids: list[int]
    logprobs: list[float]
    closed: bool  # False: cut by max_new_tokens; the runner appends an end-of-turn token
    #: per sampled token, the ids it was sampled among (constrained decoding), else empty
    allowed: list[tuple[int, ...] | None] = field(default_factory=list)
    #: "constrained" or "free": how this turn's answer was decoded
    decoding: str = "free"
    #: the prompt it was sampled after (kept only with ``agent.window_training: every_turn``)
    prompt: list[int] = field(default_factory=list)


@dataclass
class _Conversation:
    turns: list[SampledTurn] = field(default_factory=list)


class Segments:
    """Builds a conversation's tokens from its messages and the sampled turns."""

    def __init__(self, tokenizer: Any, prefix: str) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ChatTemplateError(
                f"tokenizer {getattr(tokenizer, 'name_or_path', tokenizer)!r} has no chat_template; "
                "set one (tokenizer.chat_template = ...) or use a chat model"
            )
        self.tok = tokenizer
        self.prefix = prefix
        eos = tokenizer.eos_token
        if eos is None:
            raise ChatTemplateError("tokenizer has no eos_token (the end-of-turn token); set one")
        self.eos_text = eos
        self.eos_id = int(tokenizer.convert_tokens_to_ids(eos))
        self._cache: dict[str, list[int]] = {}
        # head()/continuation() text by their messages: a run re-assembles every live conversation
        # each turn, and rendering the chat template (jinja) is the runner's main cost otherwise.
        self._texts: dict[tuple[Any, ...], str] = {}

    @staticmethod
    def _key(kind: str, messages: Sequence[Message]) -> tuple[Any, ...]:
        return (kind, *(tuple(m.items()) for m in messages))

    def encode(self, text: str) -> list[int]:
        ids = self._cache.get(text)
        if ids is None:
            ids = self._cache[text] = list(self.tok.encode(text, add_special_tokens=False))
        return ids

    def render(self, messages: Sequence[Message], generation_prompt: bool) -> str:
        text: str = self.tok.apply_chat_template(
            list(messages), tokenize=False, add_generation_prompt=generation_prompt
        )
        return text

    def head(self, messages: Sequence[Message]) -> str:
        """System + first user message + generation prompt + forced prefix."""
        key = self._key("head", messages[:2])
        text = self._texts.get(key)
        if text is None:
            text = self._texts[key] = self.render(messages[:2], True) + self.prefix
        return text

    def continuation(self, messages: Sequence[Message]) -> str:
        """Template text after an assistant turn's end-of-turn token, up to the next turn's prefix.

        ``messages`` ends with the user message that follows the assistant message before it.
        """
        key = self._key("continuation", messages)
        text = self._texts.get(key)
        if text is None:
            text = self._texts[key] = self._continuation(messages)
        return text

    def _continuation(self, messages: Sequence[Message]) -> str:
        full = self.render(messages, True) + self.prefix
        before = self.render(messages[:-1], False)
        anchor = messages[-2]["content"] + self.eos_text
        cut = before.rfind(anchor)
        if cut < 0 or full[: cut + len(anchor)] != before[: cut + len(anchor)]:
            raise ChatTemplateError(
                "the chat template is not prefix-stable (rendering one more turn changed earlier "
                "text), so turns cannot be appended token by token; use a ChatML/Qwen-style template"
            )
        return full[cut + len(anchor) :]

    def assemble(
        self, messages: Sequence[Message], turns: Sequence[SampledTurn], first_turn: int
    ) -> tuple[list[int], list[int], list[int], list[float], list[list[int]]]:
        """Tokens, loss mask, turn index and log-probs of ``messages``, and the constrained tokens as
        ``[position, allowed ids]`` pairs (empty without constrained decoding).

        ``messages`` alternate ``system, user, (assistant, user)*[, assistant]``; the k-th assistant
        message is ``turns[k]``, which is turn ``first_turn + k`` of the episode (0-based).
        """
        out = _TokenRows()
        out.add(self.encode(self.head(messages)), 0, first_turn)
        n_assistant = sum(1 for m in messages if m["role"] == "assistant")
        if n_assistant != len(turns):
            raise AssertionError(f"{n_assistant} assistant messages but {len(turns)} sampled turns")
        for k, turn in enumerate(turns):
            t = first_turn + k
            out.add_sampled(turn, t, self.eos_id)
            end = 2 + 2 * k + 2  # messages[: end] ends with the user message after this turn
            if end <= len(messages):
                out.add(self.encode(self.continuation(messages[:end])), 0, t + 1)
        return out.ids, out.mask, out.turn_idx, out.logps, out.allowed

    def per_turn(
        self, turns: Sequence[SampledTurn]
    ) -> tuple[list[int], list[int], list[int], list[float], list[list[int]], list[int]]:
        """:meth:`assemble`'s outputs for an episode trained turn by turn (``agent.window_training:
        every_turn``), plus where each turn's sequence starts: turn k's sequence is the prompt it was
        sampled after (``turns[k].prompt``, its context window) followed by what it sampled, and the
        sequences follow one another in turn order."""
        out = _TokenRows()
        starts: list[int] = []
        for t, turn in enumerate(turns):
            starts.append(len(out.ids))
            out.add(turn.prompt, 0, t)
            out.add_sampled(turn, t, self.eos_id)
        return out.ids, out.mask, out.turn_idx, out.logps, out.allowed, starts


@dataclass
class _TokenRows:
    """A training sequence being built: tokens, loss mask, turn index, log-probs and the constrained
    tokens' ``[position, allowed ids]`` pairs."""

    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    turn_idx: list[int] = field(default_factory=list)
    logps: list[float] = field(default_factory=list)
    allowed: list[list[Any]] = field(default_factory=list)

    def add(self, new: Sequence[int], m: int, t: int, lp: Sequence[float] | None = None) -> None:
        self.ids.extend(new)
        self.mask.extend([m] * len(new))
        self.turn_idx.extend([t] * len(new))
        self.logps.extend(lp if lp is not None else [0.0] * len(new))

    def add_sampled(self, turn: SampledTurn, t: int, eos_id: int) -> None:
        """Turn ``t``'s sampled tokens (trained), then the end-of-turn token the runner closed it with."""
        self.allowed.extend([len(self.ids) + j, list(a)] for j, a in enumerate(turn.allowed) if a is not None)
        self.add(turn.ids, 1, t, turn.logprobs)
        if not turn.closed:
            self.add([eos_id], 0, t)


def run_rollouts(
    groups: EnvGroups,
    engine: RolloutEngine,
    tokenizer: Any,
    params: SamplingParams,
    *,
    seed: int,
    seed_round: int = 0,
    iteration: int = 0,
    run_id: str = "",
) -> list[Trajectory]:
    """Play one episode in every env of ``groups`` (reset for ``seed_round``) and return trajectories
    labelled ``iteration``.

    Each turn, all live envs generate in one batch; finished envs drop out. Sampling seeds depend
    only on (seed, seed_round, split, env_id, turn), so the same config gives the same tokens. The
    pipeline's iteration ``k`` plays train round ``k - 1``; validation always plays round 0 and is
    labelled with the number of iterations its policy has trained.
    """
    play = _Episodes(groups, engine, tokenizer, params, seed_round)
    # A turn's prompt continues the conversation of the turn before: the engine may reuse its KV cache.
    # With one turn there is nothing to continue, and keeping every sequence's cache would be waste.
    with engine.conversations() if groups.protocol.max_turn > 1 else contextlib.nullcontext():
        for turn in range(groups.protocol.max_turn):
            if not play.play_turn(turn, seed, seed_round):
                break
    return [play.trajectory(ep, run_id, iteration) for ep in groups.trajectories()]


class _Episodes:
    """The episodes of one :func:`run_rollouts` call: what each env's conversation holds in tokens, turn
    after turn, and the trajectories they make."""

    def __init__(
        self,
        groups: EnvGroups,
        engine: RolloutEngine,
        tokenizer: Any,
        params: SamplingParams,
        seed_round: int,
    ) -> None:
        self.groups, self.engine, self.tokenizer, self.params = groups, engine, tokenizer, params
        self.protocol = protocol = groups.protocol
        self.prefix = forced_prefix(protocol)
        self.seg = Segments(tokenizer, self.prefix)
        self.window = protocol.max_context_window
        self.split = groups.mode
        groups.reset(seed_round)
        self.convs = {i: _Conversation() for i in groups.env_ids}
        self.progress = _Progress(self.split, len(self.convs), protocol.max_turn)
        self.constrained = protocol.action_decoding == "constrained"
        self.every_turn = self.window > 0 and protocol.window_training == "every_turn"
        self.grammars: dict[tuple[str, ...], ActionGrammar] = {}

    def constraint(self, env_id: int) -> AnswerConstraint | None:
        """A fresh answer constraint over env ``env_id``'s actions in its current state (one grammar per
        action set), or ``None`` where that state takes free text (WebShop's search page)."""
        actions = tuple(self.groups.env(env_id).answer_actions() or ())
        if not actions:
            return None
        if actions not in self.grammars:
            self.grammars[actions] = ActionGrammar.for_protocol(self.tokenizer, actions, self.protocol)
        return AnswerConstraint(
            self.grammars[actions],
            self.tokenizer,
            in_answer=not self.protocol.enable_think,
            budget=self.params.max_new_tokens,
        )

    def visible(self, env_id: int, for_generation: bool) -> tuple[list[Message], list[SampledTurn], int]:
        """The messages the model sees (inside the context window), their sampled turns, and the
        index of the first turn shown."""
        history = self.groups.history(env_id)
        n = len(history)
        if not for_generation:
            while n and not history[n - 1].played:
                n -= 1
        start = max(0, n - self.window) if self.window > 0 else 0
        played = [i for i in range(start, n) if history[i].played]
        turns = [self.convs[env_id].turns[i] for i in played]
        return self.groups.messages(env_id, for_generation), turns, start

    def play_turn(self, turn: int, seed: int, seed_round: int) -> bool:
        """One turn of every live env, generated in one batch; ``False`` when none was live."""
        groups, seg = self.groups, self.seg
        active = groups.active_ids()
        if not active:
            return False
        prompts = []
        for env_id in active:
            messages, turns, start = self.visible(env_id, True)
            prompts.append(seg.assemble(messages, turns, start)[0])
        seeds = [turn_seed(seed, seed_round, self.split, env_id, turn) for env_id in active]
        constraints = [self.constraint(env_id) if self.constrained else None for env_id in active]
        if self.constrained:
            gens = cast(_ConstrainedEngine, self.engine).generate(
                prompts, self.params, seeds, constraints=constraints
            )
        else:
            gens = self.engine.generate(prompts, self.params, seeds)
        responses = {}
        for env_id, prompt, gen, constraint in zip(active, prompts, gens, constraints, strict=True):
            ids = list(gen.token_ids)
            closed = gen.finish_reason == "stop" and bool(ids) and ids[-1] == seg.eos_id
            self.convs[env_id].turns.append(
                SampledTurn(
                    ids=ids,
                    logprobs=list(gen.logprobs),
                    closed=closed,
                    allowed=list(gen.allowed),
                    decoding="free" if constraint is None else "constrained",
                    prompt=list(prompt) if self.every_turn else [],
                )
            )
            responses[env_id] = self.prefix + self.tokenizer.decode(ids, skip_special_tokens=True)
        groups.step(responses)
        self.progress.turn_done(turn, len(groups.active_ids()))
        return True

    def trajectory(self, ep: EpisodeSummary, run_id: str, iteration: int) -> Trajectory:
        """The trajectory of the finished episode ``ep`` (an ``EnvGroups.trajectories()`` entry)."""
        segment_starts: list[int] = []
        if self.every_turn:
            messages, turns, start = (
                self.groups.messages(ep.env_id, False, whole=True),
                self.convs[ep.env_id].turns,
                0,
            )
            ids, mask, turn_idx, logps, allowed, segment_starts = self.seg.per_turn(turns)
        else:
            messages, turns, start = self.visible(ep.env_id, False)
            ids, mask, turn_idx, logps, allowed = self.seg.assemble(messages, turns, start)
        # Transcripts keep what the model actually wrote (the history holds normalised text).
        raw = [r.raw_response or "" for r in self.groups.history(ep.env_id) if r.played]
        shown = [dict(m) for m in messages]
        k = len(raw) - len(turns)
        for m in shown:
            if m["role"] == "assistant":
                m["content"] = raw[k]
                k += 1
        cut_turns = sum(1 for t in self.convs[ep.env_id].turns if not t.closed)
        decoding: dict[str, Any] = {}
        if self.constrained:  # absent: every turn decoded freely (what every run before this option did)
            decoding = {
                "turn_decoding": [t.decoding for t in self.convs[ep.env_id].turns],
                "allowed_token_ids": allowed,
            }
        return Trajectory(
            run_id=run_id,
            iteration=iteration,
            split=self.split,
            env_tag=ep.tag,
            group_id=ep.group_id,
            env_id=ep.env_id,
            seed=ep.seed,
            turn_count=ep.turns,
            success=ep.success,
            truncated=ep.truncated,
            reward=ep.reward,
            format_penalty=ep.format_penalty,
            score=ep.score,
            input_ids=ids,
            loss_mask=mask,
            turn_index=turn_idx,
            rollout_logprobs=[lp if m else 0.0 for lp, m in zip(logps, mask, strict=True)],
            messages=shown,
            actions=ep.actions,
            turn_rewards=ep.turn_rewards,
            info={
                "end_reason": ep.end_reason,
                "num_actions": ep.num_actions,
                "turn_penalties": ep.turn_penalties,
                "turns_cut_by_max_new_tokens": cut_turns,
                # a turn hit max_new_tokens without its end-of-turn token (RAGEN's clip ratio)
                "response_truncated": cut_turns > 0,
                "first_trained_turn": start,
                "infos": ep.infos,
                **decoding,
                # every turn's own sequence (its prompt, then its answer), one after another
                **(
                    {"segment_starts": segment_starts, "context_window": self.window}
                    if self.every_turn
                    else {}
                ),
            },
        )

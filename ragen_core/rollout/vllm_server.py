"""The vLLM side of the ``vllm`` rollout backend: runs under vLLM's own interpreter.

vLLM pins its own torch / transformers / fastapi, which cannot share a venv with prefect 3.9 and
transformers 5.24, so :class:`ragen_core.rollout.vllm_engine.VLLMEngine` starts this module as a
child process with the vLLM venv's Python (``python -m ragen_core.rollout.vllm_server FD``) and
speaks to it over one end of a socket pair (``multiprocessing.connection`` framing, pickled
plain-Python messages: lists of ints and floats, dicts, strings). Nothing from the main venv is
imported here: only the standard library, torch, safetensors, vLLM, and the two pure-Python modules
of this repository that constrained decoding shares with the hf engine and the learner (the answer
grammar, :mod:`ragen_core.rollout.constrained`, and the mask, :mod:`ragen_core.algorithms.constrained`).

Constrained action decoding runs the answer grammar *inside* vLLM: :class:`ConstrainedAnswers` is a
vLLM v1 logits processor; a request whose ``extra_args`` carry an ``AnswerConstraint.spec()`` gets
its own constraint, which masks each next-token row to the allowed ids before sampling (after it,
vLLM applies temperature, top-k and top-p, as the hf engine does). vLLM's raw log-probs are taken
before logits processors, so such a request also asks for the raw log-probs of every token its
grammar can allow (``logprob_token_ids``), and :func:`_renormalised` replays the constraint over the
sampled ids to recover each step's allowed set and renormalise the sampled token's log-prob over it.

Messages (request -> reply; any failure replies ``("error", traceback)`` and the loop goes on):

* ``("init", engine_kwargs)`` -> ``("ok", info)``: builds ``vllm.LLM`` with prefix caching on,
  ``logprobs_mode="raw_logprobs"`` (our log-prob convention: temperature-1 log-softmax of the
  raw logits), :class:`WeightSync` as the worker extension and :class:`ConstrainedAnswers` as a
  logits processor;
* ``("generate", {"prompts", "params", "seeds", "max_tokens", "constraints"})`` ->
  ``("ok", [(ids, logprobs, finish, allowed), ...])``; ``constraints`` (optional) holds one
  ``AnswerConstraint.spec()`` or ``None`` per prompt, and ``allowed`` is, per generated token, the
  ids it was sampled among (``None``: free), or ``None`` for an unconstrained prompt;
* ``("update_weights", path)`` -> ``("ok", n_tensors)``: every worker loads the safetensors file
  at ``path`` (tmpfs on CPU) into its model in place, then the prefix cache is dropped (its
  keys/values were computed with the old weights);
* ``("close", None)``: exits. End-of-file on the socket (the parent died) exits too.
"""

from __future__ import annotations

import functools
import sys
import traceback
from multiprocessing.connection import Connection
from typing import Any

from vllm.v1.sample.logits_processor import AdapterLogitsProcessor


class WeightSync:
    """vLLM worker extension (``worker_extension_cls``): in-place weight loads in each worker."""

    def ragen_load_weights(self, path: str) -> int:
        from safetensors.torch import load_file

        state = load_file(path)
        # vLLM's in-place reload: maps HF names (q/k/v -> qkv_proj, gate/up -> gate_up_proj, tied
        # lm_head) and redoes the post-load processing (the CPU backend repacks linear weights
        # for its kernels, so a plain ``model.load_weights`` would hit the emptied originals).
        self.reload_weights(weights_iterator=iter(state.items()), is_checkpoint_format=True)  # type: ignore[attr-defined]
        _retie_lm_head(self.model_runner.model)  # type: ignore[attr-defined]
        return len(state)


def _retie_lm_head(model: Any) -> None:
    """Tie ``lm_head`` to the reloaded embedding and redo the head's kernel processing.

    A tied checkpoint has no ``lm_head.weight``, so the reload never processes the head: on CPU
    its prepacked logits GEMM (built from the embedding at start-up) would keep the old weights.
    Measured without this: log-probs off by ~1 nat after a sync on the tiny model.
    """
    cfg = getattr(model, "config", None)
    head = getattr(model, "lm_head", None)
    if not getattr(cfg, "tie_word_embeddings", False) or head is None or not hasattr(head, "weight"):
        return
    embed = model.model.embed_tokens
    if head.weight is not embed.weight:
        head.weight = embed.weight
    method = getattr(head, "quant_method", None)
    if method is not None:
        method.process_weights_after_loading(head)  # CPU: re-dispatch the logits GEMM; GPU: no-op


#: the key of a request's constraint (``AnswerConstraint.spec()``) in ``SamplingParams.extra_args``
CONSTRAINT_KEY = "ragen_answer"


@functools.lru_cache(maxsize=4)
def _tokenizer(path: str) -> Any:
    """The model's tokenizer, loaded the same way in the engine's worker and in this process (only
    constraints that wait for the model to write ``<answer>`` need it)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def _constraint(spec: dict[str, Any], tokenizer_path: str) -> Any:
    from ragen_core.rollout.constrained import AnswerConstraint

    return AnswerConstraint.from_spec(spec, None if spec["in_answer"] else _tokenizer(tokenizer_path))


class _RequestConstraint:
    """One request's :class:`AnswerConstraint` inside vLLM: called with the request's output ids so far
    and its next-token logits row, it advances over the new ids and masks the row to the allowed ids
    with :func:`restrict_to_allowed`, the function the hf engine and the learner use."""

    def __init__(self, spec: dict[str, Any], tokenizer_path: str) -> None:
        self.spec, self.tokenizer_path = spec, tokenizer_path
        self.constraint = _constraint(spec, tokenizer_path)
        self.seen = 0

    def __call__(self, output_ids: list[int], logits: Any) -> Any:
        import torch

        from ragen_core.algorithms.constrained import restrict_to_allowed

        if len(output_ids) < self.seen:  # vLLM dropped tokens (a failed KV load): start again
            self.constraint, self.seen = _constraint(self.spec, self.tokenizer_path), 0
        for t in output_ids[self.seen :]:
            self.constraint.advance(int(t))
        self.seen = len(output_ids)
        allowed = self.constraint.allowed()
        if allowed is None:
            return logits
        table = torch.tensor([allowed], dtype=torch.long)
        return restrict_to_allowed(logits[None], table)[0]


class ConstrainedAnswers(AdapterLogitsProcessor):  # type: ignore[misc]  # vLLM: untyped here (own venv)
    """vLLM logits processor (the v1 API, loaded by name in vLLM's engine process) that runs each
    constrained request's answer grammar; requests without a constraint are left alone."""

    def __init__(self, vllm_config: Any, device: Any, is_pin_memory: bool) -> None:
        super().__init__(vllm_config, device, is_pin_memory)
        self.tokenizer_path = str(vllm_config.model_config.tokenizer)

    def is_argmax_invariant(self) -> bool:
        return False  # masking changes the greedy token too

    def new_req_logits_processor(self, params: Any) -> Any:
        spec = (params.extra_args or {}).get(CONSTRAINT_KEY)
        return None if spec is None else _RequestConstraint(spec, self.tokenizer_path)


def _sampling_params(
    params: dict[str, Any], seed: int, max_tokens: int, constraint: dict[str, Any] | None
) -> Any:
    from vllm import SamplingParams

    from ragen_core.rollout.constrained import grammar_from_spec

    top_k = int(params.get("top_k", -1))
    extra: dict[str, Any] = {}
    if constraint is None:
        logprobs: dict[str, Any] = {"logprobs": 0}  # the sampled token's log-prob only
    else:
        # The raw log-probs of every token the grammar can allow, at every step: the sampled token's
        # log-prob renormalised over the step's allowed ids is computed from them (_renormalised).
        logprobs = {"logprob_token_ids": list(grammar_from_spec(constraint["grammar"]).vocabulary())}
        extra = {"extra_args": {CONSTRAINT_KEY: constraint}}
    return SamplingParams(
        n=1,
        temperature=float(params.get("temperature", 1.0)),
        top_p=float(params.get("top_p", 1.0)),
        top_k=0 if top_k == -1 else top_k,
        max_tokens=max_tokens,
        seed=int(seed),
        # stop exactly at the ids we are given (the tokenizer's eos is not implied)
        ignore_eos=True,
        stop_token_ids=list(params["stop_token_ids"]),
        detokenize=False,  # token-in, token-out: text is never used
        skip_special_tokens=False,
        **logprobs,
        **extra,
    )


def _renormalised(
    spec: dict[str, Any], tokenizer_path: str, ids: list[int], steps: list[dict[int, Any]]
) -> tuple[list[float], list[list[int] | None]]:
    """The log-probs of a constrained request's tokens under the policy that sampled them, and each
    token's allowed ids (``None``: free).

    vLLM's raw log-probs are taken before the logits processors, over the whole vocabulary. Replaying
    the same constraint over the sampled ids gives each step's allowed set ``A_t`` (the automaton is
    deterministic in the ids, so it is the set the logits processor masked with), and
    ``log pi_c(y) = log pi(y) - logsumexp_{a in A_t} log pi(a)``: the learner's
    ``log_softmax`` over the allowed logits, up to float rounding.
    """
    import math

    constraint = _constraint(spec, tokenizer_path)
    lps: list[float] = []
    allowed_per_token: list[list[int] | None] = []
    for t, d in zip(ids, steps, strict=True):
        allowed = constraint.allowed()
        raw = float(d[t].logprob)
        if allowed is None:
            lps.append(raw)
            allowed_per_token.append(None)
        else:
            if t not in allowed:
                raise RuntimeError(
                    f"vLLM sampled token {t} outside the answer grammar's allowed ids {list(allowed)}: "
                    "the logits processor and the replay disagree"
                )
            mass = [float(d[a].logprob) for a in allowed]
            top = max(mass)
            lps.append(raw - top - math.log(sum(math.exp(m - top) for m in mass)))
            allowed_per_token.append(list(allowed))
        constraint.advance(t)
    return lps, allowed_per_token


def _generate(
    llm: Any, req: dict[str, Any], tokenizer_path: str
) -> list[tuple[list[int], list[float], str, list[list[int] | None] | None]]:
    from vllm.inputs import TokensPrompt

    prompts: list[list[int]] = req["prompts"]
    constraints = req.get("constraints") or [None] * len(prompts)
    sps = [
        _sampling_params(req["params"], seed, max_tokens, constraint)
        for seed, max_tokens, constraint in zip(req["seeds"], req["max_tokens"], constraints, strict=True)
    ]
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sps, use_tqdm=False)
    results = []
    for out, constraint in zip(outs, constraints, strict=True):
        c = out.outputs[0]
        ids = [int(t) for t in c.token_ids]
        allowed = None
        if constraint is None:
            lps = [float(d[t].logprob) for d, t in zip(c.logprobs or [], ids, strict=True)]
        else:
            lps, allowed = _renormalised(constraint, tokenizer_path, ids, list(c.logprobs or []))
        finish = "stop" if c.finish_reason == "stop" else "length"
        results.append((ids, lps, finish, allowed))
    return results


def serve(conn: Connection) -> None:
    llm = None
    tokenizer_path = ""
    while True:
        try:
            op, payload = conn.recv()
        except (EOFError, OSError):
            return
        if op == "close":
            conn.send(("ok", None))
            return
        try:
            if op == "init":
                import torch
                from vllm import LLM

                if not torch.cuda.is_available():
                    # vLLM 0.32 on CPU cannot rewind a seeded request's torch.Generator after a
                    # partial (chunked) prefill ("CPU Generator does not use offset"): schedule
                    # whole prompts only, as vLLM's CPU platform itself does for MLA models.
                    payload = {
                        "enable_chunked_prefill": False,
                        "max_num_batched_tokens": max(int(payload["max_model_len"]), 8192),
                        **payload,
                    }

                llm = LLM(
                    **payload,
                    enable_prefix_caching=True,
                    logprobs_mode="raw_logprobs",
                    worker_extension_cls="ragen_core.rollout.vllm_server.WeightSync",
                    logits_processors=["ragen_core.rollout.vllm_server:ConstrainedAnswers"],
                )
                tokenizer_path = str(llm.llm_engine.model_config.tokenizer)
                import vllm

                reply: Any = {"vllm_version": vllm.__version__, "python": sys.executable}
            elif llm is None:
                raise RuntimeError(f"{op!r} before 'init'")
            elif op == "generate":
                reply = _generate(llm, payload, tokenizer_path)
            elif op == "update_weights":
                counts = llm.collective_rpc("ragen_load_weights", args=(payload,))
                llm.reset_prefix_cache()
                reply = int(counts[0])
            else:
                raise ValueError(f"unknown request {op!r}")
            conn.send(("ok", reply))
        except Exception:
            conn.send(("error", traceback.format_exc()))


def main() -> None:
    conn = Connection(int(sys.argv[1]))
    try:
        serve(conn)
    finally:
        conn.close()


if __name__ == "__main__":
    main()

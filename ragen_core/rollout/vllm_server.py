"""The vLLM side of the ``vllm`` rollout backend: runs under vLLM's own interpreter.

vLLM pins its own torch / transformers / fastapi, which cannot share a venv with prefect 3.9 and
transformers 5.24, so :class:`ragen_core.rollout.vllm_engine.VLLMEngine` starts this module as a
child process with the vLLM venv's Python (``python -m ragen_core.rollout.vllm_server FD``) and
speaks to it over one end of a socket pair (``multiprocessing.connection`` framing, pickled
plain-Python messages: lists of ints and floats, dicts, strings). Nothing from the main venv is
imported here: only the standard library, torch, safetensors and vLLM.

Messages (request -> reply; any failure replies ``("error", traceback)`` and the loop goes on):

* ``("init", engine_kwargs)`` -> ``("ok", info)``: builds ``vllm.LLM`` with prefix caching on,
  ``logprobs_mode="raw_logprobs"`` (our log-prob convention: temperature-1 log-softmax of the
  raw logits) and :class:`WeightSync` as the worker extension;
* ``("generate", {"prompts", "params", "seeds"})`` -> ``("ok", [(ids, logprobs, finish), ...])``;
* ``("update_weights", path)`` -> ``("ok", n_tensors)``: every worker loads the safetensors file
  at ``path`` (tmpfs on CPU) into its model in place, then the prefix cache is dropped (its
  keys/values were computed with the old weights);
* ``("close", None)``: exits. End-of-file on the socket (the parent died) exits too.
"""

from __future__ import annotations

import sys
import traceback
from multiprocessing.connection import Connection
from typing import Any


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


def _sampling_params(params: dict[str, Any], seed: int, max_tokens: int) -> Any:
    from vllm import SamplingParams

    top_k = int(params.get("top_k", -1))
    return SamplingParams(
        n=1,
        temperature=float(params.get("temperature", 1.0)),
        top_p=float(params.get("top_p", 1.0)),
        top_k=0 if top_k == -1 else top_k,
        max_tokens=max_tokens,
        seed=int(seed),
        logprobs=0,  # the sampled token's log-prob only
        # stop exactly at the ids we are given (the tokenizer's eos is not implied)
        ignore_eos=True,
        stop_token_ids=list(params["stop_token_ids"]),
        detokenize=False,  # token-in, token-out: text is never used
        skip_special_tokens=False,
    )


def _generate(llm: Any, req: dict[str, Any]) -> list[tuple[list[int], list[float], str]]:
    from vllm.inputs import TokensPrompt

    prompts: list[list[int]] = req["prompts"]
    sps = [
        _sampling_params(req["params"], seed, max_tokens)
        for seed, max_tokens in zip(req["seeds"], req["max_tokens"], strict=True)
    ]
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sps, use_tqdm=False)
    results = []
    for out in outs:
        c = out.outputs[0]
        ids = [int(t) for t in c.token_ids]
        lps = [float(d[t].logprob) for d, t in zip(c.logprobs or [], ids, strict=True)]
        finish = "stop" if c.finish_reason == "stop" else "length"
        results.append((ids, lps, finish))
    return results


def serve(conn: Connection) -> None:
    llm = None
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
                )
                import vllm

                reply: Any = {"vllm_version": vllm.__version__, "python": sys.executable}
            elif llm is None:
                raise RuntimeError(f"{op!r} before 'init'")
            elif op == "generate":
                reply = _generate(llm, payload)
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

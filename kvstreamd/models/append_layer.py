"""A cache layer that appends in place: transformers' `DynamicLayer`, except that the tokens run
after a prefix go into room reserved after the prefix's rows (`PrefixKV.empty_heads_first(room=)`).

transformers' dynamic layer appends by concatenating, so every step copies the whole prefix into
a new tensor: the e2e question's 19 tokens after a fetched 4096-token SmolLM2 prefix spent ~50 ms
of its ~0.19 s in `torch.cat` (30 layers x K and V, 188 MB of fp32), and each generated token as
much again. Written into the room instead, the same tensors are read by attention: the same
logits, bit for bit. Once the room is spent, or the layer was changed under it (a batch op that
makes new tensors), the layer concatenates as transformers' does."""
from __future__ import annotations

import torch
from transformers.cache_utils import DynamicLayer


class AppendLayer(DynamicLayer):
    """Holds keys and values `[1, H, T, D]` that are the first T rows of `room_keys` and
    `room_values` `[1, H, T + room, D]` (views of one buffer, never copied)."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, room_keys: torch.Tensor,
                 room_values: torch.Tensor) -> None:
        super().__init__()
        if not (_starts(keys, room_keys) and _starts(values, room_values)):
            raise ValueError("keys and values must be the first rows of the room given for them")
        self.lazy_initialization(keys, values)
        self.keys, self.values = keys, values
        self._room: tuple[torch.Tensor, torch.Tensor] | None = (room_keys, room_values)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        if self._room is not None and self.is_initialized:
            room_k, room_v = self._room
            n, t = self.keys.shape[-2], key_states.shape[-2]
            if (n + t <= room_k.shape[-2] and _starts(self.keys, room_k) and _starts(self.values, room_v)
                    and key_states.shape[:-2] == room_k.shape[:-2] and value_states.shape[:-2] == room_v.shape[:-2]
                    and key_states.dtype == room_k.dtype and value_states.dtype == room_v.dtype):
                room_k[..., n:n + t, :].copy_(key_states)
                room_v[..., n:n + t, :].copy_(value_states)
                self.keys, self.values = room_k[..., :n + t, :], room_v[..., :n + t, :]
                return self.keys, self.values
            self._room = None  # spent, or no longer what the layer holds: concatenate from here on
        return super().update(key_states, value_states, *args, **kwargs)


def _starts(held: torch.Tensor | None, room: torch.Tensor) -> bool:
    """Whether `held` is the first rows (dim -2) of `room`: the same memory, strides and other dims."""
    return (held is not None and held.data_ptr() == room.data_ptr() and held.stride() == room.stride()
            and held.shape[:-2] == room.shape[:-2] and held.shape[-1] == room.shape[-1]
            and held.shape[-2] <= room.shape[-2])

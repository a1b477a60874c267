"""The shared-memory hand-off's GPU twin: a fetch's buffer in device memory, handed to the
model process as a CUDA IPC handle, which it opens to get the same memory as a torch tensor,
with no copy.

The buffer is its own cudaMalloc allocation, not a block of torch's caching allocator (whose
blocks share allocations, and so IPC handles, with unrelated tensors): the handle then covers
exactly the buffer, offset 0. The handle travels as hex in the fetch's start event, beside
the shape and dtype; nothing is pickled. The daemon writes a chunk, waits for the copy's CUDA
event, then emits the chunk's event: memory the model reads after that event is complete.

Uses CuPy's runtime bindings (cudaMalloc, cudaIpcGetMemHandle, cudaIpcOpenMemHandle); needs a
GPU to do anything, which codec.gpu.available() says.
"""
from __future__ import annotations

import secrets

import torch

from kvstreamd.handoff.buffers import nbytes_of
from kvstreamd.handoff.shm import DTYPES


def _as_torch(ptr: int, nbytes: int, owner, device: int, shape, dtype: str) -> torch.Tensor:
    """A torch tensor over raw device memory (through CuPy's __cuda_array_interface__); the
    tensor keeps `owner` alive."""
    import cupy

    mem = cupy.cuda.UnownedMemory(ptr, nbytes, owner, device)
    raw = cupy.ndarray((nbytes,), dtype=cupy.uint8, memptr=cupy.cuda.MemoryPointer(mem, 0))
    return torch.as_tensor(raw, device=f"cuda:{device}").view(DTYPES[dtype]).view(*shape)


class CudaBuffer:
    """A fetch's buffer on the daemon's GPU: a buffers.FetchBuffer."""

    def __init__(self, nbytes: int, device: int):
        import cupy

        self.nbytes = max(int(nbytes), 1)
        self.device = int(device)
        with cupy.cuda.Device(self.device):
            self.ptr = cupy.cuda.runtime.malloc(self.nbytes)
        self.name = f"cuda-{secrets.token_hex(8)}"
        self._closed = False

    @classmethod
    def create(cls, shape, dtype: str, device: int) -> "CudaBuffer":
        return cls(nbytes_of(shape, dtype), device)

    def tensor(self, shape, dtype: str) -> torch.Tensor:
        return _as_torch(self.ptr, self.nbytes, self, self.device, shape, dtype)

    def handle(self) -> str:
        """The cudaIpcMemHandle_t, hex: what the model process opens."""
        import cupy

        with cupy.cuda.Device(self.device):
            return bytes(cupy.cuda.runtime.ipcGetMemHandle(self.ptr)).hex()

    def placement(self) -> dict:
        return {"device": f"cuda:{self.device}", "cuda_ipc": self.handle()}

    def release(self) -> None:
        """Free the allocation (a model process that opened its handle keeps its mapping
        until it closes it: CUDA frees the memory when the last user lets go)."""
        if self._closed:
            return
        import cupy

        self._closed = True
        with cupy.cuda.Device(self.device):
            cupy.cuda.runtime.free(self.ptr)


class CudaAttached:
    """The model process's side: the daemon's buffer opened from its handle."""

    def __init__(self, ptr: int, nbytes: int, device: int, shape, dtype: str):
        self.ptr, self.nbytes, self.device = ptr, nbytes, device
        self.tensor = _as_torch(ptr, nbytes, self, device, shape, dtype)

    @classmethod
    def open(cls, handle_hex: str, shape, dtype: str, device: int) -> "CudaAttached":
        import cupy

        nbytes = nbytes_of(shape, dtype)
        with cupy.cuda.Device(device):
            ptr = cupy.cuda.runtime.ipcOpenMemHandle(bytes.fromhex(handle_hex),
                                                     cupy.cuda.runtime.cudaIpcMemLazyEnablePeerAccess)
        return cls(ptr, nbytes, device, shape, dtype)

    def release(self) -> None:
        """Close the mapping. Tensors over it must not be used afterwards (clone what must
        outlive the fetch, as with the shared-memory buffer)."""
        if self.ptr is None:
            return
        import cupy

        self.tensor = None
        with cupy.cuda.Device(self.device):
            cupy.cuda.runtime.ipcCloseMemHandle(self.ptr)
        self.ptr = None

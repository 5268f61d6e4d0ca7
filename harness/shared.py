"""Memory the harness owns and lends a solution's worker, so that what the harness later reads there is what the
worker wrote before it was killed, not what it chose to send afterwards.

The timer lends the buffer that holds the outputs of every timed call (harness.timing.TimedLoop writes them there,
outside the timed region, before it replies); the harness kills the worker as soon as the reply arrives and only then
reads the buffer. Work the worker's process would do after its reply (computing the judged outputs once the harness's
clock has stopped) dies with it, GPU work included: a killed process's CUDA context is torn down with its queued work.

On the CPU the buffer is a memfd that both processes map. On a GPU it is a CUDA virtual-memory allocation (the
driver's cuMem API) exported as a POSIX file descriptor: unlike a CUDA IPC handle, a file descriptor passes over the
worker's socket into the sandbox's own PID and IPC namespaces. `Lent` is the owner's side, `Borrowed` the worker's.

The judged calls' inputs go the same way, so that the harness itself, not the solution's process, sees whether a
call wrote into its inputs.
"""
from __future__ import annotations

import ctypes
import fcntl
import mmap
import os

import torch

ALIGN = 256     # bytes between the tensors laid out in a buffer: enough for any dtype and for vector stores


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class _AllocationProp(ctypes.Structure):     # CUmemAllocationProp
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int), ("location", _Location),
                ("win32HandleMetaData", ctypes.c_void_p), ("allocFlags", _AllocFlags)]


class _AccessDesc(ctypes.Structure):         # CUmemAccessDesc
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


_PINNED, _POSIX_FD, _ON_DEVICE, _READ_WRITE, _MINIMUM_GRANULARITY = 1, 1, 1, 3, 0


class _Driver:
    """The few CUDA driver calls a lent GPU buffer needs, on the device's primary context (torch's)."""

    def __init__(self):
        self.lib = ctypes.CDLL("libcuda.so.1")

    def __call__(self, name: str, *args) -> None:
        rc = getattr(self.lib, name)(*args)
        if rc != 0:
            text = ctypes.c_char_p()
            self.lib.cuGetErrorString(rc, ctypes.byref(text))
            raise RuntimeError(f"{name} failed: {text.value.decode() if text.value else rc}")

    def on_device(self, index: int) -> None:
        """Make the device's primary context current on this thread (torch's runtime calls may not have yet)."""
        torch.zeros(1, device=f"cuda:{index}")
        ctx = ctypes.c_void_p()
        self("cuCtxGetCurrent", ctypes.byref(ctx))
        device = ctypes.c_int()
        self("cuDeviceGet", ctypes.byref(device), ctypes.c_int(index))
        primary = ctypes.c_void_p()
        self("cuDevicePrimaryCtxRetain", ctypes.byref(primary), device)
        if ctx.value != primary.value:
            self("cuCtxSetCurrent", primary)
        self("cuDevicePrimaryCtxRelease", device)

    def map(self, handle: ctypes.c_ulonglong, size: int, index: int) -> int:
        ptr = ctypes.c_ulonglong()
        self("cuMemAddressReserve", ctypes.byref(ptr), ctypes.c_size_t(size), ctypes.c_size_t(0),
             ctypes.c_ulonglong(0), ctypes.c_ulonglong(0))
        self("cuMemMap", ptr, ctypes.c_size_t(size), ctypes.c_size_t(0), handle, ctypes.c_ulonglong(0))
        access = _AccessDesc(_Location(_ON_DEVICE, index), _READ_WRITE)
        self("cuMemSetAccess", ptr, ctypes.c_size_t(size), ctypes.byref(access), ctypes.c_size_t(1))
        return ptr.value

    def unmap(self, ptr: int, size: int) -> None:
        self("cuMemUnmap", ctypes.c_ulonglong(ptr), ctypes.c_size_t(size))
        self("cuMemAddressFree", ctypes.c_ulonglong(ptr), ctypes.c_size_t(size))


class _DevicePointer:
    """A device address as an object torch.as_tensor takes without copying (the CUDA array interface)."""

    def __init__(self, ptr: int, nbytes: int):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "strides": None,
                                         "version": 2}


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def gpu_size(nbytes: int, device: torch.device) -> int:
    """nbytes rounded up to the device's allocation granularity (what a lent GPU buffer really holds)."""
    drv, index = _Driver(), _index(device)
    drv.on_device(index)
    prop = _AllocationProp(_PINNED, _POSIX_FD, _Location(_ON_DEVICE, index))
    granularity = ctypes.c_size_t()
    drv("cuMemGetAllocationGranularity", ctypes.byref(granularity), ctypes.byref(prop),
        ctypes.c_int(_MINIMUM_GRANULARITY))
    return -(-max(nbytes, 1) // granularity.value) * granularity.value


class Lent:
    """A buffer of at least `nbytes` bytes on `device` that this process owns: `fd` to lend it (the receiver maps
    `nbytes`), `tensor` (uint8) to read it. close() when no work of this process uses it any more."""

    def __init__(self, nbytes: int, device: torch.device | str):
        self.device = torch.device(device)
        self._close = []
        try:
            if self.device.type == "cuda":
                self._lend_gpu(nbytes)
            else:
                self._lend_cpu(nbytes)
        except BaseException:
            self.close()
            raise

    def _lend_cpu(self, nbytes: int) -> None:
        self.nbytes = max(nbytes, 1)
        self.fd = os.memfd_create("lent", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        self._close.append(lambda: os.close(self.fd))
        os.ftruncate(self.fd, self.nbytes)
        # its size fixed for good: a borrower that shrank it would make this process's reads past the end a SIGBUS
        fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
        # the map lives as long as a view of it: it is unmapped when the last one is gone
        self.tensor = torch.frombuffer(mmap.mmap(self.fd, self.nbytes), dtype=torch.uint8)
        self._close.append(lambda: setattr(self, "tensor", None))

    def _lend_gpu(self, nbytes: int) -> None:
        drv, index = _Driver(), _index(self.device)
        self.nbytes = gpu_size(nbytes, self.device)
        prop = _AllocationProp(_PINNED, _POSIX_FD, _Location(_ON_DEVICE, index))
        handle = ctypes.c_ulonglong()
        drv("cuMemCreate", ctypes.byref(handle), ctypes.c_size_t(self.nbytes), ctypes.byref(prop),
            ctypes.c_ulonglong(0))
        self._close.append(lambda: drv("cuMemRelease", handle))
        fd = ctypes.c_int()
        drv("cuMemExportToShareableHandle", ctypes.byref(fd), handle, ctypes.c_int(_POSIX_FD), ctypes.c_ulonglong(0))
        self.fd = fd.value
        self._close.append(lambda: os.close(self.fd))
        ptr = drv.map(handle, self.nbytes, index)
        self._close.append(lambda: drv.unmap(ptr, self.nbytes))
        self.tensor = torch.as_tensor(_DevicePointer(ptr, self.nbytes), device=self.device)
        self._close.append(lambda: setattr(self, "tensor", None))

    def settle(self) -> None:
        """Wait until this process's writes into the buffer are done. Another process's kernels read it with no
        ordering against this process's streams: lent before that, they read what was there before."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def close(self) -> None:
        if self.device.type == "cuda" and self._close:
            torch.cuda.synchronize(self.device)
        while self._close:
            self._close.pop()()


class Borrowed:
    """The worker's side: the lent buffer behind `fd` (closed here) as `tensor`, uint8 [nbytes] on `device`, until
    release()."""

    def __init__(self, fd: int, nbytes: int, device: torch.device | str):
        self.device, self.nbytes, self.ptr = torch.device(device), nbytes, None
        try:
            if self.device.type == "cuda":
                drv, index = _Driver(), _index(self.device)
                drv.on_device(index)
                handle = ctypes.c_ulonglong()
                drv("cuMemImportFromShareableHandle", ctypes.byref(handle), ctypes.c_void_p(fd),
                    ctypes.c_int(_POSIX_FD))
                self.ptr = drv.map(handle, nbytes, index)
                drv("cuMemRelease", handle)         # the mapping keeps the memory
                self.tensor = torch.as_tensor(_DevicePointer(self.ptr, nbytes), device=self.device)
            else:
                self.tensor = torch.frombuffer(mmap.mmap(fd, nbytes), dtype=torch.uint8)
        finally:
            os.close(fd)

    def release(self) -> None:
        """Unmap (a GPU buffer once this process's work is done; a CPU one when its last view is gone)."""
        self.tensor = None
        if self.ptr is not None:
            torch.cuda.synchronize(self.device)
            _Driver().unmap(self.ptr, self.nbytes)
            self.ptr = None


def layout(specs: list[tuple[torch.dtype, tuple[int, ...]]]) -> tuple[list[int], int]:
    """Offsets of `specs` (dtype, shape) within one group, and the group's size, each aligned to ALIGN; groups (one
    per timed call) lie back to back."""
    offsets, size = [], 0
    for dtype, shape in specs:
        offsets.append(size)
        size += -(-(dtype.itemsize * int(torch.Size(shape).numel())) // ALIGN) * ALIGN
    return offsets, size


def views(buffer: torch.Tensor, specs: list[tuple[torch.dtype, tuple[int, ...]]], count: int) -> list[tuple]:
    """`count` groups of tensors (dtype, shape) laid out in buffer (uint8) by `layout`."""
    offsets, size = layout(specs)
    if count * size > buffer.numel():
        raise ValueError(f"a buffer of {buffer.numel()} bytes cannot hold {count} x {size}")
    return [tuple(buffer[k * size + off:k * size + off + dtype.itemsize * int(torch.Size(shape).numel())]
                  .view(dtype).view(shape) for (dtype, shape), off in zip(specs, offsets))
            for k in range(count)]

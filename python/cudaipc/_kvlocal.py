"""A KV space in this process (cudaipc.kv's Local): a layout over regions of memory
this process owns, built from the engines' common layouts (docs/kv.md's table) over
torch tensors (CUDA or CPU), CuPy arrays or NumPy arrays; and host memory readers
can map (alloc_host: a memfd). The Go package kv's space.go, Memory and Local.

A region is the memory a registration shares: a GPU tensor's own bytes, or for host
memory from alloc_host the whole memfd (so that several tensors in one buffer are
one region, each at its own base); other host memory (any NumPy array or CPU
tensor) can be a read's destination but cannot be registered.
"""

from __future__ import annotations

import bisect
import fcntl
import math
import mmap
import os
import threading
import weakref
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

from . import _cuda
from ._kvdesc import Layout, Part, check_layout, uuid_text
from .errors import LayoutMismatch

__all__ = ["Memory", "Local", "alloc_host", "vllm_layout", "sglang_layout", "offload_layout", "memory_of"]


class _HostMap(mmap.mmap):
    """A read-write shared mapping of a sealable memfd (alloc_host's), which keeps
    the memfd open while it lives."""
    fd: int
    addr: int


_maps_lock = threading.Lock()
_maps: List[Tuple[int, "weakref.ref[_HostMap]"]] = []   # (address, map), by address


def _memfd_of(addr: int, size: int) -> Optional[_HostMap]:
    """The live alloc_host mapping [addr, addr + size) lies in, if any."""
    with _maps_lock:
        _maps[:] = [(a, r) for a, r in _maps if r() is not None]
        i = bisect.bisect_right([a for a, _ in _maps], addr) - 1
        if i >= 0:
            a, r = _maps[i]
            m = r()
            if m is not None and addr + size <= a + len(m):
                return m
    return None


def alloc_host(shape: Union[int, Sequence[int]], dtype: Any = "uint8") -> Any:
    """A zeroed NumPy array of ``shape`` and ``dtype`` in host memory other
    processes can map: a memfd created with MFD_ALLOW_SEALING and sealed against
    shrinking (what the daemon requires of registered host memory, so that no
    reader's mapping can lose its pages). Build a host space's layout over it (or
    over views of it, e.g. ``torch.from_numpy``) and register it with
    :func:`cudaipc.kv.register`. The memory lives while the array or any view of it
    does; readers that mapped it keep it until they unmap."""
    import numpy as np
    dt = np.dtype(dtype)
    shp = (shape,) if isinstance(shape, int) else tuple(int(s) for s in shape)
    n = int(math.prod(shp)) * dt.itemsize
    if n <= 0:
        raise ValueError("kv.alloc_host: shape %r of %s is %d bytes: want > 0" % (shp, dt, n))
    fd = os.memfd_create("cudaipc-kv", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, n)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
        m = _HostMap(fd, n, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException:
        os.close(fd)
        raise
    m.fd = fd
    weakref.finalize(m, os.close, fd)
    arr = np.frombuffer(m, dtype=dt).reshape(shp)
    m.addr = int(arr.ctypes.data)
    with _maps_lock:
        _insert(m)
    return arr


def _insert(m: _HostMap) -> None:
    """Add m to the address-ordered list (the caller holds _maps_lock)."""
    i = bisect.bisect_right([a for a, _ in _maps], m.addr)
    _maps.insert(i, (m.addr, weakref.ref(m)))


class Memory:
    """One region of a local space: ``size`` bytes at ``addr`` on ``device``
    ("host" or a GPU UUID; ``ordinal`` is this process's ordinal of that GPU, None for
    host), ``fd`` the memfd of registrable host memory (-1 otherwise), ``writable``
    whether reads may write it, and ``owner`` what keeps the memory alive."""

    __slots__ = ("device", "addr", "size", "ordinal", "fd", "writable", "owner")

    def __init__(self, device: str, addr: int, size: int, ordinal: Optional[int], fd: int, writable: bool, owner: Any):
        self.device, self.addr, self.size, self.ordinal = device, addr, size, ordinal
        self.fd, self.writable, self.owner = fd, writable, owner

    @property
    def is_gpu(self) -> bool:
        return self.ordinal is not None

    def __repr__(self) -> str:
        return "<kv.Memory %d bytes at %#x on %s>" % (self.size, self.addr, self.device)


class _Tensor:
    """What the layout helpers need of a tensor or array: its shape, item size,
    address, byte size, contiguity and device (ordinal None for host)."""

    def __init__(self, obj: Any, what: str):
        self.obj = obj
        if hasattr(obj, "data_ptr") and hasattr(obj, "element_size"):            # torch
            self.shape = tuple(int(s) for s in obj.shape)
            self.itemsize = int(obj.element_size())
            self.addr = int(obj.data_ptr())
            self.contiguous = bool(obj.is_contiguous())
            self.cuda = bool(obj.is_cuda)
            self.writable = True
        elif hasattr(obj, "__cuda_array_interface__"):                          # CuPy and friends
            cai = obj.__cuda_array_interface__
            self.shape = tuple(int(s) for s in cai["shape"])
            self.itemsize = int(obj.itemsize)
            self.addr = int(cai["data"][0])
            self.contiguous = bool(obj.flags.c_contiguous)
            self.cuda = True
            self.writable = not cai["data"][1]
        elif hasattr(obj, "__array_interface__") and hasattr(obj, "flags"):      # NumPy
            self.shape = tuple(int(s) for s in obj.shape)
            self.itemsize = int(obj.itemsize)
            self.addr = int(obj.__array_interface__["data"][0])
            self.contiguous = bool(obj.flags["C_CONTIGUOUS"])
            self.cuda = False
            self.writable = bool(obj.flags["WRITEABLE"])
        else:
            raise TypeError("kv: %s is a %s: want a torch.Tensor, a CuPy array or a NumPy array" % (what, type(obj).__name__))
        if not self.contiguous:
            raise ValueError("kv: %s of shape %r is not contiguous: a KV layout needs each tensor's memory in one piece "
                             "(pass the cache tensor itself, not a transposed or sliced view)" % (what, self.shape))
        self.nbytes = int(math.prod(self.shape)) * self.itemsize
        if self.nbytes <= 0:
            raise ValueError("kv: %s of shape %r is empty" % (what, self.shape))


def memory_of(obj: Any, what: str = "region") -> Tuple[Memory, int]:
    """The region a tensor or array lies in and its offset there: for host memory
    from alloc_host the whole memfd, else the tensor's own bytes."""
    t = obj if isinstance(obj, _Tensor) else _Tensor(obj, what)
    if t.cuda:
        ordinal = _cuda.pointer_ordinal(t.addr)
        device = uuid_text(_cuda.uuids()[ordinal])
        return Memory(device, t.addr, t.nbytes, ordinal, -1, t.writable, t.obj), 0
    m = _memfd_of(t.addr, t.nbytes)
    if m is not None:
        return Memory("host", m.addr, len(m), None, m.fd, True, m), t.addr - m.addr
    return Memory("host", t.addr, t.nbytes, None, -1, t.writable, t.obj), 0


class Local:
    """A KV space in this process: its ``layout`` over its ``memory``, region by
    region (Go's kv.Local). It is what :func:`cudaipc.kv.register` registers and what
    a read writes into. Build one with :func:`vllm_layout`, :func:`sglang_layout` or
    :func:`offload_layout`, or give a layout of your own over regions (tensors or
    arrays, each region its whole memory)."""

    def __init__(self, layout: Layout, memory: Sequence[Any]):
        self.layout = layout
        self.memory: List[Memory] = [m if isinstance(m, Memory) else memory_of(m, "region %d" % i)[0]
                                     for i, m in enumerate(memory)]
        # The kv.Space this memory is registered as (kv.register binds it, until the
        # space closes): a read from another node is written by the daemon into
        # that registration.
        self.space: Optional[Any] = None
        self.check()

    @property
    def blocks(self) -> int:
        return self.layout.blocks

    @property
    def layers(self) -> List[List[Part]]:
        return self.layout.layers

    def check(self) -> None:
        """Check the layout against the memory (every block of every part inside its
        region); raises InvalidDescError."""
        mem = self.memory
        check_layout(self.layout, lambda i: mem[i].size if 0 <= i < len(mem) else None)

    def __repr__(self) -> str:
        devs = sorted({m.device for m in self.memory})
        return "<kv.Local %d layers x %d parts, %d blocks, %d regions on %s>" % (
            len(self.layers), len(self.layers[0]) if self.layers else 0, self.blocks, len(self.memory), ", ".join(devs))


class _Regions:
    """Regions of a layout under construction: one per memfd (alloc_host memory) or
    per tensor (anything else)."""

    def __init__(self) -> None:
        self.memory: List[Memory] = []
        self._by_fd: Dict[int, int] = {}

    def add(self, t: _Tensor, what: str) -> Tuple[int, int]:
        """The region index of tensor t and its offset in that region."""
        m, off = memory_of(t, what)
        if m.fd >= 0:
            i = self._by_fd.get(m.fd)
            if i is not None:
                return i, off
            self._by_fd[m.fd] = len(self.memory)
        self.memory.append(m)
        return len(self.memory) - 1, off


def _tensors(caches: Any, what: str) -> List[Any]:
    """A sequence of per-layer tensors from a list, a tuple or a dict (vLLM's
    register_kv_caches gives {layer name: tensor}, in layer order)."""
    if isinstance(caches, dict):
        caches = list(caches.values())
    out = list(caches)
    if not out:
        raise ValueError("kv: no %s: want one per layer" % what)
    return out


def _same_blocks(blocks: List[int], what: str) -> int:
    if len(set(blocks)) != 1:
        raise LayoutMismatch("kv: %s have %s blocks: every layer of a space has the same number of blocks" % (what, blocks))
    return blocks[0]


def vllm_layout(kv_caches: Any, *, blocks_first: bool = False) -> Local:
    """The space of vLLM's per-layer KV caches (a list of tensors, or the dict that
    ``register_kv_caches`` gets): each of shape ``[2, num_blocks, block_size,
    kv_heads, head_dim]`` (K blocks, then V blocks), or with ``blocks_first``
    ``[num_blocks, 2, block_size, ...]`` (K and V of a block side by side). A block
    of a part is ``prod(shape[2:])`` elements. Two parts a layer, K then V."""
    ts = [_Tensor(c, "layer %d's KV cache" % i) for i, c in enumerate(_tensors(kv_caches, "vLLM KV caches"))]
    regs = _Regions()
    layers: List[List[Part]] = []
    blocks: List[int] = []
    for i, t in enumerate(ts):
        kdim = 1 if blocks_first else 0
        if len(t.shape) < 3 or t.shape[kdim] != 2:
            want = "[num_blocks, 2, block_size, ...]" if blocks_first else "[2, num_blocks, block_size, ...]"
            raise ValueError("kv: layer %d's KV cache has shape %r: want %s%s" % (
                i, t.shape, want, "" if blocks_first else " (blocks_first=True for [num_blocks, 2, ...])"))
        nb = t.shape[0] if blocks_first else t.shape[1]
        b = int(math.prod(t.shape[2:])) * t.itemsize
        r, off = regs.add(t, "layer %d's KV cache" % i)
        if blocks_first:
            layers.append([Part(r, off, 2 * b, b), Part(r, off + b, 2 * b, b)])
        else:
            layers.append([Part(r, off, b, b), Part(r, off + nb * b, b, b)])
        blocks.append(nb)
    return Local(Layout(_same_blocks(blocks, "the layers' KV caches"), layers), regs.memory)


def sglang_layout(k_buffers: Any, v_buffers: Any, *, page_size: int = 1) -> Local:
    """The space of SGLang's per-layer K and V buffers (``MHATokenToKVPool``'s
    ``k_buffer`` and ``v_buffer`` lists), each of shape ``[tokens, heads, head_dim]``
    (any trailing shape): a block is ``page_size`` tokens, and a space has
    ``tokens // page_size`` blocks (a last partial page is not addressable). Two
    parts a layer, K in the K buffer, V in the V buffer."""
    ks, vs = _tensors(k_buffers, "SGLang K buffers"), _tensors(v_buffers, "SGLang V buffers")
    if len(ks) != len(vs):
        raise LayoutMismatch("kv: %d K buffers and %d V buffers: want one of each a layer" % (len(ks), len(vs)))
    if not isinstance(page_size, int) or page_size <= 0:
        raise ValueError("kv: page_size %r: want a positive number of tokens" % (page_size,))
    regs = _Regions()
    layers: List[List[Part]] = []
    blocks: List[int] = []
    for i, (k, v) in enumerate(zip(ks, vs)):
        row: List[Part] = []
        for name, obj in (("K", k), ("V", v)):
            t = _Tensor(obj, "layer %d's %s buffer" % (i, name))
            if len(t.shape) < 1 or t.shape[0] < page_size:
                raise ValueError("kv: layer %d's %s buffer has shape %r: want [tokens, ...] of at least one page (%d tokens)"
                                 % (i, name, t.shape, page_size))
            b = page_size * int(math.prod(t.shape[1:])) * t.itemsize
            r, off = regs.add(t, "layer %d's %s buffer" % (i, name))
            row.append(Part(r, off, b, b))
            blocks.append(t.shape[0] // page_size)
        layers.append(row)
    return Local(Layout(_same_blocks(blocks, "the K and V buffers"), layers), regs.memory)


def offload_layout(buffer: Any) -> Local:
    """The space of a block-major offload buffer (all layers of a block together,
    as a host offload tier keeps them): one tensor of shape ``[num_blocks, layers,
    parts, ...]`` (parts 2 for K and V); a block of a part is ``prod(shape[3:])``
    elements. Part p of layer l: base ``(parts*l + p) * bytes``, stride ``layers *
    parts * bytes``."""
    t = _Tensor(buffer, "the offload buffer")
    if len(t.shape) < 3:
        raise ValueError("kv: the offload buffer has shape %r: want [num_blocks, layers, parts, ...]" % (t.shape,))
    nb, nl, np_ = t.shape[:3]
    b = int(math.prod(t.shape[3:])) * t.itemsize
    regs = _Regions()
    r, off = regs.add(t, "the offload buffer")
    per = nl * np_ * b
    layers = [[Part(r, off + (np_ * l + p) * b, per, b) for p in range(np_)] for l in range(nl)]
    return Local(Layout(nb, layers), regs.memory)


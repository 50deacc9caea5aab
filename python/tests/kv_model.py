"""Disaggregated prefill and decode of a real model through KV spaces, for
test_kv_model.py (a small torch model, host memory) and test_kv_model_gpu.py (a
transformers Llama with random weights, GPU memory).

The pieces:

- :class:`TinyModel`, a decoder written here (causal attention with grouped KV heads
  and rotary positions, a gated MLP, RMS norms), with a KV cache per layer of shape
  ``[batch, kv_heads, seq, head_dim]``: what runs where transformers is not installed;
  :class:`HFModel` wraps a transformers ``LlamaForCausalLM`` behind the same calls.
- Paging: :func:`page_in` copies a contiguous KV cache into vLLM's per-layer paged
  layout ``[2, num_blocks, block_size, kv_heads, head_dim]`` at given block ids (vLLM's
  ``reshape_and_cache`` through a slot mapping), :func:`page_out` copies it back.
- The roles, each a process (``python kv_model.py ROLE JSON``):

  ``prefill`` runs each prompt, pages its cache into a paged cache of its own at
  scattered block ids, registered as a KV space (cudaipc.kv), and prints one JSON line
  a request: the space's description, the block ids, the prompt's length and first
  token (what vLLM carries from prefill to decode in ``kv_transfer_params``); then it
  keeps the space until its input ends.

  ``decode`` registers its own paged cache as a space with its daemon (which writes
  into it when the prefill's daemon is another node of a cluster), reads each
  request's blocks into it at other block ids with one ``read_blocks``, rebuilds the
  cache layer by layer as each layer's blocks arrive (``wait_layer``) and generates
  greedily; it prints one JSON line a request (done, or the read's error and the
  blocks it names) and saves tokens and logits, and beside them the same model doing
  prefill and decode in this one process.

- :func:`disaggregate` and :func:`killed_prefill` run the roles for the tests,
  :func:`check_decoded` compares.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

BLOCK_SIZE = 16
"""Tokens a KV block holds (vLLM's default)."""

KV = List[Tuple[torch.Tensor, torch.Tensor]]
"""A KV cache: per layer (K, V), each ``[batch, kv_heads, seq, head_dim]``."""


@dataclass
class ModelConfig:
    """The shape of the model on both sides, and how it is made (``kind``: ``tiny`` for
    :class:`TinyModel`, ``llama`` for transformers' Llama; weights from ``seed``)."""

    kind: str = "tiny"
    vocab: int = 1000
    hidden: int = 256
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 64
    mlp: int = 512
    seed: int = 1234
    dtype: str = "float32"
    device: str = "cpu"

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)


# --- the models -------------------------------------------------------------------------


def _rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w


def _rope(x: torch.Tensor, pos: torch.Tensor, theta: float = 10000.0) -> torch.Tensor:
    """Rotary position embedding of x ``[batch, heads, seq, dim]`` at positions pos ``[seq]``."""
    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d))
    ang = pos.to(torch.float32)[:, None] * inv[None, :]
    cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


class TinyModel:
    """A small decoder with random weights from the config's seed: per layer, causal
    attention whose ``heads`` query heads share ``kv_heads`` KV heads (GQA), rotary
    positions, and a gated MLP; the cache is a list of (K, V) a layer."""

    def __init__(self, cfg: ModelConfig):
        self.cfg = cfg
        g = torch.Generator().manual_seed(cfg.seed)

        def w(*shape: int) -> torch.Tensor:
            t = torch.randn(*shape, generator=g) / math.sqrt(shape[0])
            return t.to(device=cfg.device, dtype=cfg.torch_dtype)

        def norm() -> torch.Tensor:
            t = 1.0 + 0.1 * torch.randn(cfg.hidden, generator=g)
            return t.to(device=cfg.device, dtype=cfg.torch_dtype)

        h, q, kv = cfg.hidden, cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
        self.embed = (torch.randn(cfg.vocab, h, generator=g)).to(device=cfg.device, dtype=cfg.torch_dtype)
        self.blocks = [dict(n1=norm(), wq=w(h, q), wk=w(h, kv), wv=w(h, kv), wo=w(q, h),
                            n2=norm(), w1=w(h, cfg.mlp), w3=w(h, cfg.mlp), w2=w(cfg.mlp, h))
                       for _ in range(cfg.layers)]
        self.norm = norm()
        self.head = w(h, cfg.vocab)

    @torch.no_grad()
    def forward(self, ids: torch.Tensor, cache: Optional[KV]) -> Tuple[torch.Tensor, KV]:
        """Logits ``[batch, seq, vocab]`` of ids ``[batch, seq]`` after the cached tokens,
        and the cache with ids' keys and values appended (a new list)."""
        cfg = self.cfg
        b, t = ids.shape
        past = cache[0][0].shape[2] if cache else 0
        pos = torch.arange(past, past + t, device=ids.device)
        x = self.embed[ids]
        out: KV = []
        for i, p in enumerate(self.blocks):
            hx = _rms_norm(x, p["n1"])
            q = (hx @ p["wq"]).view(b, t, cfg.heads, cfg.head_dim).transpose(1, 2)
            k = (hx @ p["wk"]).view(b, t, cfg.kv_heads, cfg.head_dim).transpose(1, 2)
            v = (hx @ p["wv"]).view(b, t, cfg.kv_heads, cfg.head_dim).transpose(1, 2)
            q, k = _rope(q, pos), _rope(k, pos)
            if cache:
                k = torch.cat((cache[i][0], k), dim=2)
                v = torch.cat((cache[i][1], v), dim=2)
            out.append((k, v))
            rep = cfg.heads // cfg.kv_heads
            kk, vv = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
            s = (q @ kk.transpose(-1, -2)) / math.sqrt(cfg.head_dim)
            # Query j (absolute position past + j) sees keys 0 .. past + j.
            mask = torch.ones(t, past + t, dtype=torch.bool, device=ids.device).tril(past)
            s = s.masked_fill(~mask, float("-inf"))
            a = torch.softmax(s.float(), dim=-1).to(vv.dtype) @ vv
            x = x + a.transpose(1, 2).reshape(b, t, -1) @ p["wo"]
            hx = _rms_norm(x, p["n2"])
            x = x + (torch.nn.functional.silu(hx @ p["w1"]) * (hx @ p["w3"])) @ p["w2"]
        return _rms_norm(x, self.norm) @ self.head, out

    def prefill(self, ids: torch.Tensor) -> Tuple[torch.Tensor, Any]:
        """The prompt's last logits ``[vocab]`` and its cache (this model's own form)."""
        logits, cache = self.forward(ids, None)
        return logits[0, -1], cache

    def step(self, token: int, cache: Any) -> Tuple[torch.Tensor, Any]:
        """One decode step: the logits ``[vocab]`` after token, and the grown cache."""
        ids = torch.tensor([[token]], device=self.cfg.device)
        logits, cache = self.forward(ids, cache)
        return logits[0, -1], cache

    def to_layers(self, cache: Any) -> KV:
        """The cache as (K, V) a layer."""
        return list(cache)

    def from_layers(self, kv: KV) -> Any:
        """A cache of this model's form from (K, V) a layer."""
        return list(kv)


class HFModel:
    """transformers' ``LlamaForCausalLM`` built from a ``LlamaConfig`` of the config's
    shape with random weights (``torch.manual_seed(seed)`` before construction: the same
    weights in every process), eager attention, behind :class:`TinyModel`'s calls; its
    cache is a ``DynamicCache``."""

    def __init__(self, cfg: ModelConfig):
        from transformers import LlamaConfig, LlamaForCausalLM
        self.cfg = cfg
        conf = LlamaConfig(vocab_size=cfg.vocab, hidden_size=cfg.hidden, intermediate_size=cfg.mlp,
                           num_hidden_layers=cfg.layers, num_attention_heads=cfg.heads,
                           num_key_value_heads=cfg.kv_heads, head_dim=cfg.head_dim,
                           max_position_embeddings=4096, initializer_range=0.1, attn_implementation="eager")
        torch.manual_seed(cfg.seed)
        self.model = LlamaForCausalLM(conf).to(device=cfg.device, dtype=cfg.torch_dtype).eval()

    @torch.no_grad()
    def prefill(self, ids: torch.Tensor) -> Tuple[torch.Tensor, Any]:
        out = self.model(input_ids=ids, use_cache=True)
        return out.logits[0, -1], out.past_key_values

    @torch.no_grad()
    def step(self, token: int, cache: Any) -> Tuple[torch.Tensor, Any]:
        ids = torch.tensor([[token]], device=self.cfg.device)
        out = self.model(input_ids=ids, past_key_values=cache, use_cache=True)
        return out.logits[0, -1], out.past_key_values

    def to_layers(self, cache: Any) -> KV:
        if hasattr(cache, "layers"):  # transformers >= 4.56: a DynamicLayer a layer
            return [(lay.keys, lay.values) for lay in cache.layers]
        if hasattr(cache, "key_cache"):
            return list(zip(cache.key_cache, cache.value_cache))
        return [(k, v) for k, v in cache]

    def from_layers(self, kv: KV) -> Any:
        from transformers import DynamicCache
        try:
            cache = DynamicCache(config=self.model.config)
        except TypeError:
            cache = DynamicCache()
        for i, (k, v) in enumerate(kv):
            cache.update(k, v, i)
        return cache


def make_model(cfg: ModelConfig) -> Any:
    """The model the config names, with its weights."""
    if cfg.kind == "tiny":
        return TinyModel(cfg)
    if cfg.kind == "llama":
        return HFModel(cfg)
    raise ValueError("unknown model kind %r" % cfg.kind)


def prompt(cfg: ModelConfig, length: int) -> torch.Tensor:
    """The test prompt of length tokens ``[1, length]`` (random ids, seeded by length)."""
    g = torch.Generator().manual_seed(cfg.seed * 7919 + length)
    return torch.randint(0, cfg.vocab, (1, length), generator=g).to(cfg.device)


def decode(model: Any, cache: Any, first: int, steps: int) -> Tuple[List[int], torch.Tensor]:
    """Greedy decoding of steps tokens after first: the tokens and each step's logits
    ``[steps, vocab]`` (step i's logits are those that chose token i)."""
    tokens, logits = [], []
    tok = first
    for _ in range(steps):
        lg, cache = model.step(tok, cache)
        tok = int(torch.argmax(lg).item())
        tokens.append(tok)
        logits.append(lg)
    return tokens, torch.stack(logits)


def reference(cfg: ModelConfig, lengths: Sequence[int], steps: int) -> Dict[int, Dict[str, Any]]:
    """One process doing prefill and decode: per prompt length, the first token and the
    prompt's last logits, then the decoded tokens and their logits."""
    model = make_model(cfg)
    out = {}
    for n in lengths:
        last, cache = model.prefill(prompt(cfg, n))
        first = int(torch.argmax(last).item())
        tokens, logits = decode(model, cache, first, steps)
        out[n] = dict(first=first, prefill_logits=last.cpu(), tokens=tokens, logits=logits.cpu())
    return out


# --- paging -----------------------------------------------------------------------------


def blocks_for(seq: int, block_size: int = BLOCK_SIZE) -> int:
    """How many blocks seq tokens take."""
    return -(-seq // block_size)


def slot_mapping(blocks: Sequence[int], seq: int, block_size: int = BLOCK_SIZE) -> torch.Tensor:
    """vLLM's slot mapping: token i of a request whose block table is blocks lies in
    slot ``blocks[i // block_size] * block_size + i % block_size`` of the flattened cache."""
    if len(blocks) != blocks_for(seq, block_size):
        raise ValueError("%d tokens take %d blocks of %d, not %d" % (seq, blocks_for(seq, block_size), block_size, len(blocks)))
    i = torch.arange(seq)
    return torch.tensor(list(blocks), dtype=torch.long)[i // block_size] * block_size + i % block_size


def paged_cache(cfg: ModelConfig, num_blocks: int, block_size: int = BLOCK_SIZE,
                alloc: Optional[Callable[[int], torch.Tensor]] = None) -> List[torch.Tensor]:
    """A paged KV cache of num_blocks blocks, as vLLM allocates it: a tensor a layer of
    shape ``[2, num_blocks, block_size, kv_heads, head_dim]`` (K then V), on the config's
    device, filled with random values so that a block never written is not zero.
    ``alloc(nbytes)``, if given, allocates each layer's memory (a uint8 tensor), e.g. host
    memory other processes can map."""
    g = torch.Generator().manual_seed(cfg.seed + num_blocks)
    shape = (2, num_blocks, block_size, cfg.kv_heads, cfg.head_dim)
    out = []
    for _ in range(cfg.layers):
        fill = torch.randn(shape, generator=g).to(device=cfg.device, dtype=cfg.torch_dtype)
        if alloc is None:
            out.append(fill)
            continue
        t = alloc(fill.numel() * fill.element_size()).view(cfg.torch_dtype).view(shape)
        t.copy_(fill)
        out.append(t)
    return out


def page_in_layer(k: torch.Tensor, v: torch.Tensor, paged: torch.Tensor, blocks: Sequence[int]) -> None:
    """Copy one layer's K and V ``[1, kv_heads, seq, head_dim]`` into paged
    ``[2, num_blocks, block_size, kv_heads, head_dim]`` at the request's blocks (the
    slots past the sequence in its last block are left as they were)."""
    _, nb, bs, h, d = paged.shape
    slots = slot_mapping(blocks, k.shape[2], bs).to(paged.device)
    for part, x in enumerate((k, v)):
        paged[part].view(nb * bs, h, d)[slots] = x[0].transpose(0, 1).to(paged.dtype)


def page_out_layer(paged: torch.Tensor, blocks: Sequence[int], seq: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """The inverse of :func:`page_in_layer`: one layer's K and V ``[1, kv_heads, seq,
    head_dim]`` (contiguous, new tensors) from the request's blocks of paged."""
    _, nb, bs, h, d = paged.shape
    slots = slot_mapping(blocks, seq, bs).to(paged.device)
    k, v = (paged[part].view(nb * bs, h, d)[slots].transpose(0, 1).unsqueeze(0).contiguous() for part in (0, 1))
    return k, v


def page_in(kv: KV, paged: Sequence[torch.Tensor], blocks: Sequence[int]) -> None:
    """Copy a request's cache, layer by layer, into the paged cache at its blocks."""
    if len(kv) != len(paged):
        raise ValueError("a cache of %d layers into a paged cache of %d" % (len(kv), len(paged)))
    for (k, v), p in zip(kv, paged):
        page_in_layer(k, v, p, blocks)


def page_out(paged: Sequence[torch.Tensor], blocks: Sequence[int], seq: int) -> KV:
    """A request's cache of seq tokens from its blocks of the paged cache."""
    return [page_out_layer(p, blocks, seq) for p in paged]


def scattered(num_blocks: int, seed: int) -> List[int]:
    """All block ids of a paged cache in a random order: requests take them in turn, so
    that a request's blocks are scattered, as a busy engine's are."""
    return torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()


# --- the roles --------------------------------------------------------------------------


def _say(msg: Dict[str, Any]) -> None:
    print(json.dumps(msg), flush=True)


def _connect(socket: str) -> Any:
    import cudaipc
    return cudaipc.connect(socket)


def _alloc(cfg: ModelConfig) -> Optional[Callable[[int], torch.Tensor]]:
    """How a role allocates its paged cache: host memory other processes can map (a
    memfd: kv.alloc_host) on the CPU; torch's allocator on a GPU (with
    expandable_segments:True in PYTORCH_CUDA_ALLOC_CONF, VMM memory shared by
    descriptor; else cudaMalloc memory, shared by legacy IPC)."""
    if cfg.device != "cpu":
        return None
    from cudaipc import kv as ckv
    return lambda n: torch.from_numpy(ckv.alloc_host(n))


def role_prefill(a: Dict[str, Any]) -> None:
    """Args: socket, name (the space's), model (a ModelConfig's fields), lengths,
    num_blocks, block_seed. Registers its paged cache as the space name, then per
    length runs a prompt, pages its cache in at the next scattered blocks and prints
    {"length", "desc" (the space's description, base64), "blocks", "first" (the token
    the prompt's last logits choose), "prefill_logits"}; then {"ready": true} and keeps
    the space until its input ends."""
    from cudaipc import kv as ckv
    cfg = ModelConfig(**a["model"])
    if cfg.device != "cpu":
        torch.cuda.set_device(torch.device(cfg.device))
    model = make_model(cfg)
    paged = paged_cache(cfg, a["num_blocks"], alloc=_alloc(cfg))
    free = scattered(a["num_blocks"], a["block_seed"])
    store = _connect(a["socket"])
    space = ckv.register(store, a["name"], paged)
    meta = space.desc.to_text()
    for n in a["lengths"]:
        last, cache = model.prefill(prompt(cfg, n))
        blocks, free = free[:blocks_for(n)], free[blocks_for(n):]
        page_in(model.to_layers(cache), paged, blocks)
        if cfg.device != "cpu":
            torch.cuda.synchronize()   # the blocks are written before a reader is told of them
        _say(dict(length=n, desc=meta, blocks=blocks, first=int(torch.argmax(last).item()),
                  prefill_logits=last.float().cpu().tolist()))
    _say(dict(ready=True, pid=os.getpid()))
    sys.stdin.read()
    space.close()
    store.close()


def role_decode(a: Dict[str, Any]) -> None:
    """Args: socket, model, requests (prefill's lines), num_blocks, block_seed, steps,
    out, reference (bool). Reads each request's blocks with one read, waits layer by
    layer, rebuilds the cache and decodes; prints a JSON line a request, {"length",
    "ok": true, "blocks"} or {"length", "blocks", "error", "error_blocks", "layer",
    "space", "message", "cause"} (blocks: its own, the read's destination; the rest the
    read's BlockError, cause its cause's class), and saves (torch.save, at out) {"decoded":
    {length: {tokens, logits}}, "reference": reference(...) of the requests' lengths, if
    asked: this process doing prefill and decode itself}."""
    from cudaipc import kv as ckv
    cfg = ModelConfig(**a["model"])
    if cfg.device != "cpu":
        torch.cuda.set_device(torch.device(cfg.device))
    model = make_model(cfg)
    paged = paged_cache(cfg, a["num_blocks"], alloc=_alloc(cfg))
    free = scattered(a["num_blocks"], a["block_seed"])
    store = _connect(a["socket"])
    if cfg.device != "cpu":
        # The read copies on a stream of its own (or its daemon writes), which does not
        # wait for torch's: the paged cache's filling must be done before a read can
        # write into it.
        torch.cuda.synchronize()
    # Registered with its daemon, which writes into it when a request's blocks are on
    # another node (on the prefill's node the read copies them itself).
    space = ckv.register(store, "kvmodel/decode-%d/kv" % os.getpid(), paged)
    decoded: Dict[int, Dict[str, Any]] = {}
    for req in a["requests"]:
        n = req["length"]
        mine, free = free[:blocks_for(n)], free[blocks_for(n):]
        try:
            t = ckv.read_blocks(store, src=req["desc"], src_blocks=req["blocks"], dst=space, dst_blocks=mine)
            kv: KV = []
            for layer in range(cfg.layers):
                t.wait_layer(layer, timeout=60)
                kv.append(page_out_layer(paged[layer], mine, n))
            t.wait(timeout=60)
        except ckv.BlockError as e:
            _say(dict(length=n, error=type(e).__name__, blocks=mine, error_blocks=e.blocks, layer=e.layer,
                      space=e.space, message=str(e), cause=type(e.cause).__name__))
            continue
        tokens, logits = decode(model, model.from_layers(kv), req["first"], a["steps"])
        decoded[n] = dict(tokens=tokens, logits=logits.cpu())
        _say(dict(length=n, ok=True, blocks=mine))
    ref = reference(cfg, [r["length"] for r in a["requests"]], a["steps"]) if a.get("reference") else {}
    torch.save(dict(decoded=decoded, reference=ref), a["out"])
    space.close()
    store.close()


# --- running the roles (the test's side) ------------------------------------------------


class Prefill:
    """A prefill process, started with its role's arguments: :attr:`requests` are its
    JSON lines, one a request, read once it says it is ready. Its space lives until
    :meth:`close` (its input ends) or :meth:`kill` (``kill -9``)."""

    def __init__(self, args: Dict[str, Any], env: Optional[Dict[str, str]] = None, timeout: float = 120.0):
        self.err = tempfile.TemporaryFile()
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "prefill", json.dumps(args)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.err, env=env)
        lines: "queue.Queue[Optional[bytes]]" = queue.Queue()

        def pump() -> None:
            assert self.proc.stdout is not None
            for line in self.proc.stdout:
                lines.put(line)
            lines.put(None)
        threading.Thread(target=pump, daemon=True).start()
        self.requests: List[Dict[str, Any]] = []
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                self.kill()
                raise RuntimeError("prefill did not get ready in %.0f s: %s" % (timeout, self.stderr()))
            if line is None:
                self.proc.wait()
                raise RuntimeError("prefill exited (%s) before it was ready: %s" % (self.proc.returncode, self.stderr()))
            msg = json.loads(line)
            if msg.get("ready"):
                break
            self.requests.append(msg)

    def stderr(self) -> str:
        """What the process wrote on its standard error (its last 4,000 characters)."""
        self.err.seek(0)
        return self.err.read().decode(errors="replace")[-4000:]

    def kill(self) -> None:
        """kill -9 the process and reap it."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(30)

    def close(self) -> None:
        """End its input (it closes its space and exits) and wait for it."""
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()
        self.err.close()

    def __enter__(self) -> "Prefill":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def run_role(role: str, args: Dict[str, Any], env: Optional[Dict[str, str]] = None,
             timeout: float = 300.0) -> List[Dict[str, Any]]:
    """Run a decode or reference process to its end; its JSON lines. A non-zero exit
    raises with its standard error."""
    r = subprocess.run([sys.executable, os.path.abspath(__file__), role, json.dumps(args)],
                       capture_output=True, timeout=timeout, env=env, stdin=subprocess.DEVNULL)
    if r.returncode != 0:
        raise RuntimeError("%s exited %d: %s" % (role, r.returncode, r.stderr.decode(errors="replace")[-4000:]))
    return [json.loads(x) for x in r.stdout.decode().splitlines() if x.startswith("{")]


NODES = ["one-node", "two-nodes"]
"""Where the decode process's daemon is, for the tests' ``daemons`` fixtures: "one-node"
is the prefill's own daemon; "two-nodes" a second daemon of a cluster on this host
(etcd, UCX over tcp on loopback), so that the read crosses nodes (docs/kv.md, "Across
nodes")."""


@contextlib.contextmanager
def daemons(nodes: str, cudaipc_bin: str, args: List[str], etcd: Optional[str] = None) -> Iterator[Tuple[Any, Any]]:
    """(the prefill's daemon, the decode's daemon) for nodes (see :data:`NODES`), each
    started with args; for "two-nodes", members of the cluster whose directory is etcd
    (clusterutil.daemons)."""
    from clusterutil import daemons as pair
    with pair(nodes, cudaipc_bin, args, etcd) as p:
        yield p


def disaggregate(cfg: ModelConfig, lengths: Sequence[int], steps: int, prefill_socket: str, decode_socket: str,
                 out: str, env: Optional[Dict[str, str]] = None) -> Tuple[List[Dict[str, Any]], List[Dict[str, Any]], Dict[str, Any]]:
    """One prefill process (on prefill_socket's daemon) serving the prompts of lengths,
    and one decode process (on decode_socket's) reading and decoding them, which also
    computes the reference in-process; the prefill's lines, the decode's lines, and the
    decode's saved results. The two paged caches differ in size and block order."""
    need = sum(blocks_for(n) for n in lengths)
    args = dict(socket=prefill_socket, name="kvmodel/prefill/kv", model=asdict(cfg), lengths=list(lengths),
                num_blocks=need + 11, block_seed=1)
    with Prefill(args, env=env) as p:
        lines = run_role("decode", dict(socket=decode_socket, model=asdict(cfg), requests=p.requests,
                                        num_blocks=need + 23, block_seed=2, steps=steps, out=out, reference=True), env=env)
    return p.requests, lines, torch.load(out)


def check_decoded(requests: List[Dict[str, Any]], lines: List[Dict[str, Any]], res: Dict[str, Any],
                  rtol: float, atol: float) -> None:
    """Assert that every request was read and decoded as one process does: the prefill's
    first token and last logits, then every decoded token and step's logits, against
    the reference; and that its blocks were scattered, elsewhere on each side."""
    assert [x["length"] for x in lines] == [r["length"] for r in requests], lines
    for req, line in zip(requests, lines):
        n = req["length"]
        assert line.get("ok"), line
        ref, got = res["reference"][n], res["decoded"][n]
        assert req["first"] == ref["first"], n
        torch.testing.assert_close(torch.tensor(req["prefill_logits"]), ref["prefill_logits"].float(), rtol=rtol, atol=atol)
        assert got["tokens"] == ref["tokens"], (n, got["tokens"], ref["tokens"])
        assert got["logits"].dtype == ref["logits"].dtype
        torch.testing.assert_close(got["logits"], ref["logits"], rtol=rtol, atol=atol)
        src, dst = req["blocks"], line["blocks"]
        assert len(src) == len(dst) == blocks_for(n) and src != dst
        if len(src) > 1:   # not one run of ids (the seeds are fixed: this is the test's set-up)
            assert src != list(range(src[0], src[0] + len(src))) and dst != list(range(dst[0], dst[0] + len(dst)))


def killed_prefill(cfg: ModelConfig, prefill_socket: str, decode_socket: str, out: str,
                   env: Optional[Dict[str, str]] = None) -> Tuple[List[Dict[str, Any]], List[Dict[str, Any]], Dict[str, Any]]:
    """Two prefill engines on prefill_socket's daemon, each with one request; the first
    is killed (kill -9) after handing its request over and before the decode process
    reads it, and its space is gone from the daemon; the decode process then reads
    both requests. The two engines' requests, the decode's lines and its results."""
    import cudaipc
    base = dict(socket=prefill_socket, model=asdict(cfg), num_blocks=40)
    doomed = Prefill(dict(base, name="kvmodel/doomed/kv", lengths=[100], block_seed=3), env=env)
    try:
        with Prefill(dict(base, name="kvmodel/live/kv", lengths=[37], block_seed=4), env=env) as live:
            doomed.kill()
            with cudaipc.connect(prefill_socket) as st:
                deadline = time.monotonic() + 20
                while True:
                    try:
                        st.stat("kvmodel/doomed/kv/0")
                    except cudaipc.NotFound:
                        break
                    if time.monotonic() > deadline:
                        raise AssertionError("the killed engine's space is still on its daemon after 20 s")
                    time.sleep(0.02)
            requests = doomed.requests + live.requests
            lines = run_role("decode", dict(socket=decode_socket, model=asdict(cfg), requests=requests, num_blocks=30,
                                            block_seed=5, steps=4, out=out, reference=True), env=env)
            return requests, lines, torch.load(out)
    finally:
        doomed.close()

def main(argv: Optional[List[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("role", choices=["prefill", "decode"])
    p.add_argument("args", help="the role's arguments, as JSON")
    ns = p.parse_args(argv)
    torch.set_num_threads(1)
    a = json.loads(ns.args)
    {"prefill": role_prefill, "decode": role_decode}[ns.role](a)


if __name__ == "__main__":
    main()

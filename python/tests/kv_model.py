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
"""

from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

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
                           max_position_embeddings=4096, initializer_range=0.1)
        conf._attn_implementation = "eager"
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


def paged_cache(cfg: ModelConfig, num_blocks: int, block_size: int = BLOCK_SIZE) -> List[torch.Tensor]:
    """A paged KV cache of num_blocks blocks, as vLLM allocates it: a tensor a layer of
    shape ``[2, num_blocks, block_size, kv_heads, head_dim]`` (K then V), on the config's
    device, filled with random values so that a block never written is not zero."""
    g = torch.Generator().manual_seed(cfg.seed + num_blocks)
    shape = (2, num_blocks, block_size, cfg.kv_heads, cfg.head_dim)
    return [torch.randn(shape, generator=g).to(device=cfg.device, dtype=cfg.torch_dtype) for _ in range(cfg.layers)]


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

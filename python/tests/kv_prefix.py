"""Prefix caching of a real model through a cluster-wide KV block pool, for
test_kv_prefix.py (kv_model.py's small torch model, host memory) and
test_kv_prefix_gpu.py (a transformers Llama with random weights on a GPU).

Two processes, each attached to its own daemon of one cluster (``python kv_prefix.py
ROLE JSON``):

``put`` (process A) prefills a long shared prefix, pages its KV cache into a paged
cache (vLLM's per-layer ``[2, num_blocks, 16, kv_heads, head_dim]``, scattered block
ids; kv_model.py's paging), and puts its full blocks into the pool "kvprefix/pool"
(made cluster-wide), each under its key: the chained content hash of the block's
tokens and its parent's key, as vLLM's prefix caching keys blocks. It prints what
the put did and exits: the blocks stay in the pool, on the nodes that own their keys.

``serve`` (process B) gets a prompt of that prefix and a suffix of its own: it looks
the prompt's block keys up (pinned), gets the cached blocks into its own paged cache
at other block ids, rebuilds the cache layer by layer as each layer arrives, prefills
only the suffix and decodes greedily; and for comparison the same prompt prefilled
whole, in this process. It prints the times to first token of both (the cached path
twice: its blocks first fetched from the nodes holding them, then held by its own
daemon, which kept copies) and saves both results.

A pool holds host memory: on a GPU, A stages its blocks through a host copy of its
paged cache (the put's source) and B gets them into a host copy of its own, then
copies each layer into its GPU cache as it arrives (:data:`STAGING`).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import struct
import subprocess
import sys
import time
from dataclasses import asdict
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from kv_model import (BLOCK_SIZE, KV, ModelConfig, TinyModel, blocks_for, decode, make_model, page_in,  # noqa: E402
                      page_out_layer, paged_cache, prompt, scattered)

POOL = "kvprefix/pool"
"""The cluster-wide pool's name."""

STAGING = "host"
"""How GPU blocks reach the pool and come back: through host copies of the paged
caches (pools hold host memory; a put from or a get into GPU memory is refused)."""


def block_keys(ids: Sequence[int], block_size: int = BLOCK_SIZE) -> List[bytes]:
    """The keys of the full blocks of a token sequence: block i's is SHA-256 of block
    i-1's key (32 zero bytes for block 0) and block i's token ids, so that a key names
    its block and everything before it (vLLM's hash(parent_hash, block tokens))."""
    keys, parent = [], bytes(32)
    for i in range(len(ids) // block_size):
        toks = [int(t) for t in ids[i * block_size:(i + 1) * block_size]]
        parent = hashlib.sha256(parent + struct.pack("<%dq" % block_size, *toks)).digest()
        keys.append(parent)
    return keys


def suffix(cfg: ModelConfig, length: int) -> torch.Tensor:
    """B's own tokens after the shared prefix ``[1, length]``."""
    g = torch.Generator().manual_seed(cfg.seed * 104729 + length)
    return torch.randint(0, cfg.vocab, (1, length), generator=g).to(cfg.device)


@torch.no_grad()
def prefill_after(model: Any, ids: torch.Tensor, cache: Any) -> Tuple[torch.Tensor, Any]:
    """The last logits ``[vocab]`` of ids ``[1, n]`` run after cache, and the grown cache."""
    if isinstance(model, TinyModel):
        logits, grown = model.forward(ids, cache)
        return logits[0, -1], grown
    out = model.model(input_ids=ids, past_key_values=cache, use_cache=True)
    return out.logits[0, -1], out.past_key_values


def _sync(cfg: ModelConfig) -> None:
    if cfg.device != "cpu":
        torch.cuda.synchronize()


def _say(msg: Dict[str, Any]) -> None:
    print(json.dumps(msg), flush=True)


def _host_cache(cfg: ModelConfig, num_blocks: int) -> List[torch.Tensor]:
    """A paged cache of cfg's shape in host memory other processes can map (a memfd)."""
    from cudaipc import kv
    return paged_cache(dataclasses.replace(cfg, device="cpu"), num_blocks, alloc=lambda n: torch.from_numpy(kv.alloc_host(n)))


def _caches(cfg: ModelConfig, num_blocks: int, stage: bool) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
    """(the paged cache the model uses, the host one the pool reads and writes): one
    and the same on the CPU; on a GPU, or with stage, the model's own and a host copy
    (:data:`STAGING`; stage runs that path on the CPU, for the tests)."""
    host = _host_cache(cfg, num_blocks)
    if cfg.device == "cpu" and not stage:
        return host, host
    return paged_cache(cfg, num_blocks), host


def role_put(a: Dict[str, Any]) -> None:
    """Args: socket, model, prefix (tokens), num_blocks, block_seed, capacity, stage. Prints
    {"keys", "stored", "existed", "full", "unavailable", "blocks"}."""
    import cudaipc
    from cudaipc import kv
    cfg = ModelConfig(**a["model"])
    if cfg.device != "cpu":
        torch.cuda.set_device(torch.device(cfg.device))
    model = make_model(cfg)
    ids = prompt(cfg, a["prefix"])
    paged, host = _caches(cfg, a["num_blocks"], a.get("stage", False))
    blocks = scattered(a["num_blocks"], a["block_seed"])[:blocks_for(a["prefix"])]
    _, cache = model.prefill(ids)
    page_in(model.to_layers(cache), paged, blocks)
    if paged is not host:
        _sync(cfg)
        for p, h in zip(paged, host):
            h[:, blocks] = p[:, blocks].cpu()
    store = cudaipc.connect(a["socket"])
    space = kv.register(store, "kvprefix/put-%d/kv" % os.getpid(), kv.vllm_layout(host))
    pool = kv.create_pool(store, POOL, kv.block_bytes(space.desc), a["capacity"], cluster=True)
    keys = block_keys(ids[0].tolist())
    r = pool.put(keys, space, blocks[:len(keys)], timeout=60)
    _say(dict(keys=[k.hex() for k in keys], stored=r.stored, existed=r.existed, full=r.full, unavailable=r.unavailable,
              blocks=blocks[:len(keys)]))
    pool.close()
    space.close()
    store.close()


def _cached_first_token(cfg: ModelConfig, model: Any, pool: Any, ids: torch.Tensor, paged: List[torch.Tensor],
                        host: List[torch.Tensor], host_local: Any, mine: List[int]) -> Tuple[int, torch.Tensor, Any, int, float]:
    """The first token of ids through the pool: the cached blocks' count looked up,
    got into blocks mine of host (host_local: its kv.Local), each layer into paged as
    it arrives, the suffix prefilled.
    (first token, its logits, the cache, blocks cached, seconds from the prompt to the
    first token)."""
    start = time.perf_counter()
    keys = block_keys(ids[0].tolist())
    n, pin = pool.lookup(keys, pin=True, timeout=30)
    kv_layers: KV = []
    if n:
        t = pool.get(keys[:n], host_local, mine[:n], pin=pin, timeout=30)
        for layer in range(cfg.layers):
            t.wait_layer(layer, timeout=60)
            if paged[layer] is not host[layer]:
                paged[layer][:, mine[:n]] = host[layer][:, mine[:n]].to(cfg.device)
            kv_layers.append(page_out_layer(paged[layer], mine[:n], n * BLOCK_SIZE))
        t.wait(timeout=60)
    cache = model.from_layers(kv_layers) if n else None
    rest = ids[:, n * BLOCK_SIZE:]
    if cache is None:
        last, cache = model.prefill(rest)
    else:
        last, cache = prefill_after(model, rest, cache)
    first = int(torch.argmax(last).item())
    _sync(cfg)
    return first, last, cache, n, time.perf_counter() - start


def role_serve(a: Dict[str, Any]) -> None:
    """Args: socket, model, prefix, suffix (tokens), num_blocks, block_seed, steps,
    capacity, out, stage. Prints {"cached_blocks", "ttft_full", "ttft_cached_remote",
    "ttft_cached_local", "blocks"} and saves (torch.save, at out) {"cached": {first,
    prefill_logits, tokens, logits}, "full": the same of a whole prefill}."""
    import cudaipc
    from cudaipc import kv
    cfg = ModelConfig(**a["model"])
    if cfg.device != "cpu":
        torch.cuda.set_device(torch.device(cfg.device))
    model = make_model(cfg)
    ids = torch.cat((prompt(cfg, a["prefix"]), suffix(cfg, a["suffix"])), dim=1)
    paged, host = _caches(cfg, a["num_blocks"], a.get("stage", False))
    mine = scattered(a["num_blocks"], a["block_seed"])
    host_local = kv.vllm_layout(host)
    store = cudaipc.connect(a["socket"])
    pool = kv.create_pool(store, POOL, kv.block_bytes(host_local), a["capacity"], cluster=True)
    # Warm up the model's kernels on another prompt of the same length, so that
    # neither timing below pays for them.
    model.prefill(prompt(cfg, ids.shape[1]))
    _sync(cfg)

    start = time.perf_counter()
    last, cache = model.prefill(ids)
    first = int(torch.argmax(last).item())
    _sync(cfg)
    ttft_full = time.perf_counter() - start
    tokens, logits = decode(model, cache, first, a["steps"])
    full = dict(first=first, prefill_logits=last.float().cpu(), tokens=tokens, logits=logits.cpu())

    # The blocks come from the nodes that own them; the second time, from copies
    # this daemon kept.
    first, last, cache, n, ttft_remote = _cached_first_token(cfg, model, pool, ids, paged, host, host_local, mine)
    first2, _, _, n2, ttft_local = _cached_first_token(cfg, model, pool, ids, paged, host, host_local, mine)
    tokens, logits = decode(model, cache, first, a["steps"])
    cached = dict(first=first, prefill_logits=last.float().cpu(), tokens=tokens, logits=logits.cpu(), again=(first2, n2))
    torch.save(dict(cached=cached, full=full), a["out"])
    _say(dict(cached_blocks=n, ttft_full=ttft_full, ttft_cached_remote=ttft_remote, ttft_cached_local=ttft_local,
              blocks=mine[:n], staging=STAGING if paged is not host else None))
    pool.close()
    store.close()


def run_role(role: str, args: Dict[str, Any], env: Optional[Dict[str, str]] = None,
             timeout: float = 300.0) -> List[Dict[str, Any]]:
    """Run a role's process to its end; its JSON lines. A non-zero exit raises with
    its standard error."""
    r = subprocess.run([sys.executable, os.path.abspath(__file__), role, json.dumps(args)],
                       capture_output=True, timeout=timeout, env=env, stdin=subprocess.DEVNULL)
    if r.returncode != 0:
        raise RuntimeError("%s exited %d: %s" % (role, r.returncode, r.stderr.decode(errors="replace")[-4000:]))
    return [json.loads(x) for x in r.stdout.decode().splitlines() if x.startswith("{")]


def prefix_cached(cfg: ModelConfig, prefix: int, suffix_len: int, steps: int, put_socket: str, serve_socket: str,
                  out: str, env: Optional[Dict[str, str]] = None,
                  stage: bool = False) -> Tuple[Dict[str, Any], Dict[str, Any], Dict[str, Any]]:
    """Process A puts the prefix's blocks through put_socket's daemon and exits;
    process B serves prefix + suffix through serve_socket's (both staging through
    host copies of their caches with stage, as on a GPU). (A's line, B's line, B's
    saved results.)"""
    nb = blocks_for(prefix + suffix_len) + 9
    capacity = 4 * nb * _block_bytes(cfg)
    put = run_role("put", dict(socket=put_socket, model=asdict(cfg), prefix=prefix, num_blocks=nb, block_seed=11,
                               capacity=capacity, stage=stage), env=env)
    serve = run_role("serve", dict(socket=serve_socket, model=asdict(cfg), prefix=prefix, suffix=suffix_len,
                                   num_blocks=nb + 5, block_seed=12, steps=steps, capacity=capacity, out=out, stage=stage),
                     env=env)
    return put[-1], serve[-1], torch.load(out)


def _block_bytes(cfg: ModelConfig) -> int:
    """Bytes of one pool block: a 16-token block of every layer, K and V."""
    return cfg.layers * 2 * BLOCK_SIZE * cfg.kv_heads * cfg.head_dim * torch.tensor([], dtype=cfg.torch_dtype).element_size()


def check_cached(put: Dict[str, Any], serve: Dict[str, Any], res: Dict[str, Any], prefix: int,
                 rtol: float, atol: float) -> None:
    """Assert that A stored every full block of the prefix, that B found them all and
    its tokens and logits from the cached prefix equal the whole prefill's (its first
    token and every decoded one; logits to rtol/atol: the suffix's attention runs over
    the same keys and values in a differently shaped computation), that the second
    cached run found them again, and that B's block ids are not A's."""
    full = prefix // BLOCK_SIZE
    assert put["stored"] == full and put["unavailable"] == 0, put
    assert serve["cached_blocks"] == full, serve
    c, f = res["cached"], res["full"]
    assert c["first"] == f["first"], (c["first"], f["first"])
    torch.testing.assert_close(c["prefill_logits"], f["prefill_logits"], rtol=rtol, atol=atol)
    assert c["tokens"] == f["tokens"], (c["tokens"], f["tokens"])
    torch.testing.assert_close(c["logits"], f["logits"], rtol=rtol, atol=atol)
    assert tuple(c["again"]) == (f["first"], full), c["again"]
    assert serve["blocks"] != put["blocks"]


def main(argv: Optional[List[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("role", choices=["put", "serve"])
    p.add_argument("args", help="the role's arguments, as JSON")
    ns = p.parse_args(argv)
    torch.set_num_threads(1)
    a = json.loads(ns.args)
    {"put": role_put, "serve": role_serve}[ns.role](a)


if __name__ == "__main__":
    main()

package cluster

import (
	"context"
	"errors"
	"fmt"
	"math/bits"
	"sync"
	"time"

	"github.com/cudaipc/cudaipc/protocol"
)

// Cluster-wide KV block pools (docs/kv.md, "Across the cluster"): a pool
// of one name on the cluster's nodes, each node holding the keys
// Placement gives it. The node a client asks sends each other owner of
// the request's keys one request for its keys over the control channel
// ("poollookup", "poolpresent", "poolget", "poolput", "pooldelete"), all
// owners at once.
// The keys travel in a frame after the request. Blocks travel inline (a
// frame after a put's request, or after a get's answer) when they fit
// MaxInline; otherwise the sending node gathers them into one staging
// buffer, exposed through the data plane, which the other node fetches in
// pieces of poolPiece bytes, several in flight, as staged KV reads are.
// Nothing is written to the directory.

// ErrPoolNode: the node that owns keys of a cluster-wide pool did not
// answer (refused, dropped the connection, stalled past the call's
// deadline, or died). Its keys count as absent. Code UNAVAILABLE.
var ErrPoolNode = class("the node owning the keys did not answer", protocol.ErrUnavailable)

// ErrPoolRefused: the node that owns keys of a cluster-wide pool answered
// but refused the request (its pool of that name is of another shape, or
// not cluster-wide, or it has no room for a pool it would make). Its keys
// count as absent. Code UNAVAILABLE.
var ErrPoolRefused = class("the node owning the keys refused the request", protocol.ErrUnavailable)

const (
	// MaxPoolCallKeys bounds the keys of one request to an owner: a
	// request of more keys is cut into several, one after another.
	MaxPoolCallKeys = 16384
	// maxPoolRaw bounds the frame after a pool request: its keys, and a
	// put's blocks inline.
	maxPoolRaw = MaxPoolCallKeys*protocol.MaxKeyBytes + MaxInline
	// poolPiece is one fetch of a staged pool transfer.
	poolPiece = 4 << 20
	// poolDepth is how many fetches of a staged pool transfer are in
	// flight at once.
	poolDepth = 16
	// DefaultPoolStoreTimeout bounds an owner's fetch of a put's staged
	// blocks when the request gives no deadline; MaxPoolTimeout bounds
	// any.
	DefaultPoolStoreTimeout = 30 * time.Second
	MaxPoolTimeout          = 10 * time.Minute
)

// PoolCall is one request of a cluster-wide pool to a node that owns
// keys of it.
type PoolCall struct {
	// Reader is the uid of the client the request serves: the owner
	// applies the store's rules to it, as for its own clients.
	Reader uint32
	// Pool is the pool's qualified name (UID:NAME).
	Pool string
	// KeyBytes is the pool's key size, Keys the request's keys end to end
	// (1 to MaxPoolCallKeys of them).
	KeyBytes int
	Keys     []byte
	// Shape is the pool's: the owner checks its pool against it, and a
	// put makes the pool with it where the owner has none.
	Shape PoolShape
}

// Count returns the number of keys.
func (c *PoolCall) Count() int { return len(c.Keys) / c.KeyBytes }

// PoolShape is what a cluster-wide pool is made of.
type PoolShape struct {
	BlockBytes int64 `json:"block_bytes"`
	Capacity   int64 `json:"capacity"`
	Shared     bool  `json:"shared,omitempty"`
}

// PoolStaged is a put's blocks staged on the putting node: one region
// read through Worker, the blocks end to end in key order.
type PoolStaged struct {
	Worker []byte      `json:"worker"`
	Region SpaceRegion `json:"region"`
}

// PoolBlocks are a put's blocks as its owner receives them: Inline, the
// blocks end to end in key order, or Staged on node From.
type PoolBlocks struct {
	Inline []byte
	Staged *PoolStaged
	From   string
}

// PoolSource is a Source that also serves the requests of cluster-wide
// KV block pools from other nodes. A Source without it answers them as
// unknown ops. Its methods fail wrapping ErrNotFound when this node has
// no pool of that name the reader may use (ErrNotFound: the keys are
// absent here).
type PoolSource interface {
	// LookupPool returns how many of c's keys, from the first, this
	// node's pool holds.
	LookupPool(c PoolCall) (int, error)
	// PresentPool says which of c's keys this node's pool holds.
	PresentPool(c PoolCall) ([]bool, error)
	// GatherPool copies the blocks of c's keys this node's pool holds
	// (found[i] for key i), end to end in key order, into inline when
	// they are at most max bytes, or else into a buffer it exposes (e)
	// until release.
	GatherPool(c PoolCall, max int64) (found []bool, inline []byte, e SpaceExposure, release func(), err error)
	// StorePool stores c's blocks, making the pool with c.Shape where
	// this node has none, and returns each key's put status
	// (protocol.BlockStored, BlockExisted, BlockFull).
	StorePool(ctx context.Context, c PoolCall, b PoolBlocks) (status []byte, err error)
	// DeletePool removes c's keys from this node's pool and returns how
	// many it held.
	DeletePool(c PoolCall) (int, error)
}

// poolRequest is the part of a ctlRequest the pool ops use.
func (c *PoolCall) request(op string, timeout time.Duration) ctlRequest {
	shape := c.Shape
	return ctlRequest{Op: op, Reader: c.Reader, Pool: c.Pool, KeyBytes: c.KeyBytes, Count: c.Count(), Shape: &shape,
		Inline: int64(len(c.Keys)), TimeoutMs: timeout.Milliseconds()}
}

// decodePoolCall checks a pool request from a peer and the frame that
// came after it (raw), returning the call and, for a put, its inline
// blocks.
func decodePoolCall(req ctlRequest, raw []byte) (PoolCall, []byte, error) {
	var c PoolCall
	bad := func(format string, a ...any) (PoolCall, []byte, error) {
		return c, nil, fmt.Errorf("%w: %s: %s", ErrBadRecord, req.Op, fmt.Sprintf(format, a...))
	}
	if _, _, ok := protocol.SplitOwner(req.Pool); !ok || protocol.ValidateName(req.Pool) != nil {
		return bad("pool %q: want UID:NAME", req.Pool)
	}
	if req.KeyBytes < protocol.MinKeyBytes || req.KeyBytes > protocol.MaxKeyBytes {
		return bad("keys of %d bytes", req.KeyBytes)
	}
	if req.Count < 1 || req.Count > MaxPoolCallKeys {
		return bad("%d keys, want 1 to %d", req.Count, MaxPoolCallKeys)
	}
	sh := req.Shape
	if sh == nil || sh.BlockBytes < 1 || sh.BlockBytes > protocol.MaxBlockBytes || sh.Capacity < 1 || sh.Capacity > protocol.MaxObjectSize {
		return bad("no pool shape, or blocks or capacity out of bounds")
	}
	if req.TimeoutMs < 0 || req.TimeoutMs > MaxPoolTimeout.Milliseconds() {
		return bad("a timeout of %d ms", req.TimeoutMs)
	}
	keys := req.Count * req.KeyBytes
	c = PoolCall{Reader: req.Reader, Pool: req.Pool, KeyBytes: req.KeyBytes, Shape: *sh}
	if len(raw) < keys {
		return bad("%d bytes after the request for %d keys of %d bytes", len(raw), req.Count, req.KeyBytes)
	}
	c.Keys = raw[:keys]
	rest := raw[keys:]
	if req.Op != "poolput" {
		if len(rest) != 0 || req.Staged != nil {
			return bad("blocks with the request")
		}
		return c, nil, nil
	}
	size := int64(req.Count) * sh.BlockBytes // no overflow: both bounded well below 2^63
	switch st := req.Staged; {
	case st == nil && int64(len(rest)) == size && size <= MaxInline:
		return c, rest, nil
	case st != nil && len(rest) == 0:
		e := SpaceExposure{Worker: st.Worker, Regions: []SpaceRegion{st.Region}}
		if err := e.validate(1); err != nil {
			return bad("staged blocks: %v", err)
		}
		if st.Region.Size != size {
			return bad("staged blocks of %d bytes for %d blocks of %d", st.Region.Size, req.Count, sh.BlockBytes)
		}
		return c, nil, nil
	}
	return bad("%d bytes of blocks after the keys, staged %v, for %d blocks of %d bytes", len(rest), req.Staged != nil, req.Count, sh.BlockBytes)
}

// checkPoolAnswer checks a pool request's answer from a peer (and the
// bytes after it) against the request.
func checkPoolAnswer(op string, c *PoolCall, resp *ctlResponse, raw []byte) error {
	n := c.Count()
	bad := func(format string, a ...any) error {
		return fmt.Errorf("%w: %s answer: %s", ErrBadRecord, op, fmt.Sprintf(format, a...))
	}
	switch op {
	case "poollookup":
		if resp.Found < 0 || resp.Found > n {
			return bad("%d keys found of %d", resp.Found, n)
		}
	case "pooldelete":
		if resp.Deleted < 0 || resp.Deleted > n {
			return bad("%d keys deleted of %d", resp.Deleted, n)
		}
	case "poolput":
		if len(resp.Status) != n {
			return bad("%d statuses for %d keys", len(resp.Status), n)
		}
		for _, s := range resp.Status {
			if s > protocol.BlockFull {
				return bad("status %d", s)
			}
		}
	case "poolpresent":
		if err := checkMask(resp.Mask, n); err != nil {
			return bad("%v", err)
		}
	case "poolget":
		if err := checkMask(resp.Mask, n); err != nil {
			return bad("%v", err)
		}
		found := 0
		for _, b := range resp.Mask {
			found += bits.OnesCount8(b)
		}
		size := int64(found) * c.Shape.BlockBytes
		switch {
		case found == 0:
			if len(raw) != 0 || len(resp.Regions) != 0 {
				return bad("blocks for no key found")
			}
		case len(resp.Regions) == 0:
			if int64(len(raw)) != size {
				return bad("%d bytes inline for %d blocks of %d", len(raw), found, c.Shape.BlockBytes)
			}
		default:
			e := SpaceExposure{Worker: resp.Exposure.Worker, Regions: resp.Regions}
			if err := e.validate(1); err != nil {
				return bad("%v", err)
			}
			if len(raw) != 0 || resp.Handle == 0 || resp.Regions[0].Size != size {
				return bad("staged blocks of %d bytes (handle %d) for %d blocks of %d", resp.Regions[0].Size, resp.Handle, found, c.Shape.BlockBytes)
			}
		}
	}
	return nil
}

// checkMask checks a bitmap of n keys: (n+7)/8 bytes, no bit past n.
func checkMask(m []byte, n int) error {
	if len(m) != (n+7)/8 || n%8 != 0 && m[n/8]>>(n%8) != 0 {
		return fmt.Errorf("a mask of %d bytes for %d keys", len(m), n)
	}
	return nil
}

// mask packs found into a bitmap, a bit a key from bit 0 of byte 0.
func mask(found []bool) []byte {
	m := make([]byte, (len(found)+7)/8)
	for i, f := range found {
		if f {
			m[i/8] |= 1 << (i % 8)
		}
	}
	return m
}

// unmask unpacks a checked bitmap of n keys.
func unmask(m []byte, n int) []bool {
	out := make([]bool, n)
	for i := range out {
		out[i] = m[i/8]>>(i%8)&1 == 1
	}
	return out
}

// servePool answers the pool ops; held keeps a get's exposure until the
// peer releases it ("close").
func (s *ControlServer) servePool(req ctlRequest, raw []byte, peer string, held *exposures) (ctlResponse, []byte) {
	var resp ctlResponse
	ps, ok := s.Source.(PoolSource)
	if !ok {
		resp.Err = fmt.Sprintf("%s %q", unknownOp, req.Op)
		return resp, nil
	}
	c, inline, err := decodePoolCall(req, raw)
	if err != nil {
		resp.Err = err.Error()
		return resp, nil
	}
	fail := func(err error) (ctlResponse, []byte) {
		resp.Err, resp.NotHeld = err.Error(), errors.Is(err, ErrNotFound)
		return resp, nil
	}
	switch req.Op {
	case "poollookup":
		if resp.Found, err = ps.LookupPool(c); err != nil {
			return fail(err)
		}
	case "poolpresent":
		found, err := ps.PresentPool(c)
		if err != nil {
			return fail(err)
		}
		if len(found) != c.Count() {
			return fail(fmt.Errorf("the store answered %d keys of %d", len(found), c.Count()))
		}
		resp.Mask = mask(found)
	case "pooldelete":
		if resp.Deleted, err = ps.DeletePool(c); err != nil {
			return fail(err)
		}
	case "poolput":
		timeout := time.Duration(req.TimeoutMs) * time.Millisecond
		if timeout == 0 {
			timeout = DefaultPoolStoreTimeout
		}
		ctx, cancel := context.WithTimeout(context.Background(), timeout)
		defer cancel()
		if resp.Status, err = ps.StorePool(ctx, c, PoolBlocks{Inline: inline, Staged: req.Staged, From: peer}); err != nil {
			return fail(err)
		}
		if len(resp.Status) != c.Count() {
			return fail(fmt.Errorf("the store answered %d statuses for %d keys", len(resp.Status), c.Count()))
		}
	case "poolget":
		if !held.reserve() {
			return fail(fmt.Errorf("more than %d objects exposed on one connection", MaxExposures))
		}
		found, b, e, release, err := ps.GatherPool(c, MaxInline)
		if err != nil {
			held.unreserve()
			return fail(err)
		}
		if len(found) != c.Count() {
			held.unreserve()
			if release != nil {
				release()
			}
			return fail(fmt.Errorf("the store answered %d keys of %d", len(found), c.Count()))
		}
		resp.Mask = mask(found)
		if release != nil {
			resp.Handle, resp.Exposure.Worker, resp.Regions = held.add(release), e.Worker, e.Regions
			return resp, nil
		}
		held.unreserve()
		if len(b) > 0 {
			resp.Inline = int64(len(b))
			return resp, b
		}
	}
	return resp, nil
}

// pool sends req with the call's keys (and, for a put, blocks inline
// after them) and checks the answer; an answer refusing the call is an
// error wrapping ErrNotFound (NotHeld) or ErrPoolRefused.
func (cc *ControlClient) pool(ctx context.Context, c *PoolCall, req ctlRequest, blocks []byte) (ctlResponse, []byte, error) {
	out := c.Keys
	if len(blocks) > 0 {
		out = append(append(make([]byte, 0, len(c.Keys)+len(blocks)), c.Keys...), blocks...)
	}
	req.Inline = int64(len(out))
	var in []byte
	resp, err := cc.exchangeRaw(ctx, req, out, &in)
	switch {
	case err != nil:
		return resp, nil, err
	case resp.Err != "" && resp.NotHeld:
		return resp, nil, fmt.Errorf("node %s: %w", cc.ch.peer, errorText{resp.Err, ErrNotFound})
	case resp.Err != "":
		return resp, nil, fmt.Errorf("%w: node %s: %s", ErrPoolRefused, cc.ch.peer, resp.Err)
	}
	return resp, in, checkPoolAnswer(req.Op, c, &resp, in)
}

// poolExchange is ControlClient.pool over the puller's pooled connection
// to node, retried once on a connection found broken. On success the peer
// is still held: the caller releases it.
func (p *Puller) poolExchange(ctx context.Context, node string, c *PoolCall, req ctlRequest, blocks []byte) (*peer, ctlResponse, []byte, error) {
	for attempt := 0; ; attempt++ {
		pe, err := p.acquire(ctx, node)
		if err != nil {
			return nil, ctlResponse{}, nil, poolNodeError(node, err)
		}
		resp, in, err := pe.cc.pool(ctx, c, req, blocks)
		if err == nil {
			return pe, resp, in, nil
		}
		stale := errors.Is(err, errChannel)
		refused := errors.Is(err, ErrNotFound) || errors.Is(err, ErrPoolRefused)
		p.release(pe, !refused)
		if !stale || attempt > 0 || ctx.Err() != nil {
			return nil, resp, nil, poolNodeError(node, err)
		}
	}
}

// poolNodeError is the error of a pool request whose node failed.
func poolNodeError(node string, err error) error {
	if errors.Is(err, ErrNotFound) || errors.Is(err, ErrPoolNode) || errors.Is(err, ErrPoolRefused) {
		return err
	}
	return fmt.Errorf("%w: node %s: %v", ErrPoolNode, node, err)
}

// PoolLookup asks node how many of c's keys, from the first, it holds.
// Errors wrap ErrNotFound (the node has no such pool for c.Reader: none
// of the keys), ErrPoolRefused or ErrPoolNode; the other pool calls fail
// in the same way.
func (p *Puller) PoolLookup(ctx context.Context, node string, c PoolCall) (int, error) {
	pe, resp, _, err := p.poolExchange(ctx, node, &c, c.request("poollookup", 0), nil)
	if err != nil {
		return 0, err
	}
	p.release(pe, false)
	return resp.Found, nil
}

// PoolPresent asks node which of c's keys it holds.
func (p *Puller) PoolPresent(ctx context.Context, node string, c PoolCall) ([]bool, error) {
	pe, resp, _, err := p.poolExchange(ctx, node, &c, c.request("poolpresent", 0), nil)
	if err != nil {
		return nil, err
	}
	p.release(pe, false)
	return unmask(resp.Mask, c.Count()), nil
}

// PoolDelete asks node to remove c's keys, and returns how many it held.
func (p *Puller) PoolDelete(ctx context.Context, node string, c PoolCall) (int, error) {
	pe, resp, _, err := p.poolExchange(ctx, node, &c, c.request("pooldelete", 0), nil)
	if err != nil {
		return 0, err
	}
	p.release(pe, false)
	return resp.Deleted, nil
}

// PoolPut has node store c's blocks, b.Inline (at most MaxInline bytes)
// or b.Staged on this node, and returns each key's status. timeout is the
// node's to fetch staged blocks (0: DefaultPoolStoreTimeout).
func (p *Puller) PoolPut(ctx context.Context, node string, c PoolCall, b PoolBlocks, timeout time.Duration) ([]byte, error) {
	req := c.request("poolput", min(timeout, MaxPoolTimeout))
	req.Staged = b.Staged
	pe, resp, _, err := p.poolExchange(ctx, node, &c, req, b.Inline)
	if err != nil {
		return nil, err
	}
	p.release(pe, false)
	return resp.Status, nil
}

// PoolGet asks node for the blocks of c's keys it holds. place is told
// which keys it holds (found[i] for key i) and returns where each found
// block goes, in key order (nil: skip it); PoolGet returns once they are
// all there, or fails (with whatever it wrote partly written).
func (p *Puller) PoolGet(ctx context.Context, node string, c PoolCall, place func(found []bool) [][]byte) error {
	pe, resp, in, err := p.poolExchange(ctx, node, &c, c.request("poolget", 0), nil)
	if err != nil {
		return err
	}
	bad := false
	if resp.Handle != 0 {
		defer func() {
			p.bg.Go(func() {
				rctx, cancel := context.WithTimeout(context.Background(), HandshakeTimeout)
				if err := pe.cc.Release(rctx, resp.Handle); err != nil {
					bad = true
				}
				cancel()
				p.release(pe, bad)
			})
		}()
	} else {
		defer p.release(pe, false)
	}
	found := unmask(resp.Mask, c.Count())
	n := 0
	for _, f := range found {
		if f {
			n++
		}
	}
	if n == 0 {
		place(found)
		return nil
	}
	dst := place(found)
	if len(dst) != n {
		panic(fmt.Sprintf("cluster: %d destinations for %d blocks", len(dst), n))
	}
	bb := c.Shape.BlockBytes
	if resp.Handle == 0 {
		for k, d := range dst {
			copy(d, in[int64(k)*bb:int64(k+1)*bb])
		}
		return nil
	}
	if err := p.fetchBlocks(ctx, pe, node, resp.Exposure.Worker, resp.Regions[0], bb, dst); err != nil {
		bad = true
		return err
	}
	return nil
}

// FetchPoolBlocks reads a put's blocks staged on node from (b.Staged) into
// dst (block k of the staging into dst[k]; nil: skip it).
func (p *Puller) FetchPoolBlocks(ctx context.Context, b PoolBlocks, blockBytes int64, dst [][]byte) error {
	pe, err := p.acquire(ctx, b.From)
	if err != nil {
		return poolNodeError(b.From, err)
	}
	err = p.fetchBlocks(ctx, pe, b.From, b.Staged.Worker, b.Staged.Region, blockBytes, dst)
	p.release(pe, err != nil)
	return err
}

// poolPieces are the buffers staged pool transfers fetch pieces into.
var poolPieces = sync.Pool{New: func() any { b := make([]byte, poolPiece); return &b }}

// fetchBlocks reads the blocks staged in reg (through worker, of pe's
// node) in pieces, several in flight, copying block k into dst[k]; pieces
// that hold no block wanted are not read.
func (p *Puller) fetchBlocks(ctx context.Context, pe *peer, node string, worker []byte, reg SpaceRegion, bb int64, dst [][]byte) error {
	ep, err := pe.endpoint(ctx, p.Transport, worker)
	if err != nil {
		return poolNodeError(node, fmt.Errorf("connect to its worker: %w", err))
	}
	wanted := func(off, n int64) bool {
		for k := off / bb; k*bb < off+n && k < int64(len(dst)); k++ {
			if dst[k] != nil {
				return true
			}
		}
		return false
	}
	var mu sync.Mutex
	var at int64
	next := func() (chunkRead, bool) {
		mu.Lock()
		defer mu.Unlock()
		for at < reg.Size {
			off, n := at, min(poolPiece, reg.Size-at)
			at += n
			if !wanted(off, n) {
				continue
			}
			buf := poolPieces.Get().(*[]byte)
			return chunkRead{addr: reg.Addr + uint64(off), dst: (*buf)[:n], rkey: reg.RKey}, true
		}
		return chunkRead{}, false
	}
	done := func(c chunkRead, err error) {
		if err == nil {
			off := int64(c.addr - reg.Addr)
			end := off + int64(len(c.dst))
			for k := off / bb; k*bb < end && k < int64(len(dst)); k++ {
				if dst[k] == nil {
					continue
				}
				from, to := max(k*bb, off), min((k+1)*bb, end)
				copy(dst[k][from-k*bb:to-k*bb], c.dst[from-off:to-off])
			}
		}
		b := c.dst[:cap(c.dst)]
		poolPieces.Put(&b)
	}
	timeout := p.ChunkTimeout
	if timeout <= 0 {
		timeout = DefaultChunkTimeout
	}
	if err := readChunks(ctx, ep, nil, poolDepth, timeout, next, done); err != nil {
		if errors.Is(err, context.DeadlineExceeded) {
			err = fmt.Errorf("no answer within the call's deadline")
		}
		return poolNodeError(node, err)
	}
	return nil
}

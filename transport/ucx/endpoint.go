package ucx

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"slices"
	"sync"
	"sync/atomic"
	"time"
	"weak"

	raw "github.com/cudaipc/cudaipc/internal/ucx"
)

// overreadSlack is zeroed room after a copy of peer bytes handed to UCX,
// which parses them without knowing their length: a well-formed envelope
// around a short or wrong payload makes UCX read zeros, not past the end.
const overreadSlack = 4096

// Endpoint is a connection from a Worker to a peer's worker
// (ucp_ep_create), in UCP_ERR_HANDLING_MODE_PEER: when the peer dies, its
// requests fail (IsPeerFailure) instead of hanging, and a canceled Get can
// close it forcibly. UCX uses only transports that detect peer failure for
// such endpoints: tcp, rc, dc, not shared memory (UCX_TLS=sm alone makes
// Connect fail with UCS_ERR_UNREACHABLE in 1.13).
type Endpoint struct {
	w      *Worker
	h      raw.Ep
	id     uintptr      // the err_handler arg that finds this endpoint
	failed atomic.Int32 // the ucs_status_t UCX's error handler reported, 0 if none
	closed bool         // guarded by w.mu
	broken error        // guarded by w.mu
	keys   map[*RemoteKey]struct{}
	addr   string // the peer's raw worker address
	// sn is the UCX endpoint's connection sequence number towards the
	// peer, or -1 where UCX matches none (Worker.sns says why).
	sn int
}

// The endpoints' error handler: one C callback for the process (purego has
// a fixed number), which finds the endpoint by the id UCX hands back. The
// table holds weak pointers: an endpoint of a Context dropped without
// Close must not keep that Context reachable, or its cleanup (the backstop
// against a leaked Context) would never run. An endpoint nobody can reach
// has nobody to tell of its failure.
var (
	errHandlerOnce sync.Once
	errHandler     uintptr
	endpointIDs    atomic.Uintptr
	endpointsByID  endpointTable
)

// endpointTable maps the ids UCX hands the error handler to endpoints,
// weakly.
type endpointTable struct{ m sync.Map } // uintptr -> weak.Pointer[Endpoint]

// Store records e under id.
func (t *endpointTable) Store(id uintptr, e *Endpoint) { t.m.Store(id, weak.Make(e)) }

// Delete forgets id.
func (t *endpointTable) Delete(id uintptr) { t.m.Delete(id) }

// Load returns the endpoint recorded under id, if it is still reachable.
func (t *endpointTable) Load(id uintptr) (*Endpoint, bool) {
	v, ok := t.m.Load(id)
	if !ok {
		return nil, false
	}
	e := v.(weak.Pointer[Endpoint]).Value()
	return e, e != nil
}

func endpointErrHandler() uintptr {
	errHandlerOnce.Do(func() {
		errHandler = raw.NewErrHandler(func(arg uintptr, _ raw.Ep, s raw.Status) {
			if e, ok := endpointsByID.Load(arg); ok {
				e.failed.CompareAndSwap(0, int32(s))
			}
		})
	})
	return errHandler
}

// Err returns the failure UCX reported for the endpoint (the peer died,
// the link broke; IsPeerFailure matches it), or nil. The worker must be
// progressed (Serve, Get) for UCX to notice.
func (e *Endpoint) Err() error {
	if s := raw.Status(e.failed.Load()); s != raw.OK {
		return &raw.Error{Func: "ucp_ep (error handler)", Status: s}
	}
	return nil
}

// Connect creates an endpoint to the worker at addr, on a UCX endpoint
// to addr that an earlier Close kept (Close says why) when there is one.
// UCX connects lazily: an unreachable peer shows at the first Get, not
// here.
func (w *Worker) Connect(addr WorkerAddress) (*Endpoint, error) {
	if err := checkAddress(addr.b); err != nil {
		return nil, err
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.closed {
		return nil, ErrClosed
	}
	if e := w.unparkLocked(addr); e != nil {
		return e, nil
	}
	return w.connectLocked(addr)
}

// connectLocked is Connect with w.mu held, of a checked address.
func (w *Worker) connectLocked(addr WorkerAddress) (*Endpoint, error) {
	buf := make([]byte, len(addr.b)+overreadSlack)
	copy(buf, addr.b)
	e := &Endpoint{w: w, id: endpointIDs.Add(1), keys: map[*RemoteKey]struct{}{}, addr: string(addr.b), sn: w.nextSNLocked(addr.b)}
	p := &raw.EpParams{
		FieldMask:     raw.EpParamFieldRemoteAddress | raw.EpParamFieldErrHandlingMode | raw.EpParamFieldErrHandler,
		Address:       &buf[0],
		ErrMode:       raw.ErrHandlingPeer,
		ErrHandlerCb:  endpointErrHandler(),
		ErrHandlerArg: e.id,
	}
	endpointsByID.Store(e.id, e)
	h, err := raw.EpCreate(w.h, p)
	runtime.KeepAlive(buf)
	if err != nil {
		endpointsByID.Delete(e.id)
		if errors.Is(err, raw.ErrUnreachable) {
			return nil, fmt.Errorf("%w; endpoints detect peer failure (UCP_ERR_HANDLING_MODE_PEER), which UCX's shared-memory transports do not support: tcp, rc or dc must be among UCX_TLS on both sides", err)
		}
		return nil, err
	}
	e.h = h
	w.endpoints[e] = struct{}{}
	return e, nil
}

// maxConnSN is UCX's ucp_ep_match_conn_sn_t's maximum (a uint16 in 1.13
// and 1.16): the sequence number at which UCX stops counting and matching.
const maxConnSN = 1<<16 - 1

// nextSNLocked returns the connection sequence number UCX gives the next
// endpoint w creates to the worker at addr, and counts it; w.mu is held.
//
// UCX pairs two workers' endpoints to each other by these numbers: the
// n-th endpoint one creates to the other (ucp_ep_match_get_sn, one a
// destination, once per ucp_ep_create) takes the connection the other's
// n-th endpoint to it opened, or waits for it (ucp_ep_match_retrieve and
// ucp_ep_match_insert in ucp_ep_create_api_to_worker_addr; v1.13.1 and
// v1.16.0). Every UCX endpoint of w is made by connectLocked, so this
// count is UCX's. -1: UCX matches none (its count saturated, or addr is
// w's own, whose endpoints UCX pairs with each other).
func (w *Worker) nextSNLocked(addr []byte) int {
	if string(addr) == string(w.addr.b) {
		return -1
	}
	if w.sns == nil {
		w.sns = map[string]int{}
	}
	sn := w.sns[string(addr)]
	if sn >= maxConnSN {
		return -1
	}
	w.sns[string(addr)] = sn + 1
	return sn
}

// closeWait bounds how long Close waits for the operations in flight on
// an endpoint to flush before it closes the endpoint forcibly.
const closeWait = 2 * time.Second

// Close closes the endpoint and destroys its remote keys. It is
// idempotent. The operations in flight on it are flushed first
// (ucp_ep_flush_nbx, up to a short time); then the worker keeps the UCX
// endpoint for the next Connect to the same address, unless it failed or
// the flush did not finish, which close it forcibly.
//
// Why it is kept: a served peer's endpoint back to this worker (for Fetch
// replies) is usually paired by UCX with this one, and a gracefully closed
// UCX endpoint stays paired but drops every rendezvous message that
// arrives on it, so the peer's later replies would be canceled. A worker
// keeps at most maxParked and closes those whose peer failed; after a
// forced close the serving peer replies on the endpoint paired with the
// one each request came by (fetchServer.peerLocked). The reading of UCX's
// sources behind this: docs/lab/ucx-data-plane.md, "Kept endpoints".
func (e *Endpoint) Close() error { return e.close(false) }

func (e *Endpoint) close(force bool) error {
	w := e.w
	w.mu.Lock()
	defer w.mu.Unlock()
	if e.closed {
		return nil
	}
	for k := range e.keys {
		raw.RkeyDestroy(k.h)
		k.closed = true
	}
	e.keys = nil
	w.cancelDrainsLocked(e)
	e.closed = true
	delete(w.endpoints, e)
	if !force && e.broken == nil && e.failed.Load() == 0 && e.flushLocked() {
		w.parkLocked(e)
		return nil
	}
	err := e.closeLocked()
	endpointsByID.Delete(e.id)
	return err
}

// maxParked bounds the UCX endpoints a worker keeps after Close; beyond,
// the oldest is closed forcibly.
const maxParked = 256

// flushLocked waits, progressing the worker, up to closeWait for the
// operations in flight on the endpoint to complete (ucp_ep_flush_nbx) and
// reports whether they did; w.mu is held.
func (e *Endpoint) flushLocked() bool {
	w := e.w
	req, err := raw.EpFlushNbx(e.h, &raw.RequestParam{})
	if err != nil {
		return false
	}
	if req == 0 {
		return true
	}
	deadline := time.Now().Add(closeWait)
	for {
		raw.WorkerProgress(w.h)
		if s := raw.RequestCheckStatus(req); s != raw.InProgress {
			raw.RequestFree(req)
			return s == raw.OK
		}
		if time.Now().After(deadline) {
			// UCX releases the request when it completes: the forced
			// close that follows cancels it.
			raw.RequestFree(req)
			return false
		}
	}
}

// parkLocked keeps the UCX endpoint of e, which Close closed, for the next
// Connect to its address; w.mu is held. The error handler still reaches e
// (its id), so that a failure while parked is seen.
func (w *Worker) parkLocked(e *Endpoint) {
	w.sweepParkedLocked()
	if len(w.parked) >= maxParked {
		old := w.parked[0]
		w.parked = slices.Delete(w.parked, 0, 1)
		_ = old.closeLocked()
		endpointsByID.Delete(old.id)
	}
	w.parked = append(w.parked, e)
}

// unparkLocked returns a new Endpoint on the most recently parked UCX
// endpoint to addr, or nil when there is none; w.mu is held.
func (w *Worker) unparkLocked(addr WorkerAddress) *Endpoint {
	w.sweepParkedLocked()
	for i := len(w.parked) - 1; i >= 0; i-- {
		p := w.parked[i]
		if p.addr != string(addr.b) {
			continue
		}
		w.parked = slices.Delete(w.parked, i, i+1)
		e := &Endpoint{w: w, h: p.h, id: p.id, keys: map[*RemoteKey]struct{}{}, addr: p.addr, sn: p.sn}
		endpointsByID.Store(e.id, e)
		w.endpoints[e] = struct{}{}
		return e
	}
	return nil
}

// sweepParkedLocked closes forcibly the parked endpoints whose peer
// failed, or all of them when the worker is closing; w.mu is held.
func (w *Worker) sweepParkedLocked() {
	kept := w.parked[:0]
	for _, p := range w.parked {
		if p.failed.Load() == 0 && !w.closed {
			kept = append(kept, p)
			continue
		}
		_ = p.closeLocked()
		endpointsByID.Delete(p.id)
	}
	clear(w.parked[len(kept):])
	w.parked = kept
}

// closeLocked closes the UCX endpoint forcibly (ucp_ep_close_nbx with
// UCP_EP_CLOSE_FLAG_FORCE: requests in flight on it complete canceled)
// and progresses the worker until the close completes, up to twice
// closeWait; w.mu is held. Endpoints are never closed gracefully in UCX:
// Close keeps them instead (it says why), and UCX refuses a second close
// of an endpoint whose graceful close did not finish.
func (e *Endpoint) closeLocked() error {
	w := e.w
	p := &raw.RequestParam{OpAttrMask: raw.OpAttrFieldFlags, Flags: raw.EpCloseFlagForce}
	req, err := raw.EpCloseNbx(e.h, p)
	if err != nil || req == 0 {
		return nil // a forced close of a failed endpoint may report its failure
	}
	deadline := time.Now().Add(2 * closeWait)
	for {
		raw.WorkerProgress(w.h)
		if raw.RequestCheckStatus(req) != raw.InProgress {
			raw.RequestFree(req)
			return nil
		}
		if time.Now().After(deadline) {
			raw.RequestFree(req)
			return errors.New("ucx: the forced close of an endpoint did not complete")
		}
	}
}

// RemoteKey is a peer's region key unpacked on an endpoint
// (ucp_ep_rkey_unpack): the handle Get reads the peer's region with. It is
// valid on that endpoint only, and destroyed when it or its endpoint is
// closed.
type RemoteKey struct {
	e      *Endpoint
	h      raw.Rkey
	key    RegionKey
	closed bool // guarded by e.w.mu
}

// Unpack checks key and unpacks its rkey for this endpoint.
func (e *Endpoint) Unpack(key RegionKey) (*RemoteKey, error) {
	if err := checkKey(key.Addr, key.Len, key.Rkey); err != nil {
		return nil, err
	}
	buf := make([]byte, len(key.Rkey)+overreadSlack)
	copy(buf, key.Rkey)
	w := e.w
	w.mu.Lock()
	defer w.mu.Unlock()
	if e.closed || w.closed {
		return nil, ErrClosed
	}
	h, err := raw.EpRkeyUnpack(e.h, buf)
	if err != nil {
		return nil, err
	}
	k := &RemoteKey{e: e, h: h, key: key}
	e.keys[k] = struct{}{}
	return k, nil
}

// Key returns the region key k was unpacked from.
func (k *RemoteKey) Key() RegionKey { return k.key }

// Close destroys the key (ucp_rkey_destroy). It is idempotent.
func (k *RemoteKey) Close() error {
	w := k.e.w
	w.mu.Lock()
	defer w.mu.Unlock()
	if k.closed {
		return nil
	}
	k.closed = true
	raw.RkeyDestroy(k.h)
	delete(k.e.keys, k)
	return nil
}

// GetOptions tune GetWith. The zero value gives the defaults.
type GetOptions struct {
	// Chunk is the size of one ucp_get_nbx; 0 means DefaultChunk.
	Chunk int
	// Depth is how many chunks are in flight at once; 0 means DefaultDepth.
	Depth int
	// CancelWait bounds how long a canceled Get waits for the chunks in
	// flight to finish before it closes the endpoint forcibly to end them;
	// 0 means DefaultCancelWait.
	CancelWait time.Duration
	// Local, when set, is a region of this endpoint's Context that holds
	// dst: its registration is passed with each read (UCP_OP_ATTR_FIELD_MEMH)
	// so that zero-copy transports (RDMA) need not register dst again. It
	// must stay open until GetWith returns.
	Local *MemRegion
}

// Defaults of GetOptions.
const (
	DefaultChunk      = 1 << 20
	DefaultDepth      = 8
	DefaultCancelWait = 100 * time.Millisecond
)

// ErrNoRMA is returned by Get on a context made with NoRMA: read with
// Fetch.
var ErrNoRMA = errors.New("ucx: Get on a context made with NoRMA (no one-sided reads): use Fetch")

// ErrOutOfBounds is returned by Get for a read outside the key's region.
var ErrOutOfBounds = errors.New("ucx: read outside the remote region")

// Get reads len(dst) bytes at remoteAddr of the peer's region behind key
// into dst with one-sided GETs (ucp_get_nbx) in pipelined chunks,
// progressing the endpoint's worker until all complete. See GetWith.
func Get(ctx context.Context, ep *Endpoint, key *RemoteKey, remoteAddr uint64, dst []byte) error {
	return GetWith(ctx, ep, key, remoteAddr, dst, GetOptions{})
}

// GetWith is Get with options. The read must lie inside the key's region
// (ErrOutOfBounds). When ctx ends (or the endpoint or key is closed), no
// further chunk is issued and GetWith waits up to o.CancelWait for those in
// flight. UCX cannot cancel a GET: if they have not completed by then,
// GetWith closes the endpoint forcibly, which makes UCX complete them as
// canceled, and waits for that too. So when GetWith returns, UCX no longer
// writes into dst, and the error wraps ctx.Err() (or ErrClosed); a forcibly
// closed endpoint returns ErrClosed afterwards. Only if UCX failed to
// complete the requests within 5 s of the forced close does the error say
// that dst may still be written. dst may be any memory; with
// GetOptions.Local its registration is reused.
func GetWith(ctx context.Context, ep *Endpoint, key *RemoteKey, remoteAddr uint64, dst []byte, o GetOptions) error {
	if len(dst) > 0 && o.Local != nil && !(RegionKey{Addr: o.Local.key.Addr, Len: o.Local.key.Len}).Contains(raw.Addr(dst), uint64(len(dst))) {
		return errors.New("ucx: dst does not lie inside GetOptions.Local")
	}
	var pin runtime.Pinner
	if len(dst) > 0 {
		pin.Pin(&dst[0])
		defer pin.Unpin()
	}
	err := get(ctx, ep, key, remoteAddr, uint64(len(dst)), o, func(off, end uint64, k raw.Rkey, p *raw.RequestParam) (raw.Request, error) {
		return raw.GetNbx(ep.h, dst[off:end], remoteAddr+off, k, p)
	})
	runtime.KeepAlive(dst)
	return err
}

// GetInto reads n bytes at remoteAddr of the peer's region behind key into
// the local region at offset off, like GetWith (o.Local is local). local
// may be any registered region, device memory included (RegisterMemory
// with MemoryCUDA), which a []byte cannot stand for; it must stay open
// until GetInto returns.
func GetInto(ctx context.Context, ep *Endpoint, key *RemoteKey, remoteAddr uint64, local *MemRegion, off, n uint64, o GetOptions) error {
	if off > local.key.Len || n > local.key.Len-off {
		return fmt.Errorf("ucx: [%d, +%d) is not inside the local region of %d bytes", off, n, local.key.Len)
	}
	o.Local = local
	base := local.key.Addr + off
	return get(ctx, ep, key, remoteAddr, n, o, func(from, end uint64, k raw.Rkey, p *raw.RequestParam) (raw.Request, error) {
		return raw.GetNbxAt(ep.h, base+from, end-from, remoteAddr+from, k, p)
	})
}

// issueFunc issues the read of bytes [from, end) of a Get; w.mu is held.
type issueFunc func(from, end uint64, k raw.Rkey, p *raw.RequestParam) (raw.Request, error)

// get is GetWith's and GetInto's read: n bytes in chunks issued by issue,
// in readLoop, bounded by ctx as GetWith describes.
func get(ctx context.Context, ep *Endpoint, key *RemoteKey, remoteAddr, n uint64, o GetOptions, issue issueFunc) error {
	if ep.w.ctx.noRMA {
		return ErrNoRMA
	}
	l, ok, err := newReadLoop(ctx, ep, key, remoteAddr, n, readLimits{o.Chunk, o.Depth, o.CancelWait, DefaultChunk})
	if !ok {
		return err
	}
	g := &getOps{issueFn: issue, reqs: make([]raw.Request, 0, l.depth)}
	if lr := o.Local; lr != nil {
		if lr.ctx != ep.w.ctx {
			return errors.New("ucx: GetOptions.Local belongs to another Context than the endpoint")
		}
		lr.mu.Lock()
		closed := lr.closed
		lr.mu.Unlock()
		if closed {
			return ErrClosed
		}
		g.param.OpAttrMask |= raw.OpAttrFieldMemh | raw.OpAttrFieldMemoryType
		g.param.Memh = lr.h
		g.param.MemoryType = lr.memType
	}
	err = l.run(ctx, g)
	if l.stopped != nil && err == l.stopped && !g.forced.IsZero() && !errors.Is(err, ErrClosed) {
		return fmt.Errorf("%w (the endpoint was closed to end the reads in flight)", err)
	}
	return err
}

// getOps are a Get's steps in readLoop: one ucp_get_nbx a chunk. UCX cannot
// cancel a GET: a stopped Get whose reads do not end closes the endpoint
// forcibly, which completes them as canceled.
type getOps struct {
	issueFn issueFunc
	param   raw.RequestParam
	reqs    []raw.Request
	forced  time.Time // when the forced close began
}

func (g *getOps) issue(l *readLoop, from, end uint64) error {
	req, err := g.issueFn(from, end, l.key.h, &g.param)
	if err == nil && req != 0 {
		g.reqs = append(g.reqs, req)
	}
	return err
}

func (g *getOps) inflight() int { return len(g.reqs) }

func (g *getOps) halt(*readLoop) {}

func (g *getOps) reap(l *readLoop) {
	kept := g.reqs[:0]
	for _, r := range g.reqs {
		s := raw.RequestCheckStatus(r)
		if s == raw.InProgress {
			kept = append(kept, r)
			continue
		}
		raw.RequestFree(r)
		if s != raw.OK && g.forced.IsZero() {
			l.fail(&raw.Error{Func: "ucp_get_nbx", Status: s})
		}
	}
	g.reqs = kept
}

func (g *getOps) stalled(l *readLoop) error {
	switch {
	case g.forced.IsZero() && time.Now().After(l.giveUp):
		// The peer does not complete the reads in flight. A forced close of
		// the endpoint completes its requests as canceled once its lanes
		// are discarded (on the next progress calls); until they complete
		// they may still write.
		g.forced = time.Now()
		if !l.ep.closed {
			l.ep.shutLocked()
		}
	case !g.forced.IsZero() && time.Since(g.forced) > purgeWait:
		// UCX did not end the requests: give them back to it (each is
		// released when it completes) and say that dst is not safe.
		n := len(g.reqs)
		for _, r := range g.reqs {
			raw.RequestFree(r)
		}
		g.reqs = nil
		return fmt.Errorf("%w; %d reads were still in flight %v after the endpoint was closed and may still write into dst", l.stopped, n, purgeWait)
	}
	return nil
}

// shutLocked closes the endpoint forcibly and destroys its keys; w.mu is
// held. Requests in flight on it complete as canceled on later progress.
func (e *Endpoint) shutLocked() {
	for k := range e.keys {
		raw.RkeyDestroy(k.h)
		k.closed = true
	}
	e.keys = nil
	e.w.cancelDrainsLocked(e)
	_ = e.closeLocked()
	e.closed = true
	delete(e.w.endpoints, e)
	endpointsByID.Delete(e.id)
}

package ucx

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"sync"
	"sync/atomic"
	"time"

	raw "github.com/cudaipc/cudaipc/internal/ucx"
)

// overreadSlack is zeroed room after a copy of peer bytes handed to UCX,
// which parses them without knowing their length: a well-formed envelope
// around a short or wrong payload makes UCX read zeros, not past the end.
const overreadSlack = 4096

// Endpoint is a connection from a Worker to a peer's worker
// (ucp_ep_create), in UCP_ERR_HANDLING_MODE_PEER: when the peer dies, its
// requests fail (IsPeerFailure) instead of hanging.
type Endpoint struct {
	w      *Worker
	h      raw.Ep
	id     uintptr      // the err_handler arg that finds this endpoint
	failed atomic.Int32 // the ucs_status_t UCX's error handler reported, 0 if none
	closed bool         // guarded by w.mu
	broken error        // guarded by w.mu
	keys   map[*RemoteKey]struct{}
}

// The endpoints' error handler: one C callback for the process (purego has
// a fixed number), which finds the endpoint by the id UCX hands back.
var (
	errHandlerOnce sync.Once
	errHandler     uintptr
	endpointIDs    atomic.Uintptr
	endpointsByID  sync.Map // uintptr -> *Endpoint
)

func endpointErrHandler() uintptr {
	errHandlerOnce.Do(func() {
		errHandler = raw.NewErrHandler(func(arg uintptr, _ raw.Ep, s raw.Status) {
			if v, ok := endpointsByID.Load(arg); ok {
				v.(*Endpoint).failed.CompareAndSwap(0, int32(s))
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

// Connect creates an endpoint to the worker at addr. UCX connects lazily:
// an unreachable peer shows at the first Get, not here.
func (w *Worker) Connect(addr WorkerAddress) (*Endpoint, error) {
	if err := checkAddress(addr.b); err != nil {
		return nil, err
	}
	buf := make([]byte, len(addr.b)+overreadSlack)
	copy(buf, addr.b)
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.closed {
		return nil, ErrClosed
	}
	e := &Endpoint{w: w, id: endpointIDs.Add(1), keys: map[*RemoteKey]struct{}{}}
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
		return nil, err
	}
	e.h = h
	w.endpoints[e] = struct{}{}
	return e, nil
}

// closeWait bounds how long Close waits for a graceful close (in-flight
// operations flushed, the peer told) before it forces one.
const closeWait = 2 * time.Second

// Close closes the endpoint: gracefully when the peer answers within a
// short time, forcibly otherwise. Its remote keys are destroyed. It is
// idempotent.
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
	err := e.closeLocked(force || e.broken != nil || e.failed.Load() != 0)
	e.closed = true
	delete(w.endpoints, e)
	endpointsByID.Delete(e.id)
	return err
}

// closeLocked runs ucp_ep_close_nbx and progresses the worker until it
// completes; w.mu is held. A graceful close that does not finish within
// closeWait is abandoned for a forced one.
func (e *Endpoint) closeLocked(force bool) error {
	w := e.w
	p := &raw.RequestParam{OpAttrMask: raw.OpAttrFieldFlags}
	if force {
		p.Flags = raw.EpCloseFlagForce
	}
	req, err := raw.EpCloseNbx(e.h, p)
	if err != nil || req == 0 {
		if force {
			return nil // a forced close of a failed endpoint may report its failure
		}
		return err
	}
	deadline := time.Now().Add(closeWait)
	for {
		raw.WorkerProgress(w.h)
		s := raw.RequestCheckStatus(req)
		if s != raw.InProgress {
			raw.RequestFree(req)
			if s == raw.OK || force {
				return nil
			}
			return &raw.Error{Func: "ucp_ep_close_nbx", Status: s}
		}
		if !force && time.Now().After(deadline) {
			// The request belongs to the endpoint and ends with the forced
			// close below.
			raw.RequestFree(req)
			return e.closeLocked(true)
		}
		if force && time.Now().After(deadline.Add(closeWait)) {
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

// ErrOutOfBounds is returned by Get for a read outside the key's region.
var ErrOutOfBounds = errors.New("ucx: read outside the remote region")

// Get reads len(dst) bytes at remoteAddr of the peer's region behind key
// into dst with one-sided GETs (ucp_get_nbx) in pipelined chunks,
// progressing the endpoint's worker until all complete. See GetWith.
func Get(ctx context.Context, ep *Endpoint, key *RemoteKey, remoteAddr uint64, dst []byte) error {
	return GetWith(ctx, ep, key, remoteAddr, dst, GetOptions{})
}

// GetWith is Get with options. The read must lie inside the key's region
// (ErrOutOfBounds). When ctx ends, no further chunk is issued and GetWith
// waits up to o.CancelWait for those in flight; if they have not completed
// by then it closes the endpoint forcibly, which ends them. Either way,
// when GetWith returns UCX no longer writes into dst; the error then wraps
// ctx.Err(), and a forcibly closed endpoint returns ErrClosed afterwards.
// dst may be any memory, preferably registered (a MemRegion's) for
// zero-copy transports.
func GetWith(ctx context.Context, ep *Endpoint, key *RemoteKey, remoteAddr uint64, dst []byte, o GetOptions) error {
	if key.e != ep {
		return errors.New("ucx: the remote key was unpacked on another endpoint")
	}
	if !key.key.Contains(remoteAddr, uint64(len(dst))) {
		return fmt.Errorf("%w: [%#x, +%d) is not inside [%#x, +%d)", ErrOutOfBounds, remoteAddr, len(dst), key.key.Addr, key.key.Len)
	}
	if len(dst) == 0 {
		return nil
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	chunk, depth, cancelWait := o.Chunk, o.Depth, o.CancelWait
	if chunk <= 0 {
		chunk = DefaultChunk
	}
	if depth <= 0 {
		depth = DefaultDepth
	}
	if cancelWait <= 0 {
		cancelWait = DefaultCancelWait
	}
	var param raw.RequestParam
	if l := o.Local; l != nil {
		if l.ctx != ep.w.ctx {
			return errors.New("ucx: GetOptions.Local belongs to another Context than the endpoint")
		}
		if !(RegionKey{Addr: l.key.Addr, Len: l.key.Len}).Contains(raw.Addr(dst), uint64(len(dst))) {
			return errors.New("ucx: dst does not lie inside GetOptions.Local")
		}
		l.mu.Lock()
		closed := l.closed
		l.mu.Unlock()
		if closed {
			return ErrClosed
		}
		param.OpAttrMask |= raw.OpAttrFieldMemh
		param.Memh = l.h
	}
	var pin runtime.Pinner
	pin.Pin(&dst[0])
	defer pin.Unpin()

	w := ep.w
	var (
		inflight = make([]raw.Request, 0, depth)
		next     int
		firstErr error
		canceled error
		giveUp   time.Time
	)
	for {
		w.mu.Lock()
		if ep.closed || key.closed || w.closed {
			// Only a forced close (which ended every request) gets here
			// with requests in flight.
			for _, r := range inflight {
				raw.RequestFree(r)
			}
			w.mu.Unlock()
			if canceled != nil {
				return canceled
			}
			return ErrClosed
		}
		if firstErr == nil && ep.failed.Load() != 0 {
			firstErr = ep.Err()
		}
		for firstErr == nil && canceled == nil && next < len(dst) && len(inflight) < depth {
			end := min(next+chunk, len(dst))
			req, err := raw.GetNbx(ep.h, dst[next:end], remoteAddr+uint64(next), key.h, &param)
			if err != nil {
				firstErr = err
				break
			}
			if req != 0 {
				inflight = append(inflight, req)
			}
			next = end
		}
		if len(inflight) > 0 {
			raw.WorkerProgress(w.h)
		}
		kept := inflight[:0]
		for _, r := range inflight {
			s := raw.RequestCheckStatus(r)
			if s == raw.InProgress {
				kept = append(kept, r)
				continue
			}
			raw.RequestFree(r)
			if s != raw.OK && firstErr == nil {
				firstErr = &raw.Error{Func: "ucp_get_nbx", Status: s}
			}
		}
		inflight = kept
		if len(inflight) == 0 && (firstErr != nil || canceled != nil || next == len(dst)) {
			if firstErr != nil && IsPeerFailure(firstErr) {
				ep.broken = firstErr
			}
			w.mu.Unlock()
			break
		}
		if canceled != nil && time.Now().After(giveUp) {
			// The peer does not complete the chunks in flight: end them by
			// closing the endpoint; UCX completes them with UCS_ERR_CANCELED.
			for k := range ep.keys {
				raw.RkeyDestroy(k.h)
				k.closed = true
			}
			ep.keys = nil
			_ = ep.closeLocked(true)
			ep.closed = true
			delete(w.endpoints, ep)
			endpointsByID.Delete(ep.id)
			for _, r := range inflight {
				raw.RequestFree(r)
			}
			w.mu.Unlock()
			return fmt.Errorf("%w (the endpoint was closed to end the reads in flight)", canceled)
		}
		w.mu.Unlock()
		if canceled == nil {
			if err := ctx.Err(); err != nil {
				canceled = err
				giveUp = time.Now().Add(cancelWait)
			}
		}
	}
	runtime.KeepAlive(dst)
	if canceled != nil {
		return canceled
	}
	return firstErr
}

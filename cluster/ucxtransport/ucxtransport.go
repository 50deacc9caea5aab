// Package ucxtransport is the cluster's data plane on UCX: it implements
// cluster.Transport with transport/ucx, one worker serving this node's
// registered memory (progressed by its own goroutine, as GETs over tcp and
// shared memory are emulated with messages the serving side must handle)
// and one worker for this node's reads.
//
// Worker addresses and rkeys cross nodes in transport/ucx's checked
// envelopes (WorkerAddress and RegionKey binary encodings): what a peer sends
// is checked before UCX parses it, and a malformed one is an error wrapping
// ucx.ErrMalformed, never a crash.
package ucxtransport

import (
	"context"
	"errors"
	"fmt"
	"sync"

	"github.com/cudaipc/cudaipc/cluster"
	"github.com/cudaipc/cudaipc/transport/ucx"
)

// Transport is a node's UCX data plane.
type Transport struct {
	c         *ucx.Context
	serve     *ucx.Worker
	pull      *ucx.Worker
	addr      []byte
	stop      context.CancelFunc
	served    chan struct{}
	closeOnce sync.Once
}

// New initializes UCX (transports and devices from UCX_TLS,
// UCX_NET_DEVICES, ...) and starts serving. Without libucp it fails with
// an error matching ucx.ErrNotFound that says what to install.
func New(name string) (*Transport, error) {
	c, err := ucx.NewContext(ucx.ContextOptions{Name: name})
	if err != nil {
		return nil, err
	}
	t := &Transport{c: c, served: make(chan struct{})}
	if t.serve, err = c.NewWorker(ucx.WorkerOptions{Name: name + "-serve"}); err == nil {
		t.pull, err = c.NewWorker(ucx.WorkerOptions{Name: name + "-pull"})
	}
	if err == nil {
		t.addr, err = t.serve.Address().MarshalBinary()
	}
	if err != nil {
		c.Close()
		return nil, fmt.Errorf("ucx: %w", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	t.stop = cancel
	go func() {
		defer close(t.served)
		_ = t.serve.Serve(ctx)
	}()
	return t, nil
}

// Close stops serving and releases UCX: registered regions, endpoints and
// workers.
func (t *Transport) Close() error {
	t.closeOnce.Do(func() {
		t.stop()
		<-t.served
		t.c.Close()
	})
	return nil
}

// WorkerAddress implements cluster.Transport: the serving worker's address
// in its envelope.
func (t *Transport) WorkerAddress() []byte { return t.addr }

// Region is memory registered once for peers' reads: an arena.
type Region struct {
	r   *ucx.MemRegion
	key []byte
}

// Register registers mem (a whole arena, mapped for as long as the region
// is open) for peers' reads and packs its key once.
func (t *Transport) Register(mem []byte) (*Region, error) {
	return packRegion(t.c.Register(mem))
}

// packRegion is the Region of r, registered unless err, with its key
// packed; a key that cannot be packed deregisters r.
func packRegion(r *ucx.MemRegion, err error) (*Region, error) {
	if err != nil {
		return nil, err
	}
	k, err := r.Key().MarshalBinary()
	if err != nil {
		r.Close()
		return nil, err
	}
	return &Region{r: r, key: k}, nil
}

// CanRegisterCUDA reports whether this UCX registers GPU memory directly
// (ucp_context_query lists CUDA among its memory types); without it GPU
// objects cross through pinned host memory.
func (t *Transport) CanRegisterCUDA() bool { return t.c.Supports(ucx.MemoryCUDA) }

// RegisterDevice registers length bytes of GPU memory at device address
// addr (a whole GPU arena, allocated for as long as the region is open)
// for peers' reads. It fails unless CanRegisterCUDA.
func (t *Transport) RegisterDevice(addr, length uint64) (*Region, error) {
	return packRegion(t.c.RegisterMemory(addr, length, ucx.MemoryCUDA))
}

// Key is the region's packed key in its envelope: Exposure.RKey.
func (r *Region) Key() []byte { return r.key }

// Addr is the remote address of byte off of the region: Exposure.Addr.
func (r *Region) Addr(off int64) uint64 { return r.r.Key().Addr + uint64(off) }

// Close deregisters the region; peers' reads in flight fail.
func (r *Region) Close() error { return r.r.Close() }

// Connect implements cluster.Transport.
func (t *Transport) Connect(ctx context.Context, addr []byte) (cluster.Endpoint, error) {
	var a ucx.WorkerAddress
	if err := a.UnmarshalBinary(addr); err != nil {
		return nil, err
	}
	ep, err := t.pull.Connect(a)
	if err != nil {
		return nil, err
	}
	return &endpoint{ep: ep, keys: map[string]*ucx.RemoteKey{}}, nil
}

type endpoint struct {
	ep   *ucx.Endpoint
	mu   sync.Mutex
	keys map[string]*ucx.RemoteKey
}

// key returns rkey (a RegionKey envelope) unpacked on e, once per
// endpoint.
func (e *endpoint) key(rkey []byte) (*ucx.RemoteKey, error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if k, ok := e.keys[string(rkey)]; ok {
		return k, nil
	}
	var rk ucx.RegionKey
	err := rk.UnmarshalBinary(rkey)
	if err != nil {
		return nil, err
	}
	k, err := e.ep.Unpack(rk)
	if err != nil {
		return nil, err
	}
	e.keys[string(rkey)] = k
	return k, nil
}

// Get implements cluster.Endpoint. rkey is a RegionKey envelope.
func (e *endpoint) Get(ctx context.Context, rkey []byte, addr uint64, dst []byte) error {
	k, err := e.key(rkey)
	if err != nil {
		return err
	}
	return peerGone(ucx.Get(ctx, e.ep, k, addr, dst))
}

// GetStream implements cluster.StreamEndpoint with ucx.GetStream: one
// loop keeps o.Depth GETs in flight on the endpoint.
func (e *endpoint) GetStream(ctx context.Context, rkey []byte, o cluster.StreamOptions, next func(wait bool) (cluster.Read, bool), done func(cluster.Read, error)) error {
	k, err := e.key(rkey)
	if err != nil {
		return err
	}
	err = ucx.GetStream(ctx, e.ep, k, ucx.StreamOptions{Depth: o.Depth, Timeout: o.Timeout},
		func(wait bool) (ucx.Read, bool) {
			r, ok := next(wait)
			return ucx.Read(r), ok
		},
		func(r ucx.Read, err error) { done(cluster.Read(r), peerGone(err)) })
	return peerGone(err)
}

// peerGone says so in an error of a peer that failed.
func peerGone(err error) error {
	if err != nil && ucx.IsPeerFailure(err) {
		return fmt.Errorf("%w (the holder or the link to it is gone)", err)
	}
	return err
}

func (e *endpoint) Close() error {
	err := e.ep.Close()
	if errors.Is(err, ucx.ErrClosed) {
		return nil
	}
	return err
}

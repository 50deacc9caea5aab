// Package ucxtransport is the cluster's data plane on UCX: it implements
// cluster.Transport with transport/ucx, one worker serving this node's
// registered memory (progressed by its own goroutine: it answers peers'
// fetches, and GETs, which tcp and shared memory emulate with messages)
// and one worker for this node's reads; with Options.Lanes, several of
// each (lanes.go). Reads are ucx.Fetch by default (Options.Read).
//
// Worker addresses and rkeys cross nodes in transport/ucx's checked
// envelopes (WorkerAddress and RegionKey binary encodings): what a peer sends
// is checked before UCX parses it, and a malformed one is an error wrapping
// ucx.ErrMalformed, never a crash.
package ucxtransport

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"

	"github.com/cudaipc/cudaipc/cluster"
	"github.com/cudaipc/cudaipc/transport/ucx"
)

// Transport is a node's UCX data plane.
type Transport struct {
	read      ReadMode
	fetches   atomic.Uint64
	gets      atomic.Uint64
	c         *ucx.Context
	serve     []*ucx.Worker
	pull      []*ucx.Worker
	addr      []byte
	stop      context.CancelFunc
	served    sync.WaitGroup
	closeOnce sync.Once
}

// Options are New's settings.
type Options struct {
	// Lanes is how many serving workers (each progressed by its own
	// goroutine) and pulling workers the transport has, at most MaxLanes;
	// 0 means 1. A pull from a node of several lanes reads over as many
	// endpoints (over tcp: connections), on as many workers, its reads
	// taking the lanes in turn, so that one progress thread a side does
	// not bound the pull. A node publishes every lane's address
	// (lanes.go), and whether it answers GETs.
	Lanes int
	// Read is how this node reads from peers: ReadFetch (the default) or
	// ReadGet. A node of ReadGet also answers peers' GETs (UCX's RMA
	// feature), and reads with fetches from peers that do not; one of
	// ReadFetch answers no GETs, and cannot read from peers of earlier
	// versions, which answer nothing else.
	Read ReadMode
}

// ReadMode is how a node reads peers' memory.
type ReadMode string

// Read modes.
const (
	// ReadFetch asks the holder to send the bytes of an exposure's window
	// (ucx.Fetch): a reader killed mid-read cannot abort the holder, as
	// UCX 1.16's emulated GET over tcp can, and the holder answers no GETs.
	ReadFetch ReadMode = "fetch"
	// ReadGet reads with one-sided GETs (ucx.Get) where the peer answers
	// them, and answers peers' GETs: over tcp UCX answers an emulated GET
	// of any address of the daemon's process, so use it only where every
	// host that can reach the daemon's UCX ports is trusted.
	ReadGet ReadMode = "get"
)

// New initializes UCX (transports and devices from UCX_TLS,
// UCX_NET_DEVICES, ...) and starts serving, with one lane. Without libucp
// it fails with an error matching ucx.ErrNotFound that says what to
// install.
func New(name string) (*Transport, error) { return NewWith(name, Options{}) }

// NewWith is New with options.
func NewWith(name string, o Options) (*Transport, error) {
	lanes := max(o.Lanes, 1)
	if lanes > MaxLanes {
		return nil, fmt.Errorf("ucx: %d lanes, at most %d", lanes, MaxLanes)
	}
	switch o.Read {
	case "":
		o.Read = ReadFetch
	case ReadFetch, ReadGet:
	default:
		return nil, fmt.Errorf("ucx: read mode %q, want %q or %q", o.Read, ReadFetch, ReadGet)
	}
	// Without RMA, this node answers no GETs: over tcp UCX answers an
	// emulated GET of any address of the process, whatever the rkey, so
	// only a node that reads with GETs (and whose peers do) enables it.
	c, err := ucx.NewContext(ucx.ContextOptions{Name: name, NoRMA: o.Read != ReadGet})
	if err != nil {
		return nil, err
	}
	t := &Transport{c: c, read: o.Read}
	addrs := make([]ucx.WorkerAddress, 0, lanes)
	for i := 0; i < lanes && err == nil; i++ {
		suffix := ""
		if lanes > 1 {
			suffix = fmt.Sprintf("-%d", i)
		}
		var sw, pw *ucx.Worker
		if sw, err = c.NewWorker(ucx.WorkerOptions{Name: name + "-serve" + suffix}); err == nil {
			pw, err = c.NewWorker(ucx.WorkerOptions{Name: name + "-pull" + suffix})
		}
		if err == nil {
			t.serve, t.pull = append(t.serve, sw), append(t.pull, pw)
			addrs = append(addrs, sw.Address())
		}
	}
	if err == nil {
		t.addr, err = peerAddress{lanes: addrs, fetch: true, get: o.Read == ReadGet}.marshal()
	}
	if err != nil {
		c.Close()
		return nil, fmt.Errorf("ucx: %w", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	t.stop = cancel
	for _, w := range t.serve {
		t.served.Go(func() { _ = w.Serve(ctx) })
	}
	return t, nil
}

// Reads returns how many reads this node has made of peers' memory with
// ucx.Fetch and with ucx.Get.
func (t *Transport) Reads() (fetches, gets uint64) { return t.fetches.Load(), t.gets.Load() }

// Served returns what this node's serving workers answered to peers'
// fetches.
func (t *Transport) Served() ucx.FetchStats { return t.c.FetchStats() }

// Close stops serving and releases UCX: registered regions, endpoints and
// workers.
func (t *Transport) Close() error {
	t.closeOnce.Do(func() {
		t.stop()
		t.served.Wait()
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

// Key is the region's packed key in its envelope: the whole region, for
// GETs. Exposure.RKey is a Window's key.
func (r *Region) Key() []byte { return r.key }

// magicWindow starts a window key: magicWindow (4), the window's token
// (16), then the region's key envelope.
var magicWindow = [4]byte{'u', 'c', 'W', 'K'}

// Window opens a window on n bytes of the region at offset off for peers'
// reads and returns its key (Exposure.RKey): peers that fetch read only
// those bytes, and only until release. GETs, where this node answers them,
// read the whole region.
func (r *Region) Window(off, n int64) (key []byte, release func(), err error) {
	if off < 0 || n < 0 {
		return nil, nil, fmt.Errorf("ucx: window [%d, +%d)", off, n)
	}
	w, err := r.r.Window(uint64(off), uint64(n))
	if err != nil {
		return nil, nil, err
	}
	return r.windowKey(w), func() { w.Close() }, nil
}

// FillingWindow is Window on bytes still being written: peers' fetches of
// bytes past what Filling.Ready last said wait at this node until it
// covers them (ucx.MemRegion.FillingWindow). A node that answers GETs must
// not expose bytes so: GETs read whatever the region holds.
func (r *Region) FillingWindow(off, n int64) (*Filling, error) {
	if off < 0 || n < 0 {
		return nil, fmt.Errorf("ucx: window [%d, +%d)", off, n)
	}
	w, err := r.r.FillingWindow(uint64(off), uint64(n))
	if err != nil {
		return nil, err
	}
	return &Filling{Key: r.windowKey(w), w: w}, nil
}

// Filling is an open FillingWindow.
type Filling struct {
	// Key is the window's key (Exposure.RKey).
	Key []byte
	w   *ucx.Window
}

// Ready says that the window's first k bytes hold what peers may read.
func (f *Filling) Ready(k int64) { f.w.Ready(uint64(max(k, 0))) }

// Close closes the window: peers' later fetches, and those waiting, are
// refused.
func (f *Filling) Close() { f.w.Close() }

func (r *Region) windowKey(w *ucx.Window) []byte {
	tok := w.Token()
	return append(append(append(make([]byte, 0, len(magicWindow)+len(tok)+len(r.key)), magicWindow[:]...), tok[:]...), r.key...)
}

// parseKey splits a key a peer handed out: a window key (a token and its
// region's key), or a region key alone (a peer of an earlier version).
func parseKey(b []byte) (rk ucx.RegionKey, tok ucx.Token, window bool, err error) {
	tok, b, window, err = splitKey(b)
	if err == nil {
		err = rk.UnmarshalBinary(b)
	}
	return rk, tok, window, err
}

// splitKey splits a key a peer handed out into its window's token (a
// window key) and its region's key envelope, which it does not check.
func splitKey(b []byte) (tok ucx.Token, region []byte, window bool, err error) {
	if !bytes.HasPrefix(b, magicWindow[:]) {
		return tok, b, false, nil
	}
	if len(b) < len(magicWindow)+len(tok) {
		return tok, nil, false, &ucx.MalformedError{What: "region key", Reason: fmt.Sprintf("window key of %d bytes, truncated", len(b))}
	}
	tok = ucx.Token(b[len(magicWindow):])
	return tok, b[len(magicWindow)+len(tok):], true, nil
}

// Addr is the remote address of byte off of the region: Exposure.Addr.
func (r *Region) Addr(off int64) uint64 { return r.r.Key().Addr + uint64(off) }

// Close deregisters the region; peers' reads in flight fail.
func (r *Region) Close() error { return r.r.Close() }

// Connect implements cluster.Transport: an endpoint to each of the peer's
// lanes (as many as both sides have), on this node's pulling workers.
func (t *Transport) Connect(ctx context.Context, addr []byte) (cluster.Endpoint, error) {
	pa, err := parsePeerAddress(addr)
	if err != nil {
		return nil, err
	}
	// Fetch where the peer answers fetches, unless both read with GETs;
	// a node without RMA cannot read a peer that answers only GETs.
	fetch := pa.fetch && (t.read == ReadFetch || !pa.get)
	if !fetch && t.read != ReadGet {
		return nil, errors.New("ucx: the peer answers only GETs (a daemon of an earlier version): this one reads with fetches; upgrade the peer, or run this one with experimental-cluster-read = \"get\"")
	}
	e := &endpoint{t: t, keys: map[string]*peerKey{}, fetch: fetch}
	for i, a := range pa.lanes[:min(len(pa.lanes), len(t.pull))] {
		ep, err := t.pull[i].Connect(a)
		if err != nil {
			e.Close()
			return nil, err
		}
		e.lanes = append(e.lanes, ep)
	}
	return e, nil
}

// endpoint reads from one peer over its lanes.
type endpoint struct {
	t     *Transport
	lanes []*ucx.Endpoint
	fetch bool          // read with ucx.Fetch, not ucx.Get
	next  atomic.Uint64 // the lane of the next Get
	mu    sync.Mutex
	keys  map[string]*peerKey // by the region key envelope's bytes
}

// peerKey is a peer's region key, unpacked on each lane.
type peerKey struct {
	lanes []*ucx.RemoteKey
}

// key returns the region key of rkey (a window key, or a region key
// envelope) unpacked on each lane, once per endpoint and region: the
// windows a peer opens on one region, a token each, share it.
func (e *endpoint) key(rkey []byte) (k *peerKey, tok ucx.Token, window bool, err error) {
	tok, region, window, err := splitKey(rkey)
	if err != nil {
		return nil, tok, false, err
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	if k, ok := e.keys[string(region)]; ok {
		return k, tok, window, nil
	}
	var rk ucx.RegionKey
	if err := rk.UnmarshalBinary(region); err != nil {
		return nil, tok, false, err
	}
	k = &peerKey{lanes: make([]*ucx.RemoteKey, len(e.lanes))}
	for i, ep := range e.lanes {
		if k.lanes[i], err = ep.Unpack(rk); err != nil {
			return nil, tok, false, err
		}
	}
	e.keys[string(region)] = k
	return k, tok, window, nil
}

// Get implements cluster.Endpoint: on the next lane, in turn, so that a
// pull's concurrent reads spread over the lanes. rkey is a window key
// (fetched) or a region key (read with GETs).
func (e *endpoint) Get(ctx context.Context, rkey []byte, addr uint64, dst []byte) error {
	k, tok, window, err := e.key(rkey)
	if err != nil {
		return err
	}
	i := int(e.next.Add(1) % uint64(len(e.lanes)))
	if e.fetch && window {
		e.t.fetches.Add(1)
		return peerGone(ucx.Fetch(ctx, e.lanes[i], k.lanes[i], addr, dst, ucx.FetchOptions{Token: tok}))
	}
	e.t.gets.Add(1)
	return peerGone(ucx.Get(ctx, e.lanes[i], k.lanes[i], addr, dst))
}

// peerGone says so in an error of a peer that failed.
func peerGone(err error) error {
	if err != nil && ucx.IsPeerFailure(err) {
		return fmt.Errorf("%w (the holder or the link to it is gone)", err)
	}
	return err
}

// Close closes every lane's endpoint.
func (e *endpoint) Close() error {
	var errs []error
	for _, ep := range e.lanes {
		if err := ep.Close(); err != nil && !errors.Is(err, ucx.ErrClosed) {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

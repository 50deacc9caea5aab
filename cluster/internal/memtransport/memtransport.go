// Package memtransport is an in-process cluster.Transport for tests: every
// Network is a set of workers, each exposing byte slices under random rkeys,
// and Get copies real bytes out of them. A worker can be killed, after
// which Gets from it fail as a dead peer's would.
package memtransport

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/cudaipc/cudaipc/cluster"
)

// Network is a set of workers that can reach each other.
type Network struct {
	mu      sync.Mutex
	workers map[string]*Worker
}

// NewNetwork returns an empty network.
func NewNetwork() *Network { return &Network{workers: map[string]*Worker{}} }

// Worker is one node's transport.
type Worker struct {
	net  *Network
	addr string

	mu      sync.Mutex
	delay   time.Duration
	hold    <-chan struct{}
	waiting int
	dead    bool
	regions map[string][]byte
	gets    int
}

// Worker adds a worker to the network.
func (n *Network) Worker() *Worker {
	w := &Worker{net: n, addr: "mem-" + rand.Text(), regions: map[string][]byte{}}
	n.mu.Lock()
	n.workers[w.addr] = w
	n.mu.Unlock()
	return w
}

// WorkerAddress implements cluster.Transport.
func (w *Worker) WorkerAddress() []byte { return []byte(w.addr) }

// Register exposes b under a new rkey; its remote address is 0x1000.
func (w *Worker) Register(b []byte) (rkey []byte, addr uint64, release func(), err error) {
	k := rand.Text()
	w.mu.Lock()
	w.regions[k] = b
	w.mu.Unlock()
	return []byte(k), 0x1000, func() {
		w.mu.Lock()
		delete(w.regions, k)
		w.mu.Unlock()
	}, nil
}

// SetDelay makes each Get served by this worker wait d first (so that
// tests can kill it mid-pull, or hang it).
func (w *Worker) SetDelay(d time.Duration) {
	w.mu.Lock()
	w.delay = d
	w.mu.Unlock()
}

// Hold makes each Get served by this worker wait, after any delay, until
// release is closed or the Get's context ends (so that a test can see the
// Gets a pull has asked of each holder before any is served); nil stops
// holding later Gets.
func (w *Worker) Hold(release <-chan struct{}) {
	w.mu.Lock()
	w.hold = release
	w.mu.Unlock()
}

// Waiting counts the Gets waiting on Hold's release now.
func (w *Worker) Waiting() int {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.waiting
}

// Kill makes every later Get from this worker fail.
func (w *Worker) Kill() {
	w.mu.Lock()
	w.dead = true
	w.mu.Unlock()
}

// Gets counts the Gets this worker served.
func (w *Worker) Gets() int {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.gets
}

// Connect implements cluster.Transport.
func (w *Worker) Connect(ctx context.Context, addr []byte) (cluster.Endpoint, error) {
	w.net.mu.Lock()
	peer := w.net.workers[string(addr)]
	w.net.mu.Unlock()
	if peer == nil {
		return nil, fmt.Errorf("memtransport: no worker at address %q", addr)
	}
	return &endpoint{peer: peer}, nil
}

type endpoint struct{ peer *Worker }

// ErrDead is what a Get from a killed worker returns.
var ErrDead = errors.New("memtransport: peer unreachable")

func (e *endpoint) Get(ctx context.Context, rkey []byte, addr uint64, dst []byte) error {
	e.peer.mu.Lock()
	d := e.peer.delay
	e.peer.mu.Unlock()
	if d > 0 {
		select {
		case <-time.After(d):
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	e.peer.mu.Lock()
	if hold := e.peer.hold; hold != nil {
		e.peer.waiting++
		e.peer.mu.Unlock()
		var err error
		select {
		case <-hold:
		case <-ctx.Done():
			err = ctx.Err()
		}
		e.peer.mu.Lock()
		e.peer.waiting--
		if err != nil {
			e.peer.mu.Unlock()
			return err
		}
	}
	defer e.peer.mu.Unlock()
	if e.peer.dead {
		return ErrDead
	}
	b, ok := e.peer.regions[string(rkey)]
	if !ok {
		return fmt.Errorf("memtransport: unknown rkey")
	}
	if addr < 0x1000 || addr-0x1000+uint64(len(dst)) > uint64(len(b)) {
		return fmt.Errorf("memtransport: [%#x, +%d) outside the region", addr, len(dst))
	}
	copy(dst, b[addr-0x1000:])
	e.peer.gets++
	return nil
}

func (e *endpoint) Close() error { return nil }

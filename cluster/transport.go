package cluster

import (
	"context"
	"sync"
	"time"
)

// Transport is the data plane seam: reads of memory that another node
// exposed (its UCX worker address, an rkey and a remote address, from an
// Exposure). The UCX implementation registers arenas once, when they are
// made, and reads by asking the holder's UCX worker to send the bytes
// (ucx.Fetch; one-sided GETs with peers of earlier versions); tests use an
// in-process one that moves real bytes.
type Transport interface {
	// WorkerAddress is this node's worker address, which peers connect
	// to.
	WorkerAddress() []byte
	// Connect returns an endpoint to the worker at addr. A malformed
	// address is an error, never a crash.
	Connect(ctx context.Context, addr []byte) (Endpoint, error)
}

// Endpoint reads from one remote worker.
type Endpoint interface {
	// Get reads len(dst) bytes at remote address addr of the memory that
	// rkey (packed by the remote side) describes into dst, returning when
	// the bytes are in dst or ctx is done. A malformed rkey is an error.
	Get(ctx context.Context, rkey []byte, addr uint64, dst []byte) error
	// Close closes the endpoint.
	Close() error
}

// chunkRead is one read of a pull: len(dst) bytes at remote address addr,
// chunk first and those after it; or of a space read (kvspace.go): of
// region region, first its tag, through rkey.
type chunkRead struct {
	addr   uint64
	dst    []byte
	first  int
	rkey   []byte // nil: readChunks's
	region int
}

// readChunks keeps up to depth reads from ep in flight, each a Get (of
// rkey, or of the read's own) on a goroutine of its own bounded by timeout
// (0: none), until next has no more. next may block until it has a read; false ends that goroutine.
// done gets every read next returned, with nil when its bytes are in dst
// or its error; a goroutine stops at its first failed read. next and done
// are called from several goroutines at once. readChunks returns when
// every goroutine has, with the first error (ctx's when it ended).
// Concurrent reads rather than one loop issuing them all: the loop read no
// faster and tripped a UCX 1.13 assertion when a daemon closed right after
// a pull (docs/lab/cluster-measured.md, "Checks beside the reads").
func readChunks(ctx context.Context, ep Endpoint, rkey []byte, depth int, timeout time.Duration, next func() (chunkRead, bool), done func(chunkRead, error)) error {
	var (
		mu    sync.Mutex
		first error
		wg    sync.WaitGroup
	)
	failed := func() bool {
		mu.Lock()
		defer mu.Unlock()
		return first != nil
	}
	for range max(depth, 1) {
		wg.Go(func() {
			for !failed() {
				r, ok := next()
				if !ok {
					return
				}
				rctx, cancel := ctx, context.CancelFunc(func() {})
				if timeout > 0 {
					rctx, cancel = context.WithTimeout(ctx, timeout)
				}
				key := rkey
				if r.rkey != nil {
					key = r.rkey
				}
				err := ep.Get(rctx, key, r.addr, r.dst)
				if err == nil {
					err = rctx.Err()
				}
				cancel()
				done(r, err)
				if err != nil {
					mu.Lock()
					if first == nil {
						first = err
					}
					mu.Unlock()
					return
				}
			}
		})
	}
	wg.Wait()
	if err := ctx.Err(); err != nil {
		return err
	}
	return first
}

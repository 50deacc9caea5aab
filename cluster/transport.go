package cluster

import (
	"context"
	"sync"
	"time"
)

// Transport is the data plane seam: one-sided reads of memory that another
// node exposed (its UCX worker address, an rkey and a remote address, from
// an Exposure). The UCX implementation registers arenas once, when they
// are made, and reads with ucp_get_nbx; tests use an in-process one that
// moves real bytes.
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

// Read is one read of a stream of reads (StreamEndpoint): len(Dst) bytes
// at remote address Addr. Tag is the caller's, handed back with it.
type Read struct {
	Addr uint64
	Dst  []byte
	Tag  int
}

// StreamOptions tune a stream of reads.
type StreamOptions struct {
	// Depth is how many reads are in flight at once.
	Depth int
	// Timeout bounds each read from its issue; a read not complete by
	// then fails with an error wrapping context.DeadlineExceeded and
	// stops the stream. 0 means no bound.
	Timeout time.Duration
}

// StreamEndpoint is an Endpoint that keeps several reads in flight from
// one goroutine (UCX: one loop issues the GETs, progresses the worker and
// sees each completion), which the puller prefers to concurrent Gets.
type StreamEndpoint interface {
	Endpoint
	// GetStream reads what next hands it, up to o.Depth reads at once,
	// until next has no more: next is called when a read can be issued
	// (wait: none is in flight, and next may block until it has one;
	// returning false then ends the stream, and otherwise means "none
	// now", asked again after the next completion). done is called once
	// for every read next returned, with nil when its bytes are in Dst or
	// its error, after which nothing writes into Dst. next and done may
	// be called from several goroutines at once (an endpoint of several
	// connections runs a loop on each) and must not wait for the stream's
	// own reads. The first failed read stops the issuing of new
	// ones; GetStream returns when every read is done, with the first
	// error (ctx's when it ended).
	GetStream(ctx context.Context, rkey []byte, o StreamOptions, next func(wait bool) (Read, bool), done func(Read, error)) error
}

// getStream runs a stream of reads on ep: its own GetStream when it has
// one, else o.Depth goroutines each doing one Get at a time (next and
// done are then called from several goroutines at once).
func getStream(ctx context.Context, ep Endpoint, rkey []byte, o StreamOptions, next func(wait bool) (Read, bool), done func(Read, error)) error {
	if se, ok := ep.(StreamEndpoint); ok {
		return se.GetStream(ctx, rkey, o, next, done)
	}
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
	for range max(o.Depth, 1) {
		wg.Go(func() {
			for !failed() {
				r, ok := next(true)
				if !ok {
					return
				}
				rctx, cancel := ctx, context.CancelFunc(func() {})
				if o.Timeout > 0 {
					rctx, cancel = context.WithTimeout(ctx, o.Timeout)
				}
				err := ep.Get(rctx, rkey, r.Addr, r.Dst)
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

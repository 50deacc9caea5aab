package ucx

import (
	"context"
	"errors"
	"fmt"
	"time"
)

// readLoop is the loop Get and Fetch share: it issues a read's requests in
// chunks, at most depth in flight, progresses the worker, reaps what
// completed, and ends once nothing is in flight and the read is done, failed
// or stopped. ctx's end, or the close of the endpoint or key, stops the
// read: nothing more is issued and the requests in flight get cancelWait to
// end; what is done with those that do not is the read's own (readOps.stalled).
// The worker's lock is held for each round and released between rounds.
type readLoop struct {
	ep         *Endpoint
	key        *RemoteKey
	n          uint64 // bytes to read
	chunk      uint64
	depth      int
	cancelWait time.Duration

	next     uint64    // where the next request starts
	firstErr error     // the first failure
	stopped  error     // ctx's error, or ErrClosed when ep or key was closed
	giveUp   time.Time // when a stopped read stops waiting for the peer
}

// readOps are one kind of read's steps in readLoop; each runs with w.mu
// held.
type readOps interface {
	// issue issues the requests that read bytes [from, end). An error ends
	// the issuing; what it issued before failing is in flight all the same.
	issue(l *readLoop, from, end uint64) error
	// inflight is how many requests are in flight.
	inflight() int
	// reap frees the requests that completed, records their failures
	// (readLoop.fail) and keeps the others in flight.
	reap(l *readLoop)
	// halt runs each round once the read failed or stopped, before reap.
	halt(l *readLoop)
	// stalled runs each round while a stopped read still has requests in
	// flight; an error ends the read with it at once, the requests given
	// back to UCX.
	stalled(l *readLoop) error
}

// fail records err as the read's failure unless it already has one.
func (l *readLoop) fail(err error) {
	if l.firstErr == nil {
		l.firstErr = err
	}
}

// going reports whether the read has neither failed nor stopped.
func (l *readLoop) going() bool { return l.firstErr == nil && l.stopped == nil }

// stop stops the read with err unless it is stopped already.
func (l *readLoop) stop(err error) {
	if l.stopped == nil {
		l.stopped, l.giveUp = err, time.Now().Add(l.cancelWait)
	}
}

// run runs the read to its end and returns its error: ctx's (or ErrClosed)
// when it stopped, else its first failure.
func (l *readLoop) run(ctx context.Context, ops readOps) error {
	w := l.ep.w
	defer w.reading()()
	var idle idleWait
	for {
		w.mu.Lock()
		if w.closed {
			// The worker is destroyed, and with it every request: nothing
			// can write into the destination any more, and the requests must
			// not be touched.
			w.mu.Unlock()
			return stoppedErr(l.stopped, ErrClosed)
		}
		if l.ep.closed || l.key.closed {
			l.stop(ErrClosed)
		}
		if l.ep.failed.Load() != 0 {
			l.fail(l.ep.Err())
		}
		if !l.going() {
			ops.halt(l)
		}
		for l.going() && l.next < l.n && ops.inflight() < l.depth {
			end := min(l.next+l.chunk, l.n)
			if err := ops.issue(l, l.next, end); err != nil {
				l.fail(err)
				break
			}
			l.next = end
		}
		var progressed uint32
		before := ops.inflight()
		if before > 0 {
			progressed = w.progressLocked()
		}
		ops.reap(l)
		if ops.inflight() == 0 && (!l.going() || l.next == l.n) {
			if l.firstErr != nil && IsPeerFailure(l.firstErr) {
				l.ep.broken = l.firstErr
			}
			w.mu.Unlock()
			return stoppedErr(l.stopped, l.firstErr)
		}
		if l.stopped != nil {
			if err := ops.stalled(l); err != nil {
				w.mu.Unlock()
				return err
			}
		}
		w.mu.Unlock()
		if err := ctx.Err(); err != nil {
			l.stop(err)
		}
		// Every read on a worker polls it: one poller for all, the others
		// waiting on its rounds, was slower for the same CPU
		// (docs/lab/bench-cross-node-sync.md, "Fetches").
		idle.after(progressed > 0 || ops.inflight() < before)
	}
}

// readLimits are a read's chunk, depth and cancel wait as given (0: the
// default), and its default chunk.
type readLimits struct {
	chunk, depth int
	cancelWait   time.Duration
	defaultChunk uint64
}

// newReadLoop checks a read of n bytes at remoteAddr with key on ep and
// returns its loop; ok is false when the read ends here, with err (nil for
// an empty read).
func newReadLoop(ctx context.Context, ep *Endpoint, key *RemoteKey, remoteAddr, n uint64, lim readLimits) (l *readLoop, ok bool, err error) {
	switch {
	case key.e != ep:
		return nil, false, errors.New("ucx: the remote key was unpacked on another endpoint")
	case !key.key.Contains(remoteAddr, n):
		return nil, false, fmt.Errorf("%w: [%#x, +%d) is not inside [%#x, +%d)", ErrOutOfBounds, remoteAddr, n, key.key.Addr, key.key.Len)
	case n == 0:
		return nil, false, nil
	case ctx.Err() != nil:
		return nil, false, ctx.Err()
	}
	l = &readLoop{ep: ep, key: key, n: n, chunk: uint64(lim.chunk), depth: lim.depth, cancelWait: lim.cancelWait}
	if lim.chunk <= 0 {
		l.chunk = lim.defaultChunk
	}
	if l.depth <= 0 {
		l.depth = DefaultDepth
	}
	if l.cancelWait <= 0 {
		l.cancelWait = DefaultCancelWait
	}
	return l, true, nil
}

// reading counts a Get or Fetch running on the worker (Close waits for
// them) and returns the function that uncounts it.
func (w *Worker) reading() func() {
	w.mu.Lock()
	w.gets++
	w.mu.Unlock()
	return func() {
		w.mu.Lock()
		w.gets--
		w.mu.Unlock()
	}
}

// purgeWait bounds how long a stopped read waits for UCX to complete its
// requests once it made them end (a Get's forced close, a Fetch's canceled
// receives) before it gives them back to UCX; it takes one progress call on
// tcp.
const purgeWait = 5 * time.Second

func stoppedErr(stopped, otherwise error) error {
	if stopped != nil {
		return stopped
	}
	return otherwise
}

// idleWait paces a loop that polls UCX: it spins while there is progress
// and for getSpin after the last, so that short reads complete at UCX's
// own latency, then sleeps between polls (from 10 µs, doubling to
// getMaxSleep), so that a read waiting on a slow link or a slow peer does
// not keep a CPU busy. Over tcp the kernel buffers what arrives meanwhile.
type idleWait struct {
	last  time.Time
	sleep time.Duration
}

const (
	getSpin     = 50 * time.Microsecond
	getMaxSleep = time.Millisecond
)

func (i *idleWait) after(progress bool) {
	now := time.Now()
	if progress || i.last.IsZero() {
		i.last, i.sleep = now, 0
		return
	}
	if now.Sub(i.last) < getSpin {
		return
	}
	i.sleep = min(max(2*i.sleep, 10*time.Microsecond), getMaxSleep)
	time.Sleep(i.sleep)
}

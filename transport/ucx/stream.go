package ucx

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"time"

	raw "github.com/cudaipc/cudaipc/internal/ucx"
)

// Read is one read of GetStream: len(Dst) bytes at the peer's address
// Addr into Dst. Tag is the caller's, handed back with the read.
type Read struct {
	Addr uint64
	Dst  []byte
	Tag  int
}

// StreamOptions tune GetStream. The zero value gives the defaults.
type StreamOptions struct {
	// Depth is how many reads are in flight at once; 0 means
	// DefaultDepth.
	Depth int
	// Timeout bounds each read from its issue: a read still in flight
	// after it stops the stream as the end of its context would, with an
	// error wrapping ErrReadTimeout and context.DeadlineExceeded. 0 means
	// no bound.
	Timeout time.Duration
	// CancelWait is GetOptions.CancelWait, for a stopped stream.
	CancelWait time.Duration
}

// ErrReadTimeout is wrapped by GetStream's error when a read did not
// complete within StreamOptions.Timeout.
var ErrReadTimeout = errors.New("ucx: a read did not complete in time")

// readTimeout is ErrReadTimeout that also matches context.DeadlineExceeded.
type readTimeout struct{ after time.Duration }

func (e readTimeout) Error() string {
	return fmt.Sprintf("%v (%v)", ErrReadTimeout, e.after)
}
func (e readTimeout) Is(target error) bool {
	return target == ErrReadTimeout || target == context.DeadlineExceeded
}

// streamRead is a read of GetStream in flight.
type streamRead struct {
	r      Read
	req    raw.Request
	issued time.Time
	pin    runtime.Pinner
}

// GetStream keeps up to o.Depth reads in flight on ep from the calling
// goroutine alone, which issues them (one ucp_get_nbx each), progresses
// the worker and notices each completion as soon as UCX reports it: the
// pipeline of many concurrent Gets on one endpoint without their
// contention for the worker, and with no read waiting for a slower one
// before it.
//
// next hands GetStream its reads: it is called whenever a read can be
// issued; wait says that none is in flight, and then next may block until
// it has one. next returning false ends the stream when wait is set, and
// means "none now" otherwise (it is asked again after the next
// completion). done is called exactly once for every read next returned,
// from the calling goroutine, with nil when its bytes are in Dst, or with
// its error; either way UCX no longer writes into Dst by then, unless the
// error says otherwise (as GetWith's). next and done are never called with
// the worker's lock held, and must not block on the stream's completions.
//
// The first failed read stops the issuing of new ones; the reads in
// flight are let complete, each done with its own outcome, and GetStream
// returns that first error. ctx's end, a read past o.Timeout, or the
// endpoint or key closed stop the stream as GetWith's cancellation does
// (o.CancelWait, then a forced close of the endpoint), and GetStream
// returns the cause. Every read must lie inside the key's region
// (ErrOutOfBounds, for that read).
func GetStream(ctx context.Context, ep *Endpoint, key *RemoteKey, o StreamOptions, next func(wait bool) (Read, bool), done func(Read, error)) error {
	if key.e != ep {
		return errors.New("ucx: the remote key was unpacked on another endpoint")
	}
	depth, cancelWait := o.Depth, o.CancelWait
	if depth <= 0 {
		depth = DefaultDepth
	}
	if cancelWait <= 0 {
		cancelWait = DefaultCancelWait
	}
	w := ep.w
	w.mu.Lock()
	w.gets++
	w.mu.Unlock()
	defer func() {
		w.mu.Lock()
		w.gets--
		w.mu.Unlock()
	}()
	var (
		inflight []*streamRead
		queued   []Read // from next, to be issued under the lock
		finished []*streamRead
		failed   []Read  // reads that failed, to be done
		failures []error // their errors
		firstErr error
		stopped  error
		giveUp   time.Time
		forced   time.Time
		ended    bool // next said there is no more
		noneNow  bool // next had none; asked again after a completion
		idle     idleWait
		param    raw.RequestParam
	)
	finish := func() {
		if len(finished) > 0 || len(failed) > 0 {
			noneNow = false
		}
		for _, f := range finished {
			f.pin.Unpin()
			done(f.r, nil)
		}
		for i, r := range failed {
			done(r, failures[i])
		}
		finished, failed, failures = finished[:0], failed[:0], failures[:0]
	}
	fail := func(r Read, err error) {
		failed, failures = append(failed, r), append(failures, err)
		if firstErr == nil {
			firstErr = err
		}
	}
	for {
		// Ask for reads while there is room (outside the lock: next may
		// block when nothing is in flight).
		if stopped == nil && firstErr == nil && !ended {
			for len(inflight)+len(queued) < depth {
				wait := len(inflight)+len(queued) == 0
				if noneNow && !wait {
					break
				}
				r, ok := next(wait)
				if !ok {
					ended, noneNow = wait, !wait
					break
				}
				queued = append(queued, r)
			}
		}
		if stopped == nil {
			if err := ctx.Err(); err != nil {
				stopped, giveUp = err, time.Now().Add(cancelWait)
			}
		}

		w.mu.Lock()
		if w.closed {
			// The worker is destroyed, and with it every request: nothing
			// writes into the reads' memory any more.
			w.mu.Unlock()
			err := stoppedErr(stopped, ErrClosed)
			for _, f := range inflight {
				f.pin.Unpin()
				fail(f.r, err)
			}
			for _, r := range queued {
				fail(r, err)
			}
			inflight, queued = nil, nil
			finish()
			return stoppedErr(stopped, ErrClosed)
		}
		if stopped == nil && (ep.closed || key.closed) {
			stopped, giveUp = ErrClosed, time.Now().Add(cancelWait)
		}
		if firstErr == nil && ep.failed.Load() != 0 {
			firstErr = ep.Err()
		}
		for _, r := range queued {
			if firstErr != nil || stopped != nil {
				fail(r, stoppedErr(stopped, firstErr))
				continue
			}
			n := uint64(len(r.Dst))
			if !key.key.Contains(r.Addr, n) {
				fail(r, fmt.Errorf("%w: [%#x, +%d) is not inside [%#x, +%d)", ErrOutOfBounds, r.Addr, n, key.key.Addr, key.key.Len))
				continue
			}
			if n == 0 {
				finished = append(finished, &streamRead{r: r})
				continue
			}
			f := &streamRead{r: r, issued: time.Now()}
			f.pin.Pin(&r.Dst[0])
			req, err := raw.GetNbx(ep.h, r.Dst, r.Addr, key.h, &param)
			if err != nil {
				f.pin.Unpin()
				fail(r, err)
				continue
			}
			if req == 0 {
				finished = append(finished, f)
				continue
			}
			f.req = req
			inflight = append(inflight, f)
		}
		queued = queued[:0]
		var progressed uint32
		if len(inflight) > 0 {
			progressed = raw.WorkerProgress(w.h)
		}
		before := len(inflight)
		kept := inflight[:0]
		for _, f := range inflight {
			s := raw.RequestCheckStatus(f.req)
			if s == raw.InProgress {
				kept = append(kept, f)
				continue
			}
			raw.RequestFree(f.req)
			if s == raw.OK {
				finished = append(finished, f)
				continue
			}
			f.pin.Unpin()
			var err error = &raw.Error{Func: "ucp_get_nbx", Status: s}
			if stopped != nil {
				err = stopped
			}
			if !forced.IsZero() || stopped != nil {
				// Canceled by the stop, not a failure of the read itself.
				failed, failures = append(failed, f.r), append(failures, err)
			} else {
				fail(f.r, err)
			}
		}
		clear(inflight[len(kept):])
		inflight = kept
		if stopped == nil && o.Timeout > 0 {
			for _, f := range inflight {
				if time.Since(f.issued) > o.Timeout {
					stopped, giveUp = readTimeout{o.Timeout}, time.Now().Add(cancelWait)
					break
				}
			}
		}
		if len(inflight) == 0 && (firstErr != nil || stopped != nil || ended) {
			if firstErr != nil && IsPeerFailure(firstErr) {
				ep.broken = firstErr
			}
			w.mu.Unlock()
			finish()
			break
		}
		switch {
		case stopped != nil && forced.IsZero() && time.Now().After(giveUp):
			// As in get: a forced close completes the reads in flight as
			// canceled.
			forced = time.Now()
			if !ep.closed {
				ep.shutLocked()
			}
		case !forced.IsZero() && time.Since(forced) > purgeWait:
			n := len(inflight)
			err := fmt.Errorf("%w; %d reads were still in flight %v after the endpoint was closed and may still write into their memory", stopped, n, purgeWait)
			for _, f := range inflight {
				raw.RequestFree(f.req)
				f.pin.Unpin()
				failed, failures = append(failed, f.r), append(failures, err)
			}
			inflight = nil
			w.mu.Unlock()
			finish()
			return err
		}
		w.mu.Unlock()
		progress := progressed > 0 || len(inflight) < before || len(finished) > 0 || len(failed) > 0
		finish()
		idle.after(progress)
	}
	if stopped != nil {
		if !forced.IsZero() && !errors.Is(stopped, ErrClosed) {
			return fmt.Errorf("%w (the endpoint was closed to end the reads in flight)", stopped)
		}
		return stopped
	}
	return firstErr
}

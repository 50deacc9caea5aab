package store

import (
	"context"
	"errors"
	"log/slog"
	"runtime"
	"sync"
	"time"

	"github.com/cudaipc/cudaipc"
	"github.com/cudaipc/cudaipc/protocol"
	"github.com/cudaipc/cudaipc/protocol/storev1"
)

// A seal that waits on the client's CUDA event (SealRequest.wait_event): the
// client enqueues its copy into the object, records an interprocess event
// after it and sends the seal at once; the daemon seals when the event has
// completed. The seal's round trip then overlaps the copy instead of
// following it. The event is the client's: the daemon only queries it
// (cuEventQuery), never waits in the driver, so a client that dies or never
// completes its work holds up nothing but its own seal, which ends with its
// connection.

const (
	// maxConnEvents bounds the events one connection may have the daemon
	// open (a client needs one per GPU it copies from).
	maxConnEvents = 8
	// sealSpin is how long a waiting seal polls without sleeping: about the
	// copy of a few GiB, so that a seal is sent back as soon as the copy
	// ends; then it polls at growing intervals up to sealPollMax.
	sealSpin    = 4 * time.Millisecond
	sealPollMax = time.Millisecond
)

// connEvents are the events a connection had the daemon open, by
// descriptor, and whether a seal waits on one.
type connEvents struct {
	mu      sync.Mutex
	open    map[string]*cudaipc.RemoteEvent
	waiting bool
}

func waitEventErr(format string, args ...any) error {
	return protocol.Errorf(storev1.Error_INVALID, "wait_event: "+format, args...)
}

// take returns the opened event of descriptor blob (opening it the first
// time) and marks a seal waiting; release ends that.
func (ce *connEvents) take(blob []byte) (*cudaipc.RemoteEvent, error) {
	ce.mu.Lock()
	defer ce.mu.Unlock()
	if ce.waiting {
		return nil, waitEventErr("another seal of this connection waits on an event: one at a time")
	}
	ev := ce.open[string(blob)]
	if ev == nil {
		if len(ce.open) >= maxConnEvents {
			return nil, waitEventErr("this connection already had %d events opened", len(ce.open))
		}
		var d cudaipc.EventDescriptor
		if err := d.UnmarshalBinary(blob); err != nil {
			return nil, waitEventErr("%v", err)
		}
		var err error
		if ev, err = cudaipc.ImportEvent(d); err != nil {
			return nil, waitEventErr("opening the event: %v (seal after synchronizing instead)", err)
		}
		if ce.open == nil {
			ce.open = make(map[string]*cudaipc.RemoteEvent)
		}
		ce.open[string(blob)] = ev
	}
	ce.waiting = true
	return ev, nil
}

func (ce *connEvents) release() {
	ce.mu.Lock()
	ce.waiting = false
	ce.mu.Unlock()
}

// close closes every event opened for the connection.
func (ce *connEvents) close() error {
	ce.mu.Lock()
	defer ce.mu.Unlock()
	var errs []error
	for k, ev := range ce.open {
		errs = append(errs, ev.Close())
		delete(ce.open, k)
	}
	return errors.Join(errs...)
}

// waitEvent polls ev until it has completed or ctx ends.
// It returns how many times it queried the event.
func waitEvent(ctx context.Context, ev *cudaipc.RemoteEvent) (int, error) {
	start := time.Now()
	pause := 10 * time.Microsecond
	for polls := 1; ; polls++ {
		done, err := ev.Done()
		if err != nil {
			return polls, waitEventErr("querying the event: %v", err)
		}
		if done {
			return polls, nil
		}
		if err := ctx.Err(); err != nil {
			return polls, err
		}
		if time.Since(start) < sealSpin {
			runtime.Gosched()
			continue
		}
		time.Sleep(pause)
		pause = min(2*pause, sealPollMax)
	}
}

// sealAfterEvent answers a seal with wait_event: at once when the event
// cannot be used, else once it completed and the object is sealed.
func (cn *conn) sealAfterEvent(id uint64, r *storev1.SealRequest) {
	ev, err := cn.events.take(r.GetWaitEvent())
	if err != nil {
		cn.reply("seal", protocol.ErrorResponse(id, err), nil)
		return
	}
	cn.wg.Go(func() {
		defer cn.events.release()
		t0 := time.Now()
		polls, err := waitEvent(cn.ss.ctx, ev)
		t1 := time.Now()
		if err == nil {
			err = cn.seal(r)
		}
		t2 := time.Now()
		if cn.ss.ctx.Err() != nil {
			return
		}
		if err != nil {
			cn.reply("seal", protocol.ErrorResponse(id, err), nil)
		} else {
			cn.reply("seal", &storev1.Response{Id: id, Body: &storev1.Response_Seal{Seal: &storev1.SealResponse{}}}, nil)
		}
		if cn.log.Enabled(cn.ss.ctx, slog.LevelDebug) {
			cn.log.Debug("seal waited on the client's event", "name", r.GetName(), "id", id, "wait", t1.Sub(t0), "polls", polls,
				"seal", t2.Sub(t1), "err", err, "event_done_ns", t1.UnixNano(), "replied_ns", time.Now().UnixNano())
		}
	})
}

// seal seals as r says (a rename and tensor, or a shard of a version).
func (cn *conn) seal(r *storev1.SealRequest) error {
	sr := sealReqOf(r)
	if err := cn.ss.seal(sr); err != nil {
		return err
	}
	if sr.rename != "" {
		sr.name = sr.rename
	}
	return cn.ss.clusterSealed(cn.ss.ctx, sr.name, sr.version, sr.shard)
}

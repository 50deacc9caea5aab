package cudaipc

import (
	"errors"
	"fmt"
	"runtime"
	"sync"
	"time"

	"github.com/cudaipc/cudaipc/internal/cu"
)

// EventFlags are the flags of NewEvent.
type EventFlags uint32

// Event flags (CU_EVENT_*).
const (
	EventDefault       EventFlags = EventFlags(cu.EventDefault)
	EventBlockingSync  EventFlags = EventFlags(cu.EventBlockingSync)  // Synchronize blocks instead of spinning
	EventDisableTiming EventFlags = EventFlags(cu.EventDisableTiming) // no timestamps: cheaper, required for IPC
	EventInterprocess  EventFlags = EventFlags(cu.EventInterprocess)  // can be exported; needs EventDisableTiming
)

// Event marks a point in a stream. An interprocess event, exported with
// IPCHandle and opened in another process with OpenEventHandle, orders work
// across processes: the producer records it after its writes, the consumer
// makes its stream wait on it before its reads.
type Event struct {
	dev      *Device
	mu       sync.Mutex
	e        cu.Event
	flags    EventFlags
	imported bool
	closed   bool
	exported *EventHandle // set by Export, for same-process ImportEvent
	cleanup  runtime.Cleanup
}

type eventLeak struct {
	dev *Device
	e   cu.Event
}

func destroyLeakedEvent(l eventLeak) {
	releaseLeaked("Event", l.dev, 0, &live.events, func() error { return cu.EventDestroy(l.e) })
}

// NewEvent creates an event with the given flags.
func (d *Device) NewEvent(flags EventFlags) (*Event, error) {
	if flags&^(EventBlockingSync|EventDisableTiming|EventInterprocess) != 0 {
		return nil, &ArgError{Op: "NewEvent", Arg: "flags", Reason: fmt.Sprintf("unknown bits %#x", uint32(flags))}
	}
	if flags&EventInterprocess != 0 && flags&EventDisableTiming == 0 {
		return nil, &ArgError{Op: "NewEvent", Arg: "flags", Reason: "EventInterprocess requires EventDisableTiming"}
	}
	var e cu.Event
	err := d.do(func() error {
		var err error
		e, err = cu.EventCreate(cu.EventFlags(flags))
		return err
	})
	if err != nil {
		return nil, err
	}
	return newEvent(d, e, flags, false), nil
}

// NewIPCEvent creates an event that can be exported to other processes
// (EventInterprocess|EventDisableTiming).
func (d *Device) NewIPCEvent() (*Event, error) {
	return d.NewEvent(EventInterprocess | EventDisableTiming)
}

// OpenEventHandle opens an event exported by another process
// (cuIpcOpenEventHandle, about 0.5 ms). Close it when done.
func (d *Device) OpenEventHandle(h EventHandle) (*Event, error) {
	if h.IsZero() {
		return nil, &ArgError{Op: "OpenEventHandle", Arg: "handle", Reason: "all zero bytes: not an exported handle"}
	}
	var e cu.Event
	err := d.do(func() error {
		var err error
		e, err = cu.IpcOpenEventHandle(cu.IpcEventHandle{Reserved: h})
		return err
	})
	if err != nil {
		return nil, err
	}
	return newEvent(d, e, EventInterprocess|EventDisableTiming, true), nil
}

// newEvent wraps an event the driver made or opened, with the cleanup
// backstop that destroys it should it be dropped without Close.
func newEvent(d *Device, e cu.Event, flags EventFlags, imported bool) *Event {
	live.events.Add(1)
	ev := &Event{dev: d, e: e, flags: flags, imported: imported}
	ev.cleanup = runtime.AddCleanup(ev, destroyLeakedEvent, eventLeak{d, e})
	return ev
}

func (e *Event) handle(op string) (cu.Event, error) {
	if e == nil {
		return 0, &ArgError{Op: op, Arg: "event", Reason: "nil"}
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.closed {
		return 0, closedErr("Event", op)
	}
	return e.e, nil
}

// Device returns the event's device.
func (e *Event) Device() *Device { return e.dev }

// Imported reports whether the event was opened from another process.
func (e *Event) Imported() bool { return e.imported }

// IPCHandle exports the event (cuIpcGetEventHandle). The event must have
// been created with EventInterprocess.
func (e *Event) IPCHandle() (EventHandle, error) {
	h, err := e.handle("IPCHandle")
	if err != nil {
		return EventHandle{}, err
	}
	if e.flags&EventInterprocess == 0 {
		return EventHandle{}, &ArgError{Op: "IPCHandle", Arg: "event", Reason: "created without EventInterprocess; use NewIPCEvent"}
	}
	var out cu.IpcEventHandle
	err = e.dev.do(func() error {
		var err error
		out, err = cu.IpcGetEventHandle(h)
		return err
	})
	return EventHandle(out.Reserved), err
}

// Record captures the work queued on s so far (nil: the default stream).
func (e *Event) Record(s *Stream) error {
	h, err := e.handle("Record")
	if err != nil {
		return err
	}
	sh, err := s.handle("Record")
	if err != nil {
		return err
	}
	return e.dev.do(func() error { return cu.EventRecord(h, sh) })
}

// Synchronize waits until the work captured by the last Record completes.
func (e *Event) Synchronize() error {
	h, err := e.handle("Synchronize")
	if err != nil {
		return err
	}
	return e.dev.do(func() error { return cu.EventSynchronize(h) })
}

// Done reports whether the work captured by the last Record has completed.
func (e *Event) Done() (bool, error) {
	h, err := e.handle("Done")
	if err != nil {
		return false, err
	}
	err = e.dev.do(func() error { return cu.EventQuery(h) })
	if err == nil {
		return true, nil
	}
	if isNotReady(err) {
		return false, nil
	}
	return false, err
}

// Elapsed returns the GPU time between start's last Record and e's
// (cuEventElapsedTime, resolution about 0.5 µs): the way to time device
// work without the host's launch and wake-up latency. Both events must be
// of one device, created without EventDisableTiming, and completed
// (ErrNotReady otherwise: Synchronize on e first).
func (e *Event) Elapsed(start *Event) (time.Duration, error) {
	end, err := e.handle("Elapsed")
	if err != nil {
		return 0, err
	}
	begin, err := start.handle("Elapsed")
	if err != nil {
		return 0, err
	}
	if e.flags&EventDisableTiming != 0 || start.flags&EventDisableTiming != 0 {
		return 0, &ArgError{Op: "Elapsed", Arg: "event", Reason: "created with EventDisableTiming (IPC events never time)"}
	}
	if start.dev != e.dev {
		return 0, &ArgError{Op: "Elapsed", Arg: "start", Reason: fmt.Sprintf("on %s, not on %s", start.dev, e.dev)}
	}
	var ms float32
	err = e.dev.do(func() error {
		var err error
		ms, err = cu.EventElapsedTime(begin, end)
		return err
	})
	if err != nil {
		return 0, err
	}
	return time.Duration(float64(ms) * float64(time.Millisecond)), nil
}

// Close destroys the event; closing twice is not an error.
func (e *Event) Close() error {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.closed {
		return nil
	}
	if err := e.dev.do(func() error { return cu.EventDestroy(e.e) }); err != nil {
		return err
	}
	e.unregisterExported()
	e.closed = true
	e.cleanup.Stop()
	live.events.Add(-1)
	return nil
}

func isNotReady(err error) bool { return errors.Is(err, ErrNotReady) }

package cudaipc

import (
	"bytes"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"hash/crc32"
	"log/slog"
	"math"
	"runtime"
	"sync"

	"github.com/cudaipc/cudaipc/internal/cu"
)

// EventDescriptorBinarySize is the length of an EventDescriptor's binary
// encoding, version 1.
const EventDescriptorBinarySize = 124

// eventMagic opens every binary EventDescriptor: "CIPE".
var eventMagic = [4]byte{'C', 'I', 'P', 'E'}

// EventDescriptor describes an interprocess event exported by one process
// so that another can wait on it: the event counterpart of Region, with the
// same identity fields and the same rules (docs/region.md). It is a bearer
// capability too.
type EventDescriptor struct {
	Version      uint16      // format version, RegionVersion
	Handle       EventHandle // cuIpcGetEventHandle
	Device       UUID        // the GPU the event belongs to
	ExporterPID  int         // pid of the exporting process, in its PID namespace
	PIDNamespace uint64      // inode of the exporter's /proc/self/ns/pid
	BootID       BootID      // the exporter's /proc/sys/kernel/random/boot_id
}

func eventErr(field, format string, args ...any) error {
	return &RegionError{What: "event descriptor", Field: field, Reason: fmt.Sprintf(format, args...)}
}

// Validate checks every field; it returns a *RegionError naming the first
// bad one.
func (d EventDescriptor) Validate() error {
	switch {
	case d.Version != RegionVersion:
		return eventErr("version", "%d: this package reads version %d", d.Version, RegionVersion)
	case d.Handle.IsZero():
		return eventErr("handle", "all zero bytes: not an exported handle")
	case d.Device.IsZero():
		return eventErr("device", "zero GPU UUID")
	case d.ExporterPID <= 0 || d.ExporterPID > math.MaxInt32:
		return eventErr("exporter_pid", "%d: not a process id", d.ExporterPID)
	case d.PIDNamespace == 0:
		return eventErr("pid_namespace", "zero: want the inode of the exporter's /proc/self/ns/pid")
	case d.BootID.IsZero():
		return eventErr("boot_id", "zero: want the exporter's /proc/sys/kernel/random/boot_id")
	}
	return nil
}

// String describes d for logs without the handle's bytes.
func (d EventDescriptor) String() string {
	return fmt.Sprintf("EventDescriptor(%s, pid %d, %s)", d.Device, d.ExporterPID, d.Handle)
}

// AppendBinary appends the binary encoding (docs/region.md) to b.
func (d EventDescriptor) AppendBinary(b []byte) ([]byte, error) {
	if err := d.Validate(); err != nil {
		return b, err
	}
	start := len(b)
	b = append(b, eventMagic[:]...)
	b = binary.LittleEndian.AppendUint16(b, d.Version)
	b = binary.LittleEndian.AppendUint16(b, 0) // flags, reserved
	b = append(b, d.Handle[:]...)
	b = append(b, d.Device[:]...)
	b = binary.LittleEndian.AppendUint32(b, uint32(d.ExporterPID))
	b = binary.LittleEndian.AppendUint32(b, 0) // reserved
	b = binary.LittleEndian.AppendUint64(b, d.PIDNamespace)
	b = append(b, d.BootID[:]...)
	b = binary.LittleEndian.AppendUint32(b, crc32.ChecksumIEEE(b[start:]))
	return b, nil
}

// MarshalBinary returns the EventDescriptorBinarySize-byte encoding.
func (d EventDescriptor) MarshalBinary() ([]byte, error) {
	return d.AppendBinary(make([]byte, 0, EventDescriptorBinarySize))
}

// UnmarshalBinary decodes and validates the binary encoding.
func (d *EventDescriptor) UnmarshalBinary(b []byte) error {
	if len(b) < 8 {
		return eventErr("length", "%d bytes: too short for a binary event descriptor (%d)", len(b), EventDescriptorBinarySize)
	}
	if !bytes.Equal(b[0:4], eventMagic[:]) {
		return eventErr("magic", "%q: want %q", b[0:4], eventMagic[:])
	}
	le := binary.LittleEndian
	if v := le.Uint16(b[4:]); v != RegionVersion {
		return eventErr("version", "%d: this package reads version %d", v, RegionVersion)
	}
	if len(b) != EventDescriptorBinarySize {
		return eventErr("length", "%d bytes: want %d", len(b), EventDescriptorBinarySize)
	}
	if got, want := le.Uint32(b[120:]), crc32.ChecksumIEEE(b[:120]); got != want {
		return eventErr("crc32", "%#08x: bytes 0-119 sum to %#08x", got, want)
	}
	if f, r := le.Uint16(b[6:]), le.Uint32(b[92:]); f != 0 || r != 0 {
		return eventErr("flags", "%#x/%#x: reserved fields must be zero", f, r)
	}
	var v EventDescriptor
	v.Version = le.Uint16(b[4:])
	copy(v.Handle[:], b[8:72])
	copy(v.Device[:], b[72:88])
	v.ExporterPID = int(le.Uint32(b[88:]))
	v.PIDNamespace = le.Uint64(b[96:])
	copy(v.BootID[:], b[104:120])
	if err := v.Validate(); err != nil {
		return err
	}
	*d = v
	return nil
}

type eventJSON struct {
	Version      uint16      `json:"version"`
	Handle       EventHandle `json:"handle"`
	Device       UUID        `json:"device"`
	ExporterPID  int         `json:"exporter_pid"`
	PIDNamespace uint64      `json:"pid_namespace"`
	BootID       BootID      `json:"boot_id"`
}

// MarshalJSON encodes d as one JSON object (docs/region.md).
func (d EventDescriptor) MarshalJSON() ([]byte, error) {
	if err := d.Validate(); err != nil {
		return nil, err
	}
	return json.Marshal(eventJSON(d))
}

// UnmarshalJSON decodes and validates the JSON encoding; unknown fields
// are rejected.
func (d *EventDescriptor) UnmarshalJSON(b []byte) error {
	var j eventJSON
	if err := strictJSON(b, &j); err != nil {
		return eventErr("json", "%v", err)
	}
	v := EventDescriptor(j)
	if err := v.Validate(); err != nil {
		return err
	}
	*d = v
	return nil
}

// exportedEvents finds this process's exported events by handle, for an
// ImportEvent in the exporting process itself.
var exportedEvents struct {
	mu sync.Mutex
	m  map[EventHandle]*Event
}

// Export describes the event for other processes. The event must have been
// created with EventInterprocess (NewIPCEvent). Keep it open while
// importers use it.
func (e *Event) Export() (EventDescriptor, error) {
	h, err := e.IPCHandle()
	if err != nil {
		return EventDescriptor{}, err
	}
	id, err := SelfIdentity()
	if err != nil {
		return EventDescriptor{}, err
	}
	e.mu.Lock()
	if !e.closed && !e.imported {
		exportedEvents.mu.Lock()
		if exportedEvents.m == nil {
			exportedEvents.m = map[EventHandle]*Event{}
		}
		exportedEvents.m[h] = e
		exportedEvents.mu.Unlock()
		e.exported = &h
	}
	e.mu.Unlock()
	d := EventDescriptor{Version: RegionVersion, Handle: h, Device: e.dev.uuid,
		ExporterPID: id.PID, PIDNamespace: id.PIDNamespace, BootID: id.BootID}
	return d, d.Validate()
}

// unregisterExported forgets e as an exported event; e.mu is held.
func (e *Event) unregisterExported() {
	if e.exported == nil {
		return
	}
	exportedEvents.mu.Lock()
	if exportedEvents.m[*e.exported] == e {
		delete(exportedEvents.m, *e.exported)
	}
	exportedEvents.mu.Unlock()
	e.exported = nil
}

// Signal is the producer's half of cross-process ordering: queue it on s
// after the writes that consumers must see. It is Record, restricted to
// interprocess events so that a forgotten flag fails here and not as a
// consumer that never waits.
func (e *Event) Signal(s *Stream) error {
	if e != nil && e.flags&EventInterprocess == 0 {
		return &ArgError{Op: "Signal", Arg: "event", Reason: "created without EventInterprocess; use NewIPCEvent"}
	}
	return e.Record(s)
}

// RemoteEvent is an event exported by another process (or by this one),
// imported through the process-wide cache: imports of one event share one
// cuIpcOpenEventHandle (about 455 µs), and the last Close destroys it.
type RemoteEvent struct {
	desc    EventDescriptor
	ev      *Event
	ref     *eventRef
	cleanup runtime.Cleanup
}

type eventRef struct {
	mu     sync.Mutex
	closed bool
	cache  *importCache
	entry  *eventEntry // nil when the event is this process's own
	desc   EventDescriptor
}

func (r *eventRef) release() error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.closed {
		return nil
	}
	r.closed = true
	if r.entry != nil {
		return r.cache.releaseEvent(r.entry)
	}
	return nil
}

func releaseLeakedEvent(r *eventRef) {
	slog.Warn("cudaipc: RemoteEvent garbage-collected without Close; closing it", "event", r.desc.String())
	if err := r.release(); err != nil {
		slog.Warn("cudaipc: closing leaked RemoteEvent failed", "err", err)
	}
}

func (r *RemoteEvent) event(op string) (*Event, error) {
	r.ref.mu.Lock()
	defer r.ref.mu.Unlock()
	if r.ref.closed {
		return nil, closedErr("RemoteEvent", op)
	}
	return r.ev, nil
}

// Wait is the consumer's half: work queued on s after Wait runs only once
// the work the producer queued before its last Signal has completed.
// s may belong to any device of this process.
func (r *RemoteEvent) Wait(s *Stream) error {
	ev, err := r.event("Wait")
	if err != nil {
		return err
	}
	if s == nil {
		h, err := ev.handle("Wait")
		if err != nil {
			return err
		}
		return ev.dev.do(func() error { return cu.StreamWaitEvent(0, h) })
	}
	return s.WaitEvent(ev)
}

// Synchronize blocks the calling goroutine until the work captured by the
// producer's last Signal has completed.
func (r *RemoteEvent) Synchronize() error {
	ev, err := r.event("Synchronize")
	if err != nil {
		return err
	}
	return ev.Synchronize()
}

// Done reports whether the work captured by the producer's last Signal has
// completed.
func (r *RemoteEvent) Done() (bool, error) {
	ev, err := r.event("Done")
	if err != nil {
		return false, err
	}
	return ev.Done()
}

// Descriptor returns the descriptor the event was imported from.
func (r *RemoteEvent) Descriptor() EventDescriptor { return r.desc }

// Device returns the device the event was opened on.
func (r *RemoteEvent) Device() *Device { return r.ev.dev }

// Close releases the event; the last Close of an event's imports destroys
// it. Closing twice is not an error.
func (r *RemoteEvent) Close() error {
	r.cleanup.Stop()
	return r.ref.release()
}

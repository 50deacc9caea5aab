package cudaipc

import (
	"encoding/binary"
	"fmt"
	"os"
	"sync"

	"github.com/cudaipc/cudaipc/internal/cu"
)

// Timeline orders GPU work across processes without IPC events: a 64-bit
// counter in device memory shared by file descriptor. A producer's stream
// raises it after its work (Signal, cuStreamWriteValue64), a consumer's
// stream waits until it reaches a value (Wait, cuStreamWaitValue64) before
// its later work. Unlike an IPC event it needs no shared /dev/shm and no
// shared PID namespace: the descriptor crosses containers over a Unix
// socket like any VMM export. docs/containers.md says when to use which.
//
// Values only grow: Signal(v) after Signal(w) needs v > w, and Wait(v)
// returns once the counter is at least v (the driver compares cyclically,
// so 2^63 signals would wrap; a process will not live that long). The
// counter starts at 0.
//
// The memory is one VMM granule (2 MiB on current GPUs) holding 8 used
// bytes: make one Timeline per producer, not per object.
type Timeline struct {
	dev     *Device
	ptr     DevicePtr
	owner   *ShareableBuffer // the creator's allocation, or nil
	mapping *Mapping         // an importer's mapping (ImportFD), or nil

	mu     sync.Mutex
	closed bool
}

// StreamMemOpsSupported reports whether the device can run the 64-bit
// stream memory operations Timeline uses
// (CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS).
func (d *Device) StreamMemOpsSupported() bool {
	v, err := cu.DeviceGetAttribute(cu.AttrCanUse64BitStreamMemOps, d.dev)
	return err == nil && v != 0
}

func timelineSupport(op string, d *Device) error {
	if !d.VMMFDSupported() {
		return notSupported(op, d)
	}
	if !d.StreamMemOpsSupported() {
		return fmt.Errorf("cudaipc: %s: %s cannot use 64-bit stream memory operations (CAN_USE_64_BIT_STREAM_MEM_OPS is 0): order with IPC events instead: %w", op, d, ErrNotSupported)
	}
	return nil
}

// NewTimeline allocates a timeline on d, at 0. Share it with ExportFD.
func (d *Device) NewTimeline() (*Timeline, error) {
	if err := timelineSupport("NewTimeline", d); err != nil {
		return nil, err
	}
	b, err := d.AllocShareable(8)
	if err != nil {
		return nil, err
	}
	if _, err := b.WriteAt(make([]byte, 8), 0); err != nil {
		return nil, joinFree(err, b)
	}
	return &Timeline{dev: d, ptr: b.Ptr(), owner: b}, nil
}

func joinFree(err error, b *ShareableBuffer) error {
	if ferr := b.Free(); ferr != nil {
		return fmt.Errorf("%w (and freeing: %v)", err, ferr)
	}
	return err
}

// ImportTimeline maps a timeline exported by Timeline.ExportFD, in this or
// another process. It does not take f: close it after the call.
func (d *Device) ImportTimeline(f *os.File) (*Timeline, error) {
	if err := timelineSupport("ImportTimeline", d); err != nil {
		return nil, err
	}
	m, err := d.ImportFD(f, 8)
	if err != nil {
		return nil, err
	}
	return &Timeline{dev: d, ptr: m.Ptr(), mapping: m}, nil
}

// TimelineAt returns a Timeline over the 8 bytes at p, memory this process
// already maps and keeps mapped longer than the Timeline: for instance the
// lease of a timeline its creator registered with the store
// (ExportPointer of Timeline.Ptr), mapped read-only, which Wait needs no
// more than. Close on it unmaps nothing; ExportFD fails.
func (d *Device) TimelineAt(p DevicePtr) (*Timeline, error) {
	if p == 0 || p%8 != 0 {
		return nil, &ArgError{Op: "TimelineAt", Arg: "pointer", Reason: fmt.Sprintf("%#x: want a non-nil, 8-byte aligned address", uint64(p))}
	}
	if err := timelineSupport("TimelineAt", d); err != nil {
		return nil, err
	}
	return &Timeline{dev: d, ptr: p}, nil
}

// Device returns the device that holds the counter.
func (t *Timeline) Device() *Device { return t.dev }

// Ptr returns the counter's device address in this process, for kernels
// that signal or poll it themselves.
func (t *Timeline) Ptr() DevicePtr { return t.ptr }

// ExportFD exports the timeline as a new close-on-exec descriptor for
// ImportTimeline; only its creator can.
func (t *Timeline) ExportFD() (*os.File, error) {
	if err := t.check("ExportFD"); err != nil {
		return nil, err
	}
	if t.owner == nil {
		return nil, &ArgError{Op: "Timeline.ExportFD", Arg: "timeline", Reason: "not the creator's timeline (imported, or TimelineAt); export the creator's"}
	}
	return t.owner.ExportFD()
}

func (t *Timeline) check(op string) error {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.closed {
		return closedErr("Timeline", op)
	}
	return nil
}

func (t *Timeline) streamOf(op string, s *Stream) (cu.Stream, error) {
	if err := t.check(op); err != nil {
		return 0, err
	}
	if s != nil && s.dev != t.dev {
		return 0, &ArgError{Op: op, Arg: "stream", Reason: fmt.Sprintf("a stream of %s, the timeline is on %s", s.dev, t.dev)}
	}
	return s.handle(op)
}

// Signal queues on s (nil: the legacy default stream) a write of v to the
// counter, after everything queued on s before it; the write's memory
// barrier makes s's earlier writes visible before the value is.
func (t *Timeline) Signal(s *Stream, v uint64) error {
	h, err := t.streamOf("Timeline.Signal", s)
	if err != nil {
		return err
	}
	return t.dev.do(func() error { return cu.StreamWriteValue64(h, cu.DevicePtr(t.ptr), v, cu.StreamWriteValueDflt) })
}

// Wait makes s (nil: the legacy default stream) hold the work queued after
// this call until the counter is at least v. It returns at once; the host
// does not block (Stream.Synchronize does).
func (t *Timeline) Wait(s *Stream, v uint64) error {
	h, err := t.streamOf("Timeline.Wait", s)
	if err != nil {
		return err
	}
	return t.dev.do(func() error { return cu.StreamWaitValue64(h, cu.DevicePtr(t.ptr), v, cu.StreamWaitValueGEQ) })
}

// Value reads the counter now (a synchronous copy on the legacy default
// stream, which is why it is for tests and diagnostics, not for waiting).
func (t *Timeline) Value() (uint64, error) {
	if err := t.check("Value"); err != nil {
		return 0, err
	}
	var b [8]byte
	if err := t.dev.CopyFromDevice(b[:], t.ptr); err != nil {
		return 0, err
	}
	return binary.LittleEndian.Uint64(b[:]), nil
}

// Close unmaps the counter in this process (the memory lives on while any
// other process maps it). Work still queued that waits on or signals it
// must have finished: synchronize those streams first. Closing twice is
// not an error.
func (t *Timeline) Close() error {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.closed {
		return nil
	}
	t.closed = true
	switch {
	case t.owner != nil:
		return t.owner.Free()
	case t.mapping != nil:
		return t.mapping.Close()
	}
	return nil
}

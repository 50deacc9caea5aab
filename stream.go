package cudaipc

import (
	"runtime"
	"sync"

	"github.com/cudaipc/cudaipc/internal/cu"
)

// Stream is a CUDA stream: work queued on it runs in order, asynchronously
// to the host. A nil *Stream means the device's legacy default stream.
// A Stream that becomes unreachable without Close is destroyed by a
// cleanup and the leak is logged.
type Stream struct {
	dev     *Device
	mu      sync.Mutex
	s       cu.Stream
	closed  bool
	cleanup runtime.Cleanup
}

type streamLeak struct {
	dev *Device
	s   cu.Stream
}

func destroyLeakedStream(l streamLeak) {
	releaseLeaked("Stream", l.dev, 0, &live.streams, func() error { return cu.StreamDestroy(l.s) })
}

// NewStream creates a stream that does not synchronize with the legacy
// default stream (CU_STREAM_NON_BLOCKING).
func (d *Device) NewStream() (*Stream, error) {
	var s cu.Stream
	err := d.do(func() error {
		var e error
		s, e = cu.StreamCreate(cu.StreamNonBlocking)
		return e
	})
	if err != nil {
		return nil, err
	}
	live.streams.Add(1)
	st := &Stream{dev: d, s: s}
	st.cleanup = runtime.AddCleanup(st, destroyLeakedStream, streamLeak{d, s})
	return st, nil
}

func (s *Stream) handle(op string) (cu.Stream, error) {
	if s == nil {
		return 0, nil
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return 0, closedErr("Stream", op)
	}
	return s.s, nil
}

// Device returns the stream's device.
func (s *Stream) Device() *Device { return s.dev }

// Close destroys the stream after its queued work completes; closing twice
// is not an error.
func (s *Stream) Close() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return nil
	}
	if err := s.dev.do(func() error { return cu.StreamDestroy(s.s) }); err != nil {
		return err
	}
	s.closed = true
	s.cleanup.Stop()
	live.streams.Add(-1)
	return nil
}

func (s *Stream) run(op string, f func(cu.Stream) error) error {
	h, err := s.handle(op)
	if err != nil {
		return err
	}
	return s.dev.do(func() error { return f(h) })
}

// Synchronize waits until all work queued on the stream has completed.
func (s *Stream) Synchronize() error {
	return s.run("Synchronize", cu.StreamSynchronize)
}

// Done reports whether all work queued on the stream has completed.
func (s *Stream) Done() (bool, error) {
	err := s.run("Done", cu.StreamQuery)
	if err == nil {
		return true, nil
	}
	if isNotReady(err) {
		return false, nil
	}
	return false, err
}

// CopyAsync queues a copy of n bytes between device addresses.
func (s *Stream) CopyAsync(dst, src DevicePtr, n int64) error {
	if n < 0 {
		return &ArgError{Op: "CopyAsync", Arg: "n", Reason: "negative"}
	}
	return s.run("CopyAsync", func(h cu.Stream) error {
		return cu.MemcpyAsync(cu.DevicePtr(dst), cu.DevicePtr(src), uint64(n), h)
	})
}

// CopyToDeviceAsync queues a copy of src to dst. If src is pageable Go
// memory the driver stages it before returning; if it is a HostBuffer's
// memory the copy reads it later, so keep the HostBuffer until the stream
// is synchronized.
func (s *Stream) CopyToDeviceAsync(dst DevicePtr, src []byte) error {
	return s.run("CopyToDeviceAsync", func(h cu.Stream) error { return cu.MemcpyHtoDAsync(cu.DevicePtr(dst), src, h) })
}

// CopyFromDeviceAsync queues a copy from src into dst. It is asynchronous
// only when dst is a HostBuffer's memory; read dst after synchronizing.
func (s *Stream) CopyFromDeviceAsync(dst []byte, src DevicePtr) error {
	return s.run("CopyFromDeviceAsync", func(h cu.Stream) error { return cu.MemcpyDtoHAsync(dst, cu.DevicePtr(src), h) })
}

// MemsetAsync queues setting n bytes at p to v.
func (s *Stream) MemsetAsync(p DevicePtr, v byte, n int64) error {
	if n < 0 {
		return &ArgError{Op: "MemsetAsync", Arg: "n", Reason: "negative"}
	}
	return s.run("MemsetAsync", func(h cu.Stream) error { return cu.MemsetD8Async(cu.DevicePtr(p), v, uint64(n), h) })
}

// WaitEvent makes work queued on the stream after this call wait until e
// completes. e may be an event opened from another process.
func (s *Stream) WaitEvent(e *Event) error {
	ev, err := e.handle("WaitEvent")
	if err != nil {
		return err
	}
	return s.run("WaitEvent", func(h cu.Stream) error { return cu.StreamWaitEvent(h, ev) })
}

package cudaipc_test

import (
	"bytes"
	"errors"
	"io"
	"testing"
	"time"

	"github.com/cudaipc/cudaipc"
	"github.com/cudaipc/cudaipc/internal/testutil"
)

func TestDeviceProperties(t *testing.T) {
	dev := testutil.RequireGPU(t)
	if dev.Name() == "" || dev.UUID().IsZero() || dev.PCIBusID() == "" || dev.TotalMemory() == 0 {
		t.Fatalf("incomplete device: %q %s %q %d", dev.Name(), dev.UUID(), dev.PCIBusID(), dev.TotalMemory())
	}
	if major, _ := dev.ComputeCapability(); major < 3 {
		t.Fatalf("compute capability %d", major)
	}
	if !dev.UnifiedAddressing() || !dev.LegacyIPCSupported() {
		t.Fatal("a discrete GPU on 64-bit Linux must support UVA and legacy IPC")
	}
	byUUID, err := cudaipc.DeviceByUUID(dev.UUID())
	if err != nil || byUUID != dev {
		t.Fatalf("DeviceByUUID: %v", err)
	}
	if _, err := cudaipc.DeviceByUUID(cudaipc.UUID{1}); !errors.Is(err, cudaipc.ErrDeviceNotVisible) {
		t.Fatalf("unknown UUID: %v", err)
	}
	n, _ := cudaipc.DeviceCount()
	if _, err := cudaipc.DeviceByOrdinal(n); !errors.Is(err, cudaipc.ErrInvalidValue) {
		t.Fatalf("ordinal out of range: %v", err)
	}
	v, err := cudaipc.DriverVersion()
	if err != nil || v < 12000 {
		t.Fatalf("driver version %d, %v", v, err)
	}
	free, total, err := dev.MemInfo()
	if err != nil || free == 0 || total < free {
		t.Fatalf("MemInfo %d/%d %v", free, total, err)
	}
}

func TestBufferReadWriteCopy(t *testing.T) {
	dev := testutil.RequireGPU(t)
	const size = 3<<20 + 5
	data := testutil.RandomBytes(uint64(time.Now().UnixNano()), size)
	a, err := dev.Alloc(size)
	if err != nil {
		t.Fatal(err)
	}
	defer a.Free()
	b, err := dev.Alloc(size)
	if err != nil {
		t.Fatal(err)
	}
	defer b.Free()
	if _, err := a.WriteAt(data, 0); err != nil {
		t.Fatal(err)
	}
	if err := dev.Copy(b.Ptr(), a.Ptr(), size); err != nil {
		t.Fatal(err)
	}
	got := make([]byte, size)
	if _, err := b.ReadAt(got, 0); err != nil || !bytes.Equal(got, data) {
		t.Fatalf("device copy: %v", err)
	}
	// Partial reads and writes at offsets, and the edges.
	if _, err := a.WriteAt([]byte{1, 2, 3}, size-3); err != nil {
		t.Fatal(err)
	}
	tail := make([]byte, 10)
	n, err := a.ReadAt(tail, size-10)
	if err != nil || n != 10 || !bytes.Equal(tail[7:], []byte{1, 2, 3}) || !bytes.Equal(tail[:7], data[size-10:size-3]) {
		t.Fatalf("tail read %d %v %v", n, err, tail)
	}
	n, err = a.ReadAt(make([]byte, 20), size-10)
	if n != 10 || err != io.EOF {
		t.Fatalf("short read: %d %v", n, err)
	}
	if _, err := a.WriteAt([]byte{1, 2}, size-1); !errors.Is(err, cudaipc.ErrInvalidValue) {
		t.Fatalf("write past the end: %v", err)
	}
	if _, err := a.ReadAt(make([]byte, 1), -1); !errors.Is(err, cudaipc.ErrInvalidValue) {
		t.Fatalf("negative offset: %v", err)
	}
	if err := a.Memset(0x5a); err != nil {
		t.Fatal(err)
	}
	if _, err := a.ReadAt(got, 0); err != nil || !bytes.Equal(got, bytes.Repeat([]byte{0x5a}, size)) {
		t.Fatalf("memset: %v", err)
	}
	pi, err := dev.PointerInfo(a.Ptr() + 1000)
	if err != nil {
		t.Fatal(err)
	}
	if pi.Base != a.Ptr() || pi.Size < size || pi.BufferID == 0 || pi.Device != dev.Ordinal() || pi.Managed {
		t.Fatalf("pointer info %+v", pi)
	}
}

func TestFreedBufferIsClosed(t *testing.T) {
	dev := testutil.RequireGPU(t)
	before := cudaipc.LiveObjects()
	b, err := dev.Alloc(4096)
	if err != nil {
		t.Fatal(err)
	}
	if cudaipc.LiveObjects().Buffers != before.Buffers+1 {
		t.Fatal("live count did not grow")
	}
	if err := b.Free(); err != nil {
		t.Fatal(err)
	}
	if err := b.Free(); err != nil {
		t.Fatalf("second Free: %v", err)
	}
	if _, err := b.ReadAt(make([]byte, 1), 0); !errors.Is(err, cudaipc.ErrClosed) {
		t.Fatalf("read after free: %v", err)
	}
	if _, err := b.MemHandle(); !errors.Is(err, cudaipc.ErrClosed) {
		t.Fatalf("export after free: %v", err)
	}
	if cudaipc.LiveObjects() != before {
		t.Fatal("live count did not return")
	}
}

func TestStreamsAndEventsInProcess(t *testing.T) {
	dev := testutil.RequireGPU(t)
	s, err := dev.NewStream()
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	ev, err := dev.NewEvent(cudaipc.EventDisableTiming)
	if err != nil {
		t.Fatal(err)
	}
	defer ev.Close()
	if _, err := ev.IPCHandle(); !errors.Is(err, cudaipc.ErrInvalidValue) {
		t.Fatalf("export of a non-IPC event: %v", err)
	}
	const size = 1 << 20
	buf, _ := dev.Alloc(size)
	defer buf.Free()
	host, err := dev.AllocHost(size)
	if err != nil {
		t.Fatal(err)
	}
	defer host.Free()
	data := testutil.RandomBytes(uint64(time.Now().UnixNano()), size)
	copy(host.Bytes(), data)
	if err := s.CopyToDeviceAsync(buf.Ptr(), host.Bytes()); err != nil {
		t.Fatal(err)
	}
	if err := ev.Record(s); err != nil {
		t.Fatal(err)
	}
	if err := ev.Synchronize(); err != nil {
		t.Fatal(err)
	}
	if done, err := ev.Done(); err != nil || !done {
		t.Fatalf("event not done after Synchronize: %v", err)
	}
	clear(host.Bytes())
	if err := s.CopyFromDeviceAsync(host.Bytes(), buf.Ptr()); err != nil {
		t.Fatal(err)
	}
	if err := s.Synchronize(); err != nil {
		t.Fatal(err)
	}
	if done, err := s.Done(); err != nil || !done {
		t.Fatalf("stream not done: %v", err)
	}
	if !bytes.Equal(host.Bytes(), data) {
		t.Fatal("async round trip differs")
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	if err := s.Synchronize(); !errors.Is(err, cudaipc.ErrClosed) {
		t.Fatalf("use after close: %v", err)
	}
}

// TestEventElapsed times a 256 MiB device copy with events: the result must
// be positive and below what the copy would take at 100 GB/s (an H200
// copies at about 2 TB/s), and events without timing must be refused.
func TestEventElapsed(t *testing.T) {
	dev := testutil.RequireGPU(t)
	const size = 256 << 20
	src, err := dev.Alloc(size)
	if err != nil {
		t.Fatal(err)
	}
	defer src.Free()
	dst, err := dev.Alloc(size)
	if err != nil {
		t.Fatal(err)
	}
	defer dst.Free()
	if _, err := src.WriteAt(testutil.RandomBytes(uint64(time.Now().UnixNano()), size), 0); err != nil {
		t.Fatal(err)
	}
	s, err := dev.NewStream()
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	start, err := dev.NewEvent(cudaipc.EventDefault)
	if err != nil {
		t.Fatal(err)
	}
	defer start.Close()
	end, err := dev.NewEvent(cudaipc.EventDefault)
	if err != nil {
		t.Fatal(err)
	}
	defer end.Close()
	for range 2 { // the first copy warms up
		if err := start.Record(s); err != nil {
			t.Fatal(err)
		}
		if err := s.CopyAsync(dst.Ptr(), src.Ptr(), size); err != nil {
			t.Fatal(err)
		}
		if err := end.Record(s); err != nil {
			t.Fatal(err)
		}
		if err := end.Synchronize(); err != nil {
			t.Fatal(err)
		}
	}
	d, err := end.Elapsed(start)
	if err != nil {
		t.Fatal(err)
	}
	if d <= 0 || d > size*time.Second/100e9 {
		t.Fatalf("256 MiB copy took %v by events", d)
	}
	t.Logf("256 MiB device copy: %v, %.0f GB/s", d, size/d.Seconds()/1e9)
	noTiming, err := dev.NewEvent(cudaipc.EventDisableTiming)
	if err != nil {
		t.Fatal(err)
	}
	defer noTiming.Close()
	var ae *cudaipc.ArgError
	if _, err := noTiming.Elapsed(start); !errors.As(err, &ae) {
		t.Fatalf("Elapsed on an event without timing: %v", err)
	}
}

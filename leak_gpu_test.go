package cudaipc_test

import (
	"fmt"
	"runtime"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/cudaipc/cudaipc"
	"github.com/cudaipc/cudaipc/internal/testutil"
)

// TestDroppedObjectsAreReleased: every owned type has a cleanup backstop.
// Objects dropped without Close or Free are released once collected, and
// the live counts return to where they were.
func TestDroppedObjectsAreReleased(t *testing.T) {
	dev := testutil.RequireGPU(t)
	mapped, err := unix.Mmap(-1, 0, 1<<20, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Munmap(mapped) // after the registration's cleanup ran (Eventually below)
	before := cudaipc.LiveObjects()
	func() {
		s, err := dev.NewStream()
		if err != nil {
			t.Fatal(err)
		}
		e, err := dev.NewIPCEvent()
		if err != nil {
			t.Fatal(err)
		}
		if err := e.Record(s); err != nil {
			t.Fatal(err)
		}
		b, err := dev.Alloc(1 << 20)
		if err != nil {
			t.Fatal(err)
		}
		h, err := dev.AllocHost(4096)
		if err != nil {
			t.Fatal(err)
		}
		sb, err := dev.AllocShareable(1)
		if err != nil {
			t.Fatal(err)
		}
		hr, err := dev.RegisterHost(mapped)
		if err != nil {
			t.Fatal(err)
		}
		_, _, _, _, _, _ = s, e, b, h, sb, hr
	}()
	during := cudaipc.LiveObjects()
	if during.Streams != before.Streams+1 || during.Events != before.Events+1 || during.Buffers != before.Buffers+1 ||
		during.HostBuffers != before.HostBuffers+1 || during.ShareableBuffers != before.ShareableBuffers+1 ||
		during.HostRegistrations != before.HostRegistrations+1 {
		t.Fatalf("live before %+v, with the objects %+v", before, during)
	}
	testutil.Eventually(t, testutil.Wait, func() error {
		runtime.GC()
		if now := cudaipc.LiveObjects(); now != before {
			return fmt.Errorf("live before %+v, after dropping and collecting %+v", before, now)
		}
		return nil
	})
	// The device still works: nothing was destroyed twice.
	if err := dev.Synchronize(); err != nil {
		t.Fatal(err)
	}
}

// RegisterHost page-locks memory the caller mapped: a device→host copy
// lands in it, Unregister twice is no error, and the memory can be
// registered again afterwards.
func TestRegisterHost(t *testing.T) {
	dev := testutil.RequireGPU(t)
	const size = 8<<20 + 123
	mem, err := unix.Mmap(-1, 0, size, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Munmap(mem)
	want := testutil.RandomBytes(11, size)
	buf, err := dev.Alloc(size)
	if err != nil {
		t.Fatal(err)
	}
	defer buf.Free()
	if err := dev.CopyToDevice(buf.Ptr(), want); err != nil {
		t.Fatal(err)
	}
	before := cudaipc.LiveObjects().HostRegistrations
	for range 2 {
		reg, err := dev.RegisterHost(mem)
		if err != nil {
			t.Fatal(err)
		}
		if n := cudaipc.LiveObjects().HostRegistrations; n != before+1 {
			t.Fatalf("%d registrations live, want %d", n, before+1)
		}
		s, err := dev.NewStream()
		if err != nil {
			t.Fatal(err)
		}
		if err := s.CopyFromDeviceAsync(reg.Bytes(), buf.Ptr()); err != nil {
			t.Fatal(err)
		}
		if err := s.Synchronize(); err != nil {
			t.Fatal(err)
		}
		s.Close()
		if string(mem) != string(want) {
			t.Fatal("the copy into registered memory differs")
		}
		clear(mem)
		if err := reg.Unregister(); err != nil {
			t.Fatal(err)
		}
		if err := reg.Unregister(); err != nil || reg.Bytes() != nil {
			t.Fatalf("second Unregister: %v, bytes %v", err, reg.Bytes() != nil)
		}
		if n := cudaipc.LiveObjects().HostRegistrations; n != before {
			t.Fatalf("%d registrations live after Unregister, want %d", n, before)
		}
	}
}

package cudaipc

import (
	"errors"
	"math"
	"os"
	"strings"
	"testing"

	"github.com/cudaipc/cudaipc/internal/cu"
)

func TestVMMArgumentsRejectedBeforeTheDriver(t *testing.T) {
	// Both devices were never initialized: a driver call through them would
	// fail with a load or context error, so these prove the checks ran first.
	none := &Device{}
	fd := &Device{attrs: map[cu.DeviceAttribute]int{cu.AttrVirtualMemoryManagement: 1, cu.AttrHandleTypePosixFDSupported: 1}}
	if none.VMMFDSupported() || !fd.VMMFDSupported() {
		t.Fatal("VMMFDSupported does not follow the attributes")
	}
	closed, err := os.Open(os.DevNull)
	if err != nil {
		t.Fatal(err)
	}
	closed.Close()
	garbage := os.NewFile(987654, "garbage")
	for _, d := range []*Device{none, fd} {
		checks := []struct {
			name string
			err  error
			want string
		}{
			{"alloc 0", func() error { _, err := d.AllocShareable(0); return err }(), "positive"},
			{"alloc -1", func() error { _, err := d.AllocShareable(-1); return err }(), "positive"},
			{"import size 0", func() error { _, err := d.ImportFD(os.Stdin, 0); return err }(), "positive"},
			{"import nil", func() error { _, err := d.ImportFD(nil, 1); return err }(), "nil"},
			{"import closed", func() error { _, err := d.ImportFD(closed, 1); return err }(), "closed"},
			{"import garbage", func() error { _, err := d.ImportFD(garbage, 1); return err }(), "EBADF"},
		}
		for _, c := range checks {
			var ae *ArgError
			if !errors.As(c.err, &ae) {
				t.Errorf("%s: got %v, want *ArgError", c.name, c.err)
				continue
			}
			if !errors.Is(c.err, ErrInvalidValue) {
				t.Errorf("%s: %v does not match ErrInvalidValue", c.name, c.err)
			}
			if !strings.Contains(c.err.Error(), c.want) {
				t.Errorf("%s: %q lacks %q", c.name, c.err, c.want)
			}
		}
	}
	f, err := os.Open(os.DevNull)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	for name, err := range map[string]error{
		"AllocShareable": func() error { _, err := none.AllocShareable(1); return err }(),
		"ImportFD":       func() error { _, err := none.ImportFD(f, 1); return err }(),
		"VMMGranularity": func() error { _, err := none.VMMGranularity(); return err }(),
	} {
		if !errors.Is(err, ErrNotSupported) {
			t.Errorf("%s on a device without POSIX fd handles: %v, want ErrNotSupported", name, err)
		} else if !strings.Contains(err.Error(), name) || !strings.Contains(err.Error(), "VMMFDSupported") {
			t.Errorf("%s: %q does not say what failed and why", name, err)
		}
	}
}

func TestRoundUp(t *testing.T) {
	const g = 2 << 20
	for _, c := range []struct{ size, want int64 }{
		{1, g}, {g - 1, g}, {g, g}, {g + 1, 2 * g}, {3*g + 17, 4 * g},
		{math.MaxInt64 / g * g, math.MaxInt64 / g * g},
	} {
		got, err := roundUp("x", c.size, g)
		if err != nil || got != c.want {
			t.Errorf("roundUp(%d) = %d, %v; want %d", c.size, got, err, c.want)
		}
	}
	if _, err := roundUp("x", math.MaxInt64-5, g); !errors.Is(err, ErrInvalidValue) {
		t.Errorf("overflow: %v, want an ArgError", err)
	}
	if _, err := roundUp("x", 1, 0); err == nil {
		t.Error("granularity 0 accepted")
	}
}

func TestVMMClosedObjects(t *testing.T) {
	d := &Device{}
	b := &ShareableBuffer{deviceRange: deviceRange{what: "ShareableBuffer", dev: d, size: 4096, closed: true}}
	m := &Mapping{ref: &mappingRef{dev: d, size: 4096, own: &vmmMapping{}, closed: true}}
	if err := b.Free(); err != nil {
		t.Errorf("Free of a freed buffer: %v", err)
	}
	if err := b.Close(); err != nil {
		t.Errorf("Close of a freed buffer: %v", err)
	}
	if err := m.Close(); err != nil {
		t.Errorf("Close of a closed mapping: %v", err)
	}
	if _, err := b.ExportFD(); !errors.Is(err, ErrClosed) {
		t.Errorf("ExportFD after Free: %v", err)
	}
	buf := make([]byte, 8)
	for name, err := range map[string]error{
		"buffer ReadAt":   func() error { _, err := b.ReadAt(buf, 0); return err }(),
		"buffer WriteAt":  func() error { _, err := b.WriteAt(buf, 0); return err }(),
		"mapping ReadAt":  func() error { _, err := m.ReadAt(buf, 0); return err }(),
		"mapping WriteAt": func() error { _, err := m.WriteAt(buf, 0); return err }(),
	} {
		if !errors.Is(err, ErrClosed) {
			t.Errorf("%s: %v, want ErrClosed", name, err)
		}
	}
	// One line that names the call first, without a doubled prefix.
	_, err := b.ReadAt(buf, 0)
	if got, want := err.Error(), "cudaipc: ShareableBuffer.ReadAt: the ShareableBuffer is closed"; got != want {
		t.Errorf("closed error text %q, want %q", got, want)
	}
}

package cudaipc

import (
	"errors"
	"strings"
	"testing"

	"github.com/cudaipc/cudaipc/internal/cu"
)

func TestEveryResultHasAName(t *testing.T) {
	names := ResultNames()
	if len(names) < 100 {
		t.Fatalf("only %d CUresult names", len(names))
	}
	seen := map[string]Result{}
	for r, n := range names {
		if !strings.HasPrefix(n, "CUDA_") {
			t.Errorf("%d: name %q", r, n)
		}
		if r.Name() != n {
			t.Errorf("%d: Name() = %q, table says %q", r, r.Name(), n)
		}
		if prev, dup := seen[n]; dup {
			t.Errorf("name %q used by %d and %d", n, prev, r)
		}
		seen[n] = r
	}
	if got := Result(12345).Name(); got != "CUresult(12345)" {
		t.Errorf("unknown code named %q", got)
	}
}

func TestErrorTextAndMatching(t *testing.T) {
	cases := []struct {
		code     Result
		sentinel error
		name     string
	}{
		{1, ErrInvalidValue, "CUDA_ERROR_INVALID_VALUE"},
		{205, ErrMapBufferObjectFailed, "CUDA_ERROR_MAP_FAILED"},
		{400, ErrInvalidResourceHandle, "CUDA_ERROR_INVALID_HANDLE"},
		{201, ErrDeviceUninitialized, "CUDA_ERROR_INVALID_CONTEXT"},
		{711, ErrTooManyPeers, "CUDA_ERROR_TOO_MANY_PEERS"},
		{801, ErrNotSupported, "CUDA_ERROR_NOT_SUPPORTED"},
		{704, ErrPeerAccessAlreadyEnabled, "CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED"},
		{600, ErrNotReady, "CUDA_ERROR_NOT_READY"},
	}
	for _, c := range cases {
		var err error = &Error{Func: "cuIpcOpenMemHandle", Code: c.code}
		wrapped := errors.Join(errors.New("context"), err)
		if !errors.Is(wrapped, c.sentinel) {
			t.Errorf("%v does not match its sentinel", err)
		}
		if errors.Is(err, ErrOutOfMemory) {
			t.Errorf("%v matches ErrOutOfMemory", err)
		}
		msg := err.Error()
		if !strings.Contains(msg, "cuIpcOpenMemHandle") || !strings.Contains(msg, c.name) {
			t.Errorf("message %q lacks the call or the name %s", msg, c.name)
		}
		var de *Error
		if !errors.As(wrapped, &de) || de.Code != c.code {
			t.Errorf("errors.As lost the code of %v", err)
		}
	}
}

func TestLoadErrorMatchesNoDriver(t *testing.T) {
	err := &Error{Func: "cuDeviceGetCount", Err: &cu.LoadError{Path: "libcuda.so.1", Reason: "not found"}}
	if !errors.Is(err, ErrNoDriver) {
		t.Fatal("load error does not match ErrNoDriver")
	}
	if errors.Is(err, ErrInvalidValue) {
		t.Fatal("load error matches a CUresult")
	}
	for _, want := range []string{"cuDeviceGetCount", "libcuda.so.1", "install the NVIDIA driver", EnvLibrary} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("%q lacks %q", err.Error(), want)
		}
	}
}

func TestArgumentsRejectedBeforeTheDriver(t *testing.T) {
	// A Device that was never initialized: any driver call through it would
	// fail differently, so these errors prove the Go-side checks ran first.
	d := &Device{}
	var h MemHandle
	h[3] = 1
	checks := []struct {
		name string
		err  error
		want string
	}{
		{"flags 0", func() error { _, err := d.OpenMemHandle(h, 0); return err }(), "LazyEnablePeerAccess"},
		{"flags 2", func() error { _, err := d.OpenMemHandle(h, 2); return err }(), "LazyEnablePeerAccess"},
		{"flags 3", func() error { _, err := d.OpenMemHandle(h, 3); return err }(), "does not define"},
		{"flags 1|2", func() error { _, err := d.OpenMemHandle(h, LazyEnablePeerAccess, 2); return err }(), "does not define"},
		{"zero handle", func() error { _, err := d.OpenMemHandle(MemHandle{}, LazyEnablePeerAccess); return err }(), "zero"},
		{"zero event handle", func() error { _, err := d.OpenEventHandle(EventHandle{}); return err }(), "zero"},
		{"alloc 0", func() error { _, err := d.Alloc(0); return err }(), "positive"},
		{"alloc -1", func() error { _, err := d.Alloc(-1); return err }(), "positive"},
		{"host alloc 0", func() error { _, err := d.AllocHost(0); return err }(), "positive"},
		{"register nothing", func() error { _, err := d.RegisterHost(nil); return err }(), "empty"},
		{"nil export", func() error { _, err := d.GetMemHandle(0); return err }(), "nil"},
		{"nil close", d.CloseMemHandle(0), "nil"},
		{"copy -1", d.Copy(1, 2, -1), "negative"},
		{"memset -1", d.Memset(1, 0, -1), "negative"},
		{"event flags", func() error { _, err := d.NewEvent(EventInterprocess); return err }(), "EventDisableTiming"},
		{"event bits", func() error { _, err := d.NewEvent(0x80); return err }(), "unknown"},
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

func TestRangeChecks(t *testing.T) {
	for _, c := range []struct {
		size int64
		n    int
		off  int64
		ok   bool
	}{
		{100, 100, 0, true}, {100, 0, 100, true}, {100, 1, 100, false}, {100, 10, 95, false},
		{100, 1, -1, false}, {100, 101, 0, false}, {1 << 62, 1, 1<<62 - 1, true}, {10, 1, 1 << 62, false},
	} {
		err := checkRange("x", c.size, c.n, c.off)
		if (err == nil) != c.ok {
			t.Errorf("size %d n %d off %d: err %v", c.size, c.n, c.off, err)
		}
	}
}

package ucx_test

import (
	"errors"
	"os"
	"os/exec"
	"strings"
	"testing"

	"github.com/cudaipc/cudaipc/internal/ucx"
)

func TestStatusText(t *testing.T) {
	err := error(&ucx.Error{Func: "ucp_ep_create", Status: ucx.ErrUnreachable})
	if !errors.Is(err, ucx.ErrUnreachable) || errors.Is(err, ucx.ErrNoDevice) {
		t.Fatalf("errors.Is does not match by status: %v", err)
	}
	for _, want := range []string{"ucp_ep_create", "UCS_ERR_UNREACHABLE", "(-6)"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("%q lacks %q", err, want)
		}
	}
	for s, name := range ucx.Names() {
		if s.Name() != name || !strings.HasPrefix(s.Error(), name) {
			t.Errorf("status %d: Name %q, Error %q, want %q", int8(s), s.Name(), s.Error(), name)
		}
	}
	for s, want := range map[ucx.Status]string{-45: "UCS_ERR_LINK_FAILURE(-45)", -70: "UCS_ERR_ENDPOINT_FAILURE(-70)", -30: "ucs_status_t(-30)"} {
		if s.Name() != want {
			t.Errorf("Status(%d).Name() = %q, want %q", int8(s), s.Name(), want)
		}
	}
}

// TestMissingLibrary loads a library that does not exist, in a child
// process (Load runs once per process): a clear error, not a crash.
func TestMissingLibrary(t *testing.T) {
	if os.Getenv("UCX_MISSING_CHILD") == "1" {
		err := ucx.Load()
		if !errors.Is(err, ucx.ErrNotFound) {
			t.Fatalf("Load of a missing library: %v, want ErrNotFound", err)
		}
		_, err = ucx.InitVersion(&ucx.Params{})
		if !errors.Is(err, ucx.ErrNotFound) || !strings.Contains(err.Error(), "ucp_init_version") {
			t.Fatalf("InitVersion without UCX: %v", err)
		}
		if !strings.Contains(err.Error(), "UCX not found") || !strings.Contains(err.Error(), "install libucx0") {
			t.Fatalf("the error does not say what to install: %v", err)
		}
		if err := ucx.SetLibrary("other"); err == nil {
			t.Fatal("SetLibrary after Load succeeded")
		}
		return
	}
	cmd := exec.Command(os.Args[0], "-test.run=^TestMissingLibrary$", "-test.v")
	cmd.Env = append(os.Environ(), "UCX_MISSING_CHILD=1", ucx.EnvLibrary+"=/nonexistent/libucp.so.0")
	out, err := cmd.CombinedOutput()
	if err != nil || !strings.Contains(string(out), "--- PASS: TestMissingLibrary") {
		t.Fatalf("child: %v\n%s", err, out)
	}
}

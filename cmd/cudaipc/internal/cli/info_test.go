package cli

import (
	"bytes"
	"context"
	"encoding/json"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/cudaipc/cudaipc"
	"github.com/cudaipc/cudaipc/internal/testutil"
)

func TestMain(m *testing.M) {
	testutil.RunRole(testutil.Roles{"dumpExporter": roleDumpExporter})
	// The doctor's self-test, 'bench ipc' and 'demo' re-execute this binary
	// (as 'cudaipc diag-helper'); so do tests that run 'cudaipc serve'.
	if runAsCLIMain() {
		os.Exit(0)
	}
	os.Exit(m.Run())
}

func run(t *testing.T, args ...string) (string, string, error) {
	t.Helper()
	var out, errb bytes.Buffer
	err := Run(context.Background(), args, &out, &errb)
	return out.String(), errb.String(), err
}

func TestInfo(t *testing.T) {
	out, _, err := run(t, "info", "--json")
	if cudaipc.Init() != nil {
		if testutil.GPURequired() {
			t.Fatal("no driver but a GPU is required")
		}
		if err == nil || !strings.Contains(err.Error(), "libcuda.so.1") || !strings.Contains(err.Error(), "install the NVIDIA driver") || strings.Contains(err.Error(), "\n") {
			t.Fatalf("info without a driver: %v", err)
		}
		return
	}
	if err != nil {
		t.Fatal(err)
	}
	var r infoReport
	if err := json.Unmarshal([]byte(out), &r); err != nil {
		t.Fatalf("%v\n%s", err, out)
	}
	devs, _ := cudaipc.Devices()
	if len(r.Devices) != len(devs) || len(r.PeerAccess) != len(devs) {
		t.Fatalf("info lists %d devices, the API %d", len(r.Devices), len(devs))
	}
	for i, d := range devs {
		if r.Devices[i].UUID != d.UUID().String() || !r.Devices[i].LegacyIPC {
			t.Errorf("device %d: %+v", i, r.Devices[i])
		}
	}
	text, _, err := run(t, "info")
	if err != nil || !strings.Contains(text, devs[0].UUID().String()) {
		t.Fatalf("text info: %v\n%s", err, text)
	}
}

func TestDoctor(t *testing.T) {
	out, _, err := run(t, "doctor", "--json", "--socket", t.TempDir()+"/none.sock")
	var checks []struct{ Name, Status, Detail string }
	if jerr := json.Unmarshal([]byte(out), &checks); jerr != nil {
		t.Fatalf("%v\n%s", jerr, out)
	}
	status := map[string]struct{ Name, Status, Detail string }{}
	for _, c := range checks {
		status[c.Name] = c
	}
	if status["store socket"].Status != "warn" || !strings.Contains(status["store socket"].Detail, "cudaipc serve") {
		t.Errorf("store socket check: %+v", status["store socket"])
	}
	if cudaipc.Init() != nil {
		if err != nil || status["driver"].Status != "warn" {
			t.Fatalf("doctor without a driver: %v, want a pass with the driver a warning: %+v", err, checks)
		}
		return
	}
	if err != nil {
		t.Fatalf("doctor on a GPU machine: %v\n%s", err, out)
	}
	rt := status["ipc round trip"]
	if rt.Status != "ok" || !strings.Contains(rt.Detail, "read them back") {
		t.Fatalf("ipc round trip: %+v", rt)
	}
}

func TestVersionFlag(t *testing.T) {
	out, _, err := run(t, "--version")
	if err != nil || !strings.HasPrefix(out, "cudaipc ") || !strings.Contains(out, "go1.") {
		t.Fatalf("--version: %q, %v", out, err)
	}
}

// doctor's store check asks the daemon: ok when one answers, a warning for
// a socket file nobody serves (a daemon that died).
func TestDoctorStoreCheck(t *testing.T) {
	storeStatus := func(sock string) (string, string) {
		out, _, _ := run(t, "doctor", "--json", "--socket", sock)
		var checks []struct{ Name, Status, Detail string }
		if err := json.Unmarshal([]byte(out), &checks); err != nil {
			t.Fatalf("%v\n%s", err, out)
		}
		for _, c := range checks {
			if c.Name == "store socket" {
				return c.Status, c.Detail
			}
		}
		t.Fatalf("no store socket check in %s", out)
		return "", ""
	}
	sock := serve(t)
	// serve(t) picks the backend: host, or cuda where there is a GPU.
	if st, detail := storeStatus(sock); st != "ok" || !strings.Contains(detail, "a daemon answers") || !strings.Contains(detail, "backend ") {
		t.Errorf("live daemon: %s %s", st, detail)
	}
	dead := filepath.Join(t.TempDir(), "dead.sock")
	l, err := net.Listen("unixpacket", dead)
	if err != nil {
		t.Fatal(err)
	}
	l.(*net.UnixListener).SetUnlinkOnClose(false)
	l.Close() // the socket file stays, nobody listens
	if st, detail := storeStatus(dead); st != "warn" || !strings.Contains(detail, "no daemon answers") {
		t.Errorf("socket file without a daemon: %s %s", st, detail)
	}
}

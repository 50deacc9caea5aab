package cli

import (
	"bytes"
	"crypto/rand"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/cudaipc/cudaipc"
	"github.com/cudaipc/cudaipc/client"
)

// TestFailuresAreOneLine runs each failure path of the CLI as a process and
// checks what a person sees: one line on stderr, naming the program once,
// with no doubled prefix, and the exit status (2 for bad arguments, the
// class's code for a store failure of one (ExitNotFound, ...), else 1).
func TestFailuresAreOneLine(t *testing.T) {
	sock := serve(t)
	dir := t.TempDir()
	file := filepath.Join(dir, "in")
	if err := os.WriteFile(file, []byte("some bytes"), 0o600); err != nil {
		t.Fatal(err)
	}
	mustRun(t, "put", file, "--name", "taken", "--socket", sock)
	none := filepath.Join(dir, "none.sock")
	noDriver := cudaipc.Init() != nil
	u, _ := cudaipc.ParseUUID("GPU-5f1c2a3b-4d5e-6f70-8192-a3b4c5d6e7f8")
	vmm := cudaipc.Region{Version: cudaipc.RegionVersion, Kind: cudaipc.KindVMMFD, AllocationID: cudaipc.NewAllocationID(),
		Size: 4096, AllocSize: 2 << 20, Device: u, ExporterPID: 1, PIDNamespace: 2, BootID: cudaipc.BootID{3}, ExporterBase: 1 << 40}
	vmmJSON, err := vmm.MarshalJSON()
	if err != nil {
		t.Fatal(err)
	}

	cases := []struct {
		args []string
		code int
		want string // in the line
		skip bool
	}{
		{args: []string{"bogus"}, code: 2, want: "unexpected argument"},
		{args: []string{"get"}, code: 2, want: "name"},
		{args: []string{"ls", "--socket", none}, code: 1, want: "start one with 'cudaipc serve'"},
		{args: []string{"stat", "missing", "--socket", sock}, code: ExitNotFound, want: "'cudaipc ls'"},
		{args: []string{"rm", "missing1", "missing2", "--socket", sock}, code: ExitNotFound, want: `"missing1": no such object: 'cudaipc ls' lists the objects you can read; delete "missing2"`},
		{args: []string{"put", file, "--name", "taken", "--socket", sock}, code: 1, want: "'cudaipc rm'"},
		{args: []string{"put", filepath.Join(dir, "absent"), "--name", "x", "--socket", sock}, code: 1, want: "no such file"},
		{args: []string{"put", file, "--name", "bad\x01name", "--socket", sock}, code: 1, want: "names are"},
		{args: []string{"put", file, "--name", "x", "--dtype", "float99", "--socket", sock}, code: 2, want: "not a dtype; one of bfloat16, bool, complex128"},
		{args: []string{"bench"}, code: 2, want: `expected one of "ipc", "store", "put", "cluster" (see 'cudaipc help bench')`},
		{args: []string{"get", "never", "--timeout", "20ms", "--socket", sock}, code: ExitTimeout, want: "--timeout"},
		{args: []string{"get", "never", "--socket", sock}, code: ExitNotFound, want: `get "never": no such object: 'cudaipc ls' lists the objects you can read; --wait waits for it to be put`},
		{args: []string{"get", "taken", "-o", filepath.Join(dir, "no", "such", "dir"), "--socket", sock}, code: 1, want: "-o"},
		{args: []string{"serve", "--socket", sock, "--log-level", "warn"}, code: 1, want: "already running"},
		{args: []string{"serve", "--gpu-share", "bogus", "--socket", none}, code: 2, want: "--gpu-share"},
		{args: []string{"serve", "--cluster", "etcd://127.0.0.1:9", "--cluster-secret", filepath.Join(dir, "absent"), "--experimental-cluster-streams", "65", "--socket", none}, code: 1, want: "experimental-cluster-streams = 65: want 0 (the default) to 64"},
		{args: []string{"serve", "--cluster", "etcd://127.0.0.1:9", "--cluster-secret", filepath.Join(dir, "absent"), "--experimental-cluster-lanes", "17", "--socket", none}, code: 1, want: "experimental-cluster-lanes = 17: want 0 (one) to 16"},
		{args: []string{"serve", "--cluster", "etcd://127.0.0.1:9", "--cluster-secret", filepath.Join(dir, "absent"), "--experimental-cluster-chunk", "3MiB", "--socket", none}, code: 1, want: "experimental-cluster-chunk = 3 MiB: want 0 (the default) or a power of two from 64KiB to 1GiB"},
		{args: []string{"serve", "--cluster", "etcd://127.0.0.1:9", "--cluster-secret", filepath.Join(dir, "absent"), "--experimental-cluster-chunk", "2GiB", "--socket", none}, code: 1, want: "experimental-cluster-chunk = 2 GiB: want 0 (the default) or a power of two"},
		{args: []string{"serve", "--cluster", "etcd://127.0.0.1:9", "--cluster-secret", filepath.Join(dir, "absent"), "--experimental-cluster-gpu-publish", "later", "--socket", none}, code: 2, want: "--experimental-cluster-gpu-publish must be one of"},
		{args: []string{"dump", "--region", "xyz"}, code: 2, want: "docs/region.md"},
		{args: []string{"dump", "--region", `{"version":"x"}`}, code: 2, want: "docs/region.md"},
		{args: []string{"dump", "--region", `{"version":1,"device":"bad"}`}, code: 2, want: "GPU UUID"},
		{args: []string{"dump", "--region", "@" + filepath.Join(dir, "absent")}, code: 2, want: "--region"},
		{args: []string{"dump", "--region", "{}", "--chunk", "0"}, code: 2, want: "--chunk"},
		{args: []string{"dump", "--region", string(vmmJSON), "-o", filepath.Join(dir, "out"), "--socket", none}, code: 1, want: "read through the store daemon"},
		{args: []string{"dump", "--region", string(vmmJSON), "-o", filepath.Join(dir, "out"), "--socket", sock}, code: 1, want: "no object you may read"},
		{args: []string{"bench", "ipc", "--size", "5"}, code: 2, want: "--size"},
		{args: []string{"bench", "store", "--clients", "0"}, code: 2, want: "--clients"},
		{args: []string{"demo", "--sizes", "0"}, code: 2, want: "--sizes"},
		{args: []string{"diag-helper", "bogus", "{}"}, code: 2, want: "bogus"},
		{args: []string{"info"}, code: 1, want: "libcuda.so.1", skip: !noDriver},
		{args: []string{"bench", "ipc"}, code: 1, want: "libcuda.so.1", skip: !noDriver},
		{args: []string{"serve", "--backend", "cuda", "--socket", none}, code: 1, want: "--backend host", skip: !noDriver},
		{args: []string{"demo", "--device", "0"}, code: 2, want: "--device host", skip: !noDriver},
	}
	for _, c := range cases {
		if c.skip {
			continue
		}
		cmd := exec.Command(os.Args[0], c.args...) // this binary as cudaipc (runAsCLIMain)
		cmd.Env = append(os.Environ(), mainEnv+"=1", "CUDAIPC_SOCKET=")
		var stderr bytes.Buffer
		cmd.Stdout, cmd.Stderr = new(bytes.Buffer), &stderr
		err := cmd.Run()
		code := 0
		var ee *exec.ExitError
		if errors.As(err, &ee) {
			code = ee.ExitCode()
		}
		line := strings.TrimSuffix(stderr.String(), "\n")
		if w, rest, ok := strings.Cut(line, "\n"); ok && strings.HasPrefix(w, "cudaipc: waiting for ") {
			line = rest // get --timeout says first what it waits for
		}
		name := strings.Join(c.args, " ")
		switch {
		case code != c.code:
			t.Errorf("cudaipc %s: exit %d, want %d\n%s", name, code, c.code, stderr.String())
		case line == "" || strings.Contains(line, "\n"):
			t.Errorf("cudaipc %s: want one line on stderr, got:\n%s", name, stderr.String())
		case !strings.HasPrefix(line, "cudaipc: ") || strings.Contains(line[len("cudaipc: "):], "cudaipc: "):
			t.Errorf("cudaipc %s: want the program named once at the start: %s", name, line)
		case strings.Contains(line, "json: json:") || strings.Contains(line, "internal"):
			t.Errorf("cudaipc %s: doubled prefix or internal label: %s", name, line)
		case !strings.Contains(line, c.want):
			t.Errorf("cudaipc %s: %q lacks %q", name, line, c.want)
		default:
			t.Logf("exit %d: %s", code, line)
		}
	}
}

// A client in another PID namespace than a daemon sharing by legacy IPC
// gets a setup error naming the flag that fixes it, not an internal one.
func TestExplainOtherPIDNamespace(t *testing.T) {
	inner := fmt.Errorf("%w: the region was exported in PID namespace 1, this process is in 2; WithAnyPIDNamespace tries anyway", cudaipc.ErrOtherPIDNamespace)
	err := explain(&client.Error{Op: "get", Name: "x", Err: fmt.Errorf("mapping the GPU object: %w", inner)}, "/s")
	line := Message(err)
	if !errors.Is(err, cudaipc.ErrOtherPIDNamespace) || strings.Contains(line, "\n") || !strings.Contains(line, "'cudaipc serve --gpu-share fd'") ||
		strings.Contains(line, "With") || strings.Contains(line, "internal") || !strings.HasPrefix(line, `cudaipc: get "x": `) {
		t.Fatalf("%s", line)
	}
}

// doctor passes where the driver cannot be loaded (a CPU-only machine: the
// host backend works), with the driver line a warning, and still runs the
// checks that need no driver. CUDAIPC_LIBCUDA names a library that is not
// there, so that this holds on a GPU machine too.
func TestDoctorWithoutDriver(t *testing.T) {
	cmd := exec.Command(os.Args[0], "doctor", "--json", "--socket", filepath.Join(t.TempDir(), "none.sock"))
	cmd.Env = append(os.Environ(), mainEnv+"=1", "CUDAIPC_LIBCUDA="+filepath.Join(t.TempDir(), "libcuda.so.1"))
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Run(); err != nil {
		t.Fatalf("doctor without a driver: %v\n%s%s", err, stdout.String(), stderr.String())
	}
	var checks []struct{ Name, Status, Detail string }
	if err := json.Unmarshal(stdout.Bytes(), &checks); err != nil {
		t.Fatalf("%v:\n%s", err, stdout.String())
	}
	got := map[string]string{}
	for _, c := range checks {
		got[c.Name] = c.Status
		if c.Status == "fail" {
			t.Errorf("failed check %s: %s", c.Name, c.Detail)
		}
	}
	for name, want := range map[string]string{"driver": "warn", "ipc namespace": "ok", "capabilities": "ok", "/dev/shm": "ok", "pid namespace": "ok", "memfd": "ok", "ipc round trip": "skip"} {
		if got[name] != want {
			t.Errorf("check %q: %q, want %q (all: %v)", name, got[name], want, got)
		}
	}
}

// TestQuotaFullNamesTheQuota: a put over the uid's quota says that the
// quota is full and which setting sets it, with the LIMIT code, and does not
// send the user to --capacity (the store has room).
func TestQuotaFullNamesTheQuota(t *testing.T) {
	sock := serve(t, "--backend", "host", "--capacity", "64MiB", "--config", writeConfig(t, "quota = \"1MiB\"\n"))
	file := filepath.Join(t.TempDir(), "in")
	data := make([]byte, 2<<20)
	if _, err := rand.Read(data); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(file, data, 0o600); err != nil {
		t.Fatal(err)
	}
	_, _, err := storeCLI(t, "put", file, "--name", "over", "--socket", sock)
	if err == nil {
		t.Fatal("a put of 2 MiB within a 1 MiB quota succeeded")
	}
	msg := Message(err)
	if !errors.Is(err, client.ErrLimit) || ExitCode(err) != 1 || !strings.Contains(msg, "uid") || !strings.Contains(msg, "quota") ||
		!strings.Contains(msg, "quota setting") || strings.Contains(msg, "--capacity") || strings.Contains(msg, "\n") {
		t.Fatalf("put over the quota: %q (exit %d, LIMIT %v)", msg, ExitCode(err), errors.Is(err, client.ErrLimit))
	}
	t.Log(msg)
}

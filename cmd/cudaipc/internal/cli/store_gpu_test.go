package cli

import (
	"bytes"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/cudaipc/cudaipc"
	"github.com/cudaipc/cudaipc/cmd/cudaipc/internal/diag"
	"github.com/cudaipc/cudaipc/internal/testutil"
)

func TestServeCUDAWithoutGPU(t *testing.T) {
	if n, err := cudaipc.DeviceCount(); err == nil && n > 0 {
		t.Skip("this machine has a GPU")
	}
	sock := filepath.Join(t.TempDir(), "store.sock")
	_, _, err := storeCLI(t, "serve", "--backend", "cuda", "--socket", sock, "--log-level", "error")
	if err == nil || !strings.Contains(err.Error(), "backend cuda needs") || !strings.Contains(err.Error(), "--backend host") {
		t.Fatalf("serve --backend cuda without a GPU: %v", err)
	}
	if _, err := os.Stat(sock); err == nil {
		t.Fatal("a failed serve left its socket")
	}
}

// serveProcess runs 'cudaipc serve' as a child process (this test binary
// acting as the CLI), so that its GPU memory crosses a process boundary.
func serveProcess(t *testing.T, args ...string) string {
	t.Helper()
	sock := filepath.Join(t.TempDir(), "store.sock")
	cmd := exec.Command(os.Args[0], append([]string{"serve", "--socket", sock, "--log-level", "warn"}, args...)...)
	cmd.Env = append(os.Environ(), mainEnv+"=1")
	var errOut bytes.Buffer
	cmd.Stderr = &errOut
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	t.Cleanup(func() {
		cmd.Process.Signal(os.Interrupt)
		if err := <-done; err != nil {
			t.Errorf("serve: %v\n%s", err, errOut.String())
		}
	})
	testutil.Eventually(t, testutil.Wait, func() error {
		select {
		case err := <-done:
			t.Fatalf("serve exited: %v\n%s", err, errOut.String())
		default:
		}
		_, _, err := storeCLI(t, "ls", "--socket", sock)
		return err
	})
	return sock
}

// put --device, get, ls, stat --json and dump --region of the stat's
// region, against a daemon process with the cuda backend, sharing by legacy
// IPC and by descriptor.
func TestGPUStoreCommands(t *testing.T) {
	for _, share := range []string{"ipc", "fd"} {
		t.Run(share, func(t *testing.T) { testGPUStoreCommands(t, share) })
	}
}

func testGPUStoreCommands(t *testing.T, share string) {
	dev := testutil.RequireGPU(t)
	sock := serveProcess(t, "--backend", "cuda", "--gpu-share", share)
	dir := t.TempDir()
	data := testutil.RandomBytes(42, 9<<20+13) // more than two put/get chunks
	in := filepath.Join(dir, "in.bin")
	if err := os.WriteFile(in, data, 0o600); err != nil {
		t.Fatal(err)
	}
	uuid := dev.UUID().String()
	if out := mustRun(t, "put", in, "--name", "g0", "--device", "0", "--socket", sock); !strings.Contains(out, uuid) {
		t.Errorf("put said %q, want the GPU's UUID", out)
	}
	mustRun(t, "put", in, "--name", "g1", "--device", uuid, "--socket", sock)
	if _, _, err := storeCLI(t, "put", in, "--name", "g2", "--device", "99", "--socket", sock); err == nil || !strings.Contains(err.Error(), "ordinal 99") {
		t.Errorf("put --device 99: %v", err)
	}

	for _, name := range []string{"g0", "g1"} {
		out := filepath.Join(dir, name+".out")
		mustRun(t, "get", name, "-o", out, "--socket", sock)
		if got, err := os.ReadFile(out); err != nil || !bytes.Equal(got, data) {
			t.Errorf("get %s -o: %d bytes, %v", name, len(got), err)
		}
	}
	if got := mustRun(t, "get", "g0", "--socket", sock); got != string(data) {
		t.Errorf("get to stdout: %d bytes", len(got))
	}
	if table := mustRun(t, "ls", "--socket", sock); !strings.Contains(table, uuid) {
		t.Errorf("ls does not show the device: %q", table)
	}

	var info struct {
		Device string          `json:"device"`
		Size   int64           `json:"size"`
		Region json.RawMessage `json:"region"`
	}
	if err := json.Unmarshal([]byte(mustRun(t, "stat", "g1", "--json", "--socket", sock)), &info); err != nil {
		t.Fatal(err)
	}
	wantKind := map[string]cudaipc.Kind{"ipc": cudaipc.KindCUDAIPC, "fd": cudaipc.KindVMMFD}[share]
	r, err := cudaipc.DecodeRegion(info.Region)
	if err != nil || info.Device != uuid || r.Size != int64(len(data)) || r.Device != dev.UUID() || r.Kind != wantKind {
		t.Fatalf("stat --json: device %q, region %s (%v), want kind %s", info.Device, info.Region, err, wantKind)
	}
	// dump maps a cuda-ipc region itself, and reads a vmm-fd one through
	// the daemon (--socket), which hands it the descriptor.
	dumped := filepath.Join(dir, "dump.bin")
	mustRun(t, "dump", "--region", string(info.Region), "-o", dumped, "--socket", sock)
	if got, err := os.ReadFile(dumped); err != nil || !bytes.Equal(got, data) {
		t.Fatalf("dump of the stat region: %d bytes, %v", len(got), err)
	}
	// A part of it, at an odd offset.
	sub, err := r.Sub(4097, 1<<20+3)
	if err != nil {
		t.Fatal(err)
	}
	subJSON, _ := sub.MarshalJSON()
	if got := mustRun(t, "dump", "--region", string(subJSON), "--socket", sock); got != string(data[4097:4097+1<<20+3]) {
		t.Fatalf("dump of a sub-region: %d bytes", len(got))
	}
	mustRun(t, "rm", "g0", "g1", "--socket", sock)
}

func TestGPUDemo(t *testing.T) {
	dev := testutil.RequireGPU(t)
	var rep diag.DemoReport
	if err := json.Unmarshal([]byte(mustRun(t, "demo", "--sizes", "4KiB,1MiB,96MiB", "--json")), &rep); err != nil {
		t.Fatal(err)
	}
	if !rep.OK || rep.Backend != "cuda" || rep.Device != dev.UUID().String() || rep.GPUShare != "ipc" || len(rep.Objects) != 3 {
		t.Fatalf("demo report: %+v", rep)
	}
	for _, o := range rep.Objects {
		if !o.OK || o.CopyGBps <= 0 {
			t.Errorf("object %+v", o)
		}
	}
	human := mustRun(t, "demo", "--sizes", "64KiB")
	if !strings.Contains(human, "objects on GPU "+dev.UUID().String()) || !strings.Contains(human, "GPU copy from mapping") {
		t.Errorf("demo output:\n%s", human)
	}
	// --device host forces host objects, even with a GPU. (A fresh report:
	// json.Unmarshal into a used slice keeps fields the JSON omits.)
	var hostRep diag.DemoReport
	if err := json.Unmarshal([]byte(mustRun(t, "demo", "--sizes", "64KiB", "--device", "host", "--json")), &hostRep); err != nil {
		t.Fatal(err)
	}
	if !hostRep.OK || hostRep.Device != "host" || len(hostRep.Objects) != 1 || hostRep.Objects[0].CopyGBps != 0 {
		t.Fatalf("demo --device host: %+v", hostRep)
	}
}

// demo --gpu-share fd shares the GPU arenas as descriptors, and says so.
func TestGPUDemoFD(t *testing.T) {
	dev := testutil.RequireGPU(t)
	var rep diag.DemoReport
	if err := json.Unmarshal([]byte(mustRun(t, "demo", "--gpu-share", "fd", "--sizes", "4KiB,1MiB,96MiB", "--json")), &rep); err != nil {
		t.Fatal(err)
	}
	if !rep.OK || rep.Backend != "cuda" || rep.Device != dev.UUID().String() || rep.GPUShare != "fd" || len(rep.Objects) != 3 {
		t.Fatalf("demo report: %+v", rep)
	}
	for _, o := range rep.Objects {
		if !o.OK || o.CopyGBps <= 0 {
			t.Errorf("object %+v", o)
		}
	}
	if human := mustRun(t, "demo", "--gpu-share", "fd", "--sizes", "64KiB"); !strings.Contains(human, "GPU sharing: fd") {
		t.Errorf("demo output:\n%s", human)
	}
}

// TestBenchIPC runs 'cudaipc bench ipc' small on a GPU, its exporter
// process (this binary as 'cudaipc diag-helper') included.
func TestBenchIPC(t *testing.T) {
	testutil.RequireGPU(t)
	out, errOut, err := storeCLI(t, "bench", "ipc", "--size", "67108864", "--iters", "20", "--bw-iters", "5", "--json")
	if err != nil {
		t.Fatalf("%v\n%s", err, errOut)
	}
	var r struct {
		GPUs    int `json:"gpus"`
		Metrics map[string]struct {
			P50, P99, Ratio float64
			N               int
		} `json:"metrics"`
	}
	if err := json.Unmarshal([]byte(out), &r); err != nil {
		t.Fatalf("%v\n%s", err, out)
	}
	for _, k := range []string{"export_first", "export_again", "open_cold_1mib", "close_1mib", "open_cold_large", "close_large",
		"open_already_open", "close_decrement", "event_open", "d2d_local", "ipc_read", "host_staged", "host_staged_dma"} {
		m, ok := r.Metrics[k]
		if !ok || m.P50 <= 0 || m.P99 <= 0 || m.N == 0 {
			t.Errorf("%s: %+v", k, m)
		}
	}
	if m := r.Metrics["ipc_read"]; m.Ratio < 0.5 {
		t.Errorf("ipc_read at %.2fx the in-process copy (docs/driver-facts.md: no loss)", m.Ratio)
	}
	if r.Metrics["host_staged"].P50 >= r.Metrics["ipc_read"].P50 {
		t.Errorf("host staging faster than IPC: %+v", r.Metrics)
	}
	if r.GPUs > 1 {
		if m := r.Metrics["peer_ipc"]; m.Ratio < 0.5 {
			t.Errorf("peer_ipc: %+v", m)
		}
	}
	t.Log("\n" + mustRun(t, "bench", "ipc", "--size", "1048576", "--iters", "2", "--bw-iters", "1"))
}

package cli

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"reflect"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/cudaipc/cudaipc"
	"github.com/cudaipc/cudaipc/client"
	"github.com/cudaipc/cudaipc/cmd/cudaipc/internal/diag"
	"github.com/cudaipc/cudaipc/internal/testutil"
	"github.com/cudaipc/cudaipc/store"
)

// mainEnv makes this test binary act as the cudaipc command, for the
// processes that 'cudaipc demo' starts by re-executing itself.
const mainEnv = "CUDAIPC_CLI_TEST_MAIN"

// runAsCLIMain runs the CLI as main would when this test binary was
// started as a demo worker; TestMain (info_test.go) calls it first.
func runAsCLIMain() bool {
	if os.Getenv(mainEnv) != "1" {
		os.Setenv(mainEnv, "1") // inherited by the demo's workers
		return false
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	err := Run(ctx, os.Args[1:], os.Stdout, os.Stderr)
	writePeakRSS()
	if err != nil {
		os.Stderr.WriteString(Message(err) + "\n")
		os.Exit(ExitCode(err))
	}
	return true
}

// storeCLI runs the CLI in-process and returns its output.
func storeCLI(t *testing.T, args ...string) (stdout, stderr string, err error) {
	t.Helper()
	var o, e bytes.Buffer
	err = runIO(context.Background(), args, strings.NewReader(""), &o, &e)
	return o.String(), e.String(), err
}

func mustRun(t *testing.T, args ...string) string {
	t.Helper()
	out, errOut, err := storeCLI(t, args...)
	if err != nil {
		t.Fatalf("cudaipc %s: %v\nstderr: %s", strings.Join(args, " "), err, errOut)
	}
	return out
}

// serve runs 'cudaipc serve' on a fresh socket until the test ends.
func serve(t *testing.T, args ...string) string {
	t.Helper()
	sock := filepath.Join(t.TempDir(), "store.sock")
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	wg.Add(1)
	var errOut bytes.Buffer
	var serr error
	go func() {
		defer wg.Done()
		serr = Run(ctx, append([]string{"serve", "--socket", sock, "--log-level", "warn"}, args...), &bytes.Buffer{}, &errOut)
	}()
	t.Cleanup(func() {
		cancel()
		wg.Wait()
		if serr != nil {
			t.Errorf("serve: %v\n%s", serr, errOut.String())
		}
	})
	waitServing(t, sock)
	return sock
}

// waitServing waits until the daemon on sock answers ls.
func waitServing(t *testing.T, sock string) {
	t.Helper()
	testutil.Eventually(t, testutil.Wait, func() error {
		_, _, err := storeCLI(t, "ls", "--socket", sock)
		return err
	})
}

func TestMetricsAddr(t *testing.T) {
	if got := metricsAddr("9464"); got != "127.0.0.1:9464" {
		t.Errorf("metricsAddr: %q", got)
	}
	if got := metricsAddr("0.0.0.0:9464"); got != "0.0.0.0:9464" {
		t.Errorf("metricsAddr: %q", got)
	}
}

func TestNoDaemon(t *testing.T) {
	sock := filepath.Join(t.TempDir(), "none.sock")
	_, _, err := storeCLI(t, "ls", "--socket", sock)
	if err == nil || !strings.Contains(err.Error(), "start one with 'cudaipc serve'") || !strings.Contains(err.Error(), sock) {
		t.Fatalf("ls without a daemon: %v", err)
	}
	t.Setenv("CUDAIPC_SOCKET", sock)
	if _, _, err := storeCLI(t, "stat", "x"); err == nil || !strings.Contains(err.Error(), sock) {
		t.Fatalf("CUDAIPC_SOCKET not used: %v", err)
	}
}

func TestStoreCommands(t *testing.T) {
	sock := serve(t)
	dir := t.TempDir()
	data := make([]byte, 300<<10+17)
	rand.Read(data)
	in := filepath.Join(dir, "in.bin")
	if err := os.WriteFile(in, data, 0o600); err != nil {
		t.Fatal(err)
	}
	out := mustRun(t, "put", in, "--name", "blob", "--socket", sock)
	if !strings.Contains(out, `"blob"`) {
		t.Errorf("put said %q", out)
	}
	if _, _, err := storeCLI(t, "put", in, "--name", "blob", "--socket", sock); err == nil || !strings.Contains(err.Error(), "cudaipc rm") {
		t.Errorf("put of an existing name: %v", err)
	}

	if got := mustRun(t, "get", "blob", "--socket", sock); got != string(data) {
		t.Errorf("get to stdout: %d bytes, want %d", len(got), len(data))
	}
	outFile := filepath.Join(dir, "out.bin")
	mustRun(t, "get", "blob", "-o", outFile, "--socket", sock)
	if got, err := os.ReadFile(outFile); err != nil || !bytes.Equal(got, data) {
		t.Errorf("get -o: %d bytes, %v", len(got), err)
	}

	var info map[string]any
	if err := json.Unmarshal([]byte(mustRun(t, "stat", "blob", "--json", "--socket", sock)), &info); err != nil {
		t.Fatal(err)
	}
	for _, k := range []string{"name", "size", "device", "sealed", "leases", "region"} {
		if _, ok := info[k]; !ok {
			t.Errorf("stat --json lacks %q: %v", k, info)
		}
	}
	if info["name"] != "blob" || info["size"] != float64(len(data)) || info["sealed"] != true || info["leases"] != float64(0) || info["device"] != "host" {
		t.Errorf("stat --json: %v", info)
	}
	if human := mustRun(t, "stat", "blob", "--socket", sock); !strings.Contains(human, "sealed:") {
		t.Errorf("stat: %q", human)
	}

	var list []map[string]any
	if err := json.Unmarshal([]byte(mustRun(t, "ls", "--json", "--socket", sock)), &list); err != nil {
		t.Fatal(err)
	}
	if len(list) != 1 || list[0]["name"] != "blob" {
		t.Errorf("ls --json: %v", list)
	}
	if table := mustRun(t, "ls", "--socket", sock); !strings.Contains(table, "blob") || !strings.HasPrefix(table, "NAME") {
		t.Errorf("ls: %q", table)
	}

	// From standard input.
	var o, e bytes.Buffer
	if err := runIO(context.Background(), []string{"put", "-", "--name", "piped", "--socket", sock}, bytes.NewReader(data[:1000]), &o, &e); err != nil {
		t.Fatalf("put -: %v\n%s", err, e.String())
	}
	if got := mustRun(t, "get", "piped", "--socket", sock); got != string(data[:1000]) {
		t.Errorf("put - then get: %d bytes", len(got))
	}

	mustRun(t, "rm", "blob", "piped", "--socket", sock)
	if _, _, err := storeCLI(t, "stat", "blob", "--socket", sock); err == nil || !strings.Contains(err.Error(), "cudaipc ls") {
		t.Errorf("stat after rm: %v", err)
	}
	if got := mustRun(t, "ls", "--json", "--socket", sock); strings.TrimSpace(got) != "[]" {
		t.Errorf("ls --json of an empty store: %q", got)
	}
	if _, _, err := storeCLI(t, "get", "blob", "--timeout", "500ms", "--socket", sock); err == nil || !strings.Contains(err.Error(), "not sealed within") {
		t.Errorf("get with timeout: %v", err)
	}
}

func TestServeDetectsRunningDaemon(t *testing.T) {
	sock := serve(t)
	_, _, err := storeCLI(t, "serve", "--socket", sock, "--log-level", "error")
	if err == nil || !strings.Contains(err.Error(), "already running") {
		t.Fatalf("second serve on one socket: %v", err)
	}
}

func TestDemo(t *testing.T) {
	out := mustRun(t, "demo", "--sizes", "4KiB,1MiB,3MiB", "--json")
	var rep diag.DemoReport
	if err := json.Unmarshal([]byte(out), &rep); err != nil {
		t.Fatalf("%v\n%s", err, out)
	}
	// Without a GPU the demo is all host memory; with one (the auto
	// backend picks cuda) TestGPUDemo checks it further.
	wantBackend, wantDevice := "host", "host"
	if n, err := cudaipc.DeviceCount(); err == nil && n > 0 {
		wantBackend, wantDevice = "cuda", "GPU-"
	}
	if !rep.OK || len(rep.Objects) != 3 || rep.Backend != wantBackend || !strings.HasPrefix(rep.Device, wantDevice) || rep.ProducerPID == rep.ConsumerPID {
		t.Fatalf("demo report: %+v", rep)
	}
	for _, o := range rep.Objects {
		if !o.OK || len(o.SHA256) != 64 {
			t.Errorf("object %+v", o)
		}
	}
	human := mustRun(t, "demo", "--sizes", "64KiB")
	if !strings.Contains(human, "every byte matched") {
		t.Errorf("demo output:\n%s", human)
	}
}

func TestBenchStore(t *testing.T) {
	out := mustRun(t, "bench", "store", "--clients", "2", "--duration", "100ms", "--size", "8KiB", "--json")
	var res map[string]any
	if err := json.Unmarshal([]byte(out), &res); err != nil {
		t.Fatalf("%v\n%s", err, out)
	}
	for _, k := range []string{"ops_per_sec", "p50_us", "p99_us"} {
		if v, ok := res[k].(float64); !ok || v <= 0 {
			t.Errorf("%s = %v", k, res[k])
		}
	}
	// Against a running daemon too.
	sock := serve(t)
	out = mustRun(t, "bench", "store", "--clients", "1", "--duration", "50ms", "--socket", sock)
	if !strings.Contains(out, "get+release cycles") {
		t.Errorf("bench store: %q", out)
	}
}

func TestServeStopsOnSIGTERM(t *testing.T) {
	sock := filepath.Join(t.TempDir(), "store.sock")
	var errOut bytes.Buffer
	cmd := exec.Command(os.Args[0], "serve", "--socket", sock) // runs as cudaipc (runAsCLIMain)
	cmd.Stderr = &errOut
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	waitServing(t, sock)
	mustRun(t, "put", os.Args[0], "--name", "self", "--socket", sock)
	if err := cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	if err := cmd.Wait(); err != nil {
		t.Fatalf("serve after SIGTERM: %v\n%s", err, errOut.String())
	}
	if _, err := os.Lstat(sock); !os.IsNotExist(err) {
		t.Errorf("socket left behind after a clean shutdown: %v", err)
	}
	if !strings.Contains(errOut.String(), "store daemon stopped") {
		t.Errorf("serve's log:\n%s", errOut.String())
	}
}

func TestServeMetrics(t *testing.T) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	port := strconv.Itoa(l.Addr().(*net.TCPAddr).Port)
	l.Close() // a small window in which another process could take the port
	sock := serve(t, "--config", writeConfig(t, "metrics = \""+port+"\"\n"))
	data := testutil.RandomBytes(uint64(time.Now().UnixNano()), 10000)
	file := filepath.Join(t.TempDir(), "in")
	if err := os.WriteFile(file, data, 0o600); err != nil {
		t.Fatal(err)
	}
	if _, _, err := storeCLI(t, "put", file, "--name", "m1", "--socket", sock); err != nil {
		t.Fatal(err)
	}
	var body []byte
	testutil.Eventually(t, testutil.Wait, func() error { // the listener starts beside the socket
		resp, err := http.Get("http://127.0.0.1:" + port + "/metrics")
		if err != nil {
			return fmt.Errorf("no metrics on port %s: %w", port, err)
		}
		defer resp.Body.Close()
		body, err = io.ReadAll(resp.Body)
		if err != nil {
			return fmt.Errorf("metrics on port %s: %w", port, err)
		}
		if resp.StatusCode != http.StatusOK {
			return fmt.Errorf("metrics on port %s: %s", port, resp.Status)
		}
		return nil
	})
	for _, want := range []string{
		`cudaipc_store_objects{device="host",state="sealed"} 1`,
		`cudaipc_store_requests_total{op="create",result="ok"} 1`,
		`cudaipc_store_bytes_used{device="host"}`,
	} {
		if !strings.Contains(string(body), want) {
			t.Errorf("metrics lack %s", want)
		}
	}
}

// --gpu-share takes ipc or fd; anything else fails before a store starts.
// Without a GPU, fd is accepted and does not matter to the host backend.
func TestGPUShareFlag(t *testing.T) {
	for _, cmd := range []string{"serve", "demo"} {
		_, _, err := run(t, cmd, "--gpu-share", "bogus", "--socket", filepath.Join(t.TempDir(), "s.sock"))
		if err == nil || !strings.Contains(err.Error(), "--gpu-share") || !strings.Contains(err.Error(), `"bogus"`) {
			t.Errorf("%s --gpu-share bogus: %v", cmd, err)
		}
	}
	sock := serve(t, "--backend", "host", "--gpu-share", "fd")
	mustRun(t, "ls", "--socket", sock)
}

// TestGetTimeoutStoppedDaemon checks that get's --timeout bounds the whole
// command, the dial included, against a daemon that stopped answering.
func TestGetTimeoutStoppedDaemon(t *testing.T) {
	sock := filepath.Join(t.TempDir(), "store.sock")
	cmd := exec.Command(os.Args[0], "serve", "--socket", sock, "--log-level", "warn") // runs as cudaipc (runAsCLIMain)
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() {
		cmd.Process.Signal(syscall.SIGCONT)
		cmd.Process.Signal(syscall.SIGTERM)
		cmd.Wait()
	}()
	waitServing(t, sock)
	mustRun(t, "put", os.Args[0], "--name", "self", "--socket", sock)
	testutil.Stop(t, cmd.Process.Pid)
	_, _, err := storeCLI(t, "get", "self", "--timeout", "300ms", "--socket", sock, "-o", filepath.Join(t.TempDir(), "out"))
	if err == nil || !strings.Contains(err.Error(), "did not answer within --timeout 300ms") {
		t.Errorf("get --timeout against a stopped daemon: %v", err)
	}
}

// A bare cudaipc, "cudaipc help" and "cudaipc help COMMAND" print the usage
// (all of it, every command named) and succeed; every flag with a default
// that its placeholder hides says it in its help.
func TestHelp(t *testing.T) {
	for _, args := range [][]string{nil, {"help"}, {"--help"}} {
		out := mustRun(t, args...)
		for _, cmd := range []string{"info", "doctor", "serve", "put", "get", "ls", "stat", "rm", "dump", "demo", "bench ipc", "bench store", "bench put"} {
			if !strings.Contains(out, "\n  "+cmd+" ") {
				t.Errorf("cudaipc %s: usage lacks %q:\n%s", strings.Join(args, " "), cmd, out)
			}
		}
	}
	out := mustRun(t, "help", "bench", "ipc")
	for _, want := range []string{"Usage: cudaipc bench ipc", "(default 1GiB)", "(default 200)", "(default 20)"} {
		if !strings.Contains(out, want) {
			t.Errorf("cudaipc help bench ipc lacks %q:\n%s", want, out)
		}
	}
}

// serve logs the capacity it serves with, once: the default resolved, not
// the flag's 0.
func TestServeLogsCapacity(t *testing.T) {
	sock := filepath.Join(t.TempDir(), "store.sock")
	ctx, cancel := context.WithCancel(context.Background())
	var logs testutil.SyncBuffer
	done := make(chan error, 1)
	go func() { done <- Run(ctx, []string{"serve", "--socket", sock, "--backend", "host"}, io.Discard, &logs) }()
	waitServing(t, sock)
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if n := strings.Count(logs.String(), " capacity="); n != 1 || !strings.Contains(logs.String(), fmt.Sprintf(" capacity=%d ", store.DefaultCapacity)) {
		t.Fatalf("want one capacity=%d in the log:\n%s", store.DefaultCapacity, logs.String())
	}
}

// get of a name with no sealed object fails at once unless asked to wait;
// with --wait it says on stderr what it waits for (stderr is no terminal
// here) and writes the object once it is put.
func TestGetWait(t *testing.T) {
	sock := serve(t)
	dir := t.TempDir()
	out := filepath.Join(dir, "out")
	start := time.Now()
	if _, _, err := storeCLI(t, "get", "later", "-o", out, "--socket", sock); err == nil || !strings.Contains(err.Error(), "no such object") || !errors.Is(err, client.ErrNotFound) {
		t.Fatalf("get of a name nobody put: %v, want ErrNotFound at once", err)
	}
	t.Logf("failed after %v", time.Since(start))
	data := testutil.RandomBytes(uint64(time.Now().UnixNano()), 5000)
	in := filepath.Join(dir, "in")
	if err := os.WriteFile(in, data, 0o600); err != nil {
		t.Fatal(err)
	}
	var stderr testutil.SyncBuffer
	done := make(chan error, 1)
	go func() {
		done <- runIO(context.Background(), []string{"get", "later", "--wait", "-o", out, "--socket", sock}, strings.NewReader(""), io.Discard, &stderr)
	}()
	testutil.Eventually(t, testutil.Wait, func() error {
		if !strings.Contains(stderr.String(), `waiting for "later" to be sealed, until Ctrl-C`) {
			return fmt.Errorf("get --wait said %q on stderr", stderr.String())
		}
		return nil
	})
	mustRun(t, "put", in, "--name", "later", "--socket", sock)
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if got, err := os.ReadFile(out); err != nil || !bytes.Equal(got, data) {
		t.Fatalf("get --wait wrote %d bytes (%v), not the %d put", len(got), err, len(data))
	}
}

// Every flag whose placeholder hides its default (kong shows a default
// only in place of a placeholder) says the default in its help: "(default
// ${default})", or what 0 means for a flag whose default is 0.
func TestFlagsShowDefaults(t *testing.T) {
	var walk func(typ reflect.Type, path string)
	walk = func(typ reflect.Type, path string) {
		for i := range typ.NumField() {
			f := typ.Field(i)
			_, isCmd := f.Tag.Lookup("cmd")
			if f.Type.Kind() == reflect.Struct && (isCmd || f.Anonymous) {
				walk(f.Type, path+" "+strings.ToLower(f.Name))
				continue
			}
			def, hasDef := f.Tag.Lookup("default")
			if !hasDef || f.Tag.Get("placeholder") == "" || def == "" {
				continue
			}
			help := f.Tag.Get("help")
			if !strings.Contains(help, "default") && !strings.Contains(help, "(0:") {
				t.Errorf("cudaipc%s --%s (default %q): the help does not say the default: %q", path, f.Name, def, help)
			}
		}
	}
	walk(reflect.TypeOf(cliRoot{}), "")
}

package cli

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/cudaipc/cudaipc/internal/testutil"

	"github.com/cudaipc/cudaipc/client"
	"github.com/cudaipc/cudaipc/internal/cu"
)

// TestInfoJSONWithoutDriver runs 'info --json' as a process whose driver
// cannot load: stdout must still be one JSON object, with the reason.
func TestInfoJSONWithoutDriver(t *testing.T) {
	cmd := exec.Command(os.Args[0], "info", "--json")
	cmd.Env = append(os.Environ(), mainEnv+"=1", cu.EnvLibrary+"=/nonexistent/libcuda.so.1")
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	err := cmd.Run()
	var ee *exec.ExitError
	if !errors.As(err, &ee) || ee.ExitCode() != 1 {
		t.Fatalf("info --json without a driver: %v (want exit 1)\nstderr: %s", err, stderr.String())
	}
	var r infoReport
	if err := json.Unmarshal(stdout.Bytes(), &r); err != nil {
		t.Fatalf("stdout is not JSON: %v\n%q", err, stdout.String())
	}
	if !strings.Contains(r.Error, "/nonexistent/libcuda.so.1") || r.Devices == nil || len(r.Devices) != 0 {
		t.Fatalf("report without a driver: %+v", r)
	}
}

// openPTY returns the two ends of a new pseudo-terminal.
func openPTY(t *testing.T) (ptmx, tty *os.File) {
	t.Helper()
	m, err := os.OpenFile("/dev/ptmx", os.O_RDWR|unix.O_NOCTTY, 0)
	if err != nil {
		t.Skipf("no pseudo-terminals here: %v", err)
	}
	t.Cleanup(func() { m.Close() })
	if err := unix.IoctlSetPointerInt(int(m.Fd()), unix.TIOCSPTLCK, 0); err != nil {
		t.Skipf("unlockpt: %v", err)
	}
	n, err := unix.IoctlGetInt(int(m.Fd()), unix.TIOCGPTN)
	if err != nil {
		t.Skipf("ptsname: %v", err)
	}
	s, err := os.OpenFile("/dev/pts/"+strconv.Itoa(n), os.O_RDWR|unix.O_NOCTTY, 0)
	if err != nil {
		t.Skipf("opening the terminal end: %v", err)
	}
	t.Cleanup(func() { s.Close() })
	return m, s
}

// TestGetRefusesTerminal: 'get NAME' with stdout on a terminal writes
// nothing there and says what to do, as dump does; /dev/null, another
// character device, is not a terminal.
func TestGetRefusesTerminal(t *testing.T) {
	sock := serve(t)
	dir := t.TempDir()
	data := make([]byte, 5000)
	rand.Read(data)
	in := filepath.Join(dir, "in.bin")
	if err := os.WriteFile(in, data, 0o600); err != nil {
		t.Fatal(err)
	}
	mustRun(t, "put", in, "--name", "bin", "--socket", sock)
	_, tty := openPTY(t)
	var errb bytes.Buffer
	err := runIO(context.Background(), []string{"get", "bin", "--socket", sock}, strings.NewReader(""), tty, &errb)
	if err == nil || ExitCode(err) != 2 || !strings.Contains(err.Error(), "-o FILE") {
		t.Fatalf("get to a terminal: %v (exit %d)", err, ExitCode(err))
	}
	devnull, err := os.OpenFile(os.DevNull, os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer devnull.Close()
	if err := runIO(context.Background(), []string{"get", "bin", "--socket", sock}, strings.NewReader(""), devnull, &errb); err != nil {
		t.Fatalf("get to /dev/null: %v", err)
	}
}

// TestInvalidUTF8Name: a name that is not UTF-8 gets the client's error,
// however it is given, and no object takes a mangled name.
func TestInvalidUTF8Name(t *testing.T) {
	sock := serve(t)
	in := filepath.Join(t.TempDir(), "in.bin")
	if err := os.WriteFile(in, []byte("abc"), 0o600); err != nil {
		t.Fatal(err)
	}
	bad := "a\xffb"
	for _, args := range [][]string{
		{"put", in, "--name", bad},
		{"put", in, "--name=" + bad},
		{"get", bad, "-o", filepath.Join(t.TempDir(), "out")},
		{"stat", bad},
		{"rm", bad},
	} {
		_, _, err := storeCLI(t, append(args, "--socket", sock)...)
		if !errors.Is(err, client.ErrInvalid) || !strings.Contains(err.Error(), "not valid UTF-8") {
			t.Errorf("%s: %v, want the client's invalid-name error", args[0], err)
		}
	}
	if out := mustRun(t, "ls", "--socket", sock, "--json"); strings.Contains(out, "\ufffd") || strings.Contains(out, `"name"`) {
		t.Errorf("an object was stored: %s", out)
	}
}

// peakRSSEnv names the file a CLI child (runAsCLIMain) writes its peak
// resident set to, in bytes, before it exits. The child's rusage cannot
// tell it: os/exec starts children with vfork (CLONE_VM), and at exec the
// kernel folds the high-water mark of the address space the child leaves,
// the test process's, into the child's ru_maxrss, so a test process that
// holds a CUDA context (~480 MiB resident on an H200) shows as every
// child's peak. VmHWM is the child's own address space's.
const peakRSSEnv = "CUDAIPC_CLI_TEST_PEAK_RSS"

// writePeakRSS writes this process's VmHWM, in bytes, to the file named by
// peakRSSEnv, if set.
func writePeakRSS() {
	path := os.Getenv(peakRSSEnv)
	if path == "" {
		return
	}
	status, err := os.ReadFile("/proc/self/status")
	if err != nil {
		return
	}
	for line := range strings.Lines(string(status)) {
		if kb, ok := strings.CutPrefix(line, "VmHWM:"); ok {
			n, err := strconv.ParseInt(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(kb), "kB")), 10, 64)
			if err == nil {
				_ = os.WriteFile(path, []byte(strconv.FormatInt(n<<10, 10)), 0o600)
			}
			return
		}
	}
}

// putFromPipe runs 'cudaipc put - ARGS' as a process whose standard input
// is a pipe fed with random bytes, up to limit bytes or until the reader
// stops, and returns its error output, its exit code and its own peak RSS
// (VmHWM: see peakRSSEnv).
func putFromPipe(t *testing.T, limit int64, args ...string) (stderr string, code int, maxRSS int64) {
	t.Helper()
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	peakFile := filepath.Join(t.TempDir(), "peak-rss")
	cmd := exec.Command(os.Args[0], append([]string{"put", "-"}, args...)...)
	cmd.Env = append(os.Environ(), mainEnv+"=1", peakRSSEnv+"="+peakFile)
	cmd.Stdin = r
	var errb bytes.Buffer
	cmd.Stderr = &errb
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	r.Close()
	fed := make(chan struct{})
	go func() {
		defer close(fed)
		defer w.Close()
		buf := make([]byte, 1<<20)
		rand.Read(buf)
		for n := int64(0); n < limit; n += int64(len(buf)) {
			if _, err := w.Write(buf); err != nil {
				return // the reader stopped: EPIPE
			}
		}
	}()
	err = cmd.Wait()
	w.Close() // unblocks the feeder if the child died holding the pipe
	<-fed
	var ee *exec.ExitError
	if err != nil && !errors.As(err, &ee) {
		t.Fatal(err)
	}
	peak, err := os.ReadFile(peakFile)
	if err != nil {
		t.Fatalf("put %v (exit %d) reported no peak RSS: %v; stderr: %s", args, cmd.ProcessState.ExitCode(), err, errb.String())
	}
	maxRSS, err = strconv.ParseInt(string(peak), 10, 64)
	if err != nil {
		t.Fatal(err)
	}
	return errb.String(), cmd.ProcessState.ExitCode(), maxRSS
}

// TestPutEndlessPipe: put from a pipe that does not end fails cleanly,
// with or without --size, and its memory stays bounded; a sized pipe
// streams.
func TestPutEndlessPipe(t *testing.T) {
	sock := serve(t)
	// "Endless": far more than put may buffer, and than its RSS bound.
	const endless = 1 << 30
	// Well under the endless input either way: the race detector's shadow
	// memory roughly quadruples the child's resident set.
	rssBound := int64(160 << 20)
	if testutil.RaceEnabled {
		rssBound = 640 << 20
	}
	for _, tc := range []struct {
		name string
		args []string
		want string
	}{
		{"unsized", []string{"--name", "a"}, "give --size"},
		{"sized", []string{"--name", "b", "--size", "8MiB"}, "longer than --size"},
	} {
		errOut, code, rss := putFromPipe(t, endless, append(tc.args, "--socket", sock)...)
		if code != 1 || !strings.Contains(errOut, tc.want) || !strings.Contains(errOut, "nothing was stored") {
			t.Errorf("%s: exit %d, stderr %q; want exit 1 and %q", tc.name, code, errOut, tc.want)
		}
		if rss > rssBound {
			t.Errorf("%s: peak RSS %d MiB, want at most %d MiB", tc.name, rss>>20, rssBound>>20)
		}
		t.Logf("%s: peak RSS %d MiB", tc.name, rss>>20)
	}
	if out := mustRun(t, "ls", "--socket", sock, "--json"); strings.Contains(out, `"name"`) {
		t.Errorf("a failed put left an object: %s", out)
	}
	// A pipe of exactly --size bytes streams into the object. The host
	// object is filled in place, through the child's mapping of the arena,
	// so its peak RSS holds the object: the measure sees the child's memory.
	errOut, code, rss := putFromPipe(t, 96<<20, "--name", "c", "--size", "96MiB", "--socket", sock)
	if code != 0 {
		t.Fatalf("sized pipe: exit %d: %s", code, errOut)
	}
	if rss < 96<<20 {
		t.Errorf("a put that wrote 96 MiB through its mapping: peak RSS %d MiB, want at least 96 MiB", rss>>20)
	}
	if out := mustRun(t, "stat", "c", "--socket", sock, "--json"); !strings.Contains(out, `"size": 100663296`) {
		t.Errorf("stat of the streamed object: %s", out)
	}
	// A pipe shorter than --size fails and stores nothing.
	if errOut, code, _ := putFromPipe(t, 1<<20, "--name", "d", "--size", "2MiB", "--socket", sock); code != 1 || !strings.Contains(errOut, "ended after 1048576 of 2097152 bytes") {
		t.Errorf("short pipe: exit %d: %s", code, errOut)
	}
}

// asUser runs the CLI as another uid, in a process of its own: exe is a
// copy of this test binary that uid may execute.
func asUser(t *testing.T, exe string, uid uint32, stdin []byte, args ...string) (string, error) {
	t.Helper()
	cmd := exec.Command(exe, args...)
	cmd.Env = append(os.Environ(), mainEnv+"=1", "HOME=/")
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: uid, Gid: uid}}
	cmd.Stdin = bytes.NewReader(stdin)
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	if err := cmd.Run(); err != nil {
		return out.String(), fmt.Errorf("%v: %s", err, errb.String())
	}
	return out.String(), nil
}

// twoUserStore starts a daemon that admits uid 65534 in a directory that
// uid can reach, and a copy of this test binary it can run.
func twoUserStore(t *testing.T, args ...string) (sock, exe string) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root to run the CLI as another uid")
	}
	dir, err := os.MkdirTemp("", "cudaipc-users-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	if err := os.Chmod(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	exe = filepath.Join(dir, "cli.test")
	bin, err := os.ReadFile(os.Args[0])
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(exe, bin, 0o755); err != nil {
		t.Fatal(err)
	}
	sock = filepath.Join(dir, "store.sock")
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	var errOut bytes.Buffer
	go func() {
		done <- Run(ctx, append([]string{"serve", "--socket", sock, "--log-level", "warn", "--backend", "host", "--allow-uid", "65534"}, args...), &bytes.Buffer{}, &errOut)
	}()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("serve: %v\n%s", err, errOut.String())
		}
	})
	waitServing(t, sock)
	return sock, exe
}

// TestOwnersCannotBeImpersonated: uid 65534 and root each have their own
// namespace; neither can take, shadow or stand in for the other's object,
// and --owner pins whose bytes a get returns. Both directions.
func TestOwnersCannotBeImpersonated(t *testing.T) {
	sock, exe := twoUserStore(t)
	nobodyData, rootData := make([]byte, 7000), make([]byte, 9000)
	rand.Read(nobodyData)
	rand.Read(rootData)
	dir := t.TempDir()
	rootFile := filepath.Join(dir, "root.bin")
	if err := os.WriteFile(rootFile, rootData, 0o600); err != nil {
		t.Fatal(err)
	}
	// The attacker moves first, with the name root will use.
	if out, err := asUser(t, exe, 65534, nobodyData, "put", "-", "--name", "model/weights", "--shared", "--socket", sock); err != nil {
		t.Fatalf("put as 65534: %v %s", err, out)
	}
	// Root does not see it under the bare name, and can take the name.
	if _, _, err := storeCLI(t, "stat", "model/weights", "--socket", sock); !errors.Is(err, client.ErrNotFound) {
		t.Fatalf("root's stat of the attacker's name: %v, want not found", err)
	}
	mustRun(t, "put", rootFile, "--name", "model/weights", "--shared", "--socket", sock)
	get := func(args ...string) ([]byte, string, error) {
		out := filepath.Join(t.TempDir(), "out.bin")
		stdout, _, err := storeCLI(t, append([]string{"get", "-o", out, "--socket", sock}, args...)...)
		if err != nil {
			return nil, "", err
		}
		b, err := os.ReadFile(out)
		return b, stdout, err
	}
	if b, said, err := get("model/weights"); err != nil || !bytes.Equal(b, rootData) || !strings.Contains(said, "owner uid 0") {
		t.Fatalf("root's get of its own name: %v, %q, root's bytes %v", err, said, bytes.Equal(b, rootData))
	}
	if b, said, err := get("65534:model/weights"); err != nil || !bytes.Equal(b, nobodyData) || !strings.Contains(said, "owner uid 65534") {
		t.Fatalf("root's get of 65534's object: %v %q", err, said)
	}
	if b, _, err := get("model/weights", "--owner", "65534"); err != nil || !bytes.Equal(b, nobodyData) {
		t.Fatalf("get --owner 65534: %v", err)
	}
	if _, _, err := get("65534:model/weights", "--owner", "0"); !errors.Is(err, client.ErrInvalid) {
		t.Fatalf("a name of uid 65534 with --owner 0: %v, want invalid", err)
	}
	// ls shows both, each with its owner; root's own bare.
	var objs []client.ObjectInfo
	if err := json.Unmarshal([]byte(mustRun(t, "ls", "--json", "--socket", sock)), &objs); err != nil {
		t.Fatal(err)
	}
	owners := map[string]uint32{}
	for _, o := range objs {
		owners[o.Name] = o.OwnerUID
	}
	if len(owners) != 2 || owners["model/weights"] != 0 || owners["65534:model/weights"] != 65534 {
		t.Fatalf("root's ls: %v", owners)
	}

	// The other direction: 65534 reads its own by the bare name, root's by
	// root's qualified name, and cannot create in root's namespace.
	out, err := asUser(t, exe, 65534, nil, "get", "model/weights", "--socket", sock)
	if err != nil || out != string(nobodyData) {
		t.Fatalf("65534's get of its own name: %v (its own bytes: %v)", err, out == string(nobodyData))
	}
	if out, err = asUser(t, exe, 65534, nil, "get", "0:model/weights", "--owner", "root", "--socket", sock); err != nil || out != string(rootData) {
		t.Fatalf("65534's get of root's object: %v", err)
	}
	if _, err = asUser(t, exe, 65534, nobodyData, "put", "-", "--name", "0:model/weights2", "--socket", sock); err == nil || !strings.Contains(err.Error(), "namespace") {
		t.Fatalf("65534 creating in root's namespace: %v", err)
	}
	if _, err = asUser(t, exe, 65534, nil, "rm", "0:model/weights", "--socket", sock); err == nil {
		t.Fatal("65534 removed root's object")
	}
	if out, err = asUser(t, exe, 65534, nil, "stat", "0:model/weights", "--json", "--socket", sock); err != nil || !strings.Contains(out, `"owner_uid": 0`) || !strings.Contains(out, `"name": "0:model/weights"`) {
		t.Fatalf("65534's stat of root's object: %v\n%s", err, out)
	}
}

// TestPutNeverEvictsForRejectedInput: a put from a pipe longer than its
// --size, into a store that must evict to make room, fails without
// evicting anything; a pipe of exactly --size evicts as a put must.
func TestPutNeverEvictsForRejectedInput(t *testing.T) {
	sock := serve(t, "--capacity", "8MiB")
	victim := filepath.Join(t.TempDir(), "victim")
	data := make([]byte, 5<<20)
	rand.Read(data)
	if err := os.WriteFile(victim, data, 0o600); err != nil {
		t.Fatal(err)
	}
	mustRun(t, "put", victim, "--name", "victim", "--socket", sock)
	errOut, code, _ := putFromPipe(t, 6<<20, "--name", "long", "--size", "4MiB", "--socket", sock)
	if code != 1 || !strings.Contains(errOut, "longer than --size") || !strings.Contains(errOut, "nothing was stored or evicted") {
		t.Fatalf("a pipe longer than --size: exit %d, stderr %q", code, errOut)
	}
	if out := mustRun(t, "stat", "victim", "--socket", sock, "--json"); !strings.Contains(out, `"size": 5242880`) {
		t.Fatalf("the unrelated object is gone after a rejected put: %s", out)
	}
	if errOut, code, _ := putFromPipe(t, 4<<20, "--name", "fits", "--size", "4MiB", "--socket", sock); code != 0 {
		t.Fatalf("a pipe of exactly --size that needs room: exit %d: %s", code, errOut)
	}
	if out := mustRun(t, "ls", "--socket", sock, "--json"); strings.Contains(out, `"victim"`) || !strings.Contains(out, `"fits"`) {
		t.Errorf("after a put that needed room: %s", out)
	}
}

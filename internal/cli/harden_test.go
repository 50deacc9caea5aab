package cli

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/json"
	"errors"
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

// putFromPipe runs 'cudaipc put - ARGS' as a process whose standard input
// is a pipe fed with random bytes, up to limit bytes or until the reader
// stops, and returns its error output, its exit code and its peak RSS.
func putFromPipe(t *testing.T, limit int64, args ...string) (stderr string, code int, maxRSS int64) {
	t.Helper()
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(os.Args[0], append([]string{"put", "-"}, args...)...)
	cmd.Env = append(os.Environ(), mainEnv+"=1")
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
	ru := cmd.ProcessState.SysUsage().(*syscall.Rusage)
	return errb.String(), cmd.ProcessState.ExitCode(), ru.Maxrss << 10
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
	// A pipe of exactly --size bytes streams into the object.
	if errOut, code, _ := putFromPipe(t, 96<<20, "--name", "c", "--size", "96MiB", "--socket", sock); code != 0 {
		t.Fatalf("sized pipe: exit %d: %s", code, errOut)
	}
	if out := mustRun(t, "stat", "c", "--socket", sock, "--json"); !strings.Contains(out, `"size": 100663296`) {
		t.Errorf("stat of the streamed object: %s", out)
	}
	// A pipe shorter than --size fails and stores nothing.
	if errOut, code, _ := putFromPipe(t, 1<<20, "--name", "d", "--size", "2MiB", "--socket", sock); code != 1 || !strings.Contains(errOut, "ended after 1048576 of 2097152 bytes") {
		t.Errorf("short pipe: exit %d: %s", code, errOut)
	}
}

package client_test

// The tests here run the store daemon and most clients as separate
// processes: this test binary re-executed with CUDAIPC_TEST_ROLE naming
// what the child does (TestMain dispatches). Children talk to the test
// over stdin/stdout lines, so the tests wait on events, never on timers.

import (
	"bufio"
	"bytes"
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"runtime/pprof"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/cudaipc/cudaipc/client"
	"github.com/cudaipc/cudaipc/internal/seeddata"
	"github.com/cudaipc/cudaipc/internal/testutil"
	"github.com/cudaipc/cudaipc/store"
)

const roleEnv = "CUDAIPC_TEST_ROLE"

func TestMain(m *testing.M) {
	if role := os.Getenv(roleEnv); role != "" {
		if err := testutil.MountProcIfAsked(); err != nil {
			fmt.Fprintf(os.Stderr, "role %s: %v\n", role, err)
			os.Exit(3)
		}
		if err := runRole(role); err != nil {
			fmt.Fprintf(os.Stderr, "role %s: %v\n", role, err)
			os.Exit(1)
		}
		os.Exit(0)
	}
	os.Exit(m.Run())
}

func runRole(role string) error {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
	defer stop()
	sock := os.Getenv("CUDAIPC_SOCKET")
	if role == "daemon" {
		if path := os.Getenv("CPUPROFILE"); path != "" {
			// BenchmarkRoundTrip's -daemon-profile: stops at SIGTERM.
			f, err := os.Create(path)
			if err != nil {
				return err
			}
			defer f.Close()
			if err := pprof.StartCPUProfile(f); err != nil {
				return err
			}
			defer pprof.StopCPUProfile()
		}
		return runDaemon(ctx, sock)
	}
	out := bufio.NewWriter(os.Stdout)
	say := func(format string, a ...any) {
		fmt.Fprintf(out, format+"\n", a...)
		out.Flush()
	}
	if f := ownDialRoles[role]; f != nil {
		return f(ctx, sock, say)
	}
	c, err := client.Dial(ctx, sock)
	if role == "dialer" {
		// Reports how the dial went, then tries to create and seal.
		if err != nil {
			say("err %s", errClass(err))
			return nil
		}
		defer c.Close()
		o, err := c.Create(ctx, os.Getenv("NAME"), 4096, client.CreateOptions{})
		if err == nil {
			rand.Read(o.Bytes())
			err = o.Seal(ctx)
		}
		if err != nil {
			say("created-err %s", errClass(err))
			return nil
		}
		say("ok")
		return nil
	}
	if err != nil {
		return err
	}
	defer c.Close()
	name := os.Getenv("NAME")
	switch role {
	case "holder": // leases NAME, reports its hash, holds until killed
		l, err := c.Get(ctx, name)
		if err != nil {
			return err
		}
		say("leased %s", hash(l.Bytes()))
		io.Copy(io.Discard, os.Stdin)
		return l.Release()
	case "creator": // creates NAME, writes half of it, then waits to be killed
		size, _ := strconv.ParseInt(os.Getenv("SIZE"), 10, 64)
		o, err := c.Create(ctx, name, size, client.CreateOptions{})
		if err != nil {
			return err
		}
		rand.Read(o.Bytes()[:size/2])
		say("writing")
		io.Copy(io.Discard, os.Stdin)
		return nil
	case "producer": // creates, fills with random bytes and seals NAME (shared with other uids if SHARED=1)
		size, _ := strconv.ParseInt(os.Getenv("SIZE"), 10, 64)
		o, err := c.Create(ctx, name, size, client.CreateOptions{Shared: os.Getenv("SHARED") == "1"})
		if err != nil {
			return err
		}
		rand.Read(o.Bytes())
		h := hash(o.Bytes())
		if err := o.Seal(ctx); err != nil {
			return err
		}
		say("sealed %s", h)
		return nil
	}
	if f := gpuRoles[role]; f != nil {
		return f(ctx, c, say)
	}
	if f := fastRoles[role]; f != nil {
		return f(ctx, c, say)
	}
	return fmt.Errorf("unknown role %q", role)
}

func runDaemon(ctx context.Context, sock string) error {
	cfg := store.Config{Backend: "host"}
	if v := os.Getenv("BACKEND"); v != "" {
		cfg.Backend = v
	}
	cfg.GPUShare = os.Getenv("GPU_SHARE")
	if v := os.Getenv("CAPACITY"); v != "" {
		cfg.Capacity, _ = strconv.ParseInt(v, 10, 64)
	}
	cfg.NoEvict = os.Getenv("NOEVICT") == "1"
	if v := os.Getenv("DAEMON_SPIN"); v != "" { // BenchmarkRoundTrip: serve --experimental-spin
		if d, err := time.ParseDuration(v); err == nil {
			cfg.Spin = -1 // 0: never
			if d > 0 {
				cfg.Spin = d
			}
		}
	}
	cfg.KeepArenas, _ = strconv.ParseInt(os.Getenv("KEEP_ARENAS"), 10, 64)
	cfg.KeepVersions, _ = strconv.Atoi(os.Getenv("KEEP_VERSIONS"))
	cfg.MaxConnsPerUID, _ = strconv.Atoi(os.Getenv("MAX_CONNS_PER_UID"))
	cfg.MaxLeasesPerClient, _ = strconv.Atoi(os.Getenv("MAX_LEASES"))
	for _, f := range strings.Fields(os.Getenv("ALLOW_UIDS")) {
		u, _ := strconv.ParseUint(f, 10, 32)
		cfg.AllowUIDs = append(cfg.AllowUIDs, uint32(u))
	}
	st, err := store.New(cfg)
	if err != nil {
		return err
	}
	defer st.Close()
	return st.ListenAndServe(ctx, sock)
}

// errClass names the client sentinel err matches, for children to report.
func errClass(err error) string {
	for _, s := range []struct {
		name string
		err  error
	}{
		{"permission", client.ErrPermission}, {"gone", client.ErrStoreGone}, {"notfound", client.ErrNotFound},
		{"timeout", client.ErrTimeout}, {"full", client.ErrStoreFull}, {"exists", client.ErrExists},
	} {
		if errors.Is(err, s.err) {
			return s.name + " " + strconv.Quote(err.Error())
		}
	}
	return "other " + strconv.Quote(err.Error())
}

func hash(b []byte) string {
	h := sha256.Sum256(b)
	return hex.EncodeToString(h[:])
}

// proc is a child process of the test.
type proc struct {
	t      testing.TB
	cmd    *exec.Cmd
	in     io.WriteCloser
	out    *bufio.Reader
	stderr *testutil.SyncBuffer
	waited chan struct{}
	err    error
}

// spawn starts this test binary in role, with env added ("K=V").
func spawn(t testing.TB, role string, cred *syscall.Credential, env ...string) *proc {
	t.Helper()
	return spawnExe(t, os.Args[0], role, cred, env...)
}

// spawnExe is spawn with another copy of this test binary, for a child of
// another uid that may not reach the original.
func spawnExe(t testing.TB, exe, role string, cred *syscall.Credential, env ...string) *proc {
	t.Helper()
	var attr *syscall.SysProcAttr
	if cred != nil {
		attr = &syscall.SysProcAttr{Credential: cred}
	}
	return spawnAttr(t, exe, role, attr, env...)
}

// spawnAttr is spawnExe with the child's process attributes, e.g. new
// namespaces (testutil.NewNamespaces).
func spawnAttr(t testing.TB, exe, role string, attr *syscall.SysProcAttr, env ...string) *proc {
	t.Helper()
	cmd := exec.Command(exe, "-test.run=^$")
	cmd.Env = append(append(os.Environ(), roleEnv+"="+role), env...)
	cmd.SysProcAttr = attr
	p := &proc{t: t, cmd: cmd, stderr: &testutil.SyncBuffer{}, waited: make(chan struct{})}
	cmd.Stderr = p.stderr
	var err error
	if p.in, err = cmd.StdinPipe(); err != nil {
		t.Fatal(err)
	}
	// Not StdoutPipe: Wait, which runs concurrently, would close its read
	// end as soon as the child exits, losing the output of a quick child
	// ("file already closed").
	out, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	cmd.Stdout = w
	p.out = bufio.NewReader(out)
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	w.Close()
	t.Cleanup(func() { out.Close() })
	go func() { p.err = cmd.Wait(); close(p.waited) }()
	t.Cleanup(func() {
		p.cmd.Process.Kill()
		p.in.Close()
		<-p.waited
	})
	return p
}

// line reads the child's next line of output.
func (p *proc) line() string {
	p.t.Helper()
	s, err := p.out.ReadString('\n')
	if err != nil {
		<-p.waited
		p.t.Fatalf("%s: no more output (%v, exit %v); stderr:\n%s", p.cmd.Env[len(os.Environ())], err, p.err, p.stderr.String())
	}
	return strings.TrimSuffix(s, "\n")
}

// expect reads a line and checks that it starts with prefix; it returns
// the rest.
func (p *proc) expect(prefix string) string {
	p.t.Helper()
	l := p.line()
	if !strings.HasPrefix(l, prefix) {
		p.t.Fatalf("child said %q, want %q...; stderr:\n%s", l, prefix, p.stderr.String())
	}
	return strings.TrimSpace(strings.TrimPrefix(l, prefix))
}

func (p *proc) kill9() {
	p.t.Helper()
	if err := p.cmd.Process.Signal(syscall.SIGKILL); err != nil {
		p.t.Fatal(err)
	}
	<-p.waited
}

// daemon is a store daemon child process.
type daemon struct {
	*proc
	socket string
}

// startDaemon runs a daemon on sock and waits until it answers.
func startDaemon(t testing.TB, sock string, env ...string) *daemon {
	t.Helper()
	d := &daemon{proc: spawn(t, "daemon", nil, append(env, "CUDAIPC_SOCKET="+sock)...), socket: sock}
	d.waitAnswers(t, sock)
	return d
}

// waitAnswers waits until a dial of sock, the daemon p's socket as this
// process sees it, succeeds, and fails the test if p exits first.
func (p *proc) waitAnswers(t testing.TB, sock string) {
	t.Helper()
	testutil.Eventually(t, testutil.Wait, func() error {
		select {
		case <-p.waited:
			t.Fatalf("daemon exited (%v):\n%s", p.err, p.stderr.String())
		default:
		}
		c, err := client.Dial(context.Background(), sock)
		if err != nil {
			return err
		}
		c.Close()
		return nil
	})
}

// socketPath returns a socket path in a fresh directory.
func socketPath(t *testing.T) string {
	return filepath.Join(t.TempDir(), "store.sock")
}

func dial(t *testing.T, sock string) *client.Client {
	t.Helper()
	c, err := client.Dial(context.Background(), sock)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

// dialNoIdle dials a client that keeps no idle GPU arenas mapped: every
// mapping goes with its last Object or Lease.
func dialNoIdle(t *testing.T, sock string) *client.Client {
	t.Helper()
	c, err := client.DialOptions(context.Background(), sock, client.Options{MaxIdleArenas: -1})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

// put creates, fills with random bytes and seals an object, returning
// its contents.
func put(t *testing.T, c *client.Client, name string, size int64) []byte {
	t.Helper()
	ctx := context.Background()
	o, err := c.Create(ctx, name, size, client.CreateOptions{})
	if err != nil {
		t.Fatalf("create %s: %v", name, err)
	}
	rand.Read(o.Bytes())
	want := bytes.Clone(o.Bytes())
	if err := o.Seal(ctx); err != nil {
		t.Fatalf("seal %s: %v", name, err)
	}
	return want
}

// putLeased puts an object as put does and leases it; the lease is
// released when the test ends, if the test has not released it.
func putLeased(t *testing.T, c *client.Client, name string, size int64) ([]byte, *client.Lease) {
	t.Helper()
	want := put(t, c, name, size)
	l, err := c.Get(context.Background(), name)
	if err != nil {
		t.Fatalf("get %s: %v", name, err)
	}
	t.Cleanup(func() { l.Release() })
	return want, l
}

// checkGet leases name, fails the test unless the lease reads want, and
// releases it.
func checkGet(t *testing.T, c *client.Client, name string, want []byte) {
	t.Helper()
	l, err := c.Get(context.Background(), name)
	if err != nil {
		t.Fatalf("get %s: %v", name, err)
	}
	if !bytes.Equal(l.Bytes(), want) {
		t.Fatalf("%s: the lease reads other bytes than were sealed", name)
	}
	if err := l.Release(); err != nil {
		t.Fatalf("release %s: %v", name, err)
	}
}

// checkLeaseHeld fails the test unless l still reads want and then
// releases cleanly, after what happened meanwhile (after names it).
func checkLeaseHeld(t *testing.T, l *client.Lease, want []byte, after string) {
	t.Helper()
	if !bytes.Equal(l.Bytes(), want) {
		t.Fatalf("the lease's bytes changed after %s", after)
	}
	if err := l.Release(); err != nil {
		t.Fatalf("Release after %s: %v", after, err)
	}
}

// getBytes leases name, reads its size bytes (host or GPU object) and
// releases it.
func getBytes(t *testing.T, c *client.Client, name string, size int64) []byte {
	t.Helper()
	l, err := c.Get(context.Background(), name)
	if err != nil {
		t.Fatalf("get %s: %v", name, err)
	}
	defer l.Release()
	got := make([]byte, size)
	if _, err := l.ReadAt(got, 0); err != nil {
		t.Fatalf("read %s: %v", name, err)
	}
	return got
}

// stream is deterministic random content: every client can check an
// object written by any other.
func stream(seed uint64, name string, size int) []byte {
	return seeddata.Bytes(seeddata.Named(seed, name), size)
}

// waitLeases polls Stat until name has n leases (the daemon notices a
// dead client asynchronously; there is no event for it).
func waitLeases(t *testing.T, c *client.Client, name string, n int) {
	t.Helper()
	testutil.Eventually(t, testutil.Wait, func() error {
		info, err := c.Stat(context.Background(), name)
		if err != nil {
			t.Fatal(err)
		}
		if info.Leases != n {
			return fmt.Errorf("%s has %d leases, want %d", name, info.Leases, n)
		}
		return nil
	})
}

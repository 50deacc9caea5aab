package node_test

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/base64"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/cudaipc/cudaipc/client"
	"github.com/cudaipc/cudaipc/cluster"
	"github.com/cudaipc/cudaipc/cluster/internal/etcdtest"
	"github.com/cudaipc/cudaipc/internal/testutil"
	"github.com/cudaipc/cudaipc/transport/ucx"
)

// A control-port flood against a daemon process (the cudaipc binary) on
// loopback, as one unauthenticated program can make it: connections that
// send 64 random bytes and close, then connections held open from many
// source addresses. The daemon's log, its descriptors, its peers' pulls
// and its local gets are measured against bounds.

// Bounds of the flood and of what the daemon may spend on it.
const (
	floodConns   = 20000
	floodFor     = 20 * time.Second
	floodWorkers = 16
	// floodSources are the loopback addresses the connect-and-close
	// phase comes from (each has its own ports: 20,000 connections
	// closed by the client leave that many in TIME_WAIT).
	floodSources = 4
	// heldSources and heldPerSource make the held phase: more than the
	// daemon's bound per source and, together, more than its bound in
	// all.
	heldSources   = 40
	heldPerSource = 25
	heldFor       = cluster.HandshakeTimeout + 2*time.Second
	// floodLogLines bounds the lines the daemon writes from the flood's
	// start to its last summary.
	floodLogLines = 100
	// floodFdSlack is what the daemon's descriptors may grow beyond its
	// bound of pending connections: its peers' channels and UCX
	// endpoints, the arenas of their pulls.
	floodFdSlack = 48
	// measureFor is how long local gets are measured before the flood
	// and after it.
	measureFor = 3 * time.Second
)

// procDaemon is a cudaipc daemon process on loopback.
type procDaemon struct {
	name, adv, log string
	cmd            *exec.Cmd
	exited         chan struct{}
	c              *client.Client
}

func startProcDaemon(t *testing.T, srv *etcdtest.Server, dir, secretFile, name string) *procDaemon {
	t.Helper()
	bin := cudaipcBinary(t)
	port := freeLoopbackPort(t)
	d := &procDaemon{name: name, adv: net.JoinHostPort("127.0.0.1", strconv.Itoa(port)), log: filepath.Join(dir, name+".log"), exited: make(chan struct{})}
	f, err := os.Create(d.log)
	if err != nil {
		t.Fatal(err)
	}
	sock := filepath.Join(dir, name+".sock")
	// No --cluster-listen: the control port listens where it is
	// advertised, on 127.0.0.1 only.
	config := filepath.Join(dir, name+".toml")
	if err := os.WriteFile(config, []byte("cluster-prefix = \"/t/"+t.Name()+"/\"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	d.cmd = exec.Command(bin, "--socket", sock, "serve", "--backend", "host", "--capacity", "256MiB", "--config", config,
		"--cluster", "etcd://"+srv.HostPort(), "--node", name,
		"--cluster-secret", secretFile, "--cluster-advertise", d.adv, "--experimental-cluster-lanes", "1")
	d.cmd.Env = append(os.Environ(), testutil.UCXLoopbackEnv...)
	d.cmd.Stdout, d.cmd.Stderr = f, f
	d.cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := d.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() { _ = d.cmd.Wait(); f.Close(); close(d.exited) }()
	t.Cleanup(func() {
		_ = d.cmd.Process.Signal(syscall.SIGKILL)
		select {
		case <-d.exited:
		case <-time.After(10 * time.Second):
			t.Errorf("daemon %s did not exit within 10s of SIGKILL", name)
		}
	})
	ctx, cancel := context.WithTimeout(context.Background(), testutil.Wait)
	defer cancel()
	testutil.Eventually(t, testutil.Wait, func() error {
		select {
		case <-d.exited:
			t.Fatalf("daemon %s exited:\n%s", name, d.logText())
		default:
		}
		if !strings.Contains(d.logText(), "joined the cluster") {
			return fmt.Errorf("daemon %s has not joined", name)
		}
		c, err := client.Dial(ctx, sock)
		if err != nil {
			return err
		}
		d.c = c
		return nil
	})
	t.Cleanup(func() { d.c.Close() })
	return d
}

func freeLoopbackPort(t *testing.T) int {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port
}

func (d *procDaemon) logText() string {
	b, _ := os.ReadFile(d.log)
	return string(b)
}

// fds counts the daemon's open descriptors.
func (d *procDaemon) fds(t *testing.T) int {
	t.Helper()
	es, err := os.ReadDir(fmt.Sprintf("/proc/%d/fd", d.cmd.Process.Pid))
	if err != nil {
		t.Fatalf("daemon %s's descriptors: %v", d.name, err)
	}
	return len(es)
}

// putCluster puts name on d, cluster-visible, of size random bytes.
func (d *procDaemon) putCluster(t *testing.T, ctx context.Context, name string, size int) []byte {
	t.Helper()
	b := make([]byte, size)
	rand.Read(b)
	o, err := d.c.Create(ctx, name, int64(size), client.CreateOptions{Cluster: true})
	if err != nil {
		t.Fatalf("create %s on %s: %v", name, d.name, err)
	}
	copy(o.Bytes(), b)
	if err := o.Seal(ctx); err != nil {
		t.Fatalf("seal %s on %s: %v", name, d.name, err)
	}
	return b
}

// pull gets name on d (from another node) and checks its bytes.
func (d *procDaemon) pull(ctx context.Context, name string, want []byte) error {
	l, err := d.c.Get(ctx, name)
	if err != nil {
		return fmt.Errorf("get %s on %s: %w", name, d.name, err)
	}
	defer l.Release()
	if !bytes.Equal(l.Bytes(), want) {
		return fmt.Errorf("get %s on %s: the bytes differ", name, d.name)
	}
	return nil
}

// latencies records the durations of local gets by phase.
type latencies struct {
	mu    sync.Mutex
	phase string
	by    map[string][]time.Duration
}

func (l *latencies) set(p string) { l.mu.Lock(); l.phase = p; l.mu.Unlock() }

func (l *latencies) add(d time.Duration) {
	l.mu.Lock()
	l.by[l.phase] = append(l.by[l.phase], d)
	l.mu.Unlock()
}

func (l *latencies) p50(p string) (time.Duration, int) {
	l.mu.Lock()
	defer l.mu.Unlock()
	s := slices.Clone(l.by[p])
	if len(s) == 0 {
		return 0, 0
	}
	slices.Sort(s)
	return s[len(s)/2], len(s)
}

// loopbackFrom is a dialer whose connections come from 127.0.0.n.
func loopbackFrom(n int) *net.Dialer {
	return &net.Dialer{LocalAddr: &net.TCPAddr{IP: net.IPv4(127, 0, 0, byte(n))}, Timeout: 5 * time.Second}
}

// TestControlPortFlood: a flood of the control port by one unauthenticated
// program (floodConns connections in at most floodFor, each sending 64
// random bytes and closing, then heldSources×heldPerSource connections
// held open past the handshake deadline) costs the daemon at most
// floodLogLines lines of log, each refusal counted in them, and at most
// its bound of pending connections in descriptors, back near its baseline
// after; a peer daemon dialling it for the first time during each phase
// pulls its objects, and local gets keep working (their p50 is logged,
// quiet and during the flood).
func TestControlPortFlood(t *testing.T) {
	if err := ucx.Available(); err != nil {
		if os.Getenv("CUDAIPC_REQUIRE_UCX") == "1" || os.Getenv(etcdtest.EnvRequire) == "1" {
			t.Fatal(err)
		}
		t.Skip(err)
	}
	srv := etcdtest.Start(t)
	dir := t.TempDir()
	secretFile := filepath.Join(dir, "secret")
	key := make([]byte, 32)
	rand.Read(key)
	if err := os.WriteFile(secretFile, []byte(base64.StdEncoding.EncodeToString(key)), 0o600); err != nil {
		t.Fatal(err)
	}
	a := startProcDaemon(t, srv, dir, secretFile, "a")
	b := startProcDaemon(t, srv, dir, secretFile, "b")
	c := startProcDaemon(t, srv, dir, secretFile, "c")
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	// Listening where advertised only: another loopback address of the
	// host reaches no control port.
	_, port, _ := net.SplitHostPort(a.adv)
	if conn, err := net.DialTimeout("tcp", "127.0.0.2:"+port, 5*time.Second); err == nil {
		conn.Close()
		t.Fatal("a's control port answers on 127.0.0.2: it listens on every interface")
	}
	const objSize = 4<<20 + 123
	objs := map[string][]byte{}
	for _, name := range []string{"during-churn", "during-held", "after-b", "after-c"} {
		objs[name] = a.putCluster(t, ctx, name, objSize)
	}
	local := a.putCluster(t, ctx, "local", 1<<20)

	lat := &latencies{by: map[string][]time.Duration{}}
	lat.set("quiet")
	getLocal := func() {
		start := time.Now()
		// GetWith asks the daemon every time (Get may retake a lease
		// without it).
		l, err := a.c.GetWith(ctx, "local", client.GetOptions{})
		if err != nil {
			t.Errorf("local get on a: %v", err)
			return
		}
		if l.Bytes()[0] != local[0] || l.Bytes()[len(local)-1] != local[len(local)-1] {
			t.Error("local get on a: the bytes differ")
		}
		l.Release()
		lat.add(time.Since(start))
	}
	baseFds := a.fds(t)
	logStart := len(a.logText())

	// Local gets and descriptor samples run through both phases.
	stop := make(chan struct{})
	var bg sync.WaitGroup
	var maxFds atomic.Int64
	bg.Go(func() {
		for i := 0; i < 1_000_000; i++ {
			select {
			case <-stop:
				return
			default:
			}
			getLocal()
			if t.Failed() {
				return
			}
		}
	})
	bg.Go(func() {
		tick := time.NewTicker(50 * time.Millisecond)
		defer tick.Stop()
		for {
			if n := int64(a.fds(t)); n > maxFds.Load() {
				maxFds.Store(n)
			}
			select {
			case <-stop:
				return
			case <-tick.C:
			}
		}
	})
	stopBackground := sync.OnceFunc(func() { close(stop); bg.Wait() })
	defer stopBackground()
	// The same loop of gets measures the quiet before and after the
	// flood: the p50s compare like with like.
	time.Sleep(measureFor)

	// Phase 1: connect, 64 random bytes, close.
	lat.set("churn")
	var made, dialFailed atomic.Int64
	var next atomic.Int64
	churnStart := time.Now()
	deadline := churnStart.Add(floodFor + 5*time.Second)
	var workers sync.WaitGroup
	for w := range floodWorkers {
		workers.Go(func() {
			d := loopbackFrom(2 + w%floodSources)
			junk := make([]byte, 64)
			for {
				i := next.Add(1)
				if i > floodConns || time.Now().After(deadline) {
					return
				}
				// Paced: floodConns spread over floodFor, as the
				// bound is stated.
				time.Sleep(time.Until(churnStart.Add(time.Duration(i) * floodFor / floodConns)))
				conn, err := d.Dial("tcp", a.adv)
				if err != nil {
					dialFailed.Add(1)
					continue
				}
				made.Add(1)
				rand.Read(junk)
				_, _ = conn.Write(junk)
				conn.Close()
			}
		})
	}
	// B dials a for the first time in the middle of it.
	pullErr := make(chan error, 1)
	go func() { pullErr <- b.pull(ctx, "during-churn", objs["during-churn"]) }()
	workers.Wait()
	churnTook := time.Since(churnStart)
	if err := testutil.Next(t, pullErr, testutil.Wait); err != nil {
		t.Fatalf("a peer's pull during the churn: %v", err)
	}
	churnFds := maxFds.Load()

	// Phase 2: connections held open from many sources, past the
	// handshake deadline.
	lat.set("held")
	var held []net.Conn
	var heldFailed int
	heldStart := time.Now()
	for s := range heldSources {
		d := loopbackFrom(20 + s)
		for range heldPerSource {
			conn, err := d.Dial("tcp", a.adv)
			if err != nil {
				heldFailed++
				continue
			}
			// A frame announced, never finished.
			_, _ = conn.Write([]byte{0, 0, 0, 100, '{'})
			held = append(held, conn)
		}
	}
	defer func() {
		for _, conn := range held {
			conn.Close()
		}
	}()
	// C dials a for the first time while every pending place is taken.
	go func() { pullErr <- c.pull(ctx, "during-held", objs["during-held"]) }()
	if err := testutil.Next(t, pullErr, testutil.Wait); err != nil {
		t.Fatalf("a peer's pull while connections are held: %v", err)
	}
	// Past the deadline, every held connection has been closed by a.
	testutil.Eventually(t, testutil.Wait, func() error {
		if time.Since(heldStart) < heldFor {
			return fmt.Errorf("holding the connections for %v", heldFor)
		}
		buf := make([]byte, 1)
		for _, conn := range held {
			conn.SetReadDeadline(time.Now().Add(time.Millisecond))
			if _, err := conn.Read(buf); err == nil || os.IsTimeout(err) {
				return fmt.Errorf("a held connection is still open on a's side after %v", time.Since(heldStart).Round(time.Millisecond))
			}
		}
		return nil
	})
	for _, conn := range held {
		conn.Close()
	}
	lat.set("after")
	time.Sleep(measureFor)
	stopBackground()

	// Afterwards: both peers pull again, and a's descriptors come back.
	if err := b.pull(ctx, "after-b", objs["after-b"]); err != nil {
		t.Fatalf("after the flood: %v", err)
	}
	if err := c.pull(ctx, "after-c", objs["after-c"]); err != nil {
		t.Fatalf("after the flood: %v", err)
	}
	var afterFds int
	testutil.Eventually(t, testutil.Wait, func() error {
		if afterFds = a.fds(t); afterFds > baseFds+floodFdSlack {
			return fmt.Errorf("a has %d descriptors after the flood, %d before", afterFds, baseFds)
		}
		return nil
	})
	bound := int64(baseFds + cluster.DefaultMaxPending + floodFdSlack)
	if m := maxFds.Load(); m > bound {
		t.Fatalf("a reached %d descriptors during the flood (%d before): over its bound of %d", m, baseFds, bound)
	}

	// Every refused connection is in the log, in a bounded number of
	// lines: wait for the last summary.
	attempts := int(made.Load()) + len(held)
	summary := regexp.MustCompile(` refused=(\d+) `)
	var lines []string
	var logged int
	count := func() {
		lines = strings.Split(strings.TrimSpace(a.logText()[logStart:]), "\n")
		logged = 0
		for _, l := range lines {
			if m := summary.FindStringSubmatch(l); m != nil {
				n, _ := strconv.Atoi(m[1])
				logged += n
			} else if strings.Contains(l, "control: refused") {
				logged++
			}
		}
	}
	// The last summary comes within the daemon's summary interval (5 s); a
	// connection the kernel completed but never queued for accept (its
	// queue full) is not the daemon's to count, hence at least 90%.
	for wait := time.Now().Add(15 * time.Second); ; time.Sleep(100 * time.Millisecond) {
		if count(); logged >= attempts || time.Now().After(wait) {
			break
		}
	}
	if logged < attempts*9/10 || logged > attempts {
		t.Fatalf("%d refusals counted in a's log, of %d connections:\n%s", logged, attempts, strings.Join(lines, "\n"))
	}
	if len(lines) > floodLogLines {
		t.Fatalf("a wrote %d log lines about a flood of %d connections, want at most %d; the first:\n%s",
			len(lines), attempts, floodLogLines, strings.Join(lines[:20], "\n"))
	}
	quiet, nq := lat.p50("quiet")
	after, na := lat.p50("after")
	churn, nc := lat.p50("churn")
	heldP50, nh := lat.p50("held")
	t.Logf("churn: %d connections (%d dials failed) in %v (%.0f/s); held: %d connections from %d sources (%d dials failed)",
		made.Load(), dialFailed.Load(), churnTook.Round(time.Millisecond), float64(made.Load())/churnTook.Seconds(), len(held), heldSources, heldFailed)
	t.Logf("a's log: %d lines for %d connections, %d refusals counted in them; the first summary:\n%s", len(lines), attempts, logged,
		lines[slices.IndexFunc(lines, func(l string) bool { return summary.MatchString(l) })])
	t.Logf("a's descriptors: %d before, at most %d in the churn, %d in all, %d after", baseFds, churnFds, maxFds.Load(), afterFds)
	t.Logf("local get p50 on a: quiet %v (%d gets), churn %v (%d), held %v (%d), after %v (%d)", quiet, nq, churn, nc, heldP50, nh, after, na)
}

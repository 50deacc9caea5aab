package node_test

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/cudaipc/cudaipc/client"
	"github.com/cudaipc/cudaipc/cluster/internal/etcdtest"
	"github.com/cudaipc/cudaipc/internal/testutil"
	"github.com/cudaipc/cudaipc/transport/ucx"
)

// The cluster of issue 18 item 8: a real etcd and three daemons (the
// cudaipc binary) in network namespaces of their own, joined by veth pairs
// to a bridge in a fourth, UCX over tcp on those links. Addresses are in
// 10.213.77.0/24 inside the test's namespaces only; the test talks to the
// daemons through their Unix sockets (the file system is shared).

const netPrefix = "10.213.77."

type netns struct {
	t      *testing.T
	prefix string
	hub    string
	nodes  []string
}

func ipRun(t *testing.T, args ...string) {
	t.Helper()
	out, err := exec.Command("ip", args...).CombinedOutput()
	if err != nil {
		t.Fatalf("ip %s: %v: %s", strings.Join(args, " "), err, out)
	}
}

// newNetns makes the hub namespace (bridge br0, address .1) and n node
// namespaces (eth0, address .11, .12, ...), removed when the test ends.
func newNetns(t *testing.T, n int) *netns {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("network namespaces need root")
	}
	if _, err := exec.LookPath("ip"); err != nil {
		t.Skip("no ip command (apt-get install iproute2)")
	}
	ns := &netns{t: t, prefix: fmt.Sprintf("cit%d%03d", os.Getpid()%10000, rand.IntN(1000))}
	ns.hub = ns.prefix + "-hub"
	ipRun(t, "netns", "add", ns.hub)
	t.Cleanup(func() { _ = exec.Command("ip", "netns", "del", ns.hub).Run() })
	ipRun(t, "-n", ns.hub, "link", "set", "lo", "up")
	// An address of its own: a bridge without one follows its lowest port
	// and changes address when that port goes, leaving every node's cached
	// MAC of .1 (etcd) stale for tens of seconds (clustertest.NewNet).
	ipRun(t, "-n", ns.hub, "link", "add", "br0", "address", "02:00:0a:d5:4d:01", "type", "bridge")
	ipRun(t, "-n", ns.hub, "addr", "add", netPrefix+"1/24", "dev", "br0")
	ipRun(t, "-n", ns.hub, "link", "set", "br0", "up")
	for i := range n {
		name := fmt.Sprintf("%s-n%d", ns.prefix, i)
		ipRun(t, "netns", "add", name)
		t.Cleanup(func() { _ = exec.Command("ip", "netns", "del", name).Run() })
		ns.nodes = append(ns.nodes, name)
		h := fmt.Sprintf("h%d", i)
		ipRun(t, "-n", ns.hub, "link", "add", h, "type", "veth", "peer", "name", "eth0", "netns", name)
		ipRun(t, "-n", ns.hub, "link", "set", h, "master", "br0", "up")
		ipRun(t, "-n", name, "link", "set", "lo", "up")
		ipRun(t, "-n", name, "addr", "add", fmt.Sprintf("%s%d/24", netPrefix, 11+i), "dev", "eth0")
		ipRun(t, "-n", name, "link", "set", "eth0", "up")
	}
	return ns
}

func nodeAddr(i int) string { return fmt.Sprintf("%s%d", netPrefix, 11+i) }

// inNetns runs f on a thread in network namespace name: sockets f makes
// (in this goroutine) belong to it.
func inNetns(name string, f func() error) error {
	runtime.LockOSThread()
	orig, err := os.Open("/proc/thread-self/ns/net")
	if err != nil {
		runtime.UnlockOSThread()
		return err
	}
	defer orig.Close()
	target, err := os.Open("/run/netns/" + name)
	if err != nil {
		runtime.UnlockOSThread()
		return err
	}
	defer target.Close()
	if err := unix.Setns(int(target.Fd()), unix.CLONE_NEWNET); err != nil {
		runtime.UnlockOSThread()
		return err
	}
	ferr := f()
	if err := unix.Setns(int(orig.Fd()), unix.CLONE_NEWNET); err != nil {
		return err // the thread stays locked, and dies with the goroutine
	}
	runtime.UnlockOSThread()
	return ferr
}

// proc is a process the test started in a namespace.
type proc struct {
	cmd    *exec.Cmd
	exited chan struct{}
	log    string
}

func startIn(t *testing.T, ns, logPath string, env []string, args ...string) *proc {
	t.Helper()
	f, err := os.OpenFile(logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command("ip", append([]string{"netns", "exec", ns}, args...)...)
	cmd.Env = append(os.Environ(), env...)
	cmd.Stdout, cmd.Stderr = f, f
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	p := &proc{cmd: cmd, exited: make(chan struct{}), log: logPath}
	go func() { _ = cmd.Wait(); f.Close(); close(p.exited) }()
	t.Cleanup(func() { p.kill(t) })
	return p
}

func (p *proc) kill(t *testing.T) {
	_ = p.cmd.Process.Signal(syscall.SIGKILL)
	select {
	case <-p.exited:
	case <-time.After(10 * time.Second):
		t.Errorf("pid %d did not exit within 10s of SIGKILL", p.cmd.Process.Pid)
	}
}

func (p *proc) logHas(s string) bool {
	b, _ := os.ReadFile(p.log)
	return bytes.Contains(b, []byte(s))
}

func (p *proc) tail() string {
	b, _ := os.ReadFile(p.log)
	if len(b) > 3000 {
		b = b[len(b)-3000:]
	}
	return string(b)
}

// hubEtcd runs etcd in the hub namespace on .1:2379.
func hubEtcd(t *testing.T, ns *netns, dir string) *proc {
	t.Helper()
	bin := etcdtest.Require(t)
	url := "http://" + netPrefix + "1:2379"
	peer := "http://" + netPrefix + "1:2380"
	p := startIn(t, ns.hub, filepath.Join(dir, "etcd.log"), nil, bin, "--name", "hub", "--data-dir", filepath.Join(dir, "etcd-data"),
		"--listen-client-urls", url, "--advertise-client-urls", url, "--listen-peer-urls", peer,
		"--initial-advertise-peer-urls", peer, "--initial-cluster", "hub="+peer, "--log-level", "warn")
	eventually(t, 20*time.Second, "etcd healthy in the hub namespace", func() bool {
		return inNetns(ns.hub, func() error {
			c, err := net.DialTimeout("tcp", netPrefix+"1:2379", time.Second)
			if err != nil {
				return err
			}
			defer c.Close()
			c.SetDeadline(time.Now().Add(2 * time.Second))
			fmt.Fprintf(c, "GET /health HTTP/1.0\r\n\r\n")
			b, _ := bufio.NewReader(c).ReadString(0)
			if !strings.Contains(b, `"health":"true"`) {
				return errors.New("unhealthy")
			}
			return nil
		}) == nil
	})
	return p
}

var builtBinary string

// cudaipcBinary builds the cudaipc command once per test binary run.
func cudaipcBinary(t *testing.T) string {
	t.Helper()
	if builtBinary != "" {
		return builtBinary
	}
	gobin, err := exec.LookPath("go")
	if err != nil {
		t.Skip("no go command to build cudaipc with")
	}
	dir, err := os.MkdirTemp("", "cudaipc-netns-bin-")
	if err != nil {
		t.Fatal(err)
	}
	bin := filepath.Join(dir, "cudaipc")
	cmd := exec.Command(gobin, "build", "-o", bin, "github.com/cudaipc/cudaipc/cmd/cudaipc")
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("go build cudaipc: %v: %s", err, out)
	}
	builtBinary = bin
	return bin
}

type nsDaemon struct {
	name string
	p    *proc
	c    *client.Client
	sock string
}

func startNsDaemon(t *testing.T, ns *netns, i, port int, name, secretFile, dir string) *nsDaemon {
	t.Helper()
	bin := cudaipcBinary(t)
	sock := filepath.Join(dir, name+".sock")
	p := startIn(t, ns.nodes[i], filepath.Join(dir, name+".log"),
		[]string{"UCX_TLS=tcp", "UCX_NET_DEVICES=eth0", "UCX_WARN_UNUSED_ENV_VARS=n"},
		bin, "--socket", sock, "--log-level", "debug", "serve", "--backend", "host", "--capacity", "512MiB",
		"--cluster", "etcd://"+netPrefix+"1:2379", "--node", name, "--cluster-secret", secretFile,
		"--cluster-listen", fmt.Sprintf("%s:%d", nodeAddr(i), port),
		// Four reads in flight a holder, so that of ns/big's 12 chunks
		// neither holder can take all at once: the kill -9 below lands in
		// reads of the killed one (serve's default, 16 at 4 lanes, let the
		// other holder's reads take every chunk first in 2 of 4 runs
		// under -race, and the kill went unseen).
		"--experimental-cluster-streams", "4")
	d := &nsDaemon{name: name, p: p, sock: sock}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	eventually(t, 30*time.Second, "daemon "+name+" serving", func() bool {
		select {
		case <-p.exited:
			t.Fatalf("daemon %s exited: %s", name, p.tail())
		default:
		}
		c, err := client.Dial(ctx, sock)
		if err != nil {
			return false
		}
		d.c = c
		return true
	})
	t.Cleanup(func() { d.c.Close() })
	return d
}

func (d *nsDaemon) put(t *testing.T, name string, size int, cluster bool) []byte {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	b := make([]byte, size)
	rand.NewChaCha8([32]byte{byte(size), byte(len(name)), 7}).Read(b)
	o, err := d.c.Create(ctx, name, int64(size), client.CreateOptions{Cluster: cluster})
	if err != nil {
		t.Fatalf("create %s on %s: %v", name, d.name, err)
	}
	copy(o.Bytes(), b)
	if err := o.Seal(ctx); err != nil {
		t.Fatalf("seal %s on %s: %v", name, d.name, err)
	}
	return b
}

func (d *nsDaemon) get(ctx context.Context, name string) ([]byte, error) {
	l, err := d.c.Get(ctx, name)
	if err != nil {
		return nil, err
	}
	defer l.Release()
	return bytes.Clone(l.Bytes()), nil
}

// shape limits the egress of node i's link, so that a pull from it lasts
// long enough to kill the node in the middle.
func (ns *netns) shape(t *testing.T, i int, rate string) {
	ipRunTC(t, ns.nodes[i], "qdisc", "replace", "dev", "eth0", "root", "tbf", "rate", rate, "burst", "64kb", "latency", "100ms")
}

func ipRunTC(t *testing.T, nsName string, args ...string) {
	t.Helper()
	out, err := exec.Command("ip", append([]string{"netns", "exec", nsName, "tc"}, args...)...).CombinedOutput()
	if err != nil {
		t.Fatalf("tc %s: %v: %s", strings.Join(args, " "), err, out)
	}
}

func TestClusterInNetworkNamespaces(t *testing.T) {
	if err := ucx.Available(); err != nil {
		if os.Getenv("CUDAIPC_REQUIRE_UCX") == "1" || os.Getenv(etcdtest.EnvRequire) == "1" {
			t.Fatal(err)
		}
		t.Skip(err)
	}
	etcdtest.Require(t)
	ns := newNetns(t, 3)
	dir := t.TempDir()
	etcd := hubEtcd(t, ns, dir)
	secretFile := filepath.Join(dir, "secret")
	if err := os.WriteFile(secretFile, []byte("netns-cluster-secret-0123456789"), 0o600); err != nil {
		t.Fatal(err)
	}
	a := startNsDaemon(t, ns, 0, 7946, "a", secretFile, dir)
	b := startNsDaemon(t, ns, 1, 7946, "b", secretFile, dir)
	c := startNsDaemon(t, ns, 2, 7946, "c", secretFile, dir)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()

	// Put on A, get on B and C.
	want := a.put(t, "ns/x", 8<<20+5, true)
	for _, d := range []*nsDaemon{b, c} {
		got, err := d.get(ctx, "ns/x")
		if err != nil || !bytes.Equal(got, want) {
			t.Fatalf("get ns/x on %s: %v (equal: %v)", d.name, err, bytes.Equal(got, want))
		}
	}

	// Versions and newer_than across nodes: A publishes two-shard
	// versions, B reads the latest, C waits for a newer one.
	v1, s1 := publishOn(t, a.c, a.name, "ns/policy", 2, 1<<20)
	if ver, got, err := getVersionOn(ctx, b.c, "ns/policy", client.GetOptions{Version: v1, Shard: 1}); err != nil || ver != v1 || !bytes.Equal(got, s1[1]) {
		t.Fatalf("policy v%d shard 1 on B: v%d %v", v1, ver, err)
	}
	type vres struct {
		ver uint64
		b   []byte
		err error
	}
	newer := make(chan vres, 1)
	go func() {
		ver, got, err := getVersionOn(ctx, c.c, "ns/policy", client.GetOptions{NewerThan: v1, Wait: true})
		newer <- vres{ver, got, err}
	}()
	v2, s2 := publishOn(t, a.c, a.name, "ns/policy", 2, 1<<20)
	select {
	case r := <-newer:
		if r.err != nil || r.ver != v2 || !bytes.Equal(r.b, s2[0]) {
			t.Fatalf("newer than v%d on C: v%d %v (want v%d)", v1, r.ver, r.err, v2)
		}
	case <-time.After(60 * time.Second):
		t.Fatal("C's get newer_than did not return within 60s")
	}

	// A node without the secret is refused: it can verify no record, and
	// the holders would refuse its control channel.
	evilSecret := filepath.Join(dir, "evil-secret")
	os.WriteFile(evilSecret, []byte("not-the-cluster-secret-at-all"), 0o600)
	evil := startNsDaemon(t, ns, 2, 7947, "evil", evilSecret, dir)
	if _, err := evil.get(ctx, "ns/x"); err == nil || !strings.Contains(err.Error(), "unauthenticated") {
		t.Fatalf("get on a node without the secret: %v", err)
	}
	if a.p.logHas("control: exposed\" peer=evil") {
		t.Fatal("memory was exposed to the node without the secret")
	}

	// etcd stopped: local work goes on, cluster calls fail fast; back:
	// everything recovers.
	etcd.kill(t)
	b.put(t, "local-during-outage", 4096, false)
	start := time.Now()
	_, err := b.get(ctx, "ns/unknown")
	if err == nil || !strings.Contains(err.Error(), "cluster directory unavailable") {
		t.Fatalf("cluster get with etcd down: %v", err)
	}
	if took := time.Since(start); took > 10*time.Second {
		t.Fatalf("cluster get with etcd down took %v", took)
	}
	t.Logf("with etcd down a cluster get failed after %v: %v", time.Since(start).Round(time.Millisecond), err)
	hubEtcd(t, ns, dir)
	var want2 []byte
	eventually(t, 60*time.Second, "cluster puts work again after etcd returns", func() bool {
		oc, cancel := context.WithTimeout(ctx, 10*time.Second)
		defer cancel()
		o, err := b.c.Create(oc, "ns/after", 1<<20, client.CreateOptions{Cluster: true})
		if err != nil {
			return false
		}
		want2 = make([]byte, 1<<20)
		rand.NewChaCha8([32]byte{9}).Read(want2)
		copy(o.Bytes(), want2)
		if err := o.Seal(oc); err != nil {
			b.c.Delete(oc, "ns/after")
			return false
		}
		return true
	})
	// C fails fast for a while after its own last failed call of the
	// outage (etcddir's fastFail), which can end after B's put works.
	testutil.Eventually(t, 60*time.Second, func() error {
		got, err := c.get(ctx, "ns/after")
		if err != nil {
			return fmt.Errorf("get on C after etcd came back: %w", err)
		}
		if !bytes.Equal(got, want2) {
			t.Fatal("C's copy of ns/after differs from B's")
		}
		return nil
	})

	// kill -9 of a holder mid-pull, another holder alive: B's get
	// finishes from C.
	big := a.put(t, "ns/big", 48<<20, true)
	if got, err := c.get(ctx, "ns/big"); err != nil || !bytes.Equal(got, big) {
		t.Fatalf("get ns/big on C: %v", err)
	}
	ns.shape(t, 0, "80mbit")
	ns.shape(t, 2, "80mbit")
	type result struct {
		b   []byte
		err error
	}
	res := make(chan result, 1)
	go func() { g, err := b.get(ctx, "ns/big"); res <- result{g, err} }()
	eventually(t, 30*time.Second, "B pulling from A", func() bool { return a.p.logHas(`control: exposed" peer=b object=0:ns/big`) })
	a.p.kill(t)
	select {
	case r := <-res:
		if r.err != nil || !bytes.Equal(r.b, big) {
			t.Fatalf("get ns/big on B after A died mid-pull: %v", r.err)
		}
	case <-time.After(90 * time.Second):
		t.Fatal("get on B did not finish within 90s of A's death")
	}
	if !b.p.logHas(`dropping a holder" object=0:ns/big node=a`) {
		t.Errorf("B's log does not show A dropped mid-pull:\n%s", b.p.tail())
	}

	// The only holder killed mid-pull: the get fails in bounded time with
	// one line naming it, and leaves no half replica.
	c.put(t, "ns/only", 32<<20, true)
	res2 := make(chan error, 1)
	start = time.Now()
	go func() { _, err := b.get(ctx, "ns/only"); res2 <- err }()
	eventually(t, 30*time.Second, "B pulling from C", func() bool { return c.p.logHas(`control: exposed" peer=b object=0:ns/only`) })
	c.p.kill(t)
	select {
	case err := <-res2:
		if err == nil || !strings.Contains(err.Error(), "node c") || strings.Contains(err.Error(), "\n") {
			t.Fatalf("get with its only holder dead: %v; want one line naming node c", err)
		}
		t.Logf("only holder killed: failed after %v: %v", time.Since(start).Round(time.Millisecond), err)
	case <-time.After(90 * time.Second):
		t.Fatal("get on B did not fail within 90s of its only holder's death")
	}
	if _, err := b.c.Stat(ctx, "ns/only"); !errors.Is(err, client.ErrNotFound) {
		t.Fatalf("stat of the failed pull on B: %v (a half replica?)", err)
	}

	// A killed node restarts under its name once its old record expired,
	// holding nothing: it pulls what it lost from B.
	a2 := startNsDaemon(t, ns, 0, 7946, "a", secretFile, dir)
	if got, err := a2.get(ctx, "ns/x"); err != nil || !bytes.Equal(got, want) {
		t.Fatalf("get ns/x on the restarted A: %v", err)
	}
}

func publishOn(t *testing.T, c *client.Client, node, name string, shards, size int) (uint64, [][]byte) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	var ver uint64
	var all [][]byte
	for i := range shards {
		o, err := c.Publish(ctx, name, int64(size), client.CreateOptions{Cluster: true, Shards: shards, Shard: i, Version: ver})
		if err != nil {
			t.Fatalf("publish %s shard %d on %s: %v", name, i, node, err)
		}
		ver = o.Version()
		b := make([]byte, size)
		rand.NewChaCha8([32]byte{byte(ver), byte(i), 5}).Read(b)
		copy(o.Bytes(), b)
		if err := o.Seal(ctx); err != nil {
			t.Fatalf("seal %s v%d shard %d on %s: %v", name, ver, i, node, err)
		}
		all = append(all, b)
	}
	return ver, all
}

func getVersionOn(ctx context.Context, c *client.Client, name string, opts client.GetOptions) (uint64, []byte, error) {
	l, err := c.GetWith(ctx, name, opts)
	if err != nil {
		return 0, nil, err
	}
	defer l.Release()
	return l.Info().Version, bytes.Clone(l.Bytes()), nil
}

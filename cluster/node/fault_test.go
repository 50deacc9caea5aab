package node_test

import (
	"bytes"
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"syscall"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/cudaipc/cudaipc"
	"github.com/cudaipc/cudaipc/client"
	"github.com/cudaipc/cudaipc/cluster"
	"github.com/cudaipc/cudaipc/cluster/etcddir"
	"github.com/cudaipc/cudaipc/cluster/internal/etcdtest"
	"github.com/cudaipc/cudaipc/cluster/node"
	"github.com/cudaipc/cudaipc/internal/testutil"
	"github.com/cudaipc/cudaipc/store"
)

// Issue 19 item 5 with real processes: a daemon (store and node) in a
// helper process, the test binary re-executed as the "daemon" role, killed
// with SIGKILL in the middle of a pull or of a publish, beside daemons in
// the test's own process that the test inspects.

// roles are the helper processes of this package's tests.
var roles = testutil.Roles{"daemon": daemonRole}

// daemonCmd is what the test tells a daemon helper.
type daemonCmd struct {
	// Op is "start" (Etcd, Prefix, Node, Backend, Capacity, PullDelay),
	// "get" (Name: start a get, answer at once), "stats", or "put"
	// (Name, Size, Seed, Versioned, Version, Shard, Shards; Hold: answer
	// once the seal is stuck allocating a staging buffer of at least
	// Hold bytes, instead of when the put is done).
	Op, Etcd, Prefix, Node, Backend, Name string
	Capacity, Size, Hold                  int64
	PullDelay                             time.Duration
	// Streams is the node's reads in flight from one holder
	// (Config.StreamsPerHolder; 0: the default).
	Streams       int
	Seed          byte
	Versioned     bool
	Version       uint64
	Shard, Shards int
	// Local makes a put's object node-local (not cluster-visible).
	Local bool
	// Listen is the control channel's address ("" for 127.0.0.1:0), and
	// ChunkTimeout the node's pulls' (0: the default), at "start".
	Listen       string
	ChunkTimeout time.Duration
	// Layout, Layers, Blocks, Shared and GPU are, for "kvspace" (Name, Size:
	// the block bytes, Seed), the KV space the daemon's own client
	// registers (kvspace_test.go).
	Layout         string
	Layers, Blocks int
	Shared         bool
	// GPU puts the space in GPU 0's memory: "vmm" (shared by descriptor)
	// or "legacy" (cudaMalloc memory); "" in host memory.
	GPU string
}

// daemonReply answers a daemonCmd.
type daemonReply struct {
	Err string
	// Version is the version a put made; Held that the put is stuck
	// where Hold asked.
	Version uint64
	Held    bool
	// InFlight, Pulls and Failed are the node's pull counters, Got the
	// bytes its pulls' chunk reads delivered (SlowPulls).
	InFlight           int64
	Pulls, Failed, Got uint64
	// GetErr is the result of the get started by "get", once it is done
	// ("" while running or after a success, which sets GetDone).
	GetErr  string
	GetDone bool
	// Has answers "has" (Name: the store has it sealed, stat finds it);
	// Holders answers "holders" (Name: the directory's live holders of
	// the plain object).
	Has     bool
	Holders []string
	// Desc answers "kvspace": the space's description (MarshalText).
	Desc string
}

// daemonRole runs a daemon joined to the test's etcd, serving the store on
// a socket in a temporary directory, until stdin closes or it is killed.
func daemonRole(p *testutil.Peer) error {
	var c daemonCmd
	if err := p.Recv(&c); err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelInfo})).With("node", c.Node)
	var n *node.Node
	var err error
	for {
		n, err = node.Start(ctx, node.Config{
			Directory: etcddir.Config{Endpoints: []string{c.Etcd}, Node: c.Node, Secret: secret, TTL: 2 * time.Second,
				CallTimeout: 5 * time.Second, Prefix: c.Prefix, KeepRecords: 2},
			Listen: cmp.Or(c.Listen, "127.0.0.1:0"), Logger: log, StreamsPerHolder: c.Streams,
		})
		// An etcd started beside the daemons (in a network namespace) is
		// waited for, bounded.
		if err == nil || !errors.Is(err, cluster.ErrUnavailable) || ctx.Err() != nil {
			break
		}
		time.Sleep(200 * time.Millisecond)
	}
	if err != nil {
		return err
	}
	defer n.Close()
	// Before the store serves anything: its goroutines start after this.
	got := node.SlowPulls(n, c.PullDelay)
	if c.ChunkTimeout > 0 {
		node.SetChunkTimeout(n, c.ChunkTimeout)
	}
	reg := prometheus.NewRegistry()
	reg.MustRegister(n.Collectors()...)
	st, err := store.New(store.Config{Backend: c.Backend, Capacity: c.Capacity, Cluster: n, Logger: log, Registerer: reg})
	if err != nil {
		return err
	}
	defer st.Close()
	if err := n.Attach(ctx, st); err != nil {
		return err
	}
	dir, err := os.MkdirTemp("", "cudaipc-daemon-role-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	sock := filepath.Join(dir, "s.sock")
	sctx, stop := context.WithCancel(context.Background())
	defer stop()
	go func() { _ = st.ListenAndServe(sctx, sock) }()
	var cl *client.Client
	for cl == nil {
		if cl, err = client.Dial(ctx, sock); err != nil {
			if ctx.Err() != nil {
				return err
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
	defer cl.Close()
	var device string
	if c.Backend == "cuda" {
		devs, err := cudaipc.Devices()
		if err != nil || len(devs) == 0 {
			return fmt.Errorf("no GPU for the cuda backend: %v", err)
		}
		device = devs[0].UUID().String()
	}
	if err := p.Send(daemonReply{}); err != nil {
		return err
	}
	getDone := make(chan error, 1)
	var getErr error
	var getFinished bool
	for {
		if err := p.Recv(&c); err != nil {
			if errors.Is(err, io.EOF) {
				return nil
			}
			return err
		}
		var r daemonReply
		switch c.Op {
		case "get":
			go func(name string) {
				ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
				defer cancel()
				l, err := cl.Get(ctx, name)
				if err == nil {
					l.Release()
				}
				getDone <- err
			}(c.Name)
		case "read":
			// A get that does not wait, its bytes checked against
			// randomBytes(Size, Seed); a failure is the answer's GetErr.
			r.GetDone = true
			if err := readOn(sock, c); err != nil {
				r.GetErr = err.Error()
			}
		case "kvspace":
			if r.Desc, err = registerKVSpace(cl, c); err != nil {
				r.Err = err.Error()
			}
		case "has":
			sctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			in, err := cl.Stat(sctx, c.Name)
			cancel()
			r.Has = err == nil && in.Sealed
		case "holders":
			hctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			e, err := n.Directory().Lookup(hctx, cluster.Ref{Owner: uint32(os.Getuid()), Name: c.Name})
			cancel()
			if err != nil {
				r.Err = err.Error()
			}
			r.Holders = e.Holders
		case "stats":
			select {
			case getErr = <-getDone:
				getFinished = true
			default:
			}
			s := n.Stats()
			r.InFlight, r.Pulls, r.Failed, r.Got = s.InFlight, s.Pulls, s.Failed, got.Load()
			if getFinished {
				r.GetDone = true
				if getErr != nil {
					r.GetErr = getErr.Error()
				}
			}
		case "put":
			var held <-chan struct{}
			if c.Hold > 0 {
				held = node.HoldPinnedAllocs(n, c.Hold)
			}
			done := make(chan daemonReply, 1)
			go func(c daemonCmd) {
				var r daemonReply
				v, err := putOn(cl, device, c)
				if err != nil {
					r.Err = err.Error()
				}
				r.Version = v
				done <- r
			}(c)
			select {
			case r = <-done:
			case <-held:
				r.Held = true
			case <-time.After(time.Minute):
				r.Err = "the put neither ended nor reached the hold within a minute"
			}
		default:
			r.Err = "unknown op " + c.Op
		}
		if err := p.Send(r); err != nil {
			return err
		}
	}
}

// putOn creates, writes and seals c's object (on device, "" for host
// memory) of randomBytes(c.Size, c.Seed), returning its version.
func putOn(cl *client.Client, device string, c daemonCmd) (uint64, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	opts := client.CreateOptions{Cluster: !c.Local, Device: device}
	var o *client.Object
	var err error
	if c.Versioned {
		opts.Versioned, opts.Version, opts.Shard, opts.Shards = true, c.Version, c.Shard, c.Shards
		o, err = cl.Publish(ctx, c.Name, c.Size, opts)
	} else {
		o, err = cl.Create(ctx, c.Name, c.Size, opts)
	}
	if err != nil {
		return 0, err
	}
	if _, err := o.WriteAt(randomBytes(int(c.Size), c.Seed), 0); err != nil {
		return 0, err
	}
	if err := o.Seal(ctx); err != nil {
		return 0, err
	}
	return o.Version(), nil
}

// readOn gets c.Name without waiting, on a connection of its own to the
// daemon at sock, and checks its bytes against randomBytes(c.Size,
// c.Seed). The connection's end releases the lease at once, as a reader
// process's exit does (a lease released through the connection's lease
// table is reclaimed only when the store needs the room).
func readOn(sock string, c daemonCmd) error {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cl, err := client.Dial(ctx, sock)
	if err != nil {
		return err
	}
	defer cl.Close()
	l, err := cl.Get(ctx, c.Name)
	if err != nil {
		return err
	}
	defer l.Release()
	if !bytes.Equal(l.Bytes(), randomBytes(int(c.Size), c.Seed)) {
		return fmt.Errorf("%s: %d bytes that are not the ones put", c.Name, len(l.Bytes()))
	}
	return nil
}

// helperDaemon is a daemon in a helper process.
type helperDaemon struct {
	name string
	c    *testutil.Child
}

func startHelperDaemon(t *testing.T, srv *etcdtest.Server, name, backend string, capacity int64, pullDelay time.Duration) *helperDaemon {
	t.Helper()
	return startHelperDaemonWith(t, srv, daemonCmd{Node: name, Backend: backend, Capacity: capacity, PullDelay: pullDelay})
}

// startHelperDaemonWith is startHelperDaemon with the start command's
// other fields (Streams) as c has them.
func startHelperDaemonWith(t *testing.T, srv *etcdtest.Server, c daemonCmd) *helperDaemon {
	t.Helper()
	h := &helperDaemon{name: c.Node, c: testutil.Spawn(t, "daemon")}
	c.Op, c.Etcd, c.Prefix = "start", srv.Endpoint(), "/t/"+t.Name()+"/"
	h.ask(t, c)
	return h
}

// ask sends cmd and returns the reply, failing the test on an error or
// when none comes within a minute.
func (h *helperDaemon) ask(t *testing.T, cmd daemonCmd) daemonReply {
	t.Helper()
	if err := h.c.Send(cmd); err != nil {
		t.Fatalf("helper %s: %v\n%s", h.name, err, h.c.Stderr())
	}
	ch := make(chan error, 1)
	var r daemonReply
	go func() { ch <- h.c.Recv(&r) }()
	select {
	case err := <-ch:
		if err != nil {
			t.Fatalf("helper %s: %v\n%s", h.name, err, h.c.Stderr())
		}
	case <-time.After(time.Minute):
		t.Fatalf("helper %s: no answer to %s within a minute\n%s", h.name, cmd.Op, h.c.Stderr())
	}
	if r.Err != "" {
		t.Fatalf("helper %s: %s: %s", h.name, cmd.Op, r.Err)
	}
	return r
}

// kill kills the helper with SIGKILL and waits for it to be gone.
func (h *helperDaemon) kill(t *testing.T) {
	t.Helper()
	if err := syscall.Kill(h.c.Pid(), syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	if err := h.c.Wait(10 * time.Second); err == nil || !bytes.Contains([]byte(err.Error()), []byte("killed")) {
		t.Fatalf("helper %s after SIGKILL: %v", h.name, err)
	}
}

// leasesOn is how many leases d's store counts on its object name.
func leasesOn(t *testing.T, ctx context.Context, d *daemon, name string) int {
	t.Helper()
	in, err := d.c.Stat(ctx, name)
	if err != nil {
		t.Fatalf("stat %s on %s: %v", name, d.name, err)
	}
	return in.Leases
}

// readerKilledMidPull: a reader daemon killed (SIGKILL) while it pulls an
// object of holder A leaves nothing on A: the pin goes with the reader's
// etcd lease (TTL 2 s), the exposure with its control connection, both
// with the store leases they held; the reader never became a holder; a
// later reader pulls the right bytes. The reader's chunk reads are slowed
// (SlowPulls, 1 s each) and it keeps two in flight, so that its pull of 17
// chunks takes some 9 s and the kill lands mid-pull on any link however
// fast the chunks land (with 8 in flight, as by default, the pull took 3
// s, and on the H200 a faster landing once let it end between two polls).
func readerKilledMidPull(t *testing.T, backend, device string, size int) {
	srv := etcdtest.Start(t)
	a := startDaemonOn(t, srv, "a", 1<<30, backend)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	want := randomBytes(size, 31)
	if device != "" {
		putGPU(t, ctx, a, "victim", device, want, client.CreateOptions{})
		// A's staging behind the record holds a lease on the object
		// until it ends: count the leases after it.
		testutil.Eventually(t, testutil.Wait, func() error {
			if n := node.Filling(a.node); n != 0 {
				return fmt.Errorf("%d objects still staging on A", n)
			}
			return nil
		})
	} else {
		o, err := a.c.Create(ctx, "victim", int64(size), client.CreateOptions{Cluster: true})
		if err != nil {
			t.Fatal(err)
		}
		copy(o.Bytes(), want)
		if err := o.Seal(ctx); err != nil {
			t.Fatal(err)
		}
	}
	base := leasesOn(t, ctx, a, "victim")
	ref := cluster.Ref{Name: "victim"}
	reader := startHelperDaemonWith(t, srv, daemonCmd{Node: "reader", Backend: backend, Capacity: 1 << 30, PullDelay: time.Second, Streams: 2})
	reader.ask(t, daemonCmd{Op: "get", Name: "victim"})
	// Kill it once chunks flow (its UCX endpoint wired up: a reader dying
	// while it is being wired up crashes the holder in UCX 1.13;
	// docs/cluster.md, "Failure behaviour"), and A pins and exposes.
	testutil.Eventually(t, testutil.Wait, func() error {
		s := reader.ask(t, daemonCmd{Op: "stats"})
		if s.GetDone {
			t.Fatalf("the reader's get ended before the kill: %q", s.GetErr)
		}
		if s.InFlight != 1 || s.Got == 0 {
			return fmt.Errorf("reader: %d pulls in flight, %d bytes read", s.InFlight, s.Got)
		}
		if n := node.PinsHeld(a.node); n != 1 {
			return fmt.Errorf("A holds %d pins", n)
		}
		if l := leasesOn(t, ctx, a, "victim"); l < base+2 {
			return fmt.Errorf("A's store: %d leases on the object, want %d+2 (the pin's and the exposure's)", l, base)
		}
		return nil
	})
	if s := reader.ask(t, daemonCmd{Op: "stats"}); s.Got >= uint64(size) {
		t.Fatalf("the reader read all %d bytes before the kill", s.Got)
	}
	reader.kill(t)
	killed := time.Now()
	testutil.Eventually(t, testutil.Wait, func() error {
		n, err := a.node.Directory().Pinned(ctx, ref)
		if err != nil {
			return err
		}
		if n != 0 || node.PinsHeld(a.node) != 0 {
			return fmt.Errorf("A: %d pins in etcd, %d held", n, node.PinsHeld(a.node))
		}
		if l := leasesOn(t, ctx, a, "victim"); l != base {
			return fmt.Errorf("A's store: %d leases on the object, want %d", l, base)
		}
		return nil
	})
	t.Logf("pin and exposure gone %v after the kill", time.Since(killed).Round(10*time.Millisecond))
	if e, err := a.node.Directory().Lookup(ctx, ref); err != nil || !slices.Equal(e.Holders, []string{"a"}) {
		t.Fatalf("holders after the reader's death: %+v %v, want only a", e, err)
	}
	c := startDaemonOn(t, srv, "c", 1<<30, backend)
	l, err := c.c.Get(ctx, "victim")
	if err != nil {
		t.Fatalf("get on C after the reader's death: %v", err)
	}
	defer l.Release()
	var got []byte
	if device != "" {
		got = readGPU(t, l)
	} else {
		got = bytes.Clone(l.Bytes())
	}
	if !bytes.Equal(got, want) {
		t.Fatal("C's replica differs from A's object")
	}
}

func TestGPUReaderDaemonKilledMidPull(t *testing.T) {
	dev := testutil.RequireGPU(t)
	readerKilledMidPull(t, "cuda", dev.UUID().String(), 64<<20+4097)
}

func TestReaderDaemonKilledMidPull(t *testing.T) {
	readerKilledMidPull(t, "host", "", 64<<20+4097)
}

// publisherKilledMidPublish: the publisher of a versioned name, a daemon
// in a helper process, publishes v1, which a reader R pulls and keeps a
// lease of; then it starts v2 in two shards, seals shard 0 and is killed
// (SIGKILL) publishing shard 1: on a GPU in the middle of the shard's
// seal (its staging, stuck allocating the pinned buffer: HoldPinnedAllocs),
// in host memory before it. No v2 becomes visible: latest stays v1, shard
// 1 has no record and shard 0 no holder once the publisher's lease is
// gone; R's lease still reads v1, and a new reader C gets v1 (from R) and
// waits in vain for anything newer.
func publisherKilledMidPublish(t *testing.T, backend, device string) {
	srv := etcdtest.Start(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	pub := startHelperDaemon(t, srv, "pub", backend, 1<<30, 0)
	r := startDaemonOn(t, srv, "r", 1<<30, backend)
	const name = "policy"
	const size1, size2 = 8<<20 + 3, 96<<20 + 5 // shard 1 needs a new pinned buffer (64 MiB units)
	v1 := pub.ask(t, daemonCmd{Op: "put", Name: name, Size: size1, Seed: 41, Versioned: true}).Version
	want1 := randomBytes(size1, 41)
	read := func(l *client.Lease) []byte {
		if device != "" {
			return readGPU(t, l)
		}
		return bytes.Clone(l.Bytes())
	}
	held, err := r.c.GetWith(ctx, name, client.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	defer held.Release()
	if held.Info().Version != v1 || !bytes.Equal(read(held), want1) {
		t.Fatalf("R's get of %s: v%d, want v%d with its bytes", name, held.Info().Version, v1)
	}
	ref := func(v uint64, shard uint32) cluster.Ref { return cluster.Ref{Name: name, Version: v, Shard: shard} }
	testutil.Eventually(t, testutil.Wait, func() error {
		e, err := r.node.Directory().Lookup(ctx, ref(v1, 0))
		if err != nil || !slices.Equal(e.Holders, []string{"pub", "r"}) {
			return fmt.Errorf("v%d holders %v, %v: want pub and r", v1, e.Holders, err)
		}
		return nil
	})
	v2 := pub.ask(t, daemonCmd{Op: "put", Name: name, Size: size1, Seed: 42, Versioned: true, Shards: 2}).Version
	if v2 <= v1 {
		t.Fatalf("v2 is %d after v1 %d", v2, v1)
	}
	if device != "" {
		if s := pub.ask(t, daemonCmd{Op: "put", Name: name, Size: size2, Seed: 43, Versioned: true, Version: v2, Shard: 1, Shards: 2, Hold: size2}); !s.Held {
			t.Fatalf("shard 1's seal did not stop in its staging: %+v", s)
		}
	}
	dir := r.node.Directory()
	if l, err := dir.Latest(ctx, 0, name); err != nil || l.Version != v1 {
		t.Fatalf("latest with v%d half published: %+v %v", v2, l, err)
	}
	pub.kill(t)
	killed := time.Now()
	testutil.Eventually(t, testutil.Wait, func() error {
		e, err := dir.Lookup(ctx, ref(v2, 0))
		if err != nil || len(e.Holders) != 0 {
			return fmt.Errorf("v%d shard 0: holders %v, %v; want its record with no holder", v2, e.Holders, err)
		}
		return nil
	})
	t.Logf("the dead publisher's holders gone %v after the kill", time.Since(killed).Round(10*time.Millisecond))
	if _, err := dir.Lookup(ctx, ref(v2, 1)); !errors.Is(err, cluster.ErrNotFound) {
		t.Fatalf("v%d shard 1 after its publisher died mid-seal: %v, want no record", v2, err)
	}
	if l, err := dir.Latest(ctx, 0, name); err != nil || l.Version != v1 {
		t.Fatalf("latest after the publisher's death: %+v %v, want v%d", l, err, v1)
	}
	if !bytes.Equal(read(held), want1) {
		t.Fatal("R's lease of v1 changed under the publisher's death")
	}
	c := startDaemonOn(t, srv, "c", 1<<30, backend)
	l, err := c.c.GetWith(ctx, name, client.GetOptions{})
	if err != nil {
		t.Fatalf("get of %s on C: %v", name, err)
	}
	if l.Info().Version != v1 || !bytes.Equal(read(l), want1) {
		t.Fatalf("C's get of %s: v%d, want v%d with its bytes", name, l.Info().Version, v1)
	}
	l.Release()
	wctx, wcancel := context.WithTimeout(ctx, 3*time.Second)
	defer wcancel()
	if l, err := c.c.GetWith(wctx, name, client.GetOptions{NewerThan: v1, Wait: true}); err == nil {
		l.Release()
		t.Fatalf("C got v%d newer than v%d after the publisher died mid-publish", l.Info().Version, v1)
	}
}

func TestGPUPublisherDaemonKilledMidPublish(t *testing.T) {
	dev := testutil.RequireGPU(t)
	publisherKilledMidPublish(t, "cuda", dev.UUID().String())
}

func TestPublisherDaemonKilledMidPublish(t *testing.T) {
	publisherKilledMidPublish(t, "host", "")
}

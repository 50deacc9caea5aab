package ucxtransport_test

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"os"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/cudaipc/cudaipc/cluster"
	"github.com/cudaipc/cudaipc/cluster/internal/clustertest"
	"github.com/cudaipc/cudaipc/cluster/internal/etcdtest"
	"github.com/cudaipc/cudaipc/cluster/ucxtransport"
	"github.com/cudaipc/cudaipc/internal/testutil"
)

// roles are the helper processes of this package's tests.
var roles = testutil.Roles{"fanout-node": fanoutNode}

// nodeCmd is what the test tells a fanout-node helper.
type nodeCmd struct {
	// Op is "start" (Node, IP, Etcd), "put" (Name, Size, Chunk),
	// "pull" (Name, Fanout) or "state" (Name: its pins, exposures and
	// holders as this node sees them).
	Op, Node, IP, Etcd, Name string
	Size, Chunk              int64
	Fanout                   bool
	Streams                  int
	// Version and Shard name a version's shard (of Shards) for "put"
	// and "pull"; 0 for a plain object.
	Version       uint64
	Shard, Shards uint32
}

// nodeReply answers a nodeCmd.
type nodeReply struct {
	Err string
	// Sum is the sha256 of the object put or pulled; Seconds how long the
	// pull took; Fed how many of its bytes came from feeders.
	Sum     string
	Seconds float64
	Fed     uint64
	// Pinned, Exposed and Holders answer "state", Latest the name's
	// latest committed version (0 for none).
	Pinned, Exposed int
	Holders         []string
	Latest          uint64
}

const fanoutPrefix = "/t/fanout/"

// maxFanout is issue 19's bound: with fan-out, all readers done within
// this many times size / link rate.
const maxFanout = 1.3

// fanoutNode is one cluster node in a network namespace of its own: UCX
// over tcp on its eth0 (UCX_NET_DEVICES, set by the test), the control
// channel on its address, and a puller with and one without fan-out.
func fanoutNode(p *testutil.Peer) error {
	var c nodeCmd
	if err := p.Recv(&c); err != nil {
		return err
	}
	tr, err := ucxtransport.New(c.Node)
	if err != nil {
		return err
	}
	defer tr.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	var n *clustertest.Node
	var closeNode func()
	for {
		// etcd starts beside the nodes: wait for it, bounded.
		n, closeNode, err = clustertest.OpenNode(ctx, clustertest.NodeOptions{Endpoints: []string{c.Etcd}, Prefix: fanoutPrefix,
			Listen: net.JoinHostPort(c.IP, "7946"), Name: c.Node, Secret: secret, T: node{tr}})
		if err == nil || !errors.Is(err, cluster.ErrUnavailable) || ctx.Err() != nil {
			break
		}
		time.Sleep(200 * time.Millisecond)
	}
	cancel()
	if err != nil {
		return err
	}
	defer closeNode()
	fan := &cluster.Puller{Dir: n.Dir, Transport: node{tr}, Secret: secret, Sink: n.Store, ChunkTimeout: 10 * time.Second,
		Feeds: n.Dir, Feeding: n.Feeding, StreamsPerHolder: c.Streams}
	n.P.ChunkTimeout, n.P.StreamsPerHolder = 10*time.Second, c.Streams
	if err := p.Send(nodeReply{}); err != nil {
		return err
	}
	for {
		if err := p.Recv(&c); err != nil {
			if errors.Is(err, io.EOF) {
				return nil
			}
			return err
		}
		var r nodeReply
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
		switch c.Op {
		case "put":
			b := make([]byte, c.Size)
			rand.NewChaCha8([32]byte{byte(c.Size), byte(c.Shard), byte(c.Version)}).Read(b)
			_, b, err := n.PublishAs(ctx, cluster.Object{Name: c.Name, Owner: 1000, ChunkSize: c.Chunk,
				Version: c.Version, Shard: c.Shard, Shards: c.Shards}, b)
			if err != nil {
				r.Err = err.Error()
				break
			}
			s := sha256.Sum256(b)
			r.Sum = hex.EncodeToString(s[:])
		case "pull":
			pl := n.P
			if c.Fanout {
				pl = fan
			}
			ref := cluster.Ref{Owner: 1000, Name: c.Name, Version: c.Version, Shard: c.Shard}
			fed := pl.Stats().FedBytes
			start := time.Now()
			if _, err := pl.Pull(ctx, ref); err != nil {
				r.Err = err.Error()
				break
			}
			r.Seconds = time.Since(start).Seconds()
			r.Fed = pl.Stats().FedBytes - fed
			s := sha256.Sum256(n.Store.Get(ref))
			r.Sum = hex.EncodeToString(s[:])
		case "state":
			ref := cluster.Ref{Owner: 1000, Name: c.Name, Version: c.Version, Shard: c.Shard}
			var err error
			if r.Pinned, err = n.Dir.Pinned(ctx, ref); err == nil {
				var e cluster.Entry
				e, err = n.Dir.Lookup(ctx, ref)
				r.Holders = e.Holders
			}
			if err == nil || errors.Is(err, cluster.ErrNotFound) {
				var l cluster.Latest
				if l, err = n.Dir.Latest(ctx, 1000, c.Name); err == nil {
					r.Latest = l.Version
				} else if errors.Is(err, cluster.ErrNotFound) {
					err = nil
				}
			}
			if err != nil {
				r.Err = err.Error()
			}
			r.Exposed = n.Store.Exposed()
		default:
			r.Err = "unknown op " + c.Op
		}
		cancel()
		if err := p.Send(r); err != nil {
			return err
		}
	}
}

// recv reads a helper's reply, failing the test when none comes within d
// or the reply is an error.
func recv(t *testing.T, c *testutil.Child, d time.Duration) nodeReply {
	t.Helper()
	r := recvAny(t, c, d)
	if r.Err != "" {
		t.Fatalf("helper %d: %s", c.Pid(), r.Err)
	}
	return r
}

// recvAny reads a helper's reply, error or not.
func recvAny(t *testing.T, c *testutil.Child, d time.Duration) nodeReply {
	t.Helper()
	ch := make(chan error, 1)
	var r nodeReply
	go func() { ch <- c.Recv(&r) }()
	select {
	case err := <-ch:
		if err != nil {
			t.Fatalf("helper %d: %v\n%s", c.Pid(), err, c.Stderr())
		}
	case <-time.After(d):
		t.Fatalf("helper %d: no answer within %v\n%s", c.Pid(), d, c.Stderr())
	}
	return r
}

// parseRate parses tc's "200mbit" into bits per second.
func parseRate(t *testing.T, s string) float64 {
	for _, u := range []struct {
		suffix string
		mult   float64
	}{{"gbit", 1e9}, {"mbit", 1e6}, {"kbit", 1e3}} {
		if v, ok := strings.CutSuffix(s, u.suffix); ok {
			f, err := strconv.ParseFloat(v, 64)
			if err == nil && f > 0 {
				return f * u.mult
			}
		}
	}
	t.Fatalf("rate %q: want e.g. 200mbit", s)
	return 0
}

// TestFanoutOverLimitedLinks is issue 19's fan-out test: one publisher
// and four readers, each a process in a network namespace of its own
// behind a link limited to the same rate both ways (clustertest.Net.Link:
// HTB, jumbo frames). Four pulls straight from the publisher share its
// link, so the last ends after at least 4 × size/rate (logged, and the
// same run's reference); with fan-out the readers chain, each byte crosses
// every link once, and the last reader must be done within 1.3 × size/rate
// (the bound) and within half the time of the last naive pull;
// one reader is served by the publisher, the others wholly by feeders.
//
// A timed assertion, which the project otherwise avoids: the issue asks
// for this bound in CI. It holds with margin because the links, not the
// CPUs, set the pace: at the default 25 Mbit/s the five processes move
// about 12 MB/s in all, a tenth of what the project's 2-core machine moves
// between them, and one copy takes 4 s, so the bound leaves 1.2 s for what
// the chain adds. What it adds, measured (docs/lab/cluster-measured.md): the frames'
// headers (0.7% at MTU 9000), the setup before the first read (10-50 ms:
// directory records, control channel, UCX connect), one chunk's time on the
// link per hop (64 KiB: 21 ms; chunks are whole when forwarded) and
// scheduling stalls of a loaded machine (up to ~0.1 s seen): 1.03-1.09×
// in 30 runs, quiet, with -race and beside CPU hogs. A reader's
// time is its own, from its request to its sealed replica, which leaves out
// the pipes to this process.
//
// CUDAIPC_FANOUT_RATE (e.g. 100mbit), CUDAIPC_FANOUT_MIB,
// CUDAIPC_FANOUT_CHUNK_KIB (a power of two, at least 64) and
// CUDAIPC_FANOUT_STREAMS (reads in flight per source, default 8) change
// the defaults (25mbit, 12 MiB, 64 KiB); at higher rates the CPUs of a
// small machine may set the pace instead, and the bound then measures the
// machine.
func TestFanoutOverLimitedLinks(t *testing.T) {
	requireUCX(t)
	clustertest.RequireNet(t)
	etcdtest.Require(t)
	rate := "25mbit"
	if s := os.Getenv("CUDAIPC_FANOUT_RATE"); s != "" {
		rate = s
	}
	mib := int64(12)
	if s := os.Getenv("CUDAIPC_FANOUT_MIB"); s != "" {
		var err error
		if mib, err = strconv.ParseInt(s, 10, 64); err != nil || mib <= 0 {
			t.Fatalf("CUDAIPC_FANOUT_MIB=%q", s)
		}
	}
	chunk, streams := int64(64<<10), 8
	if s := os.Getenv("CUDAIPC_FANOUT_CHUNK_KIB"); s != "" {
		k, _ := strconv.Atoi(s)
		chunk = int64(k) << 10
	}
	if s := os.Getenv("CUDAIPC_FANOUT_STREAMS"); s != "" {
		streams, _ = strconv.Atoi(s)
	}
	size := mib << 20
	ideal := float64(size) * 8 / parseRate(t, rate) // seconds for one copy over one link
	const readers = 4
	limit := time.Duration((8*ideal + 60) * float64(time.Second))

	nw := clustertest.NewNet(t)
	etcd := nw.StartEtcd()
	var nodes []*testutil.Child
	for i := range readers + 1 {
		name := "pub"
		if i > 0 {
			name = fmt.Sprintf("r%d", i)
		}
		c := testutil.SpawnWith(t, "fanout-node", testutil.SpawnOptions{SysProcAttr: clustertest.NewNetnsAttr(),
			Env: []string{"UCX_TLS=tcp", "UCX_NET_DEVICES=eth0", "UCX_WARN_UNUSED_ENV_VARS=n", "UCX_LOG_FILE=stderr"}})
		ip := nw.Link(c.Pid(), rate)
		if err := c.Send(nodeCmd{Op: "start", Node: name, IP: ip, Etcd: etcd, Streams: streams}); err != nil {
			t.Fatal(err)
		}
		nodes = append(nodes, c)
	}
	for _, c := range nodes {
		recv(t, c, time.Minute)
	}
	pub, rs := nodes[0], nodes[1:]

	round := func(name string, fanout bool) (wall time.Duration, each []float64, fed []uint64) {
		t.Helper()
		if err := pub.Send(nodeCmd{Op: "put", Name: name, Size: size, Chunk: chunk}); err != nil {
			t.Fatal(err)
		}
		want := recv(t, pub, time.Minute).Sum
		start := time.Now()
		for _, c := range rs {
			if err := c.Send(nodeCmd{Op: "pull", Name: name, Fanout: fanout}); err != nil {
				t.Fatal(err)
			}
		}
		for i, c := range rs {
			r := recv(t, c, limit)
			if r.Sum != want {
				t.Fatalf("%s: reader r%d's replica has sha256 %s, the publisher's %s", name, i+1, r.Sum, want)
			}
			each, fed = append(each, r.Seconds), append(fed, r.Fed)
		}
		return time.Since(start), each, fed
	}
	naive, naiveEach, _ := round("ns/naive", false)
	fan, fanEach, fed := round("ns/fanout", true)

	t.Logf("%d MiB to %d readers over %s links (one copy: %.2fs)", mib, readers, rate, ideal)
	t.Logf("naive:   all done in %.2fs = %.2f× one copy (each: %s)", naive.Seconds(), naive.Seconds()/ideal, secs(naiveEach))
	t.Logf("fan-out: all done in %.2fs = %.2f× one copy (each: %s; bytes from feeders: %v)", fan.Seconds(), fan.Seconds()/ideal, secs(fanEach), fed)
	f, nv := slices.Max(fanEach), slices.Max(naiveEach)
	if f > maxFanout*ideal {
		t.Errorf("the last reader took %.2fs with fan-out = %.2f× size/rate (naive: %.2f×): want at most %.1f×",
			f, f/ideal, nv/ideal, maxFanout)
	}
	if f > nv/2 {
		t.Errorf("the last reader took %.2fs with fan-out (%.2f× size/rate), %.2fs without (%.2f×): want at most half",
			f, f/ideal, nv, nv/ideal)
	}
	zero, all := 0, 0
	for _, b := range fed {
		if b == 0 {
			zero++
		} else if b == uint64(size) {
			all++
		}
	}
	if zero != 1 || all != readers-1 {
		t.Errorf("bytes from feeders %v: want one reader from the publisher, the others all from feeders", fed)
	}
	for _, c := range nodes {
		c.CloseStdin()
	}
	for _, c := range nodes {
		if err := c.Wait(30 * time.Second); err != nil {
			t.Errorf("helper %d: %v\n%s", c.Pid(), err, c.Stderr())
		}
	}
}

func secs(s []float64) string {
	var b strings.Builder
	for i, v := range s {
		if i > 0 {
			b.WriteString(" ")
		}
		fmt.Fprintf(&b, "%.2fs", v)
	}
	return b.String()
}

package node_test

import (
	"context"
	"fmt"
	"os"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/cudaipc/cudaipc/client"
	"github.com/cudaipc/cudaipc/cluster"
	"github.com/cudaipc/cudaipc/cluster/internal/clustertest"
	"github.com/cudaipc/cudaipc/cluster/internal/etcdtest"
	"github.com/cudaipc/cudaipc/cluster/node"
	"github.com/cudaipc/cudaipc/internal/testutil"
	"github.com/cudaipc/cudaipc/store"
	"github.com/cudaipc/cudaipc/transport/ucx"
)

// Last copies with real daemons, each a helper process: node B, near its
// capacity, holds big2, whose other holder A has died (so B's replica is
// the cluster's last copy), and a node-local object. B then pulls big3,
// which needs room, from C, and C fails in the middle of the pull: killed
// (SIGKILL, on loopback) or cut off (its link dropping every packet, in
// network namespaces the test makes). The pull fails cleanly, leaving no
// half object; the room it made came from the node-local object, never
// from big2, which is still readable on B with its bytes.

// Sizes on B (host memory, capacity 96 MiB): big2 and local take 56 MiB,
// big3 needs 48 of the 40 left, so one of them must go.
const (
	lcCapacity = 96 << 20
	lcBig2     = 40 << 20
	lcLocal    = 16 << 20
	lcBig3     = 48 << 20
)

// lcDaemons starts the scenario's daemons: start makes one with c's
// start command (Node, Capacity, PullDelay, Streams, ChunkTimeout).
type lcDaemons struct {
	start func(c daemonCmd) *helperDaemon
}

// lastCopyScenario runs the scenario up to the failed pull; cut fails C
// mid-pull. It returns B, and C's failure time.
func lastCopyScenario(t *testing.T, ds lcDaemons, chunkTimeout time.Duration, cut func(c *helperDaemon)) (b *helperDaemon, failed time.Duration) {
	a := ds.start(daemonCmd{Node: "a", Capacity: 1 << 30})
	// B's chunk reads are slowed (0.3 s each, two in flight), so that its
	// pull of big3's 12 chunks lasts about 2 s: time to fail C within it.
	b = ds.start(daemonCmd{Node: "b", Capacity: lcCapacity, PullDelay: 300 * time.Millisecond, Streams: 2, ChunkTimeout: chunkTimeout})
	a.ask(t, daemonCmd{Op: "put", Name: "big2", Size: lcBig2, Seed: 2})
	if r := b.ask(t, daemonCmd{Op: "read", Name: "big2", Size: lcBig2, Seed: 2}); r.GetErr != "" {
		t.Fatalf("B's first read of big2: %s", r.GetErr)
	}
	a.kill(t)
	// B's replica is the last copy once A's lease has run out (TTL 2 s).
	testutil.Eventually(t, 20*time.Second, func() error {
		if h := b.ask(t, daemonCmd{Op: "holders", Name: "big2"}).Holders; !slices.Equal(h, []string{"b"}) {
			return fmt.Errorf("big2's holders %v, want only b", h)
		}
		return nil
	})
	b.ask(t, daemonCmd{Op: "put", Name: "local", Size: lcLocal, Seed: 3, Local: true})
	c := ds.start(daemonCmd{Node: "c", Capacity: 1 << 30})
	c.ask(t, daemonCmd{Op: "put", Name: "big3", Size: lcBig3, Seed: 4})

	before := b.ask(t, daemonCmd{Op: "stats"}).Got // big2's
	b.ask(t, daemonCmd{Op: "get", Name: "big3"})
	testutil.Eventually(t, 30*time.Second, func() error {
		s := b.ask(t, daemonCmd{Op: "stats"})
		if s.GetDone {
			t.Fatalf("B's get of big3 ended before C failed: %q", s.GetErr)
		}
		if s.Got == before {
			return fmt.Errorf("B has read nothing of big3 yet (%d pulls in flight)", s.InFlight)
		}
		return nil
	})
	// The room was made (a holder answered before it): the node-local
	// object went, not the last copy.
	if b.ask(t, daemonCmd{Op: "has", Name: "local"}).Has {
		t.Fatal("B made room for big3 without evicting the node-local object")
	}
	if s := b.ask(t, daemonCmd{Op: "stats"}); s.Got-before >= lcBig3 {
		t.Fatalf("B read all of big3 before C failed")
	}
	cut(c)
	cutAt := time.Now()
	var getErr string
	testutil.Eventually(t, max(3*chunkTimeout, 30*time.Second)+10*time.Second, func() error {
		s := b.ask(t, daemonCmd{Op: "stats"})
		if !s.GetDone {
			return fmt.Errorf("B's get of big3 still running %v after C failed", time.Since(cutAt).Round(time.Millisecond))
		}
		getErr = s.GetErr
		return nil
	})
	failed = time.Since(cutAt)
	t.Logf("B's get of big3 failed %v after C failed: %s", failed.Round(time.Millisecond), getErr)
	// One line naming C; or, where C's lease (2 s) ran out before the get
	// looked the object up again after the failed pull, saying that no
	// live node holds it.
	if getErr == "" || strings.Contains(getErr, "\n") ||
		!strings.Contains(getErr, "node c") && !strings.Contains(getErr, "no live node holds the object") {
		t.Fatalf("B's get of big3 with its only holder failed: %q, want one line naming node c or no live holder", getErr)
	}
	if b.ask(t, daemonCmd{Op: "has", Name: "big3"}).Has {
		t.Fatal("B has big3 after its pull failed: a half object")
	}
	if r := b.ask(t, daemonCmd{Op: "read", Name: "big2", Size: lcBig2, Seed: 2}); r.GetErr != "" {
		t.Fatalf("big2, the cluster's last copy, after B's failed pull: %s", r.GetErr)
	}
	if h := b.ask(t, daemonCmd{Op: "holders", Name: "big2"}).Holders; !slices.Equal(h, []string{"b"}) {
		t.Fatalf("big2's holders after B's failed pull: %v, want b", h)
	}
	return b, failed
}

func requireClusterDaemons(t *testing.T) *etcdtest.Server {
	t.Helper()
	if err := ucx.Available(); err != nil {
		if os.Getenv("CUDAIPC_REQUIRE_UCX") == "1" || os.Getenv(etcdtest.EnvRequire) == "1" {
			t.Fatal(err)
		}
		t.Skip(err)
	}
	return etcdtest.Start(t)
}

// TestPullSparesLastCopy is the scenario on loopback with C killed
// mid-pull; then B, holding the last copy big2 and 56 MiB free, is asked
// for D's big4 of 60 MiB: the get fails STORE_FULL naming the node, the
// device and the last copy that holds the room, evicting nothing; and a
// replica that D (alive) holds too is evicted for D's big5 while big2
// stays.
func TestPullSparesLastCopy(t *testing.T) {
	srv := requireClusterDaemons(t)
	ds := lcDaemons{start: func(c daemonCmd) *helperDaemon {
		c.Backend = "host"
		return startHelperDaemonWith(t, srv, c)
	}}
	b, _ := lastCopyScenario(t, ds, 0, func(c *helperDaemon) { c.kill(t) })

	d := ds.start(daemonCmd{Node: "d", Capacity: 1 << 30})
	d.ask(t, daemonCmd{Op: "put", Name: "big4", Size: 60 << 20, Seed: 5})
	r := b.ask(t, daemonCmd{Op: "read", Name: "big4", Size: 60 << 20, Seed: 5})
	for _, want := range []string{"store full", "node b", "device host", "1 object, 40 MiB, is a last copy in the cluster"} {
		if !strings.Contains(r.GetErr, want) {
			t.Errorf("B's get of big4 with only a last copy to evict: %q, want it to say %q", r.GetErr, want)
		}
	}
	if b.ask(t, daemonCmd{Op: "has", Name: "big4"}).Has || !b.ask(t, daemonCmd{Op: "has", Name: "big2"}).Has {
		t.Fatal("B's failed get of big4 left it, or took big2")
	}
	// rep is held by D too: it may go for big5 (16 + 40 + 50 > 96 MiB).
	d.ask(t, daemonCmd{Op: "put", Name: "rep", Size: 16 << 20, Seed: 6})
	d.ask(t, daemonCmd{Op: "put", Name: "big5", Size: 50 << 20, Seed: 7})
	if r := b.ask(t, daemonCmd{Op: "read", Name: "rep", Size: 16 << 20, Seed: 6}); r.GetErr != "" {
		t.Fatalf("B's get of rep: %s", r.GetErr)
	}
	testutil.Eventually(t, 20*time.Second, func() error {
		if h := b.ask(t, daemonCmd{Op: "holders", Name: "rep"}).Holders; !slices.Equal(h, []string{"b", "d"}) {
			return fmt.Errorf("rep's holders %v, want b and d", h)
		}
		return nil
	})
	if r := b.ask(t, daemonCmd{Op: "read", Name: "big5", Size: 50 << 20, Seed: 7}); r.GetErr != "" {
		t.Fatalf("B's get of big5, with rep (held by D too) to evict: %s", r.GetErr)
	}
	if b.ask(t, daemonCmd{Op: "has", Name: "rep"}).Has {
		t.Fatal("B made room for big5 without evicting rep, which D holds too")
	}
	if r := b.ask(t, daemonCmd{Op: "read", Name: "big2", Size: lcBig2, Seed: 2}); r.GetErr != "" {
		t.Fatalf("big2 after B made room for big5: %s", r.GetErr)
	}
}

// TestPartitionedHolderSparesLastCopy is the scenario in network
// namespaces the test makes, C cut off mid-pull (every packet on its link
// dropped, both ways): B's pull fails once its chunk timeout (2 s here)
// drops C, with one line naming it.
func TestPartitionedHolderSparesLastCopy(t *testing.T) {
	requireClusterDaemons(t)
	nw := clustertest.NewNet(t)
	etcd := nw.StartEtcd()
	const chunkTimeout = 2 * time.Second
	ds := lcDaemons{start: func(c daemonCmd) *helperDaemon {
		h := &helperDaemon{name: c.Node, c: testutil.SpawnWith(t, "daemon", testutil.SpawnOptions{SysProcAttr: clustertest.NewNetnsAttr(),
			Env: []string{"UCX_TLS=tcp", "UCX_NET_DEVICES=eth0", "UCX_WARN_UNUSED_ENV_VARS=n"}})}
		nw.Link(h.c.Pid(), "")
		c.Op, c.Etcd, c.Prefix, c.Backend, c.Listen = "start", etcd, "/t/"+t.Name()+"/", "host", ":0"
		h.ask(t, c)
		return h
	}}
	_, failed := lastCopyScenario(t, ds, chunkTimeout, func(c *helperDaemon) { nw.Partition(c.c.Pid()) })
	if failed > 3*chunkTimeout+5*time.Second {
		t.Errorf("B's pull failed %v after the partition, with a chunk timeout of %v", failed, chunkTimeout)
	}
}

// MayEvict vouches for a replica only while the directory says another
// live node holds the same incarnation: not for an object only this node
// holds, nor for another incarnation, nor for anything while etcd is away
// (a last copy, by default); once etcd is back it vouches again.
func TestMayEvictAsksTheDirectory(t *testing.T) {
	srv := requireClusterDaemons(t)
	a, b := startDaemon(t, srv, "a"), startDaemon(t, srv, "b")
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	a.put(t, "shared-copy", 1<<20, client.CreateOptions{Cluster: true})
	b.put(t, "only-b", 1<<20, client.CreateOptions{Cluster: true})
	if _, err := b.get(ctx, "shared-copy"); err != nil {
		t.Fatal(err)
	}
	owner := uint32(os.Getuid())
	entry := func(name string, holders ...string) cluster.Entry {
		var e cluster.Entry
		testutil.Eventually(t, 20*time.Second, func() error {
			var err error
			if e, err = b.node.Directory().Lookup(ctx, cluster.Ref{Owner: owner, Name: name}); err != nil {
				return err
			}
			if !slices.Equal(e.Holders, holders) {
				return fmt.Errorf("%s: holders %v, want %v", name, e.Holders, holders)
			}
			return nil
		})
		return e
	}
	both, mine := entry("shared-copy", "a", "b"), entry("only-b", "b")
	objs := []store.ClusterObject{
		{Owner: owner, Name: "shared-copy", ID: both.ID},
		{Owner: owner, Name: "only-b", ID: mine.ID},
		{Owner: owner, Name: "shared-copy", ID: "another-incarnation"},
	}
	vouched := func(n *node.Node) []bool { return n.MayEvict(ctx, objs) }
	testutil.Eventually(t, 10*time.Second, func() error {
		if got := vouched(b.node); !slices.Equal(got, []bool{true, false, false}) {
			return fmt.Errorf("B vouches %v, want [true false false]", got)
		}
		return nil
	})
	if got := vouched(a.node)[0]; !got {
		t.Fatal("A does not vouch for shared-copy, which B holds too")
	}
	srv.Kill()
	testutil.Eventually(t, 20*time.Second, func() error {
		if got := vouched(b.node); slices.Contains(got, true) {
			return fmt.Errorf("B vouches %v with etcd away, want nothing", got)
		}
		return nil
	})
	srv.Restart()
	testutil.Eventually(t, 30*time.Second, func() error {
		if got := vouched(b.node); !slices.Equal(got, []bool{true, false, false}) {
			return fmt.Errorf("B vouches %v once etcd is back, want [true false false]", got)
		}
		return nil
	})
}

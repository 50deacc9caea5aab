package etcddir

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/cudaipc/cudaipc/cluster"
	"github.com/cudaipc/cudaipc/cluster/internal/etcdtest"
	"github.com/cudaipc/cudaipc/internal/testutil"
)

// testCallTimeout is long: the test machine may be loaded.
const testCallTimeout = 5 * time.Second

var testSecret = mustSecret("0123456789abcdef-test-secret")

func mustSecret(s string) cluster.Secret {
	sec, err := cluster.NewSecret([]byte(s))
	if err != nil {
		panic(err)
	}
	return sec
}

func open(t *testing.T, srv *etcdtest.Server, node string, mod ...func(*Config)) *Directory {
	t.Helper()
	cfg := Config{Endpoints: []string{srv.Endpoint()}, Node: node, Secret: testSecret, TTL: 2 * time.Second, CallTimeout: testCallTimeout, Prefix: "/t/" + t.Name() + "/"}
	for _, m := range mod {
		m(&cfg)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	d, err := Open(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { d.Close() })
	return d
}

// eventually polls cond every 50 ms until it holds, failing the test after
// timeout.
func eventually(t *testing.T, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("not within %v: %s", timeout, what)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func ctxT(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	t.Cleanup(cancel)
	return ctx
}

func node(name string) cluster.Node {
	return cluster.Node{Name: name, Worker: []byte("worker-" + name), Control: "10.0.0.1:7000"}
}

func object(name string, size int64) (cluster.Object, []byte) {
	b := make([]byte, size)
	rand.NewChaCha8([32]byte{byte(size), byte(size >> 8), byte(size >> 16)}).Read(b)
	chunk := cluster.ChunkSizeFor(size)
	return cluster.Object{Name: name, Owner: 1000, Size: size, ChunkSize: chunk, Sums: cluster.Checksums(b, chunk), ID: cluster.NewID()}, b
}

// mustPublish publishes o through d and fails the test if that fails.
func mustPublish(t *testing.T, ctx context.Context, d *Directory, o cluster.Object) {
	t.Helper()
	if _, err := d.Publish(ctx, o); err != nil {
		t.Fatalf("publish %s: %v", o.Ref(), err)
	}
}

// mustJoin joins d to the cluster as node(name) and fails the test if
// that fails.
func mustJoin(t *testing.T, ctx context.Context, d *Directory, name string) {
	t.Helper()
	if err := d.Join(ctx, node(name)); err != nil {
		t.Fatalf("join %s: %v", name, err)
	}
}

// wantDeleted fails the test unless the next event, within 5 s, reports
// the deletion of o's incarnation.
func wantDeleted(t *testing.T, events <-chan Event, o cluster.Object) {
	t.Helper()
	if ev := testutil.Next(t, events, 5*time.Second); !ev.Deleted || ev.Ref != o.Ref() || ev.ID != o.ID {
		t.Fatalf("event %+v, want the deletion of %s incarnation %s", ev, o.Ref(), o.ID)
	}
}

func TestParseURL(t *testing.T) {
	eps, tls, err := ParseURL("etcd://a:2379,10.0.0.2:2379")
	if err != nil || tls || !slices.Equal(eps, []string{"http://a:2379", "http://10.0.0.2:2379"}) {
		t.Fatalf("got %v %v %v", eps, tls, err)
	}
	eps, tls, err = ParseURL("etcds://[::1]:2379")
	if err != nil || !tls || !slices.Equal(eps, []string{"https://[::1]:2379"}) {
		t.Fatalf("got %v %v %v", eps, tls, err)
	}
	for _, bad := range []string{"", "http://a:1", "etcd://", "etcd://a", "etcd://a:0", "etcd://a:x", "etcd://a:1,,b:2"} {
		if _, _, err := ParseURL(bad); err == nil {
			t.Errorf("ParseURL(%q) accepted", bad)
		}
	}
}

func TestNodesJoinAndVanish(t *testing.T) {
	srv := etcdtest.Start(t)
	a, b := open(t, srv, "a"), open(t, srv, "b")
	ctx := ctxT(t)
	mustJoin(t, ctx, a, "a")
	mustJoin(t, ctx, b, "b")
	if err := a.Join(ctx, node("a")); err != nil {
		t.Fatalf("rejoin on the same lease: %v", err)
	}
	a2 := open(t, srv, "a")
	if err := a2.Join(ctx, node("a")); !errors.Is(err, cluster.ErrExists) {
		t.Fatalf("a second live node named a: %v, want ErrExists", err)
	}
	ns, err := b.Nodes(ctx)
	if err != nil || len(ns) != 2 || ns[0].Name != "a" || string(ns[1].Worker) != "worker-b" {
		t.Fatalf("nodes: %+v %v", ns, err)
	}
	// A node that dies (stops renewing) vanishes within its TTL.
	a.abandon()
	start := time.Now()
	eventually(t, 8*time.Second, "a's record expires", func() bool {
		_, err := b.Node(ctx, "a")
		return errors.Is(err, cluster.ErrNotFound)
	})
	t.Logf("a dead node's record went after %v (TTL 2s)", time.Since(start).Round(100*time.Millisecond))
	// Its name is free again.
	mustJoin(t, ctx, a2, "a")
	// A node that closes leaves at once.
	b.Close()
	if _, err := a2.Node(ctx, "b"); !errors.Is(err, cluster.ErrNotFound) {
		t.Fatalf("b after Close: %v", err)
	}
}

func TestPublishLookupHoldersDelete(t *testing.T) {
	srv := etcdtest.Start(t)
	a, b, c := open(t, srv, "a"), open(t, srv, "b"), open(t, srv, "c")
	ctx := ctxT(t)
	events := c.Watch(ctx)
	o, _ := object("model/w 1", 5<<20+17)
	ref := o.Ref()
	if _, err := b.Lookup(ctx, ref); !errors.Is(err, cluster.ErrNotFound) {
		t.Fatalf("lookup before publish: %v", err)
	}
	mustPublish(t, ctx, a, o)
	e, err := b.Lookup(ctx, ref)
	if err != nil {
		t.Fatal(err)
	}
	if e.ID != o.ID || e.Size != o.Size || !slices.Equal(e.Sums, o.Sums) || e.Origin != "a" || !slices.Equal(e.Holders, []string{"a"}) {
		t.Fatalf("entry %+v", e)
	}
	o2 := o
	o2.ID = cluster.NewID()
	if _, err := b.Publish(ctx, o2); !errors.Is(err, cluster.ErrExists) {
		t.Fatalf("publish over a held name: %v", err)
	}
	if err := b.AddHolder(ctx, e); err != nil {
		t.Fatal(err)
	}
	if e, _ = c.Lookup(ctx, ref); !slices.Equal(e.Holders, []string{"a", "b"}) {
		t.Fatalf("holders %v", e.Holders)
	}
	// Another owner's name of the same spelling is another object.
	other := o
	other.Owner, other.ID = 1001, cluster.NewID()
	mustPublish(t, ctx, c, other)
	ls, err := c.List(ctx)
	if err != nil || len(ls) != 2 || ls[0].Owner != 1000 || len(ls[0].Holders) != 2 || ls[1].Owner != 1001 {
		t.Fatalf("list %+v %v", ls, err)
	}
	if err := b.RemoveHolder(ctx, ref); err != nil {
		t.Fatal(err)
	}
	// Holders leave, then a new incarnation may replace the record.
	if err := a.RemoveHolder(ctx, ref); err != nil {
		t.Fatal(err)
	}
	if e, _ = c.Lookup(ctx, ref); len(e.Holders) != 0 {
		t.Fatalf("holders %v", e.Holders)
	}
	if _, err := b.Publish(ctx, o2); err != nil {
		t.Fatalf("publish over an unheld name: %v", err)
	}
	// Advertising a replica of the old incarnation fails.
	if err := a.AddHolder(ctx, e); !errors.Is(err, cluster.ErrNotFound) {
		t.Fatalf("advertise a replaced incarnation: %v", err)
	}
	if e, _ = c.Lookup(ctx, ref); e.ID != o2.ID || !slices.Equal(e.Holders, []string{"b"}) {
		t.Fatalf("after replacement: %+v", e)
	}
	if err := a.Delete(ctx, 1000, o.Name); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Lookup(ctx, ref); !errors.Is(err, cluster.ErrNotFound) {
		t.Fatalf("lookup after delete: %v", err)
	}
	if err := a.Delete(ctx, 1000, o.Name); !errors.Is(err, cluster.ErrNotFound) {
		t.Fatalf("second delete: %v", err)
	}
	if err := b.AddHolder(ctx, e); !errors.Is(err, cluster.ErrNotFound) {
		t.Fatalf("advertise a deleted name: %v", err)
	}
	wantDeleted(t, events, o2)
}

func TestForgedRecordsRejected(t *testing.T) {
	srv := etcdtest.Start(t)
	a := open(t, srv, "a")
	evil := open(t, srv, "evil", func(c *Config) { c.Secret = mustSecret("another-secret-of-16+bytes") })
	ctx := ctxT(t)
	o, _ := object("x", 1000)
	mustPublish(t, ctx, evil, o)
	if _, err := a.Lookup(ctx, o.Ref()); !errors.Is(err, cluster.ErrBadRecord) {
		t.Fatalf("record written with another secret: %v, want ErrBadRecord", err)
	}
	mustJoin(t, ctx, evil, "evil")
	if ns, err := a.Nodes(ctx); err != nil || len(ns) != 0 {
		t.Fatalf("nodes with a forged one: %+v %v", ns, err)
	}
	// A genuine record moved to another key does not verify either.
	y, _ := object("y", 1000)
	mustPublish(t, ctx, a, y)
	r, err := a.cli.Get(ctx, a.k.obj(y.Ref()))
	if err != nil {
		t.Fatal(err)
	}
	z := cluster.Ref{Owner: 1000, Name: "z"}
	for _, v := range []string{string(r.Kvs[0].Value), "", "garbage", "cr1" + string(make([]byte, 40))} {
		if _, err := a.cli.Put(ctx, a.k.obj(z), v); err != nil {
			t.Fatal(err)
		}
		if _, err := a.Lookup(ctx, z); !errors.Is(err, cluster.ErrBadRecord) {
			t.Fatalf("value %.20q under another key: %v, want ErrBadRecord", v, err)
		}
	}
	ls, err := a.List(ctx)
	if err != nil || len(ls) != 1 || ls[0].Name != "y" {
		t.Fatalf("list keeps only the genuine record: %+v %v", ls, err)
	}
}

func TestVersionsAcrossNodes(t *testing.T) {
	srv := etcdtest.Start(t)
	a, b, c := open(t, srv, "a"), open(t, srv, "b"), open(t, srv, "c")
	ctx := ctxT(t)
	if _, err := c.Latest(ctx, 1000, "w"); !errors.Is(err, cluster.ErrNotFound) {
		t.Fatalf("latest before any: %v", err)
	}
	m := loadedMirror(t, ctx, c)
	for v := uint64(1); v <= 3; v++ {
		for shard, d := range []*Directory{a, b} {
			o, _ := object("w", 70000)
			o.Version, o.Shard, o.Shards = v, uint32(shard), 2
			committed, err := d.Publish(ctx, o)
			if err != nil {
				t.Fatal(err)
			}
			if committed != (shard == 1) {
				t.Fatalf("v%d shard %d: committed=%v", v, shard, committed)
			}
			if shard == 0 {
				if l, err := c.Latest(ctx, 1000, "w"); v > 1 && (err != nil || l.Version != v-1) || v == 1 && !errors.Is(err, cluster.ErrNotFound) {
					t.Fatalf("v%d half published: latest %+v %v", v, l, err)
				}
			}
		}
		eventually(t, 10*time.Second, fmt.Sprintf("the mirror shows v%d committed", v), func() bool {
			l, ok := m.Latest(1000, "w")
			return ok && l.Version == v && l.Shards == 2
		})
	}
	if l, err := c.Latest(ctx, 1000, "w"); err != nil || l.Version != 3 {
		t.Fatalf("latest: %+v %v", l, err)
	}
	// An older version published late does not move latest back.
	o, _ := object("w", 100)
	o.Version, o.Shards = 2, 1
	o.Name = "w"
	if _, err := a.Publish(ctx, o); !errors.Is(err, cluster.ErrExists) {
		t.Fatalf("republish v2 shard 0: %v", err)
	}
	ls, err := c.List(ctx)
	if err != nil || len(ls) != 6 || ls[5].Latest != 3 {
		t.Fatalf("list: %d entries, %v", len(ls), err)
	}
	if err := b.Delete(ctx, 1000, "w"); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Latest(ctx, 1000, "w"); !errors.Is(err, cluster.ErrNotFound) {
		t.Fatalf("latest after delete: %v", err)
	}
}

// A version is committed only with a live holder for each shard: a
// publisher that goes after shard 0 of 2 (its lease with it) leaves a
// record no one holds, and the publisher of shard 1 does not commit the
// version; a live node publishing shard 0 again (replacing the unheld
// record) does.
func TestVersionNeedsLiveShards(t *testing.T) {
	srv := etcdtest.Start(t)
	a, b, c := open(t, srv, "a"), open(t, srv, "b"), open(t, srv, "c")
	ctx := ctxT(t)
	shard := func(d *Directory, i uint32) (bool, error) {
		o, _ := object("w", 5000+int64(i))
		o.Version, o.Shard, o.Shards = 4, i, 2
		return d.Publish(ctx, o)
	}
	if committed, err := shard(a, 0); err != nil || committed {
		t.Fatalf("shard 0 on a: committed=%v %v", committed, err)
	}
	if err := a.Close(); err != nil { // revokes a's lease: its holder key goes at once
		t.Fatal(err)
	}
	if committed, err := shard(b, 1); err != nil || committed {
		t.Fatalf("shard 1 on b with shard 0's publisher gone: committed=%v %v, want not committed", committed, err)
	}
	if l, err := c.Latest(ctx, 1000, "w"); !errors.Is(err, cluster.ErrNotFound) {
		t.Fatalf("latest with shard 0 unheld: %+v %v", l, err)
	}
	if committed, err := shard(c, 0); err != nil || !committed {
		t.Fatalf("shard 0 again on c: committed=%v %v, want committed", committed, err)
	}
	if l, err := b.Latest(ctx, 1000, "w"); err != nil || l.Version != 4 || l.Shards != 2 {
		t.Fatalf("latest: %+v %v, want version 4 of 2 shards", l, err)
	}
}

func TestPins(t *testing.T) {
	srv := etcdtest.Start(t)
	a, b := open(t, srv, "a"), open(t, srv, "b")
	ctx := ctxT(t)
	events := a.Watch(ctx)
	o, _ := object("p", 1<<20)
	mustPublish(t, ctx, a, o)
	unpin, err := b.Pin(ctx, "a", o.Ref(), o.ID)
	if err != nil {
		t.Fatal(err)
	}
	next := func() Event {
		select {
		case ev := <-events:
			return ev
		case <-time.After(5 * time.Second):
			t.Fatal("no event within 5s")
		}
		return Event{}
	}
	if ev := next(); !ev.Pinned || ev.Reader != "b" || ev.Ref != o.Ref() {
		t.Fatalf("event %+v", ev)
	}
	if n, err := a.Pinned(ctx, o.Ref()); n != 1 || err != nil {
		t.Fatalf("pinned %d %v", n, err)
	}
	unpin()
	if ev := next(); !ev.Unpinned || ev.Reader != "b" {
		t.Fatalf("event %+v", ev)
	}
	// A reader that dies loses its pins with its lease.
	if _, err := b.Pin(ctx, "a", o.Ref(), o.ID); err != nil {
		t.Fatal(err)
	}
	if ev := next(); !ev.Pinned {
		t.Fatalf("event %+v", ev)
	}
	b.abandon()
	if ev := next(); !ev.Unpinned {
		t.Fatalf("event %+v", ev)
	}
	if n, err := a.Pinned(ctx, o.Ref()); n != 0 || err != nil {
		t.Fatalf("pinned %d %v", n, err)
	}
}

// TestEtcdStoppedAndBack stops etcd for longer than the TTL: calls fail
// with ErrUnavailable (at once after the first), and when etcd is back the
// node restores its records on a new lease and keeps them there.
//
// etcd keeps leases across its restart and renews them, so a's records on
// its lost lease show again for about a TTL after etcd is back: the test
// waits for them on a's new lease, not merely for them to show. Then it
// watches them for two TTLs. On a loaded machine a renewal may come late
// and the lease lapse (etcd deletes its records), after which the node
// writes them again on a new lease: the designed recovery, which the test
// tells from records really lost by asking etcd whether the lease they
// should be on is still alive.
func TestEtcdStoppedAndBack(t *testing.T) {
	srv := etcdtest.Start(t)
	a, b := open(t, srv, "a"), open(t, srv, "b")
	ctx := ctxT(t)
	mustJoin(t, ctx, a, "a")
	o, _ := object("survivor", 4096)
	mustPublish(t, ctx, a, o)
	before := a.currentLease()
	srv.Kill()
	// The first call waits out its timeout; later ones fail at once.
	for i := range 3 {
		start := time.Now()
		_, err := b.Lookup(ctx, o.Ref())
		took := time.Since(start)
		if !errors.Is(err, cluster.ErrUnavailable) {
			t.Fatalf("lookup %d with etcd down: %v, want ErrUnavailable", i, err)
		}
		if took > testCallTimeout+time.Second {
			t.Fatalf("lookup %d took %v with etcd down", i, took)
		}
		t.Logf("lookup %d with etcd down: %v after %v", i, err, took.Round(time.Millisecond))
	}
	// Down longer than the TTL: a's lease is lost on its side.
	time.Sleep(3 * time.Second)
	srv.Restart()
	back := time.Now()
	// records reads a's node and holder records with the lease each is
	// on, and a's lease before and after the read (a lease that changed
	// meanwhile makes the reading worthless: ok false).
	keys := []string{a.k.node("a"), a.k.hold(o.Ref(), "a")}
	type reading struct {
		lease clientv3.LeaseID // a's lease; 0 while it holds none
		onIt  bool             // both records exist, on that lease
		ok    bool
	}
	read := func() reading {
		l := a.currentLease()
		rctx, cancel := context.WithTimeout(ctx, testCallTimeout)
		defer cancel()
		r, err := b.cli.Txn(rctx).Then(clientv3.OpGet(keys[0]), clientv3.OpGet(keys[1])).Commit()
		if err != nil || a.currentLease() != l {
			return reading{}
		}
		on := l != 0
		for _, resp := range r.Responses {
			kvs := resp.GetResponseRange().Kvs
			on = on && len(kvs) == 1 && clientv3.LeaseID(kvs[0].Lease) == l
		}
		return reading{lease: l, onIt: on, ok: true}
	}
	onNewLease := func() bool {
		r := read()
		return r.ok && r.onIt && r.lease != before
	}
	eventually(t, 20*time.Second, "a's records back on a new lease", onNewLease)
	t.Logf("a's records on a new lease %v after etcd's restart", time.Since(back).Round(10*time.Millisecond))
	eventually(t, 10*time.Second, "b sees a's records", func() bool {
		n, err1 := b.Node(ctx, "a")
		e, err2 := b.Lookup(ctx, o.Ref())
		return err1 == nil && n.Name == "a" && err2 == nil && slices.Equal(e.Holders, []string{"a"})
	})
	// And they live on a lease that is renewed: watched for 2 TTLs.
	lapses := 0
	for end := time.Now().Add(2 * a.cfg.TTL); time.Now().Before(end); time.Sleep(50 * time.Millisecond) {
		r := read()
		if !r.ok || r.onIt {
			continue
		}
		// Not on a's lease: a lapse when etcd let that lease expire (or
		// a holds none yet), else the records are lost.
		if r.lease != 0 {
			tctx, cancel := context.WithTimeout(ctx, testCallTimeout)
			ttl, err := b.cli.TimeToLive(tctx, r.lease)
			cancel()
			if err != nil {
				continue // etcd slow to answer: read again
			}
			if ttl.TTL > 0 {
				t.Fatalf("a's records are not on a's lease %x, which etcd still keeps (TTL %ds): the records are lost", r.lease, ttl.TTL)
			}
		}
		lapses++
		lapsed := r.lease
		t.Logf("a's lease %x lapsed (renewals late): waiting for the records on a new lease", lapsed)
		eventually(t, 10*time.Second, "a's records restored on a new lease after a lapse", func() bool {
			r := read()
			return r.ok && r.onIt && r.lease != lapsed
		})
	}
	if lapses > 0 {
		t.Logf("a's lease lapsed %d time(s) in 2 TTLs and its records were restored each time", lapses)
	}
	eventually(t, 10*time.Second, "b sees a's records at the end", func() bool {
		e, err := b.Lookup(ctx, o.Ref())
		return err == nil && slices.Equal(e.Holders, []string{"a"})
	})
}

// A lease that lapses while etcd answers (renewals late on a loaded
// machine; here revoked by another client) takes the node's records with
// it; the node notices at its next renewal and writes every record it
// keeps (node, holder, pin) again on a new lease.
func TestLeaseLapseRestores(t *testing.T) {
	srv := etcdtest.Start(t)
	a, b := open(t, srv, "a"), open(t, srv, "b")
	ctx := ctxT(t)
	mustJoin(t, ctx, a, "a")
	o, _ := object("lapse", 4096)
	mustPublish(t, ctx, b, o)
	e, err := a.Lookup(ctx, o.Ref())
	if err != nil {
		t.Fatal(err)
	}
	if err := a.AddHolder(ctx, e); err != nil {
		t.Fatal(err)
	}
	if _, err := a.Pin(ctx, "b", o.Ref(), o.ID); err != nil {
		t.Fatal(err)
	}
	lost := a.currentLease()
	start := time.Now()
	if _, err := b.cli.Revoke(ctx, lost); err != nil {
		t.Fatal(err)
	}
	eventually(t, 10*time.Second, "a's records restored on a new lease", func() bool {
		l := a.currentLease()
		if l == 0 || l == lost {
			return false
		}
		_, errN := b.Node(ctx, "a")
		e, errL := b.Lookup(ctx, o.Ref())
		n, errP := b.Pinned(ctx, o.Ref())
		return errN == nil && errL == nil && slices.Equal(e.Holders, []string{"a", "b"}) && errP == nil && n == 1
	})
	t.Logf("a's records restored %v after its lease was revoked (TTL 2s)", time.Since(start).Round(10*time.Millisecond))
}

func TestManyObjects(t *testing.T) {
	srv := etcdtest.Start(t)
	a := open(t, srv, "a")
	ctx := ctxT(t)
	for i := range 50 {
		o, _ := object(fmt.Sprintf("ns/obj-%02d", i), int64(1+rand.IntN(10<<20)))
		mustPublish(t, ctx, a, o)
	}
	ls, err := a.List(ctx)
	if err != nil || len(ls) != 50 {
		t.Fatalf("list: %d %v", len(ls), err)
	}
	for i, l := range ls {
		if l.Name != fmt.Sprintf("ns/obj-%02d", i) || len(l.Holders) != 1 {
			t.Fatalf("entry %d: %+v", i, l)
		}
	}
}

func TestOldVersionRecordsPruned(t *testing.T) {
	srv := etcdtest.Start(t)
	a := open(t, srv, "a", func(c *Config) { c.KeepRecords = 3 })
	ctx := ctxT(t)
	for v := uint64(1); v <= 12; v++ {
		o, _ := object("steps", 70000)
		o.Version, o.Shards = v, 1
		if committed, err := a.Publish(ctx, o); err != nil || !committed {
			t.Fatalf("v%d: %v %v", v, committed, err)
		}
	}
	ls, err := a.List(ctx)
	if err != nil || len(ls) != 3 || ls[0].Version != 10 || ls[2].Version != 12 || ls[2].Latest != 12 {
		t.Fatalf("after 12 versions with KeepRecords 3: %d records, first %+v, %v", len(ls), ls, err)
	}
	if _, err := a.Lookup(ctx, cluster.Ref{Owner: 1000, Name: "steps", Version: 9}); !errors.Is(err, cluster.ErrNotFound) {
		t.Fatalf("v9: %v", err)
	}
	r, err := a.cli.Get(ctx, a.k.holdName(1000, "steps"), clientv3.WithPrefix(), clientv3.WithCountOnly())
	if err != nil || r.Count != 3 {
		t.Fatalf("holder keys left: %d %v", r.Count, err)
	}
}

// Watch reports each commit of a version with the keep_last its publisher
// recorded (Keep), and 0 for a record without one.
func TestWatchCommits(t *testing.T) {
	srv := etcdtest.Start(t)
	a, c := open(t, srv, "a"), open(t, srv, "c")
	ctx := ctxT(t)
	events := c.Watch(ctx)
	for v := uint64(1); v <= 3; v++ {
		for _, name := range []string{"kept", "plain"} {
			o, _ := object(name, 70000)
			o.Version, o.Shards = v, 1
			if name == "kept" {
				o.Keep = 2
			}
			if committed, err := a.Publish(ctx, o); err != nil || !committed {
				t.Fatalf("%s v%d: committed=%v %v", name, v, committed, err)
			}
		}
	}
	// Older records pruned show as deletions; the commits come in order.
	want := []Event{}
	for v := uint64(1); v <= 3; v++ {
		want = append(want, Event{Committed: true, Keep: 2, Ref: cluster.Ref{Owner: 1000, Name: "kept", Version: v}},
			Event{Committed: true, Ref: cluster.Ref{Owner: 1000, Name: "plain", Version: v}})
	}
	for len(want) > 0 {
		select {
		case ev := <-events:
			if !ev.Committed {
				continue
			}
			ev.Key = ""
			if ev != want[0] {
				t.Fatalf("event %+v, want %+v", ev, want[0])
			}
			want = want[1:]
		case <-time.After(5 * time.Second):
			t.Fatalf("no commit event within 5s; want %+v", want[0])
		}
	}
}

// A replica pulled while this node's lease is lost is advertised once a
// new lease is granted, unless its name was deleted meanwhile (the
// advertisement's guard) or the node withdrew it.
func TestAddHolderWithoutLeaseDeferred(t *testing.T) {
	srv := etcdtest.Start(t)
	a, b := open(t, srv, "a"), open(t, srv, "b")
	ctx := ctxT(t)
	var refs []cluster.Ref
	var entries []Entry
	for _, name := range []string{"ns/kept", "ns/deleted", "ns/withdrawn"} {
		o, _ := object(name, 4096)
		mustPublish(t, ctx, b, o)
		e, err := a.Lookup(ctx, o.Ref())
		if err != nil {
			t.Fatal(err)
		}
		refs, entries = append(refs, o.Ref()), append(entries, e)
	}
	release := holdGrants(t, a)
	lost := a.currentLease()
	if _, err := b.cli.Revoke(ctx, lost); err != nil {
		t.Fatal(err)
	}
	eventually(t, 10*time.Second, "a notices its lease is lost", func() bool { return a.currentLease() == 0 })
	for _, e := range entries {
		err := a.AddHolder(ctx, e)
		if !errors.Is(err, cluster.ErrUnavailable) || !strings.Contains(err.Error(), "deferred") {
			t.Fatalf("advertise without a lease: %v, want unavailable and deferred", err)
		}
	}
	if err := b.Delete(ctx, refs[1].Owner, refs[1].Name); err != nil {
		t.Fatal(err)
	}
	if err := a.RemoveHolder(ctx, refs[2]); err != nil {
		t.Fatal(err)
	}
	release()
	eventually(t, 10*time.Second, "a advertised as a holder on its new lease", func() bool {
		e, err := b.Lookup(ctx, refs[0])
		return a.currentLease() != 0 && err == nil && slices.Equal(e.Holders, []string{"a", "b"})
	})
	if _, err := b.Lookup(ctx, refs[1]); !errors.Is(err, cluster.ErrNotFound) {
		t.Fatalf("lookup of the deleted name: %v", err)
	}
	for _, ref := range refs[1:] {
		r, err := b.cli.Get(ctx, a.k.hold(ref, "a"))
		if err != nil || r.Count != 0 {
			t.Fatalf("holder record of %s: %d (%v), want none", ref, r.Count, err)
		}
	}
}

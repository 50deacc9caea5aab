package etcddir

import (
	"bytes"
	"errors"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/cudaipc/cudaipc/cluster"
	"github.com/cudaipc/cudaipc/cluster/internal/etcdtest"
)

// rewriteBound is how soon a node writes back a record of its own that
// went or changed (docs/cluster.md, "Failure behaviour": within a second
// of its watch seeing the change), with slack for a loaded test machine.
const rewriteBound = 3 * time.Second

// logBuf is a directory's log, for tests that count its lines.
type logBuf struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *logBuf) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *logBuf) count(s string) int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return strings.Count(l.b.String(), s)
}

func withLog(l *logBuf) func(*Config) {
	return func(c *Config) { c.Logger = slog.New(slog.NewTextHandler(l, nil)) }
}

// restored waits until ref is recorded as o's incarnation with holders,
// and returns how long it took.
func restored(t *testing.T, d *Directory, ref cluster.Ref, id string, holders []string) time.Duration {
	t.Helper()
	start := time.Now()
	ctx := ctxT(t)
	eventually(t, rewriteBound, ref.String()+" recorded again with its holders", func() bool {
		e, err := d.Lookup(ctx, ref)
		return err == nil && e.ID == id && slices.Equal(e.Holders, holders)
	})
	return time.Since(start)
}

// noDeleteEvent fails if events has a deletion before the deletion of
// sentinel's name, which the test makes after the faults: the watch
// reports in revision order, so a deletion the faults caused would come
// first.
func noDeleteEvent(t *testing.T, events <-chan Event, sentinel string) {
	t.Helper()
	timeout := time.After(10 * time.Second)
	for {
		select {
		case ev := <-events:
			if !ev.Deleted {
				continue
			}
			if ev.Ref.Name != sentinel {
				t.Fatalf("a deletion reported for %s (incarnation %s): no owner deleted it", ev.Ref, ev.ID)
			}
			return
		case <-timeout:
			t.Fatalf("no deletion of %s reported within 10s", sentinel)
		}
	}
}

// An object record deleted, or overwritten, by someone with etcd access
// but no secret (etcdctl del/put) is written back by its holders; no
// deletion is reported, so nobody drops a replica. A holder's own record
// is written back too. Each key's rewrite is logged once.
func TestUnsignedDeleteWrittenBack(t *testing.T) {
	srv := etcdtest.Start(t)
	var alog logBuf
	a, b, c := open(t, srv, "a", withLog(&alog)), open(t, srv, "b"), open(t, srv, "c")
	ctx := ctxT(t)
	events := c.Watch(ctx)
	o, _ := object("w", 3<<20+5)
	mustPublish(t, ctx, a, o)
	e, err := b.Lookup(ctx, o.Ref())
	if err != nil {
		t.Fatal(err)
	}
	if err := b.AddHolder(ctx, e); err != nil {
		t.Fatal(err)
	}
	key := a.k.obj(o.Ref())
	for i := range 3 {
		if _, err := c.cli.Delete(ctx, key); err != nil {
			t.Fatal(err)
		}
		t.Logf("deletion %d: written back after %v", i, restored(t, c, o.Ref(), o.ID, []string{"a", "b"}).Round(time.Millisecond))
	}
	for _, v := range []string{"garbage", "", "cr1" + string(make([]byte, 40))} {
		if _, err := c.cli.Put(ctx, key, v); err != nil {
			t.Fatal(err)
		}
		t.Logf("overwritten with %.10q: written back after %v", v, restored(t, c, o.Ref(), o.ID, []string{"a", "b"}).Round(time.Millisecond))
	}
	// Holders' records, deleted with their prefix.
	if _, err := c.cli.Delete(ctx, a.k.holders(), clientv3.WithPrefix()); err != nil {
		t.Fatal(err)
	}
	t.Logf("holders written back after %v", restored(t, c, o.Ref(), o.ID, []string{"a", "b"}).Round(time.Millisecond))
	// Seven rewrites of two keys (A or B wins each race for the object
	// record): at most one line per key, no summary within the minute.
	if n, again := alog.count("written back;"), alog.count("written back again"); n > 2 || again != 0 {
		t.Errorf("A logged %d first rewrites and %d summaries, want at most 2 (its object and holder records) and none", n, again)
	}
	s, _ := object("sentinel", 1000)
	mustPublish(t, ctx, a, s)
	if err := a.Delete(ctx, s.Owner, s.Name); err != nil {
		t.Fatal(err)
	}
	noDeleteEvent(t, events, "sentinel")
}

// The owner's delete writes a tombstone that every holder honours: the
// records stay gone. A tombstone that does not verify (garbage, sealed
// with another secret, or a genuine one copied from another name's key)
// deletes nothing and is not reported.
func TestTombstones(t *testing.T) {
	srv := etcdtest.Start(t)
	a, b, c := open(t, srv, "a"), open(t, srv, "b"), open(t, srv, "c")
	ctx := ctxT(t)
	events := c.Watch(ctx)
	o, _ := object("w", 5000)
	x, _ := object("x", 6000)
	for _, p := range []cluster.Object{o, x} {
		mustPublish(t, ctx, a, p)
		e, err := b.Lookup(ctx, p.Ref())
		if err != nil {
			t.Fatal(err)
		}
		if err := b.AddHolder(ctx, e); err != nil {
			t.Fatal(err)
		}
	}
	// A genuine tombstone, of x.
	if err := b.Delete(ctx, x.Owner, x.Name); err != nil {
		t.Fatal(err)
	}
	wantDeleted(t, events, x)
	xt, err := c.cli.Get(ctx, a.k.tomb(x.Owner, x.Name))
	if err != nil || len(xt.Kvs) != 1 || xt.Kvs[0].Lease == 0 {
		t.Fatalf("x's tombstone: %+v %v, want one on a lease", xt, err)
	}
	tkey := a.k.tomb(o.Owner, o.Name)
	evil := mustSecret("another-secret-of-16+bytes")
	forged, err := cluster.Seal(evil, tkey, &cluster.Tombstone{Owner: o.Owner, Name: o.Name, IDs: []string{o.ID}, Node: "a", Deleted: time.Now()})
	if err != nil {
		t.Fatal(err)
	}
	for _, v := range []string{"garbage", string(forged), string(xt.Kvs[0].Value)} {
		if _, err := c.cli.Txn(ctx).Then(clientv3.OpPut(tkey, v), clientv3.OpDelete(a.k.obj(o.Ref()))).Commit(); err != nil {
			t.Fatal(err)
		}
		restored(t, c, o.Ref(), o.ID, []string{"a", "b"})
	}
	if a.heldRecord(o.Ref()) == nil || b.heldRecord(o.Ref()) == nil {
		t.Fatal("a forged tombstone made a holder stop guarding its record")
	}
	s, _ := object("sentinel", 1000)
	mustPublish(t, ctx, a, s)
	if err := a.Delete(ctx, s.Owner, s.Name); err != nil {
		t.Fatal(err)
	}
	noDeleteEvent(t, events, "sentinel")
	// The owner's delete (on a node that holds nothing of it): reported,
	// and nobody writes the records back.
	if err := c.Delete(ctx, o.Owner, o.Name); err != nil {
		t.Fatal(err)
	}
	wantDeleted(t, events, o)
	eventually(t, rewriteBound, "holders stop guarding a deleted name", func() bool {
		return a.heldRecord(o.Ref()) == nil && b.heldRecord(o.Ref()) == nil
	})
	// A later rewrite of another object (x2) comes after any of o's.
	x2, _ := object("x2", 1000)
	mustPublish(t, ctx, a, x2)
	if _, err := c.cli.Delete(ctx, a.k.obj(x2.Ref())); err != nil {
		t.Fatal(err)
	}
	restored(t, c, x2.Ref(), x2.ID, []string{"a"})
	if _, err := c.Lookup(ctx, o.Ref()); !errors.Is(err, cluster.ErrNotFound) {
		t.Fatalf("a deleted name after its tombstone: %v, want ErrNotFound", err)
	}
}

// A node record without a lease (it never expires), or one that does not
// verify, is no live node: Nodes leaves it out, Node says ErrBadRecord, and
// the node of that name joins over it at once. A live node whose record
// is overwritten writes it back.
func TestNodeRecordsNeedLease(t *testing.T) {
	srv := etcdtest.Start(t)
	a, b := open(t, srv, "a"), open(t, srv, "b")
	ctx := ctxT(t)
	mustJoin(t, ctx, a, "a")
	mustJoin(t, ctx, b, "b")
	key := a.k.node("a")
	r, err := b.cli.Get(ctx, key)
	if err != nil {
		t.Fatal(err)
	}
	genuine := string(r.Kvs[0].Value)
	a.abandon() // killed: its lease lingers for the TTL
	for _, v := range []string{"garbage", genuine} {
		if _, err := b.cli.Put(ctx, key, v); err != nil { // without a lease
			t.Fatal(err)
		}
		if _, err := b.Node(ctx, "a"); !errors.Is(err, cluster.ErrBadRecord) {
			t.Fatalf("a record of %.10q without a lease: %v, want ErrBadRecord", v, err)
		}
		if ns, err := b.Nodes(ctx); err != nil || len(ns) != 1 || ns[0].Name != "b" {
			t.Fatalf("nodes: %+v %v, want only b", ns, err)
		}
		a2 := open(t, srv, "a")
		start := time.Now()
		if err := a2.Join(ctx, node("a")); err != nil {
			t.Fatalf("join over a record of %.10q without a lease: %v", v, err)
		}
		t.Logf("joined over a record of %.10q without a lease in %v", v, time.Since(start).Round(time.Millisecond))
		if _, err := b.Node(ctx, "a"); err != nil {
			t.Fatal(err)
		}
		a2.abandon()
	}
	// A live node's record overwritten (with a lease of someone else's, or
	// none): written back on its own lease.
	other, err := b.cli.Grant(ctx, 60)
	if err != nil {
		t.Fatal(err)
	}
	for _, put := range []clientv3.Op{clientv3.OpPut(b.k.node("b"), "garbage"), clientv3.OpPut(b.k.node("b"), "x", clientv3.WithLease(other.ID)), clientv3.OpDelete(b.k.node("b"))} {
		if _, err := b.cli.Do(ctx, put); err != nil {
			t.Fatal(err)
		}
		eventually(t, rewriteBound, "b's record written back", func() bool {
			r, err := b.cli.Get(ctx, b.k.node("b"))
			_, nerr := b.Node(ctx, "b")
			return err == nil && len(r.Kvs) == 1 && clientv3.LeaseID(r.Kvs[0].Lease) == b.currentLease() && nerr == nil
		})
	}
}

// A commit that prunes old versions' records is no fault: their holders
// do not write them back. The latest record, deleted by someone without
// the secret, is written back by a holder of the name's versions.
func TestVersionsGuarded(t *testing.T) {
	srv := etcdtest.Start(t)
	a := open(t, srv, "a", func(c *Config) { c.KeepRecords = 2 })
	b := open(t, srv, "b")
	ctx := ctxT(t)
	var objs []cluster.Object
	for v := uint64(1); v <= 3; v++ {
		o, _ := object("pol", 4000+int64(v))
		o.Version, o.Shards = v, 1
		if ok, err := a.Publish(ctx, o); err != nil || !ok {
			t.Fatalf("publish v%d: %v %v", v, ok, err)
		}
		objs = append(objs, o)
	}
	l, err := b.Latest(ctx, 1000, "pol")
	if err != nil || l.Version != 3 || l.Pruned != 1 {
		t.Fatalf("latest %+v %v, want v3 with v1 pruned", l, err)
	}
	if _, err := b.cli.Delete(ctx, a.k.latest(1000, "pol")); err != nil {
		t.Fatal(err)
	}
	eventually(t, rewriteBound, "latest written back", func() bool {
		l, err := b.Latest(ctx, 1000, "pol")
		return err == nil && l.Version == 3
	})
	for _, v := range []string{"garbage", ""} {
		if _, err := b.cli.Put(ctx, a.k.latest(1000, "pol"), v); err != nil {
			t.Fatal(err)
		}
		eventually(t, rewriteBound, "latest written back", func() bool {
			l, err := b.Latest(ctx, 1000, "pol")
			return err == nil && l.Version == 3
		})
	}
	// The whole name's object records: v2 and v3 come back, v1 (pruned)
	// does not.
	if _, err := b.cli.Delete(ctx, a.k.objName(1000, "pol"), clientv3.WithPrefix()); err != nil {
		t.Fatal(err)
	}
	restored(t, b, objs[2].Ref(), objs[2].ID, []string{"a"})
	restored(t, b, objs[1].Ref(), objs[1].ID, []string{"a"})
	if _, err := b.Lookup(ctx, objs[0].Ref()); !errors.Is(err, cluster.ErrNotFound) {
		t.Fatalf("v1, pruned by v3's commit: %v, want ErrNotFound", err)
	}
	if a.heldRecord(objs[0].Ref()) != nil {
		t.Fatal("a still guards v1's pruned record")
	}
}

// Everything under the cluster's prefix deleted at once: every node's
// record, every object record with its holders, every latest record come
// back.
func TestWholePrefixDeleted(t *testing.T) {
	srv := etcdtest.Start(t)
	a, b := open(t, srv, "a"), open(t, srv, "b")
	ctx := ctxT(t)
	for _, d := range []*Directory{a, b} {
		if err := d.Join(ctx, node(d.NodeName())); err != nil {
			t.Fatal(err)
		}
	}
	var objs []cluster.Object
	for i, name := range []string{"p", "q", "r"} {
		o, _ := object(name, 3000+int64(i))
		mustPublish(t, ctx, a, o)
		objs = append(objs, o)
	}
	v, _ := object("v", 7000)
	v.Version, v.Shards = 1, 1
	mustPublish(t, ctx, b, v)
	e, err := a.Lookup(ctx, objs[0].Ref())
	if err != nil {
		t.Fatal(err)
	}
	if err := b.AddHolder(ctx, e); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	if _, err := a.cli.Delete(ctx, a.k.p, clientv3.WithPrefix()); err != nil {
		t.Fatal(err)
	}
	restored(t, a, objs[0].Ref(), objs[0].ID, []string{"a", "b"})
	restored(t, a, objs[1].Ref(), objs[1].ID, []string{"a"})
	restored(t, a, objs[2].Ref(), objs[2].ID, []string{"a"})
	restored(t, a, v.Ref(), v.ID, []string{"b"})
	eventually(t, rewriteBound, "nodes and latest written back", func() bool {
		ns, err := a.Nodes(ctx)
		l, lerr := a.Latest(ctx, 1000, "v")
		return err == nil && len(ns) == 2 && lerr == nil && l.Version == 1
	})
	t.Logf("the whole prefix written back in %v", time.Since(start).Round(time.Millisecond))
}

// UnverifiedNodes names the nodes whose records another secret sealed.
func TestUnverifiedNodes(t *testing.T) {
	srv := etcdtest.Start(t)
	a, b := open(t, srv, "a"), open(t, srv, "b")
	evil := open(t, srv, "evil", func(c *Config) { c.Secret = mustSecret("another-secret-of-16+bytes") })
	ctx := ctxT(t)
	for _, d := range []*Directory{a, b, evil} {
		if err := d.Join(ctx, node(d.NodeName())); err != nil {
			t.Fatal(err)
		}
	}
	if bad, good, err := a.UnverifiedNodes(ctx); err != nil || !slices.Equal(bad, []string{"evil"}) || good != 1 {
		t.Fatalf("a: %v %d %v, want evil unverified and b verified", bad, good, err)
	}
	if bad, good, err := evil.UnverifiedNodes(ctx); err != nil || !slices.Equal(bad, []string{"a", "b"}) || good != 0 {
		t.Fatalf("evil: %v %d %v, want a and b unverified", bad, good, err)
	}
}

// A node that could not see its records go (cut off from etcd) writes
// them back when its watch resumes, having checked every record of its
// own: whether it resumes where it stopped or, etcd having compacted that
// history away, from the present.
func TestGuardResumesAfterCutOff(t *testing.T) {
	srv := etcdtest.Start(t)
	var alog logBuf
	a, b := open(t, srv, "a", withLog(&alog)), open(t, srv, "b")
	ctx := ctxT(t)
	o, _ := object("w", 9000)
	mustPublish(t, ctx, a, o)
	for _, compact := range []bool{false, true} {
		resume := holdGuard(t, a)
		if _, err := b.cli.Delete(ctx, a.k.obj(o.Ref())); err != nil {
			t.Fatal(err)
		}
		if compact {
			// Past the delete: etcd keeps no deletion at or before the
			// compaction's revision.
			r, err := b.cli.Put(ctx, a.k.p+"unrelated", "x")
			if err != nil {
				t.Fatal(err)
			}
			if _, err := b.cli.Compact(ctx, r.Header.Revision); err != nil {
				t.Fatal(err)
			}
		}
		if _, err := b.Lookup(ctx, o.Ref()); !errors.Is(err, cluster.ErrNotFound) {
			t.Fatalf("compact %v: the record while A's guard is held: %v, want ErrNotFound", compact, err)
		}
		resume()
		t.Logf("compact %v: written back %v after the guard resumed", compact, restored(t, b, o.Ref(), o.ID, []string{"a"}).Round(time.Millisecond))
	}
	eventually(t, rewriteBound, "A says its guard lost history to compaction", func() bool {
		return alog.count("lost history to compaction") == 1
	})
}

// An object record replaced by another verified incarnation (published
// where no live holder was recorded, its holders' records having gone
// while they could not see it) is the name's now: its former holders stop
// guarding theirs, and nobody fights over the record.
func TestSupersededIncarnationNotFought(t *testing.T) {
	srv := etcdtest.Start(t)
	a, b, c := open(t, srv, "a"), open(t, srv, "b"), open(t, srv, "c")
	ctx := ctxT(t)
	o, _ := object("w", 5000)
	mustPublish(t, ctx, a, o)
	e, err := b.Lookup(ctx, o.Ref())
	if err != nil {
		t.Fatal(err)
	}
	if err := b.AddHolder(ctx, e); err != nil {
		t.Fatal(err)
	}
	ra, rb := holdGuard(t, a), holdGuard(t, b)
	if _, err := c.cli.Delete(ctx, c.k.holdRef(o.Ref()), clientv3.WithPrefix()); err != nil {
		t.Fatal(err)
	}
	o2 := o
	o2.ID = cluster.NewID()
	if _, err := c.Publish(ctx, o2); err != nil {
		t.Fatalf("publish over a record without holders: %v", err)
	}
	ra()
	rb()
	eventually(t, rewriteBound, "a and b stop guarding the replaced incarnation", func() bool {
		return a.heldRecord(o.Ref()) == nil && b.heldRecord(o.Ref()) == nil
	})
	if e, err := c.Lookup(ctx, o.Ref()); err != nil || e.ID != o2.ID || !slices.Equal(e.Holders, []string{"c"}) {
		t.Fatalf("after the replacement: %+v %v, want o2 held by c", e, err)
	}
	if n := a.Rewrites() + b.Rewrites(); n != 0 {
		t.Fatalf("a and b wrote back %d records over the new incarnation", n)
	}
}
